"""The per-host scheduler: a façade over submission, admission, observation and the run table.

``Scheduler`` starts and stops the rooms, recovers the runs directory, and answers the read
views (the queue, the ledger, a run's files, the status). The rooms, one concept each:

* ``submission.Submissions``: checks that need the host, ``auto`` VRAM, idempotency, sweeps;
* ``admission.Admission``: the queue, when a decision is made (``policy.decide``, pure) and
  carrying it out through ``_Carrier`` (launch, grant, preempt, waiting);
* ``observation.Observer``: what processes use, runs' peaks, enforcement, unmanaged VRAM;
* ``runs.RunTable``: a record's life from submission to its terminal state.

All state lives on the event-loop thread; handlers call the methods directly.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from .. import contract
from ..contract import ABORTED, CANCELLED, FAILED, LEASE_QUEUED, QUEUED, RUNNING, TERMINAL_STATES
from ..schemas import EvalSpec, LeaseRequest
from ..store import FoundRun, RunFileError, RunStore, StoreError
from . import attempts, policy
from .admission import Admission
from .cgroups import Cgroups
from .comparisons import Comparisons
from .config import SchedulerConfig
from .errors import SpecRejected, StateConflict, Unavailable, UnknownRun, store_failure
from .executors import Executor, ExecutorContext
from .executors.local import LocalExecutor
from .gpus import GpuProbe
from .host_tenant import HostTenant
from .kernels import KernelInfo, OwnKernel
from .leases import Lease, LeaseTable, refused_holder
from .ledger import Capacity, DeviceBudget, capacity, device_budgets, ledger_view
from .observation import Observer, describe_holder
from .runs import Listener, Run, RunScheduling, RunTable, parse_timestamp, record_from_disk, slim_spec
from .shared import NoSharedModels, SharedModels
from .submission import Submissions, dumps
from .writer import RunWriter

log = logging.getLogger("jupyter_evalsched")
# How long a stop waits for the sweep submissions under way to end: each ends once its chunk under
# way (64 directories at most) is written, then cancels the runs it made, their records one batch
# of the writer's thread.
SWEEPS_END_WAIT_S = 10.0
# How long a stop waits, off the event loop, for the I/O threads' calls under way (an sbatch or
# scancel on a slurmctld that does not answer, a write to a stalled disk): the server's loop keeps
# turning meanwhile, and a stop's callers' own caps can fire. Past it, the stop goes on.
IO_END_WAIT_S = 10.0

# Serialised queue views kept (one per limit asked), and their bytes at most (the latest is kept
# whatever its size).
QUEUE_CACHE_ENTRIES = 4
QUEUE_CACHE_BYTES = 16 * 2**20

__all__ = ["Scheduler", "StatusView"]


@dataclass(frozen=True)
class StatusView:
    """What the scheduler has in force, for ``GET /evalsched/status`` and the doctor."""

    runs_dir: str
    started: bool
    runs: int
    counts: dict[str, int]
    broken: dict[str, str]  # run directories recovery could not read: id -> why
    enforce_vram: str
    vram_tolerance: float
    default_executor: str
    executors: tuple[str, ...]
    gpu_source: str
    probe: GpuProbe  # the doctor's host checks ask it again
    local_mode: dict[str, object] | None  # the local executor's (cgroups, warm starts), if enabled
    local_cgroups: Cgroups | None  # the local executor's, if any
    host_ledger: dict[str, Any] | None  # the host ledger link's status, when host_ledger is set


def _call_name(fn: Callable[..., Any], args: tuple[Any, ...]) -> str:
    """What a stop's warning calls a call: its function and what it was for (a run's id, a job
    id, a few words of a string argument), e.g. ``SlurmExecutor._hand_over(<run id>)``."""
    inner = getattr(fn, "func", fn)  # (a functools.partial)
    name = getattr(inner, "__qualname__", None) or repr(inner)
    said = []
    for arg in args[:3]:
        if isinstance(getattr(arg, "id", None), str):
            arg = arg.id  # (a run)
        if isinstance(arg, (str, int)) and not isinstance(arg, bool):
            said.append(str(arg)[:40])
        elif isinstance(arg, (list, tuple, set, dict)):
            said.append(f"{len(arg)} item(s)")
    return f"{name}({', '.join(said)})"


class _IoPool(ThreadPoolExecutor):
    """The I/O threads, each call under way known by name: the stop waits for them off the loop,
    with a bound, and names those it stopped waiting for."""

    def __init__(self) -> None:
        super().__init__(max_workers=8, thread_name_prefix="evalsched-io")
        # call -> its function and arguments, named only if a stop stops waiting for it (a done
        # callback removes it)
        self.under_way: dict[Future[Any], tuple[Callable[..., Any], tuple[Any, ...]]] = {}

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        try:
            future = super().submit(fn, *args, **kwargs)
        except RuntimeError:  # (shut down: a request still served on a kept connection, say)
            raise Unavailable("the scheduler is stopping; retry once the server is back") from None
        self.under_way[future] = (fn, args)
        future.add_done_callback(lambda f: self.under_way.pop(f, None))
        return future

    async def ended(self, timeout: float) -> list[str]:
        """No new call; those under way (queued ones included) waited for, ``timeout`` at most,
        without holding the loop. The names of those still under way, if any."""
        self.shutdown(wait=False)
        futures = [asyncio.wrap_future(f) for f in list(self.under_way)]
        for future in futures:  # (their callers read their errors: these copies' are no news)
            future.add_done_callback(lambda f: f.cancelled() or f.exception())
        if futures:
            await asyncio.wait(futures, timeout=timeout)
        return sorted(
            f"{_call_name(*call)} ({'running' if f.running() else 'queued'})"
            for f, call in list(self.under_way.items())
        )


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
        self.writer = RunWriter(self.store)  # new run directories and terminal records, off the loop
        self.table = RunTable(self.store, self.writer)
        self.leases = LeaseTable(self.store, emit=self.table.emit)
        self.executors: dict[str, Executor] = {e.name: e for e in (executors or [LocalExecutor(self.models)])}
        self._loop: asyncio.AbstractEventLoop | None = None
        self.context: ExecutorContext | None = None  # what executors get; set by start()
        self._stopping = False  # (stop() or halt() has begun)
        self._io = _IoPool()
        self._cancelled_sweeps_write = asyncio.Lock()  # (cancel_sweep: its list written one at a time)
        # Comparisons read whole episode logs: in worker processes of their own (their parsing
        # would hold this interpreter's GIL against the event loop), a bounded number at once.
        self.comparisons = Comparisons(self.table, self.store)
        self._tasks: list[asyncio.Future[None]] = []
        self._budgets: list[DeviceBudget] = []
        self._queue_cache: dict[int | None, tuple[int, bytes, float]] = {}  # limit -> (version, JSON, when)
        self._started = False
        self.primary_info: dict | None = None  # which server schedules for this host (set by the app)
        self.broken: dict[str, str] = {}  # run directories recovery could not read: id -> why
        # Admission first: its run-table listeners come before the executors' (bound at start).
        self.admission = Admission(config, self.table, self.leases, self.executors, _Carrier(self), self._capacity)
        # The shared models' VRAM is the ledger's: a model loads once admitted (Admission.load_model).
        self.admission.model_memory = self.models.memory
        self.models.bind_ledger(self._admit_model)
        self.observer = Observer(
            config,
            probe,
            self.models,
            self.table,
            self.leases,
            self.executors,
            lambda: self._budgets,
            self._unmanaged_changed,
        )
        self.submissions = Submissions(
            config,
            self.store,
            self.table,
            self.executors,
            self.models,
            self.admission,
            self._empty_capacity,
            self._require_loop,
            self.writer,
        )
        self.leases.on_end(self._on_lease_ended)
        # A host shared by several users: the host ledger grants every GPU placement first.
        self.host: HostTenant | None = None
        self._model_keys: dict[str, str] = {}  # shared model -> the key of its host ledger grant
        if config.host_ledger:
            self.host = HostTenant(config.host_ledger, self._host_changed)
            self.admission.host_gate = self.host.gate
            self.admission.host_demand = self.host.link.set_demand  # the ledger's fair share
            self.submissions.host_never = self.host.never
            self.table.subscribe(self._host_run_changed)
            for hook in (self.table.on_exit, self.table.on_end):
                hook(self._host_release_run)
            self.table.on_requeue(lambda run, plan: self._host_release_run(run))

    @property
    def own_kernels(self) -> Callable[[], Awaitable[list[OwnKernel]]] | None:
        """This server's kernels (their pids and notebooks), for naming GPU processes; set by the app."""
        return self.observer.own_kernels

    @own_kernels.setter
    def own_kernels(self, value: Callable[[], Awaitable[list[OwnKernel]]] | None) -> None:
        self.observer.own_kernels = value

    # ----------------------------------------------------------------- life cycle

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self.admission.bind(self._loop)
        self.store.ensure()
        self.writer.bind(self._loop)
        if self.host is not None:
            await self.host.start()
        self._budgets = self._compute_budgets()
        self.context = ExecutorContext(
            table=self.table, store=self.store, config=self.config, loop=self._loop, io=self._io
        )
        for executor in self.executors.values():
            executor.bind(self.context)
        found = await self._loop.run_in_executor(None, self._read_runs_dir)
        # Admission opens below, once every executor's ``recovered`` has returned: no run starts
        # before (a resumed attempt's processes carry the run id that ``recovered`` searches for).
        self._recover(found)
        for executor in self.executors.values():
            try:
                await executor.recovered()
            except Exception:  # (a bug of ours: logged, and the others clean up all the same)
                log.exception("evalsched: the %s executor's clean-up after recovery failed", executor.name)
        await self.table.all_written()  # what recovery decided is on disk before the API answers
        leases = await self._loop.run_in_executor(None, self.store.read_leases)
        self.submissions.recovered_cancelled_sweeps(
            await self._loop.run_in_executor(None, self.store.read_cancelled_sweeps)
        )
        if self.admission.stopping:
            return  # stopped meanwhile (the server shut down as it started): it stays stopped
        self.leases.bind(self._loop)
        self.leases.recover(leases, max_ttl_s=self.config.max_lease_ttl_s)
        self.table.note_seq(max((lease.record["seq"] for lease in self.leases), default=0))
        if self.host is not None:
            self._host_adopt()
        self._started = self.admission.started = True
        self._tasks = [
            asyncio.ensure_future(self._reconcile_forever()),
            asyncio.ensure_future(self._watch_progress_forever()),
        ]
        self.admission.decide(now=True)

    def suspend(self, why: str) -> None:
        """Its runs directory was moved: every write refused (``RunStore.refuse_writes``), no
        admission. It stops no run (a run writes its own files by path, and ends at its next
        write); what their ends would write is refused too."""
        self.store.refuse_writes(why)
        self.admission.stop()

    def halt(self) -> None:
        """Admit nothing from now on: the first step of a stop, taken at once where the stop waits
        for a start under way (that start then ends unstarted, ``started`` False)."""
        self._stopping = True
        self.admission.stop()

    async def stop(self) -> None:
        """Shutdown: running runs are killed and end ``aborted`` (``cancelled`` where a cancel was
        waiting out its grace period); queued jobs stay queued, and so do runs admitted but not
        started yet. Admission stops first; then the sweep submissions under way are waited for
        (``SWEEPS_END_WAIT_S`` at most): each cancels the runs it made."""
        self._stopping = True
        self.admission.stop()
        # A sweep submission under way ends at its next chunk and cancels the runs it made: that
        # is written now, through the writer, not after it closes (on the loop, by path) or after
        # the runs directory's lock is released, when the next primary may have read them queued.
        if not await self.submissions.sweeps_ended(SWEEPS_END_WAIT_S):
            log.warning(
                "evalsched: a sweep submission did not end within %g s of the stop; stopping all the same",
                SWEEPS_END_WAIT_S,
            )
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            try:
                await task
            except (asyncio.CancelledError, Exception):
                pass
        self._tasks = []
        self.leases.stop()
        if self._loop is not None:
            for executor in self.executors.values():
                await executor.stop()
        if self.host is not None:
            await self.host.stop()
        # The terminal records still waiting (a large cascade's) are written by the writer's
        # thread as it ends, while the loop goes on: as long as the disk completes writes, but a
        # disk that hangs holds the stop ``IO_END_WAIT_S`` (then as long again for the I/O
        # threads below) at most. No request makes a run, nor starts an I/O call, meanwhile.
        self._started = False
        self._io.shutdown(wait=False)
        late = "the scheduler stopped; this write came too late"
        written = await self.writer.close_within(IO_END_WAIT_S)
        if written:
            self.table.flush_writes()  # (what was never queued: none where the writer ran)
        else:
            # The disk hangs: from now on nothing more is written, by the writer's thread when
            # it gets past its write, nor by a caller on the loop (it would hang there too).
            self.store.refuse_writes(late)
        left = await self._io.ended(IO_END_WAIT_S)
        if not written:
            left.insert(0, f"the run writer's thread (no write done for {IO_END_WAIT_S:g} s)")
        if left:
            # Those calls end on their own later: what they would write is refused, never written
            # after the runs directory is released (another server may hold it by then).
            self.store.refuse_writes(late)
            log.warning(
                "evalsched: I/O calls under way did not end within %g s of the stop: %s; stopping all the "
                "same (anything they would write is refused)",
                IO_END_WAIT_S,
                ", ".join(left),
            )
        self.comparisons.close()
        if not left:
            # (Left open where a thread was given up on: a write of it relative to a descriptor
            # number that a later open reused would land in another directory.)
            self.store.close()
        # Nothing is written for this scheduler once it has stopped: not by a start that a stop
        # stopped waiting for (its recovery writes by path), nor by a thread given up on. (A
        # moved runs directory keeps its own reason.)
        if self.store.refused is None:
            self.store.refuse_writes(late)

    def _compute_budgets(self) -> list[DeviceBudget]:
        if self.host is not None:
            # The host ledger's devices and usable VRAM (the last seen while it is away; the
            # probe's until it was first seen: GPU work waits meanwhile).
            budgets = self.host.budgets()
            if budgets is not None:
                return budgets
        return device_budgets(
            self.probe.devices(),
            reserve_mb=self.config.reserve_vram_mb,
            usable_override={int(k): int(v) for k, v in self.config.usable_vram_mb.items()},
            env_usable_mb=self.config.default_usable_vram_mb,
        )

    async def _admit_model(self, name: str) -> None:
        """A model host's load waits here until the ledger admits the model's VRAM. Its callers
        share one load: one that goes away (a client that disconnects) cancels nobody else's."""
        await asyncio.shield(self.admission.load_model(name))

    def _capacity(self) -> Capacity:
        if self.host is not None:
            return self.host.capacity(self._budgets, self.config.cpu_slots, self.observer.unmanaged)
        return capacity(self._budgets, self.config.cpu_slots, self.observer.unmanaged)

    def _empty_capacity(self) -> Capacity:
        """The host with nothing on it: what can never fit does not fit here."""
        return capacity(self._budgets, self.config.cpu_slots, {})

    # ----------------------------------------------------------------- recovery

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
            except Exception as exc:  # (ValueError: not a record) whatever it is, that directory alone
                self.broken[f.run_id] = str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}"
        if self.broken:
            log.warning(
                "evalsched: %d run directories are broken and were left as they are (DELETE them through the "
                "API to remove them): %s",
                len(self.broken),
                "; ".join(f"{k}: {v}" for k, v in sorted(self.broken.items())[:20]),
            )
        usable.sort(key=lambda item: (item[1]["seq"], item[0].run_id))
        for f, record in usable:
            try:
                self._recover_found(f, record)
            except Exception as exc:
                # One run's files must never stop the server from starting: that run fails.
                log.exception("evalsched: cannot recover run %s", f.run_id)
                self._recovery_failed(f.run_id, exc)
        self.admission.recovered()  # now that every run is known
        if len(self.table):
            log.info(
                "evalsched: recovered %d runs (%d queued) from %s",
                len(self.table),
                self.admission.queued_count(),
                self.store.root,
            )

    def _recover_found(self, f: FoundRun, record: dict[str, Any]) -> None:
        run = Run(record=record, spec=f.spec or {}, submitted_ts=parse_timestamp(record["submitted_at"]))
        run.done_on_disk = f.done
        self.table.add(run)
        if record["idempotency_key"]:
            self.submissions.by_key[record["idempotency_key"]] = run.id
        if f.spec is None and not run.terminal:
            why = f"{f.spec_problem}: the run cannot start or be judged"
            self.table.finish(run, FAILED, contract.reason(contract.EXCEPTION, f"RunFileError: {why}"))
            return
        self._recover_run(run, f.done)

    def _recovery_failed(self, run_id: str, exc: Exception) -> None:
        why = f"the server could not recover the run: {type(exc).__name__}: {exc}"
        run = self.table.get(run_id)
        if run is None:
            self.broken[run_id] = why
            return
        try:
            if not run.terminal:
                self.table.finish(run, FAILED, contract.reason(contract.EXCEPTION, why))
        except Exception:
            log.exception("evalsched: cannot fail run %s either", run_id)

    def _recover_run(self, run: Run, done: bool) -> None:
        state = run.state
        if state in TERMINAL_STATES:
            if not done:
                self.table.ensure_done(run)  # every terminal run directory has _DONE
            return
        if state not in (QUEUED, RUNNING):
            log.warning("evalsched: run %s has unknown state %r; left as it is", run.id, state)
            return
        if run.why_code in (contract.PREEMPTING, contract.CANCELLING):
            # A preemption or cancel the dead server was carrying out is no one's any more (they
            # are kept in memory only), though a write of the record carried its reason to disk:
            # nothing is ending the run now (a re-attached detached run, a SLURM job).
            self.table.set_reason(run, None)
        executor = self.executors.get(run.executor)
        if executor is None:
            why = f"the {run.executor} executor is not enabled on this server any more"
            self.table.finish(run, ABORTED, contract.reason(contract.SERVER_RESTART, why))
        elif executor.uses_ledger and state == QUEUED:
            self.admission.recover_queued(run)
        else:
            if executor.uses_ledger:
                self.admission.recover_running(run)  # holds its resources until its end is recorded
            executor.recover(run, done)

    # ----------------------------------------------------------------- submission (submission.py)

    def validate_for_host(self, spec: EvalSpec) -> None:
        self.submissions.validate_for_host(spec)

    def resolve_auto_vram(self, spec: EvalSpec) -> tuple[EvalSpec, str]:
        return self.submissions.resolve_auto_vram(spec)

    async def submit(self, spec: EvalSpec, idempotency_key: str | None = None) -> tuple[dict[str, Any], bool]:
        """Validate, write the run directory, queue (``Submissions.submit``)."""
        self._require_started()
        return await self.submissions.submit(spec, idempotency_key)

    async def submit_sweep(
        self, spec: EvalSpec, sweep: Any, idempotency_key: str | None = None
    ) -> tuple[dict[str, Any], bool]:
        """One run per point of ``sweep`` (``Submissions.submit_sweep``)."""
        self._require_started()
        return await self.submissions.submit_sweep(spec, sweep, idempotency_key, self._cancel_all)

    def sweep_runs(self, sweep_id: str) -> list[Run]:
        return self.submissions.sweep_runs(sweep_id)

    def sweep_view(self, sweep_id: str) -> dict[str, Any]:
        return self.submissions.sweep_view(sweep_id)

    def list_sweeps(self, limit: int = 100) -> list[dict[str, Any]]:
        return self.submissions.list_sweeps(limit)

    async def cancel_sweep(self, sweep_id: str, by: str | None = None) -> dict[str, Any]:
        """Cancel the sweep's unfinished runs; finished ones stay as they are. Answers once the
        records of the runs it ended are on disk (the writer's thread writes them meanwhile):
        the sweep's view, each run with ``cancel_requested`` (signalled by a cancel, not ended
        yet: it shows ``running`` until it has stopped) and ``still_ending``, how many are."""
        self.sweep_runs(sweep_id)  # (an unknown sweep: a 404 before anything is written)
        # On disk first (a retry of its submission after a restart makes no more runs), one write
        # at a time, each of the list as it is then: two cancels' writes on two threads could
        # land the older list last. A disk that refuses it: a 503, and nothing is cancelled.
        async with self._cancelled_sweeps_write:
            cancelled = self.submissions.cancelled_with(sweep_id)
            try:
                await self._require_loop().run_in_executor(self._io, self.store.write_cancelled_sweeps, cancelled)
            except StoreError as exc:
                self.submissions.cancel_not_written(sweep_id)
                raise store_failure(exc) from exc
            self.submissions.sweep_cancelled(sweep_id)
        # Read now: a run its submission registered while the list was being written is one of
        # them (none can be registered from here on).
        runs = self.sweep_runs(sweep_id)
        await self._cancel_all(runs, by)
        view = self.sweep_view(sweep_id)
        ending = {run.id for run in runs if not run.terminal and run.cancel_requested}
        view["runs"] = [{**record, "cancel_requested": record["id"] in ending} for record in view["runs"]]
        view["still_ending"] = len(ending)
        return view

    async def _cancel_all(self, runs: list[Run], by: str | None = None) -> None:
        """Cancel the unfinished ones of ``runs``, then wait for the records of those that ended
        here: all of them together, one batch of the writer's thread, not a round trip each."""
        ended: list[str] = []
        for run in runs:
            if not run.terminal:
                await self._cancel(run, by)
                if run.terminal:
                    ended.append(run.id)
        for run_id in ended:
            await self.table.written(run_id)

    # ----------------------------------------------------------------- admission (admission.py)

    def request_admission(self) -> None:
        self.admission.request_admission()

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
        run.scheduling = RunScheduling.of(run.spec)
        try:
            self.table.requeue(run, attempts.resume_plan(run.record))
        except StoreError as exc:
            raise store_failure(exc) from exc
        return run.record

    def _on_lease_ended(self, lease: Lease) -> None:
        if self.host is not None:
            self.host.release(lease.id)  # its grant at the host ledger ends with it
        if not self._started or self.admission.stopping:
            return
        self.observer.account()  # what its process still holds is unmanaged again
        self.admission.lease_ended(lease)

    # ----------------------------------------------------------------- leases

    async def request_lease(self, request: LeaseRequest) -> dict[str, Any]:
        """A new lease, admitted at once when it fits (the answer says ``granted`` or ``queued``).
        SpecRejected when it can never fit, its pid may not hold a lease (``leases.refused_holder``)
        or, without a pid, its ``ttl_s`` is over ``max_lease_ttl_s`` (none: it gets that one);
        StateConflict when ``max_leases`` leases are live already."""
        self._require_started()
        ttl_s = request.ttl_s
        if request.pid is None:
            max_ttl = self.config.max_lease_ttl_s
            if ttl_s is None:
                ttl_s = max_ttl
            elif ttl_s > max_ttl:
                msg = (
                    f"a lease without a pid is held at most max_lease_ttl_s={max_ttl:g} s: "
                    "give a shorter ttl_s, or the pid of the process that uses the lease"
                )
                raise SpecRejected(f"ttl_s: {msg}", [{"loc": ["ttl_s"], "msg": msg, "type": "ttl_over_max"}])
        probe_job = policy.QueuedJob(
            id="-", seq=0, marginal_vram_mb=request.vram_mb, gpus=request.gpus, exclusive=request.exclusive_gpu, cpus=0
        )
        why = policy.never_fits(probe_job, self._empty_capacity())
        if not why and self.host is not None and probe_job.uses_gpu:
            host_why = self.host.never(request.vram_mb, request.gpus, request.exclusive_gpu, "lease")
            why = ("marginal_vram_mb", host_why) if host_why else None
        if why:
            field_name = {"marginal_vram_mb": "vram_mb"}.get(why[0], why[0])
            raise SpecRejected(
                f"{field_name}: can never fit on this host: {why[1]}",
                [{"loc": [field_name], "msg": f"can never fit on this host: {why[1]}", "type": "never_fits"}],
            )
        kernel: KernelInfo | None = None
        tree: set[int] = set()
        if request.pid is not None:
            refused = await self._require_loop().run_in_executor(self._io, refused_holder, request.pid)
            if refused is not None:
                kind, msg = refused
                raise SpecRejected(f"pid: {msg}", [{"loc": ["pid"], "msg": msg, "type": kind}])
            own = await self.own_kernels() if self.own_kernels is not None else []
            kernel, tree = await self._require_loop().run_in_executor(self._io, describe_holder, request.pid, own)
        # Checked after the awaits above, so that requests in flight together cannot pass it.
        max_leases = self.config.max_leases
        if len(self.leases.live()) >= max_leases:
            raise StateConflict(
                f"this server holds {max_leases} live leases (max_leases): release one "
                "(DELETE /evalsched/leases/{lease_id}) before asking for another"
            )
        try:
            lease = self.leases.request(
                vram_mb=request.vram_mb,
                gpus=request.gpus,
                exclusive_gpu=request.exclusive_gpu,
                priority=request.priority,
                pid=request.pid,
                ttl_s=ttl_s,
                label=request.label,
                seq=self.table.next_seq(),
                kernel_id=kernel.kernel_id if kernel else None,
                session_path=kernel.session_path if kernel else None,
            )
        except ValueError as exc:
            raise SpecRejected(f"pid: {exc}", [{"loc": ["pid"], "msg": str(exc), "type": "no_such_process"}]) from None
        except StoreError as exc:
            raise store_failure(exc) from exc
        # What its process holds already (as the last observation saw it) is absorbed by its grant.
        lease.holder_pids = frozenset(tree)
        lease.observed = self.observer.unmanaged_of(tree)
        self.admission.decide(now=True)
        return lease.record

    def get_lease(self, lease_id: str) -> Lease:
        lease = self.leases.get(lease_id)
        if lease is None:
            raise UnknownRun(
                f"no lease with id {lease_id!r} (it ended long ago, or never was): `jupyter evalsched leases` lists the live ones"
            )
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
            raise UnknownRun(
                f"no run with id {run_id!r} on this server (deleted, or never submitted here): `jupyter evalsched list` lists the runs"
            )
        return run

    async def cancel(self, run_id: str, by: str | None = None) -> dict:
        """Cancel a run; ``by`` (a key of ``contract.CANCELLED_BY``) says who asked, in its reason.
        Answers with its record, once on disk when the run ended here (a running one is signalled
        and ends when its process does)."""
        run = self.get(run_id)
        if run.terminal:
            raise StateConflict(f"run {run_id} already ended ({run.state}); nothing to cancel")
        await self._cancel(run, by)
        await self.table.written(run.id)
        return run.record

    async def _cancel(self, run: Run, by: str | None = None) -> None:
        if by is not None and run.cancelled_by is None:
            run.cancelled_by = by
        executor = self.executors.get(run.executor)
        # A queued ledger run that admission does not hold was made while the scheduler stopped
        # (it decides nothing then): not started, nor will it be; a sweep under way cancels it.
        unadmitted = (
            self.admission.stopping
            and executor is not None
            and executor.uses_ledger
            and run.state == QUEUED
            and not run.starting
        )
        if self.admission.withdraw(run) or executor is None or unadmitted:
            self.table.finish(run, CANCELLED, contract.cancelled_reason(run.cancelled_by, "while queued"))
        else:
            await executor.cancel(run)

    async def compare(self, run_ids: list[str] | None, sweep_id: str | None, baseline: str | None) -> bytes:
        """``GET /evalsched/compare``, its answer as JSON (``Comparisons.compare``)."""
        runs = self.comparisons.inputs(run_ids, sweep_id, baseline, self.sweep_runs, self.get)
        self._require_loop()
        return await self.comparisons.compare(runs, baseline)

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
            raise StateConflict(
                f"run {run_id} is a dependency of queued runs: {', '.join(dependents[:5])}; cancel them first, or delete it once they ended"
            )
        self.table.settle(run_id)  # its terminal record, if still waiting, first: then nothing more is written
        self._delete_directory(run_id)
        self.table.remove(run_id)
        if run.record["idempotency_key"]:
            self.submissions.by_key.pop(run.record["idempotency_key"], None)

    def _delete_directory(self, run_id: str) -> None:
        try:
            self.store.delete(run_id)
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise Unavailable(f"cannot delete run {run_id}: {exc.strerror or exc}") from exc

    async def on_disk(self, run_id: str | None = None) -> None:
        """Once the terminal record of ``run_id`` (of every run: None) that the writer's thread
        is writing is on disk: a record the API answers with is the one on disk."""
        if run_id is None:
            await self.table.all_written()
        else:
            await self.table.written(run_id)

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

    def queued_in_order(self, limit: int | None = None) -> list[Run]:
        return self.admission.queued_in_order(limit)

    def ledger(self) -> dict:
        leases = {lease.id: lease.record for lease in self.leases.granted()}
        if self.host is not None:  # a shared host: the other users' holdings by user name only
            own = self.host.own(self.observer.unmanaged)
            view = ledger_view(
                self._budgets,
                self.config.cpu_slots,
                self.admission.running_jobs(),
                own,
                leases,
                self.admission.model_loads(),
            )
            return self.host.ledger(view)
        return ledger_view(
            self._budgets,
            self.config.cpu_slots,
            self.admission.running_jobs(),
            self.observer.unmanaged,
            leases,
            self.admission.model_loads(),
        )

    def leases_in_order(self) -> list[Lease]:
        """Live leases: granted ones by grant, then queued ones in admission order."""
        return self.admission.leases_in_order()

    def queue_view(self, limit: int | None = None) -> dict:
        """The queue view; with ``limit``, ``queued`` holds the first ``limit`` runs in its order
        (``queued_total`` counts them all): a long queue costs a client only what it shows."""
        # First the runs starting (admitted, no process yet: queued until they have one), then
        # admission's order; runs of placing executors (SLURM) wait elsewhere: after ours.
        # One pass over the active runs, by their records: ten thousand queued are read often.
        starting: list[dict[str, Any]] = []
        elsewhere: list[dict[str, Any]] = []
        running: list[dict[str, Any]] = []
        in_admission = self.admission.is_queued
        for run in self.table.active():
            rec = run.record
            state = rec["state"]
            if state == RUNNING:
                running.append(rec)
            elif state == QUEUED:
                if run.starting:
                    starting.append(rec)
                elif not in_admission(rec["id"]):
                    elsewhere.append(rec)
        total = len(starting) + self.admission.queued_count() + len(elsewhere)
        wanted = None if limit is None else max(limit - len(starting), 0)
        queued = starting + [run.record for run in self.queued_in_order(wanted)] + elsewhere
        if limit is not None:
            del queued[limit:]
        return {
            "primary": self.primary_info,
            "queued": queued,
            "queued_total": total,
            "running": sorted(running, key=lambda r: r["started_at"] or ""),
            "ledger": self.ledger(),
            "leases": [lease.record for lease in self.leases_in_order()],
        }

    def queue_view_json(self, limit: int | None = None) -> bytes:
        """The queue view serialised, cached until the next change (GET /queue is polled), per
        ``limit`` (the few that clients use)."""
        now = time.monotonic()
        version = self.table.version + self.leases.version + self.observer.version
        cached = self._queue_cache.get(limit)
        # Also expire after a second: aging reorders the queue with time alone.
        if cached is not None and cached[0] == version and now - cached[2] < 1.0:
            self._queue_cache[limit] = self._queue_cache.pop(limit)  # the latest used last
            return cached[1]
        data = dumps(self.queue_view(limit))
        self._queue_cache.pop(limit, None)
        self._queue_cache[limit] = (version, data, now)  # the latest last
        # A few limits are in use (the panel's, the widgets'); a long queue's whole view is
        # megabytes: keep what fits, the least recently used going first.
        while len(self._queue_cache) > 1 and (
            len(self._queue_cache) > QUEUE_CACHE_ENTRIES
            or sum(len(entry[1]) for entry in self._queue_cache.values()) > QUEUE_CACHE_BYTES
        ):
            del self._queue_cache[next(iter(self._queue_cache))]
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

    def status_view(self) -> StatusView:
        """What the scheduler has in force (``GET /evalsched/status``, the doctor)."""
        local = self.executors.get("local")
        return StatusView(
            runs_dir=str(self.store.root),
            started=self._started,
            runs=len(self.table),
            counts=self.counts,
            broken=dict(self.broken),
            enforce_vram=self.config.enforce_vram,
            vram_tolerance=self.config.vram_tolerance,
            default_executor=self.config.default_executor,
            executors=tuple(self.executors),
            gpu_source=getattr(self.probe, "source", "nvml"),
            probe=self.probe,
            local_mode=local.mode if local is not None else None,
            local_cgroups=getattr(local, "cgroups", None),
            host_ledger=self.host.status() if self.host is not None else None,
        )

    @property
    def started(self) -> bool:
        """True once recovery has read the runs directory (and until stop())."""
        return self._started

    @property
    def stopping(self) -> bool:
        """``stop()`` (or ``halt()``, its first step) has begun."""
        return self._stopping

    @property
    def has_live_runs(self) -> bool:
        """Runs that are running, or handed to another system: JupyterHub must not cull us."""
        return len(self.table.active()) > self.admission.queued_count()

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

    # ----------------------------------------------------------------- the host ledger (host_tenant.py)

    def _host_changed(self) -> None:
        """The host ledger's view moved (a grant, a user, the connection): capacity and budgets
        with it, the jobs it refused looked at again."""
        self._budgets = self._compute_budgets()
        if self._started:
            self.admission.host_changed()
            self._unmanaged_changed()

    def _host_run_changed(self, event: dict[str, Any]) -> None:
        """A run's process exists: its grant is tied to it (no longer to this server's)."""
        if event.get("type") != "run" or self.host is None:
            return
        record = event["run"]
        if record["state"] == RUNNING and record.get("pid") and record["id"] in self.host.grants:
            self.host.retie(record["id"], int(record["pid"]))

    def _host_release_run(self, run: Run) -> None:
        if self.host is not None:
            self.host.release(run.id)

    def model_grant_key(self, name: str) -> str:
        """The host ledger's key of the shared model's grant: one per load, so that a release
        still on its way (the ledger away) never meets the next load's grant."""
        if name not in self._model_keys:
            self._model_keys[name] = f"model-{secrets.token_hex(4)}-{name}"[:200]
        return self._model_keys[name]

    def release_model_grant(self, name: str) -> None:
        """The model holds no VRAM any more (unloaded, or never granted): its grant goes back."""
        key = self._model_keys.pop(name, None)
        if key is not None and self.host is not None:
            self.host.release(key)

    def _host_adopt(self) -> None:
        """After a restart: the detached runs re-attached and the granted leases kept hold
        grants an earlier server was given; they are learned again (HostTenant.adopt)."""
        assert self.host is not None
        for run in self.table.active():
            devices = tuple(run.record.get("devices") or ())
            if run.state == RUNNING and devices and run.record.get("pid"):
                sched = run.scheduling
                self.host.adopt(
                    run.id, sched.marginal_vram_mb, devices, sched.exclusive_gpu, "run", int(run.record["pid"])
                )
        for lease in self.leases.granted():
            rec = lease.record
            if rec["devices"]:
                self.host.adopt(
                    lease.id, int(rec["vram_mb"]), tuple(rec["devices"]), bool(rec["exclusive_gpu"]), "lease", lease.pid
                )

    def _unmanaged_changed(self) -> None:
        # VRAM outside the scheduler changed: no run or lease did, so say it on its own.
        self.table.emit({"type": "ledger", "ledger": self.ledger()})

    async def _reconcile_forever(self) -> None:
        """The periodic backstop: missed exits and other systems' states (the executors),
        refused writes, lease holders, observed usage, runs held by dependencies, a decision."""
        while True:
            await asyncio.sleep(self.config.reconcile_interval_s)
            try:
                for executor in self.executors.values():
                    await executor.reconcile()
                if self.table.has_unwritten:
                    self.table.retry_unwritten()
                self.leases.check_processes()
                await self.observer.observe(self._require_loop(), self._io)
                self.admission.reconcile()
            except Exception:
                log.exception("evalsched: reconciliation failed")

    async def _watch_progress_forever(self) -> None:
        while True:
            await asyncio.sleep(self.config.progress_interval_s)
            try:
                for run in self.table.active():
                    if run.state == RUNNING:
                        self.table.refresh_progress(run)
            except Exception:
                log.exception("evalsched: progress watch failed")


