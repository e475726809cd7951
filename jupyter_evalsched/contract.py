"""The public contract's vocabulary (docs/reference.md): states, reason codes, run-directory file names,
scheduling defaults. One place, imported by the server, the runner, the client and the policy.

Standard library only, and nothing but builtins at import time: the run subprocess imports
this on its start-up path, where every module costs (no ``re``, no ``datetime``).
"""

from __future__ import annotations

TYPE_CHECKING = False  # typing is not imported at run time (see above); mypy knows this name
if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping
    from typing import Any

# --------------------------------------------------------------------------- states

QUEUED = "queued"
RUNNING = "running"
SUCCEEDED = "succeeded"
FAILED = "failed"
CANCELLED = "cancelled"
ABORTED = "aborted"

STATES = (QUEUED, RUNNING, SUCCEEDED, FAILED, CANCELLED, ABORTED)
ACTIVE_STATES = frozenset({QUEUED, RUNNING})
TERMINAL_STATES = frozenset({SUCCEEDED, FAILED, CANCELLED, ABORTED})
RESUMABLE_STATES = frozenset({FAILED, CANCELLED, ABORTED})  # POST /runs/{id}/resume queues them again

# Leases (VRAM held for interactive work): their own three states.
LEASE_QUEUED = "queued"
LEASE_GRANTED = "granted"
LEASE_ENDED = "ended"
LEASE_STATES = (LEASE_QUEUED, LEASE_GRANTED, LEASE_ENDED)

# --------------------------------------------------------------------------- priority lanes

LANES = ("high", "normal", "low")  # highest first

# --------------------------------------------------------------------------- reason codes

WAITING_VRAM = "waiting_vram"
WAITING_CPU = "waiting_cpu"
WAITING_GPU_EXCLUSIVE = "waiting_gpu_exclusive"
# waiting_model_vram: a shared model the job needs (or a model's load itself) waits for room on its GPU
WAITING_MODEL_VRAM = "waiting_model_vram"
WAITING_DEPENDENCY = "waiting_dependency"
RESERVED_FOR = "reserved_for"  # reserved_for:<id>
DEPENDENCY_FAILED = "dependency_failed"  # dependency_failed:<id>
EXCEPTION = "exception"
EXIT_CODE = "exit_code"  # exit_code:<n>
SIGNAL = "signal"  # signal:<NAME>
TIMEOUT = "timeout"
CANCELLED_REASON = "cancelled"
SERVER_RESTART = "server_restart"
MODEL_UNAVAILABLE = "model_unavailable"  # model_unavailable: <model>: <why, with the host's stderr>
OVER_VRAM = "over_vram"  # over_vram: used 20000 MB on GPU 0, declared 8000 MB
OOM = "oom"  # the run's cgroup hit its memory_mb limit and the kernel killed it
PREEMPTED_BY = "preempted_by"  # preempted_by:<id>: queued again, resumes when there is room
PREEMPTING = "preempting"  # preempting:<id>: running, told to stop at its next episode boundary
# running: a cancel signalled it (or asked SLURM to end its job); it ends cancelled once it stopped
CANCELLING = "cancelling"
RETRYING = "retrying"  # queued, waiting out the back-off before an automatic retry
# queued: admitted (its resources held), its process not started yet (a model host, a cgroup, a zygote)
STARTING = "starting"
RUN_FILE = "run_file"  # run_file: _DONE is a FIFO, not a regular file; the server does not open it
# queued, GPU work only: the host ledger (c.EvalSchedApp.host_ledger) is not connected
HOST_LEDGER_UNAVAILABLE = "host_ledger_unavailable"
HOST_LEDGER = "host_ledger"  # host_ledger: <the host ledger's reason>: it did not grant the run's GPUs
QUOTA = "quota"  # quota: user alice may hold 20000 MB of VRAM; holds 16000 MB (the host ledger's)
# The reason codes of a failure that ``retry_on`` may name, and its default.
RETRYABLE_CODES = (EXCEPTION, EXIT_CODE, SIGNAL, OOM, TIMEOUT, OVER_VRAM, MODEL_UNAVAILABLE)
DEFAULT_RETRY_ON = (EXIT_CODE, SIGNAL, OOM)
# How a lease ends.
RELEASED = "released"
PROCESS_EXITED = "process_exited"
TTL_EXPIRED = "ttl_expired"


