"""Bursts of no-op runs on this tree's default server and another tree's, side by side, alternated
burst by burst: what a change moved in part 2 of ``bench_as_users_run.py`` and in the CPU a run
costs, with the host's drift taken out.

    .venv/bin/python bench/bench_burst_ab.py --old DIR [--rounds 16] [--burst 50] [--slots 2]
        [--host-processes N]

Two ``jupyter server`` subprocesses with the extension's defaults on this host (no virtual GPUs,
cgroups as detected, warm starts on) but ``cpu_slots = --slots``, one per code tree: this one and
``--old`` (another checkout, imported through ``PYTHONPATH``; its dependencies must be those of
this environment). Each round posts a burst of ``--burst`` no-op runs
(``examples.basic:noop``, 1 episode) to one server, one POST after another on a keep-alive
connection as part 2 does, and waits for every ``_DONE``; then the same on the other server (the
order flips every round, a second apart). Per burst: the makespan (first POST to last ``_DONE``),
the server process's CPU (every thread's, ``/proc/<pid>/task/*/schedstat``) and the whole
machine's (``/proc/stat``, which counts the zygote, the runs and the kernel's work too), each per
run. Printed: the medians per tree and the medians of the rounds' paired differences (old - new).

``--host-processes N``: N more idle processes (``sleep``) live on the host while both trees run,
as on a shared GPU host, whose process table holds hundreds or thousands (users' kernels, their
data loaders, daemons): a run's clean-up searches the whole table for what the run left behind.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from jupyter_evalsched.client import LocalServer  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_rest import Conn  # noqa: E402  (the keep-alive client the REST bench uses)

NOOP = "jupyter_evalsched.examples.basic:noop"
CLK_TCK = os.sysconf("SC_CLK_TCK")
RUN_TIMEOUT_S = 120


def compile_tree(tree: Path) -> None:
    """Byte-compile a tree's package, as ``scripts/setup.sh`` does (``PYTHONDONTWRITEBYTECODE`` is
    set on these machines): a zygote that imports its modules from source compiles, which makes
    the interpreter's AST classes before its spares are forked, and so hides or adds a cost that
    the other tree's does not have (``runner.zygote.make_interpreter_state``)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    subprocess.run(
        [sys.executable, "-m", "compileall", "-q", str(tree / "jupyter_evalsched")],
        env=env,
        check=True,
        stdout=subprocess.DEVNULL,
    )


