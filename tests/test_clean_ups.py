"""What runs leave behind, found in one pass over /proc (issue #29: psutil's search of the
process table, once per run, held the GIL for a third of a server's profile samples): each run's
escaped processes killed, nobody else's, and runs that end together share one search."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
from proc_status import alive
from waiting import wait_until

from jupyter_evalsched.scheduler import escapees, launcher
from jupyter_evalsched.scheduler.launcher import CleanUps, RunProcess, kill_escaped_all


@pytest.fixture
def spawn():
    procs: list[subprocess.Popen] = []

    def start(run_id: str) -> subprocess.Popen:
        # A session of its own, as a run's descendant that called setsid: no killpg reaches it.
        proc = subprocess.Popen(
            [sys.executable, "-c", "import time; time.sleep(120)"],
            env={**os.environ, "EVALSCHED_RUN_ID": run_id},
            start_new_session=True,
        )
        procs.append(proc)
        # Popen returns once the exec closed its pipe, a moment before the new image's
        # environment can be read: a search in between would pass the process over.
        wait_until(lambda: f"EVALSCHED_RUN_ID={run_id}\0".encode() in _environ(proc.pid), timeout=20)
        return proc

    yield start
    for proc in procs:
        proc.kill()
        proc.wait()


def gone(proc: subprocess.Popen) -> bool:
    return proc.poll() is not None


def test_each_runs_escaped_processes_are_killed_and_nobody_elses(spawn):
    older = spawn("run-d")  # run-d's spawn is stamped after this process started: not its
    time.sleep(1.2)  # (the search allows a second of slack between a run's spawn stamp and its processes)
    since = time.time()
    a, b, other = spawn("run-a"), spawn("run-b"), spawn("run-c")  # run-c is not searched for
    b2 = spawn("run-b")
    killed = kill_escaped_all({"run-a": since, "run-b": since, "run-d": since})
    assert killed.keys() == {"run-a", "run-b"}, killed
    assert killed["run-a"] == [a.pid] and sorted(killed["run-b"]) == sorted([b.pid, b2.pid]), killed
    for proc in (a, b, b2):
        wait_until(lambda p=proc: gone(p), timeout=10)
    assert all(alive(p.pid) for p in (older, other)), "a process not of a searched run (or older) was killed"


def test_a_process_whose_environment_names_no_run_is_left(spawn):
    proc = spawn("")
    assert kill_escaped_all({"run-x": time.time() - 5}) == {}
    assert alive(proc.pid)


def test_runs_that_end_together_share_one_search(spawn, monkeypatch):
    """Three runs queued together: the first thread's call cleans up after all three in one
    search; the two other calls (one in a second thread, where it waits for that batch) search
    nothing, and each returns only once its run's escaped process is dead."""
    searches: list[list[str]] = []
    searched = threading.Event()
    real = launcher.kill_escaped_all

    def counted(runs: dict[str, float]) -> dict[str, list[int]]:
        searches.append(sorted(runs))
        time.sleep(0.3)  # a search under way while the other calls come
        try:
            return real(runs)
        finally:
            searched.set()

    monkeypatch.setattr(launcher, "kill_escaped_all", counted)
    ids = [f"run-{uuid.uuid4().hex[:8]}" for _ in range(3)]
    since = time.time()
    procs = [spawn(run_id) for run_id in ids]
    clean_ups = CleanUps()
    events = [clean_ups.add(RunProcess(run_id, None, spawned_at=since)) for run_id in ids]
    returned: list[tuple[int, bool]] = []
    lock = threading.Lock()

    def run(i: int) -> None:
        clean_ups.run(events[i])
        with lock:
            returned.append((i, searched.is_set()))

    with ThreadPoolExecutor(2) as pool:
        list(pool.map(run, range(3)))
    assert searches == [sorted(ids)], searches
    assert sorted(i for i, _ in returned) == [0, 1, 2]
    assert all(after for _, after in returned), f"a call returned before the search for its run was done: {returned}"
    for proc in procs:
        wait_until(lambda p=proc: gone(p), timeout=10)
    # A run queued after that batch gets a search of its own.
    late = spawn("run-late")
    clean_ups.run(clean_ups.add(RunProcess("run-late", None, spawned_at=since)))
    assert searches[-1] == ["run-late"]
    wait_until(lambda: gone(late), timeout=10)


@pytest.mark.parametrize(
    "environ, ids",
    [
        (b"EVALSCHED_RUN_ID=a\0X=1\0EVALSCHED_RUN_ID=b", ["a", "b"]),
        (b"X=1\0EVALSCHED_RUN_ID=c\0", ["c"]),
        (b"EVALSCHED_RUN_ID=e", ["e"]),
        (b"X=1\0Y=2\0", []),
        (b"", []),
        (b"XEVALSCHED_RUN_ID=d\0Y=EVALSCHED_RUN_ID=f\0", []),  # a longer name, a value that says it
        (b"EVALSCHED_RUN_ID=\0", [""]),
    ],
)
def test_the_run_ids_in_an_environment(environ, ids):
    assert list(escapees.run_ids_in(environ)) == ids


