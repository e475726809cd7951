"""Runs that survive the server, with real `jupyter server` processes killed with SIGKILL:
``auto_resume`` (an interrupted run resumes from its episodes) and detached runs (they keep
running and are re-attached by the next server)."""

from __future__ import annotations

import json
import os
import signal
import statistics
from pathlib import Path

import psutil
import pytest
from live_server import wait_until
from proc_status import alive

from jupyter_evalsched.client import LocalServer
from jupyter_evalsched.examples.basic import _unit_float

# Each test starts, kills and restarts real servers (about 10 s each): CI runs them with -m slow
# (docs/install.md: the default suite stays within ten minutes).
pytestmark = pytest.mark.slow

SLEEPY = "jupyter_evalsched.examples.basic:sleepy"
GATE = f"{Path(__file__).resolve().parent / 'evals_observed.py'}:gate"
FAST = [
    "--EvalSchedApp.cancel_grace_s=2.0",
    "--EvalSchedApp.reconcile_interval_s=0.5",
    "--EvalSchedApp.progress_interval_s=0.05",
]


def sleepy_run(episodes: int, seed: int, **kw) -> dict:
    spec = {
        "entrypoint": SLEEPY,
        "episodes": episodes,
        "seed": seed,
        "params": {"sleep_s": 0.1},
        "cwd": "/",  # outlives each server (a server's own root_dir is removed with it)
        "scheduling": {"marginal_vram_mb": 8000},
    }
    spec.update(kw)
    return spec


def gated_detached_run(pid_file: Path, gate: Path, **kw) -> dict:
    """A detached one-episode run that writes its pid to ``pid_file`` and ends once ``gate``
    exists: the test decides when."""
    spec = {
        "entrypoint": GATE,
        "episodes": 1,
        "params": {"pid_file": str(pid_file), "gate": str(gate)},
        "cwd": "/",  # outlives each server (a server's own root_dir is removed with it)
        "detach": True,
    }
    spec.update(kw)
    return spec


def lines_of(runs: Path, run_id: str) -> list[dict]:
    path = runs / run_id / "episodes.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def kill_server(server: LocalServer) -> None:
    server.process.send_signal(signal.SIGKILL)
    server.process.wait()
    server.cleanup()


def settled(client, run_id: str):
    rec = client.get(run_id)
    return rec if rec["state"] in ("succeeded", "failed", "cancelled", "aborted") else None


def test_auto_resume_after_sigkill_finishes_the_run_as_if_uninterrupted(tmp_path):
    runs = tmp_path / "runs"
    server = LocalServer(virtual_gpus="24000", runs_dir=str(runs), extra_args=FAST)
    try:
        c = server.client()
        rec = c.submit(sleepy_run(20, seed=500))
        wait_until(lambda: len(lines_of(runs, rec["id"])) >= 5, timeout=30)
        pid = wait_until(lambda: c.get(rec["id"])["pid"], timeout=10)  # its running record on disk
    finally:
        kill_server(server)
    wait_until(lambda: not alive(pid), timeout=5, message="the run outlived its server")
    before = lines_of(runs, rec["id"])
    assert 5 <= len(before) < 20

    restarted = LocalServer(
        virtual_gpus="24000", runs_dir=str(runs), extra_args=[*FAST, "--EvalSchedApp.auto_resume=True"]
    )
    try:
        c = restarted.client()
        final = wait_until(lambda: settled(c, rec["id"]), timeout=60)
        assert final["state"] == "succeeded", final
        assert final["attempt"] == 2 and [h["state"] for h in final["history"]] == ["aborted"]
        assert final["history"][0]["reason"].startswith("server_restart")
        lines = lines_of(runs, rec["id"])
        assert sorted(e["index"] for e in lines) == list(range(20))  # each index exactly once
        assert lines[: len(before)] == before  # what finished before the kill was not run again
        assert {e["attempt"] for e in lines[len(before) :]} == {2}
        expected = statistics.fmean(_unit_float(500 + i) for i in range(20))
        assert abs(final["metrics"]["score"]["mean"] - expected) < 1e-12
        assert (runs / rec["id"] / "_DONE").exists()
    finally:
        restarted.cleanup()


