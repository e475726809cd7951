"""Issue #32, the host ledger: real system users (useradd), a host ledger served by an
unprivileged third user on virtual GPUs, tenants started as the two others, raw sockets for the
hostile ones. Only the GPUs are virtual."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import random
import resource
import signal
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
from host_ledger_users import (
    PREFIX,
    REPO,
    Agent,
    Ledger,
    as_user,
    assert_never_over,
    grant_ids,
    wait_for_view,
)
from proc_status import alive
from waiting import async_wait_until, wait_until

from jupyter_evalsched.host_ledger.client import HostLedgerError, status
from jupyter_evalsched.host_ledger.protocol import FRAME_DEADLINE_S, ProtocolError, encode, recv_sync, send_sync
from jupyter_evalsched.host_ledger.server import SEND_DEADLINE_S, TURN_S, connection_cap
from jupyter_evalsched.host_ledger.tenant import TenantLink

pytestmark = pytest.mark.timeout(120)
ALICE, BOB = PREFIX + "alice", PREFIX + "bob"


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


def _kill(pid: int) -> None:
    """Kill a run an agent spawned (a test that failed half way leaves none behind)."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


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


def test_the_deployment_examples_parse(tmp_path):
    from jupyter_evalsched.host_ledger.config import load_config

    examples = REPO / "jupyter-config" / "host-ledger"
    assert load_config(str(examples / "host-ledger.json")).quota_of(["alice"]).gpus == 2
    unit = (examples / "evalsched-host-ledger.service").read_text()
    for line in (
        "RuntimeDirectory=evalsched",
        "User=evalsched",
        "evalsched host-ledger --socket /run/evalsched/ledger.sock",
        "LimitNOFILE=65536",
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
        "ledger.sock.state.json.lock",  # (held while a ledger runs: one ledger per state file)
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


def test_fair_share_holds_an_ask_back_only_for_room_it_would_take_and_a_grant_serves_the_demand(users, ledger, agents):
    """Bob, holding less, tells demand: alice's asks that leave room for it are granted (a 0 MB
    demand keeps no room at all); one that would take its room gives way until bob is granted
    it, and that grant serves bob's demand: it holds alice back no more once bob lets it go."""
    alice, bob = agents("alice"), agents("bob")
    alice.ok("request", key="a0", vram_mb=4000)
    assert bob.ok("demand", asks=[{"vram_mb": 0}]) == 0  # needs no room: not kept
    assert alice.ok("request", key="a1", vram_mb=4000, wait=False)["state"] == "granted"
    assert bob.ok("demand", asks=[{"vram_mb": 8000}]) == 1
    # 16000 MB free: alice's 4000 leaves 12000, room for bob's 8000.
    assert alice.ok("request", key="a2", vram_mb=4000, wait=False)["state"] == "granted"

    # 12000 MB free and bob wants 12000: alice's 4000 would take his room.
    assert bob.ok("demand", asks=[{"vram_mb": 12000}]) == 1
    refused = alice.ok("request", key="a3", vram_mb=4000, wait=False)
    assert refused["state"] == "busy", refused
    assert refused["reason"] == f"fair share: user {BOB} holds less (0 MB) and waits for this room"
    wait_until(lambda: "turn" in bob.ok("events"), timeout=10, message="bob was never told his turn")
    b1 = bob.ok("request", key="b1", vram_mb=12000, wait=False)
    assert b1["state"] == "granted", b1
    wait_until(lambda: "retry" in alice.ok("events"), timeout=10, message="alice was never told to retry")
    assert ledger.view()["demand"] == []  # served by the grant
    # Bob lets it go, holding nothing again: the demand his grant served holds nobody back.
    bob.ok("release", grant=b1["grant"]["id"])
    assert alice.ok("request", key="a3", vram_mb=4000, wait=False)["state"] == "granted"
    assert_never_over(ledger.view())


def _open_files_soft_limit(pid: int) -> int:
    limits = Path(f"/proc/{pid}/limits").read_text()
    return int(next(line.split()[3] for line in limits.splitlines() if line.startswith("Max open files")))


def test_a_ledger_raises_its_open_files_limit_and_refuses_connections_past_its_cap(users):
    """Started with a soft limit of 40 descriptors (hard 120), the ledger raises it to 120 and
    serves at most connection_cap(120) connections: one more is refused, saying so (once in
    its log), and the grants and /proc reads go on, never short of a descriptor."""
    served = Ledger(users["ledger"], {"virtual_gpus": [24000], "reclaim_window_s": 0})
    raws: list[socket.socket] = []
    alice = None
    run = None
    try:
        served.start(open_files=(40, 120))
        assert _open_files_soft_limit(served.proc.pid) == 120
        cap = connection_cap(120)
        alice = Agent(users["alice"], served.socket)
        alice.ok("connect")  # one connection
        run = alice.ok("spawn")
        grant = alice.ok("request", key="a-run", vram_mb=10000, pids=[run])
        refusal = None
        for _ in range(cap):  # root's own: under its 64 a user, over the cap
            sock = _raw(served.socket)
            raws.append(sock)
            with contextlib.suppress(OSError):  # (a refused one may be closed already)
                send_sync(sock, {"op": "hello", "id": 1})
            answer = recv_sync(sock, 10.0)
            if not answer["ok"]:
                refusal = answer
                break
        assert refusal is not None and len(raws) == cap, (len(raws), refusal)
        assert refusal["error"] == "too_many_connections"
        assert f"at most {cap} connections at once" in refusal["reason"]
        # At the cap, the ledger goes on: sweeps, /proc, answers on the connections it has.
        assert grant_ids(alice.ok("view")) == {grant["id"]}
        for sock in raws:
            sock.close()
        view = wait_until(served.view, ignore=(HostLedgerError, OSError, ProtocolError), timeout=20)
        assert grant_ids(view) == {grant["id"]} and alive(run)
        assert Path(served.log).read_text().count("the most it may: refusing more") == 1
    finally:
        for sock in raws:
            sock.close()
        if run is not None:
            _kill(run)
        if alice is not None:
            alice.stop()
        served.stop()


def test_a_sweep_that_cannot_read_proc_ends_no_grant_and_says_so_once(tmp_path, caplog):
    """In one process, as root: out of file descriptors (EMFILE), /proc cannot be read; that is
    no process gone, so the sweep keeps the grant, and the connection accept() could not take is
    taken once descriptors are back, each trouble said once in the log (no flood)."""
    from jupyter_evalsched.host_ledger.client import HostLedgerClient
    from jupyter_evalsched.host_ledger.config import parse_config
    from jupyter_evalsched.host_ledger.protocol import read_frame
    from jupyter_evalsched.host_ledger.server import HostLedger

    caplog.set_level(logging.INFO)

    def said(words: str) -> int:
        return sum(1 for r in caplog.records if words in r.getMessage())

    async def go() -> None:
        server = HostLedger(parse_config({"virtual_gpus": [24000]}), str(tmp_path / "ledger.sock"))
        await server.start()
        run = subprocess.Popen(["sleep", "600"])
        client = HostLedgerClient(server.socket_path)
        late = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # connecting it takes no new descriptor
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        held: list[int] = []
        try:
            await client.connect()
            grant = await client.request("run", 10000, pids=[run.pid])
            resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 4, hard))
            with contextlib.suppress(OSError):
                while True:
                    held.append(os.open("/dev/null", os.O_RDONLY))
            late.connect(server.socket_path)  # (into the backlog: accept() is the ledger's)
            await async_wait_until(
                lambda: (
                    grant["id"] not in server.grants
                    or (said("cannot read /proc") and said("cannot accept connections"))
                ),
                timeout=30,
            )
        finally:
            for fd in held:
                os.close(fd)
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        try:
            assert grant["id"] in {g["id"] for g in (await client.view())["grants"]}
            reader, writer = await asyncio.open_unix_connection(sock=late)
            writer.write(encode({"op": "hello", "id": 1}))
            assert (await asyncio.wait_for(read_frame(reader), 20))["ok"] is True
            writer.close()
            assert said("cannot accept connections") == 1 and said("out of system resource") == 0
            run.kill()
            run.wait()
            await async_wait_until(lambda: not server.grants, timeout=20)  # gone now: ended
        finally:
            run.kill()
            await client.close()
            await server.stop()

    asyncio.run(go())


