"""The runs directory: layout, atomic writes, and every read of a run's files.

``<runs_dir>/<run_id>/`` is a run's whole contract (docs/reference.md, "Run directory"). The
server owns ``spec.json``, ``shared_urls.json``, ``job.json`` and (for runs it finalizes)
``_DONE``; the run owns ``summary.json``, ``episodes.jsonl`` and its logs. Nothing outside this
module joins a run directory with a file name.

A run directory appears atomically: it is assembled under a hidden temporary name and renamed
into place, so a crash mid-submission never leaves a half-written run behind.

Everything under the runs directory is writable by the runs (same uid), so every open of a
path there goes through :func:`open_run_file`: no link followed (at the file or at its
directory), no wait on a FIFO, nothing but a regular file accepted (:class:`UnsafeRunFile`).
Reads are bounded: a run's own files are written by user code and may be huge, deeply nested,
not JSON, or hold non-finite numbers (``1e999``). A bad file is a :class:`RunFileError` whose
message says what is wrong (the server then ends the run ``failed`` with that message), never an
exception that escapes the lifecycle.
"""

from __future__ import annotations

import bisect
import errno
import hashlib
import io
import itertools
import json
import logging
import math
import os
import secrets
import shutil
import stat
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Generator, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from . import contract
from .contract import is_valid_run_id

# (Re-exported, "X as X": the server's modules open run files through this module.)
from .safe_open import _SAFE_FLAGS, kind_of
from .safe_open import RunFileError as RunFileError
from .safe_open import UnsafeRunFile as UnsafeRunFile
from .safe_open import open_dir as open_dir
from .safe_open import open_log as open_log
from .safe_open import open_run_file as open_run_file

_tmp_counter = itertools.count()

# Bounds on what is read of a run's files. Generous for real runs: a summary holds aggregates, a
# job.json a record; episodes.jsonl grows with the run, one line per episode.
MAX_JSON_BYTES = 16 * 1024 * 1024
MAX_EPISODES_BYTES = 256 * 1024 * 1024
# One line of episodes.jsonl (a longer one is skipped unread: the runner's lines are far shorter,
# at most MAX_METRIC_NAMES names of at most MAX_METRIC_NAME_CHARS characters), and the bytes of the
# file's lines one page of GET /runs/{id}/episodes holds in all (it ends early rather than pass
# it): bytes as on disk. A page keeps each episode as its answer's JSON text, not parsed, and
# also ends before that text passes MAX_EPISODES_ANSWER_BYTES (the runner's lines are as long in
# the answer as on disk; a line not of the runner's may be 4 times longer, "1e15" as
# "1000000000000000.0"): a page takes about its answer's size in memory, and one line parsed at a
# time (parsed, 16 MiB of "[]," took 416 MiB; one line of 4 MiB of it takes 180 MiB).
MAX_EPISODE_LINE_BYTES = 4 * 1024 * 1024
MAX_EPISODES_PAGE_BYTES = 16 * 1024 * 1024
MAX_EPISODES_ANSWER_BYTES = 32 * 1024 * 1024
# Where episodes.jsonl's lines start, kept per run (EpisodeIndexes) so that a page reads its own
# lines, not the whole file before and after them: a mark at most every EPISODE_MARK_BYTES (1,024
# for the largest file read), for the EPISODE_INDEXES runs paged last.
EPISODE_MARK_BYTES = 256 * 1024
EPISODE_INDEXES = 32
# The last bytes an index read, read again by each page to tell that the file still holds them: a
# resumed run cuts off the torn line its last attempt left and writes its own lines there; a file
# may be rewritten in place. A torn line shorter than that is all in them, with the newline before
# it (the runner's lines are, but for hundreds of long metric names): its cut is always seen.
EPISODE_CHECK_BYTES = 64 * 1024
MAX_JSON_DEPTH = 64
# A spec's params may be nested schemas.MAX_PARAMS_DEPTH (64) levels deep, and they sit a few levels
# down in spec.json and in job.json (a sweep run's sweep_point): what validation accepts, reads back.
SPEC_JSON_DEPTH = MAX_JSON_DEPTH + 8

log = logging.getLogger("jupyter_evalsched")

STAGING_PREFIX = ".staging-"  # a run directory being assembled, or being deleted
MODEL_LOGS_DIR = ".models"  # the shared-model hosts' stderr (run ids never start with a dot)
LEASES_DIR = ".leases"  # one <lease id>.json per lease
# The sweeps cancelled while they were submitted, newest last: a retry of such a submission
# (its Idempotency-Key) makes no more of its runs, also after a restart.
CANCELLED_SWEEPS_FILE = ".evalsched-cancelled-sweeps.json"
MAX_LEASE_FILES = 10_000

# Without fsync, a batch of new run directories is assembled by the calling thread until one of
# them took it more CPU than SLOW_DIRECTORY_CPU_S (each took 0.07 ms in all, the median, on a
# settled disk of this project's 2-core VMs, and 0.56 ms on a busy one), or longer than
# SLOW_DIRECTORY_S (a disk that makes the thread sleep; a wait for the GIL alone can take 5 ms);
# the rest then go to several threads.
SLOW_DIRECTORY_CPU_S = 0.0003
SLOW_DIRECTORY_S = 0.02


class StoreError(Exception):
    """A run-directory operation failed for a reason worth telling the client (disk full, ...)."""


class StoreBug(StoreError):
    """A run-directory write failed on a bug of ours (the server's log has the traceback): unlike
    a full or read-only disk, waiting will not mend it, so the client is not told to retry."""

    def __init__(
        self, message: str = "cannot write the run directory: an internal error (the server's log says which)"
    ) -> None:
        super().__init__(message)


class RunsDirMoved(StoreError, OSError):
    """Every write refused: the runs directory this server locked was moved or replaced, and a
    write by path would land wherever that path now leads (``RunStore.refuse_writes``)."""


def disk_trouble(exc: BaseException) -> bool:
    """Whether a failed run-directory write was the disk's trouble (full, read-only, an entry in
    the way), which a retry may get past, rather than a bug of ours, logged with its traceback."""
    return isinstance(exc, (StoreError, OSError, RunFileError)) and not isinstance(exc, StoreBug)


