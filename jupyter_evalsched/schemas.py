"""Pydantic models of the public contract: the eval spec, the run record, the ledger and queue views.

These are used by the server only. The run subprocess reads the same JSON with the standard
library (see ``runner/``) so that it never pays pydantic's import cost.
"""

from __future__ import annotations

import difflib
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
MAX_MEMORY_MB = 1024 * 1024 * 1024  # 1 PB of host memory
MAX_GPUS = 64
MAX_CPUS = 4096
MAX_WORKERS = 256
MAX_SOURCE_CHARS = 1_000_000
MAX_PARAMS_JSON_CHARS = 1_000_000
MAX_PARAMS_DEPTH = 64
MAX_RETRIES = 100
MAX_NAME_CHARS = 200
MAX_PATH_CHARS = 4096  # entrypoint, cwd
MAX_MODELS = 64
MAX_DEPENDS_ON = 1000
# A run's environment travels in one datagram to a warm spare (the zygote's SOCK_SEQPACKET socket:
# about 208 KB by default, with the server's own environment and run_env beside it) and through
# execve for a cold start (at most 128 KiB per NAME=value string): the spec's share stays well
# below both. Counted as the NAME=value pairs with their NUL, in UTF-8.
MAX_ENV_NAME_CHARS = 1024
MAX_ENV_VALUE_BYTES = 32 * 1024
MAX_ENV_BYTES = 64 * 1024
# The whole spec as compact JSON, non-ASCII escaped (as spec.json holds it), defaults filled in.
# The same number is the request body limit (handlers.MAX_BODY_BYTES).
MAX_SPEC_JSON_CHARS = 4 * 1024 * 1024


def utcnow_iso() -> str:
    """ISO 8601 in UTC with microseconds and ``+00:00``, as the contract pins."""
    return datetime.now(UTC).isoformat(timespec="microseconds")


def iso_from_timestamp(at: float) -> str:
    """``at`` (``time.time()``) as :func:`utcnow_iso` writes it."""
    return datetime.fromtimestamp(at, UTC).isoformat(timespec="microseconds")


class _Strict(BaseModel):
    # Strict types: a boolean is not a number, "100" is not a number, 1 is not a boolean. (An
    # integer is still a valid float: JSON does not tell 10 from 10.0.)
    model_config = ConfigDict(extra="forbid", populate_by_name=True, strict=True)


class Scheduling(_Strict):
    """What a run asks of the host. ``marginal_vram_mb`` is per GPU, on top of the shared models."""

    marginal_vram_mb: int | Literal["auto"] = Field(
        contract.SCHEDULING_DEFAULTS["marginal_vram_mb"],
        description="VRAM added per GPU, in MB; 'auto': the highest observed peak of earlier succeeded runs "
        "of the same eval, plus a margin",
    )
    gpus: int = Field(
        contract.SCHEDULING_DEFAULTS["gpus"],
        ge=1,
        le=MAX_GPUS,
        description="GPUs needed when the run uses VRAM or is exclusive",
    )
    exclusive_gpu: bool = Field(
        contract.SCHEDULING_DEFAULTS["exclusive_gpu"], description="nothing else may run on the run's GPUs"
    )
    priority: Priority = contract.SCHEDULING_DEFAULTS["priority"]
    cpus: int = Field(contract.SCHEDULING_DEFAULTS["cpus"], ge=0, le=MAX_CPUS, description="CPU slots the run takes")
    memory_mb: int | None = Field(
        contract.SCHEDULING_DEFAULTS["memory_mb"],
        ge=1,
        le=MAX_MEMORY_MB,
        description="host memory limit of the run (its cgroup), in MB",
    )
    preemptible: bool | None = Field(
        contract.SCHEDULING_DEFAULTS["preemptible"],
        description="a waiting job of a higher lane may stop it at an episode boundary (it resumes later); "
        "default: true in the low lane, false otherwise",
    )

    @field_validator("marginal_vram_mb", mode="before")
    @classmethod
    def _vram_figure(cls, v: Any) -> Any:
        # One clear error instead of the two of the union (not an int; not 'auto').
        if v == "auto" and isinstance(v, str):
            return v
        if type(v) is not int:
            raise ValueError(f"must be an integer number of MB or 'auto', not {json.dumps(v)[:40]}")
        if not 0 <= v <= MAX_VRAM_MB:
            raise ValueError(f"must be between 0 and {MAX_VRAM_MB} MB, or 'auto'")
        return v


