"""The response cache of the OpenAI-compatible routes (``EvalSchedApp.openai_cache_mb``).

A deterministic request (``openai_shapes.deterministic``: greedy, seeded or scoring only) is
answered from ``<runs_dir>/.openai-cache/<key>.json`` when the same prompt was answered before by
the same model files, so that an interrupted lm-eval or Inspect run resumed against the server
recomputes nothing it already had. One entry per prompt (a request of several prompts sends the
model only those it has no entry for, however a resumed run batches them). The key
(``cache_key``) is a SHA-256 of the model's declaration (loader, task, directory, device, dtype,
options), a digest of the model directory's files (``model_digest``) and the canonical engine
request of the prompt (what ``openai_shapes`` parsed, defaults filled in, so that two spellings of
one request share an entry); a file of the model that changes changes the key. What is stored is
the host's answer, from which a plain or a streamed answer is made.

The runs directory is writable by its users, so every file is reached as ``store`` reaches run
files: relative to the cache directory opened without following a link, never following a link
at the file, read only when it is a regular file of bounded size, written by an atomic rename
(0600). A damaged or planted entry is a miss. Its size is bounded: past ``max_bytes``, the entries
used least recently (their mtime, renewed at each hit) are removed down to 90 % of it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import stat
import threading
import time
from pathlib import Path
from typing import Any

from .shared_models.model_files import model_digest as model_digest
from .store import atomic_write_bytes, dumps, open_dir, parse_json, read_bytes_nofollow

CACHE_DIR = ".openai-cache"  # under the runs directory (run ids never start with a dot)
FORMAT = 1  # in every key: a change of what is stored is a change of every key
_ENTRY = re.compile(r"^[0-9a-f]{64}\.json$")


def cache_key(declaration: dict[str, Any], files: str, kind: str, request: dict) -> str:
    """The entry of one engine ``request`` (one prompt; ``kind``: completions or chat) to the
    declared model."""
    model = {k: declaration.get(k) for k in ("loader", "task", "model", "device", "dtype", "options")}
    canonical = {k: v for k, v in request.items() if k != "stream"}
    text = json.dumps(
        {"format": FORMAT, "model": model, "files": files, "kind": kind, "request": canonical},
        sort_keys=True,
        default=str,
    )
    return hashlib.sha256(text.encode()).hexdigest()


class ResponseCache:
    """The entries under ``<runs_dir>/.openai-cache``, at most ``max_bytes`` in all. Blocking file
    I/O: call it from a thread (``asyncio.to_thread``)."""

    def __init__(self, runs_dir: Path, max_bytes: int):
        self.runs_dir = Path(runs_dir)
        self.root = self.runs_dir / CACHE_DIR
        self.max_bytes = max_bytes
        self.max_entry_bytes = max(1, max_bytes // 4)  # one answer never takes the whole cache
        self._lock = threading.Lock()
        self._total: int | None = None  # bytes in the cache, once counted

    def _ensure_root(self) -> None:
        """The cache directory, created 0700; OSError when it is not our own plain directory."""
        dfd = open_dir(self.runs_dir)
        try:
            with contextlib.suppress(FileExistsError):
                os.mkdir(CACHE_DIR, 0o700, dir_fd=dfd)
            info = os.stat(CACHE_DIR, dir_fd=dfd, follow_symlinks=False)
            if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
                raise OSError(f"{self.root} is not a directory of this server's user")
        finally:
            os.close(dfd)

    def get(self, key: str) -> dict | None:
        """The answer stored for ``key``; None when there is none (or it is unreadable)."""
        path = self.root / f"{key}.json"
        try:
            entry = parse_json(read_bytes_nofollow(path, self.max_entry_bytes), path.name)
        except (OSError, ValueError):  # absent, a link or a FIFO, too large, not JSON: a miss
            return None
        if not isinstance(entry, dict) or entry.get("key") != key or not isinstance(entry.get("answer"), dict):
            return None
        with contextlib.suppress(OSError):  # used now: the last to be evicted
            dfd = open_dir(self.root)
            try:
                # The clock's own time, finer than the kernel's file times of earlier writes.
                now = time.time_ns()
                os.utime(path.name, ns=(now, now), dir_fd=dfd, follow_symlinks=False)
            finally:
                os.close(dfd)
        return entry["answer"]

    def put(self, key: str, answer: dict) -> bool:
        """Store ``answer`` for ``key``; False when it was not stored (too large, no room)."""
        data = dumps({"key": key, "answer": answer})
        if len(data) > self.max_entry_bytes:
            return False
        try:
            self._ensure_root()
            atomic_write_bytes(self.root / f"{key}.json", data, mode=0o600)
        except (OSError, ValueError):
            return False
        with self._lock:
            self._total = (self._total if self._total is not None else self._count()) + len(data)
            if self._total > self.max_bytes:
                self._total = self._evict(int(self.max_bytes * 0.9))
        return True

    def _entries(self) -> list[tuple[float, int, str]]:
        """``(mtime, size, name)`` of every entry (regular files named as entries only)."""
        dfd = open_dir(self.root)
        try:
            found = []
            with os.scandir(dfd) as listing:
                for entry in listing:
                    if not _ENTRY.match(entry.name):
                        continue
                    info = entry.stat(follow_symlinks=False)
                    if stat.S_ISREG(info.st_mode):
                        found.append((info.st_mtime, info.st_size, entry.name))
            return found
        finally:
            os.close(dfd)

    def _count(self) -> int:
        try:
            return sum(size for _, size, _ in self._entries())
        except OSError:
            return 0

    def _evict(self, target: int) -> int:
        """Remove the least recently used entries until at most ``target`` bytes are left."""
        try:
            entries = sorted(self._entries())
            total = sum(size for _, size, _ in entries)
            dfd = open_dir(self.root)
        except OSError:
            return 0
        try:
            for _, size, name in entries:
                if total <= target:
                    break
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(name, dir_fd=dfd)
                total -= size
        finally:
            os.close(dfd)
        return total
