"""Observed against declared (#15): per-run cgroups (nothing escapes, memory limits), observed VRAM
and host memory, enforcement of declarations, learned declarations ("auto")."""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from proc_status import main_thread_exited
from rest import spec, submit
from waiting import async_wait_until, wait_until

from jupyter_evalsched.client import LocalServer
from jupyter_evalsched.scheduler import escapees, observation
from jupyter_evalsched.scheduler.gpus import write_process_table

EVALS = str(Path(__file__).with_name("evals_observed.py"))


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


async def record(api, run_id: str) -> dict:
    code, rec = await api("GET", f"runs/{run_id}")
    assert code == 200, rec
    return rec


async def until(api, run_id: str, check, timeout: float = 15.0) -> dict:
    async def probe():
        rec = await record(api, run_id)
        return rec if check(rec) else None

    return await async_wait_until(probe, timeout=timeout)


def gated(tmp_path: Path, name: str, vram: int, **scheduling) -> tuple[dict, Path, Path]:
    """A run that writes its pid and runs until the test opens its gate (it then succeeds)."""
    pid_file, gate = tmp_path / f"{name}.pid", tmp_path / f"{name}.gate"
    body = {
        "name": name,
        "entrypoint": f"{EVALS}:gate",
        "params": {"pid_file": str(pid_file), "gate": str(gate)},
        "scheduling": {"marginal_vram_mb": vram, **scheduling},
    }
    return body, pid_file, gate


async def running_pid(api, run_id: str, pid_file: Path) -> int:
    await async_wait_until(pid_file.exists, timeout=15)
    return int(pid_file.read_text())


# --------------------------------------------------------------------------- observed VRAM and enforcement


async def test_a_run_over_its_declaration_is_observed_and_warned_about(
    api, tmp_path, plant_gpu_processes, jp_ws_fetch, gpu_source
):
    ws = await jp_ws_fetch("evalsched", "events")
    body, pid_file, gate = gated(tmp_path, "over", 8000)
    rec = await submit(api, body)
    pid = await running_pid(api, rec["id"], pid_file)
    gpu = (await record(api, rec["id"]))["devices"][0]
    plant_gpu_processes([{"pid": pid, "gpu": gpu, "used_mb": 10000}])
    rec = await until(api, rec["id"], lambda r: r["warnings"])
    assert rec["observed"]["peak_vram_mb"] == {str(gpu): 10000} and rec["observed"]["source"] == gpu_source
    assert rec["warnings"] == [f"over_vram: used 10000 MB on GPU {gpu}, declared 8000 MB"]
    assert rec["state"] == "running"  # warn is the default: it goes on
    # Its own VRAM is observed, never charged twice: the ledger holds its declaration alone.
    code, ledger = await api("GET", "ledger")
    dev = ledger["devices"][gpu]
    assert (dev["allocated_mb"], dev["unmanaged_mb"], dev["free_mb"]) == (8000, 0, 16000), dev
    warning = None
    while warning is None:
        message = json.loads(await ws.read_message())
        if message["type"] == "warning":
            warning = message
    assert warning == {
        "type": "warning",
        "run_id": rec["id"],
        "code": "over_vram",
        "message": rec["warnings"][0],
    }
    ws.close()
    plant_gpu_processes([{"pid": pid, "gpu": gpu, "used_mb": 3000}])  # peaks never go down
    gate.touch()
    final = await until(api, rec["id"], lambda r: r["state"] == "succeeded")
    assert final["observed"]["peak_vram_mb"] == {str(gpu): 10000}
    assert final["observed"]["peak_rss_mb"] > 0
    on_disk = json.loads(Path(final["run_dir"], "job.json").read_text())
    assert on_disk["observed"] == final["observed"] and on_disk["warnings"] == final["warnings"]


async def test_within_its_tolerance_a_run_gets_no_warning(api, tmp_path, plant_gpu_processes):
    body, pid_file, gate = gated(tmp_path, "close", 8000)
    rec = await submit(api, body)
    pid = await running_pid(api, rec["id"], pid_file)
    gpu = (await record(api, rec["id"]))["devices"][0]
    plant_gpu_processes([{"pid": pid, "gpu": gpu, "used_mb": 8700}])  # +8.75 %, under the 10 % tolerance
    rec = await until(api, rec["id"], lambda r: r["observed"] and r["observed"]["peak_vram_mb"])
    gate.touch()
    final = await until(api, rec["id"], lambda r: r["state"] == "succeeded")
    assert final["warnings"] == [] and final["observed"]["peak_vram_mb"] == {str(gpu): 8700}


