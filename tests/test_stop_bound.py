"""The scheduler's stop waits for its I/O threads off the event loop, and for a bounded time: a
call stuck in one (an ``sbatch`` or ``scancel`` on a slurmctld that does not answer, a write to a
stalled disk) neither stands the whole Jupyter server still nor holds the stop past its cap."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
import time
from pathlib import Path

import pytest
from waiting import async_wait_until, loop_ticker

from jupyter_evalsched.scheduler import service
from jupyter_evalsched.scheduler.errors import Unavailable
from jupyter_evalsched.store import CANCELLED_SWEEPS_FILE, RunsDirMoved, RunStore


async def test_a_call_stuck_in_an_io_thread_holds_neither_the_loop_nor_the_stop(
    jp_serverapp, evalsched, runs_dir, monkeypatch, caplog, api
):
    """The stop shut the I/O pool down with ``wait=True`` on the event loop: a call stuck in one
    of its threads held the loop (kernels, other extensions, any cap the stop's callers set) for
    as long as it took. The loop now keeps turning while the stop waits, the stop ends at its cap
    with a warning that names the call, and what the call writes once it ends is refused (the runs
    directory is released by then)."""
    monkeypatch.setattr(service, "IO_END_WAIT_S", 3.0)
    ext = jp_serverapp.extension_manager.extension_points["jupyter_evalsched"].app
    scheduler = evalsched
    held = threading.Event()
    release = threading.Event()

    def stuck_scancel(job_id: str) -> None:
        held.set()
        release.wait(60)
        scheduler.store.write_cancelled_sweeps([("late-sweep", None)])

    stuck = scheduler._io.submit(stuck_scancel, "4242")
    assert held.wait(30)

    async def meanwhile(stopping: asyncio.Future) -> None:
        # While the stop waits for the call: a request is told the server stops (it was told
        # "starting"), and one that reaches the closed I/O threads gets a 503, not a 500.
        await async_wait_until(lambda: not scheduler.started or stopping.done(), timeout=30)
        code, answer = await api("GET", "runs")
        assert code == 503 and "stopping" in answer["message"], answer
        with pytest.raises(Unavailable, match="stopping"):
            scheduler._io.submit(time.sleep, 0)

    warnings = await _stop_while_held(ext, release, caplog, meanwhile)
    assert len(warnings) == 1 and "stuck_scancel(4242) (running)" in warnings[0], warnings
    with pytest.raises(RunsDirMoved):
        await asyncio.wrap_future(stuck)
    path = runs_dir / CANCELLED_SWEEPS_FILE
    assert not path.exists() or "late-sweep" not in json.dumps(json.loads(path.read_text()))


async def test_a_writer_stuck_on_the_disk_holds_neither_the_loop_nor_the_stop(
    jp_serverapp, evalsched, runs_dir, monkeypatch, caplog, api
):
    """The stop wrote the terminal records still waiting and joined the writer's thread on the
    event loop: a write stuck on the disk (a stalled NFS server) held the loop and the stop for as
    long as it took. The loop now keeps turning while the writer ends, the stop ends at its cap
    with a warning that names the writer, and the directory it was making when the disk came
    back is refused, not made after the stop."""
    monkeypatch.setattr(service, "IO_END_WAIT_S", 2.0)
    ext = jp_serverapp.extension_manager.extension_points["jupyter_evalsched"].app
    scheduler = evalsched
    held, release = threading.Event(), threading.Event()
    create_many = scheduler.store.create_many

    def stuck_create_many(runs):
        if threading.current_thread().name == "evalsched-writer":
            held.set()
            release.wait(60)
        return create_many(runs)

    monkeypatch.setattr(scheduler.store, "create_many", stuck_create_many)
    before = _run_dirs(runs_dir)
    submitting = asyncio.ensure_future(api("POST", "runs", {"entrypoint": "jupyter_evalsched.examples.basic:noop"}))
    await async_wait_until(held.is_set, timeout=30)
    warnings = await _stop_while_held(ext, release, caplog)
    assert len(warnings) == 1 and "the run writer's thread" in warnings[0], warnings
    # The disk is back (released above): the writer goes on, and its directory is refused.
    code, answer = await asyncio.wait_for(submitting, 30)
    assert code == 503 and "came too late" in answer["message"], (code, answer)
    await async_wait_until(lambda: not any(t.name == "evalsched-writer" for t in threading.enumerate()), timeout=30)
    assert _run_dirs(runs_dir) == before


def _run_dirs(runs_dir):
    return sorted(p.name for p in runs_dir.iterdir() if not p.name.startswith("."))


async def _stop_while_held(ext, release: threading.Event, caplog, meanwhile=None) -> list[str]:
    """The extension stopped while ``release`` is not set (it is, 20 s later at most: well after
    the cap, so that a stop that waits for it ends at all; and on return): the stop did not wait
    for it and the event loop turned meanwhile. ``meanwhile(stopping)`` runs during the stop.
    The stop's warnings of what it stopped waiting for."""
    releaser = threading.Timer(20.0, release.set)
    releaser.start()
    ticks, ticker = loop_ticker()
    try:
        await asyncio.sleep(0.05)
        caplog.set_level(logging.WARNING, logger="jupyter_evalsched")
        began = time.monotonic()
        stopping = asyncio.ensure_future(ext.stop_extension())
        if meanwhile is not None:
            await meanwhile(stopping)
        await stopping
        ended = time.monotonic()
        assert not release.is_set(), f"the stop waited for what was held ({ended - began:.1f} s)"
        during = [t for t in ticks if began < t < ended]
        assert len(during) >= 5, f"the event loop stood still during the stop: {len(during)} turns"
        return [r.getMessage() for r in caplog.records if "did not end within" in r.getMessage()]
    finally:
        ticker.cancel()
        releaser.cancel()
        release.set()


@pytest.mark.parametrize("write", ["job.json", "run directory", "cancelled sweeps"])
def test_a_write_refused_while_it_waited_for_the_disk_leaves_nothing(tmp_path, monkeypatch, write):
    """Writes are refused once the stop stops waiting for them (or the runs directory moved); a
    write already past that check, stuck in its ``fsync`` (a stalled disk) when the refusal came,
    used to land once the disk came back, after the runs directory was released. It now checks
    again before its rename puts anything in place: what was there stays, and nothing is left."""
    store = RunStore(tmp_path / "runs", fsync=True)
    store.ensure()
    store.create("20261207T000000.000000-aaaaaa", {"job.json": b'{"state": "queued"}'})
    before = {p.relative_to(store.root): p.read_bytes() for p in store.root.rglob("*") if p.is_file()}
    fsync = os.fsync

    def fsync_while_the_stop_refuses(fd: int) -> None:
        store.refuse_writes("the scheduler stopped; this write came too late")
        fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync_while_the_stop_refuses)
    with pytest.raises(RunsDirMoved, match="came too late"):
        if write == "job.json":
            store.write_job("20261207T000000.000000-aaaaaa", {"state": "aborted"})
        elif write == "run directory":
            store.assemble("20261207T000000.000000-bbbbbb", {"job.json": b"{}", "spec.json": b"{}"})
        else:
            store.write_cancelled_sweeps([("late-sweep", None)])
    after = {p.relative_to(store.root): p.read_bytes() for p in store.root.rglob("*") if p.is_file()}
    assert after == before
    assert sorted(p.name for p in store.root.iterdir()) == ["20261207T000000.000000-aaaaaa"]


