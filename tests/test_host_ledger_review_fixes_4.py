"""The host ledger, after a fourth review: between users' servers (which ask without waiting),
a grant that takes the room another user told as demand is a turn, and the turns rotate whatever
either holds (real system users, a real ledger served by its own unprivileged user on virtual
GPUs, tenants started as the others). Only the GPUs are virtual."""

from __future__ import annotations

import pytest
from host_ledger_users import PREFIX, Agent
from waiting import wait_until

from jupyter_evalsched.host_ledger.policy import Ask, Holding, HostDevice, Quota, deferred_to, next_grant, owed_turns

pytestmark = pytest.mark.timeout(120)
ALICE, BOB = PREFIX + "alice", PREFIX + "bob"
GPU0 = {0: HostDevice(0, 24000)}


def _run_ends_and_the_next_asks(bob: Agent, held: dict, key: str) -> dict:
    """Bob's server: a run ends (its grant released) and the next queued run asks at once, as
    its admission does, before anyone else's server has seen the room free."""
    bob.ok("release", grant=held["id"])
    return bob.ok("request", key=key, vram_mb=16000, wait=False)


@pytest.mark.parametrize("ledger_config", [{"virtual_gpus": [24000], "reclaim_window_s": 0}])
def test_a_server_that_releases_and_asks_again_at_once_cannot_hold_the_room_another_user_demands(users, ledger, agents):
    """Alice's server holds 8000 MB and tells 16000 MB of queued work; bob's holds the other
    16000 MB, and each time one of his runs ends the next asks at once. Holding 0 MB then, he is
    never given way to, and his grants took no room given way for: judged by holdings alone he
    would hold the room all along, and alice's demand would never be served. His first grant
    took the room of her demand (it fit): a turn. His next ask gives way to her, whatever either
    holds; once she has had the room, the next is his again."""
    alice, bob = agents("alice"), agents("bob")
    alice.ok("request", key="a0", vram_mb=8000)
    held = bob.ok("request", key="b0", vram_mb=16000)  # the GPU is full
    assert alice.ok("demand", asks=[{"vram_mb": 16000}]) == 1
    first = _run_ends_and_the_next_asks(bob, held, "b1")
    assert first["state"] == "granted", first  # holding 0 MB against her 8000: his turn
    turns = alice.ok("events").count("turn")
    second = _run_ends_and_the_next_asks(bob, first["grant"], "b2")
    assert second["state"] == "busy", second
    assert (
        second["reason"]
        == f"fair share: user {ALICE} waits for this room and has the next turn (user {BOB} had the last)"
    )
    wait_until(lambda: alice.ok("events").count("turn") > turns, timeout=10, message="alice was never told her turn")
    hers = alice.ok("request", key="a1", vram_mb=16000, wait=False)
    assert hers["state"] == "granted", hers
    # The rotation goes on: her run ends, and the room is bob's again (she had the last turn).
    assert alice.ok("demand", asks=[{"vram_mb": 16000}]) == 1
    alice.ok("release", grant=hers["grant"]["id"])
    third = bob.ok("request", key="b3", vram_mb=16000, wait=False)
    assert third["state"] == "granted", third
    # And then hers: he had the last turn again.
    fourth = _run_ends_and_the_next_asks(bob, third["grant"], "b4")
    assert fourth["state"] == "busy" and f"user {ALICE} waits for this room" in fourth["reason"], fourth


def test_an_asker_that_took_a_turn_since_another_was_last_granted_gives_way_to_its_demand_whatever_it_holds():
    """The rotation between servers, pure: a grant that takes the room of another user's demand
    that fits now is a turn (next_grant), and the user who took it gives way to that user's
    demand next (deferred_to's ``ahead``, from owed_turns), though it holds less."""
    alice = [Holding("alice", (0,), 8000)]
    # Bob (0 MB) takes the room alice's told 16000 MB fit in: a turn, though no ask of hers waits.
    pick = next_grant([Ask("bob", 16000)], GPU0, alice, {}, demand=[Ask("alice", 16000)])
    assert pick is not None and pick.turn is True
    assert next_grant([Ask("bob", 16000)], GPU0, alice, {}).turn is False  # (none told)
    # Room left for her demand, or a demand of 0 MB (it keeps no room): no turn.
    assert next_grant([Ask("bob", 8000)], GPU0, alice, {}, demand=[Ask("alice", 8000)]).turn is False
    assert next_grant([Ask("bob", 16000)], GPU0, alice, {}, demand=[Ask("alice", 0)]).turn is False
    # Nor a demand her quota keeps from fitting now: the room was none she could use.
    capped = {"alice": Quota(vram_mb=12000)}
    assert next_grant([Ask("bob", 16000)], GPU0, alice, capped, demand=[Ask("alice", 8000)]).turn is False
    assert owed_turns("bob", {"alice", "bob"}, {"bob": 3}, {"alice": 1, "bob": 3}) == {"alice"}
    assert owed_turns("bob", {"alice"}, {"bob": 3}, {"alice": 4}) == frozenset()
    # Holding 0 MB against her 8000, bob gives way to her only when he owes her the turn.
    assert deferred_to(Ask("bob", 16000), [Ask("alice", 16000)], GPU0, alice, {}) is None
    assert deferred_to(Ask("bob", 16000), [Ask("alice", 16000)], GPU0, alice, {}, ahead={"alice"}) == 0
    # Of several, the one ahead first (carol holds less, but bob owes alice).
    both = [Ask("carol", 15000), Ask("alice", 15000)]
    held = [*alice, Holding("bob", (0,), 1000)]
    assert deferred_to(Ask("bob", 15000), both, GPU0, held, {}) == 0
    assert deferred_to(Ask("bob", 15000), both, GPU0, held, {}, ahead={"alice"}) == 1
