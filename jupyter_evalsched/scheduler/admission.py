"""Admission: the queue of ledger runs (and leases), and when a decision is made.

The decision itself is ``policy.decide`` (pure); this module keeps the queue state it is made
on (queued, eligible, blocked by a dependency, running), decides when to ask for one (``decide``:
the one place that coalesces requests), and carries decisions out through a ``Carrier`` (launch,
grant, preempt, waiting). Dependency failures are finished here, through the run table.

Admission runs on every event that can change the answer (a submission, a run's exit or end, a
requeue, a lease's end, a dependency's change) and on the periodic reconciliation, and is carried
out in the same loop iteration as a run's exit, before that run's files are written.

All of it runs on the event-loop thread.
"""

from __future__ import annotations

import asyncio
import dataclasses
import heapq
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from .. import contract
from ..contract import FAILED, QUEUED, RUNNING
from . import attempts, policy
from .attempts import Requeue
from .config import SchedulerConfig
from .executors import Executor
from .leases import Lease, LeaseTable
from .ledger import Capacity
from .runs import Run, RunNames, RunTable, parse_timestamp
from .shared import ModelMemory, ModelUnavailable

log = logging.getLogger("jupyter_evalsched")

MODEL_LOAD_SEQ = -(1 << 40)  # a model's load goes ahead of the runs of its lane: its callers wait


class Carrier(Protocol):
    """What carrying out a decision does outside admission's own state."""

    def launch(self, run: Run, devices: tuple[int, ...]) -> None:
        """The run is admitted on ``devices`` (admission took them already): record it (still
        ``queued``, reason ``starting``) and start it; it is ``running`` once its process exists."""

    def grant(self, grants: list[tuple[Lease, tuple[int, ...]]]) -> None:
        """The leases are granted these devices (one call per decision)."""

    def preempt(self, run: Run, by: str) -> None:
        """Stop the running ``run`` at its next episode boundary so that ``by`` can start."""

    def waiting(self, job: Run | Lease, why: contract.Why) -> None:
        """Why a queued run or lease waits (news, not a transition)."""

    def load(self, name: str) -> None:
        """The shared model's VRAM is admitted (its host may load it now)."""

    def unload(self, name: str, by: str) -> None:
        """Unload the idle shared model so that job ``by`` gets its room; decide again once it is gone."""


@dataclass(slots=True)
class ModelLoad:
    """A shared model's load waiting for room: its caller awaits ``done``."""

    need: policy.ModelNeed
    seq: int
    requested_ts: float
    done: asyncio.Future[None]
    why: contract.Why | None = None


