"""Runs handed to SLURM: submission, state tracking that never hammers the controller, cancel,
re-attachment after a restart.

The run directory (on a filesystem the cluster shares) stays the whole contract: SLURM starts
the same runner, which writes ``summary.json`` and ``_DONE`` exactly as a local run does. The
VRAM ledger is local and does not apply: SLURM places these runs. One ``squeue`` call per poll
covers every tracked job, whatever their number; ``scontrol show job`` is asked only about jobs
that left the queue without a ``_DONE``. Polls come every ``poll_interval_s`` while something
changes, and back off (up to ``max_poll_interval_s``) while nothing does. SLURM jobs do not die
with the server: after a restart they are tracked again.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable

from ... import contract
from ...contract import CANCELLED, FAILED, QUEUED, RUNNING, SUCCEEDED
from ...schemas import utcnow_iso
from ..environment import run_environment
from ..runs import Run
from ..slurm import SlurmCli, SlurmJobState, pending_why, server_environment, verdict
from . import Executor, ExecutorContext

log = logging.getLogger("jupyter_evalsched")

# How much longer than two commands' timeouts (an sbatch under way, then the scancel of a run
# cancelled meanwhile) a stop waits for them.
STOP_MARGIN_S = 5.0


class SlurmExecutor(Executor):
    name = "slurm"
    uses_ledger = False

    def __init__(
        self,
        cli: SlurmCli,
        poll_interval_s: float = 1.0,
        max_poll_interval_s: float = 15.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cli = cli
        self._clock = clock
        self.poll_interval_s = poll_interval_s
        self.max_poll_interval_s = max(poll_interval_s, max_poll_interval_s)
        self._tracked: dict[str, Run] = {}  # every SLURM run not yet terminal
        self._submitting: set[str] = set()
        self._handing: set[asyncio.Task[None]] = set()  # the sbatch calls under way, and what follows
        self._stopping = False
        self._polling = False
        self._interval = poll_interval_s
        self._next_poll = 0.0

    @property
    def interpreter(self) -> str:
        return self.cli.config.python  # (on the compute nodes, at this path)

    def bind(self, ctx: ExecutorContext) -> None:
        super().bind(ctx)
        ctx.table.on_end(self._on_end)

    def _on_end(self, run: Run) -> None:
        self._tracked.pop(run.id, None)
        # SLURM runs may wait on this one (local or not): look again, outside the caller's work.
        self.ctx.loop.call_soon(self.advance)

    # ------------------------------------------------------------------ hand-off

    def submit(self, run: Run) -> None:
        self._tracked[run.id] = run
        self.advance()

    def recover(self, run: Run, done: bool) -> None:
        self._tracked[run.id] = run  # SLURM jobs outlive the server: track them again
        self._poll_soon()

    def advance(self) -> None:
        """Hand to SLURM every run whose dependencies allow it: those that succeeded, or that
        are SLURM jobs themselves (then SLURM's ``afterok`` waits for them)."""
        if self._stopping:  # (the next server hands them to SLURM)
            return
        table = self.ctx.table
        for run in list(self._tracked.values()):
            if run.record["slurm_job_id"] or run.id in self._submitting or run.cancel_requested:
                continue
            slurm_deps, pending, failed = [], [], None
            pending_runs: list[tuple[str, str]] = []  # (id, name) of the dependencies it waits on
            for dep_id in run.depends_on:
                dep = table.get(dep_id)
                state = dep.state if dep is not None else "deleted"
                if state == SUCCEEDED:
                    continue
                if dep is not None and dep.record["slurm_job_id"] and state in (QUEUED, RUNNING):
                    slurm_deps.append(dep.record["slurm_job_id"])
                elif state in (QUEUED, RUNNING):
                    pending.append(f"{contract.run_named(dep_id, dep.record['name'] if dep else None)} is {state}")
                    if dep is not None:
                        pending_runs.append((dep_id, dep.record["name"]))
                else:
                    failed = (dep_id, state, dep.record["name"] if dep is not None else None)
                    break
            if failed:
                table.finish(
                    run,
                    FAILED,
                    contract.reason(
                        contract.DEPENDENCY_FAILED,
                        f"{contract.run_named(failed[0], failed[2])} ended {failed[1]}",
                        arg=failed[0],
                    ),
                )
                continue
            if pending:
                table.set_reason(
                    run,
                    contract.Why(
                        contract.WAITING_DEPENDENCY,
                        "; ".join(pending),
                        holders=[contract.Holder("run", d, n) for d, n in pending_runs],
                    ),
                )
                continue
            self._submitting.add(run.id)
            table.set_reason(run, contract.Why(contract.WAITING_CPU, "being handed to SLURM (sbatch)"))
            task = asyncio.ensure_future(self._sbatch(run, slurm_deps))
            self._handing.add(task)
            task.add_done_callback(self._handing.discard)

    async def _sbatch(self, run: Run, dep_ids: list[str]) -> None:
        ctx = self.ctx
        run_dir = ctx.store.run_dir(run.id)
        try:
            spec = ctx.table.full_spec(run)
            env = run_environment(
                run.id,
                ctx.config.run_env,
                spec.get("env") or {},
                devices=None,
                parent_pid=None,
                fsync=ctx.config.fsync,
                base=server_environment(os.environ, self.cli.config.export_env),
                attempt=run.record["attempt"],
            )
            ctx.store.write_shared_urls(run.id, {})
            # The logs, owner-only, before SLURM opens them for appending: made by slurmstepd,
            # they would take its umask's mode (0644 under the usual 022).
            ctx.store.create_logs(run.id)
            job_id = await ctx.loop.run_in_executor(ctx.io, self.cli.submit, run.id, run_dir, spec, env, dep_ids)
        except Exception as exc:
            self._submitting.discard(run.id)
            ctx.table.finish(run, FAILED, contract.reason(contract.EXCEPTION, f"sbatch refused the run: {exc}"))
            return
        self._submitting.discard(run.id)
        ctx.table.update(
            run,
            slurm_job_id=str(job_id),
            slurm_state="PENDING",
            why=contract.Why(contract.WAITING_CPU, f"SLURM job {job_id} submitted, not yet scheduled"),
        )
        self._poll_soon()
        if run.cancel_requested:
            await self._scancel(run)

    # ------------------------------------------------------------------ tracking

    def _poll_soon(self) -> None:
        self._interval = self.poll_interval_s
        self._next_poll = 0.0

    async def reconcile(self) -> None:
        """At most one ``squeue`` per interval for all tracked jobs; ``scontrol`` only for jobs
        gone without ``_DONE``. The interval grows while nothing changes."""
        tracked = {r.record["slurm_job_id"]: r for r in self._tracked.values() if r.record["slurm_job_id"]}
        now = self._clock()
        if not tracked or self._polling or now < self._next_poll:
            return
        self._polling = True
        ctx = self.ctx
        try:
            states = await ctx.loop.run_in_executor(ctx.io, self.cli.poll, list(tracked))
        except Exception as exc:
            log.warning("evalsched: SLURM poll failed: %s", exc)
            states = None
        finally:
            self._polling = False
        changed = states is not None and self._apply(tracked, states)
        self._interval = self.poll_interval_s if changed else min(self._interval * 2, self.max_poll_interval_s)
        self._next_poll = self._clock() + self._interval

    def _apply(self, tracked: dict[str, Run], states: dict[str, SlurmJobState]) -> bool:
        table, store = self.ctx.table, self.ctx.store
        changed = False
        for slurm_id, run in tracked.items():
            if run.id not in self._tracked:
                continue
            st = states.get(slurm_id)
            if store.done_exists(run.id):
                self._conclude(run, st)
                changed = True
                continue
            if st is None:
                continue
            moved = table.set_slurm_state(run, st.state)
            changed = changed or moved
            if st.finished:
                self._conclude(run, st)
                changed = True
            elif st.state in ("RUNNING", "COMPLETING") and run.state == QUEUED:
                table.update(run, state=RUNNING, reason=None, started_at=utcnow_iso())
            elif run.state == QUEUED:
                if not table.set_reason(run, pending_why(st, uses_gpu=run.scheduling.uses_gpu)) and moved:
                    table.changed(run)  # the reason stands, the state it names moved
        return changed

    def _conclude(self, run: Run, st: SlurmJobState | None) -> None:
        table = self.ctx.table
        if st is not None:
            table.set_exit_code(run, st.exit_code)
        judged = table.conclude(run, st.exit_code if st is not None else None)
        if judged is not None:
            table.finish(run, *judged, done_on_disk=True)
            return
        if st is None:
            table.finish(run, FAILED, contract.reason(contract.EXIT_CODE, "SLURM lost track of the job", arg="unknown"))
            return
        run_ids = {r.record["slurm_job_id"]: r.id for r in table.active() if r.record["slurm_job_id"]}
        state, reason = verdict(st, run_ids)
        if run.cancel_requested and state != SUCCEEDED:
            state = CANCELLED
            reason = contract.cancelled_reason(run.cancelled_by, f"(scancel {st.job_id})")
        table.finish(run, state, reason)

    # ------------------------------------------------------------------ operations

    async def cancel(self, run: Run) -> None:
        run.cancel_requested = True
        if not run.record["slurm_job_id"]:
            if run.id not in self._submitting:
                self.ctx.table.finish(
                    run,
                    CANCELLED,
                    contract.cancelled_reason(run.cancelled_by, "before it reached SLURM"),
                )
            return  # _sbatch cancels it once sbatch answers
        await self._scancel(run)

    async def _scancel(self, run: Run) -> None:
        ctx = self.ctx
        try:
            await ctx.loop.run_in_executor(ctx.io, self.cli.cancel, run.record["slurm_job_id"])
        except Exception as exc:
            log.warning("evalsched: scancel %s failed: %s", run.record["slurm_job_id"], exc)
        self._poll_soon()

    async def stop(self) -> None:
        """SLURM jobs outlive the server, but what this server began with SLURM ends first: each
        ``sbatch`` under way is waited for, so that its job id is in the run's record (the next
        server would hand the run to SLURM a second time), and a run cancelled meanwhile is then
        ``scancel``'d (its cancel waits for that job id). At most two commands' timeouts, and a
        little more: a hung ``slurmctld`` does not hold the stop for longer."""
        self._stopping = True
        handing = [task for task in self._handing if not task.done()]
        if not handing:
            return
        wait_s = 2 * self.cli.config.command_timeout_s + STOP_MARGIN_S
        _, late = await asyncio.wait(handing, timeout=wait_s)
        if late:
            log.warning(
                "evalsched: %d run(s) being handed to SLURM got no answer from sbatch within %g s of the "
                "stop; the next start may hand them to SLURM again",
                len(late),
                wait_s,
            )

    @property
    def tracked(self) -> int:
        return len(self._tracked)