def test_a_second_ledger_is_refused_while_the_first_lives_even_one_too_busy_to_answer(users, ledger, agents):
    """The first ledger stopped (a loop busy for a while) with its backlog full: a second one
    started on the same socket and state cannot connect to it, and must not take it over (both
    would grant the same GPU): it is refused at once, naming the first, and the first serves on."""
    alice = agents("alice")
    grant = alice.ok("request", key="a", vram_mb=20000)
    socket_inode = os.stat(ledger.socket).st_ino
    flood: list[socket.socket] = []
    second = None
    os.kill(ledger.proc.pid, signal.SIGSTOP)
    try:
        for _ in range(10000):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.setblocking(False)
            try:
                sock.connect(ledger.socket)
            except BlockingIOError:  # the backlog is full
                sock.close()
                break
            flood.append(sock)
        second = ledger.popen()
        assert second.stdout is not None
        assert '"ready"' not in second.stdout.readline()  # (nothing: it exited)
        assert second.wait(timeout=60) == 2
    finally:
        os.kill(ledger.proc.pid, signal.SIGCONT)
        for sock in flood:
            sock.close()
        if second is not None and second.poll() is None:
            second.kill()
            second.wait()
    said = Path(ledger.log).read_text()
    assert f"another host ledger (pid {ledger.proc.pid}) holds {ledger.state_file}.lock" in said, said[-2000:]
    assert os.stat(ledger.socket).st_ino == socket_inode
    # (root's flood is served, then its connections end: the view waits for a slot of root's)
    view = wait_until(ledger.view, ignore=(HostLedgerError, OSError, ProtocolError), timeout=30)
    assert grant_ids(view) == {grant["id"]}
    refused = alice.call("request", key="b", vram_mb=8000, wait=False)
    assert refused["result"]["state"] == "busy", refused


