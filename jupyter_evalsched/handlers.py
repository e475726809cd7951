"""REST and WebSocket handlers under ``/evalsched/``.

Every handler is authenticated and authorized against one resource, ``evalsched`` (GET: read,
POST/DELETE: write, the event socket: execute), so JupyterHub's authorizers can scope it.
Errors are JSON in jupyter_server's shape plus ``detail`` for validation failures; nothing a
client sends can produce a 500.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any, TypeVar, cast
from urllib.parse import urlsplit

from jupyter_core.utils import ensure_async
from jupyter_server.auth.decorator import authorized, ws_authenticated
from jupyter_server.auth.utils import HTTP_METHOD_TO_AUTH_ACTION
from jupyter_server.base.handlers import APIHandler, JupyterHandler
from jupyter_server.base.websocket import WebSocketMixin
from jupyter_server.extension.handler import ExtensionHandlerMixin
from pydantic import BaseModel, ValidationError
from tornado import httputil, web, websocket
from tornado.http1connection import HTTP1Connection, HTTP1ConnectionParameters
from tornado.httpclient import HTTPClientError, HTTPRequest
from tornado.iostream import StreamClosedError

from . import contract, store
from ._version import __version__
from .contract import STATES
from .internal import LinkHTTPClient, LinkRefused, LinkTCPClient, link_websocket_connect
from .scheduler.errors import SchedulerError
from .scheduler.service import Scheduler
from .scheduler.shared import ModelUnavailable
from .schemas import MAX_SPEC_JSON_CHARS, EvalSpec, LeaseRequest, SweepRequest, extra_field_hint
from .store import RunFileError

if TYPE_CHECKING:
    from .app import EvalSchedApp

AUTH_RESOURCE = "evalsched"
EXTENSION = "jupyter_evalsched"
MAX_BODY_BYTES = MAX_SPEC_JSON_CHARS  # one number for both: a body carries one spec (and a sweep's points)
RETRY_AFTER_S = 1  # a 429's Retry-After
FORWARD_TIMEOUT_S = 60  # a secondary's wait for the primary's whole answer (REST: answers in ms)
RELAY_MAX_BODY_BYTES = 1 << 40  # a relayed answer may be of any size (tornado's default cuts at 100 MB)
RELAY_CONNECT_TIMEOUT_S = 20  # a relay's connection to the primary (on loopback: tornado's fetch default)
# What a delegated answer keeps of the primary's headers (besides the status).
RELAYED_HEADERS = (
    "Content-Type",
    "Location",
    "Retry-After",
    "Cache-Control",
    "X-Evalsched-Cache",
    contract.LOG_OFFSET_HEADER,
    contract.LOG_SIZE_HEADER,
)
MAX_LIST_LIMIT = contract.MAX_LIST_LIMIT
RUN_ID = r"(?P<run_id>[^/]+)"
IDEMPOTENCY_KEY_RE = re.compile(r"[!-~]{1,200}")
T = TypeVar("T")
M = TypeVar("M", bound=BaseModel)
LEASE_ID = r"(?P<lease_id>[^/]+)"
SWEEP_ID = r"(?P<sweep_id>[^/]+)"


class ApiError(web.HTTPError):
    """An HTTP error whose JSON body carries ``detail`` (the list of field errors)."""

    def __init__(self, status: int, message: str, detail: list[dict] | None = None, reason: str | None = None):
        super().__init__(status, "%s", message, reason=reason)
        self.message = message
        self.detail = detail


def as_http_error(exc: BaseException) -> ApiError | None:
    """The one mapping from what the scheduler raises to an HTTP answer; None for a bug of ours."""
    if isinstance(exc, SchedulerError):
        return ApiError(exc.status, exc.message, exc.detail)
    if isinstance(exc, RunFileError):
        # The run's own files are not in a state that can be served (a planted link, garbage).
        return ApiError(409, str(exc))
    return None


def int_query(name: str, text: str | None, default: int | None, lo: int, hi: int) -> int | None:
    """An integer query parameter ``name`` given as ``text``; ValueError says what is wrong."""
    if text is None or text == "":
        return default
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"query parameter {name!r} must be an integer, got {text!r}") from None
    if not lo <= value <= hi:
        raise ValueError(f"query parameter {name!r} must be between {lo} and {hi}, got {value}")
    return value


class _Relay(httputil.HTTPMessageDelegate):
    """A delegated answer written to the client as the primary sends it: its status and headers
    once they are all in, then each part of its body at once. Read off the relay's own
    connection to the primary (``EvalSchedHandler.relay_to_primary``)."""

    def __init__(self, handler: EvalSchedHandler, primary_pid: int):
        self.handler = handler
        self.primary_pid = primary_pid
        self.status: int | None = None
        self.headers: dict[str, str] = {}
        self.started = False
        self.complete = False  # the whole answer came

    def headers_received(
        self, start_line: httputil.RequestStartLine | httputil.ResponseStartLine, headers: httputil.HTTPHeaders
    ) -> None:
        assert isinstance(start_line, httputil.ResponseStartLine)
        # (after an interim 1xx answer: the real one's status and headers replace it)
        self.status = start_line.code
        self.headers = {name.lower(): value for name, value in headers.get_all()}

    def data_received(self, chunk: bytes) -> Awaitable[None] | None:
        # A client gone is closing this connection (on_connection_close): a part read meanwhile
        # goes nowhere. (Not raised: tornado logs what a delegate raises, with a traceback.)
        # Awaited by tornado before it reads on: the primary is read no faster than the client
        # takes the answer, which is not buffered here without bound.
        if not self.handler.client_gone:
            return self.write(chunk)
        return None

    def finish(self) -> None:
        self.complete = True

    def write(self, data: bytes) -> Awaitable[None]:
        """Write ``data`` to the client; done once it is flushed (or the client is gone)."""
        handler = self.handler
        if not self.started:
            self.started = True
            handler.set_status(self.status or 502)
            for name in RELAYED_HEADERS:
                if name.lower() in self.headers:
                    handler.set_header(name, self.headers[name.lower()])
            handler.set_header("X-Evalsched-Primary", str(self.primary_pid))
        handler.write(data)
        return _flushed(handler.flush())


async def _flushed(flush: Awaitable[None]) -> None:
    try:
        await flush
    except StreamClosedError:
        pass  # (the client went away: on_connection_close ends the relay)


def is_delegating(handler: Any) -> bool:
    """A server that does not hold its runs directory's lock forwards to the one that does."""
    return not handler.app.role.is_primary


