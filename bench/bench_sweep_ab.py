"""Sweep submissions on this tree's default server and another tree's, side by side, alternated
sweep by sweep: how long ``POST /evalsched/sweeps`` takes to answer for a sweep of many points,
with the host's drift taken out.

    .venv/bin/python bench/bench_sweep_ab.py --old DIR [--rounds 8] [--points 500]
        [--host-processes N]

Two ``jupyter server`` subprocesses with the extension's defaults on this host (cgroups as
detected, warm starts on), one per code tree: this one and ``--old`` (another checkout, imported
through ``PYTHONPATH``; its dependencies must be those of this environment). Each holds its
sweeps' runs behind a dependency on a sleeping run that takes no CPU slot, so that the figure is
the submission's alone (the runs would share the CPUs with it): each round posts a sweep of
``--points`` no-op points to one server, waits for the answer (the API answers once every run
directory is on disk), then does the same on the other (the order flips every round, a second
apart). Per sweep: the time to the answer and the server process's CPU (every thread's). Printed:
the medians per tree, points a second, and the medians of the rounds' paired ratios (new/old).

Before the first round the bench waits (2 minutes at most) until a new file in the servers' runs
directories costs no more than 3x one on tmpfs: on ext4 without a journal, every file created
passes over the inodes freed in the last seconds, and an earlier benchmark's clean-up would be
measured instead (``bench_as_users_run.disk_settled``).
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench_as_users_run import disk_settled
from bench_burst_ab import ab_parser, process_cpu_s, run_ab
from bench_rest import SLEEPY, Conn

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from jupyter_evalsched.client import LocalServer  # noqa: E402

NOOP = "jupyter_evalsched.examples.basic:noop"
SETTLE_MAX_WAIT_S = 120.0


class Side:
    """One tree's server, the run its sweeps wait for, and its sweeps' figures."""

    def __init__(self, label: str, tree: Path, runs_dir: Path) -> None:
        self.label = label
        self.tree = tree
        self.server = LocalServer(
            virtual_gpus=None, cpu_slots=None, runs_dir=str(runs_dir), env={"PYTHONPATH": str(tree)}
        )
        self.conn = Conn(self.server.url, self.server.token)
        hold = {"entrypoint": SLEEPY, "episodes": 1, "params": {"sleep_s": 3600}, "scheduling": {"cpus": 0}}
        code, data = self.conn.call("POST", "/evalsched/runs", json.dumps({**hold, "name": "hold"}).encode())
        if code != 201:
            raise SystemExit(f"{label}: the run that holds the sweeps was refused: {code} {data[:300]!r}")
        self.hold = json.loads(data)["id"]
        self.rows: list[dict[str, float]] = []

    def sweep(self, points: int, keep: bool = True) -> None:
        body = {
            "entrypoint": NOOP,
            "episodes": 1,
            "depends_on": [self.hold],
            "sweep": [{"i": i} for i in range(points)],
        }
        pid = self.server.process.pid
        cpu0 = process_cpu_s(pid)
        t0 = time.perf_counter()
        code, data = self.conn.call("POST", "/evalsched/sweeps", json.dumps(body).encode())
        took = time.perf_counter() - t0
        if code != 201:
            raise SystemExit(f"{self.label}: the sweep was answered {code}: {data[:300]!r}")
        made = json.loads(data)["runs"]
        if [run["sweep_point"]["i"] for run in made] != list(range(points)):
            raise SystemExit(f"{self.label}: the sweep's runs are not its points in order")
        if keep:
            self.rows.append({"took": took, "cpu": process_cpu_s(pid) - cpu0})

    def median(self, key: str) -> float:
        return statistics.median(row[key] for row in self.rows)

    def close(self) -> None:
        self.conn.call("POST", f"/evalsched/runs/{self.hold}/cancel", b"{}")
        self.server.cleanup()


def main() -> None:
    ap = ab_parser(__doc__)
    ap.add_argument("--rounds", type=int, default=8, help="measured sweeps per server")
    ap.add_argument("--points", type=int, default=500, help="points per sweep (at most 1000)")
    run_ab(ap.parse_args(), measure)


def measure(args) -> None:
    sides: list[Side] = []
    with tempfile.TemporaryDirectory(prefix="bench-sweep-", dir=Path.home()) as folder:
        try:
            for label, tree in (("new", REPO), ("old", args.old.resolve())):
                sides.append(Side(label, tree, Path(folder) / label))
            new, old = sides
            print(
                f"new: {new.tree}\nold: {old.tree}\n{args.rounds} sweeps of {args.points} held no-op points per server"
            )
            print(f"the runs directories: {disk_settled(Path(folder), SETTLE_MAX_WAIT_S)[0]}")
            for side in sides:
                side.sweep(min(args.points, 50), keep=False)  # caches warm
            for i in range(args.rounds):
                for side in (new, old) if i % 2 == 0 else (old, new):
                    time.sleep(1.0)
                    side.sweep(args.points)
            for side in sides:
                print(
                    f"{side.label}: answered in {side.median('took') * 1e3:.0f} ms"
                    f" ({args.points / side.median('took'):.0f} points/s), server CPU"
                    f" {side.median('cpu') / args.points * 1e3:.3f} ms a point (medians)"
                )
            ratio = statistics.median(n["took"] / o["took"] for n, o in zip(new.rows, old.rows, strict=True))
            cpu = statistics.median(n["cpu"] / o["cpu"] for n, o in zip(new.rows, old.rows, strict=True))
            print(f"medians of the paired ratios (new/old): time to the answer {ratio:.2f}x, server CPU {cpu:.2f}x")
        finally:
            for side in sides:
                side.close()


if __name__ == "__main__":
    main()