def test_a_state_file_that_cannot_be_saved_leaves_each_change_unmade_and_no_waiter_untold(users, ledger, agents):
    """The state file cannot be written (its directory read-only here; a full disk likewise):
    a release is refused (the grant still held, nothing half done), a grant cannot be made (a
    request that does not wait is told why; one that waits is told why, and waits on), and
    once it can be written again the waiting request is granted and told."""
    alice, bob = agents("alice"), agents("bob")
    bobs_run = bob.ok("spawn")
    b = bob.ok("request", key="b", vram_mb=20000, pids=[bobs_run])
    waiting = alice.send("request", key="a", vram_mb=20000)
    wait_for_view(ledger, lambda v: v["waiting"])
    os.chmod(ledger.dir, 0o555)  # (the ledger's user may no longer make its staged state there)
    try:
        refused = bob.call("release", grant=b["id"])
        assert refused["error"] == "internal" and f"grant {b['id']} is still held" in refused["reason"], refused
        assert "cannot save its state" in refused["reason"]
        busy = alice.ok("request", key="a-small", vram_mb=1000, wait=False)
        assert busy["state"] == "busy" and "cannot save its state" in busy["reason"], busy
        view = ledger.view()
        assert grant_ids(view) == {b["id"]} and [w["key"] for w in view["waiting"]] == ["a"]
        bob.ok("kill", pid=bobs_run)  # b ends; alice's request could be granted, but not saved
        bobs_run = None
        wait_for_view(ledger, lambda v: not v["grants"] and "cannot save its state" in v["waiting"][0]["reason"])
        assert not alice.done(waiting)
    finally:
        os.chmod(ledger.dir, 0o755)
        if bobs_run is not None:
            _kill(bobs_run)
    granted = alice.result(waiting, timeout=20)["result"]
    assert grant_ids(ledger.view()) == {granted["id"]}
    with open(ledger.state_file, encoding="utf-8") as f:
        assert [g["id"] for g in json.load(f)["grants"]] == [granted["id"]]


