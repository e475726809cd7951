"""The per-host scheduler: submission, admission against the VRAM ledger, recovery, views.

It decides; it does not own the record's life (the run table does) nor how runs execute (the
executors do). Admission runs on every event that can change the answer (a submission, a run's
end, a cancel) with a periodic sweep as a backstop, and is carried out in the same loop
iteration as a run's exit, before that run's files are written.

All state lives on the event-loop thread; handlers call the methods directly.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import psutil
from pydantic import ValidationError

from .. import contract
from ..contract import ABORTED, CANCELLED, FAILED, QUEUED, RUNNING, TERMINAL_STATES
from ..models import EvalSpec, LeaseRequest, utcnow_iso
from ..runner.entrypoint import resolve_entrypoint_file
from ..store import FoundRun, RunFileError, RunStore, StoreError, new_run_id
from . import attempts, compare, policy, sweeps
from .config import SchedulerConfig
from .errors import SpecRejected, StateConflict, Unavailable, UnknownRun
from .executors import Executor, ExecutorContext, ObservedTarget
from .executors.local import LocalExecutor
from .gpus import GpuProbe, GpuProcess
from .kernels import KernelInfo, OwnKernel, identify
from .leases import Lease, LeaseTable
from .ledger import DeviceBudget, Observation, Unmanaged, account, capacity, device_budgets, ledger_view
from .runs import (
    Listener,
    Requeue,
    Run,
    RunNames,
    RunTable,
    new_record,
    parse_timestamp,
    record_from_disk,
    slim_spec,
    source_digest,
)
from .shared import NoSharedModels, SharedModels

log = logging.getLogger("jupyter_evalsched")

__all__ = ["Scheduler"]


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        probe: GpuProbe,
        models: SharedModels | None = None,
        executors: list[Executor] | None = None,
    ) -> None:
        self.config = config
        self.probe = probe
        self.models: SharedModels = models if models is not None else NoSharedModels()
        self.store = RunStore(config.runs_dir, fsync=config.fsync)
        self.table = RunTable(self.store)
        self.leases = LeaseTable(self.store, emit=self.table.emit)
        # This server's kernels (their pids and notebooks), for naming GPU processes; set by the app.
        self.own_kernels: Callable[[], Awaitable[list[OwnKernel]]] | None = None
        self._kernels: dict[int, KernelInfo] = {}
        self.executors: dict[str, Executor] = {e.name: e for e in (executors or [LocalExecutor(self.models)])}
        # Admission's own view: the ledger runs waiting for resources, and those holding them.
        self._queued: dict[str, Run] = {}
        # Queued runs held by a dependency still queued or running: (why, dependencies). They
        # are kept out of admission's decisions and looked at again when a dependency changes.
        self._blocked: dict[str, tuple[contract.Why, tuple[str, ...]]] = {}
        self._waiting_on: dict[str, set[str]] = {}  # dependency id -> blocked runs waiting on it
        self._eligible: dict[str, Run] = {}  # the queued runs not blocked: what a decision looks at
        self._running: dict[str, Run] = {}
        self._released: set[str] = set()  # runs whose process exited, their end not recorded yet
        self._loop: asyncio.AbstractEventLoop | None = None
        self.context: ExecutorContext | None = None  # what executors get; set by start()
        self._io = ThreadPoolExecutor(max_workers=8, thread_name_prefix="evalsched-io")
        self._tasks: list[asyncio.Future] = []
        self._unmanaged: dict[int, Unmanaged] = {}
        self._budgets: list[DeviceBudget] = []
        self._queue_cache: tuple[int, bytes, float] | None = None
        self._observed_version = 0  # bumped when the probe's figures change what the ledger shows
        self._last_processes: list[GpuProcess] = []
        self._last_sample: HostSample | None = None
        self._observation: Observation | None = None
        self._started = False
        self._stopping = False
        self._creating: set[str] = set()
        self._admit_scheduled = False
        self._admitting = False
        self._decide_again = False
        # Set after a full decision that changed nothing: a new job may then be decided alone.
        self._settled = False
        self._reservation: policy.Reservation | None = None
        self._head_lane = len(policy.LANES)
        self.primary_info: dict | None = None  # which server schedules for this host (set by the app)
        self.broken: dict[str, str] = {}  # run directories recovery could not read: id -> why
        self._by_key: dict[str, str] = {}  # Idempotency-Key -> the run it created
        self._keys_in_flight: dict[str, asyncio.Future[None]] = {}
        # Retries waiting out their back-off: queued, not yet admissible (run id -> its timer).
        self._backoff: dict[str, asyncio.TimerHandle] = {}
        self.table.requeue_policy = self._retry_policy
        self.table.on_exit(self._on_run_exited)
        self.table.on_end(self._on_run_ended)
        self.table.on_requeue(self._on_run_requeued)
        self.table.subscribe(self._run_changed)
        self.leases.on_end(self._on_lease_ended)

    # ----------------------------------------------------------------- life cycle

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self.store.ensure()
        self._budgets = self._compute_budgets()
        self.context = ExecutorContext(
            table=self.table, store=self.store, config=self.config, loop=self._loop, io=self._io
        )
        for executor in self.executors.values():
            executor.bind(self.context)
        found = await self._loop.run_in_executor(None, self._read_runs_dir)
        self._recover(found)
        for executor in self.executors.values():
            executor.recovered()
        self.leases.bind(self._loop)
        self.leases.recover(await self._loop.run_in_executor(None, self.store.read_leases))
        self.table.note_seq(max((lease.record["seq"] for lease in self.leases), default=0))
        self._started = True
        self._tasks = [
            asyncio.ensure_future(self._sweep_forever()),
            asyncio.ensure_future(self._watch_progress_forever()),
        ]
        self._admit()

    async def stop(self) -> None:
        """Shutdown: running runs are killed and end ``aborted`` (rule 4); queued jobs stay queued,
        and so do runs admitted but not started yet. Admission stops first."""
        self._stopping = True
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            try:
                await task
            except (asyncio.CancelledError, Exception):
                pass
        self._tasks = []
        for timer in self._backoff.values():
            timer.cancel()  # they stay queued on disk: the next start admits them
        self._backoff.clear()
        self.leases.stop()
        if self._loop is not None:
            for executor in self.executors.values():
                await executor.stop()
        self.table.flush_writes()  # the terminal records still waiting (a large cascade's)
        self._started = False
        self._io.shutdown(wait=True)

    def _compute_budgets(self) -> list[DeviceBudget]:
        return device_budgets(
            self.probe.devices(),
            reserve_mb=self.config.reserve_mb,
            usable_override=self.config.usable_override,
            env_usable_mb=self.config.env_usable_mb,
            baseline_mb=self.models.baseline_mb_by_device(),
        )

    # ----------------------------------------------------------------- recovery (rule 4)

    def _read_runs_dir(self) -> list[FoundRun]:
        return self.store.scan()

    def _recover(self, found: list[FoundRun]) -> None:
        """Rebuild the table from the runs directory. A directory whose ``job.json`` is not a run
        record is left on disk as it is, listed as broken (``GET /evalsched/status``) and can be
        deleted through the API; one whose ``spec.json`` alone is broken keeps its record and, if
        it was queued or running, ends failed with what is wrong."""
        usable: list[tuple[FoundRun, dict[str, Any]]] = []
        for f in found:
            if f.job is None:
                self.broken[f.run_id] = f.job_problem or "job.json is missing"
                continue
            try:
                usable.append((f, record_from_disk(f.job, f.run_id, str(f.path))))
            except ValueError as exc:
                self.broken[f.run_id] = str(exc)
        if self.broken:
            log.warning(
                "evalsched: %d run directories are broken and were left as they are (DELETE them through the "
                "API to remove them): %s",
                len(self.broken),
                "; ".join(f"{k}: {v}" for k, v in sorted(self.broken.items())[:20]),
            )
        usable.sort(key=lambda item: (item[1]["seq"], item[0].run_id))
        for f, record in usable:
            run = Run(record=record, spec=f.spec or {}, submitted_ts=parse_timestamp(record["submitted_at"]))
            run.done_on_disk = f.done
            self.table.add(run)
            if record["idempotency_key"]:
                self._by_key[record["idempotency_key"]] = run.id
            if f.spec is None and not run.terminal:
                why = f"{f.spec_problem}: the run cannot start or be judged"
                self.table.finish(run, FAILED, contract.reason(contract.EXCEPTION, f"RunFileError: {why}"))
                continue
            self._recover_run(run, f.done)
        for queued in list(self._queued.values()):  # now that every run is known
            self._check_dependencies(queued)
        if len(self.table):
            log.info(
                "evalsched: recovered %d runs (%d queued) from %s", len(self.table), len(self._queued), self.store.root
            )

    def _recover_run(self, run: Run, done: bool) -> None:
        state = run.state
        if state in TERMINAL_STATES:
            if not done:
                self.table.ensure_done(run)  # every terminal run directory has _DONE
            return
        if state not in (QUEUED, RUNNING):
            log.warning("evalsched: run %s has unknown state %r; left as it is", run.id, state)
            return
        executor = self.executors.get(run.executor)
        if executor is None:
            why = f"the {run.executor} executor is not enabled on this server any more"
            self.table.finish(run, ABORTED, contract.reason(contract.SERVER_RESTART, why))
        elif executor.uses_ledger and state == QUEUED:
            retry_at = run.record.get("retry_at")
            left = parse_timestamp(retry_at) - time.time() if retry_at else 0.0
            if left > 0 and self._loop is not None:
                self._backoff[run.id] = self._loop.call_later(left, self._retry_due, run.id)
                return
            # What it waited for, from the record's data: a preemption stays ahead of admission's
            # reasons, a restart's reason stays until admission's; anything else is decided again.
            run.requeued_why = attempts.preemption_of(run.record)
            code = (run.record["why"] or {}).get("code")
            if run.requeued_why is None and code != contract.SERVER_RESTART:
                run.record["reason"] = run.record["why"] = None
            self._enqueue(run)
        else:
            if executor.uses_ledger:
                self._running[run.id] = run  # holds its resources until its end is recorded
                run.started_ts = parse_timestamp(run.record.get("started_at"))
            executor.recover(run, done)

    # ----------------------------------------------------------------- submission

    def validate_for_host(self, spec: EvalSpec) -> None:
        """Checks that need the host: never-fits, unknown models and dependencies, the cwd and
        the entrypoint's file."""
        errors: list[dict] = []
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
            )
            why = policy.never_fits(probe_job, capacity(self._budgets, self.config.cpu_slots, {}))
            if why:
                errors.append(
                    {
                        "loc": ["scheduling", why[0]],
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
                errors.append({"loc": ["depends_on"], "msg": f"unknown run id {dep!r}", "type": "unknown_dependency"})
        cwd = self._resolve_cwd(spec.cwd)
        if not os.path.isdir(cwd):
            errors.append({"loc": ["cwd"], "msg": f"{cwd!r} is not a directory", "type": "bad_cwd"})
        elif spec.entrypoint:
            problem = _entrypoint_problem(spec, cwd)
            if problem:
                errors.append({"loc": ["entrypoint"], "msg": problem[1], "type": problem[0]})
        if errors:
            raise SpecRejected("; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in errors), errors)

    def _resolve_cwd(self, cwd: str | None) -> str:
        if not cwd:
            return self.config.default_cwd
        return os.path.normpath(os.path.join(self.config.default_cwd, os.path.expanduser(cwd)))

    async def submit(self, spec: EvalSpec, idempotency_key: str | None = None) -> tuple[dict[str, Any], bool]:
        """Validate, write the run directory, queue. Returns once ``job.json`` is on disk, with
        the record and whether it is new: a key seen before answers with the first run (the
        client retried a submission whose answer it lost), a key reused for another spec is a
        StateConflict."""
        self._require_started()
        if idempotency_key is None:
            return await self._submit(spec, None), True
        pending = self._keys_in_flight.get(idempotency_key)
        if pending is not None:  # the same submission, retried while the first is being written
            await asyncio.shield(pending)
        known = self._by_key.get(idempotency_key)
        if known is not None:
            return self._replay(known, spec), False
        future = self._require_loop().create_future()
        self._keys_in_flight[idempotency_key] = future
        try:
            return await self._submit(spec, idempotency_key), True
        finally:
            del self._keys_in_flight[idempotency_key]
            future.set_result(None)

    def _replay(self, run_id: str, spec: EvalSpec) -> dict[str, Any]:
        run = self.table.get(run_id)
        if run is None:
            raise StateConflict(f"the Idempotency-Key was used for run {run_id}, which has been deleted")
        try:
            first = self.table.full_spec(run)
        except RunFileError as exc:
            raise StateConflict(
                f"the Idempotency-Key was used for run {run_id}, whose spec cannot be read: {exc}"
            ) from None
        again = self._normalized(spec)
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
        spec_dict["cwd"] = self._resolve_cwd(spec.cwd)
        spec_dict["executor"] = spec.executor or self.config.default_executor
        return spec_dict

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

    async def _submit(
        self,
        spec: EvalSpec,
        idempotency_key: str | None,
        sweep: tuple[str, dict[str, Any], str | None] | None = None,
        vram_source: str | None = None,
    ) -> dict[str, Any]:
        """``vram_source`` given: the spec was checked already (a sweep's runs share one check)."""
        if vram_source is None:
            spec, vram_source = self.resolve_auto_vram(spec)
            self.validate_for_host(spec)
        run_id = new_run_id()
        while run_id in self.table or run_id in self._creating:
            run_id = new_run_id()
        executor = self.executors[spec.executor or self.config.default_executor]
        spec_dict = self._normalized(spec)
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
        )
        files = {contract.SPEC_FILE: _dumps(spec_dict), contract.JOB_FILE: _dumps(record)}
        if not spec_dict.get("models"):  # known now: written here, off the loop, not at the start
            files[contract.SHARED_URLS_FILE] = _dumps({"models": {}})
        if spec.source is not None:
            files[contract.EVAL_SOURCE_FILE] = spec.source.encode()
        # The logs exist (empty) from the submission on: the start only opens them, and a new
        # file's inode is not allocated between a run's admission and its start.
        files[contract.STDOUT_FILE] = files[contract.STDERR_FILE] = b""
        # Creating files costs about a millisecond each on these disks, mostly waiting: done in
        # a thread pool, several submissions overlap and the event loop stays free.
        self._creating.add(run_id)
        try:
            await self._require_loop().run_in_executor(self._io, self.store.create, run_id, files)
        except StoreError as exc:
            raise Unavailable(str(exc)) from exc
        finally:
            self._creating.discard(run_id)
        run = Run(record=record, spec=spec_dict, submitted_ts=time.time())
        self.table.add(run)
        self.table.remember_spec(run_id, spec_dict, len(files[contract.SPEC_FILE]))
        if idempotency_key is not None:
            self._by_key[idempotency_key] = run_id
        self.table.changed(run)
        if self._stopping:
            return record  # on disk, queued: the next start runs it
        if not executor.uses_ledger:
            executor.submit(run)
            return record
        self._enqueue(run)
        if self._settled and not self._admit_scheduled and self._can_decide_alone(run):
            self._admit_new(run)
        else:
            self.request_admission()
        return record

    # ----------------------------------------------------------------- admission

    def request_admission(self) -> None:
        """Coalesce admission requests made in one loop iteration into one decision."""
        self._settled = False
        if self._loop is None or self._admit_scheduled:
            return
        self._admit_scheduled = True
        self._loop.call_soon(self._admit)

    def _on_run_exited(self, run: Run) -> None:
        """The run's process is gone: its resources go to the next in line right now, before its
        verdict is read and its files are written (its end follows in this loop iteration)."""
        if self._running.pop(run.id, None) is None:
            return
        self._released.add(run.id)
        if not self._started or self._stopping:
            return
        if self._admitting:
            self._decide_again = True
        else:
            self._settled = False
            self._admit()

    def _on_run_ended(self, run: Run) -> None:
        self._dequeue(run.id)
        held = self._running.pop(run.id, None) is not None
        released = run.id in self._released  # at its exit: admission has seen it gone already
        self._released.discard(run.id)
        if not self._started or self._stopping:
            return
        if self._admitting:
            self._decide_again = True  # a dependency failure inside a decision: decide once more
        elif held:
            # Right here, in the same loop iteration as the end, before its files are written.
            self._settled = False
            self._admit()
        elif not released:
            self.request_admission()

    def _retry_policy(self, run: Run, state: str, reason: str | None) -> Requeue | None:
        """A failure retried instead of ended (``retries``, ``retry_on``): a plain decision on the
        record; the run table carries it out."""
        if self._stopping:
            return None
        return attempts.retry_plan(
            run.record,
            run.spec.get("retry_on") or contract.DEFAULT_RETRY_ON,
            state,
            reason,
            backoff_s=self.config.retry_backoff_s,
            backoff_max_s=self.config.retry_backoff_max_s,
            now=time.time(),
        )

    def _on_run_requeued(self, run: Run, plan: Requeue) -> None:
        """A run queued again (resume, retry, preemption, restart): back to admission, after its
        back-off; what it held is free at once."""
        self._dequeue(run.id)
        self._running.pop(run.id, None)
        self._released.discard(run.id)
        timer = self._backoff.pop(run.id, None)
        if timer is not None:
            timer.cancel()
        executor = self.executors.get(run.executor)
        if executor is None:
            return
        if not executor.uses_ledger:
            if self._started and not self._stopping and self._loop is not None:
                # Handed over again (SLURM), after the retry's back-off.
                self._loop.call_later(plan.delay_s, self._hand_over_again, run.id)
            return
        # Why it is back in the queue stays its reason while it waits (admission's reason follows).
        run.requeued_why = plan.why if plan.why is not None and plan.why.code == contract.PREEMPTED_BY else None
        if plan.delay_s > 0 and self._loop is not None and not self._stopping:
            self._backoff[run.id] = self._loop.call_later(plan.delay_s, self._retry_due, run.id)
        else:
            self._enqueue(run)
        if not self._started or self._stopping:
            return
        if self._admitting:
            self._decide_again = True
        else:
            # Soon, not now: every requeue listener (the executor's clean-up of the attempt that
            # ended) runs first, and the caller finishes with the run before its next attempt.
            self.request_admission()

    def _hand_over_again(self, run_id: str) -> None:
        run = self.table.get(run_id)
        executor = self.executors.get(run.executor) if run is not None else None
        if run is None or executor is None or run.state != QUEUED or self._stopping:
            return  # cancelled meanwhile
        if run.record.get("retry_at"):
            self.table.update(run, save=False, retry_at=None)
        executor.submit(run)

    def _retry_due(self, run_id: str) -> None:
        self._backoff.pop(run_id, None)
        run = self.table.get(run_id)
        if run is None or run.state != QUEUED or self._stopping:
            return
        self.table.update(run, save=False, retry_at=None)
        self._enqueue(run)
        self.request_admission()

    def resume(self, run_id: str) -> dict[str, Any]:
        """Queue a failed, aborted or cancelled run again under the same id: its next attempt
        skips the episodes already in ``episodes.jsonl``."""
        self._require_started()
        run = self.get(run_id)
        if run.state not in contract.RESUMABLE_STATES:
            what = "it is still " + run.state if not run.terminal else "it succeeded"
            raise StateConflict(f"run {run_id} cannot be resumed: {what} (only failed, aborted or cancelled runs can)")
        if run.executor not in self.executors:
            raise StateConflict(f"run {run_id} cannot be resumed: the {run.executor} executor is not enabled here")
        try:
            spec = self.table.full_spec(run)
        except RunFileError as exc:
            raise StateConflict(f"run {run_id} cannot be resumed: its spec cannot be read ({exc})") from None
        # A run found finished at start kept its record alone: its spec is needed again.
        run.spec = slim_spec(spec)
        run.scheduling = contract.scheduling_of(run.spec)
        try:
            self.table.requeue(run, attempts.resume_plan(run.record))
        except StoreError as exc:
            raise Unavailable(str(exc)) from exc
        return run.record

    def _can_decide_alone(self, run: Run) -> bool:
        """A new job can be decided on its own when nothing else changed since the last full
        decision (the waiting jobs still cannot start) and it does not outrank the head of the
        queue (which would move the anti-starvation reservation)."""
        if run.depends_on:
            return all(
                dep.state in (QUEUED, RUNNING, contract.SUCCEEDED)
                for dep in map(self.table.get, run.depends_on)
                if dep is not None
            )
        return policy.LANE_INDEX[run.record["priority"]] >= self._head_lane

    def _on_lease_ended(self, lease: Lease) -> None:
        if not self._started or self._stopping:
            return
        self._account()  # what its process still holds is unmanaged again
        if self._admitting:
            self._decide_again = True
        elif lease.record["devices"]:
            self._settled = False
            self._admit()  # what it held goes to the next in line at once
        else:
            self.request_admission()

    def _admit_new(self, run: Run) -> None:
        """Admission for one newly submitted job: O(running), not O(queue). With 10,000 jobs
        queued, a full decision per submission would make a burst of submissions quadratic."""
        cap = capacity(self._budgets, self.config.cpu_slots, self._unmanaged)
        decision = policy.decide(
            [self._as_queued(run, time.time())],
            self._running_jobs(),
            cap,
            self._dependency_states([run]),
            self.config.policy,
            reservation=self._reservation,
            dependency_names=RunNames(self.table),
        )
        if decision.dependency_failed or decision.starts:
            if decision.starts:
                # Everything already waiting was overtaken by this newcomer.
                for waiting in self._queued.values():
                    if waiting is not run:
                        waiting.passed_over += 1
            self._carry_out(decision)
            return
        for why in decision.why.values():
            self.table.set_reason(run, _waiting_why(run, why))

    def _admit(self) -> None:
        self._admit_scheduled = False
        if self._loop is None or self._admitting or self._stopping:
            return
        self._admitting = True
        try:
            for _ in range(100):  # dependency failures can cascade down a chain
                self._decide_again = False
                if not self._queued and not self.leases.queued():
                    self._settled, self._reservation, self._head_lane = True, None, len(policy.LANES)
                    return
                decision = self._decide()
                self._reservation = decision.reservation()
                # Settled from here on, unless carrying the decision out asks for another one.
                self._settled = True
                self._carry_out(decision)
                if not self._decide_again:
                    return
        finally:
            self._admitting = False

    def _carry_out(self, decision: policy.Decision) -> None:
        with self.table.deferring_writes():  # thousands of dependents can fail at once
            for run_id, dep in decision.dependency_failed.items():
                run = self._queued[run_id]
                dep_run = self.table.get(dep)
                dep_state = dep_run.state if dep_run is not None else "deleted"
                self.table.finish(
                    run, FAILED, contract.reason(contract.DEPENDENCY_FAILED, f"{dep} ended {dep_state}", arg=dep)
                )
        granted = False
        for start in decision.starts:
            if start.id in self._queued:
                self._launch(self._queued[start.id], start.devices)
            else:
                lease = self.leases.get(start.id)
                if lease is not None and lease.live:
                    self.leases.grant(lease, start.devices)
                    granted = True
        if granted:
            self._account()
        for victim_id, job_id in decision.preempt.items():
            victim = self._running.get(victim_id)
            executor = self.executors.get(victim.executor) if victim is not None else None
            if victim is not None and executor is not None and executor.preempt(victim, job_id):
                log.info("evalsched: preempting run %s for %s", victim_id, job_id)
        for job_id in decision.passed_over:
            waiting: Run | Lease | None = self._queued.get(job_id) or self.leases.get(job_id)
            if waiting is not None:
                waiting.passed_over += 1
        for job_id, why in decision.why.items():
            queued_run = self._queued.get(job_id)
            if queued_run is not None:
                self.table.set_reason(queued_run, _waiting_why(queued_run, why))
                continue
            lease = self.leases.get(job_id)
            if lease is not None and lease.live:
                self.leases.set_reason(lease, why)

    def _as_queued(self, run: Run, now: float) -> policy.QueuedJob:
        sched = run.scheduling
        return policy.QueuedJob(
            id=run.id,
            seq=run.record["seq"],
            priority=run.record["priority"],
            marginal_vram_mb=run.record["marginal_vram_mb"],
            gpus=sched["gpus"],
            exclusive=sched["exclusive_gpu"],
            cpus=sched["cpus"],
            depends_on=tuple(run.depends_on),
            waited_s=now - run.submitted_ts,
            passed_over=run.passed_over,
            name=run.record["name"],
        )

    def _lease_as_queued(self, lease: Lease, now: float) -> policy.QueuedJob:
        rec = lease.record
        return policy.QueuedJob(
            id=lease.id,
            seq=rec["seq"],
            priority=rec["priority"],
            marginal_vram_mb=rec["vram_mb"],
            gpus=rec["gpus"],
            exclusive=rec["exclusive_gpu"],
            cpus=0,  # interactive work runs in its kernel, on no CPU slot of ours
            waited_s=now - lease.requested_ts,
            passed_over=lease.passed_over,
            kind="lease",
            held=tuple(sorted(lease.observed.items())),
            name=lease.holder,
        )

    def _dependency_states(self, runs: list[Run]) -> dict[str, str]:
        states = {}
        for run in runs:
            for dep_id in run.depends_on:
                dep = self.table.get(dep_id)
                if dep is not None:
                    states[dep_id] = dep.state
        return states

    # ----------------------------------------------------------------- the queue and dependencies

    def _enqueue(self, run: Run) -> None:
        self._queued[run.id] = run
        self._eligible[run.id] = run
        self._check_dependencies(run)

    def _dequeue(self, run_id: str) -> None:
        self._queued.pop(run_id, None)
        self._eligible.pop(run_id, None)
        self._unblock(run_id)

    def _check_dependencies(self, run: Run) -> bool:
        """Whether the queued ``run`` is held by a dependency still queued or running (then it
        says so, and stays out of admission's decisions until a dependency changes). A run
        whose dependencies all succeeded, or one of which failed, is admission's to decide."""
        self._unblock(run.id)
        if run.id not in self._queued or not run.depends_on:
            return False
        verdict = policy.dependency_verdict(run.depends_on, _DependencyStates(self.table), RunNames(self.table))
        if verdict is None or not isinstance(verdict[1], contract.Why):
            return False
        deps = tuple(run.depends_on)
        self._blocked[run.id] = (verdict[1], deps)
        self._eligible.pop(run.id, None)
        for dep in deps:
            self._waiting_on.setdefault(dep, set()).add(run.id)
        self.table.set_reason(run, _waiting_why(run, verdict[1]))
        return True

    def _unblock(self, run_id: str) -> None:
        held = self._blocked.pop(run_id, None)
        if held is None:
            return
        queued = self._queued.get(run_id)
        if queued is not None:
            self._eligible[run_id] = queued
        for dep in held[1]:
            waiting = self._waiting_on.get(dep)
            if waiting is not None:
                waiting.discard(run_id)
                if not waiting:
                    del self._waiting_on[dep]

    def _run_changed(self, event: dict[str, Any]) -> None:
        """A run's record changed: the runs waiting on it are looked at again (its start changes
        their reason; its end may free them, or fail them)."""
        if event.get("type") != "run":
            return
        waiting = self._waiting_on.get(event["run"]["id"])
        if not waiting:
            return
        freed = False
        for run_id in list(waiting):
            run = self._queued.get(run_id)
            if run is None:
                self._unblock(run_id)
            elif not self._check_dependencies(run):
                freed = True
        if freed and self._started and not self._stopping:
            if self._admitting:
                self._decide_again = True
            else:
                self.request_admission()

    def _recheck_blocked(self) -> None:
        """Backstop (the periodic sweep): every held run looked at again."""
        for run_id in list(self._blocked):
            run = self._queued.get(run_id)
            if run is None:
                self._unblock(run_id)
            elif not self._check_dependencies(run):
                self.request_admission()

    def _decide(self) -> policy.Decision:
        now = time.time()
        # Runs held by a dependency cannot start and take nothing from the others: a decision
        # costs O(the runs that could start), not O(the queue), however many wait on others.
        eligible = list(self._eligible.values())
        queued = [self._as_queued(run, now) for run in eligible]
        queued += [self._lease_as_queued(lease, now) for lease in self.leases.queued()]
        self._head_lane = min((policy.effective_lane(q, self.config.policy) for q in queued), default=len(policy.LANES))
        cap = capacity(self._budgets, self.config.cpu_slots, self._unmanaged)
        deps = self._dependency_states(eligible)
        return policy.decide(
            queued, self._running_jobs(), cap, deps, self.config.policy, dependency_names=RunNames(self.table)
        )

    def _running_jobs(self) -> list[policy.RunningJob]:
        """What holds resources: running runs, then granted leases."""
        now = time.time()
        jobs = [
            policy.RunningJob(
                id=run.id,
                devices=tuple(run.record["devices"]),
                marginal_vram_mb=run.record["marginal_vram_mb"],
                exclusive=run.scheduling["exclusive_gpu"],
                cpus=run.scheduling["cpus"],
                priority=run.record["priority"],
                preemptible=run.record["preemptible"],
                runtime_s=now - (run.started_ts or now),
                preemptions=run.record["preemptions"],
                stopping=run.preempted_by is not None,
                name=run.record["name"],
            )
            for run in self._running.values()
        ]
        jobs += [
            policy.RunningJob(
                id=lease.id,
                devices=tuple(lease.record["devices"]),
                marginal_vram_mb=lease.record["vram_mb"],
                exclusive=lease.record["exclusive_gpu"],
                cpus=0,
                kind="lease",
                label=lease.holder,
            )
            for lease in self.leases.granted()
        ]
        return jobs

    def _launch(self, run: Run, devices: tuple[int, ...]) -> None:
        """Take the resources now (the ledger changes in this very decision), then start the run."""
        self._dequeue(run.id)
        self._running[run.id] = run
        run.started_ts = time.time()
        run.requeued_why = None
        self.table.update(
            run,
            save=False,
            notify=False,
            state=RUNNING,
            reason=None,
            devices=list(devices),
            started_at=utcnow_iso(),
        )
        self.executors[run.executor].launch(run)

    # ----------------------------------------------------------------- leases

    async def request_lease(self, request: LeaseRequest) -> dict[str, Any]:
        """A new lease, admitted at once when it fits (the answer says ``granted`` or ``queued``).
        SpecRejected when it can never fit or its pid is not a live process."""
        self._require_started()
        probe_job = policy.QueuedJob(
            id="-", seq=0, marginal_vram_mb=request.vram_mb, gpus=request.gpus, exclusive=request.exclusive_gpu, cpus=0
        )
        why = policy.never_fits(probe_job, capacity(self._budgets, self.config.cpu_slots, {}))
        if why:
            field_name = {"marginal_vram_mb": "vram_mb"}.get(why[0], why[0])
            raise SpecRejected(
                f"{field_name}: can never fit on this host: {why[1]}",
                [{"loc": [field_name], "msg": f"can never fit on this host: {why[1]}", "type": "never_fits"}],
            )
        kernel: KernelInfo | None = None
        tree: set[int] = set()
        if request.pid is not None:
            own = await self.own_kernels() if self.own_kernels is not None else []
            kernel, tree = await self._require_loop().run_in_executor(self._io, _describe_holder, request.pid, own)
        try:
            lease = self.leases.request(
                vram_mb=request.vram_mb,
                gpus=request.gpus,
                exclusive_gpu=request.exclusive_gpu,
                priority=request.priority,
                pid=request.pid,
                ttl_s=request.ttl_s,
                label=request.label,
                seq=self.table.next_seq(),
                kernel_id=kernel.kernel_id if kernel else None,
                session_path=kernel.session_path if kernel else None,
            )
        except ValueError as exc:
            raise SpecRejected(f"pid: {exc}", [{"loc": ["pid"], "msg": str(exc), "type": "no_such_process"}]) from None
        except StoreError as exc:
            raise Unavailable(str(exc)) from exc
        # What its process holds already (as the last sweep saw it) is absorbed by its grant.
        lease.holder_pids = frozenset(tree)
        lease.observed = self._unmanaged_of(tree)
        if not self._stopping:
            self._settled = False
            self._admit()
        return lease.record

    def _unmanaged_of(self, pids: set[int]) -> dict[int, int]:
        out: dict[int, int] = {}
        for device, entry in self._unmanaged.items():
            used = sum(p["used_mb"] for p in entry.processes if p["pid"] in pids and p["lease_id"] is None)
            if used:
                out[device] = used
        return out

    def get_lease(self, lease_id: str) -> Lease:
        lease = self.leases.get(lease_id)
        if lease is None:
            raise UnknownRun(f"no lease with id {lease_id!r}")
        return lease

    def release_lease(self, lease_id: str) -> dict[str, Any]:
        """End a lease (``released``); a lease that already ended stays as it ended."""
        lease = self.get_lease(lease_id)
        self.leases.end(lease, contract.RELEASED, "released through the API")
        return lease.record

    # ----------------------------------------------------------------- client operations

    def get(self, run_id: str) -> Run:
        run = self.table.get(run_id)
        if run is None:
            if run_id in self.broken:
                raise StateConflict(
                    f"the directory of run {run_id} is broken ({self.broken[run_id]}); DELETE the run to remove it"
                )
            raise UnknownRun(f"no run with id {run_id!r}")
        return run

    async def cancel(self, run_id: str) -> dict:
        run = self.get(run_id)
        if run.terminal:
            raise StateConflict(f"run {run_id} already ended ({run.state}); nothing to cancel")
        executor = self.executors.get(run.executor)
        timer = self._backoff.pop(run.id, None)
        if timer is not None:
            timer.cancel()
        if run.id in self._queued or timer is not None or executor is None:
            self.table.finish(
                run, CANCELLED, contract.reason(contract.CANCELLED_REASON, "cancelled through the API while queued")
            )
        else:
            await executor.cancel(run)
        return run.record

    # ----------------------------------------------------------------- sweeps and comparison

    async def submit_sweep(
        self, spec: EvalSpec, sweep: Any, idempotency_key: str | None = None
    ) -> tuple[dict[str, Any], bool]:
        """One run per point of ``sweep`` (DESIGN.md "Sweeps and comparison"), every one an
        ordinary run with ``sweep_id``. All points are checked before the first run is written.
        With ``idempotency_key``, run i has the key ``<key>#<i>``: a retried submission answers
        with the runs already made, and makes the ones an interrupted first try did not."""
        self._require_started()
        try:
            points = sweeps.expand(sweep)
        except sweeps.SweepError as exc:
            raise SpecRejected(
                f"{'.'.join(map(str, exc.loc))}: {exc.msg}", [{"loc": exc.loc, "msg": exc.msg, "type": "sweep"}]
            ) from None
        spec, vram_source = self.resolve_auto_vram(spec)
        self.validate_for_host(spec)
        specs = [self._sweep_spec(spec, point, i) for i, point in enumerate(points)]
        keys = [None if idempotency_key is None else f"{idempotency_key}#{i}" for i in range(len(points))]
        sweep_id = None
        known = [self._by_key.get(k) for k in keys if k is not None]
        if any(known):
            first = next(run_id for run_id in known if run_id)
            sweep_id = self.get(first).record.get("sweep_id")
        sweep_id = sweep_id or sweeps.new_sweep_id()
        records: list[dict[str, Any]] = []
        made: list[str] = []
        try:
            for i, (one, point) in enumerate(zip(specs, points, strict=True)):
                key = keys[i]
                if key is not None and key in self._by_key:
                    records.append(self._replay(self._by_key[key], one))
                    continue
                records.append(await self._submit(one, key, (sweep_id, point, spec.name), vram_source))
                made.append(records[-1]["id"])
        except Exception:
            # No half-made sweep is left to run: the runs this call made are cancelled (their
            # directories stay, and say so).
            for run_id in made:
                run = self.table.get(run_id)
                if run is not None and not run.terminal:
                    await self.cancel(run_id)
            raise
        return {"id": sweep_id, "runs": records}, bool(made)

    def _sweep_spec(self, spec: EvalSpec, point: dict[str, Any], index: int) -> EvalSpec:
        raw = spec.model_dump(mode="json", by_alias=True, exclude_unset=True)
        raw["params"] = {**spec.params, **point}
        raw["name"] = sweeps.run_name(spec.name, point)
        try:
            return EvalSpec.model_validate_json(json.dumps(raw))
        except ValidationError as exc:
            first = exc.errors(include_url=False, include_context=False, include_input=False)[0]
            loc = ["sweep", index, *first["loc"]]
            msg = f"point {index} ({sweeps.point_label(point)}) makes an invalid spec: {first['msg']}"
            raise SpecRejected(msg, [{"loc": loc, "msg": msg, "type": first["type"]}]) from None

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

    async def cancel_sweep(self, sweep_id: str) -> dict[str, Any]:
        """Cancel the sweep's unfinished runs; finished ones stay as they are."""
        for run in self.sweep_runs(sweep_id):
            if not run.terminal:
                await self.cancel(run.id)
        return self.sweep_view(sweep_id)

    def compare_inputs(self, run_ids: list[str] | None, sweep_id: str | None, baseline: str | None) -> list[Run]:
        """The runs a comparison is about, checked (unknown ids: 404; too many, or a baseline
        that is not among them: 422)."""
        if (run_ids is None) == (sweep_id is None):
            raise SpecRejected("name the runs to compare: ?runs=a,b,c or ?sweep=ID (one of them)")
        runs = (
            self.sweep_runs(sweep_id) if sweep_id is not None else [self.get(r) for r in dict.fromkeys(run_ids or [])]
        )
        if not runs:
            raise SpecRejected("no runs to compare")
        if len(runs) > compare.MAX_COMPARE_RUNS:
            raise SpecRejected(f"{len(runs)} runs; at most {compare.MAX_COMPARE_RUNS} are compared at once")
        if baseline is not None and baseline not in {r.id for r in runs}:
            raise SpecRejected(f"the baseline {baseline!r} is not one of the compared runs")
        return runs

    def compare_runs(self, runs: list[Run], baseline: str | None) -> dict[str, Any]:
        """The comparison (blocking: it reads every run's spec and episodes; a thread's work)."""
        data = []
        problems: dict[str, str] = {}
        for run in runs:
            record = dict(run.record)
            try:
                record["params"] = self.table.full_spec(run).get("params") or {}
            except RunFileError as exc:
                record["params"] = {}
                problems[run.id] = str(exc)
            try:
                episodes = compare.episode_metrics(self.store.episodes(run.id))
            except RunFileError as exc:
                episodes = {}
                problems[run.id] = str(exc)
            data.append((record, episodes))
        result = compare.compare(data, baseline)
        for row in result["rows"]:
            row["error"] = problems.get(row["id"])
        return result

    def delete(self, run_id: str) -> None:
        if run_id in self.broken and run_id not in self.table:
            self._delete_directory(run_id)
            del self.broken[run_id]
            return
        run = self.get(run_id)
        if not run.terminal:
            raise StateConflict(f"run {run_id} is {run.state}; cancel it before deleting it")
        dependents = [other.id for other in self.table.active() if run_id in other.depends_on]
        if dependents:
            raise StateConflict(f"run {run_id} is a dependency of queued runs: {', '.join(dependents[:5])}")
        self._delete_directory(run_id)
        self.table.remove(run_id)
        if run.record["idempotency_key"]:
            self._by_key.pop(run.record["idempotency_key"], None)

    def _delete_directory(self, run_id: str) -> None:
        try:
            self.store.delete(run_id)
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise Unavailable(f"cannot delete run {run_id}: {exc.strerror or exc}") from exc

    def list_runs(self, states: set[str] | None = None, limit: int = 100) -> tuple[list[dict[str, Any]], int]:
        out: list[dict[str, Any]] = []
        total = 0
        # Concurrent submissions may be registered slightly out of order: sort by submission.
        for run in sorted(self.table, key=lambda r: r.record["seq"], reverse=True):
            if states and run.state not in states:
                continue
            total += 1
            if len(out) < limit:
                out.append(run.record)
        return out, total

    def queued_in_order(self) -> list[Run]:
        now = time.time()
        jobs = policy.admission_order((self._as_queued(run, now) for run in self._queued.values()), self.config.policy)
        return [self._queued[j.id] for j in jobs]

    def ledger(self) -> dict:
        leases = {lease.id: lease.record for lease in self.leases.granted()}
        return ledger_view(self._budgets, self.config.cpu_slots, self._running_jobs(), self._unmanaged, leases)

    def leases_in_order(self) -> list[Lease]:
        """Live leases: granted ones by grant, then queued ones in admission order."""
        now = time.time()
        granted = sorted(self.leases.granted(), key=lambda lease: lease.record["granted_at"] or "")
        waiting = {lease.id: lease for lease in self.leases.queued()}
        order = policy.admission_order((self._lease_as_queued(w, now) for w in waiting.values()), self.config.policy)
        return granted + [waiting[job.id] for job in order]

    def queue_view(self) -> dict:
        queued = [run.record for run in self.queued_in_order()]
        # Runs of placing executors (SLURM) wait elsewhere: after ours, in submission order.
        queued += [r.record for r in self.table.active() if r.state == QUEUED and r.id not in self._queued]
        running = [r.record for r in self.table.active() if r.state == RUNNING]
        return {
            "primary": self.primary_info,
            "queued": queued,
            "running": sorted(running, key=lambda r: r["started_at"] or ""),
            "ledger": self.ledger(),
            "leases": [lease.record for lease in self.leases_in_order()],
        }

    def queue_view_json(self) -> bytes:
        """The queue view serialised, cached until the next change (GET /queue is polled)."""
        cached = self._queue_cache
        now = time.monotonic()
        version = self.table.version + self.leases.version + self._observed_version
        # Also expire after a second: aging reorders the queue with time alone.
        if cached is not None and cached[0] == version and now - cached[2] < 1.0:
            return cached[1]
        data = _dumps(self.queue_view())
        self._queue_cache = (version, data, now)
        return data

    def summary(self, run_id: str) -> tuple[dict | None, str | None]:
        """The run's ``summary.json`` and, when it exists but cannot be used, why."""
        run = self.get(run_id)
        try:
            value = self.store.summary(run.id)
        except RunFileError as exc:
            return None, str(exc)
        if value is not None and not isinstance(value, dict):
            return None, f"{contract.SUMMARY_FILE} does not hold a JSON object"
        return value, None

    def episodes(self, run_id: str) -> list[dict]:
        """The run's ``episodes.jsonl`` lines; RunFileError when it cannot be read."""
        return self.store.episodes(self.get(run_id).id)

    def logs(self, run_id: str, stream: str, tail: int | None) -> str:
        """The end of the run's log; RunFileError when it cannot be read."""
        return self.store.log_tail(self.get(run_id).id, stream, tail)

    @property
    def started(self) -> bool:
        """True once recovery has read the runs directory (and until stop())."""
        return self._started

    @property
    def has_live_runs(self) -> bool:
        """Runs that are running, or handed to another system: JupyterHub must not cull us."""
        return len(self.table.active()) > len(self._queued)

    @property
    def counts(self) -> dict[str, int]:
        counts = self.table.counts()
        for name, executor in self.executors.items():
            if not executor.uses_ledger:
                counts[name] = sum(1 for r in self.table.active() if r.executor == name)
        return counts

    # ----------------------------------------------------------------- events

    def subscribe(self, listener: Listener) -> None:
        """Every event: runs, leases and warnings (one stream)."""
        self.table.subscribe(listener)

    def unsubscribe(self, listener: Listener) -> None:
        self.table.unsubscribe(listener)

    # ----------------------------------------------------------------- background work

    def _require_started(self) -> None:
        if not self._started:
            raise Unavailable("the scheduler is not running")

    def _require_loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            raise Unavailable("the scheduler is not running")
        return self._loop

    async def _sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(self.config.sweep_interval_s)
            try:
                for executor in self.executors.values():
                    await executor.sweep()
                if self.table.has_unwritten:
                    self.table.retry_unwritten()
                self.leases.check_processes()
                await self._observe()
                self._recheck_blocked()
                self._admit()
            except Exception:
                log.exception("evalsched: sweep failed")

    async def _observe(self) -> None:
        """Read what the probe and the host say each process uses, and sort it out: runs' observed
        usage (and enforcement of their declarations), leases' holders, unmanaged VRAM by kernel."""
        loop = self._require_loop()
        processes = await loop.run_in_executor(None, self.probe.processes)
        targets: dict[str, ObservedTarget] = {}
        for executor in self.executors.values():
            targets.update(executor.observed_targets())
        leases = self.leases.live()
        if not processes and not self._unmanaged and not targets and not any(lease.observed for lease in leases):
            return
        own_kernels: list[OwnKernel] = []
        if processes and self.own_kernels is not None:
            try:
                own_kernels = await self.own_kernels()
            except Exception:
                log.debug("evalsched: this server's kernels could not be listed", exc_info=True)
        lease_roots = {lease.id: lease.pid for lease in leases if lease.pid is not None}
        sample = await loop.run_in_executor(
            self._io, sample_host, processes, targets, self.models.pids(), lease_roots, own_kernels
        )
        self._kernels = sample.kernels
        for lease in leases:
            if lease.live:
                lease.holder_pids = frozenset(sample.lease_pids.get(lease.id, lease.holder_pids))
                kernel = sample.kernels.get(lease.pid) if lease.pid is not None else None
                if kernel is not None:
                    self.leases.set_kernel(lease, kernel.kernel_id, kernel.session_path)
        self._last_processes, self._last_sample = processes, sample
        self._account()
        if self._observation is not None:
            self._observe_runs(self._observation, sample)

    def _observe_runs(self, observation: Observation, sample: HostSample) -> None:
        """Peaks into the runs' records, and their declarations enforced (``enforce_vram``)."""
        source = getattr(self.probe, "source", "nvml")
        for run_id, rss_mb in sample.run_rss_mb.items():
            run = self.table.get(run_id)
            if run is None or run.terminal:
                continue
            used = observation.runs.get(run_id, {})
            peak = sample.run_memory_peak_mb.get(run_id)
            self.table.observe(run, used, max(rss_mb, peak or 0), source)
            if used and self.config.enforce_vram != "off":
                self._enforce_vram(run, used)

    def _enforce_vram(self, run: Run, used: dict[int, int]) -> None:
        rec = run.record
        usable = {b.index: b.usable_mb for b in self._budgets}
        for device, mb in sorted(used.items()):
            if device not in rec["devices"]:
                declared = 0  # a GPU it was not given (CUDA_VISIBLE_DEVICES ignored)
            elif rec["exclusive_gpu"]:
                declared = usable.get(device, 0)
            else:
                declared = rec["marginal_vram_mb"]
            if mb <= declared * (1 + self.config.vram_tolerance):
                continue
            text = contract.reason(contract.OVER_VRAM, f"used {mb} MB on GPU {device}, declared {declared} MB")
            self.table.add_warning(run, f"{contract.OVER_VRAM}:{device}", text)
            if self.config.enforce_vram == "kill":
                executor = self.executors.get(run.executor)
                if executor is not None and executor.kill_run(run, text):
                    log.warning("evalsched: run %s stopped: %s", run.id, text)
                return

    def _account(self) -> None:
        """Sort the last sample out against the leases as they are now: after every sweep, and
        when a lease is granted or ends (what its process holds changes hands at once)."""
        if self._last_sample is None:
            return
        leases = self.leases.live()
        budgets = {b.index: b.usable_mb for b in self._budgets}
        observation = account(
            self._last_processes,
            baseline_pids=self._last_sample.baseline_pids,
            run_pids=self._last_sample.run_pids,
            lease_pids={lease.id: lease.holder_pids for lease in leases if lease.holder_pids},
            lease_charges={
                lease.id: {d: lease.charge(d, budgets.get(d, 0)) for d in lease.record["devices"]} for lease in leases
            },
            kernels=self._kernels,
        )
        changed = _ledger_figures(observation.unmanaged) != _ledger_figures(self._unmanaged)
        self._unmanaged = observation.unmanaged
        for lease in leases:
            self.leases.set_observed(
                lease, observation.leases.get(lease.id, {}), observation.over_lease.get(lease.id, 0)
            )
        self._observation = observation
        if changed:
            # VRAM outside the scheduler changed: no run or lease did, so say it on its own.
            self._observed_version += 1
            self.table.emit({"type": "ledger", "ledger": self.ledger()})

    async def _watch_progress_forever(self) -> None:
        while True:
            await asyncio.sleep(self.config.progress_interval_s)
            try:
                for run in self.table.active():
                    if run.state == RUNNING:
                        self.table.refresh_progress(run)
            except Exception:
                log.exception("evalsched: progress watch failed")


class _DependencyStates:
    """The states of runs, looked up as dependencies are (a Mapping's ``get``)."""

    __slots__ = ("_table",)

    def __init__(self, table: RunTable) -> None:
        self._table = table

    def get(self, run_id: str, /) -> str | None:
        run = self._table.get(run_id)
        return run.state if run is not None else None


def _waiting_why(run: Run, why: contract.Why) -> contract.Why:
    """Admission's why for a waiting run; for a preempted one, after ``preempted_by:<id>: ...``
    (the code stays the preemption's until it starts again)."""
    return attempts.waiting_after_preemption(run.requeued_why, why)


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


@dataclass(slots=True)
class HostSample:
    """What the I/O thread read of the host for one observation."""

    run_pids: dict[str, set[int]] = field(default_factory=dict)
    baseline_pids: set[int] = field(default_factory=set)
    lease_pids: dict[str, set[int]] = field(default_factory=dict)
    kernels: dict[int, KernelInfo] = field(default_factory=dict)
    run_rss_mb: dict[str, int] = field(default_factory=dict)
    run_memory_peak_mb: dict[str, int] = field(default_factory=dict)  # from the run's memory cgroup


def sample_host(
    processes: list[GpuProcess],
    targets: dict[str, ObservedTarget],
    model_pids: set[int],
    lease_roots: dict[str, int],
    own_kernels: list[OwnKernel],
) -> HostSample:
    """In the I/O thread: the process trees of runs, model hosts and lease holders, runs' RSS, and
    which GPU processes are kernels. One walk of the process table serves every tree."""
    children = _children_map()
    out = HostSample()
    for run_id, target in targets.items():
        pids = target.pids() if target.cgroup is not None else None
        if not pids:
            pids = _tree(target.pid, children)
        out.run_pids[run_id] = pids
        out.run_rss_mb[run_id] = _rss_mb(pids)
        if target.cgroup is not None:
            peak = target.cgroup.memory_peak_mb()
            if peak is not None:
                out.run_memory_peak_mb[run_id] = peak
    for pid in model_pids:
        out.baseline_pids |= _tree(pid, children)
    for lease_id, pid in lease_roots.items():
        out.lease_pids[lease_id] = _tree(pid, children)
    ours = set().union(out.baseline_pids, *out.run_pids.values())
    candidates = {p.pid for p in processes if p.pid not in ours} | set(lease_roots.values())
    if candidates:
        out.kernels = identify(candidates, own_kernels)
    return out


def _describe_holder(pid: int, own: list[OwnKernel]) -> tuple[KernelInfo | None, set[int]]:
    """In the I/O thread: the kernel a lease's process is (or runs under), and its process tree."""
    return identify([pid], own).get(pid), _tree(pid, _children_map())


def _children_map() -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for proc in psutil.process_iter(["ppid"]):
        ppid = proc.info.get("ppid")
        if ppid:
            out.setdefault(ppid, []).append(proc.pid)
    return out


def _tree(root: int, children: dict[int, list[int]]) -> set[int]:
    out = {root}
    stack = [root]
    while stack:
        for child in children.get(stack.pop(), ()):
            if child not in out:
                out.add(child)
                stack.append(child)
    return out


def _rss_mb(pids: set[int]) -> int:
    total = 0
    for pid in pids:
        try:
            total += psutil.Process(pid).memory_info().rss
        except psutil.Error:
            continue
    return total // (1024 * 1024)


def _ledger_figures(unmanaged: dict[int, Unmanaged]) -> dict[int, tuple[int, list]]:
    return {k: (v.mb, v.processes) for k, v in unmanaged.items()}


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()
