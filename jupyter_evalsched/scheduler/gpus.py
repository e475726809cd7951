"""GPU discovery behind a probe interface: NVML on real hosts, virtual devices on CPU hosts.

The probe answers two questions: which GPUs exist (index, name, total memory), and which
processes hold memory on them (so that VRAM used outside the scheduler can be kept out of the
free figure). Admission never polls live memory for our own runs (rule 5): their marginals stay
declared.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import threading
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Protocol, runtime_checkable

log = logging.getLogger(__name__)

MIB = 1024 * 1024


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
    """The real probe, through nvidia-ml-py (``nvml``: the bindings module, ``pynvml`` by default).
    A host without NVML has no GPUs.

    What it reports:

    - Devices by NVML index (the index of ``CUDA_VISIBLE_DEVICES``), total memory in MiB. A GPU in
      MIG mode is one device of its whole memory: runs are placed on GPU indexes, not on MIG
      instances; the processes of all its instances count on it.
    - Each process once per GPU. One listed both as compute and as graphics ("C+G" in nvidia-smi)
      has one figure for its memory on the GPU, so the larger is taken, never the sum; on a MIG GPU
      the instances' lists are read (the parent's need privileges a container lacks) and a process
      in several instances holds memory in each (summed). ``usedGpuMemory`` None (NVML cannot say:
      Windows WDDM, some containers) counts as 0 MB: the process is still listed. Processes are
      named as NVML names them (its executable), "" when it cannot.
    - No error escapes to the scheduler's sweep. A GPU whose query fails (lost, process lists "Not
      Supported" in a container) keeps its last known processes (a failure must not show VRAM as
      free), the others are read as usual, and the failure is in :attr:`problem` (doctor) and
      logged once.
    """

    source = "nvml"

    def __init__(self, nvml: ModuleType | None = None) -> None:
        self._ok = False
        self.error: str | None = None  # why NVML is unavailable (for doctor), None when it works
        self._lock = threading.Lock()
        self._last: dict[int, list[GpuProcess]] = {}  # per GPU, its last processes read
        self._problems: dict[str, dict[str, str]] = {"devices": {}, "processes": {}}
        self._v2_lists = False  # the driver predates the bindings' _v3 process lists
        try:
            module = nvml if nvml is not None else importlib.import_module("pynvml")
            module.nvmlInit()
            self._nvml: Any = module
            self._ok = True
        except Exception as exc:  # NVMLError_LibraryNotFound, DriverNotLoaded, ImportError...
            self.error = f"{type(exc).__name__}: {exc}"
            log.info("NVML unavailable (%s): treating the host as having no GPUs", exc)

    @property
    def problem(self) -> str | None:
        """What NVML fails to tell (a lost GPU, process lists not supported), or None."""
        with self._lock:
            found = {**self._problems["devices"], **self._problems["processes"]}
        return "; ".join(f"{scope}: {why}" for scope, why in sorted(found.items())) or None

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
        out: list[GpuInfo] = []
        problems: dict[str, str] = {}
        try:
            count = nv.nvmlDeviceGetCount()
        except Exception as exc:
            count = 0
            problems["NVML"] = _why(exc)
        for i in range(count):
            try:
                handle = nv.nvmlDeviceGetHandleByIndex(i)
                name = nv.nvmlDeviceGetName(handle)
                total = nv.nvmlDeviceGetMemoryInfo(handle).total // MIB
            except Exception as exc:  # one GPU lost: the others are still GPUs
                problems[f"GPU {i}"] = _why(exc)
                continue
            name = name.decode() if isinstance(name, bytes) else str(name)
            out.append(GpuInfo(index=i, name=name, total_mb=int(total)))
        self._note("devices", problems)
        return out

    def processes(self) -> list[GpuProcess]:
        if not self._ok:
            return []
        nv = self._nvml
        problems: dict[str, str] = {}
        with self._lock:
            last = dict(self._last)
        try:
            count = nv.nvmlDeviceGetCount()
        except Exception as exc:
            problems["NVML processes"] = _why(exc)
            count = 0
        read: dict[int, list[GpuProcess]] = {}
        for i in range(count):
            try:
                read[i] = self._processes_of(i)
            except Exception as exc:
                problems[f"GPU {i} processes"] = _why(exc)
        with self._lock:
            self._last = {**last, **read}
            out = [p for i in sorted(self._last) for p in self._last[i]]
        self._note("processes", problems)
        return out

    def _processes_of(self, index: int) -> list[GpuProcess]:
        nv = self._nvml
        handle = nv.nvmlDeviceGetHandleByIndex(index)
        used: dict[int, int] = {}
        for instance in self._instances(handle):
            here: dict[int, int] = {}
            for p in self._lists(instance):
                here[int(p.pid)] = max(here.get(int(p.pid), 0), int(p.usedGpuMemory or 0))
            for pid, size in here.items():
                used[pid] = used.get(pid, 0) + size
        return [
            GpuProcess(pid=pid, device=index, used_mb=size // MIB, name=self._name(pid)) for pid, size in used.items()
        ]

    def _name(self, pid: int) -> str:
        try:
            name = self._nvml.nvmlSystemGetProcessName(pid)
        except Exception:  # gone meanwhile, or a process of another PID namespace (a container)
            return ""
        return name.decode() if isinstance(name, bytes) else str(name)

    def _instances(self, handle: Any) -> list[Any]:
        """The handles whose process lists tell a GPU's processes: its MIG devices in MIG mode."""
        nv = self._nvml
        try:
            mode = nv.nvmlDeviceGetMigMode(handle)[0]
        except (nv.NVMLError_NotSupported, nv.NVMLError_FunctionNotFound):
            return [handle]  # not MIG-capable, or a driver without MIG
        if mode != nv.NVML_DEVICE_MIG_ENABLE:
            return [handle]
        out = []
        for k in range(nv.nvmlDeviceGetMaxMigDeviceCount(handle)):
            try:
                out.append(nv.nvmlDeviceGetMigDeviceHandleByIndex(handle, k))
            except nv.NVMLError_NotFound:
                continue  # a slot without a MIG device
        return out

    def _lists(self, handle: Any) -> list[Any]:
        """The compute and graphics processes of a handle. One list "Not Supported" is an empty
        list; both, and any other error, raise."""
        nv = self._nvml
        if not self._v2_lists:
            try:
                return self._both(
                    handle, nv.nvmlDeviceGetComputeRunningProcesses, nv.nvmlDeviceGetGraphicsRunningProcesses
                )
            except (nv.NVMLLibraryMismatchError, nv.NVMLError_FunctionNotFound):
                self._v2_lists = True
                log.info("NVML: the driver predates the bindings' _v3 process lists: using _v2")
        return self._both(
            handle, nv.nvmlDeviceGetComputeRunningProcesses_v2, nv.nvmlDeviceGetGraphicsRunningProcesses_v2
        )

    def _both(self, handle: Any, *fetches: Any) -> list[Any]:
        out: list[Any] = []
        unsupported: list[Exception] = []
        for fetch in fetches:
            try:
                out += fetch(handle)
            except self._nvml.NVMLError_NotSupported as exc:
                unsupported.append(exc)
        if len(unsupported) == len(fetches):
            raise unsupported[0]
        return out

    def _note(self, kind: str, problems: dict[str, str]) -> None:
        with self._lock:
            before, self._problems[kind] = self._problems[kind], problems
        for scope, why in sorted(problems.items()):
            if before.get(scope) != why:
                log.warning("NVML: %s: %s", scope, why)


def _why(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


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
