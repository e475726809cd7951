"""Issue #29: the writer's thread writes run directories off the event loop (``scheduler/writer.py``).

Concurrent submissions are written in one batch, each answered once its own directory is on disk;
a directory that cannot be written fails that submission alone, with a JSON error. Terminal
records (``job.json``, then ``_DONE``) are written by the same thread, in order per run: a later
write for the run (a requeue, a deletion) takes a waiting one back or waits for it; an API call
that ends a run (cancel, a sweep's cancel) answers once the record is on disk.

The writes are slowed or held at the file-write boundary (``RunStore.assemble``,
``RunStore.write_job``): an answer given before its write would then see the disk without it.
No figure of time is asserted.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import threading
import time

from rest import NOOP, SLEEPY, spec, submit
from waiting import async_wait_until

from jupyter_evalsched import store as store_module
from jupyter_evalsched.scheduler import runs as runs_module
from jupyter_evalsched.scheduler import submission as submission_module
from jupyter_evalsched.scheduler.attempts import Requeue
from jupyter_evalsched.scheduler.runs import Run, RunTable, new_record
from jupyter_evalsched.scheduler.writer import RunWriter
from jupyter_evalsched.schemas import EvalSpec
from jupyter_evalsched.store import STAGING_PREFIX, RunStore, StoreBug, StoreError, new_run_id


def _complete_on_disk(runs_dir, run_id: str) -> bool:
    job = runs_dir / run_id / "job.json"
    return (runs_dir / run_id / "spec.json").is_file() and job.is_file() and json.loads(job.read_text())["id"] == run_id


def _staging_left(runs_dir) -> list[str]:
    return [name for name in os.listdir(runs_dir) if name.startswith(STAGING_PREFIX)]


def _slowed_assemble(store, monkeypatch, hold_first: threading.Event | None = None) -> list[str]:
    """Each run directory written a little later than it would be (the first one, with
    ``hold_first``, only once it is set); returns the ids in the order written."""
    assemble = store.assemble
    written: list[str] = []

    def slowed(run_id, files):
        if hold_first is not None and not written:
            hold_first.wait(30)
        time.sleep(0.01)
        written.append(run_id)
        return assemble(run_id, files)

    monkeypatch.setattr(store, "assemble", slowed)
    return written


async def _post_all(jp_fetch, bodies: list[dict]) -> list[asyncio.Future]:
    return [
        asyncio.ensure_future(jp_fetch("evalsched", "runs", method="POST", body=json.dumps(body), raise_error=False))
        for body in bodies
    ]


async def test_each_concurrent_submission_is_on_disk_when_it_is_answered(
    jp_fetch, api, evalsched, runs_dir, monkeypatch
):
    """Eight submissions at once (the test client's most): the first is held until all are with
    the writer, so the others are written as one batch; each answer finds its whole directory on
    disk."""
    gate = await submit(api, spec(entry=SLEEPY, episodes=1, sleep_s=3600))
    body = {"entrypoint": NOOP, "episodes": 1, "depends_on": [gate["id"]]}
    release = threading.Event()
    written = _slowed_assemble(evalsched.store, monkeypatch, hold_first=release)
    pending = await _post_all(jp_fetch, [body] * 8)
    creating = evalsched.submissions._creating
    await async_wait_until(lambda: len(creating) == 8, timeout=10, message="not every submission reached the writer")
    release.set()
    answered = []
    for next_answer in asyncio.as_completed(pending):
        resp = await next_answer
        assert resp.code == 201, resp.body
        rec = json.loads(resp.body)
        assert _complete_on_disk(runs_dir, rec["id"]), f"run {rec['id']} was answered before its directory was on disk"
        answered.append(rec["id"])
    assert sorted(answered) == sorted(written)
    assert _staging_left(runs_dir) == []
    code, listed = await api("GET", "runs", params={"state": "queued", "limit": "100"})
    assert set(answered) <= {r["id"] for r in listed["runs"]}
    await api("POST", f"runs/{gate['id']}/cancel")


async def test_a_directory_that_cannot_be_written_fails_its_submission_alone(
    jp_fetch, api, evalsched, runs_dir, monkeypatch
):
    """Eight submissions in one batch; one run's path is taken already (a directory someone left
    there): that submission is a 503 saying so, the seven others are made, and nothing is left
    of the failed one but what was there before."""
    ids = [f"20260101T000000.00000{i}-abcdef" for i in range(8)]
    doomed = ids[4]
    (runs_dir / doomed).mkdir(parents=True)
    (runs_dir / doomed / "keep").write_text("not the server's")
    handed_out = iter(ids)
    monkeypatch.setattr(submission_module, "new_run_id", lambda: next(handed_out))
    release = threading.Event()
    _slowed_assemble(evalsched.store, monkeypatch, hold_first=release)
    pending = await _post_all(jp_fetch, [spec(entry=NOOP)] * 8)
    creating = evalsched.submissions._creating
    await async_wait_until(lambda: len(creating) == 8, timeout=10, message="not every submission reached the writer")
    release.set()
    answers = [await resp for resp in pending]
    made = [json.loads(r.body)["id"] for r in answers if r.code == 201]
    failed = [json.loads(r.body) for r in answers if r.code != 201]
    assert sorted(made) == sorted(set(ids) - {doomed})
    assert [r.code for r in answers].count(503) == 1 and len(failed) == 1
    assert failed[0]["message"] == (
        f"cannot create the directory of run {doomed}: {runs_dir / doomed} exists already"
    ), failed[0]
    assert all(_complete_on_disk(runs_dir, run_id) for run_id in made)
    assert os.listdir(runs_dir / doomed) == ["keep"]
    assert _staging_left(runs_dir) == []
    assert (await api("GET", f"runs/{doomed}"))[0] == 404
    for run_id in made:
        await wait_for_end(api, run_id)


async def test_a_bug_while_writing_answers_500_not_retry(api, evalsched, runs_dir, monkeypatch, caplog):
    """A bug of ours while a run directory is written (in one directory, or in the whole batch)
    is no full disk: the answer is a 500 with a message that says no more than that, not a 503
    that tells the client to retry (it would, and meet the bug again). What the failed write made
    is gone: the staging directory of the one, the directories of a batch that failed after
    they were renamed into place."""
    store = evalsched.store
    message = "cannot write the run directory: an internal error (the server's log says which)"
    fill = store._fill

    def broken_fill(staging, files, root):
        fill(staging, files, root)  # (the files are there, in the staging directory)
        raise TypeError("a bug in one directory")

    monkeypatch.setattr(store, "_fill", broken_fill)
    code, body = await api("POST", "runs", spec(entry=NOOP))
    assert (code, body["message"]) == (500, message), (code, body)
    monkeypatch.setattr(store, "_fill", fill)
    create_many = store.create_many

    def broken_batch(runs):
        create_many(runs)  # (renamed into place)
        raise RuntimeError("a bug in the batch")

    monkeypatch.setattr(store, "create_many", broken_batch)
    code, body = await api("POST", "runs", spec(entry=NOOP))
    assert (code, body["message"]) == (500, message), (code, body)
    code, body = await api("POST", "sweeps", {**spec(entry=NOOP), "sweep": {"seed": [1, 2]}})
    assert (code, body["message"]) == (500, message), (code, body)
    for bug in ("a bug in one directory", "a bug in the batch"):
        assert any(r.exc_info and str(r.exc_info[1]) == bug for r in caplog.records), f"{bug!r} was not logged"
    assert [e for e in os.listdir(runs_dir) if not e.startswith(".")] == []
    assert _staging_left(runs_dir) == []
    assert (await api("GET", "runs"))[1]["runs"] == []


async def wait_for_end(api, run_id: str) -> None:
    async def ended() -> bool:
        return (await api("GET", f"runs/{run_id}"))[1]["state"] in ("succeeded", "failed", "cancelled", "aborted")

    await async_wait_until(ended, timeout=30, message=f"run {run_id} did not end")


def test_a_batch_syncs_the_runs_directory_once_and_fails_one_run_alone(tmp_path, monkeypatch):
    synced: list[str] = []
    real_fsync = os.fsync

    def recording_fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    store = RunStore(tmp_path / "runs", fsync=True)
    store.ensure()
    ids = [f"20260101T000000.00000{i}-abcdef" for i in range(3)]
    (store.root / f"{STAGING_PREFIX}{ids[1]}").mkdir()  # a staging directory that is not ours
    files = {"spec.json": b"{}", "job.json": b"{}"}
    errors = store.create_many([(run_id, files) for run_id in ids])
    assert errors[0] is None and errors[2] is None
    assert isinstance(errors[1], StoreError) and "exists already" in str(errors[1])
    root = str(store.root)
    assert synced.count(root) == 1 and synced[-1] == root  # one fsync for both renames, after them
    for run_id in (ids[0], ids[2]):
        staged = str(store.root / f"{STAGING_PREFIX}{run_id}")
        assert synced.count(staged) == 1  # each directory's entries, before its rename
        assert sorted(os.listdir(store.run_dir(run_id))) == ["job.json", "spec.json"]
    assert not store.run_dir(ids[1]).exists()
    assert (store.root / f"{STAGING_PREFIX}{ids[1]}").is_dir()  # left as it was found


def _assembled_on(store: RunStore, monkeypatch) -> dict[str, str]:
    """Which thread assembles each run directory of ``store``."""
    threads: dict[str, str] = {}
    assemble = store.assemble

    def recording_assemble(run_id: str, files: dict[str, bytes]):
        threads[run_id] = threading.current_thread().name
        return assemble(run_id, files)

    monkeypatch.setattr(store, "assemble", recording_assemble)
    return threads


def test_a_batch_is_assembled_by_one_thread_until_the_disk_makes_it_wait(tmp_path, monkeypatch):
    """Without fsync the writer's thread assembles a batch itself; once a directory has taken it
    longer than ``SLOW_DIRECTORY_CPU_S`` (a disk that makes each creation costly), the rest goes
    to the pool (not a last one alone: that would overlap nothing). With fsync the whole batch
    goes to the pool at once (each fsync waits for the disk). Either way a run that cannot be
    written fails alone, in its place, and every other run's directory is whole."""
    files = {"spec.json": b"{}", "job.json": b"{}"}
    me = threading.current_thread().name

    def batch(store: RunStore, n: int, doomed: int | None = None) -> list[str]:
        ids = [new_run_id() for _ in range(n)]
        if doomed is not None:  # a staging directory that is not ours: that run cannot be made
            (store.root / f"{STAGING_PREFIX}{ids[doomed]}").mkdir()
        errors = store.create_many([(run_id, files) for run_id in ids])
        assert [i for i, error in enumerate(errors) if error is not None] == ([] if doomed is None else [doomed])
        if doomed is not None:
            assert isinstance(errors[doomed], StoreError) and "exists already" in str(errors[doomed])
            assert not store.run_dir(ids[doomed]).exists()
            assert (store.root / f"{STAGING_PREFIX}{ids[doomed]}").is_dir()  # left as it was found
        for i, run_id in enumerate(ids):
            if i != doomed:
                assert sorted(os.listdir(store.run_dir(run_id))) == ["job.json", "spec.json"]
        return ids

    store = RunStore(tmp_path / "plain")
    store.ensure()
    threads = _assembled_on(store, monkeypatch)
    monkeypatch.setattr(store_module, "SLOW_DIRECTORY_CPU_S", 3600.0)
    monkeypatch.setattr(store_module, "SLOW_DIRECTORY_S", 3600.0)
    ids = batch(store, 6, doomed=3)
    assert [threads[run_id] for run_id in ids] == [me] * 6

    def on(ids: list[str]) -> list[str]:
        return ["pool" if threads[run_id].startswith("evalsched-create") else threads[run_id] for run_id in ids]

    monkeypatch.setattr(store_module, "SLOW_DIRECTORY_CPU_S", -1.0)  # every directory costs too much
    assert on(batch(store, 6, doomed=3)) == [me] + ["pool"] * 5
    assert on(batch(store, 3)) == [me, "pool", "pool"]
    assert on(batch(store, 2)) == [me, me]
    monkeypatch.setattr(store_module, "SLOW_DIRECTORY_CPU_S", 3600.0)
    monkeypatch.setattr(store_module, "SLOW_DIRECTORY_S", -1.0)  # every directory takes too long
    assert on(batch(store, 4)) == [me, "pool", "pool", "pool"]
    monkeypatch.setattr(store_module, "SLOW_DIRECTORY_S", 3600.0)

    synced = RunStore(tmp_path / "synced", fsync=True)
    synced.ensure()
    threads = _assembled_on(synced, monkeypatch)
    monkeypatch.setattr(store_module, "SLOW_DIRECTORY_CPU_S", 3600.0)
    ids = batch(synced, 4, doomed=1)
    assert all(threads[run_id].startswith("evalsched-create") for run_id in ids)
    ids = batch(synced, 1)  # a batch of one: no hand-off
    assert threads[ids[0]] == me


