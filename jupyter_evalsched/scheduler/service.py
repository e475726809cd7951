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
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import psutil

from .. import contract
from ..contract import ABORTED, CANCELLED, FAILED, QUEUED, RUNNING, TERMINAL_STATES
from ..models import EvalSpec, utcnow_iso
from ..runner.entrypoint import resolve_entrypoint_file
from ..store import FoundRun, RunFileError, RunStore, StoreError, new_run_id
from . import policy
from .config import SchedulerConfig
from .errors import SpecRejected, StateConflict, Unavailable, UnknownRun
from .executors import Executor, ExecutorContext
from .executors.local import LocalExecutor
from .gpus import GpuProbe
from .ledger import DeviceBudget, Unmanaged, capacity, device_budgets, ledger_view, unmanaged_by_device
from .runs import Listener, Run, RunTable, new_record, parse_timestamp, record_from_disk
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
        self.executors: dict[str, Executor] = {e.name: e for e in (executors or [LocalExecutor(self.models)])}
        # Admission's own view: the ledger runs waiting for resources, and those holding them.
        self._queued: dict[str, Run] = {}
        self._running: dict[str, Run] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self.context: ExecutorContext | None = None  # what executors get; set by start()
        self._io = ThreadPoolExecutor(max_workers=8, thread_name_prefix="evalsched-io")
        self._tasks: list[asyncio.Future] = []
        self._unmanaged: dict[int, Unmanaged] = {}
        self._budgets: list[DeviceBudget] = []
        self._queue_cache: tuple[int, bytes, float] | None = None
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
        self.table.on_end(self._on_run_ended)

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
        if self._loop is not None:
            for executor in self.executors.values():
                await executor.stop()
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
            run.record["reason"] = None
            self._queued[run.id] = run
        else:
            if executor.uses_ledger:
                self._running[run.id] = run  # holds its resources until its end is recorded
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
        if executor is not None and executor.uses_ledger:
            probe_job = policy.QueuedJob(
                id="-",
                seq=0,
                priority=sched.priority,
                marginal_vram_mb=sched.marginal_vram_mb,
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

    async def _submit(self, spec: EvalSpec, idempotency_key: str | None) -> dict[str, Any]:
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
        )
        files = {contract.SPEC_FILE: _dumps(spec_dict), contract.JOB_FILE: _dumps(record)}
        if spec.source is not None:
            files[contract.EVAL_SOURCE_FILE] = spec.source.encode()
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
        if idempotency_key is not None:
            self._by_key[idempotency_key] = run_id
        self.table.changed(run)
        if self._stopping:
            return record  # on disk, queued: the next start runs it
        if not executor.uses_ledger:
            executor.submit(run)
            return record
        self._queued[run_id] = run
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

    def _on_run_ended(self, run: Run) -> None:
        self._queued.pop(run.id, None)
        held = self._running.pop(run.id, None) is not None
        if not self._started or self._stopping:
            return
        if self._admitting:
            self._decide_again = True  # a dependency failure inside a decision: decide once more
        elif held:
            # Right here, in the same loop iteration as the end, before its files are written.
            self._settled = False
            self._admit()
        else:
            self.request_admission()

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
        )
        if decision.dependency_failed or decision.starts:
            if decision.starts:
                # Everything already waiting was overtaken by this newcomer.
                for waiting in self._queued.values():
                    if waiting is not run:
                        waiting.passed_over += 1
            self._carry_out(decision)
            return
        for reason in decision.waiting.values():
            self.table.set_reason(run, reason)

    def _admit(self) -> None:
        self._admit_scheduled = False
        if self._loop is None or self._admitting or self._stopping:
            return
        self._admitting = True
        try:
            for _ in range(100):  # dependency failures can cascade down a chain
                self._decide_again = False
                if not self._queued:
                    self._settled, self._reservation, self._head_lane = True, None, len(policy.LANES)
                    return
                decision = self._decide()
                self._reservation = (
                    policy.Reservation(decision.reserved_for, decision.reserved_devices, decision.reserved_cpus)
                    if decision.reserved_for
                    else None
                )
                # Settled from here on, unless carrying the decision out asks for another one.
                self._settled = True
                self._carry_out(decision)
                if not self._decide_again:
                    return
        finally:
            self._admitting = False

    def _carry_out(self, decision: policy.Decision) -> None:
        for run_id, dep in decision.dependency_failed.items():
            run = self._queued[run_id]
            dep_run = self.table.get(dep)
            dep_state = dep_run.state if dep_run is not None else "deleted"
            self.table.finish(
                run, FAILED, contract.reason(contract.DEPENDENCY_FAILED, f"{dep} ended {dep_state}", arg=dep)
            )
        for start in decision.starts:
            self._launch(self._queued[start.id], start.devices)
        for run_id in decision.passed_over:
            waiting = self._queued.get(run_id)
            if waiting is not None:
                waiting.passed_over += 1
        for run_id, reason in decision.waiting.items():
            waiting = self._queued.get(run_id)
            if waiting is not None:
                self.table.set_reason(waiting, reason)

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
        )

    def _dependency_states(self, runs: list[Run]) -> dict[str, str]:
        states = {}
        for run in runs:
            for dep_id in run.depends_on:
                dep = self.table.get(dep_id)
                if dep is not None:
                    states[dep_id] = dep.state
        return states

    def _decide(self) -> policy.Decision:
        now = time.time()
        queued = [self._as_queued(run, now) for run in self._queued.values()]
        self._head_lane = min((policy.effective_lane(q, self.config.policy) for q in queued), default=len(policy.LANES))
        cap = capacity(self._budgets, self.config.cpu_slots, self._unmanaged)
        deps = self._dependency_states(list(self._queued.values()))
        return policy.decide(queued, self._running_jobs(), cap, deps, self.config.policy)

    def _running_jobs(self) -> list[policy.RunningJob]:
        return [
            policy.RunningJob(
                id=run.id,
                devices=tuple(run.record["devices"]),
                marginal_vram_mb=run.record["marginal_vram_mb"],
                exclusive=run.scheduling["exclusive_gpu"],
                cpus=run.scheduling["cpus"],
            )
            for run in self._running.values()
        ]

    def _launch(self, run: Run, devices: tuple[int, ...]) -> None:
        """Take the resources now (the ledger changes in this very decision), then start the run."""
        del self._queued[run.id]
        self._running[run.id] = run
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
        if run.id in self._queued or executor is None:
            self.table.finish(
                run, CANCELLED, contract.reason(contract.CANCELLED_REASON, "cancelled through the API while queued")
            )
        else:
            await executor.cancel(run)
        return run.record

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
        return ledger_view(self._budgets, self.config.cpu_slots, self._running_jobs(), self._unmanaged)

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
        }

    def queue_view_json(self) -> bytes:
        """The queue view serialised, cached until the next change (GET /queue is polled)."""
        cached = self._queue_cache
        now = time.monotonic()
        version = self.table.version
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
                await self._refresh_unmanaged()
                self._admit()
            except Exception:
                log.exception("evalsched: sweep failed")

    async def _refresh_unmanaged(self) -> None:
        loop = self._require_loop()
        processes = await loop.run_in_executor(None, self.probe.processes)
        if not processes and not self._unmanaged:
            return
        own = set(self.models.pids())
        for executor in self.executors.values():
            own |= executor.pids()
        managed = await loop.run_in_executor(None, _with_descendants, own)
        unmanaged = unmanaged_by_device(processes, managed)
        if {k: v.mb for k, v in unmanaged.items()} != {k: v.mb for k, v in self._unmanaged.items()}:
            self.table.version += 1
        self._unmanaged = unmanaged

    async def _watch_progress_forever(self) -> None:
        while True:
            await asyncio.sleep(self.config.progress_interval_s)
            try:
                for run in self.table.active():
                    if run.state == RUNNING:
                        self.table.refresh_progress(run)
            except Exception:
                log.exception("evalsched: progress watch failed")


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


def _with_descendants(pids: set[int]) -> set[int]:
    out = set(pids)
    for pid in pids:
        try:
            out.update(c.pid for c in psutil.Process(pid).children(recursive=True))
        except psutil.Error:
            pass
    return out


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()
