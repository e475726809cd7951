"""Issue #31's bench: the shared causal LM behind ``/evalsched/v1`` of a real ``jupyter server``
with the extension's defaults, each figure against a baseline measured in the same run.

    .venv/bin/python bench/bench_openai.py [--quick] [--markdown] [--model tiny|small]
        [--memory-models tiny,gpt2s] [--rounds 6] [--seconds 2] [--parts 123]

The server is a ``LocalServer`` subprocess with nothing set but what a private server needs (its
port, token, runtime and runs directories) and the shared models, each declared with the defaults
(``max_batch_size`` 8, ``max_wait_ms`` 5, the library's intra-op threads): a random GPT-2 built
offline (``tiny``: ``shared_models/tiny_lm.py``'s 2 layers of 64; ``small``: the
same tokenizer with 4 layers of 256 and 8 heads; ``gpt2s``: GPT-2 small's shape, 12 layers of 768,
85M parameters, 340 MB; ``gpt2m``: GPT-2 medium's shape, 24 layers of 1024, 303M parameters,
1.2 GB). Parts 1 and 2 use ``--model`` (``tiny`` by default: on CPU a forward
pass of the tiny model is mostly per-operation overhead, which a batch shares; the larger
shapes' cost grows with the batch's tokens). The server also declares one model per
``--memory-models`` kind for part 3.

1. Throughput, scoring (``echo``, ``max_tokens: 0``, ``logprobs: 1``, what lm-eval's
   loglikelihood sends) and greedy generation (``max_tokens: 16``, temperature 0): 8 concurrent
   clients (threads, keep-alive connections, the server's token) against one client at a time,
   in alternating rounds of ``--seconds`` each; the ratio of each round pair, its median and
   spread. Target (scoring): >= 3x. The host's batch sizes are read from ``GET /evalsched/models``.
2. The API's overhead per request: one scoring request through the API against the same request
   to the same model loaded in this process (``CausalLM.openai_batch`` at batch 1, the host's
   OpenMP settings), interleaved, each kind first in turn; ``GET /api/status`` beside it as the
   bare HTTP round trip.
3. Memory: 4 runs (``models: [<name>]``, each scoring through ``jupyter_evalsched.openai_client()``
   and then waiting) and 2 real ipykernel kernels doing the same, against one process that loaded
   the model and scored once: the sum of PSS (``/proc/<pid>/smaps_rollup``) of the model host,
   the runs' processes (and their children) and the kernels, against that process's PSS, measured
   first, before the host loads the model (so that neither shares the model's file pages with
   the other). Target: <= 1.3x. Printed too: the size from which the one process would meet it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_rest import Conn  # noqa: E402

from jupyter_evalsched.client import LocalServer  # noqa: E402

MODEL = "bench-lm"
LOADER = "jupyter_evalsched.shared_models.loaders:causal_lm"
CLIENTS = 8
SHAPES = {
    "small": {"n_embd": 256, "n_layer": 4, "n_head": 8},
    "gpt2s": {"n_embd": 768, "n_layer": 12, "n_head": 12},
    "gpt2m": {"n_embd": 1024, "n_layer": 24, "n_head": 16},
}
SIZES = {
    "gpt2s": " (GPT-2 small's shape: 85M parameters, 340 MB in float32)",
    "gpt2m": " (GPT-2 medium's shape: 303M parameters, 1.2 GB in float32)",
}

# lm-eval-like scoring requests: a context and its continuation, 10 to 30 tokens.
PROMPTS = [
    "The cat sat on the mat and looked at the dog in the garden.",
    "A dog was running in the garden after a ball.",
    "Stocks fell sharply today after the bank reported losses for the third quarter.",
    "The team won the football match on Sunday evening.",
    "She bought apples and pears at the market before going home.",
    "It is very cold and snowing outside this morning.",
    "The meeting was moved to next week because the manager was ill.",
    "The chef cooked pasta for dinner, and the children ate all of it.",
]

RUN_SOURCE = """
import os, time
import jupyter_evalsched

