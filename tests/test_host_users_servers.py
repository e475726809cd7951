"""Issue #32's acceptance with real users' servers: two system users, each with their own
``jupyter server`` started as that user (tests/host_user_servers.py), one host ledger started as a
third, unprivileged user, on virtual GPUs. Runs go in through each server's REST API; what the
host holds is read from the host ledger (root is its admin) and from both users' ledgers.

Slow (three processes to start, and runs that take their time); every wait is on a condition,
with bounds generous enough for a loaded 2-core host."""

from __future__ import annotations

import os
import random
import signal
import time

import pytest
from host_ledger_users import PREFIX, Ledger, assert_never_over
from host_user_servers import UserServer, sleepy
from proc_status import alive
from waiting import wait_until

from jupyter_evalsched import contract

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
ALICE, BOB = PREFIX + "alice", PREFIX + "bob"
TERMINAL = {"succeeded", "failed", "cancelled", "interrupted", "timed_out"}


@pytest.fixture
def host(users, request):
    """The host ledger (as the ledger user) and both users' servers, on ``gpus`` virtual GPUs."""
    gpus: list[int] = getattr(request, "param", [24000])
    ledger = Ledger(users["ledger"], {"virtual_gpus": gpus, "reclaim_window_s": 0})
    ledger.start()
    servers: dict[str, UserServer] = {}
    try:
        for role in ("alice", "bob"):
            servers[role] = UserServer(users[role], ledger.socket, ",".join(map(str, gpus)))
        for server in servers.values():
            assert server.connected()["user"] == server.name
        yield ledger, servers["alice"], servers["bob"]
    finally:
        for server in servers.values():
            server.cleanup()
        ledger.stop()


def users_view_ok(server: UserServer) -> dict:
    """The user's own ledger never shows a GPU past its usable VRAM: its runs plus the other
    users' grants (by name) plus what no grant accounts for."""
    view = server.ok("GET", "ledger")
    for dev in view["devices"]:
        others = sum(u["allocated_mb"] for u in dev["users"])
        assert dev["allocated_mb"] + others <= dev["usable_mb"], (server.name, dev)
        assert all(u["user"] != server.name for u in dev["users"]), (server.name, dev)
    return view


def check_all(ledger: Ledger, *servers: UserServer) -> dict:
    view = ledger.view()
    assert_never_over(view)
    for server in servers:
        users_view_ok(server)
    return view


def state(server: UserServer, run_id: str) -> dict:
    return server.ok("GET", f"runs/{run_id}")


def wait_state(server: UserServer, run_id: str, states: set[str], timeout: float = 120) -> dict:
    def reached():
        rec = state(server, run_id)
        return rec if rec["state"] in states and (rec["state"] != "running" or rec.get("pid")) else None

    return wait_until(reached, timeout=timeout, interval=0.1, message=f"{server.name}'s run {run_id} not in {states}")


def grants_of(view: dict, user: str) -> list[dict]:
    return [g for g in view["grants"] if g["user"] == user]


@pytest.mark.parametrize("host", [[24000, 24000]], indirect=True)
def test_two_users_at_random_never_over_usable_and_a_wait_names_the_other_user(host):
    ledger, alice, bob = host
    servers = {ALICE: alice, BOB: bob}

    # A run that does not fit because of the other user's names that user.
    held = bob.submit(sleepy(20000, 600))
    held2 = bob.submit(sleepy(20000, 600))
    for run in (held, held2):
        wait_state(bob, run["id"], {"running"})
    blocked = alice.submit(sleepy(10000, 0.1))

    def named():
        # (Admitted on a view that did not show bob yet, the host ledger's refusal names him at
        # once; the holders follow with the next view.)
        rec = state(alice, blocked["id"])
        assert rec["state"] == "queued", rec
        holders = [(h["kind"], h["id"], h["name"]) for h in (rec["why"] or {}).get("holders") or []]
        return rec if ("user", BOB, BOB) in holders and BOB in (rec["reason"] or "") else None

    rec = wait_until(named, timeout=60, interval=0.1, message="alice's run never named bob")
    assert f"user {BOB} holds 20000 MB on GPU" in rec["reason"], rec["reason"]
    assert rec["why"]["code"] in (contract.WAITING_VRAM, contract.HOST_LEDGER), rec["why"]
    # Each user's ledger shows the other's holdings by name, and nothing of their runs.
    seen = users_view_ok(alice)
    assert [u["user"] for d in seen["devices"] for u in d["users"]] == [BOB, BOB]
    assert held["id"] not in str(seen) and "sleep_s" not in str(seen)
    check_all(ledger, alice, bob)
    bob.ok("POST", f"runs/{held['id']}/cancel")
    assert wait_state(alice, blocked["id"], TERMINAL)["state"] == "succeeded"
    bob.ok("POST", f"runs/{held2['id']}/cancel")
    wait_until(lambda: not ledger.view()["grants"], timeout=60, message="grants outlived their runs")

    # Both users at random: every view, throughout, within each GPU's usable VRAM.
    rng = random.Random(3232)
    submitted: list[tuple[UserServer, str]] = []
    most = {ALICE: 0, BOB: 0}
    for step in range(24):
        name = rng.choice([ALICE, BOB])
        vram = rng.choice([2000, 5000, 8000, 11000, 14000, 20000])
        run = servers[name].submit(sleepy(vram, rng.uniform(0.2, 1.5)))
        submitted.append((servers[name], run["id"]))
        view = check_all(ledger, alice, bob)
        for user in most:
            most[user] = max(most[user], sum(g["vram_mb"] for g in grants_of(view, user)))
        if step % 4 == 3:
            time.sleep(rng.uniform(0.0, 1.0))  # (a pace, not a synchronisation: nothing waits on it)

    def all_done():
        view = check_all(ledger, alice, bob)
        for user in most:
            most[user] = max(most[user], sum(g["vram_mb"] for g in grants_of(view, user)))
        return all(state(server, run_id)["state"] in TERMINAL for server, run_id in submitted)

    wait_until(all_done, timeout=300, interval=0.1, message="the random runs never all ended")
    finals = [state(server, run_id) for server, run_id in submitted]
    assert [r["state"] for r in finals] == ["succeeded"] * len(finals), [(r["id"], r["state"]) for r in finals]
    assert most[ALICE] and most[BOB], most  # both users were granted GPUs through the ledger
    wait_until(lambda: not ledger.view()["grants"], timeout=60, message="grants outlived their runs")


