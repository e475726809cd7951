"""The model host's batching of API requests (``openai`` op): a real host process serving the
tiny causal LM, driven through ``ModelHostManager.ask`` as the server's routes drive it.

Each API request comes on a connection of its own, so the host cannot count connections to know
whether more requests are coming; it waits (up to ``max_wait_ms``) for an API client it answered
recently that has nothing outstanding, and never for a client that is the only one."""

from __future__ import annotations

import asyncio

import pytest
import pytest_asyncio
from waiting import async_wait_until

from jupyter_evalsched.shared_models.host import api_waiting
from jupyter_evalsched.shared_models.manager import ModelHostManager
from jupyter_evalsched.shared_models.tiny_lm import build_tiny_gpt2

SCORE = {"prompt": "The cat sat on the mat.", "echo": True, "max_tokens": 0, "logprobs": 1}


def test_api_waiting_expects_recent_idle_clients_only():
    busy = {"a": 1}
    answered = {"a": 9.9, "b": 9.9, "c": 5.0}
    # b was answered 0.1 s ago and has nothing outstanding: expected back.
    assert api_waiting(busy, answered, now=10.0, recent_s=0.2)
    assert "c" not in answered  # forgotten: answered too long ago
    # a has a request outstanding: nothing to wait for once b is gone too.
    assert not api_waiting(busy, {"a": 9.9}, now=10.0, recent_s=0.2)
    assert not api_waiting({}, {"b": 9.0}, now=10.0, recent_s=0.2)
    assert not api_waiting({}, {"b": 10.0}, now=10.0, recent_s=0.0)  # max_wait_ms 0: never waits


@pytest.fixture(scope="module")
def lm_dir(tmp_path_factory) -> str:
    return build_tiny_gpt2(tmp_path_factory.mktemp("models") / "tiny-gpt2")


@pytest_asyncio.fixture
async def manager(tmp_path, lm_dir):
    # A host of each test's own: which clients it answered is the host's state. A long
    # max_wait_ms: a batch held for a client is held until that client sends (or 10 s), so what
    # the test sees does not depend on how fast this machine is. Loaded by a plain call, which
    # is no API client.
    host_manager = ModelHostManager(
        [
            {
                "name": "lm",
                "loader": "jupyter_evalsched.shared_models.loaders:causal_lm",
                "model": lm_dir,
                "max_wait_ms": 10_000,
                "cpu_threads": 1,
            }
        ],
        socket_parent=str(tmp_path),
    )
    await host_manager.start()
    reply = await host_manager.ask("lm", {"op": "call", "inputs": ["The cat"], "kwargs": {"max_tokens": 1}})
    assert reply["ok"], reply
    yield host_manager
    await host_manager.stop()


async def score(manager: ModelHostManager, client: str, prompt: str = SCORE["prompt"]) -> dict:
    reply = await manager.ask("lm", {"op": "openai", "requests": [{**SCORE, "prompt": prompt}], "client": client})
    assert reply["ok"], reply
    return reply["outputs"][0]


async def host_figures(manager: ModelHostManager) -> dict:
    reply = await manager.ask("lm", {"op": "describe"})
    return reply["describe"]


@pytest.mark.asyncio
async def test_a_lone_client_is_never_held(manager):
    # Its own last answer is recent, but it is the one sending: no batch waits for it.
    for _ in range(3):
        await asyncio.wait_for(score(manager, "alone"), 5)  # far below the 10 s a held batch would take
    figures = await host_figures(manager)
    assert figures["batch_sizes"] == {"1": 4} and figures["requests"] == 4, figures


@pytest.mark.asyncio
async def test_a_batch_waits_for_a_client_answered_just_before(manager):
    await score(manager, "a")  # a is answered: for 400 s (40 x max_wait_ms) it is expected back
    before = (await host_figures(manager))["batch_sizes"]
    b = asyncio.create_task(score(manager, "b", "A dog"))
    await async_wait_until(lambda: _queued(manager), timeout=10, message="b queued")
    assert not b.done()  # held for a, which has nothing outstanding
    a = await asyncio.wait_for(score(manager, "a"), 10)
    answered_b = await asyncio.wait_for(b, 10)
    assert a["prompt_tokens"] > 0 and answered_b["prompt_text"] == "A dog"
    after = (await host_figures(manager))["batch_sizes"]
    assert after.get("2", 0) == before.get("2", 0) + 1, (before, after)  # one forward pass for both


async def _queued(manager: ModelHostManager) -> bool:
    return (await host_figures(manager))["queued"] >= 1
