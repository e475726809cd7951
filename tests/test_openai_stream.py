"""Streams that are sent as the model host generates, clients that go away mid-stream, and the
response cache, through a real server and model host with the tiny GPT-2. What happens between
two tokens is observed by events, not by timing: the ``gated`` model holds its n-th forward pass
while ``<gate>/hold-<n>`` exists, and logs every pass in ``<gate>/calls``."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import stat
import threading
import time

import openai
import pytest
import transformers
from raw_http import post_request, send

from jupyter_evalsched.openai_cache import CACHE_DIR, ResponseCache
from jupyter_evalsched.shared_models.tiny_lm import build_tiny_gpt2

CAUSAL = "jupyter_evalsched.shared_models.loaders:causal_lm"


@pytest.fixture(scope="session")
def tiny_lm_dir(tmp_path_factory):
    return build_tiny_gpt2(tmp_path_factory.getbasetemp() / "models" / "tiny-gpt2")


@pytest.fixture(scope="session")
def reference(tiny_lm_dir):
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_lm_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_lm_dir).eval()
    return model, tokenizer


def direct_greedy(reference, text: str, max_tokens: int) -> str:
    model, tokenizer = reference
    encoded = tokenizer(text, return_tensors="pt", add_special_tokens=False)
    out = model.generate(**encoded, max_new_tokens=max_tokens, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    return tokenizer.decode(out[0, encoded["input_ids"].shape[1] :], skip_special_tokens=True)


@pytest.fixture
def gate(tmp_path):
    path = tmp_path / "gate"
    path.mkdir()
    return path


@pytest.fixture
def vector_gate(tmp_path):
    """The gate of the ``vectors`` model (testing:gated_vectors): ``hold-<n>`` holds its n-th batch."""
    path = tmp_path / "vector-gate"
    path.mkdir()
    return path


@pytest.fixture
def model_copy(tiny_lm_dir, tmp_path):
    """A copy of the model this test may change (for the cache's key)."""
    return shutil.copytree(tiny_lm_dir, tmp_path / "lm")


@pytest.fixture
def evalsched_config(tiny_lm_dir, gate, vector_gate, model_copy):
    return {
        "models": [
            {
                "name": "gated",
                "loader": "jupyter_evalsched.shared_models.testing:gated_causal_lm",
                "model": tiny_lm_dir,
                "options": {"gate": str(gate)},
                "preload": True,  # loaded before a test holds it: no request waits for the load
                "max_batch_size": 8,
                "cpu_threads": 1,
            },
            {"name": "cached", "loader": CAUSAL, "model": str(model_copy), "cpu_threads": 1},
            {
                "name": "vectors",
                "loader": "jupyter_evalsched.shared_models.testing:gated_vectors",
                "options": {"gate": str(vector_gate)},
            },
        ],
        "openai_cache_mb": 1,
    }


@pytest.fixture
def v1(jp_fetch, evalsched):
    """``await v1("completions", body)`` -> (status, body, headers)."""

    async def call(path: str, body, method: str = "POST"):
        kwargs: dict = {"method": method, "raise_error": False, "request_timeout": 300}
        if body is not None:
            kwargs["body"] = body if isinstance(body, (str, bytes)) else json.dumps(body)
        resp = await jp_fetch("evalsched", "v1", *path.split("/"), **kwargs)
        text = resp.body.decode() if resp.body else ""
        parsed = text if text.startswith("data:") or not text else json.loads(text)
        return resp.code, parsed, resp.headers

    return call


@pytest.fixture
def client(jp_serverapp, jp_http_port, jp_base_url, jp_fetch, evalsched):
    return openai.OpenAI(
        base_url=f"http://127.0.0.1:{jp_http_port}{jp_base_url}evalsched/v1",
        api_key=jp_serverapp.identity_provider.token,
        max_retries=0,
        timeout=120,
    )


async def figures(evalsched, name: str) -> dict:
    """The host's own figures (its ``describe``), asked over its socket."""
    reply = await evalsched.models.ask(name, {"op": "describe"})
    return reply["describe"]


async def until(predicate, what: str, timeout: float = 30.0):
    """Liveness only: ``await predicate()`` until it is true, failing after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        value = await predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"never happened: {what}"
        await asyncio.sleep(0.02)


def passes(gate) -> int:
    calls = gate / "calls"
    return len(calls.read_text().split()) if calls.exists() else 0


def events(data: str) -> list:
    """The ``data:`` events of a stream, parsed (``[DONE]`` as is)."""
    out = []
    for line in data.split("\n\n"):
        if line.startswith("data: "):
            payload = line[len("data: ") :]
            out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


async def loaded(evalsched, name: str = "gated") -> None:
    await until(lambda: _figure(evalsched, "state", "loaded", name), f"{name} is loaded", timeout=300)


@pytest.mark.slow  # a model host and a real server: CI runs it with -m slow (docs/install.md: the default suite stays within ten minutes)
async def test_a_stream_is_sent_while_the_host_still_generates(client, evalsched, gate, reference):
    """The openai client's iterator gets the first token while the model is held before its
    second forward pass: that token is the only one that exists. The rest follows once released,
    and the chunks add up to the greedy text."""
    await loaded(evalsched)
    (gate / "hold-2").touch()
    stream = await asyncio.to_thread(
        client.completions.create, model="gated", prompt="The cat", max_tokens=40, temperature=0, stream=True
    )
    chunks = iter(stream)
    first = await asyncio.to_thread(next, chunks)
    assert first.choices[0].text and first.choices[0].finish_reason is None
    assert passes(gate) == 1  # one forward pass, one token: the second is not computed yet
    assert (await figures(evalsched, "gated"))["requests"] == 0  # the request is not answered yet
    (gate / "hold-2").unlink()
    rest = await asyncio.to_thread(list, chunks)
    assert rest[-1].choices[0].finish_reason == "length" and rest[-1].choices[0].text == ""
    text = first.choices[0].text + "".join(chunk.choices[0].text for chunk in rest)
    assert text == direct_greedy(reference, "The cat", 40)
    assert len(rest) == 40  # one chunk per token, then the finish
    assert passes(gate) == 40

    # Chat, with the usage chunk OpenAI sends when asked: after the finish, with no choices.
    messages = [{"role": "user", "content": "Where did the cat sit?"}]
    done = await asyncio.to_thread(
        client.chat.completions.create, model="gated", messages=messages, max_tokens=9, temperature=0
    )

    def chat_stream() -> list:
        return list(
            client.chat.completions.create(
                model="gated",
                messages=messages,
                max_tokens=9,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
        )

    chunks = await asyncio.to_thread(chat_stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == done.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == done.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == done.usage.total_tokens
    assert all(c.usage is None for c in chunks[:-1])


@pytest.mark.slow  # a model host and a real server: CI runs it with -m slow (docs/install.md: the default suite stays within ten minutes)
async def test_a_client_gone_mid_stream_frees_its_slot_and_the_batch_goes_on(
    v1, evalsched, gate, reference, jp_serverapp, jp_http_port, jp_base_url
):
    """A stream and another request share a batch; the stream's client disconnects after its
    first token: its row stops generating (it asked for 200 tokens), the other request is
    answered in full, and nothing is left queued or failed."""
    token = jp_serverapp.identity_provider.token
    body = json.dumps({"model": "gated", "prompt": "The cat", "max_tokens": 200, "temperature": 0, "stream": True})
    request = post_request(jp_base_url, "evalsched/v1/completions", token, body)
    await loaded(evalsched)
    (gate / "hold-1").touch()  # the first batch (one token for "x") holds the batcher...
    (gate / "hold-3").touch()  # ...and the shared batch stops after its first token
    first = asyncio.ensure_future(v1("completions", {"model": "gated", "prompt": "x", "max_tokens": 1}))
    await until(lambda: _batches(evalsched, 1), "the first batch runs")
    reader, writer = await send(jp_http_port, request)
    other = asyncio.ensure_future(
        v1("completions", {"model": "gated", "prompt": "A dog", "max_tokens": 12, "temperature": 0})
    )
    await until(lambda: _queued(evalsched, 2), "both requests are queued")
    (gate / "hold-1").unlink()
    head = await asyncio.wait_for(reader.readuntil(b"data: "), 60)
    assert b"200 OK" in head and b"text/event-stream" in head
    chunk = json.loads((await asyncio.wait_for(reader.readuntil(b"\n\n"), 60)).decode())
    assert chunk["choices"][0]["text"]  # its first token
    writer.transport.abort()  # gone, mid-stream
    await until(lambda: _figure(evalsched, "cancelled_requests", 1), "the host sees the client gone", timeout=10)
    (gate / "hold-3").unlink()

    code, answer, _ = await other
    assert code == 200 and answer["choices"][0]["text"] == direct_greedy(reference, "A dog", 12)
    assert (await first)[0] == 200
    described = await figures(evalsched, "gated")
    assert described["batch_sizes"].get("2") == 1  # the stream and the other shared a batch
    # 1 pass for "x", 12 for "A dog" (the stream's rows were computed along, then dropped): had the
    # stream gone on, its 200 tokens would have taken 200 passes.
    assert passes(gate) == 13
    assert described["failed_requests"] == 0 and described["queued"] == 0
    assert described["requests"] == 2 and described["cancelled_requests"] == 1
    # (Greedy: sampled, the first token could be the end of text, one answer in a few hundred.)
    code, answer, _ = await v1(
        "completions", {"model": "gated", "prompt": "The cat", "max_tokens": 3, "temperature": 0}
    )
    assert code == 200 and answer["usage"]["completion_tokens"] == 3


@pytest.mark.slow  # a model host and a real server: CI runs it with -m slow (docs/install.md: the default suite stays within ten minutes)
async def test_a_batch_that_fails_midway_answers_each_request_once(v1, evalsched, gate, reference):
    """Three requests share a batch that fails at a forward pass (a model's error, as a GPU's
    out-of-memory is) after one of the first request's two prompts had stopped and after the
    stream had sent its first tokens. Each request is then run again alone, for what it still
    lacks: the first is answered as it is alone (its stopped prompt counted once), the third in
    full, and the stream, whose client has its first tokens already, ends with an error event
    rather than send them again."""
    stop = direct_greedy(reference, "The cat", 2)
    assert stop and stop not in direct_greedy(reference, "A dog", 12)  # (only "The cat" stops early)
    two = {"model": "gated", "prompt": ["The cat", "A dog"], "max_tokens": 12, "temperature": 0, "stop": [stop]}
    streamed = {"model": "gated", "prompt": "A bird", "max_tokens": 12, "temperature": 0, "stream": True}
    plain = {"model": "gated", "prompt": "Stocks fell", "max_tokens": 12, "temperature": 0}
    await loaded(evalsched)
    (gate / "hold-1").touch()  # the first batch (one token for "x") holds the batcher
    first = asyncio.ensure_future(v1("completions", {"model": "gated", "prompt": "x", "max_tokens": 1}))
    await until(lambda: _batches(evalsched, 1), "the first batch runs")
    pending = [asyncio.ensure_future(v1("completions", body)) for body in (two, streamed, plain)]
    await until(lambda: _queued(evalsched, 4), "the three requests (four prompts) are queued")
    (gate / "fail-5").touch()  # the shared batch's passes are 2 (its first token) to 13: its fourth fails
    (gate / "hold-1").unlink()
    (code_two, answer_two, _), (code_streamed, stream_text, _), (code_plain, answer_plain, _) = [
        await answer for answer in pending
    ]
    assert (await first)[0] == 200
    assert not (gate / "fail-5").exists()  # (the failure happened)
    described = await figures(evalsched, "gated")
    assert described["batch_sizes"].get("4") == 1, described["batch_sizes"]  # the three shared a batch

    assert code_two == 200, answer_two
    code, alone, _ = await v1("completions", two)
    assert code == 200
    assert [(c["text"], c["finish_reason"]) for c in answer_two["choices"]] == [
        (c["text"], c["finish_reason"]) for c in alone["choices"]
    ]
    assert answer_two["usage"] == alone["usage"]  # (the stopped prompt's tokens counted once)
    assert answer_two["choices"][0]["finish_reason"] == "stop"
    assert answer_two["choices"][1]["text"] == direct_greedy(reference, "A dog", 12)
    assert code_plain == 200 and answer_plain["choices"][0]["text"] == direct_greedy(reference, "Stocks fell", 12)

    assert code_streamed == 200  # (the status went with the first chunk)
    sent = events(stream_text)
    assert sent[-1] != "[DONE]" and sent[-1]["error"]["type"] == "server_error", sent[-1]
    assert "the batch it shared with other requests failed" in sent[-1]["error"]["message"]
    assert "forward pass 5" not in sent[-1]["error"]["message"]  # (the other requests' trouble: not told)
    text = "".join(chunk["choices"][0]["text"] for chunk in sent[:-1])
    assert text and direct_greedy(reference, "A bird", 12).startswith(text)  # each token once, in order
    assert described["failed_requests"] == 1 and described["queued"] == 0


@pytest.mark.slow  # a model host and a real server: CI runs it with -m slow (docs/install.md: the default suite stays within ten minutes)
async def test_a_batch_that_fails_at_its_first_pass_runs_each_request_again(v1, evalsched, gate, reference):
    """A stream and a plain request share a batch that fails at its first forward pass, before
    any token: the stream's client has been sent no token (the host made its head, which a
    client is sent once however often it is made), so both are run again alone and answered in
    full."""
    await loaded(evalsched)
    (gate / "hold-1").touch()  # the first batch (one token for "x") holds the batcher
    first = asyncio.ensure_future(v1("completions", {"model": "gated", "prompt": "x", "max_tokens": 1}))
    await until(lambda: _batches(evalsched, 1), "the first batch runs")
    streamed = {"model": "gated", "prompt": "A bird", "max_tokens": 6, "temperature": 0, "stream": True}
    plain = {"model": "gated", "prompt": "Stocks fell", "max_tokens": 6, "temperature": 0}
    pending = [asyncio.ensure_future(v1("completions", body)) for body in (streamed, plain)]
    await until(lambda: _queued(evalsched, 2), "both requests are queued")
    (gate / "fail-2").touch()  # the shared batch's first pass
    (gate / "hold-1").unlink()
    (code_streamed, stream_text, _), (code_plain, answer_plain, _) = [await answer for answer in pending]
    assert (await first)[0] == 200
    assert not (gate / "fail-2").exists()  # (the failure happened)
    sent = events(stream_text)
    assert code_streamed == 200 and sent[-1] == "[DONE]", sent[-2:]
    assert "".join(chunk["choices"][0]["text"] for chunk in sent[:-1]) == direct_greedy(reference, "A bird", 6)
    assert code_plain == 200 and answer_plain["choices"][0]["text"] == direct_greedy(reference, "Stocks fell", 6)
    described = await figures(evalsched, "gated")
    assert described["batch_sizes"].get("2") == 1 and described["failed_requests"] == 0, described


@pytest.mark.slow  # a model host and a real server: CI runs it with -m slow (docs/install.md: the default suite stays within ten minutes)
async def test_a_client_gone_before_its_request_reached_the_host_sends_it_nowhere(
    v1, evalsched, jp_serverapp, jp_http_port, jp_base_url, monkeypatch
):  # (v1: jp_fetch, with which the server listens)
    """A client disconnects while its (large) body is still parsed, in a thread: its request
    never reaches the model host, which would generate its 200 tokens for nobody."""
    from jupyter_evalsched import openai_api

    parsing, release, gone, handled = (threading.Event() for _ in range(4))
    parse = openai_api.parse_completion

    def held_parse(body):
        parsing.set()
        release.wait(60)
        return parse(body)

    close, post = openai_api.OpenAIHandler.on_connection_close, openai_api.CompletionsHandler.post

    def noticed_close(handler):
        close(handler)
        gone.set()

    async def observed_post(handler):
        try:
            await post(handler)
        finally:
            handled.set()

    asked = []
    ask = evalsched.models.ask

    async def recorded_ask(name, message, on_delta=None):
        if message.get("op") != "describe":  # (this test's own look at the host's figures)
            asked.append(message.get("op"))
        return await ask(name, message, on_delta)

    monkeypatch.setattr(openai_api, "parse_completion", held_parse)
    monkeypatch.setattr(openai_api.OpenAIHandler, "on_connection_close", noticed_close)
    monkeypatch.setattr(openai_api.CompletionsHandler, "post", observed_post)
    monkeypatch.setattr(evalsched.models, "ask", recorded_ask)
    await loaded(evalsched)
    body = json.dumps({"model": "gated", "prompt": "The cat", "max_tokens": 200, "temperature": 0})
    body += " " * openai_api.PARSE_ON_LOOP_BELOW  # (parsed in a thread)
    token = jp_serverapp.identity_provider.token
    _, writer = await send(jp_http_port, post_request(jp_base_url, "evalsched/v1/completions", token, body))
    await until(lambda: asyncio.to_thread(parsing.wait, 0.1), "the body is being parsed")
    writer.transport.abort()
    await until(lambda: asyncio.to_thread(gone.wait, 0.1), "the server sees the client gone")
    release.set()
    await until(lambda: asyncio.to_thread(handled.wait, 0.1), "the request is handled")
    assert asked == []
    assert (await figures(evalsched, "gated"))["requests"] == 0


@pytest.mark.slow  # a model host and a real server: CI runs it with -m slow (docs/install.md: the default suite stays within ten minutes)
async def test_an_embeddings_client_gone_while_queued_is_never_computed(
    v1, evalsched, vector_gate, jp_serverapp, jp_http_port, jp_base_url
):
    """An embeddings request waits in the model host's queue behind a held batch; its client
    disconnects: the host cancels it, and its input is never computed (the host used to compute
    it, for nobody, since a ``call`` did not watch its connection as an ``openai`` request does)."""
    (vector_gate / "hold-1").touch()  # the first batch holds the batcher
    first = asyncio.ensure_future(v1("embeddings", {"model": "vectors", "input": "first"}))
    await until(lambda: _batches(evalsched, 1, "vectors"), "the first batch runs", timeout=120)
    body = json.dumps({"model": "vectors", "input": ["never computed"]})
    token = jp_serverapp.identity_provider.token
    _, writer = await send(jp_http_port, post_request(jp_base_url, "evalsched/v1/embeddings", token, body))
    await until(lambda: _queued(evalsched, 1, "vectors"), "the request is queued")
    writer.transport.abort()
    await until(lambda: _figure(evalsched, "cancelled_requests", 1, "vectors"), "the host sees the client gone")
    (vector_gate / "hold-1").unlink()
    code, answer, _ = await first
    assert code == 200 and answer["data"][0]["embedding"] == [5.0, 1.0], answer
    code, answer, _ = await v1("embeddings", {"model": "vectors", "input": "after"})  # (the host goes on)
    assert code == 200 and answer["data"][0]["embedding"] == [5.0, 2.0], answer
    assert (vector_gate / "inputs").read_text().split("\n") == ["first", "after", ""]
    described = await figures(evalsched, "vectors")
    assert (described["requests"], described["cancelled_requests"], described["failed_requests"]) == (2, 1, 0)
    assert described["queued"] == 0 and described["batches"] == 2, described


@pytest.mark.slow  # a model host and a real server: CI runs it with -m slow (docs/install.md: the default suite stays within ten minutes)
async def test_an_embedding_that_is_no_number_is_the_models_failure_not_invalid_json(jp_fetch, evalsched):
    """A vector holding NaN (a float16 overflow) is a 502 naming the input, in valid JSON (it was
    written as ``NaN``, which OpenAI's clients cannot parse); the other inputs' requests go on."""
    body = json.dumps({"model": "vectors", "input": ["fine", "overflow"]})
    resp = await jp_fetch("evalsched", "v1", "embeddings", method="POST", body=body, raise_error=False)
    answer = json.loads(resp.body, parse_constant=lambda name: pytest.fail(f"{name} in the answer"))
    assert resp.code == 502 and answer["error"]["code"] == "model_error", answer
    assert "its embedding of input 1 holds a value that is no finite number" in answer["error"]["message"]
    resp = await jp_fetch(
        "evalsched", "v1", "embeddings", method="POST", body=json.dumps({"model": "vectors", "input": "fine"})
    )
    assert json.loads(resp.body)["data"][0]["embedding"] == [4.0, 2.0]


@pytest.mark.slow  # a model host and a real server: CI runs it with -m slow (docs/install.md: the default suite stays within ten minutes)
async def test_a_causal_model_asked_for_embeddings_is_refused_before_it_generates(v1, evalsched, gate):
    """Embeddings from a causal language model are a 400 naming ``model``, answered before a
    forward pass: loaded (refused at once) or not yet (refused once loaded, before its batch
    runs). Its plain call used to generate 16 tokens per input first, only for the text to be
    refused as no vectors."""
    body = {"input": ["The cat", "A dog"]}
    code, answer, _ = await v1("embeddings", {**body, "model": "cached"})  # (not loaded yet)
    assert code == 400 and answer["error"]["param"] == "model", answer
    described = await figures(evalsched, "cached")
    ran = {key: described[key] for key in ("state", "batches", "completion_tokens", "requests")}
    assert ran == {"state": "loaded", "batches": 0, "completion_tokens": 0, "requests": 0}, ran
    assert described["failed_requests"] == 0 and described["queued"] == 0  # (a refusal: no model failure)
    assert "does not produce embeddings: it generates text" in answer["error"]["message"], answer
    await loaded(evalsched)
    before = passes(gate)
    code, answer, _ = await v1("embeddings", {**body, "model": "gated"})
    assert code == 400 and answer["error"]["param"] == "model", answer
    assert passes(gate) == before  # not one forward pass
    described = await figures(evalsched, "gated")
    assert described["batches"] == 0 and described["completion_tokens"] == 0, described
    # ... and the same model still answers a completion (and a plain call generates, as it did).
    code, answer, _ = await v1(
        "completions", {"model": "gated", "prompt": "The cat", "max_tokens": 2, "temperature": 0}
    )
    assert code == 200 and answer["usage"]["completion_tokens"] == 2, answer
    reply = await evalsched.models.ask("gated", {"op": "call", "inputs": ["The cat"], "kwargs": {"max_tokens": 2}})
    assert reply["ok"] and isinstance(reply["outputs"][0], str), reply


async def _figure(evalsched, key: str, value, name: str = "gated") -> bool:
    return (await figures(evalsched, name))[key] == value


async def _batches(evalsched, count: int, name: str = "gated") -> bool:
    return (await figures(evalsched, name))["batches"] >= count


async def _queued(evalsched, count: int, name: str = "gated") -> bool:
    return (await figures(evalsched, name))["queued"] == count


@pytest.mark.slow  # a model host and a real server: CI runs it with -m slow (docs/install.md: the default suite stays within ten minutes)
async def test_deterministic_requests_are_answered_from_the_cache(v1, evalsched, model_copy, runs_dir, monkeypatch):
    from jupyter_evalsched import openai_api

    digest, walked_on_loop = openai_api.model_digest, []

    def recorded_digest(path):  # a walk of the model's directory: never on the loop (this test's)
        walked_on_loop.append(threading.current_thread() is threading.main_thread())
        return digest(path)

    monkeypatch.setattr(openai_api, "model_digest", recorded_digest)
    greedy = {"model": "cached", "prompt": "The cat", "max_tokens": 8, "temperature": 0}
    code, answer, headers = await v1("completions", greedy)
    assert code == 200 and headers["X-Evalsched-Cache"] == "miss"
    assert (await figures(evalsched, "cached"))["requests"] == 1
    code, again, headers = await v1("completions", {**greedy, "n": 1, "user": "someone"})  # same request
    assert code == 200 and headers["X-Evalsched-Cache"] == "hit"
    assert again["choices"] == answer["choices"] and again["usage"] == answer["usage"]
    assert (await figures(evalsched, "cached"))["requests"] == 1  # the model host never saw it

    # A stream of a cached answer streams too, the same text.
    code, text, headers = await v1("completions", {**greedy, "stream": True})
    assert code == 200 and headers["X-Evalsched-Cache"] == "hit"
    assert headers["Content-Type"].startswith("text/event-stream")
    chunks = events(text)
    assert chunks[-1] == "[DONE]"
    assert "".join(c["choices"][0]["text"] for c in chunks[:-1]) == answer["choices"][0]["text"]
    assert len(chunks) == 8 + 2  # one per token, the finish, [DONE]

    # Scoring (what lm-eval sends to resume): cached whatever the temperature, nothing is sampled.
    score = {"model": "cached", "prompt": ["The cat sat", "A dog"], "max_tokens": 0, "echo": True, "logprobs": 1}
    _, scored, headers = await v1("completions", score)
    assert headers["X-Evalsched-Cache"] == "miss"
    _, rescored, headers = await v1("completions", score)
    assert headers["X-Evalsched-Cache"] == "hit" and rescored["choices"] == scored["choices"]
    assert (await figures(evalsched, "cached"))["requests"] == 2
    # Batched otherwise (as a resumed run may): only the prompt without an entry reaches the model.
    inputs = (await figures(evalsched, "cached"))["inputs"]
    _, mixed, headers = await v1("completions", {**score, "prompt": ["A dog", "A cat"]})
    assert headers["X-Evalsched-Cache"] == "miss" and mixed["choices"][0] == {**scored["choices"][1], "index": 0}
    assert (await figures(evalsched, "cached"))["inputs"] == inputs + 1

    # Sampled without a seed: never cached (no header), the host answers every time.
    sampled = {"model": "cached", "prompt": "The cat", "max_tokens": 4, "temperature": 1.0}
    for _ in range(2):
        _, _, headers = await v1("completions", sampled)
        assert "X-Evalsched-Cache" not in headers
    assert (await figures(evalsched, "cached"))["requests"] == 5
    _, _, headers = await v1("completions", {**sampled, "seed": 3})
    assert headers["X-Evalsched-Cache"] == "miss"
    _, _, headers = await v1("completions", {**sampled, "seed": 3})
    assert headers["X-Evalsched-Cache"] == "hit"

    # The entries: private files in a private directory of the runs directory.
    root = runs_dir / CACHE_DIR
    assert stat.S_IMODE(root.stat().st_mode) == 0o700
    entries = sorted(root.iterdir())
    assert len(entries) == 5 and all(stat.S_IMODE(e.stat().st_mode) == 0o600 for e in entries)

    # A link planted at an entry is never followed: a miss, and the entry is written anew.
    (entry,) = [e for e in entries if json.loads(e.read_text())["answer"]["prompt_text"] == "The cat sat"]
    target = runs_dir.parent / "elsewhere.json"
    target.write_text(entry.read_text())
    entry.unlink()
    entry.symlink_to(target)
    _, relinked, headers = await v1("completions", score)
    assert headers["X-Evalsched-Cache"] == "miss" and relinked["choices"] == scored["choices"]
    assert not entry.is_symlink() and entry.is_file()

    # Chat is cached the same way.
    chat = {"model": "cached", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5, "temperature": 0}
    _, first_chat, headers = await v1("chat/completions", chat)
    assert headers["X-Evalsched-Cache"] == "miss"
    _, second_chat, headers = await v1("chat/completions", chat)
    assert headers["X-Evalsched-Cache"] == "hit" and second_chat["choices"] == first_chat["choices"]

    # An entry whose key is right and whose answer is not one the host makes (damaged, or written
    # by another process of the user): a miss, answered by the model and written anew. (It
    # answered 500: the bodies and streams made from it failed.)
    (entry,) = [e for e in root.iterdir() if json.loads(e.read_text())["answer"].get("prompt_text") == "A dog"]
    good = json.loads(entry.read_text())["answer"]
    for damaged in ({}, {**good, "prompt_tokens": "x"}, {**good, "logprobs": 5}, {**good, "pieces": None}):
        for stream in (False, True):
            entry.write_text(json.dumps({"key": entry.stem, "answer": damaged}))
            code, text, headers = await v1("completions", {**score, "prompt": ["A dog"], "stream": stream})
            assert code == 200 and headers["X-Evalsched-Cache"] == "miss", (damaged, stream, text)
    _, _, headers = await v1("completions", {**score, "prompt": ["A dog"]})
    assert headers["X-Evalsched-Cache"] == "hit"

    # A changed model file: every key changes.
    config = model_copy / "config.json"
    info = config.stat()
    os.utime(config, ns=(info.st_atime_ns, info.st_mtime_ns + 10**9))
    before = (await figures(evalsched, "cached"))["requests"]
    code, changed, headers = await v1("completions", greedy)
    assert code == 200 and headers["X-Evalsched-Cache"] == "miss"
    assert (await figures(evalsched, "cached"))["requests"] == before + 1
    assert changed["choices"][0]["text"] == answer["choices"][0]["text"]  # (the weights are the same)
    # ... and the answer is not stored under the new key: the host still holds what it loaded
    # from the files before (rewritten weights would answer as the old ones, and that answer
    # would be served as the new model's after its next load).
    code, _, headers = await v1("completions", greedy)
    assert code == 200 and headers["X-Evalsched-Cache"] == "miss"
    # A file copied over with its modification time kept (cp -p, rsync -a): a new key too.
    weights = next(p for p in model_copy.iterdir() if p.suffix in (".safetensors", ".bin"))
    kept = weights.stat()
    copy = model_copy.parent / "weights-copy"
    shutil.copy2(weights, copy)
    os.replace(copy, weights)
    assert (weights.stat().st_size, weights.stat().st_mtime_ns) == (kept.st_size, kept.st_mtime_ns)
    code, _, headers = await v1("completions", greedy)
    assert code == 200 and headers["X-Evalsched-Cache"] == "miss"

    assert walked_on_loop and not any(walked_on_loop)


def test_the_cache_stays_within_its_size_evicting_the_least_recently_used(tmp_path):
    cache = ResponseCache(tmp_path, max_bytes=4000)
    answer = {"text": "x" * 300}
    keys = [f"{n:064x}" for n in range(12)]
    for number, key in enumerate(keys):
        assert cache.put(key, answer)
        if number >= 2:  # the first one in use all along: the last to go
            assert cache.get(keys[0]) == answer
    sizes = [p.stat().st_size for p in (tmp_path / CACHE_DIR).iterdir()]
    assert sum(sizes) <= 4000 and len(sizes) < len(keys)
    assert cache.get(keys[0]) == answer  # used most recently: kept
    assert cache.get(keys[1]) is None  # used least recently: evicted
    assert cache.get(keys[-1]) == answer
    assert not cache.put("f" * 64, {"text": "y" * 2000})  # over a quarter of the cache: not kept
    # A runs directory whose cache is a link elsewhere: nothing is written through it.
    other = tmp_path / "other"
    other.mkdir()
    linked = tmp_path / "runs"
    linked.mkdir()
    (linked / CACHE_DIR).symlink_to(other)
    assert not ResponseCache(linked, 4000).put(keys[0], answer)
    assert list(other.iterdir()) == []
