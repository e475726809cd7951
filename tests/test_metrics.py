"""The scheduler's Prometheus series on the server's own /metrics (#19), following a run through
queued -> running -> succeeded, against a real server."""

from __future__ import annotations

from pathlib import Path

import pytest
from prom import scrape, value
from rest import spec, submit
from waiting import async_wait_until

GATE = f"{Path(__file__).resolve().parent / 'evals_observed.py'}:gate"


async def test_metrics_follow_a_run_through_its_states(api, wait_for, jp_fetch, tmp_path):
    before = await scrape(jp_fetch)
    assert value(before, "evalsched_scheduler_up") == 1.0
    assert value(before, "evalsched_gpu_memory_mb", gpu="0", kind="usable") == 24000.0
    assert value(before, "evalsched_cpu_slots", kind="total") == 8.0
    opened = tmp_path / "open"
    run = await submit(api, spec(entry=GATE, vram=6000, params={"gate": str(opened)}))
    await wait_for(run["id"], states=("running",))
    during = await scrape(jp_fetch)
    assert value(during, "evalsched_runs", state="running", priority="normal") == 1.0
    assert (
        value(during, "evalsched_gpu_memory_mb", gpu="0", kind="allocated")
        + value(during, "evalsched_gpu_memory_mb", gpu="1", kind="allocated")
        == 6000.0
    )
    assert value(during, "evalsched_admissions_total") == value(before, "evalsched_admissions_total") + 1
    assert value(during, "evalsched_run_wait_seconds_count") == value(before, "evalsched_run_wait_seconds_count") + 1
    opened.touch()
    assert (await wait_for(run["id"]))["state"] == "succeeded"

    async def counted():
        after = await scrape(jp_fetch)
        done = value(after, "evalsched_runs_finished_total", state="succeeded")
        return after if done == value(before, "evalsched_runs_finished_total", state="succeeded") + 1 else None

    after = await async_wait_until(counted, message="the succeeded run was not counted")
    assert value(after, "evalsched_runs", state="running", priority="normal") == 0.0
    assert value(after, "evalsched_gpu_memory_mb", gpu="0", kind="allocated") == 0.0
    key = "evalsched_run_duration_seconds_count"
    assert value(after, key, state="succeeded") == value(before, key, state="succeeded") + 1
    assert value(after, "evalsched_run_duration_seconds_sum", state="succeeded") > 0


async def test_metrics_are_behind_the_servers_authentication(jp_fetch, evalsched):
    from tornado.httpclient import HTTPClientError

    with pytest.raises(HTTPClientError) as err:
        await jp_fetch("metrics", method="GET", headers={"Authorization": "token not-the-token"})
    assert err.value.code == 403


async def test_cpu_slots_used_are_those_a_running_run_holds(api, wait_for, jp_fetch, tmp_path):
    """Issue #30 (11): ``evalsched_cpu_slots{kind="used"}`` is what the ledger has allocated."""
    opened = tmp_path / "open"
    run = await submit(api, spec(entry=GATE, params={"gate": str(opened)}, scheduling={"cpus": 3}))
    await wait_for(run["id"], states=("running",))
    during = await scrape(jp_fetch)
    assert value(during, "evalsched_cpu_slots", kind="used") == 3.0
    assert value(during, "evalsched_cpu_slots", kind="total") == 8.0
    opened.touch()
    assert (await wait_for(run["id"]))["state"] == "succeeded"
    assert value(await scrape(jp_fetch), "evalsched_cpu_slots", kind="used") == 0.0