def episode(ctx, index):
    client = jupyter_evalsched.openai_client(max_retries=0)
    client.completions.create(model=%(model)r, prompt=%(prompt)r, echo=True, max_tokens=0, logprobs=1)
    open(os.environ["READY_FILE"], "w").close()
    while not os.path.exists(os.environ["STOP_FILE"]):
        time.sleep(0.05)
    return {"ok": 1}
"""

KERNEL_SOURCE = """
import jupyter_evalsched
client = jupyter_evalsched.openai_client(max_retries=0)
scored = client.completions.create(model=%(model)r, prompt=%(prompt)r, echo=True, max_tokens=0, logprobs=1)
"""

ONE_PROCESS = """
import sys
from jupyter_evalsched.shared_models.loaders import causal_lm
lm = causal_lm(model=sys.argv[1])
lm.openai_batch([{"prompt": sys.argv[2], "echo": True, "max_tokens": 0, "logprobs": 1}])
print("ready", flush=True)
sys.stdin.read()
"""


class BenchFailure(RuntimeError):
    pass


# ---------------------------------------------------------------------------- the model


def build_models(kinds: list[str], folder: str) -> dict[str, tuple[str, str]]:
    """Each kind's model directory and a description of its configuration. Built in a child
    process: this one stays as a user's process that loads a model (after building one here,
    tokenizer training and all, a forward pass of the in-process baseline took 4x as long)."""
    import subprocess

    script = f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import bench_openai as b; "
    script += "[b.build_model(kind, sys.argv[1]) for kind in sys.argv[2:]]"
    subprocess.run(
        [sys.executable, "-c", script, folder, *kinds], check=True, env={**os.environ, "PYTHONPATH": str(REPO)}
    )
    return {kind: build_model(kind, folder) for kind in kinds}  # built: only their paths now


def build_model(kind: str, folder: str) -> tuple[str, str]:
    """The model directory (built unless it is there) and a description of its configuration."""
    from jupyter_evalsched.shared_models.tiny_lm import build_tiny_gpt2

    tiny = build_tiny_gpt2(os.path.join(folder, "tiny-gpt2"))
    if kind == "tiny":
        return tiny, "tiny_lm.py's random GPT-2: 2 layers, 64 dims, 2 heads, 512 tokens, context 256"
    shape = SHAPES[kind]
    path = os.path.join(folder, f"{kind}-gpt2")
    if not os.path.isfile(os.path.join(path, "config.json")):
        import torch
        from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

        from jupyter_evalsched.shared_models.tiny import save_into

        tokenizer = AutoTokenizer.from_pretrained(tiny)
        base = GPT2Config.from_pretrained(tiny)
        config = GPT2Config(**{**base.to_dict(), **shape})
        torch.manual_seed(0)
        save_into(path, f".{kind}-gpt2-", GPT2LMHeadModel(config).eval(), tokenizer)
    return path, (
        f"a random GPT-2 with tiny_lm.py's tokenizer: {shape['n_layer']} layers, {shape['n_embd']} dims,"
        f" {shape['n_head']} heads, 512 tokens, context 256{SIZES.get(kind, '')}"
    )


def score_body(prompt: str) -> bytes:
    return json.dumps({"model": MODEL, "prompt": prompt, "echo": True, "max_tokens": 0, "logprobs": 1}).encode()


def generate_body(prompt: str) -> bytes:
    return json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 16, "temperature": 0}).encode()


# ---------------------------------------------------------------------------- statistics (pure)


def med(xs: list[float]) -> float:
    return statistics.median(xs)


def spread(xs: list[float]) -> str:
    return f"{min(xs):.2f}-{max(xs):.2f}"


# ---------------------------------------------------------------------------- part 1


def post(conn: Conn, body: bytes) -> dict:
    code, data = conn.call("POST", "/evalsched/v1/completions", body)
    if code != 200:
        raise BenchFailure(f"POST /evalsched/v1/completions answered {code}: {data[:300]!r}")
    return json.loads(data)


def rate(server: LocalServer, clients: int, seconds: float, make_body) -> float:
    """Requests per second from ``clients`` threads (a keep-alive connection each), each sending
    its next request when the previous one is answered, for ``seconds``."""
    conns = [Conn(server.url, server.token) for _ in range(clients)]
    # The host waits (max_wait_ms at most) for an API client it answered in the last 0.2 s that
    # has not sent again: let the previous phase's clients be forgotten, so that they do not slow
    # this phase down. Then connect outside the timing.
    time.sleep(0.5)
    for i, conn in enumerate(conns):
        post(conn, make_body(PROMPTS[i % len(PROMPTS)]))
    counts = [0] * clients
    failures: list[BaseException] = []
    barrier = threading.Barrier(clients + 1)
    stop = [float("inf")]

    def work(i: int) -> None:
        barrier.wait()
        k = 0
        try:
            while time.perf_counter() < stop[0]:
                post(conns[i], make_body(PROMPTS[(i + k) % len(PROMPTS)]))
                k += 1
        except BaseException as exc:  # reported after the round
            failures.append(exc)
        counts[i] = k

    threads = [threading.Thread(target=work, args=(i,)) for i in range(clients)]
    for thread in threads:
        thread.start()
    barrier.wait()
    began = time.perf_counter()
    stop[0] = began + seconds
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - began
    for conn in conns:
        conn.conn.close()
    if failures:
        raise BenchFailure(f"a client failed: {failures[0]!r}")
    return sum(counts) / elapsed


def host_figures(server: LocalServer, name: str = MODEL) -> dict:
    conn = Conn(server.url, server.token)
    code, data = conn.call("GET", "/evalsched/models")
    if code != 200:
        raise BenchFailure(f"GET /evalsched/models answered {code}")
    (model,) = [m for m in json.loads(data)["models"] if m["name"] == name]
    return model


def batch_delta(before: dict, after: dict) -> str:
    """The mean batch size of the batches run between two reads of the host's figures."""
    batches = after["batches"] - before["batches"]
    inputs = after["inputs"] - before["inputs"]
    return f"{inputs / batches:.1f}" if batches else "-"


