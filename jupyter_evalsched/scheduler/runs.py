"""The run table: every run this server knows, and the life of its record.

One module owns a record from creation to its terminal state: transitions, persistence of
``job.json`` (atomically, at every transition), ``_DONE`` after the terminal ``job.json`` (both
made by the writer's thread, in order per run: ``writer.py``), retries of writes a full or
read-only disk refused, and change notification. Admission decides
*when* a run starts; executors decide *how* it runs and *how it ended*; both change records only
through this table.

Listeners: ``subscribe`` gets ``{"type": "run", "run": <record>}`` at every visible change (the
event socket); ``on_end`` gets each run that reached a terminal state (admission frees its
resources, executors wake dependents); ``on_requeue`` each run queued again for another attempt
(resumed, retried, preempted, resumed after a restart). A listener that raises is logged, never
propagated.

A run goes back to ``queued`` only through ``requeue``, and a failure becomes a retry instead of
an end inside ``finish`` (the ``requeue_policy``): a client waiting for the run never sees a
terminal state that is not final.

All of it runs on the event-loop thread (the terminal writes themselves in the writer's).
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import logging
import math
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import InitVar, dataclass, field
from datetime import datetime
from typing import Any

from .. import contract
from ..contract import ACTIVE_STATES, FAILED, SUCCEEDED, TERMINAL_STATES
from ..schemas import RECORD_FIELDS, RunRecord, iso_from_timestamp, utcnow_iso
from ..store import FileStamp, RunFileError, RunStore, StoreError, UnsafeRunFile, disk_trouble, dumps
from .attempts import Requeue
from .writer import RunWriter, TerminalWrite

log = logging.getLogger("jupyter_evalsched")

Listener = Callable[[dict], None]
EndListener = Callable[["Run"], None]
RequeueListener = Callable[["Run", "Requeue"], None]


RequeuePolicy = Callable[["Run", str, "str | None"], "Requeue | None"]


# What of a spec stays in memory: the rest (params, source, env: up to megabytes each) is read
# from spec.json when a run starts. Thousands of finished runs then cost their records alone.
HEAVY_SPEC_FIELDS = ("params", "source", "env")

FRESH_SPECS = 256  # whole specs kept from submission to start (RunTable.remember_spec) ...
FRESH_SPEC_MAX_BYTES = 16 * 1024  # ... of at most this size: 4 MB at most in all

# A running run's ``observed`` peaks reach job.json while it runs (a server killed mid-run keeps
# them for ``auto`` declarations and for the recovered record), at most once per interval per
# run, and only for a rise worth a write: a new GPU, or a peak up by the larger of the two below.
OBSERVED_WRITE_INTERVAL_S = 5.0
OBSERVED_WRITE_MIN_MB = 64
OBSERVED_WRITE_MIN_FRACTION = 0.05


def _rose(old: int | None, new: int | None) -> bool:
    if new is None:
        return False
    if old is None:
        return True
    return new - old >= max(OBSERVED_WRITE_MIN_MB, old * OBSERVED_WRITE_MIN_FRACTION)


def observed_worth_writing(written: Mapping[str, Any] | None, now: Mapping[str, Any] | None) -> bool:
    """Whether the peaks ``now`` rose enough above those last written to be written again."""
    if not now:
        return False
    written = written or {}
    old_vram, new_vram = written.get("peak_vram_mb") or {}, now.get("peak_vram_mb") or {}
    if any(_rose(old_vram.get(device), mb) for device, mb in new_vram.items()):
        return True
    return _rose(written.get("peak_rss_mb"), now.get("peak_rss_mb"))


def slim_spec(spec: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in spec.items() if k not in HEAVY_SPEC_FIELDS}


@dataclass(frozen=True, slots=True)
class RunScheduling:
    """What a run asks of the host, typed, built once from its validated spec (defaults:
    ``contract.SCHEDULING_DEFAULTS``). Admission, the ledger and enforcement read this; the
    record carries the same figures for readers of ``job.json`` and the API."""

    marginal_vram_mb: int
    gpus: int
    exclusive_gpu: bool
    priority: str
    cpus: int
    memory_mb: int | None
    preemptible: bool

    @classmethod
    def of(cls, spec: Mapping[str, Any]) -> RunScheduling:
        sched = contract.scheduling_of(spec)
        return cls(
            marginal_vram_mb=sched["marginal_vram_mb"],
            gpus=sched["gpus"],
            exclusive_gpu=sched["exclusive_gpu"],
            priority=sched["priority"],
            cpus=sched["cpus"],
            memory_mb=sched["memory_mb"],
            preemptible=sched["preemptible"],
        )

    @property
    def uses_gpu(self) -> bool:
        return contract.uses_gpu(self.marginal_vram_mb, self.exclusive_gpu)


@dataclass(eq=False, slots=True)
class Run:
    """One run: its record (the contract's run record, as sent and as written to ``job.json``),
    the light part of its spec (``slim_spec``), and what the server tracks about it in memory
    only. The whole spec is ``RunTable.full_spec(run)``."""

    record: dict[str, Any]
    spec: dict[str, Any]
    submitted_ts: float
    scheduling: RunScheduling = field(init=False)  # from ``given_scheduling``, else from the spec
    passed_over: int = 0  # times a later job was admitted ahead of it (anti-starvation)
    cancel_requested: bool = False
    cancelled_by: str | None = None  # who asked (contract.CANCELLED_BY), for the reason
    kill_reason: str | None = None  # set when the server stopped the run (over_vram: ...)
    timed_out: bool = False
    warned: set[str] = field(default_factory=set)  # keys of the warnings already recorded
    preempted_by: str | None = None  # the job it is being stopped for (its _STOP is written)
    started_ts: float | None = None  # time.time() of the current attempt's start
    exited_at: str | None = None  # when its process was seen gone (RunTable.exited): its finished_at
    requeued_why: contract.Why | None = None  # preempted_by:<id>: ..., kept ahead of admission's reasons
    done_on_disk: bool = False
    summary_stamp: FileStamp | None = None  # of the summary last applied
    observed_written: dict[str, Any] | None = None  # the ``observed`` last handed to a write
    observed_written_ts: float = 0.0  # time.monotonic() of that write (RunTable.observe)
    given_scheduling: InitVar[RunScheduling | None] = None  # made at submission, for its record

    def __post_init__(self, given_scheduling: RunScheduling | None) -> None:
        self.spec = slim_spec(self.spec)
        self.scheduling = given_scheduling or RunScheduling.of(self.spec)

    @property
    def id(self) -> str:
        return self.record["id"]

    @property
    def state(self) -> str:
        return self.record["state"]

    @property
    def executor(self) -> str:
        return self.record["executor"]

    @property
    def depends_on(self) -> list[str]:
        return self.record["depends_on"]

    @property
    def terminal(self) -> bool:
        return self.record["state"] in TERMINAL_STATES

    @property
    def why_code(self) -> str | None:
        """The code of its reason as data (``why``); None without one."""
        return (self.record["why"] or {}).get("code")

    @property
    def starting(self) -> bool:
        """Admitted (its resources held) and still ``queued``, reason ``starting``: its process
        does not exist yet (``RunTable.started`` makes it ``running``)."""
        return self.record["state"] == contract.QUEUED and self.why_code == contract.STARTING


def new_record(
    run_id: str,
    spec: dict[str, Any],
    *,
    seq: int,
    executor: str,
    run_dir: str,
    idempotency_key: str | None = None,
    marginal_vram_source: str = "declared",
    sweep_id: str | None = None,
    sweep_point: dict[str, Any] | None = None,
    sweep_name: str | None = None,
    scheduling: RunScheduling | None = None,
) -> dict[str, Any]:
    """The record of a run just submitted (``spec`` validated, defaults filled in; its
    ``scheduling`` when made already)."""
    sched = scheduling or RunScheduling.of(spec)
    return RunRecord.model_validate(
        dict(
            id=run_id,
            name=spec["name"],
            state=contract.QUEUED,
            priority=sched.priority,
            submitted_at=utcnow_iso(),
            progress={"done": 0, "total": spec["episodes"]},
            marginal_vram_mb=sched.marginal_vram_mb,
            depends_on=list(spec.get("depends_on") or ()),
            gpus=sched.gpus,
            cpus=sched.cpus,
            exclusive_gpu=sched.exclusive_gpu,
            models=list(spec.get("models") or ()),
            timeout_s=spec.get("timeout_s"),
            executor=executor,
            seq=seq,
            run_dir=run_dir,
            idempotency_key=idempotency_key,
            entrypoint=spec.get("entrypoint"),
            source_digest=source_digest(spec.get("source")),
            marginal_vram_source=marginal_vram_source,
            memory_mb=sched.memory_mb,
            preemptible=sched.preemptible,
            retries=spec.get("retries") or 0,
            detach=bool(spec.get("detach")),
            sweep_id=sweep_id,
            sweep_point=sweep_point,
            sweep_name=sweep_name,
        )
    ).model_dump(mode="json")


def source_digest(source: str | None) -> str | None:
    """What tells two cells' evals apart (both are ``eval.py:episode``)."""
    return None if source is None else hashlib.sha256(source.encode()).hexdigest()


def record_from_disk(raw: dict[str, Any], run_id: str, run_dir: str) -> dict[str, Any]:
    """A ``job.json`` read back, checked field by field (ValueError when it does not hold a run
    record); fields it lacks get their defaults, unknown ones are dropped."""
    from pydantic import ValidationError

    try:
        record = RunRecord.model_validate({**raw, "id": run_id, "run_dir": run_dir}).model_dump(mode="json")
    except ValidationError as exc:
        first = exc.errors(include_url=False, include_input=False)[0]
        where = ".".join(str(p) for p in first["loc"]) or "job.json"
        raise ValueError(f"job.json is not a run record ({where}: {first['msg']})") from None
    return record


@dataclass(frozen=True, slots=True)
class FinalSummary:
    """A run's ``summary.json`` as read once its process ended, in a thread (``read``): the
    verdict on the loop then reads nothing. ``error``: why it cannot be used."""

    value: Any = None
    error: Exception | None = None

    @classmethod
    def read(cls, store: RunStore, run_id: str) -> FinalSummary:
        try:
            return cls(store.summary(run_id, fresh=True))
        except Exception as exc:  # judged where the verdict is made, as a read there would be
            return cls(error=exc)


def runner_verdict(summary: Any) -> tuple[str, str | None] | None:
    """How a run that finalized itself (its ``_DONE`` exists) ended, from its ``summary.json``:
    ``(state, reason)``, or None when the summary does not say (the caller then judges by the
    process's exit). The one place a summary becomes a verdict."""
    if not isinstance(summary, dict):
        return None
    status = summary.get("status")
    if status == SUCCEEDED:
        return SUCCEEDED, None
    if status == FAILED:
        error = summary.get("error")
        err = error if isinstance(error, dict) else {}
        text = f"{err.get('type', 'Error')}: {err.get('message', '')}".strip().rstrip(":")
        return FAILED, contract.reason(contract.EXCEPTION, text)
    return None


def _int(value: Any, default: int = 0) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else default


# The figures of a metric in summary.json, as the runner writes them (MetricAggregator.summary).
METRIC_FIGURES = ("mean", "std", "min", "max")
METRIC_COUNTS = ("count", "skipped")
# The longest ``started_at`` a record takes from a summary (an ISO timestamp is 32 characters).
MAX_TIMESTAMP_CHARS = 64

MetricFigures = dict[str, float | int | None]


def record_metrics(metrics: Any) -> tuple[dict[str, MetricFigures | float | None], int]:
    """What a run's record keeps of a summary's ``metrics`` and how many names it left out: the
    first MAX_METRIC_NAMES names of at most MAX_METRIC_NAME_CHARS characters, each with the
    figures the runner writes (numbers or null; anything else ignored; a value that is not an
    object: a finite number, else null). The eval can rewrite
    summary.json (an ``atexit`` handler, after the runner's final one): whatever it holds, the
    record, and so job.json, stays small enough to be read back."""
    if not isinstance(metrics, dict):
        return {}, 0
    kept: dict[str, MetricFigures | float | None] = {}
    left_out = 0
    for name, value in metrics.items():
        if (
            not isinstance(name, str)
            or len(name) > contract.MAX_METRIC_NAME_CHARS
            or len(kept) >= contract.MAX_METRIC_NAMES
        ):
            left_out += 1
            continue
        if not isinstance(value, dict):  # (a plain number stays one: a summary written by hand)
            kept[name] = _finite_float(value)
            continue
        figures: MetricFigures = {}
        for key in METRIC_FIGURES:
            if key in value:
                figures[key] = _finite_float(value[key])
        for key in METRIC_COUNTS:
            if key in value:
                figures[key] = _count(value[key])
        kept[name] = figures
    return kept, left_out


def _finite_float(value: Any) -> float | None:
    if not isinstance(value, int | float) or isinstance(value, bool):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


def _count(value: Any) -> int | None:
    return value if type(value) is int and 0 <= value < 2**63 else None


def summary_timestamp(value: Any) -> str | None:
    """A summary's ``started_at`` as a record takes it: an ISO timestamp, else None."""
    if not isinstance(value, str) or len(value) > MAX_TIMESTAMP_CHARS:
        return None
    try:
        datetime.fromisoformat(value)
    except ValueError:
        return None
    return value


class RunTable:
    def __init__(self, store: RunStore, writer: RunWriter | None = None) -> None:
        self.store = store
        # Terminal job.json/_DONE writes go to the writer's thread (none: written at once).
        self.writer = writer
        self._runs: dict[str, Run] = {}  # every known run, in submission order
        self._active: dict[str, Run] = {}  # the queued and running ones
        self._seq = 0
        self._listeners: list[Listener] = []
        self._end_listeners: list[EndListener] = []
        self._requeue_listeners: list[RequeueListener] = []
        self._exit_listeners: list[EndListener] = []
        self.requeue_policy: RequeuePolicy | None = None  # a failure retried instead of ended
        self._unwritten: set[str] = set()  # runs whose job.json or _DONE a write refused
        self._deferred: list[Run] | None = None
        # Terminal records handed to the writer and not applied yet; any later write for one of
        # these runs settles its terminal write first (``_settle``).
        self._pending: dict[str, TerminalWrite] = {}
        # The whole specs of the latest submissions (small ones), as written to spec.json: most
        # runs start soon after they are submitted, and reading the file back is then the one
        # read on the way from admission to the start. Used once, at the first start.
        self._fresh_specs: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self.version = 0  # bumped at every change: caches of views compare it

    # ------------------------------------------------------------------ registry

    def get(self, run_id: str) -> Run | None:
        # Only valid ids are ever in the table: no need to check the id's characters (admission
        # looks up every queued run's dependencies with this, many times a second).
        return self._runs.get(run_id) if isinstance(run_id, str) else None

    def __contains__(self, run_id: object) -> bool:
        return run_id in self._runs

    def __iter__(self) -> Iterator[Run]:
        return iter(list(self._runs.values()))

    def __len__(self) -> int:
        return len(self._runs)

    def active(self) -> list[Run]:
        """Queued and running runs, in submission order."""
        return list(self._active.values())

    def add(self, run: Run) -> None:
        self._runs[run.id] = run
        if run.state in ACTIVE_STATES:
            self._active[run.id] = run
        self._seq = max(self._seq, _int(run.record.get("seq")))

    def remove(self, run_id: str) -> None:
        """Forget a run (its directory deleted: ``settle`` it before)."""
        self._pending.pop(run_id, None)
        self._runs.pop(run_id, None)
        self._active.pop(run_id, None)
        self._unwritten.discard(run_id)
        self._fresh_specs.pop(run_id, None)
        self.version += 1

    def remember_spec(self, run_id: str, spec: dict[str, Any], size: int) -> None:
        """``spec`` was just written to the run's spec.json (``size`` bytes): its first start
        need not read it back. Kept for the latest ``FRESH_SPECS`` small ones only."""
        if size > FRESH_SPEC_MAX_BYTES:
            return
        self._fresh_specs[run_id] = spec
        while len(self._fresh_specs) > FRESH_SPECS:
            self._fresh_specs.popitem(last=False)

    def full_spec(self, run: Run) -> dict[str, Any]:
        """The run's whole spec, from ``spec.json`` (RunFileError when it cannot be read), or
        as it was written there, for a run submitted lately (see ``remember_spec``)."""
        fresh = self._fresh_specs.pop(run.id, None)
        if fresh is not None:
            return fresh
        spec = self.store.spec(run.id)
        if not isinstance(spec, dict):
            raise RunFileError(f"{contract.SPEC_FILE} is missing or not a JSON object")
        return spec

    def next_seq(self) -> int:
        """The next submission number: runs and leases share it (FIFO within a lane is by it)."""
        self._seq += 1
        return self._seq

    def note_seq(self, seq: int) -> None:
        """A number already taken (by a lease found at start)."""
        self._seq = max(self._seq, seq)

    def counts(self) -> dict[str, int]:
        out = {"queued": 0, "running": 0, "total": len(self._runs)}
        for run in self._active.values():
            out[run.state] += 1
        return out

    # ------------------------------------------------------------------ listeners

    def subscribe(self, listener: Listener) -> None:
        self._listeners.append(listener)

    def unsubscribe(self, listener: Listener) -> None:
        if listener in self._listeners:
            self._listeners.remove(listener)

    def on_end(self, listener: EndListener) -> None:
        self._end_listeners.append(listener)

    def on_requeue(self, listener: RequeueListener) -> None:
        self._requeue_listeners.append(listener)

    def on_exit(self, listener: EndListener) -> None:
        self._exit_listeners.append(listener)

    def exited(self, run: Run) -> None:
        """The running ``run``'s process is gone, or said it is done and is leaving (a warm run on
        the CPU alone), before its verdict is known (an executor calls this, then ``finish`` or
        ``requeue`` once the process is gone): what it held on this host is free now, so
        admission need not wait for its files to be read. Its ``finished_at`` is this moment:
        before the start of a run admitted in its place. Once per attempt: the exit after the
        word changes nothing here."""
        if run.exited_at is not None:
            return
        run.exited_at = utcnow_iso()
        for listener in list(self._exit_listeners):
            try:
                listener(run)
            except Exception:
                log.exception("evalsched: exit listener failed for run %s", run.id)

    def changed(self, run: Run) -> None:
        """Tell listeners that the run's record changed."""
        self.version += 1
        self.emit({"type": "run", "run": run.record})

    def emit(self, event: dict[str, Any]) -> None:
        for listener in list(self._listeners):
            try:
                listener(event)
            except Exception:
                log.exception("evalsched: event listener failed")

    # ------------------------------------------------------------------ transitions

    def update(self, run: Run, *, save: bool = True, notify: bool = True, **fields: Any) -> None:
        """Change record fields; write ``job.json`` (``save``) and tell listeners (``notify``).
        ``why`` (a ``contract.Why`` or None) sets the ``reason`` with it; a ``reason`` given alone
        clears ``why`` (a pending reason is set with its why, never as a string alone)."""
        if "why" in fields:
            why = fields["why"]
            fields["reason"], fields["why"] = (None, None) if why is None else (why.reason, why.as_dict())
        elif "reason" in fields:
            fields["why"] = None
        unknown = fields.keys() - RECORD_FIELDS
        if unknown:
            raise KeyError(f"not run record fields: {sorted(unknown)}")
        if fields.get("state") in TERMINAL_STATES:
            raise ValueError("terminal states are reached through finish()")
        run.record.update(fields)
        if save:
            self.save(run)
        if notify:
            self.changed(run)

    def started(self, run: Run, at: float | None = None, **fields: Any) -> None:
        """The run's process exists (``fields``: its pid and how it started): ``running`` from
        now on, written to ``job.json`` before any listener is told. Until then a run stays
        ``queued`` (``starting``), so that no client sees ``running`` without a process on disk,
        and a server killed before this write finds the run queued, as its clients last saw it.
        ``at`` (wall clock): when the process became the run, where it said so itself (a warm
        start's spare stamps its hand-over); the record's ``started_at`` is that moment, not when
        its answer reached this loop (never later than now)."""
        now = time.time()
        stamp = utcnow_iso() if at is None or not at < now else iso_from_timestamp(at)
        self.update(run, state=contract.RUNNING, reason=None, started_at=stamp, **fields)

    def set_reason(self, run: Run, why: contract.Why | None) -> bool:
        """Why a run waits (its ``reason`` and ``why``, from one fact): news to the widget and
        the panel, not worth a write. True when it changed (listeners were told)."""
        data = contract.why_dict(why)
        if run.record["why"] == data and run.record["reason"] == (why.reason if why else None):
            return False
        run.record["reason"] = why.reason if why else None
        run.record["why"] = data
        self.changed(run)
        return True

    def set_exit_code(self, run: Run, code: int | None) -> None:
        """The exit status of the run's process, as the executor saw it; written with the verdict."""
        run.record["exit_code"] = code

    def set_slurm_state(self, run: Run, state: str) -> bool:
        """The job's state as ``squeue`` says it; True when it moved. Written at the next transition."""
        moved = run.record["slurm_state"] != state
        run.record["slurm_state"] = state
        return moved

    def note_warning(self, run: Run, warning: str) -> None:
        """A warning known before the run starts (``memory_limit_not_enforced``): into the record
        without an event, and once per run whatever its attempts (its code is the key)."""
        code = contract.reason_code(warning)
        if any(contract.reason_code(w) == code for w in run.record["warnings"]):
            return
        run.record["warnings"] = [*run.record["warnings"], warning]

    def refresh_progress(self, run: Run) -> bool:
        """Apply the run's ``summary.json`` to its record if the file changed; True when the
        progress or metrics changed (listeners were told)."""
        stamp = self.store.summary_stamp(run.id)
        if stamp is None or stamp == run.summary_stamp:
            return False
        run.summary_stamp = stamp
        try:
            summary = self.store.summary(run.id)
        except RunFileError:
            return False  # the verdict at the end says what is wrong with it
        if self.apply_summary(run, summary):
            self.changed(run)
            return True
        return False

    def apply_summary(self, run: Run, summary: Any) -> bool:
        """Progress and metrics from a summary into the record (no notification); True if changed."""
        if not isinstance(summary, dict):
            return False
        rec = run.record
        progress = {
            "done": _int(summary.get("episodes_done")),
            "total": _int(summary.get("episodes_total"), rec["progress"]["total"]),
        }
        # (the runner caps and drops too; whatever else wrote summary.json, the record does)
        metrics, left_out = record_metrics(summary.get("metrics"))
        dropped = max(_int(summary.get("metrics_dropped")), 0) + left_out
        if dropped > 0:
            self.note_warning(
                run,
                contract.reason(
                    contract.METRICS_CAPPED,
                    f"{dropped} metric names the episodes returned were dropped (not aggregated, not "
                    f"written): those beyond the first {contract.MAX_METRIC_NAMES}, or longer than "
                    f"{contract.MAX_METRIC_NAME_CHARS} characters",
                ),
            )
        if progress == rec["progress"] and metrics == rec["metrics"]:
            return False
        rec["progress"] = progress
        rec["metrics"] = metrics
        return True

    def observe(
        self,
        run: Run,
        vram_mb: dict[int, int],
        rss_mb: int | None,
        source: str | None = None,
        notify: bool = True,
        persist: bool = True,
    ) -> bool:
        """Fold what the run uses now into its ``observed`` peaks; True (and listeners told, unless
        not ``notify``) when a peak rose. A running run's rise is written to ``job.json`` by the
        writer's thread (``_persist_observed``: bounded), the rest by the next transition."""
        old = run.record.get("observed")
        peaks = dict((old or {}).get("peak_vram_mb") or {})
        for device, mb in vram_mb.items():
            if mb > peaks.get(str(device), -1):
                peaks[str(device)] = int(mb)
        peak_rss = (old or {}).get("peak_rss_mb")
        if rss_mb is not None and (peak_rss is None or rss_mb > peak_rss):
            peak_rss = int(rss_mb)
        new = {
            "peak_vram_mb": dict(sorted(peaks.items(), key=lambda kv: int(kv[0]))),
            "peak_rss_mb": peak_rss,
            "source": source or (old or {}).get("source") or "nvml",
        }
        if new == old:
            self._persist_observed(run)  # (a rise held back by the interval, written now)
            return False
        run.record["observed"] = new
        if persist:  # (not: a write of the whole record follows at once, its terminal one)
            self._persist_observed(run)
        if notify:
            self.changed(run)
        return True

    def _persist_observed(self, run: Run) -> None:
        """The running record, with its new peaks, queued to the writer (at once without one),
        at most every ``OBSERVED_WRITE_INTERVAL_S`` and for a rise worth it. It is queued as the
        run's pending write: a later write for the run (a transition, its terminal record, a
        deletion) settles it first, so a stale running record never lands after a newer one."""
        if run.state != contract.RUNNING or run.id in self._pending:
            return  # (a write still waits: the next observation tries again)
        observed = run.record.get("observed")
        now = time.monotonic()
        if now - run.observed_written_ts < OBSERVED_WRITE_INTERVAL_S:
            return
        if not observed_worth_writing(run.observed_written, observed):
            return
        try:
            data = dumps(run.record)
        except Exception:  # a record that cannot be serialized: its next save says so
            return
        run.observed_written, run.observed_written_ts = observed, now
        write = TerminalWrite(
            run.id, data, False, functools.partial(self._terminal_written, run, True), replaceable=True
        )
        self._pending[run.id] = write
        if self.writer is not None:
            self.writer.terminal([write])
        else:
            write.make(self.store)
            write.complete()

    def add_warning(self, run: Run, key: str, warning: str) -> bool:
        """A problem seen while it runs (``over_vram: ...``), recorded once per ``key`` (a code
        and a GPU, say); listeners get the run and a ``{"type": "warning"}`` event. True if new."""
        if key in run.warned:
            return False
        run.warned.add(key)
        run.record["warnings"] = [*run.record["warnings"], warning]
        self.changed(run)
        self.emit({"type": "warning", "run_id": run.id, "code": contract.reason_code(warning), "message": warning})
        return True

    def finish(self, run: Run, state: str, reason: str | None, *, done_on_disk: bool = False) -> None:
        """Record a terminal state and tell the listeners and the end listeners; ``job.json``
        then ``_DONE`` (unless the run already wrote it) are written by the writer's thread
        (``written`` waits for them)."""
        if state not in TERMINAL_STATES:
            raise ValueError(f"{state!r} is not a terminal state")
        if run.terminal:
            return  # the first verdict stands
        if state == FAILED and self.requeue_policy is not None:
            plan = self.requeue_policy(run, state, reason)
            if plan is not None and self.requeue(run, plan, quiet=True):
                return
        run.record.update(state=state, reason=reason, why=None, finished_at=run.exited_at or utcnow_iso())
        run.exited_at = None
        # A run whose files were refused has no usable _DONE of its own: the server writes one.
        run.done_on_disk = done_on_disk and contract.reason_code(reason) != contract.RUN_FILE
        self._active.pop(run.id, None)
        if self._deferred is not None:
            self._deferred.append(run)
        else:
            self._write_terminals([run])
        self.changed(run)
        for listener in list(self._end_listeners):
            try:
                listener(run)
            except Exception:
                log.exception("evalsched: end listener failed for run %s", run.id)

    def requeue(self, run: Run, plan: Requeue, *, quiet: bool = False) -> bool:
        """Queue the run again for its next attempt, from ``running`` (retry, preemption, restart)
        or from a terminal state (resume). ``_DONE`` goes first, then ``job.json`` says queued: a
        reader of the directory never sees a terminal record without ``_DONE``, and the record in
        memory (what the API answers) changes only once both are on disk. False (the run is left
        as it was) when ``_DONE`` cannot be removed; StoreError from a resume (``quiet`` False),
        which also leaves the run as it was when its queued record cannot be written (its
        ``_DONE`` put back): a terminal record on disk must keep its ``_DONE``."""
        self._settle(run.id)  # its terminal record first, or it would land after "queued"
        try:
            self.store.unmark_done(run.id)
            self.store.clear_stop(run.id)
        except OSError as exc:
            if quiet:
                log.error("evalsched: run %s cannot be queued again (its _DONE stays): %s", run.id, exc)
                return False
            raise StoreError(f"cannot queue run {run.id} again: {exc.strerror or exc}") from exc
        queued = dict(
            state=contract.QUEUED,
            reason=plan.reason,
            why=contract.why_dict(plan.why),
            pid=None,
            pid_create_time=None,
            exit_code=None,
            finished_at=None,
            devices=[],
            slurm_job_id=None,
            slurm_state=None,
            **plan.fields,
        )
        if not quiet:
            # A resume: its record is terminal on disk, and the API answers "queued" only once
            # the disk says so too (a quiet requeue's record is retried later, from memory).
            try:
                self.store.write_job(run.id, {**run.record, **queued})
            except (StoreError, OSError) as exc:
                self._restore_done(run.id)
                why = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
                raise StoreError(f"cannot queue run {run.id} again: {why}") from exc
        run.record.update(queued)
        run.done_on_disk = False
        run.cancel_requested = run.timed_out = False
        # (A later cancel of this attempt names its own asker.)
        run.kill_reason = run.preempted_by = run.started_ts = run.exited_at = run.cancelled_by = None
        run.summary_stamp = None
        self._active[run.id] = run
        self._unwritten.discard(run.id)
        if quiet:
            self.save(run)
        else:
            run.observed_written = run.record.get("observed")
        self.changed(run)
        for listener in list(self._requeue_listeners):
            try:
                listener(run, plan)
            except Exception:
                log.exception("evalsched: requeue listener failed for run %s", run.id)
        return True

    def _restore_done(self, run_id: str) -> None:
        try:
            self.store.mark_done(run_id)
        except OSError as exc:  # (written at the next start: a terminal record found without it)
            log.error(
                "evalsched: run %s: its _DONE, removed for a resume that failed, cannot be put back: %s", run_id, exc
            )

    def conclude(
        self, run: Run, exit_code: int | None = None, summary: FinalSummary | None = None
    ) -> tuple[str, str | None] | None:
        """The verdict of a run that finalized itself (its ``_DONE`` exists and its summary says
        how it ended), else None: the caller judges by how the process ended. A summary that
        cannot be read is a failure whose reason says what is wrong with it; a ``_DONE`` or
        summary that is not a regular file fails the run ``run_file``. Never raises: whatever
        goes wrong judging one run fails that run. ``summary``: read already, after the exit."""
        try:
            return self._conclude(run, exit_code, summary)
        except UnsafeRunFile as exc:
            return FAILED, contract.reason(contract.RUN_FILE, f"{exc}; the server does not open it")
        except Exception as exc:
            log.exception("evalsched: cannot judge run %s", run.id)
            return FAILED, contract.reason(
                contract.EXCEPTION, f"the server could not judge the run: {type(exc).__name__}: {exc}"
            )

    def _conclude(self, run: Run, exit_code: int | None, final: FinalSummary | None) -> tuple[str, str | None] | None:
        rid = run.id
        done = self.store.done_marked(rid)
        try:
            if final is None:
                summary = self.store.summary(rid, fresh=True)  # the last version, whatever its stamp
            elif final.error is not None:
                raise final.error
            else:
                summary = final.value
        except UnsafeRunFile:
            raise
        except RunFileError as exc:
            if not done:
                return None
            code = "unknown" if exit_code is None else exit_code
            return FAILED, contract.reason(
                contract.EXIT_CODE, f"the run finalized but its result cannot be used: {exc}", arg=code
            )
        self.apply_summary(run, summary)
        if run.record.get("started_at") is None and isinstance(summary, dict):
            # A short run can start and end between two looks: its own summary knows when.
            run.record["started_at"] = summary_timestamp(summary.get("started_at"))
        if not done:
            return None
        return runner_verdict(summary)

    @contextmanager
    def deferring_writes(self) -> Iterator[None]:
        """Hold terminal writes until the block ends, then hand them to the writer together (one
        batch: a decision that fails thousands of dependents queues them at once). Should the
        server die before they are written, recovery still finds the run's own ``_DONE``, marks
        it aborted, or (a dependency's failure) decides it again."""
        if self._deferred is not None:
            yield
            return
        self._deferred = []
        try:
            yield
        finally:
            pending, self._deferred = self._deferred, None
            self._write_terminals(pending)

    def _write_terminals(self, runs: list[Run], quiet: bool = False) -> None:
        """Each run's terminal ``job.json`` (its JSON made now), then its ``_DONE``, queued to
        the writer in this order (written here when there is none)."""
        writes: list[TerminalWrite] = []
        for run in runs:
            self._settle(run.id, superseded=True)  # (an earlier one for the run, still waiting, goes first)
            try:
                data = dumps(run.record)
            except Exception:  # a record that cannot be serialized: that run's problem
                self._unwritten.add(run.id)
                if not quiet:
                    log.exception("evalsched: cannot write job.json of %s", run.id)
                continue
            write = TerminalWrite(
                run.id, data, not run.done_on_disk, functools.partial(self._terminal_written, run, quiet)
            )
            self._pending[run.id] = write
            writes.append(write)
        if not writes:
            return
        if self.writer is not None:
            self.writer.terminal(writes)
        else:
            for write in writes:
                write.make(self.store)
                write.complete()

    def _terminal_written(self, run: Run, quiet: bool, write: TerminalWrite) -> None:
        """On the loop, once the writer made ``write``: what failed is retried by the
        reconciliation (``retry_unwritten``)."""
        if self._pending.get(run.id) is write:
            del self._pending[run.id]
        if self._runs.get(run.id) is not run:
            return  # deleted meanwhile
        error = write.job_error or write.done_error
        if error is not None:
            self._unwritten.add(run.id)  # (retried quietly: the record in memory is right meanwhile)
            if not quiet:
                log.error(
                    "evalsched: cannot write %s of %s: %s",
                    "job.json" if write.job_error is not None else "_DONE",
                    run.id,
                    error,
                    exc_info=None if disk_trouble(error) else error,
                )
            return
        if write.mark_done:
            run.done_on_disk = True
        self._unwritten.discard(run.id)

    def _settle(self, run_id: str, superseded: bool = False) -> None:
        """The run's terminal write, if one waits, made and applied now: before any other write
        for that run. ``superseded``: the caller writes the whole record next, so a running
        record still queued (its observed peaks, no ``_DONE``) is dropped from the writer's queue
        rather than written here, on the loop (what it says is in the next write)."""
        write = self._pending.pop(run_id, None)
        if write is None:
            return
        if self.writer is not None:
            if superseded and self.writer.withdraw(write):
                write.complete()
                return
            self.writer.settle(write)
        else:
            write.make(self.store)
            write.complete()

    def settle(self, run_id: str) -> None:
        """:meth:`_settle`, for a write of the run's directory made elsewhere (its deletion)."""
        self._settle(run_id)

    async def written(self, run_id: str) -> None:
        """Once the run's terminal record is on disk (or its write failed: the reconciliation
        retries it): an API call that ended a run answers after this."""
        write = self._pending.get(run_id)
        if write is not None:
            await write.wait(asyncio.get_running_loop())

    async def all_written(self) -> None:
        """Once every terminal write waiting now is made (recovery's, before the server says it
        has started)."""
        loop = asyncio.get_running_loop()
        waits = [write.wait(loop) for write in list(self._pending.values())]
        if waits:
            await asyncio.gather(*waits)

    def flush_writes(self) -> None:
        """Every terminal write still waiting, made now (shutdown)."""
        for run_id in list(self._pending):
            self._settle(run_id)

    @property
    def writes_waiting(self) -> int:
        return len(self._pending)

    # ------------------------------------------------------------------ persistence

    def save(self, run: Run, quiet: bool = False) -> bool:
        """Write ``job.json``. A refused write keeps the state right in memory; the reconciliation retries
        it (``retry_unwritten``)."""
        self._settle(run.id, superseded=True)
        return self._save(run, quiet)

    def _save(self, run: Run, quiet: bool = False) -> bool:
        try:
            self.store.write_job(run.id, run.record)
        except (StoreError, OSError) as exc:
            self._unwritten.add(run.id)
            if not quiet:
                log.error("evalsched: cannot write job.json of %s: %s", run.id, exc)
            return False
        except Exception:  # a record that cannot be serialized: that run's problem, not the caller's
            self._unwritten.add(run.id)
            if not quiet:
                log.exception("evalsched: cannot write job.json of %s", run.id)
            return False
        self._unwritten.discard(run.id)
        run.observed_written = run.record.get("observed")
        return True

    def ensure_done(self, run: Run) -> None:
        """A terminal run found without ``_DONE`` (the server died between the two writes)."""
        self._write_terminals([run], quiet=True)

    @property
    def has_unwritten(self) -> bool:
        return bool(self._unwritten)

    def retry_unwritten(self) -> None:
        """Write what a full or read-only disk refused, once it takes writes again."""
        for run_id in list(self._unwritten):
            run = self._runs.get(run_id)
            if run is None or not self.store.run_dir(run_id).is_dir():
                self._unwritten.discard(run_id)  # deleted, or its directory is gone
            elif run.terminal:
                if run_id not in self._pending:
                    self._write_terminals([run], quiet=True)
            else:
                self.save(run, quiet=True)


class RunNames:
    """The names of runs, looked up as dependencies are (a Mapping's ``get``): the policy names
    the dependencies a run waits on."""

    __slots__ = ("_table",)

    def __init__(self, table: RunTable) -> None:
        self._table = table

    def get(self, run_id: str, /) -> str | None:
        run = self._table.get(run_id)
        return run.record["name"] if run is not None else None


def parse_timestamp(text: Any) -> float:
    """Seconds since the epoch of a record's ISO timestamp; now when it cannot be read."""
    try:
        return datetime.fromisoformat(text).timestamp()
    except (TypeError, ValueError):
        return time.time()
