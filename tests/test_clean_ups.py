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

import pytest
from proc_status import alive
from waiting import wait_until

from jupyter_evalsched.scheduler import launcher
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
    assert list(launcher._run_ids_in(environ)) == ids
