"""One no-op run at a time, submission -> ``_DONE``, on this tree's server and another tree's, side by
side, alternated run by run: what a change to the start path moved, with the host's drift taken out.

    .venv/bin/python bench/bench_warm_turnaround.py --old DIR [--runs 200] [--rounds 3]

Two ``jupyter server`` subprocesses with the extension's defaults on this host (no virtual GPUs,
cgroups as detected, warm starts on), one per code tree: this one and ``--old`` (another checkout,
imported through ``PYTHONPATH``; its dependencies must be those of this environment). Each round
posts ``--runs`` no-op runs (``examples.basic:noop``, 1 episode) to each, one run to one server,
then one to the other (the order flips every pair), each timed from its POST (keep-alive
connection, token) until its ``_DONE`` exists (a stat every 0.1 ms). A slow minute of the machine
slows both runs of a pair alike, so the paired differences say more than either median: printed
per round, the two medians, their ratio and the median of the pairs' differences (old - new).

A breakdown of where a faster start came from needs more than this (e.g. ``/proc/self/stat``'s
``minflt`` read in the run at points along its start).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from jupyter_evalsched.client import LocalServer  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_burst_ab import compile_tree  # noqa: E402
from bench_rest import Conn  # noqa: E402  (the keep-alive client the REST bench uses)

NOOP = "jupyter_evalsched.examples.basic:noop"
WARM_UP = 15  # runs per server before each round: spares forked, caches warm


class Side:
    """One tree's server and its keep-alive connection."""

    def __init__(self, label: str, tree: Path) -> None:
        self.label = label
        self.tree = tree
        self.server = LocalServer(virtual_gpus=None, cpu_slots=None, env={"PYTHONPATH": str(tree)})
        self.conn = Conn(self.server.url, self.server.token)
        self.body = json.dumps({"entrypoint": NOOP, "episodes": 1}).encode()

    def one(self) -> float:
        """Seconds from the POST to the run's ``_DONE``."""
        t0 = time.perf_counter()
        code, data = self.conn.call("POST", "/evalsched/runs", self.body)
        if code != 201:
            raise SystemExit(f"{self.label}: POST answered {code}: {data[:300]!r}")
        done = os.path.join(json.loads(data)["run_dir"], "_DONE")
        deadline = t0 + 60
        while not os.path.exists(done):
            if time.perf_counter() > deadline:
                raise SystemExit(f"{self.label}: no _DONE within 60 s ({done})")
            time.sleep(0.0001)
        return time.perf_counter() - t0

    def close(self) -> None:
        self.server.cleanup()


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--old", type=Path, required=True, help="the other checkout (e.g. the commit before)")
    ap.add_argument("--runs", type=int, default=200, help="runs per server per round")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    for tree in (REPO, args.old.resolve()):
        compile_tree(tree)  # (each zygote as setup.sh leaves it: see there)
    new, old = Side("new", REPO), Side("old", args.old.resolve())
    try:
        print(f"new: {new.tree}\nold: {old.tree}")
        for r in range(args.rounds):
            for _ in range(WARM_UP):
                new.one()
                old.one()
            times: dict[str, list[float]] = {"new": [], "old": []}
            for i in range(args.runs):
                for side in (new, old) if i % 2 == 0 else (old, new):
                    times[side.label].append(side.one())
                    time.sleep(0.01)  # the run's process gone before the next one starts
            n, o = statistics.median(times["new"]), statistics.median(times["old"])
            diff = statistics.median(b - a for a, b in zip(times["new"], times["old"], strict=True))
            print(
                f"round {r + 1}: new {n * 1e3:.2f} ms, old {o * 1e3:.2f} ms (medians), new/old {n / o:.3f};"
                f" median of the pairs' differences (old - new) {diff * 1e3:+.2f} ms"
            )
    finally:
        new.close()
        old.close()


if __name__ == "__main__":
    main()
