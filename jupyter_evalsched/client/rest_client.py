""":class:`EvalSchedClient`: the blocking REST client of one server's ``/evalsched/`` API.

Kept light on purpose: ``urllib`` and ``json`` only (no pydantic, no jupyter_server, no tornado),
so that importing it in a kernel or a terminal costs milliseconds.
"""

from __future__ import annotations

import builtins
import http.client
import json
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections.abc import Callable
from email.message import Message
from typing import Any, TypeVar

from ..contract import LOG_OFFSET_HEADER, LOG_SIZE_HEADER, MAX_LIST_LIMIT
from .discovery import discover_server
from .errors import HOW_TO_FIX, TOKEN_HINT, EvalSchedError, ServerNotFound, WaitTimeout
from .events import EventStream
from .handle import RunHandle, run_id_of
from .live_feed import LiveFeed, RunTracker, outage_notes
from .log_reader import LogPart, LogReader
from .redirects import OPENER
from .sweep import SweepHandle

T = TypeVar("T")
# The most episodes asked for per page (the server's largest `limit`): its pages also end at
# 16 MiB of lines, so that a whole list comes in few requests of bounded size.
MAX_EPISODES_PAGE = MAX_LIST_LIMIT


class EvalSchedClient:
    """Blocking client of one server's ``/evalsched/`` API.

    >>> c = EvalSchedClient()           # found as jupyter_evalsched.client.discovery says
    >>> rec = c.submit({"entrypoint": "jupyter_evalsched.examples.basic:noop"})
    >>> c.wait(rec["id"])["state"]
    'succeeded'
    """

    def __init__(
        self, url: str | None = None, token: str | None = None, *, timeout: float = 30.0, submit_retry_s: float = 15.0
    ):
        self.timeout = timeout
        self.base_url, self.token = discover_server(url, token, timeout=timeout)
        self.submit_retry_s = submit_retry_s

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
        headers: dict[str, str] | None = None,
    ) -> Any:
        """One REST call; JSON is decoded unless ``raw`` (then the text is returned).

        A GET answered by a 503 that says the scheduler is starting (recovery reads the runs
        directory) is retried for up to ``submit_retry_s`` seconds, after its Retry-After when
        given. Other methods fail at once (a cancel from a widget must not hold the kernel; a
        submission retries in its own way, under its Idempotency-Key)."""
        return self._retrying_starting(
            method,
            lambda: self._request_once(method, path, query=query, body=body, raw=raw, timeout=timeout, headers=headers),
        )

    def _retrying_starting(self, method: str, call: Callable[[], T]) -> T:
        """``call()``, retried as :meth:`request` says while the scheduler is starting."""
        deadline = time.monotonic() + self.submit_retry_s
        pause = 0.1
        while True:
            try:
                return call()
            except EvalSchedError as exc:
                wait_s = _pause_for(exc, pause)
                if method != "GET" or not _starting(exc) or time.monotonic() + wait_s > deadline:
                    raise
            time.sleep(wait_s)
            pause = min(pause * 2, 2.0)

    def _request_once(
        self,
        method: str,
        path: str,
        *,
        query: dict | None = None,
        body: Any = None,
        raw: bool = False,
        timeout: float | None = None,
        headers: dict[str, str] | None = None,
    ) -> Any:
        payload, answer_headers = self._exchange(method, path, query=query, body=body, timeout=timeout, headers=headers)
        charset = answer_headers.get_content_charset() or "utf-8"
        text = payload.decode(charset, errors="replace")
        if raw:
            return text
        if not text:
            return None
        try:
            return json.loads(text)
        except ValueError:
            raise EvalSchedError(200, f"the server answered {path} with something that is not JSON") from None

    def _exchange(
        self,
        method: str,
        path: str,
        *,
        query: dict | None = None,
        body: Any = None,
        timeout: float | None = None,
        headers: dict[str, str] | None = None,
    ) -> tuple[bytes, Message]:
        """One HTTP exchange: the answer's body and headers; errors as the client raises them."""
        data = None
        headers = {**self._headers(), **(headers or {})}
        if body is not None:
            data = json.dumps(body).encode("utf-8")
            headers["Content-Type"] = "application/json"
        req = urllib.request.Request(self._url(path, query), data=data, method=method, headers=headers)
        try:
            # (not urlopen: a redirect to another origin must not carry the token there)
            with OPENER.open(req, timeout=timeout or self.timeout) as resp:
                return resp.read(), resp.headers
        except urllib.error.HTTPError as e:
            raise self._http_error(e, path) from None
        except urllib.error.URLError as e:
            reason = getattr(e.reason, "strerror", None) or str(e.reason)
            error = ServerNotFound(f"cannot reach {self.base_url}: {reason}: {HOW_TO_FIX}")
            # Refused: the request never reached a server. Anything else (a timeout, a reset) may
            # have reached one that then died: a submission may be retried, with its key.
            error.maybe_received = not isinstance(e.reason, ConnectionRefusedError)
            raise error from None
        except (TimeoutError, ConnectionError) as e:
            error = ServerNotFound(f"cannot reach {self.base_url}: {e}")
            error.maybe_received = not isinstance(e, ConnectionRefusedError)
            raise error from None
        except http.client.HTTPException as e:  # something that is not an HTTP server answered
            said = " ".join(str(e).split())[:80]  # (what it said may be anything: one short line of it)
            error = ServerNotFound(
                f"no HTTP server answers at {self.base_url} ({type(e).__name__}: {said}): {HOW_TO_FIX}"
            )
            error.maybe_received = True
            raise error from None

    def _http_error(self, e: urllib.error.HTTPError, path: str) -> EvalSchedError:
        try:
            body = json.loads(e.read().decode("utf-8", errors="replace") or "null")
        except (ValueError, OSError):
            body = None
        error = self._http_error_of(e.code, body, e.reason)
        try:
            error.retry_after = max(0.0, float(e.headers.get("Retry-After") or ""))
        except (TypeError, ValueError, AttributeError):  # none, or an HTTP date: our own pause then
            pass
        return error

    def _http_error_of(self, code: int, body: Any, reason: Any) -> EvalSchedError:
        if isinstance(body, dict) and ("message" in body or "reason" in body):
            detail = body.get("detail")
            message = str(body.get("message") or "")
            # Not logged in: a POST without a valid token fails tornado's XSRF check first.
            if code == 403 and (message.lower() in ("", "forbidden") or "_xsrf" in message):
                message = TOKEN_HINT
            return EvalSchedError(code, message, detail if isinstance(detail, list) else None, body.get("reason"))
        if code == 404:
            return EvalSchedError(
                404, f"no /evalsched/ API at {self.base_url} (is the jupyter_evalsched server extension enabled?)"
            )
        if code == 403:
            return EvalSchedError(403, TOKEN_HINT)
        return EvalSchedError(code, str(reason or "HTTP error"))

    # ---- endpoints

    def submit(self, spec: dict, *, idempotency_key: str | None = None) -> dict:
        """``POST /evalsched/runs``: the new run record (``queued``, or already ``running``).

        Sent with an ``Idempotency-Key`` (a fresh one unless given) and retried while the server
        answers 503 or cannot be reached (a primary that died mid-request, a server taking over):
        the server answers a key it has seen with the run it created, so a retry never makes a
        second run. Gives up after ``submit_retry_s`` seconds."""
        body = json.loads(json.dumps(spec, default=run_id_of))
        return self._post_idempotent("runs", body, idempotency_key)

    def submit_sweep(self, spec: dict, sweep: dict | list, *, idempotency_key: str | None = None) -> dict:
        """``POST /evalsched/sweeps``: ``{"id", "runs": [records]}``, one run per point of
        ``sweep`` (a grid ``{"param": [values]}`` or a list of points ``[{"param": value}]``).
        Retried like :meth:`submit`, and while the server answers 429 (as many sweep
        submissions as it takes at once are under way): a retry never makes a second sweep."""
        body = json.loads(json.dumps({**spec, "sweep": sweep}, default=run_id_of))
        return self._post_idempotent("sweeps", body, idempotency_key)

    def sweep(self, sweep_id: str) -> dict:
        """``{"id", "runs": [records], "counts": {"<state>": n}}``."""
        return self.request("GET", f"sweeps/{urllib.parse.quote(str(sweep_id), safe='')}")

    def sweeps(self, limit: int | None = None) -> builtins.list[dict]:
        """The sweeps, newest first (``id``, ``name``, ``runs``, ``counts``, ``submitted_at``)."""
        return self.request("GET", "sweeps", query={"limit": limit})["sweeps"]

    def cancel_sweep(self, sweep_id: str, by: str | None = None) -> dict:
        """Cancel a sweep's unfinished runs; ``by`` as for :meth:`cancel`. Answers the sweep's
        view, each run with ``cancel_requested`` (signalled by the cancel and still ending), and
        ``still_ending``: how many runs are (0 once all ended)."""
        path = f"sweeps/{urllib.parse.quote(str(sweep_id), safe='')}/cancel"
        return self.request("POST", path, body={}, query={"by": by} if by else None)

    def compare(self, runs: builtins.list[Any] | None = None, sweep: str | None = None, baseline: Any = None) -> dict:
        """``GET /evalsched/compare``: the runs (ids, handles or records), or a sweep's, side by side."""
        query: dict[str, Any] = {"baseline": _id_of(baseline) if baseline is not None else None}
        if runs is not None:
            query["runs"] = ",".join(_id_of(r) for r in runs)
        if sweep is not None:
            query["sweep"] = sweep
        return self.request("GET", "compare", query=query)

    def _post_idempotent(self, path: str, body: dict, idempotency_key: str | None) -> Any:
        headers = {"Idempotency-Key": idempotency_key or uuid.uuid4().hex}
        deadline = time.monotonic() + self.submit_retry_s
        pause = 0.1
        while True:
            try:
                return self._request_once("POST", path, body=body, headers=headers)
            except (EvalSchedError, ServerNotFound) as exc:
                if isinstance(exc, ServerNotFound):
                    retryable, wait_s = exc.maybe_received, pause
                else:
                    retryable = exc.status in (429, 503)  # 429: the server's limit on sweep submissions at once
                    wait_s = _pause_for(exc, pause)
                if not retryable or time.monotonic() + wait_s > deadline:
                    raise
            time.sleep(wait_s)
            pause = min(pause * 2, 2.0)

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

    def cancel(self, run_id: str, by: str | None = None) -> dict:
        """Cancel a run. ``by`` says who asks, in the run's reason: ``"cli"``, ``"widget"``,
        ``"panel"`` or ``"python"`` (``cancelled from Python (cancel())``)."""
        return self.request("POST", f"runs/{_quote_id(run_id)}/cancel", body={}, query={"by": by} if by else None)

    def resume(self, run_id: str) -> dict:
        return self.request("POST", f"runs/{_quote_id(run_id)}/resume", body={})

    def logs(self, run_id: str, stream: str = "stdout", tail: int | None = None) -> str:
        """The run's log as text (its last ``tail`` lines); :class:`LogReader` follows one."""
        return self.request("GET", f"runs/{_quote_id(run_id)}/logs", query={"stream": stream, "tail": tail}, raw=True)

    def log_part(
        self, run_id: str, stream: str = "stdout", *, offset: int | None = None, tail: int | None = None
    ) -> LogPart:
        """The bytes of the run's log from byte ``offset`` (or its last ``tail`` lines), where
        they end and the log's size: what :class:`LogReader` reads."""
        path = f"runs/{_quote_id(run_id)}/logs"
        query = {"stream": stream, "offset": offset, "tail": tail}
        data, headers = self._retrying_starting("GET", lambda: self._exchange("GET", path, query=query))
        return LogPart(data, _header_int(headers, LOG_OFFSET_HEADER), _header_int(headers, LOG_SIZE_HEADER))

    def log_reader(self, run_id: str, stream: str = "stdout", tail: int | None = None) -> LogReader:
        """A :class:`LogReader` of the run's log: each ``read()`` gives what is new since the last."""
        return LogReader(self, _id_of(run_id), stream, tail)

    def episodes(self, run_id: str) -> builtins.list[dict]:
        """Every episode of the run so far (the lines of ``episodes.jsonl``), page by page."""
        out: builtins.list[dict] = []
        offset: int | None = 0
        while offset is not None:
            page = self.episodes_page(run_id, offset=offset, limit=MAX_EPISODES_PAGE)
            out.extend(page["episodes"])
            following = page.get("next_offset")  # (a server before pages answers all, without it)
            offset = following if isinstance(following, int) and following > offset else None
        return out

    def episodes_page(self, run_id: str, offset: int = 0, limit: int | None = None) -> dict:
        """``{"episodes": [...], "next_offset": n or None, "total": n}``: the episodes of the
        complete lines ``offset`` on of ``episodes.jsonl`` (at most ``limit`` lines; the server's
        default is 1000, but with neither ``offset`` nor ``limit`` it answers every episode, or a
        413 when they are over 16 MiB of lines or 32 MiB of JSON)."""
        query = {"offset": offset or None, "limit": limit}
        return self.request("GET", f"runs/{_quote_id(run_id)}/episodes", query=query)

    def queue(self, limit: int | None = None) -> dict:
        """``{"queued": [...] in admission order, "queued_total": n, "running": [...], "ledger": {...}}``;
        with ``limit``, ``queued`` holds the first ``limit`` queued runs only (``queued_total`` counts all)."""
        return self.request("GET", "queue", query={"limit": limit})

    def ledger(self) -> dict:
        return self.request("GET", "ledger")

    def models(self) -> builtins.list[dict]:
        return self.request("GET", "models")["models"]

    def openapi(self) -> dict:
        return self.request("GET", "openapi.json")

    def handle(self, run: str | dict) -> RunHandle:
        """A :class:`RunHandle` for a run id or record."""
        return RunHandle(self, run)

    def sweep_handle(self, sweep: str | dict) -> SweepHandle:
        """A :class:`SweepHandle` for a sweep id or view."""
        return SweepHandle(self, sweep)

    def events(
        self, *, connect_timeout: float = 10.0, backend: str | None = None, queue_limit: int | None = None
    ) -> EventStream:
        """The ``/evalsched/events`` WebSocket as an iterator of event dicts (close it, or use ``with``).

        The first event is ``{"type": "snapshot", "queue": ...}`` (its ``queued`` the first
        ``queue_limit`` runs, when given), then ``{"type": "run", "run": ...}``.
        """
        return EventStream(self, connect_timeout=connect_timeout, backend=backend, queue_limit=queue_limit)

    def wait(
        self,
        run_id: str,
        timeout: float | None = None,
        *,
        use_events: bool = True,
        on_update: Callable[[dict], None] | None = None,
        poll_s: float = 1.0,
        on_note: Callable[[str], None] | None = None,
    ) -> dict:
        """Block until the run is terminal; return its final record (with ``summary``).

        Events wake the wait at once; a REST poll runs as a safety net (every ``poll_s`` without a
        socket, every few seconds with one). ``on_update(record)`` is called at every change.
        Once the run was read, a server that goes away (restarting, starting, unreachable) is
        polled until it answers again, for as long as the wait lasts: ``on_note(text)`` (default:
        a line on stderr) says so when it goes and when it is back. Raises :class:`WaitTimeout`
        after ``timeout`` seconds; Ctrl-C stops waiting.
        """
        tracker = RunTracker(_id_of(run_id), on_change=on_update)
        feed = LiveFeed(
            self, tracker, use_events=use_events, poll_s=poll_s, safety_poll_s=3.0, on_outage=outage_notes(on_note)
        )
        if not feed.run(timeout):
            raise WaitTimeout(tracker.run_id, timeout or 0.0, tracker.record)
        return tracker.record


def _header_int(headers: Message, name: str) -> int | None:
    """A whole number the server put in a header; None when absent or not one."""
    try:
        value = int(headers.get(name) or "")
    except ValueError:
        return None
    return value if value >= 0 else None


def _starting(exc: EvalSchedError) -> bool:
    """A 503 of a server whose scheduler is starting (or whose primary is changing): it did
    nothing, and answers in a moment. Not any 503 with a Retry-After: a proxy's may say that."""
    return exc.status == 503 and ("scheduler is starting" in exc.message or "is starting or changing" in exc.message)


def _pause_for(exc: EvalSchedError, pause: float) -> float:
    """The pause before a retry: the answer's Retry-After (at most 10 s), else ``pause``."""
    return min(exc.retry_after, 10.0) if exc.retry_after is not None else pause


def _id_of(run: str | dict | RunHandle) -> str:
    """Methods that take a run id also take its handle or record."""
    run = run_id_of(run)
    return str(run["id"] if isinstance(run, dict) else run)


def _quote_id(run: str | dict | RunHandle) -> str:
    return urllib.parse.quote(_id_of(run), safe="")
