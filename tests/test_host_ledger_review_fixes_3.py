"""The host ledger, after a third review: the turns rotate for waiting requests too (a user who
queues the next ask and gives the room back holds another's waiting ask back no more), and a
tenant holding more grants than one frame holds re-tells them in batches of one reclaim (real
system users, a real ledger served by its own unprivileged user on virtual GPUs, tenants started
as the others; in-process ledgers, as root, on a real socket). Only the GPUs are virtual."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import tempfile

import pytest
from host_ledger_users import PREFIX, Agent, wait_for_view
from waiting import wait_until

from jupyter_evalsched.host_ledger import client as ledger_client
from jupyter_evalsched.host_ledger.client import HostLedgerClient
from jupyter_evalsched.host_ledger.config import parse_config
from jupyter_evalsched.host_ledger.policy import Ask, Holding, HostDevice, next_grant
from jupyter_evalsched.host_ledger.protocol import MAX_FRAME_BYTES, encode, recv_sync, send_sync
from jupyter_evalsched.host_ledger.server import MAX_GRANTS_PER_UID, MAX_KEY_CHARS, MAX_PIDS, HostLedger

pytestmark = pytest.mark.timeout(180)
ALICE, BOB = PREFIX + "alice", PREFIX + "bob"
GPU0 = {0: HostDevice(0, 24000)}


# ---------------------------------------------------------------------- 1: waiting asks rotate too


def _first_done(*tagged: tuple[str, Agent, int]) -> str:
    """The name of the first of these waiting requests to be answered (exactly one is)."""
    done = wait_until(lambda: [name for name, agent, tag in tagged if agent.done(tag)], timeout=10)
    assert len(done) == 1, done
    return done[0]


def test_a_user_who_queues_the_next_ask_and_gives_the_room_back_cannot_hold_a_waiting_ask_back(users, ledger, agents):
    """Turn cycling with waiting requests: alice holds 8000 MB and waits for 16000; bob holds
    16000, queues his next 16000 and then releases what he holds. Judged by what each holds when
    the room is freed, bob (0 MB then) wins every time and alice's ask never gets a grant while
    bob holds the room all along. The turns rotate: once bob has been granted over alice's ask
    since alice was last granted, alice's ask goes first."""
    alice, bob = agents("alice"), agents("bob")
    alice.ok("request", key="a0", vram_mb=8000)
    held = bob.ok("request", key="b0", vram_mb=16000)  # the GPU is full
    big = alice.send("request", key="a-big", vram_mb=16000)
    wait_for_view(ledger, lambda v: len(v["waiting"]) == 1)
    b1 = bob.send("request", key="b1", vram_mb=16000)
    wait_for_view(ledger, lambda v: len(v["waiting"]) == 2)
    bob.ok("release", grant=held["id"])
    # Holding 0 MB against alice's 8000, bob's ask goes first: his turn.
    assert _first_done(("alice", alice, big), ("bob", bob, b1)) == "bob"
    held = bob.result(b1)["result"]
    b2 = bob.send("request", key="b2", vram_mb=16000)
    wait_for_view(ledger, lambda v: len(v["waiting"]) == 2)
    bob.ok("release", grant=held["id"])
    # Bob, holding 0 MB again, has had his turn since alice was last granted: her ask goes first.
    assert _first_done(("alice", alice, big), ("bob", bob, b2)) == "alice"
    granted = alice.result(big)["result"]
    assert granted["vram_mb"] == 16000 and not bob.done(b2)
    # The rotation goes on: the room alice gives back is bob's.
    alice.ok("release", grant=granted["id"])
    assert bob.result(b2)["result"]["vram_mb"] == 16000


def test_a_user_who_took_a_turn_since_another_was_last_granted_goes_behind_that_users_waiting_ask():
    """The rotation for waiting asks, pure: ``turns`` and ``granted`` on one count of the grants
    made (as the ledger keeps them); a grant that takes the room of another user's ask that fit
    is a turn."""
    alice = [Holding("alice", (0,), 8000)]
    waiting = [Ask("alice", 16000), Ask("bob", 16000)]
    # Holdings alone: bob (0 MB) first, taking the room of alice's ask (it fit): a turn.
    pick = next_grant(waiting, GPU0, alice, {})
    assert pick is not None and (pick.position, pick.turn) == (1, True)
    # Bob took a turn (3) since alice was last granted (1): he goes behind her ask.
    pick = next_grant(waiting, GPU0, alice, {}, turns={"bob": 3}, granted={"alice": 1, "bob": 3})
    assert pick is not None and (pick.position, pick.turn) == (0, True)
    # Alice granted since (4): holdings decide again.
    pick = next_grant(waiting, GPU0, alice, {}, turns={"bob": 3, "alice": 4}, granted={"alice": 4, "bob": 3})
    assert pick is not None and pick.position == 1
    # Behind only an ask that fits now: room nobody else can use now is not kept idle.
    only_bob = [Ask("alice", 20000), Ask("bob", 16000)]
    pick = next_grant(only_bob, GPU0, alice, {}, turns={"bob": 3}, granted={"alice": 1})
    assert pick is not None and (pick.position, pick.turn) == (1, False)
    # Room for both: the first granted takes nobody's room, no turn.
    pick = next_grant([Ask("alice", 4000), Ask("bob", 4000)], GPU0, alice, {})
    assert pick is not None and (pick.position, pick.turn) == (1, False)
    # Of several users taking turns, each goes behind the users granted before its turn.
    three = [Holding("carol", (0,), 8000)]
    asks = [Ask("alice", 16000), Ask("bob", 16000), Ask("carol", 16000)]
    turns, granted = {"bob": 5, "alice": 4}, {"alice": 4, "bob": 5, "carol": 2}
    pick = next_grant(asks, GPU0, three, {}, turns=turns, granted=granted)
    assert pick is not None and pick.position == 2  # carol: granted before both turns


