"""Issue #32, the host ledger: real system users (useradd), a host ledger served by an
unprivileged third user on virtual GPUs, tenants started as the two others, raw sockets for the
hostile ones. Only the GPUs are virtual."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import socket
import struct
import subprocess
import sys
import time

import pytest
from host_ledger_users import (
    PREFIX,
    REPO,
    Agent,
    as_user,
    assert_never_over,
    grant_ids,
    wait_for_view,
)
from proc_status import alive
from waiting import wait_until

from jupyter_evalsched.host_ledger.client import status
from jupyter_evalsched.host_ledger.protocol import FRAME_DEADLINE_S, encode
from jupyter_evalsched.host_ledger.server import SEND_DEADLINE_S, TURN_S

pytestmark = pytest.mark.timeout(120)
ALICE, BOB = PREFIX + "alice", PREFIX + "bob"


@pytest.fixture
def agents(users, ledger):
    made: list[Agent] = []

    def make(role: str) -> Agent:
        agent = Agent(users[role], ledger.socket)
        made.append(agent)
        hello = agent.ok("connect")
        assert hello["user"] == users[role].pw_name and hello["uid"] == users[role].pw_uid
        return agent

    yield make
    for agent in made:
        agent.stop()


def test_the_ledger_runs_as_its_own_unprivileged_user(users, ledger):
    assert os.stat(f"/proc/{ledger.proc.pid}").st_uid == users["ledger"].pw_uid
    assert os.stat(ledger.socket).st_mode & 0o777 == 0o666


def test_two_users_never_over_usable_and_a_wait_names_the_holder(users, ledger, agents):
    alice, bob = agents("alice"), agents("bob")
    a = alice.ok("request", key="a1", vram_mb=14000)
    assert a["devices"] == [0] and a["user"] == users["alice"].pw_name
    tag = bob.send("request", key="b1", vram_mb=14000)
    view = wait_for_view(ledger, lambda v: v["waiting"])
    assert view["waiting"][0]["reason"].endswith(f"; user {users['alice'].pw_name} holds 14000 MB on GPU 0")
    # Bob sees alice by name only: none of her keys or pids.
    mine = bob.ok("view")
    assert mine["grants"] == [] and mine["devices"][0]["users"] == [
        {"user": users["alice"].pw_name, "allocated_mb": 14000, "leases": 0, "runs": 1, "models": 0}
    ]
    assert "a1" not in str(mine)
    assert not bob.done(tag)
    alice.ok("release", grant=a["id"])
    assert bob.result(tag)["result"]["devices"] == [0]

    # Both users at random: the sum of grants on the GPU never passes its usable VRAM.
    rng = random.Random(32)
    held: dict[str, list[str]] = {"alice": [], "bob": []}
    pending: list[tuple[str, Agent, int]] = []
    tenants = {"alice": alice, "bob": bob}
    for step in range(40):
        name = rng.choice(["alice", "bob"])
        agent = tenants[name]
        if held[name] and rng.random() < 0.4:
            agent.ok("release", grant=held[name].pop(rng.randrange(len(held[name]))))
        else:
            pending.append(
                (name, agent, agent.send("request", key=f"{name}-{step}", vram_mb=rng.choice([2000, 6000, 9000])))
            )
        for entry in list(pending):
            if entry[1].done(entry[2]):
                pending.remove(entry)
                held[entry[0]].append(entry[1].result(entry[2])["result"]["id"])
        assert_never_over(ledger.view())


@pytest.mark.parametrize(
    "ledger_config", [{"virtual_gpus": [24000, 24000], "reclaim_window_s": 0, "quota": {ALICE: {"vram_mb": 20000}}}]
)
def test_a_quota_waits_with_the_pinned_reason_and_one_it_can_never_meet_is_never(users, ledger, agents):
    alice = agents("alice")
    # 16000 MB held under a 20000 MB quota: 8000 more must wait, naming the quota.
    alice.ok("request", key="a1", vram_mb=16000)
    tag = alice.send("request", key="a2", vram_mb=8000)
    view = wait_for_view(ledger, lambda v: v["waiting"])
    assert view["waiting"][0]["reason"] == f"quota: user {ALICE} may hold 20000 MB of VRAM; holds 16000 MB"
    assert not alice.done(tag)
    never = alice.call("request", key="a3", vram_mb=22000)
    assert never["error"] == "never" and never["reason"].startswith(f"quota: user {ALICE} may hold 20000 MB")
    # Bob's quota is the default (none): the other GPU is his.
    bob = agents("bob")
    assert bob.ok("request", key="b1", vram_mb=24000)["devices"] == [1]


def test_fair_share_the_next_grant_goes_to_the_user_holding_least(users, ledger, agents):
    alice, bob = agents("alice"), agents("bob")
    first = [alice.ok("request", key=f"a{i}", vram_mb=12000)["id"] for i in range(2)]  # the whole GPU
    queued: list[tuple[str, Agent, int]] = []
    for i in range(3):  # alice queues first: arrival order alone would serve her three first
        queued.append(("alice", alice, alice.send("request", key=f"a-next{i}", vram_mb=12000)))
    for i in range(3):
        queued.append(("bob", bob, bob.send("request", key=f"b-next{i}", vram_mb=12000)))
    wait_for_view(ledger, lambda v: len(v["waiting"]) == 6)
    order = []
    holding = [(alice, first[0]), (alice, first[1])]
    while len(order) < 6:
        agent, grant = holding.pop(0)
        agent.ok("release", grant=grant)
        done = wait_until(lambda: [q for q in queued if q[1].done(q[2])], timeout=10)
        assert len(done) == 1, done
        queued.remove(done[0])
        name, agent, tag = done[0]
        order.append(name)
        holding.append((agent, agent.result(tag)["result"]["id"]))
    assert order == ["bob", "alice", "bob", "alice", "bob", "alice"], order


@pytest.mark.slow  # real users' agents through several turns: CI runs it with -m slow (docs/install.md: the default suite stays within ten minutes)
def test_fair_share_between_servers_that_ask_without_waiting_keeps_room_for_the_told_demand(users, ledger, agents):
    """Users' servers ask without waiting (their own admission decides) and tell their queued
    GPU work as ``demand``: room freed by alice, who holds more, goes to bob's demand first; alice
    is told to retry once bob has it, or once bob let TURN_S pass without asking."""
    alice, bob = agents("alice"), agents("bob")
    held = [alice.ok("request", key=f"a{i}", vram_mb=12000) for i in range(2)]  # the whole GPU
    assert bob.ok("demand", asks=[{"vram_mb": 12000}, {"vram_mb": 12000}]) == 2
    assert [d["user"] for d in ledger.view()["demand"]] == [BOB, BOB]
    alice.ok("release", grant=held[0]["id"])
    refused = alice.ok("request", key="a-next", vram_mb=12000, wait=False)
    assert refused["state"] == "busy", refused
    assert refused["reason"] == f"fair share: user {BOB} holds less (0 MB) and waits for this room"
    wait_until(lambda: "turn" in bob.ok("events"), timeout=10, message="bob was never told his turn")
    assert bob.ok("request", key="b1", vram_mb=12000, wait=False)["state"] == "granted"
    wait_until(lambda: "retry" in alice.ok("events"), timeout=10, message="alice was never told to retry")
    # Holding the same as bob now, alice is not held back by his demand: arrival decides.
    alice.ok("release", grant=held[1]["id"])
    assert alice.ok("request", key="a-next", vram_mb=12000, wait=False)["state"] == "granted"

    # A turn not taken: bob frees his, holding less than alice, but never asks; alice goes on
    # after TURN_S, and bob's demand is set aside until he tells it anew.
    bob.ok("release", grant=[g for g in ledger.view()["grants"] if g["user"] == BOB][0]["id"])
    assert alice.ok("request", key="a-again", vram_mb=12000, wait=False)["state"] == "busy"
    retries = alice.ok("events").count("retry")
    wait_until(lambda: alice.ok("events").count("retry") > retries, timeout=TURN_S + 10)
    assert ledger.view()["demand"] == []
    assert alice.ok("request", key="a-again", vram_mb=12000, wait=False)["state"] == "granted"
    # Bad demand: a precise error, and the connection goes on.
    for asks in ("x", [{"vram_mb": "a lot"}], [{"vram_mb": 1}] * 17, [{"vram_mb": 1, "kind": "job"}]):
        bad = alice.call("demand", asks=asks)
        assert bad["error"] == "bad_request", bad
    assert alice.ok("view")["user"] == ALICE


def test_a_client_claiming_another_identity_or_pid_gets_nothing(users, ledger, agents):
    alice, bob = agents("alice"), agents("bob")
    bobs_run = bob.ok("spawn")
    as_bob = alice.ok("raw", message={"op": "request", "key": "x", "vram_mb": 1000, "uid": users["bob"].pw_uid})
    assert as_bob["ok"] is False and as_bob["error"] == "identity", as_bob
    as_bob = alice.ok("raw", message={"op": "request", "key": "x", "vram_mb": 1000, "user": users["bob"].pw_name})
    assert as_bob["ok"] is False and as_bob["error"] == "identity", as_bob
    for pids in ([bobs_run], [1], [ledger.proc.pid]):
        claimed = alice.call("request", key="y", vram_mb=1000, pids=pids)
        assert claimed["error"] == "not_yours", claimed
    # Re-telling a grant the ledger never made is no way around it (outside a restart's window).
    made_up = {"id": "f" * 16, "key": "x", "kind": "run", "devices": [0], "vram_mb": 24000, "exclusive": False}
    told = alice.ok("raw", message={"op": "reclaim", "grants": [{**made_up, "pids": [alice.proc.pid]}]})
    assert told["kept"] == [] and told["refused"][0]["error"] == "unknown_grant", told
    mine = alice.ok("request", key="z", vram_mb=1000)
    retied = alice.call("retie", grant=mine["id"], pids=[bobs_run])
    assert retied["error"] == "not_yours"
    view = ledger.view()
    assert [g["key"] for g in view["grants"]] == ["z"] and view["waiting"] == []
    assert view["grants"][0]["pids"][0]["pid"] == alice.proc.pid
    bob.ok("kill", pid=bobs_run)


def test_a_user_cannot_release_or_read_another_users_grants(users, ledger, agents):
    alice, bob = agents("alice"), agents("bob")
    grant = alice.ok("request", key="secret-run-name", vram_mb=5000)
    for op, fields in (("release", {"grant": grant["id"]}), ("retie", {"grant": grant["id"], "pids": [bob.proc.pid]})):
        refused = bob.call(op, **fields)
        assert refused["error"] == "unknown_grant", refused
    reclaim = bob.ok("raw", message={"op": "reclaim", "grants": [{**grant, "pids": [bob.proc.pid]}]})
    assert reclaim["kept"] == [] and reclaim["refused"][0]["error"] == "unknown_grant"
    seen = bob.ok("view")
    assert seen["grants"] == [] and "secret-run-name" not in str(seen) and grant["id"] not in str(seen)
    assert grant_ids(ledger.view()) == {grant["id"]}
    assert ledger.view()["grants"][0]["pids"][0]["pid"] == alice.proc.pid


def _raw(path: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(path)
    return sock


def _closed_by_peer(sock: socket.socket, timeout: float) -> bool:
    sock.settimeout(timeout)
    try:
        while sock.recv(65536):
            pass
    except (TimeoutError, ConnectionResetError):
        return False
    return True


def test_garbage_oversized_and_half_sent_frames_disturb_nobody(users, ledger, agents):
    alice = agents("alice")
    grant = alice.ok("request", key="a1", vram_mb=4000)
    garbage, oversized, half, silent = (_raw(ledger.socket) for _ in range(4))
    garbage.sendall(b"\x00\x00\x00\x05hello" + os.urandom(64))
    oversized.sendall(struct.pack(">I", 64 * 1024 * 1024) + b"x" * 1024)
    half.sendall(encode({"op": "hello", "id": 1})[:7])  # and nothing more
    # `silent` connects and never says anything.
    started = time.monotonic()
    view = alice.call("view", timeout=1.0)  # answered within a second while those hang about
    assert "result" in view and time.monotonic() - started < 1.0
    assert alice.ok("request", key="a2", vram_mb=1000)["devices"] == [0]
    assert _closed_by_peer(garbage, 5.0) and _closed_by_peer(oversized, 5.0)
    assert _closed_by_peer(half, FRAME_DEADLINE_S + 5.0)
    assert _closed_by_peer(silent, 10.0)  # no hello in time
    assert grant["id"] in grant_ids(ledger.view())
    assert ledger.proc.poll() is None


def test_kill_9_of_a_tenant_frees_its_grants_only_once_their_processes_are_gone(users, ledger, agents):
    alice = agents("alice")
    run = alice.ok("spawn")  # a run, in its own session: it outlives its server
    of_the_run = alice.ok("request", key="run", vram_mb=10000)
    alice.ok("retie", grant=of_the_run["id"], pids=[run])
    of_the_server = alice.ok("request", key="lease", vram_mb=5000, kind="lease")  # tied to the tenant itself
    alice.kill9()
    view = wait_for_view(ledger, lambda v: of_the_server["id"] not in grant_ids(v))
    # Sweeps have run since the tenant died (they ended its own grant): the run's is still held.
    assert grant_ids(view) == {of_the_run["id"]} and alive(run)
    assert view["devices"][0]["allocated_mb"] == 10000
    os.kill(run, signal.SIGKILL)
    wait_for_view(ledger, lambda v: not v["grants"])


@pytest.mark.parametrize("ledger_config", [{"virtual_gpus": [24000], "reclaim_window_s": 60}])
def test_a_restarted_ledger_under_load_grants_nothing_twice(users, ledger, agents):
    """Killed with -9 while both users hold grants and one waits; restarted, it grants nothing new
    until both tenants it knew have re-told theirs (the 60 s window is not waited out: this test
    takes seconds), and each grant is held once, by the same id."""
    alice, bob = agents("alice"), agents("bob")
    a_run, b_run = alice.ok("spawn"), bob.ok("spawn")
    a = alice.ok("request", key="a-run", vram_mb=14000)
    alice.ok("retie", grant=a["id"], pids=[a_run])
    b = bob.ok("request", key="b-run", vram_mb=8000)
    bob.ok("retie", grant=b["id"], pids=[b_run])
    big = bob.send("request", key="b-big", vram_mb=10000)
    wait_for_view(ledger, lambda v: v["waiting"])
    ledger.kill9()
    assert bob.result(big)["error"] == "unavailable"

    ledger.start()
    assert bob.ok("connect")["reclaiming"] is True  # alice has not re-told hers yet
    assert bob.ok("grants") == [b["id"]]
    small = [bob.send("request", key=f"b-small{i}", vram_mb=1000) for i in range(3)]
    big = bob.send("request", key="b-big", vram_mb=10000)
    view = wait_for_view(ledger, lambda v: len(v["waiting"]) == 4)
    assert view["reclaiming"] and all(w["reason"].startswith("the host ledger restarted") for w in view["waiting"])
    assert not any(bob.done(t) for t in small)
    assert_never_over(view)

    hello = alice.ok("connect")
    assert [g["id"] for g in hello["grants"]] == [a["id"]]  # kept from its state file meanwhile
    granted = [bob.result(t)["result"] for t in small[:2]]  # 2000 MB were left: two of the three
    view = wait_for_view(ledger, lambda v: not v["reclaiming"] and len(v["waiting"]) == 2)
    assert_never_over(view)
    assert sorted(g["id"] for g in view["grants"]) == sorted([a["id"], b["id"], *(g["id"] for g in granted)])
    reasons = {w["key"]: w["reason"] for w in view["waiting"]}
    assert f"user {ALICE} holds 14000 MB on GPU 0" in reasons["b-big"]
    assert not bob.done(big) and not bob.done(small[2])
    alice.ok("release", grant=a["id"])
    assert bob.result(big)["result"]["devices"] == [0]
    assert_never_over(ledger.view())
    for agent, run in ((alice, a_run), (bob, b_run)):
        agent.ok("kill", pid=run)


def test_processes_outside_any_grant_are_unmanaged_and_named_by_user(users, agents, ledger):
    alice, bob = agents("alice"), agents("bob")
    bobs_notebook, alices_run = bob.ok("spawn"), alice.ok("spawn")
    grant = alice.ok("request", key="run", vram_mb=6000)
    alice.ok("retie", grant=grant["id"], pids=[alices_run])
    ledger.plant([{"pid": bobs_notebook, "gpu": 0, "used_mb": 9000}, {"pid": alices_run, "gpu": 0, "used_mb": 5000}])
    view = wait_for_view(ledger, lambda v: v["devices"][0]["unmanaged_mb"])
    dev = view["devices"][0]
    # The run's own VRAM is its grant's, not unmanaged; bob's process is, under his name.
    assert dev["unmanaged_mb"] == 9000 and dev["free_mb"] == 24000 - 6000 - 9000
    assert dev["unmanaged_processes"] == [{"pid": bobs_notebook, "gpu": 0, "used_mb": 9000, "user": BOB}]
    tag = alice.send("request", key="more", vram_mb=10000)
    view = wait_for_view(ledger, lambda v: v["waiting"])
    assert "processes outside the ledger hold 9000 MB on GPU 0" in view["waiting"][0]["reason"]
    bob.ok("kill", pid=bobs_notebook)
    ledger.plant([])
    assert alice.result(tag)["result"]["devices"] == [0]
    alice.ok("kill", pid=alices_run)


def test_status_shows_root_every_user_and_a_user_their_own(users, ledger, agents):
    alice = agents("alice")
    alice.ok("request", key="alices-eval", vram_mb=7000)
    cli = [sys.executable, "-m", "jupyter_evalsched.cli", "host-ledger", "--socket", ledger.socket, "--status"]
    env = dict(os.environ, PYTHONPATH=str(REPO))
    whole = subprocess.run(cli, capture_output=True, text=True, timeout=60, env=env)
    assert whole.returncode == 0, whole.stderr
    assert "admin: every user" in whole.stdout and "alices-eval" in whole.stdout and ALICE in whole.stdout
    kw = as_user(users["bob"], [*cli, "--json"])
    own = subprocess.run(kw.pop("args"), capture_output=True, text=True, timeout=60, **kw)
    assert own.returncode == 0, own.stderr
    view = json.loads(own.stdout)
    assert view["user"] == BOB and view["admin"] is False and view["grants"] == []
    assert view["devices"][0]["users"] == [{"user": ALICE, "allocated_mb": 7000, "leases": 0, "runs": 1, "models": 0}]
    assert "alices-eval" not in own.stdout
    missing = subprocess.run(
        [*cli[:-3], "--socket", ledger.socket + ".nope", "--status"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert missing.returncode == 2 and "cannot connect" in missing.stderr


def test_a_bad_policy_file_stops_the_ledger_with_the_key_named(tmp_path):
    config = tmp_path / "policy.json"
    config.write_text(json.dumps({"quota": {"alice": {"vram": 1}}}))
    cli = [sys.executable, "-m", "jupyter_evalsched.cli", "host-ledger", "--socket", str(tmp_path / "s.sock")]
    proc = subprocess.run([*cli, "--config", str(config)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "quota.alice: unknown key 'vram'" in proc.stderr
    assert not (tmp_path / "s.sock").exists()


def test_the_deployment_examples_parse(tmp_path):
    from jupyter_evalsched.host_ledger.config import load_config

    examples = REPO / "jupyter-config" / "host-ledger"
    assert load_config(str(examples / "host-ledger.json")).quota("alice").gpus == 2
    unit = (examples / "evalsched-host-ledger.service").read_text()
    for line in (
        "RuntimeDirectory=evalsched",
        "User=evalsched",
        "evalsched host-ledger --socket /run/evalsched/ledger.sock",
    ):
        assert line in unit
    namespace = {"get_config": lambda: type("C", (), {"JupyterHub": type("H", (), {})()})()}
    exec(compile((examples / "jupyterhub_config.py").read_text(), "jupyterhub_config.py", "exec"), namespace)
    (service,) = namespace["c"].JupyterHub.services
    assert service["command"][service["command"].index("host-ledger") - 2 :][:3] == [
        "jupyter",
        "evalsched",
        "host-ledger",
    ]


def test_a_view_larger_than_a_request_frame_still_reaches_the_client(tmp_path):
    """Requests are capped at 64 KiB; the ledger's answers are not held to that (a busy host's
    whole view is larger). In one process, as root, against a ledger in the same loop."""
    from jupyter_evalsched.host_ledger.client import HostLedgerClient
    from jupyter_evalsched.host_ledger.config import parse_config
    from jupyter_evalsched.host_ledger.protocol import MAX_FRAME_BYTES
    from jupyter_evalsched.host_ledger.server import HostLedger

    async def go() -> None:
        server = HostLedger(parse_config({"virtual_gpus": [24000]}), str(tmp_path / "ledger.sock"))
        await server.start()
        client = HostLedgerClient(server.socket_path)
        try:
            await client.connect()
            for i in range(260):
                await client.request(f"{i:04d}-" + "k" * 190, 10)
            view = await client.view()
            assert len(view["grants"]) == 260 and len(json.dumps(view)) > MAX_FRAME_BYTES
            assert (await asyncio.to_thread(status, server.socket_path))["grants"] == view["grants"]
        finally:
            await client.close()
            await server.stop()

    asyncio.run(go())


@pytest.mark.parametrize("ledger_config", [{"virtual_gpus": [24000], "reclaim_window_s": 3}])
def test_with_its_state_file_unreadable_a_restarted_ledger_learns_the_grants_from_the_tenants(users, ledger, agents):
    """The worst restart: the ledger remembers nothing it can trust, so it waits the whole window
    (3 s here) for the tenants; alice's re-told grant is then held, and bob's request waits on it."""
    alice, bob = agents("alice"), agents("bob")
    run = alice.ok("spawn")
    a = alice.ok("request", key="a-run", vram_mb=20000)
    alice.ok("retie", grant=a["id"], pids=[run])
    ledger.kill9()
    with open(ledger.state_file, "w") as f:
        f.write("{not json")
    ledger.start()
    assert bob.ok("connect")["reclaiming"] is True
    tag = bob.send("request", key="b", vram_mb=10000)
    wait_for_view(ledger, lambda v: v["waiting"])
    hello = alice.ok("connect")  # re-tells a grant the ledger had forgotten
    assert hello["grants"] == [] and alice.ok("grants") == [a["id"]]
    holder = f"user {ALICE} holds 20000 MB on GPU 0"
    view = wait_for_view(ledger, lambda v: not v["reclaiming"] and holder in v["waiting"][0]["reason"], timeout=15)
    assert grant_ids(view) == {a["id"]} and view["grants"][0]["pids"][0]["pid"] == run
    assert not bob.done(tag)
    alice.ok("kill", pid=run)  # the run ends: its grant with it, and bob's request is granted
    assert bob.result(tag)["result"]["devices"] == [0]


def test_during_the_reclaim_window_a_re_told_grant_must_fit_beside_the_others(tmp_path):
    """In one process, as root: after a restart that lost the state, re-told grants are learnt
    only as far as the GPU holds them; one past it is refused, never kept."""
    from jupyter_evalsched.host_ledger.client import HostLedgerClient
    from jupyter_evalsched.host_ledger.config import parse_config
    from jupyter_evalsched.host_ledger.server import HostLedger

    async def go() -> None:
        path = tmp_path / "ledger.sock"
        (tmp_path / "ledger.sock.state.json").write_text("{not json")
        server = HostLedger(parse_config({"virtual_gpus": [24000], "reclaim_window_s": 60}), str(path))
        await server.start()
        clients = [HostLedgerClient(str(path)) for _ in range(2)]
        try:
            for client, (gid, mb) in zip(clients, (("a" * 16, 20000), ("b" * 16, 10000)), strict=True):
                client.grants[gid] = {
                    "id": gid, "key": gid, "kind": "run", "devices": [0], "vram_mb": mb, "exclusive": False,
                    "pids": [{"pid": os.getpid(), "start": 0}],
                }  # fmt: skip
                assert (await client.connect())["reclaiming"] is True
            assert sorted(clients[0].grants) == ["a" * 16] and clients[1].grants == {}
            assert [g["id"] for g in (await clients[0].view())["grants"]] == ["a" * 16]
        finally:
            for client in clients:
                await client.close()
            await server.stop()

    asyncio.run(go())


@pytest.mark.slow  # real users' agents through several turns: CI runs it with -m slow (docs/install.md: the default suite stays within ten minutes)
def test_a_user_who_lets_a_turn_pass_cannot_hold_others_back_by_telling_demand_again(users, ledger, agents):
    """Hostile demand: bob tells demand, never asks when told his turn, and tells it again each
    time it is set aside. Once a turn is let pass, bob's demand holds nobody back until he asks."""
    alice, bob = agents("alice"), agents("bob")
    held = [alice.ok("request", key=f"a{i}", vram_mb=12000) for i in range(2)]  # the whole GPU
    assert bob.ok("demand", asks=[{"vram_mb": 12000}]) == 1
    alice.ok("release", grant=held[0]["id"])
    assert alice.ok("request", key="a-next", vram_mb=12000, wait=False)["state"] == "busy"
    wait_until(lambda: "retry" in alice.ok("events"), timeout=TURN_S + 10, message="alice was never told to retry")
    assert bob.ok("demand", asks=[{"vram_mb": 12000}]) == 1  # told anew, still never asking
    assert alice.ok("request", key="a-next", vram_mb=12000, wait=False)["state"] == "granted"
    # Once bob is granted the room he let pass, his demand counts again.
    alice.ok("release", grant=held[1]["id"])
    b0 = bob.ok("request", key="b0", vram_mb=12000, wait=False)
    bob.ok("release", grant=b0["grant"]["id"])
    assert bob.ok("demand", asks=[{"vram_mb": 11000}]) == 1
    refused = alice.ok("request", key="a-third", vram_mb=11000, wait=False)
    assert refused["state"] == "busy" and refused["reason"].startswith(f"fair share: user {BOB}"), refused


