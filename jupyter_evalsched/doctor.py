"""What this host offers and what is in force: ``GET /evalsched/doctor``, ``jupyter evalsched doctor``.

Each check is ``{"name", "status": "ok" | "degraded" | "error", "detail", "fix"}``: one line that
says what was found, and, when it is not ok, what to do about it. The server's checks describe the
scheduler as it runs; the same host checks (GPUs, cgroups, the runner's byte code) also run
without a server, from the CLI, which then also starts a zygote to see whether warm starts work.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .app import EvalSchedApp
    from .scheduler.cgroups import Cgroups
    from .scheduler.gpus import GpuProbe

OK, DEGRADED, ERROR = "ok", "degraded", "error"

# What a run process imports before the eval: compiled once, or every run compiles it again.
RUNNER_START_MODULES = (
    "__init__.py",
    "_version.py",
    "contract.py",
    "runner/__init__.py",
    "runner/__main__.py",
    "runner/run.py",
    "runner/_proc.py",
    "runner/fastjson.py",
    "runner/results.py",
    "runner/context.py",
    "runner/entrypoint.py",
    "runner/errors.py",
)


def check(name: str, status: str, detail: str, fix: str | None = None) -> dict[str, Any]:
    return {"name": name, "status": status, "detail": detail, "fix": fix}


def gpu_check(probe: GpuProbe) -> dict[str, Any]:
    devices = probe.devices()
    sizes = ", ".join(f"{d.total_mb}" for d in devices)
    if getattr(probe, "source", "nvml") == "virtual":
        table = getattr(probe, "processes_file", None)
        problem = getattr(probe, "problem", None)
        detail = f"{len(devices)} virtual GPU(s) of {sizes} MB"
        if table:
            procs = probe.processes()
            detail += f"; process table {table}: " + (
                f"{len(procs)} process(es)" if problem is None or "does not exist" in problem else problem
            )
            if problem is not None and "does not exist" not in problem:
                return check("gpus", DEGRADED, detail, 'write a JSON list of {"pid", "gpu", "used_mb"} there')
        return check("gpus", OK, detail)
    error = getattr(probe, "error", None)
    if error:
        return check(
            "gpus",
            DEGRADED,
            f"NVML unavailable ({error}): the host is treated as having no GPU; runs are CPU-only",
            "install the NVIDIA driver (nvidia-ml-py is a dependency), or set EVALSCHED_VIRTUAL_GPUS=24000,24000 "
            "on a host without GPUs",
        )
    if not devices:
        return check("gpus", DEGRADED, "NVML works but finds no GPU", "check nvidia-smi on this host")
    driver = getattr(probe, "driver_version", lambda: None)()
    names = "; ".join(f"{d.index}: {d.name} {d.total_mb} MB" for d in devices)
    detail = f"NVML, driver {driver or '?'}: {len(devices)} GPU(s): {names}"
    probe.processes()  # what NVML fails to tell shows up when it is asked
    problem = getattr(probe, "problem", None)
    if problem:
        return check(
            "gpus",
            DEGRADED,
            f"{detail}; NVML fails on {problem}: VRAM used outside the scheduler there is not seen",
            "a GPU lost needs a reset or a reboot; process lists 'Not Supported' is a container without "
            "the host's PID namespace (run it with --pid=host) or set usable_vram_mb for that GPU",
        )
    return check("gpus", OK, detail)


def cgroup_check(cgroups: Cgroups | None) -> dict[str, Any]:
    turned_off = (
        "off (EvalSchedApp.cgroups = False): process groups only; memory_mb is not enforced",
        "set EvalSchedApp.cgroups = True (the default), and leave EvalSchedApp.cgroup_parent unset or a delegated "
        "cgroup v2 directory",
    )
    if cgroups is None:
        return check("cgroups", DEGRADED, *turned_off)
    s = cgroups.support
    if s.mode == "none" and "turned off" in s.detail:  # the setting, not the host: say which setting
        return check("cgroups", DEGRADED, *turned_off)
    if s.mode == "none":
        return check("cgroups", DEGRADED, s.detail, "see the detail; memory_mb is not enforced meanwhile")
    if not s.memory:
        return check(
            "cgroups",
            DEGRADED,
            f"{s.mode}: kill by {s.kill}, but no memory controller: memory_mb is not enforced ({s.detail})",
            "give the server a delegated cgroup v2 subtree with the memory controller (EvalSchedApp.cgroup_parent)",
        )
    return check("cgroups", OK, f"{s.mode}: each run in its own cgroup, kill by {s.kill}, memory limits on")


def runner_bytecode_check(package_dir: Path | None = None) -> dict[str, Any]:
    root = package_dir or Path(__file__).resolve().parent
    stale = []
    for rel in RUNNER_START_MODULES:
        source = root / rel
        try:
            cached = Path(importlib.util.cache_from_source(str(source)))
            if not cached.exists() or cached.stat().st_mtime < source.stat().st_mtime:
                stale.append(rel)
        except (OSError, NotImplementedError, ValueError):
            stale.append(rel)
    if stale:
        why = " (PYTHONDONTWRITEBYTECODE is set: runs never write it themselves)" if sys.dont_write_bytecode else ""
        return check(
            "runner",
            DEGRADED,
            f"{len(stale)} module(s) of the runner's start are not byte-compiled: {', '.join(stale[:4])}"
            f"{'…' if len(stale) > 4 else ''}{why}; every run compiles them again (~6 ms)",
            f"{sys.executable} -m compileall -q {root}",
        )
    return check("runner", OK, f"byte-compiled ({root})")


_OCTAL_ESCAPE = re.compile(rb"\\([0-7]{3})")


def mount_of(path: str, mountinfo: bytes) -> tuple[str, str, str, str] | None:
    """(mount point, file system type, the device's major:minor, the mount's source) of the mount
    that holds ``path`` (resolved), from ``/proc/self/mountinfo``'s bytes: the longest mount point
    that is a prefix of it (the last listed of equals: an overmount comes after what it covers).
    The kernel escapes a space, tab, newline and backslash in a name as ``\\ooo``; names are
    bytes, decoded as the file system's names are (``os.fsdecode``)."""
    target = os.path.realpath(path)
    found: tuple[str, str, str, str] | None = None
    for line in mountinfo.splitlines():
        fields = line.split()
        try:
            sep = fields.index(b"-")
            point, fstype, devno, source = (
                os.fsdecode(_OCTAL_ESCAPE.sub(lambda m: bytes([int(m[1], 8)]), field))
                for field in (fields[4], fields[sep + 1], fields[2], fields[sep + 2])
            )
        except (ValueError, IndexError):
            continue
        inside = target == point or target.startswith(point.rstrip("/") + "/")
        if inside and (found is None or len(point) >= len(found[0])):
            found = (point, fstype, devno, source)
    return found


