"""The live feed (events with polling fallback) against a fake server: no Jupyter, no sockets."""

from __future__ import annotations

import queue
import threading
import time

import pytest
from waiting import wait_until

from jupyter_evalsched.client import EvalSchedClientError, EvalSchedError, LiveFeed, QueueTracker, RunTracker
from jupyter_evalsched.client.errors import EventStreamClosed

_CLOSED = object()


class FakeStream:
    """An event stream whose events the test pushes, and which the test can drop."""

    def __init__(self):
        self._events: queue.Queue = queue.Queue()
        self.closed = False

    def push(self, event: dict) -> None:
        self._events.put(event)

    def drop(self) -> None:
        self._events.put(_CLOSED)  # what a server restart looks like to the reader

    def next_event(self, timeout=None):
        if self.closed:
            raise EventStreamClosed("event stream closed")
        try:
            item = self._events.get(timeout=timeout)
        except queue.Empty:
            return None
        if item is _CLOSED:
            self.closed = True
            raise EventStreamClosed("the server closed the event stream")
        return item

    def close(self) -> None:
        self.closed = True
        self._events.put(_CLOSED)  # unblocks a pending next_event


class FakeServer:
    """Stands in for EvalSchedClient: one run, a socket that can fail, counted REST reads."""

    def __init__(self):
        self.socket_works = False
        self.streams: list[FakeStream] = []
        self.record = {"id": "r1", "state": "queued", "progress": {"done": 0, "total": 3}, "metrics": {}}
        self.gets = 0
        self.fail_reads: Exception | None = None
        self.queue_limits: list[int | None] = []  # what each open of the stream and read asked for

    def events(self, connect_timeout: float = 10.0, queue_limit: int | None = None) -> FakeStream:
        self.queue_limits.append(queue_limit)
        if not self.socket_works:
            raise EvalSchedClientError("proxy dropped the WebSocket")
        self.streams.append(FakeStream())
        return self.streams[-1]

    def get(self, run_id: str) -> dict:
        if self.fail_reads is not None:
            raise self.fail_reads
        self.gets += 1
        return {**self.record, "summary": {"episodes_done": self.record["progress"]["done"]}}

    def queue(self, limit: int | None = None) -> dict:
        self.queue_limits.append(limit)
        run = dict(self.record)
        lists = {
            "queued": [run] if run["state"] == "queued" else [],
            "running": [run] if run["state"] == "running" else [],
        }
        return {**lists, "ledger": {"devices": []}}

    def list(self, state=None, limit=None) -> list:
        return [dict(self.record)] if self.record["state"] in (state or []) else []

    def change(self, **fields) -> dict:
        self.record = {**self.record, **fields}
        return {"type": "run", "run": dict(self.record)}


def test_feed_polls_while_the_socket_fails_and_takes_events_again_once_it_opens():
    server = FakeServer()
    seen: list[dict] = []
    tracker = RunTracker("r1", on_change=seen.append)
    feed = LiveFeed(server, tracker, poll_s=0.05, safety_poll_s=60, tick_s=0.02, reconnect_s=0.1, name="evalsched-test")
    feed.start()
    try:
        # (The feed's thread sets the mode, then the error.)
        wait_until(
            lambda: feed.mode == "polling" and "proxy dropped the WebSocket" in (feed.last_error or ""),
            message="no fallback to polling",
        )
        # Polling: a change on the server is seen through REST alone.
        server.change(state="running")
        wait_until(lambda: tracker.record["state"] == "running")

        # The socket works again: the feed opens it (the retry delay grows with each failure).
        server.socket_works = True
        wait_until(lambda: feed.mode == "live", timeout=5)
        gets = server.gets
        # Events now carry the changes; the safety poll (60 s) does not: at most the one read
        # that follows subscribing, which may land after `gets` was taken.
        server.streams[-1].push(server.change(progress={"done": 2, "total": 3}, metrics={"score": {"mean": 0.5}}))
        wait_until(lambda: tracker.record["progress"]["done"] == 2)
        assert server.gets <= gets + 1

        # The stream is lost (a server restart): polling, then live again on a new socket.
        server.streams[-1].drop()
        wait_until(lambda: feed.mode == "polling" and "event stream lost" in (feed.last_error or ""))
        wait_until(lambda: feed.mode == "live" and len(server.streams) == 2, timeout=5)

        # The end of the run comes as an event; the final summary is read at once, and the feed ends.
        server.streams[-1].push(server.change(state="succeeded", progress={"done": 3, "total": 3}))
        wait_until(lambda: not feed.alive, timeout=5)
        assert tracker.done and tracker.record["summary"] == {"episodes_done": 3}
        assert feed.mode == "stopped" and server.streams[-1].closed  # the feed closed its socket
    finally:
        feed.stop()
    states = [r["state"] for r in seen]
    assert states[0] == "queued" and states[-1] == "succeeded" and "running" in states
    assert seen[-1]["summary"] == {"episodes_done": 3}  # the last callback had the final read


