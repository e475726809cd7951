"""Building a spec on the client side: the submit flags shared by the CLI and the magics, spec
files, ``--param`` values."""

from __future__ import annotations

import argparse
import difflib
import json
import os
import re
from collections.abc import Iterable
from typing import Any

from ..contract import LANES, RETRYABLE_CODES
from .errors import SpecError
from .handle import run_id_of

# The submit flags, shared by the CLI (argparse) and the magics (IPython's magic_arguments, which
# wraps argparse): one definition, so the two can never drift apart.
SPEC_FLAGS: list[tuple[tuple[str, ...], dict[str, Any]]] = [
    (("--name",), dict(help="run name (default: derived from the entrypoint)")),
    (("--episodes",), dict(type=int, metavar="N", help="number of episodes (default 1)")),
    (
        ("--vram",),
        dict(
            type=lambda text: vram_figure(text),
            metavar="MB",
            help="marginal VRAM per GPU in MB, on top of the shared models (default 0: CPU only), or 'auto': "
            "the highest observed peak of earlier succeeded runs of the same eval, plus a margin",
        ),
    ),
    (
        ("--memory",),
        dict(type=int, metavar="MB", help="host memory limit of the run in MB (enforced through its cgroup)"),
    ),
    (("--gpus",), dict(type=int, metavar="N", help="GPUs needed when --vram > 0 or --exclusive (default 1)")),
    (("--cpus",), dict(type=int, metavar="N", help="CPU slots the run takes (default 1)")),
    (("--priority",), dict(choices=list(LANES), help="priority lane (default normal)")),
    (("--exclusive",), dict(action="store_true", default=None, help="nothing else may run on the run's GPUs")),
    (
        ("--depends-on",),
        dict(
            action="append",
            dest="depends_on",
            metavar="RUN_ID",
            help="start only after this run succeeded (repeatable)",
        ),
    ),
    (
        ("--param",),
        dict(
            action="append",
            dest="params",
            metavar="KEY=VALUE",
            help="eval parameter; VALUE is parsed as JSON when it parses, else kept as a string (repeatable)",
        ),
    ),
    (
        ("--model",),
        dict(
            action="append",
            dest="models",
            metavar="NAME",
            help="shared model the eval uses through ctx.model(NAME) (repeatable)",
        ),
    ),
    (("--workers",), dict(type=int, metavar="N", help="worker processes for the episodes (default 1)")),
    (("--timeout",), dict(type=float, metavar="SECONDS", help="fail the run after this many seconds")),
    (("--seed",), dict(type=int, help="base seed; episode i gets seed + i (default 0)")),
    (
        ("--retries",),
        dict(
            type=int,
            metavar="N",
            help="resume the run automatically up to N times after a failure named by --retry-on (default 0)",
        ),
    ),
    (
        ("--retry-on",),
        dict(
            action="append",
            dest="retry_on",
            metavar="CODE",
            choices=list(RETRYABLE_CODES),
            help="a reason code that is retried (repeatable; default: exit_code, signal, oom)",
        ),
    ),
    (
        ("--preemptible",),
        dict(
            action=argparse.BooleanOptionalAction,
            default=None,
            help="a waiting run of a higher lane may stop this one at an episode boundary; it resumes later "
            "(default: only in the low lane)",
        ),
    ),
    (
        ("--detach",),
        dict(
            action="store_true",
            default=None,
            help="the run does not die with the server; a restarted server re-attaches it",
        ),
    ),
    (
        ("--fresh-interpreter",),
        dict(
            action="store_true",
            default=None,
            help="start the run in a fresh interpreter, not forked from the server's warm zygote",
        ),
    ),
    (
        ("--executor",),
        dict(
            choices=["local", "slurm"],
            help="where the run executes: this host's ledger or SLURM (default: the server's)",
        ),
    ),
]

SPEC_FILE_SUFFIXES = (".json", ".yaml", ".yml")


def did_you_mean(message: str, options: Iterable[str]) -> str:
    """An argument parser's error ``message`` with what was probably meant: the known flag
    (``options``) closest to each unrecognized one (``--priorty`` -> ``--priority``), the choice
    closest to an invalid one (``hihg`` -> ``high``, ``stauts`` -> ``status``)."""
    hints = []
    known = list(options)
    if "unrecognized arguments:" in message:
        for word in message.split("unrecognized arguments:", 1)[1].split():
            flag = word.split("=", 1)[0]
            close = difflib.get_close_matches(flag, known, n=1, cutoff=0.6) if flag.startswith("--") else []
            if close:
                hints.append(f"did you mean {close[0]} instead of {flag}?")
    invalid = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)", message)
    if invalid:
        choices = re.findall(r"'([^']*)'", invalid.group(2))
        close = difflib.get_close_matches(invalid.group(1), choices, n=1, cutoff=0.6)
        if close:
            hints.append(f"did you mean {close[0]!r}?")
    return "; ".join([message, *hints])


