"""The compile check at submission against sources whose compile is slow: lambdas nested in one
another (``lambda: lambda: ...``) cost the compiler the square of their depth (16 KiB of them,
2,000 deep, held the server's event loop for 0.64 s). Beyond ``MAX_NESTED_LAMBDAS`` they are
parsed only, and the run compiles them (as it does a longer source); within it, or side by side,
compiled at submission. Against a real in-process Jupyter server."""

from __future__ import annotations

import ast

import pytest
from rest import submit

from jupyter_evalsched.scheduler import submission
from jupyter_evalsched.scheduler.submission import MAX_CHECKED_SOURCE_CHARS, MAX_NESTED_LAMBDAS

EPISODE = "def episode(ctx, index):\n    return {}\n"


def _source_errors(body: dict) -> list[dict]:
    return [d for d in body.get("detail") or [] if d.get("loc") == ["source"]]


def _nested(depth: int) -> str:
    return EPISODE + "x = " + "lambda: " * depth + "1\n"


@pytest.mark.parametrize(
    "source",
    [
        _nested((MAX_CHECKED_SOURCE_CHARS - len(EPISODE) - 10) // len("lambda: ")),  # as deep as 16 KiB goes
        _nested(MAX_NESTED_LAMBDAS + 1),
        # Inside a def, after lambdas side by side (in the count, not in the depth):
        EPISODE + "y = [" + "lambda: 1, " * 200 + "]\ndef f():\n    return " + "lambda: " * 150 + "1\n",
    ],
    ids=["16KiB", "limit+1", "in-a-def"],
)
def test_lambdas_nested_too_deep_are_parsed_never_compiled(monkeypatch, source):
    compiled = []

    def spy(src, filename, mode, flags=0, *args, **kwargs):
        compiled.append(flags)
        return compile(src, filename, mode, flags, *args, **kwargs)

    monkeypatch.setattr(submission, "compile", spy, raising=False)
    assert len(source) <= MAX_CHECKED_SOURCE_CHARS
    assert submission.source_syntax_error(source) is None
    assert compiled == [ast.PyCF_ONLY_AST]  # the parse only: the run compiles it


async def test_lambdas_nested_too_deep_are_left_to_the_run_which_runs_them(api, wait_for):
    rec = await submit(api, {"source": _nested(MAX_NESTED_LAMBDAS + 1), "episodes": 1, "executor": "local"})
    assert (await wait_for(rec["id"]))["state"] == "succeeded"
    # A syntax error among them is still found at submission: the parse says it.
    code, body = await api(
        "POST", "runs", {"source": _nested(MAX_NESTED_LAMBDAS + 1) + "def broken(:\n", "episodes": 1}
    )
    assert code == 422, body
    assert [(d["type"], d["msg"]) for d in _source_errors(body)] == [("syntax_error", "eval.py line 4: invalid syntax")]


async def test_lambdas_within_the_limit_or_side_by_side_are_compiled_and_run(api, wait_for):
    side_by_side = EPISODE + "y = [" + "lambda: 1, " * 1400 + "]\n"
    for source in (_nested(MAX_NESTED_LAMBDAS), side_by_side):
        rec = await submit(api, {"source": source, "episodes": 1, "executor": "local"})
        assert (await wait_for(rec["id"]))["state"] == "succeeded"
    # A syntax error among many lambdas is still found (the parse before the compile says it).
    code, body = await api("POST", "runs", {"source": side_by_side + "def broken(:\n", "episodes": 1})
    assert code == 422, body
    assert [(d["type"], d["msg"]) for d in _source_errors(body)] == [("syntax_error", "eval.py line 4: invalid syntax")]