def not_answering(pid: int, error: BaseException) -> str:
    """Why a forward failed, for a 503 (which clients retry)."""
    return f"this host's primary evalsched server (pid {pid}) is not answering ({error}); a server takes over within seconds: retry"


def no_primary_message(app: Any) -> str:
    """Why no primary can answer, for a 503."""
    if app.start_error:
        return f"this server cannot schedule its runs directory: {app.start_error}"
    if app.role.problem:
        return f"the primary evalsched server cannot be reached: {app.role.problem}"
    return "the primary evalsched server of this runs directory is starting or changing; retry in a few seconds"


class EvalSchedHandler(ExtensionHandlerMixin, APIHandler):
    """Base of the REST handlers: JSON errors, and on a secondary server, delegation of the whole
    request to the host's primary (after this server authenticated and authorized its client)."""

    auth_resource = AUTH_RESOURCE
    #: False for the handlers that answer for this server itself, whatever its role.
    delegated = True
    #: Delegated answers relayed as they come, with no time limit (the OpenAI routes: a stream,
    #: a long generation), rather than read whole within FORWARD_TIMEOUT_S.
    forward_as_it_comes = False
    client_gone = False
    _upstream: HTTP1Connection | None = None  # a relay's connection to the primary, while it reads

    def on_connection_close(self) -> None:
        self.client_gone = True
        if self._upstream is not None:  # the primary's handler sees it close, and stops there too
            self._upstream.close()
        super().on_connection_close()

    def initialize(self, name: str = EXTENSION, *args: Any, **kwargs: Any) -> None:
        super().initialize(name, *args, **kwargs)

    @property
    def app(self) -> EvalSchedApp:
        return cast("EvalSchedApp", self.extensionapp)

    @property
    def scheduler(self) -> Scheduler:
        return self.app.scheduler

    async def prepare(self) -> None:  # type: ignore[override]  # as APIHandler's own
        await super().prepare()
        if self._finished or not self.delegated:
            return
        if not self.current_user:
            raise web.HTTPError(403)  # as @web.authenticated would, before anything else is said
        if not is_delegating(self):
            if self.app.start_error:  # (a primary whose runs directory was moved)
                raise ApiError(503, no_primary_message(self.app))
            if not self.scheduler.started:
                if self.scheduler.stopping:
                    raise ApiError(503, "the scheduler is stopping; retry once the server is back")
                # Until recovery has read the runs directory, "no such run" would be a lie.
                raise ApiError(503, "the scheduler is starting (reading the runs directory); retry in a moment")
            return
        user = self.current_user
        action = HTTP_METHOD_TO_AUTH_ACTION.get(self.request.method or "", "read")
        if not await ensure_async(self.authorizer.is_authorized(self, user, action, AUTH_RESOURCE)):
            raise web.HTTPError(403)
        await self.forward_to_primary()

    def log_exception(self, typ, value, tb) -> None:
        if as_http_error(value) is None:  # scheduler errors are answers, not failures of ours
            super().log_exception(typ, value, tb)

    def send_error(self, status_code: int = 500, **kwargs: Any) -> None:
        exc = kwargs.get("exc_info", (None, None, None))[1]
        mapped = as_http_error(exc) if exc is not None else None
        if mapped is not None:
            kwargs["exc_info"] = (type(mapped), mapped, None)
            status_code = mapped.status_code
        super().send_error(status_code, **kwargs)

    def write_error(self, status_code: int, **kwargs: Any) -> None:
        """JSON errors; a bug of ours is a 500 with a message, never a traceback sent out."""
        self.set_header("Content-Type", "application/json")
        if status_code == 429:
            self.set_header("Retry-After", str(RETRY_AFTER_S))
        exc = kwargs.get("exc_info", (None, None, None))[1]
        body: dict[str, Any] = {"message": self._reason, "reason": None}
        if isinstance(exc, ApiError):
            body = {"message": exc.message, "reason": exc.reason}
            if exc.detail is not None:
                body["detail"] = exc.detail
        elif isinstance(exc, web.HTTPError):
            body = {"message": exc.log_message % exc.args if exc.log_message else self._reason, "reason": exc.reason}
        elif exc is not None:
            self.log.error("evalsched: unexpected error", exc_info=kwargs["exc_info"])
            body = {"message": f"internal error: {type(exc).__name__}", "reason": None}
        self.finish(json.dumps(body))

    async def forward_to_primary(self) -> None:
        """The request as it came, to the primary's internal listener, with the link's secret."""
        primary = self.app.role.forward_target()
        if primary is None:
            raise ApiError(503, no_primary_message(self.app))
        if self.forward_as_it_comes:
            await self.relay_to_primary(primary)
            return
        suffix = self.request.path[len(self.base_url.rstrip("/")) :].lstrip("/")
        url = primary.internal_url.rstrip("/") + "/" + suffix
        if self.request.query:
            url += "?" + self.request.query
        headers = {
            "Content-Type": self.request.headers.get("Content-Type", "application/json"),
            "Authorization": f"token {primary.secret}",
        }
        if "Idempotency-Key" in self.request.headers:
            headers["Idempotency-Key"] = self.request.headers["Idempotency-Key"]
        body = self.request.body if self.request.method in ("POST", "PUT", "PATCH") else None
        try:
            resp = await LinkHTTPClient().fetch(  # (checks whose socket it reached: internal.py)
                url,
                method=self.request.method,
                headers=headers,
                body=body,
                raise_error=False,
                request_timeout=FORWARD_TIMEOUT_S,
                follow_redirects=False,
                allow_nonstandard_methods=True,
            )
        except (OSError, HTTPClientError) as exc:
            resp_error: BaseException | None = exc
        else:
            resp_error = resp.error if resp.code == 599 else None
        if resp_error is not None:
            raise ApiError(503, not_answering(primary.pid, resp_error))
        self.set_status(resp.code)
        for name in RELAYED_HEADERS:
            if name in resp.headers:
                self.set_header(name, resp.headers[name])
        self.set_header("X-Evalsched-Primary", str(primary.pid))
        # The primary's Content-Type (the logs route's text/plain): APIHandler.finish would set JSON.
        self.finish(resp.body or b"", set_content_type=resp.headers.get("Content-Type", "application/json"))

    async def relay_to_primary(self, primary: Any) -> None:
        """The request relayed to the primary, its answer written to the client as it comes (a
        stream, a long generation: no time limit), on a connection of the relay's own. Not
        through tornado's HTTP client: its fetch cannot be stopped midway, so a client gone
        would end the relay only at the primary's next part (a plain answer's: once whole), and
        its shared client has 10 connections, which long generations would hold from every REST
        forward. A client gone closes this connection at once (``on_connection_close``), and the
        primary's handler then cancels the request there."""
        target = urlsplit(
            primary.internal_url.rstrip("/") + "/" + self.request.path[len(self.base_url.rstrip("/")) :].lstrip("/")
        )
        path = target.path + (f"?{self.request.query}" if self.request.query else "")
        headers = httputil.HTTPHeaders(
            {
                "Host": target.netloc,
                "Connection": "close",
                "Content-Type": self.request.headers.get("Content-Type", "application/json"),
                "Authorization": f"token {primary.secret}",
            }
        )
        if "Idempotency-Key" in self.request.headers:
            headers["Idempotency-Key"] = self.request.headers["Idempotency-Key"]
        body = self.request.body if self.request.method in ("POST", "PUT", "PATCH") else None
        if body is not None:
            headers["Content-Length"] = str(len(body))
        relay = _Relay(self, primary.pid)
        error: BaseException | None = None
        try:  # (StreamClosedError and the connect timeout are OSErrors)
            stream = await LinkTCPClient().connect(  # (checks whose socket it reached)
                target.hostname or "127.0.0.1", target.port or 80, timeout=timedelta(seconds=RELAY_CONNECT_TIMEOUT_S)
            )
        except OSError as exc:
            error = exc
        else:
            upstream = HTTP1Connection(
                stream, True, HTTP1ConnectionParameters(no_keep_alive=True, max_body_size=RELAY_MAX_BODY_BYTES)
            )
            self._upstream = upstream
            try:
                if not self.client_gone:  # (it may have gone while this connected)
                    upstream.write_headers(
                        httputil.RequestStartLine(self.request.method or "GET", path, "HTTP/1.1"), headers
                    )
                    if body:
                        upstream.write(body)
                    upstream.finish()
                    await upstream.read_response(relay)
            except OSError as exc:
                error = exc
            finally:
                self._upstream = None
                upstream.close()
            if error is None and not relay.complete:
                error = ConnectionError("its answer ended early or was not HTTP")
        if relay.started:
            if error is None:
                self.finish()
            else:
                await self.break_off(relay, error)  # (quiet for a client gone)
            return
        if self.client_gone:
            raise web.Finish()  # nobody to answer
        if error is not None:
            raise ApiError(503, not_answering(primary.pid, error))
        await relay.write(b"")  # an answer without a body: its status and headers
        self.finish()

    async def break_off(self, relay: _Relay, error: BaseException) -> None:
        """The primary's answer broke off after its start was relayed (the primary died, its
        connection failed): the client must see an incomplete answer, not a whole, shorter one."""
        if not self.client_gone:
            self.log.warning(
                "evalsched: the primary (pid %s) broke off its answer to %s %s: %s",
                relay.primary_pid,
                self.request.method,
                self.request.path,
                error,
            )
            if relay.headers.get("content-type", "").startswith("text/event-stream"):
                # As openai_api's stream() ends a failed stream: an event OpenAI's clients raise.
                message = (
                    f"the primary evalsched server of this host (pid {relay.primary_pid}) broke off "
                    f"its answer ({error}); retry"
                )
                event = {"error": {"message": message, "type": "server_error", "code": None, "param": None}}
                self.write(f"data: {json.dumps(event)}\n\n")
            try:
                await self.flush()  # (all that was relayed: the close below drops what is unsent)
            except StreamClosedError:
                pass
        # Closed without the last chunk, which finish() alone would write: the client's HTTP
        # library sees the answer end early. finish() after the close writes nothing (the stream
        # is closed) but ends the request for tornado, which then runs no get()/post() after
        # this prepare() (_execute returns on self._finished).
        if isinstance(self.request.connection, HTTP1Connection):  # (tornado's server: always)
            self.request.connection.close()
        self.finish()

    def send_json(self, obj: Any, status: int = 200) -> None:
        self.set_status(status)
        self.set_header("Content-Type", "application/json")
        self.finish(obj if isinstance(obj, bytes) else json.dumps(obj, separators=(",", ":")))

    def int_arg(self, name: str, default: int | None, lo: int, hi: int) -> int | None:
        try:
            return int_query(name, self.get_argument(name, None), default, lo, hi)
        except ValueError as exc:
            raise ApiError(400, str(exc)) from None

    def idempotency_key(self) -> str | None:
        """The request's ``Idempotency-Key`` (400 when it is malformed)."""
        key = self.request.headers.get("Idempotency-Key")
        if key is not None and not IDEMPOTENCY_KEY_RE.fullmatch(key):
            raise ApiError(400, "the Idempotency-Key header must be 1 to 200 printable ASCII characters, with no space")
        return key

    async def in_thread(self, fn: Callable[..., T], *args: Any) -> T:
        """Blocking reads of run files, off the event loop."""
        return await asyncio.get_running_loop().run_in_executor(None, fn, *args)


