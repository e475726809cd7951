"""Submissions to a real ``jupyter server`` as users run it, with same-run baselines.

    .venv/bin/python bench/bench_submissions.py [--submissions 2000] [--clients 8] [--phases 8]
        [--old /work/main] [--fsync] [--runs-dir-in DIR]

A ``jupyter server`` subprocess with the extension's defaults on this host (no virtual GPUs, no
``cpu_slots``, cgroups as detected; its runs directory beside the default one, in the Jupyter
data directory, unless ``--runs-dir-in``) per code tree: this tree and, with ``--old``, another
checkout (e.g. main) imported through ``PYTHONPATH``. Both run side by side, and the measures
alternate phase by phase between them (the order flips every phase), so that a busy host slows
both alike. Per server, ``--submissions`` requests of each kind in ``--phases`` phases, from
``--clients`` keep-alive clients (one thread each):

- ``GET /api/status``: Jupyter's own trivial endpoint, the baseline of that server;
- ``POST /evalsched/runs``: no-op runs (``examples.basic:noop``, 1 episode) that ``depend_on`` a
  blocker (a ``sleepy`` run that runs all along), so they stay queued: the figure is submission
  alone, not churn. Every answered run's directory is checked on disk (``spec.json``,
  ``job.json``).

Printed per tree: submissions/s (all requests over the time of their phases), p50/p99 latency,
``GET /api/status``/s, their ratio, and the issue's targets (>= 600/s, >= 0.5x status,
p99 < 30 ms); with ``--old``, the ratios new/old.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from jupyter_core.paths import jupyter_data_dir  # noqa: E402

from jupyter_evalsched.client import LocalServer  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_rest import Conn  # noqa: E402  (the keep-alive client the REST bench uses)

SLEEPY = "jupyter_evalsched.examples.basic:sleepy"
NOOP = "jupyter_evalsched.examples.basic:noop"


def hammer(
    server: LocalServer, clients: int, total: int, method: str, path: str, body: bytes | None
) -> tuple[float, list[float], list[bytes], list[str]]:
    """(seconds from the first request to the last answer, latencies, bodies of the 2xx answers,
    errors)."""
    per_client = [total // clients + (1 if i < total % clients else 0) for i in range(clients)]
    latencies: list[float] = []
    answers: list[bytes] = []
    errors: list[str] = []
    lock = threading.Lock()
    start = threading.Barrier(clients + 1)

    def work(n: int) -> None:
        conn = Conn(server.url, server.token)
        conn.call("GET", "/api/status")  # connected before the clock starts
        mine: list[float] = []
        ok: list[bytes] = []
        bad: list[str] = []
        start.wait()
        for _ in range(n):
            t0 = time.perf_counter()
            code, data = conn.call(method, path, body)
            mine.append(time.perf_counter() - t0)
            if 200 <= code < 300:
                ok.append(data)
            else:
                bad.append(f"{code}: {data[:200]!r}")
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
    return time.perf_counter() - t0, latencies, answers, errors


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(len(xs) * p))]


class Target:
    """One server of one code tree, its blocker, and what was measured on it."""

    def __init__(self, label: str, tree: Path, args: argparse.Namespace) -> None:
        self.label = label
        self.tree = tree
        args.runs_dir_in.mkdir(parents=True, exist_ok=True)
        self.runs_dir = tempfile.mkdtemp(prefix="bench-submissions-", dir=args.runs_dir_in)
        extra = ["--EvalSchedApp.fsync=True"] if args.fsync else []
        self.server = LocalServer(
            virtual_gpus=None,
            cpu_slots=None,
            env={"PYTHONPATH": str(tree)},
            extra_args=extra,
            runs_dir=os.path.join(self.runs_dir, "runs"),
        )
        client = self.server.client()
        self.blocker = client.submit({"entrypoint": SLEEPY, "episodes": 100000, "params": {"sleep_s": 3600}})
        self.body = json.dumps({"entrypoint": NOOP, "episodes": 1, "depends_on": [self.blocker["id"]]}).encode()
        self.post_s = self.status_s = 0.0
        self.post_lat: list[float] = []
        self.status_lat: list[float] = []
        self.ids: list[str] = []
        self.errors: list[str] = []

    def warm_up(self, clients: int) -> None:
        hammer(self.server, clients, 200, "GET", "/api/status", None)
        hammer(self.server, clients, 100, "POST", "/evalsched/runs", self.body)

    def phase(self, clients: int, n: int) -> None:
        took, lat, _, _ = hammer(self.server, clients, n, "GET", "/api/status", None)
        self.status_s += took
        self.status_lat += lat
        took, lat, answers, errors = hammer(self.server, clients, n, "POST", "/evalsched/runs", self.body)
        self.post_s += took
        self.post_lat += lat
        self.ids += [json.loads(a)["id"] for a in answers]
        self.errors += errors

    def figures(self) -> dict[str, float]:
        runs = Path(self.server.runs_dir)
        incomplete = [
            i for i in self.ids if not ((runs / i / "spec.json").is_file() and (runs / i / "job.json").is_file())
        ]
        rate = len(self.post_lat) / self.post_s
        status = len(self.status_lat) / self.status_s
        return {
            "rate": rate,
            "p50": pct(self.post_lat, 0.5),
            "p99": pct(self.post_lat, 0.99),
            "status": status,
            "ratio": rate / status,
            "errors": len(self.errors),
            "incomplete": len(incomplete),
        }

    def close(self) -> None:
        try:
            self.server.client().cancel(self.blocker["id"])
        finally:
            self.server.cleanup()
            shutil.rmtree(self.runs_dir, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--submissions", type=int, default=2000, help="per server, of each kind")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--phases", type=int, default=8, help="alternations between the servers")
    ap.add_argument("--old", type=Path, default=None, help="another checkout to compare with (e.g. /work/main)")
    ap.add_argument("--fsync", action="store_true", help="servers run with EvalSchedApp.fsync=True")
    ap.add_argument(
        "--runs-dir-in",
        type=Path,
        default=Path(jupyter_data_dir()) / "evalsched",
        help="the runs directories in this folder (default: where the default runs_dir is; /dev/shm: tmpfs)",
    )
    args = ap.parse_args()
    trees = [("new", REPO)] + ([("old", args.old.resolve())] if args.old else [])
    print(
        f"{args.submissions} submissions from {args.clients} clients to each fresh default `jupyter server` "
        f"(runs held by a dependency), in {args.phases} phases alternating between "
        f"{' and '.join(f'{label} ({tree})' for label, tree in trees)}"
        f"{', fsync on' if args.fsync else ''}, runs directories in {args.runs_dir_in}; "
        f"load {os.getloadavg()[0]:.2f}"
    )
    targets: list[Target] = []
    try:
        for label, tree in trees:
            targets.append(Target(label, tree, args))
        for target in targets:
            target.warm_up(args.clients)
        per_phase = [
            args.submissions // args.phases + (1 if i < args.submissions % args.phases else 0)
            for i in range(args.phases)
        ]
        for i, n in enumerate(per_phase):
            for target in targets if i % 2 == 0 else targets[::-1]:
                target.phase(args.clients, n)
        figures = {t.label: t.figures() for t in targets}
    finally:
        for target in targets:
            target.close()
    print(f"   load at the end {os.getloadavg()[0]:.2f}")
    for t in targets:
        f = figures[t.label]
        met = f["rate"] >= 600 and f["ratio"] >= 0.5 and f["p99"] < 0.030
        print(
            f"   {t.label}: POST /evalsched/runs {f['rate']:6.0f}/s  p50 {f['p50'] * 1e3:5.1f} ms  p99 {f['p99'] * 1e3:5.1f} ms"
            f" | GET /api/status {f['status']:6.0f}/s | ratio {f['ratio']:.2f} | errors {f['errors']:.0f},"
            f" incomplete dirs {f['incomplete']:.0f} -> targets (>= 600/s, >= 0.5x status, p99 < 30 ms)"
            f" {'met' if met else 'NOT met'}"
        )
        if t.errors:
            print(f"      first error: {t.errors[0]}")
    if args.old:
        new, old = figures["new"], figures["old"]
        print(
            f"   new/old: submissions/s {new['rate'] / old['rate']:.2f}x, p99 {new['p99'] / old['p99']:.2f}x,"
            f" ratio to /api/status {new['ratio']:.2f} vs {old['ratio']:.2f}"
        )


if __name__ == "__main__":
    main()
