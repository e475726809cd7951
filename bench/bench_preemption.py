"""Preemption latency against the episode length, with the idle-GPU latency measured in the same
run as its baseline (these machines are noisy: never compare with a number from another run).

    .venv/bin/python bench/bench_preemption.py [--episode-s 0.05,0.2,0.5,1.0] [--repeats 3] [--quick]

One real ``jupyter server`` with the extension (a :class:`LocalServer`) and one 10000 MB virtual
GPU, preemption allowed at once (``preempt_min_runtime_s=0``, ``preempt_grace_s=60``: no signal
during the measurement). For each episode length L and each repeat:

1. a low-priority run (8000 MB, many episodes of ``sleepy`` sleeping L s) is submitted and waited
   for until it is running and has finished at least one episode, then a further random time in
   [0, L) (``--seed``) passes, so that the high run arrives at a uniform point of an episode
   (without it, it would arrive just after a boundary, and wait a whole episode: ``--no-jitter``);
2. a high-priority run (8000 MB, one episode sleeping 0 s) is submitted: it cannot fit beside
   the low run, so the scheduler writes ``_STOP`` into the low run's directory, the low run stops
   at its next episode boundary, and the high run starts;
3. measured: submitted -> started of the high run, server-side from its record (``started_at -
   submitted_at``), and client-side from ``time.time()`` just before the POST to ``started_at``
   (same host, same clock: the client-side figure adds the POST's own round trip). The low run's
   last episode of its first attempt splits the server-side figure in two: the wait for the
   episode boundary (submitted -> that episode's end) and what follows it (the runner's exit, the
   exit noticed, admission: that episode's end -> started);
4. checked: the low run, once the high run has started, has ``preemptions == 1`` and its last
   history entry is ``preempted`` with ``preempted_by:<high id>`` (it is queued again, or already
   resumed if the high run has ended); then both are cancelled or finish, and the next
   measurement starts with the queue empty.

Baseline, interleaved with the above (one before each preemption measurement): the same high run
submitted to the idle GPU, nothing to preempt. The stop waits for the end of the episode running
when ``_STOP`` appears, and the high run arrives at a uniform point of it, so latency / L is
expected near 0.5 on average (near 1 with ``--no-jitter``) and at most 1 plus the
baseline-sized overhead.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from datetime import datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jupyter_evalsched.client import LocalServer

SLEEPY = "jupyter_evalsched.examples.basic:sleepy"
TERMINAL = ("succeeded", "failed", "cancelled", "aborted")
GPU_MB = 10000
RUN_MB = 8000
START_TIMEOUT_S = 30.0
SERVER_ARGS = [
    "--EvalSchedApp.cancel_grace_s=2.0",
    "--EvalSchedApp.reconcile_interval_s=0.5",
    "--EvalSchedApp.progress_interval_s=0.05",
    "--EvalSchedApp.preempt_min_runtime_s=0",
    "--EvalSchedApp.preempt_grace_s=60",
]


class BenchFailure(Exception):
    """The product did not do what the measurement needs (a run never started, a check failed)."""


def ts(text: str) -> float:
    """An ISO 8601 timestamp of a record (UTC, ``+00:00``) as seconds since the epoch."""
    return datetime.fromisoformat(text).timestamp()


def spec(priority: str, episodes: int, sleep_s: float) -> dict:
    return {
        "entrypoint": SLEEPY,
        "episodes": episodes,
        "params": {"sleep_s": sleep_s},
        "scheduling": {"marginal_vram_mb": RUN_MB, "priority": priority},
    }


def poll(c, run_id: str, ready, what: str, timeout: float = START_TIMEOUT_S, every: float = 0.02) -> dict:
    """Get the record until ``ready(record)``; BenchFailure after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        rec = c.get(run_id)
        if ready(rec):
            return rec
        if rec["state"] in TERMINAL or time.monotonic() > deadline:
            raise BenchFailure(
                f"run {run_id} {what}: not within {timeout:g} s; it is {rec['state']}"
                f" (reason {rec.get('reason')!r}, attempt {rec.get('attempt')}, preemptions {rec.get('preemptions')})"
            )
        time.sleep(every)


def wait_idle(c, timeout: float = START_TIMEOUT_S) -> None:
    """Until nothing is queued or running: every measurement starts clean."""
    deadline = time.monotonic() + timeout
    while True:
        q = c.queue()
        if not q["queued"] and not q["running"]:
            return
        if time.monotonic() > deadline:
            left = [(r["id"], r["state"], r.get("reason")) for r in q["queued"] + q["running"]]
            raise BenchFailure(f"the queue did not empty within {timeout:g} s: {left}")
        time.sleep(0.01)


