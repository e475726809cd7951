"""#29: a run's cgroup is made before its start. A warm run's process waits in it (the zygote's
spare placed itself there), a cold run takes one made ahead, and only the run's limits are
written at the start; ended runs' cgroups are removed off that path, memory reclaimed first.

Real servers, real runs, the host's own (hybrid) hierarchy; the pure cgroup v2 memory files,
which this host does not have, against a directory laid out like the kernel's."""

from __future__ import annotations

import asyncio
import errno
import fcntl
import json
import os
from pathlib import Path

import pytest
from rest import NOOP, spec, submit
from waiting import async_wait_until

from jupyter_evalsched.runner.zygote import SPARES, place_in_cgroup
from jupyter_evalsched.scheduler.cgroup_detect import CgroupSupport
from jupyter_evalsched.scheduler.cgroup_pool import POOL_SIZE
from jupyter_evalsched.scheduler.cgroupfs import MiB
from jupyter_evalsched.scheduler.cgroups import LEAF_PREFIX, CgroupError, Cgroups, RunCgroup

HERE = Path(__file__).resolve().parent
WHERE = f"{HERE / 'evals_cgroup.py'}:where_am_i"
PRIMARY = ("v2", "unified", "memory", "freezer", "pids")


async def cgroup_parents(api) -> dict[str, str]:
    code, status = await api("GET", "status")
    assert code == 200 and status["cgroups"]["mode"] != "none", status["cgroups"]
    return status["cgroups"]["parents"]


def primary_dir(parents: dict[str, str]) -> str:
    return parents[next(k for k in PRIMARY if k in parents)]


def leaves(parents: dict[str, str]) -> dict[str, set[int]]:
    """The cgroups in the server's namespace (its primary hierarchy): name -> the pids in it."""
    ns = primary_dir(parents)
    out = {}
    for entry in os.scandir(ns):
        if entry.is_dir(follow_symlinks=False):
            try:
                with open(os.path.join(entry.path, "cgroup.procs")) as f:
                    out[entry.name] = {int(p) for p in f.read().split()}
            except FileNotFoundError:
                continue
            except OSError as exc:  # (ENODEV: removed between the listing and the read)
                if exc.errno != errno.ENODEV:
                    raise
    return out


async def spares_in_place(api, parents: dict[str, str]) -> None:
    """Wait until the zygote is ready, its spares are forked, each in a cgroup of its own, and
    the pool holds its cgroups."""

    async def settled() -> bool:
        code, status = await api("GET", "status")
        zygotes = [z for z in status["warm_start"]["zygotes"] if z["state"] == "ready"]
        if not zygotes or len(zygotes[0]["spares"]) < SPARES:
            return False
        found = leaves(parents)
        placed = {pid for pids in found.values() for pid in pids}
        empty = [name for name, pids in found.items() if not pids]
        return set(zygotes[0]["spares"]) <= placed and len(empty) >= POOL_SIZE

    await async_wait_until(settled, timeout=30, message="the spares and the pool were not in place")


@pytest.mark.parametrize("fresh", [False, True], ids=["warm", "cold"])
async def test_a_run_is_in_its_cgroup_from_its_first_instruction(api, wait_for, tmp_path, fresh):
    parents = await cgroup_parents(api)
    await spares_in_place(api, parents)
    before = leaves(parents)
    out = tmp_path / "where.json"
    rec = await submit(
        api,
        spec(
            entry=WHERE,
            params={"parents": parents, "out": str(out)},
            fresh_interpreter=fresh,
            scheduling={"memory_mb": 300},
        ),
    )
    final = await wait_for(rec["id"])
    assert final["state"] == "succeeded", final
    assert final["start"] == ("cold" if fresh else "warm"), final
    seen = json.loads(out.read_text())
    # One cgroup of its own, the same name in every hierarchy, the process listed in each.
    names = set(seen["leaf"].values())
    assert len(names) == 1 and None not in names, seen
    name = names.pop()
    assert name.startswith(LEAF_PREFIX) and all(seen["listed"].values()), seen
    if "memory" in parents:
        assert seen["limit"] == 300 * MiB, seen  # written at the start, before the eval's first line
    # Made before the run was submitted: a warm run's very process was waiting in it.
    assert name in before, (name, before)
    if fresh:
        assert before[name] == set()
    else:
        assert before[name] == {seen["pid"]}
    # Removed once the run has ended.
    await async_wait_until(
        lambda: not any(os.path.exists(os.path.join(p, name)) for p in parents.values()),
        timeout=10,
        message=f"the cgroup {name} of the ended run is still there",
    )