class RunsHandler(EvalSchedHandler):
    _track_activity = False

    @web.authenticated
    @authorized
    async def get(self) -> None:
        states = None
        text = self.get_argument("state", None)
        if text:
            states = {s.strip() for s in text.split(",") if s.strip()}
            unknown = states - set(STATES)
            if unknown:
                raise ApiError(400, f"unknown state(s) {sorted(unknown)}; states are {', '.join(STATES)}")
        limit = self.int_arg("limit", 100, 1, MAX_LIST_LIMIT)
        await self.scheduler.on_disk()  # (terminal records being written: answered once on disk)
        runs, total = self.scheduler.list_runs(states, limit or 100)
        self.send_json({"runs": runs, "total": total})

    @web.authenticated
    @authorized
    async def post(self) -> None:
        record, created = await self.scheduler.submit(parse_spec(self.request.body), self.idempotency_key())
        self.set_header("Location", self.request.path.rstrip("/") + "/" + record["id"])
        if not created:
            self.set_header("Idempotent-Replayed", "true")
        self.send_json(record, status=201 if created else 200)


def parse_spec(body: bytes) -> EvalSpec:
    return parse_body(body, EvalSpec, "spec")


def parse_body(body: bytes, model: type[M], what: str) -> M:
    """The JSON body validated as ``model``: 400 when it is not JSON, 413 when too large, 422 with
    the field errors when it is not a valid ``what``."""
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
            422, f"the {what} must be a JSON object", [{"loc": [], "msg": "must be an object", "type": "dict_type"}]
        )
    try:
        return model.model_validate(obj)
    except ValidationError as exc:
        detail = [
            {"loc": list(err["loc"]), "msg": _field_message(model, err), "type": err["type"]}
            for err in exc.errors(include_url=False, include_context=False, include_input=False)
        ]
        message = "; ".join(f"{'.'.join(map(str, d['loc'])) or what}: {d['msg']}" for d in detail)
        raise ApiError(422, f"invalid {what}: {message}", detail) from None
    except RecursionError:
        raise ApiError(400, "the body is nested too deeply") from None


