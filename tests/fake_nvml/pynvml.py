"""A faithful fake of nvidia-ml-py's ``pynvml`` for hosts without a GPU: the only fake in the tests.

It has the real module's function names and signatures, return types (the real ``c_nvmlMemory_t``
structures, the real ``nvmlFriendlyObject`` process entries with ``usedGpuMemory`` None when NVML
says "not available") and error classes: every error is raised as the real ``NVMLError(code)``,
which the real module maps to its own subclass (``NVMLError_NotSupported``, ``NVMLError_GpuIsLost``,
...), so the product's ``except`` clauses are exercised for real.

The fake's GPUs are a JSON file named by ``$FAKE_NVML_STATE``, read on every call (a test changes
it mid-run; :func:`write_state` replaces it atomically). Without the variable the NVML library is
"not found". The state::

    {"driver": "550.54.15",
     "init_error": null,                 # "LIBRARY_NOT_FOUND", "DRIVER_NOT_LOADED", ...: nvmlInit raises it
     "privileged": false,                # a MIG parent's process lists need privileges (NVML's docs)
     "missing_functions": [],            # C functions an older driver lacks, e.g. "nvmlDeviceGetComputeRunningProcesses_v3"
     "devices": [
       {"name": "NVIDIA A100-SXM4-80GB", "memory_mb": 81920,
        "lost": false,                   # fallen off the bus: every call on it raises NVMLError_GpuIsLost
        "processes_error": null,         # e.g. "NOT_SUPPORTED" for both process lists (containers)
        "compute": [{"pid": 123, "used_mb": 5000, "name": "python"}],  # used_mb null: NOT_AVAILABLE
        "graphics": [],
        "mig": {"enabled": true, "max": 7,               # absent: not MIG-capable (NotSupported)
                "instances": [{"memory_mb": 9856, "compute": [...], "graphics": [...]}, null]}}]}

Put this directory first on ``PYTHONPATH`` (a server subprocess) or this module in
``sys.modules["pynvml"]`` (in process), or hand it to ``NvmlProbe(nvml=...)``.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import os
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

STATE_ENV = "FAKE_NVML_STATE"
IS_FAKE = True
MIB = 1024 * 1024


def _real_pynvml() -> ModuleType:
    """The installed nvidia-ml-py, whichever name this fake is imported under (it may shadow it)."""
    loaded = sys.modules.get("pynvml")
    if loaded is not None and not getattr(loaded, "IS_FAKE", False):
        return loaded
    if "_evalsched_real_pynvml" in sys.modules:
        return sys.modules["_evalsched_real_pynvml"]
    here = os.path.dirname(os.path.abspath(__file__))
    path = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("pynvml", path)
    if spec is None or spec.origin is None:
        raise ImportError("the fake pynvml needs the real nvidia-ml-py installed (for its error classes)")
    # A private name: the real module registers its error classes on sys.modules[__name__].
    spec = importlib.util.spec_from_file_location("_evalsched_real_pynvml", spec.origin)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["_evalsched_real_pynvml"] = module
    spec.loader.exec_module(module)
    return module


real = _real_pynvml()

# The real constants and error classes: NVML_*, NVMLError, NVMLError_*, NVMLLibraryMismatchError.
for _name in dir(real):
    if _name.startswith(("NVML_", "NVMLError")):
        globals()[_name] = getattr(real, _name)
NVMLError = real.NVMLError
NVMLLibraryMismatchError = real.NVMLLibraryMismatchError
NVML_DEVICE_MIG_ENABLE = real.NVML_DEVICE_MIG_ENABLE
NVML_DEVICE_MIG_DISABLE = real.NVML_DEVICE_MIG_DISABLE

_lock = threading.Lock()
_refcount = 0


def write_state(path: str, state: dict[str, Any]) -> None:
    """Replace the fake's state atomically (a reader never sees half a file)."""
    tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(state, f)
    os.replace(tmp, path)


