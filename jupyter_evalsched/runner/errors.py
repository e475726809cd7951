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

    Never raises, whatever the eval's exception does in ``__str__`` or ``__repr__`` (what cannot
    be printed is named by its type), and holds plain ``str`` only: a worker pickles it for the
    run process, which has not imported the eval's module and could not unpickle its classes.
    """
    name = _type_name(exc)
    if isinstance(exc, SystemExit):
        try:
            code = _safe_repr(exc.code)
        except Exception:  # (a subclass's property)
            code = "..."
        message = f"the eval called sys.exit({code})"
    else:
        message = _safe_str(exc)
        if not message and isinstance(exc, KeyboardInterrupt):
            message = "KeyboardInterrupt raised by the eval"
    try:
        import traceback

        prefixes = _plumbing_prefixes()
        tb = exc.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename.startswith(prefixes):
            tb = tb.tb_next
        text = str.__str__("".join(traceback.format_exception(type(exc), exc, tb)))
    except Exception:  # e.g. MemoryError again while formatting: keep what we have
        text = f"{name}: {message}\n"
    return {"type": name, "message": message, "traceback": text, "episode": episode}


def _type_name(exc: BaseException) -> str:
    try:
        return str.__str__(type(exc).__name__)  # (a metaclass may make __name__ anything)
    except Exception:
        return "BaseException"


def _safe_str(exc: BaseException) -> str:
    try:
        # str() may return a str subclass (the eval's own class): a plain copy of its text.
        return str.__str__(str(exc))
    except Exception:
        return f"<unprintable {_type_name(exc)}>"


def _safe_repr(value: object) -> str:
    try:
        return str.__str__(repr(value))
    except Exception:
        try:
            return f"<unprintable {str.__str__(type(value).__name__)}>"
        except Exception:
            return "<unprintable object>"
