"""Per-run cgroups: planning from sample hosts, detection, and the real thing on this host.

The live tests make real cgroups (root, and a host that offers them); each test uses its own
namespace, and a finalizer kills and removes everything under it, so nothing is left behind even
when a test fails. They synchronise with their processes through pipes, never fixed sleeps.
"""

from __future__ import annotations

import errno
import os
import selectors
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from waiting import wait_until

from jupyter_evalsched.scheduler import cgroups as cgmod
from jupyter_evalsched.scheduler.cgroup_detect import CgroupSupport, parse_self_cgroup, plan, plan_mode
from jupyter_evalsched.scheduler.cgroups import CgroupError, Cgroups

# --------------------------------------------------------------------------- sample hosts

PURE_V2_MOUNTS = """\
sysfs /sys sysfs rw,nosuid,nodev,noexec,relatime 0 0
proc /proc proc rw,nosuid,nodev,noexec,relatime 0 0
cgroup2 /sys/fs/cgroup cgroup2 rw,nosuid,nodev,noexec,relatime,nsdelegate,memory_recursiveprot 0 0
/dev/nvme0n1p2 / ext4 rw,relatime 0 0
"""
PURE_V2_SELF = "0::/user.slice/user-1000.slice/user@1000.service/app.slice/evalsched.scope\n"

# This machine's layout (hybrid, in a process_api memory cgroup).
HYBRID_MOUNTS = """\
tmpfs /sys/fs/cgroup tmpfs rw,relatime,mode=755 0 0
cgroup /sys/fs/cgroup/cpu cgroup rw,relatime,cpu 0 0
cgroup /sys/fs/cgroup/cpuacct cgroup rw,relatime,cpuacct 0 0
cgroup /sys/fs/cgroup/cpuset cgroup rw,relatime,cpuset 0 0
cgroup /sys/fs/cgroup/memory cgroup rw,relatime,memory 0 0
cgroup /sys/fs/cgroup/devices cgroup rw,relatime,devices 0 0
cgroup /sys/fs/cgroup/freezer cgroup rw,relatime,freezer 0 0
cgroup /sys/fs/cgroup/blkio cgroup rw,relatime,blkio 0 0
cgroup /sys/fs/cgroup/pids cgroup rw,relatime,pids 0 0
cgroup /sys/fs/cgroup/systemd cgroup rw,relatime,name=systemd 0 0
cgroup2 /sys/fs/cgroup/unified cgroup2 rw,relatime 0 0
"""
HYBRID_SELF = """\
9:name=systemd:/
8:pids:/
7:blkio:/
6:freezer:/
5:devices:/
4:memory:/process_api/610c8097a29d8493c43e97af71d4b96c
3:cpuset:/
2:cpuacct:/
1:cpu:/
0::/
"""

# A systemd v1-only host (cgroup v1 with co-mounted controllers, no cgroup2).
V1_MOUNTS = """\
tmpfs /sys/fs/cgroup tmpfs ro,nosuid,nodev,noexec,mode=755 0 0
cgroup /sys/fs/cgroup/systemd cgroup rw,nosuid,nodev,noexec,relatime,xattr,name=systemd 0 0
cgroup /sys/fs/cgroup/cpu,cpuacct cgroup rw,nosuid,nodev,noexec,relatime,cpu,cpuacct 0 0
cgroup /sys/fs/cgroup/memory cgroup rw,nosuid,nodev,noexec,relatime,memory 0 0
cgroup /sys/fs/cgroup/freezer cgroup rw,nosuid,nodev,noexec,relatime,freezer 0 0
cgroup /sys/fs/cgroup/pids cgroup rw,nosuid,nodev,noexec,relatime,pids 0 0
"""
V1_SELF = """\
11:pids:/user.slice/user-1000.slice/session-3.scope
7:freezer:/
4:memory:/user.slice/user-1000.slice/session-3.scope
3:cpu,cpuacct:/user.slice
1:name=systemd:/user.slice/user-1000.slice/session-3.scope
"""

NO_CGROUP_MOUNTS = """\
proc /proc proc rw,nosuid,nodev,noexec,relatime 0 0
tmpfs /tmp tmpfs rw,nosuid,nodev 0 0
"""


