"""The host ledger process: grants GPU capacity to the users' schedulers of one host, and does
nothing else (it starts no run and reads no user's files).

One asyncio loop owns all state; each connection is served by its own task, so a slow or hostile
peer holds nobody else (see protocol.py). Who a peer is comes from the kernel (SO_PEERCRED), never
from what it says. A grant is tied to processes (pid + start time) of its user, checked in /proc;
it ends when released, or when all its processes are gone (checked every sweep), never because a
connection closed: a user's server killed with -9 keeps its runs' grants while the runs live.

Restart: the grants and the tenants (the servers connected) are kept in a state file, written
(and synced to disk) before each answer or event that changes them. A restarted ledger keeps the saved grants whose processes
still live, and grants nothing new until every saved tenant still alive has re-told its grants
(``reclaim``) or the reclaim window has passed: nothing is granted twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import fcntl
import grp
import json
import logging
import os
import re
import resource
import socket
import stat
import struct
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..scheduler.gpus import GpuInfo, GpuProbe, NvmlProbe, VirtualProbe, parse_sizes
from . import procs
from .config import LedgerConfig
from .policy import (
    Ask,
    Decision,
    Holding,
    HostDevice,
    Quota,
    Retold,
    covers,
    decide,
    given_way_to,
    held_mb,
    key_mismatch,
    met_by,
    next_grant,
    quota_names_learnt,
    takes_room,
    why_waiting,
)
from .procs import ProcId
from .protocol import HELLO_DEADLINE_S, MAX_ANSWER_BYTES, ProtocolError, encode, read_frame

log = logging.getLogger("jupyter_evalsched.host_ledger")

SWEEP_S = 0.5
MAX_CONNECTIONS_PER_UID = 64
MAX_WAITING_PER_UID = 256
MAX_GRANTS_PER_UID = 1024
MAX_PIDS = 64
MAX_KEY_CHARS = 200
SEND_DEADLINE_S = 10.0  # a peer that takes none of its answers for this long is dropped
MAX_SEND_BUFFER = 1024 * 1024  # a peer that reads nothing is closed rather than buffered for
KINDS = ("run", "lease", "model")  # model: a shared model's VRAM, held by a user's server
MAX_DEMAND = 16  # asks a tenant may tell as its demand (its queued GPU work)
# The most grants (and, each, waiting requests and demanded asks) one view lists: a grant is at
# most about 3 KB (a 200-character key, 64 processes), so a view stays a few MB, far below the
# MAX_ANSWER_BYTES a client reads, however many users' grants the host holds.
MAX_VIEW_ENTRIES = 1000
TURN_S = 5.0  # how long room kept for a user holding less (its demand) waits for that user to ask
QUOTA_NAMES_S = 60.0  # how often the quotas' names are looked up anew (a user added, a uid renumbered)
# Connections at once, over all users: well below the ledger's file descriptor limit (see
# connection_cap), so that /proc and its state file can always be opened.
MAX_CONNECTIONS = 8192
FD_RESERVE = 64  # descriptors kept for everything but connections (state file, /proc, NVML, logs)
LISTEN_BACKLOG = 128
ACCEPT_BACKOFF_S = 1.0  # after accept() failed (out of descriptors, say): try again this much later


class BadRequest(Exception):
    def __init__(self, code: str, reason: str, **fields: Any) -> None:
        super().__init__(reason)
        self.code, self.reason = code, reason
        self.fields = fields  # more for the error answer (key_in_use: the grant held under the key)


@dataclass(eq=False)
class Conn:
    uid: int
    pid: int
    user: str
    proc: ProcId | None
    admin: bool
    writer: asyncio.StreamWriter
    tenant: bool = False  # requested or re-told grants: a restarted ledger waits for it
    closed: bool = False
    # Fair share between servers that ask without waiting: the GPU work this tenant has queued
    # (op ``demand``), and, when one of its own asks was deferred to another user's demand, until
    # when (then it is told ``retry`` and that demand is set aside; the user's demand holds nobody
    # back until it asks again).
    demand: list[Ask] = field(default_factory=list)
    # (until when, the tenant deferred to, the demanded ask it was deferred for): a waiting
    # request of its own held back for another user's turn is deferred too (see _schedule)
    deferred_for: list[tuple[float, Conn, Ask]] = field(default_factory=list)
    # An ask of its own was refused (busy) for another user's turn: told ``retry`` once its
    # deferrals are over. A request held back while it waits is granted then, and told nothing.
    owes_retry: bool = False

    largest: int = 0  # the largest frame sent to it (a busy host's view may be a few MB)
    # A reclaim told in batches (``more``), one reclaim: the ids told and how many, so far.
    reclaim_seen: set[str] = field(default_factory=set)
    reclaim_told: int = 0

    def send(self, message: dict[str, Any]) -> None:
        if self.closed:
            return
        frame = encode(message, MAX_ANSWER_BYTES)
        self.largest = max(self.largest, len(frame))
        self.writer.write(frame)
        # Unread past MAX_SEND_BUFFER besides one whole answer, which alone may be more than the
        # socket takes at once: a peer that reads it is never mistaken for one that reads nothing.
        if self.writer.transport.get_write_buffer_size() > MAX_SEND_BUFFER + self.largest:
            log.warning("closing the connection of %s (pid %s): it reads no answers", self.user, self.pid)
            self.close()

    def close(self) -> None:
        # Aborted, not closed: a close waits to flush what a client that reads nothing never
        # takes, and its handler would stay blocked in drain() holding one of its user's slots.
        self.closed = True
        self.writer.transport.abort()


@dataclass(eq=False)
class Grant:
    id: str
    uid: int
    user: str
    key: str
    kind: str
    devices: tuple[int, ...]
    vram_mb: int
    exclusive: bool
    procs: list[ProcId]
    conn: Conn | None = None

    def holding(self) -> Holding:
        return Holding(self.user, self.devices, self.vram_mb, self.exclusive, self.kind)

    def as_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "user": self.user,
            "key": self.key,
            "kind": self.kind,
            "devices": list(self.devices),
            "vram_mb": self.vram_mb,
            "exclusive": self.exclusive,
            "pids": [p.as_json() for p in self.procs],
        }


@dataclass(eq=False)
class Waiter:
    conn: Conn
    request: Any  # the request's id, which the granted event repeats
    key: str
    ask: Ask
    procs: list[ProcId]
    replied: bool = False
    reason: str = ""
    grant: Grant | None = None
    made: int = 0  # its grant's place on the count of grants made (the turns' rotation)
    gave_way: bool = False  # it fits now but waits for another user's turn (see _schedule)


@dataclass
class View:
    """The probe's latest reading."""

    gpus: list[GpuInfo] = field(default_factory=list)
    unmanaged: dict[int, list[dict[str, Any]]] = field(default_factory=dict)  # device -> processes


def make_probe(config: LedgerConfig) -> GpuProbe:
    sizes = list(config.virtual_gpus) or parse_sizes(os.environ.get("EVALSCHED_VIRTUAL_GPUS", ""))
    if sizes:
        table = config.virtual_gpu_processes or os.environ.get("EVALSCHED_VIRTUAL_GPU_PROCESSES") or None
        return VirtualProbe(sizes, processes_file=table)
    return NvmlProbe()


def peer_credentials(sock: socket.socket) -> tuple[int, int]:
    """``(pid, uid)`` of the peer, from the kernel."""
    pid, uid, _gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    return pid, uid


def _error(request: Any, code: str, reason: str) -> dict[str, Any]:
    return {"id": request, "ok": False, "error": code, "reason": reason}


