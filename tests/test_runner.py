"""Tests of the run subprocess, ``python -m jupyter_evalsched.runner --run-dir DIR``.

Real subprocesses and real files: each test writes ``spec.json`` (defaults filled, as the
server writes it) and ``shared_urls.json`` into a run directory under ``tmp_path`` and starts
the runner the way the launcher does (new session, logs redirected to the run directory).
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import statistics
import subprocess
import sys
import textwrap
import time
import types
from datetime import UTC, datetime
from pathlib import Path

import psutil
import pytest
from proc_status import ignores_signal
from run_dirs import filled_spec, runner_env
from waiting import wait_until

from jupyter_evalsched.runner import fastjson
from jupyter_evalsched.runner._proc import cgroup_procs_value
from jupyter_evalsched.runner.context import ModelRegistry, UnknownModelError, parse_devices
from jupyter_evalsched.runner.results import MetricAggregator, utc_now_iso, validate_metrics

PYTHON = sys.executable
RUNNER = [PYTHON, "-m", "jupyter_evalsched.runner"]
TERMINAL = {"succeeded", "failed"}
SUMMARY_KEYS = {
    "run_id",
    "status",
    "episodes_done",
    "episodes_total",
    "metrics",
    "started_at",
    "updated_at",
    "finished_at",
    "error",
}
ISO_UTC = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}\+00:00$")

# An eval driven by its params, used by several tests: it records the pid of the process that
# ran each episode, can fail at a given index, sleep, and return given metrics.
PROBE_EVAL = """
import os, time

def episode(ctx, index):
    pids = os.path.join(ctx.run_dir, "pids")
    os.makedirs(pids, exist_ok=True)
    open(os.path.join(pids, str(os.getpid())), "w").close()
    p = ctx.params
    if index == p.get("fail_at"):
        raise ValueError(f"probe failure in episode {index}")
    time.sleep(p.get("sleep_s", 0))
    return p.get("by_index", {}).get(str(index), {"index": index})
