"""What a run's bounded exit (``runner/leftover_children.py``) missed: children it could not see
as running, an eval's own ``atexit`` handler cut short, a queue's feeder thread waited for
without end. The runner alone, as the launcher starts it (cold), real processes."""

from __future__ import annotations

import pytest
from test_runner_hostile_evals import finalized, make_run_dir, run_runner

from jupyter_evalsched.runner.leftover_children import LEFTOVER_GRACE_S, TERMINATE_GRACE_S

# A hang guard only: the runner's own bound is a few seconds per process.
HANG_S = 60 + 4 * LEFTOVER_GRACE_S

# The child is the stdlib's ``time.sleep``: a forkserver or spawn child must unpickle its target.
LEFT_WITH_START_METHOD = """
import json, multiprocessing, os, time
def episode(ctx, index):
    if not ctx.params["pidfd"] and hasattr(os, "pidfd_open"):
        del os.pidfd_open  # (a kernel without pidfds: watched and signalled by pid)
    context = multiprocessing.get_context(ctx.params["method"])
    child = context.Process(target=time.sleep, args=(3600,), name=f"left-{index}")
    child.start()
    with open(os.path.join(ctx.params["out"], f"{index}.json"), "w") as f:
        json.dump(child.pid, f)
    return {"m": 1.0}
"""


# Each case waits out the whole grace (5 s): two cover every value of each parameter in the
# default suite, the other six run with the slow ones.
_DEFAULT_CASES = {("forkserver", 2, True), ("spawn", 1, False)}


@pytest.mark.parametrize(
    ("method", "workers", "pidfd"),
    [
        pytest.param(*case, marks=() if case in _DEFAULT_CASES else pytest.mark.slow)
        for case in [(m, w, p) for m in ("forkserver", "spawn") for w in (1, 2) for p in (True, False)]
    ],
)
def test_a_child_of_another_start_method_is_terminated_too(tmp_path, method, workers, pidfd):
    """A forkserver's children are the forkserver's, not the run's: ``waitid`` on them fails,
    and they were taken for ended, left running, and joined without end (the run sat as running
    until its timeout). With pidfds or without."""
    out = tmp_path / "out"
    out.mkdir()
    params = {"out": str(out), "method": method, "pidfd": pidfd}
    run_dir = make_run_dir(tmp_path, LEFT_WITH_START_METHOD, episodes=workers, workers=workers, params=params)
    s = finalized(run_dir, run_runner(run_dir, timeout=HANG_S), "succeeded")
    assert s["episodes_done"] == workers
    log = (run_dir / "stderr.log").read_text()
    assert log.count("left running after its episodes") == workers, log
    for index in range(workers):
        pid = int((out / f"{index}.json").read_text())
        assert f"left-{index} (pid {pid})" in log, log


SLOW_ATEXIT_STOPS_ITS_CHILD = f"""
import atexit, multiprocessing, os, time
def _serve(stop, done_path):
    stop.wait()
    open(done_path, "w").close()
def episode(ctx, index):
    stop = multiprocessing.Event()
    done_path = os.path.join(ctx.params["out"], "clean")
    child = multiprocessing.Process(target=_serve, args=(stop, done_path))
    child.start()
    def shut_down():
        time.sleep({LEFTOVER_GRACE_S + TERMINATE_GRACE_S + 1})  # (saving what the run made, say)
        stop.set()
        child.join()
    atexit.register(shut_down)
    return {{"m": 1.0}}
"""


def test_an_atexit_handler_that_takes_longer_than_the_grace_still_stops_its_child(tmp_path):
    """The grace bounds ``multiprocessing``'s join of what is left, not the eval's own ``atexit``
    handlers: one that takes longer than the grace before it stops and joins its child does so,
    cleanly (the child was terminated mid-way, a warning said so, and its work was lost)."""
    out = tmp_path / "out"
    out.mkdir()
    run_dir = make_run_dir(tmp_path, SLOW_ATEXIT_STOPS_ITS_CHILD, params={"out": str(out)})
    finalized(run_dir, run_runner(run_dir, timeout=HANG_S), "succeeded")
    log = (run_dir / "stderr.log").read_text()
    assert (out / "clean").exists(), log
    assert "left running" not in log, log


QUEUE_NEVER_READ = """
import multiprocessing
QUEUE = None
def episode(ctx, index):
    global QUEUE
    QUEUE = multiprocessing.Queue()
    QUEUE.put(b"x" * (1 << 20))  # more than its pipe holds, and nobody reads it
    return {"m": 1.0}
"""