def test_a_bug_while_assembling_fails_that_run_alone(tmp_path, monkeypatch, caplog):
    """Anything but a StoreError raised while one directory is assembled (a bug of ours) fails
    that run alone, with a StoreError that says no more than that (the log has the rest), on the
    writer's thread and in the pool alike."""
    files = {"spec.json": b"{}", "job.json": b"{}"}
    monkeypatch.setattr(store_module, "SLOW_DIRECTORY_CPU_S", 3600.0)
    monkeypatch.setattr(store_module, "SLOW_DIRECTORY_S", 3600.0)
    for fsync in (False, True):  # on this thread; with fsync, on the pool
        store = RunStore(tmp_path / f"runs-{fsync}", fsync=fsync)
        store.ensure()
        threads = _assembled_on(store, monkeypatch)
        ids = [new_run_id() for _ in range(4)]
        runs = [(run_id, files) for run_id in ids]
        runs[2] = (ids[2], {"spec.json": "not bytes"})  # type: ignore[dict-item]
        caplog.clear()
        errors = store.create_many(runs)
        assert [i for i, error in enumerate(errors) if error is not None] == [2]
        assert isinstance(errors[2], StoreBug) and "internal error" in str(errors[2])
        assert "TypeError" not in str(errors[2])
        assert any(ids[2] in r.getMessage() and r.exc_info and r.exc_info[0] is TypeError for r in caplog.records)
        assert not store.run_dir(ids[2]).exists()
        assert _staging_left(store.root) == []
        for i in (0, 1, 3):
            assert sorted(os.listdir(store.run_dir(ids[i]))) == ["job.json", "spec.json"]
        pooled = [threads[run_id].startswith("evalsched-create") for run_id in ids]
        assert pooled == [fsync] * 4


