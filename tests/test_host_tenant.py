"""Issue #32, a user's server as a tenant of the host ledger (``host_ledger``): a real Jupyter
server (pytest-jupyter, as root) joined to a real host ledger served by an unprivileged user on
virtual GPUs, with another system user (an agent, tests/host_ledger_agent.py) holding grants.

Tests are plain ``async def``: pytest-jupyter runs them on the server's loop (the agent's answers
are awaited by polling, never by blocking the loop)."""

from __future__ import annotations

import pytest
from host_ledger_users import PREFIX, Agent
from rest import spec, submit
from waiting import async_wait_until

from jupyter_evalsched import contract
from jupyter_evalsched.contract import Holder
from jupyter_evalsched.scheduler.host_tenant import (
    gate_why,
    never_reason,
    others_by_device,
    own_unmanaged,
    refusal_why,
    tenant_capacity,
    with_others,
)
from jupyter_evalsched.scheduler.ledger import DeviceBudget, Unmanaged

pytestmark = pytest.mark.timeout(120)
BOB = PREFIX + "bob"


@pytest.fixture
def evalsched_config(ledger):
    return {"host_ledger": ledger.socket, "virtual_gpus": [24000]}


@pytest.fixture
def bob(users, ledger):
    agent = Agent(users["bob"], ledger.socket)
    yield agent
    agent.stop()


async def answered(agent: Agent, tag: int, timeout: float = 15.0) -> dict:
    await async_wait_until(lambda: agent.done(tag), timeout=timeout, message=f"the agent never answered {tag}")
    return agent.result(tag)


async def connected(api) -> dict:
    async def up():
        code, body = await api("GET", "status")
        return body["host_ledger"] if code == 200 and body["host_ledger"]["connected"] else None

    return await async_wait_until(up, timeout=15, message="the server never joined the host ledger")


async def reason_of(api, run_id: str, predicate) -> dict:
    async def now():
        code, rec = await api("GET", f"runs/{run_id}")
        return rec if code == 200 and predicate(rec) else None

    return await async_wait_until(now, timeout=15, message=f"run {run_id} never reached the expected reason")


async def test_a_run_is_granted_by_the_host_ledger_waits_for_another_user_and_is_released(api, ledger, bob, wait_for):
    status = await connected(api)
    assert status == {"socket": ledger.socket, "connected": True, "user": "root", "error": None}
    # Bob holds 14000 MB of the one 24000 MB GPU, granted by the host ledger.
    await answered(bob, bob.send("connect"))
    held = (await answered(bob, bob.send("request", key="bob-1", vram_mb=14000)))["result"]

    async def bob_seen():
        code, ledger_view = await api("GET", "ledger")
        return ledger_view if ledger_view["devices"][0]["users"] else None

    view = await async_wait_until(bob_seen, timeout=15)
    dev = view["devices"][0]
    assert dev["usable_mb"] == 24000 and dev["free_mb"] == 10000
    assert dev["users"] == [{"user": BOB, "allocated_mb": 14000, "leases": 0, "runs": 1, "models": 0}]
    assert "bob-1" not in str(view)  # another user's keys are never shown

    # A run that does not fit beside bob's grant waits, naming bob (and him alone).
    big = await submit(api, spec(vram=14000, sleep_s=0.05))
    rec = await reason_of(api, big["id"], lambda r: r["why"] and r["why"]["code"] == contract.WAITING_VRAM)
    assert f"user {BOB} holds 14000 MB on GPU 0" in rec["reason"]
    assert rec["why"]["holders"][0] == {"kind": "user", "id": BOB, "name": BOB, "gpu": 0, "mb": 14000}
    # A CPU-only run goes on meanwhile.
    cpu = await submit(api, spec(vram=0))
    assert (await wait_for(cpu["id"]))["state"] == "succeeded"

    # Bob releases: the run is granted there first, its grant tied to its process, then released.
    await answered(bob, bob.send("release", grant=held["id"]))
    long = await submit(api, spec(vram=4000, episodes=1, sleep_s=30))

    async def granted_to_run():
        code, rec = await api("GET", f"runs/{long['id']}")
        if rec["state"] != "running" or not rec["pid"]:
            return None
        grants = [g for g in ledger.view()["grants"] if g["key"] == long["id"]]
        return grants if grants and [p["pid"] for p in grants[0]["pids"]] == [rec["pid"]] else None

    grants = await async_wait_until(granted_to_run, timeout=20, message="the run's grant was never tied to its pid")
    assert grants[0]["user"] == "root" and grants[0]["vram_mb"] == 4000 and grants[0]["devices"] == [0]
    assert (await wait_for(big["id"]))["state"] == "succeeded"
    code, _ = await api("POST", f"runs/{long['id']}/cancel")
    assert code == 200
    await wait_for(long["id"])
    await async_wait_until(
        lambda: not [g for g in ledger.view()["grants"] if g["user"] == "root"],
        timeout=15,
        message="the runs' grants outlived them",
    )


