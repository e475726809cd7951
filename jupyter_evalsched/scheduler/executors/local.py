"""Runs as subprocesses of this server: ``python -m jupyter_evalsched.runner --run-dir DIR``.

The run gets its devices, its environment and the URLs of the shared models it named, starts in
a new session and in a cgroup of its own (where the host allows: then nothing it starts can
escape clean-up, and ``memory_mb`` is its memory limit), dies with the server (rule 2), and its
exit is noticed at once (pidfd). Its end is judged from its own files first (it finalized:
succeeded, or failed by an exception), then from how the process ended (stopped for using more
VRAM than declared, out of its memory limit, cancelled, timed out, killed by a signal, exited
early).

A run stopped for a higher lane (``preempt``: ``_STOP`` in its directory, then its process group
after ``preempt_grace_s``) is queued again (``preempted_by:<id>``) rather than ended. A detached
run is left running at shutdown and adopted again by the next server when its pid and start time
still match; with ``auto_resume``, a run the server's death interrupted is queued again.
"""

from __future__ import annotations

import asyncio
import errno
import functools
import logging
import os
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from typing import Any, NamedTuple

from ... import contract
from ...contract import ABORTED, CANCELLED, FAILED, QUEUED, SUCCEEDED
from ...runner._proc import CGROUP_PROCS_ENV, cgroup_procs_value
from ...runner.run import NOTICE_FLAG
from ...store import RunFileError, RunStore, UnsafeRunFile
from ..attempts import Requeue, preempted_plan, restart_plan
from ..cgroup_pool import CgroupPool
from ..cgroups import CgroupError, Cgroups, RunCgroup
from ..environment import run_environment
from ..escapees import kill_escaped_all
from ..launcher import (
    Launcher,
    RunProcess,
    SpawnError,
    is_same_process,
    kill_stale_group,
    process_create_time,
    signal_name,
    wait_stale_gone,
)
from ..runs import FinalSummary, Run, parse_timestamp
from ..shared import ModelUnavailable, NoSharedModels, SharedModels
from ..zygotes import ColdInstead, WarmStartConfig, ZygotePool, cold_reason
from . import Executor, ExecutorContext, ObservedTarget

log = logging.getLogger("jupyter_evalsched")

# Runs (with a cgroup) ended before an idle server reclaims its namespace's memory: ~3 % of runs
# leave a removed cgroup held by a page (see Cgroups.reclaim_namespace); one reclaim frees all.
NAMESPACE_RECLAIM_AFTER = 32
# How long no run may have ended before the server counts as idle for that reclaim
# (``LocalExecutor._idle``).
QUIET_BEFORE_RECLAIM_S = 2.0