def test_runs_the_pool_cannot_take_are_assembled_on_the_writers_thread(tmp_path, monkeypatch):
    """When the pool cannot start another thread (or the interpreter is shutting down), the runs
    it did not take are assembled on this thread: none is lost, none is made twice."""
    from concurrent.futures import ThreadPoolExecutor

    files = {"spec.json": b"{}", "job.json": b"{}"}
    store = RunStore(tmp_path / "runs", fsync=True)
    store.ensure()
    threads = _assembled_on(store, monkeypatch)
    submit = ThreadPoolExecutor.submit
    taken: list[int] = []

    def submit_twice(self, fn, *args, **kwargs):
        if len(taken) == 2:
            raise RuntimeError("can't start new thread")
        taken.append(1)
        return submit(self, fn, *args, **kwargs)

    monkeypatch.setattr(ThreadPoolExecutor, "submit", submit_twice)
    ids = [new_run_id() for _ in range(5)]
    assert store.create_many([(run_id, files) for run_id in ids]) == [None] * 5
    for run_id in ids:
        assert sorted(os.listdir(store.run_dir(run_id))) == ["job.json", "spec.json"]
    assert [threads[run_id].startswith("evalsched-create") for run_id in ids] == [True, True, False, False, False]
    assert _staging_left(store.root) == []


