"""Replacing a file by an exchange of names: atomic for readers, without the write to disk that
some file systems make at a rename over an existing file.

ext4 (its default ``auto_da_alloc``) and btrfs take ``rename(new, existing)`` for an
application's "replace this file" without an ``fsync`` and write the new file's data at once,
in the renaming thread, so that a power loss finds the old content or the new, not an empty
file. A run rewrites ``summary.json`` after every episode: on this project's ext4 each such
rename cost 0.08 ms against 0.009 ms for an exchange, and wrote a page to disk, which the next
episode's summary made moot (a run of 3,000 no-op episodes on a real default server: 487 ms and
2,976 pages written, against 120 ms and none; bench/bench_episodes_ab.py).

:func:`replace` exchanges the two names (``renameat2(RENAME_EXCHANGE)``: a reader of the name
finds the old file or the new, never neither) and then unlinks the old file, now under the
temporary name. The file systems' heuristic does not apply to an exchange, so without ``fsync``
a power loss soon after may leave an empty file, as it may on a file system without the
heuristic (XFS, for one). The runner uses it for the intermediate summaries of runs that do not
fsync only: the final summary, a run's with ``fsync``, and the server's ``job.json`` keep
``os.replace``.

Anything at the name but a directory (a link, a FIFO a run planted) is exchanged and unlinked,
never opened or followed, as ``os.replace`` replaces it. Where the exchange cannot be made, this
is ``os.replace``, with its errors: not Linux, no ``renameat2`` in the C library, a file system
or a seccomp filter that refuses it (NFS, for one: this process stops trying), nothing at the
name yet, a directory there, a name with a NUL. ``ctypes`` is imported for the call only where
it is loaded already: the zygote loads it for the runs it forks (:func:`load`); a fresh
interpreter (a cold run) does not import it for this (1.5 ms, more than the exchange saves a
short run), and renames over the old file unless its eval imported ``ctypes``.
"""

from __future__ import annotations

import errno
import os
import sys

TYPE_CHECKING = False  # typing is not imported at run time (start-up cost); mypy knows this name
if TYPE_CHECKING:
    from collections.abc import Callable

RENAME_EXCHANGE = 2  # linux/fs.h
_AT_FDCWD = -100
_get_errno: Callable[[], int] | None = None
_renameat2: Callable[[int, bytes, int, bytes, int], int] | None = None
_looked = False  # looked for renameat2 (found or not): never again


def load() -> bool:
    """Import ``ctypes`` and look up ``renameat2`` now (a process that forks others does it once
    for them all); True when the exchange is available."""
    global _renameat2, _get_errno, _looked
    if not _looked:
        _looked = True
        try:
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            fn = libc.renameat2
        except (ImportError, OSError, AttributeError):
            return False
        fn.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint)
        fn.restype = ctypes.c_int
        _get_errno = ctypes.get_errno
        _renameat2 = fn
    return _renameat2 is not None


def replace(src: str, dst: str, dir_fd: int | None = None) -> None:
    """Put the file at ``src`` at ``dst`` as ``os.replace`` does (both names relative to
    ``dir_fd`` when given), by an exchange of names where one can be made (see the module)."""
    if not _looked and "ctypes" in sys.modules:
        load()
    if _renameat2 is not None and _exchanged(src, dst, dir_fd):
        return
    os.replace(src, dst, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)


def _exchanged(src: str, dst: str, dir_fd: int | None) -> bool:
    """Exchange the two names and unlink the old file (now at ``src``); False (nothing changed)
    when that could not be done, and ``os.replace`` is to do it."""
    global _renameat2
    rename, get_errno = _renameat2, _get_errno
    if rename is None or get_errno is None:
        return False
    fd = _AT_FDCWD if dir_fd is None else dir_fd
    a, b = os.fsencode(src), os.fsencode(dst)
    if b"\0" in a or b"\0" in b:
        return False  # (C would cut the name there: os.replace refuses it)
    if rename(fd, a, fd, b, RENAME_EXCHANGE) != 0:
        # ENOENT: nothing at dst yet (a plain rename is written by no heuristic), or no src
        # (os.replace says so). Anything else (EINVAL from NFS, ENOSYS, a seccomp filter's
        # EPERM): not here, and a run writes in one directory: no failed call per write.
        if get_errno() != errno.ENOENT:
            _renameat2 = None
        return False
    try:
        os.unlink(src, dir_fd=dir_fd)
    except IsADirectoryError:
        # A directory stood at dst: put it back, and let os.replace refuse as it always did.
        if rename(fd, a, fd, b, RENAME_EXCHANGE) != 0:
            code = get_errno()
            raise OSError(code, os.strerror(code), dst) from None
        return False
    except OSError:
        pass  # the new file is in place; the old one stays at the temporary name (the next write's)
    return True
