"""The scheduler inside a real Jupyter server: admission, run processes, ends of runs, files.

Tests are plain ``async def`` (no asyncio mark): pytest-jupyter runs them on the server's loop.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import psutil
import pytest
from proc_status import alive, ignores_signal
from rest import CRASH, NOOP, spec, submit
from tornado.httpclient import HTTPClientError
from waiting import async_wait_until


@pytest.fixture
def evalsched_config():
    return {"virtual_gpus": [24000]}


def ledger_total(evalsched) -> int:
    return max(d["allocated_mb"] for d in evalsched.ledger()["devices"])


async def test_two_big_runs_share_one_gpu_in_turn(api, wait_for, evalsched, runs_dir):
    """16000 + 16000 MB on a 24000 MB GPU: the second waits with a reason, starts within
    100 ms of the first finishing, and the ledger never shows more than 24000 MB."""
    seen_max = 0

    def watch(_event):
        nonlocal seen_max
        seen_max = max(seen_max, ledger_total(evalsched))

    evalsched.subscribe(watch)
    a = await submit(api, spec(vram=16000, episodes=4, sleep_s=0.1))
    b = await submit(api, spec(vram=16000, episodes=1, sleep_s=0.01))

    async def b_decided():  # admission has considered b: it waits with a reason
        code, queue = await api("GET", "queue")
        # (and a is running: starting, it is listed first among the queued)
        decided = code == 200 and any(r["reason"] for r in queue["queued"]) and queue["running"]
        return queue if decided else None

    queue = await async_wait_until(b_decided, message="b never got a reason")
    assert [r["id"] for r in queue["queued"]] == [b["id"]]
    assert queue["queued"][0]["reason"] == "waiting_vram: needs 16000 MB on 1 GPU; most free is 8000 MB (GPU 0)"
    assert [r["id"] for r in queue["running"]] == [a["id"]]
    dev = queue["ledger"]["devices"][0]
    assert (dev["allocated_mb"], dev["free_mb"], dev["runs"]) == (
        16000,
        8000,
        [{"id": a["id"], "marginal_vram_mb": 16000}],
    )

    ra = await wait_for(a["id"])
    rb = await wait_for(b["id"])
    assert ra["state"] == rb["state"] == "succeeded"
    # The second run's admission follows the first's exit: job.json records both times.
    job_a = json.loads((runs_dir / a["id"] / "job.json").read_text())
    job_b = json.loads((runs_dir / b["id"] / "job.json").read_text())
    from datetime import datetime

    gap = datetime.fromisoformat(job_b["started_at"]) - datetime.fromisoformat(job_a["finished_at"])
    assert gap.total_seconds() < 0.1, gap
    assert seen_max <= 24000
    evalsched.unsubscribe(watch)


async def test_a_submission_to_an_idle_scheduler_starts_before_it_is_answered(api, wait_for, evalsched):
    """Nothing queued: the newcomer outranks nobody, so it is decided alone inside its own
    submission, and its start begins before the answer is written (not a loop iteration later,
    behind the answer). Then again while runs are queued behind a dependency: they are not
    candidates either."""
    code, rec = await api("POST", "runs", spec(entry=NOOP))
    assert code == 201
    assert (rec["state"], (rec["why"] or {}).get("code")) == ("queued", "starting"), rec
    assert (await wait_for(rec["id"]))["state"] == "succeeded"

    hold = await submit(api, spec(entry="jupyter_evalsched.examples.basic:sleepy", params={"sleep_s": 30}))
    await wait_for(hold["id"], states=("running",))
    held = await submit(api, {**spec(entry=NOOP), "depends_on": [hold["id"]]})
    assert held["why"]["code"] != "starting"
    code, rec = await api("POST", "runs", spec(entry=NOOP))
    assert (rec["state"], (rec["why"] or {}).get("code")) == ("queued", "starting"), rec
    assert (await wait_for(rec["id"]))["state"] == "succeeded"
    await api("POST", f"runs/{hold['id']}/cancel")


async def test_a_newcomer_that_waits_becomes_the_head_that_others_may_outrank(api, wait_for, evalsched, monkeypatch):
    """Decided alone, a newcomer that cannot start waits at the head of an otherwise empty
    queue: a later newcomer of a higher lane outranks it and goes to a full decision (which may
    reserve for the head), one of its lane or lower is still decided alone."""
    slots = evalsched.config.cpu_slots
    hold = await submit(api, spec(entry="jupyter_evalsched.examples.basic:sleepy", params={"sleep_s": 30}))
    await wait_for(hold["id"], states=("running",))
    admission = evalsched.admission
    alone: list[str] = []
    full: list[bool] = []
    decide_alone, ask_for_a_decision = admission._admit_new, admission.request_admission

    def admit_new(run):
        alone.append(run.id)
        decide_alone(run)

    def request_admission():
        full.append(True)
        ask_for_a_decision()

    monkeypatch.setattr(admission, "_admit_new", admit_new)
    monkeypatch.setattr(admission, "request_admission", request_admission)
    # Each takes every CPU slot: none can start while the sleeper holds one.
    waiting = await submit(api, spec(entry=NOOP, scheduling={"cpus": slots}))
    assert waiting["state"] == "queued" and alone == [waiting["id"]] and not full
    low = await submit(api, spec(entry=NOOP, scheduling={"cpus": slots, "priority": "low"}))
    assert alone == [waiting["id"], low["id"]] and not full
    high = await submit(api, spec(entry=NOOP, scheduling={"cpus": slots, "priority": "high"}))
    assert high["id"] not in alone and full
    await api("POST", f"runs/{hold['id']}/cancel")
    for rec in (waiting, low, high):
        assert (await wait_for(rec["id"]))["state"] == "succeeded"


async def test_a_newcomer_started_alone_passes_over_only_the_runs_ahead_of_it(api, wait_for, evalsched):
    """What anti-starvation counts when a newcomer decided alone starts: the waiting runs a full
    decision would count as passed over (ahead of it in admission order), not one of a lower
    lane (behind it) nor one a dependency holds (not a candidate)."""
    slots = evalsched.config.cpu_slots
    hold = await submit(api, spec(entry="jupyter_evalsched.examples.basic:sleepy", params={"sleep_s": 30}))
    await wait_for(hold["id"], states=("running",))
    held = await submit(api, {**spec(entry=NOOP), "depends_on": [hold["id"]]})
    # Each takes every CPU slot: neither can start while the sleeper holds one.
    ahead = await submit(api, spec(entry=NOOP, scheduling={"cpus": slots}))
    behind = await submit(api, spec(entry=NOOP, scheduling={"cpus": slots, "priority": "low"}))
    newcomer = await submit(api, spec(entry=NOOP, scheduling={"cpus": 0}))  # (takes no slot: starts)
    assert newcomer["why"]["code"] == "starting", newcomer
    passes = {
        name: evalsched.table.get(rec["id"]).passed_over
        for name, rec in [("ahead", ahead), ("behind", behind), ("held", held)]
    }
    assert passes == {"ahead": 1, "behind": 0, "held": 0}
    await api("POST", f"runs/{hold['id']}/cancel")
    for rec in (newcomer, ahead, behind, held):
        await wait_for(rec["id"])


async def test_a_bug_in_starting_a_run_does_not_fail_its_submission(api, wait_for, evalsched, monkeypatch):
    """The start of a run decided in its own submission begins inside the request: a bug of ours
    there is logged, and the submission, on disk already, is answered 201 and stays queued."""

    def broken(run, devices):
        raise RuntimeError("a bug in the start")

    monkeypatch.setattr(evalsched.admission, "_launch", broken)
    code, rec = await api("POST", "runs", spec(entry=NOOP))
    assert code == 201 and rec["state"] == "queued", rec
    monkeypatch.undo()
    evalsched.admission.reconcile()  # (the periodic backstop's decision)
    assert (await wait_for(rec["id"]))["state"] == "succeeded"


async def test_a_bug_in_launching_a_run_fails_it_with_the_reason_and_frees_what_it_took(
    api, wait_for, evalsched, monkeypatch
):
    """Past admission (the run taken off the queue, its resources counted), a bug of ours in the
    launch fails the run with what went wrong, and what it took goes to the next."""
    carrier = type(evalsched.admission.carrier)
    real = carrier.launch

    def broken(self, run, devices):
        raise RuntimeError("a bug in the launch")

    monkeypatch.setattr(carrier, "launch", broken)
    everything = {"cpus": evalsched.config.cpu_slots}
    code, rec = await api("POST", "runs", spec(entry=NOOP, scheduling=everything))
    assert code == 201, rec
    failed = await wait_for(rec["id"])
    assert failed["state"] == "failed", failed
    assert failed["reason"].startswith(
        "exception: the server could not start the run: RuntimeError: a bug in the launch"
    )
    monkeypatch.setattr(carrier, "launch", real)
    after = await submit(api, spec(entry=NOOP, scheduling=everything))
    assert (await wait_for(after["id"]))["state"] == "succeeded"


async def test_run_directory_contract(api, wait_for, runs_dir):
    rec = await submit(api, spec(entry="jupyter_evalsched.examples.basic:accuracy_toy", episodes=5))
    final = await wait_for(rec["id"])
    assert final["state"] == "succeeded" and final["reason"] is None and final["exit_code"] == 0
    assert final["progress"] == {"done": 5, "total": 5}
    run = runs_dir / rec["id"]
    names = {p.name for p in run.iterdir()}
    assert {
        "spec.json",
        "job.json",
        "summary.json",
        "episodes.jsonl",
        "stdout.log",
        "stderr.log",
        "_DONE",
    } <= names
    assert "shared_urls.json" not in names  # a first attempt without models: none needed
    saved = json.loads((run / "spec.json").read_text())
    assert saved["scheduling"] == {
        "marginal_vram_mb": 0,
        "gpus": 1,
        "exclusive_gpu": False,
        "priority": "normal",
        "cpus": 1,
        "memory_mb": None,
        "preemptible": False,
    }
    assert saved["name"] == "basic.accuracy_toy" and saved["seed"] == 0 and saved["cwd"]
    job = json.loads((run / "job.json").read_text())
    assert job["state"] == "succeeded" and job["seq"] >= 1 and job["pid_create_time"] > 0
    for field in ("submitted_at", "started_at", "finished_at"):
        assert job[field].endswith("+00:00") and "." in job[field]
    summary = final["summary"]
    assert summary["status"] == "succeeded" and summary["episodes_done"] == 5
    assert set(summary["metrics"]["accuracy"]) >= {"mean", "std", "min", "max", "count"}
    code, eps = await api("GET", f"runs/{rec['id']}/episodes")
    assert [e["index"] for e in sorted(eps["episodes"], key=lambda e: e["index"])] == [0, 1, 2, 3, 4]
    assert (run / "stdout.log").stat().st_mode & 0o077 == 0  # owner-only


async def test_a_runs_logs_are_created_by_its_start(api, wait_for, runs_dir, tmp_path):
    """A submission writes only spec.json and job.json (and a cell's eval.py): a queued run has no logs (the logs
    endpoint answers empty text), nor does one cancelled before it started; the start creates
    them, owner-only, and the run writes its output there."""
    gate = tmp_path / "gate"
    wait = (
        "import os, time\n\ndef episode(ctx, index):\n    deadline = time.monotonic() + 30\n"
        f"    while not os.path.exists({str(gate)!r}):\n"
        "        if time.monotonic() > deadline:\n            raise TimeoutError('the test never opened the gate')\n"
        "        time.sleep(0.01)\n    return {}\n"
    )
    hold = await submit(api, {"source": wait, "episodes": 1, "scheduling": {"cpus": 0}})
    await wait_for(hold["id"], states=("running",))
    src = "def episode(ctx, index):\n    print('said by the run', flush=True)\n    return {}\n"
    held = await submit(api, {"source": src, "episodes": 1, "depends_on": [hold["id"]]})
    doomed = await submit(api, spec(entry=NOOP, depends_on=[hold["id"]]))
    run = runs_dir / held["id"]
    assert {p.name for p in run.iterdir()} == {"spec.json", "job.json", "eval.py"}
    for stream in ("stdout", "stderr"):
        assert await api("GET", f"runs/{held['id']}/logs", params={"stream": stream}, raw=True) == (200, "")
    await api("POST", f"runs/{doomed['id']}/cancel")
    assert (await wait_for(doomed["id"]))["state"] == "cancelled"
    assert {p.name for p in (runs_dir / doomed["id"]).iterdir()} == {"spec.json", "job.json", "_DONE"}
    assert await api("GET", f"runs/{doomed['id']}/logs", params={"stream": "stderr"}, raw=True) == (200, "")
    gate.touch()
    assert (await wait_for(hold["id"]))["state"] == "succeeded"
    assert (await wait_for(held["id"]))["state"] == "succeeded"
    for name in ("stdout.log", "stderr.log"):
        assert (run / name).stat().st_mode & 0o777 == 0o600
    code, text = await api("GET", f"runs/{held['id']}/logs", params={"stream": "stdout"}, raw=True)
    assert code == 200 and "said by the run" in text, text


@pytest.mark.parametrize(
    "how, reason_prefix",
    [
        ("exception", "exception: RuntimeError"),
        ("memoryerror", "exception: MemoryError"),
        ("segfault", "signal:SIGSEGV"),
        ("sigkill", "signal:SIGKILL"),
        ("exit", "exit_code:3"),
    ],
)
async def test_runs_that_die_fail_with_a_reason_and_siblings_succeed(api, wait_for, runs_dir, how, reason_prefix):
    sibling = await submit(api, spec(episodes=3, sleep_s=0.05))
    bad = await submit(api, spec(entry=CRASH, params={"how": how, "code": 3}))
    final = await wait_for(bad["id"])
    assert final["state"] == "failed"
    assert final["reason"].startswith(reason_prefix), final["reason"]
    assert (runs_dir / bad["id"] / "_DONE").exists()
    if how == "exception":
        assert (
            final["summary"]["error"]["type"] == "RuntimeError"
            and "Traceback" in final["summary"]["error"]["traceback"]
        )
    assert (await wait_for(sibling["id"]))["state"] == "succeeded"


async def test_cancel_queued_and_running(api, wait_for, runs_dir):
    running = await submit(api, spec(vram=20000, episodes=100, sleep_s=0.1))
    queued = await submit(api, spec(vram=20000))
    await wait_for(running["id"], states=("running",))
    code, rec = await api("POST", f"runs/{queued['id']}/cancel")
    assert code == 200 and rec["state"] == "cancelled" and rec["reason"].startswith("cancelled")
    assert (runs_dir / queued["id"] / "_DONE").exists()
    code, rec = await api("POST", f"runs/{running['id']}/cancel")
    assert code == 200
    final = await wait_for(running["id"], timeout=5)
    assert final["state"] == "cancelled" and final["reason"].startswith("cancelled")
    assert not alive(final["pid"])  # (gone, or a zombie; reaped between two looks is gone too)
    code, err = await api("POST", f"runs/{running['id']}/cancel")
    assert code == 409 and "already ended" in err["message"]


async def test_cancel_reaches_a_run_that_ignores_sigterm(api, wait_for):
    rec = await submit(api, spec(entry=CRASH, params={"how": "ignore_sigterm"}))
    pid = (await wait_for(rec["id"], states=("running",)))["pid"]
    assert pid, "a running run without a pid"
    await async_wait_until(lambda: ignores_signal(pid), message="the run never ignored SIGTERM")
    t0 = time.monotonic()
    await api("POST", f"runs/{rec['id']}/cancel")
    final = await wait_for(rec["id"], timeout=10)
    assert final["state"] == "cancelled"
    assert time.monotonic() - t0 >= 1.5  # SIGKILL came after the grace (2 s in the test config)


async def test_forked_children_do_not_outlive_the_run(api, wait_for, runs_dir, tmp_path):
    rec = await submit(api, spec(entry=CRASH, params={"how": "fork_and_exit"}))
    final = await wait_for(rec["id"])
    assert final["state"] == "succeeded"
    child = int(final["summary"]["metrics"]["child_pid"]["max"])

    def child_gone() -> bool:
        try:
            return psutil.Process(child).status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True

    await async_wait_until(child_gone, timeout=1, message=f"the forked child {child} outlived its run")


async def test_timeout(api, wait_for):
    rec = await submit(api, spec(episodes=100, sleep_s=0.2, timeout_s=0.5))
    final = await wait_for(rec["id"], timeout=10)
    assert final["state"] == "failed" and final["reason"].startswith("timeout")


async def test_dependencies(api, wait_for, runs_dir):
    first = await submit(api, spec(episodes=2, sleep_s=0.1))
    second = await submit(api, spec(depends_on=[first["id"]]))
    bad = await submit(api, spec(entry=CRASH, params={"how": "exception"}))
    after_bad = await submit(api, spec(depends_on=[bad["id"]]))
    chained = await submit(api, spec(depends_on=[after_bad["id"]]))

    async def second_decided():  # admission has considered it: started, or waiting with a reason
        code, rec = await api("GET", f"runs/{second['id']}")
        return rec if code == 200 and (rec["state"] != "queued" or rec["reason"]) else None

    rec = await async_wait_until(second_decided, message="the dependent run was never considered")
    if rec["state"] == "queued":
        # Named by name and id: a reader knows the run without looking the id up.
        assert rec["reason"].startswith(f"waiting_dependency: run {first['name']} ({first['id']}) is")
    assert (await wait_for(second["id"]))["state"] == "succeeded"
    r = await wait_for(after_bad["id"])
    assert r["state"] == "failed" and r["reason"].startswith(f"dependency_failed:{bad['id']}")
    assert f"run {bad['name']} ({bad['id']}) ended failed" in r["reason"]
    assert r["pid"] is None and (runs_dir / after_bad["id"] / "_DONE").exists()
    r = await wait_for(chained["id"])
    assert r["state"] == "failed" and r["reason"].startswith(f"dependency_failed:{after_bad['id']}")


async def test_runs_held_by_a_dependency_stay_out_of_decisions_and_are_freed_by_its_end(
    api, wait_for, evalsched, tmp_path
):
    """Many runs waiting on one running run: they say why (its state, as it changes), are not
    part of admission's decisions (which then cost nothing for them), and all start once it
    succeeds; a dependency that fails fails its dependents."""
    opened = tmp_path / "open"
    gate_entry = f"{Path(__file__).resolve().parent / 'evals_observed.py'}:gate"
    gate = await submit(api, spec(entry=gate_entry, params={"gate": str(opened)}))
    waiting = [await submit(api, spec(entry=NOOP, depends_on=[gate["id"]])) for _ in range(30)]
    doomed = await submit(api, spec(entry=CRASH, params={"how": "exception", "sleep_s": 0.3}))
    after_doomed = await submit(api, spec(entry=NOOP, depends_on=[doomed["id"]]))

    async def all_held():
        recs = [(await api("GET", f"runs/{r['id']}"))[1] for r in waiting]
        return all(r["reason"] == f"waiting_dependency: run {gate['name']} ({gate['id']}) is running" for r in recs)

    await async_wait_until(all_held, message="the held runs did not say that their dependency is running")
    assert all(r["id"] in evalsched.admission._blocked for r in waiting)
    assert evalsched.admission._waiting_on[gate["id"]] == {r["id"]: "running" for r in waiting}
    opened.touch()
    for rec in waiting:
        assert (await wait_for(rec["id"]))["state"] == "succeeded"
    final = await wait_for(after_doomed["id"])
    assert final["state"] == "failed" and final["reason"].startswith(f"dependency_failed:{doomed['id']}")
    assert not evalsched.admission._blocked and not evalsched.admission._waiting_on


@pytest.mark.parametrize("evalsched_config", [{"reconcile_interval_s": 3600.0}])
async def test_a_dependencys_news_leaves_its_waiters_alone_and_a_missed_end_is_caught_by_reconciliation(
    api, wait_for, evalsched, tmp_path, monkeypatch
):
    """Runs held by a dependency are looked at again only when its state moves: its other
    news (progress, reasons) and the periodic reconciliation leave them be (each look cost the
    event loop tens of microseconds a run, every second and every event, for a sweep held behind
    one run). An end whose event was missed still frees them at the next reconciliation (called
    here: the periodic one is an hour away, so that none comes in between)."""
    from jupyter_evalsched.scheduler import policy

    opened = tmp_path / "open"
    gate_entry = f"{Path(__file__).resolve().parent / 'evals_observed.py'}:gate"
    gate = await submit(api, spec(entry=gate_entry, params={"gate": str(opened)}))
    waiting = [await submit(api, spec(entry=NOOP, depends_on=[gate["id"]])) for _ in range(20)]
    admission = evalsched.admission

    async def all_held():
        recs = [(await api("GET", f"runs/{r['id']}"))[1] for r in waiting]
        return all(r["reason"].endswith(f"({gate['id']}) is running") for r in recs)

    await async_wait_until(all_held, message="the held runs did not say that their dependency is running")
    looks: list[tuple[str, ...]] = []
    verdict = policy.dependency_verdict

    def counted(depends_on, *args):
        looks.append(tuple(depends_on))
        return verdict(depends_on, *args)

    monkeypatch.setattr(policy, "dependency_verdict", counted)
    gate_run = evalsched.table.get(gate["id"])
    for _ in range(10):
        evalsched.table.changed(gate_run)  # (what its progress and reasons send)
        admission.reconcile()
    assert looks == []
    assert set(admission._blocked) >= {r["id"] for r in waiting}

    # Its end unheard: the waiters stay held, until the backstop sees the state it ended in.
    evalsched.table.unsubscribe(admission._run_changed)
    try:
        opened.touch()
        assert (await wait_for(gate["id"]))["state"] == "succeeded"
        states = [(await api("GET", f"runs/{r['id']}"))[1]["state"] for r in waiting]
        assert states == ["queued"] * len(waiting)
        assert looks == []
    finally:
        evalsched.table.subscribe(admission._run_changed)
    admission.reconcile()
    for rec in waiting:
        assert (await wait_for(rec["id"]))["state"] == "succeeded"
    assert not admission._blocked and not admission._waiting_on


async def test_dependents_failed_in_one_decision_all_reach_the_disk(
    api, wait_for, evalsched, runs_dir, tmp_path, monkeypatch
):
    """Twelve runs wait on one that is cancelled: they fail in one decision, and their records go
    to the writer's thread (never the event loop's); each ends on disk with its terminal job.json
    and _DONE."""
    import threading

    store = evalsched.table.store
    marked: dict[str, str] = {}  # run id -> the thread that wrote its _DONE
    real_mark = store.mark_done

    def mark_done(run_id, *args, **kwargs):
        marked[run_id] = threading.current_thread().name
        return real_mark(run_id, *args, **kwargs)

    monkeypatch.setattr(store, "mark_done", mark_done)
    gate_entry = f"{Path(__file__).resolve().parent / 'evals_observed.py'}:gate"
    gate = await submit(api, spec(entry=gate_entry, params={"gate": str(tmp_path / "never")}))
    waiting = [await submit(api, spec(entry=NOOP, depends_on=[gate["id"]])) for _ in range(12)]
    await async_wait_until(lambda: evalsched.get(gate["id"]).state == "running", message="the gate never ran")
    code, _ = await api("POST", f"runs/{gate['id']}/cancel")
    assert code == 200
    for rec in waiting:
        final = await wait_for(rec["id"])
        assert final["state"] == "failed" and final["reason"].startswith(f"dependency_failed:{gate['id']}")

    def on_disk():
        return all(
            json.loads((runs_dir / r["id"] / "job.json").read_text())["state"] == "failed"
            and (runs_dir / r["id"] / "_DONE").exists()
            for r in waiting
        )

    await async_wait_until(on_disk, message="not every failed dependent's record reached the disk")
    assert evalsched.table.writes_waiting == 0
    assert {marked.get(r["id"]) for r in waiting} == {"evalsched-writer"}, marked


async def test_priorities_and_exclusive(api, wait_for, evalsched):
    blocker = await submit(api, spec(vram=24000, episodes=3, sleep_s=0.1))
    low = await submit(api, spec(vram=1000, scheduling={"priority": "low"}))
    normal = await submit(api, spec(vram=1000))
    high = await submit(api, spec(vram=1000, scheduling={"priority": "high"}))
    excl = await submit(api, spec(scheduling={"exclusive_gpu": True, "priority": "high"}))

    async def all_decided():  # admission has considered all four: each waits with a reason
        code, queue = await api("GET", "queue")
        waiting = queue["queued"] if code == 200 else []
        return queue if len(waiting) == 4 and all(r["reason"] for r in waiting) else None

    queue = await async_wait_until(all_decided, message="the four queued runs never all got a reason")
    assert [r["id"] for r in queue["queued"]] == [high["id"], excl["id"], normal["id"], low["id"]]
    reasons = {r["id"]: r["reason"] for r in queue["queued"]}
    assert reasons[excl["id"]].startswith("waiting_gpu_exclusive")
    for rec in (blocker, low, normal, high, excl):
        assert (await wait_for(rec["id"]))["state"] == "succeeded"


async def test_a_queue_view_with_a_limit_lists_the_head_of_the_queue_and_counts_all(
    jp_ws_fetch, api, wait_for, evalsched
):
    gate = await submit(api, spec(episodes=1, sleep_s=60, scheduling={"cpus": 0}))
    await wait_for(gate["id"], states=("running",))  # not listed among the queued as it starts
    priorities = ["low", "normal", "high", "normal", "low", "high"]
    waiting = [
        await submit(api, spec(depends_on=[gate["id"]], scheduling={"priority": p, "cpus": 0})) for p in priorities
    ]
    code, full = await api("GET", "queue")
    assert code == 200 and full["queued_total"] == 6
    order = [r["id"] for r in full["queued"]]
    by_priority = [
        r["id"] for p in ("high", "normal", "low") for r, q in zip(waiting, priorities, strict=True) if q == p
    ]
    assert order == by_priority  # then submission order within a lane
    for limit, wanted in ((0, []), (1, order[:1]), (4, order[:4]), (6, order), (100, order)):
        code, view = await api("GET", "queue", params={"limit": limit})
        assert code == 200 and [r["id"] for r in view["queued"]] == wanted, limit
        assert view["queued_total"] == 6 and "ledger" in view
        assert [r["id"] for r in view["running"]] == [gate["id"]]
    assert len(evalsched._queue_cache) <= 4  # one serialised view per limit asked, a few kept
    for bad in ("-1", "x", "100001", "2.5"):
        code, err = await api("GET", "queue", params={"limit": bad})
        assert code == 400 and "'limit'" in err["message"], (bad, err)
    # The event stream's first message: the same view, as limited.
    ws = await jp_ws_fetch("evalsched", "events", params={"limit": 2})
    snapshot = json.loads(await ws.read_message())
    ws.close()
    assert [r["id"] for r in snapshot["queue"]["queued"]] == order[:2] and snapshot["queue"]["queued_total"] == 6
    with pytest.raises(HTTPClientError) as refused:
        await jp_ws_fetch("evalsched", "events", params={"limit": "-3"})
    assert refused.value.code == 400
    await api("POST", f"runs/{gate['id']}/cancel")


async def test_submission_errors(api, tmp_path):
    code, err = await api("POST", "runs", "{not json")
    assert code == 400 and "not valid JSON" in err["message"]
    code, err = await api("POST", "runs", {"episodes": 1})
    assert code == 422 and "entrypoint" in err["message"]
    code, err = await api("POST", "runs", spec(vram=-5))
    assert code == 422 and err["detail"][0]["loc"] == ["scheduling", "marginal_vram_mb"]
    code, err = await api("POST", "runs", spec(vram=30000))
    assert code == 422 and "can never fit" in err["message"] and "24000" in err["message"]
    code, err = await api("POST", "runs", spec(vram=1000, scheduling={"gpus": 2}))
    assert code == 422 and "the host has 1" in err["message"]
    code, err = await api("POST", "runs", spec(models=["nope"]))
    assert code == 422 and "unknown shared model 'nope'" in err["message"]
    code, err = await api("POST", "runs", spec(depends_on=["20990101T000000.000000-abcdef"]))
    assert code == 422 and "unknown run id" in err["message"]
    code, err = await api("POST", "runs", spec(cwd=str(tmp_path / "missing")))
    assert code == 422 and err["detail"][0]["loc"] == ["cwd"]
    code, err = await api("POST", "runs", spec(entry="nothere.py:episode", cwd=str(tmp_path)))
    assert code == 422 and "not found" in err["message"]
    code, err = await api("POST", "runs", '{"entrypoint": "a:b", "params": {"x": NaN}}')
    assert code == 400
    code, err = await api("POST", "runs", "[" * 100_000 + "]" * 100_000)
    assert code in (400, 422)
    code, err = await api("POST", "runs", {"entrypoint": "a:b", "bogus": 1})
    assert code == 422 and err["detail"][0]["loc"] == ["bogus"]


async def test_unknown_ids_and_state_conflicts(api, wait_for):
    for path in ("runs/nope", "runs/..%2Fetc", "runs/nope/logs", "runs/nope/episodes"):
        code, err = await api("GET", path)
        assert code == 404, path
        assert "no run" in err["message"]
    code, _ = await api("POST", "runs/nope/cancel")
    assert code == 404
    code, _ = await api("DELETE", "runs/..%2F..%2Fetc")
    assert code == 404
    rec = await submit(api, spec(episodes=50, sleep_s=0.1))
    await wait_for(rec["id"], states=("running",))
    code, err = await api("DELETE", f"runs/{rec['id']}")
    assert code == 409
    await api("POST", f"runs/{rec['id']}/cancel")
    await wait_for(rec["id"])
    code, _ = await api("DELETE", f"runs/{rec['id']}")
    assert code == 204
    code, _ = await api("GET", f"runs/{rec['id']}")
    assert code == 404
    code, err = await api("GET", "runs", params={"state": "bogus"})
    assert code == 400
    code, err = await api("GET", "runs", params={"limit": "0"})
    assert code == 400


async def test_list_logs_and_filters(api, wait_for, tmp_path):
    (tmp_path / "talk.py").write_text(
        "def episode(ctx, index):\n    for i in range(30):\n        print('line', index, i)\n    return {'i': index}\n"
    )
    rec = await submit(api, {"entrypoint": "talk.py:episode", "episodes": 2, "cwd": str(tmp_path)})
    await wait_for(rec["id"])
    code, text = await api("GET", f"runs/{rec['id']}/logs", params={"tail": "3"}, raw=True)
    assert code == 200 and text.splitlines() == ["line 1 27", "line 1 28", "line 1 29"]
    code, text = await api("GET", f"runs/{rec['id']}/logs", params={"stream": "stderr"}, raw=True)
    assert code == 200
    code, err = await api("GET", f"runs/{rec['id']}/logs", params={"stream": "x"})
    assert code == 400
    other = await submit(api, spec())
    await wait_for(other["id"])
    code, listing = await api("GET", "runs")
    assert [r["id"] for r in listing["runs"]][:2] == [other["id"], rec["id"]] and listing["total"] == 2
    code, listing = await api("GET", "runs", params={"state": "failed,cancelled"})
    assert listing == {"runs": [], "total": 0}
    code, listing = await api("GET", "runs", params={"limit": "1"})
    assert len(listing["runs"]) == 1 and listing["total"] == 2


async def test_source_runs_from_eval_py(api, wait_for, runs_dir):
    src = "import math\n\ndef episode(ctx, index):\n    return {'root': math.sqrt(index), 'seed': ctx.seed}\n"
    rec = await submit(api, {"source": src, "episodes": 3, "seed": 10})
    final = await wait_for(rec["id"])
    assert final["state"] == "succeeded" and final["name"] == "eval"
    assert (runs_dir / rec["id"] / "eval.py").read_text() == src
    assert final["summary"]["metrics"]["seed"]["max"] == 12


async def test_gpu_runs_get_their_devices(api, wait_for, tmp_path):
    (tmp_path / "env.py").write_text(
        "import os\n\ndef episode(ctx, index):\n    print(os.environ['CUDA_VISIBLE_DEVICES'], os.environ['CUDA_DEVICE_ORDER'], ctx.devices)\n    return {}\n"
    )
    gpu = await submit(
        api, {"entrypoint": "env.py:episode", "cwd": str(tmp_path), "scheduling": {"marginal_vram_mb": 100}}
    )
    cpu = await submit(api, {"entrypoint": "env.py:episode", "cwd": str(tmp_path)})
    await wait_for(gpu["id"])
    await wait_for(cpu["id"])
    _, out = await api("GET", f"runs/{gpu['id']}/logs", raw=True)
    assert out.strip() == "0 PCI_BUS_ID [0]"
    _, out = await api("GET", f"runs/{cpu['id']}/logs", raw=True)
    assert out.strip() == "PCI_BUS_ID []"


async def test_events_stream(jp_ws_fetch, api, wait_for):
    first = await submit(api, spec(episodes=3, sleep_s=0.1))
    await wait_for(first["id"])
    ws = await jp_ws_fetch("evalsched", "events")
    snapshot = json.loads(await ws.read_message())
    assert snapshot["type"] == "snapshot" and set(snapshot["queue"]) == {
        "primary",
        "queued",
        "queued_total",
        "running",
        "ledger",
        "leases",
    }
    rec = await submit(api, spec(episodes=4, sleep_s=0.15))
    seen = []
    progress = []
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        msg = json.loads(await asyncio.wait_for(ws.read_message(), 10))
        run = msg["run"]
        if run["id"] != rec["id"]:
            continue
        if not seen or seen[-1] != run["state"]:
            seen.append(run["state"])
        progress.append(run["progress"]["done"])
        if run["state"] == "succeeded":
            break
    ws.close()
    assert seen == ["queued", "running", "succeeded"]
    assert 0 < max(p for p in progress[:-1]) or len(set(progress)) > 2, progress
    # A late subscriber gets a snapshot that includes the finished state in nothing queued/running.
    ws2 = await jp_ws_fetch("evalsched", "events")
    snap = json.loads(await ws2.read_message())
    assert snap["queue"]["queued"] == [] and snap["queue"]["running"] == []
    ws2.close()


async def test_openapi_documents_every_route(api):
    code, doc = await api("GET", "openapi.json")
    assert code == 200 and doc["openapi"].startswith("3.")
    assert set(doc["paths"]) >= {
        "/runs",
        "/runs/{run_id}",
        "/runs/{run_id}/cancel",
        "/runs/{run_id}/logs",
        "/runs/{run_id}/episodes",
        "/queue",
        "/ledger",
        "/models",
        "/events",
        "/openapi.json",
        "/leases",
        "/leases/{lease_id}",
        "/models/{name}/connect",
        "/doctor",
    }
    assert "EvalSpec" in doc["components"]["schemas"]
    assert "422" in doc["paths"]["/runs"]["post"]["responses"]
    from openapi_spec_validator import validate

    validate(doc)


async def test_models_endpoint_without_models(api):
    assert await api("GET", "models") == (200, {"models": []})


async def test_polling_is_not_activity_but_live_runs_are(api, wait_for, jp_serverapp, evalsched):
    settings = jp_serverapp.web_app.settings
    await api("GET", "queue")
    before = settings.get("api_last_activity")
    for path in ("queue", "ledger", "runs", "models"):
        await api("GET", path)
    assert settings.get("api_last_activity") == before
    app = jp_serverapp.extension_manager.extension_points["jupyter_evalsched"].app
    rec = await submit(api, spec(episodes=20, sleep_s=0.05))
    await wait_for(rec["id"], states=("running",))
    app._report_activity()
    mark = settings["evalsched_last_activity"]
    assert jp_serverapp.web_app.last_activity() >= mark
    await wait_for(rec["id"])
    app._report_activity()
    assert settings["evalsched_last_activity"] == mark  # nothing live: no more activity


async def test_run_files_are_read_without_following_links(api, wait_for, runs_dir):
    rec = await submit(api, spec(episodes=1))
    await wait_for(rec["id"])
    run = runs_dir / rec["id"]
    (run / "stdout.log").unlink()
    (run / "stdout.log").symlink_to("/etc/passwd")
    code, err = await api("GET", f"runs/{rec['id']}/logs")
    assert code == 409 and "root:" not in json.dumps(err)
    (run / "episodes.jsonl").unlink()
    (run / "episodes.jsonl").symlink_to("/etc/passwd")
    code, err = await api("GET", f"runs/{rec['id']}/episodes")
    assert code == 409 and "symbolic link" in err["message"] and "root:" not in json.dumps(err)
    code, _ = await api("DELETE", f"runs/{rec['id']}")
    assert code == 204 and Path("/etc/passwd").exists()