async def test_the_exit_reads_its_cgroups_figures_off_the_event_loop_before_its_removal(api, wait_for, monkeypatch):
    on_loop: list[bool] = []
    events: list[tuple[str, str]] = []
    read, remove = RunCgroup.oom_kills, RunCgroup.remove

    def spy_read(self: RunCgroup) -> int:
        on_loop.append(asyncio._get_running_loop() is not None)
        events.append(("read", self.run_id))
        return read(self)

    def spy_remove(self: RunCgroup) -> None:
        events.append(("remove", self.run_id))
        remove(self)

    monkeypatch.setattr(RunCgroup, "oom_kills", spy_read)
    monkeypatch.setattr(RunCgroup, "remove", spy_remove)
    ids = []
    for fresh in (False, True):
        rec = await submit(api, spec(entry=NOOP, fresh_interpreter=fresh))
        final = await wait_for(rec["id"])
        assert final["state"] == "succeeded", final
        ids.append(rec["id"])
    assert on_loop == [False, False]
    for run_id in ids:
        await async_wait_until(lambda: ("remove", run_id) in events, timeout=10)
        assert events.index(("read", run_id)) < events.index(("remove", run_id)), events


async def test_an_idle_server_reclaims_its_namespace_after_enough_runs(api, wait_for, monkeypatch):
    """Every ``NAMESPACE_RECLAIM_AFTER`` ended runs, once none of the server's runs lives and none
    has ended for ``QUIET_BEFORE_RECLAIM_S``, the namespace's memory is reclaimed (off the loop):
    never while a run lives, whose page cache it would take too."""
    from jupyter_evalsched.scheduler.executors import local

    calls: list[bool] = []
    reclaim = Cgroups.reclaim_namespace

    def spy(self: Cgroups) -> None:
        calls.append(asyncio._get_running_loop() is not None)
        reclaim(self)

    monkeypatch.setattr(Cgroups, "reclaim_namespace", spy)
    monkeypatch.setattr(local, "NAMESPACE_RECLAIM_AFTER", 2)
    long = await submit(api, spec(sleep_s=1.5))
    for _ in range(2):
        final = await wait_for((await submit(api, spec(entry=NOOP)))["id"])
        assert final["state"] == "succeeded", final
    await asyncio.sleep(1.0)  # two reconciliations (0.5 s apart here) while the long run lives
    code, now = await api("GET", f"runs/{long['id']}")
    assert calls == [] and now["state"] == "running", (calls, now["state"])
    assert (await wait_for(long["id"]))["state"] == "succeeded"
    # Nor within QUIET_BEFORE_RECLAIM_S of a run's end: runs of a few milliseconds leave the
    # server without a live run most of the time, and a reclaim mid-churn held up their clean-ups.
    await asyncio.sleep(local.QUIET_BEFORE_RECLAIM_S / 2)
    assert calls == [], "reclaimed right after a run ended"
    await async_wait_until(lambda: calls, timeout=10, message="no reclaim once the server was idle")
    assert calls == [False]  # (in the pool's thread)
    await asyncio.sleep(1.0)
    assert calls == [False], "reclaimed again with no run ended since"


def memory_cgroups_dying(memory_root: str) -> int:
    """Memory cgroups the kernel still holds (/proc/cgroups) but that have no directory any more."""
    with open("/proc/cgroups") as f:
        held = next(int(line.split()[2]) for line in f if line.split()[0] == "memory")
    present = sum(1 for _ in os.walk(memory_root))
    return held - present


def namespace_charge(parents: dict[str, str]) -> int:
    """What is charged to the namespace's memory cgroup and every cgroup below it, dying ones
    included (v1 counts hierarchically)."""
    if "memory" not in parents:
        return 0
    with open(os.path.join(parents["memory"], "memory.usage_in_bytes")) as f:
        return int(f.read())


def memory_root(parents: dict[str, str]) -> str | None:
    path = parents.get("memory")
    if path is None:
        return None
    with open("/proc/self/mounts") as f:
        mounts = [line.split()[1] for line in f if line.split()[2] == "cgroup" and "memory" in line.split()[3]]
    return next((m for m in mounts if path.startswith(m + "/")), None)