def _field_message(model: type[BaseModel], err: Any) -> str:
    """A field error's message, with where an unknown field belongs (or what it is a typo of)."""
    hint = extra_field_hint(model, tuple(err["loc"])) if err["type"] == "extra_forbidden" else None
    return f"{err['msg']}; {hint}" if hint else str(err["msg"])


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


class RunHandler(EvalSchedHandler):
    _track_activity = False

    @web.authenticated
    @authorized
    async def get(self, run_id: str) -> None:
        run = self.scheduler.get(run_id)
        # The record is taken before the summary is read: a run's last summary is on disk before
        # it ends, so a record that says it ended never comes with an older summary.
        record = dict(run.record)
        summary, problem = await self.in_thread(self.scheduler.summary, run.id)
        await self.scheduler.on_disk(run.id)  # (a record that says it ended: once it is on disk)
        body = {**record, "summary": summary}
        if problem:
            body["summary_error"] = problem
        self.send_json(body)

    @web.authenticated
    @authorized
    async def delete(self, run_id: str) -> None:
        self.scheduler.delete(run_id)
        self.set_status(204)
        self.finish()


def cancelled_by(handler: EvalSchedHandler) -> str | None:
    """A cancel's ``?by=`` (who asks: the panel, the widget, the CLI, Python), for its reason."""
    by = handler.get_argument("by", None) or None
    if by is not None and by not in contract.CANCELLED_BY:
        raise ApiError(400, f"query parameter 'by' must be one of {', '.join(contract.CANCELLED_BY)}, got {by!r:.100}")
    return by


