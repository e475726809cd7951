"""Start run subprocesses, signal their process groups, and notice their exit at once.

Runs start in a new session (``setsid``) so that one signal reaches the run and every worker it
forked. The run sets ``PR_SET_PDEATHSIG`` itself right after exec (no ``preexec_fn``: it can
deadlock a threaded parent) and checks that its parent is still us. The death signal is tied to
the *thread* that forked the run, so spawns must happen on the event-loop thread, which lives as
long as the server.

Exit is noticed through a pidfd registered with the event loop: the next admission happens in
the same loop iteration as the exit, not at the next tick of the reconciliation.

A warm start (``fork``) gives the run to a process a zygote (``zygotes.py``) forked ahead: the
zygote is its parent and ties the run's death signal to itself (it dies with the server). The
zygote hands over a pidfd of each process it forks, readable once the run has exited: the exit
code of the process, which the zygote does not reap until asked, is read from ``/proc`` (see
``zombie_exit_code``), the exit is handled (the next run started), and only then is the zygote
asked to reap it. Where that read fails, the zygote reaps at once and reports the exit code over
its socket, read on the loop. Nothing of it blocks the loop.

A detached run (spec ``detach``) arms no death signal and is left running at shutdown; the next
server adopts it (``adopt``: by pid and start time, watched through a pidfd). An adopted process
is not our child, so its exit status cannot be known: its own files say how it ended.
"""

from __future__ import annotations

import asyncio
import collections
import fcntl
import functools
import logging
import os
import select
import signal
import socket
import struct
import subprocess
import threading
import time
from collections.abc import Callable, Collection
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from .. import contract
from ..runner._proc import DONE_NOTICE, process_start_time, stat_fields
from ..safe_open import UnsafeRunFile, log_open_failure, open_logs
from .cgroups import CgroupError, RunCgroup, remove_each
from .escapees import kill_escaped_all
from .zygotes import ForkRequest, ZygoteClient

log = logging.getLogger(__name__)

# run id, exit code (None: not known) -> None, or a future the clean-up (the removal of the run's
# cgroup) waits for: the handler's reads of the cgroup's figures, off the loop.
ExitCallback = Callable[[str, "int | None"], "asyncio.Future[Any] | None"]
# run id -> whether what the run held went to other runs at its word that it is done (its process
# is then given DONE_EXIT_GRACE_S to be gone).
DoneCallback = Callable[[str], bool]

# A run that said it is done exits at once (``runner.run.finish``); a process still there this
# much later lingers on purpose (an eval that delays its exit), holding a slot it gave back.
# (A process whose teardown is slow, tens of GB of memory, is not hurt: it is leaving already.)
DONE_EXIT_GRACE_S = 2.0
_UCRED = struct.Struct("iII")  # struct ucred: pid, uid, gid (SCM_CREDENTIALS)


class SpawnError(Exception):
    """The run could not start; ``code`` is the reason code its failure gets."""

    def __init__(self, message: str, code: str = contract.EXCEPTION) -> None:
        super().__init__(message)
        self.code = code


@dataclass(slots=True)
class RunProcess:
    run_id: str
    popen: subprocess.Popen | None  # None: forked by a zygote, or adopted from an earlier server
    cgroup: RunCgroup | None = None  # every process of the run is in it (where the host has cgroups)
    pidfd: int | None = None
    kill_timer: asyncio.TimerHandle | None = field(default=None, repr=False)
    spawned_at: float = field(default_factory=time.time)
    detached: bool = False  # left running at shutdown
    adopted_pid: int = 0  # adopted, or forked by a zygote
    create_time: float | None = None  # psutil's, where known: adopted, or reported by the zygote
    zygote: ZygoteClient | None = field(default=None, repr=False)  # its parent, which reports its exit
    pending: bool = False  # asked of the zygote, no pid yet
    pending_signal: tuple[str, float] | None = None  # ("term", grace) or ("kill", 0): sent once it has a pid
    exit_code: int | None = None  # a forked run's, as its zygote reported it or read from /proc
    zombie: bool = False  # a forked run whose exit code was read before its zygote reaped it
    notice: socket.socket | None = field(default=None, repr=False)  # where the run says it is done
    linger_timer: asyncio.TimerHandle | None = field(default=None, repr=False)  # armed at that word

    @property
    def pid(self) -> int:
        return self.popen.pid if self.popen is not None else self.adopted_pid

    def ended(self) -> tuple[bool, int | None]:
        """(whether it has ended, its exit code when that can be known)."""
        if self.popen is not None:
            code = self.popen.poll()
            return code is not None, code
        if self.zygote is not None:  # its pidfd shows it (``Launcher._forked_exited``), or its zygote says so
            return self.exit_code is not None, self.exit_code
        return not is_same_process(self.adopted_pid, self.create_time, alive_only=True), None


