"""The errors the client raises: all are :class:`EvalSchedClientError`, and each reads as one line."""

from __future__ import annotations

from typing import Any

# Appended to every "cannot find / reach the server" message: the two ways out.
HOW_TO_FIX = "start Jupyter with the jupyter_evalsched extension enabled, or set EVALSCHED_URL and EVALSCHED_TOKEN"
# Said by every 403 that means "not logged in", whatever the server worded it ("Forbidden",
# "'_xsrf' argument missing from POST": a POST without a valid token).
TOKEN_HINT = (
    "forbidden: wrong or missing token (give the server's token: EVALSCHED_TOKEN, --token in the CLI, "
    "token= in Python; `jupyter server list` shows it)"
)


class EvalSchedClientError(Exception):
    """Base class of every error this client raises."""


class ServerNotFound(EvalSchedClientError):
    """No server could be found or reached. The message says how to fix it."""

    maybe_received = False  # True when a request may have reached a server before the failure


class TokenRefused(ServerNotFound):
    """Jupyter servers were found, but the token given was refused by them."""


class SpecError(EvalSchedClientError, ValueError):
    """The spec could not be built on the client side (bad file, bad flag)."""


class WaitTimeout(EvalSchedClientError, TimeoutError):
    """``wait(timeout=...)`` ran out before the run reached a terminal state."""

    def __init__(self, run_id: str, timeout: float, record: dict | None, what: str = "run"):
        self.run_id = run_id
        self.record = record
        state = (record or {}).get("state", "?")
        super().__init__(f"{what} {run_id} still {state} after {timeout:g} s")


class EventStreamClosed(EvalSchedClientError):
    """The event WebSocket was closed (by us or by the server)."""


class EvalSchedError(EvalSchedClientError):
    """An HTTP error answered by the server: ``status``, ``message``, ``reason``, ``detail``.

    ``str()`` is one readable line, e.g.
    ``422: scheduling.marginal_vram_mb: Input should be greater than or equal to 0``.
    """

    retry_after: float | None = None  # the answer's Retry-After, in seconds, when it had one

    def __init__(self, status: int, message: str, detail: list | None = None, reason: str | None = None):
        self.status = status
        self.message = message
        self.detail = detail
        self.reason = reason
        super().__init__(self._one_line())

    def _one_line(self) -> str:
        text = self.message or self.reason or "error"
        if self.detail:
            parts = [_format_field_error(item) for item in self.detail[:3]]
            more = len(self.detail) - 3
            text = "; ".join(p for p in parts if p) or text
            if more > 0:
                text += f" (and {more} more)"
        text = " ".join(str(text).split())  # one line, whatever the server sent
        return f"{self.status}: {text}"


def _format_field_error(item: Any) -> str:
    """``{"loc": ["body", "scheduling", "gpus"], "msg": "..."}`` -> ``scheduling.gpus: ...``."""
    if not isinstance(item, dict):
        return str(item)
    loc = item.get("loc") or item.get("field") or ()
    if isinstance(loc, str):
        loc = [loc]
    names = [str(p) for p in loc if p not in ("body", "__root__")]
    msg = item.get("msg") or item.get("message") or ""
    return f"{'.'.join(names)}: {msg}" if names else str(msg)


def server_away(exc: BaseException) -> bool:
    """Whether ``exc`` says the server is away for now (down, restarting, starting, behind a proxy
    that answers for it), not that the request is wrong: a follower waits through it."""
    if isinstance(exc, TokenRefused):
        return False
    if isinstance(exc, ServerNotFound):
        return True
    return isinstance(exc, EvalSchedError) and exc.status in (502, 503, 504)
