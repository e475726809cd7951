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

A run's cgroup is made *before* its start (see :mod:`.cgroup_pool`): a spare process that a
zygote forked ahead places itself in a fresh cgroup while it waits, and cold starts take one from a
small pool made ahead. Such a cgroup is named ``c+<server token>+<random>`` (never a run id), and
the run's id is given to it at the start, when its limits are written (:meth:`RunCgroup.assign`).
A run's cgroup is found again after a restart through its process (``/proc/<pid>/cgroup``).

This module holds a run's cgroup (:class:`RunCgroup`) and the host's (:class:`Cgroups`); what the
host offers is found by :mod:`.cgroup_detect`, and the files are read and written by
:mod:`.cgroupfs`.
"""

from __future__ import annotations

import fcntl
import logging
import os
import secrets
import threading
import time
from pathlib import Path

from jupyter_evalsched import contract

from .cgroup_detect import CgroupSupport, detect, enable_v2_memory, make_namespace, no_support, parse_self_cgroup
from .cgroupfs import (
    FALLBACK_HINT,
    PRIMARY_ORDER,
    V2_KEYS,
    CgroupError,
    MiB,
    bytes_value,
    keyed_value,
    kill_members,
    mb_up,
    oserror_text,
    plain_kill,
    procs_of,
    read_file,
    rmdir_tree,
    set_checked,
    sleep_backoff,
    subtree_procs,
    write_file,
)

log = logging.getLogger(__name__)

# Cgroups made ahead of their runs are named LEAF_PREFIX + <server token> + "+" + <random>: "+" is
# not a run id's character, so such a name never clashes with a run cgroup of an older version.
LEAF_PREFIX = "c+"


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
    def name(self) -> str:
        """The directory's name (the same in every hierarchy)."""
        return self.primary.name

    def assign(self, run_id: str, memory_mb: int | None) -> str:
        """The run ``run_id`` starts in this cgroup (made ahead): its limit is written and read
        back. Returns why ``memory_mb`` is not enforced ("" when it is, or when none is asked)."""
        self.run_id = run_id
        if not memory_mb:
            return ""
        if self.memory_kind is None:
            return "this host gives runs no memory cgroup"
        try:
            self.set_memory_limit(memory_mb)
        except CgroupError as exc:
            return str(exc)
        return ""

    @property
    def primary(self) -> Path:
        for key in PRIMARY_ORDER:
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
                write_file(procs, str(pid))
            except ProcessLookupError as exc:
                raise CgroupError(f"cannot add process {pid} to run {self.run_id}: the process is gone") from exc
            except OSError as exc:
                raise CgroupError(f"cannot add process {pid} to {procs}: {exc.strerror or exc}") from exc

    def pids(self) -> set[int]:
        return procs_of(self.primary)

    def populated(self) -> bool:
        v2 = self._v2_dir()
        if v2 is not None:
            try:
                return keyed_value(read_file(v2 / "cgroup.events"), "populated") == 1
            except FileNotFoundError:
                return False
        return bool(subtree_procs(self.primary))

    def _all_pids(self) -> set[int]:
        pids: set[int] = set()
        for path in self.paths.values():
            pids |= subtree_procs(path)
        return pids

    def _empty(self) -> bool:
        return not self.populated() and not self._all_pids()

    def holds_processes(self) -> bool:
        return not self._empty()

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
            delay = sleep_backoff(delay)

    def _kill_cgroup_kill(self, seen: set[int], deadline: float) -> bool:
        v2 = self._v2_dir()
        if v2 is None:
            return False
        try:
            write_file(v2 / "cgroup.kill", "1")  # the whole subtree, atomically against forks
        except FileNotFoundError:
            if v2.is_dir():
                return False  # kernel < 5.14: no cgroup.kill
            return True
        except OSError as exc:
            log.warning("run %s: cgroup.kill failed (%s); signalling each process", self.run_id, exc)
            return False
        # A process that joined only a v1 hierarchy (a race in add()) is not in v2: signal it.
        stragglers = self._all_pids() - subtree_procs(v2)
        if stragglers:
            seen |= stragglers
            kill_members(stragglers, [str(p) for p in self.paths.values()])
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
            return read_file(state_file).strip() == "FROZEN"
        return keyed_value(read_file(state_file.parent / "cgroup.events"), "frozen") == 1

    def _kill_frozen(self, seen: set[int], deadline: float) -> bool:
        freezer = self._freezer()
        if freezer is None:
            return False
        state_file, freeze, thaw, kind = freezer
        try:
            while not self._empty():
                # Frozen, nothing can fork or exit (so no pid is reused) while we signal the list.
                write_file(state_file, freeze)
                delay = 0.0002
                while not self._is_frozen(state_file, kind) and time.monotonic() < deadline:
                    delay = sleep_backoff(delay)  # a task in D state can hold FREEZING
                pids = self._all_pids()
                seen |= pids
                for pid in pids:
                    plain_kill(pid)
                write_file(state_file, thaw)  # v1: SIGKILL is delivered once thawed
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
                write_file(state_file, thaw)
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
            kill_members(pids, directories)
            if time.monotonic() >= deadline:
                return
            delay = sleep_backoff(delay)

    # ---- memory

    def memory_peak_mb(self) -> int | None:
        return self._memory_mb("memory.max_usage_in_bytes", "memory.peak")

    def memory_current_mb(self) -> int | None:
        return self._memory_mb("memory.usage_in_bytes", "memory.current")

    def _memory_mb(self, v1_name: str, v2_name: str) -> int | None:
        value = self._memory_bytes(v1_name, v2_name)
        return None if value is None else mb_up(value)

    def _memory_bytes(self, v1_name: str, v2_name: str) -> int | None:
        path = self._memory_file(v1_name, v2_name)
        if path is None:
            return None
        try:
            return bytes_value(read_file(path))
        except OSError:
            return None

    def oom_kills(self) -> int:
        path = self._memory_file("memory.oom_control", "memory.events")
        if path is None:
            return 0
        try:
            return keyed_value(read_file(path), "oom_kill") or 0
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
            set_checked(directory / "memory.limit_in_bytes", nbytes)
            memsw = directory / "memory.memsw.limit_in_bytes"
            if memsw.exists():  # swap accounting on: without this, swap absorbs the overrun
                try:
                    set_checked(memsw, nbytes)
                except CgroupError as exc:
                    log.warning("run %s: %s; swap is not limited", self.run_id, exc)
        elif self.memory_kind == "v2" and (v2 := self._v2_dir()) is not None:
            set_checked(v2 / "memory.max", nbytes)
        else:
            raise CgroupError("no memory controller for run cgroups on this host")
        limit = self.read_memory_limit_mb()
        if limit is None:
            raise CgroupError(f"memory limit of {memory_mb} MiB did not stick (the kernel reads back no limit)")
        self.memory_limit_mb = limit
        return limit

    # ---- clean-up

    def remove(self) -> bool:
        """Kill what is left, give back the memory still charged to it, then rmdir every
        directory. Idempotent; never raises. True when every directory is gone (False: a process
        still in it, slow to die: a GPU driver's teardown, an uninterruptible wait)."""
        if self._remove_if_plainly_empty():
            return True
        try:
            if any(p.is_dir() for p in self.paths.values()) and not self._empty():
                self.kill()
        except Exception:
            log.warning("run %s: killing its cgroup failed", self.run_id, exc_info=True)
        self.reclaim()
        wait_until = time.monotonic() + 0.5
        return all([rmdir_tree(path, wait_until) for path in self.paths.values()])

    def _remove_if_plainly_empty(self) -> bool:
        """A run's usual end, in a few system calls: no process in its cgroup (v2's
        ``populated`` covers the v2 directory's subtree; a directory of another hierarchy has
        no cgroup below it, which its link count tells, and nothing in its own
        ``cgroup.procs``), then its memory given back and each directory removed, v2's last:
        through v2, ``kill`` reaches the whole subtree at once. False where anything is
        otherwise, or fails: ``remove`` then takes its whole way."""
        v2 = self._v2_dir()
        try:
            if v2 is not None and keyed_value(read_file(v2 / "cgroup.events"), "populated") != 0:
                return False
            for path in self.paths.values():
                # (A cgroup file system counts a directory's subdirectories in its links.)
                if path != v2 and (os.stat(path).st_nlink != 2 or procs_of(path)):
                    return False
        except OSError:
            return False
        self.reclaim()
        for path in sorted(self.paths.values(), key=lambda path: path == v2):
            try:
                os.rmdir(path)
            except OSError:
                return False
        return True

    def remove_if_empty(self) -> bool:
        """``remove`` without a kill and without a wait (a cgroup whose process was killed and
        would not die yet: a retry). True when every directory is gone."""
        if any(p.is_dir() for p in self.paths.values()) and not self._empty():
            return False
        self.reclaim()
        now = time.monotonic()
        return all([rmdir_tree(path, now) for path in self.paths.values()])

    def reclaim(self) -> None:
        """Reclaim the page cache still charged to the (empty) cgroup: a memory cgroup removed
        with pages charged stays in the kernel as a *dying* cgroup until they are reclaimed, and
        a run writes files (its logs, its results), so without this every run left one."""
        try:
            if self.memory_kind == "v1" and "memory" in self.paths:
                write_file(self.paths["memory"] / "memory.force_empty", "0")
            elif self.memory_kind == "v2" and (v2 := self._v2_dir()) is not None:
                current = bytes_value(read_file(v2 / "memory.current"))
                if current:
                    write_file(v2 / "memory.reclaim", str(current))
        except OSError:
            pass  # (no such file on this kernel, a task still exiting, or less could be reclaimed)


