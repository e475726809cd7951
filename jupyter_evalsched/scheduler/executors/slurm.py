"""Runs handed to SLURM: submission, state tracking that never hammers the controller, cancel,
re-attachment after a restart.

The run directory (on a filesystem the cluster shares) stays the whole contract: SLURM starts
the same runner, which writes ``summary.json`` and ``_DONE`` exactly as a local run does. The
VRAM ledger is local and does not apply: SLURM places these runs. One ``squeue`` call per poll
covers every tracked job, whatever their number; ``scontrol show job`` is asked only about jobs
that left the queue without a ``_DONE``. Polls come every ``poll_interval_s`` while something
changes, and back off (up to ``max_poll_interval_s``) while nothing does. SLURM jobs do not die
with the server: after a restart they are tracked again, and a run recovered queued without a job
id is handed to SLURM only once SLURM has been asked whether it already has its job (its
``sbatch`` may have answered after the record was last written).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

from ... import contract
from ...contract import CANCELLED, FAILED, QUEUED, RUNNING, SUCCEEDED
from ...schemas import utcnow_iso
from ..environment import run_environment
from ..runs import Run
from ..slurm import (
    SCRIPT_NAME,
    SlurmCli,
    SlurmError,
    SlurmJobState,
    is_job_id,
    pending_why,
    server_environment,
    verdict,
)
from . import Executor, ExecutorContext

log = logging.getLogger("jupyter_evalsched")

# How much longer than two commands' timeouts (an sbatch under way, then the scancel of a run
# cancelled meanwhile) a stop waits for them.
STOP_MARGIN_S = 5.0
# Job ids per scancel command (a sweep's cancel is one command, not one per run).
CANCEL_BATCH = 256
# Failed scancels of one job before the server gives up on it (and says so). Each is sent again
# with the next poll due: over the polls' back-off, up to two minutes at the default intervals.
CANCEL_TRIES = 8


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
        # Recovered queued without a job id: SLURM may have its job all the same. Not handed over,
        # nor cancelled, before SLURM has been asked (_learn).
        self._unverified: set[str] = set()
        # SLURM asked about them and its states polled, after a restart: until then no run is handed over.
        self._learnt = True
        self._learning = False
        self._to_cancel: list[tuple[Run, str]] = []  # (run, job id) for the next scancel
        self._scancelling: list[tuple[Run, str]] = []  # those of the scancel under way
        self._cancel_failed: list[tuple[Run, str]] = []  # scancel failed: sent again with the next poll
        self._cancel_tries: collections.Counter[str] = collections.Counter()  # job id -> failed scancels
        self._cancelling = False  # a scancel is under way: cancels asked meanwhile join the next one
        # The sbatch calls under way and what follows, the scancels, the first look at SLURM: a
        # stop waits for them (stop_wait_s at most).
        self._handing: set[asyncio.Task[None]] = set()
        self.stop_wait_s = 2 * cli.config.command_timeout_s + STOP_MARGIN_S
        self._stopping = False
        self._closed = False  # the stop stopped waiting: nothing more is written
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
        self._learnt = False
        if not run.record["slurm_job_id"] and run.state == QUEUED:
            self._unverified.add(run.id)
        self._poll_soon()

    async def recovered(self) -> None:
        # Not waited for here: a slow slurmctld does not hold the server's start (nothing is
        # handed to SLURM before it answers).
        self._background(self._learn())

    def _background(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(work)
        self._handing.add(task)
        task.add_done_callback(self._handing.discard)

    async def _learn(self) -> None:
        """After a restart, before any run is handed to SLURM: which jobs SLURM already has of the
        runs recovered queued without a job id (their ``sbatch`` answered, but the server stopped
        or died before the id was written): those are tracked, not submitted a second time. Then
        one poll, so that dependencies are judged by what SLURM says now. Asked again at the next
        reconciliation when SLURM does not answer."""
        if self._learning or self._learnt:
            return
        self._learning = True
        ctx = self.ctx
        try:
            unverified = [r for r in map(self._tracked.get, sorted(self._unverified)) if r is not None]
            wanted = {r.id: (ctx.store.run_dir(r.id), int(r.record["attempt"] or 1)) for r in unverified}
            try:
                found = await ctx.loop.run_in_executor(ctx.io, self.cli.find_jobs, wanted) if wanted else {}
            except Exception as exc:
                log.warning(
                    "evalsched: SLURM could not be asked whether it has the jobs of %d run(s) recovered queued "
                    "(%s): they are not handed to SLURM until it answers (asked again at the next poll)",
                    len(wanted),
                    exc,
                )
                return
            if self._closed:
                return
            for run in unverified:
                self._unverified.discard(run.id)
                if run.id in self._tracked:
                    self._found(run, found.get(run.id, []))
            self._learnt = True
        finally:
            self._learning = False
        self._poll_soon()
        await self.reconcile()
        self.advance()

    def _found(self, run: Run, job_ids: list[str]) -> None:
        """A run recovered queued without a job id, and the jobs SLURM has of it (its attempt's)."""
        table = self.ctx.table
        if job_ids:
            job_id = max(job_ids, key=lambda j: (len(j), j))  # (the newest)
            others = [j for j in job_ids if j != job_id]
            if others:
                # They would run the same run, into the same directory, untracked.
                log.warning(
                    "evalsched: run %s has %d SLURM jobs (%s); %s is tracked, the others are scancel'd",
                    run.id,
                    len(job_ids),
                    ", ".join(job_ids),
                    job_id,
                )
                for other in others:
                    self._cancel_job(run, other)
            log.info("evalsched: run %s is SLURM job %s (its id had not been recorded): tracked again", run.id, job_id)
            table.update(
                run,
                slurm_job_id=job_id,
                why=contract.Why(contract.WAITING_CPU, f"SLURM job {job_id} found again after a restart"),
            )
            if run.cancel_requested:
                self._cancel_job(run)
        elif self.ctx.store.done_exists(run.id):
            self._conclude(run, None)  # (it ran, and SLURM has forgotten its job)
        elif run.cancel_requested:
            table.finish(run, CANCELLED, contract.cancelled_reason(run.cancelled_by, "before it reached SLURM"))

    def advance(self) -> None:
        """Hand to SLURM every run whose dependencies allow it: those that succeeded, or that
        are SLURM jobs themselves (then SLURM's ``afterok`` waits for them)."""
        if self._stopping or not self._learnt:  # (the next server hands them to SLURM; _learn advances)
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
            job_id, cancelled = await ctx.loop.run_in_executor(
                ctx.io, self._hand_over, run, run_dir, spec, env, dep_ids
            )
        except Exception as exc:
            self._submitting.discard(run.id)
            if not self._closed:
                ctx.table.finish(run, FAILED, contract.reason(contract.EXCEPTION, f"sbatch refused the run: {exc}"))
            return
        self._submitting.discard(run.id)
        if self._closed:  # (the stop said so: the next server finds the job, _learn)
            return
        if job_id is None:  # not submitted: cancelled, or the server stops (the next one hands it over)
            if run.cancel_requested:
                ctx.table.finish(run, CANCELLED, contract.cancelled_reason(run.cancelled_by, "before it reached SLURM"))
            return
        ctx.table.update(
            run,
            slurm_job_id=str(job_id),
            slurm_state="PENDING",
            why=contract.Why(contract.WAITING_CPU, f"SLURM job {job_id} submitted, not yet scheduled"),
        )
        self._poll_soon()
        if run.cancel_requested:  # (cancelled while sbatch ran: scancel'd there, or now)
            if not cancelled:
                self._cancel_job(run)
            self._say_ending(run)

    def _hand_over(
        self, run: Run, run_dir: Path, spec: dict, env: dict[str, str], dep_ids: list[str]
    ) -> tuple[str | None, bool]:
        """In the I/O pool: ``sbatch`` (job id, and whether it was ``scancel``'d here). Not run
        when the run was cancelled, or the server began to stop, while this waited its turn (a
        sweep's backlog: its cancel's scancels would wait behind it). A run cancelled while
        ``sbatch`` ran is scancel'd here, on this thread: that cancel is sent even where the stop
        stopped waiting and nothing on the event loop follows."""
        if run.cancel_requested or self._stopping:
            return None, False
        job_id = self.cli.submit(run.id, run_dir, spec, env, dep_ids, int(run.record["attempt"] or 1))
        cancelled = False
        if run.cancel_requested:
            try:
                self.cli.cancel(job_id)
                cancelled = True
            except SlurmError as exc:
                log.warning("evalsched: scancel %s (run %s, cancelled) failed: %s", job_id, run.id, exc)
        if self._closed:
            log.warning(
                "evalsched: run %s: sbatch answered (SLURM job %s%s) after the stop stopped waiting; its record "
                "has no job id: the next server finds the job in SLURM and tracks it",
                run.id,
                job_id,
                ", scancel'd: the run was cancelled" if cancelled else "",
            )
        return job_id, cancelled

    # ------------------------------------------------------------------ tracking

    def _poll_soon(self) -> None:
        self._interval = self.poll_interval_s
        self._next_poll = 0.0

    async def reconcile(self) -> None:
        """At most one ``squeue`` per interval for all tracked jobs; ``scontrol`` only for jobs
        gone without ``_DONE``. The interval grows while nothing changes."""
        if not self._learnt:
            await self._learn()  # (SLURM did not answer at the start: asked again)
            return
        tracked = {}
        for run in list(self._tracked.values()):
            job_id = run.record["slurm_job_id"]
            if job_id and not is_job_id(job_id):
                self._bad_job_id(run)  # (one bad record costs only itself, not every poll)
            elif job_id:
                tracked[job_id] = run
        now = self._clock()
        if self._polling or now < self._next_poll:
            return
        self._cancel_again()
        if not tracked:
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
        if self._closed:  # (a poll the stop stopped waiting for, _learn's: nothing is written now)
            return
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
                if _ending(run):  # (its reason stays: it is ending)
                    table.update(run, state=RUNNING, started_at=utcnow_iso())
                else:
                    table.update(run, state=RUNNING, reason=None, started_at=utcnow_iso())
            elif run.state == QUEUED:
                # (A cancelled run's reason says it is ending, not what its job waits for.)
                why = None if _ending(run) else pending_why(st, uses_gpu=run.scheduling.uses_gpu)
                if (why is None or not table.set_reason(run, why)) and moved:
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

    def _bad_job_id(self, run: Run) -> None:
        """A record whose ``slurm_job_id`` is no SLURM job id (its job.json edited or damaged):
        SLURM cannot be asked about its job, nor cancel it. The run ends failed, as a run whose
        sbatch answered no job id does, rather than taking every poll and scancel down with it."""
        if self._closed:
            return
        job_id = run.record["slurm_job_id"]
        log.warning(
            "evalsched: run %s: its record's SLURM job id %r is not a SLURM job id: the run ends failed (a job of "
            "it may still run in SLURM: squeue shows it, its script is %s)",
            run.id,
            job_id,
            self.ctx.store.run_dir(run.id) / SCRIPT_NAME,
        )
        if self.ctx.store.done_exists(run.id):
            self._conclude(run, None)  # (it ended on its own: its files say how)
            return
        self.ctx.table.finish(
            run,
            FAILED,
            contract.reason(
                contract.EXCEPTION,
                f"its record's SLURM job id {job_id!r} is not a SLURM job id: SLURM cannot be asked about "
                "its job, nor cancel it",
            ),
        )

    # ------------------------------------------------------------------ operations

    async def cancel(self, run: Run) -> None:
        """Ends a run not yet with SLURM at once; otherwise its job's ``scancel`` is queued (one
        command for the cancels asked together, a sweep's; a stop waits for it) and the run ends
        ``cancelled`` once SLURM says the job ended."""
        run.cancel_requested = True
        if not run.record["slurm_job_id"]:
            if run.id not in self._submitting and run.id not in self._unverified:
                self.ctx.table.finish(
                    run,
                    CANCELLED,
                    contract.cancelled_reason(run.cancelled_by, "before it reached SLURM"),
                )
            return  # _sbatch cancels it once sbatch answers; _learn once SLURM says whether it has its job
        self._cancel_tries.pop(run.record["slurm_job_id"], None)  # (asked again: as many tries again)
        self._cancel_job(run)
        self._say_ending(run)

    def _say_ending(self, run: Run) -> None:
        """Until SLURM says the job of a cancelled run ended, its record says it is ending (the
        poll keeps that reason: ``_ending``)."""
        if not run.terminal:
            self.ctx.table.set_reason(run, _ending_why(run))

    def _cancel_job(self, run: Run, job_id: str | None = None) -> None:
        """Queue the scancel of the run's job (or of ``job_id``, another job of it)."""
        job_id = job_id or run.record["slurm_job_id"]
        if not is_job_id(job_id):
            self._bad_job_id(run)  # (not in the batch: scancel would refuse the whole command)
            return
        self._to_cancel.append((run, job_id))
        if not self._cancelling:
            self._cancelling = True
            self._background(self._scancel_queued())

    def _cancel_again(self) -> None:
        """Queue again the scancels that failed; not those of jobs SLURM has said ended."""
        again, self._cancel_failed = self._cancel_failed, []
        for run, job_id in again:
            if run.id in self._tracked or job_id != run.record["slurm_job_id"]:
                self._cancel_job(run, job_id)
            else:
                self._cancel_tries.pop(job_id, None)

    async def _scancel_queued(self) -> None:
        ctx = self.ctx
        try:
            while self._to_cancel:
                batch, self._to_cancel = self._to_cancel[:CANCEL_BATCH], self._to_cancel[CANCEL_BATCH:]
                self._scancelling = batch
                job_ids = [job_id for _, job_id in batch]
                try:
                    await ctx.loop.run_in_executor(ctx.io, self.cli.cancel, *job_ids)
                except Exception as exc:
                    self._scancel_failed(batch, exc)
                else:
                    for job_id in job_ids:
                        self._cancel_tries.pop(job_id, None)
                    self._poll_soon()
                finally:
                    self._scancelling = []
        finally:
            self._cancelling = False

    def _scancel_failed(self, batch: list[tuple[Run, str]], exc: Exception) -> None:
        """A scancel failed (slurmctld did not answer, say): sent again with the next poll, up to
        ``CANCEL_TRIES`` times a job; then given up on, and said (the job may still run)."""
        again: list[tuple[Run, str]] = []
        given_up: list[tuple[Run, str]] = []
        for run, job_id in batch:
            self._cancel_tries[job_id] += 1
            (again if self._cancel_tries[job_id] < CANCEL_TRIES else given_up).append((run, job_id))
        self._cancel_failed += again
        if again:
            log.warning(
                "evalsched: scancel %s failed: %s; %s",
                " ".join(job_id for _, job_id in again),
                exc,
                "named at the stop's end" if self._stopping else "sent again with the next poll",
            )
        if given_up:
            for run, job_id in given_up:
                del self._cancel_tries[job_id]
                if _ending(run) and not run.terminal:
                    # Its job may run on: the record no longer says it ends (the panel offers
                    # Cancel again); a queued one's next poll says what its job waits for.
                    self.ctx.table.set_reason(run, None)
            log.error(
                "evalsched: scancel failed %d times (%s): gave up on the cancel of %s; those jobs may still run: "
                "cancel the runs again, or scancel the jobs",
                CANCEL_TRIES,
                exc,
                ", ".join(f"run {run.id} (SLURM job {job_id})" for run, job_id in given_up),
            )

    async def stop(self) -> None:
        """SLURM jobs outlive the server, but what this server began with SLURM ends first: each
        ``sbatch`` under way is waited for, so that its job id is in the run's record, and every
        ``scancel`` asked for (a run cancelled while its ``sbatch`` ran is scancel'd once it
        answers). An ``sbatch`` not yet begun is not run: the next server hands that run over. At
        most ``stop_wait_s`` (two commands' timeouts, and a little more): a hung ``slurmctld``
        does not hold the stop for longer. Past it, nothing more is written (the next server
        finds the jobs of runs whose ``sbatch`` answers later: ``_learn``), and the log says
        which runs and cancels were left. What that work queues while the stop waits (the scancel
        of a cancelled run's job found at the start) is waited for too, and the scancels that
        failed are sent once more (no poll follows to send them)."""
        self._stopping = True
        self._cancel_again()
        late = await self._wait_for_handing()
        if late:
            self._say_what_is_left()
        elif self._cancel_failed:
            log.warning(
                "evalsched: scancel failed at the stop; cancelled, not yet scancel'd: %s; those jobs may still "
                "run: cancel the runs again once the server is back (or scancel the jobs)",
                ", ".join(f"run {run.id} (SLURM job {job_id})" for run, job_id in self._cancel_failed),
            )
        if not late and self._cancels_unknown():  # (SLURM never said whether it has their jobs: _learn failed)
            log.warning(
                "evalsched: cancelled, not yet scancel'd: %s: SLURM has not said since the start whether it "
                "has their jobs, and the cancel is not kept on disk: cancel them again once the server is "
                "back (or scancel their jobs)",
                ", ".join(self._cancels_unknown()),
            )
        self._closed = True

    async def _wait_for_handing(self) -> set[asyncio.Task[None]]:
        """Until no task of ``_handing`` is left, those it queues meanwhile included; the tasks
        still under way after ``stop_wait_s``."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.stop_wait_s
        while under_way := {task for task in self._handing if not task.done()}:
            _, late = await asyncio.wait(under_way, timeout=max(0.0, deadline - loop.time()))
            if late:
                return late
        return set()

    def _cancels_unknown(self) -> list[str]:
        """The cancelled runs recovered queued without a job id that SLURM was not yet asked about."""
        return sorted(r for r in self._unverified if r in self._tracked and self._tracked[r].cancel_requested)

    def _say_what_is_left(self) -> None:
        handing = sorted(self._submitting)
        queued = self._to_cancel + self._scancelling + self._cancel_failed
        cancelled = {run.id for run, _ in queued} | set(self._cancels_unknown())
        unsent = sorted(cancelled | {r for r in handing if r in self._tracked and self._tracked[r].cancel_requested})
        log.warning(
            "evalsched: SLURM did not answer within %g s of the stop. Being handed to SLURM (sbatch): %s; "
            "their records keep no job id: the next server asks SLURM for their jobs before handing them "
            "over again. Cancelled, not yet scancel'd: %s; a job of theirs may still run: cancel them "
            "again once the server is back (or scancel the job)",
            self.stop_wait_s,
            ", ".join(handing) or "none",
            ", ".join(unsent) or "none",
        )

    @property
    def tracked(self) -> int:
        return len(self._tracked)


def _ending_why(run: Run) -> contract.Why:
    return contract.cancelling_why(
        run.cancelled_by,
        f"scancel of SLURM job {run.record['slurm_job_id']} asked; it ends once SLURM says the job ended",
    )


def _ending(run: Run) -> bool:
    """Whether the run's record says a cancel is ending it (``cancelling``)."""
    return run.why_code == contract.CANCELLING
