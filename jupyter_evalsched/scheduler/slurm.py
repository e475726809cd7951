"""Hand runs to SLURM: ``sbatch`` a run directory, follow the job, cancel it, judge its end.

The run directory contract does not change under SLURM: the job runs the same
``python -m jupyter_evalsched.runner --run-dir DIR`` as the local launcher, the runner writes
``summary.json`` and ``_DONE`` when it ends on its own, and the service finalizes runs that could
not (``verdict`` turns SLURM's end state into our state and reason).

Synchronous, standard library and subprocess only: the service calls this from a thread pool.
Every command has a timeout, so a hung ``slurmctld`` costs a :class:`SlurmError`, never a stuck
worker thread.

What the job sees:

* ``run_dir/slurm.sbatch`` is a self-contained bash script: the ``#SBATCH`` options, ``cd`` to
  the spec's ``cwd``, ``export`` of the run's environment, then the runner. SLURM's exit code and
  signal are the runner's, except that a run the runner finalized as failed exits 1 (so that
  ``afterok`` means "succeeded"; see ``_RUN_AND_REPORT``). The same
  options are also passed on sbatch's command line, which outranks both ``#SBATCH`` lines and any
  ``SBATCH_*`` variables in the server's environment (these still supply site defaults, such as
  ``SBATCH_ACCOUNT``, for options this module does not set).
* From the server's own environment, only what a run needs (``server_environment``): how to
  find its interpreter and libraries (``PATH``, ``PYTHONPATH``, ``VIRTUAL_ENV``, ``CONDA_*``,
  ``LD_LIBRARY_PATH``), who and where it is (``HOME``, ``USER``, ``LANG``, ``TMPDIR``, ...), and the
  settings of the ML libraries (``HF_*``, ``TRANSFORMERS_*``, ``TORCH*``, ``CUDA_*``, thread counts),
  never a variable whose name says token, secret, password, credential or key. The spec's ``env``
  and the server's ``run_env`` are exported whole: that is how a run asks for more, and an
  operator can add names or ``PREFIX*`` patterns with ``SlurmConfig.export_env``. The script is
  created owner-only (0700) before anything is written into it.
* Not exported: ``SLURM_*`` (SLURM sets the job's own; stale ones from a server that runs inside
  an allocation would overwrite them), ``EVALSCHED_PARENT_PID`` (the runner's parent under SLURM
  is slurmstepd, not our server), ``EVALSCHED_DEVICES`` (the runner then reads SLURM's
  ``CUDA_VISIBLE_DEVICES``), the host-specific shell variables (``HOSTNAME``, ``PWD``, ...), and,
  for a GPU run, the GPU visibility variables SLURM sets for its allocation. A CPU-only run gets
  ``CUDA_VISIBLE_DEVICES=""``; a GPU run gets ``CUDA_DEVICE_ORDER=PCI_BUS_ID``.
* ``exclusive_gpu`` adds nothing beyond ``--gres=gpu:k``: SLURM allocates a GPU gres to one job
  at a time (unless the site configures shards or MPS), so every SLURM GPU run is exclusive, and
  ``marginal_vram_mb`` only decides whether the run asks for GPUs at all.
* ``--no-requeue``: a requeued run would start again over its own half-written files.
* ``--comment=evalsched:<run id>:<attempt>``: with the script's path, how a restarted server finds
  the job of a run whose ``sbatch`` answered after its record was last written (``find_jobs``).
* ``--open-mode=append``: the logs are never truncated (the server may have written to them).
* With dependencies, ``--kill-on-invalid-dep=yes``: a job whose ``afterok`` dependency failed is
  cancelled (reason ``DependencyNeverSatisfied``) rather than left pending forever, even where the
  cluster lacks ``SchedulerParameters=kill_invalid_depend``.
"""

from __future__ import annotations

import collections
import math
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from .. import contract
from ..store import atomic_write_bytes

__all__ = [
    "FINISHED_STATES",
    "SlurmCommands",
    "SlurmConfig",
    "SlurmError",
    "SlurmCli",
    "SlurmJobState",
    "parse_scontrol_job",
    "is_job_id",
    "job_comment",
    "parse_found_jobs",
    "parse_squeue",
    "pending_reason",
    "pending_why",
    "render_sbatch_script",
    "sbatch_options",
    "verdict",
]

