"""Issue #32, the grants a user's server asks the host ledger for besides a run's start: a
lease's (tied to its holder), a detached run's across a restart of its server (and of the host
ledger), a shared model's VRAM. Real processes throughout: a host ledger served by an unprivileged
system user on virtual GPUs, another system user's tenant (tests/host_ledger_agent.py), the
user's Jupyter server (pytest-jupyter in this process, or a real ``jupyter server`` subprocess
where it is killed with -9)."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import openai
import pytest
from host_ledger_users import PREFIX, Agent, Ledger
from proc_status import alive
from waiting import async_wait_until, wait_until

from jupyter_evalsched import contract
from jupyter_evalsched.cli import format_ledger
from jupyter_evalsched.client import LocalServer
from jupyter_evalsched.shared_models.tiny_lm import build_tiny_gpt2

pytestmark = pytest.mark.timeout(180)
BOB = PREFIX + "bob"
GATE = f"{Path(__file__).resolve().parent / 'evals_observed.py'}:gate"
FAST = [
    "--EvalSchedApp.cancel_grace_s=2.0",
    "--EvalSchedApp.reconcile_interval_s=0.5",
    "--EvalSchedApp.progress_interval_s=0.05",
]


@pytest.fixture
def bob(users, ledger):
    agent = Agent(users["bob"], ledger.socket)
    yield agent
    agent.stop()


async def connected(api) -> dict:
    async def up():
        code, body = await api("GET", "status")
        return body["host_ledger"] if code == 200 and body["host_ledger"]["connected"] else None

    return await async_wait_until(up, timeout=15, message="the server never joined the host ledger")


async def lease_until(api, lease_id: str, predicate, what: str) -> dict:
    async def now():
        code, rec = await api("GET", f"leases/{lease_id}")
        return rec if code == 200 and predicate(rec) else None

    return await async_wait_until(now, timeout=30, message=f"lease {lease_id} never {what}")


def grants_of(ledger: Ledger, user: str = "root") -> list[dict]:
    return [g for g in ledger.view()["grants"] if g["user"] == user]


async def grants_until(ledger: Ledger, predicate, what: str) -> list[dict]:
    """This user's grants at the host ledger, once ``predicate`` holds of them (within 30 s)."""

    async def now():
        grants = await asyncio.to_thread(grants_of, ledger)
        return (grants,) if predicate(grants) else None

    return (await async_wait_until(now, timeout=30, message=what))[0]


# ----------------------------------------------------------------------------- leases


@pytest.mark.parametrize(
    "ledger_config", [{"virtual_gpus": [24000], "reclaim_window_s": 0, "quota": {"root": {"leases": 1}}}]
)
async def test_a_lease_is_granted_by_the_host_ledger_tied_to_its_holder_and_released_at_its_end(api, ledger, holder):
    await connected(api)
    first_holder = holder()
    code, first = await api("POST", "leases", {"vram_mb": 4000, "pid": first_holder.pid, "label": "first"})
    assert code == 201, first
    rec = await lease_until(api, first["id"], lambda r: r["state"] == "granted", "granted")
    [grant] = await grants_until(ledger, lambda g: len(g) == 1, "the lease was never granted at the host ledger")
    assert (grant["key"], grant["kind"], grant["vram_mb"], grant["devices"]) == (first["id"], "lease", 4000, [0])
    assert rec["devices"] == [0]
    assert [p["pid"] for p in grant["pids"]] == [first_holder.pid]  # tied to its holder, not to the server

    # A second lease is over this user's lease quota at the host ledger: it waits with its reason.
    second_holder = holder()
    code, second = await api("POST", "leases", {"vram_mb": 4000, "pid": second_holder.pid, "label": "second"})
    assert code == 201, second
    rec = await lease_until(api, second["id"], lambda r: (r["why"] or {}).get("code") == contract.QUOTA, "waited")
    assert rec["state"] == "queued" and rec["reason"] == "quota: user root may hold 1 lease; holds 1"
    # Refused, it holds nothing here: the GPU's room is the first lease's alone.
    code, view = await api("GET", "ledger")
    assert view["devices"][0]["allocated_mb"] == 4000, view["devices"][0]

    # The first is released: its grant goes back, and the second is granted in its place.
    assert (await api("DELETE", f"leases/{first['id']}"))[0] == 204
    await lease_until(api, second["id"], lambda r: r["state"] == "granted", "granted")
    [grant] = await grants_until(
        ledger, lambda g: [x["key"] for x in g] == [second["id"]], "the first lease's grant outlived it"
    )
    assert [p["pid"] for p in grant["pids"]] == [second_holder.pid]

    # Its holder exits: the lease ends, and its grant with it.
    second_holder.kill()
    second_holder.wait()
    rec = await lease_until(api, second["id"], lambda r: r["state"] == "ended", "ended")
    assert rec["reason"].startswith(contract.PROCESS_EXITED)
    await grants_until(ledger, lambda g: g == [], "the ended lease's grant outlived it")