class _Carrier:
    """How admission's decisions reach the run table, the executors and the leases."""

    __slots__ = ("_scheduler",)

    def __init__(self, scheduler: Scheduler) -> None:
        self._scheduler = scheduler

    def launch(self, run: Run, devices: tuple[int, ...]) -> None:
        s = self._scheduler
        if s.host is not None and devices:
            s.host._spawn(self._launch_granted(run, devices))
            return
        self._launch(run, devices)

    async def _launch_granted(self, run: Run, devices: tuple[int, ...]) -> None:
        """Granted by the host ledger first (admission took the devices already, so that nothing
        else is admitted on them meanwhile); refused, the run is queued again with the reason."""
        s = self._scheduler
        assert s.host is not None
        sched = run.scheduling
        s.table.update(
            run,
            save=False,
            notify=False,
            why=contract.Why(contract.STARTING, "admitted; being granted its GPUs by the host ledger"),
            devices=list(devices),
        )
        got = await s.host.grant(run.id, sched.marginal_vram_mb, devices, sched.exclusive_gpu, "run")
        if run.terminal or not run.starting:  # cancelled meanwhile
            s.host.release(run.id)
            return
        if isinstance(got, contract.Why):
            s.admission.host_refused(run, got)
            return
        self._launch(run, devices)

    def _launch(self, run: Run, devices: tuple[int, ...]) -> None:
        s = self._scheduler
        # Still queued (``starting``) until its process exists and job.json says so (the
        # executor's ``RunTable.started``); the ledger counts what it holds from now on. Not
        # written nor told here: a start that waits (a model host, a cgroup, a zygote) says so.
        where = f"GPU {', '.join(map(str, devices))}" if devices else "CPU"
        s.table.update(
            run,
            save=False,
            notify=False,
            why=contract.Why(contract.STARTING, f"admitted on {where}; its process is being started"),
            devices=list(devices),
        )
        s.executors[run.executor].launch(run)

    def grant(self, grants: list[tuple[Lease, tuple[int, ...]]]) -> None:
        s = self._scheduler
        for lease, devices in grants:
            if s.host is not None and devices:
                s.admission.lease_granting(lease, devices)  # its devices are held here meanwhile
                s.leases.set_reason(
                    lease, contract.Why(contract.STARTING, "admitted; being granted its GPUs by the host ledger")
                )
                s.host._spawn(self._grant_lease(lease, devices))
                continue
            s.leases.grant(lease, devices)
        s.observer.account()  # what a granted lease's process holds is the lease's now

    async def _grant_lease(self, lease: Lease, devices: tuple[int, ...]) -> None:
        """Granted by the host ledger first, tied to the lease's process when it has one (the
        grant ends with it there too); refused, the lease waits with the ledger's reason."""
        s = self._scheduler
        assert s.host is not None
        rec = lease.record
        pids = [lease.pid] if lease.pid is not None else None
        got = await s.host.grant(lease.id, int(rec["vram_mb"]), devices, bool(rec["exclusive_gpu"]), "lease", pids)
        if not lease.live or lease.state != LEASE_QUEUED or s.admission.stopping:  # ended meanwhile
            s.host.release(lease.id)
            s.admission.lease_host_answered(lease, None)
            return
        if isinstance(got, contract.Why):
            s.admission.lease_host_answered(lease, got)
            return
        s.leases.grant(lease, devices)
        s.admission.lease_host_answered(lease, None)
        s.observer.account()

    def preempt(self, run: Run, by: str) -> None:
        executor = self._scheduler.executors.get(run.executor)
        if executor is not None and executor.preempt(run, by):
            log.info("evalsched: preempting run %s for %s", run.id, by)

    def waiting(self, job: Run | Lease, why: contract.Why) -> None:
        s = self._scheduler
        if isinstance(job, Run):
            s.table.set_reason(job, why)
        else:
            s.leases.set_reason(job, why)

    def load(self, name: str) -> None:
        s = self._scheduler
        if s.host is None:
            s.models.admitted(name)
        elif s.admission.model_granting(name):
            s.host._spawn(self._grant_model(name))

    async def _grant_model(self, name: str) -> None:
        """A shared model's VRAM is granted by the host ledger before its host may load it
        (kind ``model``, held by this server until the model is unloaded)."""
        s = self._scheduler
        assert s.host is not None
        memory = next((m for m in s.models.memory() if m.name == name), None)
        if memory is None:  # not on a GPU: nothing to grant
            s.models.admitted(name)
            s.admission.model_host_answered(name, None)
            return
        never = s.host.never(memory.vram_mb, 1, False, "model")
        if never:  # this user's quota can never hold it: its callers fail rather than wait
            s.admission.model_host_never(name, never)
            return
        key = s.model_grant_key(name)
        got = await s.host.grant(key, memory.vram_mb, (memory.gpu,), False, "model")
        if s.admission.stopping:
            s.release_model_grant(name)
            return
        if isinstance(got, contract.Why):
            s.release_model_grant(name)  # (nothing held; a new key next time)
            s.admission.model_host_answered(name, got)
            return
        s.models.admitted(name)
        s.admission.model_host_answered(name, None)

    def unload(self, name: str, by: str) -> None:
        s = self._scheduler
        log.info("evalsched: unloading the idle shared model %s for %s", name, by)

        async def unload() -> None:
            try:
                if await s.models.unload(name):
                    s.release_model_grant(name)  # its VRAM is free: granted no more
            except Exception:
                log.exception("evalsched: cannot unload the shared model %s", name)
            s.admission.decide()  # its room (or, when it was used meanwhile, another decision)

        asyncio.ensure_future(unload())
