"""Warm starts, the server's side: the zygotes runs are forked from (docs/configuration.md,
"Warm starts").

A ``ZygoteClient`` is one zygote process (``runner/zygote.py``) and the socket to it, read on the
event loop. The zygote forks each run's process ahead of its request and hands it over (a
*spare*: a socket to it and a pidfd of it); a start is one non-blocking send to the spare, which
answers on that socket and becomes the run, and the exit code comes back from the zygote (or, as
soon as the run has exited, from the pidfd: see ``launcher``); nothing blocks the loop. A
``ZygotePool`` keeps one zygote per environment: a zygote may fork a run only when the run's
environment has the same values for what the zygote's imports depended on (``incompatible``);
another environment gets its own zygote, up to ``max_zygotes``, reaped when idle.

Whether a run may be forked at all (``cold_reason``) is decided here and in the zygote, which
refuses (threads, CUDA) or answers cold (a preloaded module's file changed: it is then replaced;
the run's cwd shadows a preloaded module: both checked by the spare) when in doubt. A cold start
is always correct, so every doubt ends in one.
"""

from __future__ import annotations

import asyncio
import collections
import errno
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .. import contract
from ..runner._proc import CGROUP_PROCS_ENV, cgroup_procs_value
from ..runner.zygote import CGROUP_SPARES, ENV_RESERVE, PRELOAD, START_DIR, ZYGOTE_FD
from ..schemas import MAX_ENV_BYTES

if TYPE_CHECKING:
    from .cgroup_pool import CgroupPool
    from .cgroups import RunCgroup

log = logging.getLogger("jupyter_evalsched")

# Room for a run's environment in /proc (runner.zygote.show_environment): a spec's env at its
# limit and 32 KiB for the server's own and run_env (one string: execve takes 128 KiB at most).
ENV_RESERVE_BYTES = MAX_ENV_BYTES + 32 * 1024

# Set per run after the fork, or the zygote's own (its socket, start directory, preloads and
# reserve): never part of what makes two environments alike.
PER_RUN_VARIABLES = frozenset(
    {
        "EVALSCHED_RUN_ID",
        "EVALSCHED_PARENT_PID",
        "EVALSCHED_ATTEMPT",
        "EVALSCHED_DEVICES",
        "EVALSCHED_DETACH",
        "EVALSCHED_CGROUP_PROCS",
        "OPENAI_API_KEY",  # a run's own key for the shared models' API: never a zygote's
        PRELOAD,
        ENV_RESERVE,
        ZYGOTE_FD,
        START_DIR,
        "CUDA_VISIBLE_DEVICES",
        "CUDA_DEVICE_ORDER",
    }
)
# Read by the interpreter, the dynamic loader or native libraries at start or load time, where
# the zygote cannot see the read: they must match whatever the preloads are. (LC_* and LANG: the
# interpreter sets its LC_CTYPE, its UTF-8 mode and its streams' encoding from them at start.)
STARTUP_PREFIXES = (
    "PYTHON",
    "LD_",
    "OMP_",
    "MKL_",
    "OPENBLAS_",
    "KMP_",
    "GOMP_",
    "MALLOC_",
    "GLIBC_",
    "LC_",
    "LANG",
)
# A preload that iterated the whole environment (torch does) is assumed to depend on these
# alone, the variables frameworks read as they import (configuration, caches, devices): other
# variables are the run's own, set after the fork (``runner.zygote.set_environment``), so runs
# whose environments differ in them share one zygote (docs/reference.md, "Warm starts").
IMPORT_TIME_PREFIXES = (
    "TORCH",
    "PYTORCH_",
    "CUDA_",
    "NCCL_",
    "NVIDIA_",
    "HF_",
    "HUGGINGFACE_",
    "TRANSFORMERS_",
    "TOKENIZERS_",
    "XLA_",
    "TF_",
    "JAX_",
    "NUMBA_",
    "NUMEXPR_",
    "XDG_",
    "HOME",
    "TMPDIR",
)

MAX_MESSAGE = 1 << 16  # the zygote's messages are small
# How long a reap may wait for the next ``taken`` to carry it (rather than a message of its own
# and a wake-up of the zygote per run), or for the end of a start in flight.
QUIET_REAP_DELAY_S = 0.1
# How long an environment whose zygote missed its start deadline gets no new zygote: its runs start
# cold at once meanwhile instead of each waiting for the deadline again.
STUCK_HOLD_S = 600.0
# A send to a spare failed because the spare is gone (not because of the message).
SPARE_GONE = frozenset({errno.EPIPE, errno.ECONNRESET, errno.ENOTCONN, errno.ECONNREFUSED, errno.EBADF})


def zygote_environment(env: Mapping[str, str]) -> dict[str, str]:
    """The environment a zygote for runs with ``env`` starts with: the run's, without what is
    set per run."""
    return {k: v for k, v in env.items() if k not in PER_RUN_VARIABLES}