def reason(code: str, detail: str | None = None, *, arg: object = None, limit: int = 500) -> str:
    """``code``, ``code:arg``, ``code: detail`` or ``code:arg: detail`` — the contract's shape of a
    ``reason``: a code, then an optional human sentence after ``": "`` (one line, at most
    ``limit`` characters)."""
    text = code if arg is None else f"{code}:{arg}"
    if detail:
        text += ": " + one_line(detail, limit)
    return text


def run_named(run_id: str, name: str | None = None) -> str:
    """A run as a reason's sentence names it: ``run big-a (20261203T063534.645737-38512a)``, by
    its name and id (the id alone when it has no name of its own), so that a reader knows it
    without looking the id up."""
    return f"run {name} ({run_id})" if name and name != run_id else f"run {run_id}"


# Who asked for a cancel (``POST .../cancel?by=panel``), in the reason's words; without ``by``,
# "through the API".
CANCELLED_BY = {
    "panel": "from the Lab panel",
    "widget": "from a notebook widget",
    "cli": "with jupyter evalsched cancel",
    "python": "from Python (cancel())",
}


def cancelled_reason(by: str | None, when: str = "") -> str:
    """``cancelled: cancelled from the Lab panel while queued``: who cancelled (``by``, a key of
    ``CANCELLED_BY``) and when (``while queued``, ``before it started``, ...)."""
    who = CANCELLED_BY.get(by or "", "through the API")
    return reason(CANCELLED_REASON, f"cancelled {who}" + (f" {when}" if when else ""))


def cancelling_why(by: str | None, how: str) -> Why:
    """``cancelling: cancelled from the Lab panel; SIGTERM sent ...``: a running run a cancel has
    signalled, who asked (as in ``cancelled_reason``) and what was done (``how``)."""
    who = CANCELLED_BY.get(by or "", "through the API")
    return Why(CANCELLING, f"cancelled {who}; {how}")


def reason_code(text: str | None) -> str | None:
    """The code of a reason (``"waiting_vram: needs ..."`` -> ``"waiting_vram"``,
    ``"exit_code:3: ..."`` -> ``"exit_code"``); None for no reason."""
    if not text:
        return None
    return text.split(":", 1)[0]


def one_line(text: str, limit: int = 500) -> str:
    """Whitespace collapsed, at most ``limit`` characters: what a reason may carry of a message."""
    text = str(text)
    # Printable text has no whitespace but ASCII spaces: the split is needed only around doubled
    # or outer spaces (admission makes a reason per waiting job; this keeps that cheap).
    if not text.isprintable() or "  " in text or text[:1] == " " or text[-1:] == " ":
        text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


# --------------------------------------------------------------------------- why: a pending reason as data

# What can stand in a pending job's way (``why.holders[].kind``).
HOLDER_KINDS = ("run", "lease", "kernel", "process", "model", "user")


class _Value:
    """Compared and hashed by ``_key()``: a holder or a why is a value."""

    __slots__ = ()

    def _key(self) -> tuple[Any, ...]:
        raise NotImplementedError

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())