def cancel_answer(record: dict[str, Any]) -> dict[str, Any]:
    """A cancel's answer: the run's record and ``cancel_requested``, true when the run still ends
    (it was signalled; a cancel never leaves a run unended otherwise), so that a client tells a
    run cancelled from one still stopping without knowing the states."""
    return {**record, "cancel_requested": record["state"] not in contract.TERMINAL_STATES}


class CancelHandler(EvalSchedHandler):
    @web.authenticated
    @authorized
    async def post(self, run_id: str) -> None:
        self.send_json(cancel_answer(await self.scheduler.cancel(run_id, cancelled_by(self))))


class ResumeHandler(EvalSchedHandler):
    @web.authenticated
    @authorized
    async def post(self, run_id: str) -> None:
        self.send_json(self.scheduler.resume(run_id))


class LogsHandler(EvalSchedHandler):
    _track_activity = False

    @web.authenticated
    @authorized
    async def get(self, run_id: str) -> None:
        run = self.scheduler.get(run_id)
        stream = self.get_argument("stream", "stdout")
        if stream not in ("stdout", "stderr"):
            raise ApiError(400, f"stream must be 'stdout' or 'stderr', got {stream!r}")
        tail = self.int_arg("tail", None, 0, 1_000_000)
        offset = self.int_arg("offset", None, 0, contract.MAX_JSON_SAFE_INT)
        if tail is not None and offset is not None:
            raise ApiError(400, "give 'tail' or 'offset', not both")
        part = await self.in_thread(self.scheduler.store.log_part, run.id, stream, tail, offset)
        # Where the next read starts (``?offset=``), and the size read: a size under the offset
        # asked for says the log was rewritten, to be read again from 0.
        self.set_header(contract.LOG_OFFSET_HEADER, str(part.end))
        self.set_header(contract.LOG_SIZE_HEADER, str(part.size))
        # The bytes as they are on disk. APIHandler.finish sets application/json unless told otherwise.
        self.finish(part.data, set_content_type="text/plain; charset=utf-8")


