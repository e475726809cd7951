"""What identifies a model's files on disk, without reading them: the response cache keys its
answers on it, and a model host says which files it loaded (``model_digest`` before and after its
load), so that an answer is stored only under the key of the files that made it."""

from __future__ import annotations

import hashlib
import os


def model_digest(path: str | None) -> str | None:
    """A digest of the files under a model directory: each file's relative name, size,
    modification and change times (ns) and inode. Not their contents: hashing a 14 GB model at
    every request would cost more than the answer; ``save_pretrained`` (any rewrite) gives a file
    a new time, and a copy that keeps the modification time (``cp -p``, ``rsync -a``) still gets a
    new change time or inode. Links are followed, to files and to directories (a directory seen
    twice, through a loop of links, is walked once). None when ``path`` is not a directory (a
    loader that names no model files: nothing to key on). Blocking: call it from a thread."""
    if not path or not os.path.isdir(path):
        return None
    rows = []
    seen: set[tuple[int, int]] = set()
    for folder, dirs, files in os.walk(path, followlinks=True):
        try:
            here = os.stat(folder)
        except OSError:
            dirs[:] = []
            continue
        if (here.st_dev, here.st_ino) in seen:
            dirs[:] = []
            continue
        seen.add((here.st_dev, here.st_ino))
        dirs.sort()
        for name in sorted(files):
            full = os.path.join(folder, name)
            try:
                info = os.stat(full)
            except OSError:
                continue
            rows.append(
                f"{os.path.relpath(full, path)}\0{info.st_size}\0{info.st_mtime_ns}\0{info.st_ctime_ns}\0{info.st_ino}"
            )
    # (A file name that is not UTF-8 comes from the walk with surrogates: its own bytes back.)
    return hashlib.sha256("\n".join(rows).encode("utf-8", "surrogateescape")).hexdigest()
