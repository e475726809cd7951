"""One cgroup per run: kill everything a run started, limit and measure its host memory.

A process group is not enough: a worker that calls ``setsid()`` (or double-forks and clears its
environment) leaves it, and ``killpg`` misses it. Cgroup membership is inherited across fork and
cannot be left without write access to cgroupfs, so killing "everything in the run's cgroup" is
complete. The same cgroup carries the run's memory limit, so the kernel's OOM kill stays inside
the run, and its counters tell afterwards that it was an OOM and how high the run went.

Hosts differ, so :meth:`Cgroups.detect` probes rather than assumes:

- pure cgroup v2 (often a systemd-delegated subtree): one hierarchy (``"v2"``) for membership,
  ``cgroup.kill`` and ``memory.max``;
- hybrid: a controller-less v2 hierarchy (``"unified"``) for membership and ``cgroup.kill``, plus
  the v1 ``memory`` hierarchy for the limit (and v1 ``freezer`` only where ``cgroup.kill`` is
  missing);
- v1 only: ``memory`` and/or ``freezer`` (``pids`` only when neither is there);
- nothing writable: mode ``"none"``; the caller falls back to process groups.

Run cgroups are children of the server's *own* cgroup in each hierarchy (where it is allowed to
create them), in a namespace directory: ``<own cgroup>/<namespace>/<run_id>``.
``CgroupSupport.parents`` holds those namespace directories, the exact directories that run
cgroups are created in, so a ``Cgroups(support)`` rebuilt from a ``CgroupSupport`` needs nothing
else.

Creating a run cgroup is on the path that starts a run: a few ``mkdir`` and writes, nothing more.
"""

from __future__ import annotations

import errno
import logging
import os
import secrets
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

from jupyter_evalsched import contract

log = logging.getLogger(__name__)

MiB = 1024 * 1024
# v1 reports "no limit" as a huge page-aligned number (LONG_MAX rounded down), v2 as "max".
_UNLIMITED_BYTES = 1 << 62
_V2_KEYS = ("v2", "unified")
_V1_KEYS = ("memory", "freezer", "pids")
# Membership is read from the first of these that the run has: every process is in all of them.
_PRIMARY_ORDER = ("v2", "unified", "memory", "freezer", "pids")
_PROBE_LIMIT = 64 * MiB
# Controllers a v1 mount can carry (its options also hold mount flags and name=...).
_V1_CONTROLLERS = frozenset(
    {"cpu", "cpuacct", "cpuset", "memory", "devices", "freezer", "net_cls", "net_prio", "blkio", "io"}
    | {"perf_event", "hugetlb", "pids", "rdma", "misc", "debug"}
)
_FALLBACK_HINT = (
    "runs fall back to process groups; run the server in a delegated cgroup "
    "(systemd-run --user --scope -p Delegate=yes ...) or set EvalSchedApp.cgroup_parent"
)


class CgroupError(Exception):
    """A cgroup could not be made or used; the message says why."""


@dataclass(frozen=True)
class CgroupSupport:
    mode: str  # "v2" | "hybrid" | "v1" | "none"
    memory: bool  # memory limits, peaks and OOM counts work for run cgroups
    kill: str  # "cgroup.kill" | "freezer" | "signal" | "none"
    detail: str  # one human line: what was found and, when degraded, what to do
    # hierarchy ("v2", "unified", "memory", "freezer", "pids") -> the directory run cgroups are made in
    parents: dict[str, str] = field(default_factory=dict)


NO_SUPPORT = CgroupSupport("none", False, "none", "cgroups not detected", {})


# --------------------------------------------------------------------------- planning (pure)


def _unescape(field_text: str) -> str:
    # /proc/self/mounts writes space, tab, newline and backslash as \ooo octal escapes.
    out: list[str] = []
    i = 0
    while i < len(field_text):
        c = field_text[i]
        chunk = field_text[i + 1 : i + 4]
        if c == "\\" and len(chunk) == 3 and all(ch in "01234567" for ch in chunk):
            out.append(chr(int(chunk, 8)))
            i += 4
        else:
            out.append(c)
            i += 1
    return "".join(out)


def parse_mounts(mounts_text: str) -> list[tuple[str, str, frozenset[str]]]:
    """``(mount point, fs type, options)`` of every cgroup/cgroup2 mount, in file order."""
    found: list[tuple[str, str, frozenset[str]]] = []
    for line in mounts_text.splitlines():
        parts = line.split()
        if len(parts) >= 4 and parts[2] in ("cgroup", "cgroup2"):
            found.append((_unescape(parts[1]), parts[2], frozenset(parts[3].split(","))))
    return found