@pytest.mark.slow
async def test_a_thousand_runs_leave_no_cgroup_and_no_pile_of_dying_ones(api, wait_for):
    parents = await cgroup_parents(api)
    await spares_in_place(api, parents)
    root = memory_root(parents)
    dying_before = memory_cgroups_dying(root) if root else 0
    charged_before = namespace_charge(parents)
    ids = []
    for _ in range(1000):
        ids.append((await submit(api, spec(entry=NOOP)))["id"])
    for run_id in ids:
        final = await wait_for(run_id, timeout=300)
        assert final["state"] == "succeeded", final

    async def only_made_ahead() -> bool:
        code, status = await api("GET", "status")
        spares = {pid for z in status["warm_start"]["zygotes"] for pid in z["spares"]}
        found = leaves(parents)
        # What is left: the pool's (empty) and the spares' (each holds its spare), nothing else.
        return all(pids <= spares for pids in found.values()) and len(found) <= POOL_SIZE + SPARES * len(
            status["warm_start"]["zygotes"]
        )

    await async_wait_until(only_made_ahead, timeout=30, message=f"cgroups of ended runs are left: {leaves(parents)}")
    for ns in parents.values():  # nor in the other hierarchies
        left = [e.name for e in os.scandir(ns) if e.is_dir(follow_symlinks=False)]
        assert len(left) <= POOL_SIZE + SPARES, left
    if root is not None:
        # A removed memory cgroup stays in the kernel (dying) while pages are charged to it: the
        # files its run wrote. Each run's cgroup is emptied of them before its rmdir, so nothing
        # stays charged below the namespace but what its live cgroups (the spares') hold. The
        # host-wide count (/proc/cgroups against the directories) moves with every other process
        # that makes memory cgroups here: printed, not asserted.
        charged = namespace_charge(parents) - charged_before
        grown = memory_cgroups_dying(root) - dying_before
        print(f"charged below the namespace: {charged / MiB:+.1f} MiB; host-wide dying memory cgroups: {grown:+d}")
        assert charged < 12 * MiB, f"{charged / MiB:.1f} MiB more charged below the namespace after 1000 runs"


# --------------------------------------------------------------------------- pure cgroup v2 files


def v2_files(directory: Path) -> None:
    """What the kernel shows in a cgroup v2 directory with the memory controller enabled."""
    files = {
        "cgroup.procs": "",
        "cgroup.events": "populated 0\nfrozen 0\n",
        "cgroup.kill": "",
        "memory.max": "max\n",
        "memory.peak": "0\n",
        "memory.current": "0\n",
        "memory.events": "low 0\nhigh 0\nmax 0\noom 0\noom_kill 0\noom_group_kill 0\n",
        "memory.reclaim": "",
    }
    for name, text in files.items():
        (directory / name).write_text(text)


def test_the_pure_v2_memory_path_against_the_kernels_file_layout(tmp_path):
    ns = tmp_path / "user.slice" / "evalsched-0-x"
    ns.mkdir(parents=True)
    cgroups = Cgroups(CgroupSupport("v2", True, "cgroup.kill", "test", {"v2": str(ns)}))
    assert cgroups.spare_placement() == {"parents": [str(ns)], "prefix": cgroups.leaf_prefix}
    run = cgroups.make()
    leaf = Path(run.primary)
    assert leaf.parent == ns and leaf.name.startswith(cgroups.leaf_prefix) and set(run.paths) == {"v2"}
    v2_files(leaf)
    assert run.memory_kind == "v2" and run.read_memory_limit_mb() is None
    # The start: only the run's limit is written, then read back.
    assert run.assign("r1", 64) == ""
    assert run.run_id == "r1" and (leaf / "memory.max").read_text() == str(64 * MiB)
    assert run.memory_limit_mb == 64
    # The exit's figures.
    (leaf / "memory.peak").write_text(f"{100 * MiB + 1}\n")
    (leaf / "memory.events").write_text("low 0\nhigh 0\nmax 7\noom 2\noom_kill 2\noom_group_kill 0\n")
    assert run.memory_peak_mb() == 101 and run.oom_kills() == 2
    # Before its rmdir, what is still charged to it is reclaimed (memory.reclaim, v2's force_empty).
    (leaf / "memory.current").write_text(f"{3 * MiB}\n")
    run.reclaim()
    assert (leaf / "memory.reclaim").read_text() == str(3 * MiB)
    # A spare's own cgroup is known by its name, one of this server's only.
    assert cgroups.leaf(leaf.name) is not None and cgroups.leaf(leaf.name).primary == leaf
    assert cgroups.leaf("c+other+123") is None and cgroups.leaf("../x") is None