@pytest.mark.parametrize("evalsched_config", [{"enforce_vram": "kill"}])
async def test_with_enforcement_a_run_over_its_declaration_is_stopped(api, tmp_path, plant_gpu_processes):
    body, pid_file, gate = gated(tmp_path, "greedy", 8000)
    rec = await submit(api, body)
    pid = await running_pid(api, rec["id"], pid_file)
    gpu = (await record(api, rec["id"]))["devices"][0]
    plant_gpu_processes([{"pid": pid, "gpu": gpu, "used_mb": 20000}])
    final = await until(api, rec["id"], lambda r: r["state"] not in ("queued", "running"))
    assert final["state"] == "failed"
    assert final["reason"] == f"over_vram: used 20000 MB on GPU {gpu}, declared 8000 MB"
    assert gone(pid)
    code, ledger = await api("GET", "ledger")
    assert ledger["devices"][gpu]["allocated_mb"] == 0


# --------------------------------------------------------------------------- cgroups


async def test_the_status_says_which_cgroup_mode_is_in_force(api):
    code, status = await api("GET", "status")
    cgroups = status["cgroups"]
    # These machines have a hybrid hierarchy writable as root.
    assert cgroups["mode"] != "none", cgroups
    assert cgroups["memory"] is True and cgroups["kill"] != "none"
    assert status["enforce_vram"] == "warn" and status["gpu_source"] == "virtual"


@pytest.mark.parametrize("fresh", [False, True], ids=["warm", "cold"])
async def test_cancel_leaves_nothing_of_a_run_that_escaped_its_session(api, tmp_path, wait_for, fresh):
    pid_file = tmp_path / "escaped.pid"
    rec = await submit(
        api,
        {
            "entrypoint": f"{EVALS}:escape",
            "params": {"pid_file": str(pid_file)},
            "cwd": str(tmp_path),
            "fresh_interpreter": fresh,
        },
    )
    await async_wait_until(pid_file.exists, timeout=15)
    code, running = await api("GET", f"runs/{rec['id']}")
    assert running["start"] == ("cold" if fresh else "warm"), running
    grandchild = int(pid_file.read_text())
    proc = psutil.Process(grandchild)
    assert proc.environ() == {} and os.getsid(grandchild) != os.getsid(proc.ppid() or grandchild)
    code, _ = await api("POST", f"runs/{rec['id']}/cancel")
    final = await wait_for(rec["id"])
    assert final["state"] == "cancelled"
    await async_wait_until(lambda: gone(grandchild), timeout=5)


@pytest.mark.parametrize("fresh", [False, True], ids=["warm", "cold"])
async def test_a_run_that_leaves_its_cgroup_is_still_attributed_and_ended_by_cancel(
    api, tmp_path, wait_for, evalsched, plant_gpu_processes, fresh
):
    """A run has the server's uid: it can write its pid into the server's own cgroup.procs (where
    no cgroup namespace stops it on this host), then start a child (setsid) and an orphaned
    grandchild (setsid, its parent gone) outside every process group of the run. Their VRAM is
    still the run's (by ancestry, and by the run's environment), and cancel ends all three."""
    code, status = await api("GET", "status")
    parents = status["cgroups"]["parents"]
    procs = [os.path.join(os.path.dirname(ns_dir), "cgroup.procs") for ns_dir in parents.values()]
    pid_file = tmp_path / "left.json"
    body = {
        "entrypoint": f"{EVALS}:leave",
        "params": {"procs": procs, "pid_file": str(pid_file)},
        "cwd": str(tmp_path),
        "scheduling": {"marginal_vram_mb": 8000},
        "fresh_interpreter": fresh,
    }
    rec = await submit(api, body)
    await async_wait_until(pid_file.exists, timeout=15)
    assert (await record(api, rec["id"]))["start"] == ("cold" if fresh else "warm")
    left = json.loads(pid_file.read_text())
    assert left["left"] == procs
    run_pid, child, orphan = left["run"], left["child"], left["orphan"]
    # (A run's cgroup is named when it is made ahead, not after the run: its process knows it.)
    cgroup = evalsched.executors["local"].launcher._procs[rec["id"]].cgroup
    assert cgroup is not None and not cgroup.pids() & {run_pid, child, orphan}  # out of the run's cgroup
    assert psutil.Process(orphan).ppid() != run_pid and os.getsid(orphan) != os.getsid(run_pid)
    assert os.getsid(child) != os.getsid(run_pid)
    gpu = (await record(api, rec["id"]))["devices"][0]
    plant_gpu_processes([{"pid": child, "gpu": gpu, "used_mb": 3000}, {"pid": orphan, "gpu": gpu, "used_mb": 4000}])
    rec = await until(api, rec["id"], lambda r: (r["observed"] or {}).get("peak_vram_mb", {}).get(str(gpu)) == 7000)
    code, ledger = await api("GET", "ledger")
    dev = ledger["devices"][gpu]
    assert (dev["allocated_mb"], dev["unmanaged_mb"]) == (8000, 0), dev  # the run's, not nobody's
    code, _ = await api("POST", f"runs/{rec['id']}/cancel")
    assert code == 200
    final = await wait_for(rec["id"])
    assert final["state"] == "cancelled", final
    for pid in (run_pid, child, orphan):
        await async_wait_until(lambda pid=pid: gone(pid), timeout=5, message=f"process {pid} of the run outlived it")