def remove_each(cgroups: list[RunCgroup]) -> list[RunCgroup]:
    """Remove each of these cgroups that would not go before (killed already: no kill again and
    no wait, so that one stuck process does not hold up every later removal); returns those
    that still would not go."""
    return [cgroup for cgroup in cgroups if not cgroup.remove_if_empty()]


def _remove_abandoned(ns_dir: str) -> bool:
    """Remove a namespace directory and the cgroups in it if no live server holds it (its lock is
    free) and none of them holds a process. True when it is gone."""
    try:
        fd = os.open(ns_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return False  # its server lives
        with os.scandir(ns_dir) as it:
            leaves = [e.path for e in it if e.is_dir(follow_symlinks=False)]
        for leaf in leaves:
            name = os.path.basename(leaf)
            if not (name.startswith(LEAF_PREFIX) or contract.is_valid_run_id(name)):
                continue
            for control, value in (("memory.force_empty", "0"), ("memory.reclaim", None)):
                _give_back_memory(Path(leaf), control, value)
            try:
                os.rmdir(leaf)
            except OSError:
                pass  # a process in it (a detached run), or not a cgroup of ours
        os.rmdir(ns_dir)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def _give_back_memory(leaf: Path, control: str, value: str | None) -> None:
    """Reclaim what is still charged to an empty cgroup before its removal (v1 ``force_empty``,
    v2 ``reclaim`` of ``memory.current``), so that it does not stay behind as a dying cgroup."""
    try:
        if value is None:
            value = read_file(leaf / "memory.current").strip()
            if value in ("", "0"):
                return
        write_file(leaf / control, value)
    except OSError:
        pass  # no such file here, or nothing more to reclaim


# --------------------------------------------------------------------------- the host's cgroups


class Cgroups:
    """What this host offers, and the run cgroups made with it."""

    def __init__(self, support: CgroupSupport) -> None:
        self._support = support
        # The names of the cgroups this instance makes ahead start with this: a restarted server
        # removes the ones of earlier instances (their runs are gone) and never its own.
        self.leaf_prefix = f"{LEAF_PREFIX}{secrets.token_hex(4)}+"
        # The namespace directories, flock'ed (shared) while this server lives, by hierarchy.
        self._held: dict[str, int] = {}
        self._held_lock = threading.Lock()  # (held again from the pool's thread and the loop)
        if "memory" in support.parents:
            self._memory_kind: str | None = "v1"
        elif support.memory and any(k in support.parents for k in V2_KEYS):
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
            support = detect(setting, ns, mounts_file, self_cgroup_file)
        except Exception as exc:  # detection must never stop the server
            log.warning("cgroup detection failed", exc_info=True)
            support = no_support(f"cgroup detection failed ({exc!r}): {FALLBACK_HINT}")
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
        """Make the namespace again, gone since detect() (removed by hand, or by another server
        of this runs directory as it stopped), and hold it: a namespace not held would be taken
        for an abandoned one, and its cgroups removed, by the next server of another runs
        directory to start (its runs would then have no cgroup to join)."""
        self._make_namespace(name, ns_dir)
        self._hold(name, ns_dir)

    def _make_namespace(self, name: str, ns_dir: str) -> None:
        make_namespace(ns_dir)
        if name in V2_KEYS and self._memory_kind == "v2":
            why = enable_v2_memory(os.path.dirname(ns_dir), ns_dir)
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
        made = self._mkdir_everywhere(run_id, f"the cgroup of run {run_id}")
        run = self._run_cgroup(run_id, made)
        if memory_mb is not None and self._memory_kind is not None:
            try:
                run.set_memory_limit(memory_mb)
            except (OSError, CgroupError) as exc:
                for path in made.values():
                    rmdir_tree(path, time.monotonic())
                if isinstance(exc, CgroupError):
                    raise
                where = str(exc.filename) if exc.filename else "memory limit"
                raise CgroupError(f"cannot create the cgroup of run {run_id}: {oserror_text(where, exc)}") from exc
        return run

    def new_name(self) -> str:
        """A fresh name for a cgroup made ahead of its run (see ``leaf_prefix``)."""
        return self.leaf_prefix + secrets.token_hex(6)

    def make(self) -> RunCgroup:
        """A fresh cgroup for a run not known yet (its id and limits come with ``assign``):
        CgroupError when it cannot be made."""
        if not self.enabled:
            raise CgroupError(f"no cgroups on this host: {self._support.detail}")
        return self._run_cgroup("", self._mkdir_everywhere(self.new_name(), "a run cgroup"))

    def _mkdir_everywhere(self, name: str, what: str) -> dict[str, Path]:
        """The directory ``name`` in each hierarchy's namespace (made when missing), or none of
        them: CgroupError saying why."""
        made: dict[str, Path] = {}
        try:
            for key, ns_dir in self._support.parents.items():
                path = Path(ns_dir, name)
                try:
                    os.mkdir(path)
                except FileNotFoundError:
                    self._ensure_namespace(key, ns_dir)
                    os.mkdir(path)
                made[key] = path
        except (OSError, CgroupError) as exc:
            for path in made.values():
                rmdir_tree(path, time.monotonic())
            if isinstance(exc, CgroupError):
                raise
            where = str(exc.filename) if exc.filename else "mkdir"
            raise CgroupError(f"cannot create {what}: {oserror_text(where, exc)}") from exc
        return made

    def leaf(self, name: str) -> RunCgroup | None:
        """The cgroup ``name`` (one a process made for itself: a zygote's spare) in each
        hierarchy, or None when the name is not one of ours."""
        if not self.enabled or not name.startswith(self.leaf_prefix) or "/" in name or name in (".", ".."):
            return None
        return self._run_cgroup("", {key: Path(ns_dir, name) for key, ns_dir in self._support.parents.items()})

    def spare_placement(self) -> dict[str, object]:
        """What a zygote needs to place each spare in a fresh cgroup of its own: the directories
        to make it in (the primary hierarchy last: a process listed there is in all of them)
        and the prefix of its name."""
        parents = self._support.parents
        primary = next((k for k in PRIMARY_ORDER if k in parents), None)
        ordered = [d for k, d in parents.items() if k != primary] + ([parents[primary]] if primary else [])
        return {"parents": ordered, "prefix": self.leaf_prefix}

    def existing(self, run_id: str, pid: int | None = None) -> RunCgroup | None:
        """The cgroup of ``run_id`` left by an earlier server process, or None: the directory of
        that name (made by an older version), else the cgroup of ours that ``pid`` (the run's
        process, checked by the caller) is in."""
        if not self.enabled or not contract.is_valid_run_id(run_id):
            return None
        paths = {name: Path(ns_dir, run_id) for name, ns_dir in self._support.parents.items()}
        paths = {name: path for name, path in paths.items() if path.is_dir()}
        if not paths and pid:
            paths = self._paths_of_process(pid)
        if not paths:
            return None
        run = self._run_cgroup(run_id, paths)
        run.memory_limit_mb = run.read_memory_limit_mb()
        return run

    def _paths_of_process(self, pid: int) -> dict[str, Path]:
        try:
            own = parse_self_cgroup(read_file(f"/proc/{pid}/cgroup"))
        except OSError:
            return {}
        paths: dict[str, Path] = {}
        for key, ns_dir in self._support.parents.items():
            where = own.get("" if key in V2_KEYS else key, "")
            parent, leaf = os.path.split(where.rstrip("/"))
            if leaf.startswith(LEAF_PREFIX) and os.path.basename(parent) == os.path.basename(ns_dir):
                path = Path(ns_dir, leaf)
                if path.is_dir():
                    paths[key] = path
        return paths

    def stale_names(self, keep: set[str] | frozenset[str] = frozenset(), *, own: bool = False) -> list[str]:
        """The cgroups in our namespace that no run of this instance uses: run ids (older
        versions) and cgroups made ahead by earlier instances (``own``: by this one too), but
        those in ``keep``."""
        names: set[str] = set()
        for ns_dir in self._support.parents.values():
            try:
                with os.scandir(ns_dir) as it:
                    names.update(e.name for e in it if e.is_dir(follow_symlinks=False))
            except FileNotFoundError:
                continue
        ours = {n for n in names if contract.is_valid_run_id(n) or n.startswith(LEAF_PREFIX)}
        return sorted(n for n in ours if (own or not n.startswith(self.leaf_prefix)) and n not in keep)

    def named(self, name: str) -> RunCgroup | None:
        """The cgroup ``name`` of our namespace where its directories exist (a stale one), or None."""
        if not self.enabled or "/" in name or name in ("", ".", ".."):
            return None
        paths = {key: Path(ns_dir, name) for key, ns_dir in self._support.parents.items()}
        paths = {key: path for key, path in paths.items() if path.is_dir()}
        return self._run_cgroup(name, paths) if paths else None

    def holding_processes(self, names: list[str]) -> list[RunCgroup]:
        """Those of the cgroups ``names`` of our namespace (stale ones) that hold a process."""
        found = (self.named(name) for name in names)
        return [cgroup for cgroup in found if cgroup is not None and cgroup.holds_processes()]

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

    def hold_namespace(self) -> None:
        """Mark the namespace directories as a live server's: a shared ``flock`` on each, held
        until ``release_namespace`` or this process's end, however it ends (a ``kill -9`` too).
        Another server removes what a namespace holds only when it can take that lock exclusively
        (``remove_empty_siblings``, ``remove_namespace``). Waits out such a removal under way,
        then makes the namespace again if it went. Called again (a server that takes over the
        runs directory): a lock on a directory that was removed and made again since is taken
        anew, on the directory of that name now."""
        for key, ns_dir in self._support.parents.items():
            self._hold(key, ns_dir)

    def _hold(self, key: str, ns_dir: str) -> None:
        with self._held_lock:
            self._hold_locked(key, ns_dir)

    def _hold_locked(self, key: str, ns_dir: str) -> None:
        held = self._held.pop(key, None)
        if held is not None:
            try:
                if os.fstat(held).st_ino == os.stat(ns_dir).st_ino:
                    self._held[key] = held
                    return
            except OSError:
                pass
            os.close(held)  # the directory it locks is gone (or replaced)
        for _ in range(3):
            try:
                fd = os.open(ns_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            except FileNotFoundError:
                fd = -1
            except OSError:
                return  # not ours to hold: siblings' clean-ups then leave it alone too
            if fd >= 0:
                try:
                    fcntl.flock(fd, fcntl.LOCK_SH)
                    if os.fstat(fd).st_ino == os.stat(ns_dir).st_ino:
                        self._held[key] = fd
                        return
                except OSError:
                    pass
                os.close(fd)  # removed by a sibling's clean-up before the lock was ours
            try:
                self._make_namespace(key, ns_dir)
            except (OSError, CgroupError):
                return

    def release_namespace(self) -> None:
        with self._held_lock:
            for fd in self._held.values():
                os.close(fd)
            self._held.clear()

    def remove_empty_siblings(self, prefix: str) -> int:
        """Remove the namespaces beside ours whose names start with ``prefix`` (other runs
        directories' schedulers of this user) and whose server is gone: no one holds their lock
        (``hold_namespace``). Their cgroups made ahead and those of ended runs go with them (memory
        reclaimed first, as a run's own clean-up does, so none lingers as a dying cgroup); a cgroup
        that still holds a process (a detached run) stays, and so does its namespace. A namespace
        whose server lives is never touched. Returns how many namespaces were removed."""
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
                    if entry.is_dir(follow_symlinks=False) and _remove_abandoned(entry.path):
                        removed += 1
                except OSError:
                    pass
        return removed

    def reclaim_namespace(self) -> None:
        """Reclaim the page cache charged to the namespace's memory cgroup and below it, removed
        run cgroups' included. A removed memory cgroup stays in the kernel (dying) while a page is
        charged to it, and a few runs' last file pages (under write-back at their clean-up) stay
        charged on a host with memory to spare: about 3 % of no-op runs left one, and a namespace
        holding hundreds slowed its server. For an idle server (no run lives): live runs' page
        cache would go too. Never raises."""
        try:
            if self._memory_kind == "v1":
                write_file(Path(self._support.parents["memory"], "memory.force_empty"), "0")
            elif self._memory_kind == "v2":
                ns = next(Path(self._support.parents[k]) for k in V2_KEYS if k in self._support.parents)
                cached = keyed_value(read_file(ns / "memory.stat"), "file")
                if cached:
                    write_file(ns / "memory.reclaim", str(cached))
        except (OSError, StopIteration):
            pass  # (less could be reclaimed, a controller gone: the next idle moment tries again)

    def remove_namespace(self) -> bool:
        """rmdir the namespace directories if no run cgroup is left in them and no other server
        of this runs directory holds them (server shutdown, a step-down, tests), and let go of
        their lock. True when all are gone. A server that stops while another waits to take over
        (a secondary, which holds the namespace too) leaves it: removed, the one taking over
        would hold a lock on a directory that is gone, and make one of the same name that nobody
        holds."""
        self.release_namespace()
        gone = True
        for ns_dir in self._support.parents.values():
            try:
                fd = os.open(ns_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            except FileNotFoundError:
                continue
            except OSError:
                gone = False
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                os.rmdir(ns_dir)
            except FileNotFoundError:
                pass
            except OSError:
                gone = False  # another server holds it, or a run cgroup is left in it
            finally:
                os.close(fd)
        return gone