async def test_without_the_host_ledger_gpu_work_waits_and_cpu_runs_go_on(api, ledger, wait_for):
    await connected(api)
    assert ledger.proc is not None
    ledger.proc.terminate()
    ledger.proc.wait(timeout=10)

    async def down():
        code, body = await api("GET", "status")
        return body["host_ledger"] if not body["host_ledger"]["connected"] else None

    status = await async_wait_until(down, timeout=15)
    assert status["error"]
    gpu = await submit(api, spec(vram=1000))
    rec = await reason_of(api, gpu["id"], lambda r: r["why"] and r["why"]["code"] == contract.HOST_LEDGER_UNAVAILABLE)
    assert rec["state"] == "queued" and ledger.socket in rec["reason"]
    cpu = await submit(api, spec(vram=0))
    assert (await wait_for(cpu["id"]))["state"] == "succeeded"
    code, checks = await api("GET", "doctor")
    [link] = [c for c in checks["checks"] if c["name"] == "host ledger"]
    assert link["status"] == "error" and "GPU work waits" in link["detail"]

    ledger.start()  # back: the GPU run is granted and runs
    assert (await wait_for(gpu["id"]))["state"] == "succeeded"
    code, checks = await api("GET", "doctor")
    [link] = [c for c in checks["checks"] if c["name"] == "host ledger"]
    assert link["status"] == "ok" and "as user root" in link["detail"]


@pytest.mark.parametrize(
    "ledger_config", [{"virtual_gpus": [24000], "reclaim_window_s": 0, "quota": {"root": {"vram_mb": 10000}}}]
)
async def test_a_quota_is_a_422_when_it_can_never_fit_and_a_wait_with_the_ledgers_reason(api, ledger, wait_for):
    await connected(api)
    code, err = await api("POST", "runs", spec(vram=12000))
    assert code == 422 and "quota: user root may hold 10000 MB of VRAM; the request needs 12000 MB" in str(err)
    code, err = await api("POST", "leases", {"vram_mb": 12000, "ttl_s": 60})
    assert code == 422 and "quota: user root" in str(err)
    first = await submit(api, spec(vram=8000, sleep_s=30))
    await reason_of(api, first["id"], lambda r: r["state"] == "running")
    second = await submit(api, spec(vram=8000))
    rec = await reason_of(api, second["id"], lambda r: r["why"] and r["why"]["code"] == contract.QUOTA)
    assert rec["state"] == "queued"
    assert rec["reason"] == "quota: user root may hold 10000 MB of VRAM; holds 8000 MB"
    code, _ = await api("POST", f"runs/{first['id']}/cancel")
    assert code == 200
    assert (await wait_for(second["id"]))["state"] == "succeeded"


# ----------------------------------------------------------------------------- the pure parts

VIEW = {
    "user": "alice",
    "quota": {"vram_mb": 20000, "gpus": None, "leases": None},
    "devices": [
        {
            "index": 0,
            "name": "virtual",
            "total_mb": 24000,
            "usable_mb": 23000,
            "users": [{"user": "bob", "allocated_mb": 9000, "leases": 0, "runs": 1}],
            "unmanaged_processes": [
                {"pid": 11, "gpu": 0, "used_mb": 500, "user": "alice"},
                {"pid": 12, "gpu": 0, "used_mb": 700, "user": "carol"},
            ],
        },
        {"index": 1, "name": "virtual", "total_mb": 24000, "usable_mb": 24000, "users": [], "unmanaged_processes": []},
    ],
}


def test_other_users_are_foreign_holders_by_name_and_this_users_processes_are_its_own():
    others = others_by_device(VIEW, "alice")
    assert others == {0: [Holder("user", "bob", "bob", 0, 9000), Holder("user", "carol", "carol", 0, 700)]}
    budgets = [DeviceBudget(0, "virtual", 24000, 23000), DeviceBudget(1, "virtual", 24000, 24000)]
    seen = {
        0: Unmanaged(
            1700, [{"pid": 11, "used_mb": 500, "lease_id": None}, {"pid": 12, "used_mb": 1200, "lease_id": None}]
        )
    }
    own = own_unmanaged(seen, lambda pid: pid == 11)
    assert own[0].mb == 500 and [p["pid"] for p in own[0].processes] == [11]
    cap = tenant_capacity(budgets, 4, own, others)
    assert cap.devices[0].unmanaged_mb == 500 + 9000 + 700 and cap.devices[0].holders[0].kind == "user"
    assert cap.devices[1].unmanaged_mb == 0


def test_the_ledger_view_gains_users_and_the_reasons_name_the_quota_or_the_user():
    ledger = {
        "devices": [
            {
                "index": 0,
                "usable_mb": 23000,
                "allocated_mb": 1000,
                "unmanaged_mb": 500,
                "free_mb": 21500,
                "unmanaged_processes": [{"pid": 11, "gpu": 0, "used_mb": 500}],
            },
        ]
    }
    out = with_others(ledger, VIEW, "alice")["devices"][0]
    assert out["users"] == [{"user": "bob", "allocated_mb": 9000, "leases": 0, "runs": 1}]
    assert [(p["pid"], p["user"]) for p in out["unmanaged_processes"]] == [(11, "alice"), (12, "carol")]
    assert out["free_mb"] == 23000 - 1000 - 1200 - 9000
    why = refusal_why("quota: user alice may hold 20000 MB of VRAM; holds 16000 MB", [])
    assert why.reason == "quota: user alice may hold 20000 MB of VRAM; holds 16000 MB"
    bob = Holder("user", "bob", "bob", 0, 9000)
    why = refusal_why("needs 14000 MB on 1 GPU; user bob holds 9000 MB on GPU 0", [bob])
    assert why.code == contract.HOST_LEDGER and why.holders == (bob,)
    assert never_reason(VIEW, "alice", 21000, 1, False, "run").startswith("quota: user alice may hold 20000 MB")
    assert never_reason(VIEW, "alice", 15000, 1, False, "run") == ""
    assert gate_why("/s", True, True, None) is None
    assert gate_why("/s", False, False, "refused").code == contract.HOST_LEDGER_UNAVAILABLE
