"""Opening a file that a run (or a user) can write, without being redirected or blocked.

Everything under the runs directory is writable by the runs (same uid). Whoever opens a path
there (the server, and a run's own process for its logs) opens it relative to its directory,
opened without following a link; never follows a link at the file; never waits for the other end
of a FIFO (a plain open of one blocks until someone opens it: on the server's loop, the whole
server); and accepts nothing but a regular file (:class:`UnsafeRunFile`).

Kept free of heavy imports: a zygote preloads it for its runs, which open their own logs.
"""

from __future__ import annotations

import errno
import os
import stat

_SAFE_FLAGS = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC

# What a failed open says about the entry it met (with the flags above).
_ENTRY_ERRNOS = {errno.ELOOP: "a symbolic link", errno.ENXIO: "a FIFO or socket", errno.EISDIR: "a directory"}


class RunFileError(ValueError):
    """A run file exists but cannot be used; the message says which file and why."""


class UnsafeRunFile(RunFileError):
    """A path under the runs directory is a link, a FIFO, a directory or anything else but a
    regular file, where the server opens one: never opened (a FIFO would block the event loop)."""


def kind_of(mode: int) -> str:
    """What a non-regular file is, in words."""
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISLNK(mode):
        return "a symbolic link"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "a device or special file"


def open_dir(path: str | os.PathLike[str]) -> int:
    """A directory under the runs directory, opened without following a link (ELOOP if it is one,
    ENOTDIR if it is not a directory): later opens relative to it cannot be redirected."""
    return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)


def open_run_file(path: str | os.PathLike[str], flags: int = os.O_RDONLY, mode: int = 0o600) -> int:
    """The one way to open a path a run or a user can write: relative to its directory (opened
    without following a link), without following a link at the file, without blocking, and only
    if it is a regular file. ``flags``: O_RDONLY, or O_WRONLY with O_CREAT/O_APPEND/...
    UnsafeRunFile when the path (or its directory) is a link, a FIFO, a directory, ...; OSError
    (FileNotFoundError, ...) otherwise."""
    parent, name = os.path.split(os.fspath(path))
    try:
        dfd = open_dir(parent or ".")
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            where = os.path.basename(parent)
            raise UnsafeRunFile(f"{where} (the directory of {name}) is not a plain directory") from None
        raise
    try:
        fd = os.open(name, flags | _SAFE_FLAGS, mode, dir_fd=dfd)
    except OSError as exc:
        kind = _ENTRY_ERRNOS.get(exc.errno or 0)
        if kind is None:
            raise
        raise UnsafeRunFile(f"{name} is {kind}, not a regular file") from None
    finally:
        os.close(dfd)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):  # a FIFO opened for reading, a directory, a device
            raise UnsafeRunFile(f"{name} is {kind_of(st.st_mode)}, not a regular file")
        if flags & (os.O_WRONLY | os.O_RDWR):
            os.set_blocking(fd, True)  # a regular file: writes must not return EAGAIN half-way
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_log(path: str | os.PathLike[str]) -> int:
    """A run's log (``stdout.log``, a model host's ``<name>.log``) opened for appending, blocking
    writes; UnsafeRunFile when it is not a regular file."""
    return open_run_file(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)


def open_logs(stdout: str | os.PathLike[str], stderr: str | os.PathLike[str]) -> tuple[int, int]:
    """A run's two logs, both or neither: (stdout's descriptor, stderr's). Raises what
    :func:`open_log` raises; the message of an OSError is the caller's to word."""
    out = open_log(stdout)
    try:
        err = open_log(stderr)
    except BaseException:
        os.close(out)
        raise
    return out, err


def log_open_failure(exc: OSError | UnsafeRunFile) -> str:
    """Why a run's logs could not be opened, as the run's failure says it."""
    if isinstance(exc, UnsafeRunFile):
        return f"cannot open the run's log files: {exc}"
    return f"cannot open the run's log files: {exc.strerror or exc}"
