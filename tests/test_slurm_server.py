"""Runs handed to a real single-node SLURM through the REST API (#8): the same spec, the same
run-directory contract; one squeue per sweep; tracked again after a server restart.
Needs the daemons of scripts/start_slurm.sh (CI starts them)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from live_server import wait_until

from jupyter_evalsched.client import LocalServer

pytestmark = [pytest.mark.slow, pytest.mark.slurm]

SLEEPY = "jupyter_evalsched.examples.basic:sleepy"
CRASH = "jupyter_evalsched.examples.basic:crash"
FAST = ["--EvalSchedApp.reconcile_interval_s=0.5", "--EvalSchedApp.progress_interval_s=0.1"]
TERMINAL = ("succeeded", "failed", "cancelled", "aborted")


def slurm_run(entry=SLEEPY, episodes=1, sleep_s=0.05, **kw):
    return {
        "entrypoint": entry,
        "episodes": episodes,
        "params": {"sleep_s": sleep_s},
        "cwd": "/",
        "executor": "slurm",
        **kw,
    }


def final(client, run_id, timeout=120):
    return wait_until(lambda: (lambda r: r if r["state"] in TERMINAL else None)(client.get(run_id)), timeout)


def server(runs: Path) -> LocalServer:
    return LocalServer(virtual_gpus="24000", runs_dir=str(runs), env={"EVALSCHED_SLURM": "1"}, extra_args=FAST)


@pytest.fixture
def cleanup(tmp_path):
    """SLURM jobs outlive the server: whatever a failed test left behind is scancel'd."""
    yield
    import subprocess

    for job_file in (tmp_path / "runs").glob("*/job.json"):
        job = json.loads(job_file.read_text())
        if job.get("slurm_job_id") and not (job_file.parent / "_DONE").exists():
            subprocess.run(["scancel", job["slurm_job_id"]], check=False)


def test_slurm_runs_through_the_api(tmp_path, cleanup):
    runs = tmp_path / "runs"
    with server(runs) as srv:
        c = srv.client()
        # The time limit is whole minutes: submit it first so that the rest overlaps its wait.
        slow = c.submit(slurm_run(episodes=1000, sleep_s=1, timeout_s=30))
        ok = c.submit(slurm_run(episodes=3, params={"sleep_s": 0.1}, scheduling={"marginal_vram_mb": 1000}))
        bad = c.submit(slurm_run(entry=CRASH, params={"how": "exception"}))
        first = c.submit(slurm_run(episodes=2))
        second = c.submit(slurm_run(depends_on=[first["id"]]))
        after_bad = c.submit(slurm_run(depends_on=[bad["id"]]))
        doomed = c.submit(slurm_run(episodes=1000, sleep_s=1))

        rec = wait_until(lambda: (lambda r: r if r["state"] == "running" else None)(c.get(doomed["id"])), timeout=60)
        assert rec["executor"] == "slurm" and rec["slurm_job_id"] and rec["slurm_state"] == "RUNNING"
        view = c.queue()
        assert doomed["id"] in [r["id"] for r in view["running"]]
        assert all(d["allocated_mb"] == 0 for d in view["ledger"]["devices"])  # SLURM places these runs
        c.cancel(doomed["id"])

        r = final(c, ok["id"])
        assert r["state"] == "succeeded" and r["summary"]["episodes_done"] == 3
        r = final(c, bad["id"])
        assert r["state"] == "failed" and r["reason"].startswith("exception: RuntimeError")
        assert final(c, second["id"])["state"] == "succeeded"
        assert final(c, first["id"])["started_at"] <= c.get(second["id"])["started_at"]
        r = final(c, after_bad["id"])
        assert r["state"] == "failed" and r["reason"].startswith("dependency_failed:")
        r = final(c, doomed["id"])
        assert r["state"] == "cancelled" and r["reason"].startswith("cancelled")
        r = final(c, slow["id"], timeout=180)
        assert r["state"] == "failed" and r["reason"].startswith("timeout"), r["reason"]

        for rec in (ok, bad, first, second, after_bad, doomed, slow):
            run = runs / rec["id"]
            assert (run / "_DONE").exists(), rec["id"]
            job = json.loads((run / "job.json").read_text())
            assert job["state"] in TERMINAL and job["executor"] == "slurm"
        assert (runs / ok["id"] / "summary.json").exists() and (runs / ok["id"] / "slurm.sbatch").exists()
        for name in ("stdout.log", "stderr.log"):  # made by the server before sbatch, not by slurmstepd
            assert (runs / ok["id"] / name).stat().st_mode & 0o777 == 0o600, name


