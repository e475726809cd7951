"""Turn an exception into the ``error`` object of ``summary.json``."""

from __future__ import annotations

import os

TYPE_CHECKING = False  # typing is not imported at run time (start-up cost); mypy knows this name
if TYPE_CHECKING:
    from typing import TypedDict

    class ErrorInfo(TypedDict):
        """The ``error`` object of ``summary.json`` (and of a worker's failure report)."""

        type: str
        message: str
        traceback: str
        episode: int | None  # the index that raised; None before the episodes (spec, import)


_RUNNER_DIR = os.path.dirname(os.path.abspath(__file__))


def _plumbing_prefixes() -> tuple[str, ...]:
    # The runner's own frames and the import machinery say nothing about the eval.
    import importlib

    return (_RUNNER_DIR + os.sep, os.path.dirname(importlib.__file__) + os.sep, "<frozen importlib")


def describe_exception(exc: BaseException, episode: int | None = None) -> ErrorInfo:
    """``{"type", "message", "traceback", "episode"}`` for ``exc``.

    The traceback is the formatted exception with the runner's leading frames removed, so it
    starts where the eval's code does. ``episode`` is the index that raised, or None when the
    run failed before its episodes (spec, import).
    """
    if isinstance(exc, SystemExit):
        message = f"the eval called sys.exit({exc.code!r})"
    elif isinstance(exc, KeyboardInterrupt) and not str(exc):
        message = "KeyboardInterrupt raised by the eval"
    else:
        message = _safe_str(exc)
    try:
        import traceback

        prefixes = _plumbing_prefixes()
        tb = exc.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename.startswith(prefixes):
            tb = tb.tb_next
        text = "".join(traceback.format_exception(type(exc), exc, tb))
    except Exception:  # e.g. MemoryError again while formatting: keep what we have
        text = f"{type(exc).__name__}: {message}\n"
    return {"type": type(exc).__name__, "message": message, "traceback": text, "episode": episode}


def _safe_str(exc: BaseException) -> str:
    try:
        return str(exc)
    except Exception:
        return f"<unprintable {type(exc).__name__}>"