SCRIPT_NAME = "slurm.sbatch"

# squeue -O with "|" as each field's suffix: unpadded, untruncated, and no field can hold a "|".
# exit_code is the raw wait status (768 = exit 3; 11 = SIGSEGV); BatchHost is "n/a" until the job
# starts; Dependency reads e.g. "afterok:11(failed)" or "(null)".
SQUEUE_FIELDS = ("JobID", "State", "Reason", "exit_code", "BatchHost", "Dependency")
SQUEUE_FORMAT = ",".join(f"{name}:|" for name in SQUEUE_FIELDS)
# What find_jobs asks: a line is "<id>|<script path>|<comment>|", matched whole (either may hold "|").
FIND_FORMAT = "JobID:|,Command:|,Comment:|"

# SLURM's base job states in which the job is over and will not change. COMPLETING is not one:
# SLURM shows it while the job's processes are still being killed, and the run may still write
# its files, so the service must not finalize the run directory yet.
FINISHED_STATES = frozenset(
    {
        "COMPLETED",
        "FAILED",
        "CANCELLED",
        "TIMEOUT",
        "NODE_FAIL",
        "OUT_OF_MEMORY",
        "PREEMPTED",
        "BOOT_FAIL",
        "DEADLINE",
        "SPECIAL_EXIT",
        "REVOKED",
    }
)
# Our own state for a job that neither squeue nor scontrol knows: slurmctld purged its record
# (MinJobAge after its end) before we saw the end.
UNKNOWN = "UNKNOWN"

_INVALID_JOB_ID = "Invalid job id"  # in squeue's and scontrol's error for unknown job ids
_JOB_ID = re.compile(r"^[0-9]+(?:_[0-9]+)?$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_NOT_EXPORTED = frozenset(
    {
        "EVALSCHED_PARENT_PID",
        "EVALSCHED_DEVICES",
        # Per host or per shell: the node's bash sets its own, and some are read-only in bash.
        "HOSTNAME",
        "PWD",
        "OLDPWD",
        "SHLVL",
        "_",
        "UID",
        "EUID",
        "PPID",
        "SHELLOPTS",
        "BASHOPTS",
    }
)
# Set by SLURM for a job's GPU allocation (gres/gpu); ours would point at the wrong devices.
_GPU_VISIBILITY = frozenset({"CUDA_VISIBLE_DEVICES", "GPU_DEVICE_ORDINAL", "ROCR_VISIBLE_DEVICES", "ZE_AFFINITY_MASK"})
_PRIORITY_NICE = {"high": 0, "normal": 0, "low": 100}

# What a run may need of the server's environment (see the module docstring).
SERVER_ENV_NAMES = frozenset(
    {
        "PATH", "HOME", "USER", "LOGNAME", "SHELL", "LANG", "LANGUAGE", "TZ", "TMPDIR", "TERM",
        "PYTHONPATH", "PYTHONHOME", "PYTHONUNBUFFERED", "PYTHONDONTWRITEBYTECODE", "VIRTUAL_ENV",
        "LD_LIBRARY_PATH", "LIBRARY_PATH", "CPATH", "XDG_CACHE_HOME", "XDG_CONFIG_HOME", "XDG_DATA_HOME",
        "SLURM_CONF",  # sbatch reads it to find the cluster (it is not exported to the job)
        "EVALSCHED_FSYNC",
    }
)  # fmt: skip
SERVER_ENV_PREFIXES = (
    "LC_", "CONDA", "HF_", "HUGGINGFACE_", "TRANSFORMERS_", "TORCH", "CUDA_", "NCCL_", "NVIDIA_",
    "OMP_", "MKL_", "OPENBLAS_", "TOKENIZERS_", "SBATCH_",
)  # fmt: skip
# Words of a variable name (split at "_") that mark a credential: HF_TOKEN, not TOKENIZERS_*.
_SECRET_WORDS = frozenset(
    {"TOKEN", "SECRET", "PASSWORD", "PASSWD", "CREDENTIAL", "CREDENTIALS", "KEY", "APIKEY", "AUTH", "COOKIE"}
)