def connection_cap(open_files: int) -> int:
    """How many connections the ledger serves at once under a file descriptor limit of
    ``open_files`` (each takes one): half of it at most, and FD_RESERVE left, so that running out
    of descriptors is a clear refusal of one more connection, never a /proc it cannot read."""
    if open_files < 0:  # RLIM_INFINITY
        return MAX_CONNECTIONS
    return max(1, min(MAX_CONNECTIONS, open_files // 2, open_files - FD_RESERVE))


def open_files_target(soft: int, hard: int) -> int:
    """The soft RLIMIT_NOFILE to run with: the hard limit (a service's soft one is often 1024,
    which a few dozen users' servers use up), or the soft one when that is already higher."""
    if hard == resource.RLIM_INFINITY:
        return soft if soft == resource.RLIM_INFINITY else max(soft, 1 << 20)
    return hard if soft != resource.RLIM_INFINITY and soft < hard else soft


def raise_open_files_limit() -> int:
    """Raise the process's soft RLIMIT_NOFILE toward its hard limit; the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = open_files_target(soft, hard)
    if want != soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        except (ValueError, OSError) as exc:  # (above fs.nr_open): keep what there is
            log.warning("cannot raise the open files limit from %s to %s: %s", soft, want, exc)
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def _int(message: dict[str, Any], key: str, default: int | None = None, low: int = 0) -> int:
    value = message.get(key, default)
    if type(value) is not int or value < low:
        raise BadRequest("bad_request", f"{key} must be a whole number >= {low}")
    return value


def private_path(what: str, path: str) -> str:
    """``path`` with its directory resolved (links and ``..`` taken out: what the ledger uses from
    then on), once that directory is one no other user may change. Refused (RuntimeError)
    otherwise: another user who could write there could put their own socket in the ledger's place
    (and answer the servers as the ledger), replace its state (and be granted what they want at
    the next start), or swap the socket for a link between its bind and its chmod.

    From ``/`` down, every directory must belong to the ledger's user or root; the last one must
    be writable by its owner only (e.g. ``/run/evalsched``, systemd's ``RuntimeDirectory=``), and
    one above it may be writable by others only with the sticky bit (``/tmp``: then nobody else may
    rename what is in it)."""
    try:
        directory = os.path.realpath(os.path.dirname(path) or os.curdir, strict=True)  # (.. after links)
    except OSError as exc:
        raise RuntimeError(f"the {what} {path}: its directory cannot be used: {exc}") from None
    me = os.geteuid()
    parts = [p for p in directory.split(os.sep) if p]
    for depth in range(len(parts) + 1):
        here = os.sep + os.sep.join(parts[:depth])
        found = os.stat(here)
        last = depth == len(parts)
        if found.st_uid not in (me, 0):
            raise RuntimeError(
                f"the {what} {path}: {here} belongs to uid {found.st_uid}, neither the ledger's user ({me}) "
                "nor root, who could replace what the ledger keeps there: refusing it; keep it in a directory "
                "of the ledger's user, e.g. /run/evalsched"
            )
        if found.st_mode & 0o022 and (last or not found.st_mode & stat.S_ISVTX):
            who = "every user" if found.st_mode & 0o002 else "its group"
            raise RuntimeError(
                f"the {what} {path}: {here} may be written by {who} (mode {stat.S_IMODE(found.st_mode):04o}): "
                "refusing it; keep it in a directory only the ledger's user can write, e.g. /run/evalsched"
            )
    return os.path.join(directory, os.path.basename(path))


def _fsync_directory(directory: str) -> None:
    """Make a rename in ``directory`` durable (OSError when it cannot be). A file system that
    cannot sync a directory at all (EINVAL: some FUSE and network ones) has nothing to make
    durable this way: that is no failure to save."""
    fd = os.open(directory or os.curdir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
    finally:
        os.close(fd)


def _whole(value: Any, low: int | None = None) -> int:
    """A whole number from the state file, at least ``low`` if given (ValueError otherwise:
    true is no pid, and -20000 MB no grant)."""
    if type(value) is not int or (low is not None and value < low):
        raise ValueError(f"{value!r} is not a whole number" + ("" if low is None else f" >= {low}"))
    return value


def _saved_grant(item: Any) -> Grant:
    """A grant as the state file keeps it (KeyError, TypeError or ValueError when it is not one)."""
    if not isinstance(item, dict) or not isinstance(item["pids"], list) or not isinstance(item["devices"], list):
        raise TypeError("not a saved grant")
    if item["kind"] not in KINDS or not isinstance(item["exclusive"], bool):
        raise ValueError("not a saved grant")
    return Grant(
        str(item["id"]),
        _whole(item["uid"]),
        "",  # (its user's name: once it is kept)
        str(item["key"]),
        item["kind"],
        tuple(_whole(i, 0) for i in item["devices"]),
        _whole(item["vram_mb"], 0),
        item["exclusive"],
        [ProcId(_whole(p["pid"]), _whole(p["start"])) for p in item["pids"]],
    )


def _uids_named(names: Iterable[str], lookup: Callable[[str], int | None]) -> dict[str, int | None]:
    """Each name's uid as ``lookup`` tells it (None: it failed, whyever). Blocking: run off the loop."""
    found: dict[str, int | None] = {}
    for name in names:
        try:
            found[name] = lookup(name)
        except Exception:  # (a directory service's failure is a failed lookup, not the ledger's end)
            found[name] = None
    return found


def _still_theirs(proc: ProcId, uid: int) -> bool:
    """Whether a saved process still runs as ``uid``. One /proc cannot tell of now is kept: each
    sweep checks it again, and a grant dropped here would be granted twice."""
    try:
        return procs.alive(proc) and procs.uid_of(proc.pid) == uid
    except procs.Unreadable:
        return True


class HostLedger:
    def __init__(self, config: LedgerConfig, socket_path: str, probe: GpuProbe | None = None) -> None:
        self.config = config
        self.socket_path = socket_path
        self.state_file = config.state_file or f"{socket_path}.state.json"
        self.probe = probe or make_probe(config)
        self.grants: dict[str, Grant] = {}
        self.waiting: list[Waiter] = []
        self.conns: set[Conn] = set()
        self.view = View()
        self.pending_tenants: set[tuple[int, ProcId]] = set()  # saved tenants yet to re-tell
        # Users who let a turn pass, and the room they let pass: their told demand holds nobody
        # back until they are granted that much (else re-telling it each time it is set aside, or
        # taking a 0 MB grant now and then, would hold the others back for ever).
        self.forfeited: dict[int, Ask] = {}
        # The turns rotate (policy.turned_since): when each user (by name, as the policy counts
        # them) was last granted, and last took a turn, on one count of the grants made.
        self._grants_made = 0
        self._last_granted: dict[str, int] = {}
        self._last_turn: dict[str, int] = {}
        # Each uid's name and quota (see _name_of, _quota_of): the policy counts users by name.
        self._name_by_uid: dict[int, str] = {}
        self._uid_by_name: dict[str, int] = {}
        self._quota_names: dict[int, frozenset[str]] = {}  # the quotas' names each uid is known by
        self._quotas: dict[int, Quota] = {}  # each uid's quota, as last worked out (see _learn_quota_names)
        self._admins: dict[int, tuple[float, bool]] = {}  # uid -> (when looked up, in the admin group)
        self.uid_named: Callable[[str], int | None] = procs.uid_named  # the directory, by name (blocking)
        self._quota_namer: asyncio.Task[None] | None = None
        self.reclaim_until = 0.0
        self._state_read = False  # a state file was read: the saved tenants are all to wait for
        self._unsaved = False  # a change (a grant ended) is not in the state file yet: the sweep saves it
        self._troubles: dict[str, str] = {}  # what keeps going wrong (logged once until it is over)
        self.max_connections = MAX_CONNECTIONS
        self._lock_fd: int | None = None
        self._listener: socket.socket | None = None
        self._acceptor: asyncio.Task[None] | None = None
        self.failed: BaseException | None = None  # why the ledger cannot go on (its accept loop ended)
        self.ended = asyncio.Event()  # set when it cannot go on: serve() then stops it
        self._sweeper: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    # ------------------------------------------------------------------ life

    async def start(self) -> None:
        self.view.gpus = await asyncio.to_thread(self.probe.devices)
        self.socket_path = private_path("socket", self.socket_path)
        self.state_file = private_path("state file", self.state_file)
        gid = self._socket_gid()  # (before anything is made: a group that is not there stops the start)
        self._lock()  # (first: a live ledger's socket and staged state are not ours to remove)
        try:
            self._claim_socket_path()
            self._remove_staged_states()
            self._load_state()
            await self._learn_quota_names()  # (before any connection: none is served the default by mistake)
            self._listener = self._listen(gid)
            await self._refresh()
        except BaseException:
            await self.stop()
            raise
        self.max_connections = connection_cap(resource.getrlimit(resource.RLIMIT_NOFILE)[0])
        self._acceptor = asyncio.create_task(self._accept_forever(self._listener))
        self._acceptor.add_done_callback(self._acceptor_ended)
        self._sweeper = asyncio.create_task(self._sweep_forever())
        self._quota_namer = asyncio.create_task(self._learn_quota_names_forever())
        log.info(
            "host ledger on %s: %d GPU(s), %d grant(s) kept from before, reclaim %s, at most %d connections",
            self.socket_path,
            len(self.view.gpus),
            len(self.grants),
            "open" if self.reclaim_open() else "closed",
            self.max_connections,
        )

    async def stop(self) -> None:
        # All at once, then waited for: nothing is answered once the stop has begun.
        running = [t for t in (self._sweeper, self._acceptor, self._quota_namer) if t is not None]
        for task in running:
            task.cancel()
        if self._listener is not None:
            self._listener.close()
        for conn in list(self.conns):
            conn.close()
        if running:
            await asyncio.wait(running)
        if self._tasks:  # closed connections end their tasks (cancelling them makes asyncio log noise)
            await asyncio.wait(list(self._tasks), timeout=2.0)
        if self._listener is not None:  # (the socket is this ledger's only once it listened on it)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.socket_path)
        self._unlock()

    def _lock(self) -> None:
        """Hold the lock beside the state file for the ledger's life (the kernel lets go of it when
        the process ends, however it ends): one ledger per state file, and only the one holding
        it may remove a stale socket. A second ledger is refused, whatever its socket does."""
        path = f"{self.state_file}.lock"
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise RuntimeError(f"the lock file {path} cannot be opened: {exc.strerror or exc}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 16, 0).decode("ascii", "replace").strip()
            os.close(fd)
            who = f" (pid {holder})" if holder.isdigit() else ""
            raise RuntimeError(
                f"another host ledger{who} holds {path}: it keeps the state {self.state_file}; "
                "refusing to start a second one"
            ) from None
        except BaseException:
            os.close(fd)
            raise
        try:
            # Best effort (for the message above, in the next one): a full disk must not stop
            # the start, and the lock is held whatever the file says.
            with contextlib.suppress(OSError):
                os.ftruncate(fd, 0)
                os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except BaseException:  # (the fd is never leaked: a leaked one would hold the lock)
            os.close(fd)
            raise
        self._lock_fd = fd

    def _unlock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # (the file stays: removing it would let two hold two files)
            self._lock_fd = None

    def _socket_gid(self) -> int | None:
        name = self.config.socket_group
        if not name:
            return None
        try:
            return grp.getgrnam(name).gr_gid
        except KeyError:
            raise RuntimeError(f"socket_group: no group {name!r} on this host") from None

    def _claim_socket_path(self) -> None:
        """Remove a stale socket (nobody listens on it: the connection is refused), holding the
        lock; refuse when a ledger may answer on it (it answers, or it does not in time: a busy
        one's backlog is full), or when what is there is not a socket (nothing of the ledger's:
        not removed)."""
        try:
            found = os.lstat(self.socket_path)
        except FileNotFoundError:
            return
        if not stat.S_ISSOCK(found.st_mode):
            raise RuntimeError(f"{self.socket_path} exists and is not a socket: refusing to replace it")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.settimeout(1.0)
            probe.connect(self.socket_path)
        except ConnectionRefusedError:
            os.unlink(self.socket_path)  # nobody listens: a killed ledger's
            return
        except OSError as exc:
            raise RuntimeError(
                f"{self.socket_path}: a host ledger may serve it (connecting to it failed: {exc}): refusing to replace it"
            ) from None
        finally:
            probe.close()
        raise RuntimeError(f"another host ledger serves {self.socket_path}")

    def _listen(self, gid: int | None) -> socket.socket:
        """The listening socket, with its group and mode; removed again when they cannot be set."""
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            listener.bind(self.socket_path)
            try:
                if gid is not None:
                    os.chown(self.socket_path, -1, gid)
                os.chmod(self.socket_path, self.config.socket_mode)
                listener.listen(LISTEN_BACKLOG)
                listener.setblocking(False)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(self.socket_path)
                raise
        except BaseException:
            listener.close()
            raise
        return listener

    async def _accept_forever(self, listener: socket.socket) -> None:
        """Accept connections, each served by its own task. Past ``max_connections`` one more is
        refused at once (answered why, then closed); when accept() itself fails (out of file
        descriptors, say), it is tried again ACCEPT_BACKOFF_S later, said once in the log."""
        loop = asyncio.get_running_loop()
        while True:
            try:
                sock, _ = await loop.sock_accept(listener)
            except OSError as exc:
                self._trouble("accept", f"cannot accept connections ({exc}): trying again every {ACCEPT_BACKOFF_S:g} s")
                await asyncio.sleep(ACCEPT_BACKOFF_S)
                continue
            self._trouble_over("accept")
            if len(self._tasks) >= self.max_connections:
                self._trouble("connections", f"serving {len(self._tasks)} connections, the most it may: refusing more")
                refusal = _error(
                    None,
                    "too_many_connections",
                    f"the host ledger serves at most {self.max_connections} connections at once: try again later",
                )
                with contextlib.suppress(OSError):
                    sock.send(encode(refusal))  # (a new socket's buffer is empty: it all goes)
                sock.close()
                continue
            if len(self._tasks) < self.max_connections // 2:  # (well below: no line per connection at the cap)
                self._trouble_over("connections")
            task = asyncio.create_task(self._serve_socket(sock))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def _acceptor_ended(self, task: asyncio.Task[None]) -> None:
        """The accept loop never ends but by stop(): if it ever does (a bug), say so and stop the
        ledger (its unit restarts it) rather than hold grants while accepting nobody."""
        if task.cancelled():
            return
        exc = task.exception()
        log.critical("host ledger: the accept loop ended (%r): stopping the ledger", exc, exc_info=exc)
        self.failed = exc or RuntimeError("the accept loop ended")
        self.ended.set()  # (serve() stops it)

    async def _serve_socket(self, sock: socket.socket) -> None:
        try:
            reader, writer = await asyncio.open_unix_connection(sock=sock, limit=1 << 17)
        except OSError:
            sock.close()
            return
        await self._serve(reader, writer)

    def _trouble(self, what: str, message: str) -> None:
        """Log ``message`` once while the same trouble goes on (no flood of the same line)."""
        if self._troubles.get(what) != message:
            self._troubles[what] = message
            log.error("host ledger: %s", message)

    def _trouble_over(self, what: str) -> None:
        if self._troubles.pop(what, None) is not None:
            log.info("host ledger: %s: over", what)

    # ------------------------------------------------------------------ state file

    def _load_state(self) -> None:
        try:
            with open(self.state_file, encoding="utf-8") as f:
                saved = json.load(f)
        except FileNotFoundError:
            # A first start (or the first since a reboot emptied /run): no tenant holds a grant.
            return
        except (OSError, ValueError) as exc:
            self._state_unusable(str(exc))
            return
        if not isinstance(saved, dict) or not all(isinstance(saved.get(k, []), list) for k in ("tenants", "grants")):
            self._state_unusable('not {"tenants": [...], "grants": [...]}')
            return
        tenants, grants, bad = [], [], 0
        for item in saved.get("tenants", []):
            try:
                tenants.append((_whole(item["uid"]), ProcId(_whole(item["pid"]), _whole(item["start"]))))
            except (KeyError, TypeError, ValueError):
                bad += 1
        for item in saved.get("grants", []):
            try:
                grants.append(_saved_grant(item))
            except (KeyError, TypeError, ValueError):
                bad += 1
        if bad:
            # A grant it cannot read is one it does not know: learnt again from the tenants.
            self._state_unusable(f"{bad} entr{'y' if bad == 1 else 'ies'} it cannot read")
        else:
            self._state_read = True
        for uid, proc in tenants:
            if _still_theirs(proc, uid):
                self.pending_tenants.add((uid, proc))
        for grant in grants:
            grant.procs = [p for p in grant.procs if _still_theirs(p, grant.uid)]
            if grant.procs:
                grant.user = self._name_of(grant.uid)
                self.grants[grant.id] = grant
        if self.pending_tenants:
            self.reclaim_until = time.monotonic() + self.config.reclaim_window_s

    def _state_unusable(self, why: str) -> None:
        log.warning("state file %s unreadable (%s): waiting the reclaim window", self.state_file, why)
        self.reclaim_until = time.monotonic() + self.config.reclaim_window_s

    def _remove_staged_states(self) -> None:
        """The staged states a ledger killed while it saved left behind (_save_state's names)."""
        directory, name = os.path.split(self.state_file)
        staged = re.compile(re.escape(name) + r"\.\d+\.[0-9a-f]{8}\.tmp")
        with contextlib.suppress(OSError), os.scandir(directory) as entries:
            for entry in entries:
                if staged.fullmatch(entry.name) and entry.is_file(follow_symlinks=False):
                    with contextlib.suppress(OSError):
                        os.unlink(entry.path)

    def _save_state(self, grants: Iterable[Grant] | None = None) -> None:
        """Write the state: the grants held (or ``grants``, what they are about to be: a change
        is saved before it is made) and the tenants. Raises what the write met."""
        tenants = {(c.uid, c.proc) for c in self.conns if c.tenant and c.proc is not None}
        tenants |= self.pending_tenants
        state = {
            "tenants": [{"uid": uid, **proc.as_json()} for uid, proc in sorted(tenants, key=str)],
            "grants": [{**g.as_json(), "uid": g.uid} for g in (self.grants.values() if grants is None else grants)],
        }
        # A new file each time, never one found there (a link would be followed).
        tmp = f"{self.state_file}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(json.dumps(state))  # dumps: the C encoder (dump to a file is pure Python)
                f.flush()
                # On disk before the rename: else a power loss may leave the new name on an empty
                # file (the metadata journalled, the data not), and the grants forgotten.
                os.fsync(f.fileno())
            os.replace(tmp, self.state_file)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        try:
            _fsync_directory(os.path.dirname(self.state_file))  # the rename itself, on disk
        except BaseException:
            # The file has the new state, which may not outlast a power loss: the caller makes
            # no change it was for, and the sweep writes what is held again (_unsaved).
            self._unsaved = True
            raise
        self._unsaved = False
        self._trouble_over("save")

    def _save_failed(self, exc: BaseException) -> str:
        """Why the state could not be saved, the same each time the same thing goes wrong: the
        error's errno and text and the state file's own path, never the staged file's (a new
        random name each time, which would make each try a new trouble and a new reason)."""
        if isinstance(exc, OSError):
            name = errno.errorcode.get(exc.errno, str(exc.errno)) if exc.errno is not None else "OSError"
            return f"{exc.strerror or type(exc).__name__} ({name})"
        return type(exc).__name__

    def _trouble_saving(self, exc: BaseException) -> str:
        """Say (once while it goes on) that the state cannot be saved; the reason, for answers."""
        why = self._save_failed(exc)
        self._trouble("save", f"cannot save the state file {self.state_file}: {why}")
        return why

    def _commit(self, grants: Iterable[Grant], unchanged: str) -> None:
        """Save the state with ``grants`` before a change to them is made; when it cannot be
        saved, the change is not made, and the caller is told so (``unchanged``: what holds)."""
        try:
            self._save_state(grants)
        except Exception as exc:
            why = self._trouble_saving(exc)
            raise BadRequest("internal", f"the host ledger cannot save its state ({why}): {unchanged}") from None

    def reclaim_open(self) -> bool:
        """Whether new grants still wait for the tenants to re-tell theirs."""
        if not self.reclaim_until:
            return False
        if time.monotonic() >= self.reclaim_until or (self._state_read and not self.pending_tenants):
            self.reclaim_until = 0.0
            return False
        return True

    # ------------------------------------------------------------------ devices and holdings

    def devices(self) -> dict[int, HostDevice]:
        return {
            g.index: HostDevice(
                g.index,
                self.config.usable(g.index, g.total_mb),
                sum(p["used_mb"] for p in self.view.unmanaged.get(g.index, [])),
            )
            for g in self.view.gpus
        }

    def holdings(self) -> list[Holding]:
        return [g.holding() for g in self.grants.values()]

    async def _refresh(self) -> None:
        """Read the probe's processes: those below no grant are unmanaged, named by user."""
        found = await asyncio.to_thread(self.probe.processes)
        by_pid: dict[int, list[Grant]] = {}
        for g in self.grants.values():
            for p in g.procs:
                by_pid.setdefault(p.pid, []).append(g)
        unmanaged: dict[int, list[dict[str, Any]]] = {}
        # A grant's processes may use up to its grant on its devices; what they use beyond it (or
        # on a device it does not hold) counts as unmanaged, under their user's name: a grant of
        # 1 MB is no cover for 20 GB that the other users would not see. The processes below one
        # pid share the grants tied to it (a server's leases are all tied to the server).
        used: dict[tuple[tuple[str, ...], int], tuple[list[Grant], int, int]] = {}  # -> (grants, MB, a pid)
        for proc in found:
            tied = next((by_pid[a] for a in procs.ancestors(proc.pid) if a in by_pid), None)
            if tied is not None:
                key = (tuple(sorted(g.id for g in tied)), proc.device)
                _, mb, pid = used.get(key, (tied, 0, proc.pid))
                used[key] = (tied, mb + proc.used_mb, pid)
                continue
            uid = procs.uid_of(proc.pid)
            unmanaged.setdefault(proc.device, []).append(
                {
                    "pid": proc.pid,
                    "gpu": proc.device,
                    "used_mb": proc.used_mb,
                    "user": self._name_of(uid) if uid is not None else None,
                    "uid": uid,
                }
            )
        for (_, device), (tied, mb, pid) in used.items():
            allowed = sum(
                self.config.usable(device, self._total(device)) if g.exclusive else g.vram_mb
                for g in tied
                if device in g.devices
            )
            if mb > allowed:
                unmanaged.setdefault(device, []).append(
                    {"pid": pid, "gpu": device, "used_mb": mb - allowed, "user": tied[0].user, "uid": tied[0].uid}
                )
        self.view.unmanaged = unmanaged

    def _total(self, device: int) -> int:
        return next((g.total_mb for g in self.view.gpus if g.index == device), 0)

    async def _sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(SWEEP_S)
            try:
                await self._sweep()
                self._trouble_over("sweep")
            except Exception as exc:  # the sweep must go on whatever one pass met
                if "sweep" not in self._troubles:
                    log.exception("host ledger sweep failed")
                self._trouble("sweep", f"the sweep failed: {exc!r}")

    async def _sweep(self) -> None:
        # A saved tenant that died meanwhile will re-tell nothing: stop waiting for it.
        self.pending_tenants = {t for t in self.pending_tenants if procs.any_alive([t[1]]) is not False}
        # Only a grant whose processes are all known to be gone ends: one /proc could not tell of
        # (out of descriptors, say) is kept until a sweep can.
        lives: dict[str, bool | None] = {}
        for g in self.grants.values():
            lives[g.id], g.procs = procs.first_alive(g.procs)
        ended = [g for g in self.grants.values() if lives[g.id] is False]
        unknown = sum(1 for live in lives.values() if live is None)
        if unknown:
            self._trouble("proc", f"cannot read /proc: {unknown} grant(s) kept until their processes can be checked")
        else:
            self._trouble_over("proc")
        for grant in ended:
            self._end(grant, "its processes are gone")
        if ended:
            self._unsaved = True
        self._expire_turns()
        try:
            await self._refresh()
            self._trouble_over("refresh")
        except procs.Unreadable as exc:  # the last reading stands until /proc can be read
            self._trouble("refresh", f"cannot read /proc ({exc}): the GPUs' processes as last read")
        self._schedule()
        if self._unsaved:
            # (until then the file still has what ended: the safe side, as a restarted ledger
            # drops a grant whose processes are gone)
            try:
                self._save_state()
            except Exception as exc:
                self._trouble_saving(exc)

    def _end(self, grant: Grant, why: str) -> None:
        self.grants.pop(grant.id, None)
        log.info("grant %s of %s ended: %s", grant.id, grant.user, why)
        if grant.conn is not None:
            grant.conn.send({"event": "ended", "grant": grant.id, "reason": why})

    # ------------------------------------------------------------------ granting

    def _schedule(self) -> None:
        """Grant the waiting requests that fit, fairest first (see policy.next_grant)."""
        if self.reclaim_open():
            why = self._reclaim_reason()
            for w in self.waiting:
                self._tell_waiting(w, why)
            return
        before = list(self.waiting)
        granted: list[Waiter] = []
        # The rotation's counts as these grants make them: kept once they are saved.
        made, last_granted, last_turn = self._grants_made, dict(self._last_granted), dict(self._last_turn)
        # The others' told demand: a grant that takes its room is a turn, as one that takes a
        # waiting request's, and a request that would take it from a user whose turn it is waits
        # (the same as _turn_of_another weighs: policy.gives_way).
        tellers = self._demand_tellers()
        demand = [a for c in tellers for a in c.demand]
        while self.waiting:
            devices = self.devices()
            pick = next_grant(
                [w.ask for w in self.waiting],
                devices,
                self.holdings(),
                {c.user: self._quota_of(c.uid) for c in [*tellers, *(w.conn for w in self.waiting)]},
                last_turn,
                last_granted,
                demand,
            )
            if pick is None:
                break
            waiter = self.waiting.pop(pick.position)
            self._grant(waiter, pick.decision)
            made += 1
            waiter.made = last_granted[waiter.ask.user] = made
            if pick.turn:
                last_turn[waiter.ask.user] = made
            granted.append(waiter)
        if granted:
            try:
                self._save_state()  # before anyone is told: a restarted ledger knows what it told
            except Exception as exc:
                # Not saved, so not granted: undone, and they wait on, told why; each sweep
                # tries again.
                for waiter in granted:
                    assert waiter.grant is not None
                    self.grants.pop(waiter.grant.id, None)
                    waiter.grant = None
                self.waiting = before
                why = f"the host ledger cannot save its state ({self._trouble_saving(exc)}): nothing is granted until it can"
                for w in self.waiting:
                    self._tell_waiting(w, why)
                return
            self._grants_made, self._last_granted, self._last_turn = made, last_granted, last_turn
        for waiter in granted:
            try:  # each is told, whatever telling another met
                self._told_granted(waiter)
            except Exception:
                log.exception("host ledger: telling %s of grant %s failed", waiter.conn.user, waiter.key)
        # What is left cannot be granted now: each is told why (a quota, or who holds the GPUs),
        # or, fitting now, gives way to another user's turn: that user is told, as for an ask
        # that does not wait, and the request is granted once the turn is taken or has expired.
        devices, holdings = self.devices(), self.holdings()
        reasons = why_waiting([w.ask for w in self.waiting], devices, holdings, [self._quota(w) for w in self.waiting])
        fitting = [w for w, why in zip(self.waiting, reasons, strict=True) if not why]
        held_for = dict(zip(fitting, self._given_way_to([(w.conn, w.ask) for w in fitting]), strict=True))
        for w, why in zip(self.waiting, reasons, strict=True):
            w.gave_way = False
            if not why:  # it fits now: next_grant held it back for another user's turn
                turn = held_for[w]
                if turn is None:  # (the grants told above changed the turns: the next sweep's pass)
                    continue
                why, w.gave_way = self._give_way(w.conn, *turn, devices, holdings), True
            self._tell_waiting(w, why)

    def _reclaim_reason(self) -> str:
        left = max(0.0, self.reclaim_until - time.monotonic())
        return f"the host ledger restarted: waiting up to {left:.0f} s for the users' servers to re-tell their grants"

    def _tell_waiting(self, w: Waiter, reason: str) -> None:
        if reason == w.reason:
            return
        w.reason = reason
        if w.replied:
            w.conn.send({"event": "waiting", "request": w.request, "key": w.key, "reason": reason})

    def _quota(self, w: Waiter) -> Quota:
        return self._quota_of(w.conn.uid)

    def _name_of(self, uid: int) -> str:
        """``uid``'s user name for this ledger's life. The policy counts what a user holds (their
        quota, their fair share) by name and the kernel tells uids: looked up once, all a uid holds
        is one user's however the host's names change meanwhile (renamed, a lookup the directory
        service failed: each new name would be a new user, with a quota of its own), and a name
        taken over by another uid is told apart by its uid (else one charged with the other's)."""
        name = self._name_by_uid.get(uid)
        if name is None:
            name = procs.user_name(uid)
            if name in self._uid_by_name:
                name = f"{name} (uid {uid})"
            self._name_by_uid[uid], self._uid_by_name[name] = name, uid
        return name

    async def _learn_quota_names(self) -> None:
        """Look up the uid of each name a quota is set under, off the loop (a directory service
        may take seconds, and the loop serves everyone). A quota holds for each uid its name was
        ever found to have: a lookup that fails (the directory down, the user renamed) loses no
        quota (see policy.quota_names_learnt), and a connection costs no lookup."""
        if not self.config.quotas:
            return
        found = await asyncio.to_thread(_uids_named, sorted(self.config.quotas), self.uid_named)
        learnt = quota_names_learnt(self._quota_names, found)
        if learnt != self._quota_names:
            self._quota_names = learnt
            self._quotas.clear()  # (worked out anew as asked: a uid's names only grow)
            self._schedule()  # a quota changed: what waits may now be granted

    async def _learn_quota_names_forever(self) -> None:
        while True:
            await asyncio.sleep(QUOTA_NAMES_S)
            try:
                await self._learn_quota_names()
                self._trouble_over("quota names")
            except Exception as exc:  # the quotas learnt stand; the next pass tries again
                self._trouble("quota names", f"looking up the quotas' names failed: {exc!r}")

    def _quota_of(self, uid: int) -> Quota:
        """``uid``'s quota: of each limit, the strictest set under a name it is known by (its
        name to this ledger, or a quota's name the directory gave it). No lookup by name: dicts,
        and the uid's own name, looked up once for the ledger's life (see _name_of)."""
        quota = self._quotas.get(uid)
        if quota is None:
            names = self._quota_names.get(uid, frozenset()) | {self._name_of(uid)}
            quota = self._quotas[uid] = self.config.quota_of(names)
        return quota

    def _grant(self, w: Waiter, decision: Decision) -> None:
        grant = Grant(
            uuid.uuid4().hex[:16],
            w.conn.uid,
            w.conn.user,
            w.key,
            w.ask.kind,
            decision.devices,
            w.ask.vram_mb,
            w.ask.exclusive,
            w.procs,
            w.conn,
        )
        self.grants[grant.id] = grant
        w.grant = grant

    def _told_granted(self, w: Waiter) -> None:
        grant = w.grant
        assert grant is not None
        log.info(
            "granted %s to %s (%s): %s MB on GPU %s", grant.id, grant.user, grant.key, grant.vram_mb, grant.devices
        )
        if w.replied:
            w.conn.send({"event": "granted", "request": w.request, "key": w.key, "grant": grant.as_json()})
        self._demand_met(w.conn, grant)
        self._turn_taken(w.conn, grant, w.made)

    # ------------------------------------------------------------------ connections

    async def _is_admin(self, uid: int) -> bool:
        """Whether ``uid`` is root or in the admin group: looked up off the loop (a group's members
        may come from a directory service: LDAP, SSSD), at most once a QUOTA_NAMES_S per uid, since
        any user may connect again and again."""
        if uid == 0 or not self.config.admin_group:
            return uid == 0
        now = time.monotonic()
        known = self._admins.get(uid)
        if known is None or now - known[0] >= QUOTA_NAMES_S:
            known = (now, await asyncio.to_thread(procs.in_group, uid, self.config.admin_group))
            self._admins[uid] = known
        return known[1]

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn: Conn | None = None
        try:
            pid, uid = peer_credentials(writer.get_extra_info("socket"))
            if sum(1 for c in self.conns if c.uid == uid) >= MAX_CONNECTIONS_PER_UID:
                writer.write(
                    encode(_error(None, "too_many_connections", f"at most {MAX_CONNECTIONS_PER_UID} per user"))
                )
                return
            try:
                peer = procs.owned(pid, uid)  # the peer's process, checked to be the peer's user's still
            except procs.Unreadable as exc:
                writer.write(
                    encode(_error(None, "internal", f"the host ledger cannot read /proc now ({exc}): connect again"))
                )
                return
            conn = Conn(uid, pid, self._name_of(uid), peer, await self._is_admin(uid), writer)
            self.conns.add(conn)
            first = True
            while not conn.closed:
                message = await read_frame(reader, HELLO_DEADLINE_S if first else None)
                if first and message.get("op") != "hello":
                    conn.send(_error(message.get("id"), "hello_first", "the first message must be hello"))
                    return
                first = False
                answer = self._answer(conn, message)
                try:
                    conn.send(answer)
                except ProtocolError as exc:  # over MAX_ANSWER_BYTES (a bug: answers are bounded)
                    log.error("host ledger: the answer to %r of user %s: %s", message.get("op"), conn.user, exc)
                    conn.send(_error(message.get("id"), "internal", f"the host ledger could not answer: {exc}"))
                try:  # its answers taken, or the connection goes: it must not hold a slot for ever
                    await asyncio.wait_for(writer.drain(), SEND_DEADLINE_S)
                except TimeoutError:
                    log.warning("closing the connection of %s (pid %s): it takes no answers", conn.user, conn.pid)
                    conn.close()
        except (ProtocolError, ConnectionError, OSError) as exc:
            log.debug("connection closed: %s", exc)
        finally:
            if conn is not None:
                self._gone(conn)
            with contextlib.suppress(Exception):
                writer.close()

    def _gone(self, conn: Conn) -> None:
        conn.closed = True
        self.conns.discard(conn)
        self.waiting = [w for w in self.waiting if w.conn is not conn]
        for grant in self.grants.values():
            if grant.conn is conn:
                grant.conn = None  # it lives on while its processes do
        self._schedule()

    def _answer(self, conn: Conn, message: dict[str, Any]) -> dict[str, Any]:
        request = message.get("id")
        op = message.get("op")
        try:
            for claim in ("uid", "user"):
                if claim in message and message[claim] not in (conn.uid, conn.user):
                    raise BadRequest(
                        "identity", f"this connection is user {conn.user} (uid {conn.uid}), as the kernel says"
                    )
            handler = getattr(self, f"_op_{op}", None) if isinstance(op, str) else None
            if handler is None:
                raise BadRequest("unknown_op", f"unknown op {op!r}")
            return {"id": request, "ok": True, **handler(conn, message)}
        except BadRequest as exc:
            return {**_error(request, exc.code, exc.reason), **exc.fields}
        except Exception as exc:  # a bug or a full disk: this caller hears why, the others go on
            log.exception("host ledger: %s from user %s failed", op, conn.user)
            return _error(request, "internal", f"the host ledger could not answer {op!r}: {exc}")

    def _owned(self, conn: Conn, pids: Any) -> list[ProcId]:
        if pids is None:
            if conn.proc is None:
                raise BadRequest("not_yours", "the connecting process is gone")
            return [conn.proc]
        if not isinstance(pids, list) or not pids or len(pids) > MAX_PIDS:
            raise BadRequest("bad_request", f"pids must be a list of 1 to {MAX_PIDS} process ids")
        out = []
        for pid in pids:
            try:
                proc = procs.owned(pid, conn.uid)
            except procs.Unreadable as exc:
                raise BadRequest(
                    "internal", f"the host ledger cannot tell whose pid {pid!r} is now ({exc}): ask again"
                ) from None
            if proc is None:
                raise BadRequest("not_yours", f"pid {pid!r} is not a live process of user {conn.user}")
            out.append(proc)
        return out

    def _grant_of(self, conn: Conn, grant_id: Any) -> Grant:
        grant = self.grants.get(grant_id) if isinstance(grant_id, str) else None
        if grant is None or grant.uid != conn.uid:  # another user's grant is as unknown as none
            raise BadRequest("unknown_grant", f"user {conn.user} holds no grant {grant_id!r}")
        return grant

    # ------------------------------------------------------------------ ops

    def _op_hello(self, conn: Conn, message: dict[str, Any]) -> dict[str, Any]:
        return {
            "user": conn.user,
            "uid": conn.uid,
            "pid": conn.pid,
            "admin": conn.admin,
            "reclaiming": self.reclaim_open(),
            "devices": self._devices_json(),
            "grants": [g.as_json() for g in self.grants.values() if g.uid == conn.uid],
        }

    def _ask(self, conn: Conn, message: dict[str, Any]) -> tuple[str, Ask]:
        key = message.get("key")
        if not isinstance(key, str) or not key or len(key) > MAX_KEY_CHARS:
            raise BadRequest("bad_request", f"key must be a string of 1 to {MAX_KEY_CHARS} characters")
        kind = message.get("kind", "run")
        if kind not in KINDS:
            raise BadRequest("bad_request", f"kind must be one of {', '.join(KINDS)}")
        exclusive = message.get("exclusive", False)
        if not isinstance(exclusive, bool):
            raise BadRequest("bad_request", "exclusive must be true or false")
        devices = message.get("devices")
        if devices is not None and (
            not isinstance(devices, list) or not all(type(i) is int for i in devices) or len(devices) > 64
        ):
            raise BadRequest("bad_request", "devices must be a list of GPU indexes")
        gpus = _int(message, "gpus", len(devices) if devices else 1, low=1)
        ask = Ask(conn.user, _int(message, "vram_mb", 0), gpus, exclusive, kind, tuple(devices) if devices else None)
        return key, ask

    def _op_request(self, conn: Conn, message: dict[str, Any]) -> dict[str, Any]:
        key, ask = self._ask(conn, message)
        conn.tenant = True
        for grant in self.grants.values():
            if grant.uid == conn.uid and grant.key == key:
                # Asked again (an answer lost, a server restarted): the same grant, but only for
                # the same ask; answered as granted, another would be used as if it held what it asks.
                mismatch = key_mismatch(grant.holding(), ask)
                if mismatch:
                    raise BadRequest(
                        "key_in_use",
                        f"user {conn.user} holds grant {grant.id} under key {key!r}, and this request asks "
                        f"for another: {mismatch}; release it first, or ask under another key",
                        grant=grant.as_json(),
                    )
                grant.conn = conn
                return {"state": "granted", "grant": grant.as_json()}
        if any(w.conn.uid == conn.uid and w.key == key for w in self.waiting):
            raise BadRequest("duplicate", f"a request {key!r} of user {conn.user} already waits")
        if sum(1 for g in self.grants.values() if g.uid == conn.uid) >= MAX_GRANTS_PER_UID:
            raise BadRequest("too_many", f"user {conn.user} holds {MAX_GRANTS_PER_UID} grants")
        if sum(1 for w in self.waiting if w.conn.uid == conn.uid) >= MAX_WAITING_PER_UID:
            raise BadRequest("too_many", f"user {conn.user} has {MAX_WAITING_PER_UID} requests waiting")
        never = decide(ask, self.devices(), [], self._quota_of(conn.uid))
        if never.state == "never":
            return {"state": "never", "reason": never.reason}
        waiter = Waiter(conn, message.get("id"), key, ask, self._owned(conn, message.get("pids")))
        if message.get("wait", True) is False and not self.reclaim_open():
            turn = self._turn_of_another(conn, ask)
            if turn:
                return {"state": "busy", "reason": turn}
        self.waiting.append(waiter)
        self._schedule()
        if waiter.grant is not None:
            return {"state": "granted", "grant": waiter.grant.as_json()}
        if message.get("wait", True) is False:
            self.waiting.remove(waiter)
            if waiter.gave_way:  # (to a turn that a grant made before it in that pass gave)
                conn.owes_retry = True
            return {"state": "busy", "reason": waiter.reason}
        waiter.replied = True
        return {"state": "waiting", "reason": waiter.reason}

    def _turn_of_another(self, conn: Conn, ask: Ask) -> str:
        """Fair share for an ask that does not wait (a user's server admits its own runs and asks
        without waiting): when granting it now would take the room of an ask that another user
        has told as demand, and that fits now, of a user it must give way to (_given_way_to),
        the ask is refused with the reason (_give_way: that user is told ``turn`` and its server
        asks); the refused one is told ``retry`` once that user has been granted that room, or
        TURN_S has passed. A waiting request is held back by the same rule (see _schedule)."""
        (turn,) = self._given_way_to([(conn, ask)])
        if turn is None:
            return ""
        conn.owes_retry = True
        return self._give_way(conn, *turn, self.devices(), self.holdings())

    def _demand_tellers(self) -> list[Conn]:
        """The connections whose told demand counts: open, and not of a user who let a turn pass."""
        return [c for c in self.conns if c.demand and not c.closed and c.uid not in self.forfeited]

    def _given_way_to(self, asks: Sequence[tuple[Conn, Ask]]) -> list[tuple[Conn, Ask] | None]:
        """For each ask (of its connection's user, waiting or not), whether it gives way to another
        user's told demand (policy.gives_way: it would take the room of a demanded ask that fits
        now, of a user holding less that took no turn since this one was last granted, or of one
        this one took a turn after): that user's connection and the ask it gives way to, or None."""
        others = [(c, a) for c in self._demand_tellers() for a in c.demand]  # (a user's own: passed over)
        if not others or not asks:
            return [None] * len(asks)
        quotas = {c.user: self._quota_of(c.uid) for c in [*(c for c, _ in asks), *(c for c, _ in others)]}
        positions = given_way_to(
            [a for _, a in asks],
            [a for _, a in others],
            self.devices(),
            self.holdings(),
            quotas,
            self._last_turn,
            self._last_granted,
        )
        return [None if p is None else others[p] for p in positions]

    def _give_way(
        self, conn: Conn, first: Conn, kept_for: Ask, devices: Mapping[int, HostDevice], holdings: list[Holding]
    ) -> str:
        """``conn`` gives way to ``first``'s told ``kept_for``: deferred to it until that user has
        been granted that room or TURN_S has passed (see _expire_turns, _turn_taken), and that
        user told its ``turn``. The fair-share reason (``devices``, ``holdings``: as now)."""
        # Told once while its turn lasts: a user's server asking again and again (each ask refused
        # for it) must not flood the other's with turns, each a pass of its admission.
        told = any(c is first for other in self.conns for _, c, _ in other.deferred_for)
        if not any(c is first for _, c, _ in conn.deferred_for):
            conn.deferred_for.append((time.monotonic() + TURN_S, first, kept_for))
        if not told:
            first.send({"event": "turn"})
        held = held_mb(first.user, devices, holdings)
        if held >= held_mb(conn.user, devices, holdings):  # (given way for its turn, not its holding)
            return f"fair share: user {first.user} waits for this room and has the next turn (user {conn.user} had the last)"
        return f"fair share: user {first.user} holds less ({held} MB) and waits for this room"

    def _deferrals_over(self, conn: Conn) -> None:
        """``conn`` gives way to nobody now: told to ``retry`` an ask refused for it. A request of
        its that waited is granted by the next pass of _schedule, and told so."""
        if conn.owes_retry:
            conn.owes_retry = False
            conn.send({"event": "retry"})

    def _expire_turns(self) -> None:
        """Tell each deferred tenant to ask again once the user it was deferred to has been
        granted what it waited for, or has not asked within TURN_S (its demand is set aside)."""
        now = time.monotonic()
        for conn in list(self.conns):
            if not conn.deferred_for:
                continue
            keep = []
            for deadline, first, kept_for in conn.deferred_for:
                if first.closed or not first.demand:
                    continue
                if now >= deadline:
                    # It did not take its turn: not in the way again until it asks.
                    first.demand = []
                    self.forfeited[first.uid] = kept_for
                    continue
                keep.append((deadline, first, kept_for))
            done = len(keep) < len(conn.deferred_for)
            conn.deferred_for = keep
            if done and not keep:
                self._deferrals_over(conn)

    def _demand_met(self, conn: Conn, grant: Grant) -> None:
        """A grant serves the user's told demand: the demanded ask it covers (the largest) is
        taken out of it, so that what was granted holds nobody back as demand still queued."""
        mine = [conn, *(c for c in self.conns if c.uid == conn.uid and c is not conn)]
        for tenant in mine:
            position = met_by(grant.holding(), tenant.demand)
            if position is not None:
                tenant.demand = [a for i, a in enumerate(tenant.demand) if i != position]
                return

    def _turn_taken(self, first: Conn, grant: Grant, made: int) -> None:
        """``first`` was granted ``grant`` (the ``made``-th grant): the tenants deferred to it for
        no more room than that may ask again. A smaller grant (0 MB, say, to stay the user holding least) takes no turn:
        they wait for TURN_S, and then ``first`` forfeits it."""

        def taken(kept_for: Ask) -> bool:
            return covers(grant.holding(), kept_for)

        let_pass = self.forfeited.get(grant.uid)
        if let_pass is not None and taken(let_pass):
            del self.forfeited[grant.uid]
        for conn in list(self.conns):
            # (by user: its server may ask on another connection than the one that told demand)
            if any(c.uid == first.uid and taken(a) for _, c, a in conn.deferred_for):
                self._last_turn[grant.user] = max(self._last_turn.get(grant.user, 0), made)
                conn.deferred_for = [
                    (d, c, a) for d, c, a in conn.deferred_for if not (c.uid == first.uid and taken(a))
                ]
                if not conn.deferred_for:
                    self._deferrals_over(conn)

    def _op_demand(self, conn: Conn, message: dict[str, Any]) -> dict[str, Any]:
        """The GPU work this tenant has queued, as asks (``vram_mb``, ``gpus``, ``exclusive``,
        ``kind``; at most MAX_DEMAND): replaces what it told before."""
        asks = message.get("asks")
        if not isinstance(asks, list) or len(asks) > MAX_DEMAND or not all(isinstance(a, dict) for a in asks):
            raise BadRequest("bad_request", f"asks must be a list of at most {MAX_DEMAND} objects")
        demand = []
        for item in asks:
            _, ask = self._ask(conn, {**item, "key": "demand"})
            # Kept: asks that could ever be granted, and that need room (0 MB keeps nobody's).
            if takes_room(ask) and decide(ask, self.devices(), [], self._quota_of(conn.uid)).state != "never":
                demand.append(ask)
        conn.demand = demand
        return {"demand": len(demand)}

    def _op_cancel(self, conn: Conn, message: dict[str, Any]) -> dict[str, Any]:
        key = message.get("key")
        mine = [w for w in self.waiting if w.conn is conn and w.key == key]  # its own: the asker waits
        self.waiting = [w for w in self.waiting if w not in mine]
        return {"cancelled": bool(mine)}

    def _op_retie(self, conn: Conn, message: dict[str, Any]) -> dict[str, Any]:
        grant = self._grant_of(conn, message.get("grant"))
        grant.procs = self._owned(conn, message.get("pids"))
        grant.conn = conn
        # Made even when it cannot be saved now (unlike a grant or a release): a retie only
        # changes which processes keep a grant alive, no VRAM is granted or freed. Refused, a
        # run started meanwhile would lose its grant when the server that asked for it dies (its
        # server reties once, as the run starts). The sweep saves it once it can; until then a
        # restarted ledger has the grant tied to the server, as before the retie.
        try:
            self._save_state()
        except Exception as exc:
            self._unsaved = True
            self._trouble_saving(exc)
        return {"grant": grant.as_json()}

    def _op_release(self, conn: Conn, message: dict[str, Any]) -> dict[str, Any]:
        grant = self._grant_of(conn, message.get("grant"))
        # Saved first: a release the ledger could not save is not made (the grant is held, and
        # the caller is told to release it again), never one made and answered as failed.
        self._commit((g for g in self.grants.values() if g is not grant), f"grant {grant.id} is still held")
        self.grants.pop(grant.id, None)
        self._schedule()
        return {"released": grant.id}

    def _op_reclaim(self, conn: Conn, message: dict[str, Any]) -> dict[str, Any]:
        """A tenant re-tells its live grants (after a restart of either side). Each is kept when
        its processes are the caller's and alive; one the ledger knows is the same grant. More
        grants than one frame holds are told in batches (``more``: one follows), one reclaim:
        a restarted ledger waits for the tenant until its last batch, and an id told in an
        earlier batch is told twice."""
        items = message.get("grants", [])
        more = message.get("more", False)
        if not isinstance(items, list) or len(items) > MAX_GRANTS_PER_UID:
            raise BadRequest("bad_request", f"grants must be a list of at most {MAX_GRANTS_PER_UID}")
        if not isinstance(more, bool):
            raise BadRequest("bad_request", "more must be true or false")
        told_in_all = conn.reclaim_told + len(items)
        if told_in_all > MAX_GRANTS_PER_UID:  # (what a user may hold: the ids kept stay bounded)
            conn.reclaim_seen, conn.reclaim_told = set(), 0  # that reclaim ends: the next is a new one
            raise BadRequest(
                "bad_request", f"grants must be at most {MAX_GRANTS_PER_UID} in one reclaim, over all its batches"
            )
        conn.tenant = True
        kept, refused = [], []
        # The grants as they will be: saved first, then made (nothing of it when it cannot be saved).
        after = dict(self.grants)
        seen = set(conn.reclaim_seen)  # the ids told so far: one told twice is kept as first told
        keys: dict[str, str] | None = None  # the user's keys held -> grant id (one grant a key)
        learnt: Retold | None = None  # the grants held and learnt so far, as the policy weighs them
        for item in items:
            try:
                if not isinstance(item, dict) or not isinstance(item.get("id"), str) or len(item["id"]) > 64:
                    raise BadRequest("bad_request", "each grant needs its id")
                if item["id"] in seen:
                    raise BadRequest("duplicate", f"grant {item['id']!r} is told twice: kept as first told")
                seen.add(item["id"])
                known = after.get(item["id"])
                if known is not None and known.uid != conn.uid:
                    raise BadRequest("unknown_grant", f"user {conn.user} holds no grant {item['id']!r}")
                told = item.get("pids") or []
                if not isinstance(told, list):
                    raise BadRequest("bad_request", f"pids must be a list of 1 to {MAX_PIDS} process ids")
                pids = [p.get("pid") if isinstance(p, dict) else p for p in told]
                live = self._owned(conn, pids)
                if known is None:
                    # Only a restarted ledger that lost its state learns grants it does not know
                    # (with its state file read, it knows every grant it made), and only ones
                    # that fit beside those it knows: re-telling is no way around the policy.
                    if self._state_read or not self.reclaim_open():
                        raise BadRequest("unknown_grant", f"user {conn.user} holds no grant {item['id']!r}")
                    key, ask = self._ask(conn, item)
                    if keys is None:
                        keys = {g.key: g.id for g in after.values() if g.uid == conn.uid}
                    if key in keys:
                        raise BadRequest(
                            "key_in_use", f"user {conn.user} holds grant {keys[key]} under key {key!r}: one grant a key"
                        )
                    if learnt is None:
                        # Its processes' VRAM may still show as unmanaged: grants alone are compared.
                        bare = {i: HostDevice(i, d.usable_mb) for i, d in self.devices().items()}
                        learnt = Retold(bare, [g.holding() for g in after.values()])
                    if ask.devices is None or any(i not in learnt.devices for i in ask.devices):
                        raise BadRequest("bad_request", "a re-told grant names the GPUs it holds")
                    why = learnt.reason(ask, self._quota_of(conn.uid))
                    if why:
                        raise BadRequest("does_not_fit", f"re-told grant does not fit: {why}")
                    known = Grant(
                        item["id"], conn.uid, conn.user, key, ask.kind, ask.devices, ask.vram_mb, ask.exclusive, live
                    )
                    keys[key] = known.id
                    learnt.learn(known.holding())
                after[known.id] = dataclasses.replace(known, procs=live, conn=conn)
                kept.append(after[known.id].as_json())
            except BadRequest as exc:
                refused.append(
                    {"id": item.get("id") if isinstance(item, dict) else None, "error": exc.code, "reason": exc.reason}
                )
        self._commit(after.values(), "none of the grants told was kept; connect again")
        for grant_id, told in after.items():
            if grant_id in self.grants:
                self.grants[grant_id].procs, self.grants[grant_id].conn = told.procs, told.conn
            else:
                self.grants[grant_id] = told
        if more:
            conn.reclaim_seen, conn.reclaim_told = seen, told_in_all
        else:
            conn.reclaim_seen, conn.reclaim_told = set(), 0
            self.pending_tenants = {t for t in self.pending_tenants if t != (conn.uid, conn.proc)}
        self._schedule()
        return {"kept": kept, "refused": refused, "reclaiming": self.reclaim_open()}

    def _op_view(self, conn: Conn, message: dict[str, Any]) -> dict[str, Any]:
        limit = min(_int(message, "limit", MAX_VIEW_ENTRIES), MAX_VIEW_ENTRIES)
        return self.view_for(conn.uid, conn.user, conn.admin, limit)

    # ------------------------------------------------------------------ views

    def _devices_json(self) -> list[dict[str, Any]]:
        return [
            {
                "index": g.index,
                "name": g.name,
                "total_mb": g.total_mb,
                "usable_mb": self.config.usable(g.index, g.total_mb),
            }
            for g in self.view.gpus
        ]

    def view_for(self, uid: int, user: str, admin: bool, limit: int = MAX_VIEW_ENTRIES) -> dict[str, Any]:
        """What one user may see: their own grants in full, the others' by user name only (the
        whole view for an admin). At most ``limit`` grants, waiting requests and demanded asks
        are listed (``omitted``: how many more): the per-device and per-user sums are whole, so
        that an answer stays far below what a client reads (MAX_ANSWER_BYTES) however many
        grants the host holds."""
        devices = self.devices()
        visible = [g for g in self.grants.values() if admin or g.uid == uid]
        waiting = [w for w in self.waiting if admin or w.conn.uid == uid]
        # The caller's own told demand first: its server checks what the ledger keeps of it.
        demand = [a for c in sorted(self.conns, key=lambda c: c.uid != uid) if admin or c.uid == uid for a in c.demand]
        listed = {g.id for g in visible[:limit]}
        out_devices = []
        for info in self._devices_json():
            dev = devices[info["index"]]
            here = [g for g in self.grants.values() if dev.index in g.devices]
            allocated = sum(dev.usable_mb if g.exclusive else g.vram_mb for g in here)
            users: dict[str, dict[str, Any]] = {}
            for g in here:
                if g.uid == uid:
                    continue
                entry = users.setdefault(
                    g.user, {"user": g.user, "allocated_mb": 0, "leases": 0, "runs": 0, "models": 0}
                )
                entry["allocated_mb"] += dev.usable_mb if g.exclusive else g.vram_mb
                entry[{"lease": "leases", "model": "models"}.get(g.kind, "runs")] += 1
            unmanaged = [
                {k: p[k] for k in ("pid", "gpu", "used_mb", "user")} for p in self.view.unmanaged.get(dev.index, [])
            ]
            out_devices.append(
                {
                    **info,
                    "allocated_mb": allocated,
                    "unmanaged_mb": dev.unmanaged_mb,
                    "free_mb": dev.usable_mb - allocated - dev.unmanaged_mb,
                    "exclusive": any(g.exclusive for g in here),
                    "grants": [g.id for g in here if g.id in listed],
                    "users": sorted(users.values(), key=lambda e: e["user"]),
                    "unmanaged_processes": unmanaged,
                }
            )
        others_waiting: dict[str, int] = {}
        for w in self.waiting:
            if w.conn.uid != uid:
                others_waiting[w.ask.user] = others_waiting.get(w.ask.user, 0) + 1
        quota = self._quota_of(uid)
        return {
            "user": user,
            "admin": admin,
            "reclaiming": self.reclaim_open(),
            # The caller's own quota: its server tells a request that can never fit (a 422) alone.
            "quota": {"vram_mb": quota.vram_mb, "gpus": quota.gpus, "leases": quota.leases},
            "devices": out_devices,
            "grants": [g.as_json() for g in visible[:limit]],
            "waiting": [
                {
                    "user": w.ask.user,
                    "key": w.key,
                    "kind": w.ask.kind,
                    "vram_mb": w.ask.vram_mb,
                    "gpus": w.ask.gpus,
                    "exclusive": w.ask.exclusive,
                    "reason": w.reason,
                }
                for w in waiting[:limit]
            ],
            "users_waiting": others_waiting,
            # The queued GPU work the tenants told (``demand``): the caller's own, or everyone's.
            "demand": [
                {"user": a.user, "vram_mb": a.vram_mb, "gpus": a.gpus, "exclusive": a.exclusive, "kind": a.kind}
                for a in demand[:limit]
            ],
            "omitted": {
                "grants": max(0, len(visible) - limit),
                "waiting": max(0, len(waiting) - limit),
                "demand": max(0, len(demand) - limit),
            },
        }


async def serve(config: LedgerConfig, socket_path: str) -> None:
    """Run a host ledger until cancelled (or SIGTERM / SIGINT)."""
    import signal

    # Each connection is a descriptor: a soft limit of 1024 (a service's default) is one a few
    # dozen users' servers could use up, as far as its hard limit allows (LimitNOFILE= in the unit).
    raise_open_files_limit()
    ledger = HostLedger(config, socket_path)
    await ledger.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print(json.dumps({"event": "ready", "socket": socket_path, "pid": os.getpid()}), flush=True)
    try:
        waits = [asyncio.ensure_future(stop.wait()), asyncio.ensure_future(ledger.ended.wait())]
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()
    finally:
        await ledger.stop()
    if ledger.failed is not None:
        raise RuntimeError(f"the host ledger stopped: {ledger.failed!r}")
