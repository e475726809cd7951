"""What an eval leaves running when its episodes are done: a ``multiprocessing.Process`` never
joined, a ``concurrent.futures.ProcessPoolExecutor`` never shut down, a ``subprocess.Popen``
child never waited for.

Python's ``multiprocessing`` joins the children it started at the interpreter's exit, without a
limit: a finished run (every episode done, its final summary written) sat as running until its
timeout. The run now gives them ``LEFTOVER_GRACE_S`` (its ``atexit`` handlers run meanwhile, as
ever), then terminates those still running, names them in its log and ends with its true state.
Real servers, real runs, warm and cold; the runner alone where a server adds nothing.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
from proc_status import alive
from rest import submit
from test_runner_hostile_evals import finalized, make_run_dir, run_runner
from waiting import async_wait_until

from jupyter_evalsched.runner.leftover_children import LEFTOVER_GRACE_S, TERMINATE_GRACE_S

# Each eval writes the pids of the children it leaves to params["out"]/<its tag>.json.
PROCESS_LEFT = """
import json, multiprocessing, os, time
def _sleep():
    time.sleep(3600)
def episode(ctx, index):
    child = multiprocessing.Process(target=_sleep, name=f"left-{index}")
    child.start()
    with open(os.path.join(ctx.params["out"], f"{ctx.params['tag']}-{index}.json"), "w") as f:
        json.dump([child.pid], f)
    return {"m": 1.0}
"""

EXECUTOR_LEFT = """
import concurrent.futures, json, multiprocessing, os
EXECUTOR = None
def episode(ctx, index):
    global EXECUTOR
    EXECUTOR = concurrent.futures.ProcessPoolExecutor(2)
    value = EXECUTOR.submit(abs, -3).result()
    pids = [p.pid for p in multiprocessing.active_children()]
    with open(os.path.join(ctx.params["out"], f"{ctx.params['tag']}-{index}.json"), "w") as f:
        json.dump(pids, f)
    return {"m": float(value)}
"""

# The child is told to stop, and joined, by the eval's own atexit handler: the run's exit must
# leave that to it, and say nothing.
STOPPED_AT_EXIT = """
import atexit, multiprocessing, os
def _serve(stop, done_path):
    stop.wait()
    open(done_path, "w").close()
def episode(ctx, index):
    stop = multiprocessing.Event()
    done_path = os.path.join(ctx.params["out"], ctx.params["tag"] + "-clean")
    child = multiprocessing.Process(target=_serve, args=(stop, done_path))
    child.start()
    def shut_down():
        stop.set()
        child.join()
    atexit.register(shut_down)
    return {"m": 1.0}
"""

POPEN_LEFT = """
import json, os, subprocess, sys
def episode(ctx, index):
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
    with open(os.path.join(ctx.params["out"], ctx.params["tag"] + "-0.json"), "w") as f:
        json.dump([child.pid], f)
    return {"m": 1.0}
"""

# A child that ignores SIGTERM: killed once the grace after the SIGTERM is over.
DEAF_CHILD_LEFT = """
import multiprocessing, signal, time
def _deaf(ready):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    ready.set()
    time.sleep(3600)
def episode(ctx, index):
    ready = multiprocessing.Event()
    multiprocessing.Process(target=_deaf, args=(ready,), name="deaf").start()
    ready.wait()
    return {"m": 1.0}
