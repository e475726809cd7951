"""What the client's HTTP requests do with a redirect: the ``urllib`` openers they go through.

``urllib`` keeps every header of a request on a redirect, ``Authorization`` included, to
whatever host the ``Location`` names (Python 3.11 to 3.13 at least): a proxy or a login page
that redirects elsewhere would receive the server's token. :data:`OPENER` drops it there.
"""

from __future__ import annotations

import urllib.parse
import urllib.request
from http.client import HTTPMessage
from typing import IO

# A query parameter that carries a Jupyter token (as ``?token=`` in the URL Jupyter prints).
TOKEN_PARAMS = frozenset({"token"})


def origin(url: str) -> tuple[str, str, int | None]:
    """``(scheme, host, port)`` of ``url``, the port the scheme's default when not given."""
    parts = urllib.parse.urlsplit(url)
    scheme = parts.scheme.lower()
    try:
        port = parts.port
    except ValueError:  # (a port that is not a number: an origin of its own)
        port = None
    return scheme, (parts.hostname or "").lower(), port or {"http": 80, "https": 443}.get(scheme)


def without_token(url: str) -> str:
    """``url`` without a ``token`` in its query."""
    parts = urllib.parse.urlsplit(url)
    query = urllib.parse.parse_qsl(parts.query, keep_blank_values=True)
    kept = [(k, v) for k, v in query if k not in TOKEN_PARAMS]
    if len(kept) == len(query):
        return url
    return urllib.parse.urlunsplit(parts._replace(query=urllib.parse.urlencode(kept)))


class CredentialsStayHome(urllib.request.HTTPRedirectHandler):
    """Follows a redirect as ``urllib`` does, without the credentials (the ``Authorization``
    header, a token in the query) where it leads to another origin (scheme, host, port)."""

    def redirect_request(
        self, req: urllib.request.Request, fp: IO[bytes], code: int, msg: str, headers: HTTPMessage, newurl: str
    ) -> urllib.request.Request | None:
        new = super().redirect_request(req, fp, code, msg, headers, newurl)
        if new is not None and origin(new.full_url) != origin(req.full_url):
            new.remove_header("Authorization")
            new.full_url = without_token(new.full_url)
        return new


class NoRedirects(urllib.request.HTTPRedirectHandler):
    """Follows no redirect: the 3xx itself is the answer (an ``HTTPError``)."""

    def redirect_request(
        self, req: urllib.request.Request, fp: IO[bytes], code: int, msg: str, headers: HTTPMessage, newurl: str
    ) -> urllib.request.Request | None:
        return None


# Every request of the REST client.
OPENER = urllib.request.build_opener(CredentialsStayHome)
# Discovery's probes: a redirect says that what answers there is not the API (a login page).
PROBE_OPENER = urllib.request.build_opener(NoRedirects)