def incompatible(zygote_env: Mapping[str, str], env_read: list[str] | None, run_env: Mapping[str, str]) -> str | None:
    """The first variable whose value in ``run_env`` differs from the zygote's where it matters
    (read by name while preloading, or read at start-up by the interpreter or a native library),
    or None when the run may be forked from that zygote. ``env_read`` None (not known yet: the
    zygote is starting): every variable matters. ``"*"`` in it: a preload iterated the
    environment (``dict(os.environ)`` then reads every name too, so the names read tell nothing
    more): the ``IMPORT_TIME_PREFIXES`` variables matter instead."""
    names: set[str] = set(zygote_env) | set(run_env)
    if env_read is None:
        names -= PER_RUN_VARIABLES
    elif "*" in env_read:
        prefixes = STARTUP_PREFIXES + IMPORT_TIME_PREFIXES
        names = {n for n in names if n.startswith(prefixes) and n not in PER_RUN_VARIABLES}
    else:
        names = set(env_read) | {n for n in names if n.startswith(STARTUP_PREFIXES) and n not in PER_RUN_VARIABLES}
    for name in sorted(names):
        if zygote_env.get(name) != run_env.get(name):
            return name
    return None


def cold_reason(spec: Mapping[str, Any], env: Mapping[str, str], warm_start: bool) -> str | None:
    """Why a run must start in a fresh interpreter whatever the zygotes say, or None."""
    if not warm_start:
        return "warm_start is off"
    if spec.get("fresh_interpreter"):
        return "the spec asks for fresh_interpreter"
    if spec.get("detach"):
        return "a detached run starts in a fresh interpreter: one forked by the zygote would die with it"
    path = env.get("PYTHONPATH")
    if path is not None and any(not entry or not os.path.isabs(entry) for entry in path.split(os.pathsep)):
        return "PYTHONPATH has a relative entry, which a fresh interpreter resolves against the run's cwd"
    return None


# ---------------------------------------------------------------------------- one zygote

STARTING, READY, RETIRING, REFUSED, DEAD = "starting", "ready", "retiring", "refused", "dead"


class ColdInstead(Exception):
    """Raised by a ``ForkRequest.prepare`` that finds the spare unfit for its run (a memory limit
    below what the spare already uses): the run starts cold, for the reason given."""


@dataclass
class ForkRequest:
    run_id: str
    run_dir: str
    cwd: str
    env: dict[str, str]
    # (pid, when the run's process got its request: wall clock, its create time or None, a pidfd
    # of it or None, the socket the run tells its end on (``DONE_NOTICE``): the callee owns both)
    # -> whether the callee watches that pidfd for the run's exit (then it reads the exit code
    # itself, and asks the zygote to reap: ``release_child``)
    on_forked: Callable[[int, float, float | None, int | None, socket.socket], bool]
    on_cold: Callable[[str], None]  # the reason: start it in a fresh interpreter
    on_error: Callable[[str, str | None], None]  # it cannot start at all: why, and its code or None
    # Given the cgroup the spare waits in (None: it has none), at the hand-over: the run's cgroup
    # (that one, its limits written; or another the runner joins), which is the callee's from then
    # on; ColdInstead: not this spare (it leaves, with its cgroup), the run starts cold.
    prepare: Callable[[RunCgroup | None], RunCgroup | None] | None = None


ExitHandler = Callable[[str, int, int], None]  # run id, pid, exit code


@dataclass
class Spare:
    """A process the zygote forked ahead of its run: the server's end of the socket it waits on,
    and a pidfd of it (None where the host has none)."""

    pid: int
    sock: socket.socket
    pidfd: int | None
    create_time: float | None
    request: ForkRequest | None = None  # once given a run, until it answers
    cgroup: RunCgroup | None = None  # the cgroup it placed itself in, until given a run
    placed: bool = True  # False: its cgroup is named, its word that it is in it not read yet
    watched: bool = False  # its word is awaited on the loop (a run waits for a placed spare)

    def close(self) -> None:
        self.sock.close()
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None


