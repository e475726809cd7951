"""Finding the server to talk to, first that works:

1. explicit ``url``/``token`` arguments;
2. ``EVALSCHED_URL`` / ``EVALSCHED_TOKEN`` in the environment;
3. the runtime file of the server that launched this kernel (``JPY_PARENT_PID``);
4. any running Jupyter server found in the runtime directory that answers ``/evalsched/queue``.
"""

from __future__ import annotations

import glob
import json
import os
import urllib.error
import urllib.parse
import urllib.request

from .errors import HOW_TO_FIX, ServerNotFound, TokenRefused


def discover_server(url: str | None = None, token: str | None = None) -> tuple[str, str]:
    """Return ``(base_url, token)`` of the server to talk to, or raise :class:`ServerNotFound`."""
    if url is None:
        url = os.environ.get("EVALSCHED_URL") or None
        if url is not None and token is None:
            token = os.environ.get("EVALSCHED_TOKEN")
    if url is not None:
        return _from_url(url, token)

    parent = os.environ.get("JPY_PARENT_PID")
    if parent and parent.isdigit():
        info = read_server_file(os.path.join(_runtime_dir(), f"jpserver-{parent}.json"))
        if info is not None:
            return normalize_base_url(info["url"]), token if token is not None else (info.get("token") or "")

    servers = running_servers()
    if not servers:
        raise ServerNotFound(f"no running Jupyter server found: {HOW_TO_FIX}")
    refused = []
    for info in servers:
        base = normalize_base_url(info["url"])
        tok = token if token is not None else (info.get("token") or "")
        status = probe_status(base, tok)
        if status == 200:
            return base, tok
        if status == 403:
            refused.append(base)
    if refused and token is not None:
        raise TokenRefused(
            f"the token given was refused by {', '.join(refused)}: give that server's token "
            "(`jupyter server list` shows it), or give none to use the one in its runtime file"
        )
    raise ServerNotFound(f"found {len(servers)} running Jupyter server(s) but none answers /evalsched/: {HOW_TO_FIX}")


def _from_url(url: str, token: str | None) -> tuple[str, str]:
    """A URL given by the user: its token is the argument, else the one in the URL (as Jupyter
    prints it), else ``EVALSCHED_TOKEN``, else the one in that very server's runtime file."""
    url, url_token = _split_token_from_url(url)
    if token is None:
        token = url_token
    if token is None:
        token = os.environ.get("EVALSCHED_TOKEN")
    base = normalize_base_url(url)
    if token is None:
        for info in running_servers():
            if normalize_base_url(info["url"]) == base:
                return base, info.get("token") or ""
    return base, token or ""


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


def probe_api(base: str, token: str, timeout: float = 2.0) -> bool:
    """Whether the server at ``base`` answers ``/evalsched/queue`` (the extension is enabled there)."""
    return probe_status(base, token, timeout) == 200


def probe_status(base: str, token: str, timeout: float = 2.0) -> int | None:
    """The HTTP status of ``/evalsched/queue`` at ``base`` (403: the token is refused), or None
    when nothing answers."""
    # limit=0: the answer lists no queued run, whatever the queue's length (an older server
    # ignores the parameter, and answers all).
    req = urllib.request.Request(urllib.parse.urljoin(base, "evalsched/queue?limit=0"))
    if token:
        req.add_header("Authorization", f"token {token}")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as e:
        return int(e.code)
    except (OSError, ValueError):
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
    """``http://h:8888/lab?token=abc`` -> (``http://h:8888/``, ``abc``): the token, and the server's
    base URL without the page (``/user/alice/lab/tree/x.ipynb`` -> ``/user/alice/``)."""
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
