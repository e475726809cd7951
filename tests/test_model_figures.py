"""A shared model's figures (issue #31): requests, tokens, tokens/s, mean batch size, last use and
its OpenAI endpoint, counted by its real model host (the tiny causal LM, built offline) and shown
by ``GET /evalsched/models`` and the widget."""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime

import pytest

from jupyter_evalsched.client.formatting import format_rate, model_figures
from jupyter_evalsched.shared_models.client import ModelClient
from jupyter_evalsched.shared_models.host import tokens_per_s
from jupyter_evalsched.shared_models.tiny_lm import build_tiny_gpt2
from jupyter_evalsched.widget import models_html


def test_tokens_per_s_is_over_the_window_or_since_the_load():
    samples = [(10.0, 500), (95.0, 100), (100.0, 200)]
    # Loaded long ago: the last 60 s hold the two recent batches.
    assert tokens_per_s(samples, now=100.0, since=0.0, window_s=60.0) == pytest.approx(300 / 60)
    # Loaded 10 s ago: only what came since, over those 10 s.
    assert tokens_per_s(samples, now=100.0, since=90.0, window_s=60.0) == pytest.approx(300 / 10)
    # A first batch right after the load counts over one second at least.
    assert tokens_per_s([(100.0, 50)], now=100.01, since=100.0, window_s=60.0) == pytest.approx(50.0)
    assert tokens_per_s(samples, now=100.0, since=None, window_s=60.0) == 0.0  # never loaded
    assert tokens_per_s([], now=100.0, since=0.0, window_s=60.0) == 0.0


def test_the_widgets_model_lines():
    model = {
        "name": "tiny-lm",
        "state": "loaded",
        "endpoint": "http://127.0.0.1:8888/evalsched/v1",
        "requests": 1,
        "tokens_per_s": 1234.56,
        "mean_batch_size": 2.5,
    }
    assert model_figures(model) == ["1 request", "1235 tok/s", "batch 2.5"]
    assert model_figures({"requests": 10, "tokens_per_s": 8.26, "mean_batch_size": 10.0}) == [
        "10 requests",
        "8.3 tok/s",
        "batch 10",
    ]
    assert format_rate(0) == "0" and format_rate(None) == "0"
    html = models_html([model, {"name": "<b>x</b>", "state": "failed", "error": {"type": "E", "message": "m"}}])
    assert "Shared models (2)" in html
    assert "user-select:all" in html and "http://127.0.0.1:8888/evalsched/v1</code>" in html
    assert "1 request · 1235 tok/s · batch 2.5" in html
    assert "&lt;b&gt;x&lt;/b&gt;" in html and "<b>x</b>" not in html  # names are escaped
    assert "E: m" in html
    assert models_html([]) == ""


@pytest.fixture(scope="session")
def tiny_lm_dir(tmp_path_factory):
    return build_tiny_gpt2(tmp_path_factory.getbasetemp() / "models" / "tiny-gpt2")


@pytest.fixture
def evalsched_config(tiny_lm_dir):
    return {
        "models": [
            {
                "name": "tiny-lm",
                "loader": "jupyter_evalsched.shared_models.loaders:causal_lm",
                "model": tiny_lm_dir,
                "max_batch_size": 64,
                "cpu_threads": 1,
            }
        ]
    }