class EpisodesHandler(EvalSchedHandler):
    """A page of the run's episodes: ``?offset=`` (complete lines of ``episodes.jsonl`` to pass
    over, default 0) and ``?limit=`` (lines, default DEFAULT_LIMIT, at most MAX_LIST_LIMIT; a page
    also ends before store.MAX_EPISODES_PAGE_BYTES of the file's lines, or
    store.MAX_EPISODES_ANSWER_BYTES of its answer's episodes). ``next_offset`` is where
    the next page starts, null at the end; ``total`` counts the complete lines as the file was read.
    With neither argument (a client from before pages): every episode, or a 413 that says how to
    page when they are more than one page's bytes, never a part of them."""

    _track_activity = False
    DEFAULT_LIMIT = 1000

    @web.authenticated
    @authorized
    async def get(self, run_id: str) -> None:
        paged = self.get_argument("offset", None) is not None or self.get_argument("limit", None) is not None
        offset = self.int_arg("offset", 0, 0, contract.MAX_JSON_SAFE_INT) or 0
        limit = self.int_arg("limit", self.DEFAULT_LIMIT, 1, MAX_LIST_LIMIT) or self.DEFAULT_LIMIT
        run = self.scheduler.get(run_id)
        page = await self.in_thread(self.scheduler.store.episodes_page, run.id, offset, limit if paged else None)
        if not paged and page.next_offset is not None:
            raise ApiError(
                413,
                f"the episodes of run {run.id} are more than one answer holds "
                f"({store.MAX_EPISODES_PAGE_BYTES / 2**20:g} MiB of episodes.jsonl's lines, or "
                f"{store.MAX_EPISODES_ANSWER_BYTES / 2**20:g} MiB of their JSON): ask for them page "
                f"by page, ?offset=0&limit={self.DEFAULT_LIMIT}, then ?offset=<next_offset> until next_offset "
                "is null (the Python client's episodes() does)",
            )
        # The episodes come as their JSON text (the page never held them parsed): what
        # json.dumps of the whole answer would write.
        following = b"null" if page.next_offset is None else b"%d" % page.next_offset
        self.send_json(b'{"episodes":%b,"next_offset":%b,"total":%d}' % (page.episodes_json, following, page.total))


class SweepsHandler(EvalSchedHandler):
    _track_activity = False

    @web.authenticated
    @authorized
    async def get(self) -> None:
        limit = self.int_arg("limit", 100, 1, MAX_LIST_LIMIT)
        await self.scheduler.on_disk()
        self.send_json({"sweeps": self.scheduler.list_sweeps(limit or 100)})

    @web.authenticated
    @authorized
    async def post(self) -> None:
        request = parse_body(self.request.body, SweepRequest, "sweep")
        view, created = await self.scheduler.submit_sweep(request.base_spec(), request.sweep, self.idempotency_key())
        self.set_header("Location", self.request.path.rstrip("/") + "/" + view["id"])
        if not created:
            self.set_header("Idempotent-Replayed", "true")
        self.send_json(view, status=201 if created else 200)


class SweepHandler(EvalSchedHandler):
    _track_activity = False

    @web.authenticated
    @authorized
    async def get(self, sweep_id: str) -> None:
        await self.scheduler.on_disk()
        self.send_json(self.scheduler.sweep_view(sweep_id))


class SweepCancelHandler(EvalSchedHandler):
    @web.authenticated
    @authorized
    async def post(self, sweep_id: str) -> None:
        self.send_json(await self.scheduler.cancel_sweep(sweep_id, cancelled_by(self)))


class CompareHandler(EvalSchedHandler):
    _track_activity = False

    @web.authenticated
    @authorized
    async def get(self) -> None:
        runs_arg = self.get_argument("runs", None)
        run_ids = [r.strip() for r in runs_arg.split(",") if r.strip()] if runs_arg is not None else None
        sweep_id = self.get_argument("sweep", None) or None
        baseline = self.get_argument("baseline", None) or None
        self.send_json(await self.scheduler.compare(run_ids, sweep_id, baseline))


