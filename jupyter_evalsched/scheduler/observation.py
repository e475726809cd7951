"""Observation: what the host says each process uses, sorted out against runs, leases and models.

On the loop: the probe's processes (read in a thread), the executors' ``observed_targets()`` (a
run's pid and cgroup), the live leases' pids. In the I/O thread, ``sample_host``: one walk of the
process table gives every process tree (runs, model hosts, lease holders), the runs' RSS and
cgroup peaks, and ``kernels.identify`` names the rest. Back on the loop, ``ledger.account``
(pure) sorts the processes out; runs get their ``observed`` peaks and, beyond their declaration,
a warning or ``Executor.kill_run`` (``enforce_vram``).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Awaitable, Callable, Mapping
from concurrent.futures import Executor as ThreadPool
from dataclasses import dataclass, field

import psutil

from .. import contract
from ..runner._proc import stat_fields
from .config import SchedulerConfig
from .escapees import environ_of, run_ids_in
from .executors import Executor, ObservedTarget
from .gpus import GpuProbe, GpuProcess
from .kernels import KernelInfo, OwnKernel, identify
from .leases import LeaseTable
from .ledger import DeviceBudget, Observation, Unmanaged, account
from .runs import Run, RunTable
from .shared import SharedModels

log = logging.getLogger("jupyter_evalsched")

OwnKernels = Callable[[], Awaitable[list[OwnKernel]]]


@dataclass(slots=True)
class HostSample:
    """What the I/O thread read of the host for one observation."""

    run_pids: dict[str, set[int]] = field(default_factory=dict)
    baseline_pids: set[int] = field(default_factory=set)
    lease_pids: dict[str, set[int]] = field(default_factory=dict)
    kernels: dict[int, KernelInfo] = field(default_factory=dict)
    run_rss_mb: dict[str, int] = field(default_factory=dict)
    run_memory_peak_mb: dict[str, int] = field(default_factory=dict)  # from the run's memory cgroup


class Observer:
    """Observed usage: runs' peaks and enforcement, leases' holders, unmanaged VRAM by kernel."""

    def __init__(
        self,
        config: SchedulerConfig,
        probe: GpuProbe,
        models: SharedModels,
        table: RunTable,
        leases: LeaseTable,
        executors: Mapping[str, Executor],
        budgets: Callable[[], list[DeviceBudget]],
        on_unmanaged_change: Callable[[], None],
    ) -> None:
        self.config = config
        self.probe = probe
        self.models = models
        self.table = table
        self.leases = leases
        self.executors = executors
        self.budgets = budgets
        self.on_unmanaged_change = on_unmanaged_change  # VRAM outside the scheduler changed
        # This server's kernels (their pids and notebooks), for naming GPU processes; set by the app.
        self.own_kernels: OwnKernels | None = None
        self.unmanaged: dict[int, Unmanaged] = {}
        self.version = 0  # bumped when the probe's figures change what the ledger shows
        self._kernels: dict[int, KernelInfo] = {}
        self._last_processes: list[GpuProcess] = []
        self._last_sample: HostSample | None = None
        self._observation: Observation | None = None

    async def observe(self, loop: asyncio.AbstractEventLoop, io: ThreadPool) -> None:
        """Read what the probe and the host say each process uses, and sort it out: runs' observed
        usage (and enforcement of their declarations), leases' holders, unmanaged VRAM by kernel."""
        processes = await loop.run_in_executor(None, self.probe.processes)
        targets: dict[str, ObservedTarget] = {}
        for executor in self.executors.values():
            targets.update(executor.observed_targets())
        leases = self.leases.live()
        if not processes and not self.unmanaged and not targets and not any(lease.observed for lease in leases):
            return
        own_kernels: list[OwnKernel] = []
        if processes and self.own_kernels is not None:
            try:
                own_kernels = await self.own_kernels()
            except Exception:
                log.debug("evalsched: this server's kernels could not be listed", exc_info=True)
        lease_roots = {lease.id: lease.pid for lease in leases if lease.pid is not None}
        sample = await loop.run_in_executor(
            io, sample_host, processes, targets, self.models.pids(), lease_roots, own_kernels
        )
        self._kernels = sample.kernels
        for lease in leases:
            if lease.live:
                lease.holder_pids = frozenset(sample.lease_pids.get(lease.id, lease.holder_pids))
                kernel = sample.kernels.get(lease.pid) if lease.pid is not None else None
                if kernel is not None:
                    self.leases.set_kernel(lease, kernel.kernel_id, kernel.session_path)
        self._last_processes, self._last_sample = processes, sample
        self.account()
        if self._observation is not None:
            self._observe_runs(self._observation, sample)

    def _observe_runs(self, observation: Observation, sample: HostSample) -> None:
        """Peaks into the runs' records, and their declarations enforced (``enforce_vram``)."""
        source = getattr(self.probe, "source", "nvml")
        for run_id, rss_mb in sample.run_rss_mb.items():
            run = self.table.get(run_id)
            if run is None or run.terminal:
                continue
            used = observation.runs.get(run_id, {})
            peak = sample.run_memory_peak_mb.get(run_id)
            self.table.observe(run, used, max(rss_mb, peak or 0), source)
            if used and self.config.enforce_vram != "off":
                self._enforce_vram(run, used)

    def _enforce_vram(self, run: Run, used: dict[int, int]) -> None:
        sched = run.scheduling
        usable = {b.index: b.usable_mb for b in self.budgets()}
        for device, mb in sorted(used.items()):
            if device not in run.record["devices"]:
                declared = 0  # a GPU it was not given (CUDA_VISIBLE_DEVICES ignored)
            elif sched.exclusive_gpu:
                declared = usable.get(device, 0)
            else:
                declared = sched.marginal_vram_mb
            if mb <= declared * (1 + self.config.vram_tolerance):
                continue
            text = contract.reason(contract.OVER_VRAM, f"used {mb} MB on GPU {device}, declared {declared} MB")
            self.table.add_warning(run, f"{contract.OVER_VRAM}:{device}", text)
            if self.config.enforce_vram == "kill":
                executor = self.executors.get(run.executor)
                if executor is not None and executor.kill_run(run, text):
                    log.warning("evalsched: run %s stopped: %s", run.id, text)
                return

    def account(self) -> None:
        """Sort the last sample out against the leases as they are now: after every observation,
        and when a lease is granted or ends (what its process holds changes hands at once)."""
        if self._last_sample is None:
            return
        leases = self.leases.live()
        budgets = {b.index: b.usable_mb for b in self.budgets()}
        observation = account(
            self._last_processes,
            baseline_pids=self._last_sample.baseline_pids,
            run_pids=self._last_sample.run_pids,
            lease_pids={lease.id: lease.holder_pids for lease in leases if lease.holder_pids},
            lease_charges={
                lease.id: {d: lease.charge(d, budgets.get(d, 0)) for d in lease.record["devices"]} for lease in leases
            },
            kernels=self._kernels,
        )
        changed = _ledger_figures(observation.unmanaged) != _ledger_figures(self.unmanaged)
        self.unmanaged = observation.unmanaged
        for lease in leases:
            self.leases.set_observed(
                lease, observation.leases.get(lease.id, {}), observation.over_lease.get(lease.id, 0)
            )
        self._observation = observation
        if changed:
            self.version += 1
            self.on_unmanaged_change()

    def unmanaged_of(self, pids: set[int]) -> dict[int, int]:
        """The unmanaged VRAM that ``pids`` hold, per device (a new lease's process, say)."""
        out: dict[int, int] = {}
        for device, entry in self.unmanaged.items():
            used = sum(p["used_mb"] for p in entry.processes if p["pid"] in pids and p["lease_id"] is None)
            if used:
                out[device] = used
        return out