def process_create_time(pid: int) -> float | None:
    """psutil's ``create_time`` of ``pid`` (None when it is gone), read without psutil's
    objects where ``/proc`` allows: this is read on the loop at every run's start."""
    created = process_start_time(pid)
    if created is not None:
        return created
    try:
        return psutil.Process(pid).create_time()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return None


def _notice_pair() -> tuple[socket.socket, socket.socket]:
    """A cold run's notice socket pair: (ours, non-blocking, told who sends; the run's, at 3 or
    above: a server started with a standard descriptor closed would hand out 0, 1 or 2, which
    the child's own stdin, stdout and stderr take)."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        ours.setblocking(False)
        ours.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        if theirs.fileno() < 3:
            high = socket.socket(fileno=fcntl.fcntl(theirs.fileno(), fcntl.F_DUPFD_CLOEXEC, 3))
            theirs.close()
            theirs = high
    except BaseException:
        ours.close()
        theirs.close()
        raise
    return ours, theirs


def _sender_pid(ancillary: list[tuple[int, int, bytes]]) -> int | None:
    """The sender's pid in a message's SCM_CREDENTIALS, as the kernel vouches for it."""
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS and len(data) >= _UCRED.size:
            return int(_UCRED.unpack_from(data)[0])
    return None


def zombie_exit_code(pid: int, pidfd: int) -> int | None:
    """The exit code (as ``Popen.returncode``) of ``pid``, another process's child that has exited
    and is not reaped yet, or None (alive, or reaped already: then its parent reports it).
    ``pidfd`` names that very process: a signal 0 through it succeeds until it is reaped, so a
    success after the read proves that the read was of this process and not of a new one that
    got its pid."""
    fields = stat_fields(pid)
    if fields is None or fields[0] not in (b"Z", b"X") or len(fields) < 50:
        return None
    try:
        status = int(fields[49])  # field 52, exit_code: the wait status (Linux 3.5+)
        signal.pidfd_send_signal(pidfd, 0)
    except (ValueError, OSError):
        return None
    return os.waitstatus_to_exitcode(status)


def is_same_process(pid: int | None, create_time: float | None, alive_only: bool = False) -> bool:
    """True only when ``pid`` is alive *and* is the process that started at ``create_time``:
    a recycled pid belongs to another process and must never be mistaken for a run.
    ``alive_only``: a zombie (exited, not yet reaped by its parent) does not count."""
    if not pid or create_time is None:
        return False
    try:
        proc = psutil.Process(pid)
        now = proc.create_time()
        if alive_only and proc.status() == psutil.STATUS_ZOMBIE:
            return False
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return False
    return abs(now - create_time) < 0.05


class Launcher:
    def __init__(self, on_exit: ExitCallback, notify_exits: bool = True, on_done: DoneCallback | None = None) -> None:
        self._on_exit = on_exit
        self._on_done = on_done
        # False: exits are noticed by poll() alone (the reconciliation), as on a host without pidfd.
        self.notify_exits = notify_exits
        self._procs: dict[str, RunProcess] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        # Clean-up of ended runs (a thread's work), done or under way: a run's next attempt waits
        # for it, or it could remove the new attempt's cgroup. Completed in the thread, without a
        # wake-up of the loop (nothing waits for it but a next attempt, which is rare); the done
        # ones are dropped at the next run's end.
        self.cleaning: collections.OrderedDict[str, Future[None]] = collections.OrderedDict()
        # Where ended runs' clean-up (cgroup removal) runs: one thread for all of it (None: the
        # loop's default executor).
        self.janitor: Executor | None = None
        self.clean_ups = CleanUps()

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            raise RuntimeError("Launcher.bind(loop) first")
        return self._loop

    @property
    def running(self) -> dict[str, int]:
        """Run id -> the pid of its live process (not those still being forked)."""
        return {run_id: p.pid for run_id, p in self._procs.items() if not p.pending}

    def _open_logs(self, stdout: Path, stderr: Path) -> tuple[int, int]:
        # The run may have left a FIFO or a link in their place (a retry reopens them).
        try:
            return open_logs(stdout, stderr)
        except UnsafeRunFile as exc:
            raise SpawnError(log_open_failure(exc), code=contract.RUN_FILE) from None
        except OSError as exc:
            raise SpawnError(log_open_failure(exc)) from exc

    def fork(
        self,
        run_id: str,
        zygote: ZygoteClient,
        run_dir: str,
        cwd: str,
        env: dict[str, str],
        cgroup: RunCgroup | None,
        on_started: Callable[[RunProcess], None],
        on_cold: Callable[[str], None],
        on_error: Callable[[str, str | None], None],
        prepare: Callable[[RunCgroup | None], RunCgroup | None] | None = None,
    ) -> RunProcess:
        """Ask ``zygote`` to fork the run (a warm start). The answer comes later, on the loop:
        ``on_started`` once it has a pid, ``on_cold(why)`` when the zygote would rather not (the
        caller then starts it cold), ``on_error(why, code)`` when it cannot start at all (``code``:
        ``run_file`` when its logs in ``run_dir`` are not regular files, else None; the run opens
        them itself, as a cold start's are opened here). A signal asked
        for meanwhile (cancel, kill) is sent once the pid is known. ``prepare`` is given the cgroup
        the spare waits in, at the hand-over, and returns the run's (its limits written); without
        it, the spare's cgroup (or ``cgroup``) is the run's."""
        proc = RunProcess(run_id, None, cgroup, zygote=zygote, pending=True)
        self._procs[run_id] = proc

        def forked(pid: int, at: float, create_time: float | None, pidfd: int | None, notice: socket.socket) -> bool:
            if self._procs.get(run_id) is not proc:  # given up meanwhile (shutdown)
                _killpg(pid, signal.SIGKILL)
                if pidfd is not None:
                    os.close(pidfd)
                notice.close()
                return False
            proc.adopted_pid = pid
            proc.pending = False
            proc.spawned_at = at
            proc.create_time = create_time
            watched = False
            if pidfd is not None and self.notify_exits:
                proc.pidfd, watched = pidfd, True
                self.loop.add_reader(pidfd, self._exited, run_id)
            elif pidfd is not None:
                os.close(pidfd)
            if watched and self._on_done is not None:
                proc.notice = notice
                self.loop.add_reader(notice.fileno(), self._noticed, run_id)
            else:
                notice.close()
            # (No move into its cgroup from here: a forked run is running already, and its runner
            # joins the cgroup itself before any user code: ``runner._proc.ensure_in_cgroup``. A
            # thread per run for it would only cost the loop a hand-over.)
            asked, proc.pending_signal = proc.pending_signal, None
            on_started(proc)
            if asked is not None and self._procs.get(run_id) is proc:
                if asked[0] == "kill":
                    self._kill_hard(proc)
                else:
                    self.terminate(run_id, asked[1])
            return watched

        def prepared(spare_cgroup: RunCgroup | None) -> RunCgroup | None:
            if prepare is not None:
                proc.cgroup = prepare(spare_cgroup)
            elif spare_cgroup is not None:
                proc.cgroup = spare_cgroup
            return proc.cgroup

        def answered(then: Callable[..., None], *answer: Any) -> None:
            if self._procs.get(run_id) is proc:
                del self._procs[run_id]
                then(*answer)

        zygote.fork(
            ForkRequest(
                run_id,
                run_dir,
                cwd,
                env,
                forked,
                functools.partial(answered, on_cold),
                functools.partial(answered, on_error),
                prepared,
            )
        )
        return proc

    def is_pending(self, run_id: str) -> bool:
        """A warm start asked of a zygote, no pid yet."""
        proc = self._procs.get(run_id)
        return proc is not None and proc.pending

    def withdraw(self, run_id: str) -> RunProcess | None:
        """A warm start asked of a zygote and not started yet is given up (a cancel): no process
        of the run is left, and none comes. Returns its ``RunProcess`` (its cgroup is the
        caller's to drop), or None when the run has no such start pending."""
        proc = self._procs.get(run_id)
        if proc is None or not proc.pending or proc.zygote is None or not proc.zygote.withdraw(run_id):
            return None
        del self._procs[run_id]
        return proc

    def zygote_exited(self, run_id: str, pid: int, code: int) -> None:
        """A zygote reaped a run it forked (or died, taking its runs with it: code -9)."""
        proc = self._procs.get(run_id)
        if proc is None or proc.zygote is None or proc.pid != pid:
            return
        proc.exit_code = code
        self._finish(proc, code)

    def spawn(
        self,
        run_id: str,
        argv: list[str],
        cwd: str,
        env: dict[str, str],
        stdout: Path,
        stderr: Path,
        cgroup: RunCgroup | None = None,
        detached: bool = False,
        notice_flag: str | None = None,
    ) -> RunProcess:
        """Start ``argv`` in a new session, its output appended to ``stdout``/``stderr`` (never
        through a symbolic link); SpawnError says why it could not start. With ``cgroup``, the
        process is moved into it right away, off the event loop (the runner checks, before any
        user code, that it is there: see ``runner._proc.ensure_in_cgroup``). With
        ``notice_flag``, the process gets a socket to say it is done on (``DONE_NOTICE``), named
        by ``notice_flag`` and its descriptor at the end of its command line."""
        if self._loop is None:
            raise RuntimeError("Launcher.bind(loop) first")
        ours = theirs = None
        if notice_flag is not None and self.notify_exits and self._on_done is not None:
            ours, theirs = _notice_pair()
            argv = [*argv, notice_flag, str(theirs.fileno())]
        try:
            out, err = self._open_logs(stdout, stderr)
        except BaseException:
            for end in (ours, theirs):
                if end is not None:
                    end.close()
            raise
        try:
            popen = subprocess.Popen(
                argv,
                cwd=cwd,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                start_new_session=True,
                close_fds=True,
                pass_fds=() if theirs is None else (theirs.fileno(),),
            )
        except BaseException as exc:
            if ours is not None:
                ours.close()
            if isinstance(exc, OSError):
                raise SpawnError(f"{type(exc).__name__}: {exc.strerror or exc} (cwd {cwd!r})") from exc
            raise
        finally:
            os.close(out)
            os.close(err)
            if theirs is not None:
                theirs.close()
        proc = RunProcess(run_id, popen, cgroup, detached=detached)
        self._procs[run_id] = proc
        if cgroup is not None:
            self.loop.run_in_executor(None, _join_cgroup, cgroup, popen.pid)
        self._watch(proc)
        if ours is not None:
            if proc.pidfd is not None:
                proc.notice = ours
                self.loop.add_reader(ours.fileno(), self._noticed, run_id)
            else:
                ours.close()  # no pidfd: exits are polled, and so is everything else
        return proc

    def adopt(self, run_id: str, pid: int, create_time: float | None, cgroup: RunCgroup | None) -> RunProcess:
        """Follow a detached run an earlier server started (the caller checked pid and start
        time): its exit is noticed through a pidfd, like a child's, without its status."""
        if self._loop is None:
            raise RuntimeError("Launcher.bind(loop) first")
        proc = RunProcess(
            run_id, None, cgroup, detached=True, adopted_pid=pid, create_time=create_time, spawned_at=create_time or 0.0
        )
        self._procs[run_id] = proc
        self._watch(proc)
        return proc

    def _watch(self, proc: RunProcess) -> None:
        if not self.notify_exits:
            return
        try:
            proc.pidfd = os.pidfd_open(proc.pid)
        except (AttributeError, OSError):
            proc.pidfd = None  # no pidfd: the scheduler's periodic reconciliation calls poll()
            return
        self.loop.add_reader(proc.pidfd, self._exited, proc.run_id)

    def _exited(self, run_id: str) -> None:
        proc = self._procs.get(run_id)
        if proc is None:
            return
        if proc.zygote is not None:
            self._forked_exited(proc)
            return
        ended, code = proc.ended()
        if ended:
            self._finish(proc, code)

    def _forked_exited(self, proc: RunProcess) -> None:
        """A forked run's pidfd is readable: it has exited, and its zygote reaps it only once
        asked. Its exit code is read here, the zygote is asked after the run's end is handled
        (and the next run started): its work at a run's exit is off that path."""
        assert proc.zygote is not None
        code = zombie_exit_code(proc.pid, proc.pidfd) if proc.pidfd is not None else None
        if code is not None:
            proc.exit_code, proc.zombie = code, True
            self._finish(proc, code)
            return
        # Not readable here (or reaped already): the zygote reaps it and reports the exit code.
        self._unwatch(proc)
        if proc.linger_timer is not None:  # gone: its pid is not its own any more once reaped
            proc.linger_timer.cancel()
            proc.linger_timer = None
        proc.zygote.release_child(proc.pid)

    def _noticed(self, run_id: str) -> None:
        """A run's socket is readable: its word that it is done (its ``_DONE`` exists and
        its process is leaving), or its end (the exit comes through the pidfd)."""
        proc = self._procs.get(run_id)
        if proc is None or proc.notice is None:
            return
        try:
            data, ancillary, _flags, _addr = proc.notice.recvmsg(len(DONE_NOTICE) + 1, socket.CMSG_SPACE(_UCRED.size))
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data, ancillary = b"", []
        self._unnotice(proc)
        if data != DONE_NOTICE or self._on_done is None or _sender_pid(ancillary) != proc.pid:
            return  # not the word, or not from the run's own process (a child it forked)
        try:
            released = self._on_done(run_id)
        except Exception:
            log.exception("done handler failed for run %s", run_id)
            return
        if released and self._procs.get(run_id) is proc:
            proc.linger_timer = self.loop.call_later(DONE_EXIT_GRACE_S, self._lingered, proc)

    def _lingered(self, proc: RunProcess) -> None:
        proc.linger_timer = None
        if self._procs.get(proc.run_id) is not proc:
            return
        log.warning(
            "evalsched: run %s said it was done %g s ago and its process %d is still there: killed",
            proc.run_id,
            DONE_EXIT_GRACE_S,
            proc.pid,
        )
        self._kill_hard(proc)

    def _unnotice(self, proc: RunProcess) -> None:
        if proc.notice is not None:
            self.loop.remove_reader(proc.notice.fileno())
            proc.notice.close()
            proc.notice = None

    def poll(self) -> None:
        """Backstop for hosts without pidfd (and for missed wake-ups)."""
        for proc in list(self._procs.values()):
            if proc.pending:
                continue
            if proc.zygote is not None:
                if proc.pidfd is not None and _readable(proc.pidfd):
                    self._forked_exited(proc)
                continue
            ended, code = proc.ended()
            if ended:
                self._finish(proc, code)

    def _unwatch(self, proc: RunProcess) -> None:
        if proc.pidfd is not None:
            self.loop.remove_reader(proc.pidfd)
            os.close(proc.pidfd)
            proc.pidfd = None

    def _stop_watching(self, proc: RunProcess) -> None:
        self._unwatch(proc)
        self._unnotice(proc)
        if proc.kill_timer is not None:
            proc.kill_timer.cancel()
        if proc.linger_timer is not None:
            proc.linger_timer.cancel()
            proc.linger_timer = None

    def _finish(self, proc: RunProcess, code: int | None) -> None:
        self._procs.pop(proc.run_id, None)
        self._stop_watching(proc)
        # The leader is gone; anything it left in its group (a forked child that outlived it)
        # goes too. The group id cannot be reused yet: it is the leader's pid, just reaped. (An
        # adopted leader was reaped by another process, so its pid may be reused already: its
        # cgroup, where it has one, is what clean-up empties.)
        # (A forked run's leader is reaped by its zygote, which does this first; one whose exit
        # code was read here is not reaped before this server asks, after its end is handled.)
        if proc.zombie or (proc.zygote is None and (proc.popen is not None or proc.cgroup is None)):
            _killpg(proc.pid, signal.SIGKILL)
        # Registered before the exit handler runs: it may start the run's next attempt at once,
        # which must wait for this clean-up (it would remove the new attempt's cgroup).
        # (Mostly the oldest are the done ones: clean-ups run in one thread, in the order they
        # were queued, though a run's may wait for its exit's figures first. Looking at all of
        # them made each end cost the loop as much as the clean-up's backlog was long.)
        while self.cleaning and next(iter(self.cleaning.values())).done():
            self.cleaning.popitem(last=False)
        cleaned: Future[None] = Future()
        cleaned.set_running_or_notify_cancel()  # (a waiter's cancel must not make it look done)
        self.cleaning.pop(proc.run_id, None)  # (a next attempt's goes last)
        self.cleaning[proc.run_id] = cleaned
        after = None
        try:
            after = self._on_exit(proc.run_id, code)
        except Exception:
            log.exception("exit handler failed for run %s", proc.run_id)
        if proc.zombie and proc.zygote is not None:
            proc.zygote.release_child(proc.pid, exit_read=True)
        # A descendant that left the group (setsid) escaped that killpg: its cgroup holds it, or
        # its environment names the run. Done off the event loop, after the exit is recorded (and
        # the cgroup's figures read): the next admission does not wait for it.
        if after is not None and not after.done():
            after.add_done_callback(lambda _: self._clean_up(proc, cleaned))
        else:
            self._clean_up(proc, cleaned)

    def _clean_up(self, proc: RunProcess, cleaned: Future[None]) -> None:
        done = self.clean_ups.add(proc)

        def work() -> None:
            try:
                self.clean_ups.run(done)
            except Exception:
                log.exception("clean-up after run %s failed", proc.run_id)
            finally:
                cleaned.set_result(None)

        try:
            if self.janitor is not None:
                self.janitor.submit(work)
            else:
                self.loop.run_in_executor(None, work)
        except RuntimeError:  # the janitor is closed (shutdown): done here
            work()

    def terminate(self, run_id: str, grace_s: float) -> bool:
        """SIGTERM to the run's group, SIGKILL after ``grace_s``. False when it is not ours."""
        proc = self._procs.get(run_id)
        if proc is None:
            return False
        if proc.pending:
            if proc.pending_signal is None:
                proc.pending_signal = ("term", grace_s)
            return True
        _killpg(proc.pid, signal.SIGTERM)
        if proc.kill_timer is None:
            proc.kill_timer = self.loop.call_later(grace_s, self._kill_hard, proc)
        return True

    def kill_due_in(self, run_id: str) -> float | None:
        """Seconds until the SIGKILL of the run's group that a ``terminate`` set (the first one's:
        a later one keeps it); None when none is set."""
        proc = self._procs.get(run_id)
        if proc is None or proc.kill_timer is None:
            return None
        return max(0.0, proc.kill_timer.when() - self.loop.time())

    def kill_now(self, run_id: str) -> bool:
        """SIGKILL to everything of the run at once (a run that must stop before it hurts its
        neighbours). False when it is not ours."""
        proc = self._procs.get(run_id)
        if proc is None:
            return False
        if proc.pending:
            proc.pending_signal = ("kill", 0.0)
            return True
        self._kill_hard(proc)
        return True

    def _kill_hard(self, proc: RunProcess) -> None:
        _killpg(proc.pid, signal.SIGKILL)
        if proc.cgroup is not None:
            self.loop.run_in_executor(None, proc.cgroup.kill)

    def kill_all(self, also: Collection[str] = ()) -> list[str]:
        """On shutdown: SIGKILL every run group and reap; returns the run ids that were killed.
        Detached runs are left running (the next server adopts them), but for those in ``also``
        (a cancel under way: the next server would not know of it)."""
        killed = []
        for proc in list(self._procs.values()):
            if proc.detached and proc.run_id not in also:
                self._stop_watching(proc)
                continue
            if proc.pending:  # not forked yet: it is killed when its pid comes (or by its zygote's end)
                killed.append(proc.run_id)
                continue
            _killpg(proc.pid, signal.SIGKILL)
            try:
                if proc.popen is not None:
                    proc.popen.wait(timeout=5)
            except subprocess.TimeoutExpired:
                log.error("run %s (pid %s) did not die on SIGKILL", proc.run_id, proc.pid)
            self._stop_watching(proc)
            clean_up_after(proc)
            killed.append(proc.run_id)
        self._procs.clear()
        return killed


def _readable(fd: int) -> bool:
    try:
        return bool(select.select([fd], [], [], 0)[0])
    except (OSError, ValueError):
        return False


def _join_cgroup(cgroup: RunCgroup, pid: int) -> None:
    try:
        cgroup.add(pid)
    except CgroupError as exc:
        # Gone already (a run that ends at once), or refused: the runner joins by itself.
        log.debug("run %s: %s", cgroup.run_id, exc)


def clean_up_after(proc: RunProcess) -> None:
    """Kill whatever the run left behind and remove its cgroup (blocking: a thread's work). The
    environment is searched even with a cgroup: a process of the run can move itself out of it
    (it has the server's uid; docs/reference.md, "What the host cannot guarantee")."""
    clean_up_after_all([proc])


def clean_up_after_all(procs: list[RunProcess], lingering: list[RunCgroup] | None = None) -> None:
    """``clean_up_after`` for runs that ended together: every cgroup emptied and removed first
    (nothing of those runs runs any more, so nothing can leave a cgroup during the search), then
    one search of the process table for all of them. A cgroup that would not go (a process in it
    slow to die) is added to ``lingering``, where given, to be removed at a later clean-up."""
    for proc in procs:
        if proc.cgroup is not None and not proc.cgroup.remove() and lingering is not None:
            lingering.append(proc.cgroup)
    try:
        kill_escaped_all({proc.run_id: proc.spawned_at for proc in procs})
    except Exception:  # a surprise in /proc must not leave the other runs' clean-ups waiting
        log.exception("searching for what runs %s left behind failed", [p.run_id for p in procs])


class CleanUps:
    """Clean-ups after runs' ends, done in a thread, by batches: the search of the process table
    (every process of the host listed, :mod:`.escapees`) is the costly part, and one search
    serves every run that ended before it began. ``add`` (on the loop) queues a run; ``run`` (in a thread, once per
    added run) cleans up after all the runs queued so far, or, where an earlier call took this
    run's batch, waits until that batch is done."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._queued: list[tuple[RunProcess, threading.Event]] = []
        # Cgroups of ended runs that would not go yet: tried again at each batch (and removed with
        # the namespace's stale ones when the server stops), not left for the next server.
        self.lingering: list[RunCgroup] = []

    def add(self, proc: RunProcess) -> threading.Event:
        done = threading.Event()
        with self._lock:
            self._queued.append((proc, done))
        return done

    def run(self, done: threading.Event) -> None:
        with self._lock:
            batch, self._queued = self._queued, []
        if batch:
            try:
                self.lingering[:] = remove_each(self.lingering)
                clean_up_after_all([proc for proc, _ in batch], self.lingering)
            finally:
                for _, event in batch:
                    event.set()
        done.wait()


def _killpg(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


# How long a restart waits, at most, for the runs an earlier server left running to go once
# killed (all of them together): one killed in the middle of a GPU driver's teardown can take
# seconds.
STALE_KILL_WAIT_S = 2.0


def kill_stale_group(pid: int, create_time: float | None) -> bool | None:
    """SIGKILL to the process group of a run an earlier server left behind, if ``pid`` is still
    that run's process (its start is ``create_time``). True: signalled; False: it is, but the
    signal was refused (not this uid's); None: not that run's process any more (gone, or its pid
    another's). Not waited for: :func:`wait_stale_gone` waits for all of them together."""
    if not is_same_process(pid, create_time):
        return None
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        return None  # gone since the look
    except PermissionError:
        return False
    return True


def wait_stale_gone(processes: list[tuple[int, float | None]], timeout: float = STALE_KILL_WAIT_S) -> list[int]:
    """Wait, ``timeout`` in all, until each of these killed processes (pid, start time: the
    leaders of :func:`kill_stale_group`'s groups) is gone or a zombie: it holds nothing more (an
    orphan's may stay unreaped where the host's init does not reap). Returns the pids still
    there then."""
    deadline = time.monotonic() + timeout
    delay = 0.0005
    while True:
        processes = [(pid, created) for pid, created in processes if is_same_process(pid, created, alive_only=True)]
        if not processes or time.monotonic() >= deadline:
            return [pid for pid, _ in processes]
        time.sleep(delay)
        delay = min(delay * 2, 0.05)


def signal_name(code: int) -> str:
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"SIG{-code}"
