"""The primary's internal listener: the link secondaries forward to.

Secondaries authenticate and authorize their own clients, then forward the request here, on a
loopback port, with the secret of the primary's advertisement (``primary.py``). The link does not
depend on how users log in to the primary (token, password, JupyterHub, HTTPS): this listener
serves the same ``/evalsched/`` handlers with an identity provider that knows the secret alone.
"""

from __future__ import annotations

import hmac
import os
import socket
import struct
from typing import Any, cast

from jupyter_server.auth import AllowAllAuthorizer, IdentityProvider
from jupyter_server.auth.identity import User
from tornado import httpclient, httpserver, httputil, netutil, web
from tornado.iostream import IOStream
from tornado.simple_httpclient import SimpleAsyncHTTPClient
from tornado.tcpclient import TCPClient
from tornado.websocket import WebSocketClientConnection
from traitlets import Unicode

SECONDARY_USER = "evalsched-secondary"


class LinkRefused(ConnectionError):
    """The socket a secondary reached at the primary's advertised port is not of this user."""


def peer_uid(sock: socket.socket) -> int | None:
    """The uid that owns the other end of an IPv4 TCP connection on this host (an accepted
    socket is its listener's), from the kernel's socket table: by ``sock_diag`` (one exact
    look-up), else (refused, or answered with an error) ``/proc/net/tcp``; None where neither
    tells."""
    ours, theirs = sock.getsockname()[:2], sock.getpeername()[:2]
    try:
        return _diag_uid(ours, theirs)
    except (OSError, struct.error):
        pass
    local = f"{socket.inet_aton(theirs[0])[::-1].hex().upper()}:{theirs[1]:04X}"
    remote = f"{socket.inet_aton(ours[0])[::-1].hex().upper()}:{ours[1]:04X}"
    try:
        with open("/proc/net/tcp", encoding="ascii") as table:
            for line in table:
                fields = line.split()  # sl local_address rem_address st ... uid (the 8th)
                if len(fields) > 7 and fields[1] == local and fields[2] == remote:
                    return int(fields[7])
    except (OSError, ValueError):
        pass
    return None


def _diag_uid(ours: tuple[str, int], theirs: tuple[str, int]) -> int:
    # inet_diag_req_v2 for the socket whose own address is ``theirs`` and whose peer is ``ours``
    # (linux/inet_diag.h), no cookie: SOCK_DIAG_BY_FAMILY (20), NLM_F_REQUEST (1).
    sockid = (
        struct.pack("!HH", theirs[1], ours[1])
        + socket.inet_aton(theirs[0]).ljust(16, b"\0")
        + socket.inet_aton(ours[0]).ljust(16, b"\0")
        + struct.pack("=III", 0, 0xFFFFFFFF, 0xFFFFFFFF)
    )
    request = struct.pack("=BBBxI", socket.AF_INET, socket.IPPROTO_TCP, 0, 0xFFFFFFFF) + sockid
    with socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, 4) as diag:  # NETLINK_SOCK_DIAG
        diag.settimeout(1.0)
        diag.send(struct.pack("=IHHII", 16 + len(request), 20, 1, 1, 0) + request)
        answer = diag.recv(65536)
    kind = struct.unpack_from("=H", answer, 4)[0]
    if kind == 2:  # NLMSG_ERROR, its errno negated after the header: a kernel without tcp_diag
        code = -struct.unpack_from("=i", answer, 16)[0]  # answers ENOENT, as for no such socket
        raise OSError(code, f"sock_diag: {os.strerror(code)}")
    if kind != 20:
        raise OSError(f"sock_diag answered a message of type {kind}")
    # inet_diag_msg: family, state, timer, retrans, its id (48 bytes), expires, rqueue, wqueue, uid
    return int(struct.unpack_from("=I", answer, 16 + 4 + 48 + 12)[0])