def test_plan_pure_v2() -> None:
    parents = plan(PURE_V2_MOUNTS, PURE_V2_SELF)
    assert parents == {"v2": "/sys/fs/cgroup/user.slice/user-1000.slice/user@1000.service/app.slice/evalsched.scope"}
    assert plan_mode(parents) == "v2"


def test_plan_hybrid() -> None:
    parents = plan(HYBRID_MOUNTS, HYBRID_SELF)
    assert parents == {
        "unified": "/sys/fs/cgroup/unified",
        "memory": "/sys/fs/cgroup/memory/process_api/610c8097a29d8493c43e97af71d4b96c",
        "freezer": "/sys/fs/cgroup/freezer",
        "pids": "/sys/fs/cgroup/pids",
    }
    assert plan_mode(parents) == "hybrid"


def test_plan_v1_only() -> None:
    parents = plan(V1_MOUNTS, V1_SELF)
    assert parents == {
        "memory": "/sys/fs/cgroup/memory/user.slice/user-1000.slice/session-3.scope",
        "freezer": "/sys/fs/cgroup/freezer",
        "pids": "/sys/fs/cgroup/pids/user.slice/user-1000.slice/session-3.scope",
    }
    assert plan_mode(parents) == "v1"


def test_plan_no_cgroup_mounts() -> None:
    assert plan(NO_CGROUP_MOUNTS, PURE_V2_SELF) == {}
    assert plan("", "") == {}
    assert plan_mode({}) == "none"


def test_plan_details() -> None:
    # A v1 hierarchy that carries only name=systemd does not make a host hybrid.
    mounts = "cgroup2 /sys/fs/cgroup/unified cgroup2 rw 0 0\ncgroup /sys/fs/cgroup/systemd cgroup rw,name=systemd 0 0\n"
    assert plan(mounts, "1:name=systemd:/\n0::/a\n") == {"v2": "/sys/fs/cgroup/unified/a"}
    # Octal escapes in mount points; a hierarchy without a line in /proc/self/cgroup is skipped.
    mounts = "cgroup2 /mnt/my\\040cgroups cgroup2 rw 0 0\ncgroup /c/memory cgroup rw,memory 0 0\n"
    assert plan(mounts, "0::/x/y\n") == {"unified": "/mnt/my cgroups/x/y"}
    assert parse_self_cgroup("3:cpu,cpuacct:/a\n0::/b\n") == {"cpu": "/a", "cpuacct": "/a", "": "/b"}


# --------------------------------------------------------------------------- detection without cgroups


def test_detect_off() -> None:
    cg = Cgroups.detect("off")
    assert cg.support.mode == "none" and not cg.enabled
    assert cg.status() == {"mode": "none", "memory": False, "kill": "none", "detail": cg.support.detail, "parents": {}}
    with pytest.raises(CgroupError):
        cg.create("r1")
    assert cg.existing("r1") is None and cg.stale_run_ids() == []


def _detect_from(tmp_path: Path, mounts_text: str | None, self_text: str = "0::/\n") -> Cgroups:
    mounts = tmp_path / "mounts"
    if mounts_text is not None:
        mounts.write_text(mounts_text)
    own = tmp_path / "self_cgroup"
    own.write_text(self_text)
    return Cgroups.detect(namespace="evalsched-test-x", mounts_file=str(mounts), self_cgroup_file=str(own))


@pytest.mark.parametrize(
    "mounts_text",
    [
        None,  # no mounts file at all
        "",
        NO_CGROUP_MOUNTS,
        "cgroup2 /nonexistent/cgroup cgroup2 rw 0 0\n",
        "cgroup /nonexistent/memory cgroup rw,memory 0 0\ncgroup /nonexistent/freezer cgroup rw,freezer 0 0\n",
    ],
    ids=["missing", "empty", "no-cgroups", "v2-missing-dir", "v1-missing-dir"],
)
def test_detect_nothing_usable(tmp_path: Path, mounts_text: str | None) -> None:
    cg = _detect_from(tmp_path, mounts_text, "4:memory:/\n6:freezer:/\n0::/\n")
    assert cg.support.mode == "none" and not cg.enabled
    assert cg.support.kill == "none" and cg.support.parents == {}
    assert "process groups" in cg.support.detail