class CpuMeter:
    """CPU seconds (user + system) used by the server, the model host and this bench process."""

    def __init__(self, server: LocalServer):
        import psutil

        self.server = psutil.Process(server.process.pid)
        self.host = psutil.Process(host_figures(server)["pid"])

    def read(self) -> tuple[float, float, float]:
        def cpu(process) -> float:
            times = process.cpu_times()
            return times.user + times.system

        return cpu(self.server), cpu(self.host), time.process_time()


def cpu_per_request(before: tuple, after: tuple, requests: float) -> tuple[float, ...]:
    return tuple(1000 * (b - a) / requests for a, b in zip(before, after, strict=True))


def part1(server: LocalServer, rounds: int, seconds: float) -> dict:
    results: dict = {}
    meter = CpuMeter(server)
    for kind, make_body in (("scoring", score_body), ("generation", generate_body)):
        ratios, together, alone, sizes = [], [], [], []
        cpu: dict[str, list[tuple[float, ...]]] = {"many": [], "one": []}
        for _ in range(rounds):
            before, cpu0 = host_figures(server), meter.read()
            many = rate(server, CLIENTS, seconds, make_body)
            middle, cpu1 = host_figures(server), meter.read()
            one = rate(server, 1, seconds, make_body)
            cpu2 = meter.read()
            cpu["many"].append(cpu_per_request(cpu0, cpu1, many * seconds))
            cpu["one"].append(cpu_per_request(cpu1, cpu2, one * seconds))
            sizes.append(batch_delta(before, middle))
            together.append(many)
            alone.append(one)
            ratios.append(many / one)
        results[kind] = {"ratios": ratios, "together": together, "alone": alone, "batch": sizes}
        print(
            f"   {kind:10s} {CLIENTS} clients {med(together):7.1f}/s (mean batch per round {', '.join(sizes)}),"
            f" 1 client {med(alone):7.1f}/s: ratio median {med(ratios):.2f}x, rounds {spread(ratios)}"
            f" ({', '.join(f'{r:.2f}' for r in ratios)})",
            flush=True,
        )
        for mode, label in (("many", f"{CLIENTS} clients"), ("one", "1 client")):
            server_ms, host_ms, client_ms = (med([c[i] for c in cpu[mode]]) for i in range(3))
            print(
                f"      CPU per request, {label:10s}: server {server_ms:.2f} ms, model host {host_ms:.2f} ms,"
                f" bench clients {client_ms:.2f} ms (medians over rounds)",
                flush=True,
            )
        results[kind]["cpu"] = cpu
    return results