"""


# --------------------------------------------------------------------------- helpers


def make_run_dir(tmp_path: Path, run_id: str = "20261129T083000-000001", models: dict | None = None, **spec) -> Path:
    run_dir = tmp_path / "runs" / run_id
    run_dir.mkdir(parents=True)
    spec = filled_spec(**spec)
    spec["cwd"] = spec["cwd"] or str(tmp_path)
    (run_dir / "spec.json").write_text(json.dumps(spec))
    (run_dir / "shared_urls.json").write_text(json.dumps({"models": models or {}}))
    if spec["source"] is not None:
        (run_dir / "eval.py").write_text(spec["source"])
    return run_dir


def write_file(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


@pytest.fixture
def started():
    """Popen objects to clean up: whatever a failing test leaves running is killed."""
    procs: list[subprocess.Popen] = []
    yield procs
    for proc in procs:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()


def start_runner(run_dir: Path, started: list, cwd: Path | None = None, env: dict | None = None) -> subprocess.Popen:
    if cwd is None:  # as the launcher does: the spec's cwd (here, tmp_path when the spec is broken)
        try:
            cwd = json.loads((run_dir / "spec.json").read_text())["cwd"]
        except (ValueError, TypeError, KeyError):
            cwd = run_dir.parent.parent
    with open(run_dir / "stdout.log", "ab") as out, open(run_dir / "stderr.log", "ab") as err:
        proc = subprocess.Popen(
            [*RUNNER, "--run-dir", str(run_dir)],
            cwd=cwd,
            env=env or runner_env(),
            stdout=out,
            stderr=err,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    started.append(proc)
    return proc


def run_to_end(run_dir: Path, started: list, timeout: float = 30, **kw) -> int:
    return start_runner(run_dir, started, **kw).wait(timeout)


def summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def episodes(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "episodes.jsonl").read_text().splitlines()]


def assert_finalized(run_dir: Path, status: str) -> dict:
    s = summary(run_dir)
    assert set(s) >= SUMMARY_KEYS
    assert s["status"] == status, s
    assert (run_dir / "_DONE").is_file()
    assert (run_dir / "_DONE").stat().st_size == 0
    assert (run_dir / "_DONE").stat().st_mtime_ns >= (run_dir / "summary.json").stat().st_mtime_ns
    for key in ("started_at", "updated_at", "finished_at"):
        assert ISO_UTC.match(s[key]), (key, s[key])
    assert s["started_at"] <= s["finished_at"] == s["updated_at"]
    for name in ("summary.json", "episodes.jsonl", "_DONE"):
        assert (run_dir / name).stat().st_mode & 0o077 == 0, f"{name} is readable by others"
    leftovers = [p.name for p in run_dir.iterdir() if p.name.endswith(".tmp")]
    assert leftovers == []
    return s


def is_gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def line_count(path: Path) -> int:
    try:
        return path.read_text().count("\n")
    except FileNotFoundError:
        return 0


def recorded_pids(run_dir: Path) -> set[int]:
    pids_dir = run_dir / "pids"
    return {int(p.name) for p in pids_dir.iterdir()} if pids_dir.is_dir() else set()


# --------------------------------------------------------------------------- success


def test_success_aggregates_metrics_and_writes_every_file(tmp_path, started):
    write_file(
        tmp_path / "metrics_eval.py",
        """
        import math

        VALUES = [0.5, 1.5, float("nan"), 4.0, float("inf")]

        def episode(ctx, index):
            return {"x": VALUES[index], "flag": index % 2 == 0, "n": index * 10}

        if __name__ == "__main__":
            raise SystemExit("a file entrypoint must be loaded without running its main block")
        """,
    )
    run_dir = make_run_dir(tmp_path, entrypoint="metrics_eval.py:episode", episodes=5, seed=7)
    proc = start_runner(run_dir, started)
    assert proc.wait(30) == 0

    s = assert_finalized(run_dir, "succeeded")
    assert s["run_id"] == run_dir.name
    assert s["episodes_done"] == s["episodes_total"] == 5
    assert s["error"] is None

    finite = [0.5, 1.5, 4.0]
    x = s["metrics"]["x"]
    assert x["count"] == 3 and x["skipped"] == 2
    assert x["mean"] == pytest.approx(statistics.fmean(finite))
    assert x["std"] == pytest.approx(statistics.pstdev(finite))
    assert (x["min"], x["max"]) == (0.5, 4.0)
    flag = s["metrics"]["flag"]
    assert flag == {
        "mean": pytest.approx(0.6),
        "std": pytest.approx(statistics.pstdev([1, 0, 1, 0, 1])),
        "min": 0.0,
        "max": 1.0,
        "count": 5,
        "skipped": 0,
    }
    assert s["metrics"]["n"]["mean"] == pytest.approx(20.0)

    lines = episodes(run_dir)
    assert [e["index"] for e in lines] == [0, 1, 2, 3, 4]
    assert {e["worker"] for e in lines} == {proc.pid}
    assert lines[0]["metrics"] == {"x": 0.5, "flag": True, "n": 0}
    assert lines[2]["metrics"]["x"] is None and lines[4]["metrics"]["x"] is None  # strict JSON: no NaN
    for e in lines:
        assert set(e) == {"index", "metrics", "started_at", "finished_at", "worker", "attempt"}
        assert e["attempt"] == 1
        assert ISO_UTC.match(e["started_at"]) and e["started_at"] <= e["finished_at"]
        assert s["started_at"] <= e["started_at"]
    # Every file the runner writes is strict JSON (what a browser or another language reads).
    json.loads((run_dir / "summary.json").read_text(), parse_constant=lambda c: pytest.fail(f"non-JSON {c}"))


def test_zero_episodes_succeed_at_once(tmp_path, started):
    run_dir = make_run_dir(tmp_path, entrypoint="jupyter_evalsched.examples.basic:noop", episodes=0, workers=4)
    assert run_to_end(run_dir, started) == 0
    s = assert_finalized(run_dir, "succeeded")
    assert (s["episodes_done"], s["episodes_total"], s["metrics"]) == (0, 0, {})
    assert episodes(run_dir) == []


def test_example_evals_are_deterministic(tmp_path, started):
    results = []
    for attempt in range(2):
        run_dir = make_run_dir(
            tmp_path / str(attempt), entrypoint="jupyter_evalsched.examples.basic:accuracy_toy", episodes=24, seed=3
        )
        assert run_to_end(run_dir, started) == 0
        results.append(assert_finalized(run_dir, "succeeded")["metrics"])
    assert results[0] == results[1]
    assert 0.0 < results[0]["accuracy"]["mean"] < 1.0 and results[0]["accuracy"]["count"] == 24


def test_ctx_fields_logger_and_unknown_model(tmp_path, started):
    write_file(
        tmp_path / "ctx_eval.py",
        """
        import json, os

        def episode(ctx, index):
            info = {"params": ctx.params, "index": ctx.index, "seed": ctx.seed, "devices": ctx.devices,
                    "run_dir": ctx.run_dir, "run_id": ctx.run_id, "episodes": ctx.episodes,
                    "logger": type(ctx.log).__module__ + "." + type(ctx.log).__name__}
            try:
                ctx.model("absent")
            except KeyError as exc:
                info["model_error"] = str(exc)
            ctx.log.info("hello from episode %d", index)
            with open(os.path.join(ctx.run_dir, f"ctx-{index}.json"), "w") as f:
                json.dump(info, f)
        """,
    )
    run_dir = make_run_dir(
        tmp_path,
        entrypoint="ctx_eval.py:episode",
        episodes=2,
        seed=10,
        params={"k": [1, "two"]},
        models={"tiny-bert": "http://127.0.0.1:1/models/tiny-bert", "gpt": "http://127.0.0.1:1/models/gpt"},
    )
    assert run_to_end(run_dir, started, env=runner_env(EVALSCHED_DEVICES="0,2")) == 0
    s = assert_finalized(run_dir, "succeeded")
    assert s["metrics"] == {}  # None means no metrics
    for index in (0, 1):
        info = json.loads((run_dir / f"ctx-{index}.json").read_text())
        assert info["index"] == index and info["seed"] == 10 + index
        assert info["params"] == {"k": [1, "two"]}
        assert info["devices"] == [0, 2]
        assert info["run_dir"] == str(run_dir) and info["run_id"] == run_dir.name and info["episodes"] == 2
        assert info["logger"] == "jupyter_evalsched.runner.eval_log.EvalLogger"  # a logging.Logger, callable
        assert "'absent'" in info["model_error"] and "'gpt', 'tiny-bert'" in info["model_error"]
    assert "hello from episode 1" in (run_dir / "stderr.log").read_text()


def test_prints_reach_the_log_at_each_episode_end(tmp_path, started):
    write_file(
        tmp_path / "printing.py",
        """
        import time

        def episode(ctx, index):
            if index == 0:
                print("line one")
                print("no newline yet", end="")
            else:
                time.sleep(30)
        """,
    )
    run_dir = make_run_dir(tmp_path, entrypoint="printing.py:episode", episodes=2)
    proc = start_runner(run_dir, started)
    wait_until(lambda: line_count(run_dir / "episodes.jsonl") == 1)
    assert proc.poll() is None
    assert (run_dir / "stdout.log").read_text() == "line one\nno newline yet"


# --------------------------------------------------------------------------- entrypoints


def test_eval_py_resolves_in_the_run_directory(tmp_path, started):
    source = textwrap.dedent(
        """
        def episode(ctx, index):
            return {"value": index + 0.5}

        if __name__ == "__main__":
            raise SystemExit("must not run")
        """
    )
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    write_file(elsewhere / "eval.py", "def episode(ctx, index):\n    raise AssertionError('wrong eval.py')\n")
    run_dir = make_run_dir(tmp_path, source=source, episodes=2, cwd=str(elsewhere))
    assert run_to_end(run_dir, started) == 0
    s = assert_finalized(run_dir, "succeeded")
    assert s["metrics"]["value"]["mean"] == 1.0


def test_file_entrypoint_relative_to_cwd_with_sibling_import(tmp_path, started):
    project = tmp_path / "project"
    write_file(project / "evals" / "helpers.py", "FACTOR = 3\n")
    write_file(
        project / "evals" / "my_eval.py",
        """
        from helpers import FACTOR

        def score(ctx, index):
            return {"score": FACTOR * index}
        """,
    )
    run_dir = make_run_dir(tmp_path, entrypoint="evals/my_eval.py:score", episodes=3, cwd=str(project))
    assert run_to_end(run_dir, started) == 0
    assert assert_finalized(run_dir, "succeeded")["metrics"]["score"]["max"] == 6


def test_module_entrypoint_importable_from_cwd(tmp_path, started):
    project = tmp_path / "project"
    write_file(project / "mypkg" / "__init__.py", "")
    write_file(project / "mypkg" / "evals.py", "def run(ctx, index):\n    return {'seed': ctx.seed}\n")
    run_dir = make_run_dir(tmp_path, entrypoint="mypkg.evals:run", episodes=2, seed=5, cwd=str(project))
    assert run_to_end(run_dir, started) == 0
    assert assert_finalized(run_dir, "succeeded")["metrics"]["seed"]["mean"] == 5.5


@pytest.mark.parametrize(
    ("entrypoint", "error_type", "message"),
    [
        ("no_such_module_xyz.evals:episode", "ModuleNotFoundError", "No module named 'no_such_module_xyz'"),
        (
            "jupyter_evalsched.examples.basic:no_such_function",
            "AttributeError",
            "module 'jupyter_evalsched.examples.basic' has no function 'no_such_function'",
        ),
        ("missing/eval_file.py:episode", "FileNotFoundError", "entrypoint file not found"),
        ("jupyter_evalsched.examples.basic:QUIZ", "TypeError", "is a list, not a function"),
    ],
)
@pytest.mark.parametrize("workers", [1, 2])
def test_unresolvable_entrypoint_fails_precisely(tmp_path, started, entrypoint, error_type, message, workers):
    run_dir = make_run_dir(tmp_path, entrypoint=entrypoint, episodes=3, workers=workers)
    assert run_to_end(run_dir, started) == 0
    s = assert_finalized(run_dir, "failed")
    error = s["error"]
    assert error["type"] == error_type
    assert message in error["message"]
    assert error["traceback"].rstrip().endswith(f"{error_type}: {error['message']}")
    assert error["episode"] is None
    assert s["episodes_done"] == 0 and s["episodes_total"] == 3
    if error_type == "FileNotFoundError":
        assert str(tmp_path / "missing" / "eval_file.py") in error["message"]
    if error_type == "ModuleNotFoundError":  # the entrypoint's own module: where it is looked for
        assert "must be importable by the server's Python" in error["message"]
        assert "'path/to/file.py:episode'" in error["message"]
    assert error_type in (run_dir / "stderr.log").read_text()


def test_import_error_inside_the_eval_module_is_reported_with_its_traceback(tmp_path, started):
    write_file(tmp_path / "broken.py", "import os\nraise ImportError('needs a GPU library')\n")
    run_dir = make_run_dir(tmp_path, entrypoint="broken.py:episode")
    assert run_to_end(run_dir, started) == 0
    error = assert_finalized(run_dir, "failed")["error"]
    assert (error["type"], error["message"]) == ("ImportError", "needs a GPU library")
    assert 'broken.py", line 2' in error["traceback"]
    assert "jupyter_evalsched/runner" not in error["traceback"]


# --------------------------------------------------------------------------- failures


def test_exception_fails_the_run_with_type_message_and_traceback(tmp_path, started):
    run_dir = make_run_dir(
        tmp_path, entrypoint="jupyter_evalsched.examples.basic:crash", episodes=5, params={"how": "exception", "at": 2}
    )
    assert run_to_end(run_dir, started) == 0
    s = assert_finalized(run_dir, "failed")
    assert s["episodes_done"] == 2 and [e["index"] for e in episodes(run_dir)] == [0, 1]
    error = s["error"]
    assert error["type"] == "RuntimeError"
    assert error["message"] == "crash requested in episode 2"
    assert error["episode"] == 2
    tb = error["traceback"]
    assert tb.startswith("Traceback (most recent call last):")
    assert "examples/basic.py" in tb and "raise RuntimeError" in tb
    assert "jupyter_evalsched/runner" not in tb  # starts at the eval's frame
    assert "RuntimeError: crash requested in episode 2" in (run_dir / "stderr.log").read_text()


@pytest.mark.parametrize(
    ("params", "error_type", "message"),
    [
        ({"how": "memoryerror"}, "MemoryError", ""),
        ({"how": "sys_exit", "code": 5}, "SystemExit", "the eval called sys.exit(5)"),
        ({"how": "sys_exit", "code": 0}, "SystemExit", "the eval called sys.exit(0)"),
    ],
)
def test_memoryerror_and_sys_exit_fail_the_run(tmp_path, started, params, error_type, message):
    run_dir = make_run_dir(tmp_path, entrypoint="jupyter_evalsched.examples.basic:crash", episodes=3, params=params)
    assert run_to_end(run_dir, started) == 0
    error = assert_finalized(run_dir, "failed")["error"]
    assert (error["type"], error["message"], error["episode"]) == (error_type, message, 0)


def test_keyboardinterrupt_raised_by_the_eval_fails_the_run(tmp_path, started):
    write_file(tmp_path / "ki.py", "def episode(ctx, index):\n    raise KeyboardInterrupt\n")
    run_dir = make_run_dir(tmp_path, entrypoint="ki.py:episode")
    assert run_to_end(run_dir, started) == 0
    error = assert_finalized(run_dir, "failed")["error"]
    assert error["type"] == "KeyboardInterrupt"


@pytest.mark.parametrize(
    ("returns", "fragment"),
    [
        ("[1, 2]", "episode 1 returned list"),
        ("{'acc': 'high'}", "episode 1 returned metric 'acc' = 'high' of type str"),
        ("{3: 1.0}", "episode 1 returned a metric name of type int"),
        ("{'acc': None}", "episode 1 returned metric 'acc' = None"),
    ],
)
def test_bad_return_value_fails_with_a_typeerror_naming_the_episode(tmp_path, started, returns, fragment):
    write_file(
        tmp_path / "bad_return.py",
        f"def episode(ctx, index):\n    return {{'ok': 1}} if index == 0 else {returns}\n",
    )
    run_dir = make_run_dir(tmp_path, entrypoint="bad_return.py:episode", episodes=3)
    assert run_to_end(run_dir, started) == 0
    s = assert_finalized(run_dir, "failed")
    assert s["error"]["type"] == "TypeError" and fragment in s["error"]["message"]
    assert s["episodes_done"] == 1


def test_numpy_like_scalars_are_accepted(tmp_path, started):
    # Real-number types that are not int/float subclasses (as numpy.float32 or numpy.int64 are not)
    # count as numbers through the numbers ABCs.
    write_file(
        tmp_path / "scalars.py",
        """
        import numbers
        from fractions import Fraction

        class Int64:
            def __init__(self, v): self.v = v
            def __int__(self): return self.v
            def __index__(self): return self.v
        numbers.Integral.register(Int64)

        def episode(ctx, index):
            return {"frac": Fraction(1, 4), "i64": Int64(7)}
        """,
    )
    run_dir = make_run_dir(tmp_path, entrypoint="scalars.py:episode")
    assert run_to_end(run_dir, started) == 0
    assert_finalized(run_dir, "succeeded")
    assert episodes(run_dir)[0]["metrics"] == {"frac": 0.25, "i64": 7}


@pytest.mark.parametrize(
    ("params", "returncode"),
    [({"how": "exit", "code": 3}, 3), ({"how": "segfault"}, -signal.SIGSEGV), ({"how": "sigkill"}, -signal.SIGKILL)],
)
def test_process_death_is_left_for_the_server_to_finalize(tmp_path, started, params, returncode):
    run_dir = make_run_dir(tmp_path, entrypoint="jupyter_evalsched.examples.basic:crash", episodes=2, params=params)
    assert run_to_end(run_dir, started) == returncode
    assert not (run_dir / "_DONE").exists()
    assert summary(run_dir)["status"] == "running"


def test_sigterm_is_not_handled_and_never_finalizes(tmp_path, started):
    run_dir = make_run_dir(
        tmp_path, entrypoint="jupyter_evalsched.examples.basic:sleepy", episodes=3, params={"sleep_s": 30}
    )
    proc = start_runner(run_dir, started)
    wait_until(lambda: (run_dir / "summary.json").exists())
    initial = summary(run_dir)
    assert set(initial) == SUMMARY_KEYS
    assert (initial["status"], initial["episodes_done"], initial["episodes_total"]) == ("running", 0, 3)
    assert (initial["metrics"], initial["finished_at"], initial["error"]) == ({}, None, None)
    assert ISO_UTC.match(initial["started_at"]) and initial["updated_at"] >= initial["started_at"]
    os.killpg(proc.pid, signal.SIGTERM)
    assert proc.wait(5) == -signal.SIGTERM
    assert not (run_dir / "_DONE").exists()


def test_sigint_from_outside_ends_the_run_like_a_cancel(tmp_path, started):
    write_file(tmp_path / "probe.py", PROBE_EVAL)
    run_dir = make_run_dir(tmp_path, entrypoint="probe.py:episode", episodes=3, params={"sleep_s": 30})
    proc = start_runner(run_dir, started)
    wait_until(lambda: recorded_pids(run_dir) == {proc.pid})  # inside the first episode
    proc.send_signal(signal.SIGINT)
    assert proc.wait(5) == -signal.SIGINT
    assert not (run_dir / "_DONE").exists()


@pytest.mark.parametrize("workers", [1])
def test_unwritable_summary_exits_74_without_done(tmp_path, started, workers):
    # Injected at the file-write boundary (root ignores chmod): a directory where the runner's
    # temp summary goes makes its open() fail. workers=1 only: from a forked worker the guess of
    # the writer's temp name (the run process's pid and thread id) failed once in CI (the run
    # finalized instead), and the single writer is the same code with or without workers.
    write_file(
        tmp_path / "block_summary.py",
        """
        import os, threading

        def episode(ctx, index):
            # Atomically: a worker killed mid-write must not leave an empty pid file behind.
            tmp = os.path.join(ctx.run_dir, f".tmp-pid-{index}")
            with open(tmp, "w") as f:
                f.write(str(os.getpid()))
            os.replace(tmp, os.path.join(ctx.run_dir, f"pid-{index}"))
            if index == 1:
                writer = os.getpid() if ctx.params["workers"] == 1 else os.getppid()
                os.mkdir(os.path.join(ctx.run_dir, f".summary.json.{writer}.{threading.get_ident()}.tmp"))
            return {"i": index}
        """,
    )
    run_dir = make_run_dir(
        tmp_path, entrypoint="block_summary.py:episode", episodes=3, workers=workers, params={"workers": workers}
    )
    code = run_to_end(run_dir, started)
    assert code == 74, (code, (run_dir / "summary.json").read_text(), (run_dir / "stderr.log").read_text()[-2000:])
    assert not (run_dir / "_DONE").exists()
    assert summary(run_dir)["status"] == "running"
    assert "cannot write the run files" in (run_dir / "stderr.log").read_text()
    for pid_file in run_dir.glob("pid-*"):
        assert is_gone(int(pid_file.read_text()))


def test_crash_ignore_sigterm_needs_sigkill(tmp_path, started):
    run_dir = make_run_dir(
        tmp_path, entrypoint="jupyter_evalsched.examples.basic:crash", params={"how": "ignore_sigterm", "hold_s": 30}
    )
    proc = start_runner(run_dir, started)
    wait_until(lambda: ignores_signal(proc.pid, signal.SIGTERM), message="the episode never ignored SIGTERM")
    os.killpg(proc.pid, signal.SIGTERM)
    # The subject: SIGTERM does not end it. A process that did not ignore SIGTERM is doomed when
    # killpg returns (the default action kills the whole group at once); the bound only lets it
    # be reaped.
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(0.3)
    os.killpg(proc.pid, signal.SIGKILL)
    assert proc.wait(5) == -signal.SIGKILL
    assert not (run_dir / "_DONE").exists()


def test_crash_fork_and_exit_leaves_a_stray_for_the_server_to_reap(tmp_path, started):
    run_dir = make_run_dir(
        tmp_path, entrypoint="jupyter_evalsched.examples.basic:crash", params={"how": "fork_and_exit"}
    )
    proc = start_runner(run_dir, started)
    assert proc.wait(30) == 0
    child = int(assert_finalized(run_dir, "succeeded")["metrics"]["child_pid"]["max"])
    try:
        assert not is_gone(child)
        assert os.getpgid(child) == proc.pid  # in the run's group: the launcher's killpg reaches it
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
    wait_until(lambda: is_gone(child), timeout=2)


# --------------------------------------------------------------------------- bad run directories and specs


def test_missing_spec_exits_2_without_done(tmp_path, started):
    run_dir = tmp_path / "runs" / "empty"
    run_dir.mkdir(parents=True)
    proc = subprocess.run([*RUNNER, "--run-dir", str(run_dir)], env=runner_env(), capture_output=True, text=True)
    assert proc.returncode == 2
    assert "spec.json is missing" in proc.stderr
    assert sorted(p.name for p in run_dir.iterdir()) == []


@pytest.mark.parametrize("argv", [[], ["--run-dir"], ["--rundir", "x"], ["--run-dir="]])
def test_bad_arguments_exit_2(argv):
    proc = subprocess.run([*RUNNER, *argv], env=runner_env(), capture_output=True, text=True)
    assert proc.returncode == 2 and "usage:" in proc.stderr


def test_finalized_run_directory_is_not_run_again(tmp_path, started):
    run_dir = make_run_dir(tmp_path, entrypoint="jupyter_evalsched.examples.basic:noop")
    assert run_to_end(run_dir, started) == 0
    before = (run_dir / "summary.json").read_bytes()
    assert run_to_end(run_dir, started) == 2
    assert (run_dir / "summary.json").read_bytes() == before


@pytest.mark.parametrize(
    ("spec_text", "error_type", "fragment", "total"),
    [
        ("{not json", "JSONDecodeError", "Expecting property name", 0),
        (json.dumps(filled_spec(entrypoint="a:b", episodes=-1)), "ValueError", "'episodes' must be an integer >= 0", 0),
        (json.dumps(filled_spec(entrypoint="a:b", episodes=4, workers=0)), "ValueError", "'workers'", 4),
        (json.dumps(filled_spec(entrypoint="no-colon", episodes=2)), "ValueError", "invalid entrypoint", 2),
        (json.dumps(filled_spec(entrypoint="a:b", params=[1])), "ValueError", "'params' must be an object", 1),
        ("[]", "ValueError", "must hold a JSON object", 0),
    ],
)
def test_invalid_spec_fails_the_run(tmp_path, started, spec_text, error_type, fragment, total):
    run_dir = make_run_dir(tmp_path, entrypoint="x:y")
    (run_dir / "spec.json").write_text(spec_text)
    assert run_to_end(run_dir, started) == 0
    s = assert_finalized(run_dir, "failed")
    assert s["error"]["type"] == error_type and fragment in s["error"]["message"]
    assert s["episodes_total"] == total


def test_invalid_shared_urls_fail_the_run(tmp_path, started):
    run_dir = make_run_dir(tmp_path, entrypoint="jupyter_evalsched.examples.basic:noop")
    (run_dir / "shared_urls.json").write_text('{"models": ["a"]}')
    assert run_to_end(run_dir, started) == 0
    assert "shared_urls.json must look like" in assert_finalized(run_dir, "failed")["error"]["message"]


# --------------------------------------------------------------------------- parent checks


def test_mismatched_parent_pid_exits_at_once_without_touching_the_run(tmp_path, started):
    run_dir = make_run_dir(tmp_path, entrypoint="jupyter_evalsched.examples.basic:noop")
    t0 = time.monotonic()
    assert run_to_end(run_dir, started, env=runner_env(EVALSCHED_PARENT_PID="1")) == 70
    assert time.monotonic() - t0 < 5
    assert sorted(p.name for p in run_dir.iterdir()) == ["shared_urls.json", "spec.json", "stderr.log", "stdout.log"]
    assert "parent process 1 is gone" in (run_dir / "stderr.log").read_text()


def test_matching_parent_pid_runs(tmp_path, started):
    run_dir = make_run_dir(tmp_path, entrypoint="jupyter_evalsched.examples.basic:noop")
    assert run_to_end(run_dir, started, env=runner_env(EVALSCHED_PARENT_PID=str(os.getpid()))) == 0
    assert_finalized(run_dir, "succeeded")


INTERMEDIATE = """
import os, subprocess, sys, time
run_dir, pid_file = sys.argv[1], sys.argv[2]
env = dict(os.environ, EVALSCHED_PARENT_PID=str(os.getpid()))
with open(os.path.join(run_dir, "stdout.log"), "ab") as out, open(os.path.join(run_dir, "stderr.log"), "ab") as err:
    proc = subprocess.Popen([sys.executable, "-m", "jupyter_evalsched.runner", "--run-dir", run_dir],
                            env=env, stdout=out, stderr=err, start_new_session=True)