def sample_host(
    processes: list[GpuProcess],
    targets: dict[str, ObservedTarget],
    model_pids: set[int],
    lease_roots: dict[str, int],
    own_kernels: list[OwnKernel],
) -> HostSample:
    """In the I/O thread: the process trees of runs, model hosts and lease holders, runs' RSS, and
    which GPU processes are kernels. One walk of the process table serves every tree."""
    children = _children_map()
    out = HostSample()
    for run_id, target in targets.items():
        # The cgroup's members and, whatever the cgroup says, every descendant of the run's
        # process and of those members: a process of the run can move itself out of its cgroup
        # (it has the server's uid), but not out of its ancestry.
        pids = target.pids() if target.cgroup is not None else set()
        for root in {target.pid, *pids}:
            pids |= _tree(root, children)
        out.run_pids[run_id] = pids
    for pid in model_pids:
        out.baseline_pids |= _tree(pid, children)
    for lease_id, pid in lease_roots.items():
        out.lease_pids[lease_id] = _tree(pid, children)
    # A GPU process of none of them that left both (out of its cgroup, orphaned): the run whose
    # id its environment carries, when it is ours (the server's uid).
    ours = set().union(out.baseline_pids, *out.run_pids.values(), *out.lease_pids.values())
    for p in processes:
        if p.pid not in ours:
            owner = run_of_environment(p.pid, targets)
            if owner is not None:
                out.run_pids[owner] |= _tree(p.pid, children)
    for run_id, target in targets.items():
        out.run_rss_mb[run_id] = _rss_mb(out.run_pids[run_id])
        if target.cgroup is not None:
            peak = target.cgroup.memory_peak_mb()
            if peak is not None:
                out.run_memory_peak_mb[run_id] = peak
    ours = set().union(out.baseline_pids, *out.run_pids.values())
    candidates = {p.pid for p in processes if p.pid not in ours} | set(lease_roots.values())
    if candidates:
        out.kernels = identify(candidates, own_kernels)
    return out


