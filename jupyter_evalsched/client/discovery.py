"""Finding the server to talk to, first that works:

1. explicit ``url``/``token`` arguments;
2. ``EVALSCHED_URL`` / ``EVALSCHED_TOKEN`` in the environment;
3. the runtime file of the server that launched this kernel (``JPY_PARENT_PID``);
4. any running Jupyter server found in the runtime directory that answers ``/evalsched/queue``,
   the newest runtime file first (the server started last), passing over a file whose port
   another user's socket listens on; ``discover_servers`` also tells the others listed.
"""

from __future__ import annotations

import glob
import http.client
import ipaddress
import json
import os
import socket
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable

from .errors import HOW_TO_FIX, ServerNotFound, TokenRefused
from .redirects import PROBE_OPENER
from .socket_table import Listener, listening_uids, read_listeners

PROBE_TIMEOUT_S = 2.0  # a probe's, where the caller gives none
# The base URL found by probing, per URL given (as given): a process makes many clients of one URL.
_resolved_bases: dict[str, str] = {}


def discover_server(url: str | None = None, token: str | None = None, timeout: float | None = None) -> tuple[str, str]:
    """Return ``(base_url, token)`` of the server to talk to, or raise :class:`ServerNotFound`.
    ``timeout``: of each probe of a base URL (the client's own timeout)."""
    return discover_servers(url, token, timeout)[0]


def discover_servers(
    url: str | None = None, token: str | None = None, timeout: float | None = None
) -> tuple[tuple[str, str], list[str]]:
    """The ``(base_url, token)`` of the server to talk to, and the base URLs of the other
    servers listed in the runtime directory (none where the server is named: ``url``,
    ``EVALSCHED_URL``, the kernel's parent server). The server is the newest listed that
    answers, each asked with its own runtime file's token; the others are not asked at all (a
    note needs no network). Raises :class:`ServerNotFound` (or :class:`TokenRefused`)."""
    if url is None:
        url = os.environ.get("EVALSCHED_URL") or None
        if url is not None and token is None:
            token = os.environ.get("EVALSCHED_TOKEN")
    if url is not None:
        return _from_url(url, token, timeout or PROBE_TIMEOUT_S), []

    parent = os.environ.get("JPY_PARENT_PID")
    if parent and parent.isdigit():
        info = read_server_file(os.path.join(_runtime_dir(), f"jpserver-{parent}.json"))
        if info is not None:
            return (normalize_base_url(info["url"]), token if token is not None else (info.get("token") or "")), []

    servers = running_servers()
    if not servers:
        raise ServerNotFound(f"no running Jupyter server found: {HOW_TO_FIX}")
    listeners = read_listeners()
    # A runtime file whose server died while its pid lives on (reused) names a port anyone may
    # listen on now: where the kernel's tables say another user's socket listens there, that
    # file's token is not sent.
    listed = [
        (normalize_base_url(info["url"]), info) for info in servers if not _anothers_listener(info["url"], listeners)
    ]
    bases = list(dict.fromkeys(base for base, _ in listed))
    refused = []
    for base, info in listed:
        tok = token if token is not None else (info.get("token") or "")
        status = probe_status(base, tok)
        if status == 200:
            return (base, tok), [other for other in bases if other != base]
        if status == 403:
            refused.append(base)
    if refused and token is not None:
        raise TokenRefused(
            f"the token given was refused by {', '.join(refused)}: give that server's token "
            "(`jupyter server list` shows it), or give none to use the one in its runtime file"
        )
    raise ServerNotFound(f"found {len(servers)} running Jupyter server(s) but none answers /evalsched/: {HOW_TO_FIX}")


def _anothers_listener(url: str, listeners: list[Listener] | None) -> bool:
    """Whether a socket of another user listens where ``url`` connects (known only where the
    kernel's tables can be read, and the host is an address or resolves at once: a loopback
    name); False where it cannot be told."""
    if listeners is None:
        return False
    parts = urllib.parse.urlsplit(url)
    port = _port(parts)
    if not parts.hostname or port is None:
        return False
    uid = os.getuid()
    addresses = _addresses(parts.hostname, port)
    return any(owner != uid for address in addresses for owner in listening_uids(address, port, listeners))