def server_environment(environ: Mapping[str, str], extra: Sequence[str] = ()) -> dict[str, str]:
    """What of the server's environment a SLURM run gets: the names and prefixes above, plus
    ``extra`` (names, or ``PREFIX*``), minus anything that looks like a credential."""
    names = SERVER_ENV_NAMES | {e for e in extra if not e.endswith("*")}
    prefixes = SERVER_ENV_PREFIXES + tuple(e[:-1] for e in extra if e.endswith("*"))
    out = {}
    for name, value in environ.items():
        explicit = name in extra
        if not (name in names or name.startswith(prefixes)):
            continue
        if not explicit and _SECRET_WORDS & set(name.upper().split("_")):
            continue
        out[name] = value
    return out


class SlurmError(Exception):
    """A SLURM command failed; the message carries its stderr."""


@dataclass(frozen=True, slots=True)
class SlurmCommands:
    """Names or paths of the SLURM client commands (tests point them at fakes)."""

    sbatch: str = "sbatch"
    squeue: str = "squeue"
    scontrol: str = "scontrol"
    scancel: str = "scancel"


@dataclass(slots=True)
class SlurmConfig:
    partition: str | None = None
    account: str | None = None
    extra_sbatch_args: list[str] = field(default_factory=list)
    # The interpreter the job runs; it must exist at this path on the compute nodes.
    python: str = sys.executable
    commands: SlurmCommands = field(default_factory=SlurmCommands)
    # --nice per priority. Negative values need SLURM operator rights, so "high" cannot rise above
    # the default; an unprivileged mapping that still orders the lanes is {0, 50, 100}.
    nice: Mapping[str, int] = field(default_factory=lambda: dict(_PRIORITY_NICE))
    command_timeout_s: float = 30.0
    # More of the server's environment for the jobs: names, or PREFIX* (see server_environment).
    export_env: list[str] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class SlurmJobState:
    job_id: str
    state: str  # SLURM's state name (PENDING, RUNNING, COMPLETING, COMPLETED, ...) or "UNKNOWN"
    reason: str  # SLURM's reason ("None", "Resources", "Dependency", "NonZeroExitCode", ...)
    exit_code: int | None  # the job script's exit status (the runner's, see _RUN_AND_REPORT); None unfinished
    signal: int | None  # the signal that ended it, if any
    finished: bool  # the state is final and no process of the job is left
    node: str | None = None  # the node the job runs or ran on (BatchHost); None while pending
    dependency: str | None = None  # SLURM's dependency text, e.g. "afterok:11(failed)"

    @property
    def popen_exit_code(self) -> int | None:
        """The exit code in ``Popen``'s convention (negative for a signal), as run records hold it."""
        if self.signal:
            return -self.signal
        return self.exit_code


# --------------------------------------------------------------------------- the sbatch script


def _job_name(spec: Mapping) -> str:
    name = str(spec.get("name") or "run")
    return "evalsched-" + re.sub(r"[^A-Za-z0-9._-]", "_", name)[:100]


def _uses_gpu(spec: Mapping) -> bool:
    sched = contract.scheduling_of(spec)
    return contract.uses_gpu(sched["marginal_vram_mb"], sched["exclusive_gpu"])


def _log_path(path: Path) -> str:
    # --output/--error are filename patterns: "%j" etc. are replaced, "%%" is a literal "%". A
    # backslash would switch the replacement off (and "%%" would then stay doubled): refuse it.
    text = str(path)
    if "\\" in text:
        raise SlurmError(f"SLURM cannot be given a log path containing a backslash: {text!r}")
    return text.replace("%", "%%")


def job_comment(run_id: str, attempt: int) -> str:
    """The ``--comment`` of a run's job: which run and attempt it is, for ``find_jobs``."""
    return f"evalsched:{run_id}:{attempt}"


