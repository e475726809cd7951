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
from proc_status import StaleGroup, alive, main_thread_exited
from waiting import wait_until

from jupyter_evalsched.scheduler import cgroups as cgroups_module
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


def _reads_of(monkeypatch, pid: int, blank: int = 0) -> list[int]:
    """Count the reads of ``/proc/<pid>/environ`` a search makes; the first ``blank`` of them
    answer empty, as the kernel does for a process in the middle of an exec."""
    real = escapees.read_environ
    reads: list[int] = []

    def read(p: int) -> bytes | None:
        if p != pid:
            return real(p)
        reads.append(p)
        return b"" if len(reads) <= blank else real(p)

    monkeypatch.setattr(escapees, "read_environ", read)
    return reads


def _stats_of(monkeypatch, pid: int, *shown) -> list[int]:
    """``/proc/<pid>/stat`` as the kernel would show it to ``environ_of`` (the start's reads are
    left alone): its first reads altered one by one by ``shown`` (each a dict of index: value,
    or None for the real one), the rest real."""
    real = escapees.stat_fields
    reads: list[int] = []

    def stat(p: int | str = "self") -> list[bytes] | None:
        fields = real(p)
        if p != pid or fields is None or sys._getframe(1).f_code.co_name != "environ_of":
            return fields
        reads.append(1)
        change = shown[len(reads) - 1] if len(reads) <= len(shown) else None
        return [change.get(i, f) for i, f in enumerate(fields)] if change else fields

    monkeypatch.setattr(escapees, "stat_fields", stat)
    return reads


# A process between the new image's memory and its tables, as /proc/<pid>/stat shows it.
IN_EXEC = {escapees.START_CODE: b"0", escapees.ENV_START: b"0", escapees.ENV_END: b"0"}


def test_a_process_caught_in_the_middle_of_an_exec_is_looked_at_again(spawn, monkeypatch):
    """From ``setup_new_exec`` to ``create_elf_tables`` a process's environ reads empty and its
    stat shows no environment yet (a shell of the run's starting its next command may be there
    when the search comes). Such a process is read again until its environment is there: found,
    and killed."""
    since = time.time() - 1
    escaped = spawn("run-exec")
    reads = _reads_of(monkeypatch, escaped.pid, blank=3)
    _stats_of(monkeypatch, escaped.pid, IN_EXEC, IN_EXEC, IN_EXEC)
    assert kill_escaped_all({"run-exec": since}) == {"run-exec": [escaped.pid]}
    assert len(reads) == 4, reads
    wait_until(lambda: gone(escaped), timeout=10)


def test_a_process_caught_while_its_tables_are_made_is_looked_at_again(spawn, monkeypatch):
    """While ``create_elf_tables`` runs, ``env_start`` equals ``env_end`` (both set) whatever the
    environment holds, and the environment reads empty: that is no empty environment of the
    process's own until the image is finished (``start_code`` set). Read again: found, killed."""
    since = time.time() - 1
    escaped = spawn("run-tables")
    fields = escapees.stat_fields(escaped.pid)
    assert fields is not None
    making = {escapees.START_CODE: b"0", escapees.ENV_END: fields[escapees.ENV_START]}
    reads = _reads_of(monkeypatch, escaped.pid, blank=2)
    _stats_of(monkeypatch, escaped.pid, None, making)
    assert kill_escaped_all({"run-tables": since}) == {"run-tables": [escaped.pid]}
    assert len(reads) == 3, reads
    wait_until(lambda: gone(escaped), timeout=10)


def test_a_chain_of_execs_is_followed_to_its_end(spawn, monkeypatch):
    """``setsid env nohup cmd`` passes through one exec after another: an image seen set up may
    be replaced before the environment is read again, which then reads empty. That emptiness
    is the next image's window (its ``start_code`` not set yet), not the process's own
    environment: it is read again, found, and killed."""
    since = time.time() - 1
    escaped = spawn("run-chain")
    reads = _reads_of(monkeypatch, escaped.pid, blank=2)
    _stats_of(monkeypatch, escaped.pid, None, IN_EXEC)
    assert kill_escaped_all({"run-chain": since}) == {"run-chain": [escaped.pid]}
    assert len(reads) == 3, reads
    wait_until(lambda: gone(escaped), timeout=10)