@dataclass
class ZygoteClient:
    loop: asyncio.AbstractEventLoop
    python: str
    env: dict[str, str]
    preload: list[str]
    on_exit: ExitHandler
    on_change: Callable[[ZygoteClient], None] | None = None
    cgroups: CgroupPool | None = None  # where each spare places itself in a cgroup of its own
    state: str = STARTING
    pid: int = 0
    info: dict[str, Any] = field(default_factory=dict)
    why: str | None = None  # refused, stale or dead: why
    children: dict[str, int] = field(default_factory=dict)  # run id -> pid
    forks: int = 0
    last_used: float = field(default_factory=time.monotonic)
    started_at: float = field(default_factory=time.monotonic)
    _sock: socket.socket | None = None
    _popen: subprocess.Popen | None = None
    _queue: collections.deque[ForkRequest] = field(default_factory=collections.deque)
    _spares: collections.deque[Spare] = field(default_factory=collections.deque)  # not given a run yet
    _asked: dict[int, Spare] = field(default_factory=dict)  # pid -> a spare given a run, no answer yet
    # pid -> the cgroup of a spare not taken (_take_spare), removed again once it has exited: it
    # makes that cgroup after its fork, perhaps after the first removal.
    _untaken: dict[int, RunCgroup] = field(default_factory=dict)
    _outbox: collections.deque[bytes] = field(default_factory=collections.deque)  # to the zygote
    # Exited runs to reap once no start is in flight: [pid, report] (report: the server needs the
    # exit code from the zygote; false where it read it itself)
    _reaps: list[list[Any]] = field(default_factory=list)
    _reap_timer: asyncio.TimerHandle | None = None
    _no_spare: str | None = None  # why the zygote could not fork a spare (until one comes)
    _start_dir: str | None = None
    _writer: bool = False
    start_timeout_s: float | None = None  # the deadline to become ready (a preload that never returns)
    timed_out: bool = False  # it missed that deadline and was killed
    _deadline: asyncio.TimerHandle | None = None

    @property
    def env_read(self) -> list[str] | None:
        read = self.info.get("env_read")
        return list(read) if isinstance(read, list) else None

    def start(self) -> None:
        """Start the zygote process (from the event loop's thread: its death signal is tied to
        the thread that forks it, which lives as long as the server)."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        # Its cwd to start in, sys.path[0]: nothing to import there. It removes it as it starts.
        self._start_dir = tempfile.mkdtemp(prefix="evalsched-zygote-")
        env = dict(self.env)
        env[START_DIR] = self._start_dir
        # Its PYTHONPATH without empty or relative entries: the interpreter would resolve them from
        # the start directory (``..`` leads out of it, into /tmp), and a run whose PYTHONPATH has
        # one is never forked (cold_reason), so they serve no run.
        if "PYTHONPATH" in env:
            kept = [entry for entry in env["PYTHONPATH"].split(os.pathsep) if os.path.isabs(entry)]
            env["PYTHONPATH"] = os.pathsep.join(kept)
            if not kept:
                del env["PYTHONPATH"]
        env[ZYGOTE_FD] = str(theirs.fileno())
        env["EVALSCHED_PARENT_PID"] = str(os.getpid())
        env[PRELOAD] = ",".join(self.preload)
        if self.cgroups is not None:
            env[CGROUP_SPARES] = json.dumps(self.cgroups.cgroups.spare_placement())
        # Room in its initial environment block, which each forked run rewrites to show its own
        # environment in /proc (runner.zygote.show_environment). Last: the zygote clears it to
        # NULs, and a run rewrites only the block before it (clear_env_reserve).
        env.pop(ENV_RESERVE, None)
        env[ENV_RESERVE] = "x" * ENV_RESERVE_BYTES
        try:
            # Its output (a preload's warnings) goes to the server's log through a pipe: no file of
            # it is held open (the runs directory stays remountable). Runs forked from it write
            # their own log files instead.
            self._popen = subprocess.Popen(
                [self.python, "-m", "jupyter_evalsched.runner.zygote"],
                cwd=self._start_dir,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                pass_fds=[theirs.fileno()],
                start_new_session=True,
                close_fds=True,
            )
        except OSError as exc:
            ours.close()
            self._gone(f"could not start the zygote: {exc}")
            return
        finally:
            theirs.close()
        self.pid = self._popen.pid
        if self.start_timeout_s is not None and self.start_timeout_s > 0:
            self._deadline = self.loop.call_later(self.start_timeout_s, self._start_overdue)
        ours.setblocking(False)
        self._sock = ours
        self.loop.add_reader(ours.fileno(), self._readable)
        output = self._popen.stdout
        if output is not None:
            os.set_blocking(output.fileno(), False)
            self.loop.add_reader(output.fileno(), self._output)

    def _start_overdue(self) -> None:
        """Not ready by its start deadline (a preload that never returns): the zygote and what it
        started are killed, and the runs waiting for it start cold."""
        self._deadline = None
        if self.state != STARTING:
            return
        self.timed_out = True
        self.why = (
            f"the zygote was not ready within {self.start_timeout_s:g} s (zygote_start_timeout_s; "
            f"does a preload module never return?): started cold"
        )
        log.warning("evalsched: zygote %d: %s; killed", self.pid, self.why)
        self._kill_group()
        self._gone(self.why)

    def _kill_group(self) -> None:
        """SIGKILL to the zygote and what its preloads started in its group (its own session:
        start_new_session; not reaped yet, so the group is still its). Only before it is ready:
        spares and runs have sessions of their own, which this does not reach."""
        if self._popen is None or self._popen.returncode is not None:
            return
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except OSError:
            pass

    def _stop_deadline(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _output(self) -> None:
        output = self._popen.stdout if self._popen is not None else None
        if output is None or output.closed:
            return
        try:
            data = os.read(output.fileno(), 65536)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self._close_output()
            return
        for line in data.decode("utf-8", "replace").splitlines():
            if line.strip():
                log.info("evalsched zygote %d: %s", self.pid, line.rstrip()[:2000])

    # ------------------------------------------------------------------ requests

    def fork(self, request: ForkRequest) -> None:
        self.last_used = time.monotonic()
        if self.state in (READY, STARTING):
            self._queue.append(request)
            if self.state == READY:
                self._flush()
            return
        request.on_cold(self.why or f"the zygote is {self.state}")

    def _flush(self) -> None:
        """Give the waiting runs to the spares, one each (the zygote forks more on ``taken``)."""
        while self._queue and self.state == READY:
            # The oldest spare that is in its cgroup: surely ready.
            spare = self._placed_spare()
            if spare is None:
                break
            self._spares.remove(spare)
            request = self._queue.popleft()
            env = request.env
            cgroup, spare.cgroup = spare.cgroup, None
            if request.prepare is not None:
                try:
                    cgroup = request.prepare(cgroup)  # (the run's limits, written before it can run)
                except ColdInstead as exc:
                    spare.cgroup = cgroup
                    self._discard_spare(spare)  # (the zygote reaps it and forks another)
                    log.info("evalsched: run %s: %s", request.run_id, exc)
                    request.on_cold(str(exc))
                    continue
            if cgroup is not None:
                env = {**env, CGROUP_PROCS_ENV: cgroup_procs_value(cgroup.procs_files())}
            message = {"run_id": request.run_id, "run_dir": request.run_dir, "cwd": request.cwd, "env": env}
            try:
                # (The run opens its own logs: a file created on this loop costs it a third of
                # a millisecond on a disk like this project's.)
                spare.sock.send(json.dumps(message).encode())
            except OSError as exc:
                # Whatever the failure (a message larger than the socket carries, a spare killed
                # from outside), the run starts cold, once: handed to the next spare it could fail
                # the same way, forever. The spare, whose cgroup went with the run, leaves; the
                # zygote reaps and replaces it. (Without a cgroup it stays, unless it is gone.)
                if exc.errno in SPARE_GONE or cgroup is not None:
                    if exc.errno not in SPARE_GONE and spare.pidfd is not None:
                        try:
                            signal.pidfd_send_signal(spare.pidfd, signal.SIGKILL)
                        except OSError:
                            pass
                    spare.close()
                else:
                    self._spares.appendleft(spare)
                why = f"the warm hand-over to spare {spare.pid} failed ({exc.strerror or exc}): started cold"
                log.warning("evalsched: run %s: %s", request.run_id, why)
                request.on_cold(why)
                continue
            spare.request = request
            self._asked[spare.pid] = spare
            # The zygote hears of it once the spare has answered: the next spare is forked after
            # this run's start, not during it.
            self.loop.add_reader(spare.sock.fileno(), self._answered, spare.pid)
        if (
            self._queue
            and not any(s.placed for s in self._spares)
            and self._no_spare is not None
            and self.state == READY
        ):
            # The zygote could not fork: these runs start cold now rather than wait, and it tries
            # again for the next ones.
            self._cold_queue(self._no_spare)
            self._send({"op": "more"})
        if self._queue and self.state == READY:
            for spare in self._spares:  # runs wait: a spare's word that it is placed is awaited
                if not spare.placed and not spare.watched:
                    spare.watched = True
                    self.loop.add_reader(spare.sock.fileno(), self._placed, spare.pid)

    def _placed_spare(self) -> Spare | None:
        """The oldest spare that is in its cgroup. A spare's word that it is (sent moments after
        its fork) is read here, when a run wants a spare, and not as it comes: a reader on each
        spare's socket woke the loop once more per run, which costs the server a good part of a
        millisecond on a VM whose idle CPUs are slow to wake."""
        for spare in list(self._spares):
            if not spare.placed:
                self._read_placed(spare)
            if spare.placed and spare in self._spares:
                return spare
        return None

    def withdraw(self, run_id: str) -> bool:
        """The run ``run_id``, asked for and not started, is not wanted any more (cancelled): its
        request is dropped, or the spare given it is killed (it may have become the run
        already; the zygote kills its group as it reaps it, and forks the next spare). False
        when no request of that run waits here."""
        for request in self._queue:
            if request.run_id == run_id:
                self._queue.remove(request)
                return True
        for pid, spare in self._asked.items():
            if spare.request is not None and spare.request.run_id == run_id:
                del self._asked[pid]
                self.loop.remove_reader(spare.sock.fileno())
                # (Without a pidfd it is not signalled, as its pid could be another's by now; one
                # that has not read its request yet leaves once its socket closes.)
                if spare.pidfd is not None:
                    try:
                        signal.pidfd_send_signal(spare.pidfd, signal.SIGKILL)
                    except OSError:
                        pass
                spare.close()
                self._taken(pid, None, False)
                return True
        return False

    def _answered(self, pid: int) -> None:
        """The spare ``pid`` answered its run (or closed its socket without answering: it died)."""
        spare = self._asked.pop(pid, None)
        if spare is None:
            return
        self.loop.remove_reader(spare.sock.fileno())
        try:
            data = spare.sock.recv(MAX_MESSAGE)
        except (BlockingIOError, InterruptedError):
            self._asked[pid] = spare  # not yet (a wake-up with nothing to read)
            self.loop.add_reader(spare.sock.fileno(), self._answered, pid)
            return
        except OSError:
            data = b""
        try:
            answer = json.loads(data) if data else {}
        except ValueError:
            answer = {}
        request = spare.request
        assert request is not None
        op = answer.get("op") if isinstance(answer, dict) else None
        pidfd, spare.pidfd = spare.pidfd, None
        if op == "started":
            self.children[request.run_id] = pid
            self.forks += 1
            at = answer.get("at")
            reaps = False
            try:
                reaps = request.on_forked(
                    pid,
                    float(at) if isinstance(at, (int, float)) else time.time(),
                    spare.create_time,
                    pidfd,
                    spare.sock,
                )
            finally:  # (the zygote forks the next spare on it, whatever happened here)
                self._taken(pid, request.run_id, reaps)
            return
        if pidfd is not None:
            os.close(pidfd)
        spare.close()
        self._taken(pid, None, False)
        why = str(answer.get("why")) if isinstance(answer, dict) else ""
        if op == "error":
            # (The one code a spare gives: its logs were not regular files.)
            request.on_error(why, contract.RUN_FILE if answer.get("code") == contract.RUN_FILE else None)
        elif op == "stale":
            self._retire(f"replaced: {why}")
            request.on_cold(why)
        elif op == "cold":
            request.on_cold(why)
        else:
            request.on_cold(f"the process forked for the run died before it started ({data[:200]!r})")

    def _taken(self, pid: int, run_id: str | None, reaps: bool) -> None:
        """Tell the zygote that its spare ``pid`` answered (``run_id`` None: it did not become the
        run); the reaps held back while the answer was awaited go with it if none is awaited any
        more (one message, one wake-up of the zygote)."""
        message: dict[str, Any] = {"op": "taken", "pid": pid, "run_id": run_id, "reaps": reaps}
        if not self._asked and self._reaps:
            message["reap"] = self._take_reaps()
        self._send(message)

    def release_child(self, pid: int, exit_read: bool = False) -> None:
        """The run ``pid``, whose exit the server watches, has exited: the zygote may reap it.
        ``exit_read``: the server read its exit code itself (from the not yet reaped process),
        so the zygote reaps it without a word back, and the server forgets it now; that reap
        waits for the next run's ``taken`` to carry it. Otherwise the zygote reports the exit
        code once it has reaped it, and the reap goes at once, unless a spare's answer is
        awaited: a run started in the exited run's place (in the same loop iteration, usually)
        does not share the CPU with the zygote while it starts. Whatever waits goes within
        ``QUIET_REAP_DELAY_S`` in any case."""
        if exit_read:
            run_id = next((r for r, p in self.children.items() if p == pid), None)
            if run_id is not None:
                del self.children[run_id]
                self.last_used = time.monotonic()
        self._reaps.append([pid, not exit_read])
        if not exit_read and not self._asked:
            self._flush_reaps()
        elif self._reap_timer is None:
            self._reap_timer = self.loop.call_later(QUIET_REAP_DELAY_S, self._reap_later)

    def _reap_later(self) -> None:
        self._reap_timer = None
        self._flush_reaps()

    def _take_reaps(self) -> list[list[Any]]:
        reaps, self._reaps = self._reaps, []
        if self._reap_timer is not None:
            self._reap_timer.cancel()
            self._reap_timer = None
        return reaps

    def _flush_reaps(self) -> None:
        if self._reaps:
            self._send({"op": "reap", "pids": self._take_reaps()})

    def settle(self, pid: int) -> None:
        """Read the answer of the spare ``pid`` now if it is still awaited (its exit was seen
        first: the answer, written before it became the run, is in its socket already)."""
        if pid in self._asked:
            self._answered(pid)

    def _retire(self, why: str) -> None:
        """A spare found a preloaded module's file edited: this zygote forks nothing more (the
        pool starts a fresh one); it ends once its runs have."""
        if self.state not in (READY, STARTING):
            return
        self.state = RETIRING
        self.why = why
        log.info("evalsched: zygote %d %s", self.pid, why)
        self._send({"op": "retire", "why": why})
        self._drop_spares()
        self._cold_all(why, asked=False)
        self._notify()

    def _send(self, message: dict[str, Any]) -> None:
        self._outbox.append(json.dumps(message).encode())
        self._drain_outbox()

    def _drain_outbox(self) -> None:
        sock = self._sock
        while self._outbox and sock is not None:
            try:
                sock.send(self._outbox[0])
            except BlockingIOError:
                if not self._writer:
                    self.loop.add_writer(sock.fileno(), self._drain_outbox)
                    self._writer = True
                return
            except OSError as exc:
                self._outbox.clear()
                log.debug("zygote %d: %s", self.pid, exc)  # its end is read as it happens
                return
            self._outbox.popleft()
        if self._writer and sock is not None:
            self.loop.remove_writer(sock.fileno())
            self._writer = False

    def close(self, wait: bool = True) -> None:
        """Closing the socket ends the zygote, and with it any run it still has. ``wait``: for
        its exit (at shutdown); else the pool's reconciliation reaps it. A zygote still starting
        has no run: it is killed, with whatever its preloads started, rather than left to finish
        a preload that takes seconds (torch) before it sees the socket closed, or one that never
        returns (a shutdown would wait 5 s for it)."""
        if self.state == STARTING:
            self._kill_group()
        self._stop_deadline()
        self._cold_all("the zygote was closed")
        self._drop_spares()
        self._shut_socket()
        if self._popen is not None and wait:
            try:
                self._popen.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._popen.kill()
                self._popen.wait()
            self._output()  # its last words
            self._close_output()
        self._remove_start_dir()
        self._discard_untaken()
        if self.state != REFUSED:
            self.state = DEAD

    # ------------------------------------------------------------------ answers

    def _readable(self) -> None:
        sock = self._sock
        while sock is not None:
            try:
                data, fds, _flags, _addr = socket.recv_fds(sock, MAX_MESSAGE, 2)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                data, fds = b"", []
                log.debug("zygote %d: %s", self.pid, exc)
            if not data:
                for fd in fds:
                    os.close(fd)
                self._gone(self.why or "the zygote exited")
                return
            try:
                self._handle(json.loads(data), fds)
            except Exception:
                log.exception("evalsched: bad message from zygote %d", self.pid)
                for fd in fds:
                    try:
                        os.close(fd)
                    except OSError:
                        pass
            sock = self._sock

    def _handle(self, message: dict[str, Any], fds: list[int]) -> None:
        op = message.get("op")
        if op == "spare":
            self._take_spare(message, fds)
            return
        for fd in fds:  # only a spare comes with descriptors
            os.close(fd)
        if op == "ready":
            self._stop_deadline()
            self.state = READY
            self.info = message
            self._remove_start_dir()  # (the zygote removed it as it started: in case it could not)
            failed = message.get("failed") or []
            log.info(
                "evalsched: zygote %d ready in %.2f s (preloaded: %s)%s",
                self.pid,
                time.monotonic() - self.started_at,
                ", ".join(message.get("preloaded") or []) or "the runner only",
                f"; could not preload: {'; '.join(failed)}" if failed else "",
            )
            self._notify()
            self._flush()
        elif op == "nospare":
            self._no_spare = str(message.get("why"))
            log.warning("evalsched: zygote %d: %s; runs that find no spare start cold", self.pid, self._no_spare)
            self._flush()
        elif op == "refused":
            self._stop_deadline()
            self.state = REFUSED
            self.why = f"warm starts are off: {message.get('why')}"
            log.warning("evalsched: %s; runs start cold", self.why)
            self._drop_spares()
            self._cold_all(self.why, asked=False)
            self._notify()
        elif op == "exit":
            pid = int(message["pid"])
            self._discard_cgroup(self._untaken.pop(pid, None))
            self.settle(pid)  # a run's answer first, then its exit
            dead = next((spare for spare in self._spares if spare.pid == pid), None)
            if dead is not None:  # it died waiting
                self._spares.remove(dead)
                self._discard_spare(dead)
                return
            run_id = next((r for r, p in self.children.items() if p == pid), None)
            if run_id is None:
                return  # a spare that answered cold or error, or one the server never took
            del self.children[run_id]
            self.last_used = time.monotonic()
            self.on_exit(run_id, pid, int(message["code"]))

    def _take_spare(self, message: dict[str, Any], fds: list[int]) -> None:
        pid, created = message.get("pid"), message.get("create_time")
        name = message.get("cgroup")
        leaf = self.cgroups.cgroups.leaf(name) if isinstance(name, str) and self.cgroups is not None else None
        if not fds or not isinstance(pid, int) or self.state != READY:
            # Not taken (a zygote retiring forked it as it was told a spare was taken): it leaves
            # as its socket closes, and so does the cgroup it made for itself, or none would.
            for fd in fds:
                os.close(fd)
            self._discard_cgroup(leaf)
            if leaf is not None and isinstance(pid, int):
                self._untaken[pid] = leaf
            return
        self._no_spare = None
        sock = socket.socket(fileno=fds[0])
        sock.setblocking(False)
        # The kernel's word of who sends each message: the run's ``done`` counts from the run's
        # own process only (Launcher._noticed). Set now, long before that message is sent.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        spare = Spare(
            pid,
            sock,
            fds[1] if len(fds) > 1 else None,
            float(created) if isinstance(created, (int, float)) else None,
        )
        spare.cgroup = leaf
        if spare.cgroup is not None:
            # Given a run once it says it is in its cgroup (moments after its fork, long before
            # it is wanted, usually): the run's limits are written there at the hand-over. That
            # word is read when a run wants this spare (``_placed_spare``).
            spare.placed = False
        self._spares.append(spare)
        self._flush()

    def _placed(self, pid: int) -> None:
        """The socket of the spare ``pid``, whose word a waiting run needs, is readable."""
        spare = next((s for s in self._spares if s.pid == pid and not s.placed), None)
        if spare is None:
            return
        self._read_placed(spare)
        if spare.placed:
            self._flush()

    def _read_placed(self, spare: Spare) -> None:
        """Read the spare's word that it made its cgroup and joined it (or why not), if it has
        come; a spare that died before it was placed is dropped (the zygote's exit message for it
        may follow)."""
        try:
            data = spare.sock.recv(MAX_MESSAGE)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        self._unwatch_placed(spare)
        if not data:
            self._spares.remove(spare)
            self._discard_spare(spare)
            return
        try:
            answer = json.loads(data)
        except ValueError:
            answer = {}
        if not isinstance(answer, dict) or not answer.get("joined"):
            why = answer.get("why") if isinstance(answer, dict) else repr(data[:200])
            log.warning(
                "evalsched: spare %d could not place itself in its cgroup (%s); its run joins one itself",
                spare.pid,
                why,
            )
            if not (isinstance(answer, dict) and answer.get("made")):
                spare.cgroup = None  # nothing of it is left: the run gets a cgroup of the pool
        spare.placed = True

    def _unwatch_placed(self, spare: Spare) -> None:
        if spare.watched:
            spare.watched = False
            try:
                self.loop.remove_reader(spare.sock.fileno())
            except (ValueError, OSError):
                pass

    def _discard_cgroup(self, cgroup: RunCgroup | None) -> None:
        if cgroup is not None and self.cgroups is not None:
            self.cgroups.discard(cgroup)

    def _discard_spare(self, spare: Spare) -> None:
        """A spare that will not become a run: it leaves (its socket closes), and its cgroup is
        removed once it has."""
        self._unwatch_placed(spare)
        spare.close()
        cgroup, spare.cgroup = spare.cgroup, None
        self._discard_cgroup(cgroup)
        if cgroup is not None and not spare.placed:
            self._untaken[spare.pid] = cgroup  # (it may make its cgroup after this removal)

    def _discard_untaken(self) -> None:
        """The zygote has ended, and its spares with it: the cgroups of those not taken go now,
        whether or not their exit was told."""
        untaken, self._untaken = self._untaken, {}
        for cgroup in untaken.values():
            self._discard_cgroup(cgroup)

    def _drop_spares(self) -> None:
        """The spares are not needed (the zygote retires or ends): each leaves once its socket
        closes."""
        while self._spares:
            self._discard_spare(self._spares.popleft())

    def _notify(self) -> None:
        if self.on_change is not None:
            self.on_change(self)

    def _cold_all(self, why: str, asked: bool = True) -> None:
        """The runs not given to a spare yet go cold, and (``asked``: the zygote is ending, and
        its children with it) those a spare has not answered. A zygote that only stops forking
        keeps them: each spare's answer says whether it became its run."""
        self._cold_queue(why)
        if not asked:
            return
        spares, self._asked = list(self._asked.values()), {}
        for spare in spares:
            self.loop.remove_reader(spare.sock.fileno())
            spare.close()
            if spare.request is not None:
                spare.request.on_cold(why)

    def _cold_queue(self, why: str) -> None:
        """The runs waiting for a spare start cold."""
        waiting = list(self._queue)
        self._queue.clear()
        for request in waiting:
            request.on_cold(why)

    def _gone(self, why: str) -> None:
        """The zygote exited (or never started): its runs died with it (their death signal)."""
        self._stop_deadline()
        self._shut_socket()
        if self._popen is not None:
            try:
                # Its socket closed as it exited: the status follows within moments (bounded, as
                # this is the loop).
                code = self._popen.wait(timeout=0.2)
            except subprocess.TimeoutExpired:
                code = None
            if code is not None and code != 0:
                why = f"{why} (exit status {code})"
        if self.state not in (REFUSED, RETIRING) or self.children:
            log.log(
                logging.WARNING if self.state != RETIRING else logging.INFO,
                "evalsched: zygote %d gone: %s",
                self.pid,
                why,
            )
        if self.state != REFUSED:
            self.state = DEAD
            self.why = self.why or why
        self._drop_spares()
        self._cold_all(why)
        children, self.children = self.children, {}
        for run_id, pid in children.items():
            self.on_exit(run_id, pid, -9)
        self._remove_start_dir()
        self._discard_untaken()
        self._notify()

    def _close_output(self) -> None:
        output = self._popen.stdout if self._popen is not None else None
        if output is not None and not output.closed:
            try:
                self.loop.remove_reader(output.fileno())
            except (ValueError, OSError):
                pass
            output.close()

    def _shut_socket(self) -> None:
        sock, self._sock = self._sock, None
        self._outbox.clear()
        self._take_reaps()  # (the zygote's end takes its runs with it)
        if sock is not None:
            try:
                self.loop.remove_reader(sock.fileno())
                if self._writer:
                    self.loop.remove_writer(sock.fileno())
                    self._writer = False
            except (ValueError, OSError):
                pass
            sock.close()

    def _remove_start_dir(self) -> None:
        """Where the zygote could not remove its start directory itself. Empty (nothing is written
        there), so an rmdir: once the zygote has removed it, whatever another user may have made
        under the same name in /tmp is not ours to empty."""
        if self._start_dir is not None:
            try:
                os.rmdir(self._start_dir)
            except OSError:
                pass
            self._start_dir = None

    def reap(self) -> bool:
        """True once the zygote process has ended (polled by the pool's reconciliation)."""
        ended = self._popen is None or self._popen.poll() is not None
        if ended:
            self._close_output()
        return ended

    def _ready_spares(self) -> list[int]:
        """The spares ready to become a run (their word that they are placed read now; a run that
        waits for such a spare gets it in a moment, as from the reader that would have read it)."""
        read = False
        for spare in list(self._spares):
            if not spare.placed:
                self._read_placed(spare)
                read = read or spare.placed
        if read and self._queue:
            self.loop.call_soon(self._flush)
        return [spare.pid for spare in self._spares if spare.placed]

    def status(self) -> dict[str, Any]:
        return {
            "pid": self.pid,
            "state": self.state,
            "why": self.why,
            "preloaded": list(self.info.get("preloaded") or []),
            "failed": list(self.info.get("failed") or []),
            "import_s": self.info.get("import_s"),
            "modules": self.info.get("modules"),
            "runs": len(self.children),
            "forks": self.forks,
            # (Those ready to become a run: a spare still placing itself in its cgroup is not.)
            "spares": self._ready_spares(),
        }


