"""The tenant's side of the host ledger: an asyncio client (what a user's scheduler uses) and a
blocking ``status`` for the CLI.

The client remembers the grants it holds; :meth:`HostLedgerClient.connect` on a new connection
(the ledger restarted, or this process did and rebuilt ``grants``) re-tells them (``reclaim``, in
batches that each fit a frame: one reclaim), so the ledger never grants their VRAM to anyone else; one it refuses is held no more (said in the log,
and listed in ``refused``). A request that waits is answered when granted
(``request`` returns then); a lost connection fails every pending call with
:class:`HostLedgerUnavailable`, and the caller connects again and asks again: a request the ledger
had already granted under the same key (for the same ask) returns that grant, never a second one.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
from collections.abc import Callable
from typing import Any

from .protocol import MAX_ANSWER_BYTES, MAX_FRAME_BYTES, ProtocolError, encode, read_frame, recv_sync, send_sync

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 5.0


class HostLedgerError(Exception):
    def __init__(self, code: str, reason: str, answer: dict[str, Any] | None = None) -> None:
        super().__init__(reason)
        self.code, self.reason = code, reason
        self.answer = answer or {}  # the error answer as it came (key_in_use: the ``grant`` held)

    @classmethod
    def of(cls, answer: dict[str, Any]) -> HostLedgerError:
        return cls(str(answer.get("error")), str(answer.get("reason")), answer)


class HostLedgerUnavailable(HostLedgerError):
    """No connection to the host ledger (down, restarting, or the socket is wrong)."""


class NeverFits(HostLedgerError):
    """The request can never be granted on this host under this user's quota (a 422)."""


# Room a reclaim's frame keeps for what is around its grants ({"op", "id", "more", "grants": []}).
RECLAIM_ENVELOPE_BYTES = 256


def reclaim_batches(grants: list[dict[str, Any]], limit: int = MAX_FRAME_BYTES) -> list[list[dict[str, Any]]]:
    """The grants to re-tell, in order, in batches that each fit in one frame of ``limit`` bytes
    with the reclaim around them (none for no grants). One frame holds about 400 grants as a
    user's server names them, and a user may hold 1,024: told in one, they could never be told."""
    room = limit - RECLAIM_ENVELOPE_BYTES
    batches: list[list[dict[str, Any]]] = []
    batch: list[dict[str, Any]] = []
    size = 0
    for grant in grants:
        told = len(json.dumps(grant, separators=(",", ":"))) + 1  # (as encode writes it; its comma)
        if batch and size + told > room:
            batches.append(batch)
            batch, size = [], 0
        batch.append(grant)
        size += told
    if batch:
        batches.append(batch)
    return batches