# ---------------------------------------------------------------------------- part 2


def part2(server: LocalServer, model_dir: str, calls: int) -> dict:
    from jupyter_evalsched.shared_models.loaders import causal_lm

    lm = causal_lm(model=model_dir)
    conn = Conn(server.url, server.token)
    status = Conn(server.url, server.token)
    request = {"prompt": PROMPTS[2], "echo": True, "max_tokens": 0, "logprobs": 1}
    body = score_body(PROMPTS[2])
    api, local, bare = [], [], []

    def timed(fn) -> float:
        began = time.perf_counter()
        fn()
        return time.perf_counter() - began

    for i in range(calls + 10):
        # Each kind first in turn: what the one before leaves running (the server finishing a
        # request, the host's threads) slows the next one down on a busy machine.
        kinds = [
            (api, lambda: post(conn, body)),
            (local, lambda: lm.openai_batch([dict(request)])),
            (bare, lambda: status.call("GET", "/api/status")),
        ]
        for samples, fn in kinds[i % 3 :] + kinds[: i % 3]:
            seconds = timed(fn)
            if i >= 10:
                samples.append(seconds)
    figures = {"api_ms": med(api) * 1000, "local_ms": med(local) * 1000, "status_ms": med(bare) * 1000}
    figures["overhead_ms"] = figures["api_ms"] - figures["local_ms"]
    print(
        f"   API {figures['api_ms']:.2f} ms, in-process {figures['local_ms']:.2f} ms (medians of {calls},"
        f" interleaved): overhead {figures['overhead_ms']:.2f} ms per request;"
        f" GET /api/status {figures['status_ms']:.2f} ms",
        flush=True,
    )
    return figures


# ---------------------------------------------------------------------------- part 3


def pss_kb(pid: int) -> int:
    """The process's proportional set size (its private pages plus its share of shared ones)."""
    with open(f"/proc/{pid}/smaps_rollup", encoding="ascii") as f:
        for line in f:
            if line.startswith("Pss:"):
                return int(line.split()[1])
    raise BenchFailure(f"no Pss line in /proc/{pid}/smaps_rollup")


def with_children(pids: list[int]) -> list[int]:
    import psutil

    out: list[int] = []
    for pid in pids:
        process = psutil.Process(pid)
        out += [pid] + [child.pid for child in process.children(recursive=True)]
    return out


def wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise BenchFailure(f"{what}: not within {timeout:g} s")
        time.sleep(0.05)


