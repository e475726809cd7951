"""The host ledger, after a second review: the turns between users' servers that ask without
waiting rotate (real system users, a real ledger served by its own unprivileged user on virtual
GPUs, tenants started as the others), and a reclaim after a lost state weighs each grant re-told
against one load (in-process ledgers, as root, on a real socket). Only the GPUs are virtual."""

from __future__ import annotations

import asyncio
import os
import pwd
import random
import shutil
import socket
import tempfile

import pytest
from host_ledger_users import PREFIX, Agent, grant_ids
from waiting import wait_until

from jupyter_evalsched.host_ledger import policy, procs
from jupyter_evalsched.host_ledger.config import parse_config
from jupyter_evalsched.host_ledger.policy import (
    Ask,
    Holding,
    HostDevice,
    Quota,
    Retold,
    deferred_to,
    retold_reason,
    turned_since,
)
from jupyter_evalsched.host_ledger.protocol import MAX_FRAME_BYTES, encode, recv_sync, send_sync
from jupyter_evalsched.host_ledger.server import MAX_GRANTS_PER_UID, Grant, HostLedger

pytestmark = pytest.mark.timeout(120)
ALICE, BOB = PREFIX + "alice", PREFIX + "bob"
GPU0 = {0: HostDevice(0, 24000)}


def _deferred(alice: Agent, bob: Agent, key: str) -> tuple[int, int]:
    """Alice asks for the room bob's demand is kept: refused for bob's turn. The turns bob and
    the retries alice had been told before (the events come on their own)."""
    told = bob.ok("events").count("turn"), alice.ok("events").count("retry")
    refused = alice.ok("request", key=key, vram_mb=12000, wait=False)
    assert refused["state"] == "busy" and refused["reason"].startswith(f"fair share: user {BOB}"), refused
    return told


def _turn_taken_and_given_back(alice: Agent, bob: Agent, key: str, told: tuple[int, int]) -> None:
    """Bob, told his turn, takes the room (12000 MB), gives it back at once and tells the same
    demand again: he holds nothing again, the least."""
    turns, retries = told
    wait_until(lambda: bob.ok("events").count("turn") > turns, timeout=10, message="bob was never told his turn")
    taken = bob.ok("request", key=key, vram_mb=12000, wait=False)
    assert taken["state"] == "granted", taken
    wait_until(lambda: alice.ok("events").count("retry") > retries, timeout=10, message="alice was not told to retry")
    bob.ok("release", grant=taken["grant"]["id"])
    assert bob.ok("demand", asks=[{"vram_mb": 12000}]) == 1


@pytest.mark.parametrize("ledger_config", [{"virtual_gpus": [24000], "reclaim_window_s": 0}])
def test_a_user_who_takes_each_turn_and_gives_it_back_at_once_cannot_hold_another_back(users, ledger, agents):
    """Turn cycling: bob, holding nothing, tells demand for the room alice asks for; each time he
    is told his turn he takes it, releases it at once and tells his demand again. Judged by what
    each holds now, he would be the one holding less at each of alice's asks, and alice (holding
    12000 MB) deferred for ever. The turns rotate: once bob has had a turn since alice was last
    granted, alice goes first; then bob's next turn comes again."""
    alice, bob = agents("alice"), agents("bob")
    held = [alice.ok("request", key=f"a{i}", vram_mb=12000) for i in range(2)]  # the whole GPU
    assert bob.ok("demand", asks=[{"vram_mb": 12000}]) == 1
    alice.ok("release", grant=held[0]["id"])
    _turn_taken_and_given_back(alice, bob, "b1", _deferred(alice, bob, "a-next"))
    # Bob had his turn since alice was last granted: alice is not deferred to him again.
    second = alice.ok("request", key="a-next", vram_mb=12000, wait=False)
    assert second["state"] == "granted", second
    # The rotation goes on: alice, granted since bob's turn, gives way to his demand once more.
    alice.ok("release", grant=second["grant"]["id"])
    _turn_taken_and_given_back(alice, bob, "b2", _deferred(alice, bob, "a-third"))
    fourth = alice.ok("request", key="a-third", vram_mb=12000, wait=False)
    assert fourth["state"] == "granted", fourth
    assert grant_ids(ledger.view()) == {held[1]["id"], fourth["grant"]["id"]}


