"""Issue #7, slow part: repeated ``kill -9`` of the server, 2,000 concurrent submissions, and
schemathesis fuzzing of the generated OpenAPI document. Each test prints its figures.

Run with ``pytest -m slow tests/test_stress.py -s`` (``-s`` shows the figures). Every test uses
a real ``jupyter server`` subprocess (LocalServer) so that it can be killed and so that blocking
clients in threads do not share the server's event loop.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from collections import defaultdict
from datetime import datetime
from pathlib import Path

import psutil
import pytest
from live_server import wait_until
from proc_status import alive

from jupyter_evalsched.client import EvalSchedError, LocalServer
from jupyter_evalsched.schemas import is_valid_run_id

pytestmark = pytest.mark.slow

SLEEPY = "jupyter_evalsched.examples.basic:sleepy"
NOOP = "jupyter_evalsched.examples.basic:noop"
TERMINAL = {"succeeded", "failed", "cancelled", "aborted"}
FAST = [
    "--EvalSchedApp.cancel_grace_s=2.0",
    "--EvalSchedApp.reconcile_interval_s=0.5",
    "--EvalSchedApp.progress_interval_s=0.05",
]


def run_dirs(runs: Path) -> list[str]:
    return sorted(p.name for p in runs.iterdir() if p.is_dir() and is_valid_run_id(p.name))


def ts(text: str) -> float:
    return datetime.fromisoformat(text).timestamp()


# ----------------------------------------------------------------------------- kill -9 of the server


def long_spec(vram: int, **kw) -> dict:
    # cwd "/" outlives every server (a LocalServer's own root_dir is removed with it).
    spec = {
        "entrypoint": SLEEPY,
        "episodes": 3000,
        "params": {"sleep_s": 0.1},
        "cwd": "/",
        "scheduling": {"marginal_vram_mb": vram},
    }
    spec.update(kw)
    return spec


def burst_spec(i: int) -> dict:
    return {
        "entrypoint": NOOP,
        "name": f"burst-{i}",
        "cwd": "/",
        "scheduling": {"marginal_vram_mb": 24000, "priority": "low"},
    }


class Burst:
    """Threads submitting as fast as they can until the server stops answering; each records,
    in order, the ids it got a 201 for."""

    def __init__(self, server: LocalServer, threads: int):
        self.server = server
        self.acked: list[list[str]] = [[] for _ in range(threads)]
        self.errors: list[str] = []
        self._threads = [threading.Thread(target=self._work, args=(k,), daemon=True) for k in range(threads)]

    def start(self):
        for t in self._threads:
            t.start()

    def _work(self, k: int) -> None:
        c = self.server.client(timeout=10)
        i = 0
        while True:
            try:
                rec = c.submit(burst_spec(k * 100000 + i))
            except EvalSchedError as exc:
                self.errors.append(f"HTTP {exc.status}: {exc}")  # an answer that is not a 201 is a failure
                return
            except Exception:
                return  # the server is gone: connection refused or reset
            self.acked[k].append(rec["id"])
            i += 1

    def join(self):
        for t in self._threads:
            t.join(15)
        assert not any(t.is_alive() for t in self._threads)

    @property
    def count(self) -> int:
        return sum(len(a) for a in self.acked)


def test_repeated_kill_9_of_the_server_loses_nothing(tmp_path):
    """Four kill -9 of the server in a row with runs running (one with worker processes) and
    runs queued, the last one in the middle of a submission burst from 6 threads: every run
    process is gone within 1 s, every interrupted run comes back aborted with a reason, every
    queued run is queued again in its order, every 201 exists once (listing and directory)."""
    runs = tmp_path / "runs"
    acked: list[str] = []  # every id that got a 201, in submission order (per client)
    aborted_expected: set[str] = set()
    kills = 0
    figures = {"kills": 0, "runs_interrupted": 0, "queued_restored": 0, "burst_acked": 0, "burst_unacked_found": 0}

    startup_gaps: list[str] = []
    pre_queue: list[str] = []  # the admission order seen just before the previous kill
    pre_running: list[str] = []
    burst: Burst | None = None
    for cycle in range(5):
        server = LocalServer(virtual_gpus="24000", cpu_slots=4, runs_dir=str(runs), extra_args=FAST)
        try:
            c = server.client()
            # ---- recovery of the previous cycle
            if cycle > 0:
                # Once the server answers, it must know every run (recovery is part of start-up).
                known = {r["id"] for r in c.list(limit=100000)}
                if set(acked) - known:
                    startup_gaps.append(
                        f"restart {cycle}: {len(set(acked) - known)} of {len(acked)} acknowledged runs "
                        f"were unknown (GET /runs listed {len(known)}) when the server first answered"
                    )
                wait_until(lambda: len(c.list(limit=100000)) >= len(acked), timeout=30)
                for rid in pre_running:
                    try:
                        rec = c.get(rid)
                    except EvalSchedError as exc:
                        d = runs / rid
                        files = (
                            {p.name: p.read_text()[:300] for p in d.iterdir() if p.name.endswith(".json")}
                            if d.exists()
                            else None
                        )
                        raise AssertionError(
                            f"cycle {cycle}: interrupted run {rid} lost after the restart ({exc}); "
                            f"its directory: {files}; server log:\n{server.log_tail(15)}"
                        ) from None
                    assert rec["state"] == "aborted" and rec["reason"].startswith("server_restart:"), rec
                    assert (runs / rid / "_DONE").exists()
                # (The head is `queued` with reason `starting` until its process and its running
                # record exist: wait for that, then read the queue.)
                wait_until(lambda: pre_queue[0] in {r["id"] for r in c.queue()["running"]}, timeout=30)
                view = c.queue()
                running_now = {r["id"] for r in view["running"]}
                queued_now = [r["id"] for r in view["queued"]]
                # The head of the old queue took the freed GPU; the rest keep their order.
                assert pre_queue[0] in running_now, (pre_queue[:3], running_now)
                normal_now = [q for q in queued_now if not c.get(q)["name"].startswith("burst-")]
                assert normal_now == pre_queue[1:], "queued runs did not come back in their order"
                figures["queued_restored"] += len(pre_queue)
                if burst is not None:
                    # Every 201 of the burst exists once, queued behind the normal lane, and each
                    # client's submissions keep that client's order.
                    burst_now = [q for q in queued_now if c.get(q)["name"].startswith("burst-")]
                    for mine in burst.acked:
                        pos = [burst_now.index(x) for x in mine]
                        assert pos == sorted(pos), "a client's burst submissions came back out of order"
                    assert set(sum(burst.acked, [])) <= set(burst_now), "a burst submission that got a 201 is missing"
                    figures["burst_unacked_found"] = len(set(burst_now) - set(sum(burst.acked, [])))
                    acked.extend(sorted(set(burst_now) - set(sum(burst.acked, []))))  # accepted, answer lost
                    burst = None
                listing = c.list(limit=100000)
                ids = [r["id"] for r in listing]
                assert len(ids) == len(set(ids)), "a run is listed twice"
                assert set(ids) == set(acked), (set(acked) - set(ids), set(ids) - set(acked))
                assert run_dirs(runs) == sorted(acked)
                assert not [p for p in runs.iterdir() if p.name.startswith(".staging-")]
                for r in listing:
                    if r["id"] in aborted_expected:
                        assert r["state"] == "aborted"
            if cycle == 4:
                # The last server: cancel what is left, then every run directory is final.
                view = c.queue()
                for r in view["queued"] + view["running"]:
                    c.cancel(r["id"])
                listing = wait_until(
                    lambda: (lambda runs: runs if all(r["state"] in TERMINAL for r in runs) else None)(
                        c.list(limit=100000)
                    ),
                    timeout=30,
                )
                assert len(listing) == len(acked) == len(set(acked))
                counts = defaultdict(int)
                for r in listing:
                    counts[r["state"]] += 1
                    assert (runs / r["id"] / "_DONE").exists()
                assert counts["aborted"] == len(aborted_expected), dict(counts)
                break

            # ---- this cycle's work: two CPU runs (one with 2 worker processes) and GPU runs that queue
            new = [c.submit(long_spec(0, workers=2, episodes=6000)), c.submit(long_spec(0))]
            new += [c.submit(long_spec(24000)) for _ in range(4)]
            acked.extend(r["id"] for r in new)
            wait_until(lambda: all(c.get(r["id"])["state"] == "running" for r in new[:2]), timeout=20)
            # Running with their processes there (a run is "running" a moment before its pid is
            # known: its cgroup is made, or the zygote answers, meanwhile).
            view = wait_until(
                lambda: (lambda v: v if len(v["running"]) == 3 and all(r["pid"] for r in v["running"]) else None)(
                    c.queue()
                ),
                timeout=20,
            )
            pre_running = [r["id"] for r in view["running"]]
            pre_queue = [r["id"] for r in view["queued"]]
            assert len(pre_queue) >= 3 and all(r["state"] == "running" for r in view["running"])
            # Let the run processes get going (workers forked, episodes written).
            wait_until(lambda: all(c.get(r)["progress"]["done"] >= 1 for r in pre_running), timeout=20)
            pids = set()
            for r in view["running"]:
                proc = psutil.Process(r["pid"])
                pids.add(proc.pid)
                pids.update(ch.pid for ch in proc.children(recursive=True))
            assert len(pids) >= 5, f"expected 3 runs and 2 workers, found {len(pids)} processes"

            if cycle == 3:  # the last kill lands in the middle of a submission burst
                burst = Burst(server, threads=6)
                burst.start()
                wait_until(lambda: burst.count >= 200, timeout=30)

            server.process.send_signal(signal.SIGKILL)
            t0 = time.monotonic()
            wait_until(lambda: not any(alive(p) for p in pids), timeout=5, interval=0.005)
            gone_after = time.monotonic() - t0
            server.process.wait()
            kills += 1
            assert gone_after < 1.0, f"run processes outlived the server by {gone_after:.2f} s"
            figures["max_ms_until_runs_gone"] = max(figures.get("max_ms_until_runs_gone", 0), round(gone_after * 1000))
            figures["processes_killed"] = figures.get("processes_killed", 0) + len(pids)
            figures["runs_interrupted"] += len(pre_running)
            aborted_expected.update(pre_running)
            if burst is not None:
                burst.join()
                assert not burst.errors, burst.errors[:5]
                acked.extend(sum(burst.acked, []))
                figures["burst_acked"] = burst.count
                assert burst.count >= 200
        finally:
            server.cleanup()

    figures.update(kills=kills, submissions=len(acked), final_states=dict(counts))
    print(f"\nkill -9 figures: {json.dumps(figures)}")
    assert kills == 4
    assert not startup_gaps, "\n".join(startup_gaps)


# ----------------------------------------------------------------------------- load


VRAMS = [0, 4000, 8000, 16000, 24000]
N_SUBMISSIONS = 2000
N_CLIENTS = 16


def load_spec(k: int, i: int) -> dict:
    n = k * 1000 + i
    vram = VRAMS[n % len(VRAMS)]
    sched = {"marginal_vram_mb": vram, "exclusive_gpu": n % 9 == 4}
    if n % 23 == 0:
        sched["cpus"] = 2
    return {"entrypoint": NOOP, "name": f"load-{k}-{i}", "episodes": 1, "cwd": "/", "scheduling": sched}


def test_2000_submissions_from_16_clients(tmp_path):
    runs = tmp_path / "runs"
    usable, cpu_slots = 24000, 8
    server = LocalServer(virtual_gpus="24000,24000", cpu_slots=cpu_slots, runs_dir=str(runs), extra_args=FAST)
    try:
        per_client = N_SUBMISSIONS // N_CLIENTS
        acked: list[list[str]] = [[] for _ in range(N_CLIENTS)]
        errors: list[str] = []
        latencies: list[float] = []
        lock = threading.Lock()

        def client_thread(k: int) -> None:
            c = server.client(timeout=60)
            for i in range(per_client):
                t0 = time.perf_counter()
                try:
                    rec = c.submit(load_spec(k, i))
                except Exception as exc:
                    errors.append(f"client {k} #{i}: {exc!r}")
                    continue
                with lock:
                    latencies.append(time.perf_counter() - t0)
                acked[k].append(rec["id"])

        t_start = time.monotonic()
        threads = [threading.Thread(target=client_thread, args=(k,)) for k in range(N_CLIENTS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        t_submitted = time.monotonic() - t_start
        assert not errors, errors[:5]
        all_ids = sum(acked, [])
        assert len(all_ids) == N_SUBMISSIONS and len(set(all_ids)) == N_SUBMISSIONS

        c = server.client(timeout=60)

        def drained():
            v = c.queue()
            return not v["queued"] and not v["running"]

        wait_until(drained, timeout=240, interval=0.5, message="the 2,000 runs did not all finish in 240 s")
        t_done = time.monotonic() - t_start
        listing = c.list(limit=100000)
        assert len(listing) == N_SUBMISSIONS, "GET /runs does not list every acknowledged run exactly once"
        assert sorted(r["id"] for r in listing) == sorted(all_ids)
        not_ok = [(r["id"], r["state"], r["reason"]) for r in listing if r["state"] != "succeeded"]
        assert not not_ok, not_ok[:10]
    finally:
        server.cleanup()

    # ---- from the files, not from the scheduler's word
    assert run_dirs(runs) == sorted(all_ids)
    jobs = {}
    problems = []
    for rid in all_ids:
        d = runs / rid
        job = json.loads((d / "job.json").read_text())
        spec = json.loads((d / "spec.json").read_text())
        lines = (d / "episodes.jsonl").read_text().splitlines()
        if job["state"] != "succeeded" or not (d / "_DONE").exists():
            problems.append(f"{rid}: {job['state']}")
        if len(lines) != spec["episodes"]:
            problems.append(f"{rid}: {len(lines)} episode lines for {spec['episodes']} episodes (ran twice?)")
        workers = {json.loads(x)["worker"] for x in lines}
        if workers != {job["pid"]}:
            problems.append(f"{rid}: episodes by {workers}, runner pid {job['pid']}")
        sched = spec["scheduling"]
        uses_gpu = sched["marginal_vram_mb"] > 0 or sched["exclusive_gpu"]
        if len(job["devices"]) != (1 if uses_gpu else 0):
            problems.append(f"{rid}: devices {job['devices']} for {sched}")
        jobs[rid] = (
            ts(job["started_at"]),
            ts(job["finished_at"]),
            job["devices"],
            sched["marginal_vram_mb"],
            sched["exclusive_gpu"],
            sched["cpus"],
        )
    assert not problems, problems[:10]

    # The ledger invariant at every admission: at each start, the runs holding a device (those
    # started before and not yet finished) sum to at most its usable memory, and an exclusive run
    # shares its device with nobody; the CPU slots likewise.
    violations = []
    items = list(jobs.items())
    by_device = defaultdict(list)
    for rid, j in items:
        for dev in j[2]:
            by_device[dev].append((rid, j))
    max_alloc = defaultdict(int)
    max_cpu = 0
    for rid, (start, _finish, devs, _vram, _excl, _cpus) in items:
        holding = [(o, oj) for o, oj in items if oj[0] <= start < oj[1]]
        cpu_in_use = sum(oj[5] for _, oj in holding)
        max_cpu = max(max_cpu, cpu_in_use)
        if cpu_in_use > cpu_slots:
            violations.append(f"{rid} started with {cpu_in_use} CPU slots in use")
        for dev in devs:
            on_dev = [(o, oj) for o, oj in holding if dev in oj[2]]
            alloc = sum(usable if oj[4] else oj[3] for _, oj in on_dev)
            max_alloc[dev] = max(max_alloc[dev], alloc)
            if alloc > usable:
                violations.append(f"{rid} started on GPU {dev} with {alloc} MB allocated: {[o for o, _ in on_dev]}")
            if any(oj[4] for _, oj in on_dev) and len(on_dev) > 1:
                violations.append(f"{rid} started on GPU {dev} sharing with an exclusive run: {[o for o, _ in on_dev]}")
    assert not violations, violations[:10]
    assert set(by_device) == {0, 1}, "both GPUs should have been used"

    latencies.sort()
    print(
        f"\nload figures: submissions={N_SUBMISSIONS} clients={N_CLIENTS} acked={len(all_ids)} "
        f"submit_phase={t_submitted:.1f}s ({N_SUBMISSIONS / t_submitted:.0f}/s) "
        f"p50={latencies[len(latencies) // 2] * 1000:.1f}ms p99={latencies[int(len(latencies) * 0.99)] * 1000:.1f}ms "
        f"all_done={t_done:.1f}s succeeded={len(jobs)} max_alloc={dict(max_alloc)} max_cpu={max_cpu} "
        f"runs_per_gpu={ {d: len(v) for d, v in by_device.items()} }"
    )


# ----------------------------------------------------------------------------- schemathesis


def test_schemathesis_finds_no_5xx(tmp_path):
    """Generated requests (valid and invalid) against every operation of the generated OpenAPI
    document: no answer is a 5xx; afterwards the runs directory holds only run directories."""
    import requests
    import schemathesis
    from hypothesis import HealthCheck, Phase, given, settings
    from schemathesis import GenerationMode

    runs = tmp_path / "runs"
    server = LocalServer(virtual_gpus="24000", cpu_slots=2, runs_dir=str(runs), extra_args=FAST)
    try:
        auth = {"Authorization": f"token {server.token}"}
        schema = schemathesis.openapi.from_url(server.url + "evalsched/openapi.json", headers=auth)
        base_url = server.url + "evalsched"
        session = requests.Session()
        tried = defaultdict(int)
        statuses = defaultdict(lambda: defaultdict(int))
        failures: list[str] = []
        samples: dict = {}
        # The destructive operations (cancel, delete) last, so that the real runs are still
        # there for the read operations.
        operations = sorted(
            (result.ok() for result in schema.get_all_operations()),
            key=lambda op: (op.method.upper() == "DELETE" or op.path.endswith("/cancel"), op.label),
        )
        assert len(operations) >= 10, [op.label for op in operations]

        # Real runs, so that the run endpoints are fuzzed past the 404 too (query parameters,
        # cancel and delete of a running and of a finished run).
        c = server.client()
        finished = c.submit({"entrypoint": SLEEPY, "episodes": 3, "params": {"sleep_s": 0.01}, "cwd": "/"})
        running = c.submit({"entrypoint": SLEEPY, "episodes": 100000, "params": {"sleep_s": 0.1}, "cwd": "/"})
        wait_until(
            lambda: c.get(finished["id"])["state"] == "succeeded" and c.get(running["id"])["state"] == "running",
            timeout=20,
        )

        def fuzz(op, strategy, examples, label):
            @settings(
                max_examples=examples,
                deadline=None,
                database=None,
                derandomize=True,
                suppress_health_check=list(HealthCheck),
                phases=[Phase.explicit, Phase.generate],
            )
            @given(case=strategy)
            def check(case):
                try:
                    resp = case.call(base_url=base_url, session=session, headers=auth, timeout=20)
                except requests.exceptions.InvalidHeader:
                    return  # requests refuses to send it: the server never sees it
                tried[label] += 1
                statuses[label][resp.status_code] += 1
                samples.setdefault((label, resp.status_code), resp.text[:160])
                if resp.status_code >= 500:
                    failures.append(
                        f"{label} -> {resp.status_code}: {case.as_curl_command(headers=auth)} :: {resp.text[:300]}"
                    )

            check()

        for op in operations:
            for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
                fuzz(op, op.as_strategy(generation_mode=mode), 60, op.label)
                if "{run_id}" in op.path:
                    for rid in (finished["id"], running["id"]):
                        fuzz(
                            op,
                            op.as_strategy(generation_mode=mode, path_parameters={"run_id": rid}),
                            25,
                            op.label + " (real id)",
                        )
        # The server is still up and answers normally.
        assert isinstance(c.queue()["queued"], list)
        total = sum(tried.values())
        print(
            f"\nschemathesis figures: cases={total} operations={len(operations)} "
            + " ".join(f"{k}={v}" for k, v in sorted(tried.items()))
        )
        print("status codes: " + json.dumps({k: dict(v) for k, v in statuses.items()}))
        print("403 samples: " + json.dumps({f"{k[0]}": v for k, v in samples.items() if k[1] == 403}))
        assert not failures, "\n".join(failures[:10])
        assert total >= 1000
        # Nothing but run directories in the runs directory.
        strays = [
            p.name
            for p in runs.iterdir()
            if not p.name.startswith(".evalsched-primary")
            and not (p.is_dir() and not p.is_symlink() and is_valid_run_id(p.name))
        ]
        assert not strays, strays
    finally:
        server.cleanup()


# ----------------------------------------------------------------------------- preemption churn


def test_preemption_and_retry_churn_loses_and_doubles_no_episode(tmp_path):
    """Low preemptible runs (some with workers, some crashing once and retried) filling two GPUs
    while high runs keep arriving: every run succeeds, every episode index is in its
    episodes.jsonl exactly once, scores equal an uninterrupted run's, no run is preempted beyond
    the limit, and the ledger is never overcommitted."""
    from jupyter_evalsched.examples.basic import _unit_float

    runs = tmp_path / "runs"
    extra = [
        *FAST,
        "--EvalSchedApp.preempt_min_runtime_s=0.2",
        "--EvalSchedApp.preempt_grace_s=10",
        "--EvalSchedApp.retry_backoff_s=0.1",
    ]
    server = LocalServer(virtual_gpus="16000,16000", runs_dir=str(runs), cpu_slots=8, extra_args=extra)
    overcommits: list[dict] = []
    stop = threading.Event()

    def watch_ledger(client) -> None:
        while not stop.is_set():
            try:
                for dev in client.ledger()["devices"]:
                    if dev["allocated_mb"] > dev["usable_mb"]:
                        overcommits.append(dev)
            except EvalSchedError:
                pass
            time.sleep(0.02)

    try:
        c = server.client()
        watcher = threading.Thread(target=watch_ledger, args=(server.client(),), daemon=True)
        watcher.start()
        low = []
        for i in range(8):
            spec = {
                "entrypoint": SLEEPY,
                "episodes": 40,
                "seed": 1000 * i,
                "workers": 1 + i % 2,
                "params": {"sleep_s": 0.03},
                "cwd": "/",
                "scheduling": {"marginal_vram_mb": 8000, "priority": "low"},
            }
            low.append(c.submit(spec))
        crashing = [
            c.submit(
                {
                    "entrypoint": "jupyter_evalsched.examples.basic:crash",
                    "episodes": 20,
                    "params": {"how": "sigkill", "at": 7, "until_attempt": 1, "sleep_s": 0.03},
                    "retries": 1,
                    "cwd": "/",
                    # Not preemptible: a preemption before episode 7 would make attempt 2 the one
                    # that reaches it, which does not crash (and no retry would be used).
                    "scheduling": {"marginal_vram_mb": 8000, "priority": "low", "preemptible": False},
                }
            )
            for _ in range(2)
        ]
        high = []
        for i in range(10):
            time.sleep(0.3)
            high.append(
                c.submit(
                    {
                        "entrypoint": SLEEPY,
                        "episodes": 3,
                        "seed": 7 + i,
                        "params": {"sleep_s": 0.05},
                        "cwd": "/",
                        "scheduling": {"marginal_vram_mb": 8000, "priority": "high"},
                    }
                )
            )
        everything = low + crashing + high
        finals = {
            r["id"]: wait_until(
                lambda r=r: (lambda x: x if x["state"] in TERMINAL else None)(c.get(r["id"])), timeout=300
            )
            for r in everything
        }
        stop.set()
        watcher.join(timeout=5)
    finally:
        stop.set()
        server.cleanup()

    bad = {k: v for k, v in finals.items() if v["state"] != "succeeded"}
    if bad:
        Path("/tmp/churn_fail.json").write_text(json.dumps(bad, indent=1))
    assert {f["state"] for f in finals.values()} == {"succeeded"}, [
        (json.dumps(v), (runs / k / "stderr.log").read_text()[-1500:])
        for k, v in finals.items()
        if v["state"] != "succeeded"
    ]
    preemptions = sum(f["preemptions"] for f in finals.values())
    for rec in everything:
        final = finals[rec["id"]]
        lines = [json.loads(x) for x in (runs / rec["id"] / "episodes.jsonl").read_text().splitlines()]
        total = final["progress"]["total"]
        assert sorted(e["index"] for e in lines) == list(range(total)), rec["id"]
        assert final["preemptions"] <= 3 and (runs / rec["id"] / "_DONE").exists()
        assert not (runs / rec["id"] / "_STOP").exists()
        if rec in low:
            seed = 1000 * low.index(rec)
            expected = sum(_unit_float(seed + i) for i in range(total)) / total
            assert abs(final["metrics"]["score"]["mean"] - expected) < 1e-9
    assert all(f["preemptions"] == 0 for f in (finals[r["id"]] for r in high))
    assert all(finals[r["id"]]["retries_used"] == 1 for r in crashing)
    assert not overcommits, overcommits[:3]
    assert preemptions > 0, "the high runs never preempted anything"
    print(f"\npreemption churn: {len(everything)} runs, {preemptions} preemptions, all succeeded, no episode twice")