def test_without_auto_resume_the_run_is_aborted_and_resumable(tmp_path):
    runs = tmp_path / "runs"
    server = LocalServer(virtual_gpus="24000", runs_dir=str(runs), extra_args=FAST)
    try:
        c = server.client()
        rec = c.submit(sleepy_run(10, seed=1))
        wait_until(lambda: len(lines_of(runs, rec["id"])) >= 2, timeout=30)
    finally:
        server.stop()  # a clean shutdown: the run is killed and ends aborted (rule 4)
        server.cleanup()
    restarted = LocalServer(virtual_gpus="24000", runs_dir=str(runs), extra_args=FAST)
    try:
        c = restarted.client()
        aborted = c.get(rec["id"])
        assert aborted["state"] == "aborted" and aborted["reason"].startswith("server_restart")
        resumed = c.handle(rec["id"]).resume()
        assert resumed["attempt"] == 2
        final = wait_until(lambda: settled(c, rec["id"]), timeout=60)
        assert final["state"] == "succeeded"
        assert sorted(e["index"] for e in lines_of(runs, rec["id"])) == list(range(10))
    finally:
        restarted.cleanup()


def test_a_detached_run_survives_sigkill_of_the_server_and_is_reattached(tmp_path):
    # The run waits on a file the test writes only after the restart: it is certainly still
    # running when the restarted server looks, so the server must re-attach it to pass.
    runs = tmp_path / "runs"
    pid_file, gate = tmp_path / "run.pid", tmp_path / "open"
    body = gated_detached_run(pid_file, gate, scheduling={"marginal_vram_mb": 8000})
    server = LocalServer(virtual_gpus="24000", runs_dir=str(runs), extra_args=FAST)
    try:
        c = server.client()
        rec = c.submit(body)
        assert rec["detach"] is True
        wait_until(pid_file.exists, timeout=30, message="the detached run never started")
        pid = int(pid_file.read_text())
        wait_until(lambda: c.get(rec["id"])["pid"] == pid, timeout=10)
    finally:
        kill_server(server)
    assert alive(pid)  # it goes on without any server
    # A cancel the dead server had signalled, its reason carried to disk by a later write of the
    # record (its observed peaks, say): the cancel died with that server, and so does the reason.
    job = runs / rec["id"] / "job.json"
    record = json.loads(job.read_text())
    why = {"code": "cancelling", "arg": None, "detail": "cancelled through the API; SIGTERM sent", "holders": []}
    job.write_text(json.dumps({**record, "reason": f"cancelling: {why['detail']}", "why": why}))

    restarted = LocalServer(virtual_gpus="24000", runs_dir=str(runs), extra_args=FAST)
    try:
        c = restarted.client()
        rec2 = c.get(rec["id"])
        # Re-attached: running, its pid followed, its VRAM held in the ledger; nothing ending it.
        assert rec2["state"] == "running" and rec2["pid"] == pid and rec2["attempt"] == 1, rec2
        assert (rec2["reason"], rec2["why"]) == (None, None), rec2
        assert alive(pid)
        ledger = c.ledger()
        assert {"id": rec["id"], "marginal_vram_mb": 8000} in ledger["devices"][0]["runs"], ledger
        gate.touch()  # released: it ends, and the server that follows it records its verdict
        final = wait_until(lambda: settled(c, rec["id"]), timeout=60)
        assert final["state"] == "succeeded" and final["attempt"] == 1 and final["history"] == [], final
        assert final["summary"]["episodes_done"] == 1, final["summary"]
        wait_until(lambda: not alive(pid), timeout=5, message="the detached run outlived its _DONE")
        assert (runs / rec["id"] / "_DONE").exists()
        assert c.ledger()["devices"][0]["runs"] == []
    finally:
        restarted.cleanup()