class HostLedgerClient:
    def __init__(
        self,
        socket_path: str,
        tenant: str = "",
        on_event: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        self.socket_path = socket_path
        self.tenant = tenant
        self.on_event = on_event  # the ledger's unasked news: "waiting" (a new reason), "ended"
        self.grants: dict[str, dict[str, Any]] = {}  # the live grants this client holds, by id
        # The grants the last connect() re-told and the ledger refused (no longer held), each as
        # {"grant", "error", "reason"}.
        self.refused: list[dict[str, Any]] = []
        self.hello: dict[str, Any] | None = None
        self._pending_id = 1
        self._calls: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._waits: dict[Any, asyncio.Future[dict[str, Any]]] = {}  # request id -> its grant
        self._on_waiting: dict[Any, Callable[[str], None]] = {}
        self._writer: asyncio.StreamWriter | None = None
        self._reader_task: asyncio.Task[None] | None = None

    @property
    def connected(self) -> bool:
        return self._writer is not None and not self._writer.is_closing()

    async def connect(self) -> dict[str, Any]:
        """Open a connection, say hello and re-tell the grants held; the hello answer."""
        await self.close()
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_unix_connection(self.socket_path, limit=1 << 17), CONNECT_TIMEOUT_S
            )
        except (OSError, TimeoutError) as exc:
            raise HostLedgerUnavailable("unavailable", f"cannot connect to {self.socket_path}: {exc}") from None
        self._writer = writer
        self._reader_task = asyncio.create_task(self._read(reader))
        self.refused = []
        try:
            self.hello = await self._call("hello", tenant=self.tenant)
            batches = reclaim_batches([self._retell(g) for g in self.grants.values()])
            kept: list[dict[str, Any]] = []
            refused: list[dict[str, Any]] = []
            for n, batch in enumerate(batches):
                # All but the last say more follow: one reclaim, which the ledger waits for whole.
                more = {"more": True} if n < len(batches) - 1 else {}
                answer = await self._call("reclaim", grants=batch, **more)
                kept += answer["kept"]
                refused += answer.get("refused", [])
            if batches:
                self._retold({"kept": kept, "refused": refused})
        except HostLedgerError:
            # Connected means re-told: a connection left open after a reclaim refused whole (the
            # ledger could not save it: ``internal``) would look connected and never re-tell the
            # grants. Closed, the next connect() tells them again (none was dropped).
            await self.close()
            raise
        return self.hello

    def _retold(self, answer: dict[str, Any]) -> None:
        """The ledger's answer to the grants re-told: those kept are held; each it refused is held
        no more (said, with the ledger's reason, and kept in ``refused`` for the caller)."""
        for item in answer.get("refused", []):
            grant = self.grants.get(str(item.get("id"))) if isinstance(item, dict) else None
            if grant is None:
                continue
            error, reason = str(item.get("error")), str(item.get("reason"))
            self.refused.append({"grant": grant, "error": error, "reason": reason})
            log.warning(
                "host ledger %s: grant %s (%s %r: %s MB on GPU %s) re-told after a reconnect and refused, "
                "so no longer held: %s (%s)",
                self.socket_path,
                grant.get("id"),
                grant.get("kind"),
                grant.get("key"),
                grant.get("vram_mb"),
                ",".join(map(str, grant.get("devices", []))),
                reason,
                error,
            )
        self.grants = {g["id"]: g for g in answer["kept"]}

    @staticmethod
    def _retell(grant: dict[str, Any]) -> dict[str, Any]:
        return {**grant, "gpus": len(grant["devices"]), "pids": [p["pid"] for p in grant["pids"]]}

    async def close(self) -> None:
        writer, self._writer = self._writer, None
        if writer is not None:
            writer.close()
            try:  # a ledger that reads nothing more must not hold this close (a server's stop)
                await asyncio.wait_for(writer.wait_closed(), 2.0)
            except Exception:
                writer.transport.abort()
        if self._reader_task is not None:
            self._reader_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._reader_task
            self._reader_task = None
        self._fail_pending("the connection was closed")

    def _fail_pending(self, why: str) -> None:
        for fut in [*self._calls.values(), *self._waits.values()]:
            if not fut.done():
                fut.set_exception(HostLedgerUnavailable("unavailable", f"host ledger: {why}"))
        self._calls.clear()
        self._waits.clear()
        self._on_waiting.clear()

    async def _read(self, reader: asyncio.StreamReader) -> None:
        why = "the connection was lost"
        try:
            while True:
                message = await read_frame(reader, max_bytes=MAX_ANSWER_BYTES)
                if "event" in message:
                    self._event(message)
                    continue
                fut = self._calls.pop(message.get("id"), None)  # type: ignore[arg-type]
                if fut is not None and not fut.done():
                    fut.set_result(message)
        except (ProtocolError, OSError) as exc:
            why = f"the connection was lost ({exc})"
        finally:
            if self._writer is not None:
                self._writer.close()
                self._writer = None
            self._fail_pending(why)

    def _event(self, message: dict[str, Any]) -> None:
        kind = message["event"]
        request = message.get("request")
        if kind == "granted":
            grant = message["grant"]
            self.grants[grant["id"]] = grant
            fut = self._waits.pop(request, None)
            self._on_waiting.pop(request, None)
            if fut is not None and not fut.done():
                fut.set_result(grant)
        elif kind == "waiting":
            callback = self._on_waiting.get(request)
            if callback is not None:
                callback(message.get("reason", ""))
        elif kind == "ended":
            self.grants.pop(message.get("grant"), None)  # type: ignore[arg-type]
        if self.on_event is not None:
            self.on_event(message)

    @property
    def _next_request(self) -> int:
        """The id the next message will carry."""
        return self._pending_id

    async def _send(self, op: str, **fields: Any) -> tuple[int, asyncio.Future[dict[str, Any]]]:
        if not self.connected:
            raise HostLedgerUnavailable("unavailable", "not connected to the host ledger")
        request = self._pending_id
        self._pending_id += 1
        fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._calls[request] = fut
        assert self._writer is not None
        try:
            self._writer.write(encode({"op": op, "id": request, **fields}))
            await self._writer.drain()
        except OSError as exc:  # lost between the check and the write
            self._calls.pop(request, None)
            fut.cancel()
            raise HostLedgerUnavailable("unavailable", f"host ledger: the connection was lost ({exc})") from None
        return request, fut

    async def _call(self, op: str, **fields: Any) -> dict[str, Any]:
        _, fut = await self._send(op, **fields)
        answer = await fut
        if not answer.get("ok"):
            raise HostLedgerError.of(answer)
        return answer

    async def request(
        self,
        key: str,
        vram_mb: int,
        gpus: int = 1,
        exclusive: bool = False,
        kind: str = "run",
        devices: list[int] | None = None,
        pids: list[int] | None = None,
        wait: bool = True,
        on_waiting: Callable[[str], None] | None = None,
    ) -> dict[str, Any]:
        """A grant (``{"id", "devices", ...}``) for ``key``. ``wait``: until granted (reasons go
        to ``on_waiting``); else the ledger's answer as it is (state "granted" or "busy").
        NeverFits when it can never be granted. ``pids``: the processes it is for (default:
        this process; re-tie it to a run's once the run exists)."""
        fields: dict[str, Any] = {"key": key, "vram_mb": vram_mb, "gpus": gpus, "exclusive": exclusive, "kind": kind}
        if devices is not None:
            fields["devices"] = devices
        if pids is not None:
            fields["pids"] = pids
        # The granted event may follow the "waiting" answer at once: its future exists first.
        loop = asyncio.get_running_loop()
        granted: asyncio.Future[dict[str, Any]] = loop.create_future()
        request = self._next_request
        self._waits[request] = granted
        if on_waiting is not None:
            self._on_waiting[request] = on_waiting
        try:
            _, fut = await self._send("request", wait=wait, **fields)
            answer = await fut
            if not answer.get("ok"):
                raise HostLedgerError.of(answer)
            state = answer["state"]
            if state == "never":
                raise NeverFits("never", answer["reason"])
            if state == "granted":
                self.grants[answer["grant"]["id"]] = answer["grant"]
                return answer["grant"] if wait else answer
            if not wait:
                return answer
            if on_waiting is not None:
                on_waiting(answer.get("reason", ""))
            return await granted
        except asyncio.CancelledError:
            if self.connected and not granted.done():
                with contextlib.suppress(HostLedgerError):
                    await self._call("cancel", key=key)
            raise
        finally:
            self._waits.pop(request, None)
            self._on_waiting.pop(request, None)
            if granted.done() and not granted.cancelled():
                granted.exception()  # failed with the connection after the answer: not news

    async def retie(self, grant_id: str, pids: list[int]) -> dict[str, Any]:
        """Tie a grant to these processes (a run's, once it exists) instead of its first ones."""
        grant = (await self._call("retie", grant=grant_id, pids=pids))["grant"]
        self.grants[grant_id] = grant
        return grant

    async def release(self, grant_id: str) -> None:
        try:
            await self._call("release", grant=grant_id)
        finally:
            self.grants.pop(grant_id, None)

    async def cancel(self, key: str) -> bool:
        return bool((await self._call("cancel", key=key))["cancelled"])

    async def view(self, limit: int | None = None) -> dict[str, Any]:
        """The host's view for this user; ``limit``: list at most this many grants, waiting
        requests and demanded asks (the ledger's own bound without it; ``omitted`` counts the rest)."""
        return await self._call("view") if limit is None else await self._call("view", limit=limit)

    async def demand(self, asks: list[dict[str, Any]]) -> int:
        """Tell the GPU work queued at this tenant (``vram_mb``, ``gpus``, ``exclusive``,
        ``kind`` each): the ledger's fair share keeps room for it against users holding more."""
        return int((await self._call("demand", asks=asks))["demand"])


def status(socket_path: str, timeout_s: float = 5.0) -> dict[str, Any]:
    """The host ledger's view for the calling user (the whole view for root or an admin); blocking."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout_s)
        try:
            sock.connect(socket_path)
        except OSError as exc:
            raise HostLedgerUnavailable("unavailable", f"cannot connect to {socket_path}: {exc}") from None
        for request, op in enumerate(("hello", "view"), 1):
            send_sync(sock, {"op": op, "id": request, "tenant": "status"})
            answer = recv_sync(sock, timeout_s)
            while "event" in answer:
                answer = recv_sync(sock, timeout_s)
            if not answer.get("ok"):
                raise HostLedgerError.of(answer)
        return answer
    finally:
        sock.close()