async def test_a_lease_without_a_holder_is_released_at_its_ttl_and_another_users_holding_is_named(api, ledger, bob):
    await connected(api)
    code, short = await api("POST", "leases", {"vram_mb": 2000, "ttl_s": 2, "label": "short"})
    assert code == 201, short
    await lease_until(api, short["id"], lambda r: r["state"] == "granted", "granted")
    [grant] = await grants_until(ledger, lambda g: len(g) == 1, "the lease was never granted at the host ledger")
    assert grant["key"] == short["id"] and grant["kind"] == "lease"
    await lease_until(api, short["id"], lambda r: r["state"] == "ended", "expired")
    await grants_until(ledger, lambda g: g == [], "the expired lease's grant outlived it")

    # Bob holds 20000 MB: a lease of 8000 waits, naming him.
    assert "result" in bob.call("connect")
    bob.ok("request", key="bob-1", vram_mb=20000)

    async def bob_seen():
        code, view = await api("GET", "ledger")
        return view if view["devices"][0]["users"] else None

    await async_wait_until(bob_seen, timeout=15)
    code, big = await api("POST", "leases", {"vram_mb": 8000, "ttl_s": 60, "label": "big"})
    assert code == 201, big
    rec = await lease_until(api, big["id"], lambda r: (r["why"] or {}).get("holders"), "waited")
    assert rec["state"] == "queued" and f"user {BOB} holds 20000 MB on GPU 0" in rec["reason"]
    assert grants_of(ledger) == []


# ----------------------------------------------------------------------------- a detached run across restarts


def kill9(server: LocalServer) -> None:
    server.process.send_signal(signal.SIGKILL)
    server.process.wait()
    server.cleanup()


@pytest.mark.slow
@pytest.mark.parametrize("ledger_config", [{"virtual_gpus": [24000], "reclaim_window_s": 4}])
def test_a_detached_run_keeps_its_grant_across_a_restart_of_its_server_and_of_the_host_ledger(tmp_path, ledger, bob):
    runs = tmp_path / "runs"
    pid_file, gate = tmp_path / "run.pid", tmp_path / "open"
    body = {
        "entrypoint": GATE,
        "episodes": 1,
        "params": {"pid_file": str(pid_file), "gate": str(gate)},
        "cwd": "/",
        "scheduling": {"marginal_vram_mb": 8000},
        "detach": True,
    }
    args = [*FAST, f"--EvalSchedApp.host_ledger={ledger.socket}"]
    server = LocalServer(virtual_gpus="24000", runs_dir=str(runs), extra_args=args)
    try:
        c = server.client()
        wait_until(lambda: c.request("GET", "status")["host_ledger"]["connected"], timeout=15)
        rec = c.submit(body)
        wait_until(pid_file.exists, timeout=30, message="the detached run never started")
        pid = int(pid_file.read_text())

        def tied():
            grants = grants_of(ledger)
            return grants if grants and [p["pid"] for p in grants[0]["pids"]] == [pid] else None

        [grant] = wait_until(tied, timeout=20, message="the run's grant was never tied to its pid")
        assert grant["key"] == rec["id"] and grant["vram_mb"] == 8000
    finally:
        kill9(server)
    assert alive(pid)

    restarted = LocalServer(virtual_gpus="24000", runs_dir=str(runs), extra_args=args)
    try:
        c = restarted.client()
        wait_until(lambda: c.request("GET", "status")["host_ledger"]["connected"], timeout=15)
        assert c.get(rec["id"])["state"] == "running"
        # The same grant, never a second one, never released while its run lives.
        assert [g["id"] for g in grants_of(ledger)] == [grant["id"]]

        # The host ledger restarts and has lost its state: the restarted server re-tells the
        # grant it learned (it never saw it granted), so bob's 20000 MB wait behind it.
        ledger.kill9()
        Path(ledger.state_file).write_text("not json")
        ledger.start()
        wait_until(lambda: [g["id"] for g in grants_of(ledger)] == [grant["id"]], timeout=20)
        assert "result" in bob.call("connect", timeout=20)
        tag = bob.send("request", key="bob-big", vram_mb=20000)

        def bob_waits():
            waiting = ledger.view()["waiting"]
            return waiting if waiting and "user root holds 8000 MB on GPU 0" in waiting[0]["reason"] else None

        wait_until(bob_waits, timeout=20, message="bob's request was not held back by the re-told grant")
        assert not bob.done(tag)
        assert [g["id"] for g in grants_of(ledger)] == [grant["id"]]

        gate.touch()  # the run ends: its grant goes back, and bob gets the room
        wait_until(lambda: c.get(rec["id"])["state"] == "succeeded", timeout=60)
        wait_until(lambda: grants_of(ledger) == [] and bob.done(tag), timeout=20, message="the grant outlived its run")
        assert bob.result(tag)["result"]["vram_mb"] == 20000
    finally:
        restarted.cleanup()


