"""A SLURM executor's stop and the next start, against a real single-node SLURM (the daemons of
scripts/start_slurm.sh): a run whose ``sbatch`` answered after its record was last written is
found in SLURM at the next start, not submitted twice; the cancels a stop finds under way (a
sweep's) are all sent; and a stop whose wait runs out leaves nothing inconsistent on disk."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
from pathlib import Path

import pytest
from live_server import wait_until
from slurm_jobs import (
    LIVE_JOB_STATES,
    final,
    jobs_of,
    long_run,
    server,
)
from waiting import async_wait_until

pytestmark = [pytest.mark.slow, pytest.mark.slurm]


def test_a_job_whose_id_was_not_recorded_is_found_at_the_next_start_not_submitted_again(tmp_path, scancel_left):
    """The server stopped (or died) after ``sbatch`` answered but before the job's id was in the
    run's record: the run is recovered queued without a job id. The next server used to hand it
    to sbatch again at its first chance (here: the next submission), two jobs of one run; it now
    asks SLURM first, finds the job by its script and comment, and tracks it."""
    runs = tmp_path / "runs"
    with server(runs) as srv:
        c = srv.client()
        rec = c.submit(long_run())
        job_id = wait_until(lambda: c.get(rec["id"])["slurm_job_id"], timeout=60)
    job_file = runs / rec["id"] / "job.json"
    record = json.loads(job_file.read_text())
    record.update(state="queued", slurm_job_id=None, slurm_state=None, started_at=None, reason=None, why=None)
    job_file.write_text(json.dumps(record))  # (as the record was before sbatch answered)

    with server(runs) as again:
        c = again.client()
        other = c.submit(long_run())  # (its hand-over handed every run without a job id)
        assert wait_until(lambda: c.get(rec["id"])["slurm_job_id"], timeout=60) == job_id
        wait_until(lambda: c.get(other["id"])["slurm_job_id"], timeout=60)
        assert [job for job, _ in jobs_of(runs)[rec["id"]]] == [job_id]
        c.cancel(rec["id"])
        c.cancel(other["id"])
        assert final(c, rec["id"])["state"] == "cancelled"
        assert [job for job, _ in jobs_of(runs)[rec["id"]]] == [job_id]


@pytest.mark.parametrize("evalsched_config", [{"slurm_enabled": True}])
async def test_a_stop_sends_every_cancel_a_sweep_asked_for(jp_serverapp, api, evalsched, runs_dir, scancel_left):
    """A sweep that ends at a stop cancels the runs it made (``Scheduler._cancel_all``, what the
    sweep's submission is given), some with a SLURM job, some whose ``sbatch`` is under way. The
    stop used to wait only for the sbatch calls: the scancels of the runs that had a job went one
    at a time, and those not sent when the I/O pool closed were lost (their jobs ran on). Every
    run now ends with no job of it left running in SLURM, and the next server says cancelled."""
    made = []
    for _ in range(4):
        code, rec = await api("POST", "runs", long_run())
        assert code == 201, rec
        made.append(rec["id"])
    await async_wait_until(lambda: all(evalsched.get(r).record["slurm_job_id"] for r in made), timeout=60)
    for _ in range(4):  # (their sbatch under way, or waiting its turn, as the stop begins)
        code, rec = await api("POST", "runs", long_run())
        assert code == 201, rec
        made.append(rec["id"])
    cancel = asyncio.ensure_future(evalsched._cancel_all([evalsched.get(r) for r in made]))
    await jp_serverapp.extension_manager.extension_points["jupyter_evalsched"].app.stop_extension()
    await cancel

    jobs = jobs_of(runs_dir)
    for run_id in made:
        record = json.loads((runs_dir / run_id / "job.json").read_text())
        if record["state"] == "cancelled":  # (it never reached SLURM)
            assert run_id not in jobs, (record, jobs.get(run_id))
            continue
        assert record["state"] == "queued", record
        assert [job for job, _ in jobs[run_id]] == [record["slurm_job_id"]], (record, jobs[run_id])
        assert jobs[run_id][0][1] not in LIVE_JOB_STATES, (run_id, jobs[run_id])
    with server(runs_dir) as again:
        c = again.client()
        assert [final(c, run_id)["state"] for run_id in made] == ["cancelled"] * len(made)


GATED_SBATCH = """#!/bin/sh
# The real sbatch, once the test opens the gate (it does once the stop has stopped waiting).
touch "{here}/called.$$"
while [ ! -e "{here}/gate" ]; do sleep 0.01; done
exec {sbatch} "$@"
"""


class _OpenOn(logging.Handler):
    """Opens the gate when the stop logs that it stopped waiting (no timer in the test)."""

    def __init__(self, gate: Path) -> None:
        super().__init__()
        self.gate = gate
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        self.messages.append(message)
        if "did not answer within" in message:
            self.gate.touch()


@pytest.mark.parametrize("evalsched_config", [{"slurm_enabled": True}])
async def test_a_stop_past_its_wait_says_what_it_left_and_writes_nothing_after(
    jp_serverapp, api, evalsched, runs_dir, tmp_path, monkeypatch, scancel_left
):
    """``sbatch`` answers only after the stop stopped waiting (a slurmctld that hangs). The log
    names the runs left; their records keep no job id and nothing is written after the stop; a
    run cancelled meanwhile has its job scancel'd all the same (it used to run on: its scancel
    waited for an event loop that had stopped serving it); the next server finds the other's job
    and tracks it, one job, not two."""
    fake = tmp_path / "gated"
    fake.mkdir()
    sbatch = fake / "sbatch"
    sbatch.write_text(GATED_SBATCH.format(here=fake, sbatch=shutil.which("sbatch")))
    sbatch.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake}{os.pathsep}{os.environ['PATH']}")
    handler = _OpenOn(fake / "gate")
    logging.getLogger("jupyter_evalsched").addHandler(handler)
    try:
        ids = []
        for _ in range(2):
            code, rec = await api("POST", "runs", long_run())
            assert code == 201, rec
            ids.append(rec["id"])
        cancelled, kept = ids
        await async_wait_until(lambda: len(list(fake.glob("called.*"))) == 2, timeout=30)
        code, answer = await api("POST", f"runs/{cancelled}/cancel")
        assert code == 200, answer
        evalsched.executors["slurm"].stop_wait_s = 0.2  # (the gate opens only once it has passed)
        await jp_serverapp.extension_manager.extension_points["jupyter_evalsched"].app.stop_extension()
        for _ in range(20):  # (whatever the event loop still had of the stop's work runs now)
            await asyncio.sleep(0)
    finally:
        logging.getLogger("jupyter_evalsched").removeHandler(handler)
    said = [m for m in handler.messages if "did not answer within" in m]
    assert len(said) == 1 and kept in said[0] and cancelled in said[0].split("Cancelled")[1], handler.messages
    for run_id in ids:
        record = json.loads((runs_dir / run_id / "job.json").read_text())
        assert record["state"] == "queued" and record["slurm_job_id"] is None, record
    jobs = jobs_of(runs_dir)
    assert len(jobs[cancelled]) == 1 and jobs[cancelled][0][1] not in LIVE_JOB_STATES, jobs
    assert len(jobs[kept]) == 1, jobs

    with server(runs_dir) as again:
        c = again.client()
        assert wait_until(lambda: c.get(kept)["slurm_job_id"], timeout=60) == jobs[kept][0][0]
        assert final(c, cancelled)["state"] == "cancelled"
        c.cancel(kept)
        assert final(c, kept)["state"] == "cancelled"
    assert len(jobs_of(runs_dir)[kept]) == 1
