"""JSON for the runner's start-up path, on CPython's C accelerator without the ``json`` package.

``import json`` costs ~10 ms on this project's machines (it imports ``re`` and ``enum``), about
the whole budget the runner has on top of the interpreter. The C scanner in ``_json`` parses
without them. Output and errors match the ``json`` module: ``loads`` hands anything unusual
(invalid input, bytes that are not UTF-8, a Python without ``_json``) to ``json.loads``, so its
exact ``JSONDecodeError`` is what a user sees; ``dumps`` writes what
``json.dumps(obj, separators=(",", ":"), allow_nan=False)`` writes, for the types the runner
produces (dict with str keys, list, tuple, str, int, float, bool, None).
"""

from __future__ import annotations

TYPE_CHECKING = False  # typing is not imported at run time (start-up cost); mypy knows this name
if TYPE_CHECKING:
    from _json import make_scanner
    from collections.abc import Callable
    from typing import Any

    _Scanner = Callable[[str, int], tuple[Any, int]]  # (text, start) -> (value, end)

_encode_str: Callable[[str], str] | None
_c_make_scanner: type[make_scanner] | None
try:
    from _json import encode_basestring_ascii as _encode_str
    from _json import make_scanner as _c_make_scanner
except ImportError:  # not CPython: the json module does everything
    _encode_str = None
    _c_make_scanner = None

_WHITESPACE = " \t\n\r"
_INF = float("inf")
_CONSTANTS = {"NaN": float("nan"), "Infinity": _INF, "-Infinity": -_INF}


class _ScannerContext:
    """The attributes ``_json.make_scanner`` reads from a ``json.JSONDecoder``."""

    strict = True
    object_hook = None
    object_pairs_hook = None
    parse_float = float
    parse_int = int
    parse_constant = staticmethod(_CONSTANTS.__getitem__)


_scan: _Scanner | None = None


def _scanner() -> _Scanner | None:
    global _scan, _c_make_scanner
    if _scan is None and _c_make_scanner is not None:
        try:
            # typeshed types the context as a make_scanner (its own TODO says: any object with
            # these attributes, which is what the C code reads).
            _scan = _c_make_scanner(_ScannerContext())  # type: ignore[arg-type]
        except Exception:
            _c_make_scanner = None
    return _scan


def _slow_loads(data: str | bytes | bytearray) -> object:
    import json

    return json.loads(data)


def loads(data: str | bytes | bytearray) -> object:
    """``json.loads``, faster to import."""
    if isinstance(data, (bytes, bytearray)):
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            return _slow_loads(data)
    else:
        text = data
    scan = _scanner()
    if scan is None:
        return _slow_loads(text)
    start = len(text) - len(text.lstrip(_WHITESPACE))
    try:
        value, end = scan(text, start)
    except Exception:
        return _slow_loads(text)
    if end != len(text) and text[end:].strip(_WHITESPACE):
        return _slow_loads(text)  # raises "Extra data"
    return value


def dumps(obj: object) -> str:
    """``json.dumps(obj, separators=(",", ":"), allow_nan=False)``, faster to import."""
    encode_str = _encode_str
    if encode_str is None:
        import json

        return json.dumps(obj, separators=(",", ":"), allow_nan=False)
    parts: list[str] = []
    _encode(obj, parts.append, encode_str, 0)
    return "".join(parts)


def _encode(obj: object, out: Callable[[str], None], encode_str: Callable[[str], str], depth: int) -> None:
    if depth > 500:
        raise ValueError("nested too deeply to encode as JSON")
    if obj is None:
        out("null")
    elif obj is True:
        out("true")
    elif obj is False:
        out("false")
    elif isinstance(obj, str):
        out(encode_str(obj))
    elif isinstance(obj, int):
        out(int.__repr__(obj))
    elif isinstance(obj, float):
        if obj != obj or obj == _INF or obj == -_INF:
            raise ValueError(f"Out of range float values are not JSON compliant: {obj!r}")
        out(float.__repr__(obj))
    elif isinstance(obj, dict):
        out("{")
        first = True
        for key, value in obj.items():
            if not isinstance(key, str):
                raise TypeError(f"keys must be str, not {type(key).__name__}")
            if not first:
                out(",")
            first = False
            out(encode_str(key))
            out(":")
            _encode(value, out, encode_str, depth + 1)
        out("}")
    elif isinstance(obj, (list, tuple)):
        out("[")
        for i, item in enumerate(obj):
            if i:
                out(",")
            _encode(item, out, encode_str, depth + 1)
        out("]")
    else:
        raise TypeError(f"Object of type {type(obj).__name__} is not JSON serializable")