def runs_disk_check(
    runs_dir: str,
    mountinfo_path: str = "/proc/self/mountinfo",
    sys_block: str = "/sys/dev/block",
    sys_ext4: str = "/sys/fs/ext4",
    jbd2_dir: str = "/proc/fs/jbd2",
) -> dict[str, Any]:
    """The file system of the runs directory. Every run makes eleven files there and replaces
    three (``job.json`` twice, ``summary.json``). A file system of ext4's driver without a journal
    (ext4, or ext2 served by it), at every new file, skips each free inode it meets that was freed
    in the last minute (six minutes while its inode table block is not written back) and whose block is
    still cached: under a steady flow of runs a new file costs several times what it costs on a
    settled disk, and runs and submissions slow with it. Whether the file system has a journal:
    ``/sys/fs/ext4/<device>/journal_task`` (``<none>`` without one), else (kernels before it) the
    journal's ``/proc/fs/jbd2/<device>-<inode>``. Where any of it cannot be read, ``ok``: not
    known. (An overlay over such a disk is not followed.)"""
    try:
        with open(mountinfo_path, "rb") as f:
            mount = mount_of(runs_dir, f.read())
    except (OSError, ValueError) as exc:
        return check("runs disk", OK, f"{runs_dir}: its file system is not known ({exc})")
    if mount is None:
        return check("runs disk", OK, f"{runs_dir}: its file system is not known")
    point, fstype, devno, source = mount
    detail = f"{runs_dir} is on {fstype} ({point})"
    try:
        device = os.path.basename(os.readlink(os.path.join(sys_block, devno)))
    except OSError:
        return check("runs disk", OK, detail)  # (not a block device's: tmpfs, NFS, overlay...)
    if not os.path.isdir(os.path.join(sys_ext4, device)):
        return check("runs disk", OK, detail)  # (not ext4's driver)
    journal = _has_journal(os.path.join(sys_ext4, device, "journal_task"), jbd2_dir, device)
    if journal is None:
        return check("runs disk", OK, f"{detail}; whether it has a journal is not known")
    if journal:
        return check("runs disk", OK, f"{detail}, with a journal")
    return check(
        "runs disk",
        DEGRADED,
        f"{detail} without a journal ({source}): at every new file, the kernel skips the free inodes"
        " it meets that were freed in the last minute (in the last six minutes while their inode table"
        " block is not written back), and every run replaces three files: runs and submissions slow"
        " as they come faster",
        "put the runs directory on a file system with a journal (EvalSchedApp.runs_dir), or give this one"
        f" a journal (tune2fs -O has_journal {source}; it takes effect at the next mount)",
    )


