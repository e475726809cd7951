"""``lease()`` whose request's answer was lost withdraws the lease that request made, and only
that one: not another thread's request with the same figures that the server recorded and whose
answer is still on its way; also when the server recorded the label stripped, or when a proxy in
front of the server answered the request 5xx after the server took it. Against a real server
subprocess; the threads are ordered by events, not by time."""

from __future__ import annotations

import threading

import pytest

import jupyter_evalsched
from jupyter_evalsched.client import lease as lease_module
from jupyter_evalsched.client.errors import EvalSchedError, ServerNotFound

try:
    from .live_server import clean_queue, client, live_server
except ImportError:
    from live_server import clean_queue, client, live_server  # noqa: F401


def _live_ids(client) -> list[str]:
    return [x["id"] for x in client.request("GET", "leases")["leases"]]


def _lost_after_the_post(client, made: list[dict], error: BaseException):
    """``client.request``, raising ``error`` once a lease request was recorded (its answer kept in
    ``made`` for the test)."""
    request = client.request

    def lost(method, path, **kw):
        answer = request(method, path, **kw)
        if (method, path) == ("POST", "leases"):
            made.append(answer)
            raise error
        return answer

    return lost


def _ended(client, lease_id: str) -> bool:
    return client.request("GET", f"leases/{lease_id}")["state"] == "ended"


def _proxy_timeout() -> EvalSchedError:
    return EvalSchedError(504, "Gateway Timeout")


@pytest.mark.parametrize(
    ("label", "error"),
    [("  padded label  ", KeyboardInterrupt()), ("behind a proxy", _proxy_timeout())],
    ids=["label-stripped-by-the-server", "proxy-504"],
)
def test_the_lost_answers_lease_is_withdrawn(client, clean_queue, cuda_env, monkeypatch, label, error):
    made: list[dict] = []
    monkeypatch.setattr(client, "request", _lost_after_the_post(client, made, error))
    with pytest.raises(type(error)):
        jupyter_evalsched.lease(1000, label=label, progress=False, client=client)
    monkeypatch.undo()
    (lost,) = made
    assert _ended(client, lost["id"]), client.request("GET", f"leases/{lost['id']}")
    assert _live_ids(client) == []


class _LockSeen:
    """``lease_module._requesting`` as it is, saying when the named thread asks for it."""

    def __init__(self, lock, thread_name: str, seen: threading.Event):
        self.lock, self.thread_name, self.seen = lock, thread_name, seen

    def __enter__(self):
        if threading.current_thread().name == self.thread_name:
            self.seen.set()
        return self.lock.__enter__()

    def __exit__(self, *exc):
        return self.lock.__exit__(*exc)


def test_another_threads_lease_in_flight_is_not_taken_for_the_lost_one(client, clean_queue, cuda_env, monkeypatch):
    # Thread "answered": its request is recorded, and its answer held back until the test lets
    # it through. Thread "lost": same figures, its answer lost (a dropped connection).
    answered_posted, let_answer_through, lost_at_lock_or_done = threading.Event(), threading.Event(), threading.Event()
    request = client.request
    made: dict[str, dict] = {}

    def per_thread(method, path, **kw):
        answer = request(method, path, **kw)
        if (method, path) != ("POST", "leases"):
            return answer
        name = threading.current_thread().name
        made[name] = answer
        if name == "answered":
            answered_posted.set()
            assert let_answer_through.wait(120)
            return answer
        dropped = ServerNotFound("cannot reach the server: connection reset")
        dropped.maybe_received = True
        raise dropped

    monkeypatch.setattr(client, "request", per_thread)
    real_lock = getattr(lease_module, "_requesting", None)
    if real_lock is not None:  # (the code before the fix had none: the thread then runs to its end)
        monkeypatch.setattr(lease_module, "_requesting", _LockSeen(real_lock, "lost", lost_at_lock_or_done))
    results: dict[str, object] = {}

    def run(name: str) -> None:
        try:
            results[name] = jupyter_evalsched.lease(
                1000, label="same", progress=False, set_cuda_visible_devices=False, client=client
            )
        except BaseException as exc:
            results[name] = exc
        finally:
            if name == "lost":
                lost_at_lock_or_done.set()

    answered = threading.Thread(target=run, args=("answered",), name="answered")
    answered.start()
    assert answered_posted.wait(120)
    lost = threading.Thread(target=run, args=("lost",), name="lost")
    lost.start()
    assert lost_at_lock_or_done.wait(120)  # at the lock (waits for the other request), or through
    let_answer_through.set()
    answered.join(120)
    lost.join(120)
    monkeypatch.undo()

    held = results["answered"]
    assert isinstance(held, lease_module.Lease), held
    assert isinstance(results["lost"], ServerNotFound), results["lost"]
    assert not _ended(client, held.id), "the other thread's lease was withdrawn"
    assert _ended(client, made["lost"]["id"])
    assert _live_ids(client) == [held.id]
    held.release()
