"""Attempts inside a real Jupyter server: resume, retries, preemption (docs/reference.md,
"Attempts, retries and preemption"). The restart cases (auto_resume, detached runs) are
in test_attempts_restart.py, with real server processes killed with SIGKILL.

Tests are plain ``async def``: pytest-jupyter runs them on the server's loop.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import threading
import time
from datetime import datetime

import pytest
from rest import CRASH, spec, submit
from waiting import async_wait_until

from jupyter_evalsched.examples.basic import _unit_float
from jupyter_evalsched.scheduler import launcher as launcher_module

TERMINAL = ("succeeded", "failed", "cancelled", "aborted")


@pytest.fixture
def evalsched_config():
    return {
        "virtual_gpus": [10000],
        "preempt_min_runtime_s": 0.0,
        "preempt_grace_s": 20.0,
        "retry_backoff_s": 0.0,
    }


def expected_mean(seed: int, episodes: int) -> float:
    """What an uninterrupted run of ``sleepy`` reports: its score is a function of the seed."""
    return statistics.fmean(_unit_float(seed + i) for i in range(episodes))


async def episodes_of(api, run_id: str) -> list[dict]:
    code, body = await api("GET", f"runs/{run_id}/episodes")
    assert code == 200, body
    return body["episodes"]


def states_seen(evalsched, run_id: str) -> list[str]:
    """Every state the run's events carried, in order (a client watching the event socket)."""
    seen: list[str] = []

    def on_event(event: dict) -> None:
        if event.get("type") == "run" and event["run"]["id"] == run_id:
            if not seen or seen[-1] != event["run"]["state"]:
                seen.append(event["run"]["state"])

    evalsched.subscribe(on_event)
    return seen


async def test_resume_a_failed_run_skips_what_was_done(api, wait_for, runs_dir):
    body = spec(CRASH, episodes=6, seed=7, params={"how": "exit", "code": 3, "at": 3, "until_attempt": 1})
    rec = await submit(api, body)
    failed = await wait_for(rec["id"])
    assert failed["state"] == "failed" and failed["reason"].startswith("exit_code:3"), failed
    assert failed["attempt"] == 1 and failed["progress"]["done"] == 3
    run_dir = runs_dir / rec["id"]
    assert (run_dir / "_DONE").exists()
    before = await episodes_of(api, rec["id"])

    code, resumed = await api("POST", f"runs/{rec['id']}/resume")
    assert code == 200, resumed
    assert resumed["id"] == rec["id"] and resumed["state"] in ("queued", "running") and resumed["attempt"] == 2
    assert resumed["history"] == [
        {
            "attempt": 1,
            "state": "failed",
            "reason": failed["reason"],
            "started_at": failed["started_at"],
            "finished_at": failed["finished_at"],
            "episodes_done": 3,
        }
    ]
    done = await wait_for(rec["id"])
    assert done["state"] == "succeeded" and done["attempt"] == 2 and done["exit_code"] == 0, done
    lines = await episodes_of(api, rec["id"])
    assert sorted(e["index"] for e in lines) == list(range(6))  # each index exactly once
    assert lines[:3] == before and [e["attempt"] for e in lines] == [1, 1, 1, 2, 2, 2]
    assert done["progress"] == {"done": 6, "total": 6} and done["metrics"]["ok"]["count"] == 6
    assert (run_dir / "_DONE").exists() and not (run_dir / "_STOP").exists()


async def test_resume_of_a_cancelled_run_equals_an_uninterrupted_one(api, wait_for, runs_dir):
    rec = await submit(api, spec(episodes=12, sleep_s=0.05, seed=40))

    async def some_done():
        code, r = await api("GET", f"runs/{rec['id']}")
        return r["progress"]["done"] >= 3

    await async_wait_until(some_done)
    code, _ = await api("POST", f"runs/{rec['id']}/cancel")
    cancelled = await wait_for(rec["id"])
    assert cancelled["state"] == "cancelled"
    done_before = {e["index"] for e in await episodes_of(api, rec["id"])}
    assert 3 <= len(done_before) < 12

    code, resumed = await api("POST", f"runs/{rec['id']}/resume")
    assert code == 200, resumed
    # Between the answer and the end, the directory holds no _DONE: it is not terminal.
    assert not (runs_dir / rec["id"] / "_DONE").exists()
    final = await wait_for(rec["id"])
    assert final["state"] == "succeeded" and final["attempt"] == 2
    lines = await episodes_of(api, rec["id"])
    assert sorted(e["index"] for e in lines) == list(range(12))
    assert {e["index"] for e in lines if e["attempt"] == 1} == done_before  # not run again
    assert final["metrics"]["score"]["mean"] == pytest.approx(expected_mean(40, 12), rel=1e-12)
    assert final["metrics"]["score"]["count"] == 12