def finish(c, run_id: str) -> dict:
    """Cancel the run unless it is already terminal, and wait for its end."""
    if c.get(run_id)["state"] not in TERMINAL:
        try:
            c.cancel(run_id)
        except Exception:  # it may have ended in between (409): the wait below says how
            pass
    return poll(c, run_id, lambda r: r["state"] in TERMINAL, "ending after cancel")


def submit_high(c) -> tuple[dict, float]:
    """Submit the high run; its record once started, and the client's clock just before the POST."""
    t_post = time.time()
    high = c.submit(spec("high", 1, 0.0))
    started = poll(c, high["id"], lambda r: r.get("started_at") is not None, "starting (the high run)")
    return started, t_post


def idle_latency(c) -> dict:
    wait_idle(c)
    high, t_post = submit_high(c)
    final = poll(c, high["id"], lambda r: r["state"] in TERMINAL, "ending (the idle high run)")
    if final["state"] != "succeeded":
        raise BenchFailure(f"idle high run {high['id']} ended {final['state']}: {final.get('reason')}")
    return {
        "server": ts(high["started_at"]) - ts(high["submitted_at"]),
        "client": ts(high["started_at"]) - t_post,
        "id": high["id"],
    }


def preemption_latency(c, episode_s: float, delay_s: float) -> dict:
    wait_idle(c)
    episodes = max(60, int(60 / episode_s))  # a minute at least: it never ends on its own in time
    low = c.submit(spec("low", episodes, episode_s))
    if not low.get("preemptible"):
        raise BenchFailure(f"low run {low['id']} is not preemptible: {low}")
    poll(
        c,
        low["id"],
        lambda r: r["state"] == "running" and (r.get("progress") or {}).get("done", 0) >= 1,
        "running with an episode done (the low run)",
        timeout=START_TIMEOUT_S + episode_s,
    )
    time.sleep(delay_s)
    high, t_post = submit_high(c)
    low_now = c.get(low["id"])
    hist = low_now.get("history") or []
    checks = {
        "preemptions": low_now.get("preemptions"),
        "attempt": low_now.get("attempt"),
        "state": low_now["state"],
        "history_reason": hist[-1].get("reason") if hist else None,
    }
    ok = (
        low_now.get("preemptions") == 1
        and bool(hist)
        and hist[-1].get("state") == "preempted"
        and str(hist[-1].get("reason") or "").startswith(f"preempted_by:{high['id']}")
    )
    high_final = poll(c, high["id"], lambda r: r["state"] in TERMINAL, "ending (the preempting high run)")
    low_final = finish(c, low["id"])
    # The boundary the low run stopped at: the end of its first attempt's last episode.
    first = [e for e in c.episodes(low["id"]) if e.get("attempt") == 1]
    last = max(first, key=lambda e: ts(e["finished_at"])) if first else None
    boundary = ts(last["finished_at"]) if last else None
    sub, start = ts(high["submitted_at"]), ts(high["started_at"])
    # How far into its last episode the low run was when the high run was submitted; negative: that
    # episode began after the submission (the runner looked before the _STOP was there).
    phase = None if last is None else sub - ts(last["started_at"])
    return {
        "server": start - sub,
        "client": start - t_post,
        "to_boundary": None if boundary is None else boundary - sub,
        "after_boundary": None if boundary is None else start - boundary,
        "phase": phase,
        "last_episode": None if last is None or boundary is None else boundary - ts(last["started_at"]),
        "delay": delay_s,
        "ok": ok,
        "checks": checks,
        "low": low["id"],
        "high": high["id"],
        "high_state": high_final["state"],
        "low_state": low_final["state"],
        "low_done_attempt1": len(first),
    }