def test_a_process_is_a_runs_by_its_environment_only_under_the_servers_uid():
    from jupyter_evalsched.scheduler.observation import run_of_environment

    run_id = "20260101T000000.000000-abcdef"
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "EVALSCHED_RUN_ID": run_id}
    ours = subprocess.Popen(["sleep", "60"], env=env)
    others = threads = None
    if os.getuid() == 0:  # another user's process naming our run is not believed
        others = subprocess.Popen(["sleep", "60"], env=env, user=65534)
    try:
        # (Right after its exec a process's environment reads empty for a moment.)
        wait_until(lambda: run_of_environment(ours.pid, {run_id: None}) == run_id, timeout=20)
        assert run_of_environment(ours.pid, {"20260101T000000.000000-000000": None}) is None
        if others is not None:
            named = f"EVALSCHED_RUN_ID={run_id}".encode()
            wait_until(lambda: named in (escapees.read_environ(others.pid) or b""), timeout=20)
            assert run_of_environment(others.pid, {run_id: None}) is None
        assert run_of_environment(os.getpid(), {run_id: None}) is None  # no such variable
        threads = main_thread_exited(env)  # its /proc/<pid> a zombie's, its threads the run's
        assert run_of_environment(threads.pid, {run_id: None}) == run_id
    finally:
        for proc in (ours, others, threads):
            if proc is not None:
                proc.kill()
                proc.wait()


async def test_a_run_over_its_memory_limit_fails_with_oom(api, wait_for):
    rec = await submit(api, {"entrypoint": f"{EVALS}:hog", "params": {"mb": 400}, "scheduling": {"memory_mb": 100}})
    final = await wait_for(rec["id"])
    assert final["state"] == "failed", final
    assert final["reason"].startswith("oom: the run reached its memory limit (memory_mb=100"), final["reason"]
    assert final["memory_mb"] == 100
    assert final["observed"]["peak_rss_mb"] >= 90, final["observed"]


async def test_a_run_within_its_memory_limit_succeeds_and_leaves_no_cgroup(api, wait_for, tmp_path):
    where = tmp_path / "cgroup.txt"
    params = {"mb": 20, "cgroup_file": str(where)}
    rec = await submit(api, {"entrypoint": f"{EVALS}:hog", "params": params, "scheduling": {"memory_mb": 200}})
    final = await wait_for(rec["id"])
    assert final["state"] == "succeeded" and final["warnings"] == [], final
    assert 20 <= final["observed"]["peak_rss_mb"] <= 200
    # The run's own cgroup directories (as the run saw them), in the server's hierarchies: gone.
    parents = (await api("GET", "status"))[1]["cgroups"]["parents"]
    names = {line.split(":", 2)[2].rstrip("/").rsplit("/", 1)[-1] for line in where.read_text().splitlines()}
    dirs = [os.path.join(ns, name) for ns in parents.values() for name in names if name.startswith("c+")]
    assert dirs, (where.read_text(), parents)
    await async_wait_until(lambda: not any(os.path.isdir(d) for d in dirs), timeout=5, message=str(dirs))


@pytest.mark.parametrize("evalsched_config", [{"cgroups": False}])
async def test_without_cgroups_runs_work_and_a_memory_limit_is_said_to_be_unenforced(api, wait_for):
    code, status = await api("GET", "status")
    assert status["cgroups"]["mode"] == "none"
    rec = await submit(api, {"entrypoint": f"{EVALS}:hog", "params": {"mb": 5}, "scheduling": {"memory_mb": 100}})
    final = await wait_for(rec["id"])
    assert final["state"] == "succeeded"
    assert final["warnings"] and final["warnings"][0].startswith("memory_limit_not_enforced: memory_mb=100")