def _addresses(host: str, port: int) -> set[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    """The addresses a TCP connection to ``host`` may go to; none where it does not resolve."""
    try:
        found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP)
        return {ipaddress.ip_address(str(info[4][0]).partition("%")[0]) for info in found}
    except (OSError, UnicodeError, ValueError):
        return set()


def _from_url(url: str, token: str | None, timeout: float) -> tuple[str, str]:
    """A URL given by the user: its token is the argument, else the one in the URL (as Jupyter
    prints it), else ``EVALSCHED_TOKEN``, else the one in that very server's runtime file.

    Its base URL: the URL as given, or a URL copied from a page of Jupyter's UIs
    (``/lab/tree/x.ipynb``) with the page cut off. Both can be right (a server may be served
    under ``/lab/``): where cutting changes the URL, the first of them, as given first, where
    this extension answers (or a runtime file lists a server)."""
    if token is None:
        token = _split_token_from_url(url)[1]
    if token is None:
        token = os.environ.get("EVALSCHED_TOKEN")
    candidates = base_candidates(url)
    if token is None:
        listed = running_servers()
        this_host = socket.gethostname()
        for base in candidates:
            for info in listed:
                if same_local_server(base, normalize_base_url(info["url"]), this_host, served_by_this_user):
                    return base, info.get("token") or ""
    return _answering_base(url, candidates, token or "", timeout), token or ""


LOOPBACK_NAMES = frozenset({"localhost", "localhost.", "ip6-localhost"})


def same_local_server(
    given: str, listed: str, this_host: str, served_by_me: Callable[[str, int], bool] = lambda host, port: False
) -> bool:
    """Whether the base URL ``given`` names the server whose runtime file says ``listed``, so
    that the file's token may be sent to it: the same URL; or the same scheme, port, path and
    host name; or, where the host names differ, both name this host's loopback (``localhost``,
    ``127.0.0.1``, ``::1``: Jupyter prints both ``localhost`` and ``127.0.0.1``), the listed one
    also by this host's own name (``this_host``: a server on all interfaces lists it), and
    ``served_by_me(given's host, port)``: each address it names is served by a socket of this
    user's alone (:func:`served_by_this_user`; two names of the loopback may be two listeners,
    of two users). Never another host."""
    if given == listed:
        return True
    a, b = urllib.parse.urlsplit(given), urllib.parse.urlsplit(listed)
    try:
        port = _port(a)
        same_port = port == _port(b)
    except ValueError:  # a port that is no number
        return False
    if a.scheme.lower() != b.scheme.lower() or not same_port or a.path != b.path or port is None:
        return False
    if a.hostname and a.hostname == b.hostname:
        return True  # (the same URL, but for the case of its host or a default port written out)
    loopback = _loopback(a.hostname) and (_loopback(b.hostname) or (b.hostname or "") == this_host.lower())
    return loopback and served_by_me(a.hostname or "", port)


def served_by_this_user(host: str, port: int) -> bool:
    """Whether each address ``host`` resolves to (TCP, ``port``) is served by a listening socket
    of this user and by no socket of another: read from the kernel's tables of sockets. False
    where that cannot be told (not Linux, a name that does not resolve)."""
    listeners = read_listeners()
    if listeners is None:
        return False
    addresses = _addresses(host, port)
    uid = os.getuid()
    return bool(addresses) and all(listening_uids(a, port, listeners) == {uid} for a in addresses)


def _port(parts: urllib.parse.SplitResult) -> int | None:
    return parts.port or {"http": 80, "https": 443}.get(parts.scheme.lower())


