"""A run's attempts: how one ends and the next begins (resume, retry, preemption, restart).

Pure: a record (and the spec's retry settings) in, a ``Requeue`` out. The run table carries it
out (``RunTable.requeue``); the runner of the next attempt skips the episodes earlier attempts
finished (``episodes.jsonl`` is the checkpoint).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from .. import contract


@dataclass(frozen=True, slots=True)
class Requeue:
    """A run's next attempt: why it waits (its reason, as data), the record fields that change
    (``attempt``, ``history``, ``retries_used``, ``preemptions``, ``retry_at``), and how long it
    waits before admission may start it (a retry's back-off)."""

    why: contract.Why | None
    fields: dict[str, Any]
    delay_s: float = 0.0

    @property
    def reason(self) -> str | None:
        return None if self.why is None else self.why.reason


# History entries kept in a record: a run preempted or retried thousands of times keeps its last.
MAX_HISTORY = 100


def attempt_end(record: dict[str, Any], state: str, reason: str | None) -> dict[str, Any]:
    """The ``history`` entry of the attempt that just ended (``state``: failed, cancelled,
    aborted or preempted)."""
    return {
        "attempt": record.get("attempt") or 1,
        "state": state,
        "reason": reason,
        "started_at": record.get("started_at"),
        "finished_at": record.get("finished_at") or _now_iso(),
        "episodes_done": (record.get("progress") or {}).get("done", 0),
    }


def _next(record: dict[str, Any], state: str, reason: str | None, **fields: Any) -> dict[str, Any]:
    history = [*(record.get("history") or []), attempt_end(record, state, reason)][-MAX_HISTORY:]
    return {"attempt": (record.get("attempt") or 1) + 1, "history": history, "retry_at": None, **fields}


def resume_plan(record: dict[str, Any]) -> Requeue:
    """``POST /runs/{id}/resume`` of a failed, aborted or cancelled run: a new attempt with its
    retries available again (the user asked for it)."""
    return Requeue(None, _next(record, record["state"], record.get("reason"), retries_used=0))


def retry_plan(
    record: dict[str, Any],
    retry_on: list[str] | tuple[str, ...],
    state: str,
    reason: str | None,
    *,
    backoff_s: float,
    backoff_max_s: float,
    now: float,
) -> Requeue | None:
    """The automatic retry of a failure, or None: only ``failed`` runs whose reason code is in
    ``retry_on`` while retries are left. The back-off doubles with every retry of the run, up to
    ``backoff_max_s``."""
    used = record.get("retries_used") or 0
    allowed = record.get("retries") or 0
    if state != contract.FAILED or used >= allowed or contract.reason_code(reason) not in retry_on:
        return None
    delay = min(backoff_s * (2**used), backoff_max_s) if backoff_s > 0 else 0.0
    attempt = (record.get("attempt") or 1) + 1
    when = datetime.fromtimestamp(now + delay, UTC)
    why = contract.Why(
        contract.RETRYING,
        f"attempt {attempt} (retry {used + 1} of {allowed}) "
        + (f"in {delay:g} s, at {when.strftime('%H:%M:%S')} UTC, " if delay else "")
        + f"after {reason}",
    )
    fields = _next(record, state, reason, retries_used=used + 1)
    fields["retry_at"] = when.isoformat(timespec="microseconds") if delay else None
    return Requeue(why, fields, delay_s=delay)


def preempted_plan(record: dict[str, Any], by: str, holder: contract.Holder | None = None) -> Requeue:
    """A run that stopped at an episode boundary for ``by`` (the run or lease ``holder``, when
    known): queued again; retries untouched."""
    progress = record.get("progress") or {}
    why = preempted_why(by, progress.get("done", 0), progress.get("total", 0), holder)
    return Requeue(why, _next(record, "preempted", why.reason, preemptions=(record.get("preemptions") or 0) + 1))


def preempted_why(by: str, done: int, total: int, holder: contract.Holder | None = None) -> contract.Why:
    """Why a preempted run waits, until it starts again: the job it was stopped for holds it."""
    return contract.Why(
        contract.PREEMPTED_BY,
        f"stopped after {done} of {total} episodes for a higher lane; resumes when there is room",
        arg=by,
        holders=[holder or contract.Holder("run", by)],
    )


def waiting_after_preemption(preempted: contract.Why | None, now: contract.Why) -> contract.Why:
    """Admission's ``now`` for a run waiting since a preemption: after ``preempted_by:<id>: ...``
    (the code stays the preemption's until it starts again); the job it was stopped for stays
    its first holder (with what admission says it holds, when it does), then admission's."""
    if preempted is None:
        return now
    first = [h for h in now.holders if h.id == preempted.arg][:1] or list(preempted.holders[:1])
    rest = [h for h in now.holders if h.id != preempted.arg]
    return contract.Why(
        preempted.code, f"{preempted.detail}; now {now.reason}", arg=preempted.arg, holders=first + rest, limit=1000
    )


def preemption_of(record: dict[str, Any]) -> contract.Why | None:
    """A recovered queued run's preemption, from its record's data (``why`` and ``history``):
    None unless it waits since it was preempted."""
    why = record.get("why")
    history = record.get("history") or []
    if not why or why.get("code") != contract.PREEMPTED_BY or not history or history[-1]["state"] != "preempted":
        return None
    by = why.get("arg")
    holder = next((h for h in why.get("holders") or () if h.get("id") == by), None)
    total = (record.get("progress") or {}).get("total", 0)
    return preempted_why(
        by,
        history[-1].get("episodes_done", 0),
        total,
        contract.Holder(holder["kind"], by, holder.get("name")) if holder else None,
    )


def restart_plan(record: dict[str, Any], why: str) -> Requeue:
    """``auto_resume``: a run the server's death or shutdown interrupted, queued again."""
    ended = contract.reason(contract.SERVER_RESTART, why)
    return Requeue(
        contract.Why(contract.SERVER_RESTART, f"{why}; resumed (auto_resume)"), _next(record, "aborted", ended)
    )


def _now_iso() -> str:
    return datetime.now(UTC).isoformat(timespec="microseconds")