# ---------------------------------------------------------------------- 2: 1,024 grants re-told


@pytest.mark.parametrize("ledger_config", [{"virtual_gpus": [24000, 24000], "reclaim_window_s": 60}])
def test_a_tenant_holding_1024_grants_re_tells_them_all_after_a_restart(users, ledger, agents):
    """Alice's server holds as many grants as a user may (1,024, each as a server's run key
    names it): one reclaim of them all is far over the 64 KiB a frame may be, and every
    connect() failed (HostLedgerUnavailable), for ever. Re-told in batches of one reclaim, all
    are kept, and the ledger grants nothing new until the last batch is in."""
    alice, bob = agents("alice"), agents("bob")
    keys = [f"run-{i:04d}-0123456789abcdef0123456789abcdef" for i in range(MAX_GRANTS_PER_UID)]
    tags = [alice.send("request", key=key, vram_mb=0, devices=[i % 2]) for i, key in enumerate(keys)]
    held = sorted(alice.result(tag, timeout=120)["result"]["id"] for tag in tags)
    assert len(set(held)) == MAX_GRANTS_PER_UID
    listed = ledger.view()["grants"]  # (a view lists 1,000: already more than a frame holds)
    assert len(encode({"op": "reclaim", "id": 2, "grants": listed}, 1 << 24)) > MAX_FRAME_BYTES
    ledger.kill9()
    ledger.start()
    assert bob.ok("connect")["reclaiming"] is True  # alice has not re-told hers yet
    waiting = bob.send("request", key="b", vram_mb=24000)
    wait_for_view(ledger, lambda v: len(v["waiting"]) == 1)
    hello = alice.call("connect", timeout=60)
    assert "result" in hello, hello
    assert alice.ok("grants") == held
    # Bob's ask waited for the whole reclaim, and was then granted beside alice's 0 MB shares.
    assert bob.result(waiting)["result"]["vram_mb"] == 24000
    view = ledger.view()
    assert not view["reclaiming"] and len(view["grants"]) + view["omitted"]["grants"] == MAX_GRANTS_PER_UID + 1


def test_reclaim_batches_fit_a_frame_for_1024_grants_of_the_largest_fields():
    """The grants re-told, in batches that each fit in a frame with the reclaim around them,
    every grant once and in order, for 1,024 grants of the longest key (non-ASCII: escaped), id and
    most processes the ledger takes; one frame when they fit in one."""
    grants = [
        {
            "id": f"{i:064x}",
            "user": ALICE,
            "key": "é" * MAX_KEY_CHARS,
            "kind": "model",
            "devices": list(range(64)),
            "vram_mb": 2**31,
            "exclusive": False,
            "gpus": 64,
            "pids": [4194304 + j for j in range(MAX_PIDS)],
        }
        for i in range(MAX_GRANTS_PER_UID)
    ]
    batches = ledger_client.reclaim_batches(grants)
    assert [g for batch in batches for g in batch] == grants
    for n, batch in enumerate(batches):
        frame = {"op": "reclaim", "id": 2**53, "grants": batch}
        if n < len(batches) - 1:
            frame["more"] = True
        assert len(encode(frame)) <= MAX_FRAME_BYTES
    assert len(ledger_client.reclaim_batches(grants[:10])) == 1
    assert ledger_client.reclaim_batches([]) == []


