"""A server's restart over runs an earlier server left ``running``: the time from the new
``jupyter server`` process's start to its first answer (``LocalServer`` waits for its status),
with every left run then ``aborted``, by what became of the runs' processes, alternated round by
round on the extension's defaults (cgroups as detected, warm starts on):

- ``gone``: they died with their server, as they do (the parent-death signal): the baseline;
- ``alive``: they are still there (orphans, whose parent is now the host's init), and the
  restart kills them: they go at once, but stay zombies until init reaps them (this project's
  test machines' init does so seconds later);
- ``zombie``: they exited, and nobody reaped them (an orphan under an init that does not reap):
  a restart used to wait 2 s for each of them before it went on.

    .venv/bin/python bench/bench_restart.py [--runs 5] [--rounds 3] [--old DIR]

Printed: the median start per case and its ratio to ``gone``'s in the same run. ``--old DIR``:
the same cases on another checkout's server too (imported through ``PYTHONPATH``), in the same
rotation: what a change moved.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from jupyter_evalsched.client import LocalServer  # noqa: E402
from jupyter_evalsched.runner._proc import process_start_time  # noqa: E402

sys.path.insert(0, str(REPO / "tests"))
from run_dirs import write_run_dir  # noqa: E402  (a run directory as a killed server leaves it: the tests')

CASES = ("gone", "alive", "zombie")


def orphan() -> int:
    """A process in a session of its own whose parent has exited: the host's init (or subreaper)
    is its parent now and reaps it once it ends, as it does a run that outlived its server."""
    out = subprocess.run(
        ["sh", "-c", "setsid sleep 600 </dev/null >/dev/null 2>&1 & echo $!"],
        capture_output=True,
        text=True,
        check=True,
    )
    return int(out.stdout)


def restart(case: str, runs: int, scratch: Path, tree: Path) -> float:
    """Seconds from the server's start to its first answer, over ``runs`` left runs."""
    root = Path(tempfile.mkdtemp(prefix=f"restart-{case}-", dir=scratch))
    children = [] if case == "alive" else [subprocess.Popen(["sleep", "600"]) for _ in range(runs)]
    pids = [orphan() for _ in range(runs)] if case == "alive" else [proc.pid for proc in children]
    ids = [f"20260101T000000.000000-{i:06x}" for i in range(runs)]
    try:
        for i, (run_id, pid) in enumerate(zip(ids, pids, strict=True)):
            write_run_dir(root / "runs" / run_id, run_id, pid, process_start_time(pid), seq=i + 1)
        for proc in children:
            proc.kill()
            if case == "gone":
                proc.wait()
            else:  # (exited, and this process, its parent, does not reap it)
                while (Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split() or ["?"])[0] != "Z":
                    time.sleep(0.001)
        started = time.monotonic()
        server = LocalServer(virtual_gpus=None, runs_dir=str(root / "runs"), env={"PYTHONPATH": str(tree)})
        try:
            took = time.monotonic() - started
            client = server.client()
            states = {client.get(run_id)["state"] for run_id in ids}
            if states != {"aborted"}:
                raise SystemExit(f"{case}: the left runs ended {states}, not aborted")
        finally:
            server.cleanup()
        return took
    finally:
        for proc in children:
            proc.kill()
            proc.wait()
        for pid in pids if case == "alive" else []:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5, help="runs left running by the earlier server")
    parser.add_argument("--rounds", type=int, default=3, help="rounds (each case once a round, rotated)")
    parser.add_argument("--old", type=Path, help="another checkout to run the same cases on")
    args = parser.parse_args()
    trees = {"this tree": REPO} | ({f"old ({args.old})": args.old.resolve()} if args.old else {})
    kinds = [(tree, case) for tree in trees for case in CASES]
    scratch = Path(tempfile.mkdtemp(prefix="bench-restart-"))
    took: dict[tuple[str, str], list[float]] = {kind: [] for kind in kinds}
    try:
        for tree in trees.values():  # warm-up: the interpreter's files in the page cache
            restart("gone", args.runs, scratch, tree)
        for i in range(args.rounds):
            for tree, case in kinds[i % len(kinds) :] + kinds[: i % len(kinds)]:
                took[tree, case].append(restart(case, args.runs, scratch, trees[tree]))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print(f"a default server's start over {args.runs} runs left running, {args.rounds} round(s), medians:")
    for tree in trees:
        base = statistics.median(took[tree, "gone"])
        for case in CASES:
            median = statistics.median(took[tree, case])
            print(f"   {tree}: their processes {case:6s}  {median:6.2f} s   {median / base:5.2f}x of gone")


if __name__ == "__main__":
    main()