def test_a_grants_processes_using_more_than_granted_count_the_rest_as_unmanaged(users, agents, ledger):
    """A grant of 1000 MB is no cover: what its processes use beyond it is counted, under the
    user's name, so the other users are not granted VRAM that is in use."""
    alice, bob = agents("alice"), agents("bob")
    alices_run = alice.ok("spawn")
    grant = alice.ok("request", key="small", vram_mb=1000)
    alice.ok("retie", grant=grant["id"], pids=[alices_run])
    ledger.plant([{"pid": alices_run, "gpu": 0, "used_mb": 20000}])
    view = wait_for_view(ledger, lambda v: v["devices"][0]["unmanaged_mb"])
    dev = view["devices"][0]
    assert dev["unmanaged_mb"] == 19000 and dev["free_mb"] == 24000 - 1000 - 19000
    assert dev["unmanaged_processes"] == [{"pid": alices_run, "gpu": 0, "used_mb": 19000, "user": ALICE}]
    assert bob.ok("view")["devices"][0]["unmanaged_processes"][0]["user"] == ALICE
    tag = bob.send("request", key="b1", vram_mb=14000)
    view = wait_for_view(ledger, lambda v: v["waiting"])
    assert "processes outside the ledger hold 19000 MB on GPU 0" in view["waiting"][0]["reason"]
    assert not bob.done(tag)
    ledger.plant([{"pid": alices_run, "gpu": 0, "used_mb": 900}])  # back within its grant
    assert bob.result(tag)["result"]["devices"] == [0]
    alice.ok("kill", pid=alices_run)


