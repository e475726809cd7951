"""The run side of a shared model: ``connect(url)`` returns a callable client.

Standard library only, on purpose: a run that uses a shared model must not pay for torch,
transformers or pydantic (the model lives in the host process). Usage::

    model = connect(url)            # url from shared_urls.json; nothing is contacted yet
    vector = model("a sentence")    # one input  -> one output
    vectors = model(["a", "b"])     # a list     -> a list, in order

Each thread (and each forked process) gets its own connection, so a client can be shared by
the threads of a run. Calls block until the host answers; ``timeout`` bounds a call (None: no
bound, since the first call may wait for a large model to load).

When the host dies while a call is in flight, that call raises ``SharedModelError`` at once (it is
not retried: the request may be what killed the host, and a retry would kill it again, together
with every other run's requests). Calls made afterwards wait, up to ``connect_timeout``, for the
server to restart the host, and then load the model again.
"""

from __future__ import annotations

import errno
import os
import select
import socket
import threading
import time
from urllib.parse import parse_qs, quote, unquote, urlsplit

from .protocol import ProtocolError, recv_message, send_message

__all__ = ["ModelClient", "SharedModelError", "connect", "make_url", "parse_url"]

SCHEME = "unix"


class SharedModelError(RuntimeError):
    """A shared model could not answer: it failed to load, it raised, or its host is unreachable.

    ``remote_type`` / ``remote_message`` / ``remote_traceback`` carry the host-side exception
    (``remote_type`` is ``"HostUnavailable"`` or ``"HostDied"`` for failures of the host itself).
    ``phase`` is ``"load"`` when the model failed to load, else ``"call"``.
    """

    def __init__(
        self,
        model: str,
        remote_type: str,
        remote_message: str,
        *,
        phase: str = "call",
        remote_traceback: str | None = None,
    ):
        self.model = model
        self.remote_type = remote_type
        self.remote_message = remote_message
        self.phase = phase
        self.remote_traceback = remote_traceback
        what = "failed to load" if phase == "load" else "failed"
        super().__init__(f"shared model {model!r} {what}: {remote_type}: {remote_message}")

    def __reduce__(self):  # keep the fields when the error crosses a process boundary
        return (
            _rebuild_error,
            (self.model, self.remote_type, self.remote_message, self.phase, self.remote_traceback),
        )


def _rebuild_error(model, remote_type, remote_message, phase, remote_traceback):
    return SharedModelError(model, remote_type, remote_message, phase=phase, remote_traceback=remote_traceback)


def make_url(socket_path: str, model: str) -> str:
    """``unix:///abs/path.sock?model=<name>`` (what the server writes into shared_urls.json)."""
    return f"{SCHEME}://{quote(os.path.abspath(socket_path))}?model={quote(model, safe='')}"


def parse_url(url: str) -> tuple[str, str]:
    """Return ``(socket_path, model_name)``; ValueError for anything else."""
    parts = urlsplit(url)
    models = parse_qs(parts.query).get("model", [])
    if parts.scheme != SCHEME or parts.netloc or not parts.path.startswith("/") or len(models) != 1:
        raise ValueError(f"not a shared-model URL (expected unix:///path.sock?model=NAME): {url!r}")
    return unquote(parts.path), models[0]


