"""The scheduler's Prometheus series on the server's own /metrics (#19), following a run through
queued -> running -> succeeded, against a real server."""

from __future__ import annotations

from pathlib import Path

import pytest
from prom import scrape, value
from rest import spec, submit
from waiting import async_wait_until

GATE = f"{Path(__file__).resolve().parent / 'evals_observed.py'}:gate"


async def test_metrics_follow_a_run_through_its_states(api, wait_for, jp_fetch, tmp_path, holder, plant_gpu_processes):
    before = await scrape(jp_fetch)
    assert value(before, "evalsched_scheduler_up") == 1.0
    assert value(before, "evalsched_gpu_memory_mb", gpu="0", kind="usable") == 24000.0
    assert value(before, "evalsched_cpu_slots", kind="total") == 8.0
    assert value(before, "evalsched_cpu_slots", kind="used") == 0.0
    assert value(before, "evalsched_leases", state="granted") == 0.0
    opened, pid_file = tmp_path / "open", tmp_path / "run.pid"
    run = await submit(api, spec(entry=GATE, vram=6000, params={"gate": str(opened), "pid_file": str(pid_file)}))
    rec = await wait_for(run["id"], states=("running",))
    gpu = rec["devices"][0]
    await async_wait_until(pid_file.exists, message="the run did not write its pid")
    # A live lease, and VRAM on the run's GPU: the run's own (observed, never charged twice) and
    # another process's (unmanaged).
    kernel, stranger = holder(), holder()
    code, lease = await api("POST", "leases", {"vram_mb": 3000, "pid": kernel.pid, "label": "metrics"})
    assert code == 201 and lease["state"] == "granted", lease
    leased_gpu = lease["devices"][0]
    plant_gpu_processes(
        [
            {"pid": int(pid_file.read_text()), "gpu": gpu, "used_mb": 5000},
            {"pid": stranger.pid, "gpu": gpu, "used_mb": 2000},
        ]
    )

    def on(samples, g, kind):
        return value(samples, "evalsched_gpu_memory_mb", gpu=str(g), kind=kind)

    async def observed():
        samples = await scrape(jp_fetch)
        return samples if on(samples, gpu, "unmanaged") == 2000.0 else None

    during = await async_wait_until(observed, message="the unmanaged VRAM never reached /metrics")
    assert value(during, "evalsched_runs", state="running", priority="normal") == 1.0
    assert value(during, "evalsched_leases", state="granted") == 1.0
    assert on(during, leased_gpu, "leased") == 3000.0
    assert on(during, 1 - leased_gpu, "leased") == 0.0
    # allocated: the run's declaration (not its 5000 MB observed) and the lease, on their GPUs
    expected = {0: 0.0, 1: 0.0}
    expected[gpu] += 6000.0
    expected[leased_gpu] += 3000.0
    for g in (0, 1):
        assert on(during, g, "allocated") == expected[g], (g, during)
        unmanaged = 2000.0 if g == gpu else 0.0
        assert on(during, g, "unmanaged") == unmanaged
        assert on(during, g, "free") == 24000.0 - expected[g] - unmanaged
    assert value(during, "evalsched_admissions_total") == value(before, "evalsched_admissions_total") + 1
    assert value(during, "evalsched_run_wait_seconds_count") == value(before, "evalsched_run_wait_seconds_count") + 1
    code, _ = await api("DELETE", f"leases/{lease['id']}")
    assert code in (200, 204)
    plant_gpu_processes([])
    opened.touch()
    assert (await wait_for(run["id"]))["state"] == "succeeded"

    async def counted():
        after = await scrape(jp_fetch)
        done = value(after, "evalsched_runs_finished_total", state="succeeded")
        return after if done == value(before, "evalsched_runs_finished_total", state="succeeded") + 1 else None

    after = await async_wait_until(counted, message="the succeeded run was not counted")
    assert value(after, "evalsched_runs", state="running", priority="normal") == 0.0
    assert value(after, "evalsched_leases", state="granted") == 0.0
    for g in (0, 1):
        assert on(after, g, "allocated") == 0.0 and on(after, g, "leased") == 0.0
    key = "evalsched_run_duration_seconds_count"
    assert value(after, key, state="succeeded") == value(before, key, state="succeeded") + 1
    assert value(after, "evalsched_run_duration_seconds_sum", state="succeeded") > 0


async def test_metrics_are_the_extensions_and_behind_the_servers_authentication(
    jp_fetch, jp_base_url, jp_http_port, evalsched
):
    """The extension's series are on the server's /metrics (a server without the extension answers
    there too, without them), and the server's authentication guards them."""
    from tornado.httpclient import AsyncHTTPClient, HTTPClientError

    resp = await jp_fetch("metrics", method="GET")
    assert resp.code == 200
    body = resp.body.decode()
    assert "evalsched_scheduler_up 1.0" in body and "evalsched_gpu_memory_mb" in body, body[:2000]
    with pytest.raises(HTTPClientError) as err:
        await jp_fetch("metrics", method="GET", headers={"Authorization": "token not-the-token"})
    assert err.value.code == 403
    # Without any credentials at all: refused too (403 here; a login redirect would do as well).
    url = f"http://localhost:{jp_http_port}{jp_base_url}metrics"
    answer = await AsyncHTTPClient().fetch(url, raise_error=False, follow_redirects=False)
    assert answer.code in (302, 403), (answer.code, answer.body[:200])
    assert b"evalsched_" not in (answer.body or b"")


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
