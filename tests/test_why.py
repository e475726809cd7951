"""Reasons as data (#28) over a real server: a pending run's or lease's ``why`` names what holds
it, in REST answers, events and ``job.json``; it is null once nothing is pending; a preempted
run's why is rebuilt from its record's data at a restart; a sweep's runs carry its name."""

from __future__ import annotations

import json
import sys
import uuid

import pytest
from rest import NOOP, SLEEPY, spec, submit
from run_dirs import write_run_dir
from waiting import async_wait_until

from jupyter_evalsched.contract import Why


async def get(api, path: str) -> dict:
    code, body = await api("GET", path)
    assert code == 200, body
    return body


async def waiting_why(api, run_id: str) -> dict:
    """The run's record once admission has said why it waits."""

    async def decided():
        rec = await get(api, f"runs/{run_id}")
        return rec if rec["why"] else None

    return await async_wait_until(decided, timeout=15)


async def next_event_of(ws, run_id: str, predicate) -> dict:
    while True:
        message = json.loads(await ws.read_message())
        if message["type"] == "run" and message["run"]["id"] == run_id and predicate(message["run"]):
            return message["run"]


async def test_a_queued_runs_why_names_the_run_ahead_then_is_null_once_it_runs(api, jp_ws_fetch, wait_for, runs_dir):
    ws = await jp_ws_fetch("evalsched", "events")
    assert json.loads(await ws.read_message())["type"] == "snapshot"
    ahead = await submit(api, spec(vram=20000, sleep_s=60, name="holds both", scheduling={"gpus": 2}))
    waiter = await submit(api, spec(NOOP, vram=16000, name="waits"))

    rec = await waiting_why(api, waiter["id"])
    why = rec["why"]
    assert why["code"] == "waiting_vram" and why["arg"] is None, why
    assert why["holders"] == [{"kind": "run", "id": ahead["id"], "name": "holds both", "gpu": 0, "mb": 20000}]
    assert rec["reason"] == Why.from_dict(why).reason  # one fact: the string is the data's
    assert rec["reason"].startswith("waiting_vram: needs 16000 MB on 1 GPU; most free is 4000 MB")
    queued = (await get(api, "queue"))["queued"]
    assert [r["why"] for r in queued if r["id"] == waiter["id"]] == [why]
    evented = await next_event_of(ws, waiter["id"], lambda r: r["why"] is not None)
    assert evented["why"]["holders"][0]["id"] == ahead["id"] and evented["reason"] == rec["reason"]

    await api("POST", f"runs/{ahead['id']}/cancel")
    running = await next_event_of(ws, waiter["id"], lambda r: r["state"] != "queued")
    assert running["why"] is None and running["reason"] is None, running
    done = await wait_for(waiter["id"])
    assert done["state"] == "succeeded" and done["why"] is None
    assert json.loads((runs_dir / waiter["id"] / "job.json").read_text())["why"] is None
    cancelled = await get(api, f"runs/{ahead['id']}")
    assert cancelled["reason"].startswith("cancelled") and cancelled["why"] is None  # an end is no pending reason
    ws.close()


async def test_a_lease_queued_behind_a_lease_names_it(api):
    code, first = await api("POST", "leases", {"vram_mb": 20000, "gpus": 2, "label": "first notebook"})
    assert code == 201 and first["state"] == "granted" and first["why"] is None
    code, second = await api("POST", "leases", {"vram_mb": 20000, "label": "second"})
    assert code == 201 and second["state"] == "queued"
    why = second["why"]
    assert why["code"] == "waiting_vram"
    assert why["holders"] == [{"kind": "lease", "id": first["id"], "name": "first notebook", "gpu": 0, "mb": 20000}]
    assert second["reason"] == Why.from_dict(why).reason
    await api("DELETE", f"leases/{first['id']}")
    granted = await get(api, f"leases/{second['id']}")
    assert granted["state"] == "granted" and granted["why"] is None and granted["reason"] is None
    await api("DELETE", f"leases/{second['id']}")


async def test_a_kernels_memory_that_blocks_a_run_names_its_notebook(api, plant_gpu_processes, tmp_path):
    import subprocess

    kernel_id = str(uuid.uuid4())
    kernel = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(300)", "-f", str(tmp_path / f"kernel-{kernel_id}.json")],
        env={"JPY_SESSION_NAME": "/home/me/analysis.ipynb", "PATH": "/usr/bin:/bin"},
    )
    try:
        plant_gpu_processes(
            [{"pid": kernel.pid, "gpu": 0, "used_mb": 10000}, {"pid": kernel.pid, "gpu": 1, "used_mb": 10000}]
        )

        async def named():
            dev = (await get(api, "ledger"))["devices"][0]
            return any(p["kernel_id"] for p in dev["unmanaged_processes"])

        await async_wait_until(named, timeout=15)
        run = await submit(api, spec(NOOP, vram=16000))
        rec = await waiting_why(api, run["id"])
        assert "; 20000 MB held by kernel of /home/me/analysis.ipynb" in rec["reason"], rec["reason"]
        assert rec["why"]["holders"] == [
            {"kind": "kernel", "id": kernel_id, "name": "/home/me/analysis.ipynb", "gpu": 0, "mb": 10000}
        ]
        code, cancelled = await api("POST", f"runs/{run['id']}/cancel")
        assert cancelled["state"] == "cancelled" and cancelled["why"] is None, cancelled  # it waits no more
    finally:
        kernel.kill()
        kernel.wait()