class EvalSpec(_Strict):
    """A submitted evaluation. Defaults are filled in before it is written as ``spec.json``."""

    name: str | None = Field(None, max_length=MAX_NAME_CHARS)
    entrypoint: str | None = Field(
        None, max_length=MAX_PATH_CHARS, description="pkg.module:function or path/file.py:function"
    )
    source: str | None = Field(None, max_length=MAX_SOURCE_CHARS, description="source of eval.py")
    episodes: int = Field(1, ge=0, le=MAX_EPISODES)
    params: dict[str, Any] = Field(default_factory=dict)
    workers: int = Field(1, ge=1, le=MAX_WORKERS)
    seed: int = Field(0, ge=-(2**63), le=2**63 - 1)
    models: list[str] = Field(default_factory=list, max_length=MAX_MODELS)
    env: dict[str, str] = Field(default_factory=dict)
    cwd: str | None = Field(None, max_length=MAX_PATH_CHARS)
    timeout_s: float | None = Field(None, gt=0, le=365 * 24 * 3600)
    depends_on: list[str] = Field(default_factory=list, max_length=MAX_DEPENDS_ON)
    scheduling: Scheduling = Field(default_factory=Scheduling)
    executor: Executor | None = Field(
        None, description="where the run executes: this host's ledger ('local') or SLURM; default: the server's"
    )
    retries: int = Field(0, ge=0, le=MAX_RETRIES, description="automatic resumes after a failure named in retry_on")
    retry_on: list[str] = Field(
        default_factory=lambda: list(contract.DEFAULT_RETRY_ON),
        max_length=len(contract.RETRYABLE_CODES),
        description="the reason codes of failures that are retried: " + ", ".join(contract.RETRYABLE_CODES),
    )
    detach: bool = Field(False, description="the run does not die with the server; a restarted server re-attaches it")
    fresh_interpreter: bool = Field(
        False, description="start the run in a fresh interpreter, never forked from a warm zygote"
    )

    @field_validator("retry_on")
    @classmethod
    def _retry_codes(cls, v: list[str]) -> list[str]:
        for code in v:
            if code not in contract.RETRYABLE_CODES:
                raise ValueError(f"unknown reason code {code!r}; choose from {', '.join(contract.RETRYABLE_CODES)}")
        return list(dict.fromkeys(v))

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
        total = 0
        for key, value in v.items():
            if not key or "=" in key or "\x00" in key or "\x00" in value:
                raise ValueError(f"invalid environment variable {key[:100]!r}")
            if len(key) > MAX_ENV_NAME_CHARS:
                raise ValueError(
                    f"a variable's name is {len(key)} characters; at most {MAX_ENV_NAME_CHARS} are accepted"
                )
            try:  # the environment is bytes: a lone surrogate (valid in JSON) cannot be passed on
                size = len(value.encode("utf-8"))
                total += len(key.encode("utf-8")) + size + 2  # NAME=value and its NUL
            except UnicodeEncodeError:
                raise ValueError(f"environment variable {key!r} is not valid UTF-8") from None
            if size > MAX_ENV_VALUE_BYTES:
                raise ValueError(f"the value of {key!r} is {size} bytes; at most {MAX_ENV_VALUE_BYTES} are accepted")
        if total > MAX_ENV_BYTES:
            raise ValueError(
                f"the variables take {total} bytes (NAME=value, each with its NUL); at most {MAX_ENV_BYTES} "
                "are accepted"
            )
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
        check_json_finite(v, "params")
        check_params_size(json_chars(v))
        return v

    @model_validator(mode="after")
    def _fill_defaults(self) -> EvalSpec:
        if self.entrypoint is None:
            if self.source is None:
                raise ValueError("one of 'entrypoint' or 'source' is required")
            self.entrypoint = "eval.py:episode"
        if self.name is None:
            self.name = default_name(self.entrypoint)
        if self.scheduling.preemptible is None:
            self.scheduling.preemptible = contract.default_preemptible(self.scheduling.priority)
        return self

    @model_validator(mode="after")
    def _bounded(self) -> EvalSpec:
        # After _fill_defaults: what is measured is what spec.json holds. The params are measured
        # apart, as they are (a dump of them would copy them).
        rest = self.model_dump(mode="json", exclude={"params", "sweep"})
        check_spec_size(json_chars(rest) + len(',"params":') + json_chars(self.params))
        return self


