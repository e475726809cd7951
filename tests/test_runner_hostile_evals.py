"""Evals that attack the run process from inside: values the runner cannot write as they are,
exceptions that cannot be described, standard streams replaced or removed, metric names and
messages of the eval's own classes sent between processes, children the eval forks that come
back through the runner's frames, and a preload's ``atexit`` handlers in warm runs.

Each case runs the real runner, cold (``python -m jupyter_evalsched.runner`` on a run directory
written here, as the launcher starts it), with one worker and with several where that path
differs, and checks what the contract says: the eval's failure is the run's (``summary.json``
failed with its ``error``, ``_DONE``, exit 0), a succeeded eval stays succeeded, and only the run's
own process finalizes. The ``atexit`` case needs a zygote, so a real server.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from rest import submit
from run_dirs import filled_spec, runner_env

RUN_ID = "20261207T120000.000000-abcdef"


def make_run_dir(tmp_path: Path, source: str, **spec) -> Path:
    run_dir = tmp_path / "runs" / RUN_ID
    run_dir.mkdir(parents=True)
    source = textwrap.dedent(source)
    written = filled_spec(source=source, cwd=str(tmp_path), **spec)
    (run_dir / "spec.json").write_text(json.dumps(written))
    (run_dir / "shared_urls.json").write_text(json.dumps({"models": {}}))
    (run_dir / "eval.py").write_text(source)
    return run_dir


def run_runner(run_dir: Path, timeout: float = 30, **env: str) -> int:
    """Run the runner to its end, as the launcher starts it; its exit status."""
    with open(run_dir / "stdout.log", "ab") as out, open(run_dir / "stderr.log", "ab") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "jupyter_evalsched.runner", "--run-dir", str(run_dir)],
            cwd=run_dir.parent.parent,
            env=runner_env(**env),
            stdout=out,
            stderr=err,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    try:
        return proc.wait(timeout)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # whatever the eval left behind
        except ProcessLookupError:
            pass
        proc.wait()


def summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def episode_lines(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "episodes.jsonl").read_text().splitlines()]


def finalized(run_dir: Path, code: int, status: str) -> dict:
    """The final summary, once the run is checked to have finalized itself with ``status``."""
    stderr = (run_dir / "stderr.log").read_text(errors="replace")
    assert code == 0, f"the runner exited {code} without finalizing:\n{stderr[-3000:]}"
    s = summary(run_dir)
    assert s["status"] == status, (s, stderr[-3000:])
    assert (run_dir / "_DONE").is_file()
    return s


# --------------------------------------------------------------------------- values


@pytest.mark.parametrize("workers", [1, 2])
def test_an_int_metric_too_large_for_a_float_is_written_as_null_and_skipped(tmp_path, workers):
    run_dir = make_run_dir(
        tmp_path,
        """
        def episode(ctx, index):
            return {"huge": 10**5000, "big": -(10**400), "small": index}
        """,
        episodes=2,
        workers=workers,
    )
    s = finalized(run_dir, run_runner(run_dir), "succeeded")
    lines = sorted(episode_lines(run_dir), key=lambda line: line["index"])
    assert [line["metrics"] for line in lines] == [{"huge": None, "big": None, "small": i} for i in range(2)]
    for name in ("huge", "big"):
        assert s["metrics"][name] == {"mean": None, "std": None, "min": None, "max": None, "count": 0, "skipped": 2}
    assert s["metrics"]["small"]["mean"] == 0.5


def test_the_std_of_values_whose_spread_overflows_is_null_like_the_mean(tmp_path):
    run_dir = make_run_dir(
        tmp_path,
        """
        def episode(ctx, index):
            return {"v": -1e308 if index == 0 else 1e308}
        """,
        episodes=2,
    )
    s = finalized(run_dir, run_runner(run_dir), "succeeded")
    assert s["metrics"]["v"] == {"mean": None, "std": None, "min": -1e308, "max": 1e308, "count": 2, "skipped": 0}


# --------------------------------------------------------------------------- failures


@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize(
    ("source", "error_type", "message"),
    [
        pytest.param(
            """
            import sys
            class Unprintable:
                def __repr__(self):
                    raise RuntimeError("no repr")
            def episode(ctx, index):
                sys.exit(Unprintable())
            """,
            "SystemExit",
            "the eval called sys.exit(<unprintable Unprintable>)",
            id="sys-exit-with-an-unprintable-code",
        ),
        pytest.param(
            """
            class Interrupt(KeyboardInterrupt):
                def __str__(self):
                    raise RuntimeError("no str")
            def episode(ctx, index):
                raise Interrupt()
            """,
            "Interrupt",
            "<unprintable Interrupt>",
            id="keyboardinterrupt-with-an-unprintable-message",
        ),
        pytest.param(
            """
            import sys
            def episode(ctx, index):
                sys.stderr = None
                raise ValueError("boom")
            """,
            "ValueError",
            "boom",
            id="stderr-removed",
        ),
        pytest.param(
            """
            class Text(str):
                pass
            class Boom(Exception):
                def __str__(self):
                    return Text("a message of the eval's own class")
            def episode(ctx, index):
                raise Boom()
            """,
            "Boom",
            "a message of the eval's own class",
            id="message-of-the-evals-own-str-class",
        ),
    ],
)
def test_an_eval_failure_that_is_hard_to_describe_fails_the_run_as_any_exception(
    tmp_path, workers, source, error_type, message
):
    run_dir = make_run_dir(tmp_path, source, episodes=2, workers=workers)
    s = finalized(run_dir, run_runner(run_dir), "failed")
    assert (s["error"]["type"], s["error"]["message"]) == (error_type, message)
    assert s["error"]["episode"] in (0, 1)


@pytest.mark.parametrize("workers", [1, 2])
def test_a_stdout_without_flush_does_not_fail_an_eval_that_succeeds(tmp_path, workers):
    run_dir = make_run_dir(
        tmp_path,
        """
        import sys
        class Tee:
            def __init__(self, stream):
                self.stream = stream
            def write(self, text):
                return self.stream.write(text)
        def episode(ctx, index):
            sys.stdout = Tee(sys.__stdout__)
            print("episode", index)
            return {"x": 1}
        """,
        episodes=2,
        workers=workers,
    )
    s = finalized(run_dir, run_runner(run_dir), "succeeded")
    assert s["episodes_done"] == 2
    assert "episode 0" in (run_dir / "stdout.log").read_text()


def test_a_stop_seen_after_the_eval_removed_stderr_still_stops_the_run(tmp_path):
    run_dir = make_run_dir(
        tmp_path,
        """
        import os, sys
        def episode(ctx, index):
            sys.stderr = None
            open(os.path.join(ctx.run_dir, "_STOP"), "w").close()
            return {"x": 1}
        """,
        episodes=3,
    )
    assert run_runner(run_dir) == 75  # EXIT_STOPPED: not finalized, resumable
    assert not (run_dir / "_DONE").exists()
    assert summary(run_dir)["episodes_done"] == 1
    assert "stopped at an episode boundary" in (run_dir / "stderr.log").read_text()


# --------------------------------------------------------------------------- between processes


@pytest.mark.parametrize("workers", [1, 2])
def test_metric_names_of_the_evals_own_str_class_give_the_same_run_with_workers(tmp_path, workers):
    run_dir = make_run_dir(
        tmp_path,
        """
        from enum import IntEnum, StrEnum
        class Metric(StrEnum):
            ACCURACY = "accuracy"
        class Grade(IntEnum):
            PASS = 1
        def episode(ctx, index):
            return {Metric.ACCURACY: 0.5, "grade": Grade.PASS}
        """,
        episodes=3,
        workers=workers,
    )
    s = finalized(run_dir, run_runner(run_dir), "succeeded")
    assert s["metrics"]["accuracy"]["mean"] == 0.5 and s["metrics"]["accuracy"]["count"] == 3
    assert s["metrics"]["grade"]["mean"] == 1.0
    assert [line["metrics"] for line in episode_lines(run_dir)] == [{"accuracy": 0.5, "grade": 1}] * 3


def test_a_worker_message_the_run_process_cannot_read_fails_the_run_and_says_so(tmp_path):
    # The eval undoes the worker's normalization of what it returns: its own class then reaches
    # the run process, which never imported the eval's module and cannot unpickle it.
    run_dir = make_run_dir(
        tmp_path,
        """
        from jupyter_evalsched.runner import workers
        workers.validate_metrics = lambda result, index: result
        class Score(float):
            pass
        def episode(ctx, index):
            return {"score": Score(0.5)}
        """,
        episodes=2,
        workers=2,
    )
    s = finalized(run_dir, run_runner(run_dir), "failed")
    assert "could not read what worker process" in s["error"]["message"], s["error"]
    assert "ModuleNotFoundError" in s["error"]["message"]
    assert s["error"]["episode"] in (0, 1)


# --------------------------------------------------------------------------- children the eval forks

FORKING_EVAL = """
import json, os, sys
def episode(ctx, index):
    if index != 0:
        return {"x": 1}
    pid = os.fork()
    if pid == 0:  # the child comes back into the runner's frames
        how = ctx.params["how"]
        if how == "exit":
            sys.exit(3)
        if how == "exec":
            os.execvp("/nonexistent/evalsched-tool", ["tool"])
        return {"x": 1}
    _, status = os.waitpid(pid, 0)
    with open(os.path.join(ctx.run_dir, "summary.json")) as f:
        status_then = json.load(f)["status"]
    return {
        "child_exit": os.waitstatus_to_exitcode(status),
        "done_after_child": int(os.path.exists(os.path.join(ctx.run_dir, "_DONE"))),
        "finalized_after_child": int(status_then != "running"),
    }
