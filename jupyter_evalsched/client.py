"""Python client of the ``/evalsched/`` REST API, used by the magics, the widget and the CLI.

Kept light on purpose: the REST side uses only ``urllib`` and ``json`` (no pydantic, no
jupyter_server), so that importing it in a kernel or a terminal costs milliseconds. The event
stream (a WebSocket) imports ``websocket-client`` or, failing that, tornado, lazily.

Server discovery, first that works:

1. explicit ``url``/``token`` arguments;
2. ``EVALSCHED_URL`` / ``EVALSCHED_TOKEN`` in the environment;
3. the runtime file of the server that launched this kernel (``JPY_PARENT_PID``);
4. any running Jupyter server found in the runtime directory that answers ``/evalsched/queue``.
"""

from __future__ import annotations

import glob
import json
import os
import queue as _queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from typing import Any

__all__ = [
    "TERMINAL_STATES",
    "EvalSchedClientError",
    "ServerNotFound",
    "EvalSchedError",
    "SpecError",
    "WaitTimeout",
    "EventStreamClosed",
    "EvalSchedClient",
    "EventStream",
    "RunHandle",
    "LocalServer",
    "SPEC_FLAGS",
    "apply_spec_options",
    "load_spec_file",
    "parse_param",
]

TERMINAL_STATES = frozenset({"succeeded", "failed", "cancelled", "aborted"})

_HOW_TO_FIX = "start Jupyter with the jupyter_evalsched extension enabled, or set EVALSCHED_URL and EVALSCHED_TOKEN"


# --------------------------------------------------------------------------- errors


class EvalSchedClientError(Exception):
    """Base class of every error this client raises."""


class ServerNotFound(EvalSchedClientError):
    """No server could be found or reached. The message says how to fix it."""


class SpecError(EvalSchedClientError, ValueError):
    """The spec could not be built on the client side (bad file, bad flag)."""


class WaitTimeout(EvalSchedClientError, TimeoutError):
    """``wait(timeout=...)`` ran out before the run reached a terminal state."""

    def __init__(self, run_id: str, timeout: float, record: dict | None):
        self.run_id = run_id
        self.record = record
        state = (record or {}).get("state", "?")
        super().__init__(f"run {run_id} still {state} after {timeout:g} s")


class EventStreamClosed(EvalSchedClientError):
    """The event WebSocket was closed (by us or by the server)."""


class EvalSchedError(EvalSchedClientError):
    """An HTTP error answered by the server: ``status``, ``message``, ``reason``, ``detail``.

    ``str()`` is one readable line, e.g.
    ``422: scheduling.marginal_vram_mb: Input should be greater than or equal to 0``.
    """

    def __init__(self, status: int, message: str, detail: list | None = None, reason: str | None = None):
        self.status = status
        self.message = message
        self.detail = detail
        self.reason = reason
        super().__init__(self._one_line())

    def _one_line(self) -> str:
        text = self.message or self.reason or "error"
        if self.detail:
            parts = [_format_field_error(item) for item in self.detail[:3]]
            more = len(self.detail) - 3
            text = "; ".join(p for p in parts if p) or text
            if more > 0:
                text += f" (and {more} more)"
        text = " ".join(str(text).split())  # one line, whatever the server sent
        return f"{self.status}: {text}"


def _format_field_error(item: Any) -> str:
    """``{"loc": ["body", "scheduling", "gpus"], "msg": "..."}`` -> ``scheduling.gpus: ...``."""
    if not isinstance(item, dict):
        return str(item)
    loc = item.get("loc") or item.get("field") or ()
    if isinstance(loc, str):
        loc = [loc]
    names = [str(p) for p in loc if p not in ("body", "__root__")]
    msg = item.get("msg") or item.get("message") or ""
    return f"{'.'.join(names)}: {msg}" if names else str(msg)


# --------------------------------------------------------------------------- discovery


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except OSError:
        return False
    return True


def _runtime_dir() -> str:
    from jupyter_core.paths import jupyter_runtime_dir

    return jupyter_runtime_dir()


def _read_server_file(path: str) -> dict | None:
    try:
        with open(path, encoding="utf-8") as f:
            info = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(info, dict) or not info.get("url"):
        return None
    return info


def running_servers(runtime_dir: str | None = None) -> list[dict]:
    """The ``jpserver-*.json`` of live servers, newest first.

    Same logic as ``jupyter_server.serverapp.list_running_servers`` without importing it: that
    module costs about two seconds to import, which every CLI call and kernel would pay.
    """
    runtime_dir = runtime_dir or _runtime_dir()
    found = []
    for path in glob.glob(os.path.join(runtime_dir, "jpserver-*.json")):
        info = _read_server_file(path)
        if info and isinstance(info.get("pid"), int) and _pid_alive(info["pid"]):
            try:
                mtime = os.path.getmtime(path)
            except OSError:
                mtime = 0.0
            found.append((mtime, info))
    found.sort(key=lambda item: item[0], reverse=True)
    return [info for _, info in found]