class Holder(_Value):
    """What stands in a pending job's way: a run or lease (id and name), a notebook kernel (its
    kernel id, its notebook path as name), another process (its pid as id), with the GPU and the
    MB it holds there when that is what blocks. Plain slots, not a dataclass: see the module's
    import rule."""

    __slots__ = ("kind", "id", "name", "gpu", "mb")

    def __init__(
        self, kind: str, id: str | None = None, name: str | None = None, gpu: int | None = None, mb: int | None = None
    ) -> None:
        self.kind = kind
        self.id = id
        self.name = name or None
        self.gpu = gpu
        self.mb = mb

    def as_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "id": self.id, "name": self.name, "gpu": self.gpu, "mb": self.mb}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Holder:
        return cls(data["kind"], data.get("id"), data.get("name"), data.get("gpu"), data.get("mb"))

    def _key(self) -> tuple[Any, ...]:
        return (self.kind, self.id, self.name, self.gpu, self.mb)

    def __repr__(self) -> str:
        return f"Holder{self._key()!r}"


class Why(_Value):
    """A pending reason as data (a record's ``why``): its code, argument, sentence and holders.
    The record's ``reason`` string is derived from it (``reason``), never the other way round, so
    the two cannot disagree and no reader parses the string."""

    __slots__ = ("code", "arg", "detail", "holders")

    def __init__(
        self,
        code: str,
        detail: str | None = None,
        *,
        arg: object = None,
        holders: Iterable[Holder] = (),
        limit: int = 500,
    ) -> None:
        self.code = code
        self.arg = None if arg is None else str(arg)
        # Normalised as ``reason`` would cut it: the sentence in the data is the one in the string.
        self.detail = one_line(detail, limit) if detail else None
        self.holders = tuple(holders)

    @property
    def reason(self) -> str:
        detail = self.detail
        return reason(self.code, detail, arg=self.arg, limit=len(detail) if detail else 500)

    def as_dict(self) -> dict[str, Any]:
        return {
            "code": self.code,
            "arg": self.arg,
            "detail": self.detail,
            "holders": [holder.as_dict() for holder in self.holders],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Why:
        """A record's ``why`` read back (a recovered record): the same fact, as it was."""
        detail = data.get("detail")
        return cls(
            data["code"],
            detail,
            arg=data.get("arg"),
            holders=[Holder.from_dict(h) for h in data.get("holders") or ()],
            limit=len(detail) if detail else 500,
        )

    def _key(self) -> tuple[Any, ...]:
        return (self.code, self.arg, self.detail, self.holders)

    def __repr__(self) -> str:
        return f"Why({self.reason!r}, holders={list(self.holders)!r})"


def why_dict(why: Why | None) -> dict[str, Any] | None:
    """A record's ``why`` field: the data, or None when nothing is pending."""
    return None if why is None else why.as_dict()


# --------------------------------------------------------------------------- run directory

SPEC_FILE = "spec.json"
SHARED_URLS_FILE = "shared_urls.json"
JOB_FILE = "job.json"
EVAL_SOURCE_FILE = "eval.py"
SUMMARY_FILE = "summary.json"
EPISODES_FILE = "episodes.jsonl"
STDOUT_FILE = "stdout.log"
STDERR_FILE = "stderr.log"
DONE_FILE = "_DONE"
# Distinct metric names a run keeps (the first seen): the runner aggregates and writes no others
# (summary.json counts them in "metrics_dropped"), and the server keeps no more of a summary's
# metrics in the run's record, nor of a run's episodes in a comparison.
MAX_METRIC_NAMES = 256
# The longest metric name a run keeps, in characters: the runner drops a longer one (counted in
# summary.json's "metrics_dropped"), and the server keeps none in a run's record (whatever
# summary.json holds) nor in a comparison, so that the record in job.json never outgrows what the
# server reads of a JSON file (store.MAX_JSON_BYTES, 16 MiB), also with MAX_METRIC_NAMES names of
# characters JSON escapes (up to 12 bytes each): 256 x 256 x 12 B = 768 KiB.
MAX_METRIC_NAME_CHARS = 256
# The warning on a run whose episodes returned more metric names than that, or names too long.
METRICS_CAPPED = "metrics_capped"
# Written by the server into a running run's directory to preempt it: the runner stops at its next
# episode boundary without finalizing (EXIT_STOPPED), and the run is resumed later.
STOP_FILE = "_STOP"
# The runner's exit status when it stopped at an episode boundary because of STOP_FILE (EX_TEMPFAIL).
EXIT_STOPPED = 75

# The entrypoint of a spec that carries ``source`` (the cell of ``%%eval_submit``).
DEFAULT_SOURCE_ENTRYPOINT = EVAL_SOURCE_FILE + ":episode"

# The largest ``limit`` of a list (``GET /evalsched/runs``, ``/sweeps``) or queue view.
MAX_LIST_LIMIT = 100_000
# The largest offset a route takes (a log's bytes, ``episodes.jsonl``'s lines): one that JSON and
# JavaScript clients hold exactly.
MAX_JSON_SAFE_INT = 2**53
# The logs route's headers: the offset just past the body (where the next read starts), and the
# log's size when it was read.
LOG_OFFSET_HEADER = "X-Evalsched-Log-Offset"
LOG_SIZE_HEADER = "X-Evalsched-Log-Size"

_RUN_ID_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._-")
MAX_RUN_ID_LENGTH = 128


def is_valid_run_id(run_id: object) -> bool:
    """``[A-Za-z0-9._-]{1,128}``, and neither ``.`` nor ``..``: a run id can never name a path
    outside the runs directory."""
    return (
        isinstance(run_id, str)
        and 0 < len(run_id) <= MAX_RUN_ID_LENGTH
        and run_id not in (".", "..")
        and all(c in _RUN_ID_CHARS for c in run_id)
    )


# --------------------------------------------------------------------------- scheduling

# The one place of the defaults: the spec's type (schemas.Scheduling) and a run's scheduling
# (scheduler/runs.RunScheduling) take them from here.
SCHEDULING_DEFAULTS: Mapping[str, Any] = {
    "marginal_vram_mb": 0,
    "gpus": 1,
    "exclusive_gpu": False,
    "priority": "normal",
    "cpus": 1,
    "memory_mb": None,
    "preemptible": None,  # None: default_preemptible(priority)
}


def default_preemptible(priority: str) -> bool:
    """A run that does not say is preemptible in the low lane only."""
    return priority == "low"


def scheduling_of(spec: Mapping[str, Any]) -> dict[str, Any]:
    """The spec's ``scheduling`` with every default filled in (a spec written by hand or by an
    older server may lack some)."""
    given = spec.get("scheduling")
    out = dict(SCHEDULING_DEFAULTS)
    if isinstance(given, dict):
        out.update({k: v for k, v in given.items() if v is not None})
    if out["preemptible"] is None:
        out["preemptible"] = default_preemptible(out["priority"])
    return out


def uses_gpu(marginal_vram_mb: int, exclusive_gpu: bool) -> bool:
    """A run gets GPUs when it declares VRAM or asks for a GPU of its own; otherwise it is a
    CPU-only run (``CUDA_VISIBLE_DEVICES=""``) and ``gpus`` does not matter."""
    return marginal_vram_mb > 0 or bool(exclusive_gpu)


# --------------------------------------------------------------------------- the entrypoint


def split_entrypoint(entrypoint: object) -> tuple[str, str]:
    """``"pkg.mod:fn"`` -> ``("pkg.mod", "fn")``; ValueError for anything else."""
    if not isinstance(entrypoint, str):
        raise ValueError(f"entrypoint must be a string like 'pkg.module:function', got {entrypoint!r:.80}")
    target, sep, func = entrypoint.rpartition(":")
    if not sep or not target or "\x00" in target or not func.isidentifier():
        raise ValueError(
            f"invalid entrypoint {entrypoint!r:.200}: expected 'pkg.module:function' or 'path/to/file.py:function'"
        )
    return target, func


def is_file_target(target: str) -> bool:
    """A file entrypoint (``path/to/file.py``) rather than a module (``pkg.module``)."""
    return target.endswith(".py") or "/" in target