def test_a_submission_is_acknowledged_only_in_the_runs_directory_the_server_holds(tmp_path):
    """The runs directory is moved away and a link put at its path: the directories of the
    submissions made until the server notices (it checks every ``promotion_interval_s``) are made
    in the directory it holds, where a server restarted on it (as the error says) finds them, not
    in the link's target. They used to go where the path led, acknowledged and then lost."""
    files = {"spec.json": b"{}", "job.json": b"{}"}
    runs, held, elsewhere = tmp_path / "runs", tmp_path / "runs.old", tmp_path / "elsewhere"
    for fsync in (False, True):
        store = RunStore(runs, fsync=fsync)
        store.ensure()
        elsewhere.mkdir()
        os.rename(runs, held)
        os.symlink(elsewhere, runs)
        try:
            ids = [new_run_id() for _ in range(3)]
            assert store.create_many([(run_id, files) for run_id in ids]) == [None] * 3
            assert sorted(os.listdir(held)) == sorted(ids) and os.listdir(elsewhere) == []
        finally:
            store.close()
            os.unlink(runs)
            shutil.rmtree(held)
            elsewhere.rmdir()


# ----------------------------------------------------------------------------- terminal writes


def _queued_runs(tmp_path, n: int, writer: bool) -> tuple[RunStore, RunTable, list[Run]]:
    store = RunStore(tmp_path / "runs")
    store.ensure()
    table = RunTable(store, RunWriter(store) if writer else None)
    runs = []
    for _ in range(n):
        run_id = new_run_id()
        spec_dict = EvalSpec(entrypoint=NOOP).model_dump(mode="json")
        record = new_record(
            run_id, spec_dict, seq=table.next_seq(), executor="local", run_dir=str(store.run_dir(run_id))
        )
        store.create(run_id, {"spec.json": json.dumps(spec_dict).encode(), "job.json": json.dumps(record).encode()})
        run = Run(record=record, spec=spec_dict, submitted_ts=0.0)
        table.add(run)
        runs.append(run)
    return store, table, runs