def test_a_user_who_took_a_turn_since_the_asker_was_last_granted_goes_behind_it():
    """The rotation, pure: the turns and grants on one count of the grants made."""
    assert turned_since("alice", {"bob": 3}, {"alice": 2}) == {"bob"}
    assert turned_since("alice", {"bob": 3}, {"alice": 4, "bob": 3}) == frozenset()
    assert turned_since("carol", {"bob": 3, "dave": 1}, {}) == {"bob", "dave"}  # never granted
    alice = [Holding("alice", (0,), 12000)]
    demand = [Ask("bob", 12000), Ask("carol", 12000)]
    assert deferred_to(Ask("alice", 12000), demand, GPU0, alice, {}) == 0
    assert deferred_to(Ask("alice", 12000), demand, GPU0, alice, {}, behind={"bob"}) == 1
    assert deferred_to(Ask("alice", 12000), demand, GPU0, alice, {}, behind={"bob", "carol"}) is None


# ---------------------------------------------------------------------- the reclaim after a lost state, in-process


def _reclaimed(config: dict, told: list[dict], others: tuple[Grant, ...] = ()) -> tuple[dict, dict]:
    """The hello and reclaim answers to this process (root) re-telling ``told`` to an in-process
    ledger restarted with a state file it cannot read, beside ``others`` (grants of other users
    it knows), on a socket in a short directory of its own (a socket's path is at most 107
    bytes, whatever the tmp_path); and the grants it then holds."""

    async def go() -> tuple[dict, dict]:
        directory = tempfile.mkdtemp(prefix="evhl-", dir="/tmp")
        path = os.path.join(directory, "ledger.sock")
        with open(f"{path}.state.json", "w", encoding="utf-8") as f:
            f.write("{not json")
        server = HostLedger(parse_config({"reclaim_window_s": 60, **config}), path)
        await server.start()
        try:
            for grant in others:
                server.grants[grant.id] = grant

            def tenant() -> tuple[dict, dict]:
                with socket.socket(socket.AF_UNIX) as sock:
                    sock.connect(path)
                    send_sync(sock, {"op": "hello", "id": 1})
                    hello = recv_sync(sock, 60)
                    send_sync(sock, {"op": "reclaim", "id": 2, "grants": told})
                    return hello, recv_sync(sock, 60)

            hello, answer = await asyncio.to_thread(tenant)
            held = sorted((g.id, g.devices, g.vram_mb, g.exclusive, g.kind) for g in server.grants.values())
            return hello, {**answer, "held": held}
        finally:
            await server.stop()
            shutil.rmtree(directory, ignore_errors=True)

    return asyncio.run(go())


def _told_here(grant_id: str, key: str, devices: list[int], vram_mb: int, **fields) -> dict:
    return {"id": grant_id, "key": key, "devices": devices, "vram_mb": vram_mb, "pids": [os.getpid()], **fields}


def test_a_reclaim_after_a_lost_state_learns_a_mixed_list_as_it_did_grant_by_grant():
    """Re-told grants are learnt one at a time, each beside those known and learnt before it:
    the answer is the one the ledger gave when it weighed each against a load made anew (pinned
    from that code), for duplicates, keys in use, whole GPUs, 0 MB shares, leases, quotas and
    another user's grant."""
    me = pwd.getpwuid(os.getuid()).pw_name
    told = [
        _told_here("a", "k1", [0], 4000),
        _told_here("b", "k1", [1], 4000),  # the key of a
        _told_here("a", "k1", [0], 12000),  # a again
        _told_here("c", "k2", [0], 0),
        _told_here("d", "k3", [1], 0, exclusive=True),
        _told_here("e", "k4", [1], 0),  # 0 MB beside the whole GPU: as an earlier ledger granted
        _told_here("f", "k5", [1], 1),  # 1 MB beside it: no room
        _told_here("g", "k6", [0], 16000),
        _told_here("h", "k7", [0], 0, exclusive=True),  # over the VRAM quota
        _told_here("i", "k5", [0], 0),  # k5: refused with f, free again
        _told_here("j", "k8", [0, 1], 0, gpus=2),
        {"key": "no id"},
        _told_here("l1", "k9", [0], 0, kind="lease"),
        _told_here("l2", "k10", [0], 0, kind="lease"),  # over the lease quota
        _told_here("m", "k11", [0], 2000),  # GPU 0 full, with the other user's 2000 MB
        _told_here("n", "k12", [1], 0, exclusive=True),
        _told_here("o", "k13", [2], 0),  # no GPU 2
        _told_here("p", "k14", [0], 1000),
        _told_here("other", "k15", [0], 0),  # another user's grant
    ]
    other = Grant("other", 4242, "someone", "x", "run", (0,), 2000, False, [procs.identify(os.getpid())])
    config = {"virtual_gpus": [24000, 24000], "quota": {me: {"leases": 1, "vram_mb": 47000}}}
    hello, answer = _reclaimed(config, told, (other,))
    assert hello["reclaiming"] is True
    assert [g["id"] for g in answer["kept"]] == ["a", "c", "d", "e", "g", "i", "j", "l1", "m"], answer
    not_fit = "re-told grant does not fit: "
    assert [(r["id"], r["error"], r["reason"]) for r in answer["refused"]] == [
        ("b", "key_in_use", f"user {me} holds grant a under key 'k1': one grant a key"),
        ("a", "duplicate", "grant 'a' is told twice: kept as first told"),
        ("f", "does_not_fit", f"{not_fit}needs 1 MB on 1 GPU; GPU 1 has 0 MB free of 24000 MB usable; user {me} holds 24000 MB on GPU 1"),
        ("h", "does_not_fit", f"{not_fit}quota: user {me} may hold 47000 MB of VRAM; holds 44000 MB"),
        (None, "bad_request", "each grant needs its id"),
        ("l2", "does_not_fit", f"{not_fit}quota: user {me} may hold 1 lease; holds 1"),
        ("n", "does_not_fit", f"{not_fit}quota: user {me} may hold 47000 MB of VRAM; holds 46000 MB"),
        ("o", "bad_request", "a re-told grant names the GPUs it holds"),
        ("p", "does_not_fit", f"{not_fit}needs 1000 MB on 1 GPU; GPU 0 has 0 MB free of 24000 MB usable; user {me} holds 22000 MB on GPU 0; user someone holds 2000 MB on GPU 0"),
        ("other", "unknown_grant", f"user {me} holds no grant 'other'"),
    ]  # fmt: skip
    assert answer["held"] == [
        ("a", (0,), 4000, False, "run"), ("c", (0,), 0, False, "run"), ("d", (1,), 0, True, "run"),
        ("e", (1,), 0, False, "run"), ("g", (0,), 16000, False, "run"), ("i", (0,), 0, False, "run"),
        ("j", (0, 1), 0, False, "run"), ("l1", (0,), 0, False, "lease"), ("m", (0,), 2000, False, "run"),
        ("other", (0,), 2000, False, "run"),
    ]  # fmt: skip