@pytest.mark.parametrize("ledger_config", [{"virtual_gpus": [24000], "reclaim_window_s": 60}])
def test_a_restarted_ledger_with_its_state_learns_no_grant_it_never_made(users, ledger, agents):
    """Restarted with its state file, the ledger knows every grant it made: during the reclaim
    window, a grant re-told that it never made (bob's, fabricated to jump the queue while the
    others wait) is refused, and the known ones are kept."""
    alice, bob = agents("alice"), agents("bob")
    a_run, b_run = alice.ok("spawn"), bob.ok("spawn")
    a = alice.ok("request", key="a-run", vram_mb=14000)
    alice.ok("retie", grant=a["id"], pids=[a_run])
    ledger.kill9()
    ledger.start()
    assert bob.ok("connect")["reclaiming"] is True  # alice has not re-told hers yet
    made_up = {"id": "f" * 16, "key": "b-made-up", "devices": [0], "vram_mb": 10000, "pids": [b_run]}
    answer = bob.ok("raw", message={"op": "reclaim", "grants": [made_up]})
    assert answer["kept"] == [] and answer["refused"][0]["error"] == "unknown_grant", answer
    assert grant_ids(ledger.view()) == {a["id"]}
    assert [g["id"] for g in alice.ok("connect")["grants"]] == [a["id"]]
    view = wait_for_view(ledger, lambda v: not v["reclaiming"])
    assert grant_ids(view) == {a["id"]}
    for agent, run in ((alice, a_run), (bob, b_run)):
        agent.ok("kill", pid=run)


