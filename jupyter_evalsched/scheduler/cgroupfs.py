"""cgroupfs: the files of a cgroup hierarchy, read and written as the kernel expects (shared by
the detection and by run cgroups)."""

from __future__ import annotations

import errno
import logging
import os
import signal
import time
from pathlib import Path

log = logging.getLogger(__name__)

MiB = 1024 * 1024
# v1 reports "no limit" as a huge page-aligned number (LONG_MAX rounded down), v2 as "max".
UNLIMITED_BYTES = 1 << 62
V2_KEYS = ("v2", "unified")
V1_KEYS = ("memory", "freezer", "pids")
# Membership is read from the first of these that the run has: every process is in all of them.
PRIMARY_ORDER = ("v2", "unified", "memory", "freezer", "pids")
PROBE_LIMIT = 64 * MiB
# Controllers a v1 mount can carry (its options also hold mount flags and name=...).
V1_CONTROLLERS = frozenset(
    {"cpu", "cpuacct", "cpuset", "memory", "devices", "freezer", "net_cls", "net_prio", "blkio", "io"}
    | {"perf_event", "hugetlb", "pids", "rdma", "misc", "debug"}
)
FALLBACK_HINT = (
    "runs fall back to process groups; run the server in a delegated cgroup "
    "(systemd-run --user --scope -p Delegate=yes ...) or set EvalSchedApp.cgroup_parent"
)


class CgroupError(Exception):
    """A cgroup could not be made or used; the message says why."""


# --------------------------------------------------------------------------- file helpers


def read_file(path: str | Path) -> str:
    # At the descriptor's level: the builtin open() makes five more system calls a file (fstat,
    # ioctl, lseek), and in a thread each system call gives the GIL away and waits to take it
    # back. A run's clean-up reads several of these files.
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        chunks = []
        while chunk := os.read(fd, 65536):
            chunks.append(chunk)
    finally:
        os.close(fd)
    return os.fsdecode(b"".join(chunks))  # (mount points and paths round-trip, whatever the bytes)


def write_file(path: str | Path, text: str) -> None:
    # One write(2), no O_CREAT: cgroupfs takes one value per write, and a missing interface file
    # must fail rather than create a plain file (a directory that is not a cgroup).
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def keyed_value(text: str, key: str) -> int | None:
    # "key value" lines (cgroup.events, memory.events, memory.oom_control)
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0] == key:
            try:
                return int(parts[1])
            except ValueError:
                return None
    return None


def bytes_value(text: str) -> int | None:
    text = text.strip()
    if text in ("", "max"):
        return None
    try:
        value = int(text)
    except ValueError:
        return None
    return None if value >= UNLIMITED_BYTES else value


def mb_up(nbytes: int) -> int:
    return -(-nbytes // MiB)


def procs_of(directory: str | Path) -> set[int]:
    try:
        text = read_file(os.path.join(directory, "cgroup.procs"))
    except (FileNotFoundError, ProcessLookupError):
        return set()
    return {int(p) for p in text.split()}


def subtree_procs(directory: str | Path) -> set[int]:
    # A run running as root may have made cgroups of its own below its run cgroup.
    pids = procs_of(directory)
    try:
        with os.scandir(directory) as it:
            subdirs = [e.path for e in it if e.is_dir(follow_symlinks=False)]
    except FileNotFoundError:
        return pids
    for sub in subdirs:
        pids |= subtree_procs(sub)
    return pids


def rmdir_tree(directory: str | Path, wait_until: float) -> bool:
    """rmdir ``directory`` and any cgroups below it, deepest first. True when it is gone."""
    try:
        os.rmdir(directory)  # most have no cgroup below them: no listing then
        return True
    except FileNotFoundError:
        return True
    except OSError:
        pass  # a cgroup below it, a task still exiting, or what the loop below says
    try:
        with os.scandir(directory) as it:
            subdirs = [e.path for e in it if e.is_dir(follow_symlinks=False)]
    except FileNotFoundError:
        return True
    except OSError:
        subdirs = []  # rmdir below says why
    for sub in subdirs:
        rmdir_tree(sub, wait_until)
    delay = 0.0005
    while True:
        try:
            os.rmdir(directory)
            return True
        except FileNotFoundError:
            return True
        except OSError as exc:
            # EBUSY while the last task is still exiting; anything else will not go away.
            if exc.errno != errno.EBUSY or time.monotonic() >= wait_until:
                log.warning("cannot remove cgroup %s: %s", directory, exc)
                return False
        time.sleep(delay)
        delay = min(delay * 2, 0.01)


def kill_members(pids: set[int], directories: list[str]) -> None:
    """SIGKILL the pids that are (still) members of ``directories``.

    A pid read from cgroup.procs may exit and be reused before we signal it: pin each process
    with a pidfd first, then signal only those still listed, through their pidfd."""
    pidfds: dict[int, int] = {}
    try:
        for pid in pids:
            try:
                pidfds[pid] = os.pidfd_open(pid)
            except ProcessLookupError:
                pass
            except OSError:  # no pidfd (old kernel): plain kill, a tiny reuse window
                plain_kill(pid)
        if not pidfds:
            return
        members: set[int] = set()
        for directory in directories:
            members |= subtree_procs(directory)
        for pid, fd in pidfds.items():
            if pid in members:
                try:
                    signal.pidfd_send_signal(fd, signal.SIGKILL)
                except ProcessLookupError:
                    pass
    finally:
        for fd in pidfds.values():
            os.close(fd)


def plain_kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def sleep_backoff(delay: float) -> float:
    time.sleep(delay)
    return min(delay * 2, 0.01)


def set_checked(path: Path, nbytes: int) -> None:
    try:
        write_file(path, str(nbytes))
        got = bytes_value(read_file(path))
    except OSError as exc:
        raise CgroupError(f"cannot set {path} to {nbytes}: {exc.strerror or exc}") from exc
    # The kernel rounds down to whole pages; anything further off was refused.
    if got is None or abs(got - nbytes) >= 64 * 1024:
        raise CgroupError(f"{path}: wrote {nbytes}, reads back {got if got is not None else 'no limit'}")


def rmdir_quiet(path: str) -> None:
    try:
        os.rmdir(path)
    except OSError:
        pass


def oserror_text(path: str, exc: OSError) -> str:
    if exc.errno == errno.EROFS:
        return f"{path}: read-only file system"
    if exc.errno in (errno.EACCES, errno.EPERM):
        return f"{path}: permission denied (not delegated to uid {os.getuid()})"
    return f"{path}: {exc.strerror or exc}"
