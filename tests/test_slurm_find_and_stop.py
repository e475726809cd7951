"""A restarted server looking for the SLURM jobs of runs recovered queued without a job id, and
what a stop leaves, against a real single-node SLURM (the daemons of scripts/start_slurm.sh): a
``--comment`` of ``extra_sbatch_args`` does not hide a run's job; another job of the user cannot
pass for it by the lines its comment prints; a poll the stop stopped waiting for writes nothing;
a cancel SLURM could not be asked about is named at the stop."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
from live_server import wait_until
from slurm_jobs import (
    FAILING,
    GATED,
    LIVE_JOB_STATES,
    SQUEUE,
    edit_record,
    fake_command,
    final,
    jobs_of,
    long_run,
    sbatch,
    server,
    submitted_then_stopped,
    unrecorded,
)
from waiting import async_wait_until

pytestmark = [pytest.mark.slow, pytest.mark.slurm]


def test_a_comment_in_extra_sbatch_args_does_not_hide_the_job_at_the_next_start(tmp_path, scancel_left):
    """sbatch keeps the last ``--comment``, abbreviations ("--com=") included: one from the site's
    ``extra_sbatch_args`` used to replace the server's, so that the next server did not find the
    job of a run whose id was not recorded, and handed the run to SLURM a second time."""
    runs = tmp_path / "runs"
    extra = '--EvalSchedApp.slurm={"extra_sbatch_args": ["--com=site-accounting"]}'
    run_id, job_id = submitted_then_stopped(runs, extra)
    unrecorded(runs, run_id)
    with server(runs, extra) as again:
        c = again.client()
        assert wait_until(lambda: c.get(run_id)["slurm_job_id"], timeout=60) == job_id
        other = c.submit(long_run())  # (handed over once SLURM was asked: the first run is not)
        wait_until(lambda: c.get(other["id"])["slurm_job_id"], timeout=60)
        assert [job for job, _ in jobs_of(runs)[run_id]] == [job_id]
        c.cancel(run_id)
        c.cancel(other["id"])
        assert final(c, run_id)["state"] == "cancelled"
    assert [job for job, _ in jobs_of(runs)[run_id]] == [job_id]


def test_another_job_cannot_pass_for_a_runs_job_by_what_its_comment_prints(tmp_path, scancel_left):
    """A comment may hold line breaks, and squeue prints it as it is: another job of the same user
    printed lines that read as the run's job, naming another of the user's jobs or an id the user
    has none of. The server used to take the newest of them (then a cancel of the run scancel'd
    that other job); it now keeps the run's own job."""
    runs = tmp_path / "runs"
    run_id, job_id = submitted_then_stopped(runs)
    record = unrecorded(runs, run_id)
    tail = f"{runs / run_id / 'slurm.sbatch'}|evalsched:{run_id}:{record['attempt']}"
    out = f"--output={tmp_path}/slurm-%j.out"  # (not the working directory's)
    victim = sbatch(out, "--wrap=sleep 300")
    scancel_left.append(victim)
    scancel_left.append(sbatch(out, f"--comment=x|\n{victim}|{tail}|\n9{job_id}99|{tail}", "--wrap=sleep 300"))
    with server(runs) as again:
        c = again.client()
        assert wait_until(lambda: c.get(run_id)["slurm_job_id"], timeout=60) == job_id
        c.cancel(run_id)
        assert final(c, run_id)["state"] == "cancelled"
    state = subprocess.run([SQUEUE, "--noheader", f"--jobs={victim}", "--Format=State"], capture_output=True, text=True)
    assert state.stdout.strip() in LIVE_JOB_STATES, state


@pytest.fixture
def recovered_running(tmp_path, runs_dir, monkeypatch, scancel_left):
    """Before the test's server starts: a run whose job runs in SLURM, recorded queued with its job
    id (the server stopped before it heard the job started); the test's server's polls (squeue
    --jobs=...) wait for a gate."""
    run_id, job_id = submitted_then_stopped(runs_dir, running=True)
    edit_record(runs_dir, run_id, state="queued", slurm_state="PENDING", started_at=None)
    fake = tmp_path / "gated"
    fake_command(fake, GATED, "squeue", "--jobs=", "a poll")
    monkeypatch.setenv("PATH", f"{fake}{os.pathsep}{os.environ['PATH']}")
    return run_id, fake / "gate"


@pytest.mark.parametrize("evalsched_config", [{"slurm_enabled": True}])
async def test_a_poll_the_stop_stopped_waiting_for_writes_nothing(
    recovered_running, jp_serverapp, evalsched, runs_dir, log_messages
):
    """The first poll after a restart (``_learn``'s) answers only after the stop stopped waiting
    for it: what it says (the job runs) used to be written into the run's record after the stop,
    once the runs directory was let go of (the next server may have read it already)."""
    run_id, gate = recovered_running
    log_messages.gate = gate
    executor = evalsched.executors["slurm"]
    executor.stop_wait_s = 0.2  # (the gate opens only once it has passed)
    await jp_serverapp.extension_manager.extension_points["jupyter_evalsched"].app.stop_extension()
    await async_wait_until(lambda: not executor._handing, timeout=60)  # (the poll answered, and what follows ran)
    assert any("did not answer within" in m for m in log_messages.messages), log_messages.messages
    record = json.loads((runs_dir / run_id / "job.json").read_text())
    assert record["state"] == "queued" and record["started_at"] is None, record


@pytest.fixture
def recovered_unrecorded(tmp_path, runs_dir, monkeypatch, scancel_left):
    """Before the test's server starts: a run recovered queued without its job's id; the test's
    server cannot ask SLURM which jobs the user has (squeue --user=... fails)."""
    run_id, _ = submitted_then_stopped(runs_dir)
    unrecorded(runs_dir, run_id)
    fake = tmp_path / "failing"
    fake_command(fake, FAILING, "squeue", "--user=", "a look for the user's jobs")
    monkeypatch.setenv("PATH", f"{fake}{os.pathsep}{os.environ['PATH']}")
    return run_id


@pytest.mark.parametrize("evalsched_config", [{"slurm_enabled": True}])
async def test_a_cancel_slurm_could_not_be_asked_about_is_named_at_the_stop(
    recovered_unrecorded, jp_serverapp, api, evalsched, runs_dir, log_messages
):
    """A run recovered queued without a job id waits for SLURM to say whether it has its job,
    and so does its cancel (kept in memory only). SLURM does not answer before the stop: the
    cancel used to be lost without a word (the next server tracks the job, the run goes on);
    the stop now names it."""
    run_id = recovered_unrecorded
    await async_wait_until(lambda: any("could not be asked" in m for m in log_messages.messages), timeout=60)
    code, answer = await api("POST", f"runs/{run_id}/cancel")
    assert code == 200 and answer["state"] == "queued" and answer["cancel_requested"], answer
    await jp_serverapp.extension_manager.extension_points["jupyter_evalsched"].app.stop_extension()
    said = [m for m in log_messages.messages if "not yet scancel'd" in m]
    assert len(said) == 1 and run_id in said[0], log_messages.messages
