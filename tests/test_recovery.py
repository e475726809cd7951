"""Restart recovery (rule 4) with real `jupyter server` processes: SIGKILL, clean shutdown,
recycled PIDs. In-flight runs are lost and say so (`aborted`); nothing else is lost."""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import os
import signal
import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta

import psutil
import pytest
from live_server import wait_until
from proc_status import StaleGroup, alive
from run_dirs import write_run_dir
from waiting import async_wait_until, loop_ticker

from jupyter_evalsched.client import LocalServer

SLEEPY = "jupyter_evalsched.examples.basic:sleepy"
NOOP = "jupyter_evalsched.examples.basic:noop"
FAST = [
    "--EvalSchedApp.cancel_grace_s=2.0",
    "--EvalSchedApp.reconcile_interval_s=0.5",
    "--EvalSchedApp.progress_interval_s=0.05",
]


def long_run(vram: int, **kw) -> dict:
    return short_run(vram, episodes=1000, params={"sleep_s": 0.1}, **kw)


def short_run(vram: int, **kw) -> dict:
    # The cwd outlives each server (a server's own root_dir is removed with it).
    spec = {
        "entrypoint": SLEEPY,
        "episodes": 1,
        "params": {"sleep_s": 0.01},
        "cwd": "/",
        "scheduling": {"marginal_vram_mb": vram},
    }
    spec.update(kw)
    return spec


@pytest.mark.parametrize("start", ["warm", "cold"])
def test_sigkill_of_the_server_aborts_running_and_requeues_queued(tmp_path, start):
    runs = tmp_path / "runs"
    extra = [*FAST, f"--EvalSchedApp.warm_start={start == 'warm'}"]
    server = LocalServer(virtual_gpus="24000", runs_dir=str(runs), extra_args=extra)
    try:
        c = server.client()
        a = c.submit(long_run(10000))
        b = c.submit(long_run(10000))
        q1 = c.submit(short_run(10000, episodes=2))
        q2 = c.submit(short_run(10000, depends_on=[q1["id"]]))
        wait_until(lambda: all(c.get(r["id"])["pid"] for r in (a, b)))  # running, its process there
        assert [c.get(r["id"])["start"] for r in (a, b)] == [start, start]
        pids = [c.get(r["id"])["pid"] for r in (a, b)]
        assert c.get(q1["id"])["state"] == "queued"
        server.process.send_signal(signal.SIGKILL)
        t0 = time.monotonic()
        wait_until(lambda: not any(alive(p) for p in pids), timeout=5)
        assert time.monotonic() - t0 < 1.0, "run processes outlived the server by more than a second"
        server.process.wait()
    finally:
        server.cleanup()

    restarted = LocalServer(virtual_gpus="24000", runs_dir=str(runs), extra_args=FAST)
    try:
        c = restarted.client()
        for r in (a, b):
            rec = c.get(r["id"])
            assert rec["state"] == "aborted" and rec["reason"].startswith("server_restart"), rec
            assert (runs / r["id"] / "_DONE").exists()
        done = wait_until(
            lambda: (lambda x: x if x["state"] in ("succeeded", "failed") else None)(c.get(q2["id"])), timeout=20
        )
        assert done["state"] == "succeeded"
        r1, r2 = c.get(q1["id"]), c.get(q2["id"])
        assert r1["state"] == "succeeded" and r1["started_at"] < r2["started_at"]
        listing = c.list(limit=100)
        assert sorted(r["id"] for r in listing) == sorted(r["id"] for r in (a, b, q1, q2))  # nothing lost or doubled
    finally:
        restarted.cleanup()


@pytest.mark.slow  # a server started, killed or restarted: CI runs it with -m slow (docs/install.md: the default suite stays within ten minutes)
def test_clean_shutdown_keeps_queued_runs_in_order(tmp_path):
    runs = tmp_path / "runs"
    server = LocalServer(virtual_gpus="24000", runs_dir=str(runs), extra_args=FAST)
    try:
        c = server.client()
        running = c.submit(long_run(24000))
        queued = [c.submit(short_run(24000)) for _ in range(3)]
        wait_until(lambda: c.get(running["id"])["state"] == "running")
    finally:
        server.stop()
        server.cleanup()
    job = json.loads((runs / running["id"] / "job.json").read_text())
    assert job["state"] == "aborted" and (runs / running["id"] / "_DONE").exists()

    restarted = LocalServer(virtual_gpus="24000", runs_dir=str(runs), extra_args=FAST)
    try:
        c = restarted.client()
        finals = [
            wait_until(lambda r=r: (lambda x: x if x["state"] == "succeeded" else None)(c.get(r["id"])), timeout=20)
            for r in queued
        ]
        starts = [f["started_at"] for f in finals]
        assert starts == sorted(starts), "queued runs did not keep their order across the restart"
    finally:
        restarted.cleanup()