class LeasesHandler(EvalSchedHandler):
    _track_activity = False

    @web.authenticated
    @authorized
    async def get(self) -> None:
        self.send_json({"leases": [lease.record for lease in self.scheduler.leases_in_order()]})

    @web.authenticated
    @authorized
    async def post(self) -> None:
        record = await self.scheduler.request_lease(parse_body(self.request.body, LeaseRequest, "lease request"))
        self.set_header("Location", self.request.path.rstrip("/") + "/" + record["id"])
        self.send_json(record, status=201)


class LeaseHandler(EvalSchedHandler):
    _track_activity = False

    @web.authenticated
    @authorized
    async def get(self, lease_id: str) -> None:
        self.send_json(self.scheduler.get_lease(lease_id).record)

    @web.authenticated
    @authorized
    async def delete(self, lease_id: str) -> None:
        self.scheduler.release_lease(lease_id)
        self.set_status(204)
        self.finish()


class QueueHandler(EvalSchedHandler):
    _track_activity = False

    @web.authenticated
    @authorized
    async def get(self) -> None:
        self.send_json(self.scheduler.queue_view_json(self.int_arg("limit", None, 0, MAX_LIST_LIMIT)))


class LedgerHandler(EvalSchedHandler):
    _track_activity = False

    @web.authenticated
    @authorized
    async def get(self) -> None:
        self.send_json(self.scheduler.ledger())


class ModelsHandler(EvalSchedHandler):
    _track_activity = False

    @web.authenticated
    @authorized
    async def get(self) -> None:
        self.send_json({"models": await self.app.describe_models()})


class ModelConnectHandler(EvalSchedHandler):
    """``POST /evalsched/models/{name}/connect``: where a kernel reaches a shared model (the URL
    runs get in ``shared_urls.json``), its host started if needed."""

    @web.authenticated
    @authorized
    async def post(self, name: str) -> None:
        host = self.app.model_host
        known = host.names() if host is not None else []
        if host is None or name not in known:
            raise ApiError(404, f"unknown shared model {name!r} (known: {', '.join(known) or 'none are configured'})")
        try:
            urls = await host.urls_for([name])
        except ModelUnavailable as exc:
            raise ApiError(503, contract.reason(contract.MODEL_UNAVAILABLE, str(exc), limit=2000)) from None
        self.send_json({"name": name, "url": urls[name]})


class DoctorHandler(EvalSchedHandler):
    _track_activity = False

    @web.authenticated
    @authorized
    async def get(self) -> None:
        from .doctor import runs_disk_check, server_checks

        disk = await asyncio.get_running_loop().run_in_executor(None, runs_disk_check, str(self.app.runs_path))
        self.send_json({"checks": server_checks(self.app, await self.app.describe_models(), disk)})


class StatusHandler(EvalSchedHandler):
    _track_activity = False
    delegated = False

    @web.authenticated
    @authorized
    async def get(self) -> None:
        """This server's own view: its role, and which server is the host's primary."""
        app = self.app
        primary = app.role.primary()
        role = "unavailable" if app.start_error else ("primary" if app.role.is_primary else "secondary")
        body: dict[str, Any] = {
            "version": __version__,
            "role": role,
            "pid": os.getpid(),
            "primary": primary.public() if primary else None,
            "error": None if role != "unavailable" and (primary or app.role.is_primary) else no_primary_message(app),
        }
        if not is_delegating(self):
            view = self.scheduler.status_view()
            # started: recovery has read the runs directory (until then run endpoints answer 503).
            body.update(runs_dir=view.runs_dir, counts=view.counts, started=view.started)
            if view.local_mode is not None:
                body["cgroups"] = view.local_mode.get("cgroups")
                body["warm_start"] = view.local_mode.get("warm_start")
            body["enforce_vram"] = view.enforce_vram
            body["gpu_source"] = view.gpu_source
            if view.host_ledger is not None:
                body["host_ledger"] = view.host_ledger
            body["broken_runs"] = [{"id": k, "problem": v} for k, v in sorted(view.broken.items())]
        self.send_json(body)


class OpenAPIHandler(EvalSchedHandler):
    _track_activity = False

    @web.authenticated
    @authorized
    async def get(self) -> None:
        from .openapi import openapi_document

        self.send_json(openapi_document(self.base_url))


