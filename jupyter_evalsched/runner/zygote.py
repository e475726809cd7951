"""The zygote: a pre-started interpreter that forks runs, so that a run does not pay for its imports.

``python -m jupyter_evalsched.runner.zygote`` is started by the server with one end of a
``SOCK_SEQPACKET`` socket pair (``EVALSCHED_ZYGOTE_FD``) and dies with it (the death signal, then
the same parent check as a run). It imports the runner and ``EVALSCHED_PRELOAD`` (comma-separated
module names), then forks each run's process ahead of its request (a *spare*; ``SPARES`` wait at
any time) and hands each spare to the server, which gives it its run directly: a start is one
message from the server to the process that becomes the run, with no hop through the zygote. One
JSON message each:

* zygote -> server: ``{"op": "ready", ...}`` once preloaded (or ``{"op": "refused", "why"}``: a
  preload started a thread or touched CUDA, and nothing may be forked from such a process);
  ``{"op": "spare", "pid", "create_time"}`` with two descriptors (``SCM_RIGHTS``): the server's end
  of a socket pair whose other end the spare waits on, and a pidfd of the spare (opened by its
  parent before it could be reaped, so it names that process and no other); ``{"op": "exit",
  "pid", "run_id", "code"}`` for every child it reaps (``code`` as ``Popen.returncode``: negative
  for a signal; ``run_id`` null while the zygote does not know it).
  ``{"op": "nospare", "why"}``: a fork failed (out of memory or processes).
* server -> zygote: ``{"op": "taken", "pid", "run_id", "reaps", "reap"?}`` once a spare answered
  its run (``run_id`` null: it did not become the run, and leaves); the zygote forks the next spare
  then, not while the run starts. ``reaps`` true: the server watches the run's pidfd, reads its exit
  code from the not yet reaped process (``/proc/<pid>/stat``), and asks for the reap afterwards,
  in the next ``taken``'s ``reap`` or in ``{"op": "reap", "pids"}``: ``[pid, report]`` each, after
  the next run has started (or 0.1 s later at most). ``report`` false: the server has the exit
  code, and the zygote reaps without an ``exit`` message (the reap waits for a ``taken`` to ride
  on); true: the server could not read it, and waits for that message. ``{"op": "retire", "why"}``:
  a spare found a preloaded module's file edited; no spare more, and the zygote ends once its runs
  have. ``{"op": "more"}``: after ``nospare``, a run went
  cold for want of a spare; the zygote tries to fork again.
* spare -> server, first, where the server set ``EVALSCHED_CGROUP_SPARES`` (then the zygote's
  ``spare`` message names the spare's cgroup, ``"cgroup"``): ``{"op": "placed", "made", "joined",
  "why"}`` once the spare made that cgroup and joined it, before it touches memory (the server
  gives a run only to a spare that said so, and writes the run's limits in that cgroup).
* server -> spare: ``{"run_id", "run_dir", "cwd", "env"}``. The spare checks what may have changed
  since the zygote imported its modules, opens the run's logs in ``run_dir`` (as the server opens a
  cold run's), then answers ``{"op": "started", "at"}`` (``at``: wall clock, the run's start) and
  becomes the run, or
  ``{"op": "cold", "why"}`` (the run's cwd shadows a preloaded module: the server starts the run
  in a fresh interpreter), ``{"op": "stale", "why"}`` (a preloaded module's file was edited: cold,
  and the server retires this zygote) or ``{"op": "error", "why", "code"?}`` (it cannot start at all: its
  cwd is gone, or its logs cannot be opened; ``code`` ``run_file``: an entry other than a regular
  file is in their place), and leaves.
* run -> server, last: ``DONE_NOTICE`` once the run's ``_DONE`` exists, right before its process
  exits (the socket stays open in the run for that alone). The server may give a CPU-only run's
  slot to the next run then, rather than after the kernel has torn the process down; it checks
  ``_DONE`` first, and a process still there a while later is killed.

A forked run must be indistinguishable from a fresh interpreter for the eval: its own session, the
death signal tied to the zygote (which dies with the server: rule 2), its environment, cwd,
``sys.argv``, ``sys.path`` (``sys.path[0]`` is the run's cwd, as with ``python -m``, none with
``PYTHONSAFEPATH``; the rest is the zygote's, which started with the same ``PYTHON*`` variables),
stdout and stderr, reseeded random generators, no inherited descriptors or threads, and user code
imported after the fork.
The spare readies everything that does not depend on the run (session, death signal, descriptors,
seeds) before its request, so a start costs a message, not a fork. Before each fork the zygote
checks that it has no thread or CUDA state (else it refuses for good); the spare, once asked,
that no preloaded module's file was edited since the zygote imported it and that the run's cwd
does not shadow a preloaded module (it has the zygote's records of both).

One thing cannot be made fresh: ``str`` hashes are salted once per interpreter, so the runs of one
zygote share the zygote's salt (a random one, unless ``PYTHONHASHSEED`` is set).
"""

from __future__ import annotations

import _signal
import _weakref
import gc
import json
import os
import select
import socket
import sys
import time

from ..contract import RUN_FILE, STDERR_FILE, STDOUT_FILE
from ..safe_open import UnsafeRunFile, log_open_failure, open_logs
from . import replace
from ._proc import (
    EXIT_PARENT_GONE,
    expected_parent_pid,
    parent_is_gone,
    process_start_time,
    set_parent_death_signal,
    stat_fields,
)

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