def test_detect_plain_directory_is_not_a_cgroup(tmp_path: Path) -> None:
    # A directory that only looks like one: the probe's write fails (no interface files), and
    # everything the probe made is removed again.
    fake = tmp_path / "cg"
    fake.mkdir()
    (fake / "cgroup.procs").write_text("")
    cg = _detect_from(tmp_path, f"cgroup2 {fake} cgroup2 rw 0 0\n")
    assert cg.support.mode == "none"
    assert sorted(p.name for p in fake.iterdir()) == ["cgroup.procs"]


def test_detect_read_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # As root, mode bits do not stop mkdir: simulate a read-only mount (as in a default container).
    fake = tmp_path / "cg"
    fake.mkdir()
    (fake / "cgroup.procs").write_text("")
    real_mkdir = os.mkdir

    def mkdir(path: str | os.PathLike[str], *args: int, **kwargs: int) -> None:
        if str(path).startswith(str(fake)):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        real_mkdir(path, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "mkdir", mkdir)
    cg = _detect_from(tmp_path, f"cgroup2 {fake} cgroup2 rw 0 0\n")
    assert cg.support.mode == "none"
    assert "read-only" in cg.support.detail and "process groups" in cg.support.detail


@pytest.mark.parametrize("setting", ["relative/dir", "/nonexistent/cgroup"])
def test_detect_bad_setting(setting: str) -> None:
    cg = Cgroups.detect(setting, namespace="evalsched-test-x")
    assert cg.support.mode == "none" and setting in cg.support.detail


def test_detect_never_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*args: object) -> None:
        raise RuntimeError("boom")

    monkeypatch.setattr(cgmod, "detect", boom)
    cg = Cgroups.detect()
    assert cg.support.mode == "none" and "boom" in cg.support.detail


# --------------------------------------------------------------------------- live cgroups on this host


def _real_planned() -> dict[str, str]:
    try:
        with open("/proc/self/mounts") as m, open("/proc/self/cgroup") as c:
            return plan(m.read(), c.read())
    except OSError:
        return {}


REAL_PLAN = _real_planned()
IS_ROOT = os.geteuid() == 0
# This project's machines (and CI) are hybrid hosts where the tests run as root:
# the tests that need it assert it rather than skip, so that a change of host shows.
HYBRID_HERE = IS_ROOT and "unified" in REAL_PLAN and "memory" in REAL_PLAN


def _kill_tree(directory: str) -> None:
    for root, dirs, _files in os.walk(directory, topdown=False):
        for d in dirs:
            _kill_tree(os.path.join(root, d))
    state = os.path.join(directory, "freezer.state")
    if os.path.exists(state):
        with open(state, "w") as f:
            f.write("THAWED")
    for _ in range(200):
        try:
            pids = open(os.path.join(directory, "cgroup.procs")).read().split()
        except FileNotFoundError:
            return
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.005)
    for _ in range(100):
        try:
            os.rmdir(directory)
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.005)


@pytest.fixture
def namespace() -> Iterator[str]:
    """A namespace of its own; afterwards nothing is left under it in any hierarchy."""
    ns = f"evalsched-test-{uuid.uuid4().hex[:12]}"
    yield ns
    dirs = [os.path.join(p, ns) for p in REAL_PLAN.values()]
    for d in dirs:
        if os.path.isdir(d):
            _kill_tree(d)
    left = [d for d in dirs if os.path.exists(d)]
    assert not left, f"cgroup directories left behind: {left}"


@pytest.fixture
def cgroups(namespace: str) -> Cgroups:
    cg = Cgroups.detect(namespace=namespace)
    # This project's machines (and CI) have writable cgroups: never a silent skip.
    assert cg.enabled, f"cgroups should work on this host: {cg.support.detail}"
    return cg


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[bytes]]]:
    """Popen objects of a test, killed and reaped afterwards whatever happened."""
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for p in started:
        if p.poll() is None:
            p.kill()
        p.wait(timeout=10)
        for stream in (p.stdin, p.stdout):
            if stream is not None:
                stream.close()


def _spawn(procs: list[subprocess.Popen[bytes]], args: list[str]) -> subprocess.Popen[bytes]:
    p = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    procs.append(p)
    return p


def _python(code: str) -> list[str]:
    return [sys.executable, "-I", "-S", "-c", code]


