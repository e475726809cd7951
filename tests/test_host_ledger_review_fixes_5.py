"""The host ledger, after a fifth review: a waiting request is weighed against the other users'
told demand as an ask that does not wait is (one rule for both): a raw client that queues its
next request and then releases what it holds cannot beat the servers' fair share (real system
users, a real ledger served by its own unprivileged user on virtual GPUs, tenants started as the
others). Only the GPUs are virtual."""

from __future__ import annotations

import pytest
from host_ledger_users import PREFIX, Agent, wait_for_view
from waiting import wait_until

from jupyter_evalsched.host_ledger import policy
from jupyter_evalsched.host_ledger.policy import Ask, Holding, HostDevice, Quota, next_grant

pytestmark = pytest.mark.timeout(120)
ALICE, BOB = PREFIX + "alice", PREFIX + "bob"
GPU0 = {0: HostDevice(0, 24000)}
HER_TURN = f"fair share: user {ALICE} waits for this room and has the next turn (user {BOB} had the last)"


def _queue_then_release(ledger, bob: Agent, held: dict, key: str) -> int:
    """Bob queues his next 16000 MB request (it waits: the GPU is full), then releases what he
    holds. The tag of the queued request, answered when it is granted."""
    tag = bob.send("request", key=key, vram_mb=16000)
    wait_for_view(ledger, lambda v: any(w["key"] == key for w in v["waiting"]))
    bob.ok("release", grant=held["id"])
    return tag


def _bobs_reason(ledger, key: str) -> str:
    view = wait_for_view(ledger, lambda v: any(w["key"] == key and w["reason"] for w in v["waiting"]))
    return next(w["reason"] for w in view["waiting"] if w["key"] == key)


@pytest.mark.parametrize("ledger_config", [{"virtual_gpus": [24000], "reclaim_window_s": 0}])
def test_a_waiting_request_gives_way_to_the_demand_of_a_user_whose_turn_it_is(users, ledger, agents):
    """Alice's server holds 8000 MB and tells 16000 MB of queued work; bob holds the other
    16000 MB and, over and over, queues a waiting 16000 MB request and then releases what he
    holds. Without waiting his asks would give way to her demand every other time; waiting, they
    were never weighed against it: he kept the room every cycle and her server was never told
    its turn. Now his held request waits (the same reason as a busy one), she is told `turn`,
    her ask is granted, and his is granted once the room is free again; the turn after is his,
    and a turn she lets pass keeps the room from him no longer than the turn lasts."""
    alice, bob = agents("alice"), agents("bob")
    alice.ok("request", key="a0", vram_mb=8000)
    held = bob.ok("request", key="b0", vram_mb=16000)  # the GPU is full
    assert alice.ok("demand", asks=[{"vram_mb": 16000}]) == 1
    # His first: holding 0 MB against her 8000, it is granted (a turn: it took her demand's room).
    b1 = _queue_then_release(ledger, bob, held, "b1")
    held = bob.result(b1)["result"]
    # His next takes her demand's room again, and he had the last turn: it waits for hers.
    b2 = _queue_then_release(ledger, bob, held, "b2")
    wait_until(lambda: "turn" in alice.ok("events"), timeout=10, message="alice was never told her turn")
    assert _bobs_reason(ledger, "b2") == HER_TURN
    assert not bob.done(b2)
    hers = alice.ok("request", key="a1", vram_mb=16000, wait=False)
    assert hers["state"] == "granted", hers
    # Her run ends with more queued: the room is his (she had the last turn), and his waiting
    # request, held for her turn, is granted.
    assert alice.ok("demand", asks=[{"vram_mb": 16000}]) == 1
    alice.ok("release", grant=hers["grant"]["id"])
    held = bob.result(b2, timeout=10)["result"]
    assert held["vram_mb"] == 16000
    # His next gives way to her again; this time she lets her turn pass: once it has expired
    # (5 s), his request is granted, the room no longer kept idle.
    turns = alice.ok("events").count("turn")
    b3 = _queue_then_release(ledger, bob, held, "b3")
    wait_until(lambda: alice.ok("events").count("turn") > turns, timeout=10, message="alice was not told her turn")
    assert _bobs_reason(ledger, "b3") == HER_TURN
    assert bob.result(b3, timeout=30)["result"]["vram_mb"] == 16000
    # A waiting client is told nothing to retry: its request is answered when granted.
    assert "retry" not in bob.ok("events")


