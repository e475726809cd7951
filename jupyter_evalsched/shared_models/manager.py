"""The server side of the shared models: starts, watches and restarts one host process per model.

``ModelHostManager`` is built by the app from the ``EvalSchedApp.models`` traitlet (a list of
dicts, validated by ``config.parse_models``: a bad declaration is a ValueError naming the model and
the field). Everything it does on the event loop is non-blocking: the hosts are asyncio
subprocesses whose events (JSON lines on their stdout) are read by a watcher task, and figures are
fetched over asyncio Unix streams. Inference never runs in the server process.

Why one host process per model: a crash, an OOM or a runaway allocation while loading or running
one model (RLIMIT_AS is per process) takes down that model's host only, never the server, the
scheduler, or the other models. The cost is one interpreter (and, on a GPU, one CUDA context) per
model, which the declared ``vram_mb`` should include.

When a host dies, the requests it was serving fail at once with ``SharedModelError`` (HostDied),
and the manager starts a new host after a hold (backoff: 0.5 s, doubling per consecutive early
death, at most 60 s) so that a crash-looping model cannot spin. The new host loads the model at
the next request. A host that died while loading tells the next host, which answers requests
with that error for the model's ``load_retry_s`` instead of loading again at once.

The ledger owns the memory of a model with ``vram_mb`` on a GPU (``bind_ledger``): its host starts
only once the ledger admitted that VRAM (a caller waits meanwhile), and holds it until the model
is unloaded (``unload``: the host stopped, when the scheduler needs the room of a model idle for
its ``idle_unload_s``); a host that dies keeps its model's room for the new one.
"""

from __future__ import annotations

import asyncio
import io
import json
import logging
import os
import secrets
import shutil
import signal
import stat
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path
from typing import Any

from ..openai_keys import run_key
from ..scheduler.shared import LoadGate, ModelMemory, ModelUnavailable
from ..store import RunFileError, open_log, tail_lines
from . import socket_dirs
from .client import make_url
from .config import ModelConfig, parse_models
from .protocol import HEADER, PlainUnpickler, encode

HOLD_BASE_S = 0.5
HOLD_MAX_S = 60.0
EARLY_DEATH_S = 60.0  # a host that dies sooner than this after its start counts as crash-looping
START_ATTEMPTS = 3  # consecutive starts that never got ready: the model is unavailable
START_TIMEOUT_S = 60.0  # the longest a run waits for its model's host to listen
STDERR_TAIL_LINES = 5
STOP_GRACE_S = 5.0
DESCRIBE_TIMEOUT_S = 2.0
# A host's reply this large or larger (every token's log-probabilities of a batch of prompts) is
# unpickled in a thread, not on the server's event loop; a smaller one costs less than the hop.
UNPICKLE_ON_LOOP_BELOW = 1 << 20
_SUN_PATH_MAX = 100  # sockaddr_un.sun_path is 108 bytes on Linux, 104 on macOS: keep a margin

_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _tmp_dir() -> str:
    """Where a socket path is short: /tmp (the system's temporary directory may be long)."""
    return "/tmp" if os.path.isdir("/tmp") else tempfile.gettempdir()


def restart_hold_s(early_deaths: int) -> float:
    """How long a dead host stays down: 0.5 s, doubling with each consecutive early death."""
    return min(HOLD_BASE_S * 2 ** max(0, early_deaths - 1), HOLD_MAX_S)


def _describe_exit(returncode: int | None) -> str:
    if returncode is None:
        return "an unknown status"
    if returncode < 0:
        try:
            return f"signal {signal.Signals(-returncode).name}"
        except ValueError:
            return f"signal {-returncode}"
    return f"exit code {returncode}"


