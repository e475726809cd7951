"""One thread writes run directories off the event loop: the directories of new submissions, the
terminal ``job.json``/``_DONE`` of ended runs, and the ``job.json`` of running runs whose observed
peaks rose (a ``TerminalWrite`` without ``_DONE``: ``RunTable._persist_observed``).

Concurrent submissions are written as one batch: the thread takes everything queued when it
wakes, has each directory assembled and renamed into place, and with ``fsync`` makes all the
renames durable with one fsync of the runs directory (``RunStore.create_many``). Each submission
is answered once its own directory is in place; a failure fails that submission alone. This
thread assembles a batch's directories itself. With ``fsync``, a batch of several goes to a pool of
up to eight threads, whose waits for the disk overlap; without it, the rest of a batch does once
one directory has cost this thread more than ``SLOW_DIRECTORY_CPU_S`` of CPU or
``SLOW_DIRECTORY_S`` in all (a busy disk: ``RunStore.create_many``).

The loop hands work over without a thread hop per item: it appends to the queue and wakes the
thread only when it sleeps; the thread hands a whole batch's outcomes back in one callback.

Writes for one run keep their order. A terminal write waits in the queue; a later write for the
same run made on the loop (a requeue's, a deletion) first settles it (``settle``): takes it back
from the queue and makes it itself, or waits for the thread to finish it.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

from ..store import RunStore, StoreBug, StoreError, discard_run_entry

log = logging.getLogger("jupyter_evalsched")

_QUEUED, _WRITING, _TAKEN = "queued", "writing", "taken"


class _Create:
    """A new run directory; ``future`` (the loop's) gets None or the StoreError."""

    __slots__ = ("error", "files", "future", "run_id")

    def __init__(self, run_id: str, files: dict[str, bytes], future: asyncio.Future[None]) -> None:
        self.run_id = run_id
        self.files = files
        self.future = future
        self.error: StoreError | None = None

    def complete(self) -> None:
        if self.future.done():  # (its submission was cancelled meanwhile)
            return
        if self.error is not None:
            self.future.set_exception(self.error)
        else:
            self.future.set_result(None)


class TerminalWrite:
    """A run's terminal ``job.json`` (its JSON made on the loop, so that later changes to the
    record in memory cannot tear it) and then, unless the run wrote its own, ``_DONE``.
    ``on_done`` is called on the loop once it is made (by the thread or by ``settle``), with
    ``job_error``/``done_error`` saying what failed. Without ``mark_done``, a running record
    (its observed peaks), kept in the same per-run order."""

    __slots__ = (
        "_applied",
        "_state",
        "_waiters",
        "data",
        "done_error",
        "finished",
        "job_error",
        "mark_done",
        "on_done",
        "replaceable",
        "run_id",
    )

    def __init__(
        self,
        run_id: str,
        data: bytes,
        mark_done: bool,
        on_done: Callable[[TerminalWrite], None],
        replaceable: bool = False,
    ) -> None:
        self.run_id = run_id
        # A running record (its observed peaks) that the run's next write of its whole record
        # may take back from the queue unmade (``RunWriter.withdraw``); nothing awaits it.
        self.replaceable = replaceable
        self.data = data
        self.mark_done = mark_done
        self.on_done = on_done
        self.job_error: Exception | None = None  # job.json not written (then no _DONE either)
        self.done_error: Exception | None = None
        self.finished = threading.Event()
        self._state = _QUEUED
        self._applied = False
        self._waiters: list[asyncio.Future[None]] = []

    def make(self, store: RunStore) -> None:
        """``job.json``, then ``_DONE``: a ``_DONE`` beside a ``job.json`` that still says
        "running" would make the next start conclude the run from stale files."""
        # Any exception is the run's problem, never the thread's end: the disk's (StoreError,
        # OSError, RunFileError) or a bug of ours, which the loop logs with its traceback.
        try:
            try:
                store.write_job(self.run_id, self.data)
            except Exception as exc:
                self.job_error = exc
                return
            if self.mark_done:
                try:
                    store.mark_done(self.run_id)
                except Exception as exc:
                    self.done_error = exc
        finally:
            self.finished.set()

    def complete(self) -> None:
        """On the loop: its outcome applied (once), and whoever awaits it told."""
        if self._applied:
            return
        self._applied = True
        try:
            self.on_done(self)
        except Exception:
            log.exception("evalsched: applying the terminal write of run %s failed", self.run_id)
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_result(None)
        self._waiters.clear()

    def wait(self, loop: asyncio.AbstractEventLoop) -> asyncio.Future[None]:
        """Done once it is on disk (or failed) and applied."""
        future = loop.create_future()
        if self._applied:
            future.set_result(None)
        else:
            self._waiters.append(future)
        return future


class RunWriter:
    """The thread and its queue. Until ``bind`` (and after ``close``) it writes nothing:
    callers then write on their own thread (``running`` is False)."""

    def __init__(self, store: RunStore) -> None:
        self.store = store
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._queue: deque[_Create | TerminalWrite] = deque()
        self._sleeping = False
        self._kick_pending = False  # a wake of the thread is scheduled on the loop
        self._items_done = 0  # written or failed, by the thread (with the store's count: progress)
        self._closing = False  # the thread ends once its queue is empty
        self._exited = False  # it has (or was given up on): callers write on their own thread
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def running(self) -> bool:
        return self._thread is not None and not self._closing

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._closing = self._exited = False
        self._thread = threading.Thread(target=self._run, name="evalsched-writer", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Write what is queued, then end the thread."""
        thread = self._thread
        if thread is None:
            return
        with self._lock:
            self._closing = True
            self._wake.notify()
        thread.join()
        self._thread = None

    async def close_within(self, stall_s: float) -> bool:
        """``close`` without holding the loop: what is queued, and what is queued meanwhile, is
        written (each outcome applied on the loop as usual) and the thread ends. A slow disk is
        waited for as long as writes complete; False once none has for ``stall_s`` (a disk that
        hangs): the thread is given up on (a daemon thread, it goes on by itself; later writes
        are made by their callers), and the caller refuses what it would still write
        (``RunStore.refuse_writes``)."""
        thread = self._thread
        if thread is None:
            return True
        with self._lock:
            self._closing = True
            self._wake.notify()
        loop = asyncio.get_running_loop()
        done, deadline = self._progress(), loop.time() + stall_s
        while thread.is_alive():
            if self._progress() != done:
                done, deadline = self._progress(), loop.time() + stall_s
            elif loop.time() >= deadline:
                with self._lock:
                    self._exited = True
                return False
            await asyncio.sleep(0.005)
        self._thread = None
        await asyncio.sleep(0)  # (its last batch's outcomes, handed over as it ended, applied)
        return True

    def _progress(self) -> tuple[int, int]:
        """Moves while the writer gets anywhere: a write done (one directory of a batch too), or
        an item ended, written or failed (a disk that answers each write with an error slowly)."""
        return self.store.writes_done, self._items_done

    # ----------------------------------------------------------------- the loop's side

    def create(self, run_id: str, files: dict[str, bytes]) -> asyncio.Future[None]:
        """A new run directory (``RunStore.assemble``); the future fails with StoreError."""
        assert self._loop is not None
        item = _Create(run_id, files, self._loop.create_future())
        if not self._put((item,)):
            item.error = self.store.create_many([(run_id, files)])[0]
            item.complete()
        return item.future

    def terminal(self, writes: list[TerminalWrite]) -> None:
        """Terminal writes, in this order after everything queued before them; written at once
        on this thread when the writer is not running."""
        if not self._put(writes):
            for write in writes:
                write.make(self.store)
                write.complete()

    def settle(self, write: TerminalWrite) -> None:
        """On the loop: ``write`` made and applied now, before another write for its run: taken
        back from the queue and made here, or, under way in the thread, waited for."""
        with self._lock:
            take = write._state == _QUEUED
            if take:
                write._state = _TAKEN
                try:
                    self._queue.remove(write)
                except ValueError:  # (never queued: the writer was not running)
                    pass
        if take:
            write.make(self.store)
        else:
            write.finished.wait()
        write.complete()

    def withdraw(self, write: TerminalWrite) -> bool:
        """On the loop: ``write`` taken back from the queue unmade, if the thread has not taken it
        yet (True; the caller completes it). Only a ``replaceable`` one: a running record, which
        the next write of the whole record replaces."""
        with self._lock:
            if not write.replaceable or write._state != _QUEUED:
                return False
            write._state = _TAKEN
            try:
                self._queue.remove(write)
            except ValueError:  # (never queued: the writer was not running)
                pass
        write.finished.set()
        return True

    def _put(self, items: tuple[_Create, ...] | list[TerminalWrite]) -> bool:
        with self._lock:
            # (Queued while it closes too: it ends once its queue is empty, not before.)
            if self._thread is None or self._exited or self._loop is None or not self._thread.is_alive():
                return False  # (written by the caller)
            self._queue.extend(items)
            if self._sleeping and not self._kick_pending:
                # Woken once the loop has run what is ready now: the submissions read in this
                # iteration go as one batch, and the loop pays one wake (a context switch on a
                # busy host) for all of them.
                self._kick_pending = True
                self._loop.call_soon(self._kick)
        return True

    def _kick(self) -> None:
        with self._lock:
            self._kick_pending = False
            if self._sleeping and self._queue:
                self._wake.notify()

    # ----------------------------------------------------------------- the thread

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._queue and not self._closing:
                    self._sleeping = True
                    self._wake.wait()
                self._sleeping = False
                if not self._queue:
                    self._exited = True  # (under the lock: nothing is queued after this look)
                    return  # closing, and nothing left
                batch = list(self._queue)
                self._queue.clear()
                for item in batch:
                    if isinstance(item, TerminalWrite):
                        item._state = _WRITING
            self._write(batch)
            loop = self._loop
            try:
                if loop is not None:
                    loop.call_soon_threadsafe(_complete_all, batch)
            except RuntimeError:  # the loop is closed: nobody waits any more
                pass

    def _write(self, batch: list[Any]) -> None:
        creates = [item for item in batch if isinstance(item, _Create)]
        if creates:
            try:
                errors = self.store.create_many([(c.run_id, c.files) for c in creates])
            except Exception:  # a bug of ours: those submissions fail, the thread goes on
                ids = [c.run_id for c in creates]
                log.exception("evalsched: writing the directories of runs %s failed", ids)
                for run_id in ids:  # (fresh ids: whatever is there of them, this batch made)
                    discard_run_entry(self.store.run_dir(run_id))
                errors = [StoreBug() for _ in creates]
            for create, error in zip(creates, errors, strict=True):
                create.error = error
            self._items_done += len(creates)
        for item in batch:
            if isinstance(item, TerminalWrite):
                item.make(self.store)
                self._items_done += 1


def _complete_all(batch: list[_Create | TerminalWrite]) -> None:
    for item in batch:
        item.complete()
