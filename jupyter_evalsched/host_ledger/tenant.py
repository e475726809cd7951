"""A user's server as a tenant of the host ledger: one long-lived link that stays connected
(re-telling its grants whenever it connects again), keeps the host's view fresh, and asks for
grants without waiting, so that the scheduler's own admission decides and the ledger only says
yes or why not.

What the scheduler gets: :meth:`TenantLink.status` (``{"socket", "connected", "user", "error"}``
for ``GET /evalsched/status`` and ``doctor``), :attr:`TenantLink.view` (the host's view for this
user: each device's usable VRAM and the other users' holdings by name), :meth:`try_grant`
(a grant, or the reason it is not granted now; :class:`NeverFits` for a 422), :meth:`retie` and
:meth:`release` (kept and sent again while the ledger is down, or cannot save it), and
:attr:`TenantLink.lost` (grants the ledger refused when re-told, asked for anew until granted).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

from .client import HostLedgerClient, HostLedgerError, HostLedgerUnavailable, NeverFits

log = logging.getLogger(__name__)

__all__ = ["HostLedgerUnavailable", "NeverFits", "TenantLink"]

STOP_S = 6.0  # the keeper's longest wait (its backoff) and then some

# A demand the ledger set aside (its turn not taken) is told again after this long, if still queued.
DEMAND_RETELL_S = 30.0
# A grant the ledger refused when re-told is asked for anew this often until granted (each ask
# that does not fit may tell another user its fair-share turn: not at every keeper's pass).
REGRANT_S = 5.0
# Refusals of a re-told grant after which there is nothing to ask for anew: its processes are
# gone or not the user's (not_yours), or the re-telling was malformed.
GONE_CODES = frozenset({"not_yours", "bad_request"})


class TenantLink:
    def __init__(
        self,
        socket_path: str,
        tenant: str = "",
        refresh_s: float = 1.0,
        max_backoff_s: float = 5.0,
        on_change: Callable[[], None] | None = None,
    ) -> None:
        self.socket_path = socket_path
        self.client = HostLedgerClient(socket_path, tenant=tenant, on_event=self._on_event)
        self.refresh_s = refresh_s
        self.max_backoff_s = max_backoff_s
        self.on_change = on_change  # the host changed (a grant ended, the view moved): admit again
        self.user: str | None = None
        self.error: str | None = "not connected yet"
        self.view: dict[str, Any] | None = None
        self._to_release: set[str] = set()
        # Grants the ledger refused when this link re-told them (it restarted, and does not know
        # them or they no longer fit): held no more, asked for anew under their keys for their
        # processes (grant id -> the grant as it was); and, once granted again, the old id -> the
        # new one (the scheduler releases or re-ties by the id it knows).
        self.lost: dict[str, dict[str, Any]] = {}
        self._renamed: dict[str, str] = {}
        self._regrant_at = 0.0
        self._demand: list[dict[str, Any]] = []  # this server's queued GPU work, as asks
        self._demand_told: list[dict[str, Any]] | None = None  # what the ledger was last told
        self._demand_told_at = 0.0
        self._task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self._stopping = False

    @property
    def connected(self) -> bool:
        return self.client.connected

    def status(self) -> dict[str, Any]:
        # Connected once the hello is answered and the first view read: the socket alone, a moment
        # earlier, has no user yet, and until the view GPU work waits and quotas are unknown (a
        # request that can never fit was taken as one that could).
        connected = self.connected and self.error is None and self.view is not None
        if connected:
            error = None
        elif self.error is None and self.connected:
            error = "connected; reading the host ledger's first view"
        else:  # lost between two of the keeper's passes: not connected, and says so before it notices
            error = self.error or "the connection to the host ledger was lost"
        return {"socket": self.socket_path, "connected": connected, "user": self.user, "error": error}

    async def start(self) -> None:
        self._task = asyncio.create_task(self._keep_connected())

    async def stop(self) -> None:
        # The flag as well as the cancel: Python 3.11's wait_for can lose a cancel that lands as a
        # connect attempt ends, and the keeper would go on for ever (a server that never stops).
        self._stopping = True
        self._wake.set()
        if self._task is not None:
            self._task.cancel()
            await asyncio.wait({self._task}, timeout=STOP_S)
        await self.client.close()

    async def _keep_connected(self) -> None:
        backoff = 0.1
        while not self._stopping:
            if not self.connected:
                try:
                    hello = await self.client.connect()
                except HostLedgerError as exc:
                    self._lost(exc.reason)
                    await asyncio.sleep(backoff)
                    backoff = min(self.max_backoff_s, backoff * 2)
                    continue
                backoff = 0.1
                # (the last connection's view is no view of this one: GPU work waits for its own)
                self.user, self.error, self.view = hello["user"], None, None
                self._demand_told = None  # a new connection knows nothing of it
                self._refused_when_retold()
            if self._to_release:  # (after a connect, or a release the ledger could not make)
                await self._release_pending()
            try:
                await self._regrant_lost()
                await self._tell_demand()
                await self.refresh()
            except HostLedgerError as exc:
                self._lost(exc.reason)
                continue
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.refresh_s)

    def _lost(self, why: str) -> None:
        changed = self.error != why
        self.error, self.view = why, None
        if changed:
            log.warning("host ledger %s: %s", self.socket_path, why)
            self._changed()

    def _refused_when_retold(self) -> None:
        """The grants the ledger refused as this connection re-told them (the client said each in
        the log): their VRAM is held no more. Each whose processes may live is asked for anew."""
        for item in self.client.refused:
            grant = item["grant"]
            if item["error"] in GONE_CODES:
                continue
            log.warning(
                "host ledger %s: %s %r runs without a host ledger grant until one is granted again (asked anew "
                "every %g s)",
                self.socket_path,
                grant.get("kind"),
                grant.get("key"),
                REGRANT_S,
            )
            self.lost[grant["id"]] = grant
            self._regrant_at = 0.0  # (at once)
        if self.client.refused:
            self._changed()

    async def _regrant_lost(self) -> None:
        """Ask anew for the lost grants (see ``lost``): under the same key, the same ask, for the
        same processes, without waiting; the ledger's policy decides as for any request."""
        if not self.lost or time.monotonic() < self._regrant_at:
            return
        self._regrant_at = time.monotonic() + REGRANT_S
        for old_id, grant in list(self.lost.items()):
            pids = [p["pid"] for p in grant["pids"]]
            try:
                answer = await self.client.request(
                    grant["key"],
                    grant["vram_mb"],
                    gpus=len(grant["devices"]),
                    exclusive=grant["exclusive"],
                    kind=grant["kind"],
                    devices=list(grant["devices"]),
                    pids=pids,
                    wait=False,
                )
            except HostLedgerUnavailable:
                raise
            except HostLedgerError as exc:
                if exc.code == "internal":
                    continue  # (the ledger could not answer now: asked again later)
                # Never, its processes gone (not_yours), its key taken by another ask: nothing to ask.
                log.warning(
                    "host ledger %s: %s %r is not asked for again: %s (%s)",
                    self.socket_path,
                    grant["kind"],
                    grant["key"],
                    exc.reason,
                    exc.code,
                )
                self.lost.pop(old_id, None)
                continue
            if answer.get("state") != "granted":
                continue  # (no room now: the run goes on without a grant, asked again later)
            new_id = answer["grant"]["id"]
            now = self.lost.pop(old_id, None)
            if now is None:  # released while asked: its use is over
                await self.release(new_id)
                continue
            self._renamed[old_id] = new_id
            log.info(
                "host ledger %s: %s %r granted again (grant %s)", self.socket_path, grant["kind"], grant["key"], new_id
            )
            told = [p["pid"] for p in now["pids"]]
            if told != pids:  # re-tied while asked: tied to those processes now
                with contextlib.suppress(HostLedgerError):
                    await self.client.retie(new_id, told)
            self._changed()

    async def refresh(self) -> None:
        view = await self.client.view()
        told = [d for d in view.get("demand", []) if d.get("user") == self.user]
        if self._demand and not told and time.monotonic() - self._demand_told_at >= DEMAND_RETELL_S:
            # Set aside by the ledger (a turn this server did not take), and still queued: tell it
            # again, now and then, so that a queue that does not change keeps its fair share.
            self._demand_told = None
        if view != self.view:
            # (an error lost the last view, the connection kept: read again, the link is back)
            self.view, self.error = view, None
            self._changed()

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change()

    def _on_event(self, event: dict[str, Any]) -> None:
        self._wake.set()  # a grant ended, a reason moved: refresh the view now
        if event.get("event") in ("turn", "retry"):
            # Fair share: this user's turn (room kept for its queued work), or its deferred ask
            # may go again. The scheduler looks again even if the view did not move.
            self._changed()

    def set_demand(self, asks: list[dict[str, Any]]) -> None:
        """The GPU work queued at this server now (told to the ledger when it changed)."""
        asks = asks[:16]
        if asks != self._demand:
            self._demand = asks
            self._wake.set()

    async def _tell_demand(self) -> None:
        if self._demand != self._demand_told:
            demand = list(self._demand)
            try:
                await self.client.demand(demand)
            except HostLedgerUnavailable:
                raise
            except HostLedgerError as exc:  # refused (an older ledger): fair share without it
                log.info("host ledger %s: demand not told: %s", self.socket_path, exc.reason)
            self._demand_told, self._demand_told_at = demand, time.monotonic()

    async def _release_pending(self) -> None:
        for grant_id in sorted(self._to_release):
            try:
                await self.client.release(grant_id)
            except HostLedgerUnavailable:
                return  # down again: the next connection tries
            except HostLedgerError as exc:
                if exc.code == "internal":
                    continue  # not released (it could not save that): the keeper's next pass tries again
                # unknown_grant: it ended meanwhile
            self._to_release.discard(grant_id)

    async def try_grant(
        self,
        key: str,
        vram_mb: int,
        devices: list[int],
        exclusive: bool = False,
        kind: str = "run",
        pids: list[int] | None = None,
    ) -> dict[str, Any] | str:
        """The grant for ``key`` on ``devices``, or why it cannot be made now (a reason to show).
        NeverFits: never on this host under this user's quota. HostLedgerUnavailable: no ledger."""
        if self._to_release:
            # Released while the ledger was away, and not yet told: told first, or a retry asking
            # under the same key (a run's next attempt) would get that grant back, then lose it.
            await self._release_pending()
            if self._to_release and self.connected:
                # (one the ledger could not release yet: the same holds until it has)
                return "the host ledger has not released this server's earlier grants yet (it cannot save its state)"
        answer = await self.client.request(
            key, vram_mb, gpus=len(devices), exclusive=exclusive, kind=kind, devices=devices, pids=pids, wait=False
        )
        if answer.get("state") == "granted":
            self._wake.set()
            return dict(answer["grant"])
        return str(answer.get("reason") or "the host ledger has no room now")

    async def retie(self, grant_id: str, pids: list[int]) -> dict[str, Any]:
        lost = self.lost.get(grant_id)
        if lost is not None:  # asked for anew for these processes from now on
            self.lost[grant_id] = {**lost, "pids": [{"pid": p} for p in pids]}
            raise HostLedgerError("unknown_grant", f"grant {grant_id} was refused when re-told; it is being asked anew")
        return await self.client.retie(self._renamed.get(grant_id, grant_id), pids)

    async def release(self, grant_id: str) -> None:
        """Release now, or as soon as the ledger is back, or can save the release (its grant must
        not outlive its use)."""
        self.lost.pop(grant_id, None)  # (not asked for again)
        grant_id = self._renamed.pop(grant_id, grant_id)
        self.client.grants.pop(grant_id, None)  # never re-told again
        if not self.connected:
            self._to_release.add(grant_id)
            return
        try:
            await self.client.release(grant_id)
        except HostLedgerUnavailable:
            self._to_release.add(grant_id)
        except HostLedgerError as exc:
            if exc.code == "internal":
                # Not released: the ledger could not save the release, and holds the grant still.
                self._to_release.add(grant_id)
            # else unknown_grant: it ended already (its processes are gone)
        self._wake.set()

    def others(self, device: int) -> list[dict[str, Any]]:
        """Other users' holdings on ``device`` by name: ``[{"user", "allocated_mb", "leases", "runs"}]``."""
        for dev in (self.view or {}).get("devices", []):
            if dev["index"] == device:
                return list(dev["users"])
        return []