def _split_token_from_url(url: str) -> tuple[str, str | None]:
    """``http://h:8888/lab?token=abc`` -> (``http://h:8888/lab``, ``abc``)."""
    parts = urllib.parse.urlsplit(url)
    qs = urllib.parse.parse_qs(parts.query)
    token = qs.get("token", [None])[0]
    clean = urllib.parse.urlunsplit((parts.scheme, parts.netloc, parts.path, "", ""))
    return clean, token


def _normalize_base(url: str) -> str:
    url = url.strip()
    if "://" not in url:
        url = "http://" + url
    return url.rstrip("/") + "/"


def discover_server(url: str | None = None, token: str | None = None) -> tuple[str, str]:
    """Return ``(base_url, token)`` of the server to talk to, or raise :class:`ServerNotFound`."""
    if url is None:
        url = os.environ.get("EVALSCHED_URL") or None
        if url is not None and token is None:
            token = os.environ.get("EVALSCHED_TOKEN")
    if url is not None:
        url, url_token = _split_token_from_url(url)
        if token is None:
            token = url_token
        if token is None:
            token = os.environ.get("EVALSCHED_TOKEN")
        base = _normalize_base(url)
        if token is None:
            # A URL without a token: take it from the runtime file of that very server, if any.
            for info in running_servers():
                if _normalize_base(info["url"]) == base:
                    token = info.get("token") or ""
                    break
        return base, token or ""

    parent = os.environ.get("JPY_PARENT_PID")
    if parent and parent.isdigit():
        info = _read_server_file(os.path.join(_runtime_dir(), f"jpserver-{parent}.json"))
        if info is not None:
            return _normalize_base(info["url"]), token if token is not None else (info.get("token") or "")

    servers = running_servers()
    if not servers:
        raise ServerNotFound(f"no running Jupyter server found: {_HOW_TO_FIX}")
    for info in servers:
        base = _normalize_base(info["url"])
        tok = token if token is not None else (info.get("token") or "")
        if _probe(base, tok):
            return base, tok
    raise ServerNotFound(f"found {len(servers)} running Jupyter server(s) but none answers /evalsched/: {_HOW_TO_FIX}")


def _probe(base: str, token: str, timeout: float = 2.0) -> bool:
    req = urllib.request.Request(urllib.parse.urljoin(base, "evalsched/queue"))
    if token:
        req.add_header("Authorization", f"token {token}")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status == 200
    except (OSError, ValueError):
        return False


# --------------------------------------------------------------------------- spec building

# The submit flags, shared by the CLI (argparse) and the magics (IPython's magic_arguments, which
# wraps argparse): one definition, so the two can never drift apart.
SPEC_FLAGS: list[tuple[tuple[str, ...], dict[str, Any]]] = [
    (("--name",), dict(help="run name (default: derived from the entrypoint)")),
    (("--episodes",), dict(type=int, metavar="N", help="number of episodes (default 1)")),
    (
        ("--vram",),
        dict(
            type=int,
            metavar="MB",
            help="marginal VRAM per GPU in MB, on top of the shared models (default 0: CPU only)",
        ),
    ),
    (("--gpus",), dict(type=int, metavar="N", help="GPUs needed when --vram > 0 or --exclusive (default 1)")),
    (("--cpus",), dict(type=int, metavar="N", help="CPU slots the run takes (default 1)")),
    (("--priority",), dict(choices=["high", "normal", "low"], help="priority lane (default normal)")),
    (("--exclusive",), dict(action="store_true", default=None, help="nothing else may run on the run's GPUs")),
    (
        ("--depends-on",),
        dict(
            action="append",
            dest="depends_on",
            metavar="RUN_ID",
            help="start only after this run succeeded (repeatable)",
        ),
    ),
    (
        ("--param",),
        dict(
            action="append",
            dest="params",
            metavar="KEY=VALUE",
            help="eval parameter; VALUE is parsed as JSON when it parses, else kept as a string (repeatable)",
        ),
    ),
    (
        ("--model",),
        dict(
            action="append",
            dest="models",
            metavar="NAME",
            help="shared model the eval uses through ctx.model(NAME) (repeatable)",
        ),
    ),
    (("--workers",), dict(type=int, metavar="N", help="worker processes for the episodes (default 1)")),
    (("--timeout",), dict(type=float, metavar="SECONDS", help="fail the run after this many seconds")),
    (("--seed",), dict(type=int, help="base seed; episode i gets seed + i (default 0)")),
    (
        ("--executor",),
        dict(
            choices=["local", "slurm"],
            help="where the run executes: this host's ledger or SLURM (default: the server's)",
        ),
    ),
]