def test_an_empty_environment_of_a_process_set_up_is_its_own(monkeypatch):
    """A process whose image is set up (its stat shows where its environment lies, and that it
    is empty) has an empty environment of its own: read once more, not waited for."""
    since = time.time() - 1
    proc = subprocess.Popen(
        [sys.executable, "-c", "print('up', flush=True); import time; time.sleep(120)"],
        env={},
        stdout=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline() == b"up\n"
        fields = escapees.stat_fields(proc.pid)
        assert fields is not None and fields[escapees.ENV_START] == fields[escapees.ENV_END] != b"0"
        assert fields[escapees.START_CODE] != b"0"
        reads = _reads_of(monkeypatch, proc.pid)
        kill_escaped_all({"run-empty": since})
        assert len(reads) == 2, reads
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("flag", [escapees.PF_EXITING, escapees.PF_KTHREAD])
def test_an_exiting_process_or_a_kernel_thread_is_not_waited_for(spawn, monkeypatch, flag):
    """Some kernels read an exiting process's environ, and a kernel thread's, as empty, with no
    environment in their stat either: passed over at once (a kernel thread has the uid of a
    server run as root), not waited for."""
    since = time.time() - 1
    proc = spawn("run-ending")
    reads = _reads_of(monkeypatch, proc.pid, blank=1_000_000)
    fields = escapees.stat_fields(proc.pid)
    assert fields is not None
    _stats_of(monkeypatch, proc.pid, {**IN_EXEC, 6: str(int(fields[6]) | flag).encode()})
    assert kill_escaped_all({"run-ending": since}) == {}
    assert len(reads) == 1, reads


def test_a_process_that_ends_while_it_is_looked_at_again_is_not_waited_for(monkeypatch):
    """A process caught in the middle of an exec that ends before it shows its environment (a
    zombie now) is passed over at the next look, not waited for until the grace runs out."""
    since = time.time() - 1
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        wait_until(lambda: escapees.stat_fields(proc.pid)[0] == b"Z", timeout=20)
        reads = _reads_of(monkeypatch, proc.pid, blank=1_000_000)
        flags = int(escapees.stat_fields(proc.pid)[6]) & ~escapees.PF_EXITING
        _stats_of(monkeypatch, proc.pid, {0: b"R", 6: str(flags).encode(), **IN_EXEC})
        assert kill_escaped_all({"run-zombie": since}) == {}
        assert len(reads) == 2, reads
    finally:
        proc.wait()


def test_a_process_whose_main_thread_has_exited_is_found_through_its_other_threads():
    """Once the main thread of a multithreaded process exits, ``/proc/<pid>`` shows that thread,
    a zombie with no environment, while the process goes on in its other threads: found through
    one of them, and killed whole."""
    since = time.time() - 1
    proc = main_thread_exited({**os.environ, "EVALSCHED_RUN_ID": "run-threads"})
    try:
        assert escapees.read_environ(proc.pid) in (None, b"")
        assert kill_escaped_all({"run-threads": since}) == {"run-threads": [proc.pid]}
        wait_until(lambda: gone(proc), timeout=10)
    finally:
        proc.kill()
        proc.wait()


class _Clock:
    """``escapees.time`` with a clock that only a sleep moves: how often a search looks again,
    counted without depending on the machine's speed."""

    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps = 0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps += 1
        self.now += seconds


def test_the_grace_for_execs_is_one_for_the_whole_search(spawn, monkeypatch):
    """Processes whose environment never shows (forever in the window, as far as the search can
    tell) are waited for together, ``EXEC_GRACE_S`` in all, then passed over: a search takes no
    longer for three of them than for one."""
    since = time.time() - 1
    procs = [spawn(f"run-stuck-{i}") for i in range(3)]
    for proc in procs:
        _reads_of(monkeypatch, proc.pid, blank=1_000_000)
        _stats_of(monkeypatch, proc.pid, *[IN_EXEC] * 1_000)
    clock = _Clock()
    monkeypatch.setattr(escapees, "time", clock)
    assert kill_escaped_all({f"run-stuck-{i}": since for i in range(3)}) == {}
    rounds = round(escapees.EXEC_GRACE_S / escapees.EXEC_POLL_S)
    assert rounds <= clock.sleeps <= rounds + 1, clock.sleeps
    assert all(alive(p.pid) for p in procs)


# setresuid as a raw system call changes the calling thread's uid alone (libc's changes all).
SETRESUID = {"x86_64": 117, "aarch64": 147}.get(os.uname().machine)


@pytest.mark.skipif(os.getuid() != 0 or SETRESUID is None, reason="needs root on x86_64 or aarch64")
def test_a_thread_under_another_uid_does_not_make_its_process_the_servers():
    """The threads of a root process whose main thread has exited are read only where they have
    the main thread's uid, the one the search checked: one that switched to another uid does not
    make the process a run's of the server's uid."""
    code = (
        "import ctypes, threading, time; libc = ctypes.CDLL(None); switched = threading.Event()\n"
        "def other():\n"
        f"    libc.syscall({SETRESUID}, 65534, 65534, 65534); switched.set(); time.sleep(120)\n"
        "threading.Thread(target=other).start(); switched.wait(); libc.pthread_exit(None)"
    )
    since = time.time() - 1
    proc = main_thread_exited({**os.environ, "EVALSCHED_RUN_ID": "run-uid"}, code)
    try:
        assert escapees.environ_of(proc.pid) is None
        assert kill_escaped_all({"run-uid": since}) == {}
        assert proc.poll() is None
    finally:
        proc.kill()
        proc.wait()


def test_the_runs_an_earlier_server_left_are_killed_whole_groups_and_waited_for_together():
    """A restart kills the process group of each run an earlier server left running (the leader
    and what it started), only where the pid is still that run's process (one whose start
    differs, its pid reused, is left alone), and waits for the leaders together."""
    groups: list[StaleGroup] = []
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
    try:
        groups += [StaleGroup(), StaleGroup()]
        reused = launcher.process_start_time(other.pid)
        assert reused is not None
        assert [launcher.kill_stale_group(g.leader.pid, g.created) for g in groups] == [True, True]
        assert launcher.kill_stale_group(other.pid, reused - 100) is None
        assert launcher.wait_stale_gone([(g.leader.pid, g.created) for g in groups], timeout=60) == []
        for group in groups:
            assert group.leader.wait(timeout=10) == -9
            wait_until(lambda group=group: not alive(group.child), timeout=10)
        assert alive(other.pid), "a process whose start differs from the run's was killed"
    finally:
        for group in groups:
            group.close()
        other.kill()
        other.wait()


def test_a_run_left_as_a_zombie_is_not_waited_for():
    """A run's process that has exited but is not reaped (an orphan under an init that does not
    reap) holds nothing more: the restart does not wait for it to go."""
    zombie = subprocess.Popen([sys.executable, "-c", "pass"], start_new_session=True)
    try:
        wait_until(lambda: (escapees.stat_fields(zombie.pid) or [b"?"])[0] == b"Z", timeout=20)
        created = launcher.process_start_time(zombie.pid)
        assert created is not None and launcher.is_same_process(zombie.pid, created)
        started = time.monotonic()
        assert launcher.wait_stale_gone([(zombie.pid, created)], timeout=60) == []
        assert time.monotonic() - started < 30, "the restart waited for a zombie"
    finally:
        zombie.wait()


def _removals_give_up(monkeypatch, give_up: bool) -> None:
    """Every cgroup removal gives up from now on (a process in the cgroup slow to die: the kernel
    keeps answering EBUSY past the wait), or none does any more. Such a process also keeps a
    removal from taking the plain path of a run's usual end, so that path is turned off with it."""
    if give_up:
        monkeypatch.setattr(cgroups_module, "rmdir_tree", lambda path, wait_until: False)
        monkeypatch.setattr(cgroups_module.RunCgroup, "_remove_if_plainly_empty", lambda self: False)
    else:
        monkeypatch.setattr(cgroups_module, "rmdir_tree", _RMDIR_TREE)
        monkeypatch.setattr(cgroups_module.RunCgroup, "_remove_if_plainly_empty", _PLAIN_REMOVAL)


_RMDIR_TREE = cgroups_module.rmdir_tree
_PLAIN_REMOVAL = cgroups_module.RunCgroup._remove_if_plainly_empty


def test_a_cgroup_that_would_not_go_is_removed_at_a_later_clean_up(monkeypatch):
    """A run's cgroup whose removal gives up (a process in it slow to die: the kernel keeps
    answering EBUSY past the wait) is tried again at the next batch of clean-ups; it was left
    until the server stopped."""
    from jupyter_evalsched.scheduler.cgroups import Cgroups

    namespace = Cgroups.detect("auto", namespace=f"evalsched-test-linger-{uuid.uuid4().hex[:8]}")
    assert namespace.enabled, namespace.support.detail
    cgroup = namespace.create("20261206T000000.000000-abcdef")
    _removals_give_up(monkeypatch, True)
    clean_ups = CleanUps()
    try:
        clean_ups.run(clean_ups.add(RunProcess("20261206T000000.000000-abcdef", None, cgroup=cgroup)))
        assert clean_ups.lingering == [cgroup] and all(p.is_dir() for p in cgroup.paths.values())
        _removals_give_up(monkeypatch, False)  # (its process gone at last)
        clean_ups.run(clean_ups.add(RunProcess("another-run", None)))  # the next run's clean-up
        assert clean_ups.lingering == [] and not any(p.exists() for p in cgroup.paths.values())
    finally:
        cgroup.remove()
        namespace.remove_namespace()


def test_a_discarded_cgroup_that_would_not_go_is_removed_later(monkeypatch):
    """A cgroup the pool discards (a spare's that will not become a run, a run's that never
    started) whose removal gives up is tried again at the next removal and at close: it was
    left behind, one cgroup more than the pool keeps (seen once on a busy host: a spare killed
    as it was dropped, still exiting past the wait)."""
    from jupyter_evalsched.scheduler.cgroup_pool import CgroupPool
    from jupyter_evalsched.scheduler.cgroups import Cgroups

    namespace = Cgroups.detect("auto", namespace=f"evalsched-test-linger-{uuid.uuid4().hex[:8]}")
    assert namespace.enabled, namespace.support.detail
    pool = CgroupPool(namespace, size=0)
    stuck, later, last = namespace.make(), namespace.make(), namespace.make()
    try:
        _removals_give_up(monkeypatch, True)
        assert pool.discard(stuck).result(timeout=30) is False
        assert pool.lingering == [stuck] and all(p.is_dir() for p in stuck.paths.values())
        _removals_give_up(monkeypatch, False)  # (its process gone at last)
        assert pool.discard(later).result(timeout=30) is True
        assert pool.lingering == [] and not any(p.exists() for p in [*stuck.paths.values(), *later.paths.values()])
        _removals_give_up(monkeypatch, True)
        assert pool.discard(last).result(timeout=30) is False
        _removals_give_up(monkeypatch, False)
        pool.close()  # the server stops: what lingers goes now
        assert pool.lingering == [] and not any(p.exists() for p in last.paths.values())
    finally:
        _removals_give_up(monkeypatch, False)
        pool.close()
        for cgroup in (stuck, later, last):
            cgroup.remove()
        namespace.remove_namespace()


def test_a_lingering_cgroup_is_retried_without_a_kill_or_a_wait():
    """A retry of a cgroup that would not go only looks: its process was killed already, and one
    stuck process (an uninterruptible wait) must not cost every later removal the 2.5 s of a
    kill and its wait, nor the log two warnings each time. (A live ``sleep`` stands in for it.)"""
    from jupyter_evalsched.scheduler.cgroups import Cgroups, remove_each

    namespace = Cgroups.detect("auto", namespace=f"evalsched-test-linger-{uuid.uuid4().hex[:8]}")
    assert namespace.enabled, namespace.support.detail
    cgroup = namespace.make()
    stuck = subprocess.Popen(["sleep", "300"])
    try:
        cgroup.add(stuck.pid)
        started = time.monotonic()
        assert remove_each([cgroup]) == [cgroup]
        assert stuck.poll() is None, "a retry killed what is in the cgroup"
        assert time.monotonic() - started < 2.0, "a retry waited for the cgroup to empty"
        stuck.kill()
        stuck.wait()
        assert remove_each([cgroup]) == [] and not any(p.exists() for p in cgroup.paths.values())
    finally:
        if stuck.poll() is None:
            stuck.kill()
            stuck.wait()
        cgroup.remove()
        namespace.remove_namespace()


def test_a_stale_cgroup_whose_process_will_not_die_is_killed_and_waited_for_once(monkeypatch):
    """A cgroup an earlier server left (or that a stop finds) whose process does not die within
    its kill's wait (an uninterruptible wait: a GPU driver's teardown) was killed and waited for
    a second time by its removal: 2.5 s more for each such cgroup, at a start and on the way to a
    stop. Now it is killed once and goes to the pool's lingering cgroups, removed without another
    kill once its process is gone. (A live ``sleep`` that the kill does not reach stands in.)"""
    from jupyter_evalsched.scheduler.cgroup_pool import CgroupPool
    from jupyter_evalsched.scheduler.cgroups import Cgroups, RunCgroup
    from jupyter_evalsched.scheduler.executors.local import _remove_stale_cgroups

    namespace = Cgroups.detect("auto", namespace=f"evalsched-test-stale-{uuid.uuid4().hex[:8]}")
    assert namespace.enabled, namespace.support.detail
    pool = CgroupPool(namespace, size=0)
    cgroup = namespace.make()
    stuck = subprocess.Popen(["sleep", "300"])
    kills: list[str] = []

    def kill_not_taken(self: RunCgroup, timeout: float = 2.0) -> set[int]:
        kills.append(self.name)  # (SIGKILL sent; the process has not gone within the wait)
        return self.pids()

    try:
        cgroup.add(stuck.pid)
        with monkeypatch.context() as patched:
            patched.setattr(RunCgroup, "kill", kill_not_taken)
            _remove_stale_cgroups(namespace, [cgroup.name], pool)
        assert kills == [cgroup.name], "killed and waited for twice"
        assert [c.name for c in pool.lingering] == [cgroup.name] and stuck.poll() is None
        stuck.kill()
        stuck.wait()
        pool.close()  # (the stop: what lingers is tried again)
        assert pool.lingering == [] and not any(p.exists() for p in cgroup.paths.values())
    finally:
        if stuck.poll() is None:
            stuck.kill()
            stuck.wait()
        pool.close()
        cgroup.remove()
        namespace.remove_namespace()