def test_a_malformed_reclaim_is_a_precise_error_and_the_connection_goes_on(users, ledger, agents):
    alice, bob = agents("alice"), agents("bob")
    held = bob.ok("request", key="b1", vram_mb=1000)
    for pids in (5, True, 2.5, {"pid": 1}):
        item = {"id": "a" * 16, "key": "x", "devices": [0], "vram_mb": 1, "pids": pids}
        answer = alice.ok("raw", message={"op": "reclaim", "grants": [item]})
        assert answer["kept"] == [] and answer["refused"][0]["id"] == "a" * 16, answer
    assert alice.ok("view")["user"] == ALICE  # the same connection answers on
    assert grant_ids(ledger.view()) == {held["id"]}


def test_the_processes_below_a_server_share_all_the_grants_tied_to_it(users, agents, ledger):
    """Leases stay tied to the user's server: its kernels' VRAM is within the sum of those grants,
    not over the one grant that happens to be looked up first."""
    alice, bob = agents("alice"), agents("bob")
    for i in range(2):
        alice.ok("request", key=f"lease{i}", kind="lease", vram_mb=6000)  # tied to alice's server
    kernel, bobs_notebook = alice.ok("spawn"), bob.ok("spawn")  # the kernel: below alice's server
    ledger.plant([{"pid": kernel, "gpu": 0, "used_mb": 11000}, {"pid": bobs_notebook, "gpu": 0, "used_mb": 1}])
    dev = wait_for_view(ledger, lambda v: v["devices"][0]["unmanaged_mb"])["devices"][0]
    assert dev["unmanaged_processes"] == [{"pid": bobs_notebook, "gpu": 0, "used_mb": 1, "user": BOB}]
    ledger.plant([{"pid": kernel, "gpu": 0, "used_mb": 13000}])  # over both grants: 1000 MB
    dev = wait_for_view(ledger, lambda v: v["devices"][0]["unmanaged_mb"] == 1000)["devices"][0]
    assert dev["unmanaged_processes"] == [{"pid": kernel, "gpu": 0, "used_mb": 1000, "user": ALICE}]
    alice.ok("kill", pid=kernel)
    bob.ok("kill", pid=bobs_notebook)


