"""One scheduler per user per host: the primary holds a lock, the other servers delegate to it.

The lock is an ``fcntl`` lock on a file in the user's runtime directory: the kernel releases it
when the holder dies, however it dies, so there is no stale lock to clean up by hand. Next to it,
the primary advertises where it listens and how to authenticate, in a file only its owner can
read. Secondaries forward ``/evalsched/`` there and try the lock again every second; the first
to get it becomes the primary (recovering the runs directory, rule 4).
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path

LOCK_NAME = "evalsched-primary.lock"
INFO_NAME = "evalsched-primary.json"


@dataclass(frozen=True)
class PrimaryInfo:
    url: str  # the primary server's base URL, ending in "/"
    token: str
    pid: int
    hostname: str
    runs_dir: str
    since: float

    def public(self) -> dict:
        """What clients may see (never the token)."""
        return {
            "url": self.url,
            "pid": self.pid,
            "hostname": self.hostname,
            "runs_dir": self.runs_dir,
            "since": self.since,
        }


class HostRole:
    """This server's role on the host: primary (holds the lock) or secondary (delegates)."""

    def __init__(self, lock_dir: Path) -> None:
        self.lock_dir = Path(lock_dir)
        self._fd: int | None = None
        self._info_cache: tuple[tuple[int, int], PrimaryInfo] | None = None

    @property
    def is_primary(self) -> bool:
        return self._fd is not None

    def try_acquire(self) -> bool:
        """Take the host-wide lock if nobody holds it. Never blocks."""
        if self._fd is not None:
            return True
        self.lock_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(self.lock_dir / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        self._fd = fd
        return True

    def advertise(self, url: str, token: str, runs_dir: str) -> None:
        info = {
            "url": url,
            "token": token,
            "pid": os.getpid(),
            "hostname": socket.gethostname(),
            "runs_dir": runs_dir,
            "since": time.time(),
        }
        path = self.lock_dir / INFO_NAME
        tmp = path.with_name(f".{INFO_NAME}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(info, f)
        os.replace(tmp, path)

    def release(self) -> None:
        if self._fd is None:
            return
        try:
            info = self.primary()
            if info is not None and info.pid == os.getpid():
                os.unlink(self.lock_dir / INFO_NAME)
        except OSError:
            pass
        os.close(self._fd)  # closing the descriptor releases the lock
        self._fd = None

    def primary(self) -> PrimaryInfo | None:
        """The advertised primary (cached by the file's mtime), or None."""
        path = self.lock_dir / INFO_NAME
        try:
            st = os.stat(path)
        except FileNotFoundError:
            return None
        key = (st.st_mtime_ns, st.st_size)
        if self._info_cache is not None and self._info_cache[0] == key:
            return self._info_cache[1]
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
            with os.fdopen(fd) as f:
                raw = json.load(f)
            info = PrimaryInfo(
                url=raw["url"],
                token=raw.get("token", ""),
                pid=int(raw["pid"]),
                hostname=raw.get("hostname", ""),
                runs_dir=raw.get("runs_dir", ""),
                since=float(raw.get("since", 0)),
            )
        except (OSError, ValueError, KeyError, TypeError):
            return None
        self._info_cache = (key, info)
        return info