async def test_the_cgroups_removed_at_the_stop_hold_no_loop(jp_serverapp, evalsched, monkeypatch):
    """The stop removed the runs' cgroups (the removals still queued after a churn of short runs,
    each a reclaim that can sleep in the kernel, then the namespace) on the event loop: the whole
    server stood still meanwhile. They are removed in a thread now, and the stop waits for them."""
    ext = jp_serverapp.extension_manager.extension_points["jupyter_evalsched"].app
    local = evalsched.executors["local"]
    release = threading.Event()
    released: list[bool] = []
    release_cgroups = local._release_cgroups

    def slow_release(*args):
        release.wait(20)
        released.append(release.is_set())
        release_cgroups(*args)

    monkeypatch.setattr(local, "_release_cgroups", slow_release)
    ticks, ticker = loop_ticker()
    opener = asyncio.get_running_loop().call_later(1.0, release.set)
    try:
        began = time.monotonic()
        await ext.stop_extension()
        ended = time.monotonic()
    finally:
        ticker.cancel()
        opener.cancel()
        release.set()
    # Released by a timer on the loop: only a loop that turned while the cgroups went could.
    assert released == [True], f"the loop stood still while the cgroups were removed ({ended - began:.1f} s)"
    assert len([t for t in ticks if began < t < ended]) >= 5


GATE = f"{Path(__file__).resolve().parent / 'evals_observed.py'}:gate"  # runs until its gate opens


async def test_a_slow_disk_that_still_writes_is_waited_for_whole(
    jp_serverapp, evalsched, runs_dir, tmp_path, monkeypatch, api
):
    """The stop's bound is for a disk that hangs, not one that is slow: each of these runs'
    terminal records takes longer to write than a tenth of the bound, and all of them together
    longer than the bound, yet every record is on disk when the stop returns (with a bound on the
    whole wait, the last ones were given up on, and the next server found those runs running)."""
    monkeypatch.setattr(service, "IO_END_WAIT_S", 1.0)
    ext = jp_serverapp.extension_manager.extension_points["jupyter_evalsched"].app
    ids = []
    for _ in range(6):
        code, rec = await api("POST", "runs", {"entrypoint": GATE, "params": {"gate": str(tmp_path / "never")}})
        assert code == 201, rec
        ids.append(rec["id"])
    await async_wait_until(lambda: all(evalsched.get(i).state == "running" for i in ids), timeout=60)
    write_job = evalsched.store.write_job

    def slow_write_job(run_id, record):
        if threading.current_thread().name == "evalsched-writer":
            time.sleep(0.3)
        write_job(run_id, record)

    monkeypatch.setattr(evalsched.store, "write_job", slow_write_job)
    began = time.monotonic()
    await ext.stop_extension()
    took = time.monotonic() - began
    states = [json.loads((runs_dir / i / "job.json").read_bytes())["state"] for i in ids]
    assert states == ["aborted"] * 6, (states, f"the stop took {took:.1f} s")
    assert all((runs_dir / i / "_DONE").exists() for i in ids)
    # Nothing is written for a stopped scheduler (a start the stop stopped waiting for goes on).
    with pytest.raises(RunsDirMoved, match="came too late"):
        write_job(ids[0], {"state": "queued"})