# ----------------------------------------------------------------------------- shared models

MODEL_QUOTA = {"virtual_gpus": [24000], "reclaim_window_s": 0, "quota": {"root": {"vram_mb": 20000}}}


@pytest.fixture(scope="module")
def tiny_lm_dir(tmp_path_factory):
    return build_tiny_gpt2(tmp_path_factory.mktemp("models") / "tiny-gpt2")


@pytest.fixture
def evalsched_config(request, ledger):
    if "tiny_lm_dir" not in request.fixturenames:
        return {"host_ledger": ledger.socket, "virtual_gpus": [24000]}
    return {
        "host_ledger": ledger.socket,
        "virtual_gpus": [24000],
        "models": [
            {
                "name": "llm",
                "loader": "jupyter_evalsched.shared_models.testing:causal_lm_on_cpu",
                "model": request.getfixturevalue("tiny_lm_dir"),
                "device": 0,
                "vram_mb": 14000,
                "idle_unload_s": 1.0,
                "cpu_threads": 1,
            }
        ],
    }


def complete(client) -> str:
    answer = client.completions.create(model="llm", prompt="The cat", max_tokens=2, temperature=0)
    return answer.choices[0].text


@pytest.mark.slow
@pytest.mark.parametrize("ledger_config", [MODEL_QUOTA])
async def test_a_shared_models_vram_is_granted_by_the_host_ledger_and_released_when_unloaded(
    tiny_lm_dir, api, ledger, bob, jp_serverapp, jp_http_port, jp_base_url
):
    await connected(api)
    client = openai.OpenAI(
        base_url=f"http://127.0.0.1:{jp_http_port}{jp_base_url}evalsched/v1",
        api_key=jp_serverapp.identity_provider.token,
        max_retries=0,
        timeout=120,
    )
    code, first = await api("POST", "leases", {"vram_mb": 8000, "ttl_s": 120, "label": "first"})
    assert code == 201, first
    await lease_until(api, first["id"], lambda r: r["state"] == "granted", "granted")

    # The model's 14000 MB fit the GPU beside the lease, but not this user's quota at the host
    # ledger (8000 + 14000 > 20000): its load waits with the ledger's reason.
    request = asyncio.ensure_future(asyncio.to_thread(complete, client))

    async def load_waits():
        code, view = await api("GET", "ledger")
        entry = next((m for m in view["devices"][0]["models"] if m["name"] == "llm"), None)
        return entry if entry and (entry.get("why") or {}).get("code") == contract.QUOTA else None

    entry = await async_wait_until(load_waits, timeout=30, message="the model's load never waited for the quota")
    assert entry["why"]["detail"] == "user root may hold 20000 MB of VRAM; holds 8000 MB"
    assert not request.done() and [g["kind"] for g in grants_of(ledger)] == ["lease"]

    # The lease ends: the model is granted there, loads and answers.
    assert (await api("DELETE", f"leases/{first['id']}"))[0] == 204
    assert isinstance(await asyncio.wait_for(request, 120), str)
    [grant] = await grants_until(ledger, lambda g: [x["kind"] for x in g] == ["model"], "the model was never granted")
    assert (grant["vram_mb"], grant["devices"]) == (14000, [0])
    assert "result" in bob.call("connect")
    assert bob.ok("view")["devices"][0]["users"] == [
        {"user": "root", "allocated_mb": 14000, "leases": 0, "runs": 0, "models": 1}
    ]

    # A lease that needs its room: the idle model is unloaded, its grant released, the lease granted.
    code, second = await api("POST", "leases", {"vram_mb": 16000, "ttl_s": 120, "label": "second"})
    assert code == 201, second
    await lease_until(api, second["id"], lambda r: r["state"] == "granted", "granted")
    await grants_until(
        ledger, lambda g: [x["key"] for x in g] == [second["id"]], "the unloaded model's grant outlived it"
    )


# ----------------------------------------------------------------------------- `jupyter evalsched queue`


def test_the_queue_shows_the_other_users_holdings_per_gpu_by_name():
    ledger = {
        "devices": [
            {
                "index": 0,
                "usable_mb": 24000,
                "allocated_mb": 4000,
                "free_mb": 6000,
                "users": [
                    {"user": "bob", "allocated_mb": 9000, "leases": 1, "runs": 1, "models": 0},
                    {"user": "carol", "allocated_mb": 5000, "leases": 0, "runs": 0, "models": 1},
                ],
            },
            {"index": 1, "usable_mb": 24000, "allocated_mb": 0, "free_mb": 24000, "users": []},
        ]
    }
    lines = format_ledger(ledger).split("\n")
    assert lines[1:3] == ["  user bob: 9,000 MB (1 run, 1 lease)", "  user carol: 5,000 MB (1 model)"], lines
    assert lines[3].startswith("GPU 1") and len(lines) == 4, lines