@pytest.mark.slow  # real users' agents through several turns: CI runs it with -m slow (docs/install.md: the default suite stays within ten minutes)
def test_a_turn_is_not_taken_by_a_grant_smaller_than_the_room_kept(users, ledger, agents):
    """Hostile demand: bob tells 12000 MB of demand and, each time he is told his turn, takes a
    0 MB grant (holding nothing, he stays the one holding least). That is no turn taken: alice
    is granted the room once bob's turn has passed."""
    alice, bob = agents("alice"), agents("bob")
    held = [alice.ok("request", key=f"a{i}", vram_mb=12000) for i in range(2)]  # the whole GPU
    assert bob.ok("demand", asks=[{"vram_mb": 12000}]) == 1
    alice.ok("release", grant=held[0]["id"])
    turns, tiny = 0, 0
    deadline = time.monotonic() + 3 * TURN_S + 20
    while True:
        answer = alice.ok("request", key="a-next", vram_mb=12000, wait=False)
        if answer["state"] == "granted":
            break
        assert time.monotonic() < deadline, f"alice was held back for ever: {answer}"
        told = bob.ok("events").count("turn")
        if told > turns:
            turns, tiny = told, tiny + 1
            assert bob.ok("request", key=f"tiny{tiny}", vram_mb=0, wait=False)["state"] == "granted"
            bob.ok("demand", asks=[{"vram_mb": 12000}])
        time.sleep(0.2)
    assert tiny >= 1