async def test_resume_answers_409_and_404(api, wait_for):
    ok = await submit(api, spec(episodes=1, sleep_s=0))
    await wait_for(ok["id"])
    code, body = await api("POST", f"runs/{ok['id']}/resume")
    assert code == 409 and "succeeded" in body["message"], body
    long = await submit(api, spec(episodes=1, sleep_s=30))
    code, body = await api("POST", f"runs/{long['id']}/resume")
    assert code == 409 and "still" in body["message"], body
    await api("POST", f"runs/{long['id']}/cancel")
    code, body = await api("POST", "runs/no-such-run/resume")
    assert code == 404, body
    code, body = await api("POST", "runs/..%2Fetc/resume")
    assert code == 404, body


async def test_a_retried_failure_is_never_seen_terminal(api, wait_for, evalsched):
    body = spec(CRASH, episodes=4, params={"how": "sigkill", "at": 2, "until_attempt": 1}, retries=2)
    rec = await submit(api, body)
    seen = states_seen(evalsched, rec["id"])
    final = await wait_for(rec["id"])
    assert final["state"] == "succeeded", final
    assert final["attempt"] == 2 and final["retries"] == 2 and final["retries_used"] == 1
    assert [h["state"] for h in final["history"]] == ["failed"]
    assert final["history"][0]["reason"].startswith("signal:SIGKILL") and final["history"][0]["episodes_done"] == 2
    assert seen[-1] == "succeeded" and not set(seen[:-1]) & set(TERMINAL), seen
    lines = await episodes_of(api, rec["id"])
    assert sorted(e["index"] for e in lines) == [0, 1, 2, 3]


async def test_a_retry_starts_only_once_its_failed_attempts_clean_up_is_done(api, wait_for, evalsched, monkeypatch):
    """The clean-up after an attempt (a thread's work: its cgroup removed, what it left killed)
    would remove the next attempt's cgroup, or kill what it started: the retry waits for it."""
    entered, release = threading.Event(), threading.Event()
    real = launcher_module.clean_up_after_all

    def held(procs, *rest):
        entered.set()
        release.wait(60)
        real(procs, *rest)

    monkeypatch.setattr(launcher_module, "clean_up_after_all", held)
    rec = await submit(
        api, spec(CRASH, episodes=2, params={"how": "exit", "code": 3, "at": 1, "until_attempt": 1}, retries=1)
    )
    try:
        await async_wait_until(entered.is_set, timeout=30, message="the first attempt's clean-up did not begin")
        await async_wait_until(
            lambda: evalsched.get(rec["id"]).record["attempt"] == 2 and evalsched.get(rec["id"]).starting,
            timeout=30,
            message="no retry was admitted",
        )
        await asyncio.sleep(0.5)  # (the retry, were it not held, starts within milliseconds)
        run = evalsched.get(rec["id"])
        assert run.starting and run.record["pid"] is None, run.record  # admitted, not started
        assert not evalsched.executors["local"].launcher.cleaning[rec["id"]].done()
    finally:
        released = time.time()
        release.set()
    final = await wait_for(rec["id"])
    assert final["state"] == "succeeded" and final["attempt"] == 2, final
    assert datetime.fromisoformat(final["started_at"]).timestamp() >= released, (final["started_at"], released)


async def test_retries_run_out_and_retry_on_decides(api, wait_for):
    always = await submit(api, spec(CRASH, episodes=2, params={"how": "exit", "code": 5}, retries=2))
    final = await wait_for(always["id"])
    assert final["state"] == "failed" and final["reason"].startswith("exit_code:5")
    assert final["attempt"] == 3 and final["retries_used"] == 2 and len(final["history"]) == 2
    # An exception is not retried by default (retry_on: exit_code, signal, oom) ...
    raised = await submit(api, spec(CRASH, episodes=1, params={"how": "exception"}, retries=3))
    final = await wait_for(raised["id"])
    assert final["state"] == "failed" and final["attempt"] == 1 and final["reason"].startswith("exception")
    # ... unless retry_on names it.
    named = await submit(
        api, spec(CRASH, episodes=1, params={"how": "exception", "until_attempt": 1}, retries=1, retry_on=["exception"])
    )
    final = await wait_for(named["id"])
    assert final["state"] == "succeeded" and final["attempt"] == 2, final
    code, body = await api("POST", "runs", spec(retry_on=["segfault"]))
    assert code == 422 and body["detail"][0]["loc"][-1] == "retry_on", body