def _readline(p: subprocess.Popen[bytes], timeout: float = 10.0) -> bytes:
    assert p.stdout is not None
    with selectors.DefaultSelector() as sel:
        sel.register(p.stdout, selectors.EVENT_READ)
        if not sel.select(timeout):
            raise AssertionError(f"no line from pid {p.pid} within {timeout} s")
    return p.stdout.readline()


def _go(p: subprocess.Popen[bytes]) -> None:
    assert p.stdin is not None
    p.stdin.write(b"go\n")
    p.stdin.flush()


def _dead(proc: psutil.Process) -> bool:
    try:
        return not proc.is_running() or proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _gone(run: cgmod.RunCgroup) -> bool:
    return not any(p.exists() for p in run.paths.values())


def test_detect_auto_here_is_hybrid(cgroups: Cgroups, namespace: str) -> None:
    assert HYBRID_HERE, f"a hybrid cgroup host and root are expected here: {REAL_PLAN}"
    s = cgroups.support
    assert (s.mode, s.memory, s.kill) == ("hybrid", True, "cgroup.kill")
    assert set(s.parents) == {"unified", "memory"}
    assert all(p.endswith("/" + namespace) and os.path.isdir(p) for p in s.parents.values())
    assert s.parents["memory"] == os.path.join(REAL_PLAN["memory"], namespace)
    # The probes are gone: nothing but interface files in the namespace directories.
    assert cgroups.stale_run_ids() == []
    assert all(not any(e.is_dir() for e in os.scandir(p)) for p in s.parents.values())
    assert cgroups.status() == {
        "mode": "hybrid",
        "memory": True,
        "kill": "cgroup.kill",
        "detail": s.detail,
        "parents": s.parents,
    }
    assert Cgroups.detect(namespace=namespace).support == s  # a second detection finds the same


def test_create_limit_add_kill_remove(cgroups: Cgroups, procs: list[subprocess.Popen[bytes]]) -> None:
    run = cgroups.create("20250101T000000.000001-abc123", memory_mb=64)
    if cgroups.support.memory:
        assert run.memory_limit_mb == 64
    assert all(p.is_dir() for p in run.paths.values())
    assert len(run.procs_files()) == len(run.paths)
    assert not run.populated() and run.pids() == set()
    p = _spawn(procs, ["sleep", "300"])
    run.add(p.pid)
    assert run.pids() == {p.pid} and run.populated()
    assert p.pid in run.kill()
    assert p.wait(timeout=5) == -signal.SIGKILL
    assert run.pids() == set() and not run.populated()
    run.remove()
    assert _gone(run)
    run.remove()  # idempotent
    assert run.kill() == set() and run.pids() == set() and not run.populated()


def test_add_dead_process(cgroups: Cgroups, procs: list[subprocess.Popen[bytes]]) -> None:
    run = cgroups.create("r-dead")
    p = _spawn(procs, ["true"])
    p.wait(timeout=5)
    with pytest.raises(CgroupError, match="gone"):
        run.add(p.pid)
    run.remove()
    assert _gone(run)


def test_invalid_run_id(cgroups: Cgroups) -> None:
    for bad in ("", "..", "a/b", "x" * 200):
        with pytest.raises(CgroupError):
            cgroups.create(bad)


# Double fork; the grandchild starts a session of its own and clears its environment, the
# intermediate exits: a process-group kill and an environment marker would both miss it.
ESCAPE = r"""
import os, sys
sys.stdin.readline()  # the test has put us in the cgroup
r, w = os.pipe()
if os.fork() == 0:
    os.close(r)
    if os.fork() != 0:
        os._exit(0)
    os.setsid()
    os.write(w, b"%d\n" % os.getpid())
    os.execve("/bin/sleep", ["sleep", "300"], {})
os.close(w)
os.wait()
sys.stdout.write(os.read(r, 64).decode())
sys.stdout.flush()
sys.stdin.readline()
"""


def test_kill_reaches_escaped_grandchild(cgroups: Cgroups, procs: list[subprocess.Popen[bytes]]) -> None:
    run = cgroups.create("r-escape")
    p = _spawn(procs, _python(ESCAPE))
    run.add(p.pid)
    _go(p)
    gpid = int(_readline(p))
    grand = psutil.Process(gpid)
    wait_until(lambda: grand.exe() == "/bin/sleep" or grand.cmdline() == ["sleep", "300"], timeout=10)
    assert grand.environ() == {} and os.getsid(gpid) == gpid != os.getsid(0)
    assert {p.pid, gpid} <= run.pids()
    assert {p.pid, gpid} <= run.kill()
    assert run.pids() == set() and not run.populated()
    assert p.wait(timeout=5) == -signal.SIGKILL
    # The grandchild is an orphan: dead at once, reaped by init whenever it gets round to it.
    wait_until(lambda: _dead(grand), timeout=5)
    run.remove()
    assert _gone(run)