def _loopback(host: str | None) -> bool:
    """A name of this host's loopback: ``localhost``, ``127.x.x.x``, ``::1`` (``hostname`` of a
    URL: lower case, without the brackets)."""
    if not host:
        return False
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def base_candidates(url: str) -> list[str]:
    """Where the server of ``url`` may be: the URL as given, then cut at each path segment that
    names a page of Jupyter's UIs, the last first (``/a/lab/tree/x`` -> ``/a/lab/tree/x/``,
    ``/a/lab/``, ``/a/``). The last is the base of a URL copied from a page of a server at
    ``/a/``; JupyterHub's ``/user/<name>/`` is kept whole (a user may be called ``lab``)."""
    url = url.strip()
    parts = urllib.parse.urlsplit(url if "://" in url else "http://" + url)
    path = parts.path.rstrip("/") + "/"
    segments = path.split("/")
    start = 3 if len(segments) > 2 and segments[1] == "user" else 1  # ("", "user", name, ...)
    paths = [path] + [
        "/".join(segments[:i]) + "/" for i in range(len(segments) - 1, start - 1, -1) if segments[i] in UI_SEGMENTS
    ]
    out: list[str] = []
    for path in paths:
        base = urllib.parse.urlunsplit((parts.scheme, parts.netloc, path, "", ""))
        if base not in out:
            out.append(base)
    return out


def _answering_base(given: str, candidates: list[str], token: str, timeout: float) -> str:
    """The first candidate where this extension's API answers (to a token it takes or not);
    else the last (the server's base for a URL copied from a page: said as such when nothing
    answers there either). A URL as given that does not answer in ``timeout``: that URL (a
    slow server is no sign that it is elsewhere). Remembered per ``given`` once found."""
    if len(candidates) == 1:
        return candidates[0]
    if given in _resolved_bases:
        return _resolved_bases[given]
    for base in candidates:
        try:
            found = _api_answer(base, token, timeout)
        except TimeoutError:
            return candidates[0] if base == candidates[0] else candidates[-1]
        if found is None:
            break  # nothing answers at that address: no other path of it will
        if found:
            _resolved_bases[given] = base
            return base
    return candidates[-1]


def _api_answer(base: str, token: str, timeout: float) -> bool | None:
    """Whether this extension's API answers at ``base``: its JSON to ``/evalsched/queue``, a
    refusal of the token included, or its 503 (starting, no primary); not a page that a UI
    serves at any path under it (JupyterLab's ``/lab/tree/...``), nor a redirect (to a login
    page: not followed, so the token goes nowhere else). None when nothing (HTTP) answers there;
    TimeoutError when nothing answered in ``timeout``."""
    req = urllib.request.Request(urllib.parse.urljoin(base, "evalsched/queue?limit=0"))
    if token:
        req.add_header("Authorization", f"token {token}")
    try:
        with PROBE_OPENER.open(req, timeout=timeout) as resp:
            status, kind, body = int(resp.status), resp.headers.get_content_type(), resp.read(65536)
    except urllib.error.HTTPError as e:  # (a 3xx too: redirects are not followed)
        status, kind, body = int(e.code), e.headers.get_content_type(), e.read(65536)
    except urllib.error.URLError as e:
        if isinstance(e.reason, TimeoutError):
            raise TimeoutError(str(e.reason)) from None
        return None
    except TimeoutError:
        raise
    except (OSError, ValueError, http.client.HTTPException):  # (HTTPException: not HTTP there)
        return None
    if status not in (200, 401, 403, 503) or kind != "application/json":
        return False
    try:
        answer = json.loads(body)
    except ValueError:  # (a queue cut at 64 KiB: a JSON answer all the same)
        return status == 200 and body.startswith(b"{")
    # A 503: the extension's own (the scheduler is starting, no primary) says why, in a message.
    return isinstance(answer, dict) and (status != 503 or "message" in answer)