async def test_a_retry_waits_out_its_backoff_and_can_be_cancelled(api, wait_for, evalsched, runs_dir):
    evalsched.config.retry_backoff_s = 300.0  # long enough to look at, and to cancel
    rec = await submit(api, spec(CRASH, episodes=1, params={"how": "exit", "code": 4}, retries=1))

    async def backing_off():
        code, r = await api("GET", f"runs/{rec['id']}")
        return r if r["state"] == "queued" and r["attempt"] == 2 else None

    waiting = await async_wait_until(backing_off)
    assert waiting["reason"].startswith("retrying: attempt 2 (retry 1 of 1) in 300 s"), waiting["reason"]
    assert "after exit_code:4" in waiting["reason"] and waiting["retry_at"]
    # Its why, the same fact as data, and written with the requeue.
    assert (waiting["why"]["code"], waiting["why"]["holders"]) == ("retrying", []), waiting["why"]
    assert json.loads((runs_dir / rec["id"] / "job.json").read_text())["why"] == waiting["why"]
    assert not (runs_dir / rec["id"] / "_DONE").exists()
    code, queue = await api("GET", "queue")
    assert rec["id"] in [r["id"] for r in queue["queued"]]
    code, cancelled = await api("POST", f"runs/{rec['id']}/cancel")
    assert code == 200 and cancelled["state"] == "cancelled", cancelled
    assert (runs_dir / rec["id"] / "_DONE").exists()


async def preempting(api, run_id: str):
    code, r = await api("GET", f"runs/{run_id}")
    return r if r["progress"]["done"] >= 2 else None


async def test_a_high_run_submitted_to_an_empty_queue_preempts_in_its_submission(api, wait_for, evalsched, monkeypatch):
    """Nothing queued: the high run is decided alone in its own submission, and the room it needs
    is made by a full decision at once, not left to the periodic reconciliation (switched off
    here: without it, the high run would wait for the low one's 30 s)."""
    monkeypatch.setattr(evalsched.admission, "reconcile", lambda: None)
    low = await submit(api, spec(vram=8000, episodes=300, sleep_s=0.1, scheduling={"priority": "low"}))
    await async_wait_until(lambda: preempting(api, low["id"]))
    high = await submit(api, spec(vram=8000, episodes=1, sleep_s=0.01, scheduling={"priority": "high"}))
    assert (await wait_for(high["id"], timeout=20))["state"] == "succeeded"
    code, rec = await api("GET", f"runs/{low['id']}")
    assert rec["preemptions"] == 1, rec
    await api("POST", f"runs/{low['id']}/cancel")
    assert (await wait_for(low["id"]))["state"] == "cancelled"


@pytest.mark.parametrize("workers", [1, 2])
async def test_a_high_run_preempts_a_low_one_which_resumes(api, wait_for, evalsched, runs_dir, workers):
    low = await submit(
        api, spec(vram=8000, episodes=20, sleep_s=0.1, seed=100, workers=workers, scheduling={"priority": "low"})
    )
    assert low["preemptible"] is True
    await async_wait_until(lambda: preempting(api, low["id"]))
    low_seen = states_seen(evalsched, low["id"])
    high = await submit(api, spec(vram=8000, episodes=1, sleep_s=0.01, scheduling={"priority": "high"}))

    high_done = await wait_for(high["id"])
    assert high_done["state"] == "succeeded"
    final = await wait_for(low["id"])
    assert final["state"] == "succeeded", final
    assert final["preemptions"] == 1 and final["attempt"] == 2 and final["retries_used"] == 0
    entry = final["history"][0]
    assert entry["state"] == "preempted" and entry["reason"].startswith(f"preempted_by:{high['id']}")
    # The high run started before the low one's next attempt did.
    assert high_done["started_at"] < final["started_at"] and high_done["started_at"] > low["submitted_at"]
    assert low_seen == ["running", "queued", "running", "succeeded"], low_seen  # never terminal between
    lines = await episodes_of(api, low["id"])
    assert sorted(e["index"] for e in lines) == list(range(20))  # no episode twice, none lost
    assert {e["attempt"] for e in lines} == {1, 2}
    assert final["metrics"]["score"]["mean"] == pytest.approx(expected_mean(100, 20), rel=1e-12)
    assert not (runs_dir / low["id"] / "_STOP").exists()