# ---------------------------------------------------------------------------- the pool


@dataclass
class WarmStartConfig:
    enabled: bool = True
    preload: list[str] = field(default_factory=list)
    max_zygotes: int = 4
    idle_s: float = 600.0
    python: str = sys.executable
    start_timeout_s: float = 60.0  # a zygote not ready by then is killed; its runs start cold
    stuck_hold_s: float = STUCK_HOLD_S  # and its environment gets no zygote for this long


class ZygotePool:
    def __init__(self, config: WarmStartConfig, on_exit: ExitHandler, cgroups: CgroupPool | None = None) -> None:
        self.config = config
        self.on_exit = on_exit
        self.cgroups = cgroups  # each spare waits in a cgroup of its own (None: no cgroups)
        self.zygotes: list[ZygoteClient] = []
        self.refused: str | None = None  # a preload that can never be forked from: warm starts are off
        self.primary_env: dict[str, str] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._early_deaths = 0
        self._closed = False
        # Environments whose zygote missed its start deadline: (env, until (monotonic), why).
        self._held: list[tuple[dict[str, str], float, str]] = []

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop

    def start(self, run_env: Mapping[str, str]) -> None:
        """The zygote for the server's own run environment, started with the server."""
        if not self.config.enabled:
            return
        self.primary_env = zygote_environment(run_env)
        self._new(self.primary_env)

    def _new(self, env: dict[str, str]) -> ZygoteClient:
        assert self._loop is not None, "ZygotePool.bind(loop) first"
        zygote = ZygoteClient(
            self._loop,
            self.config.python,
            env,
            list(self.config.preload),
            self.on_exit,
            on_change=self._changed,
            cgroups=self.cgroups,
            start_timeout_s=self.config.start_timeout_s,
        )
        self.zygotes.append(zygote)
        zygote.start()
        return zygote

    def held(self, env: Mapping[str, str]) -> str | None:
        """Why no zygote is started for ``env`` now (its last one missed its start deadline), or None."""
        now = time.monotonic()
        self._held = [entry for entry in self._held if entry[1] > now]
        for held_env, until, why in self._held:
            if held_env == env:
                return f"{why}; no zygote for this environment is tried again for {until - now:.0f} s"
        return None

    def _changed(self, zygote: ZygoteClient) -> None:
        if zygote.timed_out and zygote.state == DEAD and self.config.stuck_hold_s > 0:
            self._held = [entry for entry in self._held if entry[0] != zygote.env]
            self._held.append((zygote.env, time.monotonic() + self.config.stuck_hold_s, str(zygote.why)))
        if zygote.state == REFUSED and self.refused is None:
            self.refused = zygote.why
        elif zygote.state == READY:
            self._early_deaths = 0
        elif zygote.state == DEAD and not zygote.info:
            # It died before it was ready: a preload that crashes the interpreter. Twice more and
            # warm starts are off (a cold start is always possible).
            self._early_deaths += 1
            if self._early_deaths >= 3 and self.refused is None:
                self.refused = f"warm starts are off: the zygote died {self._early_deaths} times before it was ready ({zygote.why})"
                log.warning("evalsched: %s", self.refused)
        if zygote.state in (RETIRING, DEAD) and zygote.env == self.primary_env and self._loop is not None:
            self._loop.call_soon(self._replace_primary)

    def _replace_primary(self) -> None:
        """The server's own zygote was replaced (stale) or died: the next one starts now, to be
        ready before it is needed."""
        if not self.config.enabled or self.refused is not None or self.primary_env is None or self._closed:
            return
        if self.held(self.primary_env) is not None:
            return  # its zygote missed its start deadline: tried again after the hold (``reconcile``)
        if not any(z.env == self.primary_env and z.state in (READY, STARTING) for z in self.zygotes):
            self._new(self.primary_env)

    def choose(self, run_env: Mapping[str, str]) -> ZygoteClient | str:
        """The zygote to fork a run with ``run_env`` from (started if need be), or why none."""
        if self.refused is not None:
            return self.refused
        wanted = zygote_environment(run_env)
        held = self.held(wanted)
        if held is not None:
            return held
        for zygote in self.zygotes:
            if zygote.state not in (READY, STARTING):
                continue
            read = zygote.env_read if zygote.state == READY else None
            if incompatible(zygote.env, read, wanted) is None:
                return zygote
        live = [z for z in self.zygotes if z.state in (READY, STARTING)]
        if len(live) >= self.config.max_zygotes:
            idle = [z for z in live if not z.children and z.env != self.primary_env]
            if not idle:
                differs = incompatible(live[0].env, live[0].env_read, wanted)
                return (
                    f"all {len(live)} zygotes (max_zygotes) serve other environments "
                    f"(this run's {differs} differs) and are busy"
                )
            min(idle, key=lambda z: z.last_used).close(wait=False)
        return self._new(wanted)

    def reconcile(self) -> None:
        """Close zygotes idle for ``idle_s`` (but the server's own), drop the ended ones."""
        now = time.monotonic()
        for zygote in list(self.zygotes):
            if zygote.state in (READY, STARTING) and not zygote.children and zygote.env != self.primary_env:
                if now - zygote.last_used > self.config.idle_s:
                    log.info("evalsched: zygote %d idle for %.0f s: closed", zygote.pid, now - zygote.last_used)
                    zygote.close(wait=False)
            if zygote.state in (DEAD, RETIRING) and zygote.reap() and not zygote.children:
                if zygote._sock is not None:
                    zygote._gone("it ended")
                self.zygotes.remove(zygote)
        self._replace_primary()

    def close(self) -> None:
        self._closed = True
        for zygote in self.zygotes:
            zygote.close()
        self.zygotes.clear()

    def status(self) -> dict[str, Any]:
        return {
            "enabled": self.config.enabled,
            "preload": list(self.config.preload),
            "refused": self.refused,
            "held": [why for _env, until, why in self._held if until > time.monotonic()],
            "zygotes": [z.status() for z in self.zygotes],
        }