# Names people write for a field, from the CLI's flags and habit: where "did you mean" points.
FIELD_ALIASES = {
    "vram": "marginal_vram_mb",
    "vram_mb": "marginal_vram_mb",
    "memory": "memory_mb",
    "exclusive": "exclusive_gpu",
    "timeout": "timeout_s",
    "param": "params",
    "model": "models",
    "depends": "depends_on",
}


def _field_sections(model: type[BaseModel], path: tuple[str, ...] = ()) -> dict[str, list[tuple[str, ...]]]:
    """Every field of ``model`` and of its sub-models, with where it sits: ``{"gpus":
    [("scheduling",)], "episodes": [()]}``."""
    out: dict[str, list[tuple[str, ...]]] = {}
    for name, info in model.model_fields.items():
        out.setdefault(name, []).append(path)
        sub = info.annotation
        if isinstance(sub, type) and issubclass(sub, BaseModel):
            for inner, where in _field_sections(sub, (*path, name)).items():
                out.setdefault(inner, []).extend(where)
    return out


def _placed(name: str, where: tuple[str, ...]) -> tuple[str, str]:
    """``("under scheduling", '{"scheduling": {"gpus": ...}}')`` or the top level's."""
    example = f'"{name}": ...'
    for section in reversed(where):
        example = f'"{section}": {{{example}}}'
    return ("under " + ".".join(where) if where else "at the top level", "{" + example + "}")


def extra_field_hint(model: type[BaseModel], loc: tuple[Any, ...]) -> str | None:
    """What to do about an unknown field at ``loc`` of a ``model`` body: the section it belongs
    in when it is a field of another one (``marginal_vram_mb belongs under scheduling:
    {"scheduling": {"marginal_vram_mb": ...}}``), else the field it is probably a typo of; None
    when nothing is close."""
    if not loc or not isinstance(loc[-1], str):
        return None
    name, here = loc[-1], tuple(str(part) for part in loc[:-1])
    sections = _field_sections(model)
    elsewhere = [where for where in sections.get(name, []) if where != here]
    if elsewhere:
        place, example = _placed(name, elsewhere[0])
        return f"{name} belongs {place}: {example}"
    candidates = [field for field, places in sections.items() for _ in places]
    meant = FIELD_ALIASES.get(name.lower())
    if meant not in sections:
        meant = next(iter(difflib.get_close_matches(name, candidates, n=1, cutoff=0.7)), None)
    if meant is None:
        return None
    where = here if here in sections[meant] else sections[meant][0]
    if where == here:
        return f"did you mean {meant}?"
    place, example = _placed(meant, where)
    return f"did you mean {meant}, which belongs {place}: {example}?"


def json_chars(value: Any) -> int:
    """Characters of ``value`` as compact JSON, non-ASCII escaped: its size in ``spec.json``."""
    return len(json.dumps(value, separators=(",", ":"), allow_nan=False))


def check_params_size(size: int) -> None:
    if size > MAX_PARAMS_JSON_CHARS:
        raise ValueError(f"params are {size} characters as JSON; at most {MAX_PARAMS_JSON_CHARS} are accepted")


def check_spec_size(size: int) -> None:
    if size > MAX_SPEC_JSON_CHARS:
        raise ValueError(
            f"the spec is {size} characters as JSON (non-ASCII escaped, as spec.json holds it); at most "
            f"{MAX_SPEC_JSON_CHARS} are accepted"
        )