def new_run_id() -> str:
    """Unique, sortable by submission time: ``YYYYmmddTHHMMSS.ffffff-<random>``."""
    now = datetime.now(UTC)
    return now.strftime("%Y%m%dT%H%M%S.%f") + "-" + secrets.token_hex(3)


# --------------------------------------------------------------------------- opening


def create_run_file(path: Path) -> None:
    """Make sure ``path`` is an (empty when new) regular file: ``_DONE``, ``_STOP``."""
    os.close(open_run_file(path, os.O_WRONLY | os.O_CREAT))


def remove_run_entry(path: Path) -> None:
    """Remove whatever a run left at ``path`` (a file, a FIFO, a link, a directory tree), relative
    to its directory opened without following a link; nothing when it is absent."""
    path = Path(path)
    try:
        dfd = open_dir(path.parent)
    except FileNotFoundError:
        return
    try:
        try:
            st = os.stat(path.name, dir_fd=dfd, follow_symlinks=False)
        except FileNotFoundError:
            return
        if stat.S_ISDIR(st.st_mode):
            shutil.rmtree(path.name, dir_fd=dfd)  # (never follows the links inside)
        else:
            os.unlink(path.name, dir_fd=dfd)
    finally:
        os.close(dfd)


def discard_run_entry(path: Path) -> None:
    """:func:`remove_run_entry`, as far as it goes (clean-up: a link is removed, not skipped)."""
    try:
        remove_run_entry(path)
    except OSError:
        pass


# --------------------------------------------------------------------------- writing


def atomic_write_bytes(
    path: Path,
    data: bytes,
    fsync: bool = False,
    mode: int = 0o600,
    before_replace: Callable[[], None] | None = None,
) -> None:
    """Write ``path`` by a rename over it: the old entry, whatever it is (a FIFO or a link a run
    planted), is replaced, never opened. Relative to its directory, opened without following a
    link, so a directory swapped for a link cannot redirect the write. ``before_replace`` may
    raise to leave ``path`` as it was, once the new content is written (``RunStore._writable``:
    writes refused while this one waited for the disk)."""
    path = Path(path)
    # The temp name is unique per process and thread so concurrent writers never share one.
    tmp = f".{path.name}.{os.getpid()}.{threading.get_ident()}.{next(_tmp_counter)}.tmp"
    dfd = open_dir(path.parent)
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _SAFE_FLAGS, mode, dir_fd=dfd)
        try:
            try:  # (no file object: this runs on the loop at every run's start and end)
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
                if fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            if before_replace is not None:
                before_replace()
            os.replace(tmp, path.name, src_dir_fd=dfd, dst_dir_fd=dfd)
        except BaseException:
            try:
                os.unlink(tmp, dir_fd=dfd)
            except OSError:
                pass
            raise
        if fsync:
            os.fsync(dfd)  # the rename, durable
    finally:
        os.close(dfd)


def dumps(obj: Any) -> bytes:
    """Compact, strict JSON (no NaN): what every server-written run file holds."""
    return json.dumps(obj, separators=(",", ":"), allow_nan=False).encode()


def atomic_write_json(
    path: Path, obj: Any, fsync: bool = False, before_replace: Callable[[], None] | None = None
) -> None:
    atomic_write_bytes(path, dumps(obj), fsync=fsync, before_replace=before_replace)


def fsync_dir(path: Path) -> None:
    """Make a directory's entries (a rename, a new file) durable."""
    fd = open_dir(path)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# --------------------------------------------------------------------------- reading


def read_bytes_nofollow(path: Path, max_bytes: int) -> bytes:
    """A regular file's content (see :func:`open_run_file`); RunFileError when it is larger than
    ``max_bytes``, UnsafeRunFile when it is not a regular file."""
    fd = open_run_file(path)
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if st.st_size > max_bytes:
            raise RunFileError(f"{Path(path).name} is {st.st_size} bytes; at most {max_bytes} are read")
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:  # it grew while we read
        raise RunFileError(f"{Path(path).name} is over {max_bytes} bytes")
    return data


