"""The runs directory: layout, atomic JSON writes, reads that never follow symbolic links.

``<runs_dir>/<run_id>/`` is a run's whole contract (see DESIGN.md). A run directory appears
atomically: it is assembled under a hidden temporary name and renamed into place, so a crash
mid-submission never leaves a half-written run behind.
"""

from __future__ import annotations

import errno
import itertools
import json
import os
import secrets
import shutil
import threading
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from .models import is_valid_run_id

SPEC = "spec.json"
SHARED_URLS = "shared_urls.json"
JOB = "job.json"
SUMMARY = "summary.json"
EPISODES = "episodes.jsonl"
EVAL_SOURCE = "eval.py"
STDOUT = "stdout.log"
STDERR = "stderr.log"
DONE = "_DONE"
STAGING_PREFIX = ".staging-"

_tmp_counter = itertools.count()


class StoreError(Exception):
    """A run-directory operation failed for a reason worth telling the client (disk full, ...)."""


def new_run_id() -> str:
    """Unique, sortable by submission time: ``YYYYmmddTHHMMSS.ffffff-<random>``."""
    now = datetime.now(UTC)
    return now.strftime("%Y%m%dT%H%M%S.%f") + "-" + secrets.token_hex(3)


def atomic_write_bytes(path: Path, data: bytes, fsync: bool = False) -> None:
    # The temp name is unique per process and thread so concurrent writers never share one.
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.{next(_tmp_counter)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def atomic_write_json(path: Path, obj: Any, fsync: bool = False) -> None:
    atomic_write_bytes(path, json.dumps(obj, separators=(",", ":"), allow_nan=False).encode(), fsync=fsync)


def touch_done(run_dir: Path) -> None:
    fd = os.open(run_dir / DONE, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    os.close(fd)


def open_nofollow(path: Path) -> int:
    """Open a run file for reading, following a symbolic link neither at the file nor at its
    directory (the run directory): a link planted there cannot make us read outside."""
    path = Path(path)
    dfd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        return os.open(path.name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
    finally:
        os.close(dfd)


def read_bytes_nofollow(path: Path, max_bytes: int | None = None) -> bytes:
    """Read a run file without following symbolic links (see ``open_nofollow``)."""
    fd = open_nofollow(path)
    with os.fdopen(fd, "rb") as f:
        return f.read() if max_bytes is None else f.read(max_bytes)


def read_json_nofollow(path: Path) -> Any:
    return json.loads(read_bytes_nofollow(path))


def tail_lines(path: Path, n: int | None, max_bytes: int = 8 * 1024 * 1024) -> str:
    """The last ``n`` lines of a log (all when None), reading at most ``max_bytes`` from the end."""
    try:
        fd = open_nofollow(path)
    except FileNotFoundError:
        return ""
    with os.fdopen(fd, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if n is None:
            f.seek(max(0, size - max_bytes))
            return f.read().decode("utf-8", "replace")
        block = 64 * 1024
        data = b""
        pos = size
        while pos > 0 and data.count(b"\n") <= n and len(data) < max_bytes:
            step = min(block, pos)
            pos -= step
            f.seek(pos)
            data = f.read(step) + data
        lines = data.decode("utf-8", "replace").splitlines(keepends=True)
        return "".join(lines[-n:]) if n > 0 else ""


@dataclass(slots=True)
class _Cached:
    key: tuple[int, int]
    value: Any


class FileCache:
    """Parsed JSON keyed by (mtime_ns, size): unchanged files are never parsed twice."""

    def __init__(self, max_entries: int = 50_000) -> None:
        self._entries: dict[Path, _Cached] = {}
        self._max = max_entries
        self._lock = threading.Lock()

    def read_json(self, path: Path) -> Any:
        """Parsed content, or None when the file is missing, a symlink or not valid JSON."""
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            self.forget(path)
            return None
        if not _is_regular(st.st_mode):
            return None
        key = (st.st_mtime_ns, st.st_size)
        with self._lock:
            hit = self._entries.get(path)
        if hit is not None and hit.key == key:
            return hit.value
        try:
            value = read_json_nofollow(path)
        except (OSError, ValueError):
            return None
        with self._lock:
            if len(self._entries) >= self._max:
                self._entries.clear()
            self._entries[path] = _Cached(key, value)
        return value

    def forget(self, path: Path) -> None:
        with self._lock:
            self._entries.pop(path, None)


def _is_regular(mode: int) -> bool:
    import stat

    return stat.S_ISREG(mode)


class RunStore:
    """Where run directories live and how they are written."""

    def __init__(self, runs_dir: Path, fsync: bool = False) -> None:
        self.root = Path(runs_dir)
        self.fsync = fsync
        self.cache = FileCache()

    def ensure(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(self.root, 0o700)

    def run_dir(self, run_id: str) -> Path:
        """The directory of a run; raises KeyError for ids that could never name one."""
        if not is_valid_run_id(run_id):
            raise KeyError(run_id)
        return self.root / run_id

    def create(self, run_id: str, files: dict[str, bytes]) -> Path:
        """Assemble a run directory under a staging name, then rename it into place."""
        final = self.run_dir(run_id)
        staging = self.root / f"{STAGING_PREFIX}{run_id}"
        try:
            os.mkdir(staging, 0o700)
            for name, data in files.items():
                # No temp file needed: nobody sees the staging directory until its rename.
                fd = os.open(staging / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                    if self.fsync:
                        f.flush()
                        os.fsync(f.fileno())
            os.rename(staging, final)
        except OSError as exc:
            shutil.rmtree(staging, ignore_errors=True)
            raise StoreError(_disk_message(exc, self.root)) from exc
        return final

    def write_job(self, run_id: str, record: dict) -> None:
        path = self.run_dir(run_id) / JOB
        try:
            atomic_write_json(path, record, fsync=self.fsync)
        except OSError as exc:
            raise StoreError(_disk_message(exc, self.root)) from exc

    def mark_done(self, run_id: str) -> None:
        touch_done(self.run_dir(run_id))

    def delete(self, run_id: str) -> None:
        path = self.run_dir(run_id)
        # Rename first so the directory vanishes from listings atomically, then remove it.
        trash = self.root / f"{STAGING_PREFIX}deleted-{run_id}-{time.monotonic_ns()}"
        os.rename(path, trash)
        shutil.rmtree(trash, ignore_errors=True)

    def scan(self) -> list[tuple[str, Path]]:
        """Run directories on disk (staging leftovers are removed: they were never acknowledged)."""
        out = []
        try:
            entries = list(os.scandir(self.root))
        except FileNotFoundError:
            return out
        for entry in entries:
            if entry.name.startswith(STAGING_PREFIX):
                shutil.rmtree(entry.path, ignore_errors=True)
                continue
            if entry.is_dir(follow_symlinks=False) and is_valid_run_id(entry.name):
                out.append((entry.name, Path(entry.path)))
        return out


def _disk_message(exc: OSError, root: Path) -> str:
    if exc.errno == errno.ENOSPC:
        return f"the runs directory {root} is full (no space left on device)"
    if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return f"the runs directory {root} is not writable ({exc.strerror})"
    return f"cannot write to the runs directory {root}: {exc.strerror or exc}"