def parse_self_cgroup(self_cgroup_text: str) -> dict[str, str]:
    """Controller (``""`` for the v2 line ``0::``) -> this process's cgroup path in it."""
    paths: dict[str, str] = {}
    for line in self_cgroup_text.splitlines():
        parts = line.strip().split(":", 2)
        if len(parts) != 3:
            continue
        _hier_id, controllers, path = parts
        for controller in controllers.split(",") if controllers else [""]:
            paths.setdefault(controller, path)
    return paths


def _join(mount_point: str, cgroup_path: str) -> str:
    rel = cgroup_path.strip("/")
    return os.path.join(mount_point, rel) if rel else mount_point


def _plan(mounts_text: str, self_cgroup_text: str) -> dict[str, tuple[str, str]]:
    mounts = parse_mounts(mounts_text)
    own = parse_self_cgroup(self_cgroup_text)
    v1_mounts: dict[str, str] = {}
    has_v1_controllers = False
    v2_mount: str | None = None
    for mount_point, fstype, options in mounts:
        if fstype == "cgroup2":
            v2_mount = v2_mount or mount_point
            continue
        # A v1 hierarchy without controllers (name=systemd) carries nothing we can use.
        controllers = options & _V1_CONTROLLERS
        has_v1_controllers = has_v1_controllers or bool(controllers)
        for controller in controllers:
            v1_mounts.setdefault(controller, mount_point)
    planned: dict[str, tuple[str, str]] = {}
    if v2_mount is not None and "" in own:
        planned["unified" if has_v1_controllers else "v2"] = (v2_mount, own[""])
    for controller in _V1_KEYS:
        if controller in v1_mounts and controller in own:
            planned[controller] = (v1_mounts[controller], own[controller])
    return planned


def plan(mounts_text: str, self_cgroup_text: str) -> dict[str, str]:
    """Candidate parents of run cgroups: hierarchy -> this process's own cgroup directory in it.

    ``"v2"`` on a pure v2 host, ``"unified"`` for the v2 hierarchy of a hybrid host (one with v1
    controllers mounted too), and ``"memory"``, ``"freezer"``, ``"pids"`` for those v1 controllers.
    Pure: nothing is read or checked on disk (see :func:`plan_mode` for the mode this implies)."""
    return {name: _join(mount, path) for name, (mount, path) in _plan(mounts_text, self_cgroup_text).items()}


def plan_mode(parents: dict[str, str]) -> str:
    """The mode a set of hierarchies (keys of :func:`plan` or of ``CgroupSupport.parents``) means."""
    if "v2" in parents:
        return "v2"
    if "unified" in parents:
        return "hybrid"
    if any(k in parents for k in _V1_KEYS):
        return "v1"
    return "none"


# --------------------------------------------------------------------------- file helpers


def _read(path: str | Path) -> str:
    with open(path) as f:
        return f.read()


def _write(path: str | Path, text: str) -> None:
    # One write(2), no O_CREAT: cgroupfs takes one value per write, and a missing interface file
    # must fail rather than create a plain file (a directory that is not a cgroup).
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def _keyed(text: str, key: str) -> int | None:
    # "key value" lines (cgroup.events, memory.events, memory.oom_control)
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0] == key:
            try:
                return int(parts[1])
            except ValueError:
                return None
    return None


def _bytes_value(text: str) -> int | None:
    text = text.strip()
    if text in ("", "max"):
        return None
    try:
        value = int(text)
    except ValueError:
        return None
    return None if value >= _UNLIMITED_BYTES else value


