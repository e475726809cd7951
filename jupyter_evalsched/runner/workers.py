"""Episodes in worker processes, for ``workers > 1``.

Mechanism: ``multiprocessing`` with the "fork" start method, one duplex pipe per worker.

* fork, because it is cheap (no new interpreter, no re-import of the runner) and needs nothing
  picklable: the worker gets the closures that load the eval and build its ``ctx``.
* The workers are forked *before* the eval is imported, from the small runner process: at that
  point it has no threads and no CUDA context, the two things that make fork unsafe. Each worker
  then imports the eval itself, so module-level state (a model loaded at import, a CUDA context)
  is per worker, as it would be with "spawn", and an import error is reported like any failure.
* The run process hands out indices one at a time, in index order, to whichever worker is free,
  and is the single writer of ``episodes.jsonl`` and ``summary.json`` (completion order).
* Every worker arms its own PR_SET_PDEATHSIG against the run process (the death signal is not
  inherited across fork) and checks that the run process is still its parent, so no worker
  outlives the run, however the run process dies.
* ``stop_requested()`` (the server's ``_STOP``) is asked before each index is handed out: once it
  says yes, no more are, the running episodes finish and are recorded, and the result is
  ``"stopped"``.
* A worker that raises, or dies (signal, ``os._exit``), fails the run: no more episodes are
  handed out, the other workers are terminated (SIGTERM, then SIGKILL after a grace period)
  and the run process finalizes the run as failed.
* A worker ends as ``multiprocessing`` ends its children, but bounded like the run's own process:
  no wait for the non-daemon threads the eval left, and the ``multiprocessing`` children it left
  get a grace, then are terminated (``leftover_children``).
"""

from __future__ import annotations

import os
import signal

from ._proc import EXIT_PARENT_GONE, end_leftover_children, flush_stdio, leave_if_forked, set_parent_death_signal
from .errors import describe_exception
from .results import utc_now_iso, validate_metrics

TYPE_CHECKING = False  # typing is not imported at run time (start-up cost); mypy knows this name
if TYPE_CHECKING:
    from collections.abc import Callable
    from multiprocessing.connection import Connection
    from multiprocessing.context import ForkProcess
    from typing import Literal

    from .context import EpisodeContext, EpisodeFunction
    from .errors import ErrorInfo
    from .results import Metrics

    # Worker -> run process: the first failure, or one finished episode
    # ("ok", index, metrics, started_at, finished_at).
    _Report = tuple[Literal["error"], ErrorInfo] | tuple[Literal["ok"], int, Metrics, str, str]
    # Run process -> worker: the next index to run, or None: exit.
    _Order = int | None

# How long terminated workers get to exit before SIGKILL, and finished ones to exit at all.
TERMINATE_GRACE_S = 1.0
FINISH_GRACE_S = 10.0


class WorkerDied(RuntimeError):
    """A worker process ended without reporting its episode (a signal, ``os._exit``...)."""


def _worker_process(
    conn: Connection[_Report, _Order],
    run_pid: int,
    load_episode: Callable[[], EpisodeFunction],
    make_ctx: Callable[[int], EpisodeContext],
) -> None:
    """A worker's whole life: its episodes, then its exit as ``multiprocessing`` would end it
    (its finalizers, the join of its children), less the wait for non-daemon threads: a thread
    the eval left running must not keep the worker, and so the run, alive (as in the run's own
    process: ``__main__._exit``)."""
    _worker_main(conn, run_pid, load_episode, make_ctx)
    from multiprocessing import util

    util._exit_function()  # type: ignore[attr-defined]
    flush_stdio()
    os._exit(0)


def _worker_main(
    conn: Connection[_Report, _Order],
    run_pid: int,
    load_episode: Callable[[], EpisodeFunction],
    make_ctx: Callable[[int], EpisodeContext],
) -> None:
    """Body of a worker process: import the eval, then run the episodes it is handed."""
    set_parent_death_signal()
    if os.getppid() != run_pid:  # the run process died before the death signal was armed
        os._exit(EXIT_PARENT_GONE)
    # A child the eval forks that comes back here ends at once: this pipe is the worker's alone.
    me = os.getpid()
    try:
        try:
            episode = load_episode()
        except BaseException as exc:
            leave_if_forked(me, exc)
            conn.send(("error", describe_exception(exc)))
            return
        leave_if_forked(me)
        while True:
            try:
                index = conn.recv()
            except EOFError:
                return
            if index is None:
                return
            started_at = utc_now_iso()
            try:
                metrics = validate_metrics(episode(make_ctx(index), index), index)
            except BaseException as exc:
                leave_if_forked(me, exc)
                flush_stdio()
                conn.send(("error", describe_exception(exc, index)))
                return
            leave_if_forked(me)
            finished_at = utc_now_iso()
            flush_stdio()
            conn.send(("ok", index, metrics, started_at, finished_at))
    except (BrokenPipeError, ConnectionResetError):
        return  # the run process is gone or has given up on us
    finally:
        flush_stdio()
        # multiprocessing joins this worker's children as it leaves (Process._bootstrap), without
        # a limit: those the eval left running get the run process's grace.
        end_leftover_children(f"worker process {me}")