def test_run_on_the_callers_thread_times_out_stops_and_raises():
    server = FakeServer()
    feed = LiveFeed(server, RunTracker("r1"), poll_s=0.05, tick_s=0.02)
    started = time.monotonic()
    assert feed.run(timeout=0.3) is False  # not terminal: a timeout, not done
    assert 0.3 <= time.monotonic() - started < 3 and feed.mode == "stopped"

    # stop() from another thread ends a run() promptly.
    feed = LiveFeed(server, RunTracker("r1"), poll_s=0.05, tick_s=0.02)
    threading.Timer(0.2, feed.stop).start()
    started = time.monotonic()
    assert feed.run() is False and time.monotonic() - started < 3

    # On the caller's thread REST errors reach the caller; on the feed's thread they are kept.
    server.fail_reads = EvalSchedError(404, "unknown run id")
    with pytest.raises(EvalSchedError):
        LiveFeed(server, RunTracker("r1"), poll_s=0.05, tick_s=0.02).run(timeout=5)
    feed = LiveFeed(server, RunTracker("r1"), poll_s=0.05, tick_s=0.02, name="evalsched-test")
    feed.start()
    try:
        wait_until(lambda: feed.error == "404: unknown run id")
        server.fail_reads = None
        wait_until(lambda: feed.error is None)  # retried, at poll_s
    finally:
        feed.stop()
    assert not feed.alive


def test_queue_tracker_patches_progress_and_rereads_after_state_changes():
    server = FakeServer()
    views: list[dict] = []
    tracker = QueueTracker(views.append, finished_limit=5)
    tracker.apply({"type": "snapshot", "queue": server.queue()})
    tracker.notify()
    assert [r["id"] for r in views[-1]["queued"]] == ["r1"]
    assert not tracker.wants_read(time.monotonic() + 10)

    # Progress of a known run in the same state: patched in place, nothing to read.
    tracker.apply({"type": "run", "run": {"id": "r1", "state": "queued", "reason": "waiting_vram: ..."}})
    assert tracker.view["queued"][0]["reason"] == "waiting_vram: ..."
    assert not tracker.wants_read(time.monotonic() + 10)

    # A state change: read the view (debounced), and once more when the admission pass settled.
    event = server.change(state="succeeded", finished_at="2026-01-01T00:00:01+00:00")
    tracker.apply(event)
    assert tracker.find("r1")["state"] == "succeeded"  # from the event, before any read
    now = time.monotonic()
    assert tracker.wants_read(now + QueueTracker.READ_DEBOUNCE_S)
    tracker.read(server)
    assert tracker.view["queued"] == [] and [r["id"] for r in tracker.finished] == ["r1"]
    assert not tracker.wants_read(time.monotonic())
    assert tracker.wants_read(time.monotonic() + QueueTracker.SETTLE_S)
    tracker.notify()
    assert views[-1]["queued"] == [] and not tracker.done