@pytest.mark.slow  # heavy (a model host or a killed server); CI runs it with -m slow
def test_a_server_killed_mid_run_leaves_nothing_after_its_restart(tmp_path):
    """Server death: the run dies with the server (PDEATHSIG), its escaped grandchild with the
    run's cgroup when the next server recovers the runs directory."""
    runs = str(tmp_path / "runs")
    pid_file = tmp_path / "escaped.pid"
    server = LocalServer(virtual_gpus="24000", runs_dir=runs)
    try:
        c = server.client()
        rec = c.submit({"entrypoint": f"{EVALS}:escape", "params": {"pid_file": str(pid_file)}, "cwd": "/"})
        wait_until(pid_file.exists, timeout=15)
        # Running as the API says it, so on disk too: killed before its running record was written,
        # the run would be queued again by the next server, and run again (docs/reference.md).
        wait_until(lambda: c.get(rec["id"])["state"] == "running", timeout=15)
        grandchild = int(pid_file.read_text())
        server.process.send_signal(signal.SIGKILL)
        server.process.wait()
        assert not gone(grandchild)  # outside every group and without the run's environment
    finally:
        server.cleanup()
    with LocalServer(virtual_gpus="24000", runs_dir=runs) as again:
        final = again.client().get(rec["id"])
        assert final["state"] == "aborted" and final["reason"].startswith("server_restart")
        wait_until(lambda: gone(grandchild), timeout=5)
        parents = again.client().request("GET", "status")["cgroups"]["parents"]
        assert parents and all(os.path.isdir(p) for p in parents.values())
    # A server that stops leaves no cgroup behind, not even its (empty) namespace.
    assert not any(os.path.exists(p) for p in parents.values()), parents


@pytest.mark.slow  # heavy (a model host or a killed server); CI runs it with -m slow
def test_without_cgroups_a_restart_kills_what_each_killed_run_left_behind(tmp_path):
    """Server death without cgroups: each run dies with the server, and its escaped grandchild
    (its own session, the run's environment) is found by its ``EVALSCHED_RUN_ID`` when the next
    server recovers the runs directory."""
    runs = str(tmp_path / "runs")
    args = ["--EvalSchedApp.cgroups=False"]
    pid_files = [tmp_path / f"escaped-{i}.pid" for i in range(2)]
    server = LocalServer(virtual_gpus="24000", runs_dir=runs, extra_args=args)
    try:
        c = server.client()
        recs = [
            c.submit(
                {
                    "entrypoint": f"{EVALS}:escape",
                    "params": {"pid_file": str(pid_file), "keep_env": True},
                    "cwd": "/",
                }
            )
            for pid_file in pid_files
        ]
        wait_until(lambda: all(p.exists() for p in pid_files), timeout=15)
        # Running as the API says it, so on disk too: killed before its running record was written,
        # a run would be queued again by the next server, and run again (docs/reference.md).
        wait_until(lambda: all(c.get(r["id"])["state"] == "running" for r in recs), timeout=15)
        grandchildren = [int(p.read_text()) for p in pid_files]
        server.process.send_signal(signal.SIGKILL)
        server.process.wait()
        assert not any(gone(pid) for pid in grandchildren)  # outside every group, and no cgroup holds them
    finally:
        server.cleanup()
    try:
        with LocalServer(virtual_gpus="24000", runs_dir=runs, extra_args=args) as again:
            for rec in recs:
                final = again.client().get(rec["id"])
                assert final["state"] == "aborted" and final["reason"].startswith("server_restart"), final
            wait_until(lambda: all(gone(pid) for pid in grandchildren), timeout=5)
    finally:
        for pid in grandchildren:  # (a failure must not leave them sleeping)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.slow  # heavy (a model host or a killed server); CI runs it with -m slow
