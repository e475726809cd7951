"""Errors of scheduler operations, each with the HTTP status it means to a client."""

from __future__ import annotations

from ..store import StoreBug, StoreError


class SchedulerError(Exception):
    status = 400

    def __init__(self, message: str, detail: list[dict] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.detail = detail


class SpecRejected(SchedulerError):
    """The spec is valid JSON of the right shape but cannot run here (never fits, unknown model...)."""

    status = 422


class UnknownRun(SchedulerError):
    status = 404


class StateConflict(SchedulerError):
    """The operation does not fit the run's state (cancel a finished run, delete a running one)."""

    status = 409


class Unavailable(SchedulerError):
    """The scheduler cannot serve now (starting, runs directory unwritable): retry later."""

    status = 503


class Internal(SchedulerError):
    """A bug of ours stopped the operation (the server's log has its traceback): retrying will not
    help, so not a 503."""

    status = 500


def store_failure(exc: StoreError) -> SchedulerError:
    """What a failed run-directory write means to a client: a bug of ours (500) or the disk's
    trouble, which may pass (503)."""
    return Internal(str(exc)) if isinstance(exc, StoreBug) else Unavailable(str(exc))


class Busy(SchedulerError):
    """Too much of one kind of work is under way (sweep submissions): retry in a moment."""

    status = 429


class TooLarge(SchedulerError):
    """The answer asked for would exceed a size limit (a comparison of too many values)."""

    status = 413