def test_a_server_releases_again_what_the_ledger_could_not_release(users, ledger):
    """A user's server (its link, in this process, as root) releases a grant while the ledger
    cannot save its state: the grant is still held, and the link releases it once it can."""

    async def go() -> None:
        link = TenantLink(ledger.socket, tenant="test", refresh_s=0.2)
        await link.start()
        try:
            await async_wait_until(lambda: link.view is not None, timeout=20)
            grant = await link.try_grant("run-1", 5000, [0])
            assert isinstance(grant, dict)
            os.chmod(ledger.dir, 0o555)
            try:
                await link.release(grant["id"])
                assert grant_ids(await asyncio.to_thread(ledger.view)) == {grant["id"]}  # not released
                why = await link.try_grant("run-2", 1000, [0])
                assert isinstance(why, str) and "cannot save its state" in why, why
            finally:
                os.chmod(ledger.dir, 0o755)
            await async_wait_until(lambda: asyncio.to_thread(lambda: not ledger.view()["grants"]), timeout=20)
        finally:
            await link.stop()

    asyncio.run(go())


@pytest.mark.parametrize(
    ("policy", "said"),
    [
        ('{"quota": {"alice": {"vram": 1}}}', "quota.alice: unknown key 'vram'"),
        ('{"socket_group": "evhl32-no-such-group"}', "socket_group: no group 'evhl32-no-such-group'"),
        ('{"reclaim_window_s": Infinity}', "reclaim_window_s must be a number of seconds >= 0, got inf"),
        ('{"reclaim_window_s": NaN}', "reclaim_window_s must be a number of seconds >= 0, got nan"),
        ('{"reclaim_window_s": 1e300}', "reclaim_window_s must be at most 86400 seconds (a day), got 1e+300"),
        ('{"usable_vram_mb": {"\\u00b2": 1}}', "usable_vram_mb: '²' is not a GPU index"),
    ],
)
def test_a_bad_policy_file_stops_the_ledger_with_the_key_named(tmp_path, policy, said):
    config = tmp_path / "policy.json"
    config.write_text(policy)
    cli = [sys.executable, "-m", "jupyter_evalsched.cli", "host-ledger", "--socket", str(tmp_path / "s.sock")]
    proc = subprocess.run([*cli, "--config", str(config)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and said in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "s.sock").exists()


@pytest.mark.parametrize(
    "saved",
    [
        "[]",
        '"state"',
        '{"grants": 5}',
        '{"tenants": {"pid": 1}, "grants": []}',
        '{"tenants": [], "grants": [{"id": "x", "pids": 5}]}',  # an entry it cannot read: a grant it does not know
        # (negative VRAM or GPU index: no grant it made; pid 1 is no tenant's, so only the
        # refusal of the entry makes it wait)
        '{"grants": [{"id": "x", "uid": 1, "key": "k", "kind": "run", "devices": [0], "vram_mb": -20000,'
        ' "exclusive": false, "pids": [{"pid": 1, "start": 1}]}]}',
        '{"grants": [{"id": "x", "uid": 1, "key": "k", "kind": "run", "devices": [-1], "vram_mb": 1,'
        ' "exclusive": false, "pids": [{"pid": 1, "start": 1}]}]}',
    ],
)
def test_a_state_file_that_is_no_ledgers_state_is_waited_out_like_an_unreadable_one(users, saved):
    served = Ledger(users["ledger"], {"virtual_gpus": [24000], "reclaim_window_s": 60})
    try:
        with open(served.state_file, "w", encoding="utf-8") as f:
            f.write(saved)
        os.chown(served.state_file, served.pw.pw_uid, served.pw.pw_gid)
        served.start()
        assert served.view()["reclaiming"] is True  # it waits for the tenants to re-tell their grants
        assert "unreadable" in Path(served.log).read_text()
    finally:
        served.stop()


def _saved(ledger: Ledger) -> dict:
    with open(ledger.state_file, encoding="utf-8") as f:
        return json.load(f)


def test_a_retie_that_cannot_be_saved_is_made_and_the_run_keeps_its_grant_when_its_server_dies(users, ledger):
    """A run starts (its server reties its grant to it) while the state cannot be saved: the
    retie is made all the same (it grants no VRAM) and saved by a later sweep, so when the
    server dies the grant lives on with the run, never granted again to another."""
    server = Agent(users["alice"], ledger.socket)
    starter = Agent(users["alice"], ledger.socket)  # spawns the run: it outlives the server
    run = None
    try:
        server.ok("connect")
        run = starter.ok("spawn")
        grant = server.ok("request", key="run-1", vram_mb=20000)  # tied to the server
        before = _saved(ledger)
        assert [p["pid"] for p in before["grants"][0]["pids"]] == [server.proc.pid]
        os.chmod(ledger.dir, 0o555)
        try:
            retied = server.call("retie", grant=grant["id"], pids=[run])
            assert "result" in retied, retied
            assert [p["pid"] for p in retied["result"]["pids"]] == [run]
            server.kill9()  # the user's server dies; its run lives on
        finally:
            os.chmod(ledger.dir, 0o755)
        # A sweep saves what changed since (the retie, or the grant ended with its server).
        after = wait_until(lambda: (lambda s: s if s != before else None)(_saved(ledger)), timeout=20)
        assert [[p["pid"] for p in g["pids"]] for g in after["grants"]] == [[run]], after
        assert grant_ids(ledger.view()) == {grant["id"]} and alive(run)
        assert "cannot save the state file" in Path(ledger.log).read_text()
    finally:
        os.chmod(ledger.dir, 0o755)
        if run is not None:
            _kill(run)
        server.stop()
        starter.stop()


def test_a_state_file_that_cannot_be_saved_is_said_once_in_the_log_and_once_to_a_waiter(users, ledger, agents):
    """Each sweep tries to save again (and to grant the waiting request): the trouble is the same
    each time (no staged file's random name in it), so the log says it once and the waiter is
    told it once, however many sweeps fail."""
    alice, bob = agents("alice"), agents("bob")
    bobs_run = bob.ok("spawn")
    bob.ok("request", key="b", vram_mb=20000, pids=[bobs_run])
    waiting = alice.send("request", key="a", vram_mb=20000)
    wait_for_view(ledger, lambda v: v["waiting"])
    told_before = alice.ok("events").count("waiting")
    os.chmod(ledger.dir, 0o555)
    try:
        bob.ok("kill", pid=bobs_run)  # b ends: alice's request could be granted, but not saved
        bobs_run = None
        wait_for_view(ledger, lambda v: "cannot save its state" in v["waiting"][0]["reason"])
        # Several sweeps more, each seen through what the GPUs' processes are (read each sweep,
        # before the sweep tries to grant and to save again).
        for used_mb in (1, 2, 3):
            ledger.plant([{"pid": ledger.proc.pid, "gpu": 0, "used_mb": used_mb}])
            wait_for_view(ledger, lambda v, mb=used_mb: v["devices"][0]["unmanaged_mb"] == mb)
        assert not alice.done(waiting)
        said = Path(ledger.log).read_text()
        assert said.count("cannot save the state file") == 1, said[-3000:]
        assert f"cannot save the state file {ledger.state_file}: Permission denied (EACCES)" in said
        assert ".tmp" not in said
        assert alice.ok("events").count("waiting") == told_before + 1
    finally:
        os.chmod(ledger.dir, 0o755)
        if bobs_run is not None:
            _kill(bobs_run)
    alice.result(waiting, timeout=20)


def test_a_lock_file_that_cannot_be_written_stops_no_start_and_leaks_no_lock(tmp_path, monkeypatch):
    """Writing the pid into the lock file (a full disk: ENOSPC) is best effort: the ledger starts,
    and once stopped another starts on the same state (no descriptor left holding the lock)."""
    import errno

    from jupyter_evalsched.host_ledger import server as ledger_server
    from jupyter_evalsched.host_ledger.config import parse_config

    def full(*_: object) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    async def go() -> None:
        config = parse_config({"virtual_gpus": [24000]})
        path = str(tmp_path / "ledger.sock")
        with monkeypatch.context() as m:
            m.setattr(ledger_server.os, "pwrite", full)
            first = ledger_server.HostLedger(config, path)
            await first.start()
            await first.stop()
        second = ledger_server.HostLedger(config, path)
        await second.start()
        await second.stop()

    asyncio.run(go())


def test_a_proc_that_hides_other_users_processes_is_said_once_as_a_configuration_error(tmp_path, monkeypatch, caplog):
    """/proc mounted hidepid=1 answers EACCES for a live process of another user: that is no
    passing trouble but the ledger's configuration; it is said once, naming hidepid, and the
    grant is kept (its processes cannot be told gone)."""
    import builtins
    import errno

    from jupyter_evalsched.host_ledger import procs
    from jupyter_evalsched.host_ledger.client import HostLedgerClient
    from jupyter_evalsched.host_ledger.config import parse_config
    from jupyter_evalsched.host_ledger.server import HostLedger

    caplog.set_level(logging.INFO)
    monkeypatch.setattr(procs, "_denied_said", False)

    async def go() -> None:
        server = HostLedger(parse_config({"virtual_gpus": [24000]}), str(tmp_path / "ledger.sock"))
        await server.start()
        run = subprocess.Popen(["sleep", "600"])
        client = HostLedgerClient(server.socket_path)
        try:
            await client.connect()
            grant = await client.request("run", 10000, pids=[run.pid])
            hidden = f"/proc/{run.pid}/"
            real_open = builtins.open

            def hiding(file, *args, **kwargs):
                if isinstance(file, str) and file.startswith(hidden):
                    raise PermissionError(errno.EACCES, "Permission denied", file)
                return real_open(file, *args, **kwargs)

            monkeypatch.setattr(procs, "open", hiding, raising=False)
            for _ in range(3):
                await server._sweep()
            said = [r.getMessage() for r in caplog.records if "hidepid" in r.getMessage()]
            assert len(said) == 1 and f"/proc/{run.pid}/stat" in said[0], said
            assert grant["id"] in server.grants
        finally:
            monkeypatch.delattr(procs, "open", raising=False)
            run.kill()
            run.wait()
            await client.close()
            await server.stop()

    asyncio.run(go())


def test_a_ledger_whose_accept_loop_ends_says_so_and_is_stopped(tmp_path, caplog):
    """The accept loop ends only when the ledger stops; should it ever end by an error, that is
    logged and the ledger is marked to stop (serve() stops it), never left accepting nobody."""
    from jupyter_evalsched.host_ledger.config import parse_config
    from jupyter_evalsched.host_ledger.server import HostLedger

    async def go() -> None:
        server = HostLedger(parse_config({"virtual_gpus": [24000]}), str(tmp_path / "ledger.sock"))
        await server.start()
        try:
            server.max_connections = None  # type: ignore[assignment]  # (the next accept fails)
            sock = _raw(server.socket_path)
            await asyncio.wait_for(server.ended.wait(), 20)
            sock.close()
            assert isinstance(server.failed, TypeError)
            assert any("the accept loop ended" in r.getMessage() for r in caplog.records)
        finally:
            await server.stop()

    asyncio.run(go())


def test_the_state_is_on_disk_before_its_rename_and_a_failed_fsync_is_a_failed_save(tmp_path, monkeypatch):
    """In one process, as root: each save fsyncs the staged file before renaming it over the
    state file and the directory after (else a power loss may leave an empty state file: every
    grant forgotten). An fsync that fails is a save that failed: the change is not made, and the
    state file holds what is held."""
    import errno
    import stat

    from jupyter_evalsched.host_ledger.client import HostLedgerClient
    from jupyter_evalsched.host_ledger.config import parse_config
    from jupyter_evalsched.host_ledger.server import HostLedger

    real_fsync, real_replace = os.fsync, os.replace
    calls: list[str] = []

    def fsync(fd: int) -> None:
        calls.append("fsync directory" if stat.S_ISDIR(os.fstat(fd).st_mode) else "fsync file")
        real_fsync(fd)

    def replace(src, dst, *args, **kwargs):
        calls.append(f"replace {os.path.basename(dst)}")
        return real_replace(src, dst, *args, **kwargs)

    def eio(fd: int) -> None:
        raise OSError(errno.EIO, "Input/output error")

    def eio_for_directories(fd: int) -> None:
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            eio(fd)
        real_fsync(fd)

    def saved() -> list[str]:
        with open(server.state_file, encoding="utf-8") as f:
            return [g["id"] for g in json.load(f)["grants"]]

    server = HostLedger(parse_config({"virtual_gpus": [24000]}), str(tmp_path / "ledger.sock"))

    async def go() -> None:
        await server.start()
        client = HostLedgerClient(server.socket_path)
        try:
            await client.connect()
            monkeypatch.setattr(os, "fsync", fsync)
            monkeypatch.setattr(os, "replace", replace)
            grant = await client.request("run-1", 10000)
            assert calls[:3] == ["fsync file", "replace ledger.sock.state.json", "fsync directory"], calls
            assert saved() == [grant["id"]]  # (whole: a JSON file naming the grant)

            monkeypatch.setattr(os, "fsync", eio)  # the disk fails the staged file's data
            with pytest.raises(HostLedgerError) as refused:
                await client.release(grant["id"])
            assert refused.value.code == "internal", refused.value.reason
            assert "cannot save its state (Input/output error (EIO))" in refused.value.reason
            assert f"grant {grant['id']} is still held" in refused.value.reason
            busy = await client.request("run-2", 1000, wait=False)
            assert busy["state"] == "busy" and "cannot save its state (Input/output error (EIO))" in busy["reason"]
            assert list(server.grants) == [grant["id"]] and saved() == [grant["id"]]
            assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]  # (no staged file left)

            # The rename made, but not on disk: not made either, and a sweep writes again what is held.
            monkeypatch.setattr(os, "fsync", eio_for_directories)
            with pytest.raises(HostLedgerError) as refused:
                await client.release(grant["id"])
            assert refused.value.code == "internal" and list(server.grants) == [grant["id"]]
            monkeypatch.setattr(os, "fsync", real_fsync)
            await async_wait_until(lambda: saved() == [grant["id"]], timeout=10)
            await client.release(grant["id"])
            assert server.grants == {} and saved() == []
        finally:
            monkeypatch.setattr(os, "fsync", real_fsync)
            await client.close()
            await server.stop()

    asyncio.run(go())


