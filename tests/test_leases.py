"""Leases (#14): VRAM for interactive work in the same ledger and queue as runs; GPU processes named
by their kernel; a lease holder charged max(lease, observed)."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import uuid

import pytest
from rest import spec, submit
from waiting import async_wait_until, wait_until

from jupyter_evalsched.client import LocalServer
from jupyter_evalsched.scheduler import policy
from jupyter_evalsched.scheduler.gpus import GpuProcess, write_process_table
from jupyter_evalsched.scheduler.kernels import KernelInfo
from jupyter_evalsched.scheduler.ledger import account


async def lease(api, **body) -> dict:
    code, rec = await api("POST", "leases", body)
    assert code == 201, rec
    return rec


async def get(api, path: str) -> dict:
    code, body = await api("GET", path)
    assert code == 200, body
    return body


async def state_of(api, kind: str, rid: str, states) -> dict:
    async def reached():
        body = await get(api, f"{kind}/{rid}")
        return body if body["state"] in states else None

    return await async_wait_until(reached, timeout=15)


# --------------------------------------------------------------------------- the REST contract


async def test_a_lease_that_fits_is_granted_at_once_and_shows_in_the_ledger(api, holder):
    proc = holder()
    rec = await lease(api, vram_mb=14000, pid=proc.pid, label="analysis")
    assert rec["state"] == "granted" and rec["reason"] is None
    assert rec["devices"] == [0] and rec["cuda_visible_devices"] == "0"
    assert rec["pid"] == proc.pid and rec["priority"] == "high" and rec["granted_at"]
    assert rec["id"].startswith("lease-")
    ledger = await get(api, "ledger")
    dev = ledger["devices"][0]
    assert dev["allocated_mb"] == 14000 and dev["free_mb"] == 10000
    assert dev["leases"] == [
        {
            "id": rec["id"],
            "vram_mb": 14000,
            "pid": proc.pid,
            "label": "analysis",
            "kernel_id": None,
            "session_path": None,
            "observed_mb": 0,
            "over_lease_mb": 0,
        }
    ]
    assert dev["runs"] == []
    listed = (await get(api, "leases"))["leases"]
    assert [item["id"] for item in listed] == [rec["id"]]
    view = await get(api, "queue")
    assert [item["id"] for item in view["leases"]] == [rec["id"]]
    code, _ = await api("DELETE", f"leases/{rec['id']}")
    assert code == 204
    ended = await get(api, f"leases/{rec['id']}")
    assert ended["state"] == "ended" and ended["reason"].startswith("released") and ended["ended_at"]
    assert (await get(api, "ledger"))["devices"][0]["allocated_mb"] == 0
    assert (await get(api, "leases"))["leases"] == []
    code, _ = await api("DELETE", f"leases/{rec['id']}")  # idempotent: it stays as it ended
    assert code == 204
    assert (await get(api, f"leases/{rec['id']}"))["reason"] == ended["reason"]


async def test_a_lease_held_by_a_live_process_holds_back_a_run_until_the_process_dies(api, holder):
    proc = holder()
    rec = await lease(api, vram_mb=14000, gpus=2, pid=proc.pid, label="my notebook")
    assert rec["state"] == "granted" and rec["devices"] == [0, 1]
    run = await submit(api, spec(vram=16000))
    waiting = await get(api, f"runs/{run['id']}")
    assert waiting["state"] == "queued"
    reason = waiting["reason"]
    assert reason.startswith("waiting_vram: needs 16000 MB on 1 GPU; most free is 10000 MB"), reason
    assert f"lease {rec['id']} (my notebook) holds 14000 MB on GPU 0" in reason, reason
    proc.kill()
    proc.wait()
    killed = time.monotonic()
    started = await state_of(api, "runs", run["id"], ("running", "succeeded"))
    assert time.monotonic() - killed < 3.0, "the run should start within about a second of the holder's death"
    ended = await get(api, f"leases/{rec['id']}")
    assert ended["state"] == "ended" and ended["reason"].startswith("process_exited"), ended
    assert started["devices"] in ([0], [1])


async def test_queued_leases_are_granted_in_policy_order(api):
    first = await lease(api, vram_mb=20000, gpus=2, label="first")
    assert first["state"] == "granted"
    low = await lease(api, vram_mb=20000, gpus=2, priority="low", label="low")
    high_a = await lease(api, vram_mb=20000, gpus=2, label="high a")
    high_b = await lease(api, vram_mb=20000, gpus=2, label="high b")
    for rec in (low, high_a, high_b):
        assert rec["state"] == "queued"
    queued = (await get(api, "leases"))["leases"]
    assert [item["id"] for item in queued] == [first["id"], high_a["id"], high_b["id"], low["id"]]
    waiting = await get(api, f"leases/{high_a['id']}")
    assert waiting["reason"].startswith("waiting_vram: needs 20000 MB on each of 2 GPUs"), waiting
    assert first["id"] in waiting["reason"]
    order = []
    holding = first
    for _ in range(3):
        await api("DELETE", f"leases/{holding['id']}")
        granted = [item for item in (await get(api, "leases"))["leases"] if item["state"] == "granted"]
        assert len(granted) == 1, granted
        holding = granted[0]
        order.append(holding["label"])
    assert order == ["high a", "high b", "low"]


async def test_a_lease_ends_after_its_ttl(api):
    rec = await lease(api, vram_mb=1000, ttl_s=0.3)
    assert rec["state"] == "granted" and rec["ttl_s"] == 0.3
    ended = await state_of(api, "leases", rec["id"], ("ended",))
    assert ended["reason"].startswith("ttl_expired"), ended


async def test_an_exclusive_lease_is_the_interactive_lock_of_a_gpu(api):
    # One run on each GPU (14000 MB cannot share a 24000 MB GPU with another).
    runs = [await submit(api, spec(vram=14000, episodes=200, sleep_s=0.05)) for _ in range(2)]
    for run in runs:
        await state_of(api, "runs", run["id"], ("running",))
    lock = await lease(api, exclusive_gpu=True, label="interactive")
    assert lock["state"] == "queued" and lock["reason"].startswith("waiting_gpu_exclusive"), lock
    for run in runs:
        await api("POST", f"runs/{run['id']}/cancel")
    lock = await state_of(api, "leases", lock["id"], ("granted",))
    dev = (await get(api, "ledger"))["devices"][lock["devices"][0]]
    assert dev["exclusive"] == lock["id"] and dev["free_mb"] == 0
    behind = await submit(api, spec(vram=1000, scheduling={"exclusive_gpu": True, "gpus": 2}))
    reason = (await get(api, f"runs/{behind['id']}"))["reason"]
    assert reason.startswith("waiting_gpu_exclusive") and f"lease {lock['id']} (interactive)" in reason, reason
    await api("DELETE", f"leases/{lock['id']}")
    await state_of(api, "runs", behind["id"], ("running", "succeeded"))


@pytest.mark.parametrize(
    "body, status, words",
    [
        ({"vram_mb": 30000}, 422, "can never fit on this host"),
        ({"vram_mb": 1000, "gpus": 3}, 422, "can never fit"),
        ({"vram_mb": 0}, 422, "vram_mb > 0 or exclusive_gpu"),
        ({"vram_mb": "1000"}, 422, "vram_mb"),
        ({"vram_mb": 1000, "pid": 2**31 - 2}, 422, "no live process with pid"),
        ({"vram_mb": 1000, "color": "red"}, 422, "color"),
        ({"vram_mb": 1000, "priority": "urgent"}, 422, "priority"),
        ({"vram_mb": 1000, "ttl_s": 0}, 422, "ttl_s"),
    ],
)
async def test_bad_lease_requests_get_a_precise_error(api, body, status, words):
    code, err = await api("POST", "leases", body)
    assert code == status and words in err["message"], err
    assert (await get(api, "leases"))["leases"] == []


async def test_lease_errors_for_unknown_ids_and_bodies(api):
    code, err = await api("POST", "leases", "{not json")
    assert code == 400 and "not valid JSON" in err["message"]
    for path in ("leases/lease-nope", "leases/..%2Fetc", "leases/20261201T000000.000000-abcdef"):
        code, err = await api("GET", path)
        assert code == 404, (path, err)
        code, err = await api("DELETE", path)
        assert code == 404, (path, err)


async def test_lease_changes_are_events_on_the_socket(jp_ws_fetch, api):
    ws = await jp_ws_fetch("evalsched", "events")
    snapshot = json.loads(await ws.read_message())
    assert snapshot["type"] == "snapshot" and snapshot["queue"]["leases"] == []
    rec = await lease(api, vram_mb=1000, label="evented")
    await api("DELETE", f"leases/{rec['id']}")
    states = []
    while "ended" not in states:
        message = json.loads(await ws.read_message())
        if message["type"] == "lease":
            assert message["lease"]["id"] == rec["id"]
            states.append(message["lease"]["state"])
    assert states[0] == "queued" and "granted" in states and states[-1] == "ended"
    ws.close()


async def test_unmanaged_vram_changes_are_ledger_events(api, jp_ws_fetch, plant_gpu_processes):
    ws = await jp_ws_fetch("evalsched", "events")
    json.loads(await ws.read_message())  # the snapshot
    plant_gpu_processes([{"pid": 999999, "gpu": 1, "used_mb": 3000}])
    while True:
        message = json.loads(await ws.read_message())
        if message["type"] == "ledger":
            break
    assert message["ledger"]["devices"][1]["unmanaged_mb"] == 3000
    ws.close()


# --------------------------------------------------------------------------- charged max(lease, observed)


async def test_a_lease_holder_is_charged_the_larger_of_its_lease_and_its_use(api, holder, plant_gpu_processes):
    proc = holder()
    rec = await lease(api, vram_mb=10000, pid=proc.pid, label="kernel")

    async def device_when(check):
        async def probe():
            dev = (await get(api, "ledger"))["devices"][0]
            return dev if check(dev) else None

        return await async_wait_until(probe, timeout=10)

    plant_gpu_processes([{"pid": proc.pid, "gpu": 0, "used_mb": 6000}])
    dev = await device_when(lambda d: d["leases"] and d["leases"][0]["observed_mb"] == 6000)
    assert (dev["allocated_mb"], dev["unmanaged_mb"], dev["free_mb"]) == (10000, 0, 14000)
    assert dev["unmanaged_processes"][0]["lease_id"] == rec["id"]
    plant_gpu_processes([{"pid": proc.pid, "gpu": 0, "used_mb": 12000}])
    dev = await device_when(lambda d: d["unmanaged_mb"] == 2000)
    assert (dev["allocated_mb"], dev["free_mb"]) == (10000, 12000)
    assert dev["leases"][0]["over_lease_mb"] == 2000
    assert (await get(api, f"leases/{rec['id']}"))["over_lease_mb"] == 2000


async def test_a_process_that_already_holds_vram_is_not_charged_twice_for_its_lease(api, holder, plant_gpu_processes):
    # GPU 1 is half taken by a run; GPU 0 is used by the notebook itself, outside any lease.
    busy = await submit(api, spec(vram=14000, episodes=400, sleep_s=0.05))
    await state_of(api, "runs", busy["id"], ("running",))
    proc = holder()
    plant_gpu_processes(
        [{"pid": proc.pid, "gpu": 1 - busy_device(await get(api, f"runs/{busy['id']}")), "used_mb": 8000}]
    )

    async def unmanaged_seen():
        return sum(d["unmanaged_mb"] for d in (await get(api, "ledger"))["devices"]) == 8000

    await async_wait_until(unmanaged_seen, timeout=10)
    # 20000 on the notebook's GPU: 16000 free + the 8000 it holds already. Charged 20000, not 28000.
    rec = await lease(api, vram_mb=20000, pid=proc.pid)
    assert rec["state"] == "granted", rec
    dev = (await get(api, "ledger"))["devices"][rec["devices"][0]]
    assert (dev["allocated_mb"], dev["unmanaged_mb"], dev["free_mb"]) == (20000, 0, 4000), dev
    await api("POST", f"runs/{busy['id']}/cancel")


def busy_device(record: dict) -> int:
    return record["devices"][0]


def test_account_sorts_processes_out():
    kernel = KernelInfo("k-1", "work/analysis.ipynb", 41)
    procs = [
        GpuProcess(10, 0, 3000),  # a run's
        GpuProcess(11, 0, 500),  # the same run's child
        GpuProcess(20, 0, 2000),  # the model host's
        GpuProcess(40, 1, 9000),  # a lease holder over its 8000 MB lease
        GpuProcess(41, 0, 1500),  # a kernel without lease
        GpuProcess(50, 0, 700),  # a stranger
    ]
    out = account(
        procs,
        baseline_pids={20},
        run_pids={"run-a": {10, 11}},
        lease_pids={"lease-x": {40}},
        lease_charges={"lease-x": {1: 8000}},
        kernels={41: kernel},
    )
    assert out.runs == {"run-a": {0: 3500}}
    assert out.leases == {"lease-x": {1: 9000}} and out.over_lease == {"lease-x": 1000}
    assert out.unmanaged[0].mb == 2200 and out.unmanaged[1].mb == 1000
    named = {p["pid"]: p for p in out.unmanaged[0].processes}
    assert named[41]["kernel_id"] == "k-1" and named[41]["session_path"] == "work/analysis.ipynb"
    assert [p["lease_id"] for p in out.unmanaged[1].processes] == ["lease-x"]


def test_policy_credits_a_jobs_own_held_vram():
    cap = policy.Capacity(devices=(policy.Device(0, 24000, unmanaged_mb=8000),), cpu_slots=4)
    job = policy.QueuedJob("lease-a", 1, "high", 20000, cpus=0, kind="lease", held=((0, 8000),))
    assert policy.decide([job], [], cap, {}).starts == [policy.Start("lease-a", (0,))]
    stranger = policy.QueuedJob("lease-b", 2, "high", 20000, cpus=0, kind="lease")
    assert policy.decide([stranger], [], cap, {}).starts == []
    lock = policy.QueuedJob("lease-c", 3, "high", 0, exclusive=True, cpus=0, kind="lease", held=((0, 8000),))
    assert policy.decide([lock], [], cap, {}).starts == [policy.Start("lease-c", (0,))]


# --------------------------------------------------------------------------- kernels are named


async def test_a_real_kernel_is_named_in_the_ledger_with_its_notebook(api, jp_fetch, jp_serverapp, plant_gpu_processes):
    resp = await jp_fetch(
        "api",
        "sessions",
        method="POST",
        body=json.dumps({"path": "work/analysis.ipynb", "type": "notebook", "kernel": {"name": "python3"}}),
    )
    session = json.loads(resp.body)
    kernel_id = session["kernel"]["id"]
    try:
        km = jp_serverapp.kernel_manager.get_kernel(kernel_id)
        pid = km.provisioner.process.pid
        plant_gpu_processes([{"pid": pid, "gpu": 1, "used_mb": 5000}])

        async def named():
            dev = (await get(api, "ledger"))["devices"][1]
            return dev["unmanaged_processes"] and dev

        dev = await async_wait_until(named, timeout=15)
        assert dev["unmanaged_mb"] == 5000
        entry = dev["unmanaged_processes"][0]
        assert (entry["pid"], entry["kernel_id"], entry["session_path"]) == (pid, kernel_id, "work/analysis.ipynb")
        rec = await lease(api, vram_mb=6000, pid=pid)
        assert (rec["kernel_id"], rec["session_path"]) == (kernel_id, "work/analysis.ipynb")
        assert rec["devices"] == [1], "the lease goes where its kernel already holds memory"
        run = await submit(api, spec(vram=20000, scheduling={"gpus": 2}))
        reason = (await get(api, f"runs/{run['id']}"))["reason"]
        assert f"lease {rec['id']} (analysis.ipynb)" in reason, reason
    finally:
        await jp_fetch("api", "sessions", session["id"], method="DELETE")


async def test_a_kernel_of_another_server_is_named_from_its_process(api, holder, plant_gpu_processes, tmp_path):
    kernel_id = str(uuid.uuid4())
    proc = holder(
        sys.executable,
        "-c",
        "import time; time.sleep(300)",
        "-f",
        str(tmp_path / f"kernel-{kernel_id}.json"),
        env={"JPY_SESSION_NAME": "/home/me/elsewhere.ipynb", "JPY_PARENT_PID": "4242"},
    )
    child = holder(sys.executable, "-c", "import time; time.sleep(300)")  # not a kernel
    plant_gpu_processes([{"pid": proc.pid, "gpu": 0, "used_mb": 3000}, {"pid": child.pid, "gpu": 0, "used_mb": 100}])

    async def named():
        procs = (await get(api, "ledger"))["devices"][0]["unmanaged_processes"]
        return len(procs) == 2 and {p["pid"]: p for p in procs}

    procs = await async_wait_until(named, timeout=15)
    assert (procs[proc.pid]["kernel_id"], procs[proc.pid]["session_path"]) == (kernel_id, "/home/me/elsewhere.ipynb")
    assert procs[child.pid]["kernel_id"] is None


# --------------------------------------------------------------------------- restarts


@pytest.mark.slow  # a server started, killed or restarted: CI runs it with -m slow (docs/install.md: the default suite stays within ten minutes)
def test_leases_survive_a_restart_while_their_process_lives(tmp_path, holder):
    runs = str(tmp_path / "runs")
    living, dying = holder(), holder()
    fast = ["--EvalSchedApp.reconcile_interval_s=0.3"]
    with LocalServer(virtual_gpus="24000,24000", runs_dir=runs, extra_args=fast) as first:
        c = first.client()
        kept = c.request("POST", "leases", body={"vram_mb": 14000, "pid": living.pid, "label": "kept"})
        lost = c.request("POST", "leases", body={"vram_mb": 14000, "pid": dying.pid, "label": "lost"})
        free = c.request("POST", "leases", body={"vram_mb": 20000, "label": "no pid"})
        waiting = c.request("POST", "leases", body={"vram_mb": 20000, "pid": living.pid, "label": "waits"})
        assert [r["state"] for r in (kept, lost, free, waiting)] == ["granted", "granted", "queued", "queued"]
    os.kill(dying.pid, signal.SIGKILL)
    dying.wait()
    with LocalServer(virtual_gpus="24000,24000", runs_dir=runs, extra_args=fast) as second:
        c = second.client()
        after = {
            rec["label"]: rec for rec in (c.request("GET", f"leases/{r['id']}") for r in (kept, lost, free, waiting))
        }
        assert after["kept"]["state"] == "granted" and after["kept"]["devices"] == kept["devices"]
        assert after["lost"]["state"] == "ended" and after["lost"]["reason"].startswith("process_exited"), after["lost"]
        # The freed GPU goes to the oldest waiting lease.
        assert after["no pid"]["state"] == "granted", after["no pid"]
        assert after["waits"]["state"] == "queued"
        living.kill()
        living.wait()
        wait_until(lambda: c.request("GET", f"leases/{kept['id']}")["state"] == "ended", timeout=10)
        wait_until(lambda: c.request("GET", f"leases/{waiting['id']}")["state"] == "ended", timeout=10)


def test_the_virtual_process_table_tolerates_bad_files(tmp_path):
    from jupyter_evalsched.scheduler.gpus import VirtualProbe

    path = tmp_path / "procs.json"
    probe = VirtualProbe([24000, 24000], processes_file=str(path))
    assert probe.processes() == [] and "does not exist" in probe.problem
    path.write_text("{not json")
    assert probe.processes() == [] and "not valid JSON" in probe.problem
    write_process_table(
        str(path),
        [{"pid": 5, "gpu": 1, "used_mb": 100}, {"pid": 6, "gpu": 7, "used_mb": 1}, {"pid": "x"}, 3],
    )
    assert probe.processes() == [GpuProcess(5, 1, 100)]