class EventsHandler(WebSocketMixin, websocket.WebSocketHandler, ExtensionHandlerMixin, JupyterHandler):
    """``{"type": "snapshot", "queue": ...}`` first, then ``{"type": "run", "run": ...}`` per change."""

    auth_resource = AUTH_RESOURCE

    def initialize(self, name: str = EXTENSION, *args: Any, **kwargs: Any) -> None:
        ExtensionHandlerMixin.initialize(self, name, *args, **kwargs)

    @property
    def app(self) -> EvalSchedApp:
        return cast("EvalSchedApp", self.extensionapp)

    async def pre_get(self) -> None:
        user = self.current_user
        ok = await ensure_async(self.authorizer.is_authorized(self, user, "execute", AUTH_RESOURCE))
        if not ok:
            raise web.HTTPError(403)

    @ws_authenticated
    async def get(self, *args: Any, **kwargs: Any) -> None:
        await self.pre_get()
        if self.request.headers.get("Upgrade", "").lower() != "websocket":
            # tornado answers a plain GET with an HTML sentence; every route here answers JSON.
            self.set_status(400)
            self.set_header("Content-Type", "application/json")
            self.finish(
                json.dumps({"message": "GET /evalsched/events is a WebSocket: upgrade the connection", "reason": None})
            )
            return
        try:
            self._queue_limit = int_query("limit", self.get_argument("limit", None), None, 0, MAX_LIST_LIMIT)
        except ValueError as exc:
            self.set_status(400)
            self.set_header("Content-Type", "application/json")
            self.finish(json.dumps({"message": str(exc), "reason": None}))
            return
        res = super().get(*args, **kwargs)
        if res is not None:
            await res

    async def open(self, *args: Any, **kwargs: Any) -> None:
        if is_delegating(self):
            await self._relay_from_primary()
            return
        scheduler: Scheduler = self.app.scheduler
        if not scheduler.started:
            self.close(1013, "the scheduler is starting; reconnect in a moment")
            return
        self._scheduler = scheduler
        # The view as GET /queue serialises it (cached alike): a long queue is not rebuilt per socket.
        view = scheduler.queue_view_json(self._queue_limit)
        self.write_message(b'{"type":"snapshot","queue":' + view + b"}", binary=False)
        scheduler.subscribe(self._on_event)

    async def _relay_from_primary(self) -> None:
        """A secondary relays the primary's stream; when the primary goes, the socket closes and
        the client reconnects (to whichever server then is primary, through this one)."""
        primary = self.app.role.forward_target()
        if primary is None:
            self.close(1013, "the host's primary evalsched server is changing; reconnect")
            return
        url = "ws" + primary.internal_url[len("http") :].rstrip("/") + "/evalsched/events"
        if self._queue_limit is not None:  # that alone: the client's own query (a token) stays here
            url += f"?limit={self._queue_limit}"
        headers = {"Authorization": f"token {primary.secret}"}
        try:
            # (checks whose socket it reached before the upgrade, and its secret, is sent: internal.py)
            self._upstream = await link_websocket_connect(HTTPRequest(url, headers=headers, request_timeout=10))
        except LinkRefused as exc:
            self.close(1011, str(exc)[:120])  # (a close reason is at most 123 bytes)
            return
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
            self.write_message(_encoded(event))
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


_last_event: tuple[dict | None, str] = (None, "")


def _encoded(event: dict) -> str:
    """An event as JSON, encoded once for every socket it goes to (the run table hands the same
    dict to each subscriber in turn)."""
    global _last_event
    if _last_event[0] is not event:
        _last_event = (event, json.dumps(event, separators=(",", ":")))
    return _last_event[1]


def handlers() -> list[tuple[str, type]]:
    return [
        (r"/evalsched/runs/?", RunsHandler),
        (rf"/evalsched/runs/{RUN_ID}/cancel/?", CancelHandler),
        (rf"/evalsched/runs/{RUN_ID}/resume/?", ResumeHandler),
        (rf"/evalsched/runs/{RUN_ID}/logs/?", LogsHandler),
        (rf"/evalsched/runs/{RUN_ID}/episodes/?", EpisodesHandler),
        (rf"/evalsched/runs/{RUN_ID}/?", RunHandler),
        (r"/evalsched/sweeps/?", SweepsHandler),
        (rf"/evalsched/sweeps/{SWEEP_ID}/cancel/?", SweepCancelHandler),
        (rf"/evalsched/sweeps/{SWEEP_ID}/?", SweepHandler),
        (r"/evalsched/compare/?", CompareHandler),
        (r"/evalsched/leases/?", LeasesHandler),
        (rf"/evalsched/leases/{LEASE_ID}/?", LeaseHandler),
        (r"/evalsched/queue/?", QueueHandler),
        (r"/evalsched/ledger/?", LedgerHandler),
        (r"/evalsched/models/?", ModelsHandler),
        (r"/evalsched/models/(?P<name>[^/]+)/connect/?", ModelConnectHandler),
        (r"/evalsched/status/?", StatusHandler),
        (r"/evalsched/doctor/?", DoctorHandler),
        (r"/evalsched/events/?", EventsHandler),
        (r"/evalsched/openapi.json", OpenAPIHandler),
    ]