def parse_json(data: bytes | str, what: str, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """Strict JSON, at most ``max_depth`` levels deep; RunFileError naming ``what`` otherwise.

    A deeper value would make every later ``json.dumps`` of it (an API answer) hit the recursion
    limit; a far deeper text makes the parser itself raise RecursionError, caught here. Non-finite
    numbers (``NaN``, ``Infinity``, ``1e999``) are refused: a record holding one could never be
    written again (``allow_nan=False``) nor sent as JSON.
    """
    try:
        value = json.loads(data, parse_constant=_no_constant, parse_float=_finite_float)
    except RecursionError:
        raise RunFileError(f"{what} is nested more than {max_depth} levels deep") from None
    except UnicodeDecodeError:
        raise RunFileError(f"{what} is not UTF-8") from None
    except ValueError as exc:
        raise RunFileError(f"{what} is not valid JSON: {contract.one_line(str(exc), 200)}") from None
    if _deeper_than(value, max_depth):
        raise RunFileError(f"{what} is nested more than {max_depth} levels deep")
    return value


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{contract.one_line(text, 40)} is not a finite number")
    return value


def _deeper_than(value: Any, limit: int) -> bool:
    """True when containers nest more than ``limit`` levels (iterative: no recursion of ours)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children: Iterable[Any]
        if isinstance(item, dict):
            children = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        if depth > limit:
            return True
        stack.extend((child, depth + 1) for child in children if isinstance(child, dict | list))
    return False


def read_json_file(path: Path, max_bytes: int = MAX_JSON_BYTES, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """A run file's parsed JSON. None when it does not exist; RunFileError when it cannot be used
    (too large, too deep, not JSON, not UTF-8, a link, not a regular file, unreadable)."""
    name = Path(path).name
    try:
        data = read_bytes_nofollow(path, max_bytes)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise RunFileError(f"{name} cannot be read: {exc.strerror or exc}") from None
    if not data:  # (the writes here are atomic: only a crash of the host, or someone, empties one)
        raise RunFileError(
            f"{name} is not valid JSON: the file is empty (a write that never reached the disk, cut short"
            " by a power loss or a hard reset, or the file was emptied)"
        )
    return parse_json(data, name, max_depth)


LOG_READ_MAX_BYTES = 8 * 1024 * 1024  # of a log, in one answer of the logs route


@dataclass(frozen=True, slots=True)
class LogPart:
    """Bytes of a log as they are on disk (a part may start or end within a UTF-8 character),
    ``end`` the offset just past them, ``size`` the log's size when it was read."""

    data: bytes
    end: int
    size: int


def tail_lines(path: Path, n: int | None, max_bytes: int = LOG_READ_MAX_BYTES) -> str:
    """The last ``n`` lines of a log (all when None), reading at most ``max_bytes`` from the end."""
    return log_tail_part(path, n, max_bytes).data.decode("utf-8", "replace")


def log_tail_part(path: Path, n: int | None, max_bytes: int = LOG_READ_MAX_BYTES) -> LogPart:
    """The last ``n`` lines of a log (its last ``max_bytes`` when None), as bytes: a reader
    carries on from ``end``. Lines as ``str.splitlines`` cuts them (a carriage return too)."""
    try:
        fd = open_run_file(path)
    except FileNotFoundError:
        return LogPart(b"", 0, 0)
    with os.fdopen(fd, "rb") as f:
        size = os.fstat(fd).st_size
        if n is None:
            start = max(0, size - max_bytes)
            data = os.pread(fd, max_bytes, start)
            return LogPart(data, start + len(data), max(size, start + len(data)))
        block = 64 * 1024
        data = b""
        pos = size
        while pos > 0 and data.count(b"\n") <= n and len(data) < max_bytes:
            step = min(block, pos)
            pos -= step
            f.seek(pos)
            data = f.read(step) + data
        # Cut as text, kept as the very bytes: surrogateescape gives back every byte, invalid
        # UTF-8 included (a line break is never within a character).
        lines = data.decode("utf-8", "surrogateescape").splitlines(keepends=True)
        kept = "".join(lines[-n:]).encode("utf-8", "surrogateescape") if n > 0 else b""
        return LogPart(kept, pos + len(data), size)


def log_part_from(path: Path, offset: int, max_bytes: int = LOG_READ_MAX_BYTES) -> LogPart:
    """The bytes of a log from byte ``offset``, at most ``max_bytes`` of them; none when the
    log is shorter (``size`` then tells a reader that it was rewritten)."""
    try:
        fd = open_run_file(path)
    except FileNotFoundError:
        return LogPart(b"", offset, 0)
    try:
        size = os.fstat(fd).st_size
        data = os.pread(fd, max_bytes, offset) if offset < size else b""
    finally:
        os.close(fd)
    # (a log that grew since fstat: what was read is there all the same)
    return LogPart(data, offset + len(data), max(size, offset + len(data)) if data else size)


# (inode, mtime_ns, ctime_ns, size). Timestamps tick coarsely (a few ms here), so two versions of
# a file written within one tick can share them and their size; an atomic replacement always
# brings another inode, so the inode tells them apart (a reused inode number still needs the
# rest to match as well).
FileStamp = tuple[int, int, int, int]


def file_stamp(st: os.stat_result) -> FileStamp:
    return (st.st_ino, st.st_mtime_ns, st.st_ctime_ns, st.st_size)


@dataclass(slots=True)
class _Cached:
    key: FileStamp
    value: Any


class FileCache:
    """Parsed JSON keyed by its ``FileStamp``: unchanged files are never parsed twice."""

    def __init__(self, max_entries: int = 1024) -> None:
        self._entries: dict[Path, _Cached] = {}
        self._max = max_entries
        self._lock = threading.Lock()

    def read_json(self, path: Path, fresh: bool = False) -> Any:
        """As :func:`read_json_file` (None when missing, RunFileError when unusable), cached;
        ``fresh``: parsed again whatever the cache holds (a verdict must see the last version)."""
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            self.forget(path)
            return None
        except OSError as exc:
            raise RunFileError(f"{Path(path).name} cannot be read: {exc.strerror or exc}") from None
        key = file_stamp(st)
        with self._lock:
            hit = self._entries.get(path)
        if hit is not None and hit.key == key and not fresh:
            return hit.value
        value = read_json_file(path)
        with self._lock:
            self._entries.pop(path, None)
            while len(self._entries) >= self._max:
                del self._entries[next(iter(self._entries))]  # the oldest entry
            self._entries[path] = _Cached(key, value)
        return value

    def forget(self, path: Path) -> None:
        with self._lock:
            self._entries.pop(path, None)


@dataclass(frozen=True, slots=True)
class FoundRun:
    """What recovery reads of one run directory. A ``*_problem`` says why ``job``/``spec`` is
    None (missing, unreadable, not a JSON object); the spec of a finished run is not read."""

    run_id: str
    path: Path
    job: dict[str, Any] | None
    spec: dict[str, Any] | None
    done: bool
    job_problem: str | None = None
    spec_problem: str | None = None


def parse_episode(line: bytes) -> dict[str, Any] | None:
    """One line of ``episodes.jsonl`` as an episode; None when it is not a bounded JSON object."""
    if not line.strip():
        return None
    try:
        item = parse_json(line, contract.EPISODES_FILE, max_depth=8)
    except RunFileError:
        return None
    return item if isinstance(item, dict) else None


# An episode as the answer writes it (what json.dumps of the whole answer would write of it).
_ANSWER_ENCODER = json.JSONEncoder(separators=(",", ":"))


@dataclass(frozen=True, slots=True)
class EpisodesPage:
    """A page of ``GET /evalsched/runs/{id}/episodes``: the episodes of the file's complete lines
    ``offset`` to ``next_offset`` (lines that are not episodes skipped, counted) as a JSON array's
    text, ``next_offset`` None when the page reached the end; ``total``: the complete lines in the
    file as it was read."""

    episodes_json: bytes
    next_offset: int | None
    total: int


@dataclass(frozen=True, slots=True)
class LineIndex:
    """The complete lines of one file (``identity``: its ``(st_dev, st_ino)``) in its first
    ``scanned`` bytes: ``lines`` of them, the last one's newline just before ``end`` (the bytes from
    there to ``scanned`` are the start of a line not yet complete), and ``marks``, (line number,
    byte offset where that line starts), ascending from (0, 0), one at most every
    EPISODE_MARK_BYTES. It says nothing of the bytes from ``scanned`` on: the run appends.
    ``seen``: the digest of the last bytes it read (:func:`last_read_digest`)."""

    identity: tuple[int, int]
    lines: int = 0
    end: int = 0
    scanned: int = 0
    marks: tuple[tuple[int, int], ...] = ((0, 0),)
    seen: bytes = b""

    def mark_at_or_before(self, line: int) -> tuple[int, int]:
        """The last mark of a line at or before ``line``: where reading up to that line starts."""
        return self.marks[bisect.bisect_right(self.marks, line, key=lambda mark: mark[0]) - 1]


def last_read_digest(fd: int, scanned: int) -> bytes:
    """The digest of the file's EPISODE_CHECK_BYTES before byte ``scanned``."""
    start = max(0, scanned - EPISODE_CHECK_BYTES)
    return hashlib.blake2b(os.pread(fd, scanned - start, start), digest_size=16).digest()


def extend_line_index(fd: int, index: LineIndex, size: int) -> LineIndex:
    """``index`` over the file's bytes up to ``size``: read from ``index.scanned`` (never the
    bytes it already read), ``EPISODE_MARK_BYTES`` at a time."""
    lines, end, marks = index.lines, index.end, list(index.marks)
    at = index.scanned
    while at < size:
        chunk = os.pread(fd, min(EPISODE_MARK_BYTES, size - at), at)
        if not chunk:
            break  # (it shrank under us: the next page indexes it again)
        last = chunk.rfind(b"\n")
        if last >= 0:
            lines += chunk.count(b"\n")
            end = at + last + 1
            if end - marks[-1][1] >= EPISODE_MARK_BYTES:
                marks.append((lines, end))
        at += len(chunk)
    return LineIndex(index.identity, lines, end, at, tuple(marks), last_read_digest(fd, at))


def line_index_holds(
    index: LineIndex, identity: tuple[int, int], size: int, byte_before_end: bytes, seen: bytes
) -> bool:
    """Whether ``index`` still describes the file: the same one, not shorter, the byte its last
    line ended with still a newline, and the last bytes it read still there (``seen``: their
    digest now). A file cut short and written again, or rewritten in place, rarely keeps them."""
    return (
        index.identity == identity
        and size >= index.scanned
        and (index.end == 0 or byte_before_end == b"\n")
        and seen == index.seen
    )


class EpisodeIndexes:
    """The :class:`LineIndex` of ``episodes.jsonl`` of the EPISODE_INDEXES runs paged last (a
    page's thread reads and extends its run's; the least recently used is dropped)."""

    def __init__(self, size: int = EPISODE_INDEXES) -> None:
        self._size = size
        self._lock = threading.Lock()
        self._by_run: OrderedDict[str, LineIndex] = OrderedDict()

    def get(self, run_id: str) -> LineIndex | None:
        with self._lock:
            index = self._by_run.get(run_id)
            if index is not None:
                self._by_run.move_to_end(run_id)
            return index

    def put(self, run_id: str, index: LineIndex) -> None:
        with self._lock:
            self._by_run[run_id] = index
            self._by_run.move_to_end(run_id)
            while len(self._by_run) > self._size:
                self._by_run.popitem(last=False)

    def forget(self, run_id: str) -> None:
        with self._lock:
            self._by_run.pop(run_id, None)

    def current(self, run_id: str, lines: EpisodeLines) -> LineIndex:
        """The run's index over ``lines``'s file as it was opened: the one kept, extended over
        what the run appended since, or a new one when the file was replaced or shrank."""
        fd = lines.fileno()
        index = self.get(run_id)
        if index is not None and index.identity == lines.identity and index.scanned > lines.size:
            # Another page indexed what the run appended since this one opened the file: read
            # the file as it is now, rather than index it all again for the older snapshot.
            lines.catch_up()
        if index is None or not line_index_holds(
            index,
            lines.identity,
            lines.size,
            os.pread(fd, 1, index.end - 1) if index.end else b"",
            last_read_digest(fd, index.scanned),
        ):
            index = LineIndex(lines.identity)
        if index.scanned < lines.size:
            index = extend_line_index(fd, index, lines.size)
            self.put(run_id, index)
        return index


class EpisodeLines:
    """``episodes.jsonl`` read forward in bounded memory, up to its size when it was opened (the
    run may be appending). A line counts once it is complete, with its newline: a last line
    without one is the run's next, being written. A line over MAX_EPISODE_LINE_BYTES is skipped
    unread (None where the line would be)."""

    CHUNK = 1 << 20
    SKIP_CHUNK = 1 << 16  # (a page's skip starts at the mark before its line: most often < 512 KiB)

    def __init__(self, path: Path, max_bytes: int = MAX_EPISODES_BYTES) -> None:
        fd = open_run_file(path)
        self._file = os.fdopen(fd, "rb")
        try:
            st = os.fstat(fd)
        except BaseException:
            self._file.close()
            raise
        self.size = st.st_size  # the snapshot: the file's size when it was opened
        self.identity = (st.st_dev, st.st_ino)
        self._left = self.size  # the bytes still to read of the snapshot
        self._max_bytes = max_bytes
        if self._left > max_bytes:
            self._file.close()
            raise RunFileError(f"{Path(path).name} is {self._left} bytes; at most {max_bytes} are read")

    def __enter__(self) -> EpisodeLines:
        return self

    def __exit__(self, *exc: object) -> None:
        self._file.close()

    def fileno(self) -> int:
        return self._file.fileno()

    def catch_up(self) -> None:
        """Before any read: the file's size now as the snapshot (the run appended since it was
        opened), while it is within the bound."""
        size = os.fstat(self.fileno()).st_size
        if self.size < size <= self._max_bytes:
            self.size = self._left = size

    def seek(self, start: int, end: int) -> None:
        """Read on from byte ``start`` (the start of a line) up to byte ``end`` of the snapshot
        (where its complete lines end, when they are known: not into a long line being written)."""
        self._file.seek(start)
        self._left = max(0, min(end, self.size) - start)

    def _read(self, n: int) -> bytes:
        data = self._file.read(min(n, self._left))
        self._left -= len(data)
        return data

    def _readline(self, n: int) -> bytes:
        data = self._file.readline(min(n, self._left))
        self._left -= len(data)
        return data

    def skip(self, n: int) -> int:
        """Pass over up to ``n`` complete lines without reading them as JSON; how many there were."""
        skipped = 0
        while skipped < n and self._left:
            chunk = self._read(self.SKIP_CHUNK)
            if not chunk:
                break  # (it shrank: the run directory was rewritten under us)
            found = chunk.count(b"\n")
            if skipped + found < n:
                skipped += found
                continue
            end = -1
            for _ in range(n - skipped):
                end = chunk.index(b"\n", end + 1)
            back = len(chunk) - end - 1  # the bytes read past the n-th line: read them again
            self._file.seek(-back, os.SEEK_CUR)
            self._left += back
            skipped = n
        return skipped

    def lines(self) -> Iterator[bytes | None]:
        """The complete lines from here, without their newline; None for one too long to read."""
        while self._left:
            raw = self._readline(MAX_EPISODE_LINE_BYTES + 1)
            if raw.endswith(b"\n"):
                yield raw[:-1]
                continue
            if len(raw) <= MAX_EPISODE_LINE_BYTES:
                return  # the end: nothing, or a line without its newline yet
            while self._left:  # too long: pass over the rest of it
                rest = self._readline(self.CHUNK)
                if not rest:
                    return
                if rest.endswith(b"\n"):
                    break
            else:
                return
            yield None


def _page_answer(lines: Iterator[bytes | None], position: int, offset: int, limit: int | None) -> tuple[bytes, int]:
    """The JSON array of the episodes of ``lines`` (line ``position`` first) that make the page
    from ``offset`` (see ``RunStore.episodes_page``), and the line after the page. Each line is
    parsed alone and kept as its answer's text: the page never holds more than one parsed."""
    out = io.BytesIO()
    out.write(b"[")
    size = answer = 0  # the page's bytes on disk, and of its answer
    for raw in lines:
        if limit is not None and position - offset >= limit:
            break
        if raw is not None:
            if size and size + len(raw) > MAX_EPISODES_PAGE_BYTES:
                break
            item = parse_episode(raw)
            if item is not None:
                text = _ANSWER_ENCODER.encode(item).encode()
                if answer and answer + 1 + len(text) > MAX_EPISODES_ANSWER_BYTES:
                    break
                if answer:
                    out.write(b",")
                    answer += 1
                out.write(text)
                answer += len(text)
            size += len(raw)
        position += 1
    out.write(b"]")
    return out.getvalue(), position


# --------------------------------------------------------------------------- the runs directory


class RunStore:
    """Where run directories live, how they are written, and every read of their files."""

    def __init__(self, runs_dir: Path, fsync: bool = False) -> None:
        self.root = Path(runs_dir)
        self.fsync = fsync
        self.cache = FileCache()
        self.episode_indexes = EpisodeIndexes()
        self._pool: ThreadPoolExecutor | None = None  # a batch's directories, with fsync or a slow disk
        self._pool_lock = threading.Lock()
        self.refused: str | None = None  # why every write is refused (the directory was moved)
        # Run directories and records put in place so far, by any thread: a stop waits for a
        # slow disk while this moves (``RunWriter.close_within``). (Unlocked: any change says it.)
        self.writes_done = 0
        # The runs directory as ensure() found it (the one this server locked just before): run
        # directories are made and renamed into place relative to it, so that a submission is
        # acknowledged only for a directory in it, whatever the path names meanwhile (a link).
        self._root_fd: int | None = None
        self._root_closer: Callable[[], Any] = lambda: None

    def refuse_writes(self, why: str) -> None:
        """From now on every write of this store raises :class:`RunsDirMoved` with ``why``: the
        directory at ``root`` is no longer the one this server locked, and writes go by path."""
        self.refused = why

    def _writable(self) -> None:
        if self.refused is not None:
            raise RunsDirMoved(errno.EROFS, self.refused)

    def ensure(self) -> None:
        self._writable()
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(self.root, 0o700)
        if self._root_fd is None:
            self._root_fd = open_dir(self.root)
            self._root_closer = weakref.finalize(self, os.close, self._root_fd)  # (a store never closed)

    def close(self) -> None:
        """Let go of the runs directory (the scheduler stopped): writes go by path again."""
        if self._root_fd is not None:
            self._root_fd = None
            self._root_closer()

    def run_dir(self, run_id: str) -> Path:
        """The directory of a run; raises KeyError for ids that could never name one."""
        if not is_valid_run_id(run_id):
            raise KeyError(run_id)
        return self.root / run_id

    def file(self, run_id: str, name: str) -> Path:
        return self.run_dir(run_id) / name

    # ---- writes (the server's own files)

    def create(self, run_id: str, files: dict[str, bytes]) -> Path:
        """Assemble a run directory under a staging name, then rename it into place (durably
        with ``fsync``); StoreError says why not."""
        error = self.create_many([(run_id, files)])[0]
        if error is not None:
            raise error
        return self.run_dir(run_id)

    def create_many(self, runs: Sequence[tuple[str, dict[str, bytes]]]) -> list[StoreError | None]:
        """Several run directories at once (concurrent submissions): each assembled and renamed
        into place as :meth:`assemble` does (on this thread, or several at once where the disk
        makes each wait), then, with ``fsync``, one fsync of the runs directory for all their
        renames. One entry per run: None when its directory is in place, else the StoreError that
        failed that run alone (nothing of it is left)."""
        if self.refused is not None:
            return [RunsDirMoved(errno.EROFS, self.refused) for _ in runs]
        if self.fsync and len(runs) > 1:
            # Each file's fsync waits for the disk: from several threads at once, the waits overlap.
            out = self._assemble_on_pool(runs)
        else:
            # Without fsync one thread is the cheaper: on a disk that does not make a creation
            # wait, a pool's hand-offs and switches of the GIL cost the server about a seventh of
            # its CPU a submission (docs/performance.md, "One thread assembles a batch"). Once a
            # directory took long, the rest of the batch goes to the pool: on ext4 without a
            # journal, each creation then walks past recently freed inodes (the kernel's time,
            # counted in this thread's), which the pool's threads spread over the CPUs, and a disk
            # that makes the thread sleep is waited for by several at once. (This thread's CPU
            # time, not the clock's: a wait for the GIL, which the loop holds, is not a slow disk.)
            out = []
            for i, run in enumerate(runs):
                cpu, wall = time.thread_time(), time.monotonic()
                out.append(self._try_assemble(run))
                if i + 2 < len(runs) and (
                    time.thread_time() - cpu > SLOW_DIRECTORY_CPU_S or time.monotonic() - wall > SLOW_DIRECTORY_S
                ):
                    out.extend(self._assemble_on_pool(runs[i + 1 :]))
                    break
        placed = [i for i, error in enumerate(out) if error is None]
        if self.fsync and placed:
            root = self._root_fd
            try:
                # The renames are what acknowledges the runs: make them durable.
                os.fsync(root) if root is not None else fsync_dir(self.root)
            except OSError as exc:
                error = StoreError(_disk_message(exc, self.root))
                for i in placed:  # not durable, not acknowledged: not left to run after a restart
                    if root is not None:
                        shutil.rmtree(runs[i][0], ignore_errors=True, dir_fd=root)
                    else:
                        discard_run_entry(self.run_dir(runs[i][0]))
                    out[i] = error
        return out

    def _assemble_on_pool(self, runs: Sequence[tuple[str, dict[str, bytes]]]) -> list[StoreError | None]:
        """:meth:`_try_assemble` for each run, on the pool's threads at once; those the pool cannot
        take (no thread can be started, the interpreter is shutting down) on this thread."""
        futures = []
        try:
            pool = self._batch_pool()
            for run in runs:
                futures.append(pool.submit(self._try_assemble, run))
        except RuntimeError as exc:
            log.warning("evalsched: %d run directories assembled one by one: %s", len(runs) - len(futures), exc)
        return [future.result() for future in futures] + [self._try_assemble(run) for run in runs[len(futures) :]]

    def _try_assemble(self, run: tuple[str, dict[str, bytes]]) -> StoreError | None:
        try:
            self.assemble(*run)
        except StoreError as exc:
            return exc
        except Exception:  # a bug of ours: that run fails alone (assemble removed its staging)
            log.exception("evalsched: writing the directory of run %s failed", run[0])
            return StoreBug()
        return None

    def _batch_pool(self) -> ThreadPoolExecutor:
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="evalsched-create")
            return self._pool

    def assemble(self, run_id: str, files: dict[str, bytes]) -> Path:
        """A run directory made under a staging name (its files, with ``fsync`` each file and the
        directory synced) and renamed into place; the rename itself is made durable by the
        caller (:meth:`create_many`: one fsync of the runs directory for a batch). StoreError
        (the staging directory removed) when it cannot be."""
        final = self.run_dir(run_id)
        staging_name = f"{STAGING_PREFIX}{run_id}"
        # Relative to the runs directory ensure() opened, where there is one: see _root_fd.
        root = self._root_fd
        staging: str | Path = staging_name if root is not None else self.root / staging_name
        try:
            os.mkdir(staging, 0o700, dir_fd=root)
        except FileExistsError:
            raise StoreError(f"cannot create the directory of run {run_id}: {staging_name} exists already") from None
        except OSError as exc:
            raise StoreError(_disk_message(exc, self.root)) from exc
        try:
            self._fill(staging, files, root)
            self._writable()  # (refused while its files waited for the disk: not put in place)
            try:
                os.rename(staging, run_id if root is not None else final, src_dir_fd=root, dst_dir_fd=root)
            except OSError as exc:
                if exc.errno in (errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR, errno.EISDIR):
                    raise StoreError(f"cannot create the directory of run {run_id}: {final} exists already") from None
                raise
        except BaseException as exc:
            shutil.rmtree(staging, ignore_errors=True, dir_fd=root)
            if isinstance(exc, OSError) and not isinstance(exc, RunsDirMoved):
                raise StoreError(_disk_message(exc, self.root)) from exc
            raise
        self.writes_done += 1
        return final

    def _fill(self, staging: str | Path, files: dict[str, bytes], root: int | None) -> None:
        # The files go into the directory made here, whatever is renamed.
        dfd = os.open(staging, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=root)
        try:
            for name, data in files.items():
                # No temp file needed: nobody sees the staging directory until its rename.
                fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _SAFE_FLAGS, 0o600, dir_fd=dfd)
                try:
                    view = memoryview(data)
                    while view:
                        view = view[os.write(fd, view) :]
                    if self.fsync:
                        os.fsync(fd)
                finally:
                    os.close(fd)
            if self.fsync:
                os.fsync(dfd)
        finally:
            os.close(dfd)

    def write_job(self, run_id: str, record: dict[str, Any] | bytes) -> None:
        """``job.json``: the record, or its JSON already made (:func:`dumps`)."""
        self._writable()
        data = record if isinstance(record, bytes) else dumps(record)
        try:
            atomic_write_bytes(
                self.file(run_id, contract.JOB_FILE), data, fsync=self.fsync, before_replace=self._writable
            )
        except RunsDirMoved:
            raise
        except OSError as exc:
            raise StoreError(_disk_message(exc, self.root)) from exc
        self.writes_done += 1

    def write_shared_urls(self, run_id: str, urls: dict[str, str]) -> None:
        self._writable()
        atomic_write_json(
            self.file(run_id, contract.SHARED_URLS_FILE),
            {"models": urls},
            fsync=self.fsync,
            before_replace=self._writable,
        )

    def mark_done(self, run_id: str) -> None:
        """``_DONE`` as the server writes it for a run it finalizes; OSError when it cannot."""
        self._writable()
        path = self.file(run_id, contract.DONE_FILE)
        try:
            create_run_file(path)
        except UnsafeRunFile:
            # The run left something else there (a FIFO, a link, a directory): the server's
            # verdict stands and needs a real _DONE, so that entry goes.
            remove_run_entry(path)
            try:
                create_run_file(path)
            except UnsafeRunFile as exc:  # planted again meanwhile
                raise OSError(errno.EEXIST, str(exc)) from None
        if self.fsync:
            fsync_dir(self.run_dir(run_id))
        self.writes_done += 1

    def unmark_done(self, run_id: str) -> None:
        """Remove ``_DONE`` (a run queued again: resumed or retried), durably before the record
        says queued; OSError when it cannot be removed."""
        self._writable()
        remove_run_entry(self.file(run_id, contract.DONE_FILE))  # (a directory planted there too)
        if self.fsync:
            fsync_dir(self.run_dir(run_id))

    def write_stop(self, run_id: str) -> None:
        """``_STOP``: the run stops at its next episode boundary (preemption). UnsafeRunFile when
        the run put something else than a regular file there."""
        self._writable()
        create_run_file(self.file(run_id, contract.STOP_FILE))

    def clear_stop(self, run_id: str) -> None:
        self._writable()
        remove_run_entry(self.file(run_id, contract.STOP_FILE))

    def create_logs(self, run_id: str) -> None:
        """Both logs, empty and owner-only, where they do not exist yet (a run handed to another
        system that opens them itself: SLURM); UnsafeRunFile when something else is there."""
        self._writable()
        for stream in ("stdout", "stderr"):
            os.close(open_log(self.log_path(run_id, stream)))

    def log_path(self, run_id: str, stream: str) -> Path:
        """Where a run's ``stdout``/``stderr`` goes (the launcher opens it with :func:`open_log`)."""
        return self.file(run_id, contract.STDOUT_FILE if stream == "stdout" else contract.STDERR_FILE)

    def withdraw(self, run_ids: Sequence[str]) -> None:
        """Run directories written but never acknowledged (a sweep's points given up before they
        were runs): each renamed out of the runs at once (under a staging name, which a restart's
        scan removes), the renames made durable where ``fsync`` is on, then removed. Never
        raises: what could not be renamed is logged (it would be found as a queued run)."""
        if self.refused is not None:
            log.warning("evalsched: %d unacknowledged run directories left in %s (it moved)", len(run_ids), self.root)
            return
        root = self._root_fd
        renamed = []
        for run_id in run_ids:
            name = f"{STAGING_PREFIX}withdrawn-{run_id}"
            try:
                if root is not None:
                    os.rename(run_id, name, src_dir_fd=root, dst_dir_fd=root)
                else:
                    os.rename(self.run_dir(run_id), self.root / name)
            except OSError as exc:
                log.warning("evalsched: the directory of run %s, never acknowledged, stays: %s", run_id, exc)
                continue
            renamed.append(name)
        if renamed and self.fsync:
            try:
                os.fsync(root) if root is not None else fsync_dir(self.root)
            except OSError as exc:
                log.warning("evalsched: the removal of %d run directories is not durable: %s", len(renamed), exc)
        for name in renamed:
            if root is not None:
                shutil.rmtree(name, ignore_errors=True, dir_fd=root)
            else:
                discard_run_entry(self.root / name)

    def delete(self, run_id: str) -> None:
        self._writable()
        path = self.run_dir(run_id)
        # Rename first so the directory vanishes from listings atomically, then remove it.
        trash = self.root / f"{STAGING_PREFIX}deleted-{run_id}-{time.monotonic_ns()}"
        os.rename(path, trash)
        self.episode_indexes.forget(run_id)
        discard_run_entry(trash)

    # ---- leases (``<runs_dir>/.leases/<id>.json``)

    def _lease_path(self, lease_id: str) -> Path:
        if not is_valid_run_id(lease_id):
            raise KeyError(lease_id)
        return self.root / LEASES_DIR / f"{lease_id}.json"

    def write_lease(self, lease_id: str, record: dict[str, Any]) -> None:
        self._writable()
        path = self._lease_path(lease_id)
        try:
            path.parent.mkdir(mode=0o700, exist_ok=True)
            atomic_write_json(path, record, fsync=self.fsync, before_replace=self._writable)
        except RunsDirMoved:
            raise
        except OSError as exc:
            raise StoreError(_disk_message(exc, self.root)) from exc

    def delete_lease(self, lease_id: str) -> None:
        if self.refused is not None:
            return  # (the lease's file stays, in the moved directory: its next server ends it)
        try:
            remove_run_entry(self._lease_path(lease_id))  # (not through a link at .leases)
        except (OSError, KeyError):
            pass

    def write_cancelled_sweeps(self, sweeps: list[tuple[str, str | None]]) -> None:
        """The sweeps cancelled, each its id and the Idempotency-Key of its submission (or None),
        in ``CANCELLED_SWEEPS_FILE``: ``[{"sweep_id": ..., "idempotency_key": ...}, ...]``;
        StoreError when the disk refuses."""
        self._writable()
        entries = [{"sweep_id": sweep_id, "idempotency_key": key} for sweep_id, key in sweeps]
        try:
            atomic_write_json(
                self.root / CANCELLED_SWEEPS_FILE, entries, fsync=self.fsync, before_replace=self._writable
            )
        except RunsDirMoved:
            raise
        except OSError as exc:
            raise StoreError(_disk_message(exc, self.root)) from exc

    def read_cancelled_sweeps(self) -> list[tuple[str, str | None]]:
        """What :meth:`write_cancelled_sweeps` wrote (an id alone, as first written, has no key);
        none where it is absent or damaged (bounded read, no link followed), an entry that is
        not of that form skipped."""
        try:
            # (4,096 entries with keys of 200 characters take about 1 MiB)
            value = read_json_file(self.root / CANCELLED_SWEEPS_FILE, max_bytes=4 * 1024 * 1024)
        except RunFileError:
            return []
        out: list[tuple[str, str | None]] = []
        for entry in value if isinstance(value, list) else []:
            if isinstance(entry, str):
                out.append((entry, None))
            elif isinstance(entry, dict) and isinstance(entry.get("sweep_id"), str):
                key = entry.get("idempotency_key")
                out.append((entry["sweep_id"], key if isinstance(key, str) else None))
        return out

    def read_leases(self) -> list[tuple[str, dict[str, Any]]]:
        """Every lease file that holds a JSON object (bounded reads, no links); others are skipped."""
        folder = self.root / LEASES_DIR
        try:
            names = sorted(os.listdir(folder))[:MAX_LEASE_FILES]
        except OSError:
            return []
        out = []
        for name in names:
            lease_id = name[: -len(".json")]
            if not name.endswith(".json") or not is_valid_run_id(lease_id):
                continue
            try:
                value = read_json_file(folder / name, max_bytes=1024 * 1024)
            except RunFileError:
                continue
            if isinstance(value, dict):
                out.append((lease_id, value))
        return out

    # ---- reads

    def done_exists(self, run_id: str) -> bool:
        """Something is at ``_DONE`` (the run says it finalized); :meth:`done_marked` tells
        whether it is usable."""
        return os.path.lexists(self.file(run_id, contract.DONE_FILE))

    def done_marked(self, run_id: str) -> bool:
        """``_DONE`` is there, a regular file; UnsafeRunFile when something else is (a FIFO, a
        link, a directory: a verdict must not rest on it)."""
        try:
            st = os.lstat(self.file(run_id, contract.DONE_FILE))  # (an lstat never blocks)
        except FileNotFoundError:
            return False
        if not stat.S_ISREG(st.st_mode):
            raise UnsafeRunFile(f"{contract.DONE_FILE} is {kind_of(st.st_mode)}, not a regular file")
        return True

    def summary(self, run_id: str, fresh: bool = False) -> Any:
        """The run's ``summary.json`` (cached by its stamp unless ``fresh``), None when absent;
        RunFileError when it cannot be used."""
        return self.cache.read_json(self.file(run_id, contract.SUMMARY_FILE), fresh=fresh)

    def summary_stamp(self, run_id: str) -> FileStamp | None:
        """The ``FileStamp`` of ``summary.json``: a cheap test of "has it changed"."""
        try:
            st = os.lstat(self.file(run_id, contract.SUMMARY_FILE))
        except OSError:
            return None
        return file_stamp(st)

    def spec(self, run_id: str) -> Any:
        """The spec as written at submission (server-owned; None when it is gone)."""
        return read_json_file(self.file(run_id, contract.SPEC_FILE), max_depth=SPEC_JSON_DEPTH)

    def iter_episode_lines(self, run_id: str) -> Generator[dict[str, Any] | None, None, None]:
        """The episodes of ``episodes.jsonl`` (see :class:`EpisodeLines`), read as they are
        iterated, in bounded memory, one item per complete line: None for a line that is not an
        episode (so that a reader sees its progress through garbage too). None at all when there
        is no file; RunFileError when it cannot be read (on the first ``next``)."""
        try:
            lines = self._episode_lines(run_id)
        except FileNotFoundError:
            return
        with lines:
            try:
                for raw in lines.lines():
                    yield None if raw is None else parse_episode(raw)
            except OSError as exc:
                raise RunFileError(f"{contract.EPISODES_FILE} cannot be read: {exc.strerror or exc}") from None

    def episodes_page(self, run_id: str, offset: int, limit: int | None) -> EpisodesPage:
        """The episodes of the complete lines ``offset`` on of ``episodes.jsonl``: at most
        ``limit`` lines (None: no count), no more than MAX_EPISODES_PAGE_BYTES of them as they are
        in the file, nor MAX_EPISODES_ANSWER_BYTES of their answer (at least one line). What it
        reads is about the page's own lines: the run's :class:`LineIndex` says where they start
        and how many there are (the lines before ``offset`` are passed over, not read as JSON)."""
        try:
            lines = self._episode_lines(run_id)
        except FileNotFoundError:
            return EpisodesPage(b"[]", None, 0)
        with lines:
            try:
                index = self.episode_indexes.current(run_id, lines)
                line, byte = index.mark_at_or_before(min(offset, index.lines))
                lines.seek(byte, index.end)
                position = line + lines.skip(offset - line)
                out, position = _page_answer(lines.lines(), position, offset, limit)
            except OSError as exc:
                raise RunFileError(f"{contract.EPISODES_FILE} cannot be read: {exc.strerror or exc}") from None
        return EpisodesPage(out, position if position < index.lines else None, index.lines)

    def _episode_lines(self, run_id: str) -> EpisodeLines:
        """``episodes.jsonl`` opened (FileNotFoundError when there is none)."""
        try:
            return EpisodeLines(self.file(run_id, contract.EPISODES_FILE))
        except FileNotFoundError:
            raise
        except OSError as exc:
            raise RunFileError(f"{contract.EPISODES_FILE} cannot be read: {exc.strerror or exc}") from None

    def log_part(self, run_id: str, stream: str, lines: int | None = None, offset: int | None = None) -> LogPart:
        """The run's ``stdout``/``stderr`` as bytes: from byte ``offset`` when given, else its
        last ``lines`` lines; RunFileError when the log is a link, not a file or unreadable."""
        path = self.log_path(run_id, stream)
        try:
            return log_part_from(path, offset) if offset is not None else log_tail_part(path, lines)
        except OSError as exc:
            raise RunFileError(f"{path.name} cannot be read: {exc.strerror or exc}") from None

    def scan(self) -> list[FoundRun]:
        """Every run directory on disk with its server-owned files (staging leftovers are removed:
        they were never acknowledged). Never raises for a bad run directory: its ``problem`` says."""
        out: list[FoundRun] = []
        try:
            entries = list(os.scandir(self.root))
        except FileNotFoundError:
            return out
        for entry in entries:
            if entry.name.startswith(STAGING_PREFIX):
                discard_run_entry(Path(entry.path))
                continue
            if entry.name.startswith("."):
                continue  # ours (model logs, the primary's files), never a run: run ids start with a digit
            try:
                is_dir = entry.is_dir(follow_symlinks=False)
            except OSError:
                continue
            if is_dir and is_valid_run_id(entry.name):
                out.append(self._found(entry.name, Path(entry.path)))
        return out

    def _found(self, run_id: str, path: Path) -> FoundRun:
        job, job_problem = _read_object(path / contract.JOB_FILE)
        spec, spec_problem = None, None
        if job is None or job.get("state") not in contract.TERMINAL_STATES:
            # A finished run needs its record only: its spec (params can be megabytes) stays on disk.
            spec, spec_problem = _read_object(path / contract.SPEC_FILE)
        # Only a regular _DONE counts: a terminal run gets the server's own in place of anything
        # else; a running one is judged (conclude) and fails run_file.
        try:
            done = stat.S_ISREG(os.lstat(path / contract.DONE_FILE).st_mode)
        except OSError:
            done = False
        return FoundRun(run_id, path, job, spec, done, job_problem, spec_problem)


def _read_object(path: Path) -> tuple[dict[str, Any] | None, str | None]:
    """A server-owned JSON object of a run directory (spec.json, job.json), or None and why not."""
    try:
        value = read_json_file(path, max_depth=SPEC_JSON_DEPTH)
    except RunFileError as exc:
        return None, str(exc)
    if value is None:
        return None, f"{path.name} is missing"
    if not isinstance(value, dict):
        return None, f"{path.name} does not hold a JSON object"
    return value, None


def _disk_message(exc: OSError, root: Path) -> str:
    if exc.errno == errno.ENOSPC:
        return f"the runs directory {root} is full (no space left on device)"
    if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return f"the runs directory {root} is not writable ({exc.strerror})"
    return f"cannot write to the runs directory {root}: {exc.strerror or exc}"