def _has_journal(journal_task: str, jbd2_dir: str, device: str) -> bool | None:
    """Whether the ext4 file system on ``device`` has a journal; None: not known."""
    try:
        with open(journal_task) as f:
            return f.read().strip() != "<none>"
    except FileNotFoundError:
        pass  # (a kernel before the file: the journal's entry in /proc/fs/jbd2, below)
    except (OSError, ValueError):
        return None
    try:
        entries = os.listdir(jbd2_dir)
    except OSError:
        return None  # (no /proc/fs here, or no journal at all: jbd2 not loaded; not told apart)
    # An internal journal's entry is "<device>-<its inode>"; an external one's is its own device's
    # name (whose journal it is, not known).
    owners = [owner if inode.isdigit() else None for owner, _, inode in (n.rpartition("-") for n in entries)]
    if device in owners:
        return True
    return None if None in owners else False


def warm_start_check(warm: dict[str, Any]) -> dict[str, Any]:
    """Whether runs are forked from a warm zygote, and why not when they are not."""
    if not warm.get("enabled"):
        return check(
            "warm_start",
            DEGRADED,
            "off (EvalSchedApp.warm_start = False): every run starts cold",
            "set EvalSchedApp.warm_start = True (the default) to fork runs from a warm zygote",
        )
    if warm.get("refused"):
        return check(
            "warm_start",
            DEGRADED,
            f"{warm['refused']}; every run starts cold",
            "remove that module from preload_modules (a preload must not start threads or touch CUDA at import)",
        )
    held = warm.get("held") or []
    if held:
        return check(
            "warm_start",
            DEGRADED,
            f"{held[0]}; its runs start cold meanwhile",
            "find the preload module that does not return at import, or raise zygote_start_timeout_s",
        )
    zygotes = warm.get("zygotes") or []
    ready = [z for z in zygotes if z.get("state") == "ready"]
    preload = ", ".join(warm.get("preload") or []) or "the runner only"
    failed = [f for z in zygotes for f in z.get("failed") or []]
    if failed:
        return check(
            "warm_start",
            DEGRADED,
            f"could not preload {'; '.join(failed[:3])} (runs import it themselves)",
            "fix or remove it in preload_modules",
        )
    if not ready:
        states = ", ".join(f"{z.get('pid')}: {z.get('state')}" for z in zygotes) or "none yet"
        return check("warm_start", OK, f"on, preloading {preload}; zygotes {states}")
    first = ready[0]
    return check(
        "warm_start",
        OK,
        f"on: {len(ready)} zygote(s) ready (pid {first.get('pid')}, preloaded {preload} in {first.get('import_s')} s), "
        f"{sum(z.get('forks') or 0 for z in zygotes)} runs forked",
    )