class _Worker:
    __slots__ = ("process", "pid", "conn", "conn_open", "episode", "stopping", "reported")

    def __init__(self, process: ForkProcess, conn: Connection[_Order, _Report]) -> None:
        if process.pid is None:
            raise RuntimeError("a worker process must be started before it is tracked")
        self.process = process
        self.pid: int = process.pid
        self.conn = conn
        self.conn_open = True
        self.episode: int | None = None  # the index it is running
        self.stopping = False  # told to exit (no episodes left)
        self.reported = False  # has sent at least one message


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def run_in_workers(
    n_workers: int,
    indices: list[int],
    load_episode: Callable[[], EpisodeFunction],
    make_ctx: Callable[[int], EpisodeContext],
    on_episode: Callable[[int, Metrics, str, str, int], None],
    stop_requested: Callable[[], bool] = lambda: False,
) -> ErrorInfo | Literal["stopped"] | None:
    """Run the episodes ``indices`` (in that order) in ``n_workers`` forked processes.

    ``on_episode(index, metrics, started_at, finished_at, worker_pid)`` is called in this
    process for every finished episode. Returns None when all succeeded, ``"stopped"`` when
    ``stop_requested`` stopped it before every index was handed out, else the ``error`` object
    of the first failure.
    """
    import multiprocessing
    from multiprocessing.connection import wait

    fork = multiprocessing.get_context("fork")
    run_pid = os.getpid()
    next_indices = iter(indices)
    workers: list[_Worker] = []
    stopped = False

    def hand_out(worker: _Worker) -> None:
        nonlocal stopped
        index = None if stopped else next(next_indices, None)
        if index is not None and stop_requested():
            stopped = True
            index = None
        worker.episode = index
        worker.stopping = index is None
        try:
            worker.conn.send(index)
        except OSError:
            pass  # it died; its sentinel tells us how

    def take_messages(worker: _Worker) -> ErrorInfo | None:
        """Handle everything the worker has sent; the first error, if any."""
        while worker.conn_open and worker.conn.poll():
            try:
                message = worker.conn.recv()
            except (EOFError, OSError):
                worker.conn_open = False
                break
            except Exception as exc:  # unpickling: a class this process does not have, say
                return unreadable_message(worker, exc)
            worker.reported = True
            if message[0] == "error":
                return message[1]
            _, index, metrics, started_at, finished_at = message
            worker.episode = None
            on_episode(index, metrics, started_at, finished_at, worker.pid)
            hand_out(worker)
        return None

    def unreadable_message(worker: _Worker, exc: Exception) -> ErrorInfo:
        error = describe_exception(exc, worker.episode)
        # (What the worker sends is plain data: validate_metrics and describe_exception see to it.)
        error["message"] = (
            f"the run process could not read what worker process {worker.pid} sent about episode "
            f"{worker.episode}: {error['type']}: {error['message']}"
        )
        return error

    def death_error(worker: _Worker) -> ErrorInfo:
        code = worker.process.exitcode
        how = f"was killed by {_signal_name(-code)}" if code is not None and code < 0 else f"exited with code {code}"
        if worker.episode is None:
            what = "before it was told to stop"
        elif worker.reported:
            what = f"while running episode {worker.episode}"
        else:
            what = f"while importing the eval or running episode {worker.episode}"
        message = f"worker process {worker.pid} {how} {what}"
        return {
            "type": WorkerDied.__name__,
            "message": message,
            "traceback": f"{WorkerDied.__name__}: {message}\n",
            "episode": worker.episode,
        }

    flush_stdio()  # or the children would inherit, and print again, what is still buffered
    error: ErrorInfo | None = None
    all_done = False  # every worker finished its episodes and was told to stop
    try:
        for _ in range(n_workers):
            parent_end, child_end = fork.Pipe(duplex=True)
            # Not daemonic: a daemonic process may not start processes of its own, and evals
            # are allowed to. This function always reaps its workers itself (finally below).
            process = fork.Process(
                target=_worker_process,
                args=(child_end, run_pid, load_episode, make_ctx),
                name=f"evalsched-worker-{len(workers)}",
            )
            process.start()
            child_end.close()
            worker = _Worker(process, parent_end)
            workers.append(worker)
            hand_out(worker)  # the first index waits in the pipe while it imports the eval

        live = {w.process.sentinel: w for w in workers}
        while live and error is None:
            waitables: list[int | Connection[_Order, _Report]] = list(live)
            waitables.extend(w.conn for w in live.values() if w.conn_open)
            ready = set(wait(waitables))
            for sentinel, worker in list(live.items()):
                if worker.conn_open and worker.conn in ready:
                    error = take_messages(worker)
                    if error is not None:
                        break
                if sentinel in ready:
                    error = take_messages(worker)  # whatever it sent before it exited
                    if error is not None:
                        break
                    worker.process.join()
                    del live[sentinel]
                    if not worker.stopping:
                        error = death_error(worker)
                        break
        all_done = error is None
        return "stopped" if error is None and stopped else error
    finally:
        # After a failure, or an exception of our own (a run file that cannot be written), the
        # workers still running are terminated; after success they are exiting already.
        _stop_workers(workers, terminate=not all_done)


def _stop_workers(workers: list[_Worker], *, terminate: bool) -> None:
    import time

    if terminate:
        for worker in workers:
            if worker.process.exitcode is None:
                try:
                    worker.process.terminate()
                except OSError:
                    pass
    deadline = time.monotonic() + (TERMINATE_GRACE_S if terminate else FINISH_GRACE_S)
    for worker in workers:
        worker.process.join(max(0.0, deadline - time.monotonic()))
    for worker in workers:
        if worker.process.exitcode is None:  # ignores SIGTERM, or hangs after its last episode
            worker.process.kill()
            worker.process.join()
        worker.conn.close()
