"""Which GPU processes are notebook kernels, and of which notebook.

A process is named as a kernel when it, or one of its ancestors, is the kernel process of one of
the user's Jupyter servers on the host: the primary's own (its kernel manager knows their pids, its
session manager their notebooks' current paths) or any other server's (a kernel started by
jupyter_client has its connection file ``kernel-<id>.json`` on its command line, and a kernel
started for a notebook has ``JPY_SESSION_NAME``, the notebook's path when it started, in its
environment). Only processes of this user count: another user's process with such an argument
is not our kernel (and, for root, every process would be readable).

Reads of ``/proc`` happen in the scheduler's I/O thread, for the few processes that hold VRAM.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from ..runner._proc import stat_fields

_CONNECTION_FILE_RE = re.compile(rb"kernel-([0-9a-fA-F-]{8,64})\.json")
MAX_ANCESTORS = 8  # a GPU process deeper than this below a kernel is not named after it


@dataclass(frozen=True, slots=True)
class KernelInfo:
    kernel_id: str
    session_path: str | None  # the notebook, when the kernel belongs to one
    pid: int  # the kernel process (the GPU process itself or one of its ancestors)


@dataclass(frozen=True, slots=True)
class OwnKernel:
    """A kernel of this server, as its kernel and session managers know it."""

    kernel_id: str
    pid: int | None
    session_path: str | None


def _read(path: str, limit: int = 1 << 20) -> bytes | None:
    try:
        with open(path, "rb") as f:
            return f.read(limit)
    except OSError:
        return None


def _parent(pid: int) -> int | None:
    fields = stat_fields(pid)
    try:
        ppid = int(fields[1]) if fields is not None else 0  # ppid (field 4)
    except (ValueError, IndexError):
        return None
    return ppid or None


def kernel_of_process(pid: int) -> KernelInfo | None:
    """The kernel that ``pid`` is (from its command line and environment), or None. A process
    of another user is no kernel of ours, whatever its command line says."""
    try:
        if os.stat(f"/proc/{pid}").st_uid != os.geteuid():
            return None
    except OSError:
        return None
    cmdline = _read(f"/proc/{pid}/cmdline")
    if not cmdline:
        return None
    match = _CONNECTION_FILE_RE.search(cmdline)
    if match is None:
        return None
    return KernelInfo(
        kernel_id=match.group(1).decode(),
        session_path=_environ(pid).get("JPY_SESSION_NAME") or None,
        pid=pid,
    )


def _environ(pid: int) -> dict[str, str]:
    data = _read(f"/proc/{pid}/environ")
    out: dict[str, str] = {}
    for item in (data or b"").split(b"\0"):
        key, sep, value = item.partition(b"=")
        if sep and key == b"JPY_SESSION_NAME":
            out[key.decode()] = value.decode("utf-8", "replace")
    return out


def identify(pids: Iterable[int], own: Iterable[OwnKernel] = ()) -> dict[int, KernelInfo]:
    """``{pid: the kernel it belongs to}`` for the processes of ``pids`` that are kernels or run
    below one. ``own``: this server's kernels, whose paths are current (a notebook renamed since
    its kernel started keeps its old ``JPY_SESSION_NAME``)."""
    own_by_pid = {k.pid: k for k in own if k.pid}
    own_by_id = {k.kernel_id: k for k in own}
    cache: dict[int, KernelInfo | None] = {}
    out: dict[int, KernelInfo] = {}
    for pid in set(pids):
        info = _kernel_above(pid, own_by_pid, cache)
        if info is None:
            continue
        mine = own_by_id.get(info.kernel_id)
        if mine is not None and mine.session_path:
            info = KernelInfo(info.kernel_id, mine.session_path, info.pid)
        out[pid] = info
    return out


def _kernel_above(
    pid: int, own_by_pid: Mapping[int, OwnKernel], cache: dict[int, KernelInfo | None]
) -> KernelInfo | None:
    seen: list[int] = []
    current: int | None = pid
    found: KernelInfo | None = None
    for _ in range(MAX_ANCESTORS + 1):
        if current is None or current <= 1:
            break
        if current in cache:
            found = cache[current]
            break
        seen.append(current)
        mine = own_by_pid.get(current)
        if mine is not None:
            found = KernelInfo(mine.kernel_id, mine.session_path, current)
            break
        found = kernel_of_process(current)
        if found is not None:
            break
        current = _parent(current)
    for p in seen:
        cache[p] = found
    return found