def check_json_finite(value: Any, where: str, depth: int = 0) -> None:
    """ValueError when ``value`` holds a non-finite number or is nested deeper than
    ``MAX_PARAMS_DEPTH`` (``depth``: where it sits in the params)."""
    if depth > MAX_PARAMS_DEPTH:
        raise ValueError(f"{where} is nested too deeply")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{where} contains a non-finite number")
    if isinstance(value, dict):
        for k, item in value.items():
            check_json_finite(item, f"{where}.{k}", depth + 1)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            check_json_finite(item, f"{where}[{i}]", depth + 1)


def default_name(entrypoint: str) -> str:
    target, _, func = entrypoint.rpartition(":")
    base = target.rsplit("/", 1)[-1]
    if base.endswith(".py"):
        base = base[:-3]
    else:
        base = base.rsplit(".", 1)[-1]
    return base if func == "episode" else f"{base}.{func}"


class LeaseRequest(_Strict):
    """``POST /evalsched/leases``: VRAM for interactive work, admitted like a run."""

    vram_mb: int = Field(0, ge=0, le=MAX_VRAM_MB, description="VRAM per GPU, in MB")
    gpus: int = Field(contract.SCHEDULING_DEFAULTS["gpus"], ge=1, le=MAX_GPUS)
    exclusive_gpu: bool = Field(
        contract.SCHEDULING_DEFAULTS["exclusive_gpu"],
        description="nothing else on the leased GPUs (the interactive lock)",
    )
    priority: Priority = Field("high", description="lane: a person is waiting")
    pid: int | None = Field(None, ge=1, le=2**31 - 1, description="the lease ends when this process exits")
    ttl_s: float | None = Field(None, gt=0, le=365 * 24 * 3600, description="the lease ends this long after its grant")
    label: str = Field("", max_length=200, description="shown in the ledger and in the reasons of what waits")

    @field_validator("label")
    @classmethod
    def _label_printable(cls, v: str) -> str:
        if any(ord(c) < 32 for c in v):
            raise ValueError("must not contain control characters")
        return v.strip()

    @model_validator(mode="after")
    def _asks_for_something(self) -> LeaseRequest:
        if self.vram_mb == 0 and not self.exclusive_gpu:
            raise ValueError("a lease needs vram_mb > 0 or exclusive_gpu")
        return self


HolderKind = Literal["run", "lease", "kernel", "process", "model", "user"]
assert HolderKind.__args__ == contract.HOLDER_KINDS  # type: ignore[attr-defined]


class Holder(BaseModel):
    """What stands in a pending job's way (contract.Holder)."""

    kind: HolderKind
    id: str | None = Field(None, description="a run's or lease's id, a kernel's id, a process's pid")
    name: str | None = Field(None, description="a run's name, a lease's label, a kernel's notebook path")
    gpu: int | None = Field(None, description="the GPU it holds (NVML order), when that is what blocks")
    mb: int | None = Field(None, description="the VRAM it holds on that GPU")


class Why(BaseModel):
    """A pending reason as data (contract.Why): the record's ``reason`` is derived from it."""

    code: str = Field(description="the reason code (waiting_vram, reserved_for, preempted_by, ...)")
    arg: str | None = Field(None, description="the code's argument: reserved_for:<arg>")
    detail: str | None = Field(None, description="the human sentence after ': '")
    # A default (not a factory) so that the document says it: always sent (pydantic copies it).
    holders: list[Holder] = Field(default=[], description="what stands in the way, largest first")


LeaseState = Literal["queued", "granted", "ended"]
assert LeaseState.__args__ == contract.LEASE_STATES  # type: ignore[attr-defined]


