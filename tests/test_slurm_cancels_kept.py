"""What the SLURM executor does with cancels and job ids that go wrong, against a real single-node
SLURM (the daemons of scripts/start_slurm.sh): a failed ``scancel`` is sent again (a bounded
number of times); a record whose job id is malformed costs only that run; the other jobs SLURM
has of a run found again after a restart are scancel'd; the stop waits for a cancel queued while
it waits."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest
from live_server import wait_until
from slurm_jobs import (
    GATED,
    LIVE_JOB_STATES,
    SCANCEL,
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

from jupyter_evalsched.scheduler.executors.slurm import CANCEL_TRIES

pytestmark = [pytest.mark.slow, pytest.mark.slurm]

# Polls (and so the retries of a failed scancel) at most every half second.
QUICK_POLLS = {"slurm_enabled": True, "slurm": {"poll_interval_s": 0.1, "max_poll_interval_s": 0.5}}
BAD_JOB_ID = "12x"

FLAKY = """#!/bin/sh
# The real scancel, except that it fails as with slurmctld unreachable while {here}/down exists.
echo "$*" >> "{here}/calls"
if [ -e "{here}/down" ]; then
  echo "scancel: error: Kill job error on job id $1: Unable to contact slurm controller (connect failure)" >&2
  exit 1
fi
exec {real} "$@"
"""


def live(runs: Path, run_id: str) -> list[str]:
    """The jobs of the run that SLURM still runs or holds."""
    return [job for job, state in jobs_of(runs).get(run_id, []) if state in LIVE_JOB_STATES]


def handed_over(runs: Path, n: int) -> list[tuple[str, str]]:
    """``n`` SLURM runs handed over by a server that then stopped: [(run id, job id)]."""
    with server(runs) as srv:
        c = srv.client()
        ids = [c.submit(long_run())["id"] for _ in range(n)]
        return [(r, wait_until(lambda r=r: c.get(r)["slurm_job_id"], timeout=60)) for r in ids]


@pytest.fixture
def flaky_scancel(tmp_path, monkeypatch):
    """The server's scancel fails until the test removes ``down``; ``calls`` lists its calls."""
    fake = tmp_path / "flaky"
    fake.mkdir()
    path = fake / "scancel"
    path.write_text(FLAKY.format(here=fake, real=SCANCEL))
    path.chmod(0o755)
    (fake / "down").touch()
    monkeypatch.setenv("PATH", f"{fake}{os.pathsep}{os.environ['PATH']}")
    return fake


def scancels(fake: Path) -> list[str]:
    calls = fake / "calls"
    return calls.read_text().splitlines() if calls.exists() else []


async def submitted(api, evalsched) -> tuple[str, str]:
    code, rec = await api("POST", "runs", long_run())
    assert code == 201, rec
    job_id = await async_wait_until(lambda: evalsched.get(rec["id"]).record["slurm_job_id"], timeout=60)
    return rec["id"], job_id


@pytest.mark.parametrize("evalsched_config", [QUICK_POLLS])
async def test_a_failed_scancel_is_sent_again(
    flaky_scancel, jp_serverapp, api, evalsched, runs_dir, log_messages, scancel_left
):
    """slurmctld does not answer the scancel of a cancel (a restart, a network blip): the cancel
    used to be dropped with a log line, and the job ran on; it is now sent again with a later
    poll, and the run ends cancelled."""
    run_id, job_id = await submitted(api, evalsched)
    code, answer = await api("POST", f"runs/{run_id}/cancel")
    assert code == 200, answer
    ending = f"scancel of SLURM job {job_id} asked; it ends once SLURM says the job ended"
    assert answer["why"]["code"] == "cancelling" and answer["reason"].endswith(ending), answer
    await async_wait_until(
        lambda: any("scancel" in m and job_id in m and "failed" in m for m in log_messages.messages), timeout=60
    )
    # Polls came and went (the job pending or running all along): the record still says it is ending.
    await async_wait_until(lambda: evalsched.get(run_id).record["slurm_state"] == "RUNNING", timeout=60)
    await asyncio.sleep(1.0)  # (two polls at least)
    record = evalsched.get(run_id).record
    assert record["state"] == "running" and record["why"]["code"] == "cancelling", record
    (flaky_scancel / "down").unlink()
    await async_wait_until(lambda: evalsched.get(run_id).state == "cancelled", timeout=60)
    assert len(scancels(flaky_scancel)) >= 2
    assert not live(runs_dir, run_id)


