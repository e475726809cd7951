"""The private directories that hold the model hosts' sockets.

Each is named for the server and the host that made it (``evalsched-models-<pid>-<host tag>``,
with ``-<random>`` under ``/tmp``) and holds a lock file that its server keeps locked (``flock``)
for its whole life. A server that stops removes its own directory; one that was killed cannot,
and a later server of the same user removes it: one of this host whose lock no one holds and
that holds nothing but sockets and lock files. The lock, not the pid, says whether its server
lives: a pid may be another namespace's (containers) or reused, and a live server's directory may
have no socket listening (its hosts start when a run first needs a model, and stop when idle).
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import os
import re
import secrets
import socket
import stat
import tempfile

PREFIX = "evalsched-models-"
LOCK_FILE = ".lock"
_NAME = re.compile(r"evalsched-models-[0-9]{1,10}-([0-9a-f]{8})(?:-[a-z0-9_]{1,16})?", re.ASCII)


class DirectoryHeld(Exception):
    """Another live server holds the directory (its lock file is locked)."""


@functools.cache
def host_tag() -> str:
    """Eight hex digits for this host (its machine id, else its name): a home directory shared by
    several hosts (NFS) holds their servers' directories side by side, and a server leaves the
    others alone."""
    try:
        with open("/etc/machine-id", "rb") as f:
            ident = f.read(256).strip()
    except OSError:
        ident = b""
    return hashlib.sha256(ident or socket.gethostname().encode()).hexdigest()[:8]


def dir_name(pid: int | None = None) -> str:
    """The name of this server's socket directory (a prefix, under ``/tmp``)."""
    return f"{PREFIX}{os.getpid() if pid is None else pid}-{host_tag()}"


def fresh(parent: str) -> str:
    """A new private directory (0700) for this server's sockets in ``parent``."""
    path = tempfile.mkdtemp(prefix=dir_name() + "-", dir=parent)
    os.chmod(path, 0o700)
    return path


def hold(path: str) -> int:
    """Lock ``path``'s lock file for as long as the returned descriptor stays open. Ours is made
    and locked under a temporary name, then linked into place: nobody sees it unlocked. A lock
    file already there is taken over only if nobody holds it (a killed server's: the same pid
    after a restart in a container); DirectoryHeld if somebody does."""
    staged = os.path.join(path, f"{LOCK_FILE}.{os.getpid()}.{secrets.token_hex(4)}")
    target = os.path.join(path, LOCK_FILE)
    # O_RDWR: over NFS, flock is a POSIX lock, which an exclusive lock needs a writable file for.
    fd = os.open(staged, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        try:
            os.link(staged, target)
        except FileExistsError:
            _take_over(staged, target)
        else:
            os.unlink(staged)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(staged)
        raise
    return fd


def _take_over(staged: str, target: str) -> None:
    """Put our lock file in place of one nobody holds, holding the old one meanwhile (a sweeper
    holds it while it removes the directory: then we are refused)."""
    old = os.open(target, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        try:
            fcntl.flock(old, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise DirectoryHeld(f"{os.path.dirname(target)} is another server's") from None
        os.rename(staged, target)
    finally:
        os.close(old)


def remove_unheld(parent: str) -> list[str]:
    """Remove from ``parent`` the socket directories of this host's servers that are gone (their
    lock held by no one; see the module's docstring). Anything else stays: another user's, a link,
    another host's, a directory without a lock file (an older version's, or one being made), one
    that holds other files (a host's log). Returns the paths removed."""
    removed: list[str] = []
    try:
        entries = list(os.scandir(parent))
    except OSError:
        return removed
    tag = host_tag()
    for entry in entries:
        match = _NAME.fullmatch(entry.name)
        if match is None or match.group(1) != tag:
            continue
        try:
            if _remove_if_unheld(entry):
                removed.append(entry.path)
        except OSError:
            continue  # changed under us, or not ours to remove: leave it
    return removed


def _remove_if_unheld(entry: os.DirEntry) -> bool:
    info = entry.stat(follow_symlinks=False)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
        return False
    dfd = os.open(entry.path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        opened = os.fstat(dfd)  # the directory opened is the one looked at
        if (opened.st_dev, opened.st_ino) != (info.st_dev, info.st_ino):
            return False
        try:
            lock = os.open(LOCK_FILE, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
        except FileNotFoundError:
            return False
        try:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False  # its server lives
            # Holding it, nobody can put another lock file in its place (hold() takes over only
            # an unheld one): the name still is the file locked.
            locked, named = os.fstat(lock), os.stat(LOCK_FILE, dir_fd=dfd, follow_symlinks=False)
            if (locked.st_dev, locked.st_ino) != (named.st_dev, named.st_ino):
                return False
            names = os.listdir(dfd)
            for name in names:
                mode = os.lstat(name, dir_fd=dfd).st_mode
                is_lock = (name == LOCK_FILE or name.startswith(LOCK_FILE + ".")) and stat.S_ISREG(mode)
                if not (is_lock or stat.S_ISSOCK(mode)):
                    return False
            for name in names:
                os.unlink(name, dir_fd=dfd)
            os.rmdir(entry.path)  # refused if a server put something in it meanwhile
            return True
        finally:
            os.close(lock)
    finally:
        os.close(dfd)