with open(pid_file + ".tmp", "w") as f:
    f.write(str(proc.pid))
os.replace(pid_file + ".tmp", pid_file)
time.sleep(600)
"""


@pytest.mark.parametrize("workers", [1, 2])
def test_runner_and_workers_die_with_their_parent(tmp_path, started, workers):
    write_file(tmp_path / "probe.py", PROBE_EVAL)
    run_dir = make_run_dir(tmp_path, entrypoint="probe.py:episode", episodes=4, workers=workers, params={"sleep_s": 60})
    pid_file = tmp_path / "runner.pid"
    intermediate = subprocess.Popen(
        [PYTHON, "-c", INTERMEDIATE, str(run_dir), str(pid_file)], cwd=tmp_path, env=runner_env()
    )
    started.append(intermediate)
    runner_pid = int(wait_until(lambda: pid_file.exists() and pid_file.read_text()))
    episode_pids = wait_until(lambda: len(recorded_pids(run_dir)) == workers and recorded_pids(run_dir))
    if workers > 1:
        assert runner_pid not in episode_pids
    doomed = {runner_pid, *episode_pids}
    try:
        intermediate.kill()
        intermediate.wait()
        wait_until(
            lambda: all(is_gone(pid) for pid in doomed),
            timeout=1.0,
            interval=0.01,
            message=f"still alive after the parent died: {doomed}",
        )
    finally:
        for pid in doomed:
            if not is_gone(pid):
                os.kill(pid, signal.SIGKILL)
    assert not (run_dir / "_DONE").exists()


# --------------------------------------------------------------------------- workers


def test_workers_run_every_episode_once_in_other_processes(tmp_path, started):
    write_file(tmp_path / "probe.py", PROBE_EVAL)
    run_dir = make_run_dir(tmp_path, entrypoint="probe.py:episode", episodes=12, workers=3, params={"sleep_s": 0.05})
    proc = start_runner(run_dir, started)
    assert proc.wait(30) == 0
    s = assert_finalized(run_dir, "succeeded")
    lines = episodes(run_dir)
    assert sorted(e["index"] for e in lines) == list(range(12))
    workers = {e["worker"] for e in lines}
    assert proc.pid not in workers
    assert len(workers) == 3 and workers == recorded_pids(run_dir)
    assert all(is_gone(pid) for pid in workers)
    assert s["episodes_done"] == 12
    assert s["metrics"]["index"] == {
        "mean": 5.5,
        "std": pytest.approx(statistics.pstdev(range(12))),
        "min": 0.0,
        "max": 11.0,
        "count": 12,
        "skipped": 0,
    }


def test_worker_exception_fails_the_run_and_no_worker_outlives_it(tmp_path, started):
    write_file(tmp_path / "probe.py", PROBE_EVAL)
    run_dir = make_run_dir(
        tmp_path, entrypoint="probe.py:episode", episodes=40, workers=3, params={"sleep_s": 0.2, "fail_at": 4}
    )
    proc = start_runner(run_dir, started)
    assert proc.wait(30) == 0
    worker_pids = recorded_pids(run_dir)
    assert len(worker_pids) == 3 and proc.pid not in worker_pids
    assert all(is_gone(pid) for pid in worker_pids), "a worker outlived the run process"
    s = assert_finalized(run_dir, "failed")
    assert s["error"]["type"] == "ValueError"
    assert s["error"]["message"] == "probe failure in episode 4"
    assert s["error"]["episode"] == 4
    assert 'probe.py", line' in s["error"]["traceback"]
    indices = [e["index"] for e in episodes(run_dir)]
    assert len(indices) == len(set(indices)) == s["episodes_done"]
    assert 4 not in indices and s["episodes_done"] < 10  # stopped handing out episodes


def test_worker_segfault_fails_the_run_naming_signal_and_episode(tmp_path, started):
    run_dir = make_run_dir(
        tmp_path,
        entrypoint="jupyter_evalsched.examples.basic:crash",
        episodes=8,
        workers=2,
        params={"how": "segfault", "at": 3, "sleep_s": 0.05},
    )
    assert run_to_end(run_dir, started) == 0
    error = assert_finalized(run_dir, "failed")["error"]
    assert error["type"] == "WorkerDied" and error["episode"] == 3
    assert "killed by SIGSEGV while running episode 3" in error["message"]


def test_worker_ignoring_sigterm_is_killed_after_a_failure(tmp_path, started):
    write_file(
        tmp_path / "stubborn.py",
        """
        import os, signal, time

        def episode(ctx, index):
            open(os.path.join(ctx.run_dir, f"pid-{index}"), "w").write(str(os.getpid()))
            ignoring = os.path.join(ctx.run_dir, "ignoring-sigterm")
            if index == 0:
                signal.signal(signal.SIGTERM, signal.SIG_IGN)
                open(ignoring, "w").close()
                time.sleep(60)
            # Fail once the other worker ignores SIGTERM (its marker file says so).
            deadline = time.monotonic() + 20
            while not os.path.exists(ignoring) and time.monotonic() < deadline:
                time.sleep(0.01)
            raise RuntimeError("second worker fails")
        """,
    )
    run_dir = make_run_dir(tmp_path, entrypoint="stubborn.py:episode", episodes=2, workers=2)
    t0 = time.monotonic()
    assert run_to_end(run_dir, started) == 0
    assert (run_dir / "ignoring-sigterm").exists(), "the failure came before the other worker ignored SIGTERM"
    assert time.monotonic() - t0 < 10
    assert is_gone(int((run_dir / "pid-0").read_text()))
    assert assert_finalized(run_dir, "failed")["error"]["message"] == "second worker fails"


def test_sigterm_to_the_group_ends_runner_and_workers_without_done(tmp_path, started):
    write_file(tmp_path / "probe.py", PROBE_EVAL)
    run_dir = make_run_dir(tmp_path, entrypoint="probe.py:episode", episodes=4, workers=2, params={"sleep_s": 60})
    proc = start_runner(run_dir, started)
    worker_pids = wait_until(lambda: len(recorded_pids(run_dir)) == 2 and recorded_pids(run_dir))
    os.killpg(proc.pid, signal.SIGTERM)
    assert proc.wait(5) == -signal.SIGTERM
    wait_until(lambda: all(is_gone(pid) for pid in worker_pids), timeout=1.0)
    assert not (run_dir / "_DONE").exists()


# --------------------------------------------------------------------------- atomicity and weight


def test_summary_is_never_seen_partial_and_done_comes_after_the_final_summary(tmp_path, started):
    total = 3000
    run_dir = make_run_dir(tmp_path, entrypoint="jupyter_evalsched.examples.basic:noop", episodes=total)
    summary_path, done_path = run_dir / "summary.json", run_dir / "_DONE"
    proc = start_runner(run_dir, started)
    reads, progress_seen, problems = 0, set(), []
    deadline = time.monotonic() + 60
    wait_until(summary_path.exists, timeout=10, interval=0.0005)
    while time.monotonic() < deadline:
        done = done_path.exists()  # checked BEFORE reading: a _DONE implies a terminal summary
        try:
            data = summary_path.read_bytes()
        except FileNotFoundError:
            problems.append("summary.json vanished")
            continue
        try:
            s = json.loads(data)
        except ValueError:
            problems.append(data[:200])
            continue
        reads += 1
        if set(s) != SUMMARY_KEYS:
            problems.append(f"keys {sorted(s)}")
        progress_seen.add(s["episodes_done"])
        if done:
            if s["status"] not in TERMINAL:
                problems.append(f"_DONE exists but status is {s['status']}")
            break
    assert proc.wait(30) == 0
    assert problems == []
    assert len(progress_seen) > 20, f"the reader did not race the writer ({reads} reads)"
    s = assert_finalized(run_dir, "succeeded")
    assert s["episodes_done"] == total
    assert line_count(run_dir / "episodes.jsonl") == total


def test_runner_imports_no_server_code(tmp_path, started):
    write_file(
        tmp_path / "modules_eval.py",
        """
        import os, sys

        def episode(ctx, index):
            with open(os.path.join(ctx.run_dir, "modules.txt"), "w") as f:
                f.write("\\n".join(sorted(sys.modules)))
        """,
    )
    run_dir = make_run_dir(tmp_path, entrypoint="modules_eval.py:episode")
    assert run_to_end(run_dir, started) == 0
    modules = set((run_dir / "modules.txt").read_text().split("\n"))
    assert "jupyter_evalsched.runner.run" in modules  # the probe saw the runner's process
    heavy = {
        "pydantic",
        "tornado",
        "jupyter_server",
        "traitlets",
        "psutil",
        "numpy",
        "torch",
        "jupyter_evalsched.schemas",
    }
    assert modules & heavy == set()
    # What the start-up budget leaves out: imported only when a run needs them.
    assert modules & {"json", "re", "enum", "logging", "multiprocessing", "argparse", "traceback", "typing"} == set()


def _timed_child(argv: list[str], env: dict, cwd: Path) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of one child process, from its own rusage."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, env=env, cwd=cwd)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    assert proc.returncode == 0
    return wall, usage.ru_utime + usage.ru_stime


def _turnaround_samples(tmp_path: Path, rounds: int) -> tuple[list, list]:
    env = runner_env(PYTHONPYCACHEPREFIX=str(tmp_path / "pycache"))  # bytecode cached, as when installed
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    bare, runs = [], []
    for attempt in range(rounds + 1):
        run_dir = make_run_dir(tmp_path, run_id=f"r{attempt}", entrypoint="jupyter_evalsched.examples.basic:noop")
        b = _timed_child([PYTHON, "-c", "pass"], env, tmp_path)
        r = _timed_child([*RUNNER, "--run-dir", str(run_dir)], env, tmp_path)
        assert (run_dir / "_DONE").exists()
        if attempt:  # the first round writes the bytecode caches
            bare.append(b)
            runs.append(r)
    return bare, runs


def test_noop_run_costs_little_more_cpu_than_a_bare_interpreter(tmp_path):
    """The start-up budget, in CPU time (robust to a busy host): a no-op run may cost at most
    twice `python -c pass` (medians, interleaved; it is about 1.6x here). Not the best of each:
    the same work's CPU time swings with this kind of VM's speed, and the best of six bare
    interpreters' (about 20 ms) was once 15 ms, which failed a sound runner at 2.1x. Wall time:
    see the slow test below."""
    bare, runs = _turnaround_samples(tmp_path, 8)
    mid_bare, mid_run = statistics.median(c for _, c in bare), statistics.median(c for _, c in runs)
    assert mid_run <= 2.0 * mid_bare, f"runner {mid_run * 1e3:.1f} ms CPU vs python -c pass {mid_bare * 1e3:.1f} ms"


@pytest.mark.slow
def test_noop_run_turnaround_is_at_most_twice_a_bare_interpreter(tmp_path):
    """The contract's figure for the runner's share: no-op run to _DONE <= 2x `python -c pass`
    (wall time; best of many, interleaved; meaningful on an otherwise idle host)."""
    bare, runs = _turnaround_samples(tmp_path, 30)
    best_bare, best_run = min(w for w, _ in bare), min(w for w, _ in runs)
    assert best_run <= 2.0 * best_bare, f"runner {best_run * 1e3:.1f} ms vs python -c pass {best_bare * 1e3:.1f} ms"


# --------------------------------------------------------------------------- in-process units


def test_aggregator_matches_statistics_and_counts_skipped():
    values = [3.0, -1.5, 2.25, float("nan"), 10**400, 7, True, float("-inf")]
    agg = MetricAggregator()
    for v in values:
        agg.add({"m": v})
    finite = [3.0, -1.5, 2.25, 7.0, 1.0]
    out = agg.summary()["m"]
    assert out["count"] == 5 and out["skipped"] == 3
    assert out["mean"] == pytest.approx(statistics.fmean(finite))
    assert out["std"] == pytest.approx(statistics.pstdev(finite))
    assert (out["min"], out["max"]) == (-1.5, 7.0)
    agg.add({"only_nan": float("nan")})
    assert agg.summary()["only_nan"] == {"mean": None, "std": None, "min": None, "max": None, "count": 0, "skipped": 1}


def test_aggregator_is_stable_for_many_values():
    agg = MetricAggregator()
    for i in range(100_000):
        agg.add({"x": 1e9 + (i % 2)})
    out = agg.summary()["x"]
    assert out["count"] == 100_000
    assert out["mean"] == pytest.approx(1e9 + 0.5)
    assert out["std"] == pytest.approx(0.5, rel=1e-6)


def test_atomic_writes_from_many_threads_never_collide(tmp_path):
    import threading

    from jupyter_evalsched.runner.results import write_json_atomic

    target = str(tmp_path / "summary.json")
    errors: list[BaseException] = []

    def writer(n: int) -> None:
        try:
            for i in range(200):
                write_json_atomic(target, {"writer": n, "i": i, "pad": "x" * (n * 500)}, fsync=False)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(n,)) for n in range(6)]
    for t in threads:
        t.start()
    reads = 0
    while any(t.is_alive() for t in threads):
        data = json.loads(Path(target).read_text()) if os.path.exists(target) else None
        reads += data is not None
    for t in threads:
        t.join()
    assert errors == []
    assert json.loads(Path(target).read_text())["i"] == 199
    assert sorted(os.listdir(tmp_path)) == ["summary.json"]


def test_validate_metrics():
    assert validate_metrics(None, 0) == {}
    assert validate_metrics({"a": 1, "b": 2.5, "c": False}, 0) == {"a": 1, "b": 2.5, "c": False}
    with pytest.raises(TypeError, match="episode 7 returned tuple"):
        validate_metrics((1,), 7)
    with pytest.raises(TypeError, match="episode 7 returned metric 'x'"):
        validate_metrics({"x": [1]}, 7)
    with pytest.raises(TypeError, match="episode 7 returned metric 'x'"):
        validate_metrics({"x": 1j}, 7)


def test_timestamps_match_datetime_isoformat():
    stamp = utc_now_iso()
    assert ISO_UTC.match(stamp)
    parsed = datetime.fromisoformat(stamp)
    assert parsed.tzinfo == UTC
    assert abs((datetime.now(UTC) - parsed).total_seconds()) < 5
    assert parsed.isoformat(timespec="microseconds") == stamp


def test_parse_devices():
    assert parse_devices({"EVALSCHED_DEVICES": "0,2"}) == [0, 2]
    assert parse_devices({"EVALSCHED_DEVICES": ""}) == []
    assert parse_devices({"EVALSCHED_DEVICES": "", "CUDA_VISIBLE_DEVICES": "1"}) == []
    assert parse_devices({"CUDA_VISIBLE_DEVICES": "3,1"}) == [3, 1]  # under SLURM
    assert parse_devices({"CUDA_VISIBLE_DEVICES": "GPU-8f3a"}) == []
    assert parse_devices({}) == []


def test_model_registry_connects_lazily_once_per_name(monkeypatch):
    calls = []
    fake = types.ModuleType("jupyter_evalsched.shared_models.client")
    fake.connect = lambda url: calls.append(url) or ("client", url)
    monkeypatch.setitem(sys.modules, "jupyter_evalsched.shared_models.client", fake)
    registry = ModelRegistry({"bert": "http://h/bert", "gpt": "http://h/gpt"})
    assert calls == []
    assert registry.get("bert") == ("client", "http://h/bert")
    assert registry.get("bert") is registry.get("bert")
    registry.get("gpt")
    assert calls == ["http://h/bert", "http://h/gpt"]
    with pytest.raises(KeyError) as info:
        registry.get("llama")
    assert isinstance(info.value, UnknownModelError)
    assert str(info.value).startswith("unknown shared model 'llama'; this run has: 'bert', 'gpt'")


@pytest.mark.parametrize(
    "value",
    [
        {"a": 1, "b": [1.5, -0.0, 1e-7, 1e308, 10**30, True, None], "c": {"d": 'é\n"\\\u2028\x00'}},
        [],
        "plain",
        {"run_id": "x", "metrics": {"m": {"mean": 0.1 + 0.2, "count": 3}}, "error": None},
    ],
)
def test_fastjson_matches_json(value):
    text = fastjson.dumps(value)
    assert text == json.dumps(value, separators=(",", ":"), allow_nan=False)
    assert fastjson.loads(text) == json.loads(text)
    assert fastjson.loads(" \n" + json.dumps(value, indent=2) + "\n").__repr__() == value.__repr__()
    assert fastjson.loads(text.encode()) == value


def test_fastjson_errors_match_json():
    for bad in ["{not json", "", "[1,]", '{"a": 1} extra', "\ufeff{}", b"\xff\xfe{"]:
        with pytest.raises(ValueError) as ours:
            fastjson.loads(bad)
        with pytest.raises(ValueError) as theirs:
            json.loads(bad)
        assert (type(ours.value), str(ours.value)) == (type(theirs.value), str(theirs.value))
    assert math.isnan(fastjson.loads('{"x": NaN}')["x"])
    with pytest.raises(ValueError):
        fastjson.dumps({"x": float("nan")})
    with pytest.raises(TypeError):
        fastjson.dumps({"x": object()})


# --------------------------------------------------------------------------- attempts: resume and _STOP

SLEEPY_ENTRY = "jupyter_evalsched.examples.basic:sleepy"


def sleepy_score(seed: int) -> float:
    from jupyter_evalsched.examples.basic import _unit_float

    return _unit_float(seed)


def episode_lines(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "episodes.jsonl").read_text().splitlines() if line]


def test_a_resumed_run_skips_finished_episodes_and_ignores_a_partial_last_line(tmp_path, started):
    run_dir = make_run_dir(tmp_path, entrypoint=SLEEPY_ENTRY, episodes=6, seed=10, params={"sleep_s": 0})
    earlier = [
        {"index": i, "metrics": {"score": sleepy_score(10 + i)}, "started_at": "x", "finished_at": "y", "worker": 1}
        for i in (0, 3)
    ]
    text = "".join(json.dumps(e) + "\n" for e in earlier)
    # An attempt that died while writing its third line; and a line of another run's size.
    text += json.dumps({"index": 99, "metrics": {"score": 5.0}}) + "\n" + '{"index": 1, "metri'
    (run_dir / "episodes.jsonl").write_text(text)

    assert run_to_end(run_dir, started, env=runner_env(EVALSCHED_ATTEMPT="2")) == 0
    lines = episode_lines(run_dir)  # every line parses: the partial one was cut off
    indices = [e["index"] for e in lines if e["index"] != 99]
    assert sorted(indices) == list(range(6)), indices  # each index exactly once
    assert lines[:2] == earlier, "the earlier attempt's lines were rewritten"
    assert [e["attempt"] for e in lines[3:]] == [2, 2, 2, 2] and [e["index"] for e in lines[3:]] == [1, 2, 4, 5]
    s = summary(run_dir)
    assert s["status"] == "succeeded" and s["episodes_done"] == 6 and s["episodes_total"] == 6
    expected = [sleepy_score(10 + i) for i in range(6)]
    assert s["metrics"]["score"]["count"] == 6
    assert s["metrics"]["score"]["mean"] == pytest.approx(statistics.fmean(expected), rel=1e-12)
    assert s["metrics"]["score"]["std"] == pytest.approx(statistics.pstdev(expected), rel=1e-9)


def test_a_resumed_run_whose_episodes_are_all_done_only_finalizes(tmp_path, started):
    run_dir = make_run_dir(tmp_path, entrypoint="no_such_module_at_all:episode", episodes=2)
    lines = [{"index": i, "metrics": {"m": i}} for i in range(2)]
    (run_dir / "episodes.jsonl").write_text("".join(json.dumps(e) + "\n" for e in lines))
    assert run_to_end(run_dir, started, env=runner_env(EVALSCHED_ATTEMPT="3")) == 0
    s = summary(run_dir)  # the eval was not even imported: nothing was left to run
    assert s["status"] == "succeeded" and s["metrics"]["m"]["mean"] == 0.5 and (run_dir / "_DONE").exists()


@pytest.mark.parametrize("workers", [1, 3])
def test_stop_file_stops_the_run_at_an_episode_boundary_and_a_resume_finishes_it(tmp_path, started, workers):
    run_dir = make_run_dir(
        tmp_path, entrypoint=SLEEPY_ENTRY, episodes=400, workers=workers, params={"sleep_s": 0.02}, seed=3
    )
    proc = start_runner(run_dir, started)
    wait_until(lambda: (run_dir / "episodes.jsonl").exists() and len(episode_lines(run_dir)) >= 4)
    (run_dir / "_STOP").touch()
    assert proc.wait(30) == 75  # EXIT_STOPPED: not finalized
    assert not (run_dir / "_DONE").exists()
    first = episode_lines(run_dir)
    assert len(first) < 400, "the run did not stop"
    assert len({e["index"] for e in first}) == len(first)  # no episode twice
    s = summary(run_dir)
    assert s["status"] == "running" and s["episodes_done"] == len(first)
    assert "stopped at an episode boundary" in (run_dir / "stderr.log").read_text()

    (run_dir / "_STOP").unlink()
    assert run_to_end(run_dir, started, env=runner_env(EVALSCHED_ATTEMPT="2"), timeout=60) == 0
    lines = episode_lines(run_dir)
    assert sorted(e["index"] for e in lines) == list(range(400))
    assert lines[: len(first)] == first and {e["attempt"] for e in lines[len(first) :]} == {2}
    final = summary(run_dir)
    assert final["status"] == "succeeded" and final["episodes_done"] == 400
    expected = statistics.fmean(sleepy_score(3 + i) for i in range(400))
    assert final["metrics"]["score"]["mean"] == pytest.approx(expected, rel=1e-12)


def test_ctx_attempt_is_the_attempt_number(tmp_path, started):
    run_dir = make_run_dir(
        tmp_path,
        source="def episode(ctx, index):\n    return {'attempt': ctx.attempt}\n",
        episodes=1,
    )
    assert run_to_end(run_dir, started, env=runner_env(EVALSCHED_ATTEMPT="4")) == 0
    assert episode_lines(run_dir)[0]["metrics"] == {"attempt": 4} and episode_lines(run_dir)[0]["attempt"] == 4


def test_a_run_that_cannot_join_its_cgroup_runs_none_of_its_code(tmp_path, started):
    """The cgroup the server gave the run is gone (removed meanwhile): the run fails, saying so,
    before its entrypoint is even imported; nothing of it would have been contained (killed with
    the run, held to its memory limit). It used to say so on stderr and run uncontained."""
    write_file(tmp_path / "ran.py", "import pathlib\npathlib.Path(__file__).with_name('imported').touch()\n"
               "def episode(ctx, index):\n    return {}\n")  # fmt: skip
    run_dir = make_run_dir(tmp_path, entrypoint=f"{tmp_path / 'ran.py'}:episode", episodes=1)
    gone = tmp_path / "cgroup" / "evalsched-r-gone" / "cgroup.procs"  # (its directory never made)
    assert run_to_end(run_dir, started, env=runner_env(EVALSCHED_CGROUP_PROCS=str(gone))) == 0
    error = assert_finalized(run_dir, "failed")["error"]
    assert error["type"] == "NotInCgroup" and error["episode"] is None, error
    assert error["message"].startswith(f"the run's process could not join its cgroup ({gone}: No such file"), error
    assert not (tmp_path / "imported").exists()


def test_a_cgroup_whose_path_holds_a_colon_is_joined(tmp_path, started):
    """``EVALSCHED_CGROUP_PROCS`` names one file per line: a cgroup under a systemd unit or a
    container whose name holds a ":" is a cgroup like any other. Split on ":", as it was, its
    path fell apart and the run failed as unable to join it. (Plain files stand in for the
    cgroup.procs files: the runner writes its pid to each, as to a cgroup's.)"""
    procs = [tmp_path / "machine-vm:1.scope" / h / "evalsched-r-c" / "cgroup.procs" for h in ("memory", "unified")]
    for path in procs:
        write_file(path, "")
    run_dir = make_run_dir(tmp_path, entrypoint="jupyter_evalsched.examples.basic:noop", episodes=1)
    value = cgroup_procs_value([str(p) for p in procs])
    assert run_to_end(run_dir, started, env=runner_env(EVALSCHED_CGROUP_PROCS=value)) == 0
    assert_finalized(run_dir, "succeeded")
    pids = [p.read_text() for p in procs]
    assert pids[0].isdigit() and pids == [pids[0]] * 2, pids


def test_the_colon_joined_form_of_a_server_started_before_an_upgrade_is_still_read(tmp_path, started):
    """A server started before the package's upgrade still joins the files with ":"; the runner
    it starts from the upgraded package reads that too (a value naming no existing file)."""
    procs = [tmp_path / h / "evalsched-r-c" / "cgroup.procs" for h in ("memory", "unified")]
    for path in procs:
        write_file(path, "")
    run_dir = make_run_dir(tmp_path, entrypoint="jupyter_evalsched.examples.basic:noop", episodes=1)
    value = ":".join(str(p) for p in procs)
    assert run_to_end(run_dir, started, env=runner_env(EVALSCHED_CGROUP_PROCS=value)) == 0
    assert_finalized(run_dir, "succeeded")
    assert all(p.read_text().isdigit() for p in procs)


def test_a_cgroup_a_server_inherited_is_not_handed_to_its_runs():
    """A server started inside a run has that run's ``EVALSCHED_CGROUP_PROCS`` in its environment;
    its own runs get the variable only from their launcher (their own cgroup), never that one,
    which would fail them as unable to join it once that run is over."""
    from jupyter_evalsched.scheduler.environment import run_environment

    inherited = {"EVALSCHED_CGROUP_PROCS": "/sys/fs/cgroup/unified/evalsched-0-x/c+gone/cgroup.procs", "HOME": "/h"}
    env = run_environment("r", {"EVALSCHED_CGROUP_PROCS": "/spec"}, devices=None, parent_pid=None, fsync=False,
                          base=inherited)  # fmt: skip
    assert "EVALSCHED_CGROUP_PROCS" not in env and env["HOME"] == "/h"