class LeaseRecord(BaseModel):
    """A lease, as REST answers it, events carry it and ``<runs_dir>/.leases/<id>.json`` holds it."""

    model_config = ConfigDict(extra="ignore")

    id: str
    state: LeaseState
    reason: str | None = Field(
        None, description="why it waits, or how it ended (released, process_exited, ttl_expired)"
    )
    why: Why | None = Field(
        None, description="why it waits, as data (its reason is derived from it); null once granted"
    )
    vram_mb: int
    gpus: int = 1
    exclusive_gpu: bool = False
    priority: Priority = "high"
    devices: list[int] = Field(default_factory=list, description="the leased GPU indices (NVML order) once granted")
    cuda_visible_devices: str | None = Field(
        None, description="the CUDA_VISIBLE_DEVICES value that shows the leased GPUs"
    )
    pid: int | None = None
    pid_create_time: float | None = None
    label: str = ""
    kernel_id: str | None = Field(None, description="the notebook kernel that holds the lease, when its pid is one")
    session_path: str | None = Field(None, description="that kernel's notebook")
    ttl_s: float | None = None
    requested_at: str
    granted_at: str | None = None
    ended_at: str | None = None
    seq: int = 0
    observed_mb: dict[str, int] = Field(
        default_factory=dict, description="VRAM its process (and children) use now, per GPU index (NVML)"
    )
    over_lease_mb: int = Field(0, description="how much more than leased its process uses, summed over GPUs")


class LeaseList(BaseModel):
    leases: list[LeaseRecord]


class Progress(BaseModel):
    done: int = 0
    total: int = 0


class Observed(BaseModel):
    """What a run used, as observed while it ran: peaks only (they never go down)."""

    peak_vram_mb: dict[str, int] = Field(default_factory=dict, description="per GPU index (NVML order)")
    peak_rss_mb: int | None = Field(
        None,
        description="host memory at its peak: the run's memory cgroup peak where there is one (page cache "
        "it caused included, as the limit counts it), else the highest sampled RSS of its processes",
    )
    source: Literal["nvml", "virtual"] = Field("nvml", description="where the VRAM figures come from")


class AttemptEnd(BaseModel):
    """How an earlier attempt of a run ended (the record's ``history``)."""

    attempt: int
    state: Literal["failed", "cancelled", "aborted", "preempted"]
    reason: str | None = None
    started_at: str | None = None
    finished_at: str | None = None
    episodes_done: int = 0


class SweepRequest(EvalSpec):
    """``POST /evalsched/sweeps``: a spec plus the points to run it at."""

    sweep: Any = Field(
        description='a grid {"<param>": [values, ...]} (every combination) or a list of points '
        '[{"<param>": value, ...}]; each point updates the spec\'s params for one run'
    )

    def base_spec(self) -> EvalSpec:
        """The spec without the sweep. Validated already, as this request: not again (a large
        spec's validation is costly, and it is the same)."""
        fields = {name: getattr(self, name) for name in EvalSpec.model_fields}
        return EvalSpec.model_construct(self.model_fields_set - {"sweep"}, **fields)


