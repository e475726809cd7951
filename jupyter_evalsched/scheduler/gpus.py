"""GPU discovery behind a probe interface: NVML on real hosts, virtual devices on CPU hosts.

The probe answers two questions: which GPUs exist (index, name, total memory), and which
processes hold memory on them (so that VRAM used outside the scheduler can be kept out of the
free figure). Admission never polls live memory for our own runs (rule 5): their marginals stay
declared.
"""

from __future__ import annotations

import json
import logging
import os
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

    source = "nvml"

    def __init__(self) -> None:
        self._ok = False
        self.error: str | None = None  # why NVML is unavailable (for doctor), None when it works
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml = pynvml
            self._ok = True
        except Exception as exc:  # NVMLError_LibraryNotFound, DriverNotLoaded, ImportError...
            self.error = f"{type(exc).__name__}: {exc}"
            log.info("NVML unavailable (%s): treating the host as having no GPUs", exc)

    def driver_version(self) -> str | None:
        if not self._ok:
            return None
        try:
            version = self._nvml.nvmlSystemGetDriverVersion()
        except Exception:
            return None
        return version.decode() if isinstance(version, bytes) else str(version)

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

    ``processes_file`` (``EVALSCHED_VIRTUAL_GPU_PROCESSES``) is the virtual process table: a JSON
    list ``[{"pid": 123, "gpu": 0, "used_mb": 5000}, ...]``, reported exactly as NVML reports the
    processes of real GPUs, so that unmanaged VRAM, kernels, leases and the observed usage of runs
    work, and are tested, without a GPU. It is re-read whenever it changes (mtime and size); a
    missing or invalid file means no processes, logged once per problem, never an error.
    """

    source = "virtual"

    def __init__(self, sizes_mb: list[int], name: str = "Virtual GPU", processes_file: str | None = None) -> None:
        self._devices = [GpuInfo(index=i, name=name, total_mb=int(s), virtual=True) for i, s in enumerate(sizes_mb)]
        self.processes_file = processes_file or None
        self._stamp: tuple[int, int, int] | None = None
        self._table: list[GpuProcess] = []
        self._problem: str | None = None
        self._lock = threading.Lock()

    def devices(self) -> list[GpuInfo]:
        return list(self._devices)

    def processes(self) -> list[GpuProcess]:
        if not self.processes_file:
            return []
        with self._lock:
            try:
                st = os.stat(self.processes_file)
            except FileNotFoundError:
                self._use([], "does not exist")
                self._stamp = None
                return []
            except OSError as exc:
                self._use([], f"cannot be read: {exc.strerror or exc}")
                self._stamp = None
                return []
            stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
            if stamp != self._stamp:
                self._stamp = stamp
                table, problem = read_process_table(self.processes_file, len(self._devices))
                self._use(table, problem)
            return list(self._table)

    @property
    def problem(self) -> str | None:
        """Why the process table is not in use (missing, invalid), or None."""
        return self._problem

    def _use(self, table: list[GpuProcess], problem: str | None) -> None:
        self._table = table
        if problem is not None and problem != self._problem:
            log.warning("virtual GPU process table %s %s: no virtual GPU processes", self.processes_file, problem)
        self._problem = problem


MAX_PROCESS_TABLE_BYTES = 1024 * 1024


def read_process_table(path: str, device_count: int) -> tuple[list[GpuProcess], str | None]:
    """The entries of a virtual process table file, or ``([], why)`` when it cannot be used.
    Entries whose ``gpu`` is not a virtual device are dropped (one bad entry does not void the rest)."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_PROCESS_TABLE_BYTES + 1)
    except OSError as exc:
        return [], f"cannot be read: {exc.strerror or exc}"
    if len(data) > MAX_PROCESS_TABLE_BYTES:
        return [], f"is larger than {MAX_PROCESS_TABLE_BYTES} bytes"
    try:
        raw = json.loads(data or b"[]")
    except (ValueError, RecursionError):
        return [], "is not valid JSON"
    if not isinstance(raw, list):
        return [], 'is not a JSON list of {"pid", "gpu", "used_mb"}'
    out = []
    for item in raw:
        if not isinstance(item, dict):
            continue
        pid, gpu, used = item.get("pid"), item.get("gpu"), item.get("used_mb")
        if type(pid) is not int or type(gpu) is not int or type(used) is not int:
            continue
        if pid <= 0 or used < 0 or not 0 <= gpu < device_count:
            continue
        name = item.get("name")
        out.append(GpuProcess(pid=pid, device=gpu, used_mb=used, name=name if isinstance(name, str) else ""))
    return out, None


def write_process_table(path: str, entries: list[dict]) -> None:
    """Replace a virtual process table atomically (what a test or a demo notebook uses to make a
    process "hold" virtual VRAM)."""
    directory = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(directory, f".{os.path.basename(path)}.{os.getpid()}.{threading.get_ident()}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(entries, f)
    os.replace(tmp, path)


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
