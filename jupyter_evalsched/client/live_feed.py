"""Events with polling fallback: the one loop that follows the server, for ``wait()``, the
widgets and the CLI.

A :class:`LiveFeed` keeps a *tracker* current: :class:`RunTracker` (one run's record) or
:class:`QueueTracker` (the queue view and the runs that finished last); the tracker calls back at
every change. Events of the ``/evalsched/events`` WebSocket are folded in as they come. REST reads
are the truth: one right after subscribing (so that a change between the two cannot be missed),
one whenever the tracker knows that REST has more than the events (the final summary, the pending
reasons that follow a state change), one at :meth:`LiveFeed.wake`, and a safety net every
``safety_poll_s`` (every ``poll_s`` without a socket). When the socket cannot be opened or is lost
(a proxy that drops WebSockets, a server restart), the feed polls, and opens the socket again
later, waiting longer after each failure.

A feed runs on the caller's thread (:meth:`LiveFeed.run`, where Ctrl-C reaches it and errors
propagate) or on a daemon thread of its own (:meth:`LiveFeed.start`, for widgets: the kernel is
never blocked; errors are kept in ``error`` and ``last_error``). :meth:`LiveFeed.stop` is safe
from any thread. Either way a server that goes away once it was read (a restart: unreachable,
then starting) is polled until it answers again: ``on_outage`` is told when it goes and when it
is back; on the caller's thread only the first read's failure, and errors that are not the
server's absence (a 404, a 403), propagate.
"""

from __future__ import annotations

import atexit
import sys
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any, Protocol

from ..contract import MAX_LIST_LIMIT, QUEUED, RUNNING, TERMINAL_STATES
from .errors import HOW_TO_FIX, EvalSchedClientError, EventStreamClosed, server_away


class Tracker(Protocol):
    """What a :class:`LiveFeed` keeps current. A tracker may also have ``queue_limit``: how many
    queued runs the stream's first event (the queue view) should list, 0 for a tracker that does
    not read it (a long queue's view is megabytes); without one, or None, all of them."""

    @property
    def done(self) -> bool:
        """Nothing more will change: the feed ends."""
        ...

    def apply(self, event: dict) -> None:
        """Fold in one event of the stream."""

    def wants_read(self, now: float) -> bool:
        """Whether REST knows more than the events told (``now``: ``time.monotonic()``)."""
        ...

    def read(self, client: Any) -> None:
        """Read the truth over REST; errors propagate."""

    def notify(self) -> None:
        """Call back if anything changed since the last call."""


# --------------------------------------------------------------------------- the feed

_THREADED_FEEDS: weakref.WeakSet[LiveFeed] = weakref.WeakSet()
_exit_hook_installed = False


def _stop_threaded_feeds() -> None:
    # Interpreter exit (a kernel shutting down): stop the threads before modules are torn down
    # under them. Installed at the first start(), so that it runs before the exit hooks of what
    # was imported earlier (ipywidgets, ipykernel): atexit runs the last registered first.
    for feed in list(_THREADED_FEEDS):
        feed.stop(join=False)