class _Host:
    """What the manager knows about one model and its host process."""

    def __init__(self, config: ModelConfig, socket_path: str):
        self.config = config
        self.socket_path = socket_path
        self.url = make_url(socket_path, config.name)
        self.proc: asyncio.subprocess.Process | None = None
        self.started_at = 0.0
        self.ready = asyncio.Event()
        self.state = "not_loaded"
        self.error: dict | None = None
        self.load_count = 0
        self.load_seconds: float | None = None
        self.starts = 0
        self.deaths = 0
        self.early_deaths = 0  # consecutive deaths soon after start: the hold grows with them
        self.failed_starts = 0  # consecutive starts that died (or failed) before listening
        self.held_until = 0.0
        self.respawn: asyncio.Task | None = None
        self.watcher: asyncio.Task | None = None
        self.lock = asyncio.Lock()
        self.inherited_failure: dict | None = None  # a load failure to hand to the next host
        self.last_figures: dict = {}
        # The ledger's side: its VRAM admitted (until unloaded), callers in flight through the
        # manager, requests in flight in the host (its busy/idle events), when it was last used.
        self.resident = False
        self.unloading = False
        self.in_flight = 0
        self.busy = False
        self.last_used = time.monotonic()

    @property
    def in_use(self) -> bool:
        return self.in_flight > 0 or self.busy

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.returncode is None

    @property
    def pid(self) -> int | None:
        """The PID of the host process while it is alive, else None."""
        return self.proc.pid if self.proc is not None and self.proc.returncode is None else None


