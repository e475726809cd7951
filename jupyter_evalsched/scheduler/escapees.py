"""What a run left outside its process group and its cgroup, found in the process table and killed.

A run's descendant can call ``setsid`` (no ``killpg`` reaches it) and, having the server's uid,
write its pid into another ``cgroup.procs`` (its cgroup's kill misses it). It still carries
``EVALSCHED_RUN_ID=<run id>`` in its environment, so after runs end the whole process table is
searched once for all of them (``kill_escaped_all``; the clean-up thread batches the runs that
ended together).

A process caught in the middle of an ``exec`` shows an empty environment for a moment: the new
image's memory is in place before the kernel has finished recording where its environment lies.
Such a process is looked at again, 1 ms apart, until its environment is there
(:func:`environ_of`), for 50 ms at most in all for a search, rather than passed over.

A search looks at every process of the host, so its cost grows with the host's processes, not
with the runs: hundreds or thousands on a shared GPU host. Only processes started since the
earliest searched run's spawn can be a run's; the others are passed over by their start time,
which is read from ``/proc/<pid>/stat`` once per process and then remembered
(:class:`StartTimes`). A search then costs one read of ``/proc`` (the directory), the starts of
the few processes new since the last one, and the uid and environment of those started since the
runs.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Iterator

import psutil

from ..runner._proc import stat_fields

log = logging.getLogger(__name__)

RUN_ID_VARIABLE = b"EVALSCHED_RUN_ID="

# What the listing of /proc says for the inode of an entry the kernel could not set up.
NO_ENTRY_INODE = 1

list_proc = os.scandir  # (the tests list a /proc of their own through it)

# How long a search waits, at most, for the processes it caught in the middle of an exec to show
# their environment (all of them together), and how often it looks again.
EXEC_GRACE_S = 0.05
EXEC_POLL_S = 0.001
# /proc/<pid>/stat: flags (field 9) of a process that has no environment worth waiting for, and
# the indices in stat_fields of start_code, env_start and env_end (fields 26, 50 and 51).
PF_EXITING = 0x4
PF_KTHREAD = 0x00200000
START_CODE, ENV_START, ENV_END = 23, 47, 48
NUM_THREADS = 17  # (field 20)


class StartTimes:
    """When each process of the host started (clock ticks since boot, as ``/proc/<pid>/stat``
    says), remembered between searches under the inode number of its ``/proc/<pid>`` entry.

    That number comes with the directory listing, at no cost: the kernel gives a process's
    ``/proc/<pid>`` an inode of its own while the process lives, numbered from a counter
    (``get_next_ino``) whose numbers are not handed out twice until it wraps round. Since Linux
    5.7 a process's entry goes when it ends, before its pid can be reused, so a pid reused by a
    new process comes with a new inode and its start is read again; so is a process whose entry
    the kernel dropped from its caches meanwhile. An entry the kernel could not set up (the
    process was ending, or memory ran out) is listed with inode 1: read, never remembered.

    What could go wrong is only a miss of this best-effort search, never a wrong kill (every
    process that may be killed has its start read again through a pidfd): after the 32-bit
    counter, shared with every pipe, socket and ``/proc`` file, wrapped round, or on a kernel
    before 5.7, where a lookup racing a process's end could leave its entry for the pid's next
    owner, a run's process might be taken for the older one and left alive. (On gVisor every
    listing numbers the entries anew: nothing is found again, and each start is read, as before.)"""

    def __init__(self) -> None:
        self._known: dict[tuple[str, int], int] = {}  # (pid, inode): start ticks

    def started_since(self, earliest: float) -> list[tuple[int, int]]:
        """(pid, start ticks) of every process now that started at ``earliest`` (ticks) or later,
        from the listing of ``/proc``; a process gone before its start was read is left out.
        What is remembered is what this listing saw: the processes that ended are forgotten.
        (The loop runs once per process of the host, holding the GIL: kept to a lookup.)"""
        known: dict[tuple[str, int], int] = {}
        found: list[tuple[int, int]] = []
        try:
            with list_proc("/proc") as entries:
                for entry in entries:
                    key = (entry.name, entry.inode())
                    started = self._known.get(key)
                    if started is None:
                        if not key[0].isdigit():
                            continue
                        started = start_ticks(int(key[0]))
                        if started is None:
                            continue  # gone
                        if key[1] > NO_ENTRY_INODE:  # (an entry of its own, to know it by next time)
                            known[key] = started
                    else:
                        known[key] = started
                    if started >= earliest:
                        found.append((int(key[0]), started))
        except OSError:
            return found
        self._known = known
        return found


# One listing at a time (the clean-up thread's search, or a recovery's), each with what the last
# one saw.
_search_lock = threading.Lock()
_start_times = StartTimes()


def kill_escaped_all(runs: dict[str, float]) -> dict[str, list[int]]:
    """Kill the processes runs (run id: its spawn) left outside their process groups (a descendant
    that called ``setsid``) and outside their cgroups (one that wrote its pid into another
    cgroup.procs, as the server's uid may), in one pass over ``/proc``: they still carry
    ``EVALSCHED_RUN_ID=<run id>`` in their environment. Only processes of the server's uid started
    after the run's spawn are looked at. Best effort: a process that both leaves the run's cgroup
    and clears its environment escapes it. A process's start is known from an earlier search or read
    from its ``stat``; only the few started since the earliest spawn are read further (``status``
    for the uid, ``environ`` for the run id), and each is killed through a pidfd once its start is
    read again, so a recycled pid is never hit."""
    if not runs:
        return {}
    boot, tick = psutil.boot_time(), 1.0 / os.sysconf("SC_CLK_TCK")
    # In clock ticks since boot, as /proc/<pid>/stat says when each process started.
    since = {run_id: (at - 1.0 - boot) / tick for run_id, at in runs.items()}
    earliest = min(since.values())
    me, uid = os.getpid(), os.getuid()
    killed: dict[str, list[int]] = {}
    with _search_lock:
        candidates = _start_times.started_since(earliest)
    unsettled: list[tuple[int, int]] = []
    for pid, started in candidates:
        if pid == me or _real_uid(pid) != uid:
            continue  # not the server's uid (not a run's, whatever it says)
        if not _look_at(pid, started, since, killed):
            unsettled.append((pid, started))
    # Those caught in the middle of an exec, again until their environment is there: one grace
    # for the whole search, after the others' kills.
    deadline = time.monotonic() + EXEC_GRACE_S
    while unsettled and time.monotonic() < deadline:
        time.sleep(EXEC_POLL_S)
        unsettled = [(pid, started) for pid, started in unsettled if not _look_at(pid, started, since, killed)]
    for run_id, pids in killed.items():
        log.warning("run %s left %d process(es) outside its process group; killed %s", run_id, len(pids), pids)
    return killed


class _Unsettled:
    """What :func:`environ_of` says of a process caught in the middle of an ``exec``."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "UNSETTLED"


UNSETTLED = _Unsettled()


def environ_of(pid: int) -> bytes | None | _Unsettled:
    """``/proc/<pid>/environ``; None when the process has none to read (gone, not ours to read,
    a zombie, exiting, a kernel thread); ``UNSETTLED`` when it is in the middle of an ``exec``.
    A process whose main thread has exited and whose other threads go on shows theirs.

    From ``exec_mmap`` until ``load_elf_binary`` has finished the new image's tables, a
    process's environ reads empty (so does an environ opened on the old memory and read after
    it went), and its ``stat`` shows ``start_code`` 0: the kernel sets it only once
    ``create_elf_tables`` has returned, and while that runs ``env_start`` equals ``env_end``
    for a moment whatever the environment holds. An empty environment is the process's own only
    when it reads empty again and a ``stat`` read after that shows a finished image
    (``start_code`` set) whose ``env_start`` equals ``env_end``: a chain of execs, such as
    ``setsid env nohup cmd``, passes through one window after another, and the second read may
    fall into the next one. Where this host's ``stat`` does not fill those fields in (a sandbox),
    an empty environment is taken as it reads, as before."""
    environ = read_environ(pid)
    if environ:
        return environ
    fields = stat_fields(pid)
    try:
        if fields and fields[0] == b"Z" and int(fields[NUM_THREADS]) > 1:
            return _threads_environ(pid)  # its main thread has exited, its others go on
        if environ is None:
            return None
        if not fields or fields[0] in (b"Z", b"X") or int(fields[6]) & (PF_EXITING | PF_KTHREAD):
            return None  # gone, ending (a zombie too) or a kernel thread: nothing to wait for
        if not STAT_SHOWS_EXEC:
            return environ
        if fields[START_CODE] == b"0":
            return UNSETTLED
    except (ValueError, IndexError):
        return None
    environ = read_environ(pid)  # (the exec may have ended between the two reads)
    if environ != b"":
        return environ
    again = stat_fields(pid)
    if again and len(again) > ENV_END and again[START_CODE] != b"0" and again[ENV_START] == again[ENV_END]:
        return b""  # this image's own, empty environment
    return UNSETTLED


def _stat_shows_exec() -> bool:
    """Whether this host's ``/proc/<pid>/stat`` shows a process's ``start_code`` and ``env_end``
    (a sandbox's may show 0): this process's own are set."""
    fields = stat_fields()
    try:
        return fields is not None and fields[START_CODE] != b"0" and fields[ENV_END] != b"0"
    except IndexError:
        return False


STAT_SHOWS_EXEC = _stat_shows_exec()


def _threads_environ(pid: int) -> bytes | None:
    """The environment of a process whose main thread has exited while its other threads go on
    (``pthread_exit`` in ``main``; a runtime may do it): its ``/proc/<pid>`` describes that
    thread, a zombie whose environ reads nothing, though the process it led still runs and the
    search can kill it through ``pid``. Read from one of its live threads instead, one that has
    the uid the caller checked (the main thread's: a thread of a root process may have switched
    to another) and is not exiting; None when there is none (the process is ending)."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    uid = _real_uid(pid)
    for tid in tids:
        thread = f"{pid}/task/{tid}"
        if tid == str(pid) or uid is None or _real_uid(thread) != uid:
            continue
        fields = stat_fields(thread)
        try:
            if not fields or fields[0] in (b"Z", b"X") or int(fields[6]) & PF_EXITING:
                continue
        except (ValueError, IndexError):
            continue
        if environ := read_environ(thread):
            return environ
    return None


def read_environ(pid: int | str) -> bytes | None:
    """``/proc/<pid>/environ`` (``pid`` may be ``<pid>/task/<tid>``, a thread's) as it reads now;
    None when it cannot be read."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return f.read()
    except OSError:
        return None


def _look_at(pid: int, started: int, since: dict[str, float], killed: dict[str, list[int]]) -> bool:
    """Kill ``pid`` if its environment names a searched run that it started after (added to
    ``killed``). False when its environment is not set up yet (``UNSETTLED``)."""
    environ = environ_of(pid)
    if isinstance(environ, _Unsettled):
        return False
    if environ:
        run_id = next((r for r in run_ids_in(environ) if r in since), None)
        if run_id is not None and started >= since[run_id] and _kill_if_started(pid, started):
            killed.setdefault(run_id, []).append(pid)
    return True


def run_ids_in(environ: bytes) -> Iterator[str]:
    """The values of ``EVALSCHED_RUN_ID`` in a process's ``/proc/<pid>/environ`` (NUL-separated;
    found with ``bytes.find``, not a split of the whole environment: a run's may be large)."""
    padded, key = b"\0" + environ, b"\0" + RUN_ID_VARIABLE
    at = padded.find(key)
    while at >= 0:
        start = at + len(key)
        end = padded.find(b"\0", start)
        yield padded[start : end if end >= 0 else None].decode("utf-8", "replace")
        at = padded.find(key, end) if end >= 0 else -1


def start_ticks(pid: int) -> int | None:
    """When ``pid`` started, in clock ticks since boot (None: gone)."""
    fields = stat_fields(pid)
    try:
        return None if fields is None else int(fields[19])  # starttime (field 22)
    except (ValueError, IndexError):
        return None


def _real_uid(pid: int | str) -> int | None:
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"Uid:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


def _kill_if_started(pid: int, started: int) -> bool:
    """SIGKILL to ``pid`` if it is still the process that started at ``started`` (ticks)."""
    try:
        fd = os.pidfd_open(pid)
    except OSError:
        return False  # gone
    try:
        if start_ticks(pid) != started:
            return False  # another process now has the pid
        signal.pidfd_send_signal(fd, signal.SIGKILL)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
