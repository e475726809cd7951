"""Pydantic models of the public contract: the eval spec, the run record, the ledger and queue views.

These are used by the server only. The run subprocess reads the same JSON with the standard
library (see ``runner/``) so that it never pays pydantic's import cost.
"""

from __future__ import annotations

import json
import math
import re
from datetime import UTC, datetime
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    field_validator,
    model_validator,
)

from . import contract
from .contract import STATES, TERMINAL_STATES, is_valid_run_id

ENTRYPOINT_RE = re.compile(r"^[^:\x00]+:[A-Za-z_][A-Za-z0-9_]*$")
MODEL_NAME_RE = re.compile(r"^[A-Za-z0-9._-]{1,128}$")

State = Literal["queued", "running", "succeeded", "failed", "cancelled", "aborted"]
Priority = Literal["high", "normal", "low"]
Executor = Literal["local", "slurm"]
assert set(State.__args__) == set(STATES) and Priority.__args__ == contract.LANES  # type: ignore[attr-defined]

__all__ = ["STATES", "TERMINAL_STATES", "is_valid_run_id"]  # re-exported for the server modules

# Bounds that keep a hostile or mistaken spec from exhausting the host. Generous for real use.
MAX_EPISODES = 10_000_000
MAX_VRAM_MB = 16 * 1024 * 1024  # 16 TB per GPU: anything larger is certainly a mistake
MAX_GPUS = 64
MAX_CPUS = 4096
MAX_WORKERS = 256
MAX_SOURCE_CHARS = 1_000_000
MAX_PARAMS_JSON_CHARS = 1_000_000


def utcnow_iso() -> str:
    """ISO 8601 in UTC with microseconds and ``+00:00``, as the contract pins."""
    return datetime.now(UTC).isoformat(timespec="microseconds")


class _Strict(BaseModel):
    # Strict types: a boolean is not a number, "100" is not a number, 1 is not a boolean. (An
    # integer is still a valid float: JSON does not tell 10 from 10.0.)
    model_config = ConfigDict(extra="forbid", populate_by_name=True, strict=True)


class Scheduling(_Strict):
    """What a run asks of the host. ``marginal_vram_mb`` is per GPU, on top of the shared models."""

    marginal_vram_mb: int = Field(0, ge=0, le=MAX_VRAM_MB, description="VRAM added per GPU, in MB")
    gpus: int = Field(1, ge=1, le=MAX_GPUS, description="GPUs needed when the run uses VRAM or is exclusive")
    exclusive_gpu: bool = Field(False, description="nothing else may run on the run's GPUs")
    priority: Priority = "normal"
    cpus: int = Field(1, ge=0, le=MAX_CPUS, description="CPU slots the run takes")


class EvalSpec(_Strict):
    """A submitted evaluation. Defaults are filled in before it is written as ``spec.json``."""

    name: str | None = Field(None, max_length=200)
    entrypoint: str | None = Field(None, max_length=4096, description="pkg.module:function or path/file.py:function")
    source: str | None = Field(None, max_length=MAX_SOURCE_CHARS, description="source of eval.py")
    episodes: int = Field(1, ge=0, le=MAX_EPISODES)
    params: dict[str, Any] = Field(default_factory=dict)
    workers: int = Field(1, ge=1, le=MAX_WORKERS)
    seed: int = Field(0, ge=-(2**63), le=2**63 - 1)
    models: list[str] = Field(default_factory=list, max_length=64)
    env: dict[str, str] = Field(default_factory=dict)
    cwd: str | None = Field(None, max_length=4096)
    timeout_s: float | None = Field(None, gt=0, le=365 * 24 * 3600)
    depends_on: list[str] = Field(default_factory=list, max_length=1000)
    scheduling: Scheduling = Field(default_factory=Scheduling)
    executor: Executor | None = Field(
        None, description="where the run executes: this host's ledger ('local') or SLURM; default: the server's"
    )

    @field_validator("name")
    @classmethod
    def _name_printable(cls, v: str | None) -> str | None:
        if v is not None:
            if not v.strip():
                raise ValueError("must not be blank")
            if any(ord(c) < 32 for c in v):
                raise ValueError("must not contain control characters")
        return v

    @field_validator("entrypoint")
    @classmethod
    def _entrypoint_shape(cls, v: str | None) -> str | None:
        if v is not None and not ENTRYPOINT_RE.match(v):
            raise ValueError("must look like 'pkg.module:function' or 'path/to/file.py:function'")
        return v

    @field_validator("models")
    @classmethod
    def _model_names(cls, v: list[str]) -> list[str]:
        for name in v:
            if not MODEL_NAME_RE.match(name):
                raise ValueError(f"invalid model name {name!r}")
        return list(dict.fromkeys(v))

    @field_validator("depends_on")
    @classmethod
    def _dep_ids(cls, v: list[str]) -> list[str]:
        for rid in v:
            if not is_valid_run_id(rid):
                raise ValueError(f"invalid run id {rid!r}")
        return list(dict.fromkeys(v))

    @field_validator("env")
    @classmethod
    def _env_names(cls, v: dict[str, str]) -> dict[str, str]:
        for key, value in v.items():
            if not key or "=" in key or "\x00" in key or "\x00" in value:
                raise ValueError(f"invalid environment variable {key!r}")
            try:  # the environment is bytes: a lone surrogate (valid in JSON) cannot be passed on
                key.encode("utf-8")
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise ValueError(f"environment variable {key!r} is not valid UTF-8") from None
        return v

    @field_validator("cwd")
    @classmethod
    def _cwd_no_nul(cls, v: str | None) -> str | None:
        if v is not None and "\x00" in v:
            raise ValueError("must not contain NUL")
        return v

    @field_validator("params")
    @classmethod
    def _params_finite(cls, v: dict[str, Any]) -> dict[str, Any]:
        _check_json_finite(v, "params")
        size = len(json.dumps(v, separators=(",", ":"), allow_nan=False))
        if size > MAX_PARAMS_JSON_CHARS:
            raise ValueError(f"params are {size} characters as JSON; at most {MAX_PARAMS_JSON_CHARS} are accepted")
        return v

    @model_validator(mode="after")
    def _fill_defaults(self) -> EvalSpec:
        if self.entrypoint is None:
            if self.source is None:
                raise ValueError("one of 'entrypoint' or 'source' is required")
            self.entrypoint = "eval.py:episode"
        if self.name is None:
            self.name = default_name(self.entrypoint)
        return self