def vram_figure(text: str) -> int | str:
    """``--vram``: a number of MB, or ``auto``."""
    if text.strip().lower() == "auto":
        return "auto"
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of MB or 'auto', got {text!r}") from None


def parse_param(text: str) -> tuple[str, Any]:
    """``"k=v"`` -> ``("k", v)`` with ``v`` parsed as JSON when it parses, else the raw string."""
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key:
        raise SpecError(f"--param expects KEY=VALUE, got {text!r}")
    try:
        value = json.loads(raw)
    except ValueError:
        value = raw
    return key, value


# The sweep flags of `jupyter evalsched submit` and `%eval_sweep` (not of `%eval_submit`).
SWEEP_FLAGS: list[tuple[tuple[str, ...], dict[str, Any]]] = [
    (
        ("--sweep",),
        dict(
            action="append",
            default=None,
            metavar="PARAM=V1,V2,...",
            help="run at every combination of these values (repeatable: a grid); values are JSON when they "
            "parse, else strings",
        ),
    ),
    (
        ("--sweep-points",),
        dict(
            default=None,
            metavar="JSON",
            help='run at each of these points: a JSON list like \'[{"temperature": 0.2}, {"temperature": 1.0, "k": 5}]\'',
        ),
    ),
]


def sweep_from_options(options: Any) -> dict | list | None:
    """The ``sweep`` of ``--sweep``/``--sweep-points`` (None when neither is given)."""
    grid_args = getattr(options, "sweep", None)
    points_arg = getattr(options, "sweep_points", None)
    if grid_args and points_arg:
        raise SpecError("give --sweep (a grid) or --sweep-points (a list), not both")
    if points_arg:
        try:
            points = json.loads(points_arg)
        except ValueError as e:
            raise SpecError(f"--sweep-points is not JSON: {e}") from None
        if not isinstance(points, list):
            raise SpecError("--sweep-points takes a JSON list of objects")
        return points
    if not grid_args:
        return None
    grid: dict[str, list[Any]] = {}
    for text in grid_args:
        name, sep, raw = text.partition("=")
        name = name.strip()
        if not sep or not name or not raw:
            raise SpecError(f"--sweep expects PARAM=V1,V2,..., got {text!r}")
        if name in grid:
            raise SpecError(f"--sweep {name} is given twice")
        grid[name] = [_value(v) for v in _split_values(raw)]
    return grid


def _split_values(raw: str) -> list[str]:
    """``0.2,0.7,"a,b",[1,2]`` -> the four values: commas inside quotes or brackets do not split."""
    out, depth, quote, start = [], 0, False, 0
    for i, c in enumerate(raw):
        if c == '"' and (i == 0 or raw[i - 1] != "\\"):
            quote = not quote
        elif not quote and c in "[{":
            depth += 1
        elif not quote and c in "]}":
            depth -= 1
        elif c == "," and not quote and depth == 0:
            out.append(raw[start:i])
            start = i + 1
    out.append(raw[start:])
    return [v.strip() for v in out]


def _value(raw: str) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        return raw


