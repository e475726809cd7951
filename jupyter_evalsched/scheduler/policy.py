"""The admission policy: which queued jobs start now, on which GPUs, and why the others wait.

Pure: plain data in, a decision out, no I/O and no clock (the caller passes waiting times).
That keeps it testable in microseconds with property-based tests.

Rules, in order of precedence:
- dependencies: a job whose dependency ended in any state but ``succeeded`` fails without running;
  one whose dependency has not finished waits and takes nothing;
- lanes ``high`` > ``normal`` > ``low``, FIFO (submission ``seq``) within a lane; a job is promoted
  one lane per ``aging_s`` of waiting so that low-priority work cannot starve;
- a job that fits may start ahead of one that does not (backfill) ...
- ... unless the head of the queue is starving (waited ``starvation_s`` or passed over
  ``starvation_passes`` times): then the GPUs and CPU slots it needs are reserved for it and no
  job behind it may take them. Reserved devices only drain, so the head eventually fits.

- preemption: a waiting job that cannot fit otherwise gets room by stopping the fewest, newest
  preemptible runs of strictly lower lanes (declared lanes: aging never lets a job preempt), each
  of which has run ``preempt_min_runtime_s`` and was preempted fewer than ``max_preemptions``
  times. Runs already stopping count as freed (and claimed by the first job they make room for),
  so a job never preempts twice for the same room. A preempted run comes back in its own lane,
  which can never preempt the lane that preempted it: no cycles.

Jobs are runs and leases alike (``kind``): a lease is VRAM held for interactive work, admitted by
the same rules. A process that already holds VRAM outside the scheduler (a kernel that loaded a
model before asking for its lease) is charged ``max(lease, observed)``, never both: the job's
``held`` figures are the VRAM of its own process already counted as unmanaged on each device,
which its placement absorbs.

Shared models are jobs too (``kind`` "model"): a loaded model holds its declared VRAM on its GPU
like a run (a ``RunningJob``), and nothing while unloaded. A job that needs models not loaded yet
(``QueuedJob.models``: a run that declares them, or a model's own load) starts only when they fit
on their GPUs too, and they are admitted with it (``Decision.loads``). A model idle for its
``idle_unload_s`` is unloaded for a job waiting for room (``Decision.unload``) before any run is
preempted for it; a model in use never is.

Every waiting job gets a ``contract.Why``: its reason as data, with the holders that stand in its
way (the runs and leases on the GPUs it needs, the kernels and other processes holding VRAM there,
the job a reservation is for, the dependencies it waits on). Its ``reason`` string is derived
from it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from itertools import combinations
from typing import Protocol

from .. import contract
from ..contract import Holder, Why

LANES = contract.LANES
LANE_INDEX = {name: i for i, name in enumerate(LANES)}


@dataclass(frozen=True, slots=True)
class ModelNeed:
    """A shared model a job needs loaded: its declared VRAM on its GPU."""

    name: str
    gpu: int
    vram_mb: int


@dataclass(frozen=True, slots=True)
class QueuedJob:
    id: str
    seq: int
    priority: str = "normal"
    marginal_vram_mb: int = 0
    gpus: int = 1
    exclusive: bool = False
    cpus: int = 1
    depends_on: tuple[str, ...] = ()
    waited_s: float = 0.0
    passed_over: int = 0
    kind: str = "run"  # "run", "lease" or "model" (a model's load)
    # (device, MB): VRAM this job's own process already holds there, counted as unmanaged.
    held: tuple[tuple[int, int], ...] = ()
    name: str = ""  # named as a holder in the reasons of the jobs it holds back
    models: tuple[ModelNeed, ...] = ()  # shared models it needs that are not loaded: admitted with it

    @property
    def uses_gpu(self) -> bool:
        return contract.uses_gpu(self.marginal_vram_mb, self.exclusive)


@dataclass(frozen=True, slots=True)
class RunningJob:
    id: str
    devices: tuple[int, ...] = ()
    marginal_vram_mb: int = 0
    exclusive: bool = False
    cpus: int = 1
    kind: str = "run"  # "run" or "lease"
    label: str = ""  # who holds a lease (its label, notebook or pid): named in the reasons of jobs it holds back
    priority: str = "normal"  # its declared lane
    preemptible: bool = False
    runtime_s: float = 0.0  # how long its current attempt has run
    preemptions: int = 0
    stopping: bool = False  # told to stop (preempted): its resources are about to be freed
    name: str = ""  # a run's name, named as a holder in the reasons of jobs it holds back (a lease's is its label)
    # A loaded model ("model"): unloadable for a waiting job once idle_s >= idle_unload_s (None:
    # never). The caller gives idle_s 0 while the model is in use (a request, a live run).
    idle_s: float = 0.0
    idle_unload_s: float | None = None

    @property
    def unloadable(self) -> bool:
        return self.kind == "model" and self.idle_unload_s is not None and self.idle_s >= self.idle_unload_s


@dataclass(frozen=True, slots=True)
class Device:
    index: int
    usable_mb: int
    # VRAM held by processes the scheduler does not manage (observed through NVML).
    unmanaged_mb: int = 0
    # Who holds that VRAM: kernels (named by their notebook) and other processes, largest first.
    holders: tuple[Holder, ...] = ()


@dataclass(frozen=True, slots=True)
class Capacity:
    devices: tuple[Device, ...]
    cpu_slots: int


@dataclass(frozen=True, slots=True)
class PolicyConfig:
    starvation_s: float = 600.0
    starvation_passes: int = 50
    aging_s: float = 3600.0
    preemption: bool = True
    preempt_min_runtime_s: float = 60.0
    max_preemptions: int = 3


@dataclass(frozen=True, slots=True)
class Start:
    id: str
    devices: tuple[int, ...]


@dataclass(slots=True)
class Decision:
    starts: list[Start] = field(default_factory=list)
    # id -> why it waits (its reason as data), for every queued job that does not start
    why: dict[str, Why] = field(default_factory=dict)
    # id -> the dependency that did not succeed; these jobs end ``failed`` without running
    dependency_failed: dict[str, str] = field(default_factory=dict)
    # ids of waiting jobs that a later job overtook in this decision (feeds ``passed_over``)
    passed_over: list[str] = field(default_factory=list)
    reserved_for: str | None = None
    reserved_devices: tuple[int, ...] = ()
    reserved_cpus: int = 0
    reserved_holder: Holder | None = None  # the job reserved for, as the reasons of the others name it
    # running run id -> the waiting job it is stopped for (it resumes later)
    preempt: dict[str, str] = field(default_factory=dict)
    # shared models admitted in this decision (their loads, or with a run that needs them)
    loads: list[str] = field(default_factory=list)
    # idle loaded model -> the waiting job it is unloaded for
    unload: dict[str, str] = field(default_factory=dict)

    def reservation(self) -> Reservation | None:
        """What a starving job holds, carried over to a decision about new jobs alone."""
        if self.reserved_for is None:
            return None
        holder = self.reserved_holder
        return Reservation(
            self.reserved_for,
            self.reserved_devices,
            self.reserved_cpus,
            holder.kind if holder else "run",
            (holder.name or "") if holder else "",
        )

    @property
    def waiting(self) -> dict[str, str]:
        """id -> pending reason ("code" or "code: sentence"), derived from ``why``."""
        return {job_id: why.reason for job_id, why in self.why.items()}


def lane_after_waiting(priority: str, waited_s: float, config: PolicyConfig) -> int:
    """The lane of a job of ``priority`` that has waited ``waited_s``: one up per ``aging_s``."""
    lane = LANE_INDEX.get(priority, 1)
    if config.aging_s > 0:
        lane -= int(waited_s // config.aging_s)
    return max(lane, 0)


def effective_lane(job: QueuedJob, config: PolicyConfig) -> int:
    return lane_after_waiting(job.priority, job.waited_s, config)


def admission_key(job: QueuedJob, config: PolicyConfig) -> tuple[int, int]:
    """Where a job stands in admission order: its effective lane, then its submission."""
    return admission_key_of(job.priority, job.waited_s, job.seq, config)


def admission_key_of(priority: str, waited_s: float, seq: int, config: PolicyConfig) -> tuple[int, int]:
    """``admission_key`` from the fields it reads (the queue view orders runs without a job each)."""
    return lane_after_waiting(priority, waited_s, config), seq


def admission_order(jobs: Iterable[QueuedJob], config: PolicyConfig) -> list[QueuedJob]:
    """Highest effective lane first, then submission order."""
    return sorted(jobs, key=lambda j: admission_key(j, config))


def never_fits(job: QueuedJob, capacity: Capacity) -> tuple[str, str] | None:
    """(the scheduling field at fault, why) when the job could not start even on an idle host;
    None when it could."""
    if job.cpus > capacity.cpu_slots:
        return "cpus", f"needs {job.cpus} CPU slots; the host has {capacity.cpu_slots}"
    if job.models:
        # Admitted together with the shared models it names that are not loaded.
        idle = _Book(capacity, ())
        for model in job.models:
            if not idle.models_fit((model,)):
                usable = idle.usable[model.gpu]
                return (
                    "models",
                    f"shared model {model.name} needs {model.vram_mb} MB on GPU {model.gpu}; its usable VRAM is {usable} MB",
                )
        if _place(job, idle, frozenset()) is None:
            named = ", ".join(f"{m.name}: {m.vram_mb} MB on GPU {m.gpu}" for m in job.models)
            return (
                "marginal_vram_mb",
                f"needs {job.marginal_vram_mb} MB on {_gpus(job.gpus)} beside its shared models ({named})",
            )
    if not job.uses_gpu:
        return None
    if job.gpus > len(capacity.devices):
        have = len(capacity.devices)
        return "gpus", f"needs {job.gpus} GPU{'s' if job.gpus > 1 else ''}; the host has {have}"
    roomy = [d for d in capacity.devices if d.usable_mb >= job.marginal_vram_mb]
    if len(roomy) < job.gpus:
        best = max((d.usable_mb for d in capacity.devices), default=0)
        return "marginal_vram_mb", (
            f"needs {job.marginal_vram_mb} MB on {_gpus(job.gpus)}; the largest usable is {best} MB"
            + ("" if job.gpus == 1 else f" and only {len(roomy)} GPU(s) have {job.marginal_vram_mb} MB")
        )
    return None


class _Book:
    """Mutable accounting for one decision: free VRAM, run counts and exclusivity per device."""

    __slots__ = (
        "free",
        "usable",
        "unmanaged",
        "runs",
        "exclusive",
        "cpu_free",
        "cpu_total",
        "leases",
        "users",
        "cpu_users",
        "foreign",
        "nearest",
    )
    cpu_users: list[Holder]  # the jobs holding CPU slots

    def copy(self) -> _Book:
        twin = object.__new__(_Book)
        twin.usable, twin.cpu_total, twin.cpu_free = self.usable, self.cpu_total, self.cpu_free
        twin.unmanaged, twin.free, twin.runs = dict(self.unmanaged), dict(self.free), dict(self.runs)
        twin.exclusive = dict(self.exclusive)
        twin.leases = {k: list(v) for k, v in self.leases.items()}
        twin.users = {k: list(v) for k, v in self.users.items()}
        twin.cpu_users = list(self.cpu_users)
        twin.nearest = {}
        twin.foreign = self.foreign  # never changed after __init__
        return twin

    def release(self, run: RunningJob) -> None:
        """Undo ``take`` of a running run (what it holds once it has stopped)."""
        for index in run.devices:
            if index not in self.free:
                continue
            self.free[index] += self.usable[index] if run.exclusive else run.marginal_vram_mb
            self.runs[index] -= 1
            if self.exclusive.get(index) == run.id:
                del self.exclusive[index]
            self.users[index] = [u for u in self.users[index] if u.id != run.id]
        self.nearest.clear()
        if run.cpus:
            self.cpu_users = [u for u in self.cpu_users if u.id != run.id]
        self.cpu_free += run.cpus

    def models_fit(self, models: Sequence[ModelNeed]) -> bool:
        """Whether these models fit on their GPUs now (a GPU not on the host accounts nothing)."""
        need: dict[int, int] = {}
        for model in models:
            need[model.gpu] = need.get(model.gpu, 0) + model.vram_mb
        return all(
            index not in self.free or (index not in self.exclusive and self.free[index] >= mb)
            for index, mb in need.items()
        )

    def take_models(self, models: Sequence[ModelNeed]) -> None:
        for model in models:
            self.take(model.name, (model.gpu,), model.vram_mb, False, 0, kind="model", name=model.name)

    def __init__(self, capacity: Capacity, running: Sequence[RunningJob]):
        self.usable = {d.index: d.usable_mb for d in capacity.devices}
        self.unmanaged = {d.index: d.unmanaged_mb for d in capacity.devices}
        self.free = {d.index: d.usable_mb - d.unmanaged_mb for d in capacity.devices}
        self.runs = {d.index: 0 for d in capacity.devices}  # runs and leases on each device
        self.leases: dict[int, list[RunningJob]] = {d.index: [] for d in capacity.devices}
        # The runs and leases on each device, as holders (named in the reasons of what waits).
        self.users: dict[int, list[Holder]] = {d.index: [] for d in capacity.devices}
        self.cpu_users = []
        # gpus -> the holders of the devices a job needing that many is nearest to fitting on,
        # until the next take or release: most waiting jobs of a decision share them.
        self.nearest: dict[int, list[Holder]] = {}
        self.foreign: dict[int, tuple[Holder, ...]] = {d.index: d.holders for d in capacity.devices}
        self.exclusive: dict[int, str] = {}
        self.cpu_total = capacity.cpu_slots
        self.cpu_free = capacity.cpu_slots
        for run in running:
            name = run.label if run.kind == "lease" else run.name
            self.take(run.id, run.devices, run.marginal_vram_mb, run.exclusive, run.cpus, kind=run.kind, name=name)
            if run.kind == "lease":
                for index in run.devices:
                    if index in self.leases:
                        self.leases[index].append(run)

    def take(
        self,
        run_id: str,
        devices: Iterable[int],
        marginal: int,
        exclusive: bool,
        cpus: int,
        held: Mapping[int, int] | None = None,
        *,
        kind: str = "run",
        name: str = "",
    ) -> None:
        for index in devices:
            if index not in self.free:
                continue  # a device that disappeared from the host; nothing to account
            # An exclusive run allocates the device's whole usable memory.
            charge = self.usable[index] if exclusive else marginal
            # What the job's own process already held there (unmanaged until now) is absorbed.
            absorbed = min(held.get(index, 0), charge) if held else 0
            self.free[index] -= charge - absorbed
            self.unmanaged[index] -= absorbed
            self.runs[index] += 1
            self.users[index].append(Holder(kind, run_id, name, index, charge))
            if exclusive:
                self.exclusive[index] = run_id
        self.nearest.clear()
        if cpus:
            self.cpu_users.append(Holder(kind, run_id, name))
        self.cpu_free -= cpus

    def candidates(self, job: QueuedJob, blocked: frozenset[int]) -> list[int]:
        """Devices the job could use now, best fit first (least free left over, then index)."""
        held = dict(job.held)
        out = []
        for index, free in self.free.items():
            if index in blocked or index in self.exclusive:
                continue
            own = held.get(index, 0)
            if job.exclusive:
                # Exclusive means nothing else on the device: no run or lease of ours, no foreign
                # process (the job's own process aside).
                if self.runs[index] == 0 and self.unmanaged[index] - own <= 0 and free + own >= job.marginal_vram_mb:
                    out.append(index)
            elif free + min(own, job.marginal_vram_mb) >= job.marginal_vram_mb:
                out.append(index)
        out.sort(key=lambda i: (self.free[i], i))
        return out


@dataclass(frozen=True, slots=True)
class Reservation:
    """What a starving job holds: carried over when a decision is made for new jobs only."""

    job_id: str
    devices: tuple[int, ...]
    cpus: int
    kind: str = "run"  # the job's kind and name: the reasons of the jobs it holds back name it
    name: str = ""


def decide(
    queued: Sequence[QueuedJob],
    running: Sequence[RunningJob],
    capacity: Capacity,
    dependency_states: Mapping[str, str],
    config: PolicyConfig = PolicyConfig(),
    reservation: Reservation | None = None,
    dependency_names: Mapping[str, str] | StateLookup | None = None,
) -> Decision:
    """Decide which of ``queued`` start now.

    ``dependency_states`` maps run ids to their state; a dependency absent from it counts as
    failed (it cannot succeed any more). ``reservation`` is one still held from an earlier
    decision, for a decision about newly submitted jobs alone (nothing else changed since).
    ``dependency_names``: the names of the dependencies, for the holders of ``waiting_dependency``.
    """
    decision = Decision()
    book = _Book(capacity, running)

    eligible: list[QueuedJob] = []
    for job in queued:
        verdict = dependency_verdict(job.depends_on, dependency_states, dependency_names)
        if verdict is None:
            eligible.append(job)
        elif isinstance(verdict[1], str):
            decision.dependency_failed[job.id] = verdict[1]
        else:
            decision.why[job.id] = verdict[1]

    ordered = admission_order(eligible, config)
    reserved_devices: frozenset[int] = frozenset()
    reserved_cpus = 0
    if reservation is not None:
        decision.reserved_holder = Holder(reservation.kind, reservation.job_id, reservation.name)
        decision.reserved_for = reservation.job_id
        reserved_devices = frozenset(reservation.devices)
        reserved_cpus = reservation.cpus
        decision.reserved_devices, decision.reserved_cpus = reservation.devices, reservation.cpus
    waiting_ahead: list[str] = []

    for position, job in enumerate(ordered):
        job = _without_loaded(job, decision.loads)
        blocked = reserved_devices
        placement = _place(job, book, blocked)
        cpu_ok = job.cpus <= book.cpu_free - (reserved_cpus if decision.reserved_for else 0)

        if placement is not None and cpu_ok:
            book.take_models(job.models)
            decision.loads.extend(m.name for m in job.models)
            if job.kind != "model":
                decision.starts.append(Start(job.id, placement))
            book.take(
                job.id,
                placement,
                job.marginal_vram_mb,
                job.exclusive,
                job.cpus,
                dict(job.held),
                kind=job.kind,
                name=job.name,
            )
            decision.passed_over.extend(waiting_ahead)
            continue

        waiting_ahead.append(job.id)
        if decision.reserved_for is not None:
            # Would it have fitted without the reservation? Then the reservation is the reason.
            if _place(job, book, frozenset()) is not None and job.cpus <= book.cpu_free:
                decision.why[job.id] = Why(
                    contract.RESERVED_FOR,
                    f"{_describe_reservation(reserved_devices, reserved_cpus)} held for an older job, "
                    + _job_named(decision.reserved_holder, decision.reserved_for),
                    arg=decision.reserved_for,
                    holders=(decision.reserved_holder,) if decision.reserved_holder else (),
                )
                continue
        decision.why[job.id] = _why_waiting(job, book, placement is not None, blocked)

        if position == 0 and reservation is None and _starving(job, config):
            decision.reserved_holder = Holder(job.kind, job.id, job.name)
            decision.reserved_for = job.id
            reserved_devices = frozenset(_reservation_devices(job, book))
            reserved_cpus = job.cpus
            decision.reserved_devices = tuple(sorted(reserved_devices))
            decision.reserved_cpus = reserved_cpus
    _plan_unloads(ordered, decision, book, running)
    if config.preemption:
        _plan_preemptions(ordered, decision, book, running, config)
    return decision


# Resource reasons: only a job waiting for room may preempt (not one held back by a dependency or
# an older job's reservation).
_ROOM_CODES = (contract.WAITING_VRAM, contract.WAITING_GPU_EXCLUSIVE, contract.WAITING_CPU, contract.WAITING_MODEL_VRAM)
PREEMPTION_PLANS_PER_DECISION = 16  # waiting jobs considered per decision: bounds its cost
_MAX_VICTIMS = 8
_MAX_TRIALS = 2000


def _plan_unloads(ordered: Sequence[QueuedJob], decision: Decision, book: _Book, running: Sequence[RunningJob]) -> None:
    """Fill ``decision.unload``: for each job waiting for room, in admission order, the fewest
    idle models (longest idle first) whose unloading lets it fit. Nothing is unloaded otherwise."""
    idle = sorted((r for r in running if r.unloadable and not r.stopping), key=lambda r: (-r.idle_s, r.id))
    if not idle:
        return
    future = book.copy()  # each job that gets room claims it
    for run in running:
        if run.kind == "model" and run.stopping:
            future.release(run)  # being unloaded already: its room is claimed first, never unloaded twice
    for job in ordered:
        job = _without_loaded(job, decision.loads)
        why = decision.why.get(job.id)
        if why is None or why.code not in _ROOM_CODES:
            continue
        if _fits(job, future):
            _claim(job, future)
            continue
        own = {m.name for m in job.models}
        candidates = [r for r in idle if r.id not in decision.unload and r.id not in own]
        victims = _fewest_newest(job, future, candidates) if candidates else None
        if victims is None:
            continue
        for victim in victims:
            decision.unload[victim.id] = job.id
            future.release(victim)
        _claim(job, future)


def _plan_preemptions(
    ordered: Sequence[QueuedJob], decision: Decision, book: _Book, running: Sequence[RunningJob], config: PolicyConfig
) -> None:
    """Fill ``decision.preempt`` for the waiting jobs, in admission order, that cannot fit."""
    movable = [
        r
        for r in running
        if r.kind == "run"
        and r.preemptible
        and not r.stopping
        and r.runtime_s >= config.preempt_min_runtime_s
        and r.preemptions < config.max_preemptions
    ]
    stopping = [r for r in running if r.stopping]
    if not movable and not stopping:
        return
    unloaded_for = set(decision.unload.values())  # idle models make their room: no run is stopped
    lowest_movable = max((LANE_INDEX.get(r.priority, 1) for r in movable), default=-1)
    # The book as it will be once the stopping runs are gone; each job that gets room claims it.
    future = book.copy()
    for run in stopping:
        future.release(run)
    planned = 0
    for job in ordered:
        job = _without_loaded(job, decision.loads)
        if planned >= PREEMPTION_PLANS_PER_DECISION:
            break
        why = decision.why.get(job.id)
        if why is None or why.code not in _ROOM_CODES or job.id in unloaded_for:
            continue
        lane = LANE_INDEX.get(job.priority, 1)
        if _fits(job, future):
            _claim(job, future)  # runs already stopping make its room
            continue
        if lane >= lowest_movable:
            continue
        planned += 1
        # Newest first: the least work is interrupted (and lost: at most an episode each).
        candidates = sorted(
            (r for r in movable if r.id not in decision.preempt and LANE_INDEX.get(r.priority, 1) > lane),
            key=lambda r: (r.runtime_s, r.id),
        )
        victims = _fewest_newest(job, future, candidates)
        if victims is None:
            continue
        for victim in victims:
            decision.preempt[victim.id] = job.id
            future.release(victim)
        _claim(job, future)


def _without_loaded(job: QueuedJob, loads: Sequence[str]) -> QueuedJob:
    """The job without the models admitted earlier in this decision (loaded for another job)."""
    if not job.models or not loads:
        return job
    return replace(job, models=tuple(m for m in job.models if m.name not in loads))


def _fits(job: QueuedJob, book: _Book) -> bool:
    return job.cpus <= book.cpu_free and _place(job, book, frozenset()) is not None


def _claim(job: QueuedJob, book: _Book) -> None:
    placement = _place(job, book, frozenset()) or ()
    book.take_models(job.models)
    book.take(job.id, placement, job.marginal_vram_mb, job.exclusive, job.cpus, dict(job.held))


def _fewest_newest(job: QueuedJob, book: _Book, candidates: list[RunningJob]) -> tuple[RunningJob, ...] | None:
    """The smallest set of ``candidates`` whose stop lets ``job`` fit, preferring the newest
    (candidates come newest first, and combinations keep that order); None when none does."""
    relevant = [r for r in candidates if r.cpus or r.devices]
    trials = 0
    for size in range(1, min(len(relevant), _MAX_VICTIMS) + 1):
        for victims in combinations(relevant, size):
            trials += 1
            if trials > _MAX_TRIALS:
                return None
            trial = book.copy()
            for victim in victims:
                trial.release(victim)
            if _fits(job, trial):
                return victims
    return None


def _starving(job: QueuedJob, config: PolicyConfig) -> bool:
    return job.waited_s >= config.starvation_s or job.passed_over >= config.starvation_passes


class StateLookup(Protocol):
    def get(self, key: str, /) -> str | None: ...


def dependency_verdict(
    depends_on: Iterable[str],
    states: Mapping[str, str] | StateLookup,
    names: Mapping[str, str] | StateLookup | None = None,
) -> tuple[str, str] | tuple[str, Why] | None:
    """None when every dependency succeeded; ``("failed", dep)`` when one cannot succeed any
    more (absent from ``states`` counts as failed); else ``("waiting", why)``, the dependencies
    still queued or running its holders (named from ``names`` when given)."""
    pending = []
    holders = []
    for dep in depends_on:
        state = states.get(dep)
        if state == "succeeded":
            continue
        if state in ("queued", "running"):
            name = names.get(dep) if names is not None else None
            pending.append(f"{contract.run_named(dep, name)} is {state}")
            holders.append(Holder("run", dep, name))
            continue
        return ("failed", dep)
    if pending:
        return ("waiting", _why(contract.WAITING_DEPENDENCY, "; ".join(pending), holders))
    return None


def _place(job: QueuedJob, book: _Book, blocked: frozenset[int]) -> tuple[int, ...] | None:
    if job.models:
        # Its models first, on their GPUs; then the job, on what they leave.
        if not book.models_fit(job.models):
            return None
        if not job.uses_gpu:
            return ()
        book = book.copy()
        book.take_models(job.models)
    if not job.uses_gpu:
        return ()
    candidates = book.candidates(job, blocked)
    if len(candidates) < job.gpus:
        return None
    return tuple(sorted(candidates[: job.gpus]))


def _reservation_devices(job: QueuedJob, book: _Book) -> list[int]:
    """The devices a starving job will get once they drain: the ones closest to fitting it."""
    if not job.uses_gpu:
        return []
    able = [i for i, usable in book.usable.items() if usable - book.unmanaged[i] >= job.marginal_vram_mb]
    if not able:
        able = list(book.usable)
    able.sort(key=lambda i: (-book.free[i], book.runs[i], i))
    return able[: job.gpus]


def _job_named(holder: Holder | None, job_id: str) -> str:
    """A waiting job as a sentence names it: ``run big (2026...-ab12)``, ``lease lease-...``."""
    if holder is not None and holder.kind != "run":
        return f"{holder.kind} {job_id}" + (f" ({holder.name})" if holder.name else "")
    return contract.run_named(job_id, holder.name if holder is not None else None)


def _describe_reservation(devices: frozenset[int], cpus: int) -> str:
    parts = []
    if devices:
        parts.append("GPU " + ", ".join(str(i) for i in sorted(devices)))
    if cpus:
        parts.append(f"{cpus} CPU slot{'s' if cpus != 1 else ''}")
    return " and ".join(parts) if parts else "resources"


# Holders named in one why, the largest first: a record stays small however busy the host is.
MAX_HOLDERS = 16


def _why(code: str, detail: str, holders: Iterable[Holder] = ()) -> Why:
    # Admission's sentences are never cut (they were not before they became data).
    return Why(code, detail, holders=holders, limit=max(500, len(detail)))


def _why_waiting(job: QueuedJob, book: _Book, placed: bool, blocked: frozenset[int]) -> Why:
    if not placed and job.models and not book.models_fit(job.models):
        return _why_model_room(job, book)
    if not placed:
        if job.exclusive:
            busy = ", ".join(_device_users(book, i) for i in sorted(book.runs) if book.runs[i])
            taken = [i for i in sorted(book.usable) if book.runs[i] or book.unmanaged[i] > 0]
            return _why(
                contract.WAITING_GPU_EXCLUSIVE,
                f"needs {_gpus(job.gpus)} with nothing else on {'it' if job.gpus == 1 else 'them'}; {busy or 'none idle'}",
                _holders(book, taken),
            )
        usable_now = {i: f for i, f in book.free.items() if i not in book.exclusive}
        if usable_now:
            best = max(usable_now, key=lambda i: (usable_now[i], -i))
            best_free = max(usable_now[best], 0)
            most = f"most free is {best_free} MB (GPU {best})"
        else:
            most = "every GPU is held by an exclusive run"
        roomy = sum(1 for f in usable_now.values() if f >= job.marginal_vram_mb)
        text = f"needs {job.marginal_vram_mb} MB on {_gpus(job.gpus)}; "
        if job.gpus > 1:
            text += f"{roomy} of {job.gpus} have room; "
        text += most
        leases = _lease_holders(book)
        if leases:
            text += "; " + leases
        unmanaged = sum(book.unmanaged.values())
        if unmanaged:
            users = _user_charges(book)[:3]  # other users of a host ledger's host, by name only
            for name, index, mb in users:
                text += f"; user {name} holds {mb} MB on GPU {index}"
            kernels = _kernel_charges(book)[:3]
            for name, mb in kernels:
                text += f"; {mb} MB held by kernel of {name}"
            rest = unmanaged - sum(mb for _, mb in kernels) - sum(mb for _, _, mb in users)
            if rest > 0:
                text += f"; {rest} MB held by processes outside the scheduler"
        holders = book.nearest.get(job.gpus)
        if holders is None:
            holders = book.nearest[job.gpus] = _holders(book, _nearest_devices(job.gpus, book))
        return _why(contract.WAITING_VRAM, text, holders)
    return _why(
        contract.WAITING_CPU,
        f"needs {job.cpus} CPU slot{'s' if job.cpus != 1 else ''}; {max(book.cpu_free, 0)} of {book.cpu_total} free",
        book.cpu_users[:MAX_HOLDERS],
    )


def _why_model_room(job: QueuedJob, book: _Book) -> Why:
    """``waiting_model_vram``: a shared model the job needs (or loads) does not fit on its GPU;
    what holds that GPU (other models among them) stands in its way."""
    need: dict[int, list[ModelNeed]] = {}
    for model in job.models:
        need.setdefault(model.gpu, []).append(model)
    short = [i for i, models in sorted(need.items()) if not book.models_fit(models)] or sorted(need)
    parts = []
    for index in short:
        for model in need[index]:
            free = "held by an exclusive run" if index in book.exclusive else f"{max(book.free[index], 0)} MB free"
            parts.append(f"shared model {model.name} needs {model.vram_mb} MB on GPU {index}; {free}")
    return _why(contract.WAITING_MODEL_VRAM, "; ".join(parts), _holders(book, short))


def _nearest_devices(gpus: int, book: _Book) -> list[int]:
    """The devices a job waiting for VRAM is nearest to fitting on (most free first): what holds
    them is what stands in its way."""
    open_devices = [i for i in book.free if i not in book.exclusive] or list(book.free)
    open_devices.sort(key=lambda i: (-book.free[i], i))
    return open_devices[: max(gpus, 1)]


def _foreign(book: _Book, index: int) -> list[Holder]:
    """The processes outside the scheduler that hold VRAM on a device, as much as is still
    unmanaged there (a job admitted in this decision may have absorbed its own process's)."""
    left = max(book.unmanaged.get(index, 0), 0)
    out = []
    for holder in book.foreign.get(index, ()):
        mb = min(holder.mb or 0, left)
        if mb <= 0:
            break
        left -= mb
        out.append(holder if mb == holder.mb else Holder(holder.kind, holder.id, holder.name, holder.gpu, mb))
    return out


def _holders(book: _Book, devices: Iterable[int]) -> list[Holder]:
    """Everything on ``devices``: runs, leases, kernels and other processes, largest first."""
    found = [h for i in devices for h in (*book.users.get(i, ()), *_foreign(book, i))]
    found.sort(key=lambda h: (-(h.mb or 0), h.gpu if h.gpu is not None else -1, h.kind, h.id or ""))
    return found[:MAX_HOLDERS]


def _kernel_charges(book: _Book) -> list[tuple[str, int]]:
    """(notebook, MB) of the kernels holding unmanaged VRAM, over every device, largest first."""
    charges: dict[str, int] = {}
    for index in book.foreign:
        for holder in _foreign(book, index):
            if holder.kind == "kernel" and holder.name:
                charges[holder.name] = charges.get(holder.name, 0) + (holder.mb or 0)
    return sorted(charges.items(), key=lambda kv: (-kv[1], kv[0]))


def _user_charges(book: _Book) -> list[tuple[str, int, int]]:
    """(user, GPU, MB) of the other users' holdings (holders of kind ``user``), largest first."""
    found = [
        (holder.name or holder.id or "", index, holder.mb or 0)
        for index in book.foreign
        for holder in _foreign(book, index)
        if holder.kind == "user"
    ]
    return sorted(found, key=lambda t: (-t[2], t[1], t[0]))


def _device_users(book: _Book, index: int, limit: int = 3) -> str:
    """``GPU 0: run train (2026...-a9b770), lease lease-... (analysis.ipynb)``: who holds a device,
    its runs by name and id (the first ``limit``, then how many more)."""
    leases = book.leases.get(index, [])
    models = [h for h in book.users.get(index, ()) if h.kind == "model"]
    runs = book.runs[index] - len(leases) - len(models)
    named = [h for h in book.users.get(index, ()) if h.kind == "run" and h.id][: min(runs, limit)]
    parts = [contract.run_named(h.id or "", h.name) for h in named]
    if runs > len(named):
        more = runs - len(named)
        parts.append(f"{more} {'more ' if named else ''}run{'s' if more != 1 else ''}")
    parts += [f"lease {lease.id} ({lease.label})" if lease.label else f"lease {lease.id}" for lease in leases]
    parts += [f"model {h.id}" for h in models]
    return f"GPU {index}: " + ", ".join(parts)


def _lease_holders(book: _Book, limit: int = 3) -> str:
    """The leases that hold VRAM, largest first: ``lease L (analysis.ipynb) holds 14000 MB on GPU 0``."""
    held = [(lease, index) for index, leases in sorted(book.leases.items()) for lease in leases]
    if not held:
        return ""
    held.sort(key=lambda item: (-_lease_charge(book, *item), item[1], item[0].id))
    parts = [
        f"lease {lease.id}{f' ({lease.label})' if lease.label else ''} holds {_lease_charge(book, lease, index)} MB "
        f"on GPU {index}"
        for lease, index in held[:limit]
    ]
    if len(held) > limit:
        parts.append(f"{len(held) - limit} more lease(s)")
    return ", ".join(parts)


def _lease_charge(book: _Book, lease: RunningJob, index: int) -> int:
    return book.usable.get(index, 0) if lease.exclusive else lease.marginal_vram_mb


def _gpus(n: int) -> str:
    return "1 GPU" if n == 1 else f"each of {n} GPUs"