class LiveFeed:
    """Follow the server for ``tracker``: events when possible, REST polls as a safety net.

    ``mode`` is ``starting``, ``live`` (events), ``polling`` (REST only) or ``stopped``;
    ``last_error`` says why events are not in use, ``error`` why the last REST read failed (None
    after a good one). ``on_tick()`` is called after every turn of the loop (every event, and every
    ``tick_s`` without one: clocks, throttled renders); returning False ends the feed.
    """

    def __init__(
        self,
        client: Any,
        tracker: Tracker,
        *,
        use_events: bool = True,
        poll_s: float = 1.0,
        safety_poll_s: float = 3.0,
        tick_s: float = 0.25,
        reconnect_s: float = 5.0,
        connect_timeout: float = 5.0,
        on_tick: Callable[[], bool | None] | None = None,
        name: str = "evalsched-feed",
        on_outage: Callable[[str | None], None] | None = None,
    ):
        self.client = client
        self.tracker = tracker
        self.use_events = use_events
        self.poll_s = poll_s
        self.safety_poll_s = safety_poll_s
        self.tick_s = tick_s
        self.reconnect_s = reconnect_s
        self.connect_timeout = connect_timeout
        self.on_tick = on_tick
        self.name = name
        self.mode = "starting"
        self.last_error: str | None = None
        self.error: str | None = None
        self._stop = threading.Event()
        self._woken = threading.Event()
        self._stream: Any = None
        self._thread: threading.Thread | None = None
        self._following = False
        self._contain_errors = False
        self._connect_at = 0.0
        self._connect_failures = 0
        self._read_at: float | None = None  # time of the last REST read; None: read at once
        self.on_outage = on_outage
        self._reached = False  # a REST read worked: a failure after it is an outage, waited through
        self._away = False  # in an outage (on_outage was told)

    # ---- control

    def run(self, timeout: float | None = None) -> bool:
        """Follow on this thread until the tracker is done (True), or until ``timeout`` seconds
        pass or ``stop()`` is called (False)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        return self._follow(deadline, contain_errors=False)

    def start(self) -> None:
        """Follow on a daemon thread named ``name`` until the tracker is done or ``stop()``."""
        global _exit_hook_installed
        if not _exit_hook_installed:
            atexit.register(_stop_threaded_feeds)
            _exit_hook_installed = True
        _THREADED_FEEDS.add(self)
        self._thread = threading.Thread(target=self._follow, args=(None, True), name=self.name, daemon=True)
        self._thread.start()

    def read_now(self) -> None:
        """One REST read on this thread, e.g. to fill a widget before it is shown; a failure is
        kept in ``error``. The feed reads again once subscribed."""
        try:
            self.tracker.read(self.client)
        except EvalSchedClientError as e:
            self.error = str(e)
        else:
            self.error = None

    @property
    def alive(self) -> bool:
        """Whether the feed's own thread runs."""
        return self._thread is not None and self._thread.is_alive()

    def wake(self) -> None:
        """Ask for a REST read at the next tick (after a cancel, say)."""
        self._woken.set()

    def stop(self, join: bool = True, timeout: float = 3.0) -> None:
        """End the feed (idempotent, from any thread); ``join`` waits for its thread."""
        self._stop.set()
        stream = self._stream
        if stream is not None:
            stream.close()  # unblocks a pending receive
        if not self._following:
            self.mode = "stopped"
        thread = self._thread
        if join and thread is not None and thread.is_alive() and threading.current_thread() is not thread:
            thread.join(timeout)

    # ---- the loop

    def _follow(self, deadline: float | None, contain_errors: bool) -> bool:
        self._following = True
        self._contain_errors = contain_errors
        try:
            while not self._stop.is_set():
                try:
                    verdict = self._step(deadline)
                except Exception as e:
                    if not contain_errors:
                        raise
                    # On the feed's thread there is nobody to raise to: keep it, and go on.
                    self.last_error = f"{type(e).__name__}: {e}"
                    verdict = None
                    self._stop.wait(self.tick_s)
                if verdict is not None:
                    return verdict
            return False
        finally:
            self._close_stream()
            self._following = False
            self.mode = "stopped"
            _THREADED_FEEDS.discard(self)

    def _step(self, deadline: float | None) -> bool | None:
        """One turn: True when the tracker is done, False to stop, None to go on."""
        self._open_stream_if_due()
        self._read_if_due()
        self.tracker.notify()
        if self.on_tick is not None and self.on_tick() is False:
            return False
        if self.tracker.done:
            return True
        now = time.monotonic()
        if deadline is not None and now >= deadline:
            return False
        wait_s = self.tick_s if deadline is None else max(0.01, min(self.tick_s, deadline - now))
        event = self._next_event(wait_s)
        if event is not None:
            self.tracker.apply(event)
        return None

    def _open_stream_if_due(self) -> None:
        if self._stream is not None:
            return
        if not self.use_events:
            self.mode = "polling"
            return
        now = time.monotonic()
        if now < self._connect_at:
            return
        try:
            # A tracker written before limits has none: the whole view, asked as it was then.
            limit = getattr(self.tracker, "queue_limit", None)
            if limit is None:
                stream = self.client.events(connect_timeout=self.connect_timeout)
            else:
                stream = self.client.events(connect_timeout=self.connect_timeout, queue_limit=limit)
        except Exception as e:  # any failure to connect: polling alone is correct, only slower
            self._connect_failures += 1
            self._connect_at = now + min(60.0, self.reconnect_s * self._connect_failures)
            self.mode = "polling"
            self.last_error = f"events unavailable: {e}"
            return
        if self._stop.is_set():  # stop() came while connecting
            stream.close()
            return
        self._stream = stream
        self._connect_failures = 0
        self.mode = "live"
        self._read_at = None  # subscribed: now read, so that nothing in between is missed

    def _read_if_due(self) -> None:
        now = time.monotonic()
        if self._read_at is not None:
            since = now - self._read_at
            if self.error is not None:
                due = since >= self.poll_s  # a server that fails is not asked faster than this
            else:
                interval = self.safety_poll_s if self._stream is not None else self.poll_s
                due = self._woken.is_set() or since >= interval or self.tracker.wants_read(now)
            if not due:
                return
        self._woken.clear()
        self._read_at = now
        try:
            self.tracker.read(self.client)
        except EvalSchedClientError as e:
            # A server never read (a wrong URL or token) is told at once; one that went away
            # (a restart) is polled, every poll_s, until it answers or the caller stops.
            if not self._contain_errors and not (self._reached and server_away(e)):
                raise
            self.error = str(e)
            if not self._away and server_away(e):
                self._away = True
                if self.on_outage is not None:
                    self.on_outage(self.error)
        else:
            self.error = None
            self._reached = True
            if self._away:
                self._away = False
                if self.on_outage is not None:
                    self.on_outage(None)

    def _next_event(self, wait_s: float) -> dict | None:
        stream = self._stream
        if stream is None:
            self._stop.wait(wait_s)
            return None
        try:
            return stream.next_event(timeout=wait_s)
        except EventStreamClosed as e:
            self._stream = None
            if not self._stop.is_set():
                # A server restart, a proxy's idle timeout: poll meanwhile, and reconnect soon.
                self.mode = "polling"
                self.last_error = f"event stream lost: {e}"
                self._connect_at = time.monotonic() + min(1.0, self.reconnect_s)
            return None

    def _close_stream(self) -> None:
        stream, self._stream = self._stream, None
        if stream is not None:
            stream.close()