def test_with_both_users_queueing_grants_alternate_by_holdings(host):
    """One 24000 MB GPU, alice holding all of it with two runs, three more of hers queued before
    bob's three: each time a run ends, the next grant goes to the user holding less."""
    ledger, alice, bob = host
    first = [alice.submit(sleepy(12000, 600)) for _ in range(2)]
    for run in first:
        wait_state(alice, run["id"], {"running"})
    queued: dict[str, tuple[UserServer, str]] = {}
    for _ in range(3):
        queued[alice.submit(sleepy(12000, 600))["id"]] = (alice, ALICE)
    for _ in range(3):
        queued[bob.submit(sleepy(12000, 600))["id"]] = (bob, BOB)

    def waiting_on_the_other():
        return all(state(s, rid)["state"] == "queued" for rid, (s, _) in queued.items())

    wait_until(waiting_on_the_other, timeout=30, interval=0.1)
    # Each server has told the host ledger what it has queued (its demand).
    wait_until(
        lambda: sorted(d["user"] for d in ledger.view()["demand"]) == [ALICE] * 3 + [BOB] * 3,
        timeout=30,
        interval=0.1,
        message="the servers never told their queued work",
    )
    holding: list[tuple[UserServer, str]] = [(alice, r["id"]) for r in first]
    order: list[str] = []
    while len(order) < 6:
        server, run_id = holding.pop(0)
        server.ok("POST", f"runs/{run_id}/cancel")

        def next_running():
            check_all(ledger, alice, bob)
            return [rid for rid, (s, _) in queued.items() if state(s, rid)["state"] == "running"]

        started = wait_until(next_running, timeout=60, interval=0.1, message=f"no grant after {order}")
        assert len(started) == 1, started
        server, user = queued.pop(started[0])
        order.append(user)
        holding.append((server, started[0]))
        # The other runs stay queued meanwhile: one run ended, one started.
        view = check_all(ledger, alice, bob)
        assert sum(g["vram_mb"] for g in view["grants"]) <= 24000
    assert order == [BOB, ALICE, BOB, ALICE, BOB, ALICE], order
    for server, run_id in holding:
        server.ok("POST", f"runs/{run_id}/cancel")


def test_kill_9_of_a_users_server_frees_its_grants_once_its_runs_are_gone_never_earlier(host):
    ledger, alice, bob = host
    detached = alice.submit(sleepy(9000, 600, detach=True))
    attached = alice.submit(sleepy(6000, 600))
    d = wait_state(alice, detached["id"], {"running"})
    a = wait_state(alice, attached["id"], {"running"})

    def tied():
        by_key = {g["key"]: g for g in grants_of(ledger.view(), ALICE)}
        if set(by_key) != {detached["id"], attached["id"]}:
            return None
        pids = {k: [p["pid"] for p in g["pids"]] for k, g in by_key.items()}
        return pids if pids == {detached["id"]: [d["pid"]], attached["id"]: [a["pid"]]} else None

    wait_until(tied, timeout=60, interval=0.1, message="the runs' grants were never tied to their processes")
    # Bob's run waits on alice's holdings (15000 of 24000 MB), and on the detached run's alone.
    waits = bob.submit(sleepy(16000, 0.1))
    wait_until(lambda: ALICE in (state(bob, waits["id"])["reason"] or ""), timeout=60, interval=0.1)

    alice.kill9()
    # The attached run dies with its server (its death signal); the detached one does not.
    wait_until(lambda: not alive(a["pid"]), timeout=30, message="the attached run outlived its server")

    def only_the_detached():
        view = ledger.view()
        assert_never_over(view)
        keys = {g["key"] for g in grants_of(view, ALICE)}
        assert detached["id"] in keys, "the detached run's grant ended while it runs"
        return keys == {detached["id"]}

    wait_until(only_the_detached, timeout=60, interval=0.1)
    # Sweeps go on (two seconds of them at least): while the detached run lives, its grant stays,
    # and bob's run still waits for it.
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline:
        assert alive(d["pid"])
        view = ledger.view()
        assert [g["key"] for g in grants_of(view, ALICE)] == [detached["id"]]
        assert state(bob, waits["id"])["state"] == "queued"
        users_view_ok(bob)
        time.sleep(0.1)
    os.kill(d["pid"], signal.SIGKILL)
    wait_until(lambda: not grants_of(ledger.view(), ALICE), timeout=60, message="the run gone, its grant stayed")
    assert wait_state(bob, waits["id"], TERMINAL)["state"] == "succeeded"
