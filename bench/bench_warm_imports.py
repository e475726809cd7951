"""In-process breakdown (not the product as users run it: see bench_as_users_run.py): the
runner's own part of a no-op warm run, forked from a process that holds the zygote's preloads,
with the standard-library modules its start path needs (``importlib``, ``importlib.util``,
``contextlib``) preloaded, as the zygote has them now, against the same run with those modules
dropped from ``sys.modules`` before the fork and imported again inside the timed window, as every
warm run did before. Alternated run by run, in one process.

    .venv/bin/python bench/bench_warm_imports.py [--runs 60]

Timed: from the forked child's first instruction to its ``_DONE`` (``main_checked`` and
``finish``: the spec read, summaries, the eval loaded by file, one episode).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jupyter_evalsched.runner import run as runner
from jupyter_evalsched.runner import zygote

START_PATH_STDLIB = (
    "importlib",
    "importlib.util",
    "importlib._abc",
    "importlib._bootstrap",
    "importlib._bootstrap_external",
    "contextlib",
)


def one_run(root: Path, eval_path: Path, drop: bool) -> float:
    run_dir = Path(tempfile.mkdtemp(dir=root))
    (run_dir / "spec.json").write_text(json.dumps({"entrypoint": f"{eval_path}:episode", "episodes": 1}))
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the run's process
        try:
            if drop:
                for name in START_PATH_STDLIB:
                    sys.modules.pop(name, None)
            t0 = time.perf_counter()
            if drop:
                import importlib.util

                from jupyter_evalsched.runner import entrypoint

                entrypoint.importlib = importlib
                entrypoint.import_module = importlib.import_module
            code = runner.finish(runner.main_checked(["--run-dir", str(run_dir)]))
            os.write(w, f"{time.perf_counter() - t0} {code}".encode())
        finally:
            os._exit(0)
    os.close(w)
    os.waitpid(pid, 0)
    answer = os.read(r, 100).decode().split()
    os.close(r)
    if len(answer) != 2 or not (run_dir / "_DONE").exists():
        raise SystemExit(f"the run in {run_dir} did not finish: {answer}")
    return float(answer[0])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=60, help="runs of each kind, alternated")
    args = ap.parse_args()
    preloaded, failed, refused, _ = zygote.preload([])
    if failed or refused:
        raise SystemExit(f"the zygote's preloads failed: {failed} {refused}")
    root = Path(tempfile.mkdtemp(prefix="bench-warm-imports-"))
    try:
        eval_path = root / "noop_eval.py"
        eval_path.write_text("def episode(ctx, index):\n    return {}\n")
        now, before = [], []
        for _ in range(args.runs):
            now.append(one_run(root, eval_path, drop=False))
            before.append(one_run(root, eval_path, drop=True))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    a, b = statistics.median(now) * 1000, statistics.median(before) * 1000
    print(f"the runner's part of a no-op warm run (in-process, medians of {args.runs}, alternated):")
    print(f"  start path's stdlib preloaded (now)         {a:6.2f} ms")
    print(f"  imported after the fork (as before)         {b:6.2f} ms")
    print(f"  ratio now/before {a / b:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
