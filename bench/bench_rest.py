"""REST throughput and queue-read latency of a real `jupyter server` with the extension, each
against Jupyter's own trivial endpoint (`GET /api/status`) measured in the same run.

    .venv/bin/python bench/bench_rest.py [--submissions 4000] [--clients 8] [--queued 10000]

1. Submissions over REST from N concurrent clients (keep-alive connections, one thread each):
   submissions/s, latency p50/p99, and a check that every 201 exists afterwards (none lost).
   Baseline: the same clients doing `GET /api/status`.
2. `GET /evalsched/queue` with 10,000 jobs queued: median latency, against `GET /api/status`.
   Nothing changes between the reads, so the server answers from its cache.
3. The same after a change (one more submission before each read, as when runs come and go
   while a panel or widget reads the queue): the whole view, against `?limit=50` (what the
   widget, `queue --watch` and the discovery probe ask for), alternated round by round.

The jobs queue behind an exclusive run on the single virtual GPU, so the queue really holds them.
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import sys
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jupyter_evalsched.client import LocalServer

SLEEPY = "jupyter_evalsched.examples.basic:sleepy"


class Conn:
    def __init__(self, url: str, token: str):
        parts = urlsplit(url)
        self.base = parts.path.rstrip("/")
        self.conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
        self.headers = {"Authorization": f"token {token}", "Content-Type": "application/json"}

    def call(self, method: str, path: str, body: bytes | None = None) -> tuple[int, bytes]:
        self.conn.request(method, self.base + path, body=body, headers=self.headers)
        resp = self.conn.getresponse()
        return resp.status, resp.read()


def hammer(url, token, clients: int, per_client: int, method: str, path: str, body: bytes | None):
    latencies: list[float] = []
    ids: list[str] = []
    errors: list[str] = []
    lock = threading.Lock()
    start = threading.Barrier(clients + 1)

    def work():
        conn = Conn(url, token)
        mine, my_ids = [], []
        start.wait()
        for _ in range(per_client):
            t0 = time.perf_counter()
            code, data = conn.call(method, path, body)
            mine.append(time.perf_counter() - t0)
            if method == "POST":
                if code == 201:
                    my_ids.append(json.loads(data)["id"])
                else:
                    errors.append(f"{code}: {data[:200]!r}")
        with lock:
            latencies.extend(mine)
            ids.extend(my_ids)

    threads = [threading.Thread(target=work) for _ in range(clients)]
    for t in threads:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - t0
    return len(latencies) / elapsed, latencies, ids, errors


def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(len(xs) * p))]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--submissions", type=int, default=4000)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--queued", type=int, default=10000)
    args = ap.parse_args()
    per_client = args.submissions // args.clients
    with LocalServer(
        virtual_gpus="24000", cpu_slots=4, extra_args=["--EvalSchedApp.reconcile_interval_s=1.0"]
    ) as server:
        c = server.client()
        blocker = c.submit(
            {"entrypoint": SLEEPY, "episodes": 100000, "params": {"sleep_s": 1}, "scheduling": {"exclusive_gpu": True}}
        )
        body = json.dumps({"entrypoint": SLEEPY, "episodes": 1, "scheduling": {"marginal_vram_mb": 1000}}).encode()

        base_rate, base_lat, _, _ = hammer(
            server.url, server.token, args.clients, per_client, "GET", "/api/status", None
        )
        rate, lat, ids, errors = hammer(
            server.url, server.token, args.clients, per_client, "POST", "/evalsched/runs", body
        )
        listed = {r["id"] for r in c.list(state="queued", limit=100000)}
        lost = [i for i in ids if i not in listed]
        print(f"1. submissions over REST, {args.clients} concurrent clients, {len(lat)} requests")
        print(
            f"   GET /api/status (baseline)  {base_rate:8.0f} req/s   p50 {pct(base_lat, 0.5) * 1000:6.2f} ms   p99 {pct(base_lat, 0.99) * 1000:6.2f} ms"
        )
        print(
            f"   POST /evalsched/runs        {rate:8.0f} req/s   p50 {pct(lat, 0.5) * 1000:6.2f} ms   p99 {pct(lat, 0.99) * 1000:6.2f} ms"
        )
        print(
            f"   ratio submit/status throughput: {rate / base_rate:.2f}   accepted {len(ids)}, errors {len(errors)}, lost {len(lost)}"
        )
        print(
            f"   target >= 500/s, p99 < 50 ms, none lost -> {'met' if rate >= 500 and pct(lat, 0.99) < 0.05 and not lost and not errors else 'NOT met'}\n"
        )
        if errors:
            print("   first error:", errors[0])

        # Fill up to --queued with a few more fast clients.
        missing = args.queued - len(listed)
        if missing > 0:
            hammer(server.url, server.token, args.clients, missing // args.clients + 1, "POST", "/evalsched/runs", body)
        nq = len(c.queue()["queued"])
        conn = Conn(server.url, server.token)
        q_lat, s_lat = [], []
        for _ in range(40):
            t0 = time.perf_counter()
            code, data = conn.call("GET", "/evalsched/queue")
            q_lat.append(time.perf_counter() - t0)
            assert code == 200
            t0 = time.perf_counter()
            conn.call("GET", "/api/status")
            s_lat.append(time.perf_counter() - t0)
        print(f"2. GET /evalsched/queue with {nq} queued ({len(data) / 1e6:.1f} MB)")
        print(f"   GET /api/status (baseline)  median {statistics.median(s_lat) * 1000:7.2f} ms")
        print(
            f"   GET /evalsched/queue        median {statistics.median(q_lat) * 1000:7.2f} ms   p90 {pct(q_lat, 0.9) * 1000:7.2f} ms"
        )
        print(
            f"   ratio queue/status: {statistics.median(q_lat) / statistics.median(s_lat):.1f}x   target <= 50 ms median -> "
            f"{'met' if statistics.median(q_lat) <= 0.05 else 'NOT met'}"
        )

        # 3. After a change: every read builds the view anew (ordering the queue, serialising it).
        changed: dict[str, list[float]] = {"/evalsched/queue": [], "/evalsched/queue?limit=50": []}
        sizes: dict[str, int] = {}
        for _ in range(15):
            for path, times in changed.items():
                code, _ = conn.call("POST", "/evalsched/runs", body)
                assert code == 201
                t0 = time.perf_counter()
                code, data = conn.call("GET", path)
                times.append(time.perf_counter() - t0)
                assert code == 200
                sizes[path] = len(data)
        whole, head = (statistics.median(t) for t in changed.values())
        print(f"\n3. GET /evalsched/queue with {nq} queued, one submission before each read (alternated)")
        for (path, times), size in zip(changed.items(), sizes.values(), strict=True):
            print(
                f"   GET {path:28s} median {statistics.median(times) * 1000:7.2f} ms   "
                f"p90 {pct(times, 0.9) * 1000:7.2f} ms   {size / 1e3:9.1f} kB"
            )
        print(f"   ratio limit=50 / whole view: {head / whole:.2f}x")
        c.cancel(blocker["id"])


if __name__ == "__main__":
    main()
