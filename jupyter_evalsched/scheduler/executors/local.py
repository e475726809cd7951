"""Runs as subprocesses of this server: ``python -m jupyter_evalsched.runner --run-dir DIR``.

The run gets its devices, its environment and the URLs of the shared models it named, starts in
a new session, dies with the server (rule 2), and its exit is noticed at once (pidfd). Its end is
judged from its own files first (it finalized: succeeded, or failed by an exception), then from
how the process ended (cancelled, timed out, killed by a signal, exited early).
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys

from ... import contract
from ...contract import ABORTED, CANCELLED, FAILED, QUEUED
from ...store import RunFileError
from ..environment import run_environment
from ..launcher import Launcher, SpawnError, kill_escaped, kill_stale_group, process_create_time, signal_name
from ..runs import Run
from ..shared import ModelUnavailable, NoSharedModels, SharedModels
from . import Executor, ExecutorContext

log = logging.getLogger("jupyter_evalsched")


class LocalExecutor(Executor):
    name = "local"
    uses_ledger = True

    def __init__(
        self, models: SharedModels | None = None, python: str = sys.executable, notify_exits: bool = True
    ) -> None:
        self.models: SharedModels = models if models is not None else NoSharedModels()
        self.python = python
        self.launcher = Launcher(self._on_exit, notify_exits=notify_exits)
        self._timeouts: dict[str, asyncio.TimerHandle] = {}
        self._starting: dict[str, asyncio.Task[None]] = {}  # admitted runs waiting for their model host

    def bind(self, ctx: ExecutorContext) -> None:
        super().bind(ctx)
        self.launcher.bind(ctx.loop)
        ctx.table.on_end(self._forget)

    # ------------------------------------------------------------------ start

    def launch(self, run: Run) -> None:
        if run.record["models"]:
            # The model host may need starting: the run waits for it (resources held), visibly.
            self.ctx.table.update(run)
            task = asyncio.ensure_future(self._launch_with_models(run))
            self._starting[run.id] = task
            task.add_done_callback(lambda _: self._starting.pop(run.id, None))
        else:
            self._spawn(run, {})

    async def _launch_with_models(self, run: Run) -> None:
        table = self.ctx.table
        try:
            urls = await self.models.urls_for(list(run.record["models"]))
        except ModelUnavailable as exc:
            table.finish(run, FAILED, contract.reason(contract.MODEL_UNAVAILABLE, str(exc), limit=2000))
            return
        except Exception as exc:
            table.finish(run, FAILED, contract.reason(contract.EXCEPTION, f"shared model host unavailable: {exc}"))
            return
        if run.terminal:
            return
        if run.cancel_requested:
            table.finish(
                run,
                CANCELLED,
                contract.reason(contract.CANCELLED_REASON, "cancelled through the API before it started"),
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
        )
        try:
            ctx.store.write_shared_urls(run.id, urls)
            proc = self.launcher.spawn(
                run.id,
                [self.python, "-m", "jupyter_evalsched.runner", "--run-dir", str(ctx.store.run_dir(run.id))],
                cwd=run.spec["cwd"],
                env=env,
                stdout=ctx.store.log_path(run.id, "stdout"),
                stderr=ctx.store.log_path(run.id, "stderr"),
            )
        except (SpawnError, OSError) as exc:
            # A run admitted but not started must not hold its resources.
            ctx.table.finish(run, FAILED, contract.reason(contract.EXCEPTION, f"could not start the run: {exc}"))
            return
        timeout = run.spec.get("timeout_s")
        if timeout:
            self._timeouts[run.id] = ctx.loop.call_later(timeout, self._on_timeout, run.id)
        ctx.table.update(run, pid=proc.pid, pid_create_time=process_create_time(proc.pid))

    # ------------------------------------------------------------------ end

    def _on_exit(self, run_id: str, code: int) -> None:
        table = self.ctx.table
        run = table.get(run_id)
        if run is None or run.terminal:
            return
        with table.deferring_writes():
            run.record["exit_code"] = code
            verdict = table.conclude(run, code)
            if verdict is not None:
                table.finish(run, *verdict, done_on_disk=True)
            else:
                table.finish(run, *self._judge_exit(run, code))

    def _judge_exit(self, run: Run, code: int | None) -> tuple[str, str]:
        """How a run that did not finalize itself ended."""
        if run.cancel_requested:
            return CANCELLED, contract.reason(contract.CANCELLED_REASON, "cancelled through the API")
        if run.timed_out:
            return FAILED, contract.reason(contract.TIMEOUT, f"ran longer than timeout_s={run.spec.get('timeout_s')}")
        if code is not None and code < 0:
            return FAILED, contract.reason(
                contract.SIGNAL, "the run process was killed by a signal", arg=signal_name(code)
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
        timer = self._timeouts.pop(run.id, None)
        if timer is not None:
            timer.cancel()

    # ------------------------------------------------------------------ operations

    async def cancel(self, run: Run) -> None:
        run.cancel_requested = True
        # False while the run waits for its model host: _launch_with_models then cancels it.
        self.launcher.terminate(run.id, self.ctx.config.cancel_grace_s)

    def recover(self, run: Run, done: bool) -> None:
        table = self.ctx.table
        if done:
            # The run finalized itself while no server was watching: its verdict stands.
            verdict = table.conclude(run, run.record.get("exit_code"))
            if verdict is not None:
                table.finish(run, *verdict, done_on_disk=True)
            else:
                table.finish(run, *self._judge_exit(run, run.record.get("exit_code")))
            return
        kill_stale_group(run.record.get("pid") or 0, run.record.get("pid_create_time"))
        kill_escaped(run.id, run.record.get("pid_create_time") or 0.0)
        table.finish(
            run, ABORTED, contract.reason(contract.SERVER_RESTART, "the server died or shut down while it ran")
        )

    async def sweep(self) -> None:
        self.launcher.poll()

    async def stop(self) -> None:
        """Shutdown: running runs are killed and end ``aborted`` (rule 4). Runs admitted but not
        started (waiting for their model host) lose nothing: they go back to the queue."""
        table = self.ctx.table
        for run_id, task in list(self._starting.items()):
            task.cancel()
            run = table.get(run_id)
            if run is not None and not run.terminal:
                table.update(run, state=QUEUED, reason=None, devices=[], started_at=None)
        for run_id in self.launcher.kill_all():
            run = table.get(run_id)
            if run is not None:
                table.finish(
                    run, ABORTED, contract.reason(contract.SERVER_RESTART, "the server shut down while it ran")
                )

    def pids(self) -> set[int]:
        return self.launcher.running_pids
