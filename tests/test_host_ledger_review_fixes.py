"""The host ledger, after a review of its per-user accounting, its reclaim and its fair share:
real system users (useradd), a real ledger served by its own unprivileged user on virtual GPUs,
tenants started as other users. Only the GPUs are virtual."""

from __future__ import annotations

import contextlib
import ctypes
import os
import pwd
import subprocess
import tempfile
from collections.abc import Iterator

import pytest
from host_ledger_users import PREFIX, Ledger, grant_ids, wait_for_view

pytestmark = pytest.mark.timeout(120)
ALICE, BOB = PREFIX + "alice", PREFIX + "bob"
ALIAS = PREFIX + "alice2"  # a second name for alice's uid
CAROL, CAROL_RENAMED = PREFIX + "carol", PREFIX + "carol9"  # a user this module renames
LOST_STATE = {"virtual_gpus": [24000, 24000], "reclaim_window_s": 60}


def _lose_state(ledger: Ledger) -> None:
    """Restart the ledger with a state file it cannot read: it learns the grants re-told."""
    ledger.kill9()
    with open(ledger.state_file, "w", encoding="utf-8") as f:
        f.write("{not json")
    ledger.start()


def _told(grant_id: str, key: str, devices: list[int], vram_mb: int, pid: int, **fields) -> dict:
    return {"id": grant_id, "key": key, "kind": "run", "devices": devices, "vram_mb": vram_mb, "pids": [pid], **fields}


# ---------------------------------------------------------------------- 1: quotas and grants by uid


@pytest.fixture(scope="module")
def alias(users) -> pwd.struct_passwd:
    """A second name for alice's uid (useradd -o), listed after hers: the host names the uid
    alice, and the policy names the alias."""
    try:
        found = pwd.getpwnam(ALIAS)
    except KeyError:
        uid = str(users["alice"].pw_uid)
        subprocess.run(["useradd", "-o", "-u", uid, "-M", "-N", ALIAS], check=True, capture_output=True)
        found = pwd.getpwnam(ALIAS)
    assert found.pw_uid == users["alice"].pw_uid and pwd.getpwuid(found.pw_uid).pw_name == ALICE
    return found


PASSWD = "/etc/passwd"


