"""Server memory with many finished runs of large params, against an empty server in the same run.

    .venv/bin/python bench/bench_memory.py [--runs 10000] [--params-kb 100] [--live 200]

1. Recovery: a runs directory holding ``--runs`` finished runs, each with ``--params-kb`` of
   params in its spec.json (written as the server writes them). A real ``jupyter server``
   starts on it; its RSS once it answers (and after listing every run) is compared with a server
   started on an empty runs directory.
2. Live: ``--live`` runs of the same size submitted over REST to the empty server and finished;
   the server's RSS after them against before, per run.

What a finished run may keep in memory is its record (about a kilobyte), not its spec.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jupyter_evalsched.client import LocalServer

NOOP = "jupyter_evalsched.examples.basic:noop"


def rss_mb(pid: int) -> float:
    return psutil.Process(pid).memory_info().rss / 2**20


def settled_rss(server: LocalServer) -> float:
    """RSS once it stops moving (the last allocations of start-up), the lowest of a few samples."""
    samples = []
    for _ in range(5):
        time.sleep(0.3)
        samples.append(rss_mb(server.process.pid))
    return min(samples)


def big_params(kb: int) -> dict:
    return {"prompts": ["x" * 1000 for _ in range(kb)]}


def write_finished_runs(root: Path, count: int, params_kb: int) -> None:
    root.mkdir(parents=True)
    params = big_params(params_kb)
    for i in range(count):
        run_id = f"20260101T000000.{i:06d}-{i % 0xFFFFFF:06x}"
        run = root / run_id
        run.mkdir()
        spec = {"name": "big", "entrypoint": NOOP, "episodes": 1, "params": params, "seed": 0, "workers": 1,
                "models": [], "env": {}, "cwd": "/", "timeout_s": None, "depends_on": [], "source": None,
                "executor": "local", "scheduling": {"marginal_vram_mb": 0, "gpus": 1, "exclusive_gpu": False,
                                                    "priority": "normal", "cpus": 1}}  # fmt: skip
        record = {"id": run_id, "name": "big", "state": "succeeded", "reason": None, "priority": "normal",
                  "submitted_at": "2026-01-01T00:00:00.000000+00:00",
                  "started_at": "2026-01-01T00:00:00.100000+00:00",
                  "finished_at": "2026-01-01T00:00:00.200000+00:00", "pid": 1000 + i, "devices": [],
                  "exit_code": 0, "progress": {"done": 1, "total": 1}, "marginal_vram_mb": 0, "depends_on": [],
                  "seq": i + 1, "metrics": {"score": {"mean": 1.0, "std": 0.0, "min": 1.0, "max": 1.0,
                                                      "count": 1}}}  # fmt: skip
        (run / "spec.json").write_text(json.dumps(spec))
        (run / "job.json").write_text(json.dumps(record))
        (run / "summary.json").write_text(json.dumps({"run_id": run_id, "status": "succeeded"}))
        (run / "_DONE").touch()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=10_000)
    ap.add_argument("--params-kb", type=int, default=100)
    ap.add_argument("--live", type=int, default=200)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-memory-"))
    try:
        t0 = time.perf_counter()
        write_finished_runs(tmp / "full", args.runs, args.params_kb)
        print(f"wrote {args.runs} finished runs of {args.params_kb} KB params in {time.perf_counter() - t0:.1f} s")

        with LocalServer(runs_dir=str(tmp / "empty"), cpu_slots=2) as empty:
            base = settled_rss(empty)
            print(f"empty server:                        {base:8.1f} MB RSS")

            t0 = time.perf_counter()
            with LocalServer(runs_dir=str(tmp / "full"), cpu_slots=2, startup_timeout=600) as full:
                started = time.perf_counter() - t0
                loaded = settled_rss(full)
                client = full.client(timeout=300)
                listed = client.list(limit=args.runs)
                assert len(listed) == args.runs, len(listed)
                served = settled_rss(full)
            print(
                f"server with {args.runs} finished runs:   {loaded:8.1f} MB RSS  "
                f"(+{loaded - base:.1f} MB, {loaded / base:.2f}x empty; "
                f"{(loaded - base) * 1024 / args.runs:.2f} KB per run; answered after {started:.1f} s)"
            )
            print(f"  ... after listing all of them:     {served:8.1f} MB RSS  (+{served - base:.1f} MB)")

            client = empty.client(timeout=60)
            params = big_params(args.params_kb)
            ids = [client.submit({"entrypoint": NOOP, "params": params})["id"] for _ in range(args.live)]
            deadline = time.monotonic() + 600
            while time.monotonic() < deadline:
                states = {r["state"] for r in client.list(limit=args.live + 10)}
                if states <= {"succeeded", "failed", "cancelled", "aborted"}:
                    break
                time.sleep(0.5)
            failed = [r["id"] for r in client.list(limit=args.live + 10) if r["state"] != "succeeded"]
            after = settled_rss(empty)
            print(
                f"empty server after {len(ids)} live runs:     {after:8.1f} MB RSS  "
                f"(+{after - base:.1f} MB, {(after - base) * 1024 / len(ids):.1f} KB per run of "
                f"{args.params_kb} KB params; {len(failed)} not succeeded)"
            )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    os.environ.pop("EVALSCHED_URL", None)
    sys.exit(main())