def test_a_detached_run_that_died_unwatched_is_aborted(tmp_path):
    runs = tmp_path / "runs"
    server = LocalServer(virtual_gpus="24000", runs_dir=str(runs), extra_args=FAST)
    try:
        c = server.client()
        rec = c.submit(sleepy_run(1000, seed=2, detach=True))
        wait_until(lambda: len(lines_of(runs, rec["id"])) >= 1, timeout=30)
        pid = wait_until(lambda: c.get(rec["id"])["pid"], timeout=10)  # its running record on disk
    finally:
        kill_server(server)
    psutil.Process(pid).kill()  # it dies while no server watches it
    wait_until(lambda: not alive(pid), timeout=5)
    restarted = LocalServer(virtual_gpus="24000", runs_dir=str(runs), extra_args=FAST)
    try:
        rec2 = restarted.client().get(rec["id"])
        assert rec2["state"] == "aborted", rec2
        assert rec2["reason"].startswith("server_restart: the detached run died without finishing while no server")
        assert (runs / rec["id"] / "_DONE").exists()
    finally:
        restarted.cleanup()


def test_a_detached_run_whose_running_record_was_refused_never_runs_twice_at_once(tmp_path):
    """A detached run whose ``running`` record the disk refused (full) still says ``queued`` on
    disk when its server is killed: the next server queues it again, and must end the process
    still running it (found in the cgroup it left) before it starts the new one. It used to
    remove that cgroup off the loop, after the new attempt had started: the two processes of
    the run lived side by side for 120 to 180 ms (measured), each holding what the run holds."""
    runs = tmp_path / "runs"
    pid_file, gate = tmp_path / "run.pid", tmp_path / "open"
    body = gated_detached_run(pid_file, gate)
    server = LocalServer(virtual_gpus="24000", runs_dir=str(runs), extra_args=FAST)
    try:
        c = server.client()
        run_id = c.submit(body)["id"]
        wait_until(pid_file.exists, timeout=30, message="the detached run never started")
        pid = int(pid_file.read_text())
        wait_until(lambda: c.get(run_id)["pid"] == pid, timeout=10)
        parents = c.request("GET", "status")["cgroups"]["parents"]
    finally:
        kill_server(server)
    assert alive(pid)
    # More cgroups the killed server left, empty, ahead of the run's in name order (a pool's, a
    # crashed server's): the clean-up that removes them all one by one must not be what ends
    # the run's process. (Before, with them, the new attempt always started first.)
    left = [os.path.join(parent, f"c+00000000+{i:04d}") for parent in parents.values() for i in range(150)]
    for path in left:
        os.mkdir(path)
    # What a refused write of its running record leaves: the record as it was before it.
    job = runs / run_id / "job.json"
    record = json.loads(job.read_text())
    assert record["state"] == "running" and record["pid"] == pid, record
    record.update(state="queued", started_at=None, pid=None, pid_create_time=None, start=None, start_detail=None)
    job.write_text(json.dumps(record))

    restarted = LocalServer(virtual_gpus="24000", runs_dir=str(runs), extra_args=FAST)
    try:
        c = restarted.client()

        def started_again():
            rec = c.get(run_id)
            return rec["state"] == "running" and rec["pid"] not in (None, pid)

        wait_until(started_again, timeout=30, interval=0.001, message="the run never started again")
        assert not alive(pid), "the earlier process of the run still ran when its new one had started"
        gate.touch()
        final = wait_until(lambda: settled(c, run_id), timeout=60)
        assert final["state"] == "succeeded", final
        wait_until(lambda: not any(os.path.exists(path) for path in left), timeout=30)
    finally:
        restarted.cleanup()
        for path in left:
            if os.path.isdir(path):
                os.rmdir(path)
