"""Per-device VRAM and CPU-slot accounting: what each GPU may give to runs, and who holds it.

``usable`` per device, first that is set: the per-device override, ``EVALSCHED_USABLE_VRAM_MB``,
else ``total - reserve`` (virtual GPUs have no reserve). Free = usable - Σ marginal of the runs,
leases and loaded shared models on it - VRAM held by unmanaged processes. A shared model holds
its declared ``vram_mb`` from its load's admission until it is unloaded (``baseline_mb``).

What the probe reports per process is sorted out by :func:`account`: our runs' VRAM is observed
(never charged twice: their declaration is what admission counts), the model hosts' is their
models' declaration, a lease holder's is charged ``max(lease, observed)``, and everything else is
unmanaged.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..contract import Holder
from .gpus import GpuInfo, GpuProcess
from .kernels import KernelInfo
from .policy import Capacity, Device, RunningJob


@dataclass(frozen=True, slots=True)
class DeviceBudget:
    index: int
    name: str
    total_mb: int
    usable_mb: int


@dataclass(slots=True)
class Unmanaged:
    """VRAM held on a device by processes the scheduler does not manage."""

    mb: int = 0
    processes: list[dict] = field(default_factory=list)


def device_budgets(
    gpus: Iterable[GpuInfo],
    reserve_mb: int,
    usable_override: Mapping[int, int],
    env_usable_mb: int | None,
) -> list[DeviceBudget]:
    out = []
    for gpu in gpus:
        if gpu.index in usable_override:
            usable = int(usable_override[gpu.index])
        elif env_usable_mb is not None:
            usable = int(env_usable_mb)
        else:
            reserve = 0 if gpu.virtual else reserve_mb
            usable = gpu.total_mb - reserve
        usable = max(0, min(usable, gpu.total_mb))
        out.append(DeviceBudget(gpu.index, gpu.name, gpu.total_mb, usable))
    return out


@dataclass(slots=True)
class Observation:
    """What the probe's processes mean for the ledger (see :func:`account`)."""

    unmanaged: dict[int, Unmanaged] = field(default_factory=dict)
    runs: dict[str, dict[int, int]] = field(default_factory=dict)  # run id -> {device: MB used now}
    leases: dict[str, dict[int, int]] = field(default_factory=dict)  # lease id -> {device: MB used now}
    over_lease: dict[str, int] = field(default_factory=dict)  # lease id -> MB used beyond the lease


def account(
    processes: Iterable[GpuProcess],
    *,
    baseline_pids: Iterable[int] = (),
    run_pids: Mapping[str, Iterable[int]] | None = None,
    lease_pids: Mapping[str, Iterable[int]] | None = None,
    lease_charges: Mapping[str, Mapping[int, int]] | None = None,
    kernels: Mapping[int, KernelInfo] | None = None,
) -> Observation:
    """Sort the probe's processes out (pure).

    ``baseline_pids``: the model hosts (their VRAM is their models' declaration). ``run_pids``: each running
    run's processes (its VRAM is observed, its declaration charged). ``lease_pids``: each live
    lease's process tree; ``lease_charges``: what each lease holds per device (nothing while it
    waits). A lease holder is charged ``max(lease, observed)``: only what it uses beyond its lease
    is unmanaged. Every other process is unmanaged, named by its kernel when it is one.
    """
    kernels = kernels or {}
    baseline = set(baseline_pids)
    owner_of_run = {pid: rid for rid, pids in (run_pids or {}).items() for pid in pids}
    owner_of_lease = {pid: lid for lid, pids in (lease_pids or {}).items() for pid in pids}
    out = Observation()
    for proc in processes:
        if proc.pid in baseline:
            continue
        run_id = owner_of_run.get(proc.pid)
        if run_id is not None:
            per = out.runs.setdefault(run_id, {})
            per[proc.device] = per.get(proc.device, 0) + proc.used_mb
            continue
        lease_id = owner_of_lease.get(proc.pid)
        entry = out.unmanaged.setdefault(proc.device, Unmanaged())
        kernel = kernels.get(proc.pid)
        entry.processes.append(
            {
                "pid": proc.pid,
                "gpu": proc.device,
                "used_mb": proc.used_mb,
                "name": proc.name,
                "kernel_id": kernel.kernel_id if kernel else None,
                "session_path": kernel.session_path if kernel else None,
                "lease_id": lease_id,
            }
        )
        if lease_id is None:
            entry.mb += proc.used_mb
        else:
            per = out.leases.setdefault(lease_id, {})
            per[proc.device] = per.get(proc.device, 0) + proc.used_mb
    for lease_id, per_device in out.leases.items():
        charges = (lease_charges or {}).get(lease_id, {})
        over = 0
        for device, used in per_device.items():
            excess = max(0, used - charges.get(device, 0))
            out.unmanaged.setdefault(device, Unmanaged()).mb += excess
            over += excess
        out.over_lease[lease_id] = over
    return out