def test_a_reclaim_of_1024_grants_walks_the_grants_held_once(monkeypatch):
    """1,024 grants re-told in one reclaim (each as small as a grant is told: they fit in one
    frame) are weighed against one load, made once and added to as each is learnt; made anew for
    each, they walked half a million grants (523,776), on the loop that serves every user (about
    a second in an in-process probe, against 0.2 s now, the state's save and /proc included)."""
    walked: list[int] = []
    real = policy._load

    def counting(devices, holdings):
        holdings = list(holdings)
        walked.append(len(holdings))
        return real(devices, holdings)

    monkeypatch.setattr(policy, "_load", counting)
    told = [
        {"id": f"{i:x}", "key": f"{i:x}", "devices": [i % 2], "pids": [os.getpid()]} for i in range(MAX_GRANTS_PER_UID)
    ]
    assert len(encode({"op": "reclaim", "id": 2, "grants": told})) <= MAX_FRAME_BYTES
    _, answer = _reclaimed({"virtual_gpus": [24000, 24000]}, told)
    assert len(answer["kept"]) == MAX_GRANTS_PER_UID and answer["refused"] == []
    assert walked == [0], walked[:5]


def test_grants_learnt_one_at_a_time_are_weighed_as_against_a_load_made_anew():
    """Random mixes of shares, 0 MB, whole GPUs and leases, of two users, under quotas: each
    re-told grant gets the same reason from Retold (one load, added to) as from retold_reason
    over the grants learnt before it."""
    devices = {0: HostDevice(0, 24000), 1: HostDevice(1, 16000), 2: HostDevice(2, 8000)}
    quotas = {"alice": Quota(vram_mb=60000, gpus=2, leases=2), "bob": Quota()}
    rng = random.Random(67)
    for _ in range(40):
        known = [Holding("bob", (rng.randrange(3),), rng.choice([0, 1000, 4000]))]
        learnt, held = Retold(devices, known), list(known)
        for _ in range(60):
            gpus = rng.choice([1, 1, 2])
            ask = Ask(
                rng.choice(["alice", "bob"]),
                rng.choice([0, 0, 500, 3000, 9000]),
                gpus,
                exclusive=rng.random() < 0.15,
                kind=rng.choice(["run", "run", "lease", "model"]),
                devices=tuple(rng.sample(range(3), gpus)),
            )
            why = retold_reason(ask, devices, held, quotas[ask.user])
            assert learnt.reason(ask, quotas[ask.user]) == why, (ask, held)
            if not why:
                assert ask.devices is not None
                holding = Holding(ask.user, ask.devices, ask.vram_mb, ask.exclusive, ask.kind)
                learnt.learn(holding)
                held.append(holding)
