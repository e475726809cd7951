"""Shared models through the server: runs name a model in their spec and reach the one copy
the server's model host loaded (#4), the ledger holds a loaded model's VRAM (#31)."""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
from pathlib import Path

import pytest
from prom import scrape, value
from waiting import async_wait_until

from jupyter_evalsched.shared_models import socket_dirs

UPPER = "jupyter_evalsched.shared_models.testing:upper"

EVAL = """
def episode(ctx, index):
    shout = ctx.model("shout")
    out = shout(["run", str(index)])
    assert out == ["RUN", str(index)], out
    return {"ok": 1}
"""


@pytest.fixture
def evalsched_config():
    return {
        "virtual_gpus": [24000],
        "models": [
            {"name": "shout", "loader": UPPER, "options": {"batch_ms": 20}, "max_wait_ms": 20},
            {"name": "on-gpu", "loader": UPPER, "device": 0, "vram_mb": 6000},
        ],
    }


async def test_four_runs_share_one_load(api, wait_for, jp_fetch):
    ids = []
    for _ in range(4):
        code, rec = await api("POST", "runs", {"source": EVAL, "episodes": 5, "models": ["shout"]})
        assert code == 201, rec
        ids.append(rec["id"])
    for run_id in ids:
        final = await wait_for(run_id, timeout=60)
        assert final["state"] == "succeeded", final
    code, body = await api("GET", "models")
    shout = next(m for m in body["models"] if m["name"] == "shout")
    assert shout["state"] == "loaded" and shout["load_count"] == 1
    assert shout["requests"] == 20 and shout["batches"] <= 20 and shout["mean_batch_size"] >= 1.0
    on_gpu = next(m for m in body["models"] if m["name"] == "on-gpu")
    assert on_gpu["state"] == "not_loaded"  # lazily: nobody used it

    # The same figures on the server's /metrics (refreshed in the background every few seconds).
    async def served():
        samples = await scrape(jp_fetch)
        return samples if value(samples, "evalsched_model_requests_total", model="shout") == 20 else None

    samples = await async_wait_until(served, timeout=20, message="the model's requests never reached /metrics")
    assert value(samples, "evalsched_model_batch_size_count", model="shout") == shout["batches"]
    assert value(samples, "evalsched_model_batch_size_sum", model="shout") == shout["inputs"] == 40  # 2 per call


async def test_a_model_holds_its_vram_only_once_loaded(api, wait_for):
    """Not loaded, the model holds nothing; a run that names it admits its VRAM with the run's."""
    code, ledger = await api("GET", "ledger")
    dev = ledger["devices"][0]
    assert (dev["total_mb"], dev["baseline_mb"], dev["usable_mb"], dev["free_mb"]) == (24000, 0, 24000, 24000)
    assert dev["models"] == []
    code, err = await api("POST", "runs", {"entrypoint": "a:b", "scheduling": {"marginal_vram_mb": 30000}})
    assert code == 422 and "24000" in err["message"]
    source = EVAL.replace('"shout"', '"on-gpu"')
    code, rec = await api("POST", "runs", {"source": source, "episodes": 1, "models": ["on-gpu"]})
    assert (await wait_for(rec["id"], timeout=60))["state"] == "succeeded"
    code, ledger = await api("GET", "ledger")
    dev = ledger["devices"][0]
    assert (dev["baseline_mb"], dev["allocated_mb"], dev["free_mb"]) == (6000, 6000, 18000)
    assert [(m["name"], m["vram_mb"], m["state"]) for m in dev["models"]] == [("on-gpu", 6000, "held")]


async def test_a_killed_model_host_fails_only_its_callers(api, wait_for, evalsched):
    code, rec = await api("POST", "runs", {"source": EVAL, "episodes": 2, "models": ["shout"]})
    assert (await wait_for(rec["id"], timeout=60))["state"] == "succeeded"
    killed = evalsched.models.pids()
    assert killed
    for pid in killed:
        os.kill(pid, signal.SIGKILL)

    async def death_recorded():  # the manager saw its host die (and schedules a restart)
        code, body = await api("GET", "models")
        shout = next(m for m in body["models"] if m["name"] == "shout")
        return (shout.get("error") or {}).get("type") == "HostDied"

    await async_wait_until(death_recorded, message="the killed model host's death was never recorded")
    # The server still answers, and the next run gets a restarted host.
    code, queue = await api("GET", "queue")
    assert code == 200
    code, rec = await api("POST", "runs", {"source": EVAL, "episodes": 2, "models": ["shout"]})
    assert (await wait_for(rec["id"], timeout=60))["state"] == "succeeded"
    code, body = await api("GET", "models")
    shout = next(m for m in body["models"] if m["name"] == "shout")
    assert shout["load_count"] == 2


@pytest.fixture
def jp_runtime_dir():
    """A short runtime directory, so the server keeps its model sockets there (a long one makes
    the manager fall back to a fresh directory under /tmp)."""
    path = Path(tempfile.mkdtemp(prefix="rt-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def taken_socket(jp_runtime_dir):
    """The socket path of the first model ("shout") taken by a directory before the server
    starts: its host exits before it listens, at every start."""
    (jp_runtime_dir / socket_dirs.dir_name() / "m0.sock" / "taken").mkdir(parents=True)


async def test_a_run_waiting_on_a_model_that_cannot_start_fails_with_the_reason(taken_socket, api, wait_for, runs_dir):
    code, rec = await api("POST", "runs", {"source": EVAL, "episodes": 1, "models": ["shout"]})
    assert code == 201, rec
    final = await wait_for(rec["id"], timeout=30)
    assert final["state"] == "failed", final
    reason = final["reason"]
    assert reason.startswith("model_unavailable: shout: the model host (pid "), reason
    assert "exited with exit code 1 before it listened" in reason and "IsADirectoryError" in reason, reason
    assert (runs_dir / rec["id"] / "_DONE").exists() and final["pid"] is None  # never started
    code, body = await api("GET", "models")
    shout = next(m for m in body["models"] if m["name"] == "shout")
    assert shout["state"] == "failed" and "IsADirectoryError" in shout["error"]["message"]
    assert "IsADirectoryError" in (runs_dir / ".models" / "shout.log").read_text()
    # The ledger gave back what the run held, and other models still serve.
    code, ledger = await api("GET", "ledger")
    assert ledger["cpu_slots"]["allocated"] == 0
