"""One scheduler per runs directory: the primary holds a lock on the directory, the others forward.

The lock is an ``flock`` on the runs directory itself (not on a file in it, and not in a runtime
directory): two servers that share a runs directory contend for the same lock whatever their
runtime directories, and there is no lock file to delete. The kernel releases it when its holder
dies, however it dies. Should the directory at that path stop being the one locked (renamed,
replaced), ``still_holds`` says so and the primary steps down.

Beside it, ``.evalsched-primary.json`` (0600) advertises the primary: where its internal listener
is (loopback) and the secret that listener accepts, a credential of the link between servers that
has nothing to do with how users log in. Everything read from the runs directory is checked:
owned by this user, not writable by others, not a symbolic link; anything else is refused with an
error that says what is wrong.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import secrets
import socket
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .store import atomic_write_bytes

INFO_NAME = ".evalsched-primary.json"


class UnsafePath(Exception):
    """A path this server would trust is not safe to trust; the message says why and what to do."""


@dataclass(frozen=True)
class PrimaryInfo:
    url: str  # the primary's own base URL (for people: where it serves its users)
    internal_url: str  # the loopback listener secondaries forward to, ending in "/"
    secret: str  # what that listener accepts (``Authorization: token <secret>``)
    pid: int
    hostname: str
    runs_dir: str
    since: float
    # Its process's start (clock ticks after boot, /proc/PID/stat): with the pid, which process
    # advertised, unmoved by steps of the wall clock. None in an advertisement written before.
    start: int | None = None

    def public(self) -> dict[str, Any]:
        """What clients may see (never the secret or the internal listener)."""
        return {
            "url": self.url,
            "pid": self.pid,
            "hostname": self.hostname,
            "runs_dir": self.runs_dir,
            "since": self.since,
        }


def check_private(st: os.stat_result, what: str) -> None:
    """UnsafePath unless ``st`` (from lstat/fstat) is owned by us and not writable by others."""
    uid = os.getuid()
    if stat.S_ISLNK(st.st_mode):
        raise UnsafePath(f"{what} is a symbolic link; it must be a real {what.split()[0]} of yours")
    if st.st_uid != uid:
        raise UnsafePath(f"{what} is owned by uid {st.st_uid}, not by you (uid {uid})")
    if st.st_mode & 0o022:
        raise UnsafePath(f"{what} is writable by other users (mode {stat.S_IMODE(st.st_mode):o}); chmod go-w it")


def new_secret() -> str:
    return secrets.token_hex(32)


class HostRole:
    """This server's role for a runs directory: primary (holds the lock) or secondary (forwards)."""

    def __init__(self, runs_dir: Path) -> None:
        self.runs_dir = Path(runs_dir)
        self._fd: int | None = None
        self._locked: tuple[int, int] | None = None  # (st_dev, st_ino) of the directory locked
        self._info_cache: tuple[tuple[int, int, int], PrimaryInfo] | None = None
        self.problem: str | None = None  # why the advertisement cannot be used, when it cannot

    @property
    def is_primary(self) -> bool:
        return self._fd is not None

    @property
    def info_path(self) -> Path:
        return self.runs_dir / INFO_NAME

    def try_acquire(self) -> bool:
        """Take the runs directory's lock if nobody holds it (never blocks). Creates the directory
        (0700) when it does not exist; UnsafePath when it is not a directory of ours."""
        if self._fd is not None:
            return True
        self.runs_dir.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.mkdir(self.runs_dir, 0o700)
        except FileExistsError:
            pass
        except OSError as exc:
            raise UnsafePath(f"the runs directory {self.runs_dir} cannot be created: {exc.strerror or exc}") from None
        try:
            fd = os.open(self.runs_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            why = {
                errno.ELOOP: "is a symbolic link; give the real directory",
                errno.ENOTDIR: "is not a directory",
            }.get(exc.errno or 0, f"cannot be opened: {exc.strerror or exc}")
            raise UnsafePath(f"the runs directory {self.runs_dir} {why}") from None
        try:
            st = os.fstat(fd)
            check_private(st, f"the runs directory {self.runs_dir}")
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                return False
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        self._locked = (st.st_dev, st.st_ino)
        return True

    def still_holds(self) -> bool:
        """True while the directory at the runs path is the one this server locked."""
        if self._locked is None:
            return False
        try:
            st = os.lstat(self.runs_dir)
        except OSError:
            return False
        return (st.st_dev, st.st_ino) == self._locked

    def moved_message(self) -> str:
        """Why the locked directory is no longer the runs directory, where it went (the kernel's
        name for the locked descriptor), and what to do."""
        where = None
        if self._fd is not None:
            try:
                where = os.readlink(f"/proc/self/fd/{self._fd}")
            except OSError:
                pass
        if where is None or where.endswith(" (deleted)"):
            moved = f"the runs directory {self.runs_dir} was removed or moved away while this server scheduled it"
            target = "its new path"
        else:
            moved = f"the runs directory {self.runs_dir} was moved to {where} while this server scheduled it"
            target = where
        return (
            f"{moved}: this server stopped scheduling and writes nothing more, neither there nor at "
            f"{self.runs_dir} (runs still running write by path too, and end at their next write). "
            f"Restart the server with EvalSchedApp.runs_dir={target} (or move the directory back and "
            "restart it): the restarted server recovers every run from the directory"
        )

    def advertise(self, url: str, internal_url: str, secret: str) -> None:
        info = {
            "url": url,
            "internal_url": internal_url,
            "secret": secret,
            "pid": os.getpid(),
            "hostname": socket.gethostname(),
            "runs_dir": str(self.runs_dir),
            "since": time.time(),
            "start": _start_ticks("self"),
        }
        # A unique temp name, created exclusively: a FIFO planted at a predictable one would block.
        atomic_write_bytes(self.info_path, json.dumps(info).encode())

    def advertises_us(self) -> bool:
        info = self.primary()
        return info is not None and info.pid == os.getpid()

    def unadvertise(self) -> None:
        """No longer say where to forward: before the internal listener stops, whose port any
        user of the host may take once it is free, while this server still holds the lock (a stop
        or a step-down that waits for its runs; a suspension) and secondaries answer 503. In the
        directory locked, wherever it now is (a suspension's was moved: a server started on its
        new path is a secondary, which would read the advertisement there)."""
        if self._fd is None:
            return
        try:
            fd = os.open(INFO_NAME, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=self._fd)
            try:
                ours = json.loads(os.read(fd, 64 * 1024)).get("pid") == os.getpid()
            finally:
                os.close(fd)
            if ours:
                os.unlink(INFO_NAME, dir_fd=self._fd)
        except (OSError, ValueError, AttributeError):
            pass  # (none, not ours, or not one: nothing of ours to take back)

    def release(self) -> None:
        if self._fd is None:
            return
        self.unadvertise()
        os.close(self._fd)  # closing the descriptor releases the lock
        self._fd = None
        self._locked = None

    def forward_target(self) -> PrimaryInfo | None:
        """The advertised primary to forward a request to: only while its process lives (this
        user's, started before it advertised). A primary killed leaves its advertisement, and its
        loopback port free until a server takes over: any user of the host could listen there and
        be sent the requests (their specs, their prompts) and answer them. (A primary that stops
        removes its advertisement first: ``unadvertise``.)"""
        info = self.primary()
        if info is None or _advertiser_alive(info, self.runs_dir):
            return info
        if info.start is None and _is_ours(info.pid):
            self.problem = (
                f"its advertisement names no process start (an older version wrote it) and its pid "
                f"({info.pid}) does not hold the lock on the runs directory: that primary is gone and the "
                "pid another process's; a server takes over within seconds"
            )
        else:
            self.problem = f"its process ({info.pid}) is gone; a server takes over within seconds"
        return None

    def primary(self) -> PrimaryInfo | None:
        """The advertised primary (cached by the file's identity), or None; ``problem`` says why
        when the file exists but must not be trusted or cannot be read."""
        try:
            fd = os.open(self.info_path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        except FileNotFoundError:
            self.problem = None
            return None
        except OSError as exc:
            self.problem = (
                f"{self.info_path} is a symbolic link: refusing to use it"
                if exc.errno == errno.ELOOP
                else f"{self.info_path} cannot be read: {exc.strerror or exc}"
            )
            return None
        try:
            st = os.fstat(fd)
            check_private(st, f"the primary's advertisement {self.info_path}")
            if not stat.S_ISREG(st.st_mode) or st.st_mode & 0o077:
                raise UnsafePath(f"the primary's advertisement {self.info_path} must be a regular file of mode 600")
            key = (st.st_ino, st.st_mtime_ns, st.st_size)
            if self._info_cache is not None and self._info_cache[0] == key:
                self.problem = None
                return self._info_cache[1]
            raw = json.loads(os.read(fd, 64 * 1024))
            info = PrimaryInfo(
                url=str(raw["url"]),
                internal_url=str(raw["internal_url"]),
                secret=str(raw["secret"]),
                pid=int(raw["pid"]),
                hostname=str(raw.get("hostname", "")),
                runs_dir=str(raw.get("runs_dir", "")),
                since=float(raw.get("since", 0)),
                start=int(raw["start"]) if raw.get("start") is not None else None,
            )
        except UnsafePath as exc:
            self.problem = f"{exc}: refusing to forward requests there"
            return None
        except (OSError, ValueError, KeyError, TypeError):
            self.problem = None  # being rewritten: the next look finds it whole
            return None
        finally:
            os.close(fd)
        self.problem = None
        self._info_cache = (key, info)
        return info


def _start_ticks(pid: int | str) -> int | None:
    from .runner._proc import stat_fields

    fields = stat_fields(pid)
    try:
        return int(fields[19]) if fields is not None else None  # starttime (field 22)
    except (IndexError, ValueError):
        return None


def _advertiser_alive(info: PrimaryInfo, runs_dir: Path) -> bool:
    """Whether the process that advertised ``info`` still runs: ``info.pid`` is a process of this
    user, started when the advertiser did (not a later one given the same pid). An advertisement
    without ``start`` (an older version's) names its process by the pid alone, which a later
    process may have been given once it died: that pid must then hold the lock on ``runs_dir``,
    which only the primary does (a live primary of the older version is forwarded to)."""
    if not _is_ours(info.pid):
        return False
    if info.start is None:
        return _holds_flock(info.pid, runs_dir)
    return _start_ticks(info.pid) == info.start


def _is_ours(pid: int) -> bool:
    try:
        return os.stat(f"/proc/{pid}").st_uid == os.getuid()
    except OSError:
        return False


def _holds_flock(pid: int, path: Path) -> bool:
    """Whether ``pid`` holds an exclusive flock on the file at ``path``: one of its descriptors
    lists the lock in its fdinfo (``lock:\t1: FLOCK  ADVISORY  WRITE <pid> <major>:<minor>:<inode>
    0 EOF``, the locks taken through that open file, not a waiter's) and is that file (its device
    and inode, as ``/proc/<pid>/fd/<n>`` stats: not those /proc/locks names, which a btrfs
    subvolume's files do not stat with, nor an inode alone, which another file system's file may
    have). Only the locked descriptors are statted (each, a look-up of its file system)."""
    try:
        target = os.stat(path)
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for fd in fds:
        try:
            with open(f"/proc/{pid}/fdinfo/{fd}", encoding="ascii", errors="replace") as info:
                if not _lists_an_exclusive_flock(info.read()):
                    continue
        except OSError:
            continue  # (closed meanwhile)
        try:
            held = os.stat(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if (held.st_dev, held.st_ino) == (target.st_dev, target.st_ino):
            return True
    return False


def _lists_an_exclusive_flock(fdinfo: str) -> bool:
    return any(
        line.split()[:1] == ["lock:"] and line.split()[2:5] == ["FLOCK", "ADVISORY", "WRITE"]
        for line in fdinfo.splitlines()
    )
