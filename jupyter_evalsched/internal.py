"""The primary's internal listener: the link secondaries forward to.

Secondaries authenticate and authorize their own clients, then forward the request here, on a
loopback port, with the secret of the primary's advertisement (``primary.py``). The link does not
depend on how users log in to the primary (token, password, JupyterHub, HTTPS): this listener
serves the same ``/evalsched/`` handlers with an identity provider that knows the secret alone.
"""

from __future__ import annotations

import hmac
from typing import Any

from jupyter_server.auth import AllowAllAuthorizer, IdentityProvider
from jupyter_server.auth.identity import User
from tornado import httpserver, netutil, web
from traitlets import Unicode

SECONDARY_USER = "evalsched-secondary"


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