class LocalExecutor(Executor):
    name = "local"
    uses_ledger = True

    def __init__(
        self,
        models: SharedModels | None = None,
        python: str = sys.executable,
        notify_exits: bool = True,
        cgroups: Cgroups | None = None,
    ) -> None:
        self.models: SharedModels = models if models is not None else NoSharedModels()
        self.python = python
        self.cgroups = cgroups  # None or mode "none": process groups only
        self.launcher = Launcher(self._on_exit, notify_exits=notify_exits, on_done=self._on_done)
        self.zygotes: ZygotePool | None = None  # warm starts (set up at bind when they are on)
        self._timeouts: dict[str, asyncio.TimerHandle] = {}
        self._starting: dict[str, asyncio.Task[None]] = {}  # admitted runs waiting for their model host
        self._cgroups: dict[str, RunCgroup] = {}  # the live runs' cgroups
        # Cgroups made ahead (cold starts) and removed afterwards, in a thread of their own.
        self.pool: CgroupPool | None = CgroupPool(cgroups) if cgroups is not None and cgroups.enabled else None
        self._handover: dict[str, RunCgroup] = {}  # warm starts asked of a spare: the run's cgroup
        self._concluding: dict[str, asyncio.Future[ExitReads]] = {}  # exits whose figures are read
        self._preempt_timers: dict[str, asyncio.TimerHandle] = {}
        # What recovered runs left, dealt with for all of them at once (``recovered``): the
        # process groups still there (pid, start), their cgroups, and the runs without one, whose
        # escaped processes are searched for.
        self._stale_groups: dict[str, tuple[int, float | None]] = {}  # run id: its leader (pid, start)
        self._stale_cgroups: list[RunCgroup] = []
        self._ended_since_reclaim = 0  # runs with a cgroup ended since the namespace's last reclaim
        self._last_cgroup_end = 0.0  # (monotonic) when a run with a cgroup last ended
        self._escapes_to_search: dict[str, float] = {}
        self._stopping = False

    @property
    def interpreter(self) -> str:
        return self.python

    def bind(self, ctx: ExecutorContext) -> None:
        super().bind(ctx)
        self.launcher.bind(ctx.loop)
        config = ctx.config
        if self.pool is not None:
            self.pool.start()
            self.launcher.janitor = self.pool.janitor
        if config.warm_start:
            self.zygotes = ZygotePool(
                WarmStartConfig(
                    preload=list(config.preload_modules),
                    max_zygotes=config.max_zygotes,
                    idle_s=config.zygote_idle_s,
                    start_timeout_s=config.zygote_start_timeout_s,
                    python=self.python,
                ),
                self.launcher.zygote_exited,
                cgroups=self.pool,
            )
            self.zygotes.bind(ctx.loop)
            base = run_environment("", config.run_env, devices=None, parent_pid=os.getpid(), fsync=config.fsync)
            self.zygotes.start(base)
        ctx.table.on_end(self._forget)
        ctx.table.on_requeue(self._on_requeued)

    # ------------------------------------------------------------------ start

    def launch(self, run: Run) -> None:
        cleaning = self.launcher.cleaning.get(run.id)
        if cleaning is not None and not cleaning.done():
            # The previous attempt's clean-up (its cgroup's removal) is still under way in a
            # thread: the new attempt starts once it is done, or that would remove its cgroup.
            asyncio.wrap_future(cleaning, loop=self.ctx.loop).add_done_callback(lambda _: self._launch_now(run))
            return
        self._launch_now(run)

    def _launch_now(self, run: Run) -> None:
        if not run.starting:
            return  # cancelled meanwhile
        if self._stopping:  # admitted, then the server began to shut down: it loses nothing
            self.ctx.table.update(run, state=QUEUED, reason=None, devices=[], started_at=None)
            return
        if run.cancel_requested:
            self.ctx.table.finish(
                run,
                CANCELLED,
                contract.cancelled_reason(run.cancelled_by, "before it started"),
            )
            return
        if run.record["models"]:
            # The model host may need starting: the run waits for it (resources held), visibly.
            models = run.record["models"]
            self.ctx.table.set_reason(
                run,
                contract.Why(
                    contract.STARTING,
                    f"waiting for shared models: {', '.join(models)}",
                    holders=[contract.Holder("model", name, name) for name in models],
                ),
            )
            task = asyncio.ensure_future(self._launch_later(run))
            self._starting[run.id] = task
            task.add_done_callback(lambda _: self._starting.pop(run.id, None))
        else:
            # (Its cgroup was made ahead: a warm run's process waits in it, a cold run takes one
            # from the pool.)
            self._spawn(run, {})

    async def _launch_later(self, run: Run) -> None:
        """The start, once the model host answers."""
        table = self.ctx.table
        urls: dict[str, str] = {}
        if run.record["models"]:
            try:
                urls = await self.models.urls_for(list(run.record["models"]))
            except ModelUnavailable as exc:
                table.finish(run, FAILED, contract.reason(contract.MODEL_UNAVAILABLE, str(exc), limit=2000))
                return
            except Exception as exc:
                table.finish(run, FAILED, contract.reason(contract.EXCEPTION, f"shared model host unavailable: {exc}"))
                return
        if run.terminal or run.cancel_requested:
            if not run.terminal:
                table.finish(
                    run,
                    CANCELLED,
                    contract.cancelled_reason(run.cancelled_by, "before it started"),
                )
            return
        self._spawn(run, urls)

    def _spawn(self, run: Run, urls: dict[str, str]) -> None:
        ctx = self.ctx
        config = ctx.config
        try:
            spec = ctx.table.full_spec(run)
        except RunFileError as exc:
            ctx.table.finish(run, FAILED, contract.reason(contract.EXCEPTION, f"RunFileError: {exc}"))
            return
        env = run_environment(
            run.id,
            config.run_env,
            spec.get("env") or {},
            devices=run.record["devices"],
            parent_pid=os.getpid(),
            fsync=config.fsync,
            attempt=run.record["attempt"],
            detach=run.record["detach"],
        )
        if run.record["models"]:
            env.update(self.models.run_env(run.id))  # the shared models' OpenAI-compatible API
        cwd = spec.get("cwd") or ctx.config.default_cwd
        try:
            # A run without models has no shared_urls.json (none: no models); a later attempt
            # gets ``{"models": {}}`` (the eval may have touched its run directory).
            if run.record["models"] or run.record["attempt"] > 1:
                ctx.store.write_shared_urls(run.id, urls)
        except OSError as exc:
            # Renamed over whatever is there; only a directory the run made there stops it.
            code = contract.RUN_FILE if exc.errno in (errno.EISDIR, errno.ENOTEMPTY) else contract.EXCEPTION
            self._start_failed(run, None, str(exc), code)
            return
        why = cold_reason(spec, env, self.zygotes is not None)
        zygote = None
        if why is None and self.zygotes is not None:
            choice = self.zygotes.choose(env)
            if isinstance(choice, str):
                why = choice
            else:
                zygote = choice
        if zygote is None:
            self._spawn_cold(run, cwd, env, why or "warm_start is off")
            return
        ctx.table.set_reason(run, contract.Why(contract.STARTING, f"waiting for a warm start from zygote {zygote.pid}"))

        def handed_back(then: Callable[..., None], *answer: Any) -> None:
            # The spare did not become the run (it leaves): the cgroup it was given goes with it.
            self._drop_cgroup(self._handover.pop(run.id, None))
            then(*answer)

        def failed(why: str, code: str | None) -> None:
            self._start_failed(run, None, why, code or contract.EXCEPTION)

        try:
            self.launcher.fork(
                run.id,
                zygote,
                str(ctx.store.run_dir(run.id)),
                cwd,
                env,
                None,
                on_started=lambda proc: self._started(run, proc, proc.cgroup, "warm", f"forked by zygote {zygote.pid}"),
                on_cold=functools.partial(handed_back, functools.partial(self._spawn_cold, run, cwd, env)),
                on_error=functools.partial(handed_back, failed),
                prepare=functools.partial(self._prepare_warm, run),
            )
        except SpawnError as exc:
            self._start_failed(run, None, str(exc), exc.code)

    def _prepare_warm(self, run: Run, spare_cgroup: RunCgroup | None) -> RunCgroup | None:
        """At the hand-over to a spare (on the loop): the run's cgroup is the one the spare waits
        in, where only the run's limits are written now (a spare without one: a cgroup of the
        pool, which the runner joins before any user code)."""
        if spare_cgroup is None:
            cgroup = self._run_cgroup(run)
        else:
            cgroup = spare_cgroup
            why = cgroup.assign(run.id, run.scheduling.memory_mb)
            if why and cgroup.memory_kind is not None:
                # A limit below what the spare already uses (the kernel refuses it: EBUSY) would
                # leave the run unlimited: a cold start has it written before it starts.
                raise ColdInstead(f"memory_mb={run.scheduling.memory_mb} could not be set on a warm process ({why})")
            self._note_limit(run, cgroup, why)
        if cgroup is not None:
            self._handover[run.id] = cgroup
        return cgroup

    def _run_cgroup(self, run: Run) -> RunCgroup | None:
        """A cgroup of the pool, given to ``run`` with its limits, or None (the host has none, or
        it could not be made: then the run's process group is what clean-up kills, and a
        ``memory_mb`` is not enforced, which the run's warnings say)."""
        if self.pool is None:
            why = self.cgroups.support.detail if self.cgroups is not None else "cgroups are off"
            self._note_limit(run, None, why)
            return None
        try:
            cgroup = self.pool.take()
        except Exception as exc:  # (CgroupError says what; anything else must not lose the run)
            why = str(exc) if isinstance(exc, CgroupError) else f"{type(exc).__name__}: {exc}"
            log.warning("evalsched: run %s runs without a cgroup: %s", run.id, why)
            self._note_limit(run, None, why)
            return None
        self._note_limit(run, cgroup, cgroup.assign(run.id, run.scheduling.memory_mb))
        return cgroup

    def _note_limit(self, run: Run, cgroup: RunCgroup | None, why: str) -> None:
        memory_mb = run.scheduling.memory_mb
        if memory_mb and (cgroup is None or cgroup.memory_limit_mb is None):
            why = why or "this host gives runs no memory cgroup"
            self.ctx.table.note_warning(
                run, contract.reason("memory_limit_not_enforced", f"memory_mb={memory_mb} is not enforced: {why}")
            )

    def _spawn_cold(self, run: Run, cwd: str, env: dict[str, str], why: str) -> None:
        """Start the run in a fresh interpreter; ``why`` says why it is not forked."""
        ctx = self.ctx
        if not run.starting:
            return
            return
        if run.cancel_requested or run.kill_reason is not None:  # asked while a zygote was asked
            if run.kill_reason is not None:
                ctx.table.finish(run, FAILED, run.kill_reason)
            else:
                ctx.table.finish(
                    run,
                    CANCELLED,
                    contract.cancelled_reason(run.cancelled_by, "before it started"),
                )
            return
        cgroup = self._run_cgroup(run)
        if cgroup is not None:
            env = {**env, CGROUP_PROCS_ENV: cgroup_procs_value(cgroup.procs_files())}
        try:
            proc = self.launcher.spawn(
                run.id,
                [self.python, "-m", "jupyter_evalsched.runner", "--run-dir", str(ctx.store.run_dir(run.id))],
                cwd=cwd,
                env=env,
                stdout=ctx.store.log_path(run.id, "stdout"),
                stderr=ctx.store.log_path(run.id, "stderr"),
                cgroup=cgroup,
                detached=run.record["detach"],
                notice_flag=NOTICE_FLAG,
            )
        except (SpawnError, OSError) as exc:
            self._start_failed(run, cgroup, str(exc), exc.code if isinstance(exc, SpawnError) else contract.EXCEPTION)
            return
        self._started(run, proc, cgroup, "cold", why)

    def _start_failed(self, run: Run, cgroup: RunCgroup | None, why: str, code: str = contract.EXCEPTION) -> None:
        self._drop_cgroup(cgroup)
        if run.terminal:
            return
        # A run admitted but not started must not hold its resources.
        self.ctx.table.finish(run, FAILED, contract.reason(code, f"could not start the run: {why}"))

    def _drop_cgroup(self, cgroup: RunCgroup | None) -> None:
        if cgroup is not None and self.pool is not None:
            self.pool.discard(cgroup)

    def _started(self, run: Run, proc: RunProcess, cgroup: RunCgroup | None, start: str, detail: str) -> None:
        ctx = self.ctx
        self._handover.pop(run.id, None)
        if cgroup is not None:
            self._cgroups[run.id] = cgroup
        timeout = run.spec.get("timeout_s")
        if timeout:
            self._timeouts[run.id] = ctx.loop.call_later(timeout, self._on_timeout, run.id)
        ctx.table.started(
            run,
            pid=proc.pid,
            pid_create_time=proc.create_time if proc.create_time is not None else process_create_time(proc.pid),
            at=proc.spawned_at if proc.zygote is not None else None,
            start=start,
            start_detail=detail,
        )

    # ------------------------------------------------------------------ end

    def _on_done(self, run_id: str) -> bool:
        """A run said it is done: its ``_DONE`` exists and its process is leaving. A run on
        the CPU alone gives its slot to the next run now, rather than once the kernel has torn its
        process down; one on GPUs keeps them until its process is gone (its memory there is freed
        only then). Its verdict still waits for the exit. True when it gave its slot."""
        table = self.ctx.table
        run = table.get(run_id)
        if run is None or run.terminal or run.exited_at is not None or run.record["devices"]:
            return False
        if not os.path.exists(os.path.join(self.ctx.store.run_dir(run_id), contract.DONE_FILE)):
            return False  # the word without the file: not the runner's
        table.exited(run)
        return True

    def _on_exit(self, run_id: str, code: int | None) -> asyncio.Future[ExitReads] | None:
        table = self.ctx.table
        run = table.get(run_id)
        cgroup = self._cgroups.pop(run_id, None)
        if cgroup is not None:
            self._ended_since_reclaim += 1
            self._last_cgroup_end = time.monotonic()
        if run is None or run.terminal:
            return None
        table.exited(run)  # its resources go to the next run first: the verdict reads files
        if cgroup is None:
            self._conclude(run, code, None, None, 0)
            return None
        # Read in a thread, before clean-up removes the cgroup (the launcher waits for this): the
        # last figures, whether the kernel killed something of the run for its memory limit, and
        # the final summary the verdict rests on.
        figures = self.ctx.loop.run_in_executor(self.ctx.io, _exit_reads, cgroup, self.ctx.table.store, run_id)
        self._concluding[run_id] = figures
        figures.add_done_callback(functools.partial(self._figures_read, run, code, cgroup))
        return figures

    def _figures_read(self, run: Run, code: int | None, cgroup: RunCgroup, figures: asyncio.Future[ExitReads]) -> None:
        self._concluding.pop(run.id, None)
        peak, oom_kills, summary = None, 0, None
        if not figures.cancelled() and figures.exception() is None:
            peak, oom_kills, summary = figures.result()
        self._conclude(run, code, cgroup, peak, oom_kills, summary)

    def _conclude(
        self,
        run: Run,
        code: int | None,
        cgroup: RunCgroup | None,
        peak: int | None,
        oom_kills: int,
        summary: FinalSummary | None = None,
    ) -> None:
        table = self.ctx.table
        if run.terminal:
            return
        if peak is not None:
            table.observe(run, {}, peak, notify=False, persist=False)  # (in the terminal record)
        with table.deferring_writes():
            table.set_exit_code(run, code)
            verdict = table.conclude(run, code, summary)
            done = verdict is not None
            if run.preempted_by is not None:
                if verdict is None and not (run.kill_reason or run.cancel_requested or run.timed_out):
                    # Stopped at an episode boundary (or signalled after its grace): next attempt.
                    # (The next attempt may be admitted, even started, before requeue returns.)
                    if table.requeue(
                        run,
                        preempted_plan(run.record, run.preempted_by, self._job_holder(run.preempted_by)),
                        quiet=True,
                    ):
                        return
                else:
                    self._clear_stop(run)  # it ended on its own first: the _STOP is moot
            if verdict is None:
                verdict = self._judge_exit(run, code)
            stopped = run.kill_reason is not None or run.cancel_requested or run.timed_out
            if oom_kills and verdict[0] != SUCCEEDED and not stopped:
                verdict = (FAILED, self._oom_reason(run, cgroup, oom_kills, code))
            table.finish(run, *verdict, done_on_disk=done)

    @staticmethod
    def _oom_reason(run: Run, cgroup: RunCgroup | None, kills: int, code: int | None) -> str:
        limit = cgroup.memory_limit_mb if cgroup is not None else None
        observed = run.record.get("observed") or {}
        peak = observed.get("peak_rss_mb")
        what = "the run process" if code == -9 else f"{kills} process{'es' if kills != 1 else ''} of the run"
        return contract.reason(
            contract.OOM,
            f"the run reached its memory limit (memory_mb={limit or run.scheduling.memory_mb}"
            f"{f', peak {peak} MB' if peak is not None else ''}) and the kernel killed {what}",
        )

    def _judge_exit(self, run: Run, code: int | None) -> tuple[str, str]:
        """How a run that did not finalize itself ended."""
        if run.kill_reason is not None:
            return FAILED, run.kill_reason
        if run.cancel_requested:
            return CANCELLED, contract.cancelled_reason(run.cancelled_by)
        if run.timed_out:
            return FAILED, contract.reason(contract.TIMEOUT, f"ran longer than timeout_s={run.spec.get('timeout_s')}")
        if code is not None and code < 0:
            return FAILED, contract.reason(
                contract.SIGNAL, "the run process was killed by a signal", arg=signal_name(code)
            )
        if code is None:  # not our child (adopted, or ended before this server): no status to read
            what = (
                "the detached run process exited"
                if run.record["detach"]
                else "the run process exited while no server watched it"
            )
            return FAILED, contract.reason(
                contract.EXIT_CODE,
                f"{what} without finishing (its exit status is known only to the server that started it)",
                arg="unknown",
            )
        if code == contract.EXIT_STOPPED:
            return FAILED, contract.reason(
                contract.EXIT_CODE,
                f"the run stopped at an episode boundary because {contract.STOP_FILE} is in its directory "
                "(resume it to go on)",
                arg=code,
            )
        return FAILED, contract.reason(contract.EXIT_CODE, "the run process exited without finishing", arg=code)

    def _on_timeout(self, run_id: str) -> None:
        self._timeouts.pop(run_id, None)
        run = self.ctx.table.get(run_id)
        if run is None or run.terminal:
            return
        run.timed_out = True
        self.launcher.terminate(run_id, self.ctx.config.cancel_grace_s)

    def _forget(self, run: Run) -> None:
        for timers in (self._timeouts, self._preempt_timers):
            timer = timers.pop(run.id, None)
            if timer is not None:
                timer.cancel()

    def _on_requeued(self, run: Run, plan: Requeue) -> None:
        self._forget(run)
        task = self._starting.pop(run.id, None)
        if task is not None:
            task.cancel()

    def _clear_stop(self, run: Run) -> None:
        try:
            self.ctx.store.clear_stop(run.id)
        except (OSError, RunFileError):
            pass

    # ------------------------------------------------------------------ preemption

    def preempt(self, run: Run, by: str) -> bool:
        """Ask the run to stop at its next episode boundary for ``by`` (``_STOP``); its process
        group is signalled once ``preempt_grace_s`` has passed. False when it cannot be asked (not
        started yet, or already ending)."""
        if run.terminal or run.preempted_by is not None or run.id not in self.launcher.running:
            return False
        if run.cancel_requested or run.kill_reason is not None or run.timed_out:
            return False
        ctx = self.ctx
        try:
            ctx.store.write_stop(run.id)
        except UnsafeRunFile as exc:
            # Never opened, so it cannot be asked to stop: it stops now (its room is wanted).
            self.kill_run(run, contract.reason(contract.RUN_FILE, f"{exc}; the server does not open it"))
            return False
        except OSError as exc:
            log.warning("evalsched: cannot preempt run %s: %s", run.id, exc)
            return False
        run.preempted_by = by
        grace = ctx.config.preempt_grace_s
        holder = self._job_holder(by)
        for_whom = contract.run_named(by, holder.name) if holder.kind == "run" else f"lease {by}"
        ctx.table.set_reason(
            run,
            contract.Why(
                contract.PREEMPTING,
                f"stops at its next episode boundary to make room for {for_whom} (signalled after {grace:g} s)",
                arg=by,
                holders=[holder],
            ),
        )
        self._preempt_timers[run.id] = ctx.loop.call_later(grace, self._preempt_overdue, run.id)
        return True

    def _preempt_overdue(self, run_id: str) -> None:
        self._preempt_timers.pop(run_id, None)
        run = self.ctx.table.get(run_id)
        if run is None or run.terminal or run.preempted_by is None:
            return
        log.warning("evalsched: run %s did not stop within preempt_grace_s; signalling it", run_id)
        self.launcher.terminate(run_id, self.ctx.config.cancel_grace_s)

    # ------------------------------------------------------------------ operations

    async def cancel(self, run: Run) -> None:
        run.cancel_requested = True
        # Not started yet, it ends now, not once it starts: waiting for its model host or cgroup
        # (that start, when it comes, sees the run ended and drops what it made), or asked of a
        # zygote (withdrawn: its request dropped, or the spare given it killed).
        starting = self._starting.get(run.id)
        waiting = starting is not None and not starting.done()  # (a done one may have started it)
        pending = None if waiting else self.launcher.withdraw(run.id)
        # No process of it anywhere (its start waits for the last attempt's clean-up): ends now too.
        unstarted = run.starting and run.id not in self.launcher.running and not self.launcher.is_pending(run.id)
        if waiting or pending is not None or unstarted:
            self._handover.pop(run.id, None)
            if pending is not None:
                self._drop_cgroup(pending.cgroup)
            self.ctx.table.finish(
                run,
                CANCELLED,
                contract.cancelled_reason(run.cancelled_by, "before it started"),
            )
            return
        grace = self.ctx.config.cancel_grace_s
        if self.launcher.terminate(run.id, grace):
            # Running until its process has stopped: the record says it is ending, and how. (The
            # SIGKILL may come sooner: a timeout's or a preemption's signal set it first.)
            due = self.launcher.kill_due_in(run.id)
            left = round(grace if due is None else due, 1)
            at = datetime.now(UTC) + timedelta(seconds=left)
            self.ctx.table.set_reason(
                run,
                contract.cancelling_why(
                    run.cancelled_by,
                    f"SIGTERM sent to its process group; SIGKILL if it still runs in {left:g} s, at {at:%H:%M:%S} UTC",
                ),
            )

    def _job_holder(self, job_id: str) -> contract.Holder:
        """The waiting job a run is preempted for, as a holder: a run (named), else a lease."""
        waiting = self.ctx.table.get(job_id)
        if waiting is not None:
            return contract.Holder("run", job_id, waiting.record["name"])
        return contract.Holder("lease", job_id)

    def kill_run(self, run: Run, reason: str) -> bool:
        if run.terminal or run.kill_reason is not None:
            return False
        run.kill_reason = reason
        return self.launcher.kill_now(run.id)

    def recover(self, run: Run, done: bool) -> None:
        table = self.ctx.table
        pid, create_time = run.record.get("pid") or 0, run.record.get("pid_create_time")
        if not done:
            if run.record["detach"] and is_same_process(pid, create_time, alive_only=True):
                self._adopt(run, pid, create_time)
                return
            # ``done`` is from the scan: the run may have finished since (``_DONE`` is written
            # before it exits, and a detached run goes on while the server starts).
            done = self.ctx.store.done_exists(run.id)
        if done:
            # The run finalized itself while no server was watching: its verdict stands.
            verdict = table.conclude(run, run.record.get("exit_code"))
            if verdict is not None:
                table.finish(run, *verdict, done_on_disk=True)
            else:
                table.finish(run, *self._judge_exit(run, run.record.get("exit_code")))
            return
        # (Its cgroup is found through its process, while that lives; those of runs whose process
        # is gone are removed with every other stale one: ``recovered``.)
        alive = is_same_process(pid, create_time)
        stale = self.cgroups.existing(run.id, pid if alive else None) if self.cgroups is not None else None
        # Killed now, before its record says anything of it (its pid is checked again at the
        # signal), and waited for with every other run recovered so, once all are known and
        # before anything starts (``recovered``): each wait overlaps the others'. So is the
        # search of the process table for its escapes (each search lists every process of the
        # host).
        if alive:
            signalled = kill_stale_group(pid, create_time)
            if signalled:
                self._stale_groups[run.id] = (pid, create_time)
            elif signalled is False:
                log.warning("run %s: its process %d, left by an earlier server, is not ours to kill", run.id, pid)
        if stale is not None:
            self._stale_cgroups.append(stale)  # everything it held: the setsid'd, environment-less descendants too
        else:
            self._escapes_to_search[run.id] = create_time or 0.0
        why = (
            "the detached run died without finishing while no server watched it"
            if run.record["detach"]
            else "the server died or shut down while it ran"
        )
        if self.ctx.config.auto_resume:
            if table.requeue(run, restart_plan(run.record, why), quiet=True):
                return
        table.finish(run, ABORTED, contract.reason(contract.SERVER_RESTART, why))

    def _adopt(self, run: Run, pid: int, create_time: float | None) -> None:
        """A detached run still running from an earlier server: followed again, its resources
        held, its timeout counted from its start."""
        cgroup = self.cgroups.existing(run.id, pid) if self.cgroups is not None else None
        self._clear_stop(run)  # a preemption the dead server asked for is no one's any more
        self.launcher.adopt(run.id, pid, create_time, cgroup)
        if cgroup is not None:
            self._cgroups[run.id] = cgroup
        started = parse_timestamp(run.record.get("started_at"))
        run.started_ts = started
        timeout = run.spec.get("timeout_s")
        if timeout:
            left = max(0.0, started + timeout - time.time())
            self._timeouts[run.id] = self.ctx.loop.call_later(left, self._on_timeout, run.id)
        log.info("evalsched: re-attached detached run %s (pid %d)", run.id, pid)
        # A detached run whose process ended between the look above and the pidfd is noticed now.
        self.launcher.poll()

    async def reconcile(self) -> None:
        self.launcher.poll()
        if self.zygotes is not None:
            self.zygotes.reconcile()
        self._reclaim_namespace_when_idle()

    def _idle(self) -> bool:
        """None of this server's runs lives, and none has ended for ``QUIET_BEFORE_RECLAIM_S``:
        runs of a few milliseconds each leave the server without a live run most of the time,
        and a reclaim there, which can sleep in the kernel for a second, made every later run's
        clean-up wait for it."""
        if self.launcher.running or self._concluding or self._starting:
            return False
        return time.monotonic() - self._last_cgroup_end >= QUIET_BEFORE_RECLAIM_S

    def _reclaim_namespace_when_idle(self) -> None:
        """Once ``NAMESPACE_RECLAIM_AFTER`` runs with a cgroup have ended and the server is idle
        (``_idle``): the namespace's memory reclaimed in the pool's thread, which frees the
        removed cgroups still held by a page (``Cgroups.reclaim_namespace``)."""
        if self._ended_since_reclaim < NAMESPACE_RECLAIM_AFTER or self.pool is None or not self._idle():
            return
        self._ended_since_reclaim = 0
        try:
            self.ctx.loop.run_in_executor(self.pool.janitor, self.pool.cgroups.reclaim_namespace)
        except RuntimeError:  # (the pool is closed: the server stops)
            pass

    async def stop(self) -> None:
        """Shutdown: running runs are killed and end ``aborted`` (rule 4), or ``cancelled`` where a
        cancel was waiting out its grace period. Runs admitted but not started (waiting for their
        model host) lose nothing: they go back to the queue."""
        table = self.ctx.table
        self._stopping = True
        # Warm starts handed to a spare and not started: their cgroups go once the zygotes have.
        pending, self._handover = list(self._handover.values()), {}
        # A detached run whose cancel is waiting out its grace period ends now, as the others do:
        # left running, it would be re-attached by a server that knows nothing of the cancel.
        cancelling = {run_id for run_id in self.launcher.running if _cancelling(table.get(run_id))}
        detached = {
            c.name
            for run_id, c in self._cgroups.items()
            if run_id in self.launcher.running and run_id not in cancelling and _detached(table.get(run_id))
        }
        for run_id, task in list(self._starting.items()):
            task.cancel()
            run = table.get(run_id)
            if run is not None and not run.terminal:
                table.update(run, state=QUEUED, reason=None, devices=[], started_at=None)
        why = "the server shut down while it ran"
        for run_id in self.launcher.kill_all(also=cancelling):  # other detached runs go on
            run = table.get(run_id)
            if run is None:
                continue
            if run.starting:  # asked of a zygote, never started: it loses nothing
                table.update(run, reason=None, devices=[])
                continue
            if run.cancel_requested:  # cancelled, its grace period under way: ended as asked, never resumed
                table.finish(run, CANCELLED, contract.cancelled_reason(run.cancelled_by))
                continue
            if self.ctx.config.auto_resume:
                if table.requeue(run, restart_plan(run.record, why), quiet=True):
                    continue
            table.finish(run, ABORTED, contract.reason(contract.SERVER_RESTART, why))
        if self.zygotes is not None:
            self.zygotes.close()  # after the runs: a zygote's end is its runs' end (and its spares')
        if self._concluding:  # exits whose figures are being read: concluded before we stop
            await asyncio.gather(*list(self._concluding.values()), return_exceptions=True)
        # In a thread: the removals still queued (tens after a churn of short runs, each a
        # reclaim that can sleep 100 ms in the kernel) held the event loop, so the whole server.
        await self.ctx.loop.run_in_executor(None, self._release_cgroups, pending, detached)

    def _release_cgroups(self, pending: list[RunCgroup], detached: set[str]) -> None:
        """At the stop, in a thread: the cgroups of the warm starts not started, the removals
        under way, the spares' cgroups and the unused ones; then the namespace."""
        if self.pool is not None:
            for cgroup in pending:
                self.pool.discard(cgroup)
            self.pool.close()  # the removals under way, the spares' cgroups, the unused ones
            # What a spare forked as the zygote ended made (the server never heard of it).
            _remove_stale_cgroups(self.pool.cgroups, self.pool.cgroups.stale_names(detached, own=True))
        if self.cgroups is not None and self.cgroups.enabled:
            self.cgroups.remove_namespace()  # only if no run cgroup is left in it

    def observed_targets(self) -> dict[str, ObservedTarget]:
        return {run_id: ObservedTarget(pid, self._cgroups.get(run_id)) for run_id, pid in self.launcher.running.items()}

    async def recovered(self) -> None:
        """After recovery, before any run starts (a new attempt's processes carry the same run
        id; admission opens only once this returns): the recovered runs' process groups, killed
        as each was recovered, are waited for together (their leaders, ``STALE_KILL_WAIT_S`` in
        all); their cgroups are emptied and removed, several at once (each may wait for a process
        slow to die); what those without a cgroup left outside their process groups is killed,
        in one search of the process table. Any other cgroup an earlier server left that holds a
        process is emptied with them; the empty ones are removed later, in the pool's thread.
        These waits are a thread's, not the event loop's: a process stuck in an uninterruptible
        wait (a GPU driver's teardown) costs them seconds, and the whole Jupyter server (its
        kernels, its other extensions) would stand still meanwhile. A failure of one step is
        logged and the next one goes on: the server starts all the same."""
        groups, self._stale_groups = self._stale_groups, {}
        cgroups, self._stale_cgroups = self._stale_cgroups, []
        searched, self._escapes_to_search = self._escapes_to_search, {}
        own = {cgroup.name for cgroup in self._cgroups.values()}  # (adopted runs': kept)
        try:
            stuck = await self.ctx.loop.run_in_executor(
                None, _clean_up_after_earlier_server, self.cgroups, groups, cgroups, searched, own
            )
        except Exception:  # (a bug of ours: the server starts all the same)
            log.exception("cleaning up after the runs of an earlier server failed")
            stuck = []
        if stuck and self.pool is not None:
            self.pool.linger(stuck)  # (tried again with the pool's, not left until the stop)
        if self.cgroups is None or not self.cgroups.enabled or self._stopping:
            return  # (stopping: the stop removes what is stale)
        # Those of this server (made ahead, and its adopted runs') are kept, and those lingering.
        keep = own | {cgroup.name for cgroup in stuck}
        stale = self.cgroups.stale_names(keep)
        if stale and self.pool is not None:
            # (In the pool's thread: shutdown waits for it.)
            self.ctx.loop.run_in_executor(self.pool.janitor, _remove_stale_cgroups, self.cgroups, stale, self.pool)

    @property
    def mode(self) -> dict[str, object]:
        warm: dict[str, object] = (
            self.zygotes.status() if self.zygotes is not None else {"enabled": False, "refused": None, "zygotes": []}
        )
        if self.cgroups is None:
            return {
                "cgroups": {"mode": "none", "memory": False, "kill": "none", "detail": "cgroups are off"},
                "warm_start": warm,
            }
        return {"cgroups": self.cgroups.status(), "warm_start": warm}