def test_a_runs_usual_removal_lists_no_directory_and_kills_nothing(
    cgroups: Cgroups, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = cgroups.create("r-plain")
    listed: list[str] = []
    scandir = os.scandir
    monkeypatch.setattr(os, "scandir", lambda path=".": listed.append(os.fspath(path)) or scandir(path))
    monkeypatch.setattr(run, "kill", lambda *a, **k: pytest.fail("nothing to kill in a plain removal"))
    assert run.remove() is True
    assert _gone(run)
    assert [p for p in listed if run.name in p] == []


@pytest.mark.parametrize("below", ["every", "v2", "v1"])
def test_remove_takes_the_empty_cgroups_a_run_made_below_its_own(cgroups: Cgroups, below: str) -> None:
    """Empty cgroups below the run's own: in every hierarchy, only below the v2 directory (the
    v1 one goes, then v2's rmdir is refused), or only below a v1 one."""
    run = cgroups.create(f"r-below-{below}")
    v2 = run.paths.get("v2") or run.paths.get("unified")
    for path in run.paths.values():
        if below == "every" or (below == "v2") == (path == v2):
            (path / "inner" / "deeper").mkdir(parents=True)
    assert run.remove() is True
    assert _gone(run)


def test_remove_kills_a_process_left_only_in_a_cgroup_below_a_v1_one(
    cgroups: Cgroups, procs: list[subprocess.Popen[bytes]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A process the v2 directory no longer holds (moved to its parent: the server's uid may)
    and that sits in a cgroup below the run's v1 memory one: v2's ``populated`` and the memory
    directory's own ``cgroup.procs`` both look empty. It is killed before the cgroup's memory is
    reclaimed (where there is swap, a reclaim would push a live process's memory out), and every
    directory goes."""
    assert HYBRID_HERE, "this project's machines are hybrid hosts where the tests run as root"
    run = cgroups.create("r-below-busy")
    inner = run.paths["memory"] / "inner"
    inner.mkdir()
    p = _spawn(procs, ["sleep", "300"])
    run.add(p.pid)
    (inner / "cgroup.procs").write_text(str(p.pid))
    (run.paths["unified"].parent / "cgroup.procs").write_text(str(p.pid))
    assert not run.populated() and cgmod.procs_of(run.paths["memory"]) == set()
    at_reclaim: list[set[int]] = []
    reclaim = run.reclaim
    monkeypatch.setattr(
        run, "reclaim", lambda: at_reclaim.append(cgmod.subtree_procs(run.paths["memory"])) or reclaim()
    )
    assert run.remove() is True
    assert p.wait(timeout=5) == -signal.SIGKILL
    assert at_reclaim and all(pids == set() for pids in at_reclaim)
    assert _gone(run)


def test_a_v1_rmdir_refused_after_the_look_leaves_v2_to_kill_through(
    cgroups: Cgroups, procs: list[subprocess.Popen[bytes]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A process in the memory directory that the plain path's look missed (simulated: as if it
    came between that look and the rmdir), and that left v2's directory: the memory rmdir is
    refused, and as v2's directory goes last, it is still there for ``kill`` to reach the
    process through it (``cgroup.kill``, then the stragglers of the other hierarchies)."""
    assert HYBRID_HERE, "this project's machines are hybrid hosts where the tests run as root"
    run = cgroups.create("r-late")
    p = _spawn(procs, ["sleep", "300"])
    run.add(p.pid)
    (run.paths["unified"].parent / "cgroup.procs").write_text(str(p.pid))
    looks: list[object] = []
    procs_of = cgmod.procs_of
    monkeypatch.setattr(
        cgmod, "procs_of", lambda path: set() if not looks.append(path) and len(looks) == 1 else procs_of(path)
    )
    assert run.remove() is True
    assert looks[:1] == [run.paths["memory"]]
    assert p.wait(timeout=5) == -signal.SIGKILL
    assert _gone(run)


OOM = r"""
import sys
sys.stdin.readline()
b = bytearray(400 * 1024 * 1024)
for i in range(0, len(b), 4096):
    b[i] = 1
print("survived", flush=True)
"""


def test_oom_kill_is_confined_and_counted(cgroups: Cgroups, procs: list[subprocess.Popen[bytes]]) -> None:
    assert cgroups.support.memory, f"no memory controller for run cgroups: {cgroups.support.detail}"
    run = cgroups.create("r-oom", memory_mb=100)
    assert run.memory_limit_mb == 100
    assert run.oom_kills() == 0
    p = _spawn(procs, _python(OOM))
    run.add(p.pid)
    _go(p)
    assert p.wait(timeout=15) == -signal.SIGKILL
    assert p.stdout is not None and b"survived" not in p.stdout.read()
    assert run.oom_kills() >= 1
    peak = run.memory_peak_mb()
    assert peak is not None and 90 <= peak <= 101
    current = run.memory_current_mb()
    assert current is not None and current <= 101
    run.remove()
    assert _gone(run)


def test_existing_and_stale_from_another_instance(
    cgroups: Cgroups, namespace: str, procs: list[subprocess.Popen[bytes]]
) -> None:
    run = cgroups.create("r-old", memory_mb=64)
    p = _spawn(procs, ["sleep", "300"])
    run.add(p.pid)
    # A restarted server: a new instance, same namespace.
    later = Cgroups.detect(namespace=namespace)
    assert later.stale_run_ids() == ["r-old"]
    assert later.existing("r-nope") is None and later.existing("../x") is None
    found = later.existing("r-old")
    assert found is not None and found.paths == run.paths and found.pids() == {p.pid}
    if later.support.memory:
        assert found.memory_limit_mb == 64
    found.remove()
    assert p.wait(timeout=5) == -signal.SIGKILL
    assert _gone(run) and later.stale_run_ids() == [] and later.existing("r-old") is None


def test_stale_cgroups_holding_a_process_are_told_apart(
    cgroups: Cgroups, namespace: str, procs: list[subprocess.Popen[bytes]]
) -> None:
    """A restart empties, before any run starts, the stale cgroups that still hold a process (a
    detached run whose ``running`` record was refused, queued again: it would run twice at once;
    ``LocalExecutor.recovered``); the empty ones are removed later, off the loop."""
    busy, idle = cgroups.make(), cgroups.make()
    p = _spawn(procs, ["sleep", "300"])
    busy.add(p.pid)
    later = Cgroups.detect(namespace=namespace)  # the next server: another instance
    stale = later.stale_names()
    assert sorted(stale) == sorted([busy.name, idle.name])
    held = later.holding_processes([*stale, "gone-meanwhile", "../x"])
    assert [c.name for c in held] == [busy.name] and held[0].pids() == {p.pid}
    held[0].remove()
    assert p.wait(timeout=5) == -signal.SIGKILL
    assert later.holding_processes(later.stale_names()) == []
    idle.remove()


def test_an_idle_namespace_reclaim_frees_removed_cgroups_still_charged(
    cgroups: Cgroups, procs: list[subprocess.Popen[bytes]], tmp_path: Path
) -> None:
    """A removed memory cgroup stays in the kernel while a page is charged to it (a run's last
    files, under write-back at its clean-up, keep a few runs' so on a host with memory to spare).
    The namespace's reclaim, made when no run lives, frees them: what the namespace is charged
    falls back. (Removed here by a bare rmdir, without the clean-up's own reclaim.)"""
    assert cgroups.support.memory and "memory" in cgroups.support.parents, cgroups.support.detail
    usage = Path(cgroups.support.parents["memory"], "memory.usage_in_bytes")
    before = int(usage.read_text())
    run = cgroups.make()
    data = tmp_path / "results.bin"
    p = _spawn(procs, _python(f"import os, sys; sys.stdin.readline(); f = open({str(data)!r}, 'wb'); "
                              "f.write(b'x' * (8 << 20)); f.flush(); os.fsync(f.fileno())"))  # fmt: skip
    run.add(p.pid)
    _go(p)
    assert p.wait(timeout=30) == 0
    for path in run.paths.values():
        os.rmdir(path)
    held = int(usage.read_text()) - before
    assert held >= 6 << 20, f"only {held} bytes stayed charged to the removed cgroup"
    cgroups.reclaim_namespace()
    freed = held - (int(usage.read_text()) - before)
    assert freed >= 6 << 20, f"the reclaim freed {freed} of {held} bytes"


def test_create_replaces_stale_cgroup(cgroups: Cgroups, namespace: str, procs: list[subprocess.Popen[bytes]]) -> None:
    old = cgroups.create("r-again")
    p = _spawn(procs, ["sleep", "300"])
    old.add(p.pid)
    new = Cgroups.detect(namespace=namespace).create("r-again")
    assert p.wait(timeout=5) == -signal.SIGKILL
    assert new.paths == old.paths and new.pids() == set()
    new.remove()
    assert _gone(new)
    assert cgroups.remove_namespace()
    assert all(not os.path.exists(d) for d in cgroups.support.parents.values())
    # A namespace removed since detect() is made again on demand.
    again = cgroups.create("r-again")
    assert all(p.is_dir() for p in again.paths.values())
    again.remove()


SPAWNER = r"""
import subprocess, sys
sys.stdin.readline()
kids = [subprocess.Popen(["sleep", "300"]) for _ in range(3)]
print("ready", flush=True)
sys.stdin.readline()
"""


@pytest.mark.parametrize("kill", ["freezer", "signal"])
def test_v1_kill_methods(kill: str, namespace: str, procs: list[subprocess.Popen[bytes]]) -> None:
    assert HYBRID_HERE, f"a hybrid cgroup host and root are expected here: {REAL_PLAN}"
    # The v1-only paths, on this host's real v1 hierarchies.
    parents = {"memory": os.path.join(REAL_PLAN["memory"], namespace)}
    if kill == "freezer":
        parents["freezer"] = os.path.join(REAL_PLAN["freezer"], namespace)
    cg = Cgroups(CgroupSupport("v1", True, kill, "test", parents))
    run = cg.create("r-v1", memory_mb=64)
    assert run.memory_limit_mb == 64 and set(run.paths) == set(parents)
    p = _spawn(procs, _python(SPAWNER))
    run.add(p.pid)
    _go(p)
    assert _readline(p) == b"ready\n"
    members = run.pids()
    assert p.pid in members and len(members) == 4
    assert run.kill() >= members
    assert run.pids() == set() and not run.populated()
    assert p.wait(timeout=5) == -signal.SIGKILL
    if kill == "freezer":
        assert (run.paths["freezer"] / "freezer.state").read_text().strip() == "THAWED"
    run.remove()
    assert _gone(run)
    assert cg.remove_namespace()


def test_explicit_v2_parent(namespace: str, procs: list[subprocess.Popen[bytes]]) -> None:
    assert HYBRID_HERE, f"a hybrid cgroup host and root are expected here: {REAL_PLAN}"
    # The unified hierarchy as a "delegated subtree": v2 mode, no memory controller in it.
    unified = REAL_PLAN["unified"]
    cg = Cgroups.detect(unified, namespace=namespace)
    assert (cg.support.mode, cg.support.memory, cg.support.kill) == ("v2", False, "cgroup.kill")
    assert cg.support.parents == {"v2": os.path.join(unified, namespace)}
    assert "memory" in cg.support.detail
    run = cg.create("r-v2", memory_mb=64)
    assert run.memory_limit_mb is None and run.memory_peak_mb() is None and run.oom_kills() == 0
    p = _spawn(procs, ["sleep", "300"])
    run.add(p.pid)
    assert run.pids() == {p.pid}
    run.remove()
    assert p.wait(timeout=5) == -signal.SIGKILL
    assert _gone(run)


DEAD_SERVER = """
import sys
from jupyter_evalsched.scheduler.cgroups import Cgroups
cg = Cgroups.detect("auto", namespace=sys.argv[1])
cg.hold_namespace()
made = [cg.make() for _ in range(3)]  # a pool of cgroups made ahead, as a server keeps
cg.create("20260101T000000.000000-0e0e0e")  # and an ended run's, never removed
print(" ".join(str(p) for m in made for p in m.paths.values()), flush=True)
sys.stdin.read()  # until killed
"""


def test_namespaces_of_servers_that_are_gone_are_removed_and_live_ones_kept(procs):
    """A server killed with ``kill -9`` leaves its namespace with cgroups in it (made ahead, of
    ended runs): the next server of the user removes them, memory reclaimed, once the dead
    server's lock is free; a live server's namespace is never touched, empty cgroups and all; a
    dead server's cgroup that still holds a process (a detached run) stays."""
    prefix = f"evalsched-test-sib-{uuid.uuid4().hex[:8]}-"
    live = Cgroups.detect("auto", namespace=prefix + "live")
    live.hold_namespace()
    live_pool = live.make()  # empty, as a live server's pool is
    dead = _spawn(procs, [sys.executable, "-c", DEAD_SERVER, prefix + "dead"])
    dead_pool = dead.stdout.readline().decode().split()
    assert dead_pool and all(os.path.isdir(p) for p in dead_pool)
    detached_ns = Cgroups.detect("auto", namespace=prefix + "detached")  # a dead server's detached run
    detached = detached_ns.create("20260101T000000.000000-abcdef")
    sleeper = _spawn(procs, ["sleep", "300"])
    detached.add(sleeper.pid)
    detached_pool = detached_ns.make()
    ours = Cgroups.detect("auto", namespace=prefix + "ours")
    ours.hold_namespace()
    dead_dirs = [os.path.join(os.path.dirname(p), prefix + "dead") for p in ours.support.parents.values()]
    try:
        assert ours.remove_empty_siblings(prefix) == 0, "a live server's namespace was removed"
        assert all(os.path.isdir(p) for p in dead_pool)
        dead.kill()
        dead.wait(timeout=10)
        detached_ns.release_namespace()  # (never held: as a server that is gone)
        removed = ours.remove_empty_siblings(prefix)
        assert not any(os.path.exists(p) for p in dead_dirs + dead_pool), "a dead server's namespace is left"
        assert removed == len(dead_dirs)
        assert all(os.path.isdir(p) for p in live_pool.paths.values()), "a live server's empty cgroup was removed"
        assert all(os.path.isdir(p) for p in detached.paths.values()) and detached.pids() == {sleeper.pid}
        assert not any(os.path.exists(p) for p in detached_pool.paths.values()), "its empty cgroup is left"
        assert all(os.path.isdir(p) for p in ours.support.parents.values())
    finally:
        detached.remove()
        for cg in (live_pool, detached_pool):
            cg.remove()
        for cgroups in (ours, live, detached_ns):
            cgroups.remove_namespace()
        for d in dead_dirs:
            if os.path.isdir(d):
                _kill_tree(d)


def test_a_server_taking_over_a_runs_directory_keeps_its_namespace_held(procs):
    """Two servers of one runs directory share its namespace (both hold it). The primary stops;
    the one taking over makes its cgroups there: the namespace stays (it used to be removed as the
    first stopped, and made again unheld), and the next server of another runs directory to start
    takes none of it for abandoned. Removed by hand meanwhile, it is made again held."""
    prefix = f"evalsched-test-takeover-{uuid.uuid4().hex[:8]}-"
    first, second = (Cgroups.detect("auto", namespace=prefix + "shared") for _ in range(2))
    other = Cgroups.detect("auto", namespace=prefix + "other")  # a server of another runs directory
    for cgroups in (first, second, other):
        cgroups.hold_namespace()
    made = []
    try:
        made.append(first.make())  # the primary's pool
        made.pop().remove()  # (what it keeps, removed as it stops)
        assert not first.remove_namespace()  # the other server of the runs directory holds it
        assert all(os.path.isdir(d) for d in second.support.parents.values())
        second.hold_namespace()  # (it takes over)
        made.append(second.make())
        assert other.remove_empty_siblings(prefix) == 0
        assert all(os.path.isdir(p) for p in made[-1].paths.values()), "the new primary's cgroup was removed"
        made.pop().remove()
        for d in second.support.parents.values():
            os.rmdir(d)  # removed by hand (or by an older server as it stopped)
        made.append(second.make())  # makes the namespace again, and holds it
        assert other.remove_empty_siblings(prefix) == 0
        assert all(os.path.isdir(p) for p in made[-1].paths.values()), "the remade namespace was taken for abandoned"
    finally:
        for cg in made:
            cg.remove()
        for cgroups in (first, second, other):
            cgroups.remove_namespace()