@pytest.mark.slow  # real users' agents through several turns: CI runs it with -m slow (docs/install.md: the default suite stays within ten minutes)
def test_a_forfeited_turn_is_not_won_back_by_a_tiny_grant(users, ledger, agents):
    """Bob lets his turn pass, then takes a 0 MB grant and tells his demand again before alice
    asks: only a grant of the room he let pass counts his demand again."""
    alice, bob = agents("alice"), agents("bob")
    held = [alice.ok("request", key=f"a{i}", vram_mb=12000) for i in range(2)]  # the whole GPU
    assert bob.ok("demand", asks=[{"vram_mb": 12000}]) == 1
    alice.ok("release", grant=held[0]["id"])
    assert alice.ok("request", key="a-next", vram_mb=12000, wait=False)["state"] == "busy"
    wait_until(lambda: "retry" in alice.ok("events"), timeout=TURN_S + 10, message="alice was never told to retry")
    assert bob.ok("request", key="tiny", vram_mb=0, wait=False)["state"] == "granted"
    assert bob.ok("demand", asks=[{"vram_mb": 12000}]) == 1
    assert alice.ok("request", key="a-next", vram_mb=12000, wait=False)["state"] == "granted"


@pytest.mark.slow  # waits out the send deadline
def test_a_client_that_takes_no_answers_is_dropped(users, ledger, agents):
    """Requests sent without ever reading the answers: the ledger stops reading them, drops the
    connection once its answers sit unread past the send deadline (its handler would otherwise
    wait for ever, holding one of the user's connections), and answers everyone else meanwhile."""
    alice = agents("alice")
    greedy = _raw(ledger.socket)
    greedy.setblocking(False)
    # Whole frames only, one send each (a small send on a Unix stream is all or nothing): a half
    # frame would be dropped by the frame deadline instead, whatever this test is about. Sent
    # until the ledger has read nothing for 3 s: its answers fill the socket, and it stops.
    frames = [encode({"op": "hello", "id": 0}), *(encode({"op": "view", "id": i}) for i in range(1, 50000))]
    sent, progress = 0, time.monotonic()
    while sent < len(frames) and time.monotonic() - progress < 3.0:
        try:
            assert greedy.send(frames[sent]) == len(frames[sent])
        except BlockingIOError:
            time.sleep(0.05)
            continue
        sent, progress = sent + 1, time.monotonic()
    assert sent < len(frames), "the ledger read every request although no answer was taken"
    assert "result" in alice.call("view", timeout=5.0)
    time.sleep(SEND_DEADLINE_S + 10.0)  # nothing read from this side meanwhile
    # Now read what reached this side: a dropped connection ends (end of stream or reset); one
    # still open would go on being answered, then fall silent.
    greedy.setblocking(True)
    greedy.settimeout(10.0)
    try:
        while greedy.recv(1 << 20):
            pass
        gone = True
    except ConnectionResetError:
        gone = True
    except TimeoutError:
        gone = False
    assert gone, "the connection that took no answers is still open"
    assert ledger.proc.poll() is None and "result" in alice.call("view", timeout=5.0)


