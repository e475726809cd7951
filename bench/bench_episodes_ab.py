"""A run of many short episodes on this tree's default server and another tree's, alternated run
by run: what a change moved in the cost of an episode as users run one (the run rewrites
``summary.json`` after every episode), with the host's drift taken out.

    .venv/bin/python bench/bench_episodes_ab.py --old DIR [--rounds 6] [--episodes 3000]
        [--host-processes N]

Two ``jupyter server`` subprocesses with the extension's defaults on this host (no virtual GPUs,
cgroups as detected, warm starts on), one per code tree: this one and ``--old`` (another
checkout, imported through ``PYTHONPATH``; see ``bench_burst_ab.py``). Each round submits one run
of ``--episodes`` no-op episodes (``examples.basic:noop``) to each server in turn (the order flips
every round, a second apart) and waits for its ``_DONE``. Per run: the wall time from the POST to
``_DONE``, and the pages the whole machine wrote to disk meanwhile (``/proc/vmstat``
``nr_written``: the runs' summaries, and anything else the host wrote then). Printed: the medians
per tree, their ratio, and the medians of the rounds' paired differences (old - new).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_burst_ab import NOOP, REPO, RUN_TIMEOUT_S, ab_parser, run_ab
from bench_rest import Conn

from jupyter_evalsched.client import LocalServer


def pages_written() -> int:
    with open("/proc/vmstat") as f:
        for line in f:
            if line.startswith("nr_written "):
                return int(line.split()[1])
    return 0


class Side:
    def __init__(self, label: str, tree: Path, episodes: int) -> None:
        self.label = label
        self.tree = tree
        self.server = LocalServer(virtual_gpus=None, env={"PYTHONPATH": str(tree)})
        self.conn = Conn(self.server.url, self.server.token)
        self.body = json.dumps({"entrypoint": NOOP, "episodes": episodes}).encode()
        self.rows: list[dict[str, float]] = []

    def run(self, keep: bool = True) -> None:
        written0, t0 = pages_written(), time.perf_counter()
        code, data = self.conn.call("POST", "/evalsched/runs", self.body)
        if code != 201:
            raise SystemExit(f"{self.label}: POST answered {code}: {data[:300]!r}")
        done = os.path.join(json.loads(data)["run_dir"], "_DONE")
        while not os.path.exists(done):
            if time.perf_counter() - t0 > RUN_TIMEOUT_S:
                raise SystemExit(f"{self.label}: no _DONE within {RUN_TIMEOUT_S} s ({done})")
            time.sleep(0.0005)
        wall = time.perf_counter() - t0
        if keep:
            self.rows.append({"wall": wall, "pages": float(pages_written() - written0)})

    def median(self, key: str) -> float:
        return statistics.median(row[key] for row in self.rows)

    def close(self) -> None:
        self.server.cleanup()


def main() -> None:
    ap = ab_parser(__doc__)
    ap.add_argument("--rounds", type=int, default=6, help="measured runs per server")
    ap.add_argument("--episodes", type=int, default=3000, help="no-op episodes per run")
    run_ab(ap.parse_args(), measure)


def measure(args) -> None:
    new = Side("new", REPO, args.episodes)
    try:
        old = Side("old", args.old.resolve(), args.episodes)
    except BaseException:
        new.close()
        raise
    try:
        print(f"new: {new.tree}\nold: {old.tree}\n{args.rounds} runs of {args.episodes} no-op episodes on each")
        for side in (new, old):
            side.run(keep=False)  # warm: spares forked, caches filled
        for i in range(args.rounds):
            for side in (new, old) if i % 2 == 0 else (old, new):
                time.sleep(1.0)
                side.run()
        for side in (new, old):
            print(
                f"{side.label}: POST -> _DONE {side.median('wall') * 1e3:.0f} ms"
                f" ({side.median('wall') / args.episodes * 1e6:.1f} us an episode),"
                f" pages written meanwhile {side.median('pages'):.0f} (medians)"
            )
        paired = statistics.median(o["wall"] - n["wall"] for n, o in zip(new.rows, old.rows, strict=True))
        print(
            f"new / old: {new.median('wall') / old.median('wall'):.2f}x the wall time;"
            f" median of the paired differences (old - new) {paired * 1e3:+.0f} ms"
        )
    finally:
        new.close()
        old.close()


if __name__ == "__main__":
    main()
