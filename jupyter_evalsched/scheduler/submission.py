"""Submission: a validated spec becomes a queued run (or a sweep's runs).

The checks that need the host (``validate_for_host``), ``auto`` VRAM resolved from observed runs,
idempotent submissions (``Idempotency-Key``: a retry answers with the first run), the run's
directory written off the loop, and the hand-over to admission (a ledger run) or to its executor
(a placing one). Sweeps: every point checked, then one submission per point.

All of it runs on the event-loop thread (the directory is written by the writer's thread).
"""

from __future__ import annotations

import ast
import asyncio
import dataclasses
import functools
import json
import logging
import math
import os
import sys
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from .. import contract
from ..runner.entrypoint import resolve_entrypoint_file
from ..schemas import EvalSpec, check_json_finite, check_params_size, check_spec_size, json_chars
from ..store import RunFileError, RunStore, StoreError, new_run_id
from . import policy, sweeps
from .admission import Admission
from .config import SchedulerConfig
from .errors import Busy, SpecRejected, StateConflict, Unavailable, UnknownRun, store_failure
from .executors import Executor
from .ledger import Capacity
from .runs import Run, RunScheduling, RunTable, new_record, source_digest
from .shared import SharedModels
from .writer import RunWriter

log = logging.getLogger("jupyter_evalsched")
MAX_CANCELLED_SWEEPS_KEPT = 4096  # (a sweep's submission takes seconds: its cancel is among the newest)


@dataclasses.dataclass
class _NewRun:
    """A submission's run before it is on disk: what its directory holds and what the table
    and admission need once it is."""

    record: dict[str, Any]
    spec: dict[str, Any]
    scheduling: RunScheduling
    executor: Executor
    idempotency_key: str | None
    files: dict[str, bytes]

    @property
    def run_id(self) -> str:
        return str(self.record["id"])


# A sweep's point in a chunk: its spec, the id of the run it replays (or None), and the run being
# made for it with its directory's write (or None).
_ChunkPoint = tuple[dict[str, Any], str | None, tuple[_NewRun, "asyncio.Future[None]"] | None]


@dataclasses.dataclass(frozen=True)
class SweepKey:
    """The ``idempotency_key`` a sweep's run records: ``<key>#<i> <n>:<digest>``, its
    submission's key, its point's index, the sweep's number of points and their digest
    (``sweeps.points_digest``: what tells a retry from another sweep under the same key, also
    after a restart). No Idempotency-Key holds a space. Records written before the digest was
    kept hold ``<key>#<i>`` alone."""

    key: str
    index: int
    points: int | None = None
    digest: str | None = None

    @classmethod
    def parse(cls, text: str) -> SweepKey | None:
        head, _, tail = text.partition(" ")
        key, sep, index = head.rpartition("#")
        if not sep or not key or not (index.isascii() and index.isdigit()):
            return None
        if not tail:
            return cls(key, int(index))
        points, _, digest = tail.partition(":")
        if not (points.isascii() and points.isdigit()) or not digest or " " in digest:
            return None
        return cls(key, int(index), int(points), digest)

    def text(self) -> str:
        if self.points is None:
            return f"{self.key}#{self.index}"
        return f"{self.key}#{self.index} {self.points}:{self.digest}"


class IdempotencyKeys:
    """Idempotency-Key -> the run it made, in two namespaces that never meet: plain runs' keys
    (POST /runs), and sweeps' keys, each with its points' runs. A sweep's run is told apart by
    its ``sweep_id`` (its recorded key, ``SweepKey``, can look like a plain one: ``k#0``), so that
    a plain key is never a sweep's point nor the reverse, also as rebuilt from the records at a
    start (``key_index[recorded key] = run id``, the run in the table already)."""

    def __init__(self, table: RunTable) -> None:
        self.table = table
        self.runs: dict[str, str] = {}
        self.sweeps: dict[str, dict[int, str]] = {}  # a sweep's key -> {point index: run id}

    def get(self, key: str) -> str | None:
        """The run a plain submission made under ``key``."""
        return self.runs.get(key)

    def sweep(self, key: str) -> dict[int, str]:
        """The runs a sweep submitted under ``key`` has, by the index of their point."""
        return self.sweeps.get(key, {})

    def __setitem__(self, recorded: str, run_id: str) -> None:
        run = self.table.get(run_id)
        point = SweepKey.parse(recorded) if run is not None and run.record.get("sweep_id") else None
        if point is None:
            self.runs[recorded] = run_id
        else:
            self.sweeps.setdefault(point.key, {})[point.index] = run_id

    def pop(self, recorded: str, default: str | None = None) -> str | None:
        """Forget the run recorded with ``recorded`` once it left the table (deleted): of the
        plain run and the sweep's run the key may name, the one that is gone."""
        run_id = self.runs.get(recorded)
        if run_id is not None and run_id not in self.table:
            return self.runs.pop(recorded)
        point = SweepKey.parse(recorded)
        points = self.sweeps.get(point.key) if point is not None else None
        if point is not None and points is not None:
            run_id = points.get(point.index)
            if run_id is not None and run_id not in self.table:
                del points[point.index]
                if not points:
                    del self.sweeps[point.key]
                return run_id
        return default