class RunRecord(BaseModel):
    """The run record: REST answers, events and ``job.json`` share it. Every field the server
    sends is declared here (a test checks); unknown fields in an old ``job.json`` are dropped."""

    model_config = ConfigDict(extra="ignore")

    id: str
    name: str
    state: State
    reason: str | None = Field(None, description="a reason code, then an optional sentence after ': '")
    why: Why | None = Field(
        None, description="what it waits for, as data (its reason is derived from it); null when nothing is pending"
    )
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
    idempotency_key: str | None = Field(
        None,
        description="the Idempotency-Key header of the submission; for a sweep's run '<key>#<i> <n>:<digest>' "
        "(its point, the sweep's number of points and their digest)",
    )
    entrypoint: str | None = Field(None, description="the eval's entrypoint (eval.py:... for a cell's source)")
    source_digest: str | None = Field(None, description="sha256 of the spec's source, when it carries one")
    marginal_vram_source: str = Field(
        "declared", description="where marginal_vram_mb came from: 'declared', or 'auto: ...' with the figures"
    )
    memory_mb: int | None = Field(None, description="the host memory limit asked for (scheduling.memory_mb)")
    observed: Observed | None = Field(None, description="what the run was seen to use (null before anything was)")
    warnings: list[str] = Field(
        default_factory=list, description="problems seen while it ran, each starting with a code (over_vram: ...)"
    )
    attempt: int = Field(1, description="1 for the first attempt; resumes, retries and preemptions add one")
    preemptions: int = Field(0, description="times the run was preempted (stopped for a higher lane, resumed later)")
    preemptible: bool = Field(False, description="scheduling.preemptible, defaults filled in")
    retries: int = Field(0, description="automatic retries allowed (the spec's retries)")
    retries_used: int = Field(0, description="automatic retries made (a resume through the API starts again at 0)")
    retry_at: str | None = Field(None, description="when a retry waiting out its back-off is admitted again")
    detach: bool = Field(False, description="the run does not die with the server")
    start: Literal["warm", "cold"] | None = Field(
        None, description="how its current attempt started: forked from a zygote ('warm') or a fresh interpreter"
    )
    start_detail: str | None = Field(None, description="which zygote forked it, or why it started cold")
    sweep_id: str | None = Field(None, description="the sweep the run belongs to (POST /evalsched/sweeps)")
    sweep_name: str | None = Field(
        None, description="its sweep's name: the base of its runs' names '<base> [<point>]' (null outside a sweep)"
    )
    sweep_point: dict[str, Any] | None = Field(
        None, description="the parameters its sweep set for it (its params are the spec's updated with them)"
    )
    history: list[AttemptEnd] = Field(default_factory=list, description="how each earlier attempt ended")


RECORD_FIELDS = frozenset(RunRecord.model_fields)


class SweepView(BaseModel):
    id: str
    runs: list[RunRecord]
    counts: dict[str, int] = Field(default_factory=dict, description="runs per state")


class SweepCreated(BaseModel):
    id: str
    runs: list[RunRecord]


class SweepSummary(BaseModel):
    id: str
    name: str | None = Field(None, description="the name of its first run")
    runs: int
    counts: dict[str, int]
    submitted_at: str | None = None
    seq: int


class SweepList(BaseModel):
    sweeps: list[SweepSummary]


class MetricStat(BaseModel):
    mean: float | None = Field(description="over the episodes where the metric is a finite number")
    stderr: float | None = Field(description="sample standard deviation / sqrt(count); null below 2 episodes")
    count: int


class MetricDelta(BaseModel):
    mean: float | None = Field(description="mean paired difference against the baseline; null without pairs")
    ci95: list[float] | None = Field(description="95 % Student t interval of that mean; null below 2 pairs")
    paired: int = Field(description="episode indices both runs have")


class CompareRow(BaseModel):
    id: str
    name: str | None
    state: str | None = None
    params: dict[str, Any] = Field(description="the values of the parameters that differ between the runs")
    metrics: dict[str, MetricStat]
    delta: dict[str, MetricDelta]
    wall_s: float | None = Field(description="finished_at - started_at")
    peak_vram_mb: int | None = Field(description="the observed VRAM peak, summed over its GPUs")
    error: str | None = Field(None, description="why its spec or episodes could not be read")


class Comparison(BaseModel):
    params: list[str] = Field(description="the names of the parameters whose values differ")
    metrics: list[str] = Field(description="the metric names compared: at most MAX_METRIC_NAMES (256), the first seen")
    metrics_dropped: int = Field(0, description="metric names left out beyond MAX_METRIC_NAMES")
    baseline: str | None = Field(description="the run the deltas are against")
    rows: list[CompareRow]


class RunDetail(RunRecord):
    summary: dict[str, Any] | None = None
    summary_error: str | None = Field(None, description="why summary.json could not be read, when it exists but cannot")


class RunCancelAnswer(RunRecord):
    """A run's cancel answered: its record, and whether the run still ends."""

    cancel_requested: bool = Field(
        description="the cancel is under way: the run was signalled (or scancel'd) and ends cancelled when its "
        "process does; false when it ended already (cancelled at once, or before the cancel)"
    )


