"""Validation of the operator's shared-model declarations (the ``EvalSchedApp.models`` traitlet).

Standard library only: the host process parses its own model's config with this module before
it imports anything heavy. Every error is a ``ValueError`` that names the model and the field.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from typing import Any

MODEL_NAME_RE = re.compile(r"^[A-Za-z0-9._-]{1,128}$")
LOADER_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*$")
DEVICE_RE = re.compile(r"^(cpu|cuda|cuda:\d{1,3}|mps)$")
DTYPES = ("auto", "float32", "float16", "bfloat16")

KNOWN_KEYS = frozenset(
    {
        "name",
        "task",
        "loader",
        "model",
        "device",
        "dtype",
        "max_batch_size",
        "max_wait_ms",
        "vram_mb",
        "max_memory_mb",
        "preload",
        "options",
        "load_retry_s",
        "cpu_threads",
        "idle_unload_s",
    }
)

MAX_BATCH_SIZE_LIMIT = 65_536
MAX_WAIT_MS_LIMIT = 10_000


@dataclass(frozen=True)
class ModelConfig:
    """One shared model, validated. ``as_dict()`` round-trips through ``parse_model``."""

    name: str
    task: str | None = None  # a transformers pipeline task, e.g. "feature-extraction"
    loader: str | None = None  # "module:function" returning a batch callable
    model: str | None = None  # a path or hub id, handed to the pipeline or the loader
    device: str = "cpu"  # "cpu", "cuda", "cuda:N" (NVML/PCI order) or "mps"
    dtype: str | None = None  # None or one of DTYPES
    max_batch_size: int = 8
    max_wait_ms: float = 5.0
    vram_mb: int = 0  # declared VRAM the loaded model holds on its GPU: admitted by the ledger at its load
    max_memory_mb: int | None = None  # RLIMIT_AS of the host process (CPU models only)
    preload: bool = False  # load when the host starts instead of at the first request
    load_retry_s: float = 30.0  # after a failed load, requests fail fast for this long
    cpu_threads: int | None = None  # intra-op threads of the host (OMP/MKL); None: the library default
    options: dict[str, Any] = field(default_factory=dict)  # extra kwargs for pipeline()/the loader
    # Unloaded for a run or lease waiting for its room once no caller used it this long (None:
    # the server's EvalSchedApp.model_idle_unload_s).
    idle_unload_s: float | None = None

    @property
    def gpu_index(self) -> int | None:
        """The GPU index the model occupies, or None for CPU (and MPS) models."""
        if self.device == "cuda":
            return 0
        if self.device.startswith("cuda:"):
            return int(self.device.split(":", 1)[1])
        return None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _fail(name: str, key: str, problem: str) -> ValueError:
    return ValueError(f"shared model {name!r}: field {key!r} {problem}")


def _int(name: str, raw: dict, key: str, default, lo: int, hi: int):
    value = raw.get(key, default)
    if value is None and default is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise _fail(name, key, f"must be an integer, got {value!r}")
    if not lo <= value <= hi:
        raise _fail(name, key, f"must be between {lo} and {hi}, got {value}")
    return value


def _number(name: str, raw: dict, key: str, default: float, lo: float, hi: float) -> float:
    value = raw.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        raise _fail(name, key, f"must be a number, got {value!r}")
    if not lo <= value <= hi:
        raise _fail(name, key, f"must be between {lo} and {hi}, got {value}")
    return float(value)


def parse_model(raw: Any, position: int = 0) -> ModelConfig:
    """Validate one declaration; ``position`` names it in errors when it has no usable name."""
    if not isinstance(raw, dict):
        raise ValueError(f"shared model #{position}: must be a dict, got {type(raw).__name__}")
    name = raw.get("name")
    if not isinstance(name, str) or not MODEL_NAME_RE.match(name):
        raise ValueError(f"shared model #{position}: field 'name' must match {MODEL_NAME_RE.pattern}, got {name!r}")
    unknown = sorted(set(raw) - KNOWN_KEYS)
    if unknown:
        raise _fail(name, unknown[0], f"is not a known key (known: {', '.join(sorted(KNOWN_KEYS))})")

    task, loader = raw.get("task"), raw.get("loader")
    if (task is None) == (loader is None):
        raise _fail(name, "task", "or 'loader' must be given, exactly one of them")
    if task is not None and (not isinstance(task, str) or not task.strip()):
        raise _fail(name, "task", f"must be a transformers pipeline task name, got {task!r}")
    if loader is not None and (not isinstance(loader, str) or not LOADER_RE.match(loader)):
        raise _fail(name, "loader", f"must look like 'package.module:function', got {loader!r}")

    model = raw.get("model")
    if model is not None and (not isinstance(model, str) or not model):
        raise _fail(name, "model", f"must be a non-empty path or model id, got {model!r}")
    if task is not None and model is None:
        raise _fail(name, "model", "is required with 'task' (a path or model id; nothing is downloaded implicitly)")

    device = raw.get("device", "cpu")
    if isinstance(device, int) and not isinstance(device, bool) and device >= 0:
        device = f"cuda:{device}"
    if not isinstance(device, str) or not DEVICE_RE.match(device):
        raise _fail(name, "device", f"must be 'cpu', 'cuda', 'cuda:N' or 'mps', got {device!r}")

    dtype = raw.get("dtype")
    if dtype is not None and dtype not in DTYPES:
        raise _fail(name, "dtype", f"must be one of {', '.join(DTYPES)} or null, got {dtype!r}")

    max_memory_mb = _int(name, raw, "max_memory_mb", None, 64, 1 << 30)
    if max_memory_mb is not None and device.startswith("cuda"):
        # RLIMIT_AS caps virtual address space; the CUDA driver reserves far more than it uses.
        raise _fail(
            name,
            "max_memory_mb",
            "caps the address space (RLIMIT_AS), which CUDA cannot run under; use it only with device 'cpu'",
        )

    preload = raw.get("preload", False)
    if not isinstance(preload, bool):
        raise _fail(name, "preload", f"must be true or false, got {preload!r}")
    options = raw.get("options", {})
    if not isinstance(options, dict) or not all(isinstance(k, str) for k in options):
        raise _fail(name, "options", f"must be a dict with string keys, got {options!r}")

    return ModelConfig(
        name=name,
        task=task,
        loader=loader,
        model=model,
        device=device,
        dtype=dtype,
        max_batch_size=_int(name, raw, "max_batch_size", 8, 1, MAX_BATCH_SIZE_LIMIT),
        max_wait_ms=_number(name, raw, "max_wait_ms", 5.0, 0.0, MAX_WAIT_MS_LIMIT),
        vram_mb=_int(name, raw, "vram_mb", 0, 0, 16 * 1024 * 1024),
        max_memory_mb=max_memory_mb,
        preload=preload,
        load_retry_s=_number(name, raw, "load_retry_s", 30.0, 0.0, 86_400.0),
        cpu_threads=_int(name, raw, "cpu_threads", None, 1, 1024),
        idle_unload_s=None if raw.get("idle_unload_s") is None else _number(name, raw, "idle_unload_s", 0.0, 0.0, 1e9),
        options=dict(options),
    )


def parse_models(raw_list: Any) -> list[ModelConfig]:
    """Validate the whole list: each entry, and that names are unique."""
    if raw_list is None:
        return []
    if not isinstance(raw_list, (list, tuple)):
        raise ValueError(f"shared models: must be a list of dicts, got {type(raw_list).__name__}")
    configs: list[ModelConfig] = []
    seen: set[str] = set()
    for position, raw in enumerate(raw_list):
        config = parse_model(raw, position)
        if config.name in seen:
            raise _fail(config.name, "name", "is declared twice")
        seen.add(config.name)
        configs.append(config)
    return configs
