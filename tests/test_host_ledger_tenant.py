"""Issue #32: a server's link to the host ledger (host_ledger/tenant.py), against a real ledger
served in the same event loop, as root (the cross-user cases are in test_host_ledger.py)."""

from __future__ import annotations

import asyncio

import pytest

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