async def test_the_models_view_counts_requests_tokens_and_batches(api, jp_fetch, jp_http_port, jp_base_url, evalsched):
    code, answer = await api("GET", "models")
    assert code == 200, answer
    (before,) = answer["models"]
    # The server's own loopback address (what its runs get as OPENAI_BASE_URL).
    assert before["endpoint"] in {
        f"http://{host}:{jp_http_port}{jp_base_url}evalsched/v1" for host in ("127.0.0.1", "localhost")
    }, before
    assert before["requests"] == 0 and before["prompt_tokens"] == 0 and before["completion_tokens"] == 0
    assert before["tokens_per_s"] == 0 and before["last_used_at"] is None
    started = datetime.now(UTC)

    async def complete(body: dict) -> dict:
        # The first request loads the model: on a busy machine that takes more than jp_fetch's 20 s.
        body = {"model": "tiny-lm", **body}
        resp = await jp_fetch(
            "evalsched", "v1", "completions", method="POST", body=json.dumps(body), request_timeout=120
        )
        return json.loads(resp.body)

    # Four API requests at once (they share batches), one of them with two prompts.
    bodies = [
        {"prompt": "The cat sat", "max_tokens": 3, "temperature": 0},
        {"prompt": ["A dog", "Stocks fell"], "max_tokens": 2, "temperature": 0},
        {"prompt": "The chef cooked pasta", "max_tokens": 0, "echo": True, "logprobs": 0},
        {"prompt": "The cat", "max_tokens": 4, "temperature": 0},
    ]
    answers = await asyncio.gather(*(complete(body) for body in bodies))
    prompt = sum(a["usage"]["prompt_tokens"] for a in answers)
    completion = sum(a["usage"]["completion_tokens"] for a in answers)
    assert prompt > 0 and completion > 0

    # And a plain call, as ctx.model(name) makes it: the same greedy completion as the last body.
    code, connection = await api("POST", "models/tiny-lm/connect")
    assert code == 200, connection
    with ModelClient(connection["url"]) as model:
        (text,) = await asyncio.to_thread(model, ["The cat"], max_tokens=4)
    assert text == answers[-1]["choices"][0]["text"]
    prompt += answers[-1]["usage"]["prompt_tokens"]
    completion += answers[-1]["usage"]["completion_tokens"]

    code, answer = await api("GET", "models")
    (after,) = answer["models"]
    assert after["requests"] == 5  # four API requests and the plain call
    assert after["prompt_tokens"] == prompt and after["completion_tokens"] == completion
    assert after["mean_batch_size"] == pytest.approx(after["inputs"] / after["batches"], abs=1e-3)
    assert after["inputs"] == 6  # five prompts through the API, one plain input
    # Every token was served since the load, less than a minute ago and over one second at least.
    assert 0 < after["tokens_per_s"] <= prompt + completion
    assert 0 < after["tokens_per_s_since_load"] <= prompt + completion
    used = datetime.fromisoformat(after["last_used_at"])
    assert started <= used <= datetime.now(UTC)
    assert after["endpoint"] == before["endpoint"] and after["state"] == "loaded"


async def test_the_demos_openai_run_with_the_client_and_without(api, jp_serverapp, monkeypatch, caplog):
    """``examples.shared:openai_completion`` (the demo's run that uses the model) answers the same
    through the ``openai`` client and, when that is not installed, through plain HTTP, saying so."""
    import logging
    import sys
    from types import SimpleNamespace

    from jupyter_evalsched.examples.shared import openai_completion

    code, answer = await api("GET", "models")
    monkeypatch.setenv("OPENAI_BASE_URL", answer["models"][0]["endpoint"])
    monkeypatch.setenv("OPENAI_API_KEY", jp_serverapp.identity_provider.token)
    ctx = SimpleNamespace(params={"model": "tiny-lm", "max_tokens": 3}, log=logging.getLogger("demo-run"))
    with_client = await asyncio.to_thread(openai_completion, ctx, 1)
    assert with_client["openai_client"] == 1.0 and with_client["prompt_tokens"] > 0
    monkeypatch.setitem(sys.modules, "openai", None)  # `import openai` raises ImportError
    with caplog.at_level(logging.WARNING, logger="demo-run"):
        without = await asyncio.to_thread(openai_completion, ctx, 1)
    assert without == {**with_client, "openai_client": 0.0}
    assert "the openai package is not installed" in caplog.text


@pytest.mark.slow  # heavy (a model host or a killed server); CI runs it with -m slow
def test_the_widget_follows_the_models_figures(tiny_lm_dir):
    """A live QueueWidget re-reads the models' figures by itself: a request made elsewhere shows
    in its model line within seconds."""
    import openai
    from waiting import wait_until

    from jupyter_evalsched.client.local_server import LocalServer
    from jupyter_evalsched.widget import QueueWidget

    declaration = {"name": "tiny-lm", "loader": "jupyter_evalsched.shared_models.loaders:causal_lm"}
    with LocalServer(models=[{**declaration, "model": tiny_lm_dir, "cpu_threads": 1}]) as server:
        widget = QueueWidget(server.client(), poll_s=0.3)
        try:
            line = wait_until(lambda: "tiny-lm" in widget._models_box.value and widget._models_box.value, timeout=10)
            assert "0 requests" in line and f"{server.url}evalsched/v1</code>" in line, line
            assert widget._models_box.layout.display != "none"
            api = openai.OpenAI(base_url=f"{server.url}evalsched/v1", api_key=server.token, max_retries=0, timeout=120)
            api.completions.create(model="tiny-lm", prompt="The cat", max_tokens=2, temperature=0)
            wait_until(lambda: "1 request ·" in widget._models_box.value, timeout=10, message=widget._models_box.value)
        finally:
            widget.close()