async def test_the_runs_of_a_sweep_carry_its_name(api):
    code, made = await api("POST", "sweeps", {**spec(NOOP, name="grid"), "sweep": {"k": [1, 2]}})
    assert code == 201, made
    assert [(r["name"], r["sweep_name"]) for r in made["runs"]] == [("grid [k=1]", "grid"), ("grid [k=2]", "grid")]
    assert (await get(api, f"runs/{made['runs'][0]['id']}"))["sweep_name"] == "grid"
    alone = await submit(api, spec(NOOP, name="alone"))
    assert alone["sweep_id"] is None and alone["sweep_name"] is None


async def test_a_preempted_runs_why_is_rebuilt_from_its_record_at_a_restart(jp_serverapp, runs_dir):
    """The restarted server keeps the preemption ahead of admission's reason from the record's
    data (its why and its history), not by cutting the reason string."""
    run_id = "20260101T000000.000000-aaaaaa"
    preempted = "preempted_by:hi: stopped after 3 of 10 episodes for a higher lane; resumes when there is room"
    write_run_dir(
        runs_dir / run_id,
        run_id,
        None,
        None,
        entrypoint=SLEEPY,
        state="queued",
        started_at=None,
        marginal_vram_mb=30000,  # more than a GPU has: it stays queued, with a reason
        progress={"done": 3, "total": 10},
        attempt=2,
        preemptions=1,
        # What the earlier server last wrote: a requeue is written, admission's news is not.
        reason=preempted,
        why={
            "code": "preempted_by",
            "arg": "hi",
            "detail": preempted.split(": ", 1)[1],
            "holders": [{"kind": "run", "id": "hi", "name": "the high one", "gpu": None, "mb": None}],
        },
        history=[{"attempt": 1, "state": "preempted", "reason": preempted, "episodes_done": 3}],
    )
    await jp_serverapp.extension_manager.start_all_extensions()
    scheduler = jp_serverapp.extension_manager.extension_points["jupyter_evalsched"].app.scheduler
    rec = scheduler.get(run_id).record
    assert rec["state"] == "queued"
    assert rec["reason"] == preempted + "; now waiting_vram: needs 30000 MB on 1 GPU; most free is 24000 MB (GPU 0)"
    why = rec["why"]
    assert (why["code"], why["arg"]) == ("preempted_by", "hi")
    assert why["holders"][0] == {"kind": "run", "id": "hi", "name": "the high one", "gpu": None, "mb": None}
    assert rec["reason"] == Why.from_dict(why).reason


@pytest.mark.slow  # a server started, killed or restarted: CI runs it with -m slow (docs/install.md: the default suite stays within ten minutes)
def test_a_queued_runs_why_is_there_again_after_a_restart(tmp_path):
    """Across a restart of the server the run still waits, and its record says why as data: the
    lease of a notebook whose process lives holds the GPUs."""
    import subprocess

    from waiting import wait_until

    from jupyter_evalsched.client import LocalServer

    runs = str(tmp_path / "runs")
    notebook = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    fast = ["--EvalSchedApp.sweep_interval_s=0.3"]
    body = {"entrypoint": NOOP, "episodes": 1, "cwd": "/", "scheduling": {"marginal_vram_mb": 16000}}
    try:
        with LocalServer(virtual_gpus="24000", runs_dir=runs, extra_args=fast) as first:
            c = first.client()
            held = c.request("POST", "leases", body={"vram_mb": 20000, "pid": notebook.pid, "label": "notes"})
            assert held["state"] == "granted"
            run = c.submit(body)
            before = wait_until(lambda: c.get(run["id"])["why"], timeout=10)
        with LocalServer(virtual_gpus="24000", runs_dir=runs, extra_args=fast) as second:
            c = second.client()
            after = wait_until(lambda: (rec := c.get(run["id"]))["why"] and rec, timeout=10)
            assert after["state"] == "queued"
            assert after["why"] == before, (after["why"], before)
            assert after["why"]["holders"][0] == {
                "kind": "lease",
                "id": held["id"],
                "name": "notes",
                "gpu": 0,
                "mb": 20000,
            }
            c.request("POST", f"runs/{run['id']}/cancel")
    finally:
        notebook.kill()
        notebook.wait()