"""


def stderr_of(runs_dir: Path, run_id: str) -> str:
    return (runs_dir / run_id / "stderr.log").read_text(errors="replace")


def left_pids(out: Path, tag: str) -> list[int]:
    return [pid for path in sorted(out.glob(f"{tag}-*.json")) for pid in json.loads(path.read_text())]


async def zygote_ready(api) -> None:
    async def ready() -> bool:
        code, body = await api("GET", "status")
        return code == 200 and any(z["state"] == "ready" for z in body["warm_start"]["zygotes"])

    await async_wait_until(ready, timeout=60, message="no zygote became ready")


async def test_multiprocessing_children_left_running_do_not_keep_a_finished_run_alive(
    api, wait_for, tmp_path, runs_dir
):
    """Warm and cold, in the run's process and in its workers: the run ends with every episode
    done and succeeded (it sat as running until its timeout), and its log names the children it
    had to terminate."""
    await zygote_ready(api)
    out = tmp_path / "out"
    out.mkdir()
    cases = {
        "process-warm": (PROCESS_LEFT, {}),
        "process-cold": (PROCESS_LEFT, {"fresh_interpreter": True}),
        "executor-warm": (EXECUTOR_LEFT, {}),
        "executor-cold": (EXECUTOR_LEFT, {"fresh_interpreter": True}),
        "process-workers": (PROCESS_LEFT, {"workers": 2, "episodes": 3}),
    }
    submitted = {}
    for tag, (source, extra) in cases.items():
        body = {"source": source, "episodes": 1, "params": {"out": str(out), "tag": tag}, **extra}
        submitted[tag] = (await submit(api, body))["id"], body
    for tag, (run_id, body) in submitted.items():
        final = await wait_for(run_id, timeout=120)
        log = stderr_of(runs_dir, run_id)
        assert final["state"] == "succeeded", (tag, final, log[-3000:])
        assert final["start"] == ("cold" if body.get("fresh_interpreter") else "warm"), (tag, final)
        assert final["progress"] == {"done": body["episodes"], "total": body["episodes"]}, (tag, final)
        pids = left_pids(out, tag)
        assert len(pids) == (3 if tag == "process-workers" else 1 if tag.startswith("process") else 2), (tag, pids)
        assert "left running after its episodes" in log, (tag, log[-3000:])
        for pid in pids:
            assert f"pid {pid}" in log, (tag, pid, log[-3000:])
        assert not [pid for pid in pids if alive(pid)], (tag, pids)


async def test_a_child_the_evals_atexit_handler_stops_is_left_to_it(api, wait_for, tmp_path, runs_dir):
    """The grace runs alongside the ``atexit`` handlers: a handler that stops and joins the
    eval's child still does so (the child ends on its own, cleanly), and nothing is terminated."""
    await zygote_ready(api)
    out = tmp_path / "out"
    out.mkdir()
    for fresh in (False, True):
        tag = f"fresh-{fresh}"
        body = {"source": STOPPED_AT_EXIT, "params": {"out": str(out), "tag": tag}, "fresh_interpreter": fresh}
        run_id = (await submit(api, body))["id"]
        final = await wait_for(run_id, timeout=120)
        log = stderr_of(runs_dir, run_id)
        assert final["state"] == "succeeded" and final["start"] == ("cold" if fresh else "warm"), (final, log)
        assert (out / f"{tag}-clean").exists(), log
        assert "left running" not in log, log


async def test_a_subprocess_left_running_ends_with_the_run(api, wait_for, tmp_path, runs_dir):
    """A ``subprocess.Popen`` child is no multiprocessing child: nothing waits for it at the exit,
    so the run ends at once, and the server's clean-up of what the run leaves (its cgroup, its
    process group) kills the child."""
    await zygote_ready(api)
    out = tmp_path / "out"
    out.mkdir()
    for fresh in (False, True):
        tag = f"popen-{fresh}"
        body = {"source": POPEN_LEFT, "params": {"out": str(out), "tag": tag}, "fresh_interpreter": fresh}
        run_id = (await submit(api, body))["id"]
        final = await wait_for(run_id, timeout=120)
        log = stderr_of(runs_dir, run_id)
        assert final["state"] == "succeeded" and final["start"] == ("cold" if fresh else "warm"), (final, log)
        assert "left running" not in log, log
        [pid] = left_pids(out, tag)

        async def gone() -> bool:
            return not alive(pid)

        await async_wait_until(gone, timeout=30, message=f"the subprocess {pid} outlived its run")


@pytest.mark.parametrize("workers", [pytest.param(1, marks=pytest.mark.slow), 2])  # (6 s each: the graces)
def test_a_child_that_ignores_sigterm_is_killed_and_the_run_finalizes(tmp_path, workers):
    """The runner alone, cold: the deaf child gets SIGKILL after the SIGTERM's grace, and the run
    finalizes itself, succeeded."""
    run_dir = make_run_dir(tmp_path, textwrap.dedent(DEAF_CHILD_LEFT), episodes=workers, workers=workers)
    # (The runner's own bound is a few seconds per process: this limit only stops a hang.)
    code = run_runner(run_dir, timeout=60 + 4 * LEFTOVER_GRACE_S)
    s = finalized(run_dir, code, "succeeded")
    assert s["episodes_done"] == workers
    log = (run_dir / "stderr.log").read_text()
    assert log.count("left running after its episodes") == workers, log
    assert log.count("still running after SIGTERM") == workers, log
    assert "deaf (pid " in log, log


THREAD_LEFT = """
import threading, time
def episode(ctx, index):
    threading.Thread(target=time.sleep, args=(3600,), name="left-thread").start()
    return {"m": 1.0}
"""


def test_a_thread_left_running_in_a_worker_does_not_keep_the_run_alive(tmp_path):
    """A worker no more waits for the eval's non-daemon threads than the run's own process does
    (it did: ``multiprocessing`` waits for them as its children end, and the run for its
    workers, until the run's timeout)."""
    run_dir = make_run_dir(tmp_path, THREAD_LEFT, episodes=2, workers=2)
    s = finalized(run_dir, run_runner(run_dir, timeout=60), "succeeded")
    assert s["episodes_done"] == 2


def test_the_graces_are_the_documented_ones():
    """docs/reference.md ("The run process") says how long the children get, and the log's words."""
    reference = " ".join((Path(__file__).resolve().parents[1] / "docs" / "reference.md").read_text().split())
    assert f"still running {LEFTOVER_GRACE_S:g} s into the exit" in reference
    assert f"SIGKILL {TERMINATE_GRACE_S:g} s later" in reference
    assert "left running after its episodes, still running" in reference
