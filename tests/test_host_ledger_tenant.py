"""Issue #32: a server's link to the host ledger (host_ledger/tenant.py), against a real ledger
served in the same event loop, as root (the cross-user cases are in test_host_ledger.py)."""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import subprocess
from pathlib import Path

import pytest

from jupyter_evalsched.host_ledger import procs, tenant
from jupyter_evalsched.host_ledger.config import parse_config
from jupyter_evalsched.host_ledger.server import HostLedger
from jupyter_evalsched.host_ledger.tenant import HostLedgerUnavailable, NeverFits, TenantLink

pytestmark = pytest.mark.timeout(60)


async def until(predicate, timeout: float = 10.0):
    deadline = asyncio.get_running_loop().time() + timeout
    while not (value := predicate()):
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)
    return value


def test_the_link_grants_tells_why_not_and_survives_a_ledger_restart(tmp_path):
    path = str(tmp_path / "ledger.sock")
    config = parse_config({"virtual_gpus": [24000], "reclaim_window_s": 30})

    async def go() -> None:
        ledger = HostLedger(config, path)
        await ledger.start()
        changes = []
        link = TenantLink(path, tenant="test", refresh_s=0.2, on_change=lambda: changes.append(1))
        await link.start()
        try:
            await until(lambda: link.view is not None)
            assert link.status() == {"socket": path, "connected": True, "user": "root", "error": None}
            kept = await link.try_grant("run-1", 20000, [0])
            assert isinstance(kept, dict) and kept["devices"] == [0]
            why = await link.try_grant("run-2", 8000, [0])
            assert isinstance(why, str) and "user root holds 20000 MB on GPU 0" in why
            with pytest.raises(NeverFits):
                await link.try_grant("run-3", 30000, [0])
            released = await link.try_grant("run-4", 2000, [0])
            assert isinstance(released, dict)

            await ledger.stop()  # down: the link says so, and gives no grant
            await until(lambda: not link.connected and link.status()["error"])
            assert link.view is None and changes
            with pytest.raises(HostLedgerUnavailable):
                await link.try_grant("run-5", 1000, [0])
            await link.release(released["id"])  # kept until the ledger is back

            ledger = HostLedger(config, path)
            await ledger.start()  # its state file names this tenant: it waits for its re-telling
            assert ledger.reclaim_open()
            await until(lambda: link.connected and link.view is not None and not link.view["reclaiming"])
            assert [g["id"] for g in link.view["grants"]] == [kept["id"]]
            assert link.status()["error"] is None and not link._to_release
        finally:
            await link.stop()
            await ledger.stop()

    asyncio.run(go())


def _saved_grant(grant_id: str, key: str, vram_mb: int, pid: int) -> dict:
    """A grant as a ledger's state file keeps it, tied to the live process ``pid`` of root."""
    proc = procs.owned(pid, 0)
    assert proc is not None
    return {
        "id": grant_id, "uid": 0, "key": key, "kind": "run", "devices": [0], "vram_mb": vram_mb,
        "exclusive": False, "pids": [proc.as_json()],
    }  # fmt: skip


def test_a_grant_the_restarted_ledger_refuses_when_re_told_is_said_and_asked_for_anew(tmp_path, caplog, monkeypatch):
    """The ledger restarts with a state older than the grant (a save lost to a power loss, say):
    the link re-tells the grant, and the ledger, which read its state and so knows every grant it
    made, refuses it. Said in the log with the ledger's reason; the run goes on without a grant
    (said too) while another grant holds the room, and once there is room it is asked for anew
    under its key for its process, the old id standing for the new grant."""
    monkeypatch.setattr(tenant, "REGRANT_S", 0.2)
    caplog.set_level(logging.INFO)
    path = str(tmp_path / "ledger.sock")
    config = parse_config({"virtual_gpus": [24000], "reclaim_window_s": 30})

    def said(*words: str) -> list[str]:
        return [
            r.getMessage()
            for r in caplog.records
            if r.levelno >= logging.WARNING and all(w in r.getMessage() for w in words)
        ]

    async def go() -> None:
        run, other = (subprocess.Popen(["sleep", "600"]) for _ in range(2))
        ledger = HostLedger(config, path)
        await ledger.start()
        link = TenantLink(path, tenant="test", refresh_s=0.2, max_backoff_s=0.2)
        await link.start()
        try:
            await until(lambda: link.view is not None)
            held = await link.try_grant("run-1", 20000, [0], pids=[run.pid])
            assert isinstance(held, dict)
            await ledger.stop()
            state = {"tenants": [], "grants": [_saved_grant("b" * 16, "other", 10000, other.pid)]}
            Path(ledger.state_file).write_text(json.dumps(state))
            ledger = HostLedger(config, path)
            await ledger.start()
            assert not ledger.reclaim_open() and list(ledger.grants) == ["b" * 16]

            await until(lambda: said(held["id"], "refused"))
            (refused,) = said(held["id"], "refused")
            assert f"user root holds no grant '{held['id']}'" in refused and "(unknown_grant)" in refused, refused
            assert said("'run-1' runs without a host ledger grant")
            assert list(link.lost) == [held["id"]] and held["id"] not in link.client.grants
            assert list(ledger.grants) == ["b" * 16]  # (no room for it beside the other)

            other.kill()  # the other grant ends: room for the run's again
            again = await until(lambda: [g for g in ledger.grants.values() if g.key == "run-1"])
            assert again[0].id != held["id"] and again[0].vram_mb == 20000 and again[0].devices == (0,)
            assert [p.pid for p in again[0].procs] == [run.pid]
            await until(lambda: not link.lost)  # (once the link has the answer)
            await link.release(held["id"])  # (the id the scheduler knows)
            await until(lambda: not ledger.grants)
        finally:
            for proc in (run, other):
                proc.kill()
                proc.wait()
            await link.stop()
            await ledger.stop()

    asyncio.run(go())