def state_from_table(sizes_mb: list[int], table: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    """A state with GPUs of ``sizes_mb`` whose compute processes are a virtual process table's
    entries (``[{"pid", "gpu", "used_mb"}]``): what the virtual probe's tests plant, for NVML."""
    devices = [{"name": "NVIDIA Fake GPU", "memory_mb": size, "compute": [], "graphics": []} for size in sizes_mb]
    for entry in table:
        devices[entry["gpu"]]["compute"].append({k: entry[k] for k in ("pid", "used_mb", "name") if k in entry})
    return {"driver": "550.54.15", "devices": devices, **extra}


def _error(code: str) -> Exception:
    return real.NVMLError(getattr(real, f"NVML_ERROR_{code}"))


def _state() -> dict[str, Any]:
    path = os.environ.get(STATE_ENV)
    if not path:
        raise _error("LIBRARY_NOT_FOUND")
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _initialized() -> dict[str, Any]:
    if _refcount == 0:
        raise _error("UNINITIALIZED")
    return _state()


def _function(state: dict[str, Any], name: str) -> None:
    """An older driver lacks some C functions: the bindings then raise NVMLError_FunctionNotFound."""
    if name in state.get("missing_functions", ()):
        raise _error("FUNCTION_NOT_FOUND")


@dataclass(frozen=True)
class _Handle:
    """Stands for ``c_nvmlDevice_t``: the GPU's index, and the MIG slot for a MIG device handle."""

    index: int
    mig: int | None = None


def _device(state: dict[str, Any], handle: _Handle) -> dict[str, Any]:
    devices = state.get("devices", [])
    if not isinstance(handle, _Handle) or not 0 <= handle.index < len(devices):
        raise _error("INVALID_ARGUMENT")
    device = devices[handle.index]
    if device.get("lost"):
        raise _error("GPU_IS_LOST")
    if handle.mig is None:
        return device
    instances = (device.get("mig") or {}).get("instances", [])
    if handle.mig >= len(instances) or instances[handle.mig] is None:
        raise _error("NOT_FOUND")
    return instances[handle.mig]


# --------------------------------------------------------------------------- initialisation, system


def nvmlInitWithFlags(flags: int) -> None:
    global _refcount
    state = _state()
    if state.get("init_error"):
        raise _error(state["init_error"])
    with _lock:
        _refcount += 1


def nvmlInit() -> None:
    nvmlInitWithFlags(0)


def nvmlShutdown() -> None:
    global _refcount
    _initialized()
    with _lock:
        _refcount = max(0, _refcount - 1)


def nvmlSystemGetDriverVersion() -> str:
    return str(_initialized().get("driver", "550.54.15"))


def nvmlSystemGetProcessName(pid: int) -> str:
    """The ``name`` of a process entry of the state; NOT_FOUND for others (as for a process NVML
    cannot see: gone, or of another PID namespace)."""
    for device in _initialized().get("devices", []):
        wheres = [device, *((device.get("mig") or {}).get("instances") or [])]
        for entry in (e for where in wheres if where for e in where.get("compute", []) + where.get("graphics", [])):
            if entry.get("pid") == pid and entry.get("name"):
                return str(entry["name"])
    raise _error("NOT_FOUND")


# --------------------------------------------------------------------------- devices


def nvmlDeviceGetCount() -> int:
    return len(_initialized().get("devices", []))


def nvmlDeviceGetHandleByIndex(index: int) -> _Handle:
    handle = _Handle(int(index))
    _device(_initialized(), handle)  # NVML answers GPU_IS_LOST here too for a GPU off the bus
    return handle


def nvmlDeviceGetIndex(handle: _Handle) -> int:
    _device(_initialized(), handle)
    return handle.index


def nvmlDeviceGetName(handle: _Handle) -> str:
    state = _initialized()
    device = _device(state, handle)
    if handle.mig is not None:
        parent = state["devices"][handle.index]
        return f"{parent.get('name', 'NVIDIA Fake GPU')} MIG {handle.mig}"
    return str(device.get("name", "NVIDIA Fake GPU"))


def nvmlDeviceGetUUID(handle: _Handle) -> str:
    _device(_initialized(), handle)
    if handle.mig is not None:
        return f"MIG-00000000-0000-0000-{handle.index:04x}-{handle.mig:012x}"
    return f"GPU-00000000-0000-0000-0000-{handle.index:012x}"


def nvmlDeviceGetMemoryInfo(handle: _Handle, version: int | None = None) -> Any:
    device = _device(_initialized(), handle)
    total = int(device.get("memory_mb", 0)) * MIB
    used = sum(int(p.get("used_mb") or 0) * MIB for p in device.get("compute", []) + device.get("graphics", []))
    used = min(used, total)
    if not version:
        return real.c_nvmlMemory_t(total=total, free=total - used, used=used)
    return real.c_nvmlMemory_v2_t(version=version, total=total, reserved=0, free=total - used, used=used)


# --------------------------------------------------------------------------- running processes


def _processes(handle: _Handle, kind: str, function: str) -> list[Any]:
    state = _initialized()
    _function(state, function)
    device = _device(state, handle)
    if handle.mig is None and device.get("processes_error"):
        raise _error(device["processes_error"])
    if handle.mig is None and (device.get("mig") or {}).get("enabled"):
        # NVML's docs: on a MIG-enabled GPU the parent's lists aggregate the instances' only for a
        # privileged caller; per-instance information comes from the MIG device handles.
        if not state.get("privileged"):
            raise _error("NO_PERMISSION")
        slots = [(k, inst) for k, inst in enumerate(device["mig"].get("instances", [])) if inst]
    else:
        slots = [(handle.mig, device)]
    out = []
    for slot, where in slots:
        for entry in where.get(kind, []):
            used = entry.get("used_mb")
            struct = real.c_nvmlProcessInfo_v3_t(
                pid=int(entry["pid"]),
                usedGpuMemory=real.NVML_VALUE_NOT_AVAILABLE_ulonglong.value if used is None else int(used * MIB),
                gpuInstanceId=0xFFFFFFFF if slot is None else slot,
                computeInstanceId=0xFFFFFFFF if slot is None else 0,
            )
            # What the real bindings hand back: a friendly object, usedGpuMemory None when not available.
            obj = real.nvmlStructToFriendlyObject(struct)
            if obj.usedGpuMemory == real.NVML_VALUE_NOT_AVAILABLE_ulonglong.value:
                obj.usedGpuMemory = None
            out.append(obj)
    return out


def _process_lists(kind: str) -> tuple[Callable[[_Handle], list[Any]], ...]:
    """The ``_v2``, ``_v3`` and unversioned lists of one kind, as the bindings name them: the
    unversioned one calls ``_v3`` and turns a driver without it into NVMLLibraryMismatchError."""
    name = f"nvmlDeviceGet{kind.capitalize()}RunningProcesses"

    def v2(handle: _Handle) -> list[Any]:
        return _processes(handle, kind, f"{name}_v2")

    def v3(handle: _Handle) -> list[Any]:
        return _processes(handle, kind, f"{name}_v3")

    def unversioned(handle: _Handle) -> list[Any]:
        return v3(handle)

    v2.__name__, v3.__name__, unversioned.__name__ = f"{name}_v2", f"{name}_v3", name
    return v2, v3, real.throwOnVersionMismatch(unversioned)


(
    nvmlDeviceGetComputeRunningProcesses_v2,
    nvmlDeviceGetComputeRunningProcesses_v3,
    nvmlDeviceGetComputeRunningProcesses,
) = _process_lists("compute")
(
    nvmlDeviceGetGraphicsRunningProcesses_v2,
    nvmlDeviceGetGraphicsRunningProcesses_v3,
    nvmlDeviceGetGraphicsRunningProcesses,
) = _process_lists("graphics")


# --------------------------------------------------------------------------- MIG


def _mig(handle: _Handle) -> dict[str, Any]:
    device = _device(_initialized(), handle)
    if handle.mig is not None or "mig" not in device:
        raise _error("NOT_SUPPORTED")
    return device["mig"]


def nvmlDeviceGetMigMode(device: _Handle) -> list[int]:
    mode = NVML_DEVICE_MIG_ENABLE if _mig(device).get("enabled") else NVML_DEVICE_MIG_DISABLE
    return [mode, mode]


def nvmlDeviceGetMaxMigDeviceCount(device: _Handle) -> int:
    return int(_mig(device).get("max", 7))


def nvmlDeviceGetMigDeviceHandleByIndex(device: _Handle, index: int) -> _Handle:
    mig = _mig(device)
    if not mig.get("enabled") or not 0 <= index < int(mig.get("max", 7)):
        raise _error("INVALID_ARGUMENT")
    handle = _Handle(device.index, int(index))
    _device(_initialized(), handle)  # NOT_FOUND for a slot without a MIG device
    return handle


def nvmlDeviceIsMigDeviceHandle(device: _Handle) -> Any:
    _device(_initialized(), device)
    # The real binding returns the c_uint itself, not its value (truthy as the value is).
    return real.c_uint(int(device.mig is not None))


def nvmlDeviceGetDeviceHandleFromMigDeviceHandle(migDevice: _Handle) -> _Handle:
    _device(_initialized(), migDevice)
    if migDevice.mig is None:
        raise _error("INVALID_ARGUMENT")
    return _Handle(migDevice.index)