def capacity(budgets: list[DeviceBudget], cpu_slots: int, unmanaged: Mapping[int, Unmanaged]) -> Capacity:
    devices = []
    for b in budgets:
        foreign = unmanaged.get(b.index, Unmanaged())
        devices.append(Device(b.index, b.usable_mb, foreign.mb, unmanaged_holders(b.index, foreign)))
    return Capacity(devices=tuple(devices), cpu_slots=cpu_slots)


def unmanaged_holders(index: int, unmanaged: Unmanaged) -> tuple[Holder, ...]:
    """Who holds a device's unmanaged VRAM, largest first: a kernel (its processes together) by
    its notebook, any other process by its pid. What a lease's process holds is the lease's."""
    kernels: dict[str, Holder] = {}
    out: list[Holder] = []
    for proc in unmanaged.processes:
        if proc.get("lease_id") is not None or not proc.get("used_mb"):
            continue
        kernel_id = proc.get("kernel_id")
        if kernel_id is None:
            out.append(Holder("process", str(proc["pid"]), proc.get("name") or None, index, int(proc["used_mb"])))
            continue
        seen = kernels.get(kernel_id)
        mb = int(proc["used_mb"]) + (seen.mb or 0 if seen is not None else 0)
        kernels[kernel_id] = Holder("kernel", kernel_id, proc.get("session_path"), index, mb)
    out += kernels.values()
    out.sort(key=lambda h: (-(h.mb or 0), h.kind, h.id or ""))
    return tuple(out)


def ledger_view(
    budgets: list[DeviceBudget],
    cpu_slots: int,
    running: Iterable[RunningJob],
    unmanaged: Mapping[int, Unmanaged],
    leases: Mapping[str, Mapping[str, Any]] | None = None,
    model_loads: Iterable[Any] = (),
) -> dict[str, Any]:
    """The ledger as the contract shapes it (plain dicts: this is on the hot path of GET /queue).
    ``running`` holds runs, granted leases and admitted shared models; ``leases`` the lease
    records by id; ``model_loads`` the models' loads waiting for room (``admission.ModelLoad``)."""
    devices: dict[int, dict[str, Any]] = {
        b.index: {
            "index": b.index,
            "name": b.name,
            "total_mb": b.total_mb,
            "baseline_mb": 0,
            "usable_mb": b.usable_mb,
            "allocated_mb": 0,
            "free_mb": b.usable_mb,
            "unmanaged_mb": 0,
            "unmanaged_processes": [],
            "exclusive": None,
            "runs": [],
            "leases": [],
            "models": [],
        }
        for b in budgets
    }
    cpu_allocated = 0
    for run in running:
        cpu_allocated += run.cpus
        for index in run.devices:
            dev = devices.get(index)
            if dev is None:
                continue
            taken = dev["usable_mb"] if run.exclusive else run.marginal_vram_mb
            dev["allocated_mb"] += taken
            if run.kind == "lease":
                rec = (leases or {}).get(run.id) or {}
                used = int((rec.get("observed_mb") or {}).get(str(index), 0))
                dev["leases"].append(
                    {
                        "id": run.id,
                        "vram_mb": taken,
                        "pid": rec.get("pid"),
                        "label": rec.get("label") or "",
                        "kernel_id": rec.get("kernel_id"),
                        "session_path": rec.get("session_path"),
                        "observed_mb": used,
                        "over_lease_mb": max(0, used - taken),
                    }
                )
            elif run.kind == "model":
                dev["baseline_mb"] += taken
                dev["models"].append(
                    {
                        "name": run.id,
                        "vram_mb": taken,
                        "state": "unloading" if run.stopping else "held",
                        "idle_s": round(run.idle_s, 1),
                        "idle_unload_s": run.idle_unload_s,
                        "why": None,
                    }
                )
            else:
                dev["runs"].append({"id": run.id, "marginal_vram_mb": taken})
            if run.exclusive:
                dev["exclusive"] = run.id
    for load in model_loads:
        dev = devices.get(load.need.gpu)
        if dev is not None:
            dev["models"].append(
                {
                    "name": load.need.name,
                    "vram_mb": load.need.vram_mb,
                    "state": "waiting",
                    "idle_s": None,
                    "idle_unload_s": None,
                    "why": load.why.as_dict() if load.why is not None else None,
                }
            )
    for index, dev in devices.items():
        foreign = unmanaged.get(index)
        if foreign is not None:
            dev["unmanaged_mb"] = foreign.mb
            dev["unmanaged_processes"] = list(foreign.processes)
        dev["free_mb"] = dev["usable_mb"] - dev["allocated_mb"] - dev["unmanaged_mb"]
    return {
        "devices": [devices[b.index] for b in budgets],
        "cpu_slots": {"total": cpu_slots, "allocated": cpu_allocated},
    }
