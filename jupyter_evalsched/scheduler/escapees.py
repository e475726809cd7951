"""What a run left outside its process group and its cgroup, found in the process table and killed.

A run's descendant can call ``setsid`` (no ``killpg`` reaches it) and, having the server's uid,
write its pid into another ``cgroup.procs`` (its cgroup's kill misses it). It still carries
``EVALSCHED_RUN_ID=<run id>`` in its environment, so after runs end the whole process table is
searched once for all of them (``kill_escaped_all``; the clean-up thread batches the runs that
ended together).

A search looks at every process of the host, so its cost grows with the host's processes, not
with the runs: hundreds or thousands on a shared GPU host. Only processes started since the
earliest searched run's spawn can be a run's; the others are passed over by their start time,
which is read from ``/proc/<pid>/stat`` once per process and then remembered
(:class:`StartTimes`). A search then costs one read of ``/proc`` (the directory) plus the few
processes new since the last one.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Iterator

import psutil

from ..runner._proc import stat_fields

log = logging.getLogger(__name__)

RUN_ID_VARIABLE = b"EVALSCHED_RUN_ID="

# What the listing of /proc says for the inode of an entry the kernel could not set up.
NO_ENTRY_INODE = 1

list_proc = os.scandir  # (the tests list a /proc of their own through it)


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


def kill_escaped(run_id: str, since: float) -> list[int]:
    """Kill the processes a run left outside its process group (a descendant that called
    ``setsid``) and outside its cgroup (one that wrote its pid into another cgroup.procs, as the
    server's uid may): they still carry ``EVALSCHED_RUN_ID=<run_id>`` in their environment. Only
    processes of the server's uid started after ``since`` (the run's spawn) are looked at. Best
    effort: a process that both leaves the run's cgroup and clears its environment escapes it."""
    return kill_escaped_all({run_id: since}).get(run_id, [])


def kill_escaped_all(runs: dict[str, float]) -> dict[str, list[int]]:
    """``kill_escaped`` for several runs (run id: its spawn) in one pass over ``/proc``. A
    process's start is known from an earlier search or read from its ``stat``; only the few
    started since the earliest spawn are read further (``status`` for the uid, ``environ`` for
    the run id), and each is killed through a pidfd once its start is read again, so a recycled
    pid is never hit."""
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
    for pid, started in candidates:
        if pid == me or _real_uid(pid) != uid:
            continue  # not the server's uid (not a run's, whatever it says)
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                environ = f.read()
        except OSError:
            continue
        run_id = next((r for r in run_ids_in(environ) if r in since), None)
        if run_id is None or started < since[run_id]:
            continue
        if _kill_if_started(pid, started):
            killed.setdefault(run_id, []).append(pid)
    for run_id, pids in killed.items():
        log.warning("run %s left %d process(es) outside its process group; killed %s", run_id, len(pids), pids)
    return killed


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


def _real_uid(pid: int) -> int | None:
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