"""


@pytest.mark.parametrize(
    ("how", "workers", "child_exit"),
    [("exit", 1, 3), ("exec", 1, 1), ("return", 1, 0), ("exit", 2, 3), ("exec", 2, 1)],
)
def test_a_child_the_eval_forks_leaves_through_the_runner_without_touching_the_run(tmp_path, how, workers, child_exit):
    run_dir = make_run_dir(tmp_path, FORKING_EVAL, episodes=3, workers=workers, params={"how": how})
    s = finalized(run_dir, run_runner(run_dir), "succeeded")
    first = next(line for line in episode_lines(run_dir) if line["index"] == 0)
    assert first["metrics"] == {"child_exit": child_exit, "done_after_child": 0, "finalized_after_child": 0}
    assert sorted(line["index"] for line in episode_lines(run_dir)) == [0, 1, 2]  # none from the child
    assert s["episodes_done"] == 3 and s["error"] is None


# --------------------------------------------------------------------------- resumed runs


def test_a_resumed_run_counts_the_later_line_of_an_index_written_twice(tmp_path):
    run_dir = make_run_dir(tmp_path, "def episode(ctx, index):\n    return {'m': 3}\n", episodes=2)
    earlier = [{"index": 0, "metrics": {"m": 1}}, {"index": 0, "metrics": {"m": 5}}]
    (run_dir / "episodes.jsonl").write_text("".join(json.dumps(line) + "\n" for line in earlier))
    s = finalized(run_dir, run_runner(run_dir, EVALSCHED_ATTEMPT="2"), "succeeded")
    assert [line["index"] for line in episode_lines(run_dir)] == [0, 0, 1]  # index 0 is not run again
    assert s["metrics"]["m"]["mean"] == 4.0 and s["metrics"]["m"]["count"] == 2  # (5 + 3) / 2


def test_a_resumed_run_skips_a_line_nested_too_deeply_to_parse(tmp_path):
    run_dir = make_run_dir(tmp_path, "def episode(ctx, index):\n    return {'m': index}\n", episodes=2)
    nested = '{"index": 0, "metrics": ' + "[" * 100_000 + "]" * 100_000 + "}\n"
    (run_dir / "episodes.jsonl").write_text(nested)
    s = finalized(run_dir, run_runner(run_dir, EVALSCHED_ATTEMPT="2"), "succeeded")
    assert s["episodes_done"] == 2 and s["metrics"]["m"]["mean"] == 0.5


# --------------------------------------------------------------------------- warm runs

AT_EXIT_EVAL = """
import atexit, os
import cleans_up_at_exit  # (preloaded in the zygote: imported already in a warm run)
def episode(ctx, index):
    out = ctx.params["out"]
    atexit.register(lambda: open(os.path.join(out, f"own-{os.getpid()}"), "w").close())
    return {"pid": os.getpid()}