@pytest.mark.parametrize("workers", [pytest.param(1, marks=pytest.mark.slow), 2])  # (5 s each: the grace)
def test_a_queue_nobody_reads_does_not_keep_a_finished_run_alive(tmp_path, workers):
    """``multiprocessing`` joins each queue's feeder thread at the exit, and one blocked on a
    full pipe never ends: the run sat as running until its timeout."""
    run_dir = make_run_dir(tmp_path, QUEUE_NEVER_READ, episodes=workers, workers=workers)
    s = finalized(run_dir, run_runner(run_dir, timeout=HANG_S), "succeeded")
    assert s["episodes_done"] == workers
    log = (run_dir / "stderr.log").read_text()
    assert log.count("queue's feeder thread of") == workers, log
    assert "left running" not in log, log


# What multiprocessing ends itself at the exit (a Manager's process, a Pool's daemonic workers)
# and a queue read to its end: nothing to terminate, nothing to say.
ENDED_BY_MULTIPROCESSING = """
import multiprocessing
KEPT = []
def _put(queue):
    queue.put(b"y" * (1 << 20))
def episode(ctx, index):
    manager = multiprocessing.Manager()
    shared = manager.dict(a=1)
    pool = multiprocessing.Pool(2)
    queue = multiprocessing.Queue()
    child = multiprocessing.Process(target=_put, args=(queue,))
    child.start()
    got = queue.get()
    child.join()
    queue.put(b"z")
    KEPT.extend([manager, shared, pool, queue])
    return {"m": float(len(got) + pool.apply(abs, (-shared["a"],)))}
"""


@pytest.mark.parametrize("workers", [1, 2])
def test_what_multiprocessing_ends_itself_is_not_terminated(tmp_path, workers):
    run_dir = make_run_dir(tmp_path, ENDED_BY_MULTIPROCESSING, episodes=workers, workers=workers)
    s = finalized(run_dir, run_runner(run_dir, timeout=HANG_S), "succeeded")
    assert s["episodes_done"] == workers
    log = (run_dir / "stderr.log").read_text()
    assert "warning" not in log and "cannot bound" not in log, log


# A warm run's fork, ended by the runner's own exit (``__main__._exit``), in a zygote that
# preloaded ``multiprocessing`` (torch does). What the exit imported is recorded by an ``atexit``
# handler registered before ``multiprocessing``'s own, so run after it.
_IMPORTED_AT_THE_EXIT = """
import atexit, json, os, sys
from jupyter_evalsched.runner import run, zygote

run_dir = sys.argv[1]
at_exit = {}
def record():
    if "before" not in at_exit:
        return  # (the zygote's own exit)
    with open(os.path.join(run_dir, "imported.json"), "w") as f:
        json.dump(sorted(set(sys.modules) - at_exit["before"]), f)
atexit.register(record)
zygote.preload(["multiprocessing.util", "multiprocessing.queues"])
zygote.make_interpreter_state()
pid = os.fork()
if pid == 0:
    os.chdir(os.path.dirname(run_dir))
    from jupyter_evalsched.runner import __main__ as entry
    code = run.main_checked(["--run-dir", run_dir])
    at_exit["before"] = set(sys.modules)
    entry._exit(code)
_, status = os.waitpid(pid, 0)
print(os.waitstatus_to_exitcode(status))
"""


def test_a_run_that_left_nothing_imports_nothing_at_its_exit(tmp_path):
    """Every warm run's end where the zygote preloaded ``multiprocessing``: with nothing left to
    bound, the exit imports nothing (it imported ``leftover_children`` to find no child)."""
    import json
    import os
    import subprocess
    import sys

    probe = tmp_path / "probe"
    probe.mkdir()
    (probe / "exit_imports_probe.py").write_text(_IMPORTED_AT_THE_EXIT)
    (tmp_path / "noop_module.py").write_text("def episode(ctx, index):\n    return {}\n")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "spec.json").write_text(
        json.dumps({"entrypoint": "noop_module:episode", "episodes": 2, "cwd": str(tmp_path)})
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("EVALSCHED_")}
    proc = subprocess.run(
        [sys.executable, "-m", "exit_imports_probe", str(run_dir)],
        cwd=probe,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "0", proc.stderr
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "succeeded", proc.stderr
    assert (run_dir / "_DONE").is_file()
    assert json.loads((run_dir / "imported.json").read_text()) == [], proc.stderr