def _on_disk(store: RunStore, run_id: str) -> tuple[str, bool]:
    record = json.loads((store.run_dir(run_id) / "job.json").read_text())
    return record["state"], store.done_exists(run_id)


async def test_terminal_writes_keep_their_order_per_run(tmp_path, monkeypatch):
    """A run ends and the writer is held in its job.json; five more end in one block meanwhile. A
    requeue of a run whose terminal write waits in the queue makes that write first, then
    "queued"; a requeue of the run being written waits for it; a deleted run's write is settled
    before its directory goes. Every other run ends on disk with its terminal job.json, then
    _DONE."""
    store, table, runs = _queued_runs(tmp_path, 6, writer=True)
    assert table.writer is not None
    table.writer.bind(asyncio.get_running_loop())
    entered, release = threading.Event(), threading.Event()
    write_job = store.write_job
    order: list[tuple[str, str]] = []

    def held_write_job(run_id, record):
        if run_id == runs[0].id and not entered.is_set():
            entered.set()
            release.wait(30)
        order.append((run_id, (json.loads(record) if isinstance(record, bytes) else record)["state"]))
        write_job(run_id, record)

    mark_done = store.mark_done

    def recorded_mark_done(run_id):
        order.append((run_id, "_DONE"))
        mark_done(run_id)

    monkeypatch.setattr(store, "write_job", held_write_job)
    monkeypatch.setattr(store, "mark_done", recorded_mark_done)
    try:
        table.finish(runs[0], "failed", "failed: by the test")
        await async_wait_until(entered.is_set, timeout=10, message="the writer never began")
        with table.deferring_writes():  # these wait in the queue meanwhile
            for run in runs[1:]:
                table.finish(run, "failed", "failed: by the test")
        assert table.writes_waiting == 6

        queued_again = runs[2]
        assert table.requeue(queued_again, Requeue(why=None, fields={}))
        assert _on_disk(store, queued_again.id) == ("queued", False)
        assert order[-3:] == [(queued_again.id, "failed"), (queued_again.id, "_DONE"), (queued_again.id, "queued")]

        threading.Timer(0.2, release.set).start()  # (either way the outcome is the same)
        assert table.requeue(runs[0], Requeue(why=None, fields={}))  # waits for its write under way
        assert _on_disk(store, runs[0].id) == ("queued", False)

        deleted = runs[3]
        table.settle(deleted.id)
        store.delete(deleted.id)
        table.remove(deleted.id)

        await table.all_written()
        assert table.writes_waiting == 0
        for run in (runs[1], runs[4], runs[5]):
            assert _on_disk(store, run.id) == ("failed", True)
            assert run.done_on_disk
            mine = [what for run_id, what in order if run_id == run.id]
            assert mine == ["failed", "_DONE"]  # _DONE last
        assert not store.run_dir(deleted.id).exists()
        assert [what for run_id, what in order if run_id == runs[0].id] == ["failed", "_DONE", "queued"]
    finally:
        release.set()
        table.writer.close()