def run_of_environment(pid: int, run_ids: Mapping[str, object]) -> str | None:
    """The run among ``run_ids`` whose ``EVALSCHED_RUN_ID`` the process ``pid`` carries in its
    environment (every process a run starts inherits it), if the process has this server's uid
    (another user's process naming one of our runs is not believed). A process whose main
    thread has exited shows its other threads' (``escapees.environ_of``); one caught in the
    middle of an ``exec`` is no run's in this sample, and the next one looks again."""
    try:
        if os.stat(f"/proc/{pid}").st_uid != os.getuid():
            return None
    except OSError:
        return None
    environ = environ_of(pid)
    if not isinstance(environ, bytes):
        return None
    run_id = next(run_ids_in(environ), None)  # (the first, as getenv finds it)
    return run_id if run_id in run_ids else None


def describe_holder(pid: int, own: list[OwnKernel]) -> tuple[KernelInfo | None, set[int]]:
    """In the I/O thread: the kernel a lease's process is (or runs under), and its process tree."""
    return identify([pid], own).get(pid), _tree(pid, _children_map())


def _children_map() -> dict[int, list[int]]:
    """{parent pid: its child processes' pids}, from every process's ``/proc/<pid>/stat``: one
    read each, parsed here (psutil's walk cost about five times as much, 38 ms of CPU a sample
    with 1,000 idle processes added to this host, most of it holding the GIL; on a shared host
    the walk is made every second while a run runs). The kernel's ``/proc/<pid>/task/<tid>/
    children`` would give a tree's processes without the others, but may skip a child while a
    sibling ends, and is not there on every host (``CONFIG_PROC_CHILDREN``)."""
    out: dict[int, list[int]] = {}
    try:
        names = os.listdir("/proc")
    except OSError:
        return out
    for name in names:
        if not name.isdigit():
            continue
        fields = stat_fields(name)
        if fields is None:
            continue  # gone
        try:
            ppid = int(fields[1])  # field 4
        except (ValueError, IndexError):
            continue
        if ppid:
            out.setdefault(ppid, []).append(int(name))
    return out


def _tree(root: int, children: dict[int, list[int]]) -> set[int]:
    out = {root}
    stack = [root]
    while stack:
        for child in children.get(stack.pop(), ()):
            if child not in out:
                out.add(child)
                stack.append(child)
    return out


def _rss_mb(pids: set[int]) -> int:
    total = 0
    for pid in pids:
        try:
            total += psutil.Process(pid).memory_info().rss
        except psutil.Error:
            continue
    return total // (1024 * 1024)


def _ledger_figures(unmanaged: dict[int, Unmanaged]) -> dict[int, tuple[int, list[dict[str, object]]]]:
    return {k: (v.mb, v.processes) for k, v in unmanaged.items()}