def sbatch_options(
    run_dir: Path,
    spec: Mapping,
    dependency_job_ids: Sequence[str] = (),
    config: SlurmConfig | None = None,
    comment: str | None = None,
) -> list[str]:
    """The sbatch options for a run, as ``--name=value`` arguments."""
    config = config or SlurmConfig()
    run_dir = Path(run_dir)
    scheduling = contract.scheduling_of(spec)
    cwd = str(spec.get("cwd") or run_dir)
    opts = [
        f"--job-name={_job_name(spec)}",
        f"--output={_log_path(run_dir / contract.STDOUT_FILE)}",
        f"--error={_log_path(run_dir / contract.STDERR_FILE)}",
        "--open-mode=append",
        f"--chdir={cwd}",
        "--export=ALL",
        "--no-requeue",
        "--nodes=1",
        "--ntasks=1",
        f"--cpus-per-task={max(1, int(scheduling.get('cpus') or 1))}",
    ]
    if _uses_gpu(spec):
        opts.append(f"--gres=gpu:{max(1, int(scheduling.get('gpus') or 1))}")
    memory_mb = scheduling.get("memory_mb")
    if isinstance(memory_mb, int) and memory_mb > 0:
        opts.append(f"--mem={memory_mb}M")  # SLURM enforces it through its own cgroup
    timeout_s = spec.get("timeout_s")
    if timeout_s is not None and timeout_s > 0:
        # SLURM's limit has minute granularity: round up, so it never cuts a run short of timeout_s.
        opts.append(f"--time={max(1, math.ceil(timeout_s / 60))}")
    priority = scheduling.get("priority") or "normal"
    nice = config.nice.get(priority, 0)
    if nice:
        opts.append(f"--nice={nice}")
    deps = [str(j) for j in dependency_job_ids]
    if deps:
        for job_id in deps:
            _check_job_id(job_id)
        opts.append("--dependency=afterok:" + ":".join(deps))
        opts.append("--kill-on-invalid-dep=yes")
    if config.partition:
        opts.append(f"--partition={config.partition}")
    if config.account:
        opts.append(f"--account={config.account}")
    opts.extend(config.extra_sbatch_args)
    if comment is not None:
        # After extra_sbatch_args: the last --comment wins, and one of theirs (or an abbreviation,
        # "--com=") would hide the job from find_jobs (the run handed over again after a restart).
        opts.append(f"--comment={comment}")
    return opts


def _directive_token(option: str) -> str:
    # sbatch splits an #SBATCH line at blanks; double quotes keep a value with blanks together.
    if any(c in option for c in '\n\r\0"'):
        raise SlurmError(f"cannot write the sbatch option {option!r} into a script")
    if any(c.isspace() for c in option):
        name, eq, value = option.partition("=")
        return f'{name}="{value}"' if eq and name.startswith("-") else f'"{option}"'
    return option


def _sbatch_directives(options: list[str], n_extra: int) -> list[str]:
    """One ``#SBATCH`` line per option of ours; the config's extra arguments together on one line,
    since they may come as separate tokens ("-p", "debug")."""
    ours = options[: len(options) - n_extra]
    lines = [f"#SBATCH {_directive_token(o)}" for o in ours]
    if n_extra:
        lines.append("#SBATCH " + " ".join(_directive_token(o) for o in options[len(ours) :]))
    return lines