async def test_observed_peaks_of_a_running_run_are_written_bounded_and_never_after_its_end(tmp_path, monkeypatch):
    """A rise of a running run's peaks is written by the writer's thread; one write waits at a
    time, a small rise or one within the interval is not written; while a running write is held
    in the thread, the run's end is written after it, never overtaken by it."""
    store, table, (run,) = _queued_runs(tmp_path, 1, writer=True)
    assert table.writer is not None
    table.writer.bind(asyncio.get_running_loop())
    table.started(run, pid=os.getpid())
    entered, release = threading.Event(), threading.Event()
    write_job = store.write_job
    order: list[tuple[str, dict | None]] = []

    def held_write_job(run_id, record):
        record = json.loads(record) if isinstance(record, bytes) else record
        if record["state"] == "running" and record.get("observed") and not entered.is_set():
            entered.set()
            release.wait(30)
        order.append((record["state"], (record.get("observed") or {}).get("peak_vram_mb")))
        write_job(run_id, record)

    monkeypatch.setattr(store, "write_job", held_write_job)
    monkeypatch.setattr(runs_module, "OBSERVED_WRITE_INTERVAL_S", 0.0)
    try:
        table.observe(run, {0: 1000}, 10)
        await async_wait_until(entered.is_set, timeout=10, message="the writer never began")
        table.observe(run, {0: 5000}, 10)  # (one write at a time: this one waits for the next)
        assert table.writes_waiting == 1
        threading.Timer(0.2, release.set).start()
        table.finish(run, "failed", "failed: by the test")  # settles the running write first
        await table.all_written()
        assert order == [("running", {"0": 1000}), ("failed", {"0": 5000})]
        assert _on_disk(store, run.id) == ("failed", True)
    finally:
        release.set()
        table.writer.close()

    # Bounded: a rise under 64 MB (and 5 %) is not written; within the interval none is.
    store, table, (run,) = _queued_runs(tmp_path, 1, writer=False)
    table.started(run, pid=os.getpid())
    order.clear()
    monkeypatch.setattr(store, "write_job", held_write_job)
    entered.set()
    table.observe(run, {0: 1000}, 10)
    table.observe(run, {0: 1040}, 10)
    assert order == [("running", {"0": 1000})]
    monkeypatch.setattr(runs_module, "OBSERVED_WRITE_INTERVAL_S", 3600.0)
    table.observe(run, {0: 9000}, 10)
    assert order == [("running", {"0": 1000})]
    assert run.record["observed"]["peak_vram_mb"] == {"0": 9000}  # (in memory at once)