def _detached(run: Run | None) -> bool:
    return run is not None and bool(run.record["detach"])


def _cancelling(run: Run | None) -> bool:
    return run is not None and not run.terminal and run.cancel_requested


class ExitReads(NamedTuple):
    peak_mb: int | None  # the run's memory peak, None where not known
    oom_kills: int  # how many of its processes the kernel OOM-killed
    summary: FinalSummary


def _exit_reads(cgroup: RunCgroup, store: RunStore, run_id: str) -> ExitReads:
    """What a run's end is judged on, read off the loop once its process is gone."""
    return ExitReads(cgroup.memory_peak_mb(), cgroup.oom_kills(), FinalSummary.read(store, run_id))


def _clean_up_after_earlier_server(
    namespace: Cgroups | None,
    groups: dict[str, tuple[int, float | None]],
    cgroups: list[RunCgroup],
    searched: dict[str, float],
    own: set[str],
) -> list[RunCgroup]:
    """``LocalExecutor.recovered``'s waits, in a thread: the recovered runs' killed process
    groups waited for, their cgroups and any other cgroup of an earlier server that holds a
    process emptied and removed, what the runs without a cgroup left searched for and killed.
    Returns the cgroups that would not go."""
    try:
        left = set(wait_stale_gone(list(groups.values()))) if groups else set()
        for run_id, (pid, _) in groups.items():
            if pid in left:
                log.warning(
                    "run %s: its process %d, left by an earlier server, is still there after SIGKILL", run_id, pid
                )
    except Exception:
        log.exception("waiting for the processes runs of an earlier server left failed")
    # Any other cgroup the earlier server left that holds a process may be a run's whose
    # record never said it ran (its `running` write refused: a full disk), queued again by
    # this start: emptied now too, in the same pass, or that run would run twice at once.
    held: list[RunCgroup] = []
    if namespace is not None and namespace.enabled:
        try:
            known = {cgroup.name for cgroup in cgroups} | own
            held = namespace.holding_processes([n for n in namespace.stale_names() if n not in known])
        except Exception:
            log.exception("looking for processes in the cgroups an earlier server left failed")
        if held:
            log.warning(
                "evalsched: killing what %d cgroup(s) an earlier server left hold: %s",
                len(held),
                ", ".join(c.name for c in held),
            )
    stuck: list[RunCgroup] = []
    try:
        stuck = _remove_all([*cgroups, *held])
    except Exception:
        log.exception("removing the cgroups runs of an earlier server left failed")
    try:
        kill_escaped_all(searched)
    except Exception:  # a surprise in /proc must not stop the server's start
        log.exception("searching for what runs %s left behind failed", sorted(searched))
    return stuck