def job_environment(env: Mapping[str, str], uses_gpu: bool) -> dict[str, str]:
    """The variables a run's job script exports (see the module docstring for what is left out)."""
    out = {}
    for name, value in env.items():
        if name in _NOT_EXPORTED or name.startswith(("SLURM_", "BASH")) or not _ENV_NAME.match(name):
            continue
        if uses_gpu and name in _GPU_VISIBILITY:
            continue
        out[name] = str(value)
    if uses_gpu:
        out["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"  # SLURM's indices then match NVML's
    else:
        out["CUDA_VISIBLE_DEVICES"] = ""
    return out


def render_sbatch_script(
    run_id: str,
    run_dir: Path,
    spec: Mapping,
    env: Mapping[str, str],
    dependency_job_ids: Sequence[str] = (),
    config: SlurmConfig | None = None,
    comment: str | None = None,
) -> str:
    config = config or SlurmConfig()
    run_dir = Path(run_dir)
    cwd = str(spec.get("cwd") or run_dir)
    lines = [
        "#!/bin/bash",
        *_sbatch_directives(sbatch_options(run_dir, spec, dependency_job_ids, config), len(config.extra_sbatch_args)),
        *([f"#SBATCH {_directive_token(f'--comment={comment}')}"] if comment is not None else []),
        f"# jupyter_evalsched run {run_id}: written by the server, submitted with sbatch --parsable.",
        # Exit 66 (EX_NOINPUT) when cwd is missing on the node: the run then ends "exit_code:66".
        f"cd -- {shlex.quote(cwd)} || {{ echo 'evalsched: cannot enter the run cwd' {shlex.quote(cwd)} >&2; exit 66; }}",
    ]
    for name, value in sorted(job_environment(env, _uses_gpu(spec)).items()):
        lines.append(f"export {name}={shlex.quote(value)}")
    lines.append("unset EVALSCHED_PARENT_PID EVALSCHED_DEVICES")
    lines.append(_RUN_AND_REPORT.format(python=shlex.quote(config.python), run_dir=shlex.quote(str(run_dir))))
    return "\n".join(lines)


# The end of every job script. Not `exec`: the runner exits 0 whenever it finalizes the run, failed
# or not, and SLURM's afterok would then start the dependents of a failed run. So the script turns
# "finalized as failed" into exit 1 (the run directory, with _DONE, says what happened; the SLURM
# exit status only steers afterok), passes other exit codes on, and re-raises a signal that killed
# the runner on itself, so that SLURM records it (ExitCode 0:<sig>) as it would with exec. (Exit
# codes 129-192 of a normal exit are read as signals, as every shell reads them.) When SLURM
# signals the job (scancel, time limit) the shell and the runner get the signal together.
_RUN_AND_REPORT = """\
{python} -m jupyter_evalsched.runner --run-dir {run_dir}
rc=$?
if [ "$rc" -gt 128 ] && [ "$rc" -le 192 ]; then
  trap - "$((rc - 128))" 2>/dev/null
  kill -n "$((rc - 128))" $$
fi
if [ "$rc" -eq 0 ] && ! grep -Eqs '"status"[[:space:]]*:[[:space:]]*"succeeded"' {run_dir}/summary.json; then
  echo 'evalsched: the run did not succeed: the SLURM job exits 1, so that afterok dependents do not start' >&2
  exit 1
fi
exit "$rc"
"""


# --------------------------------------------------------------------------- parsing


def is_job_id(text: object) -> bool:
    """``text`` is a SLURM job id ("12", or an array task's "12_3"), and nothing more."""
    return isinstance(text, str) and _JOB_ID.fullmatch(text) is not None


def _check_job_id(job_id: str) -> str:
    if not is_job_id(job_id):
        raise SlurmError(f"not a SLURM job id: {job_id!r}")
    return job_id


def _none_if_null(text: str) -> str | None:
    text = text.strip()
    return None if text in ("", "(null)", "n/a", "None", "N/A") else text


def _base_state(state: str) -> str:
    # scontrol and squeue print one name; older versions could append flags ("CANCELLED+").
    return state.strip().split()[0].rstrip("+").upper() if state.strip() else UNKNOWN


def _from_wait_status(raw: str) -> tuple[int | None, int | None]:
    try:
        status = int(raw)
    except ValueError:
        return None, None
    return (status >> 8) & 0xFF, (status & 0x7F) or None


def parse_squeue(text: str) -> dict[str, SlurmJobState]:
    """Parse the output of ``squeue --noheader --Format=SQUEUE_FORMAT``."""
    jobs = {}
    for line in text.splitlines():
        if not line.strip():
            continue
        parts = [p.strip() for p in line.split("|")]
        if len(parts) < len(SQUEUE_FIELDS):
            raise SlurmError(f"unexpected squeue output line: {line!r}")
        job_id, state, reason, status, host, dependency = parts[: len(SQUEUE_FIELDS)]
        state = _base_state(state)
        finished = state in FINISHED_STATES
        exit_code, sig = _from_wait_status(status) if finished else (None, None)
        jobs[job_id] = SlurmJobState(
            job_id=job_id,
            state=state,
            reason=reason or "None",
            exit_code=exit_code,
            signal=sig,
            finished=finished,
            node=_none_if_null(host),
            dependency=_none_if_null(dependency),
        )
    return jobs


def parse_found_jobs(text: str, wanted: Mapping[str, str], job_ids: Iterable[str]) -> dict[str, list[str]]:
    """The jobs of ``find_jobs``' squeue (``FIND_FORMAT``) that are wanted: ``wanted`` maps each
    line's tail after the job id ("|<script path>|<comment>|") to a run id. Run id -> job ids.

    A comment (or a script's path) may hold line breaks: another job of the user can print lines
    that read as a wanted job's. A line counts only when its job id is one of the user's jobs
    (``job_ids``, squeue's list of ids alone) and begins no other line: every job's record begins
    with its own id, so a forged line repeats a real id or names none of the user's."""
    lines = text.splitlines()
    starts = collections.Counter(line.partition("|")[0].strip() for line in lines)
    known = set(job_ids)
    found: dict[str, list[str]] = {}
    for line in lines:
        job_id, bar, _ = line.partition("|")
        run_id = wanted.get(line.rstrip()[len(job_id) :]) if bar else None
        job_id = job_id.strip()
        if run_id is not None and _JOB_ID.match(job_id) and job_id in known and starts[job_id] == 1:
            found.setdefault(run_id, []).append(job_id)
    return found


def _field(text: str, name: str, pattern: str = r"\S*") -> str | None:
    m = re.search(rf"(?:^|\s){name}=({pattern})", text)
    return m.group(1) if m else None


def parse_scontrol_job(text: str) -> SlurmJobState | None:
    """Parse ``scontrol show job -o ID`` (one ``Key=Value ...`` line per job); None when empty."""
    text = text.strip().splitlines()[0] if text.strip() else ""
    job_id = _field(text, "JobId", r"\d+")
    if job_id is None:
        return None
    state = _base_state(_field(text, "JobState") or UNKNOWN)
    # Reason is one word, except a free-text state description ("Reason=launch failed ...")
    # which runs up to the next field, Dependency.
    m = re.search(r"\sReason=(.*?)\s+Dependency=", text)
    reason = m.group(1) if m else (_field(text, "Reason") or "None")
    exit_code = sig = None
    finished = state in FINISHED_STATES
    m = re.search(r"\sExitCode=(\d+):(\d+)", text)
    if m and finished:
        exit_code, sig = int(m.group(1)), int(m.group(2)) or None
    return SlurmJobState(
        job_id=job_id,
        state=state,
        reason=reason,
        exit_code=exit_code,
        signal=sig,
        finished=finished,
        node=_none_if_null(_field(text, "BatchHost") or ""),
        dependency=_none_if_null(_field(text, "Dependency") or ""),
    )


def _unknown(job_id: str) -> SlurmJobState:
    return SlurmJobState(job_id, UNKNOWN, "purged", None, None, True)


# --------------------------------------------------------------------------- the verdict


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"SIG{number}"


def _exit_code_reason(state: SlurmJobState) -> str:
    if state.signal:
        return f"signal:{_signal_name(state.signal)}"
    if state.exit_code is None:
        return "exit_code:unknown"
    return f"exit_code:{state.exit_code}"


_FAILED_DEPENDENCY = re.compile(r"(?:^|[,?:])(\d+(?:_\d+)?)(?:\+\d+)?\((?:failed|cancelled)\)", re.I)


def verdict(state: SlurmJobState, run_ids: Mapping[str, str] | None = None) -> tuple[str, str]:
    """Our contract's ``(state, reason)`` for a finished SLURM job whose run left no ``_DONE``.

    ``run_ids`` maps SLURM job ids to run ids, so that a job SLURM cancelled because an ``afterok``
    dependency failed gets ``dependency_failed:<run id>``. Raises ValueError for a job that is not
    finished.
    """
    if not state.finished:
        raise ValueError(f"SLURM job {state.job_id} is not finished ({state.state})")
    job = f"SLURM job {state.job_id}"
    s = state.state
    if s == "CANCELLED":
        if state.reason == "DependencyNeverSatisfied":
            m = _FAILED_DEPENDENCY.search(state.dependency or "")
            dep = m.group(1) if m else None
            who = (run_ids or {}).get(dep, dep) if dep else "unknown"
            return "failed", f"dependency_failed:{who}: {job} was cancelled because its dependency did not succeed"
        return "cancelled", f"cancelled: {job} was cancelled (scancel)"
    if s == "TIMEOUT":
        return "failed", f"timeout: {job} reached its SLURM time limit"
    if s == "DEADLINE":
        return "failed", f"timeout: {job} reached its SLURM deadline"
    if s == "OUT_OF_MEMORY":
        return "failed", f"signal:SIGKILL: out of memory ({job} exceeded its memory allocation)"
    if s in ("NODE_FAIL", "BOOT_FAIL"):
        node = f" {state.node}" if state.node else ""
        return "failed", f"{_exit_code_reason(state)}: node failure ({job}: {s} on node{node})"
    if s == "PREEMPTED":
        return "failed", f"{_exit_code_reason(state)}: {job} was preempted by SLURM"
    if s == UNKNOWN:
        return "failed", (
            f"exit_code:unknown: {job} is no longer known to SLURM (purged after MinJobAge) and the run "
            "did not finalize"
        )
    code = _exit_code_reason(state)
    if state.signal:
        detail = f"the run process was killed by {_signal_name(state.signal)}"
    else:
        detail = f"the run process exited with status {state.exit_code}"
    return "failed", f"{code}: {detail} without finalizing ({job} {s})"


def pending_why(state: SlurmJobState, uses_gpu: bool = False) -> contract.Why:
    """Why a queued run waits while SLURM holds its job pending, in the contract's codes.

    SLURM does not say which resource is short ("Resources", "Priority"); a GPU run waits for
    whole GPUs (a gres is never shared), hence ``waiting_gpu_exclusive``. Nor who holds it: no
    holders.
    """
    job = f"SLURM job {state.job_id}"
    if state.reason == "Dependency":
        return contract.Why(contract.WAITING_DEPENDENCY, f"{job} waits for {state.dependency or 'its dependencies'}")
    code = contract.WAITING_GPU_EXCLUSIVE if uses_gpu else contract.WAITING_CPU
    return contract.Why(code, f"{job} is pending in SLURM (reason {state.reason})")


def pending_reason(state: SlurmJobState, uses_gpu: bool = False) -> str:
    """A queued run's ``reason`` while SLURM holds its job pending (``pending_why``'s)."""
    return pending_why(state, uses_gpu).reason


# --------------------------------------------------------------------------- the executor


class SlurmCli:
    """SLURM's command-line client: submit, poll and cancel runs as batch jobs. Thread-safe;
    every method blocks (the SLURM executor calls it from a thread pool)."""

    def __init__(self, config: SlurmConfig | None = None) -> None:
        self.config = config or SlurmConfig()
        # How many times each SLURM command ran: a poll is one squeue, whatever the number of jobs.
        self.calls: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()

    # ---- commands

    def _command(self, kind: str) -> str:
        name = getattr(self.config.commands, kind)
        # Resolved against the server's PATH, not the run's (sbatch is run with the run's env).
        return shutil.which(name) or name

    def _run(self, kind: str, args: list[str], env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess:
        argv = [self._command(kind), *args]
        with self._lock:
            self.calls[kind] += 1
        try:
            return subprocess.run(
                argv,
                env=None if env is None else dict(env),
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                timeout=self.config.command_timeout_s,
            )
        except FileNotFoundError as exc:
            raise SlurmError(f"{kind} not found ({argv[0]!r}): is SLURM installed on this host?") from exc
        except subprocess.TimeoutExpired as exc:
            raise SlurmError(f"{kind} did not answer in {self.config.command_timeout_s:g} s") from exc
        except OSError as exc:
            raise SlurmError(f"cannot run {kind} ({argv[0]!r}): {exc}") from exc

    @staticmethod
    def _failure(kind: str, proc: subprocess.CompletedProcess) -> SlurmError:
        detail = (proc.stderr or "").strip() or (proc.stdout or "").strip() or "no output"
        return SlurmError(f"{kind} failed (exit {proc.returncode}): {detail}")

    # ---- submit

    def submit(
        self,
        run_id: str,
        run_dir: Path,
        spec: dict,
        env: dict[str, str],
        dependency_job_ids: list[str],
        attempt: int = 1,
    ) -> str:
        """Write ``run_dir/slurm.sbatch``, submit it and return the SLURM job id."""
        run_dir = Path(run_dir)
        deps = [str(j) for j in dependency_job_ids or ()]
        comment = job_comment(run_id, attempt)
        script = render_sbatch_script(run_id, run_dir, spec, env, deps, self.config, comment)
        path = run_dir / SCRIPT_NAME
        try:
            # Owner-only from its creation: it holds the run's environment.
            atomic_write_bytes(path, script.encode(), mode=0o700)
        except OSError as exc:
            raise SlurmError(f"cannot write {path}: {exc}") from exc
        # sbatch exports its own environment to the job (--export=ALL): give it the run's, without
        # the variables the job must not inherit. SLURM_CONF stays: it tells sbatch where to look.
        sbatch_env = {
            k: v
            for k, v in env.items()
            if k not in ("EVALSCHED_PARENT_PID", "EVALSCHED_DEVICES")
            and (not k.startswith("SLURM_") or k == "SLURM_CONF")
        }
        # The options again on the command line: they outrank SBATCH_* variables of the
        # environment, which would otherwise override the script's #SBATCH lines.
        args = ["--parsable", *sbatch_options(run_dir, spec, deps, self.config, comment), str(path)]
        proc = self._run("sbatch", args, env=sbatch_env)
        if proc.returncode != 0:
            raise self._failure("sbatch", proc)
        out = proc.stdout.strip().splitlines()
        job_id = out[-1].split(";", 1)[0].strip() if out else ""
        if not _JOB_ID.match(job_id):
            raise SlurmError(f"sbatch answered no job id: {proc.stdout.strip()!r} {proc.stderr.strip()!r}")
        return job_id

    # ---- poll

    def poll(self, job_ids: list[str]) -> dict[str, SlurmJobState]:
        """The state of each job: one ``squeue`` for all of them, then one ``scontrol show job``
        for each job squeue no longer lists. A job neither knows is ``UNKNOWN`` (and finished).
        Raises SlurmError when SLURM cannot be asked (e.g. slurmctld is down): keep the last
        known states and ask again later."""
        ids = list(dict.fromkeys(_check_job_id(str(j)) for j in job_ids))
        if not ids:
            return {}
        proc = self._run(
            "squeue", ["--noheader", "--states=all", f"--jobs={','.join(ids)}", f"--Format={SQUEUE_FORMAT}"]
        )
        if proc.returncode == 0:
            listed = parse_squeue(proc.stdout)
        elif _INVALID_JOB_ID in proc.stderr:
            # squeue fails like this when it asks for a single job that slurmctld has purged.
            listed = {}
        else:
            raise self._failure("squeue", proc)
        result = {}
        for job_id in ids:
            state = listed.get(job_id)
            result[job_id] = state if state is not None else self._show_job(job_id)
        return result

    def _show_job(self, job_id: str) -> SlurmJobState:
        proc = self._run("scontrol", ["show", "job", "-o", job_id])
        if proc.returncode != 0:
            if _INVALID_JOB_ID in proc.stderr:
                return _unknown(job_id)
            raise self._failure("scontrol", proc)
        state = parse_scontrol_job(proc.stdout)
        return state if state is not None and state.job_id == job_id else _unknown(job_id)

    # ---- find

    def find_jobs(self, runs: Mapping[str, tuple[Path, int]]) -> dict[str, list[str]]:
        """The jobs SLURM has (this user's, in any state it still lists) of ``runs`` (run id ->
        (run directory, attempt)): those whose script is the run's and whose comment names the run
        and attempt (``job_comment``). Two ``squeue``s (``parse_found_jobs``: a job's text cannot
        pass for another's); raises SlurmError when SLURM cannot be asked."""
        if not runs:
            return {}
        wanted = {
            f"|{Path(run_dir) / SCRIPT_NAME}|{job_comment(run_id, attempt)}|": run_id
            for run_id, (run_dir, attempt) in runs.items()
        }
        mine = ["--noheader", "--states=all", f"--user={os.getuid()}"]
        proc = self._run("squeue", [*mine, f"--Format={FIND_FORMAT}"])
        if proc.returncode != 0:
            raise self._failure("squeue", proc)
        # Then the ids alone (no text a job chooses): what parse_found_jobs checks the lines against.
        ids = self._run("squeue", [*mine, "--Format=JobID:|"])
        if ids.returncode != 0:
            raise self._failure("squeue", ids)
        return parse_found_jobs(
            proc.stdout, wanted, (line.partition("|")[0].strip() for line in ids.stdout.splitlines())
        )

    # ---- cancel

    def cancel(self, *job_ids: str) -> None:
        """``scancel``, one command for all of them: SIGTERM to every process of each job, SIGKILL
        after SLURM's KillWait. A job that has already ended is not an error (scancel itself
        ignores it; one SLURM no longer knows is skipped)."""
        if not job_ids:
            return
        proc = self._run("scancel", [_check_job_id(str(j)) for j in job_ids])
        if proc.returncode != 0 and not _only_invalid_ids(proc.stderr):
            raise self._failure("scancel", proc)


def _only_invalid_ids(stderr: str) -> bool:
    """scancel's complaints are all about job ids SLURM no longer knows (it still cancels the rest)."""
    lines = [line for line in stderr.splitlines() if line.strip()]
    return bool(lines) and all(_INVALID_JOB_ID in line for line in lines)