SPEC_FILE_SUFFIXES = (".json", ".yaml", ".yml")


def parse_param(text: str) -> tuple[str, Any]:
    """``"k=v"`` -> ``("k", v)`` with ``v`` parsed as JSON when it parses, else the raw string."""
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key:
        raise SpecError(f"--param expects KEY=VALUE, got {text!r}")
    try:
        value = json.loads(raw)
    except ValueError:
        value = raw
    return key, value


def load_spec_file(path: str) -> dict:
    """Read a ``.json`` or ``.yaml`` spec. A relative ``cwd`` in it is relative to the file."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise SpecError(f"cannot read spec file {path}: {e.strerror or e}") from None
    try:
        if path.endswith(".json"):
            spec = json.loads(text)
        else:
            import yaml

            spec = yaml.safe_load(text)
    except Exception as e:  # json.JSONDecodeError, yaml.YAMLError: both carry a position
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise SpecError(f"cannot parse spec file {path}: {first}") from None
    if not isinstance(spec, dict):
        raise SpecError(f"spec file {path} must contain a mapping, not {type(spec).__name__}")
    cwd = spec.get("cwd")
    if isinstance(cwd, str) and cwd and not os.path.isabs(cwd):
        spec["cwd"] = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(path)), cwd))
    return spec


def _run_id_of(value: Any) -> Any:
    return value.id if isinstance(value, RunHandle) else value


def apply_spec_options(spec: dict | None, options: Any, *, default_cwd: str | None = None) -> dict:
    """Return a copy of ``spec`` with the flags of :data:`SPEC_FLAGS` (an argparse namespace) applied.

    Flags override the spec's values; ``--depends-on``, ``--model`` append; ``--param`` updates.
    ``cwd`` defaults to ``default_cwd`` (the caller's working directory).
    """
    out = json.loads(json.dumps(spec, default=_run_id_of)) if spec else {}
    get = lambda name: getattr(options, name, None)  # noqa: E731

    for flag, key in (
        ("name", "name"),
        ("episodes", "episodes"),
        ("workers", "workers"),
        ("seed", "seed"),
        ("timeout", "timeout_s"),
        ("executor", "executor"),
    ):
        if get(flag) is not None:
            out[key] = get(flag)

    sched = dict(out.get("scheduling") or {})
    for flag, key in (
        ("vram", "marginal_vram_mb"),
        ("gpus", "gpus"),
        ("cpus", "cpus"),
        ("priority", "priority"),
        ("exclusive", "exclusive_gpu"),
    ):
        if get(flag) is not None:
            sched[key] = get(flag)
    if sched or "scheduling" in out:
        out["scheduling"] = sched

    if get("params"):
        params = dict(out.get("params") or {})
        for item in get("params"):
            key, value = parse_param(item)
            params[key] = value
        out["params"] = params
    for flag in ("depends_on", "models"):
        if get(flag):
            merged = list(out.get(flag) or []) + [_run_id_of(v) for v in get(flag)]
            out[flag] = list(dict.fromkeys(merged))
    if default_cwd is not None and not out.get("cwd"):
        out["cwd"] = default_cwd
    return out


# --------------------------------------------------------------------------- time helpers


def parse_time(value: str | None) -> datetime | None:
    if not value:
        return None
    try:
        dt = datetime.fromisoformat(value)
    except ValueError:
        return None
    return dt if dt.tzinfo else dt.replace(tzinfo=UTC)


def elapsed_s(record: dict) -> float | None:
    """Seconds a run has been running (or ran, once finished)."""
    start = parse_time(record.get("started_at"))
    if start is None:
        return None
    end = parse_time(record.get("finished_at")) or datetime.now(UTC)
    return max(0.0, (end - start).total_seconds())


def format_duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 60:
        return f"{seconds:.1f}s"
    seconds = int(seconds)
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m:02d}:{s:02d}"


def metric_means(source: dict | None) -> dict[str, float]:
    """Per-metric means of a run record (its ``summary`` when present, else its ``metrics``) or
    of a ``summary.json`` dict."""
    source = source or {}
    if source.get("summary"):
        source = source["summary"]
    metrics = source.get("metrics") or {}
    out = {}
    for name, stats in metrics.items():
        if isinstance(stats, dict) and isinstance(stats.get("mean"), (int, float)):
            out[name] = stats["mean"]
    return out


def format_metrics(source: dict | None, limit: int = 4) -> str:
    """``score=0.6804 acc=0.9`` from a run record or a summary."""
    means = metric_means(source)
    items = [f"{k}={v:.4g}" for k, v in list(means.items())[:limit]]
    if len(means) > limit:
        items.append("…")
    return " ".join(items)


# --------------------------------------------------------------------------- the client


class EvalSchedClient:
    """Blocking client of one server's ``/evalsched/`` API.

    >>> c = EvalSchedClient()                       # discovery, see the module docstring
    >>> rec = c.submit({"entrypoint": "jupyter_evalsched.examples.basic:noop"})
    >>> c.wait(rec["id"])["state"]
    'succeeded'
    """

    def __init__(self, url: str | None = None, token: str | None = None, *, timeout: float = 30.0):
        self.base_url, self.token = discover_server(url, token)
        self.timeout = timeout

    def __repr__(self) -> str:
        return f"EvalSchedClient({self.base_url!r})"

    # ---- transport

    def _url(self, path: str, query: dict | None = None) -> str:
        url = urllib.parse.urljoin(self.base_url, "evalsched/" + path.lstrip("/"))
        if query:
            clean = {k: v for k, v in query.items() if v is not None}
            if clean:
                url += "?" + urllib.parse.urlencode(clean)
        return url

    def _headers(self) -> dict[str, str]:
        headers = {"Accept": "application/json"}
        if self.token:
            headers["Authorization"] = f"token {self.token}"
        return headers

    def request(
        self,
        method: str,
        path: str,
        *,
        query: dict | None = None,
        body: Any = None,
        raw: bool = False,
        timeout: float | None = None,
    ) -> Any:
        """One REST call; JSON is decoded unless ``raw`` (then the text is returned)."""
        data = None
        headers = self._headers()
        if body is not None:
            data = json.dumps(body).encode("utf-8")
            headers["Content-Type"] = "application/json"
        req = urllib.request.Request(self._url(path, query), data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=timeout or self.timeout) as resp:
                payload = resp.read()
                charset = resp.headers.get_content_charset() or "utf-8"
        except urllib.error.HTTPError as e:
            raise self._http_error(e, path) from None
        except urllib.error.URLError as e:
            reason = getattr(e.reason, "strerror", None) or str(e.reason)
            raise ServerNotFound(f"cannot reach {self.base_url}: {reason}: {_HOW_TO_FIX}") from None
        except (TimeoutError, ConnectionError) as e:
            raise ServerNotFound(f"cannot reach {self.base_url}: {e}") from None
        text = payload.decode(charset, errors="replace")
        if raw:
            return text
        if not text:
            return None
        try:
            return json.loads(text)
        except ValueError:
            raise EvalSchedError(200, f"the server answered {path} with something that is not JSON") from None

    def _http_error(self, e: urllib.error.HTTPError, path: str) -> EvalSchedError:
        try:
            body = json.loads(e.read().decode("utf-8", errors="replace") or "null")
        except (ValueError, OSError):
            body = None
        if isinstance(body, dict) and ("message" in body or "reason" in body):
            detail = body.get("detail")
            message = str(body.get("message") or "")
            if e.code == 403 and message.lower() in ("", "forbidden"):
                message = "forbidden: wrong or missing token (set EVALSCHED_TOKEN or pass the token)"
            return EvalSchedError(e.code, message, detail if isinstance(detail, list) else None, body.get("reason"))
        if e.code == 404:
            return EvalSchedError(
                404, f"no /evalsched/ API at {self.base_url} (is the jupyter_evalsched server extension enabled?)"
            )
        if e.code == 403:
            return EvalSchedError(403, "forbidden: wrong or missing token (set EVALSCHED_TOKEN)")
        return EvalSchedError(e.code, str(e.reason or "HTTP error"))

    # ---- endpoints

    def submit(self, spec: dict) -> dict:
        """``POST /evalsched/runs``: the new run record (``queued``, or already ``running``)."""
        return self.request("POST", "runs", body=json.loads(json.dumps(spec, default=_run_id_of)))

    def list(self, state: str | list[str] | None = None, limit: int | None = None) -> list[dict]:
        """Run records, newest first. ``state`` may be ``"queued"``, ``"failed,cancelled"`` or a list."""
        if isinstance(state, (list, tuple, set, frozenset)):
            state = ",".join(state)
        return self.request("GET", "runs", query={"state": state, "limit": limit})["runs"]

    def get(self, run_id: str) -> dict:
        """The run record with ``summary`` (the run's ``summary.json``, or None)."""
        return self.request("GET", f"runs/{_quote_id(run_id)}")

    def delete(self, run_id: str) -> None:
        self.request("DELETE", f"runs/{_quote_id(run_id)}")

    def cancel(self, run_id: str) -> dict:
        return self.request("POST", f"runs/{_quote_id(run_id)}/cancel", body={})

    def logs(self, run_id: str, stream: str = "stdout", tail: int | None = None) -> str:
        return self.request("GET", f"runs/{_quote_id(run_id)}/logs", query={"stream": stream, "tail": tail}, raw=True)

    def episodes(self, run_id: str) -> list[dict]:
        return self.request("GET", f"runs/{_quote_id(run_id)}/episodes")["episodes"]

    def queue(self) -> dict:
        """``{"queued": [...] in admission order, "running": [...], "ledger": {...}}``."""
        return self.request("GET", "queue")

    def ledger(self) -> dict:
        return self.request("GET", "ledger")

    def models(self) -> list[dict]:
        return self.request("GET", "models")["models"]

    def openapi(self) -> dict:
        return self.request("GET", "openapi.json")

    def handle(self, run: str | dict) -> RunHandle:
        """A :class:`RunHandle` for a run id or record."""
        return RunHandle(self, run)

    def events(self, *, connect_timeout: float = 10.0, backend: str | None = None) -> EventStream:
        """The ``/evalsched/events`` WebSocket as an iterator of event dicts (close it, or use ``with``).

        The first event is ``{"type": "snapshot", "queue": ...}``, then ``{"type": "run", "run": ...}``.
        """
        return EventStream(self, connect_timeout=connect_timeout, backend=backend)

    def wait(
        self,
        run_id: str,
        timeout: float | None = None,
        *,
        use_events: bool = True,
        on_update: Callable[[dict], None] | None = None,
        poll_s: float = 1.0,
    ) -> dict:
        """Block until the run is terminal; return its final record (with ``summary``).

        Events wake the wait at once; a REST poll runs as a safety net (every ``poll_s`` without a
        socket, every few seconds with one). ``on_update(record)`` is called at every change.
        Raises :class:`WaitTimeout` after ``timeout`` seconds.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        stream = None
        if use_events:
            try:
                stream = self.events(connect_timeout=5.0)
            except Exception:  # no socket: polling alone is correct, only slower
                stream = None
        try:
            # Subscribe first, then read: a transition between the two cannot be missed.
            record = self.get(run_id)
            fresh = True  # the record came from GET (with an up-to-date summary), not an event
            last_get = time.monotonic()
            last_seen: tuple | None = None
            while True:
                if record.get("state") in TERMINAL_STATES and not fresh:
                    record, fresh = self.get(run_id), True  # the final summary.json is only in a GET
                key = (
                    record.get("state"),
                    json.dumps(record.get("progress"), sort_keys=True),
                    record.get("reason"),
                    json.dumps(metric_means(record)),
                )
                if on_update is not None and key != last_seen:
                    on_update(record)
                last_seen = key
                if record.get("state") in TERMINAL_STATES:
                    return record
                now = time.monotonic()
                if deadline is not None and now >= deadline:
                    raise WaitTimeout(run_id, timeout or 0.0, record)
                safety_poll = 3.0 if stream is not None else poll_s
                step = min(safety_poll, (deadline - now) if deadline is not None else safety_poll)
                refreshed = False
                if stream is not None:
                    try:
                        event = stream.next_event(timeout=max(0.01, step))
                    except EventStreamClosed:
                        stream.close()
                        stream = None
                        continue
                    if event and event.get("type") == "run" and (event.get("run") or {}).get("id") == run_id:
                        new = dict(event["run"])
                        progressed = new.get("progress") != record.get("progress")
                        new.setdefault("summary", record.get("summary"))
                        record, fresh = new, False
                        # Records carry the latest metrics; a server whose records do not is
                        # read through GET (summary.json) at most once a second while progressing.
                        if progressed and "metrics" not in new and time.monotonic() - last_get >= 1.0:
                            record, fresh = self.get(run_id), True
                            last_get = time.monotonic()
                        refreshed = True
                else:
                    time.sleep(max(0.01, step))
                if not refreshed and time.monotonic() - last_get >= (safety_poll - 0.05):
                    record, fresh = self.get(run_id), True
                    last_get = time.monotonic()
        finally:
            if stream is not None:
                stream.close()


def _quote_id(run_id: str) -> str:
    if isinstance(run_id, RunHandle):
        run_id = run_id.id
    if isinstance(run_id, dict):
        run_id = run_id["id"]
    return urllib.parse.quote(str(run_id), safe="")


# --------------------------------------------------------------------------- event stream


class EventStream:
    """An open ``/evalsched/events`` WebSocket.

    Iterate it for event dicts (iteration ends when the socket closes), or call
    :meth:`next_event` with a timeout. ``close()`` is safe from any thread and idempotent.
    Uses ``websocket-client`` when installed, else tornado on a private thread.
    """

    def __init__(self, client: EvalSchedClient, *, connect_timeout: float = 10.0, backend: str | None = None):
        parts = urllib.parse.urlsplit(client._url("events"))
        scheme = "wss" if parts.scheme == "https" else "ws"
        self.url = urllib.parse.urlunsplit((scheme, parts.netloc, parts.path, "", ""))
        self._headers = {"Authorization": f"token {client.token}"} if client.token else {}
        self._closed = False
        if backend is None:
            try:
                import websocket  # noqa: F401  (websocket-client)

                backend = "websocket-client"
            except ImportError:
                backend = "tornado"
        self.backend = backend
        if backend == "websocket-client":
            self._impl: _WsClientImpl | _TornadoImpl = _WsClientImpl(self.url, self._headers, connect_timeout)
        elif backend == "tornado":
            self._impl = _TornadoImpl(self.url, self._headers, connect_timeout)
        else:
            raise ValueError(f"unknown event stream backend {backend!r}")

    @property
    def closed(self) -> bool:
        return self._closed

    def next_event(self, timeout: float | None = None) -> dict | None:
        """The next event, or None when ``timeout`` passes first. Raises :class:`EventStreamClosed`."""
        if self._closed:
            raise EventStreamClosed("event stream closed")
        try:
            text = self._impl.recv(timeout)
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
            self._impl.close()

    def __enter__(self) -> EventStream:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


class _WsClientImpl:
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


class _TornadoImpl:
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


# --------------------------------------------------------------------------- run handle


def _in_kernel() -> bool:
    ip = sys.modules.get("IPython") and sys.modules["IPython"].get_ipython()
    return bool(ip is not None and getattr(ip, "kernel", None) is not None)


class RunHandle:
    """One run: what ``%eval_submit`` returns and ``client.handle(id)`` builds.

    ``status()``, ``record()``, ``summary()``, ``episodes()``, ``logs()`` read the server; ``wait()``
    shows a progress bar (a widget in a notebook, text in a terminal) and returns the final record.
    Displaying the handle in a notebook shows the run's live progress widget.
    """

    def __init__(self, client: EvalSchedClient, run: str | dict):
        self.client = client
        if isinstance(run, dict):
            self.id = run["id"]
            self._record: dict | None = dict(run)
        else:
            self.id = str(run)
            self._record = None

    # ---- reads

    @property
    def run_dir(self) -> str | None:
        """The run directory on the server's host (from the record's ``run_dir``)."""
        rec = self._record if self._record and "run_dir" in self._record else self.record()
        return rec.get("run_dir")

    @property
    def name(self) -> str | None:
        return (self._record or self.record()).get("name")

    def record(self) -> dict:
        """The current run record, with ``summary``."""
        self._record = self.client.get(self.id)
        return self._record

    def status(self) -> str:
        """The run's state: queued, running, succeeded, failed, cancelled or aborted."""
        return self.record()["state"]

    def summary(self) -> dict | None:
        """The run's ``summary.json`` (episodes done, per-metric mean/std/min/max/count), or None."""
        return self.record().get("summary")

    def episodes(self):
        """Finished episodes: a pandas DataFrame (one column per metric) when pandas is installed,
        else a list of dicts."""
        rows = self.client.episodes(self.id)
        try:
            import pandas as pd
        except ImportError:
            return rows
        flat = []
        for ep in rows:
            row = {k: v for k, v in ep.items() if k != "metrics"}
            row.update(ep.get("metrics") or {})
            flat.append(row)
        df = pd.DataFrame(flat)
        for col in ("started_at", "finished_at"):
            if col in df:
                df[col] = pd.to_datetime(df[col], utc=True, errors="coerce", format="ISO8601")
        if "index" in df:
            df = df.sort_values("index").reset_index(drop=True)
        return df

    def logs(self, stream: str = "stdout", tail: int | None = None) -> str:
        return self.client.logs(self.id, stream=stream, tail=tail)

    def cancel(self) -> dict:
        """Cancel the run (queued: at once; running: its process group is signalled)."""
        self._record = self.client.cancel(self.id)
        return self._record

    # ---- waiting

    def wait(self, timeout: float | None = None, progress: bool = True) -> dict:
        """Wait for the end of the run and return its final record (with ``summary``).

        Shows a progress bar unless ``progress=False``. Ctrl-C / interrupting the kernel stops
        waiting and returns the current record: the run itself goes on (``cancel()`` stops it).
        Raises :class:`WaitTimeout` after ``timeout`` seconds.
        """
        reporter = _make_reporter(self) if progress else None
        try:
            record = self.client.wait(self.id, timeout=timeout, on_update=reporter.update if reporter else None)
        except KeyboardInterrupt:
            record = self._record or {"id": self.id, "state": "?"}
            try:
                record = self.record()
            except (EvalSchedClientError, KeyboardInterrupt):
                pass
            if reporter:
                reporter.finish(record)
            print(
                f"stopped waiting; run {self.id} is still {record.get('state')} (cancel it with .cancel())",
                file=sys.stderr,
            )
            return record
        except BaseException:
            if reporter:
                reporter.finish(self._record or {})
            raise
        self._record = record
        if reporter:
            reporter.finish(record)
        return record

    # ---- display

    def __repr__(self) -> str:
        rec = self._record or {}
        state = rec.get("state", "?")
        prog = rec.get("progress") or {}
        extra = f" {prog.get('done', 0)}/{prog.get('total', 0)}" if prog.get("total") else ""
        return f"<RunHandle {self.id} {rec.get('name', '')!s} {state}{extra}>".replace("  ", " ")

    def _repr_html_(self) -> str:
        from html import escape

        rec = self._record or {"id": self.id}
        rows = [
            ("id", rec.get("id")),
            ("name", rec.get("name")),
            ("state", rec.get("state")),
            ("reason", rec.get("reason")),
            ("progress", "{done}/{total}".format(**(rec.get("progress") or {"done": 0, "total": 0}))),
            ("metrics", format_metrics(rec)),
        ]
        body = "".join(
            f"<tr><th style='text-align:left'>{escape(k)}</th><td>{escape(str(v))}</td></tr>"
            for k, v in rows
            if v not in (None, "")
        )
        return f"<table class='evalsched-run'>{body}</table>"

    def _ipython_display_(self) -> None:
        from IPython.display import display

        if _in_kernel():
            try:
                from .widget import RunProgress

                display(RunProgress(self))
                return
            except ImportError:  # ipywidgets missing: the static view below
                pass
        display({"text/plain": repr(self), "text/html": self._repr_html_()}, raw=True)


class _TextProgress:
    """A tqdm-like line on stderr: redrawn in place on a terminal, one line per change otherwise."""

    def __init__(self, handle: RunHandle, stream=None, width: int = 28):
        self.handle = handle
        self.stream = stream or sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.width = width
        self.log_interval_s = 5.0
        self._last_line = ""
        self._last_key: tuple | None = None
        self._last_print = 0.0

    def _line(self, rec: dict) -> str:
        prog = rec.get("progress") or {}
        done, total = int(prog.get("done") or 0), int(prog.get("total") or 0)
        frac = (done / total) if total else (1.0 if rec.get("state") == "succeeded" else 0.0)
        filled = int(round(frac * self.width))
        bar = "#" * filled + "-" * (self.width - filled)
        state = rec.get("state", "?")
        if state == "queued" and rec.get("reason"):
            state = f"queued ({rec['reason'].split(': ')[0]})"
        elif state not in ("running", "succeeded") and rec.get("reason"):
            state = f"{state} ({rec['reason']})"
        metrics = format_metrics(rec, limit=3)
        name = rec.get("name") or self.handle.id
        return (
            f"{name} [{bar}] {done}/{total} {format_duration(elapsed_s(rec))} {state}"
            f"{'  ' + metrics if metrics else ''}"
        )

    def update(self, rec: dict) -> None:
        line = self._line(rec)
        if line == self._last_line:
            return
        if self.tty:
            pad = max(0, len(self._last_line) - len(line))
            self.stream.write("\r" + line + " " * pad)
        else:
            # A log file gets a line per state change, and otherwise one every few seconds.
            key = (rec.get("state"), rec.get("reason"))
            now = time.monotonic()
            if key == self._last_key and now - self._last_print < self.log_interval_s:
                return
            self._last_key, self._last_print = key, now
            self.stream.write(line + "\n")
        self.stream.flush()
        self._last_line = line

    def finish(self, rec: dict) -> None:
        if rec:
            self._last_key = None  # the final line is always shown
            self.update(rec)
        if self.tty and self._last_line:
            self.stream.write("\n")
            self.stream.flush()


class _WidgetProgress:
    def __init__(self, handle: RunHandle):
        from IPython.display import display

        from .widget import RunProgress

        self.widget = RunProgress(handle, live=False)
        display(self.widget)

    def update(self, rec: dict) -> None:
        self.widget.update(rec)

    def finish(self, rec: dict) -> None:
        if rec:
            self.widget.update(rec)


def _make_reporter(handle: RunHandle):
    if _in_kernel():
        try:
            return _WidgetProgress(handle)
        except ImportError:
            pass
    return _TextProgress(handle)


# --------------------------------------------------------------------------- a private server


class LocalServer:
    """A ``jupyter server`` subprocess with the extension enabled, for the demo, tests and notebooks.

    Isolated: its own runtime and runs directories (temporary unless given), a random port, a
    random token, virtual GPUs. ``models`` (a list of dicts) goes to ``EvalSchedApp.models``
    through a JSON config file. Use it as a context manager, or call :meth:`stop`.
    """

    def __init__(
        self,
        *,
        virtual_gpus: str | None = "24000,24000",
        cpu_slots: int | None = 8,
        runs_dir: str | None = None,
        models: list[dict] | None = None,
        env: dict[str, str] | None = None,
        extra_args: list[str] | None = None,
        startup_timeout: float = 60.0,
        log_path: str | None = None,
    ):
        import secrets

        self._tmp = tempfile.mkdtemp(prefix="evalsched-server-")
        self.runs_dir = runs_dir or os.path.join(self._tmp, "runs")
        self.root_dir = os.path.join(self._tmp, "root")
        os.makedirs(self.root_dir, exist_ok=True)
        runtime_dir = os.path.join(self._tmp, "runtime")
        config_dir = os.path.join(self._tmp, "config")
        os.makedirs(config_dir, exist_ok=True)
        self.token = secrets.token_hex(16)
        self.log_path = log_path or os.path.join(self._tmp, "server.log")

        server_env = dict(os.environ)
        server_env.update(
            {
                "JUPYTER_RUNTIME_DIR": runtime_dir,
                "JUPYTER_CONFIG_DIR": config_dir,  # the user's own config stays out of it
                "EVALSCHED_RUNS_DIR": self.runs_dir,
                "PYTHONUNBUFFERED": "1",
            }
        )
        for var in ("EVALSCHED_URL", "EVALSCHED_TOKEN", "JPY_PARENT_PID"):
            server_env.pop(var, None)
        if virtual_gpus is not None:
            server_env["EVALSCHED_VIRTUAL_GPUS"] = virtual_gpus
        if cpu_slots is not None:
            server_env["EVALSCHED_CPU_SLOTS"] = str(cpu_slots)
        # The server must import the same jupyter_evalsched as this client, installed or not.
        pkg_parent = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        server_env["PYTHONPATH"] = os.pathsep.join(
            [pkg_parent] + [p for p in server_env.get("PYTHONPATH", "").split(os.pathsep) if p]
        )
        if env:
            server_env.update(env)
        if models is not None:
            with open(os.path.join(config_dir, "jupyter_server_config.json"), "w", encoding="utf-8") as f:
                json.dump({"EvalSchedApp": {"models": models}}, f)

        cmd = [
            sys.executable,
            "-m",
            "jupyter_server",
            "--no-browser",
            "--ip=127.0.0.1",
            "--ServerApp.port=0",
            "--ServerApp.port_retries=0",
            f"--IdentityProvider.token={self.token}",
            f"--ServerApp.root_dir={self.root_dir}",
            "--ServerApp.jpserver_extensions={'jupyter_evalsched': True}",
            *(["--allow-root"] if hasattr(os, "geteuid") and os.geteuid() == 0 else []),
            *(extra_args or []),
        ]
        self._log = open(self.log_path, "wb")
        self.process = subprocess.Popen(
            cmd, env=server_env, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=self.root_dir
        )
        try:
            self.url = self._wait_ready(runtime_dir, startup_timeout)
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self, runtime_dir: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        info_path = os.path.join(runtime_dir, f"jpserver-{self.process.pid}.json")
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise ServerNotFound(
                    f"jupyter server exited with code {self.process.returncode} "
                    f"before answering; its log: {self.log_path}\n{self.log_tail()}"
                )
            info = _read_server_file(info_path)
            if info is not None and _probe(_normalize_base(info["url"]), self.token, timeout=1.0):
                return _normalize_base(info["url"])
            time.sleep(0.1)
        raise ServerNotFound(
            f"jupyter server did not answer /evalsched/ within {timeout:g} s; "
            f"its log: {self.log_path}\n{self.log_tail()}"
        )

    def log_tail(self, lines: int = 30) -> str:
        try:
            with open(self.log_path, encoding="utf-8", errors="replace") as f:
                return "".join(f.readlines()[-lines:])
        except OSError:
            return ""

    def client(self, **kwargs: Any) -> EvalSchedClient:
        return EvalSchedClient(self.url, self.token, **kwargs)

    @property
    def env(self) -> dict[str, str]:
        """What a kernel or a CLI subprocess needs to find this server."""
        return {"EVALSCHED_URL": self.url, "EVALSCHED_TOKEN": self.token}

    def stop(self, timeout: float = 15.0) -> None:
        proc = getattr(self, "process", None)
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        log = getattr(self, "_log", None)
        if log is not None and not log.closed:
            log.close()

    def cleanup(self) -> None:
        """Stop, then remove the temporary directory (runs included, unless given)."""
        self.stop()
        shutil.rmtree(self._tmp, ignore_errors=True)

    def __enter__(self) -> LocalServer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.cleanup()