def _mb_up(nbytes: int) -> int:
    return -(-nbytes // MiB)


def _procs(directory: str | Path) -> set[int]:
    try:
        text = _read(os.path.join(directory, "cgroup.procs"))
    except (FileNotFoundError, ProcessLookupError):
        return set()
    return {int(p) for p in text.split()}


def _subtree_procs(directory: str | Path) -> set[int]:
    # A run running as root may have made cgroups of its own below its run cgroup.
    pids = _procs(directory)
    try:
        with os.scandir(directory) as it:
            subdirs = [e.path for e in it if e.is_dir(follow_symlinks=False)]
    except FileNotFoundError:
        return pids
    for sub in subdirs:
        pids |= _subtree_procs(sub)
    return pids


def _rmdir_tree(directory: str | Path, wait_until: float) -> bool:
    """rmdir ``directory`` and any cgroups below it, deepest first. True when it is gone."""
    try:
        with os.scandir(directory) as it:
            subdirs = [e.path for e in it if e.is_dir(follow_symlinks=False)]
    except FileNotFoundError:
        return True
    except OSError:
        subdirs = []  # rmdir below says why
    for sub in subdirs:
        _rmdir_tree(sub, wait_until)
    delay = 0.0005
    while True:
        try:
            os.rmdir(directory)
            return True
        except FileNotFoundError:
            return True
        except OSError as exc:
            # EBUSY while the last task is still exiting; anything else will not go away.
            if exc.errno != errno.EBUSY or time.monotonic() >= wait_until:
                log.warning("cannot remove cgroup %s: %s", directory, exc)
                return False
        time.sleep(delay)
        delay = min(delay * 2, 0.01)


def _kill_members(pids: set[int], directories: list[str]) -> None:
    """SIGKILL the pids that are (still) members of ``directories``.

    A pid read from cgroup.procs may exit and be reused before we signal it: pin each process
    with a pidfd first, then signal only those still listed, through their pidfd."""
    pidfds: dict[int, int] = {}
    try:
        for pid in pids:
            try:
                pidfds[pid] = os.pidfd_open(pid)
            except ProcessLookupError:
                pass
            except OSError:  # no pidfd (old kernel): plain kill, a tiny reuse window
                _plain_kill(pid)
        if not pidfds:
            return
        members: set[int] = set()
        for directory in directories:
            members |= _subtree_procs(directory)
        for pid, fd in pidfds.items():
            if pid in members:
                try:
                    signal.pidfd_send_signal(fd, signal.SIGKILL)
                except ProcessLookupError:
                    pass
    finally:
        for fd in pidfds.values():
            os.close(fd)


def _plain_kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _sleep_backoff(delay: float) -> float:
    time.sleep(delay)
    return min(delay * 2, 0.01)


# --------------------------------------------------------------------------- one run's cgroup


class RunCgroup:
    """The cgroup directories of one run, one per hierarchy in use."""

    def __init__(
        self,
        run_id: str,
        paths: dict[str, Path],
        *,
        kill_method: str,
        memory_kind: str | None,
        memory_limit_mb: int | None = None,
    ) -> None:
        self.run_id = run_id
        self.paths = paths
        self.memory_limit_mb = memory_limit_mb
        self.kill_method = kill_method
        # "v1": the "memory" hierarchy; "v2": memory.* files of the v2 directory; None: no memory.
        self.memory_kind = memory_kind

    def __repr__(self) -> str:
        return f"RunCgroup({self.run_id!r}, {sorted(self.paths)}, memory_limit_mb={self.memory_limit_mb})"

    @property
    def primary(self) -> Path:
        for key in _PRIMARY_ORDER:
            if key in self.paths:
                return self.paths[key]
        raise CgroupError(f"run {self.run_id} has no cgroup")  # never: paths is not empty

    def _v2_dir(self) -> Path | None:
        return self.paths.get("v2") or self.paths.get("unified")

    def _memory_file(self, v1_name: str, v2_name: str) -> Path | None:
        if self.memory_kind == "v1" and "memory" in self.paths:
            return self.paths["memory"] / v1_name
        v2 = self._v2_dir()
        if self.memory_kind == "v2" and v2 is not None:
            return v2 / v2_name
        return None

    # ---- membership

    def procs_files(self) -> list[str]:
        """Every cgroup.procs file of this run: a process joins by writing its pid to each, the
        primary one (membership, kill) last: a process found in the primary is in all of them."""
        ordered = [p for p in self.paths.values() if p != self.primary] + [self.primary]
        return [str(p / "cgroup.procs") for p in ordered]

    def add(self, pid: int) -> None:
        """Move ``pid`` (and so its future children) into every hierarchy of the run."""
        for procs in self.procs_files():
            try:
                _write(procs, str(pid))
            except ProcessLookupError as exc:
                raise CgroupError(f"cannot add process {pid} to run {self.run_id}: the process is gone") from exc
            except OSError as exc:
                raise CgroupError(f"cannot add process {pid} to {procs}: {exc.strerror or exc}") from exc

    def pids(self) -> set[int]:
        return _procs(self.primary)

    def populated(self) -> bool:
        v2 = self._v2_dir()
        if v2 is not None:
            try:
                return _keyed(_read(v2 / "cgroup.events"), "populated") == 1
            except FileNotFoundError:
                return False
        return bool(_subtree_procs(self.primary))

    def _all_pids(self) -> set[int]:
        pids: set[int] = set()
        for path in self.paths.values():
            pids |= _subtree_procs(path)
        return pids

    def _empty(self) -> bool:
        return not self.populated() and not self._all_pids()

    # ---- killing

    def kill(self, timeout: float = 2.0) -> set[int]:
        """SIGKILL everything in the run's cgroup; wait (at most ``timeout`` s) until it is empty.
        Returns the pids seen. Processes already gone are no error."""
        deadline = time.monotonic() + timeout
        seen = self._all_pids()
        if not seen and not self.populated():
            return seen
        done = False
        if self.kill_method == "cgroup.kill":
            done = self._kill_cgroup_kill(seen, deadline)
        elif self.kill_method == "freezer":
            done = self._kill_frozen(seen, deadline)
        if not done:
            self._kill_signal_loop(seen, deadline)
        if not self._empty():
            log.warning("run %s: cgroup not empty %.1f s after SIGKILL: %s", self.run_id, timeout, self._all_pids())
        return seen

    def _wait_empty(self, seen: set[int], deadline: float) -> bool:
        delay = 0.0002
        while True:
            if self._empty():
                return True
            if time.monotonic() >= deadline:
                return False
            delay = _sleep_backoff(delay)

    def _kill_cgroup_kill(self, seen: set[int], deadline: float) -> bool:
        v2 = self._v2_dir()
        if v2 is None:
            return False
        try:
            _write(v2 / "cgroup.kill", "1")  # the whole subtree, atomically against forks
        except FileNotFoundError:
            if v2.is_dir():
                return False  # kernel < 5.14: no cgroup.kill
            return True
        except OSError as exc:
            log.warning("run %s: cgroup.kill failed (%s); signalling each process", self.run_id, exc)
            return False
        # A process that joined only a v1 hierarchy (a race in add()) is not in v2: signal it.
        stragglers = self._all_pids() - _subtree_procs(v2)
        if stragglers:
            seen |= stragglers
            _kill_members(stragglers, [str(p) for p in self.paths.values()])
        return self._wait_empty(seen, deadline)

    def _freezer(self) -> tuple[Path, str, str, str] | None:
        # (file, freeze value, thaw value, kind)
        if "freezer" in self.paths:
            return self.paths["freezer"] / "freezer.state", "FROZEN", "THAWED", "v1"
        v2 = self._v2_dir()
        if v2 is not None and (v2 / "cgroup.freeze").exists():
            return v2 / "cgroup.freeze", "1", "0", "v2"
        return None

    def _is_frozen(self, state_file: Path, kind: str) -> bool:
        if kind == "v1":
            return _read(state_file).strip() == "FROZEN"
        return _keyed(_read(state_file.parent / "cgroup.events"), "frozen") == 1

    def _kill_frozen(self, seen: set[int], deadline: float) -> bool:
        freezer = self._freezer()
        if freezer is None:
            return False
        state_file, freeze, thaw, kind = freezer
        try:
            while not self._empty():
                # Frozen, nothing can fork or exit (so no pid is reused) while we signal the list.
                _write(state_file, freeze)
                delay = 0.0002
                while not self._is_frozen(state_file, kind) and time.monotonic() < deadline:
                    delay = _sleep_backoff(delay)  # a task in D state can hold FREEZING
                pids = self._all_pids()
                seen |= pids
                for pid in pids:
                    _plain_kill(pid)
                _write(state_file, thaw)  # v1: SIGKILL is delivered once thawed
                if self._wait_empty(seen, min(deadline, time.monotonic() + 0.05)):
                    return True
                if time.monotonic() >= deadline:
                    return False
            return True
        except FileNotFoundError:
            return not any(p.is_dir() for p in self.paths.values())
        except OSError as exc:
            log.warning("run %s: freezer failed (%s); signalling each process", self.run_id, exc)
            try:
                _write(state_file, thaw)
            except OSError:
                pass
            return False

    def _kill_signal_loop(self, seen: set[int], deadline: float) -> None:
        directories = [str(p) for p in self.paths.values()]
        delay = 0.0002
        while True:
            pids = self._all_pids()
            if not pids and not self.populated():
                return
            seen |= pids
            _kill_members(pids, directories)
            if time.monotonic() >= deadline:
                return
            delay = _sleep_backoff(delay)

    # ---- memory

    def memory_peak_mb(self) -> int | None:
        return self._memory_mb("memory.max_usage_in_bytes", "memory.peak")

    def memory_current_mb(self) -> int | None:
        return self._memory_mb("memory.usage_in_bytes", "memory.current")

    def _memory_mb(self, v1_name: str, v2_name: str) -> int | None:
        value = self._memory_bytes(v1_name, v2_name)
        return None if value is None else _mb_up(value)

    def _memory_bytes(self, v1_name: str, v2_name: str) -> int | None:
        path = self._memory_file(v1_name, v2_name)
        if path is None:
            return None
        try:
            return _bytes_value(_read(path))
        except OSError:
            return None

    def oom_kills(self) -> int:
        path = self._memory_file("memory.oom_control", "memory.events")
        if path is None:
            return 0
        try:
            return _keyed(_read(path), "oom_kill") or 0
        except OSError:
            return 0

    def read_memory_limit_mb(self) -> int | None:
        """The memory limit the kernel holds now (None: unlimited or no memory support)."""
        value = self._memory_bytes("memory.limit_in_bytes", "memory.max")
        return None if value is None else value // MiB

    def set_memory_limit(self, memory_mb: int) -> int:
        """Write the limit, read it back; returns the limit in MiB the kernel holds. CgroupError
        when it cannot be set or the kernel silently kept another value."""
        if memory_mb <= 0:
            raise CgroupError(f"memory limit must be a positive number of MiB, not {memory_mb}")
        nbytes = memory_mb * MiB
        if self.memory_kind == "v1" and "memory" in self.paths:
            directory = self.paths["memory"]
            _set_checked(directory / "memory.limit_in_bytes", nbytes)
            memsw = directory / "memory.memsw.limit_in_bytes"
            if memsw.exists():  # swap accounting on: without this, swap absorbs the overrun
                try:
                    _set_checked(memsw, nbytes)
                except CgroupError as exc:
                    log.warning("run %s: %s; swap is not limited", self.run_id, exc)
        elif self.memory_kind == "v2" and (v2 := self._v2_dir()) is not None:
            _set_checked(v2 / "memory.max", nbytes)
        else:
            raise CgroupError("no memory controller for run cgroups on this host")
        limit = self.read_memory_limit_mb()
        if limit is None:
            raise CgroupError(f"memory limit of {memory_mb} MiB did not stick (the kernel reads back no limit)")
        self.memory_limit_mb = limit
        return limit

    # ---- clean-up

    def remove(self) -> None:
        """Kill what is left, then rmdir every directory. Idempotent; never raises."""
        try:
            if any(p.is_dir() for p in self.paths.values()) and not self._empty():
                self.kill()
        except Exception:
            log.warning("run %s: killing its cgroup failed", self.run_id, exc_info=True)
        wait_until = time.monotonic() + 0.5
        for path in self.paths.values():
            _rmdir_tree(path, wait_until)


def _set_checked(path: Path, nbytes: int) -> None:
    try:
        _write(path, str(nbytes))
        got = _bytes_value(_read(path))
    except OSError as exc:
        raise CgroupError(f"cannot set {path} to {nbytes}: {exc.strerror or exc}") from exc
    # The kernel rounds down to whole pages; anything further off was refused.
    if got is None or abs(got - nbytes) >= 64 * 1024:
        raise CgroupError(f"{path}: wrote {nbytes}, reads back {got if got is not None else 'no limit'}")


# --------------------------------------------------------------------------- detection


@dataclass
class _Probe:
    name: str
    ns_dir: str
    ok: bool = False
    why: str = ""
    cgroup_kill: bool = False
    v2_freeze: bool = False
    memory: bool = False
    memory_why: str = ""


def _oserror_text(path: str, exc: OSError) -> str:
    if exc.errno == errno.EROFS:
        return f"{path}: read-only file system"
    if exc.errno in (errno.EACCES, errno.EPERM):
        return f"{path}: permission denied (not delegated to uid {os.getuid()})"
    return f"{path}: {exc.strerror or exc}"


def _make_ns(ns_dir: str) -> bool:
    """mkdir the namespace directory; True when this call made it."""
    try:
        os.mkdir(ns_dir)
        return True
    except FileExistsError:
        if not os.path.isdir(ns_dir):
            raise
        return False


def _enable_v2_memory(parent: str, ns_dir: str) -> str:
    """Enable the memory controller for run cgroups (in the parent and in the namespace directory).
    Returns "" on success, else why not."""
    try:
        if "memory" not in _read(os.path.join(parent, "cgroup.controllers")).split():
            return f"memory controller not available in {parent} (not delegated)"
        for directory in (parent, ns_dir):
            control = os.path.join(directory, "cgroup.subtree_control")
            if "memory" in _read(control).split():
                continue
            try:
                _write(control, "+memory")
            except OSError as exc:
                if exc.errno == errno.EBUSY:
                    return (
                        f"cannot enable memory in {control}: {directory} holds processes (cgroup v2 'no internal "
                        "processes' rule); move the server into a leaf cgroup below it or set EvalSchedApp.cgroup_parent "
                        "to a delegated directory without processes"
                    )
                return f"cannot enable memory in {control}: {exc.strerror or exc}"
            if "memory" not in _read(control).split():
                return f"{control}: +memory did not stick"
    except OSError as exc:
        return _oserror_text(parent, exc)
    return ""


def _probe_child(probe: _Probe, parent: str, v2_memory: bool) -> None:
    """mkdir a probe child, write its settings and read them back, rmdir it."""
    child = os.path.join(probe.ns_dir, f"probe+{os.getpid()}+{secrets.token_hex(3)}")
    os.mkdir(child)
    try:
        name = probe.name
        if name in _V2_KEYS:
            _write(os.path.join(child, "cgroup.max.descendants"), "max")
            if _read(os.path.join(child, "cgroup.max.descendants")).strip() != "max":
                raise CgroupError("cgroup.max.descendants does not read back")
            probe.cgroup_kill = os.path.exists(os.path.join(child, "cgroup.kill"))
            probe.v2_freeze = os.path.exists(os.path.join(child, "cgroup.freeze"))
            if v2_memory:
                try:
                    _set_checked(Path(child) / "memory.max", _PROBE_LIMIT)
                    probe.memory = os.path.exists(os.path.join(child, "memory.events"))
                    if not probe.memory:
                        probe.memory_why = f"{child}: no memory.events"
                except CgroupError as exc:
                    probe.memory_why = str(exc)
        elif name == "memory":
            _set_checked(Path(child) / "memory.limit_in_bytes", _PROBE_LIMIT)
            memsw = Path(child) / "memory.memsw.limit_in_bytes"
            if memsw.exists():
                _set_checked(memsw, _PROBE_LIMIT)
            for needed in ("memory.max_usage_in_bytes", "memory.usage_in_bytes", "memory.oom_control"):
                _read(os.path.join(child, needed))
            probe.memory = True
        elif name == "freezer":
            _write(os.path.join(child, "freezer.state"), "THAWED")
            if _read(os.path.join(child, "freezer.state")).strip() != "THAWED":
                raise CgroupError("freezer.state does not read back")
        elif name == "pids":
            _write(os.path.join(child, "pids.max"), "max")
            if _read(os.path.join(child, "pids.max")).strip() != "max":
                raise CgroupError("pids.max does not read back")
    finally:
        os.rmdir(child)


def _can_migrate(v2_mount: str | None, own_dir: str | None, ns_dir: str) -> str:
    """Moving a process needs write access to cgroup.procs of the common ancestor of its current
    cgroup and the target (cgroup v2 delegation rule). "" when we have it, else why not."""
    if v2_mount is None or own_dir is None:
        return ""
    try:
        common = os.path.commonpath([os.path.realpath(own_dir), os.path.realpath(ns_dir)])
    except ValueError:
        return ""
    if not common.startswith(os.path.realpath(v2_mount)):
        return ""
    procs = os.path.join(common, "cgroup.procs")
    if os.path.exists(procs) and not os.access(procs, os.W_OK):
        return f"cannot move processes into {ns_dir}: no write access to {procs} (common ancestor with the server's cgroup)"
    return ""


def _probe_hierarchy(name: str, parent: str, namespace: str, *, v2_memory: bool = False) -> _Probe:
    ns_dir = os.path.join(parent, namespace)
    probe = _Probe(name, ns_dir)
    if not os.path.isfile(os.path.join(parent, "cgroup.procs")):
        probe.why = f"{parent}: not a cgroup directory"
        return probe
    made = False
    try:
        made = _make_ns(ns_dir)
        if v2_memory:
            probe.memory_why = _enable_v2_memory(parent, ns_dir)
        _probe_child(probe, parent, v2_memory and not probe.memory_why)
        probe.ok = True
    except CgroupError as exc:
        probe.why = f"{parent}: {exc}"
    except OSError as exc:
        probe.why = _oserror_text(exc.filename or parent, exc)
    if not probe.ok and made:
        try:
            os.rmdir(ns_dir)
        except OSError:
            pass
    return probe


def _none(detail: str) -> CgroupSupport:
    return CgroupSupport("none", False, "none", detail, {})


def _resolve_own(mount_point: str, cgroup_path: str) -> str:
    """The directory of our own cgroup. Without a cgroup namespace, a container may mount its own
    cgroup as the hierarchy's root, so /proc/self/cgroup's path is longer than what is under the
    mount: try its shorter tails."""
    parts = [p for p in cgroup_path.split("/") if p]
    for i in range(len(parts) + 1):
        candidate = os.path.join(mount_point, *parts[i:]) if parts[i:] else mount_point
        if os.path.isdir(candidate):
            return candidate
    return _join(mount_point, cgroup_path)


def _detect(setting: str, namespace: str, mounts_file: str, self_cgroup_file: str) -> CgroupSupport:
    if setting == "off":
        return _none("cgroups turned off (cgroup_parent = 'off'): runs use process groups")
    if not namespace or "/" in namespace or namespace in (".", ".."):
        return _none(f"invalid cgroup namespace {namespace!r}")
    try:
        mounts_text = _read(mounts_file)
    except OSError as exc:
        mounts_text = ""
        mounts_error = f"cannot read {mounts_file}: {exc.strerror or exc}"
    else:
        mounts_error = ""
    try:
        self_text = _read(self_cgroup_file)
    except OSError:
        self_text = ""
    planned = _plan(mounts_text, self_text)
    v2_mount = next((m for m, fstype, _ in parse_mounts(mounts_text) if fstype == "cgroup2"), None)
    own_v2 = next((_resolve_own(*planned[k]) for k in _V2_KEYS if k in planned), None)

    candidates: dict[str, str]
    if setting == "auto":
        if not planned:
            why = mounts_error or f"no cgroup hierarchy mounted (per {mounts_file})"
            return _none(f"{why}: {_FALLBACK_HINT}")
        candidates = {name: _resolve_own(mount, path) for name, (mount, path) in planned.items()}
    elif os.path.isabs(setting):
        if not os.path.isfile(os.path.join(setting, "cgroup.controllers")):
            return _none(f"cgroup_parent {setting} is not a cgroup v2 directory: {_FALLBACK_HINT}")
        candidates = {"v2": os.path.normpath(setting)}
    else:
        return _none(f"cgroup_parent must be 'auto', 'off' or an absolute path, not {setting!r}: {_FALLBACK_HINT}")

    notes: list[str] = []
    usable: dict[str, _Probe] = {}
    v2_key = next((k for k in _V2_KEYS if k in candidates), None)
    if v2_key is not None:
        parent = candidates[v2_key]
        probe = _probe_hierarchy(v2_key, parent, namespace, v2_memory="memory" not in candidates)
        if probe.ok:
            why = _can_migrate(v2_mount, own_v2, probe.ns_dir)
            if why:
                probe.ok, probe.why = False, why
                _rmdir_quiet(probe.ns_dir)
        if probe.ok:
            usable[v2_key] = probe
        else:
            notes.append(probe.why)
    if "memory" in candidates:
        probe = _probe_hierarchy("memory", candidates["memory"], namespace)
        if probe.ok:
            usable["memory"] = probe
        else:
            notes.append(f"memory limits unavailable: {probe.why}")
            if v2_key in usable:  # a v2 memory controller may still be there
                retry = _probe_hierarchy(v2_key, candidates[v2_key], namespace, v2_memory=True)
                if retry.ok and retry.memory:
                    usable[v2_key] = retry
    v2_probe = usable.get(v2_key) if v2_key else None
    if v2_probe is not None and v2_probe.memory_why and "memory" not in usable:
        notes.append(f"memory limits unavailable: {v2_probe.memory_why}")

    kill = "signal"
    if v2_probe is not None and v2_probe.cgroup_kill:
        kill = "cgroup.kill"
    elif v2_probe is not None and v2_probe.v2_freeze:
        kill = "freezer"
    elif "freezer" in candidates:
        probe = _probe_hierarchy("freezer", candidates["freezer"], namespace)
        if probe.ok:
            usable["freezer"] = probe
            kill = "freezer"
        else:
            notes.append(f"freezer unavailable: {probe.why}")
    if not usable and "pids" in candidates:
        probe = _probe_hierarchy("pids", candidates["pids"], namespace)
        if probe.ok:
            usable["pids"] = probe
        else:
            notes.append(probe.why)

    if not usable:
        why = "; ".join(notes) or "no usable cgroup hierarchy"
        return _none(f"no writable cgroup hierarchy ({why}): {_FALLBACK_HINT}")

    parents = {name: probe.ns_dir for name, probe in usable.items()}
    memory = any(p.memory for p in usable.values())
    if kill == "signal":
        notes.append("no cgroup.kill nor freezer: a cgroup is killed by signalling each process until it is empty")
    mode = plan_mode(parents)
    where = ", ".join(f"{name} {path}" for name, path in parents.items())
    detail = f"{mode}: run cgroups in {where}; kill by {kill}; memory limits {'on' if memory else 'off'}"
    if notes:
        detail += " (" + "; ".join(notes) + ")"
    return CgroupSupport(mode, memory, kill, detail, parents)


def _rmdir_quiet(path: str) -> None:
    try:
        os.rmdir(path)
    except OSError:
        pass


# --------------------------------------------------------------------------- the host's cgroups


class Cgroups:
    """What this host offers, and the run cgroups made with it."""

    def __init__(self, support: CgroupSupport) -> None:
        self._support = support
        if "memory" in support.parents:
            self._memory_kind: str | None = "v1"
        elif support.memory and any(k in support.parents for k in _V2_KEYS):
            self._memory_kind = "v2"
        else:
            self._memory_kind = None

    @classmethod
    def detect(
        cls,
        setting: str = "auto",
        *,
        namespace: str | None = None,
        mounts_file: str = "/proc/self/mounts",
        self_cgroup_file: str = "/proc/self/cgroup",
    ) -> Cgroups:
        """``setting``: "auto" (what this host offers), "off" (mode none), or the absolute path of a
        cgroup v2 directory to be the parent of run cgroups (a delegated subtree). Run cgroups go
        into ``<parent>/<namespace>/<run_id>``. Probes writability and reads settings back; never
        raises: a failure is mode "none" with the reason in ``detail``."""
        ns = namespace if namespace is not None else f"evalsched-{os.getuid()}"
        try:
            support = _detect(setting, ns, mounts_file, self_cgroup_file)
        except Exception as exc:  # detection must never stop the server
            log.warning("cgroup detection failed", exc_info=True)
            support = _none(f"cgroup detection failed ({exc!r}): {_FALLBACK_HINT}")
        return cls(support)

    @property
    def support(self) -> CgroupSupport:
        return self._support

    @property
    def enabled(self) -> bool:
        return self._support.mode != "none"

    def status(self) -> dict[str, object]:
        s = self._support
        return {"mode": s.mode, "memory": s.memory, "kill": s.kill, "detail": s.detail, "parents": dict(s.parents)}

    def _check(self, run_id: str) -> None:
        if not self.enabled:
            raise CgroupError(f"no cgroups on this host: {self._support.detail}")
        if not contract.is_valid_run_id(run_id):
            raise CgroupError(f"invalid run id for a cgroup: {run_id!r}")

    def _run_cgroup(self, run_id: str, paths: dict[str, Path]) -> RunCgroup:
        return RunCgroup(run_id, paths, kill_method=self._support.kill, memory_kind=self._memory_kind)

    def _ensure_namespace(self, name: str, ns_dir: str) -> None:
        # Gone since detect() (removed by hand, or by remove_namespace()): make it again.
        _make_ns(ns_dir)
        if name in _V2_KEYS and self._memory_kind == "v2":
            why = _enable_v2_memory(os.path.dirname(ns_dir), ns_dir)
            if why:
                raise CgroupError(why)

    def create(self, run_id: str, memory_mb: int | None = None) -> RunCgroup:
        """Make the run's cgroup (killing and removing a stale one of the same id first) and set its
        memory limit. CgroupError when impossible, or when a limit asked for on a host with memory
        support does not stick; on a host without it, ``memory_limit_mb`` stays None."""
        self._check(run_id)
        stale = self.existing(run_id)
        if stale is not None:
            stale.remove()
        made: dict[str, Path] = {}
        try:
            for name, ns_dir in self._support.parents.items():
                path = Path(ns_dir, run_id)
                try:
                    os.mkdir(path)
                except FileNotFoundError:
                    self._ensure_namespace(name, ns_dir)
                    os.mkdir(path)
                made[name] = path
            run = self._run_cgroup(run_id, made)
            if memory_mb is not None and self._memory_kind is not None:
                run.set_memory_limit(memory_mb)
        except (OSError, CgroupError) as exc:
            for path in made.values():
                _rmdir_tree(path, time.monotonic())
            if isinstance(exc, CgroupError):
                raise
            where = str(exc.filename) if exc.filename else "mkdir"
            raise CgroupError(f"cannot create the cgroup of run {run_id}: {_oserror_text(where, exc)}") from exc
        return run

    def existing(self, run_id: str) -> RunCgroup | None:
        """The cgroup of ``run_id`` left by an earlier server process, or None."""
        if not self.enabled or not contract.is_valid_run_id(run_id):
            return None
        paths = {name: Path(ns_dir, run_id) for name, ns_dir in self._support.parents.items()}
        paths = {name: path for name, path in paths.items() if path.is_dir()}
        if not paths:
            return None
        run = self._run_cgroup(run_id, paths)
        run.memory_limit_mb = run.read_memory_limit_mb()
        return run

    def stale_run_ids(self) -> list[str]:
        """Run ids that have a cgroup under our namespace (in any hierarchy)."""
        ids: set[str] = set()
        for ns_dir in self._support.parents.values():
            try:
                with os.scandir(ns_dir) as it:
                    ids.update(e.name for e in it if e.is_dir(follow_symlinks=False))
            except FileNotFoundError:
                continue
        return sorted(i for i in ids if contract.is_valid_run_id(i))

    def remove_empty_siblings(self, prefix: str) -> int:
        """rmdir the *empty* namespaces beside ours whose names start with ``prefix`` (other runs
        directories' schedulers of this user, left by servers that were killed). Safe while their
        servers live: rmdir refuses a namespace that holds a run, and ``create`` makes a missing one
        again. Returns how many were removed."""
        removed = 0
        for ns_dir in self._support.parents.values():
            parent, own = os.path.split(ns_dir)
            try:
                entries = list(os.scandir(parent))
            except OSError:
                continue
            for entry in entries:
                if entry.name == own or not entry.name.startswith(prefix):
                    continue
                try:
                    if entry.is_dir(follow_symlinks=False):
                        os.rmdir(entry.path)
                        removed += 1
                except OSError:
                    pass  # not empty (a live scheduler's runs), or not ours to remove
        return removed

    def remove_namespace(self) -> bool:
        """rmdir the namespace directories if no run cgroup is left in them (server shutdown,
        tests). True when all are gone."""
        gone = True
        for ns_dir in self._support.parents.values():
            try:
                os.rmdir(ns_dir)
            except FileNotFoundError:
                pass
            except OSError:
                gone = False
        return gone