@pytest.mark.parametrize("evalsched_config", [QUICK_POLLS])
async def test_a_scancel_that_keeps_failing_is_given_up_and_said(
    flaky_scancel, jp_serverapp, api, evalsched, log_messages, scancel_left
):
    """The retries are bounded: after CANCEL_TRIES failed scancels the server gives up on the
    cancel and says so, naming the run and its job; a cancel asked again is sent again."""
    run_id, job_id = await submitted(api, evalsched)
    code, answer = await api("POST", f"runs/{run_id}/cancel")
    assert code == 200, answer
    said = await async_wait_until(lambda: [m for m in log_messages.messages if "gave up" in m], timeout=120)
    assert run_id in said[0] and job_id in said[0], said
    assert len(scancels(flaky_scancel)) == CANCEL_TRIES
    record = evalsched.get(run_id).record
    assert record["state"] in ("queued", "running")
    # Its job may run on: the record no longer says it ends (the panel offers Cancel again).
    assert (record["why"] or {}).get("code") != "cancelling", record
    (flaky_scancel / "down").unlink()
    code, answer = await api("POST", f"runs/{run_id}/cancel")
    assert code == 200 and answer["why"]["code"] == "cancelling", answer
    await async_wait_until(lambda: evalsched.get(run_id).state == "cancelled", timeout=60)
    assert len(scancels(flaky_scancel)) == CANCEL_TRIES + 1


def test_a_malformed_job_id_costs_only_its_own_run(tmp_path, scancel_left):
    """A record whose ``slurm_job_id`` is not a job id (a job.json edited or damaged) used to fail
    every poll (the whole squeue refused before it ran): no SLURM run of the server was followed
    any more. That run alone now ends failed, saying why, and the others are followed."""
    runs = tmp_path / "runs"
    (good, _), (bad, _) = handed_over(runs, 2)
    edit_record(runs, bad, slurm_job_id=BAD_JOB_ID)
    with server(runs) as again:
        c = again.client()
        ended = final(c, bad, timeout=60)
        assert ended["state"] == "failed", ended
        assert ended["reason"].startswith("exception:") and repr(BAD_JOB_ID) in ended["reason"], ended
        c.cancel(good)
        assert final(c, good, timeout=60)["state"] == "cancelled"
    assert not live(runs, good)


@pytest.fixture
def recovered_with_a_bad_id(tmp_path, runs_dir, monkeypatch, scancel_left):
    """Before the test's server starts: three runs handed to SLURM; the first recovered queued
    without its job id (so that the start asks SLURM for its job: squeue --user=..., which waits
    for the gate), the third with a malformed job id."""
    runs = handed_over(runs_dir, 3)
    unrecorded(runs_dir, runs[0][0])
    edit_record(runs_dir, runs[2][0], slurm_job_id=BAD_JOB_ID)
    fake = tmp_path / "gated"
    fake_command(fake, GATED, "squeue", "--user=", "the look for the user's jobs")
    monkeypatch.setenv("PATH", f"{fake}{os.pathsep}{os.environ['PATH']}")
    return runs, fake / "gate"


@pytest.mark.parametrize("evalsched_config", [{"slurm_enabled": True}])
async def test_a_malformed_job_id_does_not_sink_the_scancel_of_the_others(
    recovered_with_a_bad_id, jp_serverapp, evalsched, runs_dir, log_messages, scancel_left
):
    """A sweep's cancel is one scancel for all its runs: one malformed id used to make the whole
    command refused (the other jobs ran on). That run now ends failed at once, saying why (no
    poll has run yet: the start waits for SLURM's answer), and the others' jobs are scancel'd,
    the first time."""
    (found, found_job), (good, _), (bad, _) = recovered_with_a_bad_id[0]
    await evalsched._cancel_all([evalsched.get(good), evalsched.get(bad)])
    assert evalsched.get(bad).state == "failed" and repr(BAD_JOB_ID) in evalsched.get(bad).record["reason"]
    recovered_with_a_bad_id[1].touch()
    await async_wait_until(lambda: evalsched.get(good).state == "cancelled", timeout=60)
    assert not live(runs_dir, good)
    assert not [m for m in log_messages.messages if "scancel" in m and "failed" in m], log_messages.messages
    record = json.loads((runs_dir / bad / "job.json").read_text())
    assert record["state"] == "failed" and repr(BAD_JOB_ID) in record["reason"], record
    assert await async_wait_until(lambda: evalsched.get(found).record["slurm_job_id"], timeout=60) == found_job