@pytest.mark.parametrize(
    ("where", "mode", "owner", "said"),
    [
        ("socket", 0o777, None, "may be written by every user (mode 0777)"),
        ("socket", 0o1777, None, "may be written by every user (mode 1777)"),  # sticky: a new name is still anyone's
        ("state file", 0o775, None, "may be written by its group (mode 0775)"),
        ("socket", 0o755, 65534, "belongs to uid 65534, neither the ledger's user"),
    ],
)
def test_the_ledger_refuses_a_directory_another_user_may_write_in(tmp_path, where, mode, owner, said):
    """In one process, as root: a socket or state file where another user could put their own
    (a socket answering as the ledger, a state granting what they want at the next start) is
    refused at the start, saying which directory and why; nothing is made there."""
    # (This project's machines and CI run as root: a skip here would prove nothing.)
    assert os.geteuid() == 0, "this test gives a directory to another user: run the suite as root"
    from jupyter_evalsched.host_ledger.config import parse_config
    from jupyter_evalsched.host_ledger.server import HostLedger

    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, mode)
    if owner is not None:
        os.chown(shared, owner, owner)
    config = {"virtual_gpus": [24000]}
    if where == "socket":
        socket_path = shared / "ledger.sock"
        config["state_file"] = str(tmp_path / "state.json")
    else:
        socket_path = tmp_path / "ledger.sock"
        config["state_file"] = str(shared / "state.json")
    server = HostLedger(parse_config(config), str(socket_path))
    with pytest.raises(RuntimeError) as caught:
        asyncio.run(server.start())
    assert f"the {where}" in str(caught.value) and str(shared) in str(caught.value) and said in str(caught.value)
    assert list(shared.iterdir()) == [] and not socket_path.exists()