async def test_a_queued_running_record_is_replaced_by_the_runs_next_whole_write(tmp_path, monkeypatch):
    """A rise of the peaks queues a running record; while it still waits in the writer's queue
    (the thread is held in another run's write), the run's end, or a save of its whole record,
    takes it back unmade instead of writing it on the loop: what it said is in the newer write.
    The end is still job.json, then _DONE; a running record under way is still waited for."""
    store, table, (busy, run, saved) = _queued_runs(tmp_path, 3, writer=True)
    assert table.writer is not None
    table.writer.bind(asyncio.get_running_loop())
    for r in (run, saved):
        table.started(r, pid=os.getpid())
    entered, release = threading.Event(), threading.Event()
    write_job = store.write_job
    order: list[tuple[str, str, dict | None]] = []
    loop_thread = threading.get_ident()

    def held_write_job(run_id, record):
        record = json.loads(record) if isinstance(record, bytes) else record
        if run_id == busy.id and not entered.is_set():
            entered.set()
            release.wait(30)
        where = "loop" if threading.get_ident() == loop_thread else "thread"
        order.append((run_id, f"{record['state']}@{where}", (record.get("observed") or {}).get("peak_vram_mb")))
        write_job(run_id, record)

    mark_done = store.mark_done

    def recorded_mark_done(run_id):
        order.append((run_id, "_DONE", None))
        mark_done(run_id)

    monkeypatch.setattr(store, "write_job", held_write_job)
    monkeypatch.setattr(store, "mark_done", recorded_mark_done)
    monkeypatch.setattr(runs_module, "OBSERVED_WRITE_INTERVAL_S", 0.0)
    try:
        table.finish(busy, "failed", "failed: by the test")
        await async_wait_until(entered.is_set, timeout=10, message="the writer never began")
        table.observe(run, {0: 1000}, 10)
        table.observe(saved, {0: 2000}, 10)
        assert table.writes_waiting == 3  # busy's (under way), and the two running records queued
        table.finish(run, "failed", "failed: by the test")
        table.save(saved)
        assert [(r, w) for r, w, _ in order if r != busy.id] == [(saved.id, "running@loop")]
        release.set()
        await table.all_written()
        assert table.writes_waiting == 0
        mine = [(w, peaks) for r, w, peaks in order if r == run.id]
        assert mine == [("failed@thread", {"0": 1000}), ("_DONE", None)]  # the running record was never made
        assert [(w, peaks) for r, w, peaks in order if r == saved.id] == [("running@loop", {"0": 2000})]
        assert _on_disk(store, run.id) == ("failed", True)
        assert _on_disk(store, saved.id) == ("running", False)
    finally:
        release.set()
        table.writer.close()


def test_without_a_writer_every_terminal_record_is_written_at_once(tmp_path):
    store, table, runs = _queued_runs(tmp_path, 5, writer=False)
    with table.deferring_writes():
        for run in runs:
            table.finish(run, "cancelled", "cancelled: by the test")
    assert table.writes_waiting == 0
    assert [_on_disk(store, r.id) for r in runs] == [("cancelled", True)] * 5


async def test_a_bug_in_a_terminal_write_is_logged_with_its_traceback_and_retried(tmp_path, monkeypatch, caplog):
    """On the writer's thread, a bug of ours in a run's terminal job.json, or in its _DONE once
    job.json is written, is logged with its traceback; a full disk in one line. job.json made
    before a bug in _DONE stays (the failure is _DONE's); once mended, the reconciliation's retry
    writes what is missing."""
    store, table, (in_job, in_done, full) = _queued_runs(tmp_path, 3, writer=True)
    assert table.writer is not None
    table.writer.bind(asyncio.get_running_loop())
    write_job, mark_done = store.write_job, store.mark_done

    def broken_write_job(run_id, record):
        if run_id == in_job.id:
            raise TypeError("a bug in job.json")
        if run_id == full.id:
            raise StoreError("the disk is full")
        write_job(run_id, record)

    def broken_mark_done(run_id):
        if run_id == in_done.id:
            raise KeyError("a bug in _DONE")
        mark_done(run_id)

    monkeypatch.setattr(store, "write_job", broken_write_job)
    monkeypatch.setattr(store, "mark_done", broken_mark_done)
    try:
        for run in (in_job, in_done, full):
            table.finish(run, "failed", "failed: by the test")
        await table.all_written()
        logged = {r.getMessage(): r.exc_info for r in caplog.records if "cannot write" in r.getMessage()}
        traceback = {message: exc_info[0] if exc_info else None for message, exc_info in logged.items()}
        assert traceback == {
            f"evalsched: cannot write job.json of {in_job.id}: a bug in job.json": TypeError,
            f"evalsched: cannot write _DONE of {in_done.id}: 'a bug in _DONE'": KeyError,
            f"evalsched: cannot write job.json of {full.id}: the disk is full": None,
        }
        assert _on_disk(store, in_done.id) == ("failed", False)
        assert _on_disk(store, in_job.id) == _on_disk(store, full.id) == ("queued", False)
        assert table.has_unwritten

        monkeypatch.setattr(store, "write_job", write_job)
        monkeypatch.setattr(store, "mark_done", mark_done)
        table.retry_unwritten()
        await table.all_written()
        assert [_on_disk(store, run.id) for run in (in_job, in_done, full)] == [("failed", True)] * 3
        assert not table.has_unwritten
    finally:
        table.writer.close()


# ----------------------------------------------------------------------------- the API waits for them