def _check_json_finite(value: Any, where: str, depth: int = 0) -> None:
    if depth > 64:
        raise ValueError(f"{where} is nested too deeply")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{where} contains a non-finite number")
    if isinstance(value, dict):
        for k, item in value.items():
            _check_json_finite(item, f"{where}.{k}", depth + 1)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _check_json_finite(item, f"{where}[{i}]", depth + 1)


def default_name(entrypoint: str) -> str:
    target, _, func = entrypoint.rpartition(":")
    base = target.rsplit("/", 1)[-1]
    if base.endswith(".py"):
        base = base[:-3]
    else:
        base = base.rsplit(".", 1)[-1]
    return base if func == "episode" else f"{base}.{func}"


class Progress(BaseModel):
    done: int = 0
    total: int = 0


class RunRecord(BaseModel):
    """The run record: REST answers, events and ``job.json`` share it. Every field the server
    sends is declared here (a test checks); unknown fields in an old ``job.json`` are dropped."""

    model_config = ConfigDict(extra="ignore")

    id: str
    name: str
    state: State
    reason: str | None = Field(None, description="a reason code, then an optional sentence after ': '")
    priority: Priority = "normal"
    submitted_at: str
    started_at: str | None = None
    finished_at: str | None = None
    pid: int | None = None
    devices: list[int] = Field(default_factory=list, description="GPU indices (NVML order)")
    exit_code: int | None = Field(None, description="as Popen's returncode: negative for a signal")
    progress: Progress = Field(default_factory=Progress)
    marginal_vram_mb: int = 0
    depends_on: list[str] = Field(default_factory=list)
    # Beyond the pinned fields: what clients show without reading the spec.
    gpus: int = 1
    cpus: int = 1
    exclusive_gpu: bool = False
    models: list[str] = Field(default_factory=list)
    timeout_s: float | None = None
    executor: Executor = "local"
    seq: int = Field(0, description="submission counter: the queue's order, also after a restart")
    pid_create_time: float | None = Field(None, description="the run process's start time (psutil create_time)")
    run_dir: str = ""
    metrics: dict[str, Any] = Field(default_factory=dict, description="the latest aggregates of summary.json")
    slurm_job_id: str | None = None
    slurm_state: str | None = None
    idempotency_key: str | None = Field(None, description="the Idempotency-Key header of the submission")


RECORD_FIELDS = frozenset(RunRecord.model_fields)


class RunDetail(RunRecord):
    summary: dict[str, Any] | None = None
    summary_error: str | None = Field(None, description="why summary.json could not be read, when it exists but cannot")


class RunList(BaseModel):
    runs: list[RunRecord]
    total: int


class LedgerRun(BaseModel):
    id: str
    marginal_vram_mb: int


class LedgerDevice(BaseModel):
    index: int
    name: str
    total_mb: int
    baseline_mb: int
    usable_mb: int
    allocated_mb: int
    free_mb: int
    unmanaged_mb: int = 0
    unmanaged_processes: list[dict[str, Any]] = Field(default_factory=list)
    exclusive: str | None = Field(None, description="id of the exclusive run holding the device")
    runs: list[LedgerRun] = Field(default_factory=list)


class CpuSlots(BaseModel):
    total: int
    allocated: int


class Ledger(BaseModel):
    devices: list[LedgerDevice]
    cpu_slots: CpuSlots


class PrimaryServer(BaseModel):
    url: str
    pid: int
    hostname: str = ""
    runs_dir: str = ""
    since: float = 0.0


class QueueView(BaseModel):
    primary: PrimaryServer | None = Field(None, description="the server that schedules for this host")
    queued: list[RunRecord]
    running: list[RunRecord]
    ledger: Ledger


class EpisodeList(BaseModel):
    episodes: list[dict[str, Any]]


class ModelInfo(BaseModel):
    name: str
    state: str = Field(description="not_loaded, loading, loaded or failed")
    device: str | None = None
    vram_mb: int = 0
    requests: int = 0
    batches: int = 0
    mean_batch_size: float = 0.0
    load_count: int = 0
    error: dict[str, Any] | None = Field(None, description="{type, message}: why the host or the model failed")
    log: str | None = Field(None, description="the host's stderr, kept after it dies")


class ModelList(BaseModel):
    models: list[ModelInfo]


class ErrorBody(BaseModel):
    message: str
    reason: str | None = None
    detail: list[dict[str, Any]] | None = None