def test_slurm_runs_survive_a_server_restart(tmp_path, cleanup):
    runs = tmp_path / "runs"
    srv = server(runs)
    try:
        c = srv.client()
        rec = c.submit(slurm_run(episodes=8, sleep_s=1))
        wait_until(lambda: c.get(rec["id"])["state"] == "running", timeout=60)
    finally:
        srv.stop()
        srv.cleanup()
    with server(runs) as again:
        c = again.client()
        assert c.get(rec["id"])["state"] in ("running", "succeeded")  # tracked, not aborted
        r = final(c, rec["id"])
        assert r["state"] == "succeeded" and r["summary"]["episodes_done"] == 8


async def test_one_squeue_per_poll_with_many_jobs_and_back_off_while_nothing_changes(jp_serverapp, runs_dir, tmp_path):
    """The SLURM executor asks SLURM once for all tracked jobs (fake commands count calls), and
    asks less often while nothing changes (a clock the test drives)."""
    from jupyter_evalsched.scheduler.executors.slurm import SlurmExecutor
    from jupyter_evalsched.scheduler.runs import Run, new_record
    from jupyter_evalsched.scheduler.slurm import SlurmCli, SlurmCommands, SlurmConfig

    states = tmp_path / "squeue.out"
    states.write_text("")
    squeue = tmp_path / "squeue"
    squeue.write_text(f"#!/bin/sh\necho call >> {tmp_path / 'squeue.calls'}\ncat {states}\n")
    squeue.chmod(0o755)
    await jp_serverapp.extension_manager.start_all_extensions()
    sched = jp_serverapp.extension_manager.extension_points["jupyter_evalsched"].app.scheduler
    cli = SlurmCli(SlurmConfig(commands=SlurmCommands(squeue=str(squeue), scontrol="/bin/false")))
    now = [0.0]
    executor = SlurmExecutor(cli, poll_interval_s=1.0, max_poll_interval_s=8.0, clock=lambda: now[0])
    executor.bind(sched.context)
    for i in range(300):
        record = new_record(f"r{i}", {"name": "x", "episodes": 1}, seq=i, executor="slurm", run_dir=str(tmp_path))
        record.update(state="running", slurm_job_id=str(1000 + i), slurm_state="RUNNING")
        executor.recover(Run(record=record, spec={}, submitted_ts=0), done=False)
    # Every job listed as running: nothing changes from poll to poll.
    states.write_text("".join(f"{1000 + i}|RUNNING|None|0|node1|(null)|\n" for i in range(300)))

    polled_at = []
    for tick in range(60):
        now[0] = tick * 0.5
        before = cli.calls["squeue"]
        await executor.reconcile()
        assert cli.calls["squeue"] - before <= 1  # one squeue for 300 jobs
        if cli.calls["squeue"] > before:
            polled_at.append(now[0])
    # Each poll that finds nothing new doubles the interval (from 1 s), up to 8 s.
    gaps = [b - a for a, b in zip(polled_at, polled_at[1:], strict=False)]
    assert gaps[:3] == [2.0, 4.0, 8.0] and set(gaps[3:]) == {8.0}, polled_at

    # A change (a job finished) brings the interval back to 1 s.
    states.write_text(
        "".join(f"{1000 + i}|{'COMPLETED' if i == 0 else 'RUNNING'}|None|0|node1|(null)|\n" for i in range(300))
    )
    now[0] += 8.0
    await executor.reconcile()
    now[0] += 1.0
    before = cli.calls["squeue"]
    await executor.reconcile()
    assert cli.calls["squeue"] == before + 1


def test_slurm_runs_retry_and_resume_through_sbatch(tmp_path, cleanup):
    """A SLURM run that dies is retried as a new SLURM job (its attempt reaches the job through the
    exported environment) and skips the episodes done; a failed one resumes the same way."""
    runs = tmp_path / "runs"
    with server(runs) as srv:
        c = srv.client()
        retried = c.submit(
            slurm_run(
                entry=CRASH, episodes=3, params={"how": "exit", "code": 3, "at": 1, "until_attempt": 1}, retries=1
            )
        )
        failed = c.submit(slurm_run(entry=CRASH, episodes=2, params={"how": "exception", "at": 1, "until_attempt": 1}))
        r = final(c, retried["id"])
        assert r["state"] == "succeeded" and r["attempt"] == 2 and r["retries_used"] == 1, r
        assert r["history"][0]["reason"].startswith("exit_code:3"), r["history"]
        lines = [json.loads(x) for x in (runs / retried["id"] / "episodes.jsonl").read_text().splitlines()]
        assert [(e["index"], e["attempt"]) for e in lines] == [(0, 1), (1, 2), (2, 2)]
        first_job = r["history"][0]
        r = final(c, failed["id"])
        assert r["state"] == "failed" and r["reason"].startswith("exception")
        job_before = r["slurm_job_id"]
        assert c.handle(failed["id"]).resume()["attempt"] == 2
        r = final(c, failed["id"])
        assert r["state"] == "succeeded" and r["attempt"] == 2 and r["slurm_job_id"] != job_before, r
        assert first_job["episodes_done"] == 1