class LinkTCPClient(TCPClient):
    """Connections to the primary's internal listener, each checked before a byte is sent on it:
    the socket it reached must be this user's. The advertisement is checked (its process lives)
    before a forward, but its connection is made later (turns of the loop, a thread's address
    look-up): a primary gone meanwhile frees its port, and any user of the host may listen there
    and be sent the request. A connection, once made, stays with the socket it reached."""

    async def connect(self, *args: Any, **kwargs: Any) -> IOStream:
        stream = await super().connect(*args, **kwargs)
        try:
            uid = peer_uid(stream.socket)
        except OSError:  # (reset meanwhile)
            uid = None
        if uid != os.getuid():
            stream.close()
            whose = "cannot be told" if uid is None else f"is uid {uid}'s"
            raise LinkRefused(
                f"the socket at the advertised port {whose}, not this user's (uid {os.getuid()}): "
                "nothing was sent there"
            )
        return stream


class LinkHTTPClient(SimpleAsyncHTTPClient):
    """Tornado's HTTP client (one per loop, as ``AsyncHTTPClient()``) whose connections are
    ``LinkTCPClient``'s."""

    def initialize(self, *args: Any, **kwargs: Any) -> None:
        super().initialize(*args, **kwargs)
        self.tcp_client = LinkTCPClient(resolver=self.resolver)


class _LinkWebSocketConnection(WebSocketClientConnection):
    """Tornado's WebSocket client connection, whose connection is ``LinkTCPClient``'s. Tornado
    makes its own ``TCPClient`` in ``__init__`` and passes it on; the connection itself is made
    by ``_HTTPConnection.run``, which ``__init__`` schedules as a task (it starts on a later turn
    of the loop) and which connects through ``self.tcp_client``: replaced here before then."""

    def __init__(self, request: httpclient.HTTPRequest) -> None:
        super().__init__(request)
        self.tcp_client.close()
        self.tcp_client = LinkTCPClient()


async def link_websocket_connect(request: httpclient.HTTPRequest) -> WebSocketClientConnection:
    """``tornado.websocket.websocket_connect(request)`` over a ``LinkTCPClient``: the upgrade
    request (and its secret) goes only to a socket of this user."""
    request.headers = httputil.HTTPHeaders(request.headers)  # (as websocket_connect does)
    proxied = httpclient._RequestProxy(request, httpclient.HTTPRequest._DEFAULTS)
    connection = _LinkWebSocketConnection(cast(httpclient.HTTPRequest, proxied))
    return await connection.connect_future


class SecretIdentityProvider(IdentityProvider):
    """Accepts ``Authorization: token <secret>`` and nothing else (no cookies, no login page)."""

    secret = Unicode()

    def get_user(self, handler: web.RequestHandler) -> User | None:
        scheme, _, value = handler.request.headers.get("Authorization", "").partition(" ")
        # As bytes: compare_digest refuses a str with a character beyond ASCII (a TypeError, so
        # a 500 for anyone on the host who sends one).
        offered = value.strip().encode("utf-8", "surrogatepass")
        if scheme.lower() == "token" and self.secret and hmac.compare_digest(offered, self.secret.encode()):
            return User(username=SECONDARY_USER, name=SECONDARY_USER, display_name=SECONDARY_USER)
        return None

    @property
    def auth_enabled(self) -> bool:
        return True

    @property
    def login_available(self) -> bool:
        return False


class InternalListener:
    """A tornado HTTP server on 127.0.0.1 (a free port) serving ``handlers`` for secondaries."""

    def __init__(self, handlers: list[tuple[str, Any]], server_settings: dict[str, Any], secret: str) -> None:
        identity = SecretIdentityProvider(secret=secret)
        settings = dict(server_settings)
        settings.update(
            base_url="/",
            identity_provider=identity,
            authorizer=AllowAllAuthorizer(identity_provider=identity),
            xsrf_cookies=False,  # no browser here: every request carries the secret
            disable_check_xsrf=True,
            allow_remote_access=False,
            allow_unauthenticated_access=False,
        )
        self.app = web.Application([(f"/{pattern.lstrip('/')}", cls) for pattern, cls in handlers], **settings)
        sockets = netutil.bind_sockets(0, "127.0.0.1")
        self.port = sockets[0].getsockname()[1]
        self.server = httpserver.HTTPServer(self.app, xheaders=False)
        self.server.add_sockets(sockets)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/"

    async def stop(self) -> None:
        self.server.stop()
        await self.server.close_all_connections()