def ms(x: float | None) -> str:
    return "    -" if x is None else f"{x * 1000:7.1f}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--episode-s", default="0.05,0.2,0.5,1.0", help="episode lengths of the low run, comma-separated")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="one repeat of 0.05 and 0.2 s (a smoke check)")
    ap.add_argument("--seed", type=int, default=0, help="of the random delays before the high runs")
    ap.add_argument(
        "--no-jitter", action="store_true", help="submit the high run as soon as an episode is seen done (worst case)"
    )
    ap.add_argument("--verbose", action="store_true", help="print each measurement as it is taken")
    args = ap.parse_args()
    lengths = [0.05, 0.2] if args.quick else [float(x) for x in args.episode_s.split(",") if x.strip()]
    repeats = 1 if args.quick else args.repeats
    rng = random.Random(args.seed)

    idle: list[dict] = []
    results: dict[float, list[dict]] = {L: [] for L in lengths}
    with LocalServer(virtual_gpus=str(GPU_MB), cpu_slots=4, extra_args=SERVER_ARGS) as server:
        c = server.client()
        try:
            for rep in range(repeats):
                for L in lengths:
                    idle.append(idle_latency(c))
                    r = preemption_latency(c, L, 0.0 if args.no_jitter else rng.uniform(0, L))
                    results[L].append(r)
                    if args.verbose:
                        print(
                            f"  rep {rep} L={L:g}s: server {ms(r['server'])} ms, client {ms(r['client'])} ms, "
                            f"delay {ms(r['delay'])} ms, phase {ms(r['phase'])} ms, last episode {ms(r['last_episode'])} ms, "
                            f"to boundary {ms(r['to_boundary'])} ms, after {ms(r['after_boundary'])} ms; "
                            f"low {r['low']} high {r['high']} {r['checks']}"
                        )
        except BenchFailure as exc:
            print(f"FAILED: {exc}", file=sys.stderr)
            print(f"the server log, last lines:\n{server.log_tail(40)}", file=sys.stderr)
            return 1

    base = statistics.median(x["server"] for x in idle)
    base_client = statistics.median(x["client"] for x in idle)
    print(f"preemption latency: high run submitted -> started, {GPU_MB} MB virtual GPU, {RUN_MB} MB runs")
    print(
        f"{repeats} repeat(s) per episode length; the baseline interleaved, one before each preemption; "
        + (
            "high runs sent as soon as an episode is seen done (--no-jitter)\n"
            if args.no_jitter
            else f"high runs sent after a random delay in [0, L) (seed {args.seed})\n"
        )
    )
    print(
        f"idle GPU baseline (nothing to preempt), n={len(idle)}: server median {ms(base)} ms, "
        f"max {ms(max(x['server'] for x in idle))} ms; client median {ms(base_client)} ms\n"
    )
    print("server-side (record started_at - submitted_at), ms; ratios to the episode length L")
    header = (
        f"{'L (s)':>6} {'n':>2} {'median':>8} {'max':>8} {'med/L':>6} {'max/L':>6} {'med-base':>9}"
        f" {'client med':>10} {'to bound.':>9} {'after b.':>8} {'preempt ok':>10}"
    )
    print(header)
    print("-" * len(header))
    failed_checks = []
    for L, rs in results.items():
        server_s = [r["server"] for r in rs]
        med, top = statistics.median(server_s), max(server_s)
        to_b = [r["to_boundary"] for r in rs if r["to_boundary"] is not None]
        after_b = [r["after_boundary"] for r in rs if r["after_boundary"] is not None]
        oks = sum(r["ok"] for r in rs)
        failed_checks += [r for r in rs if not r["ok"]]
        print(
            f"{L:6.2f} {len(rs):2d} {ms(med):>8} {ms(top):>8} {med / L:6.2f} {top / L:6.2f} {ms(med - base):>9}"
            f" {ms(statistics.median(r['client'] for r in rs)):>10}"
            f" {ms(statistics.median(to_b) if to_b else None):>9} {ms(statistics.median(after_b) if after_b else None):>8}"
            f" {oks:>4d}/{len(rs):<5d}"
        )
    all_ratios = [r["server"] / L for L, rs in results.items() for r in rs]
    print(
        f"\nlatency / L over all {len(all_ratios)} measurements: mean {statistics.fmean(all_ratios):.2f} "
        f"(expected ~{1.0 if args.no_jitter else 0.5}), max {max(all_ratios):.2f} (expected <= 1 + baseline/L)"
    )
    over = [(L, r) for L, rs in results.items() for r in rs if r["server"] > L]
    print(f"latencies above one episode length: {len(over)} of {len(all_ratios)}")
    for L, r in over:
        print(
            f"   L={L:g}s low {r['low']} high {r['high']}: {ms(r['server'])} ms = {ms(r['to_boundary'])} ms to the boundary"
            f" (submitted {ms(r['phase'])} ms into an episode that took {ms(r['last_episode'])} ms)"
            f" + {ms(r['after_boundary'])} ms after it"
        )
    late = [r for rs in results.values() for r in rs if r["phase"] is not None and r["phase"] < 0]
    print(
        f"episodes begun after the high run's submission (the _STOP not yet there when the runner looked): "
        f"{len(late)} of {len(all_ratios)}" + "".join(f"\n   low {r['low']}: {ms(-r['phase'])} ms after" for r in late)
    )
    after_all = [r["after_boundary"] for rs in results.values() for r in rs if r["after_boundary"] is not None]
    if after_all:
        print(
            f"after the boundary (runner exit, exit noticed, admission): median {ms(statistics.median(after_all))} ms, "
            f"max {ms(max(after_all))} ms; ratio to the idle baseline (median) "
            f"{statistics.median(after_all) / base:.1f}x"
        )
    if failed_checks:
        for r in failed_checks:
            print(f"CHECK FAILED: low run {r['low']} after high run {r['high']} started: {r['checks']}")
        return 1
    print("check: every preempted low run had preemptions == 1 (preempted_by the high run) once the high run started")
    return 0


if __name__ == "__main__":
    sys.exit(main())