ZYGOTE_FD = "EVALSCHED_ZYGOTE_FD"
PRELOAD = "EVALSCHED_PRELOAD"
# Where each spare makes its own cgroup and joins it (JSON: {"parents": [dirs, primary last],
# "prefix": the name's}); unset: the host gives runs no cgroup.
CGROUP_SPARES = "EVALSCHED_CGROUP_SPARES"
# The empty directory of its own the server starts the zygote in (``python -m`` puts the cwd first
# on ``sys.path``: nothing may be imported from wherever the server happens to be). The zygote
# leaves and removes it as it starts (leave_start_directory).
START_DIR = "EVALSCHED_ZYGOTE_START_DIR"
MAX_MESSAGE = 1 << 20  # a request carries a run's environment: far below this

# What a run's start imports anyway: preloaded always.
RUNNER_MODULES = (
    "jupyter_evalsched.runner.__main__",
    "jupyter_evalsched.runner.run",
    "jupyter_evalsched.runner.results",
    "jupyter_evalsched.runner.context",
    "jupyter_evalsched.runner.entrypoint",
    "jupyter_evalsched.runner.errors",
    "jupyter_evalsched.runner.workers",
    "jupyter_evalsched.runner.async_episodes",
)

# Processes forked ahead of their runs, each waiting for one.
SPARES = 2

# The child exits with this when it could not become the run (EX_OSERR); it says why on stderr.
EXIT_CHILD_SETUP = 71

# Names whose shared libraries mean CUDA (or the NVIDIA driver) is loaded in this process.
_CUDA_LIBRARIES = ("libcuda.so", "libnvidia-ml.so", "libcudart.so")


# ---------------------------------------------------------------------------- checks


def thread_count() -> int:
    """Threads of this process as the kernel sees them (a C library's threads included)."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        import threading

        return threading.active_count()


def cuda_state() -> str | None:
    """What says CUDA is initialised here, or None. A forked child of a process that initialised
    CUDA cannot use CUDA (and may hang), hence the zygote's rule: never CUDA before fork."""
    torch = sys.modules.get("torch")
    if torch is not None:
        try:
            if torch.cuda.is_initialized():
                return "torch.cuda is initialised"
        except Exception:
            pass
    try:
        with open("/proc/self/maps", "rb") as f:
            maps = f.read()
    except OSError:
        maps = b""
    for name in _CUDA_LIBRARIES:
        at = maps.find(name.encode())
        if at >= 0:
            start = maps.rfind(b" ", 0, at) + 1
            end = maps.find(b"\n", at)
            return f"{maps[start : end if end >= 0 else None].decode('utf-8', 'replace')} is loaded"
    try:
        for fd in os.listdir("/proc/self/fd"):
            try:
                target = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                continue
            if target.startswith("/dev/nvidia"):
                return f"{target} is open"
    except OSError:
        pass
    return None


def _fork_safe_pools() -> list[Any]:
    """The thread pools loaded here that are known to survive a fork: OpenBLAS (numpy's, and so
    torch's) registers a fork handler that shuts its pool down before every fork and starts it
    again when next needed; ``blas_thread_shutdown_`` is that handler."""
    try:
        with open("/proc/self/maps", "rb") as f:
            maps = f.read().decode("utf-8", "replace")
    except OSError:
        return []
    libs = sorted({line.split()[-1] for line in maps.splitlines() if "openblas" in line.rsplit("/", 1)[-1].lower()})
    out = []
    for lib in libs:
        if not lib.startswith("/"):
            continue
        try:
            import ctypes

            shutdown = getattr(ctypes.CDLL(lib), "blas_thread_shutdown_", None)
        except OSError:
            continue
        if shutdown is not None:
            out.append(shutdown)
    return out


_pools: list[Any] | None = None


def forget_pools() -> None:
    global _pools
    _pools = None


def quiesce_fork_safe_pools() -> None:
    """Shut down the known fork-safe pools now, as their own fork handlers would: their threads
    must not count as threads that make forking unsafe."""
    global _pools
    if _pools is None:
        _pools = _fork_safe_pools()
    for shutdown in _pools:
        try:
            shutdown()
        except Exception:
            pass


# How long the threads of a pool that was just shut down may take to leave /proc/self/task: its
# shutdown returns once they have ended, a moment before the kernel has released them.
THREADS_LEAVING_S = 0.5


def unsafe_to_fork() -> str | None:
    """Why forking now would give a child a broken process, or None."""
    threads = thread_count()
    if threads > 1:
        quiesce_fork_safe_pools()
        threads = thread_count()
        deadline = time.monotonic() + THREADS_LEAVING_S
        while threads > 1 and time.monotonic() < deadline:
            time.sleep(0.001)
            threads = thread_count()
    if threads > 1:
        import threading

        names = [t.name for t in threading.enumerate() if t is not threading.main_thread()]
        which = f" ({', '.join(names[:3])})" if names else " (started outside Python)"
        return f"the zygote has {threads} threads{which}; a forked run would inherit a broken process"
    cuda = cuda_state()
    if cuda is not None:
        return f"CUDA state in the zygote: {cuda}"
    return None


# ---------------------------------------------------------------------------- what was preloaded


