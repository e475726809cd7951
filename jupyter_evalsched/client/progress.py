"""How ``RunHandle.wait()`` shows progress: the :class:`ProgressReporter` protocol, the text
reporter, and the choice between it and the notebook's widget.

The widget lives in :mod:`jupyter_evalsched.widget`, which imports this package; this package
never imports it back. Instead the widget module registers its reporter and its view of a run here
when it is imported (``%load_ext jupyter_evalsched`` imports it in a kernel).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from ..contract import QUEUED, RUNNING, SUCCEEDED
from .formatting import elapsed_s, format_duration, format_metrics, pending_head, running_reason_code

if TYPE_CHECKING:
    from .handle import RunHandle


@runtime_checkable
class ProgressReporter(Protocol):
    """Shows a run while ``wait()`` follows it."""

    def update(self, record: dict) -> None:
        """The run changed (state, progress, reason, metrics)."""

    def finish(self, record: dict) -> None:
        """Waiting ended (the run is terminal, or the wait was interrupted or timed out);
        ``record`` is the latest record, possibly empty."""


class TextProgress:
    """A tqdm-like line on stderr: redrawn in place on a terminal, one line per change otherwise."""

    def __init__(self, stream: Any = None, width: int = 28):
        self.stream = stream or sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.width = width
        self.log_interval_s = 5.0
        self._last_line = ""
        self._last_key: tuple | None = None
        self._last_print = 0.0

    def line(self, rec: dict) -> str:
        """``name [#####-----] 2/4 3.1s running  score=0.5``."""
        prog = rec.get("progress") or {}
        done, total = int(prog.get("done") or 0), int(prog.get("total") or 0)
        frac = (done / total) if total else (1.0 if rec.get("state") == SUCCEEDED else 0.0)
        filled = int(round(frac * self.width))
        bar = "#" * filled + "-" * (self.width - filled)
        state = rec.get("state", "?")
        if state == QUEUED and rec.get("reason"):
            state = f"queued ({pending_head(rec)})"  # the code and who holds it, without the sentence
        elif ending := running_reason_code(rec):
            state = f"running ({ending})"  # it is ending: cancelled, or preempted
        elif state not in (RUNNING, SUCCEEDED) and rec.get("reason"):
            state = f"{state} ({rec['reason']})"
        metrics = format_metrics(rec, limit=3)
        name = rec.get("name") or rec.get("id", "?")
        return (
            f"{name} [{bar}] {done}/{total} {format_duration(elapsed_s(rec))} {state}"
            f"{'  ' + metrics if metrics else ''}"
        )

    def update(self, record: dict) -> None:
        line = self.line(record)
        if line == self._last_line:
            return
        if self.tty:
            pad = max(0, len(self._last_line) - len(line))
            self.stream.write("\r" + line + " " * pad)
        else:
            # A log file gets a line per state change, and otherwise one every few seconds.
            key = (record.get("state"), record.get("reason"))
            now = time.monotonic()
            if key == self._last_key and now - self._last_print < self.log_interval_s:
                return
            self._last_key, self._last_print = key, now
            self.stream.write(line + "\n")
        self.stream.flush()
        self._last_line = line

    def note(self, text: str) -> None:
        """A line of its own (the server went away, say), the bar drawn again under it."""
        if self.tty and self._last_line:
            self.stream.write("\r" + text.ljust(len(self._last_line)) + "\n" + self._last_line)
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def finish(self, record: dict) -> None:
        if record:
            self._last_key = None  # the final line is always shown
            self.update(record)
        if self.tty and self._last_line:
            self.stream.write("\n")
            self.stream.flush()


class _NoProgress:
    def update(self, record: dict) -> None:
        pass

    def finish(self, record: dict) -> None:
        pass


# --------------------------------------------------------------------------- notebooks

_notebook_reporter: Callable[[RunHandle], ProgressReporter] | None = None
_notebook_view: Callable[[RunHandle], Any] | None = None


def register_notebook_progress(
    reporter: Callable[[RunHandle], ProgressReporter], view: Callable[[RunHandle], Any] | None = None
) -> None:
    """How a kernel shows runs: ``reporter(handle)`` during ``wait()``, ``view(handle)`` when a
    handle is displayed. Registered by :mod:`jupyter_evalsched.widget`; the last one wins."""
    global _notebook_reporter, _notebook_view
    _notebook_reporter, _notebook_view = reporter, view


def in_kernel() -> bool:
    """Whether this runs in a Jupyter kernel (where widgets can be shown), not a terminal IPython."""
    ipython = sys.modules.get("IPython")  # never imported here: only a kernel has it loaded
    shell = ipython.get_ipython() if ipython is not None else None
    return shell is not None and getattr(shell, "kernel", None) is not None


def notebook_view() -> Callable[[RunHandle], Any] | None:
    """The registered view of a run handle when running in a kernel, else None."""
    return _notebook_view if in_kernel() else None


def reporter_for(handle: RunHandle, progress: Any) -> ProgressReporter:
    """``progress`` of ``wait()`` as a reporter: True chooses (the notebook's widget in a kernel
    where one is registered, else a text line on stderr), False or None shows nothing, anything
    else must be a :class:`ProgressReporter`."""
    if progress is True:
        if _notebook_reporter is not None and in_kernel():
            return _notebook_reporter(handle)
        return TextProgress()
    if progress is False or progress is None:
        return _NoProgress()
    if isinstance(progress, ProgressReporter):
        return progress
    raise TypeError(
        f"progress must be True, False or an object with update(record) and finish(record), not {progress!r}"
    )