def test_a_link_whose_re_telling_the_ledger_cannot_save_connects_again_and_re_tells(tmp_path):
    """A restarted ledger that cannot save the grants re-told (a full disk) answers the reclaim
    ``internal``, and makes none of it: the link is then not connected (it would otherwise stay
    on that connection for good, its grants never re-told, its status an error), and connects
    and re-tells them once the ledger can save them."""
    path = str(tmp_path / "ledger.sock")
    config = parse_config({"virtual_gpus": [24000], "reclaim_window_s": 30})

    async def go() -> None:
        ledger = HostLedger(config, path)
        await ledger.start()
        link = TenantLink(path, tenant="test", refresh_s=0.2, max_backoff_s=0.2)
        await link.start()
        try:
            await until(lambda: link.view is not None)
            held = await link.try_grant("run-1", 20000, [0])
            assert isinstance(held, dict)
            await ledger.stop()

            ledger = HostLedger(config, path)
            full = [True]
            save = ledger._save_state

            def full_disk(grants=None) -> None:
                if full[0]:
                    raise OSError(errno.ENOSPC, "No space left on device")
                save(grants)

            ledger._save_state = full_disk  # type: ignore[method-assign]
            await ledger.start()
            assert ledger.reclaim_open()  # its state names the link's server: it waits for it
            await until(
                lambda: "cannot save its state (No space left on device (ENOSPC))" in str(link.status()["error"])
            )
            assert link.status()["connected"] is False and held["id"] in link.client.grants
            full[0] = False
            await until(lambda: link.status()["connected"] and not ledger.reclaim_open())
            assert link.status()["error"] is None and list(link.client.grants) == [held["id"]]
            assert ledger.grants[held["id"]].conn is not None and not link.lost
        finally:
            await link.stop()
            await ledger.stop()

    asyncio.run(go())


def _with_view_wrapped(tmp_path, wrap, check) -> None:
    """A link to a real ledger (in this loop) whose views are read through ``wrap(view)``;
    ``await check(link, path)`` while it runs."""
    path = str(tmp_path / "ledger.sock")

    async def go() -> None:
        ledger = HostLedger(parse_config({"virtual_gpus": [24000]}), path)
        await ledger.start()
        link = TenantLink(path, tenant="test", refresh_s=0.2)
        link.client.view = wrap(link.client.view)
        await link.start()
        try:
            await check(link, path)
        finally:
            await link.stop()
            await ledger.stop()

    asyncio.run(go())


def test_the_link_is_connected_in_its_status_only_once_it_has_read_the_hosts_view(tmp_path):
    # Until the first view, the link knows no quota: a request that can never fit is taken as one
    # that could. Its status said connected from the hello on (a test's submission in that gap
    # was a 201 where the quota made it a 422).
    first_view = asyncio.Event()

    def held(view):
        async def held_view():
            await first_view.wait()
            return await view()

        return held_view

    async def check(link, path):
        await until(lambda: link.connected and link.user)
        status = link.status()
        assert status["connected"] is False, status
        assert status["error"] == "connected; reading the host ledger's first view"
        first_view.set()
        await until(lambda: link.view is not None)
        assert link.status() == {"socket": path, "connected": True, "user": "root", "error": None}

    _with_view_wrapped(tmp_path, held, check)


def test_a_view_that_failed_once_on_a_kept_connection_is_connected_again_once_read(tmp_path):
    # An error of the ledger's own (``internal``) on a view keeps the connection: the next view
    # read is the link back. Its error was cleared only by a new connection: the status said
    # "not connected" for good while GPU work went on.
    failures = []

    def fails_once(view):
        async def failing_view():
            if not failures:
                failures.append(1)
                raise tenant.HostLedgerError("internal", "the view could not be made")
            return await view()

        return failing_view

    async def check(link, path):
        await until(lambda: failures and link.view is not None)
        assert link.client.connected
        assert link.status() == {"socket": path, "connected": True, "user": "root", "error": None}

    _with_view_wrapped(tmp_path, fails_once, check)
