"""Runs handed to SLURM: submission, state tracking that never hammers the controller, cancel,
re-attachment after a restart.

The run directory (on a filesystem the cluster shares) stays the whole contract: SLURM starts
the same runner, which writes ``summary.json`` and ``_DONE`` exactly as a local run does. The
VRAM ledger is local and does not apply: SLURM places these runs. One ``squeue`` call per sweep
covers every tracked job, whatever their number; ``scontrol show job`` is asked only about jobs
that left the queue without a ``_DONE``, to tell failure, cancel, timeout and node failure apart.
SLURM jobs do not die with the server: after a restart they are tracked again.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import TYPE_CHECKING

from .. import store
from ..models import utcnow_iso
from .slurm import pending_reason, verdict

if TYPE_CHECKING:
    from .service import Job, Scheduler

log = logging.getLogger("jupyter_evalsched")


class SlurmRuns:
    def __init__(self, scheduler: Scheduler, executor) -> None:
        self.scheduler = scheduler
        self.executor = executor
        self.jobs: dict[str, Job] = {}  # every SLURM run not yet terminal
        self._submitting: set[str] = set()
        self._polling = False

    # ------------------------------------------------------------------ views

    def queued(self) -> list[dict]:
        return [j.record for j in self.jobs.values() if j.state == "queued"]

    def running(self) -> list[dict]:
        return [j.record for j in self.jobs.values() if j.state == "running"]

    # ------------------------------------------------------------------ hand-off

    def add(self, job: Job) -> None:
        self.jobs[job.id] = job
        self.advance()

    def advance(self) -> None:
        """Hand to SLURM every run whose dependencies allow it: those that succeeded, or that
        are SLURM jobs themselves (then SLURM's ``afterok`` waits for them)."""
        s = self.scheduler
        for job in list(self.jobs.values()):
            if job.record.get("slurm_job_id") or job.id in self._submitting or job.cancel_requested:
                continue
            slurm_deps, pending, failed = [], [], None
            for dep in job.record["depends_on"]:
                d = s._jobs.get(dep)
                state = d.state if d else "deleted"
                if state == "succeeded":
                    continue
                if d is not None and d.record.get("slurm_job_id") and state in ("queued", "running"):
                    slurm_deps.append(d.record["slurm_job_id"])
                elif state in ("queued", "running"):
                    pending.append(f"{dep} is {state}")
                else:
                    failed = (dep, state)
                    break
            if failed:
                self.jobs.pop(job.id, None)
                s._finalize(job, "failed", f"dependency_failed:{failed[0]}: {failed[0]} ended {failed[1]}")
                continue
            if pending:
                reason = "waiting_dependency: " + "; ".join(pending)
                if job.record["reason"] != reason:
                    job.record["reason"] = reason
                    s._version += 1
                continue
            self._submitting.add(job.id)
            job.record["reason"] = "waiting_cpu: being handed to SLURM (sbatch)"
            asyncio.ensure_future(self._submit(job, slurm_deps))

    async def _submit(self, job: Job, dep_ids: list[str]) -> None:
        s = self.scheduler
        run_dir = s.store.run_dir(job.id)
        try:
            store.atomic_write_json(run_dir / store.SHARED_URLS, {"models": {}})
            env = s._remote_env(job)
            job_id = await s._loop.run_in_executor(s._io, self.executor.submit, job.id, run_dir, job.spec, env, dep_ids)
        except Exception as exc:
            self._submitting.discard(job.id)
            self.jobs.pop(job.id, None)
            s._finalize(job, "failed", f"exception: sbatch refused the run: {' '.join(str(exc).split())[:400]}")
            return
        self._submitting.discard(job.id)
        job.record.update(
            slurm_job_id=str(job_id),
            slurm_state="PENDING",
            reason=f"waiting_cpu: SLURM job {job_id} submitted, not yet scheduled",
        )
        s._persist(job)
        s._changed(job)
        if job.cancel_requested:
            await self._scancel(job)

    # ------------------------------------------------------------------ tracking

    async def sweep(self) -> None:
        """One ``squeue`` for all tracked jobs; ``scontrol`` only for those gone without _DONE."""
        s = self.scheduler
        tracked = {j.record["slurm_job_id"]: j for j in self.jobs.values() if j.record.get("slurm_job_id")}
        if not tracked or self._polling:
            return
        self._polling = True
        try:
            states = await s._loop.run_in_executor(s._io, self.executor.poll, list(tracked))
        except Exception as exc:
            log.warning("evalsched: SLURM poll failed: %s", exc)
            return
        finally:
            self._polling = False
        for slurm_id, job in tracked.items():
            if job.id not in self.jobs:
                continue
            st = states.get(slurm_id)
            run_dir = s.store.run_dir(job.id)
            if (run_dir / store.DONE).exists():
                self._conclude(job, st)
                continue
            if st is None:
                continue
            changed = job.record.get("slurm_state") != st.state
            job.record["slurm_state"] = st.state
            if st.finished:
                self._conclude(job, st)
            elif st.state in ("RUNNING", "COMPLETING") and job.state == "queued":
                job.record.update(state="running", reason=None, started_at=utcnow_iso())
                s._persist(job)
                s._changed(job)
            elif job.state == "queued":
                reason = pending_reason(st, uses_gpu=_uses_gpu(job))
                if reason != job.record["reason"] or changed:
                    job.record["reason"] = reason
                    s._changed(job)

    def _conclude(self, job: Job, st) -> None:
        s = self.scheduler
        self.jobs.pop(job.id, None)
        run_dir = s.store.run_dir(job.id)
        summary = _read_summary(run_dir)
        s._apply_summary(job, summary)
        if job.record.get("started_at") is None and isinstance(summary, dict):
            # A short job can start and end between two sweeps: its own summary knows when.
            job.record["started_at"] = summary.get("started_at")
        if st is not None:
            job.record["exit_code"] = st.exit_code
        if (
            (run_dir / store.DONE).exists()
            and isinstance(summary, dict)
            and summary.get("status") in ("succeeded", "failed")
        ):
            if summary["status"] == "succeeded":
                s._finalize(job, "succeeded", None, done_exists=True)
            else:
                err = summary.get("error") or {}
                s._finalize(
                    job,
                    "failed",
                    f"exception: {err.get('type', 'Error')}: {' '.join(str(err.get('message', '')).split())[:400]}",
                    done_exists=True,
                )
            return
        if st is None:
            s._finalize(job, "failed", "exit_code:None: SLURM lost track of the job")
            return
        run_ids = {j.record["slurm_job_id"]: j.id for j in s._jobs.values() if j.record.get("slurm_job_id")}
        state, reason = verdict(st, run_ids)
        if job.cancel_requested and state != "succeeded":
            state, reason = "cancelled", f"cancelled: cancelled through the API (scancel {st.job_id})"
        s._finalize(job, state, reason)

    # ------------------------------------------------------------------ cancel

    async def cancel(self, job: Job) -> None:
        job.cancel_requested = True
        if not job.record.get("slurm_job_id"):
            if job.id not in self._submitting:
                self.jobs.pop(job.id, None)
                self.scheduler._finalize(
                    job, "cancelled", "cancelled: cancelled through the API before it reached SLURM"
                )
            return  # _submit cancels it once sbatch answers
        await self._scancel(job)

    async def _scancel(self, job: Job) -> None:
        s = self.scheduler
        try:
            await s._loop.run_in_executor(s._io, self.executor.cancel, job.record["slurm_job_id"])
        except Exception as exc:
            log.warning("evalsched: scancel %s failed: %s", job.record.get("slurm_job_id"), exc)


def _uses_gpu(job) -> bool:
    sched = job.spec.get("scheduling") or {}
    return bool(sched.get("marginal_vram_mb") or sched.get("exclusive_gpu"))


def _read_summary(run_dir):
    try:
        return store.read_json_nofollow(run_dir / store.SUMMARY)
    except (OSError, ValueError):
        return None


def sbatch_available() -> bool:
    return any(os.access(os.path.join(p, "sbatch"), os.X_OK) for p in os.environ.get("PATH", "").split(os.pathsep) if p)
