"""A Ctrl-C (a kernel's interrupt) while ``lease()`` sends its request, after the server recorded
it and before the answer reached the caller, leaves no lease on the server: ``lease()`` finds the
one its lost answer named (this process's, with the request's figures, answered to no other
``lease()`` here) and withdraws it. Against a real server subprocess; the interrupt is raised
where the request returns, after the server answered."""

from __future__ import annotations

import os

import pytest

import jupyter_evalsched

try:
    from .live_server import clean_queue, client, live_server
except ImportError:
    from live_server import clean_queue, client, live_server  # noqa: F401


def _interrupted_after_the_post(client, made: list[dict]):
    """``client.request``, with a KeyboardInterrupt once a lease request was recorded (its answer
    kept in ``made`` for the test)."""
    request = client.request

    def interrupted(method, path, **kw):
        answer = request(method, path, **kw)
        if (method, path) == ("POST", "leases"):
            made.append(answer)
            raise KeyboardInterrupt
        return answer

    return interrupted


@pytest.mark.parametrize("queued", [True, False], ids=["queued", "granted"])
def test_an_interrupt_as_the_request_returns_leaves_no_lease(client, clean_queue, cuda_env, monkeypatch, queued):
    blocker = None
    if queued:  # both GPUs held: the request waits
        blocker = jupyter_evalsched.lease(exclusive_gpu=True, gpus=2, label="blocker", client=client)
    # Another lease of this process with the same figures, answered here: it stays.
    kept = None if queued else jupyter_evalsched.lease(1000, label="interrupted", progress=False, client=client)
    made: list[dict] = []
    monkeypatch.setattr(client, "request", _interrupted_after_the_post(client, made))
    with pytest.raises(KeyboardInterrupt):
        jupyter_evalsched.lease(1000, label="interrupted", progress=False, client=client)
    monkeypatch.undo()
    (lost,) = made
    assert lost["state"] == ("queued" if queued else "granted") and lost["pid"] == os.getpid()
    ended = client.request("GET", f"leases/{lost['id']}")
    assert (ended["state"], ended["reason"].split(":")[0]) == ("ended", "released"), ended
    live = client.request("GET", "leases")["leases"]
    assert [x["id"] for x in live] == [x.id for x in (blocker, kept) if x is not None]
    for held in (blocker, kept):
        if held is not None:
            held.release()


def test_a_refused_request_withdraws_nothing(client, clean_queue, cuda_env):
    kept = jupyter_evalsched.lease(1000, label="same", progress=False, client=client)
    with pytest.raises(jupyter_evalsched.client.EvalSchedError, match="422"):
        jupyter_evalsched.lease(-1, label="same", progress=False, client=client)
    assert [x["id"] for x in client.request("GET", "leases")["leases"]] == [kept.id]
    kept.release()
