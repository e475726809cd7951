"""Sweeps: one submission, many runs (docs/reference.md, "Sweeps and comparison"). Pure functions.

A sweep is a spec plus ``"sweep"``: a grid ``{"<param>": [values, ...], ...}`` (every
combination, the first parameter varying slowest) or a list of points ``[{"<param>": value,
...}, ...]``. Each point becomes one ordinary run whose ``params`` are the spec's updated with
the point; its record carries ``sweep_id``, ``sweep_point`` and ``sweep_name`` (the spec's name,
the base of its runs' names). A sweep has no state of its own:
it is the set of runs that name it.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import re
import secrets
import time
from typing import Any

from ..schemas import MAX_PARAMS_DEPTH

MAX_SWEEP_RUNS = 1000
# The sum of a sweep's runs' specs as JSON (each measured as models.MAX_SPEC_JSON_CHARS measures
# one): what its submission writes to disk and works through.
MAX_SWEEP_JSON_CHARS = 64 * 1024 * 1024
# Sweep submissions under way at once; one more is answered 429 (its client retries).
MAX_SWEEP_SUBMISSIONS = 2
SWEEP_ID_PREFIX = "sweep-"
# A submission makes a sweep's runs a chunk at a time, each chunk's directories one batch of the
# writer's thread: at most this many points, and this many characters of spec (a chunk's records
# and files are made in one turn of the event loop, and kept until the batch is written).
SWEEP_CHUNK_POINTS = 64
SWEEP_CHUNK_CHARS = 1024 * 1024
# What a run's name may not hold (EvalSpec.name: control characters) and what no text should
# (C1 controls, DEL, lone surrogates, which JSON allows in a value): a name the server makes
# from a point shows them escaped, as Python writes them (\n, \x07, \ud800).
_UNPRINTABLE = re.compile(r"[\x00-\x1f\x7f-\x9f\ud800-\udfff]")


class SweepError(ValueError):
    """A sweep that cannot be expanded: ``loc`` and ``msg`` as in a validation error."""

    def __init__(self, loc: list[str | int], msg: str) -> None:
        super().__init__(msg)
        self.loc = loc
        self.msg = msg


def new_sweep_id() -> str:
    return f"{SWEEP_ID_PREFIX}{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}-{secrets.token_hex(3)}"


def expand(sweep: Any) -> list[dict[str, Any]]:
    """The points of a sweep, in order; SweepError says what is wrong."""
    if isinstance(sweep, dict):
        if not sweep:
            raise SweepError(["sweep"], "a grid needs at least one parameter")
        axes = []
        for name, values in sweep.items():
            _check_name(name, ["sweep", name])
            if not isinstance(values, list) or not values:
                raise SweepError(["sweep", name], "a grid parameter takes a non-empty list of values")
            for i, value in enumerate(values):
                _check_depth(value, ["sweep", name, i])
            if len({_canonical(v) for v in values}) != len(values):
                raise SweepError(["sweep", name], "the same value is listed twice")
            axes.append([(name, v) for v in values])
        size = 1
        for axis in axes:
            size *= len(axis)
        if size > MAX_SWEEP_RUNS:
            raise SweepError(["sweep"], f"the grid makes {size} runs; at most {MAX_SWEEP_RUNS} per sweep")
        return [dict(combo) for combo in itertools.product(*axes)]
    if isinstance(sweep, list):
        if not sweep:
            raise SweepError(["sweep"], "a list sweep needs at least one point")
        if len(sweep) > MAX_SWEEP_RUNS:
            raise SweepError(["sweep"], f"the list has {len(sweep)} points; at most {MAX_SWEEP_RUNS} per sweep")
        seen = set()
        points = []
        for i, point in enumerate(sweep):
            if not isinstance(point, dict) or not point:
                raise SweepError(["sweep", i], "a point is a non-empty object of parameter values")
            for name, value in point.items():
                _check_name(name, ["sweep", i, name])
                _check_depth(value, ["sweep", i, name])
            key = _canonical(point)
            if key in seen:
                raise SweepError(["sweep", i], "the same point is listed twice")
            seen.add(key)
            points.append(dict(point))
        return points
    raise SweepError(["sweep"], 'a sweep is a grid {"<param>": [values]} or a list of points [{"<param>": value}]')


def chunks(sizes: list[int], max_points: int, max_chars: int) -> list[range]:
    """The points (given their specs' sizes) cut into consecutive chunks of at most
    ``max_points`` points and ``max_chars`` characters; a point larger than that alone."""
    out: list[range] = []
    start, chars = 0, 0
    for i, size in enumerate(sizes):
        if i > start and (i - start >= max_points or chars + size > max_chars):
            out.append(range(start, i))
            start, chars = i, 0
        chars += size
    if start < len(sizes):
        out.append(range(start, len(sizes)))
    return out


def point_label(point: dict[str, Any]) -> str:
    """``temperature=0.2, k=1``: how a run of a sweep is told apart from its siblings; printable
    (what is not is escaped), so that any point valid as params makes a valid run name."""
    return ", ".join(f"{printable(k)}={_short(v)}" for k, v in point.items())


def printable(text: str) -> str:
    """``text`` with its control characters and lone surrogates escaped (``"a\\nb"``)."""
    return _UNPRINTABLE.sub(lambda m: repr(m.group())[1:-1], text)


def points_digest(points: list[dict[str, Any]]) -> str:
    """What tells a sweep's points from another's (their order and their keys' order included:
    both make the runs' names), for a retry under the same Idempotency-Key."""
    text = json.dumps(points, separators=(",", ":"))  # (ASCII: a lone surrogate is escaped)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def run_name(base: str | None, point: dict[str, Any], limit: int = 200) -> str | None:
    """The name of a sweep's run: the spec's name (if any) with its point."""
    if base is None:
        return None
    name = f"{base} [{point_label(point)}]"
    return name if len(name) <= limit else name[: limit - 1] + "…"


def counts(states: list[str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for state in states:
        out[state] = out.get(state, 0) + 1
    return out


def _check_name(name: Any, loc: list[str | int]) -> None:
    if not isinstance(name, str) or not name or len(name) > 200 or any(ord(c) < 32 for c in name):
        raise SweepError(loc, "a parameter name is a non-empty string of at most 200 printable characters")


def _check_depth(value: Any, loc: list[str | int]) -> None:
    """A value nested deeper than params may be is refused here, by a walk without recursion:
    json.dumps (duplicates are found through it) would overflow the stack on it."""
    stack = [(value, 1)]  # a value sits one level down in the params
    while stack:
        item, depth = stack.pop()
        if depth > MAX_PARAMS_DEPTH:
            raise SweepError(loc, f"the value is nested more than {MAX_PARAMS_DEPTH} levels deep in the params")
        if isinstance(item, dict):
            stack.extend((v, depth + 1) for v in item.values())
        elif isinstance(item, list):
            stack.extend((v, depth + 1) for v in item)


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def _short(value: Any) -> str:
    # (JSON escapes what is not printable in a value other than a string)
    text = printable(value) if isinstance(value, str) else json.dumps(value, separators=(",", ":"))
    return text if len(text) <= 40 else text[:39] + "…"