def test_the_other_jobs_of_a_run_found_again_are_scancelled(tmp_path, scancel_left):
    """SLURM has two jobs of a run recovered queued without a job id: the server tracked the
    newest and left the other running, untracked, writing into the same run directory. It is now
    scancel'd."""
    runs = tmp_path / "runs"
    run_id, first = submitted_then_stopped(runs)
    unrecorded(runs, run_id)
    # The same script (its #SBATCH lines: the run's comment and logs), held: it never starts.
    second = sbatch("--hold", f"--output={tmp_path / 'held.out'}", str(runs / run_id / "slurm.sbatch"))
    assert int(second) > int(first)
    with server(runs) as again:
        c = again.client()
        assert wait_until(lambda: c.get(run_id)["slurm_job_id"], timeout=60) == second
        wait_until(lambda: first not in live(runs, run_id), timeout=60)
        c.cancel(run_id)
        assert final(c, run_id)["state"] == "cancelled"
    assert not live(runs, run_id)


@pytest.fixture
def cancelled_unrecorded(tmp_path, runs_dir, monkeypatch, scancel_left):
    """Before the test's server starts: a run handed to SLURM, recovered queued without its job
    id. The test's server's look for the user's jobs (squeue --user=...) waits for the gate
    ``squeue``, its scancels for the gate ``scancel``."""
    run_id, job_id = submitted_then_stopped(runs_dir)
    unrecorded(runs_dir, run_id)
    gates = {}
    for name, marker in (("squeue", "--user="), ("scancel", "")):
        fake = tmp_path / f"gated-{name}"
        fake_command(fake, GATED, name, marker, "every call" if not marker else "the look for the user's jobs")
        monkeypatch.setenv("PATH", f"{fake}{os.pathsep}{os.environ['PATH']}")
        gates[name] = fake / "gate"
    return run_id, job_id, gates


@pytest.mark.parametrize("evalsched_config", [{"slurm_enabled": True}])
async def test_the_stop_waits_for_a_cancel_queued_while_it_waits(
    cancelled_unrecorded, jp_serverapp, api, evalsched, runs_dir
):
    """The stop waits for what the executor has under way: here the start's look for the jobs of a
    cancelled run recovered without a job id. Once SLURM answers, that run's job is found and its
    scancel queued, while the stop waits: the stop used to wait only for the tasks there were when
    it began, and so ended before that scancel was sent (its I/O pool then closed). It now waits
    until no task is left."""
    run_id, job_id, gates = cancelled_unrecorded
    executor = evalsched.executors["slurm"]
    code, answer = await api("POST", f"runs/{run_id}/cancel")
    assert code == 200 and answer["state"] == "queued" and answer["cancel_requested"], answer
    app = jp_serverapp.extension_manager.extension_points["jupyter_evalsched"].app
    stop = asyncio.ensure_future(app.stop_extension())
    await async_wait_until(lambda: executor._stopping, timeout=60)
    gates["squeue"].touch()

    def only_the_scancel_left() -> bool:
        left = [task for task in executor._handing if not task.done()]
        return bool(left) and all(task.get_coro().__name__ == "_scancel_queued" for task in left)

    await async_wait_until(lambda: executor._closed or only_the_scancel_left(), timeout=60)
    for _ in range(100):  # (a stop that did not wait for the scancel would end within these)
        await asyncio.sleep(0)
    assert not executor._closed and not stop.done()
    gates["scancel"].touch()
    await stop
    assert executor._closed
    assert json.loads((runs_dir / run_id / "job.json").read_text())["slurm_job_id"] == job_id
    assert not live(runs_dir, run_id)


def test_a_stale_cancelling_reason_is_dropped_when_a_server_recovers_the_run(tmp_path, scancel_left):
    """A cancelled run's job started while its scancel failed, and that write of its record
    carried ``cancelling`` to disk; then the server went. The cancel is kept in memory only, so
    the next server does not end the job: its record must not say it does (the panel would hide
    Cancel for a job that runs on)."""
    runs = tmp_path / "runs"
    run_id, job_id = submitted_then_stopped(runs, running=True)
    why = {"code": "cancelling", "arg": None, "detail": f"scancel of SLURM job {job_id} asked", "holders": []}
    edit_record(runs, run_id, reason=f"cancelling: {why['detail']}", why=why)
    with server(runs) as again:
        c = again.client()
        record = c.get(run_id)
        assert record["slurm_job_id"] == job_id and record["state"] == "running", record
        assert (record["reason"], record["why"]) == (None, None), record
        c.cancel(run_id)
        assert final(c, run_id)["state"] == "cancelled"
    assert not live(runs, run_id)