class ModelHostManager:
    """Owns the shared-model hosts of this Jupyter server. See the module docstring.

    ``models``: the operator's declarations (list of dicts). ``socket_dir``: the private directory
    of the sockets, created 0700 (it must not exist as anything but our own directory); or else
    ``socket_parent``: where a fresh private directory is made (default: the system temp dir).
    Unix socket paths are limited to about 100 bytes: a longer or unusable place falls back to a
    fresh directory under /tmp. ``log_dir``: where each host's stderr goes (``<name>.log``;
    default: the socket directory). ``env``: extra environment of the hosts.
    """

    def __init__(
        self,
        models: Iterable[dict] | None = None,
        *,
        socket_dir: str | os.PathLike | None = None,
        socket_parent: str | os.PathLike | None = None,
        log_dir: str | None = None,
        env: dict[str, str] | None = None,
        log: logging.Logger | None = None,
        idle_unload_s: float | None = None,
    ):
        self.configs: list[ModelConfig] = parse_models(list(models) if models is not None else [])
        self.idle_unload_s = idle_unload_s  # for the models that do not declare their own
        self.requested_socket_dir = os.fspath(socket_dir) if socket_dir is not None else None
        self.socket_parent = os.fspath(socket_parent) if socket_parent is not None else None
        self.log_dir = log_dir
        self.start_attempts = START_ATTEMPTS
        self.start_timeout_s = START_TIMEOUT_S
        self.env = dict(env or {})
        self.log = log or logging.getLogger("jupyter_evalsched.shared_models")
        self.socket_dir: str | None = None
        self._socket_dir_lock: int | None = None  # held while the directory is ours (socket_dirs)
        self._hosts: dict[str, _Host] = {}
        self._stopping = False
        self._started = False
        # The OpenAI-compatible routes as runs reach them (set by the app once it serves), and the
        # secret that signs each run's API key (openai_keys).
        self.api_base: str | None = None
        self.api_secret = secrets.token_bytes(32)
        self._gate: LoadGate | None = None  # the ledger, once bound: loads wait for their VRAM
        self._preloads: list[asyncio.Task] = []

    # -- synchronous queries (no host needed) ---------------------------------------------------

    def names(self) -> list[str]:
        return [config.name for config in self.configs]

    def memory(self) -> list[ModelMemory]:
        """The models with VRAM on a GPU, as the ledger sees them (see ``ModelMemory``)."""
        now = time.monotonic()
        out = []
        for config in self.configs:
            if config.gpu_index is None or not config.vram_mb:
                continue
            host = self._hosts.get(config.name)
            idle = config.idle_unload_s if config.idle_unload_s is not None else self.idle_unload_s
            out.append(
                ModelMemory(
                    config.name,
                    config.gpu_index,
                    config.vram_mb,
                    idle,
                    resident=host is not None and host.resident,
                    busy=host is not None and host.in_use,
                    idle_s=max(0.0, now - host.last_used) if host is not None else 0.0,
                    unloading=host is not None and host.unloading,
                )
            )
        return out

    def bind_ledger(self, gate: LoadGate) -> None:
        self._gate = gate

    def admitted(self, name: str) -> None:
        host = self._hosts.get(name)
        if host is not None:
            host.resident = True
            host.last_used = time.monotonic()  # a fresh load is not idle

    async def unload(self, name: str) -> bool:
        """Stop the host of an idle model (its VRAM is free once it is gone); False, doing
        nothing, when it is in use or not resident. The next caller loads it again."""
        host = self._hosts.get(name)
        if host is None or not host.resident or host.in_use or host.unloading:
            return False
        host.unloading = True
        try:
            async with host.lock:
                if host.in_use or not host.resident:  # a caller came meanwhile
                    return False
                if host.respawn is not None:
                    host.respawn.cancel()
                proc, host.proc = host.proc, None  # its watcher sees a stop, not a death
                if proc is not None:
                    await _terminate_proc(proc)
                host.ready = asyncio.Event()
                host.state = "not_loaded" if host.state != "failed" else host.state
                host.last_figures = {}
                host.resident = False
            self.log.info("shared model %s: unloaded (idle; its VRAM was needed)", name)
            return True
        finally:
            host.unloading = False

    def _needs_ledger(self, host: _Host) -> bool:
        return self._gate is not None and host.config.gpu_index is not None and bool(host.config.vram_mb)

    async def _admit(self, host: _Host) -> None:
        """Wait until the ledger admitted the model's VRAM (at once when it is resident, or has
        none on a GPU). ModelUnavailable when it can never fit."""
        if self._gate is None or host.resident or not self._needs_ledger(host):
            return
        await self._gate(host.config.name)
        host.resident = True

    def pids(self) -> set[int]:
        return {pid for host in self._hosts.values() if (pid := host.pid) is not None}

    def run_env(self, run_id: str) -> dict[str, str]:
        """``OPENAI_BASE_URL`` and a key for run ``run_id`` (valid while it lives), for a run that
        names shared models; nothing before the server serves the routes."""
        if self.api_base is None:
            return {}
        return {"OPENAI_BASE_URL": self.api_base, "OPENAI_API_KEY": run_key(self.api_secret, run_id)}

    def url(self, name: str) -> str:
        """The URL of a model (stable for the manager's lifetime); ValueError if unknown."""
        return self._host(name).url

    # -- lifecycle ------------------------------------------------------------------------------

    async def start(self) -> None:
        """Create the private socket directory; start the hosts of models declared ``preload``."""
        if self._started:
            return
        self._started = True
        self._stopping = False
        self.socket_dir = self._make_socket_dir()
        if self.log_dir:
            try:
                os.makedirs(self.log_dir, mode=0o700, exist_ok=True)
            except OSError as exc:  # under the runs directory, anything may be there: the hosts log nothing
                self.log.warning("shared models: cannot keep the hosts' logs in %s: %s", self.log_dir, exc)
        for index, config in enumerate(self.configs):
            self._hosts[config.name] = _Host(config, os.path.join(self.socket_dir, f"m{index}.sock"))
        preload = [h for h in self._hosts.values() if h.config.preload]
        await asyncio.gather(*(self._ensure_running(h) for h in preload if not self._needs_ledger(h)))
        # A model on a GPU waits for the ledger, which starts after us: its preload goes on meanwhile.
        self._preloads = [asyncio.ensure_future(self._preload(h)) for h in preload if self._needs_ledger(h)]

    async def _preload(self, host: _Host) -> None:
        try:
            await self._admit(host)
            await self._ensure_running(host)
        except ModelUnavailable as exc:
            self.log.error("shared model %s: cannot preload: %s", host.config.name, exc.detail)

    async def stop(self) -> None:
        """Stop every host (SIGTERM, then SIGKILL after a grace period) and remove the sockets."""
        self._stopping = True
        for task in self._preloads:
            task.cancel()
        hosts = list(self._hosts.values())
        for host in hosts:
            if host.respawn is not None:
                host.respawn.cancel()
        await asyncio.gather(*(self._terminate(host) for host in hosts), return_exceptions=True)
        for host in hosts:
            if host.watcher is not None:
                host.watcher.cancel()
        if self.socket_dir:
            shutil.rmtree(self.socket_dir, ignore_errors=True)
        if self._socket_dir_lock is not None:
            os.close(self._socket_dir_lock)
            self._socket_dir_lock = None
        self._started = False

    async def urls_for(self, names: Iterable[str]) -> dict[str, str]:
        """URLs of the named models, for ``shared_urls.json``, once their hosts listen (the models
        themselves load at the first request). ValueError for an unknown name; ModelUnavailable
        when a host dies ``start_attempts`` times in a row before listening, or does not listen
        within ``start_timeout_s``: a run must not wait on a model that cannot come."""
        hosts = [self._host(name) for name in names]
        for host in hosts:
            host.in_flight += 1
        try:
            await asyncio.gather(*(self._until_listening(host) for host in hosts))
        finally:
            for host in hosts:
                host.in_flight -= 1
                host.last_used = time.monotonic()
        return {host.config.name: host.url for host in hosts}

    async def _until_listening(self, host: _Host) -> None:
        await self._admit(host)  # (waiting for room counts nothing against start_timeout_s)
        deadline = time.monotonic() + self.start_timeout_s
        while True:
            await self._admit(host)  # again if it was unloaded meanwhile
            await self._ensure_running(host)
            if host.alive and host.ready.is_set():
                return
            if host.failed_starts >= self.start_attempts:
                error = host.error or {}
                raise ModelUnavailable(host.config.name, error.get("message") or "its host cannot start")
            if time.monotonic() >= deadline:
                raise ModelUnavailable(
                    host.config.name, f"its host did not listen within {self.start_timeout_s:g} s{self._tail(host)}"
                )
            # The host listens, dies or is started again: a short poll sees all three.
            await asyncio.sleep(0.05)

    async def ask(self, name: str, message: dict, on_delta: Callable[[dict], Awaitable[None]] | None = None) -> dict:
        """Send one message to the host of model ``name`` (started if needed) on a connection of
        its own, and return the host's reply (``{"ok": True, ...}`` or ``{"ok": False, "error"}``).

        For the OpenAI-compatible routes: one connection per request, so that every request in
        flight counts as a caller and the host never waits for a batch to fill. Cancelling the
        call (a client that went away) closes the connection; the host sees it closed and cancels
        the request (it leaves its batch; the others go on). ``on_delta``: awaited with each delta
        of a streamed request (``"stream": True``) before the reply. ValueError for an unknown name; ModelUnavailable when the
        host cannot start; ConnectionError when it dies before it answers.
        """
        host = self._host(name)
        host.in_flight += 1  # in use from here: never unloaded under a request
        try:
            return await self._ask(host, name, message, on_delta)
        finally:
            host.in_flight -= 1
            host.last_used = time.monotonic()

    async def _ask(
        self, host: _Host, name: str, message: dict, on_delta: Callable[[dict], Awaitable[None]] | None
    ) -> dict:
        await self._until_listening(host)
        try:
            reader, writer = await asyncio.open_unix_connection(host.socket_path)
        except OSError as exc:
            raise ConnectionError(f"the model host of {name!r} is not reachable: {exc}") from None

        async def read_message() -> Any:
            (size,) = HEADER.unpack(await reader.readexactly(HEADER.size))
            data = await reader.readexactly(size)
            if size < UNPICKLE_ON_LOOP_BELOW:
                return PlainUnpickler(io.BytesIO(data)).load()
            return await asyncio.to_thread(lambda: PlainUnpickler(io.BytesIO(data)).load())

        try:
            await read_message()  # the host's greeting
            writer.write(encode({**message, "model": name}))
            await writer.drain()
            reply = await read_message()
            while isinstance(reply, dict) and "delta" in reply and on_delta is not None:
                await on_delta(reply["delta"])
                reply = await read_message()
        except (asyncio.IncompleteReadError, OSError) as exc:
            raise ConnectionError(
                f"the model host of {name!r} closed the connection before it answered ({exc})"
            ) from None
        finally:
            writer.close()
        if not isinstance(reply, dict):
            raise ConnectionError(f"the model host of {name!r} answered {type(reply).__name__}, not a reply")
        return reply

    async def describe(self) -> list[dict[str, Any]]:
        """One dict per model (JSON-able): name, state, device, vram_mb, requests, batches,
        mean_batch_size, load_count, error, endpoint, tokens and tokens_per_s, plus pid,
        restarts, batch_sizes and more."""
        return list(await asyncio.gather(*(self._describe_one(self._hosts.get(c.name), c) for c in self.configs)))

    # -- internals ------------------------------------------------------------------------------

    def _host(self, name: str) -> _Host:
        if not self._started:
            raise RuntimeError("ModelHostManager.start() has not been awaited")
        try:
            return self._hosts[name]
        except KeyError:
            known = ", ".join(self.names()) or "none"
            raise ValueError(f"unknown shared model {name!r} (declared: {known})") from None

    def _make_socket_dir(self) -> str:
        """The private directory, held (``socket_dirs.hold``) until ``stop()``; what killed
        servers left beside it is removed first. The requested one unless another live server
        holds it (the same name: the same pid and host, in another pid namespace), then a fresh
        one. Where locks do not work (no flock on that file system), it goes unheld: only its
        removal by a later server, if this one is killed, is lost."""
        path = self._choose_socket_dir()
        try:
            self._socket_dir_lock = socket_dirs.hold(path)
            return path
        except socket_dirs.DirectoryHeld as exc:
            self.log.warning("shared models: %s; using a fresh directory for its sockets", exc)
        except OSError as exc:
            self._warn_unheld(path, exc)
            return path
        path = socket_dirs.fresh(self._fresh_parent(os.path.dirname(path)))
        try:
            self._socket_dir_lock = socket_dirs.hold(path)
        except (socket_dirs.DirectoryHeld, OSError) as exc:  # (a fresh directory: no one else's)
            self._warn_unheld(path, exc)
        return path

    def _warn_unheld(self, path: str, exc: BaseException) -> None:
        self.log.warning("shared models: cannot lock %s (%s); a later server will not remove it", path, exc)

    def _choose_socket_dir(self) -> str:
        if self.requested_socket_dir:
            path = os.path.abspath(self.requested_socket_dir)
            self._remove_unheld(os.path.dirname(path))
            if len(os.path.join(path, "m999.sock")) <= _SUN_PATH_MAX and self._own_private_dir(path):
                return path
            self.log.warning("shared models: cannot use %s for sockets; using a directory under /tmp", path)
            tmp = _tmp_dir()
            self._remove_unheld(tmp)
            return socket_dirs.fresh(tmp)
        parent = self._fresh_parent(self.socket_parent or tempfile.gettempdir())
        os.makedirs(parent, exist_ok=True)
        self._remove_unheld(parent)
        return socket_dirs.fresh(parent)

    @staticmethod
    def _fresh_parent(parent: str) -> str:
        """``parent``, or /tmp where a fresh directory's sockets would not fit in ``sun_path``."""
        if len(os.path.join(parent, socket_dirs.dir_name() + "-XXXXXXXX", "m999.sock")) > _SUN_PATH_MAX:
            return _tmp_dir()
        return parent

    def _remove_unheld(self, parent: str) -> None:
        for path in socket_dirs.remove_unheld(parent):
            self.log.info("shared models: removed %s, left by a server that was killed", path)

    @staticmethod
    def _own_private_dir(path: str) -> bool:
        """Create ``path`` 0700, or accept an existing real directory of ours (made 0700)."""
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            try:
                os.mkdir(path, 0o700)
            except FileExistsError:
                pass
            info = os.lstat(path)
            if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
                return False  # a symlink or someone else's directory: never put sockets there
            os.chmod(path, 0o700)
            return True
        except OSError:
            return False

    def _host_env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(self.env)
        # The host must import this package even from a source checkout that is not installed.
        env["PYTHONPATH"] = os.pathsep.join(p for p in (_PACKAGE_ROOT, env.get("PYTHONPATH", "")) if p)
        env.setdefault("PYTHONUNBUFFERED", "1")
        return env

    async def _ensure_running(self, host: _Host) -> None:
        async with host.lock:
            if self._needs_ledger(host) and not host.resident:
                return  # unloaded meanwhile: admitted again first (_until_listening)
            if not (self._stopping or host.alive or (host.respawn is not None and not host.respawn.done())):
                await self._spawn_or_hold(host)

    def log_path(self, name: str) -> str:
        """Where the host of model ``name`` writes its stderr (kept after the host dies)."""
        return os.path.join(self.log_dir or self.socket_dir or ".", f"{name}.log")

    def _tail(self, host: _Host) -> str:
        """``": <the last lines of the host's stderr>"``, or nothing when it wrote none."""
        try:  # (under the runs directory: a run may have put a FIFO or a link there)
            text = tail_lines(Path(self.log_path(host.config.name)), None, max_bytes=4096)
        except (OSError, RunFileError):
            return ""
        lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
        return (": " + " | ".join(lines[-STDERR_TAIL_LINES:])) if lines else ""

    async def _spawn(self, host: _Host) -> None:
        args = [
            sys.executable, "-m", "jupyter_evalsched.shared_models.host",
            "--socket", host.socket_path,
            "--parent-pid", str(os.getpid()),
        ]  # fmt: skip
        # The declaration (its options may hold a hub token) goes through the host's stdin, a pipe
        # only the host inherits: never argv or the environment, which every user can read in /proc.
        declaration = json.dumps({"config": host.config.as_dict(), "failed_load": host.inherited_failure})
        host.inherited_failure = None
        try:
            fd = open_log(Path(self.log_path(host.config.name)))
        except RunFileError as exc:  # not a regular file: the host's stderr goes nowhere rather than block
            self.log.warning("shared models: %s; the host of %s logs nothing", exc, host.config.name)
            fd = os.open(os.devnull, os.O_WRONLY | os.O_CLOEXEC)
        with os.fdopen(fd, "ab") as log_file:
            # Spawned from the event-loop thread, which lives as long as the server: the host's
            # PR_SET_PDEATHSIG fires when the forking thread exits.
            host.proc = await asyncio.create_subprocess_exec(
                *args,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=log_file,
                env=self._host_env(),
                start_new_session=True,
            )
        await self._send_declaration(host.proc, declaration.encode())
        host.ready = asyncio.Event()
        host.started_at = time.monotonic()
        host.starts += 1
        if host.state == "loaded" or host.state == "loading":
            host.state = "not_loaded"
        self.log.info("shared model %s: host started (pid %d)", host.config.name, host.proc.pid)
        host.watcher = asyncio.get_running_loop().create_task(self._watch(host, host.proc))

    async def _send_declaration(self, proc: asyncio.subprocess.Process, data: bytes) -> None:
        """Write the declaration to the host's stdin and close it (the host reads to EOF). A host
        that died meanwhile is the watcher's to report; one that does not read in time is killed."""
        assert proc.stdin is not None
        try:
            proc.stdin.write(data)
            await asyncio.wait_for(proc.stdin.drain(), self.start_timeout_s)
        except (OSError, TimeoutError):  # BrokenPipeError, ConnectionResetError: it exited
            if proc.returncode is None:
                try:
                    proc.kill()
                except ProcessLookupError:
                    pass
        finally:
            proc.stdin.close()

    async def _watch(self, host: _Host, proc: asyncio.subprocess.Process) -> None:
        """Follow a host's events until it exits, then record the death and schedule a restart."""
        assert proc.stdout is not None
        while True:
            line = await proc.stdout.readline()
            if not line:
                break
            try:
                event = json.loads(line)
            except ValueError:
                continue
            self._on_event(host, event)
        returncode = await proc.wait()
        if self._stopping or host.proc is not proc:
            return
        self._on_death(host, proc.pid, returncode)

    def _on_event(self, host: _Host, event: dict) -> None:
        kind = event.get("event")
        if kind == "busy" or kind == "idle":
            host.busy = kind == "busy"
            host.last_used = time.monotonic()
        elif kind == "ready":
            host.ready.set()
            host.failed_starts = 0
        elif kind == "loading":
            host.state = "loading"
            host.load_count += 1
        elif kind == "loaded":
            host.state, host.error = "loaded", None
            host.load_seconds = event.get("seconds")
            self.log.info("shared model %s: loaded in %s s", host.config.name, host.load_seconds)
        elif kind == "load_failed":
            error = event.get("error") or {}
            host.state = "failed"
            host.error = {"type": error.get("type"), "message": error.get("message")}
            self.log.error(
                "shared model %s: load failed: %s: %s", host.config.name, error.get("type"), error.get("message")
            )

    def _on_death(self, host: _Host, pid: int, returncode: int) -> None:
        now = time.monotonic()
        host.deaths += 1
        host.busy = False  # its requests failed with it
        lived = now - host.started_at
        host.early_deaths = host.early_deaths + 1 if lived < EARLY_DEATH_S else 1
        hold = restart_hold_s(host.early_deaths)
        host.held_until = now + hold
        how = _describe_exit(returncode)
        if not host.ready.is_set():
            host.failed_starts += 1
            message = f"the model host (pid {pid}) exited with {how} before it listened{self._tail(host)}"
            host.state = "failed"
            host.error = {"type": "HostDied", "message": message}
            self.log.error("shared model %s: %s; next try in %.1f s", host.config.name, message, hold)
            host.last_figures = {}
            host.respawn = asyncio.get_running_loop().create_task(self._respawn_after(host, hold))
            return
        if host.state == "loading":
            hint = " (out of memory?)" if returncode == -signal.SIGKILL else ""
            message = f"the model host (pid {pid}) died with {how}{hint} while loading the model"
            host.state = "failed"
            host.error = {"type": "HostDied", "message": message}
            host.inherited_failure = {"type": "HostDied", "message": message, "phase": "load"}
        else:
            message = (
                f"the model host (pid {pid}) died with {how}; "
                f"a new host starts in {hold:.1f} s and loads the model at the next request"
            )
            if host.state == "loaded":
                host.state = "not_loaded"
            if host.state != "failed":
                host.error = {"type": "HostDied", "message": message}
        self.log.error("shared model %s: %s", host.config.name, message)
        host.last_figures = {}
        host.respawn = asyncio.get_running_loop().create_task(self._respawn_after(host, hold))

    async def _respawn_after(self, host: _Host, hold: float) -> None:
        await asyncio.sleep(hold)
        async with host.lock:
            if not self._stopping and not host.alive and (host.resident or not self._needs_ledger(host)):
                await self._spawn_or_hold(host)

    async def _spawn_or_hold(self, host: _Host) -> None:
        """Spawn; if even that fails (no memory, no file descriptors), record it and retry later,
        so that callers see a clear error rather than an exception in the scheduler."""
        try:
            await self._spawn(host)
        except Exception as exc:
            host.early_deaths += 1
            host.failed_starts += 1
            hold = restart_hold_s(host.early_deaths)
            host.held_until = time.monotonic() + hold
            host.error = {"type": "HostStartFailed", "message": f"cannot start the model host: {exc}"}
            self.log.error(
                "shared model %s: cannot start its host (%s); next try in %.1f s", host.config.name, exc, hold
            )
            host.respawn = asyncio.get_running_loop().create_task(self._respawn_after(host, hold))

    async def _terminate(self, host: _Host) -> None:
        if host.proc is not None:
            await _terminate_proc(host.proc)

    async def _fetch_figures(self, host: _Host) -> dict:
        """The live figures of a running host, over its socket (non-blocking)."""
        reader, writer = await asyncio.open_unix_connection(host.socket_path)

        async def read_message():
            (size,) = HEADER.unpack(await reader.readexactly(HEADER.size))
            return PlainUnpickler(io.BytesIO(await reader.readexactly(size))).load()

        try:
            await read_message()  # the host's greeting
            writer.write(encode({"op": "describe", "model": host.config.name}))
            await writer.drain()
            reply = await read_message()
        finally:
            writer.close()
        if not isinstance(reply, dict) or not reply.get("ok"):
            raise ConnectionError(f"bad describe reply: {reply!r}")
        return reply["describe"]

    async def _describe_one(self, host: _Host | None, config: ModelConfig) -> dict[str, Any]:
        figures: dict = {}
        if host is not None and host.alive and host.ready.is_set():
            try:
                figures = await asyncio.wait_for(self._fetch_figures(host), DESCRIBE_TIMEOUT_S)
                host.last_figures = figures
            except Exception:  # busy, dying or restarting: show the last figures we had
                figures = host.last_figures
        now = time.monotonic()
        return {
            "name": config.name,
            "state": host.state if host else "not_loaded",
            "device": config.device,
            "vram_mb": config.vram_mb,
            "requests": figures.get("requests", 0),
            "batches": figures.get("batches", 0),
            "mean_batch_size": figures.get("mean_batch_size", 0.0),
            "load_count": host.load_count if host else 0,
            "error": host.error if host else None,
            "log": self.log_path(config.name) if self._started else None,
            "inputs": figures.get("inputs", 0),
            "failed_requests": figures.get("failed_requests", 0),
            "batch_sizes": figures.get("batch_sizes", {}),
            "mean_batch_ms": figures.get("mean_batch_ms", 0.0),
            "max_batch_size": config.max_batch_size,
            "max_wait_ms": config.max_wait_ms,
            "load_seconds": host.load_seconds if host else None,
            "pid": host.pid if host else None,
            "restarts": max(0, host.starts - 1) if host else 0,
            "held_s": round(max(0.0, host.held_until - now), 3) if host and not host.alive else 0.0,
            # Where OpenAI's clients reach it (the model's id there is its name); None until served.
            "endpoint": self.api_base,
            "prompt_tokens": figures.get("prompt_tokens", 0),
            "completion_tokens": figures.get("completion_tokens", 0),
            "tokens_per_s": figures.get("tokens_per_s", 0.0),
            "tokens_per_s_since_load": figures.get("tokens_per_s_since_load", 0.0),
            "last_used_at": figures.get("last_used_at"),
        }


async def _terminate_proc(proc: asyncio.subprocess.Process) -> None:
    """SIGTERM, then SIGKILL after a grace period."""
    if proc.returncode is not None:
        return
    try:
        proc.terminate()
        await asyncio.wait_for(proc.wait(), STOP_GRACE_S)
    except ProcessLookupError:
        return
    except TimeoutError:
        try:
            proc.kill()
        except ProcessLookupError:
            return
        await proc.wait()