def _slowed_cancelled_writes(store, monkeypatch) -> None:
    """A cancelled record is written a second late (its write held at the boundary)."""
    write_job = store.write_job

    def late(run_id, record):
        if isinstance(record, bytes) and b'"state":"cancelled"' in record:
            time.sleep(1)
        write_job(run_id, record)

    monkeypatch.setattr(store, "write_job", late)


async def test_a_cancel_answers_once_the_terminal_record_is_on_disk(api, evalsched, runs_dir, monkeypatch):
    gate = await submit(api, spec(entry=SLEEPY, episodes=1, sleep_s=3600))
    held = await submit(api, spec(entry=NOOP, depends_on=[gate["id"]]))
    code, sweep = await api("POST", "sweeps", {**spec(entry=NOOP, depends_on=[gate["id"]]), "sweep": {"k": [1, 2, 3]}})
    assert code == 201, sweep
    _slowed_cancelled_writes(evalsched.store, monkeypatch)

    code, rec = await api("POST", f"runs/{held['id']}/cancel")
    assert code == 200 and rec["state"] == "cancelled"
    assert json.loads((runs_dir / held["id"] / "job.json").read_text())["state"] == "cancelled"
    assert (runs_dir / held["id"] / "_DONE").exists()

    code, view = await api("POST", f"sweeps/{sweep['id']}/cancel")
    assert code == 200 and [r["state"] for r in view["runs"]] == ["cancelled"] * 3
    for r in view["runs"]:
        assert json.loads((runs_dir / r["id"] / "job.json").read_text())["state"] == "cancelled"
        assert (runs_dir / r["id"] / "_DONE").exists()
    await api("POST", f"runs/{gate['id']}/cancel")


async def test_a_run_read_as_ended_is_ended_on_disk(api, wait_for, evalsched, runs_dir, monkeypatch):
    """The server's terminal job.json of a run that ended on its own is written a second late:
    GET of the run, and of the list, answer "succeeded" only once it is on disk."""
    write_job = evalsched.store.write_job

    def late(run_id, record):
        if isinstance(record, bytes) and b'"state":"succeeded"' in record:
            time.sleep(1)
        write_job(run_id, record)

    monkeypatch.setattr(evalsched.store, "write_job", late)
    rec = await submit(api, spec(entry=NOOP))
    final = await wait_for(rec["id"])
    assert final["state"] == "succeeded"
    assert json.loads((runs_dir / rec["id"] / "job.json").read_text())["state"] == "succeeded"
    other = await submit(api, spec(entry=NOOP))

    async def listed_as_ended() -> bool:
        code, body = await api("GET", "runs", params={"state": "succeeded"})
        return other["id"] in {r["id"] for r in body["runs"]}

    await async_wait_until(listed_as_ended, timeout=30, message="the run never ended")
    assert json.loads((runs_dir / other["id"] / "job.json").read_text())["state"] == "succeeded"


async def test_a_runs_final_summary_is_read_off_the_loop_and_its_verdict_rests_on_it(api, evalsched, monkeypatch):
    """A run with a cgroup (this host has them): its final summary.json is read in a thread once
    its process is gone, with its figures, and the verdict on the loop reads nothing more."""
    store, loop_thread = evalsched.store, threading.get_ident()
    reads: list[tuple[str, bool, bool]] = []  # (run id, fresh, on the loop)
    summary = store.summary

    def recorded(run_id, fresh=False):
        reads.append((run_id, fresh, threading.get_ident() == loop_thread))
        return summary(run_id, fresh=fresh)

    monkeypatch.setattr(store, "summary", recorded)
    rec = await submit(api, spec(entry=NOOP, episodes=2))
    run_id = rec["id"]

    async def ended():
        code, now = await api("GET", f"runs/{run_id}")
        return now if now["state"] not in ("queued", "running") else None

    final = await async_wait_until(ended, timeout=60)
    assert final["state"] == "succeeded", final
    assert final["progress"]["done"] == 2, final
    fresh = [(fresh_, on_loop) for rid, fresh_, on_loop in reads if rid == run_id and fresh_]
    assert fresh == [(True, False)], f"the final summary was not read once, off the loop: {reads}"