def _ticks_read(monkeypatch) -> list[int]:
    """The pids whose start ``escapees`` reads from ``/proc/<pid>/stat`` from now on."""
    read: list[int] = []
    real = escapees.start_ticks

    def counted(pid: int) -> int | None:
        read.append(pid)
        return real(pid)

    monkeypatch.setattr(escapees, "start_ticks", counted)
    return read


def test_a_search_reads_the_start_of_a_process_once(spawn, monkeypatch):
    """The start of a process that an earlier search saw is not read again (the search's cost
    on a host with thousands of processes), but that of a process new since then is, and so is
    that of a process killed as a run's (again, at the kill: its pid may have been reused)."""
    older = spawn("run-old")
    kill_escaped_all({"run-none": time.time()})  # the host as it is now, seen once
    read = _ticks_read(monkeypatch)
    kill_escaped_all({"run-none": time.time()})
    assert older.pid not in read and os.getppid() not in read, read
    since = time.time()
    new = spawn("run-new")
    read.clear()
    assert kill_escaped_all({"run-new": since}) == {"run-new": [new.pid]}
    assert read.count(new.pid) == 2, read  # listed as new, then read again before the kill
    assert older.pid not in read
    wait_until(lambda: gone(new), timeout=10)
    assert alive(older.pid)


_scandir = os.scandir


def _entry(name: str, inode: int) -> SimpleNamespace:
    return SimpleNamespace(name=name, inode=lambda: inode)


class _Listing:
    """``os.scandir("/proc")`` as the kernel would list it with another inode for ``pid``'s
    entry: its own shifted by ``shift``, or ``inode``."""

    def __init__(self, pid: int, shift: int = 0, inode: int | None = None) -> None:
        self.entries = [
            _entry(e.name, e.inode() + shift if inode is None else inode) if e.name == str(pid) else e
            for e in _scandir("/proc")
        ]

    def __enter__(self):
        return iter(self.entries)

    def __exit__(self, *exc):
        return False


def test_a_process_seen_under_another_inode_is_read_again(spawn, monkeypatch):
    """What a search remembers of a pid holds only for the same /proc entry. A search sees a
    run's escaped process under an entry of its pid that says it started at boot (as an older
    process under the same pid would); the next search lists the pid with its own, new entry:
    its start is read again, and the process is found and killed."""
    since = time.time() - 1
    escaped = spawn("run-reused")
    real_ticks = escapees.start_ticks
    with monkeypatch.context() as m:
        m.setattr(escapees, "list_proc", lambda path: _Listing(escaped.pid, shift=-1))
        m.setattr(escapees, "start_ticks", lambda pid: 0 if pid == escaped.pid else real_ticks(pid))
        assert kill_escaped_all({"run-reused": since}) == {}  # (older than the run: passed over)
    assert kill_escaped_all({"run-reused": since}) == {"run-reused": [escaped.pid]}
    wait_until(lambda: gone(escaped), timeout=10)


def test_an_entry_listed_without_an_inode_of_its_own_is_never_remembered(spawn, monkeypatch):
    """An entry the kernel could not set up is listed with inode 1, whatever process holds the
    pid: a start read under it is not taken for the next search's. A run's escaped process is
    listed so twice, the first time while its pid's start reads as at boot (another process's):
    the second search reads it again, and finds and kills it."""
    since = time.time() - 1
    escaped = spawn("run-unset")
    real_ticks = escapees.start_ticks
    monkeypatch.setattr(escapees, "list_proc", lambda path: _Listing(escaped.pid, inode=escapees.NO_ENTRY_INODE))
    with monkeypatch.context() as m:
        m.setattr(escapees, "start_ticks", lambda pid: 0 if pid == escaped.pid else real_ticks(pid))
        assert kill_escaped_all({"run-unset": since}) == {}
    assert kill_escaped_all({"run-unset": since}) == {"run-unset": [escaped.pid]}
    wait_until(lambda: gone(escaped), timeout=10)


def test_a_process_that_ended_is_forgotten(spawn):
    """What a search remembers is what its listing saw: a process gone since is not kept (the
    memory stays the size of the host's process table)."""
    proc = spawn("run-short")
    kill_escaped_all({"run-none": time.time()})
    assert any(name == str(proc.pid) for name, _ in escapees._start_times._known)
    proc.kill()
    proc.wait()
    kill_escaped_all({"run-none": time.time()})
    assert not any(name == str(proc.pid) for name, _ in escapees._start_times._known)


def _environ(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return f.read()
    except OSError:
        return b""