# How long the doctor without a server waits for its zygote to be ready (preloads included).
DOCTOR_ZYGOTE_TIMEOUT_S = 60.0


def zygote_check(preload: list[str] | None = None, timeout_s: float = DOCTOR_ZYGOTE_TIMEOUT_S) -> dict[str, Any]:
    """Without a server: start a zygote as the server would (the runner and ``preload``, by
    default ``EVALSCHED_PRELOAD``), wait until it is ready, refuses or dies (``timeout_s`` at
    most), then end it. What ``warm_start_check`` says of it."""
    import asyncio

    from .runner.zygote import PRELOAD
    from .scheduler import zygotes
    from .scheduler.environment import run_environment

    if preload is None:
        preload = [n.strip() for n in os.environ.get(PRELOAD, "").split(",") if n.strip()]

    async def attempt() -> dict[str, Any]:
        env = run_environment("", devices=None, parent_pid=os.getpid(), fsync=False)
        client = zygotes.ZygoteClient(
            asyncio.get_running_loop(),
            sys.executable,
            zygotes.zygote_environment(env),
            list(preload),
            lambda *_: None,
            start_timeout_s=timeout_s,
        )
        client.start()
        try:
            while client.state == zygotes.STARTING:
                await asyncio.sleep(0.05)
            status = client.status()
            return {
                "enabled": True,
                "preload": list(preload),
                "refused": client.why if client.state == zygotes.REFUSED else None,
                "held": [client.why] if client.timed_out else [],
                "dead": client.why if client.state == zygotes.DEAD and not client.timed_out else None,
                "zygotes": [status],
            }
        finally:
            client.close()

    try:
        warm = asyncio.run(attempt())
    except Exception as exc:  # whatever it is, it is this check's finding, not the doctor's end
        return check("warm_start", ERROR, f"could not start a zygote: {type(exc).__name__}: {exc}")
    if warm["dead"]:
        return check(
            "warm_start",
            DEGRADED,
            f"a zygote preloading {', '.join(preload) or 'the runner only'} died before it was ready "
            f"({warm['dead']}); runs would start cold",
            "run the preload modules in a plain python to see why they end the interpreter",
        )
    return warm_start_check(warm)


def host_ledger_check(status: dict[str, Any]) -> dict[str, Any]:
    """The link to the host ledger (EvalSchedApp.host_ledger): GPU work waits while it is down."""
    if status["connected"]:
        return check("host ledger", OK, f"connected to {status['socket']} as user {status['user']}")
    return check(
        "host ledger",
        ERROR,
        f"not connected to {status['socket']}: {status['error']}; GPU work waits, CPU-only runs go on",
        "start it (jupyter evalsched host-ledger, or its systemd unit) or correct EvalSchedApp.host_ledger",
    )


def host_checks(probe: GpuProbe, cgroups: Cgroups | None) -> list[dict[str, Any]]:
    """What the host offers, whether or not a server runs."""
    return [gpu_check(probe), cgroup_check(cgroups), runner_bytecode_check()]


