"""Submissions to a real ``jupyter server`` as users run it, with same-run baselines.

    .venv/bin/python bench/bench_submissions.py [--submissions 2000] [--clients 8] [--rounds 2]
        [--old /work/main] [--fsync]

Each round starts a fresh ``jupyter server`` subprocess with the extension's defaults on this
host (no virtual GPUs, no ``cpu_slots``, cgroups as detected), once per code tree: this tree and,
with ``--old``, another checkout (e.g. main) imported through ``PYTHONPATH``; the trees alternate
round by round. On each server, in this order:

1. ``GET /api/status``, ``--submissions`` requests from ``--clients`` keep-alive clients (one
   thread each): Jupyter's own trivial endpoint, the baseline of that server;
2. ``POST /evalsched/runs``, ``--submissions`` no-op runs (``examples.basic:noop``, 1 episode)
   from the same clients. Every run ``depends_on`` a blocker (a ``sleepy`` run that runs all
   along), so they stay queued: the figure is submission alone, not churn;
3. every answered run's directory is checked on disk (``spec.json`` and ``job.json``).

Printed per tree: submissions/s, p50/p99 latency, the ratio to ``GET /api/status`` of the same
server, and the issue's targets (>= 600/s, >= 0.5x status, p99 < 30 ms). With ``--old``, the
ratio new/old of the medians over rounds.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from jupyter_evalsched.client import LocalServer  # noqa: E402

SLEEPY = "jupyter_evalsched.examples.basic:sleepy"
NOOP = "jupyter_evalsched.examples.basic:noop"


class Conn:
    def __init__(self, url: str, token: str) -> None:
        parts = urlsplit(url)
        self.base = parts.path.rstrip("/")
        self.conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
        self.headers = {"Authorization": f"token {token}", "Content-Type": "application/json"}

    def call(self, method: str, path: str, body: bytes | None = None) -> tuple[int, bytes]:
        self.conn.request(method, self.base + path, body=body, headers=self.headers)
        resp = self.conn.getresponse()
        return resp.status, resp.read()


def hammer(
    server: LocalServer, clients: int, total: int, method: str, path: str, body: bytes | None
) -> tuple[float, list[float], list[bytes], list[str]]:
    """(requests/s, latencies, bodies of the 2xx answers, errors)."""
    per_client = [total // clients + (1 if i < total % clients else 0) for i in range(clients)]
    latencies: list[float] = []
    answers: list[bytes] = []
    errors: list[str] = []
    lock = threading.Lock()
    start = threading.Barrier(clients + 1)

    def work(n: int) -> None:
        conn = Conn(server.url, server.token)
        conn.call("GET", "/api/status")  # connected before the clock starts
        mine, ok, bad = [], [], []
        start.wait()
        for _ in range(n):
            t0 = time.perf_counter()
            code, data = conn.call(method, path, body)
            mine.append(time.perf_counter() - t0)
            (ok if 200 <= code < 300 else bad).append(data if 200 <= code < 300 else f"{code}: {data[:200]!r}")
        with lock:
            latencies.extend(mine)
            answers.extend(ok)
            errors.extend(bad)

    threads = [threading.Thread(target=work, args=(n,)) for n in per_client]
    for t in threads:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    return len(latencies) / (time.perf_counter() - t0), latencies, answers, errors


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(len(xs) * p))]


def one_server(tree: Path, args: argparse.Namespace) -> dict[str, float]:
    extra = ["--EvalSchedApp.fsync=True"] if args.fsync else []
    env = {"PYTHONPATH": str(tree)}
    runs_dir = tempfile.mkdtemp(prefix="evalsched-bench-", dir=args.runs_dir_in) if args.runs_dir_in else None
    try:
        return _one_server(tree, args, env, extra, runs_dir)
    finally:
        if runs_dir:
            shutil.rmtree(runs_dir, ignore_errors=True)


def _one_server(tree: Path, args: argparse.Namespace, env: dict, extra: list, runs_dir: str | None) -> dict[str, float]:
    with LocalServer(virtual_gpus=None, cpu_slots=None, env=env, extra_args=extra, runs_dir=runs_dir) as server:
        c = server.client()
        blocker = c.submit({"entrypoint": SLEEPY, "episodes": 100000, "params": {"sleep_s": 3600}})
        body = json.dumps({"entrypoint": NOOP, "episodes": 1, "depends_on": [blocker["id"]]}).encode()
        hammer(server, args.clients, 200, "GET", "/api/status", None)  # warm-up
        hammer(server, args.clients, 100, "POST", "/evalsched/runs", body)
        status_rate, status_lat, _, _ = hammer(server, args.clients, args.submissions, "GET", "/api/status", None)
        rate, lat, answers, errors = hammer(server, args.clients, args.submissions, "POST", "/evalsched/runs", body)
        runs_dir = Path(server.runs_dir)
        ids = [json.loads(a)["id"] for a in answers]
        incomplete = [
            i for i in ids if not ((runs_dir / i / "spec.json").is_file() and (runs_dir / i / "job.json").is_file())
        ]
        c.cancel(blocker["id"])
    if errors:
        print(f"   {tree}: {len(errors)} errors, first: {errors[0]}")
    return {
        "status_rate": status_rate,
        "status_p99": pct(status_lat, 0.99),
        "rate": rate,
        "p50": pct(lat, 0.5),
        "p99": pct(lat, 0.99),
        "ratio": rate / status_rate,
        "errors": len(errors),
        "incomplete": len(incomplete),
    }


def report(label: str, results: list[dict[str, float]]) -> dict[str, float]:
    med = {k: statistics.median(r[k] for r in results) for k in results[0]}
    for i, r in enumerate(results):
        print(
            f"   {label:5} round {i + 1}: POST /evalsched/runs {r['rate']:6.0f}/s  p50 {r['p50'] * 1e3:5.1f} ms  "
            f"p99 {r['p99'] * 1e3:5.1f} ms | GET /api/status {r['status_rate']:6.0f}/s | ratio {r['ratio']:.2f}"
            f" | errors {r['errors']:.0f}, incomplete dirs {r['incomplete']:.0f}"
        )
    met = med["rate"] >= 600 and med["ratio"] >= 0.5 and med["p99"] < 0.030
    print(
        f"   {label:5} median : {med['rate']:6.0f}/s  p99 {med['p99'] * 1e3:5.1f} ms  ratio to /api/status "
        f"{med['ratio']:.2f}  -> targets (>= 600/s, >= 0.5x status, p99 < 30 ms) {'met' if met else 'NOT met'}"
    )
    return med


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--submissions", type=int, default=2000)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--old", type=Path, default=None, help="another checkout to compare with (e.g. /work/main)")
    ap.add_argument("--fsync", action="store_true", help="servers run with EvalSchedApp.fsync=True")
    ap.add_argument(
        "--runs-dir-in", type=Path, default=None, help="make each runs directory in this folder (e.g. /dev/shm)"
    )
    args = ap.parse_args()
    trees = [("new", REPO)] + ([("old", args.old.resolve())] if args.old else [])
    results: dict[str, list[dict[str, float]]] = {label: [] for label, _ in trees}
    print(
        f"{args.submissions} submissions from {args.clients} clients to a fresh default `jupyter server` "
        f"(runs queued behind a dependency){', fsync on' if args.fsync else ''}"
        f"{f', runs directories in {args.runs_dir_in}' if args.runs_dir_in else ', runs directories on disk'}; load {os.getloadavg()[0]:.2f}"
    )
    for rnd in range(args.rounds):
        order = trees if rnd % 2 == 0 else trees[::-1]
        for label, tree in order:
            results[label].append(one_server(tree, args))
    medians = {label: report(label, results[label]) for label, _ in trees}
    if args.old:
        new, old = medians["new"], medians["old"]
        print(
            f"   new/old: throughput {new['rate'] / old['rate']:.2f}x, p99 {new['p99'] / old['p99']:.2f}x, "
            f"ratio to /api/status {new['ratio']:.2f} vs {old['ratio']:.2f}"
        )


if __name__ == "__main__":
    main()