def test_a_v2_limit_that_cannot_be_written_is_said_and_the_cgroup_kept(tmp_path):
    ns = tmp_path / "ns"
    ns.mkdir()
    cgroups = Cgroups(CgroupSupport("v2", True, "cgroup.kill", "test", {"v2": str(ns)}))
    run = cgroups.make()
    v2_files(Path(run.primary))
    (Path(run.primary) / "memory.max").unlink()
    (Path(run.primary) / "memory.max").mkdir()  # refuses every write
    why = run.assign("r1", 64)
    assert why.startswith("cannot set") and "memory.max" in why and run.memory_limit_mb is None
    assert run.run_id == "r1"  # the run keeps its cgroup: kill and figures work without the limit


def test_a_spare_that_cannot_make_its_cgroup_says_so_and_leaves_nothing(tmp_path):
    missing = tmp_path / "gone"
    assert place_in_cgroup([str(missing)], "c+x+1") == {
        "op": "placed",
        "made": False,
        "joined": False,
        "why": f"{missing / 'c+x+1'}: No such file or directory",
    }
    there = tmp_path / "there"
    there.mkdir()
    answer = place_in_cgroup([str(there), str(missing)], "c+x+2")
    assert answer["made"] is False and not (there / "c+x+2").exists()  # what it made is removed


async def test_a_live_servers_namespace_is_never_taken_for_a_gone_ones(api):
    """The server holds its namespace (a shared flock on each hierarchy's directory) while it
    lives, so another server of the user, starting, leaves its cgroups made ahead alone; only a
    namespace whose lock is free is removed (tests/test_cgroups.py: after a kill -9)."""
    parents = await cgroup_parents(api)
    prefix = os.path.basename(next(iter(parents.values())))[: -len("0123456789")]
    assert prefix.startswith("evalsched-"), parents
    other = Cgroups.detect("auto", namespace=prefix + "x" * 10)  # another runs directory's server
    other.hold_namespace()
    try:
        other.remove_empty_siblings(prefix)
        for ns in parents.values():
            assert os.path.isdir(ns), f"a live server's namespace was removed: {ns}"
            fd = os.open(ns, os.O_RDONLY | os.O_DIRECTORY)
            try:
                with pytest.raises(BlockingIOError):
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held by the server
            finally:
                os.close(fd)
        code, status = await api("GET", "status")
        assert status["cgroups"]["mode"] != "none"
    finally:
        other.remove_namespace()


async def test_a_memory_limit_below_what_a_warm_process_holds_starts_the_run_cold(api, wait_for, monkeypatch):
    """A spare has its interpreter's pages charged to its cgroup already; a ``memory_mb`` below
    them cannot be written there: the kernel refuses it (EBUSY, here the first write of a limit
    fails so). The run used to go on warm and unlimited, with a warning; it starts cold instead,
    its limit written before it starts, and enforced."""
    parents = await cgroup_parents(api)
    await spares_in_place(api, parents)
    set_limit = RunCgroup.set_memory_limit
    refused: list[str] = []

    def busy_once(self, memory_mb):
        if not refused:
            refused.append(self.run_id)
            raise CgroupError(
                f"cannot write {self.primary / 'memory.limit_in_bytes'}: [Errno 16] Device or resource busy"
            )
        return set_limit(self, memory_mb)

    monkeypatch.setattr(RunCgroup, "set_memory_limit", busy_once)
    rec = await submit(api, spec(entry=NOOP, scheduling={"memory_mb": 256}))
    final = await wait_for(rec["id"])
    assert refused == [rec["id"]] and final["state"] == "succeeded", final
    assert final["start"] == "cold" and "memory_mb=256 could not be set on a warm process" in final["start_detail"], (
        final
    )
    assert final["warnings"] == [], final["warnings"]  # (the limit held: written before it started)