async def test_a_preempted_run_says_so_while_it_stops_and_waits(api, wait_for, evalsched):
    low = await submit(api, spec(vram=8000, episodes=400, sleep_s=0.05, scheduling={"priority": "low"}))
    await async_wait_until(lambda: preempting(api, low["id"]))
    reasons: list[str] = []
    evalsched.subscribe(
        lambda e: (
            reasons.append(e["run"]["reason"] or "") if e.get("type") == "run" and e["run"]["id"] == low["id"] else None
        )
    )
    high = await submit(api, spec(vram=8000, episodes=1, sleep_s=30, scheduling={"priority": "high"}))

    async def requeued():
        code, r = await api("GET", f"runs/{low['id']}")
        return r if r["state"] == "queued" else None

    await async_wait_until(requeued)
    assert any(x.startswith(f"preempting:{high['id']}: stops at its next episode boundary") for x in reasons), reasons
    code, stopped = await api("GET", f"runs/{low['id']}")
    # Its why while it waits: the preemption's, the run it stopped for its first holder, by name.
    assert (stopped["why"]["code"], stopped["why"]["arg"]) == ("preempted_by", high["id"]), stopped["why"]
    first = stopped["why"]["holders"][0]
    assert (first["kind"], first["id"], first["name"]) == ("run", high["id"], high["name"]), stopped["why"]

    async def decided():  # admission has looked at it again: its reason still says why it is back
        code, r = await api("GET", f"runs/{low['id']}")
        return r if "; now waiting_vram: needs 8000 MB" in (r["reason"] or "") else None

    waiting = await async_wait_until(decided)
    assert waiting["reason"].startswith(f"preempted_by:{high['id']}: stopped after "), waiting["reason"]
    assert waiting["preemptions"] == 1 and waiting["state"] == "queued"
    assert waiting["why"]["code"] == "preempted_by" and waiting["why"]["holders"][0]["id"] == high["id"]
    code, queue = await api("GET", "queue")
    assert [r["id"] for r in queue["running"]] == [high["id"]]
    await api("POST", f"runs/{high['id']}/cancel")
    await api("POST", f"runs/{low['id']}/cancel")
    await wait_for(low["id"])


async def test_runs_that_are_not_preemptible_are_never_stopped(api, wait_for):
    normal = await submit(api, spec(vram=8000, episodes=1, sleep_s=30))
    assert normal["preemptible"] is False
    await async_wait_until(lambda: _state(api, normal["id"], "running"))
    high = await submit(api, spec(vram=8000, episodes=1, sleep_s=0, scheduling={"priority": "high"}))

    async def decided():
        code, r = await api("GET", f"runs/{high['id']}")
        return r if r["reason"] else None

    waiting = await async_wait_until(decided)
    assert waiting["state"] == "queued" and waiting["reason"].startswith("waiting_vram")
    code, r = await api("GET", f"runs/{normal['id']}")
    assert r["state"] == "running" and r["reason"] is None and r["preemptions"] == 0
    await api("POST", f"runs/{normal['id']}/cancel")
    assert (await wait_for(high["id"]))["state"] == "succeeded"


async def _state(api, run_id: str, state: str):
    code, r = await api("GET", f"runs/{run_id}")
    return r if r["state"] == state else None


async def test_detached_runs_cannot_use_shared_models(api):
    code, body = await api("POST", "runs", spec(detach=True, models=["tiny"]))
    assert code == 422 and any(d["loc"] == ["detach"] for d in body["detail"]), body


async def test_a_resumed_run_keeps_its_timeout(api, wait_for):
    """The next attempt gets its own timeout_s (counted from its start): resuming never disarms it."""
    rec = await submit(api, spec(episodes=200, sleep_s=0.05, timeout_s=1.0))
    first = await wait_for(rec["id"])
    assert first["state"] == "failed" and first["reason"].startswith("timeout"), first
    code, resumed = await api("POST", f"runs/{rec['id']}/resume")
    assert code == 200, resumed
    second = await wait_for(rec["id"], timeout=20)
    assert second["state"] == "failed" and second["reason"].startswith("timeout"), second
    assert second["attempt"] == 2 and second["progress"]["done"] < 200
    assert [h["reason"].split(":")[0] for h in second["history"]] == ["timeout"]
