"""The per-host scheduler: one queue, one running set, one VRAM ledger, event-driven admission.

All state lives on the event-loop thread; handlers call the synchronous methods directly. Disk
is written at every transition (``job.json`` atomically, then ``_DONE`` for terminal states), and
the run's own files are only read. Admission runs on every event that can change the answer
(submit, exit, cancel, a dependency finishing) with a periodic sweep as a backstop.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psutil

from .. import store
from ..models import TERMINAL_STATES, EvalSpec, is_valid_run_id, utcnow_iso
from . import policy
from .gpus import GpuProbe
from .launcher import Launcher, kill_escaped, kill_stale_group, process_create_time, signal_name
from .ledger import DeviceBudget, Unmanaged, capacity, device_budgets, ledger_view, unmanaged_by_device
from .remote import SlurmRuns

log = logging.getLogger("jupyter_evalsched")

Listener = Callable[[dict], None]


class SchedulerError(Exception):
    status = 400

    def __init__(self, message: str, detail: list[dict] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.detail = detail


class SpecRejected(SchedulerError):
    status = 422


class UnknownRun(SchedulerError):
    status = 404


class StateConflict(SchedulerError):
    status = 409


class Unavailable(SchedulerError):
    status = 503


@dataclass
class SchedulerConfig:
    runs_dir: Path
    cpu_slots: int = field(default_factory=lambda: os.cpu_count() or 1)
    reserve_mb: int = 0
    usable_override: dict[int, int] = field(default_factory=dict)
    env_usable_mb: int | None = None
    policy: policy.PolicyConfig = field(default_factory=policy.PolicyConfig)
    cancel_grace_s: float = 10.0
    sweep_interval_s: float = 1.0
    progress_interval_s: float = 0.2
    default_cwd: str = field(default_factory=os.getcwd)
    fsync: bool = False
    # Environment given to every run on top of the server's (e.g. PYTHONPATH for tests).
    run_env: dict[str, str] = field(default_factory=dict)
    default_executor: str = "local"


@dataclass
class Job:
    record: dict
    spec: dict
    submitted_ts: float
    passed_over: int = 0
    cancel_requested: bool = False
    timed_out: bool = False
    timeout_handle: asyncio.TimerHandle | None = None
    summary_key: tuple[int, int] | None = None
    done_exists: bool = False

    @property
    def id(self) -> str:
        return self.record["id"]

    @property
    def state(self) -> str:
        return self.record["state"]

    @property
    def scheduling(self) -> dict:
        return self.spec.get("scheduling", {})

    @property
    def remote(self) -> bool:
        return self.record.get("executor") == "slurm"


class ModelRegistry:
    """What the scheduler needs of the shared-model host (see shared_models.manager)."""

    def names(self) -> list[str]:
        return []

    def baseline_mb_by_device(self) -> dict[int, int]:
        return {}

    async def urls_for(self, names: list[str]) -> dict[str, str]:
        return {}

    def pids(self) -> set[int]:
        return set()


class Scheduler:
    def __init__(self, config: SchedulerConfig, probe: GpuProbe, models: Any = None, slurm: Any = None) -> None:
        self.config = config
        self.probe = probe
        self.models = models if models is not None else ModelRegistry()
        self.store = store.RunStore(config.runs_dir, fsync=config.fsync)
        self.launcher = Launcher(self._on_exit)
        self._jobs: dict[str, Job] = {}  # every known run, in submission order
        self._queued: dict[str, Job] = {}
        self._running: dict[str, Job] = {}
        self._seq = 0
        self._listeners: set[Listener] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._admit_scheduled = False
        self._tasks: list[asyncio.Task] = []
        self._unmanaged: dict[int, Unmanaged] = {}
        self._budgets: list[DeviceBudget] = []
        self._version = 0
        self._queue_cache: tuple[int, bytes, float] | None = None
        self._started = False
        self._creating: set[str] = set()
        self._unwritten: set[str] = set()  # runs whose job.json or _DONE a write refused
        self._io = ThreadPoolExecutor(max_workers=8, thread_name_prefix="evalsched-io")
        self.last_activity: datetime | None = None
        self._deferred: list[Job] | None = None  # terminal writes held back during an exit's admission
        # Set after a full decision that changed nothing: a new job may then be decided alone.
        self._settled = False
        self._reservation: policy.Reservation | None = None
        self._head_lane = len(policy.LANES)
        self.primary_info: dict | None = None  # which server schedules for this host (set by the app)
        self.slurm = SlurmRuns(self, slurm) if slurm is not None else None

    # ----------------------------------------------------------------- life cycle

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self.launcher.bind(self._loop)
        self.store.ensure()
        self._budgets = self._compute_budgets()
        found = await self._loop.run_in_executor(None, self._read_runs_dir)
        self._recover(found)
        self._started = True
        self._tasks = [
            asyncio.ensure_future(self._sweep_forever()),
            asyncio.ensure_future(self._watch_progress_forever()),
        ]
        self._admit()

    async def stop(self) -> None:
        """Shutdown: running runs are killed and end ``aborted`` (rule 4); queued jobs stay queued."""
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            try:
                await task
            except (asyncio.CancelledError, Exception):
                pass
        self._tasks = []
        if self._loop is None:
            return
        for run_id in self.launcher.kill_all():
            job = self._running.get(run_id)
            if job is not None:
                self._finalize(job, "aborted", "server_restart: the server shut down while it ran", admit=False)
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

    def _read_runs_dir(self) -> list[tuple[str, Path, dict | None, dict | None, bool]]:
        out = []
        for run_id, path in self.store.scan():
            job = _read_json_or_none(path / store.JOB)
            spec = _read_json_or_none(path / store.SPEC)
            out.append((run_id, path, job, spec, (path / store.DONE).exists()))
        return out

    def _recover(self, found: list[tuple[str, Path, dict | None, dict | None, bool]]) -> None:
        usable = [f for f in found if isinstance(f[2], dict) and isinstance(f[3], dict)]
        skipped = [f[0] for f in found if not (isinstance(f[2], dict) and isinstance(f[3], dict))]
        if skipped:
            log.warning(
                "evalsched: %d run directories without a readable job.json/spec.json were left as they are: %s",
                len(skipped),
                ", ".join(sorted(skipped)[:20]),
            )
        usable.sort(key=lambda f: (f[2].get("seq", 0), f[0]))
        for run_id, path, record, spec, done in usable:
            record["id"] = run_id
            record["run_dir"] = str(path)
            job = Job(record=record, spec=spec, submitted_ts=_parse_ts(record.get("submitted_at")))
            self._jobs[run_id] = job
            self._seq = max(self._seq, int(record.get("seq", 0)))
            state = record.get("state")
            if job.remote and state in ("queued", "running"):
                if self.slurm is None:
                    self._finalize(
                        job, "aborted", "server_restart: SLURM is not enabled on this server any more", admit=False
                    )
                else:
                    self.slurm.jobs[run_id] = job  # SLURM jobs outlive the server: track them again
            elif state == "queued":
                record["reason"] = None
                self._queued[run_id] = job
            elif state == "running":
                if done:
                    # The run finalized itself while no server was watching: its verdict stands.
                    self._running[run_id] = job
                    self._conclude_from_disk(job, exit_code=record.get("exit_code"))
                else:
                    kill_stale_group(record.get("pid") or 0, record.get("pid_create_time"))
                    kill_escaped(run_id, record.get("pid_create_time") or 0.0)
                    self._running[run_id] = job
                    self._finalize(
                        job, "aborted", "server_restart: the server died or shut down while it ran", admit=False
                    )
            elif state in TERMINAL_STATES:
                if not done:
                    self.store.mark_done(run_id)  # every terminal run directory has _DONE
            else:
                log.warning("evalsched: run %s has unknown state %r; left as it is", run_id, state)
        if self._jobs:
            log.info(
                "evalsched: recovered %d runs (%d queued) from %s", len(self._jobs), len(self._queued), self.store.root
            )

    # ----------------------------------------------------------------- submission

    def validate_for_host(self, spec: EvalSpec) -> None:
        """Checks that need the host: never-fits, unknown models and dependencies, the cwd."""
        errors: list[dict] = []
        sched = spec.scheduling
        executor = spec.executor or self.config.default_executor
        if executor == "slurm":
            if self.slurm is None:
                errors.append(
                    {
                        "loc": ["executor"],
                        "msg": "SLURM is not enabled on this server (EvalSchedApp.slurm_enabled)",
                        "type": "unsupported",
                    }
                )
            if spec.models:
                errors.append(
                    {
                        "loc": ["models"],
                        "msg": "shared models serve local runs only: a SLURM run on another node "
                        "cannot reach this host's model host; load the model in the eval instead",
                        "type": "unsupported",
                    }
                )
        probe_job = policy.QueuedJob(
            id="-",
            seq=0,
            priority=sched.priority,
            marginal_vram_mb=sched.marginal_vram_mb,
            gpus=sched.gpus,
            exclusive=sched.exclusive_gpu,
            cpus=sched.cpus,
        )
        why = (
            None
            if executor == "slurm"
            else policy.never_fits_field(probe_job, capacity(self._budgets, self.config.cpu_slots, {}))
        )
        if why:
            errors.append(
                {"loc": ["scheduling", why[0]], "msg": f"can never fit on this host: {why[1]}", "type": "never_fits"}
            )
        known_models = set(self.models.names())
        for name in spec.models:
            if name not in known_models:
                known = ", ".join(sorted(known_models)) or "none are configured"
                errors.append(
                    {
                        "loc": ["models"],
                        "msg": f"unknown shared model {name!r} (known: {known})",
                        "type": "unknown_model",
                    }
                )
        for dep in spec.depends_on:
            if dep not in self._jobs:
                errors.append({"loc": ["depends_on"], "msg": f"unknown run id {dep!r}", "type": "unknown_dependency"})
        cwd = self._resolve_cwd(spec.cwd)
        if not os.path.isdir(cwd):
            errors.append({"loc": ["cwd"], "msg": f"{cwd!r} is not a directory", "type": "bad_cwd"})
        elif spec.entrypoint and spec.source is None:
            target = spec.entrypoint.rpartition(":")[0]
            if target.endswith(".py") and not os.path.isfile(os.path.join(cwd, target)):
                errors.append(
                    {"loc": ["entrypoint"], "msg": f"file {target!r} not found in {cwd}", "type": "missing_file"}
                )
        if spec.source is not None and spec.entrypoint and not spec.entrypoint.startswith("eval.py:"):
            errors.append(
                {
                    "loc": ["entrypoint"],
                    "msg": "with 'source', the entrypoint must be 'eval.py:<function>'",
                    "type": "value_error",
                }
            )
        if errors:
            raise SpecRejected("; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in errors), errors)

    def _resolve_cwd(self, cwd: str | None) -> str:
        if not cwd:
            return self.config.default_cwd
        return os.path.normpath(os.path.join(self.config.default_cwd, os.path.expanduser(cwd)))

    async def submit(self, spec: EvalSpec) -> dict:
        """Validate, write the run directory, queue. Returns once ``job.json`` is on disk."""
        self._require_started()
        self.validate_for_host(spec)
        run_id = store.new_run_id()
        while run_id in self._jobs or run_id in self._creating:
            run_id = store.new_run_id()
        spec_dict = spec.model_dump(mode="json")
        spec_dict["cwd"] = self._resolve_cwd(spec.cwd)
        self._seq += 1
        now = utcnow_iso()
        sched = spec.scheduling
        record = {
            "id": run_id,
            "name": spec.name,
            "state": "queued",
            "reason": None,
            "priority": sched.priority,
            "submitted_at": now,
            "started_at": None,
            "finished_at": None,
            "pid": None,
            "devices": [],
            "exit_code": None,
            "progress": {"done": 0, "total": spec.episodes},
            "marginal_vram_mb": sched.marginal_vram_mb,
            "depends_on": list(spec.depends_on),
            "gpus": sched.gpus,
            "cpus": sched.cpus,
            "exclusive_gpu": sched.exclusive_gpu,
            "models": list(spec.models),
            "timeout_s": spec.timeout_s,
            "seq": self._seq,
            "pid_create_time": None,
            "run_dir": str(self.store.run_dir(run_id)),
            "metrics": {},
            "executor": spec.executor or self.config.default_executor,
        }
        if record["executor"] == "slurm":
            record.update(slurm_job_id=None, slurm_state=None)
        spec_dict["executor"] = record["executor"]
        files = {
            store.SPEC: _dumps(spec_dict),
            store.JOB: _dumps(record),
        }
        if spec.source is not None:
            files[store.EVAL_SOURCE] = spec.source.encode()
        # Creating files costs about a millisecond each on these disks, mostly waiting: done in
        # a thread pool, several submissions overlap and the event loop stays free.
        self._creating.add(run_id)
        try:
            await self._loop.run_in_executor(self._io, self.store.create, run_id, files)
        except store.StoreError as exc:
            raise Unavailable(str(exc)) from exc
        finally:
            self._creating.discard(run_id)
        job = Job(record=record, spec=spec_dict, submitted_ts=time.time())
        self._jobs[run_id] = job
        if job.remote:
            self._changed(job)
            self.slurm.add(job)
            return record
        self._queued[run_id] = job
        self._changed(job)
        if self._settled and not self._admit_scheduled and self._can_decide_alone(job):
            self._admit_new(job)
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

    def _can_decide_alone(self, job: Job) -> bool:
        """A new job can be decided on its own when nothing else changed since the last full
        decision (the waiting jobs still cannot start) and it does not outrank the head of the
        queue (which would move the anti-starvation reservation)."""
        if job.record["depends_on"]:
            return all(
                self._jobs[d].state in ("queued", "running", "succeeded")
                for d in job.record["depends_on"]
                if d in self._jobs
            )
        lane = policy.LANE_INDEX[job.record["priority"]]
        return lane >= self._head_lane

    def _admit_new(self, job: Job) -> None:
        """Admission for one newly submitted job: O(running), not O(queue). With 10,000 jobs
        queued, a full decision per submission would make a burst of submissions quadratic."""
        cap = capacity(self._budgets, self.config.cpu_slots, self._unmanaged)
        deps = {d: self._jobs[d].state for d in job.record["depends_on"] if d in self._jobs}
        decision = policy.decide(
            [self._as_queued(job, time.time())],
            self._running_jobs(),
            cap,
            deps,
            self.config.policy,
            reservation=self._reservation,
        )
        if decision.dependency_failed or decision.starts:
            if decision.starts:
                # Everything already waiting was overtaken by this newcomer.
                for waiting in self._queued.values():
                    if waiting is not job:
                        waiting.passed_over += 1
            self._apply(decision)
            return
        for reason in decision.waiting.values():
            if job.record["reason"] != reason:
                job.record["reason"] = reason
                self._changed(job)

    def _admit(self) -> None:
        self._admit_scheduled = False
        if self._loop is None:
            return
        for _ in range(100):  # dependency failures can cascade down a chain
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
            if not self._apply(decision):
                return

    def _apply(self, decision: policy.Decision) -> bool:
        """Carry a decision out; True when dependency failures call for another decision."""
        for run_id, dep in decision.dependency_failed.items():
            job = self._queued[run_id]
            dep_state = self._jobs[dep].state if dep in self._jobs else "deleted"
            self._finalize(job, "failed", f"dependency_failed:{dep}: {dep} ended {dep_state}", admit=False)
        for start in decision.starts:
            self._launch(self._queued[start.id], start.devices)
        for run_id in decision.passed_over:
            job = self._queued.get(run_id)
            if job is not None:
                job.passed_over += 1
        for run_id, reason in decision.waiting.items():
            job = self._queued.get(run_id)
            if job is not None and job.record["reason"] != reason:
                job.record["reason"] = reason
                self._changed(job)  # why a run waits is news to the widget and the panel
        return bool(decision.dependency_failed)

    def _as_queued(self, job: Job, now: float) -> policy.QueuedJob:
        return policy.QueuedJob(
            id=job.id,
            seq=job.record["seq"],
            priority=job.record["priority"],
            marginal_vram_mb=job.record["marginal_vram_mb"],
            gpus=job.scheduling.get("gpus", 1),
            exclusive=job.scheduling.get("exclusive_gpu", False),
            cpus=job.scheduling.get("cpus", 1),
            depends_on=tuple(job.record["depends_on"]),
            waited_s=now - job.submitted_ts,
            passed_over=job.passed_over,
        )

    def _decide(self) -> policy.Decision:
        now = time.time()
        queued = [self._as_queued(job, now) for job in self._queued.values()]
        self._head_lane = min((policy.effective_lane(q, self.config.policy) for q in queued), default=len(policy.LANES))
        deps = {}
        for job in self._queued.values():
            for dep in job.record["depends_on"]:
                if dep in self._jobs:
                    deps[dep] = self._jobs[dep].state
        cap = capacity(self._budgets, self.config.cpu_slots, self._unmanaged)
        return policy.decide(queued, self._running_jobs(), cap, deps, self.config.policy)

    def _running_jobs(self) -> list[policy.RunningJob]:
        return [
            policy.RunningJob(
                id=job.id,
                devices=tuple(job.record["devices"]),
                marginal_vram_mb=job.record["marginal_vram_mb"],
                exclusive=job.scheduling.get("exclusive_gpu", False),
                cpus=job.scheduling.get("cpus", 1),
            )
            for job in self._running.values()
        ]

    def _launch(self, job: Job, devices: tuple[int, ...]) -> None:
        """Take the resources now (the ledger is updated in this very decision), then spawn."""
        del self._queued[job.id]
        self._running[job.id] = job
        job.record.update(state="running", reason=None, devices=list(devices), started_at=utcnow_iso())
        if job.spec.get("models"):
            # The model host may need starting: do that off this decision, resources held.
            self._persist(job)
            self._changed(job)
            asyncio.ensure_future(self._launch_with_models(job, devices))
        else:
            self._spawn(job, devices, {})

    async def _launch_with_models(self, job: Job, devices: tuple[int, ...]) -> None:
        try:
            urls = await self.models.urls_for(list(job.spec["models"]))
        except Exception as exc:
            if job.id in self._running:
                self._finalize(job, "failed", f"exception: shared model host unavailable: {_one_line(str(exc))}")
            return
        if job.id not in self._running:
            return
        if job.cancel_requested:
            self._finalize(job, "cancelled", "cancelled: cancelled through the API before it started")
            return
        self._spawn(job, devices, urls)

    def _spawn(self, job: Job, devices: tuple[int, ...], urls: dict[str, str]) -> None:
        run_dir = self.store.run_dir(job.id)
        try:
            store.atomic_write_json(run_dir / store.SHARED_URLS, {"models": urls})
            proc = self.launcher.spawn(job.id, run_dir, job.spec["cwd"], self._run_env(job, devices))
        except Exception as exc:
            self._finalize(job, "failed", f"exception: could not start the run: {_one_line(str(exc))}")
            return
        job.record.update(pid=proc.pid, pid_create_time=process_create_time(proc.pid))
        timeout = job.spec.get("timeout_s")
        if timeout:
            job.timeout_handle = self._loop.call_later(timeout, self._on_timeout, job.id)
        self._persist(job)
        self._changed(job)

    def _run_env(self, job: Job, devices: tuple[int, ...]) -> dict[str, str]:
        env = dict(os.environ)
        env.update(self.config.run_env)
        env.update(job.spec.get("env") or {})
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(d) for d in devices)
        env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
        env["EVALSCHED_DEVICES"] = ",".join(str(d) for d in devices)
        env["EVALSCHED_RUN_ID"] = job.id
        env["EVALSCHED_PARENT_PID"] = str(os.getpid())
        env["PYTHONUNBUFFERED"] = "1"
        if self.config.fsync:
            env["EVALSCHED_FSYNC"] = "1"
        return env

    def _remote_env(self, job: Job) -> dict[str, str]:
        """What a SLURM run gets on top of what sbatch exports: no parent pid (its parent is
        SLURM's step daemon) and no device indices (SLURM sets CUDA_VISIBLE_DEVICES from gres)."""
        env = dict(os.environ)  # sbatch runs with exactly this; the executor strips what must not travel
        env.update(self.config.run_env)
        env.update(job.spec.get("env") or {})
        env["EVALSCHED_RUN_ID"] = job.id
        env["PYTHONUNBUFFERED"] = "1"
        if self.config.fsync:
            env["EVALSCHED_FSYNC"] = "1"
        return env

    # ----------------------------------------------------------------- ends of runs

    def _on_exit(self, run_id: str, code: int) -> None:
        job = self._running.get(run_id)
        if job is None:
            return
        # Admit right here, in the same loop iteration as the exit, and before the finished
        # run's files are written: a freed GPU is reused at once. Should the server die in
        # between, recovery still finds the run's own _DONE, or marks it aborted.
        self._deferred = []
        try:
            self._conclude_from_disk(job, exit_code=code)
            self._admit()
        finally:
            deferred, self._deferred = self._deferred, None
            for late in deferred:
                self._write_terminal(late)

    def _conclude_from_disk(self, job: Job, exit_code: int | None) -> None:
        run_dir = self.store.run_dir(job.id)
        job.record["exit_code"] = exit_code
        summary = _read_json_or_none(run_dir / store.SUMMARY)
        self._apply_summary(job, summary)
        finalized_by_run = (
            (run_dir / store.DONE).exists()
            and isinstance(summary, dict)
            and summary.get("status") in ("succeeded", "failed")
        )
        if finalized_by_run and summary["status"] == "succeeded":
            self._finalize(job, "succeeded", None, admit=False, done_exists=True)
        elif finalized_by_run:
            err = summary.get("error") or {}
            text = f"{err.get('type', 'Error')}: {err.get('message', '')}".strip().rstrip(":")
            self._finalize(job, "failed", f"exception: {_one_line(text)}", admit=False, done_exists=True)
        elif job.cancel_requested:
            self._finalize(job, "cancelled", "cancelled: cancelled through the API", admit=False)
        elif job.timed_out:
            self._finalize(
                job, "failed", f"timeout: ran longer than timeout_s={job.spec.get('timeout_s')}", admit=False
            )
        elif exit_code is not None and exit_code < 0:
            self._finalize(
                job, "failed", f"signal:{signal_name(exit_code)}: the run process was killed by a signal", admit=False
            )
        else:
            self._finalize(
                job, "failed", f"exit_code:{exit_code}: the run process exited without finishing", admit=False
            )

    def _finalize(
        self, job: Job, state: str, reason: str | None, admit: bool = True, done_exists: bool = False
    ) -> None:
        """Record a terminal state: job.json first, then _DONE, last."""
        self._queued.pop(job.id, None)
        self._running.pop(job.id, None)
        if self.slurm is not None:
            self.slurm.jobs.pop(job.id, None)
            if self._loop is not None:
                self._loop.call_soon(self.slurm.advance)  # SLURM runs may wait on this one
        if job.timeout_handle is not None:
            job.timeout_handle.cancel()
            job.timeout_handle = None
        rec = job.record
        rec.update(state=state, reason=reason, finished_at=utcnow_iso())
        job.done_exists = done_exists
        if self._deferred is not None:
            self._deferred.append(job)
        else:
            self._write_terminal(job)
        self._changed(job)
        if admit:
            self.request_admission()

    def _write_terminal(self, job: Job, quiet: bool = False) -> None:
        # _DONE only once job.json holds the terminal state: a _DONE beside a job.json that still
        # says "running" would make the next start conclude the run from stale files.
        if not self._persist(job, quiet=quiet):
            return
        if not job.done_exists:
            try:
                self.store.mark_done(job.id)
                job.done_exists = True
            except OSError as exc:
                self._unwritten.add(job.id)
                if not quiet:
                    log.error("evalsched: cannot write _DONE for %s: %s", job.id, exc)

    def _on_timeout(self, run_id: str) -> None:
        job = self._running.get(run_id)
        if job is None:
            return
        job.timed_out = True
        job.timeout_handle = None
        self.launcher.terminate(run_id, self.config.cancel_grace_s)

    # ----------------------------------------------------------------- client operations

    def get(self, run_id: str) -> Job:
        job = self._jobs.get(run_id) if is_valid_run_id(run_id) else None
        if job is None:
            raise UnknownRun(f"no run with id {run_id!r}")
        return job

    async def cancel(self, run_id: str) -> dict:
        job = self.get(run_id)
        if job.remote and job.state in ("queued", "running"):
            await self.slurm.cancel(job)
            return job.record
        if job.state == "queued":
            self._finalize(job, "cancelled", "cancelled: cancelled through the API while queued")
        elif job.state == "running":
            job.cancel_requested = True
            # False while a run waits for its model host: _launch_with_models then cancels it.
            self.launcher.terminate(run_id, self.config.cancel_grace_s)
        else:
            raise StateConflict(f"run {run_id} already ended ({job.state}); nothing to cancel")
        return job.record

    def delete(self, run_id: str) -> None:
        job = self.get(run_id)
        if job.state not in TERMINAL_STATES:
            raise StateConflict(f"run {run_id} is {job.state}; cancel it before deleting it")
        dependents = [
            j.id for j in self._jobs.values() if j.state in ("queued", "running") and run_id in j.record["depends_on"]
        ]
        if dependents:
            raise StateConflict(f"run {run_id} is a dependency of queued runs: {', '.join(dependents[:5])}")
        try:
            self.store.delete(run_id)
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise Unavailable(f"cannot delete run {run_id}: {exc.strerror or exc}") from exc
        del self._jobs[run_id]
        self._version += 1

    def list_runs(self, states: set[str] | None = None, limit: int = 100) -> tuple[list[dict], int]:
        out = []
        total = 0
        # Concurrent submissions may be registered slightly out of order: sort by submission.
        for job in sorted(self._jobs.values(), key=lambda j: j.record["seq"], reverse=True):
            if states and job.state not in states:
                continue
            total += 1
            if len(out) < limit:
                out.append(job.record)
        return out, total

    def queued_in_order(self) -> list[Job]:
        jobs = policy.admission_order(
            (
                policy.QueuedJob(
                    id=j.id, seq=j.record["seq"], priority=j.record["priority"], waited_s=time.time() - j.submitted_ts
                )
                for j in self._queued.values()
            ),
            self.config.policy,
        )
        return [self._queued[j.id] for j in jobs]

    def ledger(self) -> dict:
        return ledger_view(self._budgets, self.config.cpu_slots, self._running_jobs(), self._unmanaged)

    def queue_view(self) -> dict:
        queued = [j.record for j in self.queued_in_order()]
        running = list(j.record for j in self._running.values())
        if self.slurm is not None:
            queued += sorted(self.slurm.queued(), key=lambda r: r["seq"])
            running += self.slurm.running()
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
        # Also expire after a second: aging reorders the queue with time alone.
        if cached is not None and cached[0] == self._version and now - cached[2] < 1.0:
            return cached[1]
        data = _dumps(self.queue_view())
        self._queue_cache = (self._version, data, now)
        return data

    def summary(self, run_id: str) -> dict | None:
        job = self.get(run_id)
        return self.store.cache.read_json(self.store.run_dir(job.id) / store.SUMMARY)

    def run_dir(self, run_id: str) -> Path:
        return self.store.run_dir(self.get(run_id).id)

    @property
    def started(self) -> bool:
        """True once recovery has read the runs directory (and until stop())."""
        return self._started

    @property
    def has_live_runs(self) -> bool:
        return bool(self._running) or bool(self.slurm and self.slurm.jobs)

    @property
    def counts(self) -> dict[str, int]:
        remote = len(self.slurm.jobs) if self.slurm else 0
        return {"queued": len(self._queued), "running": len(self._running), "slurm": remote, "total": len(self._jobs)}

    # ----------------------------------------------------------------- events

    def subscribe(self, listener: Listener) -> None:
        self._listeners.add(listener)

    def unsubscribe(self, listener: Listener) -> None:
        self._listeners.discard(listener)

    def _changed(self, job: Job) -> None:
        self._version += 1
        if self._running or job.state == "running":
            self.last_activity = _now_dt()
        event = {"type": "run", "run": job.record}
        for listener in list(self._listeners):
            try:
                listener(event)
            except Exception:
                log.exception("evalsched: event listener failed")

    def _persist(self, job: Job, quiet: bool = False) -> bool:
        try:
            self.store.write_job(job.id, job.record)
        except (store.StoreError, OSError) as exc:
            # The state stays right in memory; the sweep retries the write (_retry_writes).
            self._unwritten.add(job.id)
            if not quiet:
                log.error("evalsched: cannot write job.json of %s: %s", job.id, exc)
            return False
        self._unwritten.discard(job.id)
        return True

    def _retry_writes(self) -> None:
        """Write what a full or read-only disk refused, once it takes writes again."""
        for run_id in list(self._unwritten):
            job = self._jobs.get(run_id)
            if job is None or not self.store.run_dir(run_id).is_dir():
                self._unwritten.discard(run_id)  # deleted, or its directory is gone
            elif job.state in TERMINAL_STATES:
                self._write_terminal(job, quiet=True)
            else:
                self._persist(job, quiet=True)

    # ----------------------------------------------------------------- background work

    def _require_started(self) -> None:
        if not self._started:
            raise Unavailable("the scheduler is not running")

    async def _sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(self.config.sweep_interval_s)
            try:
                self.launcher.poll()
                if self._unwritten:
                    self._retry_writes()
                await self._refresh_unmanaged()
                self._admit()
                if self.slurm is not None:
                    self.slurm.advance()
                    await self.slurm.sweep()
            except Exception:
                log.exception("evalsched: sweep failed")

    async def _refresh_unmanaged(self) -> None:
        processes = await self._loop.run_in_executor(None, self.probe.processes)
        if not processes and not self._unmanaged:
            return
        managed = await self._loop.run_in_executor(None, self._managed_pids)
        unmanaged = unmanaged_by_device(processes, managed)
        if {k: v.mb for k, v in unmanaged.items()} != {k: v.mb for k, v in self._unmanaged.items()}:
            self._version += 1
        self._unmanaged = unmanaged

    def _managed_pids(self) -> set[int]:
        pids = set(self.launcher.running_pids) | set(self.models.pids())
        for pid in list(pids):
            try:
                pids.update(c.pid for c in psutil.Process(pid).children(recursive=True))
            except psutil.Error:
                pass
        return pids

    async def _watch_progress_forever(self) -> None:
        while True:
            await asyncio.sleep(self.config.progress_interval_s)
            try:
                self._poll_progress()
            except Exception:
                log.exception("evalsched: progress watch failed")

    def _poll_progress(self) -> None:
        """Progress comes from the run's summary.json; only running runs are looked at."""
        for job in list(self._running.values()):
            path = self.store.run_dir(job.id) / store.SUMMARY
            try:
                st = os.lstat(path)
            except OSError:
                continue
            key = (st.st_mtime_ns, st.st_size)
            if key == job.summary_key:
                continue
            job.summary_key = key
            summary = self.store.cache.read_json(path)
            if self._apply_summary(job, summary):
                self._changed(job)

    def _apply_summary(self, job: Job, summary: Any) -> bool:
        if not isinstance(summary, dict):
            return False
        progress = {
            "done": _int(summary.get("episodes_done")),
            "total": _int(summary.get("episodes_total"), job.record["progress"]["total"]),
        }
        metrics = summary.get("metrics") if isinstance(summary.get("metrics"), dict) else {}
        if progress == job.record["progress"] and metrics == job.record.get("metrics"):
            return False
        job.record["progress"] = progress
        job.record["metrics"] = metrics
        return True


def _read_json_or_none(path: Path) -> Any:
    try:
        return store.read_json_nofollow(path)
    except (OSError, ValueError):
        return None


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def _parse_ts(text: str | None) -> float:
    try:
        return datetime.fromisoformat(text).timestamp()
    except (TypeError, ValueError):
        return time.time()


def _now_dt() -> datetime:

    return datetime.now(UTC)


def _int(value: Any, default: int = 0) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else default


def _one_line(text: str, limit: int = 500) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"