def test_queue_tracker_with_a_limit_lists_the_head_and_counts_the_rest():
    server = FakeServer()
    tracker = QueueTracker(queue_limit=2)
    head = [{"id": f"q{i}", "state": "queued"} for i in range(2)]
    tracker.apply({"type": "snapshot", "queue": {"queued": head, "queued_total": 5, "running": [], "ledger": None}})
    assert [r["id"] for r in tracker.view["queued"]] == ["q0", "q1"] and tracker.view["queued_total"] == 5
    # A head of a longer queue: a queued run not listed may be one beyond it whose reason changed
    # (an admission pass tells thousands), or a new one: neither counted nor listed until a read.
    for i in range(50):
        tracker.apply({"type": "run", "run": {"id": f"beyond{i}", "state": "queued", "reason": "waiting_vram"}})
    assert [r["id"] for r in tracker.view["queued"]] == ["q0", "q1"] and tracker.view["queued_total"] == 5
    assert tracker.wants_read(time.monotonic() + QueueTracker.READ_DEBOUNCE_S)
    # A listed run that starts leaves the queue and its count.
    tracker.apply({"type": "run", "run": {"id": "q0", "state": "running"}})
    assert [r["id"] for r in tracker.view["queued"]] == ["q1"] and tracker.view["queued_total"] == 4
    assert [r["id"] for r in tracker.view["running"]] == ["q0"]
    tracker.read(server)  # the read asks for the same head
    assert server.queue_limits == [2] and tracker.view["queued_total"] == 1
    # Every queued run listed: one not among them is new, counted, and listed while there is room.
    tracker.apply({"type": "snapshot", "queue": {"queued": head[:1], "queued_total": 1, "running": [], "ledger": None}})
    tracker.apply({"type": "run", "run": {"id": "new", "state": "queued"}})
    assert [r["id"] for r in tracker.view["queued"]] == ["q0", "new"] and tracker.view["queued_total"] == 2
    tracker.apply({"type": "run", "run": {"id": "newer", "state": "queued"}})
    assert [r["id"] for r in tracker.view["queued"]] == ["q0", "new"] and tracker.view["queued_total"] == 3
    # A head of a longer queue again: a run known running that is queued again (requeued,
    # resumed) is new to the queue: counted, and listed at the end while there is room.
    tracker.apply(
        {"type": "snapshot", "queue": {"queued": head[:1], "queued_total": 4, "running": [{"id": "r"}], "ledger": None}}
    )
    tracker.apply({"type": "run", "run": {"id": "r", "state": "queued"}})
    assert [r["id"] for r in tracker.view["queued"]] == ["q0", "r"] and tracker.view["queued_total"] == 5
    assert tracker.view["running"] == []
    # An older server lists every queued run and does not count them: the list is the count.
    tracker.apply({"type": "snapshot", "queue": {"queued": head, "running": [], "ledger": None}})
    assert tracker.view["queued_total"] == 2


def test_a_queue_trackers_limit_is_one_the_server_accepts():
    assert QueueTracker(queue_limit=-5).queue_limit == 0
    assert QueueTracker(queue_limit=10**6).queue_limit is None  # more rows than the server lists: all
    assert QueueTracker(queue_limit=100_000).queue_limit == 100_000


def test_a_feed_asks_the_stream_for_the_queue_its_tracker_reads():
    for tracker, wanted in ((RunTracker("r1"), 0), (QueueTracker(queue_limit=7), 7), (QueueTracker(), None)):
        server = FakeServer()
        server.socket_works = True
        feed = LiveFeed(server, tracker, poll_s=0.05)
        feed.start()
        try:
            wait_until(lambda: server.streams, timeout=5)
        finally:
            feed.stop()
        assert server.queue_limits[0] == wanted, (tracker, server.queue_limits)


def test_queue_tracker_follows_leases_and_ledger_events():
    views: list[dict] = []
    tracker = QueueTracker(views.append)
    tracker.apply({"type": "snapshot", "queue": {"queued": [], "running": [], "ledger": {"devices": []}}})
    assert tracker.view["leases"] == []
    lease = {"id": "lease-1", "state": "queued", "vram_mb": 1000}
    tracker.apply({"type": "lease", "lease": lease})
    assert tracker.view["leases"] == [lease] and tracker.wants_read(time.monotonic() + 1)
    tracker._want_read, tracker._settle_at = False, None  # as a read would (no server here)
    tracker.apply({"type": "lease", "lease": {**lease, "observed_mb": {"0": 5}}})  # same state: no read
    assert not tracker.wants_read(time.monotonic() + 1)
    tracker.apply({"type": "lease", "lease": {**lease, "state": "ended"}})
    assert tracker.view["leases"] == [] and tracker.wants_read(time.monotonic() + 1)
    ledger = {"devices": [{"index": 0, "unmanaged_mb": 700}]}
    tracker.apply({"type": "ledger", "ledger": ledger})
    tracker.notify()
    assert views[-1]["ledger"] == ledger
