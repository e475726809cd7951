"""The server's compile check of a spec's inline ``source`` (a %%eval_submit cell) at submission,
within its bounds, against a real in-process Jupyter server: a source longer than the bound is
left to the run (its compile would hold up every other request), one too deeply nested to compile
is a 422 and not a 500, and a run for another interpreter (SLURM's ``python``) is not refused by
this one's syntax."""

from __future__ import annotations

import sys

import pytest
from rest import submit

from jupyter_evalsched.scheduler.submission import MAX_CHECKED_SOURCE_CHARS

OTHER_PYTHON = "/opt/another/bin/python3"
EPISODE = "def episode(ctx, index):\n    return {}\n"
NEVER_COMPILES = EPISODE + "def broken(:\n    pass\n"


@pytest.fixture
def evalsched_config():
    # SLURM enabled, with another interpreter on the nodes: its runs are handed to an sbatch that
    # has no controller to reach and fail; their submission is what is tested. (The stop waits for
    # an sbatch under way: a short timeout spares that wait, 9 s where sbatch is installed.)
    return {"slurm_enabled": True, "slurm": {"python": OTHER_PYTHON, "command_timeout_s": 1.0}}


def _source_errors(body: dict) -> list[dict]:
    return [d for d in body.get("detail") or [] if d.get("loc") == ["source"]]


async def test_a_source_longer_than_the_bound_is_left_to_the_run(api, wait_for):
    filler = "".join(f"x{i} = {{'a': [{i}, {i + 1}], 'b': ({i},)}}\n" for i in range(2000))
    long_bad = filler + NEVER_COMPILES
    assert len(long_bad) > MAX_CHECKED_SOURCE_CHARS
    rec = await submit(api, {"source": long_bad, "episodes": 1, "executor": "local"})
    done = await wait_for(rec["id"])
    assert done["state"] == "failed" and "SyntaxError" in (done["reason"] or ""), done
    # Within the bound, the same mistake is refused at once.
    code, body = await api("POST", "runs", {"source": NEVER_COMPILES, "episodes": 1, "executor": "local"})
    assert code == 422 and [d["type"] for d in _source_errors(body)] == ["syntax_error"], body


@pytest.mark.parametrize(
    "nested",
    [
        "x = " + "1+" * 6000 + "1\n",  # RecursionError in the compiler
        "x = " + "-" * 12000 + "1\n",  # MemoryError in the parser
    ],
)
async def test_a_source_too_deeply_nested_is_a_422(api, nested):
    assert len(EPISODE + nested) <= MAX_CHECKED_SOURCE_CHARS
    code, body = await api("POST", "runs", {"source": EPISODE + nested, "episodes": 1, "executor": "local"})
    assert code == 422, body
    assert [(d["type"], d["msg"]) for d in _source_errors(body)] == [
        ("syntax_error", "eval.py: too deeply nested to compile")
    ], body
    code, body = await api("GET", "runs")
    assert code == 200 and not body["runs"], body


async def test_a_run_for_another_interpreter_is_not_checked_by_this_ones(api):
    assert sys.executable != OTHER_PYTHON
    code, body = await api("POST", "runs", {"source": NEVER_COMPILES, "episodes": 1, "executor": "local"})
    assert code == 422 and _source_errors(body), body
    # The SLURM run's Python is another (it may take syntax this one does not): its run's business.
    rec = await submit(api, {"source": NEVER_COMPILES, "episodes": 1, "executor": "slurm", "cwd": "/"})
    assert rec["executor"] == "slurm"
    await api("POST", f"runs/{rec['id']}/cancel")
