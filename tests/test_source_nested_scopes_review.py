"""The compile check at submission against sources whose compile is slow without a single
``lambda``: scopes nested in one another (generator expressions, 190 deep) that use many names of
the function around them, each passed on by every level (16 KiB of them took the compiler about a
second of the server's event loop). Such a source is parsed only at submission (a syntax error
is still found) and compiled by the run; ordinary code is compiled as before. Against a real
in-process Jupyter server and real runs."""

from __future__ import annotations

import ast

import pytest
from rest import submit

from jupyter_evalsched.scheduler import submission
from jupyter_evalsched.scheduler.submission import MAX_CHECKED_SOURCE_CHARS

EPISODE = "def episode(ctx, index):\n    return {'nested': len(list(f(*range(N))))}\n"


def _nested_scopes(depth: int, room: int = 0) -> str:
    """As many names as fit in 16 KiB (less ``room``), used through ``depth`` generator expressions."""

    def source(names: int) -> str:
        params = ",".join(f"a{i}" for i in range(names))
        used = "+".join(f"a{i}" for i in range(names))
        inner = "(" * depth + used + " for _ in [0])" * depth
        return f"N = {names}\ndef f({params}):\n    return {inner}\n" + EPISODE

    names = 1
    while len(source(names + 1)) + room <= MAX_CHECKED_SOURCE_CHARS:
        names += 1
    return source(names)


@pytest.fixture
def compiled(monkeypatch):
    """The flags of each compile() the submission check makes (the in-process server's own)."""
    seen: list[int] = []

    def spy(src, filename, mode, flags=0, *args, **kwargs):
        seen.append(flags)
        return compile(src, filename, mode, flags, *args, **kwargs)

    monkeypatch.setattr(submission, "compile", spy, raising=False)
    return seen


async def test_scopes_nested_at_a_cost_are_parsed_only_and_run(api, wait_for, compiled):
    source = _nested_scopes(190)
    assert "lambda" not in source and len(source) <= MAX_CHECKED_SOURCE_CHARS
    rec = await submit(api, {"source": source, "episodes": 1, "executor": "local"})
    assert compiled == [ast.PyCF_ONLY_AST]  # the parse only: the run compiles it
    done = await wait_for(rec["id"])
    assert done["state"] == "succeeded", done
    # A syntax error among them is still found at submission: the parse says it.
    code, body = await api("POST", "runs", {"source": source.replace("return {", "return {("), "episodes": 1})
    assert code == 422, body
    errors = [(d["type"], d["msg"].split(":")[0]) for d in body.get("detail") or [] if d.get("loc") == ["source"]]
    assert errors == [("syntax_error", "eval.py line 5")], body


async def test_ordinary_nesting_is_compiled_at_submission(api, compiled):
    # A method's comprehension, and a few levels of the same source: compiled at submission, so
    # that what only the compiler finds (not the parse) is refused there.
    broken = "return 1\n"
    for source in (
        _nested_scopes(3, room=len(broken)),
        "class A:\n    def m(self, xs):\n        return [x for x in xs]\n" * 60,
    ):
        compiled.clear()
        code, body = await api("POST", "runs", {"source": source + broken, "episodes": 1})
        assert code == 422, body
        assert body["detail"][0]["msg"].endswith("'return' outside function"), body
        assert compiled[-1] == 0, compiled  # the full compile ran