class SweepCancelAnswer(BaseModel):
    """A sweep's cancel answered: its view (``SweepView``), each run with ``cancel_requested``, and
    how many still end."""

    id: str
    runs: list[RunCancelAnswer]
    counts: dict[str, int] = Field(default_factory=dict, description="runs per state")
    still_ending: int = Field(
        description="how many of its runs were signalled (or scancel'd) and have not ended yet: each ends "
        "cancelled when its process does (they show as running until then); 0 when every run ended"
    )


class RunList(BaseModel):
    runs: list[RunRecord]
    total: int


class LedgerRun(BaseModel):
    id: str
    marginal_vram_mb: int


class LedgerLease(BaseModel):
    id: str
    vram_mb: int = Field(description="what the lease holds on this GPU (all usable VRAM when exclusive)")
    pid: int | None = None
    label: str = ""
    kernel_id: str | None = None
    session_path: str | None = None
    observed_mb: int = Field(0, description="what its process uses on this GPU now")
    over_lease_mb: int = Field(0, description="observed beyond the lease: charged as unmanaged")


class UnmanagedProcess(BaseModel):
    pid: int
    gpu: int
    used_mb: int
    name: str = ""
    kernel_id: str | None = Field(None, description="the notebook kernel this process is (or runs under)")
    session_path: str | None = Field(None, description="that kernel's notebook")
    lease_id: str | None = Field(None, description="the lease that covers it: charged max(lease, observed)")
    user: str | None = Field(
        None,
        description="on a host shared through a host ledger: the user whose process it is (another user's "
        "carries nothing more than pid, gpu, used_mb and user)",
    )


class LedgerModel(BaseModel):
    name: str
    vram_mb: int
    state: str = Field(
        description="held: the ledger holds its VRAM (admitted, loading or loaded); unloading: its host is "
        "being stopped for a waiting job (it holds its VRAM until it is gone); waiting: its load waits for room"
    )
    idle_s: float | None = Field(None, description="since a caller last used it (0 while in use); null while waiting")
    idle_unload_s: float | None = Field(None, description="unloaded for a waiting job once idle this long; null: never")
    why: Why | None = Field(None, description="why its load waits (waiting only)")


class LedgerUser(BaseModel):
    """Another user's grants on a device of a host shared through a host ledger: by user name only."""

    user: str
    allocated_mb: int = Field(description="VRAM their grants hold on this device (not in allocated_mb)")
    leases: int = Field(description="their leases holding it")
    runs: int = Field(description="their runs holding it")
    models: int = Field(0, description="their servers' shared models holding it")


class LedgerDevice(BaseModel):
    index: int
    name: str
    total_mb: int
    baseline_mb: int = Field(description="VRAM the loaded shared models hold (part of allocated_mb)")
    usable_mb: int
    allocated_mb: int
    free_mb: int
    unmanaged_mb: int = Field(0, description="VRAM of processes the scheduler does not manage (beyond their leases)")
    unmanaged_processes: list[UnmanagedProcess] = Field(default_factory=list)
    exclusive: str | None = Field(None, description="id of the exclusive run or lease holding the device")
    runs: list[LedgerRun] = Field(default_factory=list)
    leases: list[LedgerLease] = Field(default_factory=list)
    models: list[LedgerModel] = Field(
        default_factory=list, description="shared models holding VRAM here, or waiting to"
    )
    users: list[LedgerUser] = Field(
        default_factory=list,
        description="on a host shared through a host ledger: the other users' grants here, by user name only "
        "(free_mb is net of them)",
    )


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
    queued: list[RunRecord] = Field(description="in admission order; the first `limit` when the request gave one")
    queued_total: int = Field(description="how many runs are queued, listed or not")
    running: list[RunRecord]
    ledger: Ledger
    leases: list[LeaseRecord] = Field(default_factory=list, description="live leases: granted, then queued in order")


