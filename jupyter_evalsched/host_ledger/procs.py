"""What /proc says of a process, as the host ledger needs it: whose it is, and whether it is still
the same process (pid + start time: a pid reused by a later process is another process)."""

from __future__ import annotations

import grp
import os
import pwd
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ProcId:
    pid: int
    start: int  # clock ticks after boot (/proc/PID/stat field 22)

    def as_json(self) -> dict[str, int]:
        return {"pid": self.pid, "start": self.start}


def _stat(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name (field 3 on), or None when gone."""
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8", errors="replace") as f:
            text = f.read()
    except OSError:
        return None
    return text[text.rfind(")") + 2 :].split()


def identify(pid: int) -> ProcId | None:
    """The live (not zombie) process ``pid``, or None."""
    fields = _stat(pid)
    if not fields or fields[0] in ("Z", "X"):
        return None
    return ProcId(pid, int(fields[19]))


def alive(proc: ProcId) -> bool:
    return identify(proc.pid) == proc


def parent(pid: int) -> int | None:
    fields = _stat(pid)
    return int(fields[1]) if fields else None


def uid_of(pid: int) -> int | None:
    """The process's real uid when its effective uid is the same, else None (a setuid program is
    nobody's to claim)."""
    try:
        with open(f"/proc/{pid}/status", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("Uid:"):
                    real, effective = line.split()[1:3]
                    return int(real) if real == effective else None
    except (OSError, ValueError, IndexError):
        return None
    return None


def owned(pid: int, uid: int) -> ProcId | None:
    """``pid`` as a ProcId when it is a live process of ``uid``, else None."""
    if type(pid) is not int or pid <= 0:
        return None
    proc = identify(pid)
    if proc is None or uid_of(pid) != uid:
        return None
    return proc if identify(pid) == proc else None  # still the same process after the uid read


def ancestors(pid: int, limit: int = 64) -> list[int]:
    """``pid`` and its parents up to init (bounded)."""
    out: list[int] = []
    while pid > 1 and len(out) < limit:
        out.append(pid)
        up = parent(pid)
        if up is None:
            break
        pid = up
    return out


def user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def in_group(uid: int, group: str | None) -> bool:
    """Whether ``uid`` is root or a member of ``group`` (primary or supplementary)."""
    if uid == 0:
        return True
    if not group:
        return False
    try:
        entry = pwd.getpwuid(uid)
        gid = grp.getgrnam(group).gr_gid
    except KeyError:
        return False
    return gid in os.getgrouplist(entry.pw_name, entry.pw_gid)