def part3(server: LocalServer, name: str, model_dir: str, folder: str) -> dict:
    import subprocess

    from jupyter_client.manager import start_new_kernel

    one = subprocess.Popen(
        [sys.executable, "-c", ONE_PROCESS, model_dir, PROMPTS[0]],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    try:  # first: the model's host has not loaded it yet, so no other process maps its files
        if host_figures(server, name)["load_count"]:
            raise BenchFailure(f"{name} is loaded already: the baseline would share its file pages")
        if one.stdout is None or one.stdout.readline().strip() != "ready":
            raise BenchFailure(f"the one-process baseline failed (exit {one.wait()})")
        alone = pss_kb(one.pid)
    finally:
        if one.stdin is not None:
            one.stdin.close()
        one.wait(timeout=60)
    client = server.client()
    stop_file = os.path.join(folder, f"stop-{name}")
    source = RUN_SOURCE % {"model": name, "prompt": PROMPTS[0]}
    runs = []
    for n in range(4):
        ready = os.path.join(folder, f"ready-{name}-{n}")
        spec = {
            "source": source,
            "episodes": 1,
            "models": [name],
            "scheduling": {"cpus": 0},  # the default slots are the host's cores: all four at once
            "env": {"READY_FILE": ready, "STOP_FILE": stop_file},
        }
        runs.append((client.submit(spec)["id"], ready))
    kernels = []
    env = {**os.environ, "EVALSCHED_URL": server.url, "EVALSCHED_TOKEN": server.token, "PYTHONPATH": str(REPO)}
    try:
        for _ in range(2):
            km, kc = start_new_kernel(kernel_name="python3", env=env)
            kernels.append((km, kc))
            reply = kc.execute_interactive(KERNEL_SOURCE % {"model": name, "prompt": PROMPTS[0]}, timeout=300)
            if reply["content"]["status"] != "ok":
                raise BenchFailure(f"a kernel failed: {reply['content']}")
        for run_id, ready in runs:
            wait_for(lambda ready=ready: os.path.exists(ready), 300, f"run {run_id} ready")
        host_pid = host_figures(server, name)["pid"]
        run_pids = with_children([client.get(run_id)["pid"] for run_id, _ in runs])
        kernel_pids = [km.provisioner.process.pid for km, _ in kernels]
        host = pss_kb(host_pid)
        run_kb = sum(pss_kb(pid) for pid in run_pids)
        kernel_kb = sum(pss_kb(pid) for pid in kernel_pids)
    finally:
        Path(stop_file).touch()
        for km, kc in kernels:
            kc.stop_channels()
            km.shutdown_kernel(now=True)
    for run_id, _ in runs:
        wait_for(lambda run_id=run_id: client.get(run_id)["state"] in ("succeeded", "failed"), 120, "run end")
    total = host + run_kb + kernel_kb
    figures = {
        "model": name,
        "host_mb": host / 1024,
        "runs_mb": run_kb / 1024,
        "run_processes": len(run_pids),
        "kernels_mb": kernel_kb / 1024,
        "total_mb": total / 1024,
        "one_mb": alone / 1024,
        "ratio": total / alone,
        # What the sharing costs beyond the one process (the host's own extra and the callers'
        # processes) is fixed: <= 1.3x holds once the one process holding the model is this big.
        "break_even_mb": (total - alone) / 0.3 / 1024,
    }
    print(
        f"   {name}: host {figures['host_mb']:.0f} MB + 4 runs {figures['runs_mb']:.0f} MB ({len(run_pids)} processes)"
        f" + 2 kernels {figures['kernels_mb']:.0f} MB = {figures['total_mb']:.0f} MB PSS;"
        f" one process holding the model {figures['one_mb']:.0f} MB: {figures['ratio']:.2f}x"
        f" (<= 1.3x from a process of {figures['break_even_mb']:.0f} MB)",
        flush=True,
    )
    return figures


# ---------------------------------------------------------------------------- main


def markdown(configuration: str, results: dict) -> str:
    lines = [
        f"Measured with `bench/bench_openai.py` against a real `jupyter server`: {configuration}.",
        "",
        "| figure | measured | baseline in the same run | target | |",
        "|---|---|---|---|---|",
    ]
    for kind in ("scoring", "generation"):
        p = results.get("throughput", {}).get(kind)
        if p:
            ok = med(p["ratios"]) >= 3 if kind == "scoring" else None
            lines.append(
                f"| {kind}, {CLIENTS} concurrent clients / 1 at a time (median of {len(p['ratios'])} round pairs;"
                f" spread) | {med(p['together']):.0f}/s = **{med(p['ratios']):.2f}x** ({spread(p['ratios'])});"
                f" mean batch {', '.join(p['batch'])} | 1 client {med(p['alone']):.0f}/s"
                f" | {'>= 3x' if kind == 'scoring' else '-'} | {'-' if ok is None else 'PASS' if ok else 'MISS'} |"
            )
    o = results.get("overhead")
    if o:
        lines.append(
            f"| API overhead per scoring request, batch 1 (medians) | {o['api_ms']:.2f} ms through the API:"
            f" +{o['overhead_ms']:.2f} ms | in-process `openai_batch` {o['local_ms']:.2f} ms;"
            f" `GET /api/status` {o['status_ms']:.2f} ms | (report) | - |"
        )
    for m in results.get("memory", []):
        lines.append(
            f"| PSS of host + 4 runs + 2 kernels using `{m['model']}` ({m['text']})"
            f" | {m['total_mb']:.0f} MB = **{m['ratio']:.2f}x**"
            f" (host {m['host_mb']:.0f}, runs {m['runs_mb']:.0f}, kernels {m['kernels_mb']:.0f})"
            f" | one process holding the model {m['one_mb']:.0f} MB (<= 1.3x from one of"
            f" {m['break_even_mb']:.0f} MB on) | <= 1.3x"
            f" | {'PASS' if m['ratio'] <= 1.3 else 'MISS'} |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="3 rounds of 1 s, 50 overhead calls (about 3 min)")
    parser.add_argument("--markdown", action="store_true", help="also print the figures as a markdown table")
    parser.add_argument("--model", choices=("tiny", "small"), default="tiny", help="the model of parts 1 and 2")
    parser.add_argument(
        "--memory-models",
        default="tiny,gpt2s",
        help="the models of part 3, comma-separated (tiny, small, gpt2s, gpt2m)",
    )
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--parts", default="123")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.seconds, args.calls = 3, 1.0, 50
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    # The in-process baseline as the host runs its model (host.py sets it there): OpenMP threads
    # that sleep, not spin, while they wait. Read once, when torch is first imported (below); the
    # server and its hosts get the environment this bench was given.
    given_policy = os.environ.get("OMP_WAIT_POLICY")
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    folder = tempfile.mkdtemp(prefix="bench-openai-")
    memory_kinds = args.memory_models.split(",") if "3" in args.parts else []
    built = build_models(sorted({args.model, *memory_kinds}), folder)
    model_dir, model_text = built[args.model]
    models = [{"name": MODEL, "loader": LOADER, "model": model_dir}]  # the defaults for everything else
    memory_models = {f"memory-{kind}": built[kind] for kind in memory_kinds}
    models += [{"name": name, "loader": LOADER, "model": path} for name, (path, _) in memory_models.items()]
    started = time.perf_counter()
    if given_policy is None:
        del os.environ["OMP_WAIT_POLICY"]
    local = LocalServer(virtual_gpus=None, cpu_slots=None, models=models)
    os.environ["OMP_WAIT_POLICY"] = given_policy or "PASSIVE"  # for the subprocesses of part 3
    with local as server:
        post(Conn(server.url, server.token), score_body(PROMPTS[0]))  # load the model outside the timing
        described = host_figures(server)
        configuration = (
            f"Linux {platform.release()}, {os.cpu_count()} CPUs (load average {os.getloadavg()[0]:.1f} at the start);"
            f" server with the extension's defaults (no virtual GPUs), the model declared with"
            f" max_batch_size {described['max_batch_size']}, max_wait_ms {described['max_wait_ms']:g},"
            f" cpu_threads unset; model: {model_text}"
        )
        print(configuration, flush=True)
        results: dict = {}
        if "1" in args.parts:
            print(f"1. throughput, {args.rounds} alternating round pairs of {args.seconds:g} s", flush=True)
            results["throughput"] = part1(server, args.rounds, args.seconds)
        if "2" in args.parts:
            print("2. the API's overhead per request, batch 1", flush=True)
            results["overhead"] = part2(server, model_dir, args.calls)
        if "3" in args.parts:
            print("3. memory, PSS", flush=True)
            results["memory"] = []
            for name, (directory, text) in memory_models.items():
                results["memory"].append({**part3(server, name, directory, folder), "text": text})
        final = host_figures(server)
        print(f"   model loads in the host: {final['load_count']}; batch sizes {final['batch_sizes']}")
    print(f"   ({time.perf_counter() - started:.0f} s)")
    shutil.rmtree(folder, ignore_errors=True)  # the models: up to 340 MB
    if args.markdown:
        print()
        print(markdown(configuration, results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