def running_servers(runtime_dir: str | None = None) -> list[dict]:
    """The ``jpserver-*.json`` of live servers, newest first.

    Same logic as ``jupyter_server.serverapp.list_running_servers`` without importing it: that
    module costs about two seconds to import, which every CLI call and kernel would pay.
    """
    runtime_dir = runtime_dir or _runtime_dir()
    found = []
    for path in glob.glob(os.path.join(runtime_dir, "jpserver-*.json")):
        info = read_server_file(path)
        if info and isinstance(info.get("pid"), int) and _pid_alive(info["pid"]):
            try:
                mtime = os.path.getmtime(path)
            except OSError:
                mtime = 0.0
            found.append((mtime, info))
    found.sort(key=lambda item: item[0], reverse=True)
    return [info for _, info in found]


def read_server_file(path: str) -> dict | None:
    """A ``jpserver-<pid>.json`` as a dict with a ``url``, or None (missing, unreadable, partial)."""
    try:
        with open(path, encoding="utf-8") as f:
            info = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(info, dict) or not info.get("url"):
        return None
    return info


def probe_api(base: str, token: str, timeout: float = PROBE_TIMEOUT_S) -> bool:
    """Whether the server at ``base`` answers ``/evalsched/queue`` (the extension is enabled there)."""
    return probe_status(base, token, timeout) == 200


def probe_status(base: str, token: str, timeout: float = PROBE_TIMEOUT_S) -> int | None:
    """The HTTP status of ``/evalsched/queue`` at ``base`` (403: the token is refused), or None
    when nothing answers."""
    # limit=0: the answer lists no queued run, whatever the queue's length (an older server
    # ignores the parameter, and answers all).
    req = urllib.request.Request(urllib.parse.urljoin(base, "evalsched/queue?limit=0"))
    if token:
        req.add_header("Authorization", f"token {token}")
    try:
        with PROBE_OPENER.open(req, timeout=timeout) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as e:  # (a 3xx too: redirects are not followed)
        return int(e.code)
    except (OSError, ValueError, http.client.HTTPException):
        return None


def normalize_base_url(url: str) -> str:
    """``host:8888/base`` -> ``http://host:8888/base/``: a scheme and exactly one trailing slash."""
    url = url.strip()
    if "://" not in url:
        url = "http://" + url
    return url.rstrip("/") + "/"


# The first path segment of a page of Jupyter's UIs (JupyterLab, Notebook 7 and classic, Voilà),
# or of this API: a URL copied from the browser or from the server's log is cut there.
UI_SEGMENTS = frozenset(
    {"lab", "tree", "notebooks", "doc", "edit", "view", "consoles", "terminals", "retro", "voila", "evalsched"}
)


def _split_token_from_url(url: str) -> tuple[str, str | None]:
    """``http://h:8888/lab?token=abc`` -> (``http://h:8888/``, ``abc``): the token, and the URL
    without the page (``/user/alice/lab/tree/x.ipynb`` -> ``/user/alice/``: the last of
    :func:`base_candidates`)."""
    if "://" not in url.strip():
        url = "http://" + url.strip()
    parts = urllib.parse.urlsplit(url.strip())
    token = urllib.parse.parse_qs(parts.query).get("token", [None])[0]
    return urllib.parse.urlunsplit((parts.scheme, parts.netloc, _base_path(parts.path), "", "")), token


def _base_path(path: str) -> str:
    """``path`` up to its first UI segment. JupyterHub's ``/user/<name>/`` is kept whole, the name
    included (a user may be called ``lab``)."""
    segments = path.split("/")
    start = 3 if len(segments) > 2 and segments[1] == "user" else 1  # ("", "user", name, ...)
    for i in range(start, len(segments)):
        if segments[i] in UI_SEGMENTS:
            return "/".join(segments[:i]) + "/"
    return path


def _runtime_dir() -> str:
    from jupyter_core.paths import jupyter_runtime_dir  # lazily: only discovery needs it

    return jupyter_runtime_dir()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, and someone else's
        return True
    except OSError:
        return False
    return True
