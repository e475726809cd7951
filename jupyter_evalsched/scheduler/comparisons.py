"""Comparisons of runs as the server carries them out: in worker processes of their own
(:mod:`.compare_worker`, at most ``compare.COMPARE_WORKERS``, started when first needed), so that
their reading and JSON parsing never hold the server's GIL against its event loop, at most
``compare.MAX_CONCURRENT_COMPARES`` at once, within a time and a size limit. The statistics are
:mod:`.compare`'s (pure)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from ..runner._proc import stat_fields
from ..store import RunStore
from . import compare
from .compare_worker import BOOTSTRAP, timed_out
from .errors import Busy, Internal, SpecRejected, TooLarge, Unavailable
from .runs import Run, RunTable

# How long past a comparison's deadline a worker may take to answer before it is taken for hung
# and killed (it looks at the deadline itself every few lines: this covers the rest, its answer's
# writing and a loaded host).
WORKER_GRACE_S = 10.0
# An idle worker is ended after this long without a comparison (its 20 to 40 MB given back); the
# next comparison starts a new one (about 0.1 s). Retired by the server, on its event loop, where
# it also takes idle workers for comparisons: a worker is either taken or retired, never both, and
# no request is ever sent to one that is ending.
WORKER_IDLE_S = 60.0
# The first line of a worker's answer is a small header; the body is read by its length.
HEADER_LIMIT = 1 << 16
# The run record's fields a comparison answers with: only these go to the worker.
RECORD_FIELDS = ("id", "name", "state", "started_at", "finished_at")


class WorkerEnded(Exception):
    """A worker process ended (or was killed) without an answer: its exit, in words."""


class Worker:
    """One worker process (:mod:`.compare_worker`) and its pipes. ``exchange`` blocks: it runs on
    a thread of the comparisons' own, which waits in the pipes' reads, never on the event loop."""

    def __init__(self) -> None:
        # The package as this server imports it, whatever the worker's working directory, and
        # nothing else of the user's environment (compare_worker.BOOTSTRAP).
        package_parent = str(Path(__file__).resolve().parents[2])
        self.proc = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", BOOTSTRAP, package_parent],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            close_fds=True,  # (the default, said: none of the server's sockets and files)
        )
        self.retirement: asyncio.TimerHandle | None = None  # while it is idle (Comparisons)

    @property
    def alive(self) -> bool:
        """Not ended: not reaped, and its main thread not a zombie. A worker killed just before it
        is taken cannot be reaped until its watching thread has ended too, and meanwhile took the
        next comparison and answered it with a 503 (CI saw it once)."""
        if self.proc.poll() is not None:
            return False
        fields = stat_fields(self.proc.pid)
        return fields is not None and fields[0] not in (b"Z", b"X")

    def exchange(self, request: bytes) -> tuple[dict[str, Any], bytes]:
        """Send one request, read its answer: the header and the body (WorkerEnded when the
        process ends first)."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        try:
            self.proc.stdin.write(request)
            self.proc.stdin.flush()
            line = self.proc.stdout.readline(HEADER_LIMIT)
            header = json.loads(line) if line.endswith(b"\n") else None
            if not isinstance(header, dict):
                raise WorkerEnded(self._how_it_ended())
            n = header.get("bytes") if header.get("status") == "ok" else 0
            body = self.proc.stdout.read(n) if type(n) is int and n > 0 else b""
            if len(body) != (n or 0):
                raise WorkerEnded(self._how_it_ended())
        except (OSError, ValueError):  # (a pipe closed under us; a header that is not JSON)
            raise WorkerEnded(self._how_it_ended()) from None
        return header, body

    def _how_it_ended(self) -> str:
        self.kill()
        code = self.end()
        if code is None:
            return "it did not end"
        return f"killed by signal {-code}" if code < 0 else f"exit status {code}"

    def kill(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.kill()
            except ProcessLookupError:
                pass

    def end(self) -> int | None:
        """Its exit status once killed (reaped, its pipes closed); None when it did not end in time."""
        try:
            code: int | None = self.proc.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            code = None
        for pipe in (self.proc.stdin, self.proc.stdout):
            try:
                if pipe is not None:
                    pipe.close()
            except OSError:
                pass
        return code


class Comparisons:
    def __init__(self, table: RunTable, store: RunStore) -> None:
        self.table = table
        self.store = store
        self._compares = 0  # comparisons admitted and not answered yet (event loop only)
        self._free = asyncio.Semaphore(compare.COMPARE_WORKERS)
        # One thread per busy worker, waiting in its pipes (and starting, reaping it).
        self._threads = ThreadPoolExecutor(max_workers=compare.COMPARE_WORKERS, thread_name_prefix="evalsched-compare")
        self._idle: list[Worker] = []
        self._live: set[Worker] = set()  # every worker started and not discarded (idle or busy)
        self._closed = False

    def close(self) -> None:
        """Kill every worker, busy or idle (a comparison under way answers 503), and reap them."""
        self._closed = True
        for worker in self._idle:
            self._keep(worker)
        workers = list(self._live)
        self._live.clear()
        self._idle.clear()
        for worker in workers:
            worker.kill()
        for worker in workers:
            worker.end()
        self._threads.shutdown(wait=False, cancel_futures=True)

    def workers(self) -> dict[str, list[int]]:
        """The process ids of the live workers: ``{"idle": [...], "busy": [...]}``."""
        idle = {worker.proc.pid for worker in self._idle}
        live = {worker.proc.pid for worker in self._live}
        return {"idle": sorted(idle), "busy": sorted(live - idle)}

    @staticmethod
    def inputs(
        run_ids: list[str] | None,
        sweep_id: str | None,
        baseline: str | None,
        sweep_runs: Callable[[str], list[Run]],
        get: Callable[[str], Run],
    ) -> list[Run]:
        """The runs a comparison is about, checked (unknown ids: 404 through ``get``; too many, or
        a baseline that is not among them: 422)."""
        if (run_ids is None) == (sweep_id is None):
            raise SpecRejected("name the runs to compare: ?runs=a,b,c or ?sweep=ID (one of them)")
        runs = sweep_runs(sweep_id) if sweep_id is not None else [get(r) for r in dict.fromkeys(run_ids or [])]
        if not runs:
            raise SpecRejected("no runs to compare")
        if len(runs) > compare.MAX_COMPARE_RUNS:
            raise SpecRejected(f"{len(runs)} runs; at most {compare.MAX_COMPARE_RUNS} are compared at once")
        if baseline is not None and baseline not in {r.id for r in runs}:
            raise SpecRejected(f"the baseline {baseline!r} is not one of the compared runs")
        return runs

    async def compare(self, runs: list[Run], baseline: str | None) -> bytes:
        """The comparison of ``runs`` (checked by ``inputs``) as JSON, from a worker process.
        More than MAX_CONCURRENT_COMPARES at once: Busy (429); a comparison past COMPARE_TIMEOUT_S
        (its wait for a worker included; a worker that does not answer by then is killed):
        Unavailable (503); one that would hold more than MAX_COMPARE_VALUES values: TooLarge
        (413); a worker that ended without an answer (killed): Unavailable (503)."""
        if self._compares >= compare.MAX_CONCURRENT_COMPARES:
            raise Busy(
                f"{self._compares} comparisons are under way; at most {compare.MAX_CONCURRENT_COMPARES} "
                "run at once: retry in a moment"
            )
        limit_s = compare.COMPARE_TIMEOUT_S
        deadline = time.monotonic() + limit_s
        self._compares += 1
        try:
            try:
                await asyncio.wait_for(self._free.acquire(), max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                raise timed_out(limit_s) from None
            try:
                return await self._on_a_worker(runs, baseline, deadline, limit_s)
            finally:
                self._free.release()
        finally:
            self._compares -= 1

    async def _on_a_worker(self, runs: list[Run], baseline: str | None, deadline: float, limit_s: float) -> bytes:
        loop = asyncio.get_running_loop()
        worker = await self._worker(loop)
        request = {
            "root": os.path.abspath(self.store.root),
            "runs": [_record(run) for run in runs],
            "baseline": baseline,
            "timeout_s": deadline - time.monotonic(),
            "limit_s": limit_s,
            "max_values": compare.MAX_COMPARE_VALUES,
        }
        exchange = loop.run_in_executor(self._threads, worker.exchange, json.dumps(request).encode() + b"\n")
        try:
            header, body = await asyncio.wait_for(exchange, max(0.0, deadline - time.monotonic()) + WORKER_GRACE_S)
        except TimeoutError:
            self._discard(worker)  # (its thread's read ends with the process)
            raise timed_out(limit_s) from None
        except WorkerEnded as exc:
            self._discard(worker)
            if self._closed:  # (close killed it)
                raise Unavailable("the scheduler is stopping: the comparison was cut off") from None
            raise Unavailable(f"the comparison's worker process ended without an answer ({exc}); retry") from None
        if self._closed:
            self._discard(worker)
        else:
            self._idle.append(worker)
            worker.retirement = loop.call_later(WORKER_IDLE_S, self._retire, worker)
        status = header.get("status")
        if status == "ok":
            return body
        message = str(header.get("message"))
        if status == "too_large":
            raise TooLarge(message)
        if status == "unavailable":
            raise Unavailable(message)
        raise Internal(message)

    async def _worker(self, loop: asyncio.AbstractEventLoop) -> Worker:
        """An idle worker, or a new one (the caller holds one of the COMPARE_WORKERS places)."""
        while self._idle:
            worker = self._idle.pop()
            self._keep(worker)
            if worker.alive:
                return worker
            self._discard(worker)  # it died idle (the OOM killer, a kill): not this comparison's fault
        if self._closed:
            raise Unavailable("the scheduler is stopping: no comparison is started")
        try:
            worker = await loop.run_in_executor(self._threads, Worker)
        except OSError as exc:
            raise Unavailable(f"the comparison's worker process could not be started: {exc}") from None
        if self._closed:  # (close came while it started)
            worker.kill()
            worker.end()
            raise Unavailable("the scheduler is stopping: no comparison is started")
        self._live.add(worker)
        return worker

    def _retire(self, worker: Worker) -> None:
        """An idle worker's time is up (a call_later of the event loop's)."""
        worker.retirement = None
        if worker in self._idle:
            self._idle.remove(worker)
            self._discard(worker)

    @staticmethod
    def _keep(worker: Worker) -> None:
        """No retirement for a worker taken from the idle ones."""
        if worker.retirement is not None:
            worker.retirement.cancel()
            worker.retirement = None

    def _discard(self, worker: Worker) -> None:
        worker.kill()
        self._live.discard(worker)
        if not self._closed:
            self._threads.submit(worker.end)  # reaped off the loop (a killed process ends at once)


def _record(run: Run) -> dict[str, Any]:
    """What the answer shows of the run's record (small: a whole sweep's goes to the worker)."""
    record = {name: run.record.get(name) for name in RECORD_FIELDS}
    peaks = (run.record.get("observed") or {}).get("peak_vram_mb")
    record["observed"] = {"peak_vram_mb": peaks}
    return record