def load_spec_file(path: str) -> dict:
    """Read a ``.json`` or ``.yaml`` spec. A relative ``cwd`` in it is relative to the file."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise SpecError(f"cannot read spec file {path}: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise SpecError(f"spec file {path} is not UTF-8 text (byte {e.start}): save it as UTF-8") from None
    try:
        if path.endswith(".json"):
            spec = json.loads(text)
        else:
            import yaml

            spec = yaml.safe_load(text)
    except Exception as e:  # json.JSONDecodeError, yaml.YAMLError
        raise SpecError(f"cannot parse spec file {path}: {parse_error_text(e, text)}") from None
    if not isinstance(spec, dict):
        raise SpecError(f"spec file {path} must contain a mapping, not {type(spec).__name__}")
    cwd = spec.get("cwd")
    if isinstance(cwd, str) and cwd and not os.path.isabs(cwd):
        spec["cwd"] = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(path)), cwd))
    return spec


def parse_error_text(error: Exception, text: str) -> str:
    """A JSON or YAML parse error on one line, where it is first: ``line 3, column 5: expected
    ',' or ']', but got ':' (while parsing a flow sequence, at line 2, column 11)``; lines and
    columns count from 1, as editors do."""
    if isinstance(error, json.JSONDecodeError):
        return f"line {error.lineno}, column {error.colno}: {error.msg}"
    problem = getattr(error, "problem", None)
    mark = getattr(error, "problem_mark", None)  # yaml.MarkedYAMLError (0-based marks)
    if problem and mark is not None:
        out = f"line {mark.line + 1}, column {mark.column + 1}: {problem}"
        context, at = getattr(error, "context", None), getattr(error, "context_mark", None)
        if context:
            out += f" ({context}" + (f", at line {at.line + 1}, column {at.column + 1})" if at is not None else ")")
        return " ".join(out.splitlines())
    position = getattr(error, "position", None)  # yaml.ReaderError: a character's index
    first = str(error).splitlines()[0] if str(error) else type(error).__name__
    if isinstance(position, int) and 0 <= position <= len(text):
        line = text.count("\n", 0, position) + 1
        column = position - (text.rfind("\n", 0, position) + 1) + 1
        return f"line {line}, column {column}: {first}"
    return first


# Flag (argparse dest) -> spec key, at the spec's top level and in its ``scheduling``.
_TOP_LEVEL_FLAGS = {
    "name": "name",
    "episodes": "episodes",
    "workers": "workers",
    "seed": "seed",
    "timeout": "timeout_s",
    "executor": "executor",
    "retries": "retries",
    "retry_on": "retry_on",
    "detach": "detach",
    "fresh_interpreter": "fresh_interpreter",
}
_SCHEDULING_FLAGS = {
    "vram": "marginal_vram_mb",
    "gpus": "gpus",
    "cpus": "cpus",
    "priority": "priority",
    "exclusive": "exclusive_gpu",
    "memory": "memory_mb",
    "preemptible": "preemptible",
}


def apply_spec_options(spec: dict | None, options: Any, *, default_cwd: str | None = None) -> dict:
    """Return a copy of ``spec`` with the flags of :data:`SPEC_FLAGS` (an argparse namespace) applied.

    Flags override the spec's values; ``--depends-on``, ``--model`` append; ``--param`` updates.
    ``cwd`` defaults to ``default_cwd`` (the caller's working directory).
    """
    try:
        out = json.loads(json.dumps(spec, default=run_id_of)) if spec else {}
    except (TypeError, ValueError) as e:  # a dict spec of the magics may hold anything
        raise SpecError(f"the spec is not JSON data: {e}") from None
    # A field of the wrong type that no flag touches is left to the server (a 422 naming it).
    out.update(_flags_given(options, _TOP_LEVEL_FLAGS))
    sched_flags = _flags_given(options, _SCHEDULING_FLAGS)
    if out.get("scheduling") is None and "scheduling" in out:
        out["scheduling"] = {}
    if sched_flags:
        given = ", ".join(
            "--" + flag.replace("_", "-") for flag, key in _SCHEDULING_FLAGS.items() if key in sched_flags
        )
        out["scheduling"] = {**_mapping(out, "scheduling", given), **sched_flags}
    if getattr(options, "params", None):
        out["params"] = {**_mapping(out, "params", "--param"), **dict(parse_param(item) for item in options.params)}
    for flag in ("depends_on", "models"):
        if getattr(options, flag, None):
            merged = _id_list(out, flag) + [run_id_of(v) for v in getattr(options, flag)]
            out[flag] = list(dict.fromkeys(merged))  # in order, without repeats
    if default_cwd is not None and not out.get("cwd"):
        out["cwd"] = default_cwd
    return out


def _mapping(spec: dict, key: str, flags: str) -> dict:
    """The spec's ``key`` (a mapping, or nothing), for flags to add to."""
    value = spec.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise SpecError(
            f"the spec's {key} must be a mapping (key: value), not {type(value).__name__}: {flags} add to it"
        )
    return value


def _id_list(spec: dict, key: str) -> list:
    """The spec's ``depends_on`` or ``models`` as a list: one id or name alone is a list of one."""
    value = spec.get(key)
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list):
        raise SpecError(f"the spec's {key} must be a list, not {type(value).__name__}")
    return list(value)


def _flags_given(options: Any, flags: dict[str, str]) -> dict[str, Any]:
    """The spec keys of ``flags`` whose flag ``options`` sets (argparse leaves the others None)."""
    values = {key: getattr(options, flag, None) for flag, key in flags.items()}
    return {key: value for key, value in values.items() if value is not None}
