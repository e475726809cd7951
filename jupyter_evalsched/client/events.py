"""The ``/evalsched/events`` WebSocket: :class:`EventStream` and its two backends.

``websocket-client`` when installed, else tornado's client on a private thread. Both are imported
lazily: a client that never opens the stream never pays for them.
"""

from __future__ import annotations

import json
import queue as _queue
import threading
import urllib.parse
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from .errors import EvalSchedClientError, EventStreamClosed

if TYPE_CHECKING:
    from .rest_client import EvalSchedClient


class EventStream:
    """An open ``/evalsched/events`` WebSocket.

    Iterate it for event dicts (iteration ends when the socket closes), or call
    :meth:`next_event` with a timeout. ``close()`` is safe from any thread and idempotent.
    Uses ``websocket-client`` when installed, else tornado on a private thread.
    """

    def __init__(
        self,
        client: EvalSchedClient,
        *,
        connect_timeout: float = 10.0,
        backend: str | None = None,
        queue_limit: int | None = None,
    ):
        parts = urllib.parse.urlsplit(urllib.parse.urljoin(client.base_url, "evalsched/events"))
        scheme = "wss" if parts.scheme == "https" else "ws"
        query = "" if queue_limit is None else urllib.parse.urlencode({"limit": int(queue_limit)})
        self.url = urllib.parse.urlunsplit((scheme, parts.netloc, parts.path, query, ""))
        self._headers = {"Authorization": f"token {client.token}"} if client.token else {}
        self._closed = False
        if backend is None:
            try:
                import websocket  # noqa: F401  (websocket-client)

                backend = "websocket-client"
            except ImportError:
                backend = "tornado"
        self.backend = backend
        backends: dict[str, type[_WebsocketClientBackend] | type[_TornadoBackend]] = {
            "websocket-client": _WebsocketClientBackend,
            "tornado": _TornadoBackend,
        }
        if backend not in backends:
            raise ValueError(f"unknown event stream backend {backend!r}")
        self._backend: _WebsocketClientBackend | _TornadoBackend = backends[backend](
            self.url, self._headers, connect_timeout
        )

    @property
    def closed(self) -> bool:
        return self._closed

    def next_event(self, timeout: float | None = None) -> dict | None:
        """The next event, or None when ``timeout`` passes first. Raises :class:`EventStreamClosed`."""
        if self._closed:
            raise EventStreamClosed("event stream closed")
        try:
            text = self._backend.recv(timeout)
        except EventStreamClosed:
            self._closed = True
            raise
        if text is None:
            return None
        try:
            event = json.loads(text)
        except ValueError:
            return None
        return event if isinstance(event, dict) else None

    def __iter__(self) -> Iterator[dict]:
        return self

    def __next__(self) -> dict:
        while True:
            try:
                event = self.next_event(timeout=None)
            except EventStreamClosed:
                raise StopIteration from None
            if event is not None:
                return event

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._backend.close()

    def __enter__(self) -> EventStream:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


class _WebsocketClientBackend:
    """websocket-client's blocking socket; ``recv`` with a timeout, ``close`` from any thread."""

    def __init__(self, url: str, headers: dict, connect_timeout: float):
        import websocket

        self._websocket = websocket
        try:
            self._ws = websocket.create_connection(
                url, timeout=connect_timeout, header=[f"{k}: {v}" for k, v in headers.items()], enable_multithread=True
            )
        except Exception as e:
            raise EvalSchedClientError(f"cannot open the event stream at {url}: {e}") from None

    def recv(self, timeout: float | None) -> str | None:
        ws = self._websocket
        try:
            self._ws.settimeout(timeout)
            while True:
                opcode, data = self._ws.recv_data(control_frame=False)
                if opcode == ws.ABNF.OPCODE_TEXT:
                    return data.decode("utf-8", errors="replace")
                if opcode == ws.ABNF.OPCODE_CLOSE:
                    raise EventStreamClosed("the server closed the event stream")
        except ws.WebSocketTimeoutException:
            return None
        except (ws.WebSocketConnectionClosedException, OSError, AttributeError) as e:
            # AttributeError: the socket was shut down from another thread in the middle of recv.
            raise EventStreamClosed(f"event stream closed: {e}") from None

    def close(self) -> None:
        try:
            # abort() shuts the socket down without a handshake: it unblocks a recv in another thread.
            self._ws.abort()
            self._ws.close(timeout=0.2)
        except Exception:
            pass


class _TornadoBackend:
    """tornado's WebSocket client on a private thread and loop, so that it works from any thread,
    including a kernel's main thread where an asyncio loop already runs."""

    _CLOSED = object()

    def __init__(self, url: str, headers: dict, connect_timeout: float):
        import asyncio

        from tornado import httpclient, websocket

        self._messages: _queue.Queue = _queue.Queue()
        self._loop = asyncio.new_event_loop()
        self._conn = None
        ready = threading.Event()
        failure: list[BaseException] = []

        async def _main() -> None:
            request = httpclient.HTTPRequest(
                url, headers=headers, connect_timeout=connect_timeout, request_timeout=connect_timeout
            )
            try:
                self._conn = await websocket.websocket_connect(request)
            except BaseException as e:
                failure.append(e)
                ready.set()
                return
            ready.set()
            while True:
                msg = await self._conn.read_message()
                if msg is None:
                    self._messages.put(self._CLOSED)
                    return
                self._messages.put(msg if isinstance(msg, str) else msg.decode("utf-8", "replace"))

        def _thread() -> None:
            asyncio.set_event_loop(self._loop)
            try:
                self._loop.run_until_complete(_main())
            except Exception:
                self._messages.put(self._CLOSED)
            finally:
                self._loop.close()

        self._thread = threading.Thread(target=_thread, name="evalsched-events", daemon=True)
        self._thread.start()
        if not ready.wait(connect_timeout + 1) or failure:
            self.close()
            reason = failure[0] if failure else "timed out"
            raise EvalSchedClientError(f"cannot open the event stream at {url}: {reason}")

    def recv(self, timeout: float | None) -> str | None:
        try:
            msg = self._messages.get(timeout=timeout)
        except _queue.Empty:
            return None
        if msg is self._CLOSED:
            self._messages.put(self._CLOSED)  # stay closed for later calls
            raise EventStreamClosed("the server closed the event stream")
        return msg

    def close(self) -> None:
        conn = self._conn
        if conn is not None and not self._loop.is_closed():
            try:
                self._loop.call_soon_threadsafe(conn.close)
            except RuntimeError:
                pass
        self._messages.put(self._CLOSED)