@pytest.fixture
def stranger():
    """A live process that is not a run: its pid will be recorded as a run's, as after pid reuse."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield proc
    proc.kill()
    proc.wait()


async def test_a_recycled_pid_is_not_mistaken_for_the_run(jp_serverapp, runs_dir, stranger, jp_asyncio_loop):
    run_id = "20260101T000000.000000-abcdef"
    run = runs_dir / run_id
    write_run_dir(run, run_id, stranger.pid, psutil.Process(stranger.pid).create_time() - 3600)
    await jp_serverapp.extension_manager.start_all_extensions()
    scheduler = jp_serverapp.extension_manager.extension_points["jupyter_evalsched"].app.scheduler
    rec = scheduler.get(run_id).record
    assert rec["state"] == "aborted" and rec["reason"].startswith("server_restart")
    assert stranger.poll() is None, "an unrelated process with a recycled pid was killed"
    assert (run / "_DONE").exists()


async def test_the_runs_an_earlier_server_left_running_are_killed_before_their_records_say_so(
    jp_serverapp, runs_dir, monkeypatch, jp_asyncio_loop
):
    """Three runs whose processes (a leader and its child each) outlived their server: each group
    is killed as its run is recovered, before its record says it ended, and the restart waits
    for all of them at once, after every group was killed; each run ends aborted."""
    from jupyter_evalsched.scheduler.executors import local

    groups: dict[str, StaleGroup] = {}
    calls: list[tuple[str, object]] = []
    kill, wait = local.kill_stale_group, local.wait_stale_gone

    def killing(pid, created):
        run_id = next(r for r, g in groups.items() if g.leader.pid == pid)
        app = jp_serverapp.extension_manager.extension_points["jupyter_evalsched"].app
        calls.append(("kill", app.scheduler.get(run_id).record["state"]))  # (the record as recovery has it)
        return kill(pid, created)

    def waiting(processes, *args):
        calls.append(("wait", sorted(pid for pid, _ in processes)))
        return wait(processes, *args)

    monkeypatch.setattr(local, "kill_stale_group", killing)
    monkeypatch.setattr(local, "wait_stale_gone", waiting)
    try:
        for i in range(3):
            run_id = f"20260101T000000.000000-00000{i}"
            groups[run_id] = StaleGroup()
            write_run_dir(runs_dir / run_id, run_id, groups[run_id].leader.pid, groups[run_id].created, seq=i + 1)
        await jp_serverapp.extension_manager.start_all_extensions()
        scheduler = jp_serverapp.extension_manager.extension_points["jupyter_evalsched"].app.scheduler
        leaders = sorted(g.leader.pid for g in groups.values())
        assert calls == [("kill", "running")] * 3 + [("wait", leaders)], calls
        for run_id, group in groups.items():
            assert group.leader.wait(timeout=10) == -9
            wait_until(lambda group=group: not alive(group.child), timeout=10)
            rec = scheduler.get(run_id).record
            assert rec["state"] == "aborted" and rec["reason"].startswith("server_restart"), rec
    finally:
        for group in groups.values():
            group.close()


def stuck_restart(monkeypatch, stuck_s: float) -> list[tuple[str, float]]:
    """A restart's wait for what the earlier server's runs left made to last ``stuck_s`` more (a
    process stuck in an uninterruptible wait), and every launch of a run recorded: the list of
    ("wait from" | "wait to" | "launch", ``time.monotonic()``) it returns fills as they happen."""
    from jupyter_evalsched.scheduler.executors import local

    wait, launch = local.wait_stale_gone, local.LocalExecutor.launch
    events: list[tuple[str, float]] = []

    def stuck_then_wait(processes, *args):
        events.append(("wait from", time.monotonic()))
        time.sleep(stuck_s)
        try:
            return wait(processes, *args)
        finally:
            events.append(("wait to", time.monotonic()))

    def launching(self, run):
        events.append(("launch", time.monotonic()))
        return launch(self, run)

    monkeypatch.setattr(local, "wait_stale_gone", stuck_then_wait)
    monkeypatch.setattr(local.LocalExecutor, "launch", launching)
    return events


async def test_a_restart_waits_for_what_runs_left_off_the_event_loop(
    jp_serverapp, runs_dir, monkeypatch, jp_asyncio_loop
):
    """A process an earlier server's run left can take seconds to die (an uninterruptible wait:
    a GPU driver's teardown). The restart waits for it in a thread: the event loop, which serves
    the whole Jupyter server (its kernels, its other extensions), keeps turning meanwhile, and
    still no run starts before the wait is over: neither a queued run of the same directory nor
    one whose retry's back-off ends during the wait (its start would have been killed as an
    escape of the earlier run, whose clean-up searches for its run id)."""
    stuck_s = 1.5
    events = stuck_restart(monkeypatch, stuck_s)
    left, queued, retried = (f"20260101T000000.000000-00000{c}" for c in "abc")
    group = StaleGroup()
    ticks, ticker = loop_ticker()
    try:
        write_run_dir(runs_dir / left, left, group.leader.pid, group.created, seq=1)
        write_run_dir(runs_dir / queued, queued, None, None, seq=2, state="queued", started_at=None, entrypoint=NOOP)
        soon = datetime.now(UTC) + timedelta(seconds=stuck_s / 5)
        write_run_dir(
            runs_dir / retried,
            retried,
            None,
            None,
            seq=3,
            state="queued",
            started_at=None,
            entrypoint=NOOP,
            retry_at=soon.isoformat(),
        )
        await jp_serverapp.extension_manager.start_all_extensions()
        scheduler = jp_serverapp.extension_manager.extension_points["jupyter_evalsched"].app.scheduler
        assert [name for name, _ in events[:2]] == ["wait from", "wait to"], events
        waited_from, waited_to = events[0][1], events[1][1]
        during = [t for t in ticks if waited_from <= t <= waited_to]
        gaps = [b - a for a, b in itertools.pairwise([waited_from, *during, waited_to])]
        assert len(during) > 10 and max(gaps) < 0.5, (
            f"the event loop stood still while the restart waited: {len(during)} turns in"
            f" {waited_to - waited_from:.2f} s, the longest gap {max(gaps):.2f} s"
        )
        assert group.leader.wait(timeout=10) == -9
        for run_id in (queued, retried):
            await async_wait_until(
                lambda run_id=run_id: scheduler.get(run_id).record["state"] == "succeeded", timeout=30
            )
        launched = [at for name, at in events if name == "launch"]
        assert len(launched) == 2 and min(launched) > waited_to, events
        assert scheduler.get(left).record["state"] == "aborted"
    finally:
        ticker.cancel()
        group.close()


async def test_a_detached_run_that_ends_while_the_server_starts_keeps_its_verdict(jp_serverapp, runs_dir, monkeypatch):
    """A detached run that finishes after the restarted server looked at its directory (no
    ``_DONE`` yet) but before its process was checked is judged by its own ``_DONE``, not aborted."""
    from jupyter_evalsched.store import RunStore

    run_id = "20260101T000000.000000-dddddd"
    run = runs_dir / run_id
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    write_run_dir(run, run_id, ended.pid, 1.0, detach=True, progress={"done": 1, "total": 2})
    scan = RunStore.scan

    def scan_then_the_run_ends(self):
        found = scan(self)
        # What the runner does last, just after the look: its final summary, then _DONE; then it exits.
        summary = {"status": "succeeded", "episodes_done": 2, "episodes_total": 2, "metrics": {"score": 0.5}}
        (run / "summary.json").write_text(json.dumps(summary))
        (run / "_DONE").write_text("")
        return found

    monkeypatch.setattr(RunStore, "scan", scan_then_the_run_ends)
    await jp_serverapp.extension_manager.start_all_extensions()
    scheduler = jp_serverapp.extension_manager.extension_points["jupyter_evalsched"].app.scheduler
    rec = scheduler.get(run_id).record
    assert rec["state"] == "succeeded", rec
    assert rec["progress"] == {"done": 2, "total": 2} and rec["metrics"] == {"score": 0.5}
    assert json.loads((run / "job.json").read_text())["state"] == "succeeded"


async def test_recovery_tolerates_garbage(jp_serverapp, runs_dir):
    runs_dir.mkdir(parents=True)
    (runs_dir / "broken").mkdir()
    (runs_dir / "broken" / "job.json").write_text("{not json")
    (runs_dir / ".staging-20260101T000000.000000-aaaaaa").mkdir()  # a submission never acknowledged
    (runs_dir / "a-file").write_text("x")
    os.symlink("/etc", runs_dir / "evil")
    await jp_serverapp.extension_manager.start_all_extensions()
    scheduler = jp_serverapp.extension_manager.extension_points["jupyter_evalsched"].app.scheduler
    assert scheduler.counts["total"] == 0
    assert (runs_dir / "broken" / "job.json").read_text() == "{not json"  # left as it was
    assert not (runs_dir / ".staging-20260101T000000.000000-aaaaaa").exists()


@pytest.mark.parametrize("detach", [False, True])
async def test_a_run_that_finalized_unwatched_without_a_verdict_is_judged_by_its_kind(jp_serverapp, runs_dir, detach):
    """Issue #30 (11): a run found with its ``_DONE`` but no verdict in its summary (no exit status
    either: it ended while no server watched) fails ``exit_code:unknown``; only a detached run's
    reason says it was detached."""
    run_id = "20260101T000000.000000-eeeeee"
    run = runs_dir / run_id
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    write_run_dir(run, run_id, ended.pid, 1.0, detach=detach)
    (run / "_DONE").write_text("")
    await jp_serverapp.extension_manager.start_all_extensions()
    scheduler = jp_serverapp.extension_manager.extension_points["jupyter_evalsched"].app.scheduler
    rec = scheduler.get(run_id).record
    assert rec["state"] == "failed" and rec["reason"].startswith("exit_code:unknown"), rec
    assert ("detached" in rec["reason"]) == detach, rec
    if not detach:
        assert "while no server watched it" in rec["reason"], rec


async def test_a_server_stopped_while_the_restart_waits_stays_stopped(
    jp_serverapp, runs_dir, monkeypatch, jp_asyncio_loop, caplog
):
    """The extension stops (the server shuts down) while its start still waits for what an
    earlier server's runs left. The stop waits for that start (its clean-up kills by run id and
    must not outlive this server's hold on the runs directory, which another server may take at
    once), admits nothing meanwhile, and then stops what it started: no run started, no periodic
    task or timer left (none to take the runs directory again later), the directory released and
    this server not advertised, no error logged."""
    events = stuck_restart(monkeypatch, 1.0)
    left, queued = (f"20260101T000000.000000-00000{c}" for c in "ab")
    group = StaleGroup()
    try:
        write_run_dir(runs_dir / left, left, group.leader.pid, group.created, seq=1)
        write_run_dir(runs_dir / queued, queued, None, None, seq=2, state="queued", started_at=None, entrypoint=NOOP)
        ext = jp_serverapp.extension_manager.extension_points["jupyter_evalsched"].app
        starting = asyncio.ensure_future(jp_serverapp.extension_manager.start_all_extensions())
        await async_wait_until(lambda: events, timeout=30)  # (recovered, and in the wait)
        assert ext.role.is_primary and [name for name, _ in events] == ["wait from"]
        await ext.stop_extension()
        events.append(("stopped", time.monotonic()))
        await starting
        assert [name for name, _ in events] == ["wait from", "wait to", "stopped"], events
        scheduler = ext.scheduler
        assert not scheduler.started and scheduler._tasks == []
        assert scheduler.get(queued).record["state"] == "queued"
        assert ext._watch is None and not ext.role.is_primary
        primary = ext.role.primary()
        assert primary is None or primary.pid != os.getpid(), primary
        await asyncio.sleep(ext.promotion_interval_s * 1.5)  # (a role check would have come by now)
        assert not ext.role.is_primary and [name for name, _ in events] == ["wait from", "wait to", "stopped"]
        errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR and "evalsched" in r.name]
        assert errors == [], errors
    finally:
        group.close()
