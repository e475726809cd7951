"""GPU discovery behind a probe interface: NVML on real hosts, virtual devices on CPU hosts.

The probe answers two questions: which GPUs exist (index, name, total memory), and which
processes hold memory on them (so that VRAM used outside the scheduler can be kept out of the
free figure). Admission never polls live memory for our own runs (rule 5): their marginals stay
declared.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class GpuInfo:
    index: int
    name: str
    total_mb: int
    virtual: bool = False


@dataclass(frozen=True, slots=True)
class GpuProcess:
    pid: int
    device: int
    used_mb: int
    name: str = ""


@runtime_checkable
class GpuProbe(Protocol):
    def devices(self) -> list[GpuInfo]: ...

    def processes(self) -> list[GpuProcess]: ...


class NvmlProbe:
    """The real probe, through nvidia-ml-py. A host without NVML has no GPUs."""

    def __init__(self) -> None:
        self._ok = False
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml = pynvml
            self._ok = True
        except Exception as exc:  # NVMLError_LibraryNotFound, DriverNotLoaded, ImportError...
            log.info("NVML unavailable (%s): treating the host as having no GPUs", exc)

    def devices(self) -> list[GpuInfo]:
        if not self._ok:
            return []
        nv = self._nvml
        out = []
        try:
            for i in range(nv.nvmlDeviceGetCount()):
                handle = nv.nvmlDeviceGetHandleByIndex(i)
                name = nv.nvmlDeviceGetName(handle)
                if isinstance(name, bytes):
                    name = name.decode()
                total = nv.nvmlDeviceGetMemoryInfo(handle).total // (1024 * 1024)
                out.append(GpuInfo(index=i, name=str(name), total_mb=int(total)))
        except nv.NVMLError as exc:
            log.warning("NVML device query failed: %s", exc)
        return out

    def processes(self) -> list[GpuProcess]:
        if not self._ok:
            return []
        nv = self._nvml
        out = []
        try:
            for i in range(nv.nvmlDeviceGetCount()):
                handle = nv.nvmlDeviceGetHandleByIndex(i)
                procs = list(nv.nvmlDeviceGetComputeRunningProcesses(handle))
                procs += list(nv.nvmlDeviceGetGraphicsRunningProcesses(handle))
                for p in procs:
                    used = p.usedGpuMemory or 0  # None when the driver hides it
                    out.append(GpuProcess(pid=int(p.pid), device=i, used_mb=int(used) // (1024 * 1024)))
        except nv.NVMLError as exc:
            log.warning("NVML process query failed: %s", exc)
        return out


class VirtualProbe:
    """Virtual GPUs of declared sizes, for hosts without any (the demo, the tests, CPU hosts).

    ``set_foreign`` lets a test place processes the scheduler does not manage on a device, the
    way NVML would report a notebook kernel that loaded a model by hand.
    """

    def __init__(self, sizes_mb: list[int], name: str = "Virtual GPU") -> None:
        self._devices = [GpuInfo(index=i, name=name, total_mb=int(s), virtual=True) for i, s in enumerate(sizes_mb)]
        self._foreign: list[GpuProcess] = []
        self._lock = threading.Lock()

    def devices(self) -> list[GpuInfo]:
        return list(self._devices)

    def processes(self) -> list[GpuProcess]:
        with self._lock:
            return list(self._foreign)

    def set_foreign(self, processes: list[GpuProcess]) -> None:
        with self._lock:
            self._foreign = list(processes)


def parse_sizes(text: str) -> list[int]:
    """``"24000,24000"`` -> ``[24000, 24000]``, with a clear error for anything else."""
    sizes = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        try:
            value = int(float(part))
        except ValueError:
            raise ValueError(f"virtual GPU size {part!r} is not a number of MB") from None
        if value <= 0:
            raise ValueError(f"virtual GPU size {part!r} must be positive")
        sizes.append(value)
    return sizes