class Submissions:
    def __init__(
        self,
        config: SchedulerConfig,
        store: RunStore,
        table: RunTable,
        executors: Mapping[str, Executor],
        models: SharedModels,
        admission: Admission,
        empty_capacity: Callable[[], Capacity],
        require_loop: Callable[[], asyncio.AbstractEventLoop],
        writer: RunWriter,
    ) -> None:
        self.config = config
        self.store = store
        self.table = table
        self.executors = executors
        self.models = models
        self.admission = admission
        self.empty_capacity = empty_capacity  # the host with nothing running: what never fits
        self.require_loop = require_loop
        self.writer = writer  # run directories are written by its thread, concurrent ones together
        self.by_key = IdempotencyKeys(table)  # Idempotency-Key -> the run(s) it created
        self._keys_in_flight: dict[str, asyncio.Future[None]] = {}
        self._sweep_keys_in_flight: dict[str, asyncio.Future[None]] = {}
        # Sweep submissions under way, each done when it returns: a stop waits for them.
        self._sweeps_under_way: set[asyncio.Future[None]] = set()
        # Sweeps cancelled (the newest, in order) -> the Idempotency-Key of their submission (or
        # None): one still being submitted makes no more runs, nor does a retry under its key.
        self._cancelled_sweeps: dict[str, str | None] = {}
        self._cancels_being_written: dict[str, str | None] = {}  # (cancelled_with -> sweep_cancelled)
        self._creating: set[str] = set()
        # With a host ledger: why a GPU request can never be granted under this user's quota
        # (vram_mb, gpus, exclusive, kind) -> "" when it could (host_tenant.HostTenant.never).
        self.host_never: Callable[[int, int, bool, str], str] | None = None

    # ----------------------------------------------------------------- checks

    def _model_needs(self, names: list[str]) -> tuple[policy.ModelNeed, ...]:
        """The VRAM of the named shared models on their GPUs: admitted with the run when not loaded."""
        memory = {m.name: m for m in self.models.memory()}
        return tuple(
            policy.ModelNeed(m.name, m.gpu, m.vram_mb) for name in names if (m := memory.get(name)) is not None
        )

    def validate_for_host(self, spec: EvalSpec) -> None:
        """Checks that need the host: never-fits, unknown models and dependencies, the cwd and
        the entrypoint's file."""
        errors: list[dict[str, Any]] = []
        sched = spec.scheduling
        name = spec.executor or self.config.default_executor
        executor = self.executors.get(name)
        if executor is None:
            errors.append(
                {
                    "loc": ["executor"],
                    "msg": "SLURM is not enabled on this server (EvalSchedApp.slurm_enabled)"
                    if name == "slurm"
                    else f"the {name} executor is not enabled on this server",
                    "type": "unsupported",
                }
            )
        elif not executor.uses_ledger and spec.models:
            errors.append(
                {
                    "loc": ["models"],
                    "msg": "shared models serve local runs only: a SLURM run on another node "
                    "cannot reach this host's model host; load the model in the eval instead",
                    "type": "unsupported",
                }
            )
        if spec.detach and spec.models:
            errors.append(
                {
                    "loc": ["detach"],
                    "msg": "a detached run cannot use shared models: their host dies with the server, the run would not",
                    "type": "unsupported",
                }
            )
        if executor is not None and executor.uses_ledger:
            probe_job = policy.QueuedJob(
                id="-",
                seq=0,
                priority=sched.priority,
                # "auto" is resolved before (resolve_auto_vram); never-fits is checked on the figure.
                marginal_vram_mb=sched.marginal_vram_mb if isinstance(sched.marginal_vram_mb, int) else 0,
                gpus=sched.gpus,
                exclusive=sched.exclusive_gpu,
                cpus=sched.cpus,
                models=self._model_needs(spec.models),
            )
            why = policy.never_fits(probe_job, self.empty_capacity())
            if not why and self.host_never is not None and probe_job.uses_gpu:
                host_why = self.host_never(probe_job.marginal_vram_mb, probe_job.gpus, probe_job.exclusive, "run")
                why = ("marginal_vram_mb", host_why) if host_why else None
            if why:
                errors.append(
                    {
                        "loc": ["models"] if why[0] == "models" else ["scheduling", why[0]],
                        "msg": f"can never fit on this host: {why[1]}",
                        "type": "never_fits",
                    }
                )
        known_models = set(self.models.names())
        for model in spec.models:
            if model not in known_models:
                known = ", ".join(sorted(known_models)) or "none are configured"
                errors.append(
                    {
                        "loc": ["models"],
                        "msg": f"unknown shared model {model!r} (known: {known})",
                        "type": "unknown_model",
                    }
                )
        for dep in spec.depends_on:
            if dep not in self.table:
                msg = f"unknown run id {dep!r}: a run this server knows (`jupyter evalsched list`), not deleted"
                errors.append({"loc": ["depends_on"], "msg": msg, "type": "unknown_dependency"})
        cwd = self.resolve_cwd(spec.cwd)
        if not os.path.isdir(cwd):
            msg = f"{cwd!r} is not a directory on the server's host: the run starts there; give one that exists"
            errors.append({"loc": ["cwd"], "msg": msg, "type": "bad_cwd"})
        elif spec.entrypoint:
            problem = _entrypoint_problem(spec, cwd)
            if problem:
                errors.append({"loc": ["entrypoint"], "msg": problem[1], "type": problem[0]})
        # Compiled by this server's Python only where runs use it: another interpreter (SLURM's
        # `python`) may take syntax this one does not, or refuse what this one takes.
        same_python = executor is not None and executor.interpreter == sys.executable
        if spec.source is not None and same_python and (syntax := source_syntax_error(spec.source)):
            errors.append({"loc": ["source"], "msg": syntax, "type": "syntax_error"})
        if errors:
            raise SpecRejected("; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in errors), errors)

    def resolve_cwd(self, cwd: str | None) -> str:
        if not cwd:
            return self.config.default_cwd
        return os.path.normpath(os.path.join(self.config.default_cwd, os.path.expanduser(cwd)))

    def resolve_auto_vram(self, spec: EvalSpec) -> tuple[EvalSpec, str]:
        """``marginal_vram_mb: "auto"`` -> the highest observed peak of the earlier succeeded runs of
        the same eval that ran on a GPU, plus ``auto_margin``; SpecRejected without such a run.
        Returns the spec with the figure, and where it came from (the record's
        ``marginal_vram_source``)."""
        if spec.scheduling.marginal_vram_mb != "auto":
            return spec, "declared"
        name = spec.executor or self.config.default_executor
        executor = self.executors.get(name)
        loc = ["scheduling", "marginal_vram_mb"]
        if executor is not None and not executor.uses_ledger:
            msg = f"'auto' needs observed usage, which {name} runs do not have: declare a number"
            raise SpecRejected(f"scheduling.marginal_vram_mb: {msg}", [{"loc": loc, "msg": msg, "type": "auto"}])
        key = (spec.entrypoint, source_digest(spec.source))
        best: tuple[int, Run] | None = None
        for run in self.table:
            rec = run.record
            observed = rec.get("observed")
            if rec["state"] != contract.SUCCEEDED or not rec["devices"] or not isinstance(observed, dict):
                continue
            if (rec.get("entrypoint"), rec.get("source_digest")) != key:
                continue
            peak = max((int(v) for v in (observed.get("peak_vram_mb") or {}).values()), default=0)
            # A run seen using no VRAM at all says nothing of what the eval needs on a GPU (and a
            # figure of 0 would make the next run a CPU-only one).
            if peak > 0 and (best is None or peak > best[0]):
                best = (peak, run)
        if best is None:
            what = "this cell's eval" if spec.source is not None else repr(spec.entrypoint)
            msg = (
                f"'auto' needs an earlier succeeded run of {what} on a GPU whose VRAM was observed, and there is "
                'none: declare a number (e.g. "marginal_vram_mb": 8000, or --vram 8000)'
            )
            raise SpecRejected(f"scheduling.marginal_vram_mb: {msg}", [{"loc": loc, "msg": msg, "type": "auto"}])
        peak, run = best
        figure = math.ceil(peak * (1 + self.config.auto_margin))
        source = f"auto: {figure} MB = the {peak} MB peak of run {run.id} + {self.config.auto_margin:.0%}"
        scheduling = spec.scheduling.model_copy(update={"marginal_vram_mb": figure})
        return spec.model_copy(update={"scheduling": scheduling}), source

    # ----------------------------------------------------------------- submission

    async def submit(self, spec: EvalSpec, idempotency_key: str | None = None) -> tuple[dict[str, Any], bool]:
        """Validate, write the run directory, queue. Returns once ``job.json`` is on disk, with
        the record and whether it is new: a key seen before answers with the first run (the
        client retried a submission whose answer it lost), a key reused for another spec is a
        StateConflict."""
        if idempotency_key is None:
            return await self._submit(spec, None), True
        # The same submission, retried while the first is being written: it waits. Again after
        # each wait: another that waited too may have taken the key meanwhile (the first failed).
        while (pending := self._keys_in_flight.get(idempotency_key)) is not None:
            await asyncio.shield(pending)
        known = self.by_key.get(idempotency_key)
        if known is not None:
            return self._replay(known, spec), False
        future = self.require_loop().create_future()
        self._keys_in_flight[idempotency_key] = future
        try:
            return await self._submit(spec, idempotency_key), True
        finally:
            del self._keys_in_flight[idempotency_key]
            future.set_result(None)

    def _replay(self, run_id: str, spec: EvalSpec, normalized: dict[str, Any] | None = None) -> dict[str, Any]:
        """``normalized``: the spec as ``_normalized`` makes it, made already (a sweep's point)."""
        run = self.table.get(run_id)
        if run is None:
            raise StateConflict(f"the Idempotency-Key was used for run {run_id}, which has been deleted")
        try:
            first = self.table.full_spec(run)
        except RunFileError as exc:
            raise StateConflict(
                f"the Idempotency-Key was used for run {run_id}, whose spec cannot be read: {exc}"
            ) from None
        again = dict(normalized) if normalized is not None else self._normalized(spec)
        again["scheduling"] = dict(again["scheduling"])  # (a sweep's points share the base's)
        if spec.scheduling.marginal_vram_mb == "auto":  # the figure it was resolved to stands
            again["scheduling"]["marginal_vram_mb"] = first.get("scheduling", {}).get("marginal_vram_mb")
        if spec.cwd is None:  # "the server's root": a retry may reach another server after a failover
            first.pop("cwd", None)
            again.pop("cwd", None)
        if first != again:
            raise StateConflict(f"the Idempotency-Key was already used for run {run_id}, with another spec")
        return run.record

    def _normalized(self, spec: EvalSpec) -> dict[str, Any]:
        spec_dict = spec.model_dump(mode="json")
        spec_dict["cwd"] = self.resolve_cwd(spec.cwd)
        spec_dict["executor"] = spec.executor or self.config.default_executor
        return spec_dict

    async def _submit(
        self,
        spec: EvalSpec,
        idempotency_key: str | None,
        sweep: tuple[str, dict[str, Any], str | None] | None = None,
        vram_source: str | None = None,
        spec_dict: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """``vram_source`` given: the spec was checked already (a sweep's runs share one check);
        ``spec_dict``: a sweep's point, ``spec`` being its base."""
        new = self._new_run(spec, idempotency_key, sweep, vram_source, spec_dict)
        await self._written(new, self._write(new))
        return await self._register(new)

    def _new_run(
        self,
        spec: EvalSpec,
        idempotency_key: str | None,
        sweep: tuple[str, dict[str, Any], str | None] | None,
        vram_source: str | None,
        spec_dict: dict[str, Any] | None,
    ) -> _NewRun:
        """A submission's run and its files, not yet on disk: its id (reserved until it is written
        or given up) and its ``seq`` are taken here."""
        if vram_source is None:
            spec, vram_source = self.resolve_auto_vram(spec)
            self.validate_for_host(spec)
        run_id = new_run_id()
        while run_id in self.table or run_id in self._creating:
            run_id = new_run_id()
        executor = self.executors[spec.executor or self.config.default_executor]
        if spec_dict is None:
            spec_dict = self._normalized(spec)
        scheduling = RunScheduling.of(spec_dict)  # the run's, once: its record and admission read it
        record = new_record(
            run_id,
            spec_dict,
            seq=self.table.next_seq(),
            executor=executor.name,
            run_dir=str(self.store.run_dir(run_id)),
            idempotency_key=idempotency_key,
            marginal_vram_source=vram_source,
            sweep_id=sweep[0] if sweep else None,
            sweep_point=sweep[1] if sweep else None,
            sweep_name=sweep[2] if sweep else None,
            scheduling=scheduling,
        )
        # Only what the contract needs at submission: each file is an inode, a large part of a
        # submission's cost on a busy disk. No shared_urls.json for a run without models (no
        # file: no models, to the runner), and no logs: the start creates them as it opens them
        # for the run (0.89x the server's CPU a submission on this host's ext4; a turnaround unchanged).
        files = {contract.SPEC_FILE: dumps(spec_dict), contract.JOB_FILE: dumps(record)}
        if spec.source is not None:
            files[contract.EVAL_SOURCE_FILE] = spec.source.encode()
        self._creating.add(run_id)
        return _NewRun(record, spec_dict, scheduling, executor, idempotency_key, files)

    def _write(self, new: _NewRun) -> asyncio.Future[None]:
        # Creating files can wait for the disk (an fsync, a busy disk), and costs the kernel's time
        # in any case: done by the writer's thread, concurrent submissions in one batch, and the
        # event loop stays free.
        try:
            return self.writer.create(new.run_id, new.files)
        except BaseException:  # (the writer not running wrote on the spot, and failed on a bug)
            self._creating.discard(new.run_id)
            raise

    async def _written(self, new: _NewRun, write: asyncio.Future[None]) -> None:
        """Wait for ``write``, the directory of ``new``; its id is free again once it ends. A
        failure of the disk is a SchedulerError (503; a bug of ours 500)."""
        try:
            await write
        except StoreError as exc:
            raise store_failure(exc) from exc
        finally:
            self._creating.discard(new.run_id)

    async def _register(self, new: _NewRun) -> dict[str, Any]:
        """The run of ``new``, on disk, into the table and to its executor (admission may start it
        right here). Returns its record."""
        run_id, record, spec_dict = new.run_id, new.record, new.spec
        run = Run(record=record, spec=spec_dict, submitted_ts=time.time(), given_scheduling=new.scheduling)
        self.table.add(run)
        self.table.remember_spec(run_id, spec_dict, len(new.files[contract.SPEC_FILE]))
        if new.idempotency_key is not None:
            self.by_key[new.idempotency_key] = run_id
        self.table.changed(run)
        if self.admission.stopping:
            return record  # on disk, queued: the next start runs it
        if not new.executor.uses_ledger:
            new.executor.submit(run)
            return record
        try:
            # (Decided at once when nothing outranks it: its start may begin right here.)
            self.admission.submitted(run)
        except Exception:  # a bug of ours: the run is on disk and stays queued; answered all the same
            log.exception("evalsched: admitting run %s failed", run_id)
        if run.terminal:  # its start failed at once: answered with the record on disk
            await self.table.written(run_id)
        return record

    # ----------------------------------------------------------------- sweeps

    async def submit_sweep(
        self,
        spec: EvalSpec,
        sweep: Any,
        idempotency_key: str | None,
        cancel: Callable[[list[Run]], Awaitable[object]],
    ) -> tuple[dict[str, Any], bool]:
        """One run per point of ``sweep`` (docs/reference.md, "Sweeps"), every one an ordinary
        run with ``sweep_id``. All points are checked before the first run is written. With
        ``idempotency_key``, run i records the key ``<key>#<i>`` with the sweep's points' digest
        (``SweepKey``; a plain run's key never matches it): a retried submission answers with
        the runs already made, and makes the ones an interrupted first try did not; one that
        comes while the first is under way waits for it, then answers with its runs; the key
        with other points (or another spec) is a StateConflict.
        ``MAX_SWEEP_SUBMISSIONS`` are under way at once; one more is Busy (429)."""
        # The key is reserved before the first wait: a second submission with it never starts a
        # sweep of its own while the first is under way.
        key = idempotency_key
        while key is not None and (pending := self._sweep_keys_in_flight.get(key)) is not None:
            await asyncio.shield(pending)
        if len(self._sweeps_under_way) >= sweeps.MAX_SWEEP_SUBMISSIONS:
            raise Busy(
                f"{len(self._sweeps_under_way)} sweep submissions are under way, at most "
                f"{sweeps.MAX_SWEEP_SUBMISSIONS} at once: retry in a moment"
            )
        reserved = None
        if key is not None:
            reserved = self._sweep_keys_in_flight[key] = self.require_loop().create_future()
        under_way = self.require_loop().create_future()
        self._sweeps_under_way.add(under_way)
        try:
            return await self._submit_sweep(spec, sweep, key, cancel)
        finally:
            self._sweeps_under_way.discard(under_way)
            under_way.set_result(None)
            if key is not None and reserved is not None:
                del self._sweep_keys_in_flight[key]
                reserved.set_result(None)

    async def _submit_sweep(
        self,
        spec: EvalSpec,
        sweep: Any,
        idempotency_key: str | None,
        cancel: Callable[[list[Run]], Awaitable[object]],
    ) -> tuple[dict[str, Any], bool]:
        try:
            points = sweeps.expand(sweep)
        except sweeps.SweepError as exc:
            raise SpecRejected(
                f"{'.'.join(map(str, exc.loc))}: {exc.msg}", [{"loc": exc.loc, "msg": exc.msg, "type": "sweep"}]
            ) from None
        spec, vram_source = self.resolve_auto_vram(spec)
        self.validate_for_host(spec)
        # The base is validated once; each point checks only what it changes (its params and
        # name), and shares the rest of the base's spec (its params' values included).
        base = _SweepBase(spec, self._normalized(spec))
        checked = [base.check(point, i) for i, point in enumerate(points)]
        points = [point for point, _ in checked]
        sizes = [size for _, size in checked]
        total = sum(sizes)
        if total > sweeps.MAX_SWEEP_JSON_CHARS:
            msg = (
                f"the sweep's {len(points)} runs take {total} characters of spec as JSON; at most "
                f"{sweeps.MAX_SWEEP_JSON_CHARS} per sweep (fewer points, or smaller params or source)"
            )
            raise SpecRejected(f"sweep: {msg}", [{"loc": ["sweep"], "msg": msg, "type": "sweep_too_large"}])
        keys: list[str | None] = [None] * len(points)
        made_before: dict[int, str] = {}  # what earlier submissions under the key made
        sweep_id = None
        if idempotency_key is not None:
            digest = sweeps.points_digest(points)
            keys = [SweepKey(idempotency_key, i, len(points), digest).text() for i in range(len(points))]
            made_before = dict(self.by_key.sweep(idempotency_key))
            sweep_id = self._earlier_sweep(made_before, len(points), digest)
            if sweep_id is None:
                self._raise_if_cancelled_and_deleted(idempotency_key)
        sweep_id = sweep_id or sweeps.new_sweep_id()
        records: list[dict[str, Any]] = []
        made: list[str] = []
        try:
            # A chunk of points at a time (sweeps.chunks): their directories are written together,
            # as one batch of the writer's thread (a point at a time, each waited for, made a sweep
            # no faster than as many single submissions); the loop serves others between chunks.
            for chunk_range in sweeps.chunks(sizes, sweeps.SWEEP_CHUNK_POINTS, sweeps.SWEEP_CHUNK_CHARS):
                # (what to replay is decided with no wait before the chunk's writes begin)
                replays = [made_before.get(i) for i in chunk_range]
                if not all(replays):  # (a retry that only answers runs made already is not refused)
                    self._raise_if_cancelled(sweep_id, max(len(records), len(made_before)), len(points))
                    self._raise_if_stopping(sweep_id, len(made), len(points))
                chunk: list[_ChunkPoint] = []
                try:
                    for i, replay in zip(chunk_range, replays, strict=True):
                        one = base.spec_of(points[i])
                        new = None
                        if replay is None:  # (seq taken in the order of the points)
                            pending = self._new_run(spec, keys[i], (sweep_id, points[i], spec.name), vram_source, one)
                            new = (pending, self._write(pending))
                        chunk.append((one, replay, new))
                except BaseException:  # (a bug of ours) what this chunk wrote is not left to run
                    self._abandon([new for _, _, new in chunk if new is not None])
                    raise
                await self._settle_chunk(chunk, spec, sweep_id, len(points), records, made)
                await asyncio.sleep(0)  # (a chunk of replays awaits nothing: others are served between chunks)
        except Exception:
            # No half-made sweep is left to run: the runs this call made are cancelled (their
            # directories stay, and say so). A stop waits for this (sweeps_ended).
            await cancel([run for run in map(self.table.get, made) if run is not None])
            raise
        return {"id": sweep_id, "runs": records}, bool(made)

    async def _settle_chunk(
        self,
        chunk: list[_ChunkPoint],
        spec: EvalSpec,
        sweep_id: str,
        points: int,
        records: list[dict[str, Any]],
        made: list[str],
    ) -> None:
        """A chunk of a sweep's points, whose directories are being written (one batch), settled
        in the order of the points: each run into the table (and to admission) once its
        directory is on disk, its record appended to ``records`` and its id to ``made``; a
        replay's record appended as it is. At the first point that fails (its directory refused,
        a replay that conflicts) or once the sweep is cancelled, the rest of the chunk is given
        up: its directories are removed before this returns, nobody having seen them, so that a
        retry makes those points again, after the failed one, in order. Raises that failure."""
        failure: Exception | None = None
        given_up: list[tuple[_NewRun, asyncio.Future[None]]] = []
        try:
            for one, replay, new in chunk:
                if failure is not None:
                    if new is not None:
                        given_up.append(new)
                    continue
                try:
                    if new is None:
                        records.append(self._replay(str(replay), spec, one))
                        continue
                    # (shielded: cancelled meanwhile, the server stopping, this leaves the write's
                    # outcome to _abandon, which removes what was written, not to nobody)
                    await self._written(new[0], asyncio.shield(new[1]))
                    self._raise_if_cancelled(sweep_id, len(records), points)
                except Exception as exc:
                    failure = exc
                    if new is not None and not new[1].cancelled() and new[1].exception() is None:
                        given_up.append(new)  # (written, then the sweep was cancelled)
                    continue
                try:
                    record = await self._register(new[0])
                except BaseException:  # (a bug of ours) a run in the table is the sweep's to cancel
                    if new[0].run_id in self.table:
                        made.append(new[0].run_id)
                    raise
                records.append(record)
                made.append(record["id"])
        except BaseException:  # (cancelled: the server stops; or a bug of ours) nothing left half-made
            self._abandon([new for _, _, new in chunk if new is not None and new[0].run_id not in self.table])
            raise
        if given_up:
            await self._give_up(given_up)
        if failure is not None:
            raise failure

    async def _give_up(self, given_up: list[tuple[_NewRun, asyncio.Future[None]]]) -> None:
        """The directories of a sweep's points given up before they were runs: each waited for,
        then those written removed (``RunStore.withdraw``, in a thread: file-system work); their
        ids are free again once they are gone."""
        written = []
        for new, write in given_up:
            try:
                await asyncio.shield(write)
            except Exception:  # refused: nothing of it on disk
                self._creating.discard(new.run_id)
                continue
            written.append(new.run_id)
        if written:
            await self.require_loop().run_in_executor(None, self.store.withdraw, written)
            self._creating.difference_update(written)

    def _abandon(self, news: list[tuple[_NewRun, asyncio.Future[None]]]) -> None:
        """:meth:`_give_up` for a chunk whose sweep's coroutine cannot wait any more (cancelled,
        or a bug of ours): each directory removed once written, in a thread."""
        for new, write in news:
            write.add_done_callback(functools.partial(self._withdraw_once_written, new.run_id))

    def _withdraw_once_written(self, run_id: str, write: asyncio.Future[None]) -> None:
        if write.cancelled() or write.exception() is not None:
            self._creating.discard(run_id)
            return  # nothing of it was left on disk
        try:
            removal = self.require_loop().run_in_executor(None, self.store.withdraw, [run_id])
        except RuntimeError:  # (the loop is closed: the server stops) removed here, then
            self.store.withdraw([run_id])
            self._creating.discard(run_id)
            return
        removal.add_done_callback(lambda _: self._creating.discard(run_id))

    def _earlier_sweep(self, made_before: dict[int, str], points: int, digest: str) -> str | None:
        """The sweep that earlier submissions under this key made (``made_before``, its runs by
        point), if any; StateConflict where it has other points than these (``points`` of
        ``digest``): a run past them, or another digest."""
        runs = [run for _, run_id in sorted(made_before.items()) if (run := self.table.get(run_id)) is not None]
        if not runs:
            return None
        sweep_id = str(runs[0].record["sweep_id"])
        recorded = [SweepKey.parse(str(run.record["idempotency_key"])) for run in runs]
        if max(made_before) >= points or any(
            k is not None and k.digest is not None and (k.points, k.digest) != (points, digest) for k in recorded
        ):
            raise StateConflict(
                f"the Idempotency-Key was already used for sweep {sweep_id}, with other points: "
                "a retry of a submission sends the same body"
            )
        return sweep_id

    def _raise_if_cancelled(self, sweep_id: str, made: int, points: int) -> None:
        if sweep_id in self._cancelled_sweeps:
            raise StateConflict(
                f"sweep {sweep_id} was cancelled while it was submitted: the {made} of its {points} runs "
                "made by then are cancelled, and no more are made"
            )

    def _raise_if_cancelled_and_deleted(self, idempotency_key: str) -> None:
        """A key whose sweep has no run left: where that sweep was cancelled, its retry makes none
        of it again (its user cancelled it); otherwise the key went with its runs, as a plain
        run's key goes with its run, and the retry makes a new sweep. A cancel whose list is
        still being written counts (its runs may all be deleted meanwhile)."""
        cancelled = [*self._cancelled_sweeps.items(), *self._cancels_being_written.items()]
        for sweep_id, key in reversed(cancelled):
            if key == idempotency_key:
                raise StateConflict(
                    f"the Idempotency-Key was used for sweep {sweep_id}, which was cancelled and whose runs have "
                    "all been deleted: a retry makes none of them again (submit the sweep under another key, "
                    "or with none, to run it anew)"
                )

    def _raise_if_stopping(self, sweep_id: str, made: int, points: int) -> None:
        """No chunk is begun once the scheduler stops (a shutdown, a step-down, its runs directory
        moved), and the sweep's runs made are cancelled, as for any failure: the stop waits for
        that (``sweeps_ended``), so that it is written before the writer closes and the runs
        directory's lock is released, and no half-made sweep is left for the next start."""
        if self.admission.stopping:
            raise Unavailable(
                f"the scheduler stopped while sweep {sweep_id} was submitted: the {made} runs of its {points} "
                "that this submission made are cancelled, and no more are made"
            )

    async def sweeps_ended(self, timeout: float) -> bool:
        """Wait, ``timeout`` seconds at most, for the sweep submissions under way to end (once
        admission has stopped, each ends at its next chunk); False if some did not."""
        if not self._sweeps_under_way:
            return True
        _, pending = await asyncio.wait(set(self._sweeps_under_way), timeout=timeout)
        return not pending

    def cancelled_with(self, sweep_id: str) -> list[tuple[str, str | None]]:
        """The sweeps cancelled, newest last, each with its submission's Idempotency-Key, once
        ``sweep_id`` is: what the caller keeps on disk (``RunStore.write_cancelled_sweeps``)
        before :meth:`sweep_cancelled`, so that a retry after a restart makes no more of its
        runs either, nor a new sweep once its runs are all deleted."""
        key = self._sweep_key(sweep_id) or self._cancelled_sweeps.get(sweep_id)
        self._cancels_being_written[sweep_id] = key  # (its runs may all be deleted meanwhile)
        kept = [item for item in self._cancelled_sweeps.items() if item[0] != sweep_id] + [(sweep_id, key)]
        return kept[-MAX_CANCELLED_SWEEPS_KEPT:]

    def cancel_not_written(self, sweep_id: str) -> None:
        """The list :meth:`cancelled_with` gave was not written (the disk refused it): the sweep
        is not cancelled."""
        self._cancels_being_written.pop(sweep_id, None)

    def sweep_cancelled(self, sweep_id: str) -> None:
        """The sweep is cancelled (its runs are cancelled right after): a submission of it still
        under way makes no more of its runs, nor does a retry of that submission, under its
        Idempotency-Key."""
        key = self._cancels_being_written.pop(sweep_id, None) or self._sweep_key(sweep_id)
        key = key or self._cancelled_sweeps.get(sweep_id)
        self._cancelled_sweeps.pop(sweep_id, None)  # (the newest again)
        self._note_cancelled(sweep_id, key)

    def recovered_cancelled_sweeps(self, cancelled: list[tuple[str, str | None]]) -> None:
        """At a start: the sweeps cancelled before it, with their keys
        (``RunStore.read_cancelled_sweeps``)."""
        for sweep_id, key in cancelled:
            self._note_cancelled(sweep_id, key)

    def _note_cancelled(self, sweep_id: str, key: str | None) -> None:
        self._cancelled_sweeps[sweep_id] = key
        while len(self._cancelled_sweeps) > MAX_CANCELLED_SWEEPS_KEPT:
            del self._cancelled_sweeps[next(iter(self._cancelled_sweeps))]

    def _sweep_key(self, sweep_id: str) -> str | None:
        """The Idempotency-Key the sweep was submitted under, as its runs in the table record it."""
        for run in self.table:
            if run.record.get("sweep_id") == sweep_id and run.record.get("idempotency_key"):
                point = SweepKey.parse(str(run.record["idempotency_key"]))
                return point.key if point is not None else None
        return None

    def sweep_runs(self, sweep_id: str) -> list[Run]:
        runs = sorted((r for r in self.table if r.record.get("sweep_id") == sweep_id), key=lambda r: r.record["seq"])
        if not runs:
            raise UnknownRun(f"no sweep with id {sweep_id!r}")
        return runs

    def sweep_view(self, sweep_id: str) -> dict[str, Any]:
        runs = self.sweep_runs(sweep_id)
        return {"id": sweep_id, "runs": [r.record for r in runs], "counts": sweeps.counts([r.state for r in runs])}

    def list_sweeps(self, limit: int = 100) -> list[dict[str, Any]]:
        """The sweeps, newest first: id, the name of their eval, counts, submitted_at."""
        groups: dict[str, list[Run]] = {}
        for run in self.table:
            sweep_id = run.record.get("sweep_id")
            if sweep_id:
                groups.setdefault(sweep_id, []).append(run)
        out = []
        for sweep_id, runs in groups.items():
            runs.sort(key=lambda r: r.record["seq"])
            out.append(
                {
                    "id": sweep_id,
                    "name": runs[0].record.get("name"),
                    "runs": len(runs),
                    "counts": sweeps.counts([r.state for r in runs]),
                    "submitted_at": runs[0].record.get("submitted_at"),
                    "seq": runs[0].record["seq"],
                }
            )
        out.sort(key=lambda s: s["seq"], reverse=True)
        return out[:limit]


class _SweepBase:
    """A sweep's base spec, validated, and each point's spec made from it: ``EvalSpec``'s checks
    of what a point changes (its params and its name), by the same rules, without validating
    (or copying) the rest again."""

    def __init__(self, spec: EvalSpec, normalized: dict[str, Any]) -> None:
        self.spec = spec
        self.normalized = normalized
        self.params: dict[str, Any] = normalized["params"]
        measured = spec.model_dump(mode="json", exclude={"params"})  # as EvalSpec._bounded measures
        self.name_chars = json_chars(measured.get("name"))
        self.rest_chars = json_chars(measured) + len(',"params":')  # name included
        self.params_chars = json_chars(self.params)
        self._item_chars: dict[str, int] = {}  # a base parameter's '"name":value', once needed

    def _item(self, name: str) -> int:
        chars = self._item_chars.get(name)
        if chars is None:
            chars = self._item_chars[name] = json_chars(name) + 1 + json_chars(self.params[name])
        return chars

    def check(self, point: dict[str, Any], index: int) -> tuple[dict[str, Any], int]:
        """The point (as plain JSON values) and the size of its spec as JSON; SpecRejected names
        the point. Costs what the point holds, not what the base does."""
        name = sweeps.run_name(self.spec.name, point)
        try:
            point = json.loads(json.dumps(point))  # plain JSON values, as a submitted spec's
            for key, value in point.items():
                check_json_finite(value, f"params.{key}", 1)
            # The merged params' size from the base's, without making or dumping them: '{',
            # the items joined by ',', '}'.
            items = self.params_chars - 2 - max(len(self.params) - 1, 0)
            count = len(self.params)
            for key, value in point.items():
                if key in self.params:
                    items -= self._item(key)
                else:
                    count += 1
                items += json_chars(key) + 1 + json_chars(value)
            params_chars = 2 + items + max(count - 1, 0)
            check_params_size(params_chars)
            # (the name needs no check of its own: the base's passed EvalSpec's, and the point's
            # part is printable, sweeps.point_label)
            size = self.rest_chars - self.name_chars + json_chars(name) + params_chars
            check_spec_size(size)
        except ValueError as exc:
            loc: list[str | int] = ["sweep", index]
            msg = f"point {index} ({sweeps.point_label(point)}) makes an invalid spec: {exc}"
            raise SpecRejected(msg, [{"loc": loc, "msg": msg, "type": "value_error"}]) from None
        return point, size

    def spec_of(self, point: dict[str, Any]) -> dict[str, Any]:
        """The point's spec, as ``Submissions._normalized`` makes a spec (the point ``check``ed)."""
        return {
            **self.normalized,
            "params": {**self.params, **point},
            "name": sweeps.run_name(self.spec.name, point),
        }


# The longest source compiled at submission. The compile runs on the event loop (it holds the
# GIL: a thread would stall the loop as much): 16 KiB, several times a notebook cell, takes about
# 6 ms; 1 MB took 0.55 s. A longer one is the run's to compile.
MAX_CHECKED_SOURCE_CHARS = 16 * 1024
# The compiler's time grows with the square of how deeply lambdas nest (each a code object in the
# one around it): 16 KiB of `lambda: lambda: ...`, 2,000 deep, took 0.64 s of the loop; 100 deep,
# 2 ms (a def nests at most 100 deep, by indentation; a comprehension 200, by brackets). A source
# whose lambdas nest deeper is left to the run to compile, as a longer one is (Python accepts it:
# refusing it would refuse working code). Fewer `lambda`s than this in the text cannot nest deeper.
MAX_NESTED_LAMBDAS = 100
# Nested scopes (lambdas, comprehensions, defs, classes) cost the compiler more: each name used in
# one is passed on by every scope around it (a free variable of each), each level a few µs. 16 KiB
# of generator expressions 190 deep that use 1,300 names of the function around them took 1 s of
# the loop (no lambda in it). Measured as a name's (or a scope's) levels of nesting below its
# function's, summed: a source that costs more is parsed only, and left to the run to compile.
# Notebook code stays far below it (a method's comprehension costs 1 a name); the limit costs at
# most some 50 ms.
MAX_NESTED_SCOPE_COST = 10_000
# Parsed first only when longer: the parse and walk cost 3 to 4 times the compile (a typical
# 16 KiB source: 7.6 ms against 2.1 ms), and the worst a source this short can cost the compiler
# is some 50 ms (a quarter of the length, a sixteenth of the time).
MIN_PARSED_SOURCE_CHARS = 4096


def source_syntax_error(source: str) -> str | None:
    """Where and why a spec's inline ``source`` does not compile (as the run would find out once
    admitted, maybe hours later), or None. Compiled only, never run; by this server's Python, and
    only up to ``MAX_CHECKED_SOURCE_CHARS`` (None for a longer one). Lambdas nested more than
    ``MAX_NESTED_LAMBDAS`` deep, or scopes nested at a cost over ``MAX_NESTED_SCOPE_COST``, are
    not compiled (None, unless the parse fails)."""
    if len(source) > MAX_CHECKED_SOURCE_CHARS:
        return None
    try:
        if len(source) > MIN_PARSED_SOURCE_CHARS or source.count("lambda") > MAX_NESTED_LAMBDAS:
            tree = compile(source, contract.EVAL_SOURCE_FILE, "exec", ast.PyCF_ONLY_AST, dont_inherit=True)
            if _nesting_too_costly(tree):
                return None
        compile(source, contract.EVAL_SOURCE_FILE, "exec", dont_inherit=True)
    except SyntaxError as e:  # IndentationError included; a NUL byte has no line
        where = f" line {e.lineno}" if e.lineno else ""
        return f"{contract.EVAL_SOURCE_FILE}{where}: {e.msg}"
    except ValueError as e:  # a lone surrogate (not UTF-8), or a NUL byte before Python 3.12
        return f"{contract.EVAL_SOURCE_FILE}: {e}"
    except (RecursionError, MemoryError):  # the compiler's limits: `1+1+...`, `- - - 1` thousands deep
        return f"{contract.EVAL_SOURCE_FILE}: too deeply nested to compile"
    return None


# What opens a scope of its own (a comprehension too, before Python 3.12).
_SCOPES = (
    ast.Lambda,
    ast.FunctionDef,
    ast.AsyncFunctionDef,
    ast.ClassDef,
    ast.GeneratorExp,
    ast.ListComp,
    ast.SetComp,
    ast.DictComp,
)


def _nesting_too_costly(tree: ast.AST) -> bool:
    """Whether lambdas nest more than ``MAX_NESTED_LAMBDAS`` deep, or the nested scopes' cost
    (each name's and each scope's depth below the outermost function, summed) is over
    ``MAX_NESTED_SCOPE_COST``. A walk with a stack of its own: the tree may be thousands deep."""
    cost = 0
    stack: list[tuple[ast.AST, int, int]] = [(tree, -1, 0)]  # (node, scopes around it less one, lambdas)
    while stack:
        node, depth, lambdas = stack.pop()
        if isinstance(node, _SCOPES):
            depth += 1
            cost += depth
            if isinstance(node, ast.Lambda):
                lambdas += 1
                if lambdas > MAX_NESTED_LAMBDAS:
                    return True
        elif isinstance(node, ast.Name):
            cost += max(depth, 0)
        if cost > MAX_NESTED_SCOPE_COST:
            return True
        stack.extend((child, depth, lambdas) for child in ast.iter_child_nodes(node))
    return False


def _entrypoint_problem(spec: EvalSpec, cwd: str) -> tuple[str, str] | None:
    """(error type, message) when the runner could not find the entrypoint's file."""
    entrypoint = spec.entrypoint or ""
    if spec.source is not None:
        if not entrypoint.startswith(contract.EVAL_SOURCE_FILE + ":"):
            return "value_error", f"with 'source', the entrypoint must be '{contract.EVAL_SOURCE_FILE}:<function>'"
        return None
    path = resolve_entrypoint_file(entrypoint, run_dir=None, cwd=cwd)
    if path is not None and not os.path.isfile(path):
        return "missing_file", f"file {path!r} not found (the entrypoint's file, resolved against cwd {cwd})"
    return None


def dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()