def test_the_ledger_never_replaces_what_is_not_its_socket_nor_writes_through_a_planted_link(tmp_path):
    """In one process, as root: a file (not a socket) where the socket goes is left alone and the
    start refused; the state is written to a file of its own each time, so a link planted at an
    old temporary name leads nowhere."""
    from jupyter_evalsched.host_ledger.config import parse_config
    from jupyter_evalsched.host_ledger.server import HostLedger

    socket_path = tmp_path / "ledger.sock"
    socket_path.write_text("someone's file")
    server = HostLedger(parse_config({"virtual_gpus": [24000]}), str(socket_path))
    with pytest.raises(RuntimeError, match="exists and is not a socket"):
        asyncio.run(server.start())
    assert socket_path.read_text() == "someone's file"

    socket_path.unlink()
    victim = tmp_path / "victim"
    victim.write_text("untouched")
    (tmp_path / "ledger.sock.state.json.tmp").symlink_to(victim)  # where the state used to be staged

    async def go() -> None:
        server = HostLedger(parse_config({"virtual_gpus": [24000]}), str(socket_path))
        await server.start()
        try:
            server._save_state()
        finally:
            await server.stop()

    asyncio.run(go())
    assert victim.read_text() == "untouched"
    assert json.loads((tmp_path / "ledger.sock.state.json").read_text()) == {"tenants": [], "grants": []}
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "ledger.sock.state.json",
        "ledger.sock.state.json.tmp",
        "victim",
    ]


def test_the_ledger_checks_every_directory_down_to_its_socket_as_the_kernel_resolves_it(tmp_path):
    """In one process, as root: a private directory inside one that every user may write in (not
    sticky: anyone may rename it away and put their own in its place), and a path that reaches a
    shared directory through a link and ``..``, are refused as well; a staged state a killed
    ledger left is removed at the next start."""
    from jupyter_evalsched.host_ledger.config import parse_config
    from jupyter_evalsched.host_ledger.server import HostLedger

    def start(socket_path: str) -> str:
        server = HostLedger(parse_config({"virtual_gpus": [24000]}), socket_path)
        with pytest.raises(RuntimeError) as caught:
            asyncio.run(server.start())
        return str(caught.value)

    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    private = shared / "ledger"
    private.mkdir()
    os.chmod(private, 0o755)
    said = start(str(private / "ledger.sock"))
    assert f"{shared} may be written by every user (mode 0777)" in said, said
    assert list(private.iterdir()) == []

    safe = tmp_path / "safe"
    safe.mkdir()
    os.chmod(safe, 0o755)
    (shared / "sub").mkdir()
    (safe / "l").symlink_to(shared / "sub")
    said = start(f"{safe}/l/../ledger.sock")  # the kernel's way: shared/sub, then shared
    assert f"{shared} may be written by every user" in said, said
    assert sorted(p.name for p in shared.iterdir()) == ["ledger", "sub"]

    left = safe / "ledger.sock.state.json.4242.0123abcd.tmp"  # (a ledger killed while it saved)
    left.write_text("{")

    async def go() -> None:
        server = HostLedger(parse_config({"virtual_gpus": [24000]}), str(safe / "ledger.sock"))
        await server.start()
        await server.stop()

    asyncio.run(go())
    assert not left.exists()
