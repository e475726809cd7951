"""One no-op run, submission -> ``_DONE``, on real ``jupyter server`` processes (``LocalServer``):
the extension's defaults on this host (its cgroups as detected), the same with
``--EvalSchedApp.cgroups=False``, and, where the host has a cgroup v2 hierarchy beside v1
controllers (hybrid), one told to use only that v2 hierarchy (``cgroup_parent``); the servers run
side by side and are measured alternately, round by round, so that every figure has its baselines
from the same run (these machines are noisy: never compare with a number from another run).

    .venv/bin/python bench/bench_start_cgroups.py [--rounds 40] [--warmup 5] [--cold]

A round on a server: the wall clock before ``POST /runs``, then ``_DONE`` in the run's directory
polled every 0.2 ms (the user's view: when its result is final), then the run's terminal state
(so that the next round starts on an idle server). The records' own timestamps split it:
submitted -> started (admission, the start) -> finished (the run's own work and its end).
The zygote is waited for first, and the records' ``start`` says how many runs started warm;
``--cold``: every run asks for ``fresh_interpreter`` (a cold start, its cgroup from the pool).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from datetime import datetime

from jupyter_evalsched.client import LocalServer
from jupyter_evalsched.scheduler.cgroup_detect import parse_mounts, parse_self_cgroup

NOOP = {"entrypoint": "jupyter_evalsched.examples.basic:noop", "episodes": 1}


def unified_parent() -> str | None:
    """This process's own directory in the host's v2 hierarchy when v1 controllers are mounted too
    (hybrid), else None (pure v2: the default is v2 only already)."""
    with open("/proc/self/mounts") as f:
        mounts = parse_mounts(f.read())
    v2 = next((m for m, fstype, _ in mounts if fstype == "cgroup2"), None)
    if v2 is None or not any(fstype == "cgroup" and len(opts) > 2 for _, fstype, opts in mounts):
        return None
    with open("/proc/self/cgroup") as f:
        own = parse_self_cgroup(f.read()).get("")
    if own is None:
        return None
    path = os.path.join(v2, own.strip("/")) if own.strip("/") else v2
    return path if os.path.isfile(os.path.join(path, "cgroup.procs")) else None


def ts(text: str | None) -> float:
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp() if text else float("nan")


def one_run(server: LocalServer, cold: bool) -> dict[str, float]:
    client = server.client()
    t0 = time.time()
    rec = client.submit({**NOOP, "fresh_interpreter": cold})
    done = os.path.join(server.runs_dir, rec["id"], "_DONE")
    while not os.path.exists(done):
        time.sleep(0.0002)
    t1 = time.time()
    while True:
        final = client.get(rec["id"])
        if final["state"] in ("succeeded", "failed", "cancelled", "aborted"):
            break
        time.sleep(0.002)
    if final["state"] != "succeeded":
        raise SystemExit(f"run {rec['id']} ended {final['state']}: {final.get('reason')}")
    return {
        "done_ms": (t1 - t0) * 1000,
        "submitted_started_ms": (ts(final.get("started_at")) - ts(final.get("submitted_at"))) * 1000,
        "started_finished_ms": (ts(final.get("finished_at")) - ts(final.get("started_at"))) * 1000,
        "warm": final.get("start") == "warm",
    }


def wait_warm(server: LocalServer, timeout: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = server.client().request("GET", "status")
        if any(z["state"] == "ready" and z["spares"] for z in status["warm_start"]["zygotes"]):
            return status
        time.sleep(0.1)
    raise SystemExit("no zygote became ready")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--cold", action="store_true", help="fresh_interpreter runs (cold starts)")
    args = parser.parse_args()
    configs: list[tuple[str, list[str]]] = [("default", []), ("cgroups off", ["--EvalSchedApp.cgroups=False"])]
    unified = unified_parent()
    if unified is not None:
        configs.append(("v2 only", [f"--EvalSchedApp.cgroup_parent={unified}"]))
    servers: dict[str, LocalServer] = {}
    try:
        for name, extra in configs:
            servers[name] = LocalServer(virtual_gpus="24000,24000", cpu_slots=8, extra_args=extra)
        for name, server in servers.items():
            status = wait_warm(server)
            print(f"{name}: cgroups {status['cgroups']['mode']}: {status['cgroups']['detail']}")
        samples: dict[str, list[dict[str, float]]] = {name: [] for name in servers}
        for i in range(args.warmup + args.rounds):
            for name, server in servers.items():
                sample = one_run(server, args.cold)
                if i >= args.warmup:
                    samples[name].append(sample)
                time.sleep(0.05)  # the spare behind the run is forked and placed, as between a user's runs
        kind = "cold (fresh_interpreter)" if args.cold else "warm"
        print(f"\nOne no-op run, {kind}, submission -> _DONE, {args.rounds} rounds alternating (medians, ms):")
        base = statistics.median(s["done_ms"] for s in samples["default"])
        for name, rows in samples.items():
            done = sorted(s["done_ms"] for s in rows)
            med = statistics.median(done)
            p90 = done[int(0.9 * (len(done) - 1))]
            warm = sum(1 for s in rows if s["warm"])
            print(
                f"  {name:12s} {med:6.2f} (p90 {p90:6.2f}; {med / base:4.2f}x default)  "
                f"submitted->started {statistics.median(s['submitted_started_ms'] for s in rows):5.2f}  "
                f"started->finished {statistics.median(s['started_finished_ms'] for s in rows):5.2f}  "
                f"warm {warm}/{len(rows)}"
            )
    finally:
        for server in servers.values():
            server.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