@contextlib.contextmanager
def _passwd_locked() -> Iterator[None]:
    """The password files' lock (lckpwdf), as useradd and usermod take it."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.lckpwdf() != 0:
        raise OSError(ctypes.get_errno(), "cannot lock the password files (lckpwdf)")
    try:
        yield
    finally:
        libc.ulckpwdf()


def _write_passwd(content: str) -> None:
    """/etc/passwd rewritten in place, on its own inode: where it is a bind mount (some containers
    make it one) a file renamed over it fails (EBUSY). Written, then cut to length: never empty."""
    with open(PASSWD, "r+", encoding="utf-8") as f:
        f.write(content)
        f.truncate()
        f.flush()
        os.fsync(f.fileno())


def _rename(old: str, new: str) -> None:
    """Give a user another login name in /etc/passwd, as ``usermod -l`` does (which refuses while
    the user runs processes: the case here). /etc/shadow keeps the old name meanwhile: only
    logging in reads it, and neither the ledger nor the tenants (started by uid) log in."""
    with _passwd_locked():
        with open(PASSWD, encoding="utf-8") as f:
            before = f.read()
        lines = before.splitlines(keepends=True)
        assert sum(line.startswith(f"{old}:") for line in lines) == 1
        after = "".join(f"{new}:{line[len(old) + 1 :]}" if line.startswith(f"{old}:") else line for line in lines)
        try:
            _write_passwd(after)
        except BaseException:
            _write_passwd(before)
            raise


def _passwd_whole() -> bool:
    """Whether /etc/passwd still reads as a password file (root's line, seven fields a line)."""
    with open(PASSWD, encoding="utf-8") as f:
        lines = f.read().splitlines()
    return any(line.startswith("root:") for line in lines) and all(line.count(":") == 6 for line in lines if line)


@pytest.fixture
def carol(users) -> Iterator[pwd.struct_passwd]:
    """A user of this module's own, whose name the test changes and changes back (a failure where
    /etc/passwd cannot be written: this project's machines and CI can, and a skip would prove
    nothing). Its content is kept in /tmp first, written back should a rewrite have left it broken."""
    try:
        with open(PASSWD, "r+", encoding="utf-8"), _passwd_locked():
            pass
    except OSError as exc:
        pytest.fail(f"{PASSWD} cannot be written here: {exc}")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(f"{PASSWD}.evhl-rename")  # (left by an earlier version of this test)
    fd, backup = tempfile.mkstemp(prefix="evhl-passwd-", dir="/tmp")
    try:
        with open(PASSWD, encoding="utf-8") as f, os.fdopen(fd, "w", encoding="utf-8") as kept:
            kept.write(f.read())
        with contextlib.suppress(KeyError):
            pwd.getpwnam(CAROL_RENAMED)
            _rename(CAROL_RENAMED, CAROL)  # (a run killed mid-test left it renamed)
        try:
            pwd.getpwnam(CAROL)
        except KeyError:
            subprocess.run(["useradd", "-m", CAROL], check=True, capture_output=True)
        yield pwd.getpwnam(CAROL)
        with contextlib.suppress(KeyError):
            pwd.getpwnam(CAROL_RENAMED)
            _rename(CAROL_RENAMED, CAROL)
    finally:
        try:
            if not _passwd_whole():
                with open(backup, encoding="utf-8") as f, _passwd_locked():
                    _write_passwd(f.read())
        finally:
            os.unlink(backup)


@pytest.mark.parametrize(
    "ledger_config", [{"virtual_gpus": [24000, 24000], "reclaim_window_s": 0, "quota": {ALIAS: {"vram_mb": 10000}}}]
)
def test_a_quota_set_under_another_name_of_the_uid_holds(users, alias, ledger, agents):
    """The kernel tells a uid; the host names it alice, the policy sets the quota under its other
    name: it is the same user, held to that quota."""
    alice = agents("alice")
    never = alice.call("request", key="a1", vram_mb=14000)
    assert never.get("error") == "never" and "may hold 10000 MB" in never["reason"], never
    alice.ok("request", key="a2", vram_mb=8000)
    tag = alice.send("request", key="a3", vram_mb=4000)
    view = wait_for_view(ledger, lambda v: v["waiting"])
    assert view["waiting"][0]["reason"] == f"quota: user {ALICE} may hold 10000 MB of VRAM; holds 8000 MB"
    assert not alice.done(tag)


@pytest.mark.parametrize(
    "ledger_config", [{"virtual_gpus": [24000, 24000], "reclaim_window_s": 0, "quota": {"default": {"vram_mb": 20000}}}]
)
def test_a_user_renamed_while_holding_grants_is_still_one_user_to_the_quota(users, carol, ledger, agents):
    """Carol holds 16000 MB of a 20000 MB quota; renamed, her server connects again: it is the
    same user (the ledger keeps the name it first knew the uid by while it runs), whose grants
    are still hers, and 16000 MB more waits on the quota."""
    first = agents(carol)
    first.ok("request", key="c1", vram_mb=16000)
    _rename(CAROL, CAROL_RENAMED)
    assert pwd.getpwuid(carol.pw_uid).pw_name == CAROL_RENAMED
    second = agents(carol)
    assert second.ok("view")["user"] == CAROL
    tag = second.send("request", key="c2", vram_mb=16000)
    view = wait_for_view(ledger, lambda v: v["waiting"])
    assert view["waiting"][0]["reason"] == f"quota: user {CAROL} may hold 20000 MB of VRAM; holds 16000 MB"
    assert not second.done(tag)
    assert sum(g["vram_mb"] for g in view["grants"]) == 16000


# ---------------------------------------------------------------------- 2: a lease asked as a run


@pytest.mark.parametrize(
    "ledger_config",
    [{"virtual_gpus": [24000, 24000], "reclaim_window_s": 0, "quota": {ALICE: {"leases": 1, "vram_mb": 20000}}}],
)
def test_a_lease_asked_as_a_run_escapes_the_lease_count_but_never_the_vram_or_gpus(users, ledger, agents):
    """The kind is the caller's word (the ledger cannot tell a lease's processes from a run's): a
    client that asks its second lease as a run is granted it, and is held, like every grant of
    every kind, to its VRAM and GPU quotas."""
    alice = agents("alice")
    alice.ok("request", key="lease1", kind="lease", vram_mb=8000)
    tag = alice.send("request", key="lease2", kind="lease", vram_mb=8000)
    view = wait_for_view(ledger, lambda v: v["waiting"])
    assert view["waiting"][0]["reason"] == f"quota: user {ALICE} may hold 1 lease; holds 1"
    assert alice.ok("cancel", key="lease2") is True
    alice.ok("request", key="lease2-as-a-run", kind="run", vram_mb=8000)
    tag = alice.send("request", key="lease3-as-a-run", kind="run", vram_mb=8000)
    view = wait_for_view(ledger, lambda v: v["waiting"])
    assert view["waiting"][0]["reason"] == f"quota: user {ALICE} may hold 20000 MB of VRAM; holds 16000 MB"
    assert not alice.done(tag)


# ---------------------------------------------------------------------- 3: one key twice in a reclaim


@pytest.mark.parametrize("ledger_config", [LOST_STATE])
def test_a_reclaim_that_tells_one_key_or_one_grant_twice_is_kept_once(users, ledger, agents):
    """After a restart that lost the state, a tenant re-tells its grants: a key twice (two grants
    under one key: a retry under it would be answered with one and the other held for nothing),
    or one grant twice with other VRAM (the second said kept, the first held), is kept once."""
    alice = agents("alice")
    run = alice.ok("spawn")
    _lose_state(ledger)
    alice.ok("connect")
    told = [
        _told("a" * 16, "k", [0], 4000, run),
        _told("b" * 16, "k", [1], 4000, run),  # another grant under the same key
        _told("a" * 16, "k", [0], 12000, run),  # the first again, bigger
    ]
    answer = alice.ok("raw", message={"op": "reclaim", "grants": told})
    assert [g["id"] for g in answer.get("kept", [])] == ["a" * 16], answer
    refused = {(r["id"], r["error"]) for r in answer["refused"]}
    assert refused == {("b" * 16, "key_in_use"), ("a" * 16, "duplicate")}, answer
    view = ledger.view()
    assert grant_ids(view) == {"a" * 16} and [d["allocated_mb"] for d in view["devices"]] == [4000, 0]
    # A key the ledger already holds for the user, re-told under another grant's id, is refused too.
    again = alice.ok("raw", message={"op": "reclaim", "grants": [_told("c" * 16, "k", [1], 1000, run)]})
    assert again["kept"] == [] and again["refused"][0]["error"] == "key_in_use", again
    alice.ok("kill", pid=run)


# ---------------------------------------------------------------------- 5: re-told whole GPUs and 0 MB


@pytest.mark.parametrize("ledger_config", [LOST_STATE])
def test_re_told_exclusive_and_0_mb_grants_are_learnt_as_far_as_the_vram_holds(users, ledger, agents):
    """A ledger of an earlier version granted a whole GPU beside 0 MB shares of it (it does not
    now: an exclusive grant waits for a GPU no grant holds). Restarted with its state lost, the
    ledger learns them back, in either order, as they fit in VRAM; a share that takes VRAM on
    that GPU does not fit, and nothing new is placed beside the whole GPU."""
    alice, bob = agents("alice"), agents("bob")
    a_run, b_run = alice.ok("spawn"), bob.ok("spawn")
    _lose_state(ledger)
    alice.ok("connect")
    bob.ok("connect")
    zero = bob.ok("raw", message={"op": "reclaim", "grants": [_told("b" * 16, "b0", [0], 0, b_run)]})
    assert [g["id"] for g in zero["kept"]] == ["b" * 16], zero
    whole = [_told("a" * 16, "whole", [0], 0, a_run, exclusive=True), _told("c" * 16, "a0", [0], 0, a_run)]
    answer = alice.ok("raw", message={"op": "reclaim", "grants": whole})
    assert [g["id"] for g in answer["kept"]] == ["a" * 16, "c" * 16], answer
    taking = bob.ok("raw", message={"op": "reclaim", "grants": [_told("d" * 16, "b1", [0], 1, b_run)]})
    assert taking["kept"] == [] and taking["refused"][0]["error"] == "does_not_fit", taking
    view = ledger.view()
    assert grant_ids(view) == {"a" * 16, "b" * 16, "c" * 16}
    assert view["devices"][0]["allocated_mb"] == 24000 and view["devices"][0]["exclusive"] is True
    for agent, run in ((alice, a_run), (bob, b_run)):
        agent.ok("kill", pid=run)


# ---------------------------------------------------------------------- 4: turns


@pytest.mark.parametrize("ledger_config", [{"virtual_gpus": [24000], "reclaim_window_s": 0}])
def test_asks_deferred_again_and_again_tell_the_other_user_one_turn(users, ledger, agents):
    """Alice asks again and again while bob (holding less) has told demand for the room: each ask
    is refused for bob's turn, and bob's server is told its turn once, not once per ask.

    Whatever the time the asks take: should bob's turn (TURN_S from the first refusal) pass
    meanwhile, bob's demand is set aside and alice's later asks are answered (granted, or busy
    for want of room) without his turn, telling him none: one turn is all bob is ever told."""
    alice, bob = agents("alice"), agents("bob")
    alice.ok("request", key="a0", vram_mb=4000)
    assert bob.ok("demand", asks=[{"vram_mb": 16000}]) == 1
    answers = [alice.ok("request", key=f"a{i + 1}", vram_mb=12000, wait=False) for i in range(4)]
    for_bob = [a.get("state") == "busy" and a["reason"].startswith(f"fair share: user {BOB}") for a in answers]
    assert for_bob[0] and for_bob == sorted(for_bob, reverse=True), answers  # refused for bob's turn, then not
    alice.ok("view")  # (every answer and event before it has been sent)
    assert bob.ok("view")["user"] == BOB
    assert bob.ok("events").count("turn") == 1, (answers, bob.ok("events"))


# ---------------------------------------------------------------------- the pure parts, in-process


def test_a_uids_quota_is_the_strictest_of_each_limit_set_under_its_names():
    from jupyter_evalsched.host_ledger.config import parse_config
    from jupyter_evalsched.host_ledger.policy import Quota

    config = parse_config(
        {"quota": {"default": {"vram_mb": 1}, "a": {"vram_mb": 20000, "leases": 2}, "a2": {"gpus": 1, "leases": 1}}}
    )
    assert config.quota_of(["a", "a2"]) == Quota(vram_mb=20000, gpus=1, leases=1)
    assert config.quota_of(["a"]) == Quota(vram_mb=20000, leases=2)
    assert config.quota_of(["nobody"]) == Quota(vram_mb=1)


def test_a_re_told_grant_is_learnt_as_held_in_vram_and_quota():
    from jupyter_evalsched.host_ledger.policy import Ask, Holding, HostDevice, Quota, retold_reason

    devices = {0: HostDevice(0, 24000), 1: HostDevice(1, 24000)}
    shares = [Holding("bob", (0,), 0)]
    whole = Ask("alice", 0, 1, exclusive=True, devices=(0,))
    assert retold_reason(whole, devices, shares, Quota()) == ""
    assert retold_reason(Ask("bob", 0, devices=(0,)), devices, [Holding("alice", (0,), 0, True)], Quota()) == ""
    taking = retold_reason(Ask("bob", 1, devices=(0,)), devices, [Holding("alice", (0,), 0, True)], Quota())
    assert taking.startswith("needs 1 MB on 1 GPU; GPU 0 has 0 MB free"), taking
    over = retold_reason(whole, devices, [Holding("alice", (1,), 4000)], Quota(vram_mb=24000))
    assert over == "quota: user alice may hold 24000 MB of VRAM; holds 4000 MB"


# ---------------------------------------------------------------------- quotas' names, looked up off the loop

QUOTA_NAME = PREFIX + "rootquota"  # a name only the test's directory gives this process's uid


class Directory:
    """The host's directory by name, as the ledger's ``uid_named`` asks it: the test says what it
    answers (``down``: every lookup fails, as a directory service that times out), and counts the
    lookups and the threads they ran on."""

    def __init__(self, answers: dict[str, int]) -> None:
        self.answers, self.down, self.calls, self.threads = answers, False, 0, set()

    def __call__(self, name: str) -> int | None:
        import threading

        self.calls += 1
        self.threads.add(threading.get_ident())
        if self.down:
            raise OSError("the directory service timed out")
        return self.answers.get(name)


def _in_process_ledger(tmp_path, quota: dict, directory: Directory):
    from jupyter_evalsched.host_ledger.config import parse_config
    from jupyter_evalsched.host_ledger.server import HostLedger

    server = HostLedger(parse_config({"virtual_gpus": [24000], "quota": quota}), str(tmp_path / "ledger.sock"))
    server.uid_named = directory
    return server


async def _quota_told(socket_path: str) -> tuple[int | None, str]:
    """A new connection's quota as the ledger tells it, and why an 8000 MB ask is refused ("": granted)."""
    from jupyter_evalsched.host_ledger.client import HostLedgerClient, NeverFits

    client = HostLedgerClient(socket_path)
    try:
        await client.connect()
        quota = (await client.view())["quota"]["vram_mb"]
        try:
            grant = await client.request("probe", 8000, wait=False)
            await client.release(grant["grant"]["id"])
            return quota, ""
        except NeverFits as exc:
            return quota, str(exc)
    finally:
        await client.close()


def test_a_failed_lookup_of_a_quotas_name_keeps_the_quota_learnt(tmp_path):
    """The directory cannot answer when the ledger starts (the default quota holds), answers at
    the next pass (the named quota holds, for every connection from then on), then fails again, or
    no longer knows the name (the user renamed): the quota learnt holds, never the default."""
    import asyncio

    directory = Directory({QUOTA_NAME: os.getuid()})
    directory.down = True
    quota = {"default": {"vram_mb": 24000}, QUOTA_NAME: {"vram_mb": 4000}}
    server = _in_process_ledger(tmp_path, quota, directory)

    async def go() -> None:
        await server.start()
        try:
            assert await _quota_told(server.socket_path) == (24000, "")
            directory.down = False
            await server._learn_quota_names()  # (the pass the ledger makes every QUOTA_NAMES_S)
            told, why = await _quota_told(server.socket_path)
            assert told == 4000 and "may hold 4000 MB" in why, (told, why)
            directory.down = True
            await server._learn_quota_names()
            assert (await _quota_told(server.socket_path))[0] == 4000
            directory.down, directory.answers = False, {}  # renamed: the name is no one's now
            await server._learn_quota_names()
            assert (await _quota_told(server.socket_path))[0] == 4000
        finally:
            await server.stop()

    asyncio.run(go())


def test_a_connection_looks_nothing_up_by_name(tmp_path, monkeypatch):
    """The quotas' names are looked up off the loop (at start, then on a timer), never as a user
    connects: any local user may connect in a loop, and 1000 names cost 70 ms of lookups."""
    import asyncio
    import threading

    from jupyter_evalsched.host_ledger import procs

    names = {f"{PREFIX}nobody{i}": {"vram_mb": 1000} for i in range(200)}
    directory = Directory({QUOTA_NAME: os.getuid()})
    server = _in_process_ledger(tmp_path, {**names, QUOTA_NAME: {"vram_mb": 4000}}, directory)
    by_uid = []
    user_name = procs.user_name
    monkeypatch.setattr(procs, "user_name", lambda uid: by_uid.append(uid) or user_name(uid))

    async def go() -> None:
        await server.start()
        try:
            assert directory.calls == len(names) + 1
            for _ in range(5):
                assert (await _quota_told(server.socket_path))[0] == 4000
        finally:
            await server.stop()

    asyncio.run(go())
    assert directory.calls == len(names) + 1, "a connection looked a quota's name up"
    assert by_uid == [os.getuid()], by_uid  # this uid's name: once for the ledger's life
    assert threading.get_ident() not in directory.threads  # (nor on the loop's thread)


def test_a_uid_learns_quota_names_and_loses_none_to_a_failed_lookup():
    from jupyter_evalsched.host_ledger.policy import quota_names_learnt

    learnt = quota_names_learnt({}, {"a": 1, "b": None})
    assert learnt == {1: frozenset({"a"})}
    assert quota_names_learnt(learnt, {"a": None, "b": None}) == learnt  # the directory down
    assert quota_names_learnt(learnt, {"a": 2}) == {1: frozenset({"a"}), 2: frozenset({"a"})}  # taken over
    assert quota_names_learnt(learnt, {"a2": 1}) == {1: frozenset({"a", "a2"})}


def test_the_admin_groups_members_are_looked_up_off_the_loop_once_a_while(tmp_path, monkeypatch):
    """Whether a connecting user is in ``admin_group`` may come from a directory service: it is
    looked up in a thread, and again only after QUOTA_NAMES_S, however often the user connects."""
    import asyncio
    import threading

    from jupyter_evalsched.host_ledger import procs
    from jupyter_evalsched.host_ledger import server as ledger_server
    from jupyter_evalsched.host_ledger.config import parse_config
    from jupyter_evalsched.host_ledger.server import HostLedger

    ledger = HostLedger(
        parse_config({"virtual_gpus": [24000], "admin_group": "evhl-admins"}), str(tmp_path / "ledger.sock")
    )
    looked_up: list[tuple[int, str, int]] = []

    def in_group(uid: int, group: str) -> bool:
        looked_up.append((uid, group, threading.get_ident()))
        return uid == 4242

    monkeypatch.setattr(procs, "in_group", in_group)
    clock = [1000.0]
    monkeypatch.setattr(ledger_server.time, "monotonic", lambda: clock[0])

    async def go() -> list[bool]:
        answers = [await ledger._is_admin(uid) for uid in (4242, 4243, 4242, 4243, 0)]
        clock[0] += ledger_server.QUOTA_NAMES_S  # a minute on: looked up anew
        answers.append(await ledger._is_admin(4242))
        return answers

    loop_thread = threading.get_ident()
    assert asyncio.run(go()) == [True, False, True, False, True, True]
    assert [(uid, group) for uid, group, _ in looked_up] == [
        (4242, "evhl-admins"),
        (4243, "evhl-admins"),
        (4242, "evhl-admins"),
    ]
    assert all(thread != loop_thread for _, _, thread in looked_up)
