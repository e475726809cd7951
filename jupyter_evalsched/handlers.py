"""REST and WebSocket handlers under ``/evalsched/``.

Every handler is authenticated and authorized against one resource, ``evalsched`` (GET: read,
POST/DELETE: write, the event socket: execute), so JupyterHub's authorizers can scope it.
Errors are JSON in jupyter_server's shape plus ``detail`` for validation failures; nothing a
client sends can produce a 500.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
from typing import Any

from jupyter_core.utils import ensure_async
from jupyter_server.auth.decorator import authorized, ws_authenticated
from jupyter_server.base.handlers import APIHandler, JupyterHandler
from jupyter_server.base.websocket import WebSocketMixin
from jupyter_server.extension.handler import ExtensionHandlerMixin
from pydantic import ValidationError
from tornado import web, websocket
from tornado.httpclient import AsyncHTTPClient, HTTPClientError, HTTPRequest

from . import store
from .models import STATES, EvalSpec
from .scheduler.service import Scheduler, SchedulerError

AUTH_RESOURCE = "evalsched"
EXTENSION = "jupyter_evalsched"
MAX_BODY_BYTES = 4 * 1024 * 1024
MAX_LIST_LIMIT = 100_000
RUN_ID = r"(?P<run_id>[^/]+)"


class ApiError(web.HTTPError):
    """An HTTP error whose JSON body carries ``detail`` (the list of field errors)."""

    def __init__(self, status: int, message: str, detail: list[dict] | None = None, reason: str | None = None):
        super().__init__(status, "%s", message, reason=reason)
        self.message = message
        self.detail = detail


def delegated(method):
    """On a secondary server, answer by forwarding the request to the host's primary.

    Applied inside ``@web.authenticated`` and ``@authorized``: this server authenticates and
    authorizes its own client first, then speaks to the primary with the primary's credentials.
    """

    @functools.wraps(method)
    async def wrapper(self, *args, **kwargs):
        if not is_delegating(self):
            if not self.scheduler.started:
                # Until recovery has read the runs directory, "no such run" would be a lie.
                raise ApiError(503, "the scheduler is starting (reading the runs directory); retry in a moment")
            return await method(self, *args, **kwargs)
        await self.forward_to_primary()

    return wrapper


def is_delegating(handler) -> bool:
    role = handler.settings.get("evalsched_role")
    return role is not None and not role.is_primary and handler.extensionapp.single_primary


class EvalSchedHandler(ExtensionHandlerMixin, APIHandler):
    auth_resource = AUTH_RESOURCE

    def initialize(self, name: str = EXTENSION, *args: Any, **kwargs: Any) -> None:
        super().initialize(name, *args, **kwargs)

    @property
    def scheduler(self) -> Scheduler:
        return self.settings["evalsched_scheduler"]

    def write_error(self, status_code: int, **kwargs: Any) -> None:
        """JSON errors; a bug of ours is a 500 with a message, never a traceback sent out."""
        self.set_header("Content-Type", "application/json")
        exc = kwargs.get("exc_info", (None, None, None))[1]
        body: dict[str, Any] = {"message": self._reason, "reason": None}
        if isinstance(exc, ApiError):
            body = (
                {"message": exc.message, "reason": exc.reason, "detail": exc.detail}
                if exc.detail is not None
                else {"message": exc.message, "reason": exc.reason}
            )
        elif isinstance(exc, web.HTTPError):
            body = {"message": exc.log_message % exc.args if exc.log_message else self._reason, "reason": exc.reason}
        elif exc is not None:
            self.log.error("evalsched: unexpected error", exc_info=kwargs["exc_info"])
            body = {"message": f"internal error: {type(exc).__name__}", "reason": None}
        self.finish(json.dumps(body))

    async def forward_to_primary(self) -> None:
        role = self.settings["evalsched_role"]
        primary = role.primary()
        if primary is None:
            raise ApiError(503, "this host's primary evalsched server is starting or changing; retry in a few seconds")
        suffix = self.request.path[len(self.base_url.rstrip("/")) :].lstrip("/")
        url = primary.url.rstrip("/") + "/" + suffix
        if self.request.query:
            url += "?" + self.request.query
        headers = {"Content-Type": self.request.headers.get("Content-Type", "application/json")}
        if primary.token:
            headers["Authorization"] = f"token {primary.token}"
        body = self.request.body if self.request.method in ("POST", "PUT", "PATCH") else None
        try:
            resp = await AsyncHTTPClient().fetch(
                url,
                method=self.request.method,
                headers=headers,
                body=body,
                raise_error=False,
                request_timeout=60,
                follow_redirects=False,
                allow_nonstandard_methods=True,
            )
        except (OSError, HTTPClientError) as exc:
            raise ApiError(
                503,
                f"this host's primary evalsched server (pid {primary.pid}) is not answering "
                f"({exc}); a server takes over within seconds: retry",
            ) from None
        if resp.code == 599:
            raise ApiError(
                503,
                f"this host's primary evalsched server (pid {primary.pid}) is not answering "
                f"({resp.error}); a server takes over within seconds: retry",
            )
        self.set_status(resp.code)
        for name in ("Content-Type", "Location"):
            if name in resp.headers:
                self.set_header(name, resp.headers[name])
        self.set_header("X-Evalsched-Primary", str(primary.pid))
        self.finish(resp.body or b"")

    def send_json(self, obj: Any, status: int = 200) -> None:
        self.set_status(status)
        self.set_header("Content-Type", "application/json")
        self.finish(obj if isinstance(obj, bytes) else json.dumps(obj, separators=(",", ":")))

    def job_or_404(self, run_id: str):
        try:
            return self.scheduler.get(run_id)
        except SchedulerError as exc:
            raise ApiError(exc.status, exc.message) from None

    def call(self, fn, *args):
        """Run a scheduler operation and turn its errors into HTTP errors."""
        try:
            return fn(*args)
        except SchedulerError as exc:
            raise ApiError(exc.status, exc.message, exc.detail) from None

    def int_arg(self, name: str, default: int | None, lo: int, hi: int) -> int | None:
        text = self.get_argument(name, None)
        if text is None or text == "":
            return default
        try:
            value = int(text)
        except ValueError:
            raise ApiError(400, f"query parameter {name!r} must be an integer, got {text!r}") from None
        if not lo <= value <= hi:
            raise ApiError(400, f"query parameter {name!r} must be between {lo} and {hi}, got {value}")
        return value


class RunsHandler(EvalSchedHandler):
    _track_activity = False

    @web.authenticated
    @authorized
    @delegated
    async def get(self) -> None:
        states = None
        text = self.get_argument("state", None)
        if text:
            states = {s.strip() for s in text.split(",") if s.strip()}
            unknown = states - set(STATES)
            if unknown:
                raise ApiError(400, f"unknown state(s) {sorted(unknown)}; states are {', '.join(STATES)}")
        limit = self.int_arg("limit", 100, 1, MAX_LIST_LIMIT)
        runs, total = self.scheduler.list_runs(states, limit)
        self.send_json({"runs": runs, "total": total})

    @web.authenticated
    @authorized
    @delegated
    async def post(self) -> None:
        spec = parse_spec(self.request.body)
        try:
            record = await self.scheduler.submit(spec)
        except SchedulerError as exc:
            raise ApiError(exc.status, exc.message, exc.detail) from None
        self.set_header("Location", self.request.path.rstrip("/") + "/" + record["id"])
        self.send_json(record, status=201)


def parse_spec(body: bytes) -> EvalSpec:
    if len(body) > MAX_BODY_BYTES:
        raise ApiError(413, f"the body is {len(body)} bytes; at most {MAX_BODY_BYTES} are accepted")
    try:
        obj = json.loads(body or b"", parse_constant=_reject_constant)
    except RecursionError:
        raise ApiError(400, "the body is nested too deeply") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"the body is not valid JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise ApiError(
            422, "the spec must be a JSON object", [{"loc": [], "msg": "must be an object", "type": "dict_type"}]
        )
    try:
        return EvalSpec.model_validate(obj)
    except ValidationError as exc:
        detail = [
            {"loc": list(err["loc"]), "msg": err["msg"], "type": err["type"]}
            for err in exc.errors(include_url=False, include_context=False, include_input=False)
        ]
        message = "; ".join(f"{'.'.join(map(str, d['loc'])) or 'spec'}: {d['msg']}" for d in detail)
        raise ApiError(422, f"invalid spec: {message}", detail) from None
    except RecursionError:
        raise ApiError(400, "the body is nested too deeply") from None


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


class RunHandler(EvalSchedHandler):
    _track_activity = False

    @web.authenticated
    @authorized
    @delegated
    async def get(self, run_id: str) -> None:
        job = self.job_or_404(run_id)
        loop = asyncio.get_running_loop()
        summary = await loop.run_in_executor(None, self.scheduler.summary, job.id)
        self.send_json({**job.record, "summary": summary})

    @web.authenticated
    @authorized
    @delegated
    async def delete(self, run_id: str) -> None:
        self.call(self.scheduler.delete, run_id)
        self.set_status(204)
        self.finish()


class CancelHandler(EvalSchedHandler):
    @web.authenticated
    @authorized
    @delegated
    async def post(self, run_id: str) -> None:
        try:
            record = await self.scheduler.cancel(run_id)
        except SchedulerError as exc:
            raise ApiError(exc.status, exc.message, exc.detail) from None
        self.send_json(record)


class LogsHandler(EvalSchedHandler):
    _track_activity = False

    @web.authenticated
    @authorized
    @delegated
    async def get(self, run_id: str) -> None:
        job = self.job_or_404(run_id)
        stream = self.get_argument("stream", "stdout")
        if stream not in ("stdout", "stderr"):
            raise ApiError(400, f"stream must be 'stdout' or 'stderr', got {stream!r}")
        tail = self.int_arg("tail", None, 0, 1_000_000)
        path = self.scheduler.run_dir(job.id) / (store.STDOUT if stream == "stdout" else store.STDERR)
        try:
            text = await asyncio.get_running_loop().run_in_executor(None, store.tail_lines, path, tail)
        except OSError as exc:
            # ELOOP for a planted symbolic link, ENOTDIR/EACCES for a tampered run directory.
            raise ApiError(409, f"the {stream} log of run {job.id} cannot be read: {exc.strerror or exc}") from None
        self.set_header("Content-Type", "text/plain; charset=utf-8")
        self.finish(text)


class EpisodesHandler(EvalSchedHandler):
    _track_activity = False

    @web.authenticated
    @authorized
    @delegated
    async def get(self, run_id: str) -> None:
        job = self.job_or_404(run_id)
        path = self.scheduler.run_dir(job.id) / store.EPISODES
        episodes = await asyncio.get_running_loop().run_in_executor(None, read_episodes, path)
        self.send_json({"episodes": episodes})


def read_episodes(path) -> list[dict]:
    try:
        data = store.read_bytes_nofollow(path)
    except OSError:
        return []
    out = []
    for line in data.splitlines():
        try:
            item = json.loads(line)
        except ValueError:
            continue  # a torn last line while the run appends, or garbage the eval wrote
        if isinstance(item, dict):
            out.append(item)
    return out


class QueueHandler(EvalSchedHandler):
    _track_activity = False

    @web.authenticated
    @authorized
    @delegated
    async def get(self) -> None:
        self.send_json(self.scheduler.queue_view_json())


class LedgerHandler(EvalSchedHandler):
    _track_activity = False

    @web.authenticated
    @authorized
    @delegated
    async def get(self) -> None:
        self.send_json(self.scheduler.ledger())


class ModelsHandler(EvalSchedHandler):
    _track_activity = False

    @web.authenticated
    @authorized
    @delegated
    async def get(self) -> None:
        host = self.settings.get("evalsched_model_host")
        models = await host.describe() if host is not None else []
        self.send_json({"models": models})


class StatusHandler(EvalSchedHandler):
    _track_activity = False

    @web.authenticated
    @authorized
    async def get(self) -> None:
        """This server's own view: its role, and which server is the host's primary."""
        from . import __version__

        role = self.settings["evalsched_role"]
        primary = role.primary()
        body = {
            "version": __version__,
            "role": "secondary" if is_delegating(self) else "primary",
            "pid": os.getpid(),
            "primary": primary.public() if primary else None,
        }
        if not is_delegating(self):
            body.update(runs_dir=str(self.scheduler.store.root), counts=self.scheduler.counts)
        self.send_json(body)


class OpenAPIHandler(EvalSchedHandler):
    _track_activity = False

    @web.authenticated
    @authorized
    @delegated
    async def get(self) -> None:
        from .openapi import openapi_document

        self.send_json(openapi_document(self.base_url))


class EventsHandler(WebSocketMixin, websocket.WebSocketHandler, ExtensionHandlerMixin, JupyterHandler):
    """``{"type": "snapshot", "queue": ...}`` first, then ``{"type": "run", "run": ...}`` per change."""

    auth_resource = AUTH_RESOURCE

    def initialize(self, name: str = EXTENSION, *args: Any, **kwargs: Any) -> None:
        ExtensionHandlerMixin.initialize(self, name, *args, **kwargs)

    async def pre_get(self) -> None:
        user = self.current_user
        ok = await ensure_async(self.authorizer.is_authorized(self, user, "execute", AUTH_RESOURCE))
        if not ok:
            raise web.HTTPError(403)

    @ws_authenticated
    async def get(self, *args: Any, **kwargs: Any) -> None:
        await ensure_async(self.pre_get())
        res = super().get(*args, **kwargs)
        if res is not None:
            await res

    async def open(self, *args: Any, **kwargs: Any) -> None:
        if is_delegating(self):
            await self._relay_from_primary()
            return
        scheduler: Scheduler = self.settings["evalsched_scheduler"]
        if not scheduler.started:
            self.close(1013, "the scheduler is starting; reconnect in a moment")
            return
        self._scheduler = scheduler
        self.write_message(json.dumps({"type": "snapshot", "queue": scheduler.queue_view()}, separators=(",", ":")))
        scheduler.subscribe(self._on_event)

    async def _relay_from_primary(self) -> None:
        """A secondary relays the primary's stream; when the primary goes, the socket closes and
        the client reconnects (to whichever server then is primary, through this one)."""
        primary = self.settings["evalsched_role"].primary()
        if primary is None:
            self.close(1013, "the host's primary evalsched server is changing; reconnect")
            return
        url = "ws" + primary.url[len("http") :].rstrip("/") + "/evalsched/events"
        headers = {"Authorization": f"token {primary.token}"} if primary.token else {}
        try:
            self._upstream = await websocket.websocket_connect(HTTPRequest(url, headers=headers, request_timeout=10))
        except Exception as exc:
            self.close(1011, f"the primary evalsched server is not answering: {exc}"[:120])
            return
        asyncio.ensure_future(self._pump())

    async def _pump(self) -> None:
        upstream = self._upstream
        while True:
            message = await upstream.read_message()
            if message is None:
                self.close(1012, "the primary evalsched server went away; reconnect")
                return
            try:
                self.write_message(message)
            except websocket.WebSocketClosedError:
                upstream.close()
                return

    def _on_event(self, event: dict) -> None:
        try:
            self.write_message(json.dumps(event, separators=(",", ":")))
        except websocket.WebSocketClosedError:
            self._scheduler.unsubscribe(self._on_event)

    def on_message(self, message: Any) -> None:
        pass  # the stream is one-way; pings are handled by tornado

    def on_close(self) -> None:
        upstream = getattr(self, "_upstream", None)
        if upstream is not None:
            upstream.close()
        scheduler = getattr(self, "_scheduler", None)
        if scheduler is not None:
            scheduler.unsubscribe(self._on_event)


def handlers() -> list[tuple[str, type]]:
    return [
        (r"/evalsched/runs/?", RunsHandler),
        (rf"/evalsched/runs/{RUN_ID}/cancel/?", CancelHandler),
        (rf"/evalsched/runs/{RUN_ID}/logs/?", LogsHandler),
        (rf"/evalsched/runs/{RUN_ID}/episodes/?", EpisodesHandler),
        (rf"/evalsched/runs/{RUN_ID}/?", RunHandler),
        (r"/evalsched/queue/?", QueueHandler),
        (r"/evalsched/ledger/?", LedgerHandler),
        (r"/evalsched/models/?", ModelsHandler),
        (r"/evalsched/status/?", StatusHandler),
        (r"/evalsched/events/?", EventsHandler),
        (r"/evalsched/openapi.json", OpenAPIHandler),
    ]
