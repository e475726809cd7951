"""What /proc says of a process, as the host ledger needs it: whose it is, and whether it is still
the same process (pid + start time: a pid reused by a later process is another process).

Only a process that /proc says is gone (no such entry) is gone: any other failure to read it
(out of file descriptors, say) raises :class:`Unreadable`, never "gone", since the ledger ends a
grant whose processes are gone and would then grant its VRAM twice."""

from __future__ import annotations

import errno
import grp
import logging
import os
import pwd
from dataclasses import dataclass

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ProcId:
    pid: int
    start: int  # clock ticks after boot (/proc/PID/stat field 22)

    def as_json(self) -> dict[str, int]:
        return {"pid": self.pid, "start": self.start}


# What reading /proc/PID/... fails with once the process is gone: no entry (ENOENT), or it
# exited between the open and the read (ESRCH).
GONE_ERRNOS = frozenset({errno.ENOENT, errno.ESRCH})
# What reading it fails with when /proc hides the process (mounted hidepid=1: the entry is there,
# but not for the ledger's user to read): a configuration error, said once (see _denied).
DENIED_ERRNOS = frozenset({errno.EACCES, errno.EPERM})
_denied_said = False
PID_MAX_LIMIT = 1 << 22  # the kernel's largest pid_max: no process has a larger pid


class Unreadable(Exception):
    """/proc could not be read for a reason other than the process being gone (EMFILE, EIO, ...):
    whether the process lives is unknown."""

    def __init__(self, pid: int, error: OSError) -> None:
        super().__init__(f"cannot read /proc/{pid}: {error.strerror or error}")
        self.pid = pid


def _read(pid: int, what: str) -> str | None:
    """The text of /proc/PID/``what``; None when the process is gone; Unreadable otherwise."""
    if not 0 < pid <= PID_MAX_LIMIT:
        return None  # (a saved pid out of range: no such process, whatever the path would say)
    try:
        with open(f"/proc/{pid}/{what}", encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError as exc:
        if exc.errno in GONE_ERRNOS:
            return None
        if exc.errno in DENIED_ERRNOS:
            _denied(pid, what, exc)
        raise Unreadable(pid, exc) from None


def _denied(pid: int, what: str, exc: OSError) -> None:
    """A live process's /proc entry the ledger may not read: /proc is mounted hidepid=1 or 2 (a
    configuration error, never a passing one: its grants would never end). Said once."""
    global _denied_said
    if _denied_said:
        return
    _denied_said = True
    log.error(
        "host ledger: cannot read /proc/%d/%s (%s): /proc is mounted with hidepid=, which hides other "
        "users' processes from the ledger's user; the host ledger needs /proc without hidepid (or its "
        "user in the group named by /proc's gid= option). Grants whose processes it cannot read never end.",
        pid,
        what,
        exc.strerror or exc,
    )


def _stat(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name (field 3 on), or None when gone."""
    text = _read(pid, "stat")
    if text is None:
        return None
    return text[text.rfind(")") + 2 :].split()


def identify(pid: int) -> ProcId | None:
    """The live (not zombie) process ``pid``, or None."""
    fields = _stat(pid)
    if not fields or fields[0] in ("Z", "X"):
        return None
    return ProcId(pid, int(fields[19]))


def alive(proc: ProcId) -> bool:
    """Whether ``proc`` still runs (Unreadable: unknown)."""
    return identify(proc.pid) == proc


def any_alive(found: list[ProcId]) -> bool | None:
    """Whether any of ``found`` still runs: True, False (every one is gone), or None when none
    was seen alive and some could not be read (unknown: not gone)."""
    unknown = False
    for proc in found:
        try:
            if alive(proc):
                return True
        except Unreadable:
            unknown = True
    return None if unknown else False


def first_alive(found: list[ProcId]) -> tuple[bool | None, list[ProcId]]:
    """:func:`any_alive`, and ``found`` less the processes seen gone on the way: a process gone
    does not come back (its identity is its pid and start time), so a grant's next look starts at
    a live one. Read again at every sweep, a grant's 63 dead pids before its live one made each
    sweep of 1,024 such grants cost the ledger most of a core. All gone: ``found`` as it is."""
    unknown: list[ProcId] = []
    for i, proc in enumerate(found):
        try:
            if alive(proc):
                return True, unknown + found[i:]
        except Unreadable:
            unknown.append(proc)
    return (None, unknown) if unknown else (False, found)


def parent(pid: int) -> int | None:
    fields = _stat(pid)
    return int(fields[1]) if fields else None


def uid_of(pid: int) -> int | None:
    """The process's real uid when its effective uid is the same, else None (a setuid program is
    nobody's to claim; a process gone is nobody's). Unreadable: unknown."""
    text = _read(pid, "status")
    for line in (text or "").splitlines():
        if line.startswith("Uid:"):
            try:
                real, effective = line.split()[1:3]
                return int(real) if real == effective else None
            except (ValueError, IndexError):
                return None
    return None


def owned(pid: int, uid: int) -> ProcId | None:
    """``pid`` as a ProcId when it is a live process of ``uid``, else None (Unreadable: unknown)."""
    if type(pid) is not int or pid <= 0:
        return None
    proc = identify(pid)
    if proc is None or uid_of(pid) != uid:
        return None
    return proc if identify(pid) == proc else None  # still the same process after the uid read


def ancestors(pid: int, limit: int = 64) -> list[int]:
    """``pid`` and its parents up to init (bounded; Unreadable: unknown)."""
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


def uid_named(name: str) -> int | None:
    """The uid the host's user ``name`` has, or None when it has no such user."""
    try:
        return pwd.getpwnam(name).pw_uid
    except KeyError:
        return None


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