class EpisodeList(BaseModel):
    episodes: list[dict[str, Any]] = Field(
        description="the episodes of this page's lines, in file order (lines that are not episodes skipped)"
    )
    next_offset: int | None = Field(
        None, description="the offset of the next page; null when this page reached the end of the file"
    )
    total: int = Field(0, description="the complete lines of episodes.jsonl when it was read (the run may append)")


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
    log: str | None = Field(None, description="the path of the host's stderr log, kept after it dies")
    inputs: int = Field(0, description="inputs served (a request may carry several)")
    failed_requests: int = 0
    batch_sizes: dict[str, int] = Field(default_factory=dict, description="batches per batch size")
    mean_batch_ms: float = Field(0.0, description="mean time of a batch's forward pass")
    max_batch_size: int = Field(8, description="the model's configured batch limit")
    max_wait_ms: float = Field(5.0, description="how long a batch waits to fill")
    load_seconds: float | None = Field(None, description="how long the last load took")
    pid: int | None = Field(None, description="the model host's process")
    restarts: int = Field(0, description="times its host was started again")
    held_s: float = Field(0.0, description="how long before a dead host may be started again (back-off)")
    endpoint: str | None = Field(
        None,
        description="the OpenAI-compatible base URL of the shared models (<server>/evalsched/v1); the model's id there is its name",
    )
    prompt_tokens: int = Field(0, description="prompt tokens its host has read (API requests and plain calls)")
    completion_tokens: int = Field(0, description="tokens its host has generated")
    tokens_per_s: float = Field(
        0.0, description="prompt and generated tokens per second over the last 60 s (or since the load, if later)"
    )
    tokens_per_s_since_load: float = Field(
        0.0, description="prompt and generated tokens per second since the model loaded"
    )
    last_used_at: str | None = Field(
        None, description="when a caller last sent a request or got an answer (UTC, ISO 8601)"
    )


class ModelList(BaseModel):
    models: list[ModelInfo]


class ModelConnection(BaseModel):
    """``POST /evalsched/models/{name}/connect``: where a kernel reaches a shared model."""

    name: str
    url: str = Field(description="the model's URL, as runs get it in shared_urls.json")


class DoctorCheck(BaseModel):
    name: str
    status: Literal["ok", "degraded", "error"]
    detail: str
    fix: str | None = Field(None, description="what to do about it, when it is not ok")


class DoctorReport(BaseModel):
    """``GET /evalsched/doctor``: what this host offers and what is in force."""

    checks: list[DoctorCheck]


class BrokenRun(BaseModel):
    id: str
    problem: str = Field(description="why its directory cannot be used")


class HostLedgerStatus(BaseModel):
    """The link to the host ledger of a host shared by several users."""

    socket: str = Field(description="its Unix socket")
    connected: bool
    user: str | None = Field(description="this server's user, as the host ledger knows it (from the kernel)")
    error: str | None = Field(description="why it is not connected, when it is not")


class ServerStatus(BaseModel):
    """``GET /evalsched/status``: this server's own view. The fields from ``runs_dir`` on are
    sent by the server that schedules the runs directory (the primary) only."""

    version: str
    role: Literal["primary", "secondary", "unavailable"]
    pid: int
    primary: PrimaryServer | None = Field(description="the server that schedules for this runs directory")
    error: str | None = Field(description="why no primary can answer, when none can")
    runs_dir: str | None = None
    counts: dict[str, int] | None = Field(
        None, description="queued, running and total runs, and the active runs of each executor outside the ledger"
    )
    started: bool | None = Field(
        None, description="recovery has read the runs directory (until then run endpoints answer 503)"
    )
    cgroups: dict[str, Any] | None = Field(None, description="the cgroup mode in force")
    warm_start: dict[str, Any] | None = Field(None, description="the zygotes, or why warm starts are refused")
    enforce_vram: Literal["off", "warn", "kill"] | None = None
    gpu_source: str | None = Field(None, description="nvml, virtual, or the configured probe's")
    host_ledger: HostLedgerStatus | None = Field(
        None, description="the host ledger this server is a tenant of (EvalSchedApp.host_ledger), when set"
    )
    broken_runs: list[BrokenRun] = Field(default_factory=list, description="run directories that cannot be used")


class ErrorBody(BaseModel):
    message: str
    reason: str | None = None
    detail: list[dict[str, Any]] | None = None
