"""Which cgroups this host lets the server make for its runs: the pure planning from
``/proc/self/mounts`` and ``/proc/self/cgroup``, then the probe of each hierarchy (see
:mod:`.cgroups` for what each mode gives)."""

from __future__ import annotations

import errno
import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path

from .cgroupfs import (
    FALLBACK_HINT,
    PROBE_LIMIT,
    V1_CONTROLLERS,
    V1_KEYS,
    V2_KEYS,
    CgroupError,
    oserror_text,
    read_file,
    rmdir_quiet,
    set_checked,
    write_file,
)


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
        controllers = options & V1_CONTROLLERS
        has_v1_controllers = has_v1_controllers or bool(controllers)
        for controller in controllers:
            v1_mounts.setdefault(controller, mount_point)
    planned: dict[str, tuple[str, str]] = {}
    if v2_mount is not None and "" in own:
        planned["unified" if has_v1_controllers else "v2"] = (v2_mount, own[""])
    for controller in V1_KEYS:
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
    if any(k in parents for k in V1_KEYS):
        return "v1"
    return "none"


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


def make_namespace(ns_dir: str) -> bool:
    """mkdir the namespace directory; True when this call made it."""
    try:
        os.mkdir(ns_dir)
        return True
    except FileExistsError:
        if not os.path.isdir(ns_dir):
            raise
        return False


def enable_v2_memory(parent: str, ns_dir: str) -> str:
    """Enable the memory controller for run cgroups (in the parent and in the namespace directory).
    Returns "" on success, else why not."""
    try:
        if "memory" not in read_file(os.path.join(parent, "cgroup.controllers")).split():
            return f"memory controller not available in {parent} (not delegated)"
        for directory in (parent, ns_dir):
            control = os.path.join(directory, "cgroup.subtree_control")
            if "memory" in read_file(control).split():
                continue
            try:
                write_file(control, "+memory")
            except OSError as exc:
                if exc.errno == errno.EBUSY:
                    return (
                        f"cannot enable memory in {control}: {directory} holds processes (cgroup v2 'no internal "
                        "processes' rule); move the server into a leaf cgroup below it or set EvalSchedApp.cgroup_parent "
                        "to a delegated directory without processes"
                    )
                return f"cannot enable memory in {control}: {exc.strerror or exc}"
            if "memory" not in read_file(control).split():
                return f"{control}: +memory did not stick"
    except OSError as exc:
        return oserror_text(parent, exc)
    return ""


def _probe_child(probe: _Probe, parent: str, v2_memory: bool) -> None:
    """mkdir a probe child, write its settings and read them back, rmdir it."""
    child = os.path.join(probe.ns_dir, f"probe+{os.getpid()}+{secrets.token_hex(3)}")
    os.mkdir(child)
    try:
        name = probe.name
        if name in V2_KEYS:
            write_file(os.path.join(child, "cgroup.max.descendants"), "max")
            if read_file(os.path.join(child, "cgroup.max.descendants")).strip() != "max":
                raise CgroupError("cgroup.max.descendants does not read back")
            probe.cgroup_kill = os.path.exists(os.path.join(child, "cgroup.kill"))
            probe.v2_freeze = os.path.exists(os.path.join(child, "cgroup.freeze"))
            if v2_memory:
                try:
                    set_checked(Path(child) / "memory.max", PROBE_LIMIT)
                    probe.memory = os.path.exists(os.path.join(child, "memory.events"))
                    if not probe.memory:
                        probe.memory_why = f"{child}: no memory.events"
                except CgroupError as exc:
                    probe.memory_why = str(exc)
        elif name == "memory":
            set_checked(Path(child) / "memory.limit_in_bytes", PROBE_LIMIT)
            memsw = Path(child) / "memory.memsw.limit_in_bytes"
            if memsw.exists():
                set_checked(memsw, PROBE_LIMIT)
            for needed in ("memory.max_usage_in_bytes", "memory.usage_in_bytes", "memory.oom_control"):
                read_file(os.path.join(child, needed))
            probe.memory = True
        elif name == "freezer":
            write_file(os.path.join(child, "freezer.state"), "THAWED")
            if read_file(os.path.join(child, "freezer.state")).strip() != "THAWED":
                raise CgroupError("freezer.state does not read back")
        elif name == "pids":
            write_file(os.path.join(child, "pids.max"), "max")
            if read_file(os.path.join(child, "pids.max")).strip() != "max":
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
        made = make_namespace(ns_dir)
        if v2_memory:
            probe.memory_why = enable_v2_memory(parent, ns_dir)
        _probe_child(probe, parent, v2_memory and not probe.memory_why)
        probe.ok = True
    except CgroupError as exc:
        probe.why = f"{parent}: {exc}"
    except OSError as exc:
        probe.why = oserror_text(exc.filename or parent, exc)
    if not probe.ok and made:
        try:
            os.rmdir(ns_dir)
        except OSError:
            pass
    return probe


def no_support(detail: str) -> CgroupSupport:
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


def detect(setting: str, namespace: str, mounts_file: str, self_cgroup_file: str) -> CgroupSupport:
    if setting == "off":
        return no_support("cgroups turned off (cgroup_parent = 'off'): runs use process groups")
    if not namespace or "/" in namespace or namespace in (".", ".."):
        return no_support(f"invalid cgroup namespace {namespace!r}")
    try:
        mounts_text = read_file(mounts_file)
    except OSError as exc:
        mounts_text = ""
        mounts_error = f"cannot read {mounts_file}: {exc.strerror or exc}"
    else:
        mounts_error = ""
    try:
        self_text = read_file(self_cgroup_file)
    except OSError:
        self_text = ""
    planned = _plan(mounts_text, self_text)
    v2_mount = next((m for m, fstype, _ in parse_mounts(mounts_text) if fstype == "cgroup2"), None)
    own_v2 = next((_resolve_own(*planned[k]) for k in V2_KEYS if k in planned), None)

    candidates: dict[str, str]
    if setting == "auto":
        if not planned:
            why = mounts_error or f"no cgroup hierarchy mounted (per {mounts_file})"
            return no_support(f"{why}: {FALLBACK_HINT}")
        candidates = {name: _resolve_own(mount, path) for name, (mount, path) in planned.items()}
    elif os.path.isabs(setting):
        if not os.path.isfile(os.path.join(setting, "cgroup.controllers")):
            return no_support(f"cgroup_parent {setting} is not a cgroup v2 directory: {FALLBACK_HINT}")
        candidates = {"v2": os.path.normpath(setting)}
    else:
        return no_support(f"cgroup_parent must be 'auto', 'off' or an absolute path, not {setting!r}: {FALLBACK_HINT}")

    notes: list[str] = []
    usable: dict[str, _Probe] = {}
    v2_key = next((k for k in V2_KEYS if k in candidates), None)
    if v2_key is not None:
        parent = candidates[v2_key]
        probe = _probe_hierarchy(v2_key, parent, namespace, v2_memory="memory" not in candidates)
        if probe.ok:
            why = _can_migrate(v2_mount, own_v2, probe.ns_dir)
            if why:
                probe.ok, probe.why = False, why
                rmdir_quiet(probe.ns_dir)
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
        return no_support(f"no writable cgroup hierarchy ({why}): {FALLBACK_HINT}")

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