def outage_notes(on_note: Callable[[str], None] | None = None) -> Callable[[str | None], None]:
    """An ``on_outage`` for a feed that someone waits on: one line when the server goes away and
    one when it is back, to ``on_note(text)`` (default: stderr)."""

    def note(text: str) -> None:
        if on_note is not None:
            on_note(text)
        else:
            print(text, file=sys.stderr, flush=True)

    def on_outage(error: str | None) -> None:
        if error is None:
            note("server answers again")
        else:
            error = error.replace(f": {HOW_TO_FIX}", "")  # (the server was here: no advice to start one)
            note(f"server unreachable ({error}); retrying until it answers (Ctrl-C stops waiting)")

    return on_outage


# --------------------------------------------------------------------------- trackers


class RunTracker:
    """One run's ``record``, kept current by a feed; ``on_change(record)`` at every change.

    ``done`` once a terminal record was read over REST: only that one carries the final
    ``summary``.
    """

    queue_limit = 0  # the snapshot's queue is not read

    def __init__(self, run_id: str, on_change: Callable[[dict], Any] | None = None, record: dict | None = None):
        self.run_id = run_id
        self.on_change = on_change
        self.record: dict = dict(record) if record else {"id": run_id}
        self.fresh = False  # the record came from REST (with summary.json), not from an event
        self._want_read = False
        self._last_read = 0.0
        self._shown: dict | None = None

    @property
    def terminal(self) -> bool:
        return self.record.get("state") in TERMINAL_STATES

    @property
    def done(self) -> bool:
        return self.terminal and self.fresh

    def apply(self, event: dict) -> None:
        new = event.get("run") if event.get("type") == "run" else None
        if not isinstance(new, dict) or new.get("id") != self.run_id:
            return
        old = self.record
        new = dict(new)
        new.setdefault("summary", old.get("summary"))  # events carry no summary: keep the last read
        self.record, self.fresh = new, False
        # A state change comes with a new summary (an error, say); a server whose records lack
        # the latest metrics has them in summary.json as progress moves.
        lacks_metrics = new.get("progress") != old.get("progress") and "metrics" not in new
        if lacks_metrics or new.get("state") != old.get("state"):
            self._want_read = True

    def wants_read(self, now: float) -> bool:
        if self.terminal and not self.fresh:
            return True  # the final summary is only in a REST read: at once
        return self._want_read and now - self._last_read >= 1.0  # otherwise at most once a second

    def read(self, client: Any) -> None:
        self._last_read = time.monotonic()
        self._want_read = False
        self.record, self.fresh = client.get(self.run_id), True

    def notify(self) -> None:
        if self.record != self._shown:
            self._shown = self.record
            if self.on_change is not None:
                self.on_change(self.record)


