"""What a new user meets in the first minutes (README, docs/first-run.md, notebooks/), against a
real server: ``ctx.log(...)``, ``async def episode``, ``openai_client()`` in a run that names no
model, ``cancel()`` after ``wait()``, and the bundled notebooks' first cells on a server that is
not the one they need."""

from __future__ import annotations

import json
import re
import textwrap
from pathlib import Path

import pytest

from jupyter_evalsched.client import EvalSchedError

try:
    from .live_server import SLEEPY, clean_queue, client, ip, live_server
except ImportError:  # run as a plain module (rootdir on sys.path)
    from live_server import SLEEPY, clean_queue, client, ip, live_server  # noqa: F401

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
START_COMMAND = "JUPYTER_CONFIG_PATH=notebooks jupyter lab"


def run_source(client, source: str, **spec) -> dict:
    """Submit ``source`` (an eval's code, saved as the run's eval.py), wait, return its final record."""
    record = client.submit({"source": textwrap.dedent(source), "episodes": 2, **spec})
    return client.handle(record).wait(timeout=60, progress=False)


LOGGING_EVAL = """
import logging

def episode(ctx, index):
    ctx.log("called %s", index)
    ctx.log.warning("warned %d", index)
    ctx.log.info("info %d", index)
    assert isinstance(ctx.log, logging.Logger)
    assert logging.getLogger("jupyter_evalsched.eval") is ctx.log  # configurable by its name
    return {"ok": 1}
"""


def test_ctx_log_is_a_logger_that_can_be_called(client, clean_queue):
    final = run_source(client, LOGGING_EVAL)
    assert final["state"] == "succeeded", final
    stderr = client.logs(final["id"], stream="stderr")
    for index in (0, 1):
        assert re.search(rf" INFO \[pid \d+\] called {index}$", stderr, re.M), stderr
        assert re.search(rf" WARNING \[pid \d+\] warned {index}$", stderr, re.M), stderr
        assert re.search(rf" INFO \[pid \d+\] info {index}$", stderr, re.M), stderr


ASYNC_EVAL = """
import asyncio
import os

loops = []


async def episode(ctx, index):
    await asyncio.sleep(0)
    loops.append(asyncio.get_running_loop())
    if ctx.params.get("fail_at") == index:
        raise ValueError(f"async boom {index}")
    # One loop for every episode of this process: what an eval keeps between episodes stays usable.
    return {"loops": len(set(map(id, loops))), "closed": float(loops[0].is_closed())}


def decorated(function):
    def plain(ctx, index):  # a plain function that returns the coroutine
        return function(ctx, index)
    return plain


wrapped = decorated(episode)
"""


@pytest.mark.parametrize("workers", [1, 2])
def test_async_episodes_run_on_one_event_loop_per_process(client, clean_queue, workers):
    final = run_source(client, ASYNC_EVAL, episodes=6, workers=workers)
    assert final["state"] == "succeeded", final
    metrics = final["summary"]["metrics"]
    assert metrics["loops"]["max"] == 1 and metrics["closed"]["max"] == 0, metrics
    assert metrics["loops"]["count"] == 6
    assert "never awaited" not in client.logs(final["id"], stream="stderr")


def test_a_plain_function_returning_a_coroutine_and_a_failing_async_episode(client, clean_queue):
    final = run_source(client, ASYNC_EVAL, entrypoint="eval.py:wrapped", episodes=3)
    assert final["state"] == "succeeded", final
    failed = run_source(client, ASYNC_EVAL, params={"fail_at": 1}, episodes=3)
    assert failed["state"] == "failed" and failed["reason"] == "exception: ValueError: async boom 1", failed
    error = failed["summary"]["error"]
    assert error["episode"] == 1 and 'raise ValueError(f"async boom {index}")' in error["traceback"], error


OPENAI_EVAL = """
import jupyter_evalsched

def episode(ctx, index):
    jupyter_evalsched.openai_client(max_retries=0)
    return {"ok": 1}
"""


@pytest.mark.parametrize(
    "env",
    [
        {},
        # Variables the run inherited (the user's own key), not the scheduler's: not the run's key either.
        {"OPENAI_BASE_URL": "http://127.0.0.1:9/v1", "OPENAI_API_KEY": "sk-the-users-own"},
    ],
)
def test_openai_client_in_a_run_without_models_says_to_name_the_model(client, clean_queue, env):
    final = run_source(client, OPENAI_EVAL, episodes=1, env=env)
    assert final["state"] == "failed", final
    reason = final["reason"]
    assert reason.startswith("exception: EvalSchedClientError: run "), reason
    assert "name the model in the spec's `models` (`--model NAME`)" in reason, reason


def test_cancel_of_a_run_that_ended_returns_its_record(client, clean_queue):
    """first-run.md's "Then:" block: ``h.wait()`` then ``h.cancel()``."""
    handle = client.handle(client.submit({"entrypoint": SLEEPY, "episodes": 1, "params": {"sleep_s": 0}}))
    final = handle.wait(timeout=60, progress=False)
    assert final["state"] == "succeeded", final
    for _ in range(2):  # idempotent
        record = handle.cancel()
        assert record["id"] == handle.id and record["state"] == "succeeded", record
    with pytest.raises(EvalSchedError) as refused:  # the REST route still says 409
        client.cancel(handle.id)
    assert refused.value.status == 409
    with pytest.raises(EvalSchedError) as unknown:  # and an error that is not "it ended" is raised
        client.handle("20260101T000000.000000-000000").cancel()
    assert unknown.value.status == 404


def first_code_cell(notebook: str) -> str:
    cells = json.loads((NOTEBOOKS / notebook).read_text(encoding="utf-8"))["cells"]
    assert cells[0]["cell_type"] == "markdown" and START_COMMAND in "".join(cells[0]["source"]), notebook
    return "".join(next(c for c in cells if c["cell_type"] == "code")["source"])


@pytest.mark.parametrize(
    "notebook, missing",
    [("interactive_lease.ipynb", "the shared model minilm"), ("shared_model.ipynb", "the shared model minilm")],
)
def test_a_notebook_says_what_server_it_needs_before_anything_fails(ip, clean_queue, monkeypatch, notebook, missing):
    """The tests' live server has two virtual GPUs and no shared model; the notebook's first code
    cell stops there with what is missing and how to start the server the notebooks need."""
    monkeypatch.delenv("EVALSCHED_VIRTUAL_GPU_PROCESSES", raising=False)
    result = ip.run_cell(first_code_cell(notebook))
    error = result.error_in_exec
    assert isinstance(error, RuntimeError), repr(error)
    assert str(error).startswith(f"this notebook needs {missing}: "), str(error)
    assert START_COMMAND in str(error) and "docs/first-run.md" in str(error)


def test_the_documented_server_is_the_one_the_notebooks_run_against():
    first_run = (Path(__file__).resolve().parents[1] / "docs" / "first-run.md").read_text(encoding="utf-8")
    assert f"\n{START_COMMAND}\n" in first_run
    conftest = (NOTEBOOKS / "conftest.py").read_text(encoding="utf-8")
    assert '"JUPYTER_CONFIG_PATH": NOTEBOOKS_DIR' in conftest
    config = (NOTEBOOKS / "jupyter_server_config.py").read_text(encoding="utf-8")
    assert '"name": "minilm"' in config and "virtual_gpu_processes" in config