def _remove_all(cgroups: list[RunCgroup]) -> list[RunCgroup]:
    """Empty and remove these cgroups, several at once (a thread each, up to 8) where there are
    several and threads can be had: each may wait for a process slow to die. Returns those that
    would not go."""
    if len(cgroups) > 1:
        try:
            with ThreadPoolExecutor(min(len(cgroups), 8), thread_name_prefix="evalsched-recovery") as pool:
                gone = list(pool.map(RunCgroup.remove, cgroups))
            return [cgroup for cgroup, ok in zip(cgroups, gone, strict=True) if not ok]
        except RuntimeError:  # no thread to be had (the server's pids.max): one after another
            log.warning("no threads to remove %d cgroups at once; removing them one by one", len(cgroups))
    return [cgroup for cgroup in cgroups if not cgroup.remove()]


def _remove_stale_cgroups(cgroups: Cgroups, names: list[str], pool: CgroupPool | None = None) -> None:
    """Kill what is left in these cgroups of an earlier server (or of this one, at its stop) and
    remove them. One whose process would not die within the kill's wait is not killed and
    waited for a second time by its removal: it goes to ``pool``'s lingering ones (in the pool's
    thread), to be tried again without a wait, or, at the stop, is left with the namespace."""
    for name in names:
        stale = cgroups.named(name)
        if stale is None:
            continue
        pids = stale.kill()
        if pids:
            log.warning("evalsched: killed %d process(es) left in the stale cgroup %s", len(pids), name)
        if stale.holds_processes():  # (stuck: an uninterruptible wait; kill() said so)
            if pool is not None:
                pool.lingering.append(stale)
            continue
        stale.remove()
