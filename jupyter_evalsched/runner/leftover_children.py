"""What ``multiprocessing`` waits for without a limit when a run's process ends: the children the
eval left running, and the feeder threads of its queues.

``multiprocessing``'s exit handler (its ``atexit`` handler in the run's process, the end of
``Process._bootstrap`` in a worker) joins the children it started, and a non-daemonic one (a
``Process`` never joined, a ``ProcessPoolExecutor``'s workers never shut down) without a limit;
then the feeder thread of each ``Queue`` put to, which never ends while what it holds does not fit
the queue's pipe and nobody reads it. A run whose episodes were all done sat as running until its
timeout. So ``bound_joins`` runs as that handler begins (one of its finalizers: after the eval's
``atexit`` handlers registered after ``multiprocessing`` was imported, which are never cut short),
and from then on the children still running get ``LEFTOVER_GRACE_S``; those still running then
are terminated (SIGTERM, SIGKILL after ``TERMINATE_GRACE_S``) and named in the run's log. A feeder
thread is waited for until the same grace is over, then given up (said in the log). The run then
ends as its summary says.

A child started otherwise (``subprocess``, ``os.fork``) is waited for by nothing at the exit: the
run ends without it, and the server kills what the run leaves in its cgroup or process group.
Only imported where there is something to bound (``_proc.end_leftover_children`` checks).
"""

from __future__ import annotations

import os
import signal  # (multiprocessing, which is loaded, imported it already)
import sys
import time

TYPE_CHECKING = False  # typing is not imported at run time (start-up cost); mypy knows this name
if TYPE_CHECKING:
    from collections.abc import Callable
    from multiprocessing.process import BaseProcess
    from threading import Thread
    from weakref import ReferenceType

    # (name, pid, pidfd or None where the kernel has none, whether this process may wait for it:
    # a forkserver's children are the forkserver's)
    Child = tuple[str, int, int | None, bool]

LEFTOVER_GRACE_S = 5.0  # from the start of multiprocessing's exit handler (docs/reference.md, "The run process")
TERMINATE_GRACE_S = 1.0  # after the SIGTERM, before the SIGKILL
_POLL_S = 0.02


def describe(children: list[tuple[str, int]]) -> str:
    """``name (pid N), ...``: how the log names children."""
    return ", ".join(f"{name} (pid {pid})" for name, pid in children)


def leftover_warning(whose: str, children: list[tuple[str, int]], grace_s: float) -> str:
    count = f"{len(children)} multiprocessing child process{'es' if len(children) > 1 else ''}"
    return (
        f"warning: {count} of {whose} left running after its episodes, still running {grace_s:g} s into its exit: "
        f"{describe(children)}; terminating them (SIGTERM, then SIGKILL after {TERMINATE_GRACE_S:g} s). "
        "An eval should end what it starts (Process.join, Pool.close and join, ProcessPoolExecutor.shutdown, "
        "or a with block)"
    )


def feeder_warning(whose: str, grace_s: float) -> str:
    return (
        f"warning: a multiprocessing queue's feeder thread of {whose} was still writing to its pipe {grace_s:g} s "
        "into its exit (what was put on the queue was never read): not waited for, and what it still held is lost. "
        "An eval should read what it puts, or call Queue.cancel_join_thread"
    )


def own_children() -> list[BaseProcess]:
    """The running ``multiprocessing`` children this process started (not those a warm run's
    zygote started, which its fork copied into ``multiprocessing``'s list but are not ours)."""
    process = sys.modules.get("multiprocessing.process")
    if process is None:
        return []
    me = os.getpid()
    # (active_children reaps those that have ended)
    return [c for c in process.active_children() if getattr(c, "_parent_pid", me) == me and c.pid is not None]


def bound_joins(whose: str, say: Callable[[str], None]) -> None:
    """As ``multiprocessing``'s exit handler begins, before it joins what the eval left: a daemon
    thread ends the children still running once the grace is over, and each queue's feeder
    thread is waited for until then at most. ``whose``: which process this is, for the log."""
    deadline = time.monotonic() + LEFTOVER_GRACE_S
    children: list[Child] = []
    for child in sorted(own_children(), key=lambda c: c.pid or 0):
        pid = child.pid
        if pid is not None:
            waitable = not type(getattr(child, "_popen", None)).__module__.endswith("forkserver")
            children.append((child.name, pid, _pidfd(pid), waitable))
    if children:
        import threading

        threading.Thread(
            target=_end_after_grace, args=(children, whose, say), name="evalsched-leftover-children", daemon=True
        ).start()
    _bound_feeder_joins(deadline, whose, say)


def _bound_feeder_joins(deadline: float, whose: str, say: Callable[[str], None]) -> None:
    """Each queue's feeder thread is joined (a finalizer of ``multiprocessing``, after the
    children's join) until ``deadline`` at most."""
    queues = sys.modules.get("multiprocessing.queues")
    util = sys.modules.get("multiprocessing.util")
    if queues is None or util is None:
        return
    unbounded = queues.Queue._finalize_join

    def join_until_deadline(thread_ref: ReferenceType[Thread]) -> None:
        thread = thread_ref()
        if thread is None:
            return
        thread.join(max(0.0, deadline - time.monotonic()))
        if thread.is_alive():  # (a daemon thread: the process's os._exit ends it)
            say(feeder_warning(whose, LEFTOVER_GRACE_S))

    for finalizer in list(util._finalizer_registry.values()):
        if getattr(finalizer, "_callback", None) is unbounded:
            finalizer._callback = join_until_deadline


def _end_after_grace(children: list[Child], whose: str, say: Callable[[str], None]) -> None:
    left = _still_running(children, LEFTOVER_GRACE_S)
    if not left:
        return
    say(leftover_warning(whose, [(name, pid) for name, pid, _, _ in left], LEFTOVER_GRACE_S))
    _signal_all(left, signal.SIGTERM)
    deaf = _still_running(left, TERMINATE_GRACE_S)
    if deaf:
        say(f"warning: still running after SIGTERM: {describe([(n, p) for n, p, _, _ in deaf])}; killed (SIGKILL)")
        _signal_all(deaf, signal.SIGKILL)


def _still_running(children: list[Child], within_s: float) -> list[Child]:
    """Those of ``children`` still running after ``within_s`` (sooner when none is). Never reaps:
    the exit's own joins do (and a reaped child is gone)."""
    deadline = time.monotonic() + within_s
    while True:
        running = [child for child in children if not _exited(child)]
        if not running or time.monotonic() >= deadline:
            return running
        time.sleep(_POLL_S)


def _exited(child: Child) -> bool:
    _, pid, pidfd, waitable = child
    if pidfd is not None:
        # Readable once that very process has ended: reaped or not, whoever's child it is.
        import select

        poll = select.poll()
        poll.register(pidfd, select.POLLIN)
        return bool(poll.poll(0))
    if waitable:
        try:
            return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
        except ChildProcessError:
            return True  # reaped already (by the exit's join, or by the eval's own SIGCHLD handling)
    try:  # a forkserver's child, which its forkserver reaps
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:
        pass
    return False


def _pidfd(pid: int) -> int | None:
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):  # no pidfds here (or gone): watched and signalled by pid
        return None


def _signal_all(children: list[Child], signum: int) -> None:
    for _, pid, pidfd, _ in children:
        try:
            if pidfd is not None:
                # The pidfd names that process even if it has been reaped and its pid reused.
                signal.pidfd_send_signal(pidfd, signum)
            else:
                os.kill(pid, signum)
        except OSError:
            pass  # gone meanwhile
