"""One scheduler per host (#9): several `jupyter server` processes of one user, one primary,
secondaries that delegate, failover on kill -9; VRAM held by processes we do not manage."""

from __future__ import annotations

import asyncio
import json
import signal
import time

import pytest

from jupyter_evalsched.client import LocalServer
from jupyter_evalsched.scheduler.gpus import GpuProcess

SLEEPY = "jupyter_evalsched.examples.basic:sleepy"
FAST = [
    "--EvalSchedApp.cancel_grace_s=2.0",
    "--EvalSchedApp.sweep_interval_s=0.3",
    "--EvalSchedApp.progress_interval_s=0.05",
]


def wait_until(predicate, timeout=20.0, interval=0.05):
    deadline = time.monotonic() + timeout
    while True:
        try:
            value = predicate()
        except Exception:
            value = None
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"not reached within {timeout} s")
        time.sleep(interval)


def run(vram, episodes=1, sleep_s=0.02, **kw):
    return {
        "entrypoint": SLEEPY,
        "episodes": episodes,
        "params": {"sleep_s": sleep_s},
        "cwd": "/",
        "scheduling": {"marginal_vram_mb": vram},
        **kw,
    }


def final(client, run_id, timeout=30):
    return wait_until(
        lambda: (lambda r: r if r["state"] in ("succeeded", "failed", "cancelled", "aborted") else None)(
            client.get(run_id)
        ),
        timeout,
    )


def test_two_servers_one_queue_and_failover(tmp_path):
    shared = {"EVALSCHED_LOCK_DIR": str(tmp_path / "lock")}
    runs = str(tmp_path / "runs")
    first = LocalServer(virtual_gpus="24000", runs_dir=runs, env=shared, extra_args=FAST)
    second = LocalServer(virtual_gpus="24000", runs_dir=runs, env=shared, extra_args=FAST)
    try:
        a, b = first.client(), second.client()
        sa, sb = a.request("GET", "status"), b.request("GET", "status")
        assert (sa["role"], sb["role"]) == ("primary", "secondary")
        assert sb["primary"]["pid"] == first.process.pid
        assert "token" not in json.dumps(sb["primary"])

        # Runs submitted to either server land in one queue and one ledger.
        long_a = a.submit(run(16000, episodes=1000, sleep_s=0.1))
        queued_b = b.submit(run(16000))
        dependent = b.submit(run(1000, depends_on=[queued_b["id"]]))
        wait_until(lambda: a.get(long_a["id"])["state"] == "running")
        qa, qb = a.queue(), b.queue()
        assert [r["id"] for r in qa["queued"]] == [r["id"] for r in qb["queued"]] == [queued_b["id"], dependent["id"]]
        assert qa["ledger"] == qb["ledger"] and qb["ledger"]["devices"][0]["allocated_mb"] == 16000
        assert qb["primary"]["pid"] == first.process.pid
        assert qb["queued"][0]["reason"].startswith("waiting_vram")

        # The primary dies hard: the secondary takes over, aborts its in-flight run, runs the queue.
        first.process.send_signal(signal.SIGKILL)
        first.process.wait()
        t0 = time.monotonic()
        wait_until(lambda: b.request("GET", "status")["role"] == "primary", timeout=15)
        took = time.monotonic() - t0
        assert took < 5, f"failover took {took:.1f} s"
        assert b.get(long_a["id"])["state"] == "aborted"
        assert final(b, queued_b["id"])["state"] == "succeeded"
        assert final(b, dependent["id"])["state"] == "succeeded"
        assert b.queue()["primary"]["pid"] == second.process.pid
    finally:
        first.cleanup()
        second.cleanup()


def test_secondary_forwards_errors_and_logs(tmp_path):
    shared = {"EVALSCHED_LOCK_DIR": str(tmp_path / "lock")}
    runs = str(tmp_path / "runs")
    with (
        LocalServer(virtual_gpus="24000", runs_dir=runs, env=shared, extra_args=FAST) as first,
        LocalServer(virtual_gpus="24000", runs_dir=runs, env=shared, extra_args=FAST) as second,
    ):
        b = second.client()
        from jupyter_evalsched.client import EvalSchedError

        with pytest.raises(EvalSchedError) as err:
            b.submit(run(99999))
        assert err.value.status == 422 and "can never fit" in str(err.value)
        with pytest.raises(EvalSchedError) as err:
            b.get("no-such-run")
        assert err.value.status == 404
        rec = b.submit(run(0, episodes=2))
        assert final(b, rec["id"])["state"] == "succeeded"
        assert "score" in b.get(rec["id"])["summary"]["metrics"]
        events = b.events()
        try:
            first_event = next(iter(events))
            assert first_event["type"] == "snapshot" and first_event["queue"]["primary"]["pid"] == first.process.pid
        finally:
            events.close()


@pytest.fixture
def evalsched_config():
    return {"virtual_gpus": [24000]}


async def test_unmanaged_vram_holds_back_a_run_until_it_goes(api, evalsched):
    probe = evalsched.probe
    probe.set_foreign([GpuProcess(pid=999999, device=0, used_mb=10000, name="a notebook kernel")])
    await asyncio.sleep(0.8)  # the sweep (0.5 s here) reads the probe
    code, ledger = await api("GET", "ledger")
    dev = ledger["devices"][0]
    assert (dev["unmanaged_mb"], dev["free_mb"]) == (10000, 14000)
    assert dev["unmanaged_processes"] == [{"pid": 999999, "used_mb": 10000, "name": "a notebook kernel"}]
    code, rec = await api("POST", "runs", run(16000))
    assert code == 201
    await asyncio.sleep(0.2)
    code, rec = await api("GET", f"runs/{rec['id']}")
    assert rec["state"] == "queued"
    assert "10000 MB held by processes outside the scheduler" in rec["reason"]
    probe.set_foreign([])
    deadline = time.monotonic() + 5
    while rec["state"] == "queued" and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
        code, rec = await api("GET", f"runs/{rec['id']}")
    assert rec["state"] in ("running", "succeeded")


async def test_our_own_processes_are_never_counted_as_unmanaged(api, evalsched):
    code, rec = await api("POST", "runs", run(8000, episodes=40, sleep_s=0.05))
    deadline = time.monotonic() + 5
    while (rec["pid"] is None) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
        code, rec = await api("GET", f"runs/{rec['id']}")
    # NVML would list our run with its real usage; it must not be counted a second time.
    evalsched.probe.set_foreign([GpuProcess(pid=rec["pid"], device=0, used_mb=7000)])
    await asyncio.sleep(0.8)
    code, ledger = await api("GET", "ledger")
    dev = ledger["devices"][0]
    assert (dev["allocated_mb"], dev["unmanaged_mb"], dev["free_mb"]) == (8000, 0, 16000)
    await api("POST", f"runs/{rec['id']}/cancel")