class Admission:
    def __init__(
        self,
        config: SchedulerConfig,
        table: RunTable,
        leases: LeaseTable,
        executors: Mapping[str, Executor],
        carrier: Carrier,
        capacity: Callable[[], Capacity],
    ) -> None:
        self.config = config
        self.table = table
        self.leases = leases
        self.executors = executors
        self.carrier = carrier
        self.capacity = capacity  # what the ledger offers now (budgets less unmanaged VRAM)
        self._loop: asyncio.AbstractEventLoop | None = None
        self.started = False  # recovery is over: events lead to decisions
        self.stopping = False
        # The ledger runs waiting for resources, and those holding them.
        self._queued: dict[str, Run] = {}
        # Queued runs held by a dependency still queued or running: (reason, dependencies). They
        # are kept out of decisions and looked at again when a dependency's state moves.
        self._blocked: dict[str, tuple[contract.Why, tuple[str, ...]]] = {}
        # Dependency id -> the blocked runs waiting on it, each with the dependency's state it
        # was last looked at against: a run's verdict reads only its dependencies' states, so
        # events and reconciliations that leave a state as it was skip its waiters (thousands
        # of a sweep's runs held behind one were looked at again on every event and every second).
        self._waiting_on: dict[str, dict[str, str | None]] = {}
        self._eligible: dict[str, Run] = {}  # the queued runs not blocked: what a decision looks at
        self._running: dict[str, Run] = {}
        self._released: set[str] = set()  # runs whose process exited, their end not recorded yet
        self._admit_scheduled = False
        self._admitting = False
        self._decide_again = False
        # Set after a full decision that changed nothing: a new job may then be decided alone.
        self._settled = False
        self._reservation: policy.Reservation | None = None
        # The lane of the head of the queue at the last full decision; None: nothing was queued
        # that could start (a newcomer outranks nobody).
        self._head_lane: int | None = None
        # Retries waiting out their back-off: queued, not yet admissible (run id -> its timer).
        self._backoff: dict[str, asyncio.TimerHandle] = {}
        # The shared models with VRAM on a GPU, as their host sees them (set by the scheduler),
        # and the loads waiting for room (model name -> its load).
        self.model_memory: Callable[[], list[ModelMemory]] = list
        self._model_loads: dict[str, ModelLoad] = {}
        self._model_load_seq = 0
        # With a host ledger (host_tenant.py): why GPU work waits now (None: it may start), and
        # the runs it refused, kept out of decisions until its view moves.
        self.host_gate: Callable[[], contract.Why | None] | None = None
        self._host_held: dict[str, Run] = {}
        # And the GPU work queued here, told to it (its fair share keeps room for it).
        self.host_demand: Callable[[list[dict[str, Any]]], None] | None = None
        # Leases and shared models' loads being granted by the host ledger (a lease holds its
        # devices here meanwhile), and those it refused, out of decisions until its view moves.
        self._lease_granting: dict[str, tuple[int, ...]] = {}
        self._host_held_leases: set[str] = set()
        self._model_granting: set[str] = set()
        self._host_held_models: set[str] = set()
        table.requeue_policy = self._retry_policy
        table.on_exit(self._on_run_exited)
        table.on_end(self._on_run_ended)
        table.on_requeue(self._on_run_requeued)
        table.subscribe(self._run_changed)

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop

    def stop(self) -> None:
        """No decision from now on; retries waiting out a back-off stay queued on disk (the next
        start admits them)."""
        self.stopping = True
        for timer in self._backoff.values():
            timer.cancel()
        self._backoff.clear()
        for load in self._model_loads.values():
            if not load.done.done():
                load.done.set_exception(ModelUnavailable(load.need.name, "the scheduler stopped"))
        self._model_loads.clear()

    # ----------------------------------------------------------------- when to decide

    def decide(self, now: bool = False) -> None:
        """Something changed that may let a job start. Inside a decision: decide once more when
        it is carried out. Otherwise ``now`` (in this very loop iteration: what an ended run or
        lease held goes to the next in line at once) or soon (``request_admission``)."""
        if not self.started or self.stopping:
            return
        if self._admitting:
            self._decide_again = True
        elif now:
            self._settled = False
            self._admit()
        else:
            self.request_admission()

    def request_admission(self) -> None:
        """Coalesce admission requests made in one loop iteration into one decision."""
        self._settled = False
        if self._loop is None or self._admit_scheduled:
            return
        self._admit_scheduled = True
        self._loop.call_soon(self._admit)

    def submitted(self, run: Run) -> None:
        """A new ledger run: queued, and decided alone at once when nothing else can have changed."""
        self.enqueue(run)
        if self.started and self._settled and not self._admit_scheduled and self._can_decide_alone(run):
            self._admit_new(run)
        else:
            self.request_admission()

    def reconcile(self) -> None:
        """The periodic backstop: every held run whose dependency's state moved without an event
        looked at again, then a decision."""
        for run_id in [r for r in self._blocked if r not in self._queued]:
            self._unblock(run_id)
        for dep in list(self._waiting_on):
            waiting = self._waiting_on.get(dep)  # (those freed meanwhile were looked at just now)
            if waiting and self._look_again(dep, waiting):
                self.request_admission()
        self._admit()

    # ----------------------------------------------------------------- the run table's events

    def _on_run_exited(self, run: Run) -> None:
        """The run's process is gone: its resources go to the next in line right now, before its
        verdict is read and its files are written (its end follows in this loop iteration)."""
        if self._running.pop(run.id, None) is None:
            return
        self._released.add(run.id)
        self.decide(now=True)

    def _on_run_ended(self, run: Run) -> None:
        self.dequeue(run.id)
        held = self._running.pop(run.id, None) is not None
        released = run.id in self._released  # at its exit: admission has seen it gone already
        self._released.discard(run.id)
        # Inside a decision (a dependency failure), decide once more; a run that held resources
        # hands them over right here, before its files are written.
        if held or not released or self._admitting:
            self.decide(now=held)

    def _retry_policy(self, run: Run, state: str, reason: str | None) -> Requeue | None:
        """A failure retried instead of ended (``retries``, ``retry_on``): a plain decision on the
        record; the run table carries it out."""
        if self.stopping:
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
        self.dequeue(run.id)
        self._running.pop(run.id, None)
        self._released.discard(run.id)
        timer = self._backoff.pop(run.id, None)
        if timer is not None:
            timer.cancel()
        executor = self.executors.get(run.executor)
        if executor is None:
            return
        if not executor.uses_ledger:
            if self.started and not self.stopping and self._loop is not None:
                # Handed over again (SLURM), after the retry's back-off.
                self._loop.call_later(plan.delay_s, self._hand_over_again, run.id)
            return
        # Why it is back in the queue stays its reason while it waits (admission's reason follows).
        run.requeued_why = plan.why if plan.why is not None and plan.why.code == contract.PREEMPTED_BY else None
        if plan.delay_s > 0 and self._loop is not None and not self.stopping:
            self._backoff[run.id] = self._loop.call_later(plan.delay_s, self._retry_due, run.id)
        else:
            self.enqueue(run)
        # Soon, not now: every requeue listener (the executor's clean-up of the attempt that
        # ended) runs first, and the caller finishes with the run before its next attempt.
        self.decide()

    def _hand_over_again(self, run_id: str) -> None:
        run = self.table.get(run_id)
        executor = self.executors.get(run.executor) if run is not None else None
        if run is None or executor is None or run.state != QUEUED or self.stopping:
            return  # cancelled meanwhile
        if run.record.get("retry_at"):
            self.table.update(run, save=False, retry_at=None)
        executor.submit(run)

    def _retry_due(self, run_id: str) -> None:
        self._backoff.pop(run_id, None)
        run = self.table.get(run_id)
        if run is None or run.state != QUEUED or self.stopping:
            return
        self.table.update(run, save=False, retry_at=None)
        self.enqueue(run)
        self.request_admission()

    def lease_ended(self, lease: Lease) -> None:
        """What the lease held goes to the next in line at once."""
        self._lease_granting.pop(lease.id, None)
        self._host_held_leases.discard(lease.id)
        self.decide(now=bool(lease.record["devices"]))

    def _run_changed(self, event: dict[str, Any]) -> None:
        """A run's record changed: the runs waiting on it are looked at again (its start changes
        their reason; its end may free them, or fail them)."""
        if event.get("type") != "run":
            return
        dep = event["run"]["id"]
        waiting = self._waiting_on.get(dep)
        if waiting and self._look_again(dep, waiting):
            self.decide()

    def _look_again(self, dep: str, waiting: dict[str, str | None]) -> bool:
        """The runs ``waiting`` on ``dep`` that saw it in another state looked at again; True when
        one of them is held no more."""
        state = _DependencyStates(self.table).get(dep)
        moved = [run_id for run_id, seen in waiting.items() if seen != state]
        freed = False
        for run_id in moved:
            run = self._queued.get(run_id)
            if run is None:
                self._unblock(run_id)
            elif not self._check_dependencies(run):
                freed = True
        return freed

    # ----------------------------------------------------------------- recovery and cancel

    def recover_queued(self, run: Run) -> None:
        """A queued ledger run found at start: queued again, or left to its retry's back-off."""
        retry_at = run.record.get("retry_at")
        left = parse_timestamp(retry_at) - time.time() if retry_at else 0.0
        if left > 0 and self._loop is not None:
            self._backoff[run.id] = self._loop.call_later(left, self._retry_due, run.id)
            return
        # What it waited for, from the record's data: a preemption stays ahead of admission's
        # reasons, a restart's reason stays until admission's; anything else is decided again.
        run.requeued_why = attempts.preemption_of(run.record)
        if run.requeued_why is None and run.why_code != contract.SERVER_RESTART:
            self.table.update(run, save=False, notify=False, reason=None)
        if run.record["devices"]:  # admitted, not started, by the server that died: starts anew
            self.table.update(run, save=False, notify=False, devices=[])
        self.enqueue(run)

    def recover_running(self, run: Run) -> None:
        """A running ledger run found at start holds its resources until its end is recorded."""
        self._running[run.id] = run
        run.started_ts = parse_timestamp(run.record.get("started_at"))

    def recovered(self) -> None:
        """Every run is known: the dependencies of the queued ones can be looked at."""
        for queued in list(self._queued.values()):
            self._check_dependencies(queued)

    def withdraw(self, run: Run) -> bool:
        """Cancel's part: True when the run is admission's to end (queued, or waiting out a
        back-off), False when it is its executor's."""
        timer = self._backoff.pop(run.id, None)
        if timer is not None:
            timer.cancel()
        return run.id in self._queued or timer is not None

    # ----------------------------------------------------------------- decisions

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
        return self._head_lane is None or policy.LANE_INDEX[run.scheduling.priority] >= self._head_lane

    def _admit_new(self, run: Run) -> None:
        """Admission for one newly submitted job: O(running), not O(queue). With 10,000 jobs
        queued, a full decision per submission would make a burst of submissions quadratic."""
        gate = self.host_gate() if self.host_gate is not None else None
        queued = self._as_queued(run, time.time(), self._resident())
        if gate is not None and run.scheduling.uses_gpu:
            self.carrier.waiting(run, _waiting_why(run, gate))
            self._waits_in_queue(run, queued)
            return
        decision = policy.decide(
            [queued],
            self.running_jobs(),
            self.capacity(),
            self._dependency_states([run]),
            self.config.policy,
            reservation=self._reservation,
            dependency_names=RunNames(self.table),
        )
        if (decision.preempt or decision.unload) and len(self._eligible) <= 1:
            # Making room (stopping preemptible runs, unloading idle models) is a full decision's
            # to do, now, when nothing else waits (it is then as cheap as this one). Behind
            # other waiting runs the room may be for another, and a full decision per
            # submission would make a burst quadratic: the periodic one makes it.
            self.request_admission()
            return
        if decision.dependency_failed or decision.starts:
            if decision.starts:
                self._overtaken_by(run, queued, gated=gate is not None)
            self._carry_out(decision)
            return
        for why in decision.why.values():
            self.carrier.waiting(run, _waiting_why(run, why))
        self._waits_in_queue(run, queued)
        self._tell_host_demand()

    def _overtaken_by(self, run: Run, queued: policy.QueuedJob, *, gated: bool) -> None:
        """A newcomer decided alone starts: what a full decision would count as passed over, the
        waiting runs ahead of it in admission order (a run held by a dependency was not a
        candidate, nor a GPU run while the host gate is closed (``gated``), and one in a lower
        lane was behind it)."""
        now, config = time.time(), self.config.policy
        mine = policy.admission_key(queued, config)
        for waiting in self._eligible.values():
            if waiting is run or (gated and waiting.scheduling.uses_gpu):
                continue
            if policy.admission_key(self._as_queued(waiting, now), config) < mine:
                waiting.passed_over += 1
        for lease in self._leases_to_decide():
            if policy.admission_key(self._lease_as_queued(lease, now), config) < mine:
                lease.passed_over += 1

    def _waits_in_queue(self, run: Run, queued: policy.QueuedJob) -> None:
        """A newcomer decided alone that waits: the head of the queue is now at least as high as
        its lane (the next newcomer that outranks it goes to a full decision), unless a
        dependency holds it (a decision does not look at it)."""
        if run.id in self._eligible:
            lane = policy.effective_lane(queued, self.config.policy)
            if self._head_lane is None or lane < self._head_lane:
                self._head_lane = lane

    def _admit(self) -> None:
        self._admit_scheduled = False
        # Not before recovery is over (a retry's back-off can end while the restart still waits
        # for what the earlier server's runs left: a start then would be killed as their escape);
        # the start's own decision admits what was held back.
        if self._loop is None or self._admitting or self.stopping or not self.started:
            return
        self._admitting = True
        try:
            for _ in range(100):  # dependency failures can cascade down a chain
                self._decide_again = False
                if not self._queued and not self.leases.queued() and not self._model_loads:
                    self._settled, self._reservation, self._head_lane = True, None, None
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
            self._tell_host_demand()

    def _tell_host_demand(self) -> None:
        """The queued GPU runs not held by a dependency, oldest first, as the host ledger's asks."""
        if self.host_demand is None:
            return
        runs = sorted(
            (r for r in self._queued.values() if r.id not in self._blocked and r.scheduling.uses_gpu),
            key=lambda r: int(r.record["seq"]),
        )[:16]
        self.host_demand(
            [
                {
                    "vram_mb": r.scheduling.marginal_vram_mb,
                    "gpus": r.scheduling.gpus,
                    "exclusive": r.scheduling.exclusive_gpu,
                    "kind": "run",
                }
                for r in runs
            ]
        )

    def _decide(self) -> policy.Decision:
        now = time.time()
        # Runs held by a dependency cannot start and take nothing from the others: a decision
        # costs O(the runs that could start), not O(the queue), however many wait on others.
        eligible = list(self._eligible.values())
        resident = self._resident()
        queued = [self._as_queued(run, now, resident) for run in eligible]
        queued += [self._lease_as_queued(lease, now) for lease in self._leases_to_decide()]
        queued += [
            self._load_as_queued(load, now)
            for name, load in self._model_loads.items()
            if name not in self._model_granting and name not in self._host_held_models
        ]
        policy_config = self.config.policy
        self._head_lane = min((policy.effective_lane(q, policy_config) for q in queued), default=None)
        deps = self._dependency_states(eligible)
        gate = self.host_gate() if self.host_gate is not None else None
        gated = [q for q in queued if q.uses_gpu] if gate is not None else []
        if gated:  # no host ledger to grant GPUs: GPU work waits, CPU-only runs go on
            queued = [q for q in queued if not q.uses_gpu]
        decision = policy.decide(
            queued, self.running_jobs(), self.capacity(), deps, policy_config, dependency_names=RunNames(self.table)
        )
        for job in gated:
            assert gate is not None
            decision.why[job.id] = gate
        return decision

    # ----------------------------------------------------------------- the host ledger

    def host_refused(self, run: Run, why: contract.Why) -> None:
        """The host ledger did not grant the run admitted here: queued again with its reason,
        out of decisions until the host ledger's view moves (``host_changed``)."""
        self._running.pop(run.id, None)
        run.started_ts = None
        self.table.update(run, save=False, devices=[], why=_waiting_why(run, why))
        self.enqueue(run)
        if run.id in self._eligible:
            del self._eligible[run.id]
            self._host_held[run.id] = run
        self.decide()  # what it took here is free again for the others

    def host_changed(self) -> None:
        """The host ledger's view or connection changed: the runs, leases and model loads it
        refused may fit now."""
        for run_id, run in list(self._host_held.items()):
            del self._host_held[run_id]
            if run_id in self._queued and run_id not in self._blocked:
                self._eligible[run_id] = run
        self._host_held_leases.clear()
        self._host_held_models.clear()
        self.decide()

    def _leases_to_decide(self) -> list[Lease]:
        """The queued leases a decision may grant: not those being granted by the host ledger
        (they hold their devices, ``running_jobs``), nor those it refused until its view moves."""
        return [
            lease
            for lease in self.leases.queued()
            if lease.id not in self._lease_granting and lease.id not in self._host_held_leases
        ]

    def lease_granting(self, lease: Lease, devices: tuple[int, ...]) -> None:
        """The lease is admitted here on ``devices``; the host ledger grants it next."""
        self._lease_granting[lease.id] = devices

    def lease_host_answered(self, lease: Lease, why: contract.Why | None) -> None:
        """The host ledger answered for the lease: granted (None), or why it waits, out of
        decisions until the host ledger's view moves (``host_changed``)."""
        self._lease_granting.pop(lease.id, None)
        if why is not None and lease.live:
            self._host_held_leases.add(lease.id)
            self.carrier.waiting(lease, why)
        self.decide()  # what it took here is free again, or the lease is counted as granted now

    def model_granting(self, name: str) -> bool:
        """A model's load is admitted here; True when the host ledger is to grant it now (not
        when a grant is on its way already, nor while the ledger refused it)."""
        if name in self._model_granting or name in self._host_held_models:
            return False
        self._model_granting.add(name)
        return True

    def model_host_never(self, name: str, reason: str) -> None:
        """The host ledger can never grant the model's VRAM (this user's quota): its waiting
        callers fail (ModelUnavailable); the next caller asks again once its view moves."""
        self._model_granting.discard(name)
        self._host_held_models.add(name)
        load = self._model_loads.pop(name, None)
        if load is not None and not load.done.done():
            load.done.set_exception(ModelUnavailable(name, f"can never be granted on this host: {reason}"))
        self.decide()

    def model_host_answered(self, name: str, why: contract.Why | None) -> None:
        """The host ledger answered for a model's load: granted (None: the model is resident
        now), or why its load waits (until the host ledger's view moves)."""
        self._model_granting.discard(name)
        if why is not None:
            self._host_held_models.add(name)
            load = self._model_loads.get(name)
            if load is not None:
                load.why = why
        self.decide()

    def _carry_out(self, decision: policy.Decision) -> None:
        # The models first: a run admitted with its models finds them admitted when it starts.
        for name in decision.loads:
            self.carrier.load(name)
        if decision.loads or self._model_loads:
            self._answer_loads()
        for name, job_id in decision.unload.items():
            self.carrier.unload(name, job_id)
        with self.table.deferring_writes():  # thousands of dependents can fail at once
            for run_id, dep in decision.dependency_failed.items():
                run = self._queued[run_id]
                dep_run = self.table.get(dep)
                dep_state = dep_run.state if dep_run is not None else "deleted"
                named = contract.run_named(dep, dep_run.record["name"] if dep_run is not None else None)
                self.table.finish(
                    run, FAILED, contract.reason(contract.DEPENDENCY_FAILED, f"{named} ended {dep_state}", arg=dep)
                )
        grants: list[tuple[Lease, tuple[int, ...]]] = []
        for start in decision.starts:
            if start.id in self._queued:
                self._launch(self._queued[start.id], start.devices)
            else:
                lease = self.leases.get(start.id)
                if lease is not None and lease.live:
                    grants.append((lease, start.devices))
        if grants:
            self.carrier.grant(grants)
        for victim_id, job_id in decision.preempt.items():
            victim = self._running.get(victim_id)
            if victim is not None:
                self.carrier.preempt(victim, job_id)
        for job_id in decision.passed_over:
            waiting: Run | Lease | None = self._queued.get(job_id) or self.leases.get(job_id)
            if waiting is not None:
                waiting.passed_over += 1
        for job_id, why in decision.why.items():
            queued_run = self._queued.get(job_id)
            if queued_run is not None:
                self.carrier.waiting(queued_run, _waiting_why(queued_run, why))
                continue
            lease = self.leases.get(job_id)
            if lease is not None and lease.live:
                self.carrier.waiting(lease, why)
                continue
            load = self._model_loads.get(job_id)
            if load is not None:
                load.why = why

    def _launch(self, run: Run, devices: tuple[int, ...]) -> None:
        """Take the resources now (the ledger changes in this very decision), then start the run."""
        self.dequeue(run.id)
        self._running[run.id] = run
        run.started_ts = time.time()
        run.requeued_why = None
        try:
            self.carrier.launch(run, devices)
        except Exception as exc:  # a bug of ours: the run fails with it, and what it took is free
            log.exception("evalsched: starting run %s failed", run.id)
            if not run.terminal:
                reason = f"the server could not start the run: {type(exc).__name__}: {exc}"
                self.table.finish(run, FAILED, contract.reason(contract.EXCEPTION, reason))

    # ----------------------------------------------------------------- jobs as the policy sees them

    def _as_queued(self, run: Run, now: float, resident: Mapping[str, ModelMemory] | None = None) -> policy.QueuedJob:
        """The run as the policy sees it; its models' needs with ``resident`` (for a decision)."""
        sched = run.scheduling
        return policy.QueuedJob(
            models=self._needs(run, resident) if resident else (),
            id=run.id,
            seq=run.record["seq"],
            name=run.record["name"],
            priority=sched.priority,
            marginal_vram_mb=sched.marginal_vram_mb,
            gpus=sched.gpus,
            exclusive=sched.exclusive_gpu,
            cpus=sched.cpus,
            depends_on=tuple(run.depends_on),
            waited_s=now - run.submitted_ts,
            passed_over=run.passed_over,
        )

    def _load_as_queued(self, load: ModelLoad, now: float) -> policy.QueuedJob:
        return policy.QueuedJob(
            id=load.need.name,
            seq=load.seq,
            name=load.need.name,
            priority="high",
            cpus=0,
            waited_s=now - load.requested_ts,
            kind="model",
            models=(load.need,),
        )

    def _lease_as_queued(self, lease: Lease, now: float) -> policy.QueuedJob:
        rec = lease.record
        return policy.QueuedJob(
            id=lease.id,
            seq=rec["seq"],
            name=lease.holder,
            priority=rec["priority"],
            marginal_vram_mb=rec["vram_mb"],
            gpus=rec["gpus"],
            exclusive=rec["exclusive_gpu"],
            cpus=0,  # interactive work runs in its kernel, on no CPU slot of ours
            waited_s=now - lease.requested_ts,
            passed_over=lease.passed_over,
            kind="lease",
            held=tuple(sorted(lease.observed.items())),
        )

    def running_jobs(self) -> list[policy.RunningJob]:
        """What holds resources: running runs, then granted leases."""
        now = time.time()
        jobs = [
            policy.RunningJob(
                id=run.id,
                name=run.record["name"],
                devices=tuple(run.record["devices"]),
                marginal_vram_mb=run.scheduling.marginal_vram_mb,
                exclusive=run.scheduling.exclusive_gpu,
                cpus=run.scheduling.cpus,
                priority=run.scheduling.priority,
                preemptible=run.scheduling.preemptible,
                runtime_s=now - (run.started_ts or now),
                preemptions=run.record["preemptions"],
                stopping=run.preempted_by is not None,
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
        jobs += [  # admitted here, being granted by the host ledger: they hold their devices
            policy.RunningJob(
                id=lease.id,
                devices=self._lease_granting[lease.id],
                marginal_vram_mb=lease.record["vram_mb"],
                exclusive=lease.record["exclusive_gpu"],
                cpus=0,
                kind="lease",
                label=lease.holder,
            )
            for lease in self.leases.queued()
            if lease.id in self._lease_granting
        ]
        in_use = self._models_of_runs()
        jobs += [
            policy.RunningJob(
                id=m.name,
                devices=(m.gpu,),
                marginal_vram_mb=m.vram_mb,
                cpus=0,
                kind="model",
                name=m.name,
                idle_s=0.0 if (m.busy or m.name in in_use) else m.idle_s,
                idle_unload_s=m.idle_unload_s,
                stopping=m.unloading,  # its room is about to be free
            )
            for m in self.model_memory()
            if m.resident or m.name in self._model_granting
        ]
        return jobs

    # ----------------------------------------------------------------- shared models' memory

    def _resident(self) -> dict[str, ModelMemory]:
        """The shared models with VRAM on a GPU, by name (resident or not), as decisions see
        them: one being granted by the host ledger holds its VRAM already."""
        granting = self._model_granting
        return {
            m.name: dataclasses.replace(m, resident=True) if m.name in granting and not m.resident else m
            for m in self.model_memory()
        }

    def _memory(self) -> dict[str, ModelMemory]:
        """The shared models with VRAM on a GPU, by name, as their host sees them."""
        return {m.name: m for m in self.model_memory()}

    @staticmethod
    def _needs(run: Run, memory: Mapping[str, ModelMemory]) -> tuple[policy.ModelNeed, ...]:
        """The models the run declares that are not loaded: they are admitted with it."""
        names = run.record.get("models") or ()
        return tuple(
            policy.ModelNeed(m.name, m.gpu, m.vram_mb)
            for name in names
            if (m := memory.get(name)) is not None and not m.resident
        )

    def _models_of_runs(self) -> set[str]:
        """The models the live runs (started or starting) declare: in use, never unloaded."""
        return {name for run in self._running.values() for name in run.record.get("models") or ()}

    def load_model(self, name: str) -> asyncio.Future[None]:
        """A caller needs the model loaded: done once its VRAM is admitted (at once when it is
        already, or when it has none on a GPU); ModelUnavailable when it can never fit."""
        loop = self._loop or asyncio.get_running_loop()
        if self.stopping:
            raise ModelUnavailable(name, "the scheduler stopped")
        memory = self._memory().get(name)
        if memory is None or memory.resident:
            done: asyncio.Future[None] = loop.create_future()
            done.set_result(None)
            return done
        waiting = self._model_loads.get(name)
        if waiting is not None:
            return waiting.done
        done = loop.create_future()
        capacity = self.capacity()
        usable = next((d.usable_mb for d in capacity.devices if d.index == memory.gpu), None)
        if usable is not None and memory.vram_mb > usable:
            done.set_exception(
                ModelUnavailable(
                    name, f"needs {memory.vram_mb} MB on GPU {memory.gpu}, whose usable VRAM is {usable} MB"
                )
            )
            return done
        self._model_load_seq += 1
        need = policy.ModelNeed(name, memory.gpu, memory.vram_mb)
        self._model_loads[name] = ModelLoad(need, MODEL_LOAD_SEQ + self._model_load_seq, time.time(), done)
        self.decide()
        return done

    def _answer_loads(self) -> None:
        """The waiting loads whose model is admitted now (for them, or with a run) are done."""
        memory = self._memory()
        for name, load in list(self._model_loads.items()):
            m = memory.get(name)
            if m is None or m.resident or load.done.done():
                del self._model_loads[name]
                if not load.done.done():
                    load.done.set_result(None)

    def model_loads(self) -> list[ModelLoad]:
        """The loads waiting for room, in the order they came."""
        return sorted(self._model_loads.values(), key=lambda load: load.seq)

    def _dependency_states(self, runs: list[Run]) -> dict[str, str]:
        states = {}
        for run in runs:
            for dep_id in run.depends_on:
                dep = self.table.get(dep_id)
                if dep is not None:
                    states[dep_id] = dep.state
        return states

    # ----------------------------------------------------------------- the queue and dependencies

    def is_queued(self, run_id: str) -> bool:
        return run_id in self._queued

    def queued_count(self) -> int:
        return len(self._queued)

    def queued_in_order(self, limit: int | None = None) -> list[Run]:
        """The queued runs in admission order (``policy.admission_key``), the first ``limit`` of
        them when given. Keyed from each run directly: a view of ten thousand queued runs is
        read often (the panel, widgets), and a ``QueuedJob`` per run cost more than the order."""
        now = time.time()
        config = self.config.policy

        def key(run: Run) -> tuple[int, int]:
            return policy.admission_key_of(run.scheduling.priority, now - run.submitted_ts, run.record["seq"], config)

        runs = self._queued.values()
        if limit is not None and limit < len(runs):
            return heapq.nsmallest(limit, runs, key=key)
        return sorted(runs, key=key)

    def leases_in_order(self) -> list[Lease]:
        """Live leases: granted ones by grant, then queued ones in admission order."""
        now = time.time()
        granted = sorted(self.leases.granted(), key=lambda lease: lease.record["granted_at"] or "")
        waiting = {lease.id: lease for lease in self.leases.queued()}
        order = policy.admission_order((self._lease_as_queued(w, now) for w in waiting.values()), self.config.policy)
        return granted + [waiting[job.id] for job in order]

    def enqueue(self, run: Run) -> None:
        self._queued[run.id] = run
        self._eligible[run.id] = run
        self._check_dependencies(run)

    def dequeue(self, run_id: str) -> None:
        self._host_held.pop(run_id, None)
        self._queued.pop(run_id, None)
        self._eligible.pop(run_id, None)
        self._unblock(run_id)
        self._tell_host_demand()

    def _check_dependencies(self, run: Run) -> bool:
        """Whether the queued ``run`` is held by a dependency still queued or running (then it
        says so, and stays out of decisions until a dependency changes). A run whose
        dependencies all succeeded, or one of which failed, is the policy's to decide."""
        self._unblock(run.id)
        if run.id not in self._queued or not run.depends_on:
            return False
        states = _DependencyStates(self.table)
        verdict = policy.dependency_verdict(run.depends_on, states, RunNames(self.table))
        if verdict is None or not isinstance(verdict[1], contract.Why):
            return False
        deps = tuple(run.depends_on)
        self._blocked[run.id] = (verdict[1], deps)
        self._eligible.pop(run.id, None)
        for dep in deps:
            self._waiting_on.setdefault(dep, {})[run.id] = states.get(dep)
        self.carrier.waiting(run, _waiting_why(run, verdict[1]))
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
                waiting.pop(run_id, None)
                if not waiting:
                    del self._waiting_on[dep]


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