@pytest.mark.parametrize("ledger_config", [{"virtual_gpus": [24000], "reclaim_window_s": 0}])
def test_a_waiting_request_that_leaves_room_for_the_demand_is_granted_at_once(users, ledger, agents):
    """Room nobody waits for is never kept idle: a waiting request that leaves room for the
    other user's demand is granted, even while that user has the next turn."""
    alice, bob = agents("alice"), agents("bob")
    alice.ok("request", key="a0", vram_mb=8000)
    held = bob.ok("request", key="b0", vram_mb=16000)
    assert alice.ok("demand", asks=[{"vram_mb": 8000}]) == 1
    b1 = _queue_then_release(ledger, bob, held, "b1")  # his turn: it took her demand's room
    held = bob.result(b1)["result"]
    small = bob.send("request", key="b-small", vram_mb=0)  # a 0 MB share takes no room
    assert bob.result(small)["result"]["vram_mb"] == 0
    b2 = _queue_then_release(ledger, bob, held, "b2")  # 16000 MB: it would take her 8000 MB's room
    assert _bobs_reason(ledger, "b2") == HER_TURN
    b3 = bob.send("request", key="b3", vram_mb=8000)  # leaves 8000 MB for hers
    assert bob.result(b3)["result"]["vram_mb"] == 8000
    assert not bob.done(b2)


def test_a_waiting_ask_that_must_give_way_is_no_pick_and_the_next_that_need_not_is():
    """Pure: next_grant skips a waiting ask whose grant would take the room of a demanded ask
    whose user it must give way to (gives_way, the rule for asks that do not wait), and picks
    one that leaves room for it, or another user's; the rule goes both ways, never in a circle."""
    gives_way = policy.gives_way
    alice = [Holding("alice", (0,), 8000)]
    demand = [Ask("alice", 16000)]
    # Bob took a turn (the 3rd grant) after alice was last granted (the 1st): he owes her one.
    turns, granted = {"bob": 3}, {"alice": 1, "bob": 3}
    assert gives_way(Ask("bob", 16000), demand, GPU0, alice, {}, turns, granted) == 0
    assert next_grant([Ask("bob", 16000)], GPU0, alice, {}, turns, granted, demand) is None
    pick = next_grant([Ask("bob", 16000), Ask("bob", 0)], GPU0, alice, {}, turns, granted, demand)
    assert pick is not None and pick.position == 1 and not pick.turn
    # Owing nothing (no turn since she was last granted), and holding less: he goes first.
    assert gives_way(Ask("bob", 16000), demand, GPU0, alice, {}, {"bob": 1}, granted) is None
    assert next_grant([Ask("bob", 16000)], GPU0, alice, {}, {"bob": 1}, granted, demand).turn
    # A demand her quota keeps from fitting now holds nobody back.
    capped = {"alice": Quota(vram_mb=12000)}
    assert next_grant([Ask("bob", 16000)], GPU0, alice, capped, turns, granted, demand) is not None
    # Her own waiting ask, beside his held one, is the pick.
    pick = next_grant([Ask("bob", 16000), Ask("alice", 16000)], GPU0, alice, {}, turns, granted, demand)
    assert pick is not None and pick.position == 1


def test_waiting_asks_held_for_a_turn_cost_one_walk_of_the_grants(monkeypatch):
    """Weighing each waiting ask against the told demand walks the grants held once in all (the
    load after an ask is the load before it, plus that ask), not once or twice an ask: one user's
    256 waiting asks beside 1,024 grants would cost each pass of the ledger's loop half a million
    steps."""
    walks = []
    real = policy._load
    monkeypatch.setattr(policy, "_load", lambda devices, holdings: walks.append(1) or real(devices, holdings))
    holdings = [Holding("alice", (0,), 0) for _ in range(1024)] + [Holding("alice", (0,), 8000)]
    waiting = [Ask("bob", 16000) for _ in range(256)]
    demand = [Ask("alice", 16000)]
    turns, granted = {"bob": 3}, {"alice": 1, "bob": 3}
    assert next_grant(waiting, GPU0, holdings, {}, turns, granted, demand) is None
    assert len(walks) == 1
    assert policy.given_way_to(waiting, demand, GPU0, holdings, {}, turns, granted) == [0] * 256
    assert len(walks) == 2