@pytest.mark.parametrize("ledger_config", [{"virtual_gpus": [24000, 24000], "reclaim_window_s": 0}])
def test_a_request_under_a_held_key_gets_that_grant_only_when_it_asks_the_same(users, ledger, agents):
    """A key names one grant of its user: asked again the same (an answer lost, a restarted
    server learning its grant), the same grant; asked for anything else (more VRAM, other GPUs,
    another kind), a precise refusal naming the difference and the grant held, never that grant
    answered as if it were what was asked."""
    alice, bob = agents("alice"), agents("bob")
    held = alice.ok("request", key="k", vram_mb=1000, devices=[0])
    assert alice.ok("request", key="k", vram_mb=1000, devices=[0]) == held
    assert alice.ok("request", key="k", vram_mb=1000) == held  # (no GPU named: the one it holds will do)
    for other, said in (
        ({"vram_mb": 4000, "devices": [0]}, "4000 MB per GPU, not 1000 MB"),
        ({"vram_mb": 1000, "devices": [1]}, "GPU 1, not GPU 0"),
        ({"vram_mb": 1000, "kind": "lease"}, "kind lease, not run"),
        ({"vram_mb": 1000, "exclusive": True}, "whole GPUs, not shares"),
        ({"vram_mb": 1000, "gpus": 2}, "2 GPUs, not 1"),
    ):
        refused = alice.call("request", key="k", **other)
        assert refused.get("error") == "key_in_use", refused
        assert refused["reason"] == (
            f"user {ALICE} holds grant {held['id']} under key 'k', and this request asks for another: {said}; "
            "release it first, or ask under another key"
        )
    raw = alice.ok("raw", message={"op": "request", "key": "k", "vram_mb": 4000, "wait": False})
    assert raw["ok"] is False and raw["error"] == "key_in_use" and raw["grant"] == held, raw
    view = ledger.view()
    assert grant_ids(view) == {held["id"]} and view["waiting"] == []
    assert [d["allocated_mb"] for d in view["devices"]] == [1000, 0]
    # Keys are each user's own: bob's "k" is another grant.
    assert bob.ok("request", key="k", vram_mb=4000)["id"] != held["id"]
    alice.ok("release", grant=held["id"])
    assert alice.ok("request", key="k", vram_mb=4000)["vram_mb"] == 4000  # (released: the key is free)