def _stdlib_dirs() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(the standard library's directories, the site directories): in a virtual environment
    ``platstdlib`` is the environment's ``lib/pythonX.Y``, which holds its site-packages."""
    import site
    import sysconfig

    paths = sysconfig.get_paths()
    stdlib = {os.path.realpath(paths[k]) + os.sep for k in ("stdlib", "platstdlib") if k in paths}
    sites = {os.path.realpath(paths[k]) + os.sep for k in ("purelib", "platlib") if k in paths}
    try:
        sites.update(os.path.realpath(p) + os.sep for p in site.getsitepackages())
    except AttributeError:
        pass
    user = getattr(site, "USER_SITE", None)
    if user:
        sites.add(os.path.realpath(user) + os.sep)
    return tuple(stdlib), tuple(sites)


def module_files() -> dict[str, tuple[int, int, int]]:
    """{file: (inode, mtime_ns, size)} of every loaded module outside the standard library
    (installed packages included): an edit to any of them replaces the zygote (the standard
    library changes only with Python)."""
    stdlib, sites = _stdlib_dirs()
    out: dict[str, tuple[int, int, int]] = {}
    for module in list(sys.modules.values()):
        path = getattr(module, "__file__", None)
        if not isinstance(path, str) or path in out:
            continue
        real = os.path.realpath(path)
        if real.startswith(stdlib) and not real.startswith(sites):
            continue
        try:
            st = os.stat(path)
        except OSError:
            continue
        out[path] = (st.st_ino, st.st_mtime_ns, st.st_size)
    return out


def changed_file(stamps: dict[str, tuple[int, int, int]]) -> str | None:
    for path, stamp in stamps.items():
        try:
            st = os.stat(path)
        except OSError:
            return path
        if (st.st_ino, st.st_mtime_ns, st.st_size) != stamp:
            return path
    return None


def top_level_modules() -> dict[str, str]:
    """{name: the file or package directory it was loaded from} for the loaded top-level modules."""
    out = {}
    for name, module in list(sys.modules.items()):
        if "." in name:
            continue
        path = getattr(module, "__file__", None)
        if not isinstance(path, str):
            continue
        if os.path.basename(path).startswith("__init__."):
            path = os.path.dirname(path)
        out[name] = os.path.realpath(path)
    return out


def shadowing(cwd: str, loaded: dict[str, str]) -> str | None:
    """A module in ``cwd`` (``sys.path[0]`` of the run) that a fresh interpreter would import
    instead of the one preloaded here, or None."""
    try:
        names = os.listdir(cwd)
    except OSError:
        return None
    for entry in names:
        if entry in loaded:
            candidate = os.path.join(cwd, entry)
            if os.path.isfile(os.path.join(candidate, "__init__.py")) and os.path.realpath(candidate) != loaded[entry]:
                return entry
            continue
        stem, dot, ext = entry.partition(".")
        if dot and stem in loaded and (ext == "py" or ext.endswith("so") or ext == "pyc"):
            if os.path.realpath(os.path.join(cwd, entry)) != loaded[stem]:
                return stem
    return None


class _RecordingEnviron(os._Environ):  # type: ignore[type-arg]
    """``os.environ`` while the preloads import: which variables they read (their values are then
    fixed in the zygote, so a run may be forked only when it has the same). Iterating it reads
    every variable."""

    read: set[str] = set()

    def __getitem__(self, key):  # type: ignore[no-untyped-def]
        _RecordingEnviron.read.add(key)
        return super().__getitem__(key)

    def __iter__(self):  # type: ignore[no-untyped-def]
        _RecordingEnviron.read.add("*")
        return super().__iter__()


def preload(names: list[str]) -> tuple[list[str], list[str], str | None, list[str]]:
    """Import the runner, then ``names``: (imported, failed with why, refusal, variables read)."""
    imported, failed = [], []
    original = os.environ.__class__
    os.environ.__class__ = _RecordingEnviron
    restore_random = _record_unseeded_randoms()
    try:
        for name in (*RUNNER_MODULES, *names):
            try:
                __import__(name)
            except BaseException as exc:  # a broken preload must not take the zygote down
                failed.append(f"{name}: {type(exc).__name__}: {exc}")
                continue
            if name not in RUNNER_MODULES:
                imported.append(name)
            forget_pools()  # the import may have loaded a pool's library
            why = unsafe_to_fork()
            if why is not None:
                return imported, failed, f"preloading {name!r} made it unsafe to fork: {why}", []
    finally:
        os.environ.__class__ = original
        restore_random()
    return imported, failed, None, sorted(_RecordingEnviron.read)


def make_interpreter_state() -> None:
    """In the zygote, before it freezes its objects: what the interpreter makes lazily, the first
    time a process needs it, and every run would otherwise make again. The ~120 AST node classes
    come at the first ``compile()`` of any source or the first import of ``ast`` (``inspect`` and
    ``dataclasses`` import it, torch through them). A zygote that preloads none of those and
    imports its modules from their bytecode (the default) never made them, and each spare made
    them in its rehearsal, which compiles: 0.7 ms of its 5.3 ms of CPU (median of 600 runs).
    ``ctypes`` and the C library's ``renameat2``, with which a run replaces its ``summary.json``
    without a write-back per episode (:mod:`.replace`): a fresh interpreter does not import them
    for that alone."""
    try:
        compile("", "<zygote>", "exec")
    except Exception:  # (a preload's wrapper of ``compile``, or an audit hook, that refuses)
        pass
    replace.load()


# ``random.Random()`` instances a preload made without a seed (weak references): a fresh
# interpreter would seed each from the OS, so every forked run reseeds them (``_reseed``).
_UNSEEDED_RANDOMS: list[Any] = []


def _record_unseeded_randoms() -> Any:
    """While the preloads import, note each ``random.Random`` made without a seed; returns what
    undoes the patch (runs see the class as it was)."""
    import random

    original = random.Random.__init__

    def __init__(self, x=None, *args, **kwargs):  # type: ignore[no-untyped-def]
        original(self, x, *args, **kwargs)
        if x is None:
            try:
                _UNSEEDED_RANDOMS.append(_weakref.ref(self))
            except TypeError:  # a subclass with __slots__ and no __weakref__: left as it is
                pass

    random.Random.__init__ = __init__  # type: ignore[method-assign]

    def restore() -> None:
        random.Random.__init__ = original  # type: ignore[method-assign]

    return restore


# ---------------------------------------------------------------------------- the zygote


class Zygote:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        # pid -> (run id or None, whether the server reaps it: it asks, once it has read the exit)
        self.children: dict[int, tuple[str | None, bool]] = {}
        self.retiring = False
        self.refused: str | None = None
        self.stamps: dict[str, tuple[int, int, int]] = {}
        self.loaded: dict[str, str] = {}
        self.base_path: list[str] = []
        # The pids of the next runs' processes, forked ahead of their requests, the oldest first.
        self.spares: list[int] = []
        self.wake_r, self.wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        # Each spare waits in a cgroup of its own, the run's (the server's CGROUP_SPARES).
        self.cgroup_parents: list[str] = []
        self.cgroup_prefix = ""

    def send(self, message: dict[str, object], fds: list[int] | None = None) -> None:
        data = json.dumps(message, separators=(",", ":")).encode()
        try:
            if fds:
                socket.send_fds(self.sock, [data], fds)
            else:
                self.sock.send(data)
        except OSError:
            pass  # the server is gone: the next receive sees it

    def start(self) -> None:
        started = time.monotonic()
        names = [n.strip() for n in os.environ.get(PRELOAD, "").split(",") if n.strip()]
        imported, failed, refused, env_read = preload(names)
        import_s = time.monotonic() - started
        if refused is not None:
            self.refused = refused
            self.send({"op": "refused", "pid": os.getpid(), "why": refused, "failed": failed})
            return
        make_interpreter_state()  # (before the stamps: whatever it imports is watched too)
        self.stamps = module_files()
        self.loaded = top_level_modules()
        self.base_path = list(sys.path)  # (the start directory is off it: a run gets its cwd there)
        # Long-lived objects need not be scanned by the collector again in every child (and
        # touching them would copy their pages).
        gc.collect()
        gc.freeze()
        if unsafe_to_fork() is not None:
            self.make_spares()  # refuses, saying why
            return
        self.send(
            {
                "op": "ready",
                "pid": os.getpid(),
                "preloaded": imported,
                "failed": failed,
                "modules": len(sys.modules),
                "files": len(self.stamps),
                "import_s": round(import_s, 4),
                "env_read": env_read,
            }
        )
        self.make_spares()

    def serve(self) -> int:
        _signal.set_wakeup_fd(self.wake_w, warn_on_full_buffer=False)
        _signal.signal(_signal.SIGCHLD, lambda *_: None)  # a handler, so that the wake-up fd is written
        self.reap()
        while True:
            if self.retiring and not self.children:
                return 0
            try:
                ready, _, _ = select.select([self.sock.fileno(), self.wake_r], [], [])
            except InterruptedError:
                continue
            if self.wake_r in ready:
                try:
                    while os.read(self.wake_r, 512):
                        pass
                except BlockingIOError:
                    pass
                self.reap()
            if self.sock.fileno() in ready and not self.receive():
                # The server is gone (it died, or closed us): our runs must not outlive it.
                for pid in list(self.children):
                    _killpg(pid)
                for pid in self.spares:
                    _killpg(pid)
                return 0

    def receive(self) -> bool:
        try:
            data, fds, _flags, _addr = socket.recv_fds(self.sock, MAX_MESSAGE, 4)
        except (BlockingIOError, InterruptedError):
            return True
        except OSError:
            return False
        for fd in fds:  # nothing the server sends carries descriptors
            os.close(fd)
        if not data:
            return False
        try:
            message = json.loads(data)
        except ValueError:
            return True
        op = message.get("op") if isinstance(message, dict) else None
        if op == "taken":
            self.taken(message.get("pid"), message.get("run_id"), message.get("reaps") is True)
            self.reap_asked(message.get("reap"))
        elif op == "reap":
            self.reap_asked(message.get("pids") if "pids" in message else [[message.get("pid"), True]])
        elif op == "more":  # a run went cold for want of a spare: try to fork again
            self.make_spares()
        elif op == "retire":
            self.retiring = True  # no spare more: the server closes the one it has
        return True

    def reap_asked(self, entries: object) -> None:
        """The server saw these runs end: ``[pid, report]`` each. Reaped now (or, should one still
        run, by the zygote itself once it ends, like any child the server does not reap, and
        reported). ``report`` false: the server read the exit code itself, and wants no word."""
        if not isinstance(entries, list):
            return
        for entry in entries:
            if not (isinstance(entry, list) and len(entry) == 2):
                continue
            pid, report = entry
            if isinstance(pid, int) and pid in self.children:
                self.children[pid] = (self.children[pid][0], False)
                self.reap_child(pid, report=report is not False)

    def taken(self, pid: object, run_id: object, server_reaps: bool) -> None:
        """The spare ``pid`` answered the run the server gave it: it is that run's process now
        (or, ``run_id`` None, it leaves); the next spare is forked. (A pid that is not the spare
        any more ended meanwhile: reaped and reported already.)"""
        if not isinstance(pid, int) or pid not in self.spares:
            return
        self.spares.remove(pid)
        run = run_id if isinstance(run_id, str) else None
        self.children[pid] = (run, server_reaps and run is not None)
        self.reap()  # it may have ended already
        self.make_spares()

    def make_spares(self) -> None:
        """Fork processes for the next runs until ``SPARES`` wait (a burst of starts does not wait
        for forks, and a short run's successor gets a process that is ready, not one still being
        made), after checking that forking is safe (a thread or CUDA state since the start: refused
        for good), and hand each to the server: the server's end of its socket pair and a pidfd of
        it. Each readies itself, then waits for its run."""
        while len(self.spares) < SPARES and not self.retiring and self.refused is None:
            if not self.make_spare():
                return

    def make_spare(self) -> bool:
        why = unsafe_to_fork()
        if why is not None:
            self.refused = why
            self.retiring = True
            self.send({"op": "refused", "pid": os.getpid(), "why": why, "failed": []})
            return False
        for stream in (sys.stdout, sys.stderr):  # nothing of ours may end up in a run's log
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        me = os.getpid()
        cgroup = self.cgroup_prefix + os.urandom(6).hex() if self.cgroup_parents else None
        try:
            pid = os.fork()
        except OSError as exc:  # out of processes or memory: runs start cold until a fork works
            ours.close()
            theirs.close()
            # The server starts the runs that wait for a spare cold, and asks again (``more``).
            self.send({"op": "nospare", "why": f"the zygote cannot fork: {exc}"})
            return False
        if pid == 0:
            os._exit(spare_main(self, me, theirs, cgroup))
        theirs.close()
        self.spares.append(pid)
        fds = [ours.fileno()]
        pidfd = _pidfd(pid)
        if pidfd is not None:
            fds.append(pidfd)
        # ``create_time``: read now, while the zygote is idle, so that the server reads no /proc
        # file at the run's start.
        self.send({"op": "spare", "pid": pid, "create_time": process_start_time(pid), "cgroup": cgroup}, fds)
        ours.close()  # the server's now (or nobody's: the spare then leaves)
        if pidfd is not None:
            os.close(pidfd)
        return True

    def reap(self) -> None:
        """Reap the children that ended, but those the server reaps (it asks once it has read
        their exit code, after the next run has started)."""
        pids = [pid for pid, (_, server_reaps) in self.children.items() if not server_reaps]
        for pid in [*pids, *self.spares]:
            self.reap_child(pid)

    def reap_child(self, pid: int, report: bool = True) -> None:
        try:
            if os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
                return  # still running (reaped, and reported, once it ends)
        except ChildProcessError:
            return
        # Not reaped yet, so its group id cannot be reused: whatever it left in its group goes
        # now, as the server does for its own children.
        _killpg(pid)
        try:
            _, status = os.waitpid(pid, 0)
        except ChildProcessError:
            return
        run_id, _ = self.children.pop(pid, (None, False))
        if report or pid in self.spares:
            self.send({"op": "exit", "pid": pid, "run_id": run_id, "code": os.waitstatus_to_exitcode(status)})
        if pid in self.spares:  # it died waiting (killed from outside), or its answer is on its way
            self.spares.remove(pid)
            self.make_spares()


def _pidfd(pid: int) -> int | None:
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):  # no pidfd here: the server waits for the exit message
        return None