# The queue view's list of the runs in each active state.
_VIEW_LIST_OF_STATE = {QUEUED: "queued", RUNNING: "running"}


class QueueTracker:
    """The queue ``view`` (``queued`` in admission order, ``running``, ``ledger``, as
    ``GET /evalsched/queue`` answers it), and with ``finished_limit`` the runs that finished most
    recently (``finished``, latest first); ``on_change(view)`` at every change.

    With ``queue_limit``, the view lists the first ``queue_limit`` queued runs only, as the
    server orders them, and ``queued_total`` counts them all: what a long queue costs the server
    and this client is then what is shown."""

    done = False  # the queue never ends

    # A burst of events (a hundred submissions) costs a few reads, not a hundred.
    READ_DEBOUNCE_S = 0.25
    # The scheduler's admission pass, which sets the pending reasons of queued runs, follows a
    # state change and emits no event of its own: one more read this much later shows them.
    SETTLE_S = 0.5

    def __init__(
        self,
        on_change: Callable[[dict], Any] | None = None,
        *,
        finished_limit: int = 0,
        queue_limit: int | None = None,
    ):
        self.on_change = on_change
        self.finished_limit = finished_limit
        # What the server accepts (0 to 100,000): a widget asked for more rows lists them all.
        self.queue_limit = None if queue_limit is None or queue_limit > MAX_LIST_LIMIT else max(0, queue_limit)
        self.view: dict = {"queued": [], "queued_total": 0, "running": [], "ledger": None, "leases": []}
        self.finished: list[dict] = []
        self._terminal_events: list[dict] = []  # terminal records from events since the last read
        self._changed = False
        self._want_read = False
        self._settle_at: float | None = None
        self._last_read = 0.0

    def set_view(self, view: dict, finished: list[dict] | None = None) -> None:
        """Take ``view`` (and ``finished`` records) as the current state."""
        queued = list(view.get("queued") or [])
        total = view.get("queued_total")
        self.view = {
            **view,
            "queued": queued,
            # A server older than the limit lists every queued run and does not count them.
            "queued_total": total if isinstance(total, int) and total >= len(queued) else len(queued),
            "running": list(view.get("running") or []),
            "ledger": view.get("ledger"),
            "leases": list(view.get("leases") or []),
        }
        if finished is not None:
            self._merge_finished(finished, [])
        self._changed = True

    def find(self, run_id: str) -> dict | None:
        """The latest record of a run that is queued, running or among ``finished``."""
        for rec in (*self.view["running"], *self.view["queued"], *self.finished):
            if rec.get("id") == run_id:
                return rec
        return None

    def apply(self, event: dict) -> None:
        kind = event.get("type")
        if kind == "snapshot" and isinstance(event.get("queue"), dict):
            self.set_view(event["queue"])
        elif kind == "run" and isinstance(event.get("run"), dict):
            self._apply_run(event["run"])
        elif kind == "ledger" and isinstance(event.get("ledger"), dict):
            self.view["ledger"] = event["ledger"]  # VRAM outside the scheduler changed
            self._changed = True
        elif kind == "lease" and isinstance(event.get("lease"), dict):
            self._apply_lease(event["lease"])

    def _apply_lease(self, rec: dict) -> None:
        leases = [item for item in self.view.get("leases") or [] if item.get("id") != rec.get("id")]
        old = next((item for item in self.view.get("leases") or [] if item.get("id") == rec.get("id")), None)
        if rec.get("state") != "ended":
            leases.append(dict(rec))
        self.view["leases"] = leases
        if old is None or old.get("state") != rec.get("state"):
            # A grant or an end moves VRAM in the ledger, and the queue's reasons with it.
            self._want_read = True
            self._settle_at = time.monotonic() + self.SETTLE_S
        self._changed = True

    def _apply_run(self, rec: dict) -> None:
        rid = rec.get("id")
        old = next((r for r in (*self.view["running"], *self.view["queued"]) if r.get("id") == rid), None)
        if old is not None and old.get("state") == rec.get("state"):
            old.update(rec)  # progress of a known run: patched in place; the ledger has not changed
        else:
            # A state change moves the run to its new list at once; the ledger and the queue
            # order change too: read the authoritative view, and once more when the admission
            # pass has run.
            self._move(rec)
            self._want_read = True
            self._settle_at = time.monotonic() + self.SETTLE_S
        self._changed = True

    def _move(self, rec: dict) -> None:
        rid = rec.get("id")
        view = self.view
        listed = any(r.get("id") == rid for r in view["queued"])
        # Every queued run is listed: a queued run not among them is new to the queue, as is one
        # known running or finished (resumed). Otherwise it may be one beyond the listed part
        # (whose reason changed, say): the count and the list wait for the read a move asks for.
        complete = view["queued_total"] <= len(view["queued"]) or any(
            r.get("id") == rid for r in (*view["running"], *self.finished)
        )
        for key in _VIEW_LIST_OF_STATE.values():
            view[key] = [r for r in view[key] if r.get("id") != rid]
        if listed:
            view["queued_total"] -= 1
        state = rec.get("state")
        if state == QUEUED:
            if not (listed or complete):
                return
            view["queued_total"] += 1
            if self.queue_limit is not None and len(view["queued"]) >= self.queue_limit:
                return  # beyond the listed part, until the read places it
        if state in _VIEW_LIST_OF_STATE:
            view[_VIEW_LIST_OF_STATE[state]].append(dict(rec))  # at the end until the read places it
        elif state in TERMINAL_STATES:
            self._terminal_events.append(rec)
            self._merge_finished(self.finished, [rec])

    def wants_read(self, now: float) -> bool:
        if self._want_read and now - self._last_read >= self.READ_DEBOUNCE_S:
            return True
        return self._settle_at is not None and now >= self._settle_at

    def read(self, client: Any) -> None:
        now = self._last_read = time.monotonic()
        self._want_read = False
        if self._settle_at is not None and now >= self._settle_at:
            self._settle_at = None
        # (no limit, no argument: a client written before limits still serves a tracker without one)
        view = client.queue() if self.queue_limit is None else client.queue(limit=self.queue_limit)
        if self.finished_limit:
            # Listed newest-submitted first: read more than shown, then order by end time.
            listed = client.list(state=sorted(TERMINAL_STATES), limit=max(50, self.finished_limit))
            # Terminal events since the last read are merged in (a long run that just ended can
            # be older than the 50 listed); a deleted run drops out here.
            events, self._terminal_events = self._terminal_events, []
            self._merge_finished(listed, events)
        self.set_view(view)

    def notify(self) -> None:
        if self._changed:
            self._changed = False
            if self.on_change is not None:
                self.on_change(self.view)

    def _merge_finished(self, base: list[dict], extra: list[dict]) -> None:
        if not self.finished_limit:
            return
        by_id = {rec["id"]: rec for rec in (*base, *extra) if rec.get("id")}
        ordered = sorted(by_id.values(), key=lambda r: r.get("finished_at") or "", reverse=True)
        self.finished = ordered[: self.finished_limit]
