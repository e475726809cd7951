"""Per-device VRAM and CPU-slot accounting: what each GPU may give to runs, and who holds it.

``usable`` per device, first that is set: the per-device override, ``EVALSCHED_USABLE_VRAM_MB``,
else ``total - reserve - baseline`` (baseline = the shared models placed on it; virtual GPUs have
no reserve). Free = usable - Σ marginal of the runs on it - VRAM held by unmanaged processes.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .gpus import GpuInfo, GpuProcess
from .policy import Capacity, Device, RunningJob


@dataclass(frozen=True, slots=True)
class DeviceBudget:
    index: int
    name: str
    total_mb: int
    baseline_mb: int
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
    baseline_mb: Mapping[int, int],
) -> list[DeviceBudget]:
    out = []
    for gpu in gpus:
        baseline = int(baseline_mb.get(gpu.index, 0))
        if gpu.index in usable_override:
            usable = int(usable_override[gpu.index])
        elif env_usable_mb is not None:
            usable = int(env_usable_mb)
        else:
            reserve = 0 if gpu.virtual else reserve_mb
            usable = gpu.total_mb - reserve - baseline
        usable = max(0, min(usable, gpu.total_mb))
        out.append(DeviceBudget(gpu.index, gpu.name, gpu.total_mb, baseline, usable))
    return out


def unmanaged_by_device(processes: Iterable[GpuProcess], managed_pids: set[int]) -> dict[int, Unmanaged]:
    out: dict[int, Unmanaged] = {}
    for proc in processes:
        if proc.pid in managed_pids:
            continue  # our runs and our model host: their VRAM is declared, never counted twice
        entry = out.setdefault(proc.device, Unmanaged())
        entry.mb += proc.used_mb
        entry.processes.append({"pid": proc.pid, "used_mb": proc.used_mb, "name": proc.name})
    return out


def capacity(budgets: list[DeviceBudget], cpu_slots: int, unmanaged: Mapping[int, Unmanaged]) -> Capacity:
    return Capacity(
        devices=tuple(Device(b.index, b.usable_mb, unmanaged.get(b.index, Unmanaged()).mb) for b in budgets),
        cpu_slots=cpu_slots,
    )


def ledger_view(
    budgets: list[DeviceBudget],
    cpu_slots: int,
    running: Iterable[RunningJob],
    unmanaged: Mapping[int, Unmanaged],
) -> dict[str, Any]:
    """The ledger as the contract shapes it (plain dicts: this is on the hot path of GET /queue)."""
    devices: dict[int, dict[str, Any]] = {
        b.index: {
            "index": b.index,
            "name": b.name,
            "total_mb": b.total_mb,
            "baseline_mb": b.baseline_mb,
            "usable_mb": b.usable_mb,
            "allocated_mb": 0,
            "free_mb": b.usable_mb,
            "unmanaged_mb": 0,
            "unmanaged_processes": [],
            "exclusive": None,
            "runs": [],
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
            dev["runs"].append({"id": run.id, "marginal_vram_mb": taken})
            if run.exclusive:
                dev["exclusive"] = run.id
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
