"""Leases that end (#30, medium 7): a lease's pid must be a process that ends (not pid 1, not the
server, not an ancestor of it, not another user's); a lease without a pid is held at most
max_lease_ttl_s; at most max_leases are live at once."""

from __future__ import annotations

import os
import pwd
import subprocess
import sys

import pytest
from waiting import async_wait_until

from jupyter_evalsched.contract import LEASE_GRANTED
from jupyter_evalsched.schemas import LeaseRecord, utcnow_iso
from jupyter_evalsched.store import RunStore

MAX_TTL_S = 1.5
MAX_LEASES = 3


@pytest.fixture
def evalsched_config():
    return {"max_lease_ttl_s": MAX_TTL_S, "max_leases": MAX_LEASES}


async def refused(api, body: dict, field: str, words: str) -> dict:
    code, err = await api("POST", "leases", body)
    assert code == 422, err
    assert err["message"].startswith(f"{field}: ") and words in err["message"], err
    assert [d["loc"] for d in err["detail"]] == [[field]], err
    code, live = await api("GET", "leases")
    assert live["leases"] == [], live
    return err


async def ended(api, lease_id: str, timeout: float = 20.0) -> dict:
    async def done():
        code, rec = await api("GET", f"leases/{lease_id}")
        assert code == 200, rec
        return rec if rec["state"] == "ended" else None

    return await async_wait_until(done, timeout=timeout)


# --------------------------------------------------------------------------- whose pid


async def test_pid_1_cannot_hold_a_lease(api):
    err = await refused(api, {"vram_mb": 1000, "pid": 1}, "pid", "pid 1 (init) never exits")
    assert err["detail"][0]["type"] == "pid_refused"


async def test_the_servers_own_pid_cannot_hold_a_lease(api):
    # pytest-jupyter runs the server in this process.
    await refused(api, {"vram_mb": 1000, "pid": os.getpid()}, "pid", "is this server itself")


def test_an_ancestor_of_the_server_above_its_parent_cannot_hold_a_lease():
    """The rule as a server two levels below this test process applies it: this process is its
    grandparent (refused), the intermediate process its parent (allowed). Checked in a grandchild,
    so that it holds wherever the test suite itself was started from."""
    probe = (
        "import os, sys, subprocess\n"
        "inner = 'from jupyter_evalsched.scheduler.leases import refused_holder; import os; '"
        " 'print(refused_holder(%d)); print(refused_holder(os.getppid()))' % int(sys.argv[1])\n"
        "sys.stdout.write(subprocess.run([sys.executable, '-c', inner], capture_output=True, text=True, check=True).stdout)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe, str(os.getpid())], capture_output=True, text=True, check=True
    ).stdout.splitlines()
    assert "pid_refused" in out[0] and "is an ancestor of this server" in out[0], out
    assert out[1] == "None", out  # the parent may hold a lease


def other_user() -> str | None:
    try:
        pwd.getpwnam("nobody")
    except KeyError:
        return None
    return "nobody" if os.geteuid() == 0 else None


async def test_a_process_of_another_user_cannot_hold_a_lease(api):
    # (This project's machines and CI run as root and have 'nobody': a skip would prove nothing.)
    assert other_user() is not None, "this test starts a process as another user: run the suite as root"
    proc = subprocess.Popen(["sleep", "60"], user=other_user())
    try:
        await refused(api, {"vram_mb": 1000, "pid": proc.pid}, "pid", "belongs to another user")
    finally:
        proc.kill()
        proc.wait()


async def test_a_process_of_the_servers_user_may(api, holder):
    # The server's parent may hold one too: checked in a grandchild above, since this process's
    # own parent is whatever started the suite (init, when it was started detached).
    code, rec = await api("POST", "leases", {"vram_mb": 1000, "pid": holder().pid, "ttl_s": 7200})
    assert code == 201 and rec["state"] == "granted", rec
    assert rec["ttl_s"] == 7200, "a lease with a pid is not held to max_lease_ttl_s"
    code, _ = await api("DELETE", f"leases/{rec['id']}")
    assert code == 204


async def test_a_pid_that_is_gone_is_still_no_such_process(api, holder):
    proc = holder()
    proc.kill()
    proc.wait()
    err = await refused(api, {"vram_mb": 1000, "pid": proc.pid}, "pid", f"no live process with pid {proc.pid}")
    assert err["detail"][0]["type"] == "no_such_process"


# --------------------------------------------------------------------------- without a pid


async def test_a_lease_without_pid_or_ttl_gets_the_max_ttl_and_ends(api):
    code, rec = await api("POST", "leases", {"vram_mb": 1000, "label": "forgotten"})
    assert code == 201 and rec["state"] == "granted", rec
    assert rec["pid"] is None and rec["ttl_s"] == MAX_TTL_S, rec
    done = await ended(api, rec["id"])
    assert done["reason"].startswith("ttl_expired"), done
    code, live = await api("GET", "leases")
    assert live["leases"] == []


async def test_a_lease_without_pid_may_not_ask_for_more_than_the_max_ttl(api):
    err = await refused(api, {"vram_mb": 1000, "ttl_s": MAX_TTL_S + 1}, "ttl_s", "max_lease_ttl_s=1.5 s")
    assert err["detail"][0]["type"] == "ttl_over_max"
    code, rec = await api("POST", "leases", {"vram_mb": 1000, "ttl_s": MAX_TTL_S / 2})
    assert code == 201 and rec["ttl_s"] == MAX_TTL_S / 2, rec
    await api("DELETE", f"leases/{rec['id']}")


@pytest.fixture
def planted_lease(runs_dir) -> str:
    """A granted lease without pid or ttl, as an earlier server (before max_lease_ttl_s) left it,
    written before the test's server starts."""
    lease_id = "lease-20260101T000000.000000-abcdef"
    record = LeaseRecord(
        id=lease_id,
        state=LEASE_GRANTED,
        vram_mb=1000,
        gpus=1,
        exclusive_gpu=False,
        priority="high",
        pid=None,
        label="old",
        ttl_s=None,
        devices=[0],
        cuda_visible_devices="0",
        requested_at=utcnow_iso(),
        granted_at=utcnow_iso(),
        seq=1,
    ).model_dump(mode="json")
    runs_dir.mkdir(parents=True, exist_ok=True)
    RunStore(runs_dir).write_lease(lease_id, record)
    return lease_id


async def test_a_recovered_lease_without_pid_or_ttl_gets_the_max_ttl(planted_lease, api):
    code, rec = await api("GET", f"leases/{planted_lease}")
    assert code == 200 and rec["ttl_s"] == MAX_TTL_S, rec
    done = await ended(api, planted_lease)
    assert done["reason"].startswith("ttl_expired"), done


# --------------------------------------------------------------------------- how many


async def test_live_leases_are_capped_per_server(api, holder):
    proc = holder()
    held = []
    for i in range(MAX_LEASES):
        code, rec = await api("POST", "leases", {"vram_mb": 100, "pid": proc.pid, "label": f"l{i}"})
        assert code == 201, rec
        held.append(rec["id"])
    code, err = await api("POST", "leases", {"vram_mb": 100, "pid": proc.pid, "label": "one more"})
    assert code == 409, err
    assert f"this server holds {MAX_LEASES} live leases (max_leases)" in err["message"], err
    code, live = await api("GET", "leases")
    assert [item["id"] for item in live["leases"]] == held
    await api("DELETE", f"leases/{held[0]}")
    code, rec = await api("POST", "leases", {"vram_mb": 100, "pid": proc.pid, "label": "after a release"})
    assert code == 201, rec
