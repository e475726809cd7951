"""What a browser test leaves behind when it fails: a screenshot of its page and the server's log."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol

ARTIFACTS = Path(__file__).resolve().parents[1] / "test-artifacts"


class _HasLog(Protocol):
    def log_tail(self) -> str: ...


@contextmanager
def failure_report(server: _HasLog, screenshot: str, page: Callable[[], Any | None]) -> Iterator[None]:
    """On any failure inside: a full-page screenshot of ``page()`` (when there is a page yet) as
    ``test-artifacts/<screenshot>``, and the server's log tail printed; then the failure goes on.
    ``page`` is called only then, so a test may open its page inside the block."""
    try:
        yield
    except BaseException:
        shown = page()
        if shown is not None:
            ARTIFACTS.mkdir(exist_ok=True)
            try:
                shown.screenshot(path=str(ARTIFACTS / screenshot))
            except Exception as exc:  # the page may be gone: the log matters more
                print(f"no screenshot ({screenshot}): {exc}")
        print(server.log_tail())
        raise