def test_observed_peaks_reach_job_json_while_the_run_runs_and_survive_a_server_kill(tmp_path):
    """A peak's rise is written to job.json while the run runs (not only at its next transition):
    a server killed mid-run leaves it on disk, and the recovered record keeps it."""
    runs = str(tmp_path / "runs")
    args = ["--EvalSchedApp.reconcile_interval_s=0.5"]
    server = LocalServer(virtual_gpus="24000", runs_dir=runs, gpu_processes=True, extra_args=args)
    try:
        c = server.client()
        body, pid_file, _gate = gated(tmp_path, "peaks", 8000)
        rec = c.submit(body)
        wait_until(pid_file.exists, timeout=15)
        pid = int(pid_file.read_text())
        wait_until(lambda: c.get(rec["id"])["state"] == "running", timeout=15)
        gpu = c.get(rec["id"])["devices"][0]
        job = Path(c.get(rec["id"])["run_dir"], "job.json")

        def on_disk(mb: int) -> bool:
            disk = json.loads(job.read_text())
            return disk["state"] == "running" and (disk.get("observed") or {}).get("peak_vram_mb") == {str(gpu): mb}

        write_process_table(server.gpu_processes_file, [{"pid": pid, "gpu": gpu, "used_mb": 9000}])
        wait_until(lambda: on_disk(9000), timeout=15)
        # A later rise is written again (after the write interval), still while it runs.
        write_process_table(server.gpu_processes_file, [{"pid": pid, "gpu": gpu, "used_mb": 12000}])
        wait_until(lambda: on_disk(12000), timeout=30)
        assert json.loads(job.read_text())["observed"]["peak_rss_mb"] > 0
        server.process.send_signal(signal.SIGKILL)
        server.process.wait()
    finally:
        server.cleanup()
    with LocalServer(virtual_gpus="24000", runs_dir=runs) as again:
        final = again.client().get(rec["id"])
        assert final["state"] == "aborted", final
        assert final["observed"]["peak_vram_mb"] == {str(gpu): 12000}, final


# --------------------------------------------------------------------------- learned declarations


async def test_auto_declares_the_highest_observed_peak_plus_the_margin(api, tmp_path, plant_gpu_processes):
    peaks = {}
    for name, used in (("first", 7000), ("second", 9000)):
        body, pid_file, gate = gated(tmp_path, name, 10000)
        rec = await submit(api, body)
        pid = await running_pid(api, rec["id"], pid_file)
        gpu = (await record(api, rec["id"]))["devices"][0]
        plant_gpu_processes([{"pid": pid, "gpu": gpu, "used_mb": used}])
        await until(api, rec["id"], lambda r: r["observed"] and r["observed"]["peak_vram_mb"])
        gate.touch()
        await until(api, rec["id"], lambda r: r["state"] == "succeeded")
        peaks[rec["id"]] = used
    plant_gpu_processes([])
    body, _, gate = gated(tmp_path, "third", "auto")
    gate.touch()
    rec = await submit(api, body)
    highest = max(peaks, key=peaks.get)
    assert rec["marginal_vram_mb"] == math.ceil(9000 * 1.1) == 9900
    assert rec["marginal_vram_source"] == f"auto: 9900 MB = the 9000 MB peak of run {highest} + 10%"
    saved = json.loads(Path(rec["run_dir"], "spec.json").read_text())
    assert saved["scheduling"]["marginal_vram_mb"] == 9900
    declared = await submit(api, gated(tmp_path, "fourth", 1000)[0])
    assert declared["marginal_vram_source"] == "declared"


async def test_auto_without_history_is_a_422_that_says_what_to_do(api):
    code, err = await api("POST", "runs", spec(vram="auto"))
    assert code == 422
    assert "'auto' needs an earlier succeeded run of 'jupyter_evalsched.examples.basic:sleepy'" in err["message"]
    assert "declare a number" in err["message"]
    assert err["detail"][0]["loc"] == ["scheduling", "marginal_vram_mb"]


def test_the_process_trees_are_those_the_kernel_says(tmp_path):
    """The walk of the process table that the observation makes each second (every process's
    parent, read from /proc here): a process's tree is it and every descendant, a grandchild
    whose parent left its session included, and nothing else; the parents agree with psutil's.
    The grandchild's command name holds a ')', a newline and digits, as a name may."""
    odd = tmp_path / "a) 9 9\n(b"
    odd.symlink_to(shutil.which("sleep") or "/bin/sleep")
    code = (
        "import subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', "
        "'import os, subprocess, sys, time; os.setsid(); "
        'subprocess.Popen([sys.argv[1], "60"]); time.sleep(60)\', sys.argv[1]])\n'
        "time.sleep(60)\n"
    )
    root = subprocess.Popen([sys.executable, "-c", code, str(odd)], start_new_session=True)
    try:
        wait_until(lambda: len(psutil.Process(root.pid).children(recursive=True)) == 2, timeout=20)
        descendants = psutil.Process(root.pid).children(recursive=True)
        assert any(")" in p.name() for p in descendants)
        expected = {root.pid} | {p.pid for p in descendants}
        children = observation._children_map()
        assert observation._tree(root.pid, children) == expected
        assert observation._tree(os.getpid(), children) >= expected  # (this process is their parent)
        for pid in expected - {root.pid}:
            assert pid in children[psutil.Process(pid).ppid()]
    finally:
        pids = [root.pid]
        with contextlib.suppress(psutil.Error):
            pids += [p.pid for p in psutil.Process(root.pid).children(recursive=True)]
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        root.wait()