class ModelClient:
    """A callable proxy of one shared model. See the module docstring."""

    def __init__(self, url: str, *, timeout: float | None = None, connect_timeout: float = 60.0):
        self.url = url
        self.socket_path, self.name = parse_url(url)
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self._local = threading.local()
        self._lock = threading.Lock()
        self._sockets: set[socket.socket] = set()
        self._closed = False

    def __repr__(self) -> str:
        return f"<ModelClient {self.name!r} at {self.socket_path}>"

    # -- calls ------------------------------------------------------------------------------

    def __call__(self, inputs, **kwargs):
        """One input -> one output; a list -> a list of outputs in the same order.

        Only a ``list`` is a batch: a tuple or a dict is one input (e.g. a text pair). Keyword
        arguments go to the model call; requests are batched only with others of equal kwargs.
        """
        is_batch = isinstance(inputs, list)
        items = inputs if is_batch else [inputs]
        if not items:
            return []
        reply = self._request({"op": "call", "model": self.name, "inputs": items, "kwargs": kwargs})
        outputs = reply["outputs"]
        if len(outputs) != len(items):
            raise SharedModelError(self.name, "ProtocolError", f"{len(outputs)} outputs for {len(items)} inputs")
        return outputs if is_batch else outputs[0]

    def describe(self) -> dict:
        """The host's live figures for this model (state, requests, batches, batch sizes...)."""
        return self._request({"op": "describe", "model": self.name})["describe"]

    def close(self) -> None:
        with self._lock:
            self._closed = True
            sockets, self._sockets = self._sockets, set()
        for sock in sockets:
            sock.close()

    def __enter__(self) -> ModelClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- plumbing ---------------------------------------------------------------------------

    def _request(self, message: dict) -> dict:
        sock = self._connection()
        exchanged = False
        try:
            try:
                send_message(sock, message)
            except TimeoutError:
                raise SharedModelError(self.name, "TimeoutError", f"could not send within {self.timeout} s") from None
            except OSError:
                raise self._died("the connection broke while sending the request") from None
            try:
                reply = recv_message(sock, plain_only=True)
            except TimeoutError:
                raise SharedModelError(self.name, "TimeoutError", f"no answer within {self.timeout} s") from None
            except (ProtocolError, OSError) as exc:
                raise self._died(f"the host closed the connection before answering ({exc})") from None
            exchanged = True
        finally:
            if not exchanged:
                # A timeout, an error or an interrupt (KeyboardInterrupt) mid-exchange leaves the
                # connection out of step: a late answer would be read as the next call's.
                self._drop(sock)
        if not reply.get("ok"):
            error = reply.get("error") or {}
            raise SharedModelError(
                self.name,
                str(error.get("type", "Error")),
                str(error.get("message", "")),
                phase=str(error.get("phase", "call")),
                remote_traceback=error.get("traceback"),
            )
        return reply

    def _died(self, detail: str) -> SharedModelError:
        return SharedModelError(
            self.name,
            "HostDied",
            f"{detail}; the model host died or was restarted while serving this request, which was "
            "not retried. The server restarts the host; the next call loads the model again.",
        )

    def _connection(self) -> socket.socket:
        if self._closed:
            raise SharedModelError(self.name, "ClientClosed", "this client was closed")
        pid = os.getpid()
        held = getattr(self._local, "conn", None)
        if held is not None and held[0] == pid and held[1].fileno() != -1:
            if not _readable(held[1]):
                return held[1]
            # Between requests the host sends nothing: a readable connection was closed by a host
            # that has since died. Nothing was sent on it, so a new connection is safe.
            self._drop(held[1])
        sock = self._connect()
        sock.settimeout(self.timeout)
        self._local.conn = (pid, sock)
        with self._lock:
            self._sockets.add(sock)
        return sock

    def _drop(self, sock: socket.socket) -> None:
        with self._lock:
            self._sockets.discard(sock)
        sock.close()
        self._local.conn = None

    def _connect(self) -> socket.socket:
        """Connect, waiting up to ``connect_timeout`` for a host that is (re)starting."""
        deadline = time.monotonic() + self.connect_timeout
        delay = 0.02
        while True:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.settimeout(max(1.0, self.connect_timeout))
                sock.connect(self.socket_path)
                hello = recv_message(sock, plain_only=True).get("hello") or {}
                if hello.get("model") != self.name:
                    sock.close()
                    raise SharedModelError(
                        self.name, "WrongHost", f"{self.socket_path} serves {hello.get('model')!r}, not {self.name!r}"
                    )
                return sock
            except (OSError, ProtocolError) as exc:
                sock.close()
                # No greeting means no host accepted the connection (e.g. it reached the backlog of
                # a host that was dying): nothing was sent yet, so trying again is safe.
                retriable = isinstance(exc, ProtocolError) or exc.errno in (
                    errno.ENOENT, errno.ECONNREFUSED, errno.EAGAIN, errno.ECONNRESET, errno.EPIPE,
                )  # fmt: skip
                if not retriable or time.monotonic() >= deadline:
                    reason = getattr(exc, "strerror", None) or exc
                    raise SharedModelError(
                        self.name,
                        "HostUnavailable",
                        f"cannot reach the model host at {self.socket_path} ({reason}); "
                        "is the Jupyter server that owns it still running?",
                    ) from None
                time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
                delay = min(delay * 2, 0.5)


def _readable(sock: socket.socket) -> bool:
    """True when the peer closed (or sent something unasked): the connection is not reusable."""
    poller = select.poll()  # not select(): it fails for descriptors above FD_SETSIZE
    poller.register(sock, select.POLLIN | select.POLLHUP | select.POLLERR)
    return bool(poller.poll(0))


def connect(url: str, *, timeout: float | None = None, connect_timeout: float = 60.0) -> ModelClient:
    """A client of the shared model at ``url`` (from ``shared_urls.json``). Connects lazily."""
    return ModelClient(url, timeout=timeout, connect_timeout=connect_timeout)