"""


@pytest.fixture
def preload_dir(tmp_path):
    path = tmp_path / "preload"
    path.mkdir()
    # A library that registers an atexit handler as it is imported (filelock's release of the
    # locks its process still holds, torch's, huggingface_hub's): a run that imports it has it.
    (path / "cleans_up_at_exit.py").write_text(
        "import atexit, os\n"
        "HERE = os.path.dirname(os.path.abspath(__file__))\n"
        "atexit.register(lambda: open(os.path.join(HERE, f'preload-{os.getpid()}'), 'w').close())\n"
    )
    return path


@pytest.fixture
def evalsched_config(preload_dir):
    return {"run_env": {"PYTHONPATH": str(preload_dir)}, "preload_modules": ["cleans_up_at_exit"]}


async def test_a_warm_run_runs_the_atexit_handlers_of_its_preloads_as_a_cold_one_does(
    api, wait_for, tmp_path, preload_dir
):
    """The handlers a preloaded library registered as it was imported run at a warm run's exit,
    as in a cold run that imports it: a spare that forgot them (tried once, for a preload that
    removes at exit what it made at import) left, for one, filelock's lock files of the run."""
    from waiting import async_wait_until

    async def zygote_ready() -> bool:
        code, body = await api("GET", "status")
        return code == 200 and any(z["state"] == "ready" for z in body["warm_start"]["zygotes"])

    await async_wait_until(zygote_ready, timeout=30, message="no zygote became ready")
    out = tmp_path / "out"
    out.mkdir()
    for fresh in (False, True):
        body = {"source": AT_EXIT_EVAL, "episodes": 1, "params": {"out": str(out)}, "fresh_interpreter": fresh}
        final = await wait_for((await submit(api, body))["id"])
        assert final["state"] == "succeeded" and final["start"] == ("cold" if fresh else "warm"), final
        pid = final["pid"]
        assert (out / f"own-{pid}").exists(), "the run's own atexit handler did not run"
        assert (preload_dir / f"preload-{pid}").exists(), "the run did not run its preload's atexit handler"