def _killpg(pgid: int) -> None:
    try:
        os.killpg(pgid, _signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


# ---------------------------------------------------------------------------- the child


def place_in_cgroup(parents: list[str], name: str) -> dict[str, object]:
    """Make the cgroup ``name`` in each of ``parents`` and join it (the primary hierarchy
    last): the run this process becomes is in its own cgroup from its first instruction, and the
    memory it copies from the zygote is charged to it. The answer to the server: ``made`` (the
    directories are there: the server writes the run's limits in them and removes them),
    ``joined``, and ``why`` not."""
    made = False
    try:
        for parent in parents:
            os.mkdir(os.path.join(parent, name))
        made = True
        pid = str(os.getpid()).encode()
        for parent in parents:
            fd = os.open(os.path.join(parent, name, "cgroup.procs"), os.O_WRONLY)
            try:
                os.write(fd, pid)
            finally:
                os.close(fd)
    except OSError as exc:
        if not made:  # nothing joined yet: what was made goes (the server gives the run another)
            for parent in parents:
                try:
                    os.rmdir(os.path.join(parent, name))
                except OSError:
                    pass
        return {"op": "placed", "made": made, "joined": False, "why": f"{exc.filename}: {exc.strerror or exc}"}
    return {"op": "placed", "made": True, "joined": True}


def spare_main(zygote: Zygote, zygote_pid: int, sock: socket.socket, cgroup: str | None = None) -> int:
    """In the forked child, before any request: its cgroup (first: before it touches memory),
    everything a run's process needs that does not depend on the run, then the wait for the
    request. Returns the exit code."""
    try:
        os.setsid()
        set_parent_death_signal()
        if os.getppid() != zygote_pid:  # the zygote died before the signal was armed
            return EXIT_PARENT_GONE
        if cgroup is not None:
            placed = place_in_cgroup(zygote.cgroup_parents, cgroup)
            sock.send(json.dumps(placed, separators=(",", ":")).encode())
        _signal.set_wakeup_fd(-1)
        for sig in (_signal.SIGCHLD, _signal.SIGINT, _signal.SIGTERM):
            _signal.signal(sig, _signal.SIG_DFL)
        _signal.signal(_signal.SIGINT, _signal.default_int_handler)  # as a fresh interpreter has it
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        zygote.sock.detach()
        keep = sock.fileno()
        os.closerange(3, keep)  # the zygote's socket and wake-up pipe, whatever preloads opened
        os.closerange(keep + 1, _max_fd())
        _reseed()  # (the preloaded objects stay frozen: collecting them would copy their pages)
        _disown_finalizers()
    except BaseException as exc:
        _say(f"cannot become a run: {type(exc).__name__}: {exc}")
        return EXIT_CHILD_SETUP
    try:
        rehearse(zygote)
    except BaseException:  # (a KeyboardInterrupt: SIGINT from outside)
        return EXIT_CHILD_SETUP
    try:
        data = sock.recv(MAX_MESSAGE)
    except OSError:
        return 0
    if not data:
        return 0  # not needed any more: the zygote retires or ends
    try:
        request = json.loads(data)
    except ValueError:
        request = None
    fds: tuple[int, ...] = ()
    answer = malformed(request)
    if answer is None:
        # Its logs are opened here, not by the server (which would create two files on its loop
        # for each run), first (as a cold start's are) and before the answer: a run whose logs
        # cannot be opened never starts.
        fds, answer = open_own_logs(request["run_dir"])
    if answer is None:
        answer = refusal(zygote, request)
    if answer is None:
        # ``at`` (wall clock): the run's start, as a cold run's is when its process is spawned.
        answer = {"op": "started", "at": time.time()}
    try:
        sock.send(json.dumps(answer, separators=(",", ":")).encode())
    except OSError:
        answer = {"op": "gone"}  # the server is gone, or gave up on this start
    if answer["op"] != "started":
        sock.close()
        for fd in fds:
            os.close(fd)
        return 0
    return become_run(zygote, request, fds, sock.detach())


def open_own_logs(run_dir: str) -> tuple[tuple[int, ...], dict[str, object] | None]:
    """The run's stdout and stderr logs in ``run_dir``, opened as the server opens a cold run's
    (appended to, never through a link, only regular files): (their descriptors, None), or ((), the
    ``error`` answer that says why not; ``code`` ``run_file`` where an entry is in the way)."""
    try:
        return open_logs(os.path.join(run_dir, STDOUT_FILE), os.path.join(run_dir, STDERR_FILE)), None
    except UnsafeRunFile as exc:
        return (), {"op": "error", "why": log_open_failure(exc), "code": RUN_FILE}
    except OSError as exc:
        return (), {"op": "error", "why": log_open_failure(exc)}


def rehearse(zygote: Zygote) -> None:
    """In the spare, before its request: run the start's own steps on made-up input and throw the
    results away. What they write in memory (reference counts, the allocator's free lists) is
    copied from the zygote's pages now, while nobody waits for this process, rather than one
    copy-on-write fault at a time between the request and the run's first episode. Nothing here
    writes a file or changes the environment; it reads the runner's own files and
    ``/proc/self/cgroup``, and leaves the import system as the start's own steps do."""
    try:
        from . import fastjson
        from .fastjson import dumps
        from .results import MetricAggregator, utc_now_iso, validate_metrics
        from .run import RunSpec, parse_args

        message = {"run_id": "", "run_dir": os.sep, "cwd": os.sep, "env": dict(os.environ)}
        refusal(zygote, json.loads(json.dumps(message)))
        json.dumps({"op": "started", "at": time.time()}, separators=(",", ":")).encode()
        parse_args(["--run-dir", os.sep])
        spec = {"name": "", "entrypoint": "m:f", "episodes": 1, "params": {}, "workers": 1, "seed": 0, "env": {}}
        RunSpec(fastjson.loads(json.dumps(spec).encode()))
        aggregator = MetricAggregator()
        aggregator.add(validate_metrics({"m": 1.0}, 0))
        summary: dict[str, object] = {"status": "", "metrics": aggregator.summary(), "at": utc_now_iso(), "error": None}
        dumps(summary).encode()
        if sys.version_info < (3, 13) or "importlib.metadata" in sys.modules:
            import importlib

            # The start's own call then finds each finder's page copied. (From 3.13 it imports
            # importlib.metadata, dozens of modules, from the zygote's path: not in a rehearsal.)
            importlib.invalidate_caches()
        with open("/proc/self/cgroup", "rb") as f:  # as the runner checks its cgroup
            f.read().decode("utf-8", "replace").splitlines()
        _rehearse_import()
    except Exception:  # a rehearsal: whatever goes wrong here goes the same way in the start
        pass


def _rehearse_import() -> None:
    """Load a module as the start loads the eval's (its spec and module object, its source read,
    a small source compiled: an eval file often has no cached bytecode), without running it or
    registering it: the runner's own ``entrypoint.py``, read only. Nothing is written (no
    bytecode is cached: ``get_code`` is not called)."""
    import importlib.machinery
    import importlib.util

    from . import entrypoint

    spec = importlib.util.spec_from_file_location("_evalsched_rehearsal", entrypoint.__file__)
    if spec is None or not isinstance(spec.loader, importlib.machinery.SourceFileLoader):
        return
    importlib.util.module_from_spec(spec)
    spec.loader.get_data(spec.loader.path)
    spec.loader.source_to_code(_REHEARSAL_SOURCE, spec.loader.path)


_REHEARSAL_SOURCE = b"def episode(ctx, index):\n    return {'score': 1.0}\n"


def malformed(request: Any) -> dict[str, object] | None:
    """The answer to a start request that is not what the server sends, or None."""
    if not isinstance(request, dict):
        return {"op": "cold", "why": "malformed start request"}
    cwd, env, run_dir = request.get("cwd"), request.get("env"), request.get("run_dir")
    if not isinstance(cwd, str) or not isinstance(env, dict) or not isinstance(run_dir, str):
        return {"op": "cold", "why": "malformed start request"}
    return None


def refusal(zygote: Zygote, request: Any) -> dict[str, object] | None:
    """Why this process must not become the run it was asked to (the answer to the server), or
    None. What could have changed since the zygote imported its modules is looked at now."""
    answer = malformed(request)
    if answer is not None:
        return answer
    cwd = request["cwd"]
    if not os.path.isdir(cwd):
        return {"op": "error", "why": f"FileNotFoundError: no such directory (cwd {cwd!r})"}
    changed = changed_file(zygote.stamps)
    if changed is not None:
        return {"op": "stale", "why": f"{changed} changed since the zygote imported it"}
    shadow = shadowing(cwd, zygote.loaded)
    if shadow is not None:
        return {"op": "cold", "why": f"the run's cwd has its own {shadow!r}, which the zygote preloaded from elsewhere"}
    return None


def become_run(zygote: Zygote, request: dict[str, Any], fds: tuple[int, ...], notice: int) -> int:
    """In the spare, once asked: turn into the run's process, then run it. Returns the exit code.
    ``notice``: the socket to the server, kept to tell it ``done`` (``run.finish``)."""
    from . import run

    try:
        os.dup2(fds[0], 1)
        os.dup2(fds[1], 2)
        for fd in fds:
            os.close(fd)
        run.set_done_notice(notice)  # (now: where a cold run's is)
        os.chdir(request["cwd"])
        set_environment(request["env"])
        show_environment(request["env"])
        # The zygote's ``time`` computed its zone at import, from the zygote's TZ: a fresh
        # interpreter's would come from the run's. (LC_* and LANG select the zygote: they act at
        # the interpreter's start, see scheduler/zygotes.py.)
        time.tzset()
        run_dir = request["run_dir"]
        from . import __main__ as entry

        sys.argv = [entry.__file__, "--run-dir", run_dir]
        sys.orig_argv = [sys.executable, "-m", "jupyter_evalsched.runner", "--run-dir", run_dir]
        # `python -m` puts the cwd first, unless PYTHONSAFEPATH (the zygote's own: a PYTHON*
        # variable selects the zygote) tells it not to.
        sys.path[:] = [*([] if sys.flags.safe_path else [os.getcwd()]), *zygote.base_path]
        import importlib

        importlib.invalidate_caches()  # directory listings the zygote cached may be stale: user code is fresh
    except BaseException as exc:
        _say(f"cannot become the run: {type(exc).__name__}: {exc}")
        return EXIT_CHILD_SETUP
    from .run import main_checked

    code = main_checked()
    entry._exit(code)
    return code  # not reached: _exit leaves


def _say(text: str) -> None:
    try:
        os.write(2, f"evalsched zygote: {text}\n".encode())
    except OSError:
        pass


def _disown_finalizers() -> None:
    """What the zygote's objects hold is the zygote's: a run does not finalize it at its exit (a
    preload's temporary directory would be removed under the zygote, and torch's 134 operator
    libraries would be torn down for nothing), as a multiprocessing child does not run its
    parent's finalizers. The run's own finalizers and ``atexit`` handlers run as usual, and so do
    those its preloads registered as they were imported (as in a cold run that imports them: a
    library's handler acts on what the run made, a lock file it holds, say)."""
    weakref = sys.modules.get("weakref")  # (not loaded: the zygote made no finalizer)
    if weakref is not None:
        weakref.finalize._registry = {}
    util = sys.modules.get("multiprocessing.util")
    if util is not None:
        try:
            util._finalizer_registry.clear()
            util._run_after_forkers()
        except Exception:
            pass


def set_environment(env: dict[str, str]) -> None:
    """``os.environ`` becomes ``env``: only what differs is changed (most of a run's environment is
    the zygote's own, and every change is a ``putenv``)."""
    for key in [k for k in os.environ if k not in env]:
        del os.environ[key]
    for key, value in env.items():
        if os.environ.get(key) != value:
            os.environ[key] = value


ENV_RESERVE = "EVALSCHED_ENV_RESERVE"  # room in the zygote's initial environment, see show_environment

# How much of the environment block a run must rewrite: the zygote's own variables end there and
# NULs follow (clear_env_reserve). None: the whole block (the reserve was not cleared).
_env_in_use: int | None = None


def _env_block() -> tuple[int, int] | None:
    """Where this process's initial environment block lies: (env_start, env_end), or None."""
    fields = stat_fields()
    if fields is None:
        return None
    try:
        start, end = int(fields[47]), int(fields[48])  # env_start, env_end (fields 50 and 51)
    except (IndexError, ValueError):
        return None
    return (start, end) if 0 < start < end else None


def clear_env_reserve() -> None:
    """At the zygote's start, once: the reserve's value in the environment block becomes NULs
    and the variable leaves ``os.environ``. A run then rewrites only the part of the block in use
    (``show_environment``): writing the whole reserve copied each of its pages from the zygote's
    (with the padding built in memory first), some 80 page faults per run on its start path."""
    global _env_in_use
    value = os.environ.pop(ENV_RESERVE, None)  # (also unset for C code: the block's entry goes)
    where = _env_block()
    if not value or where is None:
        return
    start, end = where
    marker = f"{ENV_RESERVE}=".encode()
    try:
        fd = os.open("/proc/self/mem", os.O_RDWR | os.O_CLOEXEC)
        try:
            block = os.pread(fd, end - start, start)
            at = block.find(b"\0" + marker) + 1
            if at <= 0 and block.startswith(marker):
                at = 0
            elif at <= 0:
                return
            first = at + len(marker)
            last = block.find(b"\0", first)
            if last < 0:
                return
            os.pwrite(fd, bytes(last - first), start + first)
            # The end of the last variable: the server puts the reserve last, so where its value began.
            _env_in_use = len((block[:first] + bytes(last - first) + block[last:]).rstrip(b"\0"))
        finally:
            os.close(fd)
    except OSError:
        return


def detach_environment_strings() -> None:
    """In the zygote, before any fork: every variable gets a copy of its own on the heap. C code's
    ``environ`` pointed into the initial environment block, which each run rewrites with its own
    layout (``show_environment``): a variable the run did not change then read, through
    ``getenv``, as missing or as another's text (``TZ`` for ``time.tzset``, a native library's
    settings)."""
    for key, value in list(os.environb.items()):
        os.putenv(key, value)  # (setenv: a copy)


def show_environment(env: dict[str, str]) -> bool:
    """Make ``/proc/<pid>/environ`` show the run's environment, as a fresh interpreter's does.

    That file is the process's initial environment block, which ``os.environ`` never changes: a
    forked run would show the zygote's, and so would every process it forks without exec. The
    server's clean-up finds a run's leftovers by ``EVALSCHED_RUN_ID`` there (on hosts without
    cgroups), and other tools read it too. So the block is rewritten in place, through
    ``/proc/self/mem`` (the zygote starts with ``EVALSCHED_ENV_RESERVE`` padding it, room for
    the run's own variables); the rest of the block is NULs. False when it could not be done
    (the environment does not fit, or ``/proc`` refuses)."""
    where = _env_block()
    if where is None:
        return False
    start, end = where
    block = b"".join(os.fsencode(f"{k}={v}") + b"\0" for k, v in env.items())  # (as os.environ encodes)
    if len(block) > end - start:
        return False
    # Past the part in use the block is NULs already (clear_env_reserve): its pages stay shared.
    in_use = end - start if _env_in_use is None else min(_env_in_use, end - start)
    try:
        fd = os.open("/proc/self/mem", os.O_RDWR)
        try:
            os.pwrite(fd, block + b"\0" * max(0, in_use - len(block)), start)
        finally:
            os.close(fd)
    except OSError:
        return False
    return True


def _max_fd() -> int:
    try:
        return os.sysconf("SC_OPEN_MAX")
    except (OSError, ValueError):
        return 65536


def _reseed() -> None:
    """A fresh interpreter seeds its generators from the OS: so does every forked run. (A module
    the zygote did not load seeds itself when the run imports it.)"""
    random = sys.modules.get("random")
    if random is not None:
        random.seed()  # the module's own generator (random._inst)
        for ref in _UNSEEDED_RANDOMS:  # and those the preloads made without a seed
            made = ref()
            if made is not None:
                try:
                    made.seed()
                except Exception:
                    pass
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        try:
            numpy.random.seed()
        except Exception:
            pass
    torch = sys.modules.get("torch")
    if torch is not None:
        try:
            torch.default_generator.seed()  # the CPU generator (torch.seed() also visits devices: slow)
        except Exception:
            pass


def leave_start_directory() -> None:
    """Takes the directory the zygote started in off ``sys.path``, moves to ``/`` and removes the
    directory (empty, the server's ``START_DIR``), before anything is preloaded. A zygote killed
    later then leaves nothing in the temporary directory, and no process of ours keeps on its
    ``sys.path`` a path in ``/tmp`` that another user could make again, with modules in it, once
    it is gone. (A run gets its own cwd first on ``sys.path``: become_run.)

    Off the path goes every entry in the directory: ``python -m``'s, and the empty or relative
    ``PYTHONPATH`` entries that the interpreter made absolute from it (a trailing ``:``). They
    named the empty directory: nothing was imported from them. Relative entries go too: from
    ``/`` they would name something else. (The server gives the zygote no empty or relative
    ``PYTHONPATH`` entry: one with ``..`` would lead out of the directory.)"""
    start = os.environ.pop(START_DIR, None)
    if not start:
        return  # (not started by a server: nothing of ours to leave)
    places = {start, os.path.realpath(start)}
    try:
        places.add(os.getcwd())  # (what -m put first: the physical path)
    except OSError:
        pass  # removed already: the server gave up on this zygote while it started
    places.discard("/")

    def in_start_directory(entry: object) -> bool:
        if not isinstance(entry, str):
            return False
        return not os.path.isabs(entry) or any(entry == p or entry.startswith(p + os.sep) for p in places)

    sys.path[:] = [entry for entry in sys.path if not in_start_directory(entry)]
    try:
        os.chdir("/")
        os.rmdir(start)
    except OSError:
        pass  # the server removes it at the zygote's end


def main() -> int:
    leave_start_directory()  # (first: a zygote whose server is gone leaves nothing either)
    set_parent_death_signal()
    expected = expected_parent_pid()
    if parent_is_gone(expected):
        return EXIT_PARENT_GONE
    try:
        fd = int(os.environ.pop(ZYGOTE_FD))
    except (KeyError, ValueError):
        sys.stderr.write(f"evalsched zygote: {ZYGOTE_FD} is not set; the server starts the zygote\n")
        return 2
    clear_env_reserve()  # (its name stays in the initial block, the room after it NULs)
    placement = os.environ.pop(CGROUP_SPARES, "")
    detach_environment_strings()
    sock = socket.socket(fileno=fd)
    zygote = Zygote(sock)
    if placement:
        try:
            where = json.loads(placement)
            zygote.cgroup_parents = [str(p) for p in where["parents"]]
            zygote.cgroup_prefix = str(where["prefix"])
        except (ValueError, KeyError, TypeError):
            pass  # no placement: the server moves each run itself
    zygote.start()
    if zygote.refused is not None:
        return 0
    return zygote.serve()


if __name__ == "__main__":
    sys.exit(main())