@contextmanager
def host_crowd(n: int) -> Iterator[None]:
    """``n`` more idle processes (``sleep``) on the host while the block runs, as on a shared GPU
    host, whose process table holds hundreds or thousands."""
    crowd = [
        subprocess.Popen(["sleep", "86400"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL) for _ in range(n)
    ]
    try:
        yield
    finally:
        for proc in crowd:
            proc.kill()
            proc.wait()


def process_cpu_s(pid: int) -> float:
    """CPU seconds of every thread of ``pid`` (nanoseconds, unlike ``/proc/<pid>/stat``'s ticks)."""
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            pass  # a thread that ended meanwhile
    return total / 1e9


def machine_cpu_s() -> float:
    """CPU seconds the whole machine spent busy (user, nice, system, irq, softirq, steal)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    return (sum(fields[:3]) + sum(fields[5:8])) / CLK_TCK


class Side:
    """One tree's server, its keep-alive connection and its bursts' figures."""

    def __init__(self, label: str, tree: Path, slots: int) -> None:
        self.label = label
        self.tree = tree
        self.server = LocalServer(virtual_gpus=None, cpu_slots=slots, env={"PYTHONPATH": str(tree)})
        self.conn = Conn(self.server.url, self.server.token)
        self.body = json.dumps({"entrypoint": NOOP, "episodes": 1}).encode()
        self.rows: list[dict[str, float]] = []

    def burst(self, n: int, keep: bool = True) -> None:
        pid = self.server.process.pid
        server0, machine0 = process_cpu_s(pid), machine_cpu_s()
        t0 = time.perf_counter()
        dones = []
        for _ in range(n):
            code, data = self.conn.call("POST", "/evalsched/runs", self.body)
            if code != 201:
                raise SystemExit(f"{self.label}: POST answered {code}: {data[:300]!r}")
            dones.append(os.path.join(json.loads(data)["run_dir"], "_DONE"))
        submitted = time.perf_counter() - t0
        deadline = t0 + RUN_TIMEOUT_S
        for done in dones:
            while not os.path.exists(done):
                if time.perf_counter() > deadline:
                    raise SystemExit(f"{self.label}: no _DONE within {RUN_TIMEOUT_S} s ({done})")
                time.sleep(0.0002)
        makespan = time.perf_counter() - t0
        time.sleep(0.5)  # the last runs' ends handled: their CPU counted in this burst
        if keep:
            self.rows.append(
                {
                    "makespan": makespan,
                    "submitted": submitted,
                    "server": (process_cpu_s(pid) - server0) / n,
                    "machine": (machine_cpu_s() - machine0) / n,
                }
            )

    def median(self, key: str) -> float:
        return statistics.median(row[key] for row in self.rows)

    def close(self) -> None:
        self.server.cleanup()


def ab_parser(doc: str | None) -> argparse.ArgumentParser:
    """The options of every A/B bench here: the other checkout, and idle processes on the host."""
    ap = argparse.ArgumentParser(description=(doc or "").split("\n\n")[0])
    ap.add_argument("--old", type=Path, required=True, help="the other checkout (e.g. the commit before)")
    ap.add_argument("--host-processes", type=int, default=0, help="idle processes added to the host meanwhile")
    return ap


def run_ab(args: argparse.Namespace, measure: Callable[[argparse.Namespace], None]) -> None:
    """Both trees byte-compiled (as ``scripts/setup.sh`` does), then ``measure`` among the host's
    added idle processes."""
    for tree in (REPO, args.old.resolve()):
        compile_tree(tree)
    with host_crowd(args.host_processes):
        measure(args)


def main() -> None:
    ap = ab_parser(__doc__)
    ap.add_argument("--rounds", type=int, default=16, help="measured bursts per server")
    ap.add_argument("--burst", type=int, default=50, help="runs per burst")
    ap.add_argument("--slots", type=int, default=2, help="cpu_slots of both servers")
    run_ab(ap.parse_args(), measure)


def measure(args: argparse.Namespace) -> None:
    new = Side("new", REPO, args.slots)
    old = Side("old", args.old.resolve(), args.slots)
    try:
        listed = sum(1 for name in os.listdir("/proc") if name.isdigit())
        print(
            f"new: {new.tree}\nold: {old.tree}\n{args.rounds} bursts of {args.burst} no-op runs each, {args.slots} slots;"
            f" {listed} processes on the host ({args.host_processes} of them added idle)"
        )
        for side in (new, old):
            for _ in range(3):  # spares forked, caches warm
                side.burst(args.burst, keep=False)
        for i in range(args.rounds):
            for side in (new, old) if i % 2 == 0 else (old, new):
                time.sleep(1.0)  # the previous burst's files written back, its processes gone
                side.burst(args.burst)
        for side in (new, old):
            print(
                f"{side.label}: makespan {side.median('makespan') * 1e3:.0f} ms"
                f" (its POSTs {side.median('submitted') * 1e3:.0f} ms), server CPU {side.median('server') * 1e3:.2f} ms/run,"
                f" machine CPU {side.median('machine') * 1e3:.2f} ms/run (medians)"
            )

        def paired(key: str) -> float:
            return statistics.median(o[key] - n[key] for n, o in zip(new.rows, old.rows, strict=True))

        print(
            f"medians of the paired differences (old - new): makespan {paired('makespan') * 1e3:+.1f} ms"
            f" ({paired('makespan') / old.median('makespan') * 100:+.1f} % of old's),"
            f" server CPU {paired('server') * 1e3:+.2f} ms/run, machine CPU {paired('machine') * 1e3:+.2f} ms/run"
        )
    finally:
        new.close()
        old.close()


if __name__ == "__main__":
    main()