def _restarted_with_a_tenant(config: dict, grants: int) -> tuple[HostLedger, str, list[dict], str]:
    """An in-process ledger that granted this process (root, its tenant) ``grants`` 0 MB shares
    and was stopped: restarted on its state file, it waits for this process to re-tell them. The
    new ledger (not started), its socket, the grants and the directory to remove."""
    directory = tempfile.mkdtemp(prefix="evhl-", dir="/tmp")
    path = os.path.join(directory, "ledger.sock")

    async def first() -> list[dict]:
        server = HostLedger(parse_config(config), path)
        await server.start()
        try:
            client = HostLedgerClient(path, tenant="test")
            await client.connect()
            held = [await client.request(f"k{i}", 0) for i in range(grants)]
            await client.close()
            return held
        finally:
            await server.stop()

    held = asyncio.run(first())
    return HostLedger(parse_config(config), path), path, held, directory


def _retell(grant: dict) -> dict:
    return {**grant, "pids": [p["pid"] for p in grant["pids"]]}


def test_the_batches_of_one_reclaim_are_one_reclaim():
    """Between the batches of a reclaim (``more``), the ledger still waits for that tenant (a
    restarted ledger grants nothing new until it has re-told all its grants), and an id told in
    an earlier batch is a duplicate, as in one frame; the last batch ends the reclaim. More grants
    over the batches than a user may hold are refused, precisely, and the connection goes on."""
    ledger, path, held, directory = _restarted_with_a_tenant({"virtual_gpus": [24000], "reclaim_window_s": 60}, 3)

    async def go() -> None:
        await ledger.start()
        try:

            def tenant() -> list[dict]:
                with socket.socket(socket.AF_UNIX) as sock:
                    sock.connect(path)
                    answers = []
                    for n, message in enumerate(
                        [
                            {"op": "hello"},
                            {"op": "reclaim", "grants": [_retell(held[0]), _retell(held[1])], "more": True},
                            {"op": "view"},
                            {"op": "reclaim", "grants": [_retell(held[0])], "more": "yes"},
                            {"op": "reclaim", "grants": [_retell(held[0]), _retell(held[2])]},
                            {"op": "view"},
                        ]
                    ):
                        send_sync(sock, {**message, "id": n})
                        answers.append(recv_sync(sock, 60))
                    return answers

            _, first, between, bad, last, after = await asyncio.to_thread(tenant)
            assert [g["id"] for g in first["kept"]] == [held[0]["id"], held[1]["id"]] and first["reclaiming"] is True
            assert between["reclaiming"] is True
            assert bad["ok"] is False and bad["reason"] == "more must be true or false", bad
            assert [g["id"] for g in last["kept"]] == [held[2]["id"]], last
            assert [(r["id"], r["error"]) for r in last["refused"]] == [(held[0]["id"], "duplicate")]
            assert last["reclaiming"] is False and after["reclaiming"] is False

            def too_many() -> tuple[dict, dict, dict]:
                with socket.socket(socket.AF_UNIX) as sock:
                    sock.connect(path)
                    send_sync(sock, {"op": "hello", "id": 1})
                    recv_sync(sock, 60)
                    half = [{"id": f"x{i}"} for i in range(MAX_GRANTS_PER_UID // 2 + 1)]
                    out = []
                    for n in range(2, 5):
                        send_sync(sock, {"op": "reclaim", "id": n, "grants": half, "more": True})
                        out.append(recv_sync(sock, 60))
                    return out[0], out[1], out[2]

            ok, over, again = await asyncio.to_thread(too_many)
            assert ok["ok"] is True and len(ok["refused"]) == MAX_GRANTS_PER_UID // 2 + 1
            reason = f"grants must be at most {MAX_GRANTS_PER_UID} in one reclaim, over all its batches"
            assert (over["ok"], over["error"], over["reason"]) == (False, "bad_request", reason), over
            assert again["ok"] is True  # refused, that reclaim ended: this one is a new one
        finally:
            await ledger.stop()
            shutil.rmtree(directory, ignore_errors=True)

    asyncio.run(go())


def test_an_old_client_s_reclaim_in_one_frame_still_ends_the_reclaim():
    """A reclaim without ``more`` (what every client sent before) is the whole of it."""
    ledger, path, held, directory = _restarted_with_a_tenant({"virtual_gpus": [24000], "reclaim_window_s": 60}, 2)

    async def go() -> dict:
        await ledger.start()
        try:

            def tenant() -> dict:
                with socket.socket(socket.AF_UNIX) as sock:
                    sock.connect(path)
                    send_sync(sock, {"op": "hello", "id": 1})
                    assert recv_sync(sock, 60)["reclaiming"] is True
                    send_sync(sock, {"op": "reclaim", "id": 2, "grants": [_retell(g) for g in held]})
                    return recv_sync(sock, 60)

            return await asyncio.to_thread(tenant)
        finally:
            await ledger.stop()
            shutil.rmtree(directory, ignore_errors=True)

    answer = asyncio.run(go())
    assert len(answer["kept"]) == 2 and answer["refused"] == [] and answer["reclaiming"] is False, json.dumps(answer)