def server_checks(
    app: EvalSchedApp, models: list[dict[str, Any]], runs_disk: dict[str, Any] | None = None
) -> list[dict[str, Any]]:
    """The host checks as the scheduler sees them, and what the scheduler has in force.
    ``runs_disk``: ``runs_disk_check`` of the runs directory, made off the event loop (a path on
    a network file system can block); made here when not given."""
    scheduler = app.scheduler
    view = scheduler.status_view()
    out = host_checks(view.probe, view.local_cgroups)
    ledger = scheduler.ledger()
    if ledger["devices"]:
        usable = ", ".join(f"GPU {d['index']}: {d['usable_mb']} of {d['total_mb']} MB" for d in ledger["devices"])
        out.append(check("ledger", OK, f"usable {usable}; {ledger['cpu_slots']['total']} CPU slots"))
    else:
        out.append(check("ledger", OK, f"no GPU: CPU-only runs on {ledger['cpu_slots']['total']} CPU slots"))
    if view.host_ledger is not None:
        out.append(host_ledger_check(view.host_ledger))
    if view.enforce_vram == "off":
        out.append(
            check(
                "enforcement",
                DEGRADED,
                "enforce_vram = off: runs over their declared VRAM go unnoticed",
                "set EvalSchedApp.enforce_vram = 'warn' (the default: a warning on the run) or 'kill'",
            )
        )
    else:
        out.append(check("enforcement", OK, f"enforce_vram = {view.enforce_vram}, tolerance {view.vram_tolerance:.0%}"))
    if view.local_mode is not None:
        warm = view.local_mode.get("warm_start")
        out.append(warm_start_check(warm if isinstance(warm, dict) else {}))
    runs_dir = view.runs_dir
    broken = len(view.broken)
    primary = app.role.primary()
    where = f"this server (pid {os.getpid()}) schedules {runs_dir}"
    if primary is not None:
        where += f", advertised at {primary.url}"
    if broken:
        out.append(
            check(
                "scheduler",
                DEGRADED,
                f"{where}; {broken} broken run director{'y' if broken == 1 else 'ies'}",
                "see GET /evalsched/status (broken_runs) and DELETE them",
            )
        )
    else:
        out.append(check("scheduler", OK, f"{where}; {view.runs} runs, {view.counts['queued']} queued"))
    out.append(runs_disk if runs_disk is not None else runs_disk_check(str(runs_dir)))
    if "slurm" in view.executors:
        missing = [cmd for cmd in ("sbatch", "squeue", "scancel") if shutil.which(cmd) is None]
        if missing:
            out.append(
                check("slurm", ERROR, f"enabled, but {', '.join(missing)} not on PATH", "install SLURM's client")
            )
        else:
            out.append(check("slurm", OK, f"enabled (default executor: {view.default_executor})"))
    else:
        out.append(check("slurm", OK, "off (EvalSchedApp.slurm_enabled)"))
    for model in models:
        if model.get("error"):
            error = model["error"]
            out.append(
                check(
                    f"model {model['name']}",
                    ERROR,
                    f"{error.get('type')}: {error.get('message')}",
                    f"read its host's log: {model.get('log')}",
                )
            )
        else:
            out.append(check(f"model {model['name']}", OK, f"{model.get('state')} on {model.get('device') or 'cpu'}"))
    return out


def local_checks(zygote: bool = True) -> list[dict[str, Any]]:
    """The host checks without a server (the CLI, when none can be reached), and a zygote tried
    (``zygote_check``)."""
    from .scheduler.cgroups import Cgroups
    from .scheduler.gpus import NvmlProbe, VirtualProbe, parse_sizes

    sizes = parse_sizes(os.environ.get("EVALSCHED_VIRTUAL_GPUS", ""))
    probe: GpuProbe = (
        VirtualProbe(sizes, processes_file=os.environ.get("EVALSCHED_VIRTUAL_GPU_PROCESSES") or None)
        if sizes
        else NvmlProbe()
    )
    cgroups = Cgroups.detect("auto", namespace=f"evalsched-doctor-{os.getpid()}")
    try:
        checks = host_checks(probe, cgroups)
    finally:
        cgroups.remove_namespace()
    return [*checks, zygote_check()] if zygote else checks