def test_a_view_is_bounded_however_many_grants_the_host_holds(tmp_path):
    """In one process, as root (an admin): every user's grants, each with a long key and many
    processes, are more than a client reads in one answer (MAX_ANSWER_BYTES), which closed the
    connection; a view lists at most MAX_VIEW_ENTRIES of them (or the ``limit`` asked) and says
    how many it left out, with each GPU's sums whole."""
    from jupyter_evalsched.cli import format_host_ledger
    from jupyter_evalsched.host_ledger.client import HostLedgerClient
    from jupyter_evalsched.host_ledger.config import parse_config
    from jupyter_evalsched.host_ledger.procs import ProcId
    from jupyter_evalsched.host_ledger.protocol import MAX_ANSWER_BYTES
    from jupyter_evalsched.host_ledger.server import MAX_GRANTS_PER_UID, MAX_PIDS, MAX_VIEW_ENTRIES, Grant, HostLedger

    async def go() -> None:
        server = HostLedger(parse_config({"virtual_gpus": [24000]}), str(tmp_path / "ledger.sock"))
        await server.start()
        client = HostLedgerClient(server.socket_path)
        try:
            await client.connect()
            mine = [(await client.request(f"run-{i}", 10))["id"] for i in range(30)]
            view = await client.view()
            assert [g["id"] for g in view["grants"]] == mine and view["devices"][0]["grants"] == mine
            assert view["omitted"] == {"grants": 0, "waiting": 0, "demand": 0}
            short = await client.view(limit=10)
            assert [g["id"] for g in short["grants"]] == mine[:10] and short["devices"][0]["grants"] == mine[:10]
            assert short["omitted"] == {"grants": 20, "waiting": 0, "demand": 0}
            assert format_host_ledger(short).endswith("\n(20 more grants not listed)")  # --status says so
            assert short["devices"][0]["allocated_mb"] == 300 and short["devices"][0]["free_mb"] == 24000 - 300

            # Other users' grants as many as the ledger lets each hold, as large as it lets each be
            # (the sweep stopped: their processes are made up).
            assert server._sweeper is not None
            server._sweeper.cancel()
            procs = [ProcId(4_000_000 + n, 123_456_789_012) for n in range(MAX_PIDS)]
            for uid in range(1000, 1012):
                for n in range(MAX_GRANTS_PER_UID):
                    gid = f"{uid:05d}{n:011d}"
                    key = f"{n:04d}" + "k" * 196
                    server.grants[gid] = Grant(gid, uid, f"user{uid}", key, "run", (0,), 1, False, procs)
            assert len(json.dumps([g.as_json() for g in server.grants.values()])) > MAX_ANSWER_BYTES
            total = len(server.grants)
            whole = await asyncio.to_thread(status, server.socket_path)
            assert whole["admin"] is True and len(whole["grants"]) == MAX_VIEW_ENTRIES
            assert whole["omitted"]["grants"] == total - MAX_VIEW_ENTRIES
            assert [g["id"] for g in whole["grants"]][:30] == mine
            assert len(whole["devices"][0]["grants"]) == MAX_VIEW_ENTRIES
            assert whole["devices"][0]["allocated_mb"] == 300 + 12 * MAX_GRANTS_PER_UID
            assert (await client.view(limit=10 * MAX_VIEW_ENTRIES))["omitted"]["grants"] == total - MAX_VIEW_ENTRIES
            with pytest.raises(HostLedgerError) as bad:
                await client.view(limit=-1)
            assert bad.value.code == "bad_request" and "limit" in bad.value.reason
        finally:
            await client.close()
            await server.stop()

    asyncio.run(go())
