"""The shared models behind OpenAI's API (``/evalsched/v1``), served by a real server and model
host with a real (tiny, random, built offline) GPT-2, checked against the model itself computed
directly with transformers, and through the ``openai`` client."""

from __future__ import annotations

import asyncio
import json
import os
import threading
from collections import defaultdict

import openai
import pytest
import torch
import transformers
from raw_http import post_request, send

from jupyter_evalsched.shared_models.tiny import build_tiny_bert
from jupyter_evalsched.shared_models.tiny_lm import build_tiny_gpt2

PROMPTS = [
    "The cat sat on the mat.",
    "A dog",
    "Stocks fell sharply today because investors were worried about the bank.",
    "x",
    "The chef cooked pasta in the kitchen, and the children ate it.",
    "héllo wörld",
]


@pytest.fixture(scope="session")
def tiny_lm_dir(tmp_path_factory):
    return build_tiny_gpt2(tmp_path_factory.getbasetemp() / "models" / "tiny-gpt2")


@pytest.fixture(scope="session")
def tiny_bert_dir(tmp_path_factory):
    return build_tiny_bert(str(tmp_path_factory.getbasetemp() / "models" / "tiny-bert"))


@pytest.fixture(scope="session")
def reference(tiny_lm_dir):
    """The same model and tokenizer, loaded in this process: what the API must agree with."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_lm_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_lm_dir).eval()
    return model, tokenizer


@pytest.fixture
def evalsched_config(tiny_lm_dir, tiny_bert_dir):
    return {
        "models": [
            {
                "name": "tiny-lm",
                "loader": "jupyter_evalsched.shared_models.loaders:causal_lm",
                "model": tiny_lm_dir,
                "max_batch_size": 64,
                "cpu_threads": 1,
            },
            {
                "name": "tiny-embed",
                "loader": "jupyter_evalsched.shared_models.loaders:sentence_embeddings",
                "model": tiny_bert_dir,
                "cpu_threads": 1,
            },
            {
                "name": "missing",
                "loader": "jupyter_evalsched.shared_models.loaders:causal_lm",
                "model": str(tiny_bert_dir) + "-not-there",
            },
        ]
    }


@pytest.fixture
def v1(jp_fetch, evalsched):
    """``await v1("POST", "completions", body)`` -> (status, parsed body)."""

    async def call(method: str, path: str, body=None, headers=None):
        # (request_timeout: the first request waits for the model's load, slow on a busy host)
        kwargs: dict = {"method": method, "raise_error": False, "headers": headers or {}, "request_timeout": 300}
        if body is not None:
            kwargs["body"] = body if isinstance(body, (str, bytes)) else json.dumps(body)
        resp = await jp_fetch("evalsched", "v1", *path.split("/"), **kwargs)
        text = resp.body.decode() if resp.body else ""
        return resp.code, (json.loads(text) if text and not text.startswith("data:") else text)

    return call


@pytest.fixture
def client(jp_serverapp, jp_http_port, jp_base_url, jp_fetch, evalsched):  # jp_fetch: the server listens
    """OpenAI's own client; call it in a thread (``asyncio.to_thread``): the server runs on this
    test's event loop."""
    return openai.OpenAI(
        base_url=f"http://127.0.0.1:{jp_http_port}{jp_base_url}evalsched/v1",
        api_key=jp_serverapp.identity_provider.token,
        max_retries=0,
        timeout=300,
    )


def direct_logprobs(reference, text: str) -> list[float | None]:
    model, tokenizer = reference
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    with torch.inference_mode():
        logprobs = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    return [None] + [float(logprobs[i - 1, ids[i]]) for i in range(1, len(ids))]


def direct_greedy(reference, text: str, max_tokens: int) -> str:
    model, tokenizer = reference
    encoded = tokenizer(text, return_tensors="pt", add_special_tokens=False)
    out = model.generate(**encoded, max_new_tokens=max_tokens, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    return tokenizer.decode(out[0, encoded["input_ids"].shape[1] :], skip_special_tokens=True)


def assert_scores(choice: dict, text: str, expected: list[float | None]) -> None:
    lp = choice["logprobs"]
    assert choice["text"] == text  # echo, nothing generated
    assert len(lp["token_logprobs"]) == len(expected)
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    for got, want in zip(lp["token_logprobs"][1:], expected[1:], strict=True):
        assert abs(got - want) < 1e-4, (got, want)
    for token, offset in zip(lp["tokens"], lp["text_offset"], strict=True):
        if not token.startswith("bytes:"):  # a token inside a multi-byte character has no characters of its own
            assert text[offset : offset + len(token)] == token, (token, offset)
    assert lp["text_offset"] == sorted(lp["text_offset"])


@pytest.mark.slow  # a model host and a real server: CI runs it with -m slow (docs/install.md: the default suite stays within ten minutes)
async def test_scores_equal_the_models_own_log_softmax_batched_and_alone(v1, reference, evalsched):
    expected = {text: direct_logprobs(reference, text) for text in PROMPTS}
    score = {"model": "tiny-lm", "echo": True, "max_tokens": 0, "logprobs": 2}

    # Eight callers at once, while the model loads: they share batches (one forward pass each).
    bodies = [{**score, "prompt": PROMPTS[i % len(PROMPTS)]} for i in range(8)]
    answers = await asyncio.gather(*(v1("POST", "completions", body) for body in bodies))
    for body, (code, answer) in zip(bodies, answers, strict=True):
        assert code == 200, answer
        assert_scores(answer["choices"][0], body["prompt"], expected[body["prompt"]])
        assert answer["usage"]["completion_tokens"] == 0
        assert answer["usage"]["prompt_tokens"] == len(expected[body["prompt"]])
    # One request with every prompt: one padded batch.
    code, answer = await v1("POST", "completions", {**score, "prompt": PROMPTS})
    assert code == 200, answer
    for choice, text in zip(answer["choices"], PROMPTS, strict=True):
        assert_scores(choice, text, expected[text])
        for top, chosen in list(
            zip(choice["logprobs"]["top_logprobs"], choice["logprobs"]["token_logprobs"], strict=True)
        )[1:]:
            assert len(top) == 2 and max(top.values()) >= chosen - 1e-6
    (described,) = [m for m in await evalsched.models.describe() if m["name"] == "tiny-lm"]
    assert max(int(size) for size in described["batch_sizes"]) >= len(PROMPTS)  # one forward pass for them
    # Alone.
    for text in PROMPTS[:3]:
        code, answer = await v1("POST", "completions", {**score, "prompt": text})
        assert_scores(answer["choices"][0], text, expected[text])

    code, models = await v1("GET", "models")
    assert code == 200 and models["object"] == "list"
    assert models["data"][0] == {
        "id": "tiny-lm",
        "object": "model",
        "created": models["data"][0]["created"],
        "owned_by": "evalsched",
    }
    assert [m["id"] for m in models["data"]] == ["tiny-lm", "tiny-embed", "missing"]


@pytest.mark.slow  # a model host and a real server: CI runs it with -m slow (docs/install.md: the default suite stays within ten minutes)
async def test_greedy_completions_equal_generate(v1, reference):
    lengths = [5, 12, 1, 20, 7, 3]
    bodies = [
        {"model": "tiny-lm", "prompt": text, "max_tokens": n, "temperature": 0}
        for text, n in zip(PROMPTS, lengths, strict=True)
    ]
    answers = await asyncio.gather(*(v1("POST", "completions", body) for body in bodies))
    for body, (code, answer) in zip(bodies, answers, strict=True):
        assert code == 200, answer
        choice = answer["choices"][0]
        assert choice["text"] == direct_greedy(reference, body["prompt"], body["max_tokens"])
        assert choice["finish_reason"] in ("length", "stop")
        assert answer["usage"]["completion_tokens"] <= body["max_tokens"]
    # A stop string cuts the text before it; echo with logprobs covers the prompt and the rest.
    text = direct_greedy(reference, PROMPTS[0], 20)
    stop = text[3:5]
    code, answer = await v1(
        "POST",
        "completions",
        {
            "model": "tiny-lm",
            "prompt": PROMPTS[0],
            "max_tokens": 20,
            "temperature": 0,
            "stop": [stop],
            "echo": True,
            "logprobs": 1,
        },
    )
    choice = answer["choices"][0]
    assert choice["text"] == PROMPTS[0] + text[: text.index(stop)] and choice["finish_reason"] == "stop"
    offsets = choice["logprobs"]["text_offset"]
    assert offsets[0] == 0 and choice["logprobs"]["token_logprobs"][0] is None
    # Echo with generation: the offsets of the prompt's and the generated tokens point into the text.
    code, answer = await v1(
        "POST",
        "completions",
        {"model": "tiny-lm", "prompt": PROMPTS[1], "max_tokens": 12, "temperature": 0, "echo": True, "logprobs": 0},
    )
    choice = answer["choices"][0]
    assert choice["text"] == PROMPTS[1] + direct_greedy(reference, PROMPTS[1], 12)
    logprobs = choice["logprobs"]
    assert len(logprobs["tokens"]) == answer["usage"]["total_tokens"]
    for token, offset in zip(logprobs["tokens"], logprobs["text_offset"], strict=True):
        if not token.startswith("bytes:"):
            assert choice["text"][offset : offset + len(token)] == token, (token, offset)
    # Seeded sampling repeats itself.
    sampled = {"model": "tiny-lm", "prompt": "The dog", "max_tokens": 10, "temperature": 1.0, "top_p": 0.9, "seed": 7}
    first, second = await v1("POST", "completions", sampled), await v1("POST", "completions", sampled)
    assert first[1]["choices"][0]["text"] == second[1]["choices"][0]["text"]


@pytest.mark.slow  # heavy (a model host or a killed server); CI runs it with -m slow
async def test_the_openai_client(client, reference):
    await asyncio.to_thread(use_the_client, client, reference)


def use_the_client(client, reference):
    listed = client.models.list()
    assert [m.id for m in listed.data] == ["tiny-lm", "tiny-embed", "missing"]
    # One model, as models.retrieve asks (an unknown one was the server's HTML 404).
    assert client.models.retrieve("tiny-lm").model_dump() == listed.data[0].model_dump()
    with pytest.raises(openai.NotFoundError) as unknown:
        client.models.retrieve("nope")
    assert unknown.value.body["code"] == "model_not_found", unknown.value.body

    done = client.completions.create(model="tiny-lm", prompt="The cat", max_tokens=6, temperature=0)
    assert done.choices[0].text == direct_greedy(reference, "The cat", 6)
    assert done.usage.completion_tokens == 6

    scored = client.completions.create(model="tiny-lm", prompt="The cat sat", max_tokens=0, echo=True, logprobs=0)
    expected = direct_logprobs(reference, "The cat sat")
    assert scored.choices[0].logprobs.token_logprobs[0] is None
    assert all(
        abs(a - b) < 1e-4 for a, b in zip(scored.choices[0].logprobs.token_logprobs[1:], expected[1:], strict=True)
    )

    stream = client.completions.create(model="tiny-lm", prompt="The cat", max_tokens=6, temperature=0, stream=True)
    pieces = [chunk.choices[0].text for chunk in stream]
    assert "".join(pieces) == done.choices[0].text

    messages = [{"role": "user", "content": "Where did the cat sit?"}]
    chat = client.chat.completions.create(
        model="tiny-lm", messages=messages, max_tokens=8, temperature=0, logprobs=True, top_logprobs=2
    )
    _, tokenizer = reference
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert chat.choices[0].message.content == direct_greedy(reference, prompt, 8)
    assert chat.choices[0].message.role == "assistant"
    assert len(chat.choices[0].logprobs.content) == chat.usage.completion_tokens
    assert len(chat.choices[0].logprobs.content[0].top_logprobs) == 2
    stream = client.chat.completions.create(
        model="tiny-lm", messages=messages, max_tokens=8, temperature=0, stream=True
    )
    deltas = [chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices]
    assert "".join(deltas) == chat.choices[0].message.content

    vectors = client.embeddings.create(model="tiny-embed", input=["the cat sat", "a dog ran"])
    assert len(vectors.data) == 2 and len(vectors.data[0].embedding) == 32
    assert abs(sum(x * x for x in vectors.data[0].embedding) - 1.0) < 1e-4  # normalized by the loader

    with pytest.raises(openai.NotFoundError) as missing:
        client.completions.create(model="no-such-model", prompt="x")
    assert missing.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model="tiny-lm", prompt="x", n=2)
    assert bad.value.body["param"] == "n"


@pytest.mark.slow  # heavy (a model host or a killed server); CI runs it with -m slow
async def test_bad_input_is_an_openai_shaped_4xx(v1, jp_serverapp):
    cases = [
        ("completions", b"{not json", None),
        ("completions", [1, 2], None),
        ("completions", {"prompt": "x"}, "model"),
        ("completions", {"model": "tiny-lm", "prompt": "x", "flavour": "sweet"}, "flavour"),
        ("completions", {"model": "tiny-lm", "prompt": "x", "n": 3}, "n"),
        ("completions", {"model": "tiny-lm", "prompt": "x", "max_tokens": -1}, "max_tokens"),
        ("completions", {"model": "tiny-lm", "prompt": "x", "max_tokens": True}, "max_tokens"),
        ("completions", {"model": "tiny-lm", "prompt": "x", "logprobs": 6}, "logprobs"),
        ("completions", {"model": "tiny-lm", "prompt": "x", "temperature": -1}, "temperature"),
        ("completions", {"model": "tiny-lm", "prompt": "x", "stop": ["", "y"]}, "stop"),
        ("completions", {"model": "tiny-lm", "prompt": "x", "stop": [f"s{i}" for i in range(17)]}, "stop"),
        ("completions", {"model": "tiny-lm", "prompt": {"text": "x"}}, "prompt"),
        ("completions", {"model": "tiny-lm", "prompt": "the cat " * 400}, "prompt"),
        ("completions", {"model": "tiny-lm", "prompt": [999999]}, "prompt"),
        ("completions", {"model": "tiny-embed", "prompt": "x"}, "model"),
        ("chat/completions", {"model": "tiny-lm", "messages": []}, "messages"),
        ("chat/completions", {"model": "tiny-lm", "messages": [{"content": "x"}]}, "messages[0]"),
        ("chat/completions", {"model": "tiny-lm", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
        ("embeddings", {"model": "tiny-embed", "input": []}, "input"),
        ("embeddings", {"model": "tiny-lm", "input": "x"}, "model"),
    ]  # fmt: skip
    for path, body, param in cases:
        code, answer = await v1("POST", path, body)
        assert code == 400, (path, body, code, answer)
        assert set(answer["error"]) == {"message", "type", "code", "param"}, answer
        assert answer["error"]["type"] == "invalid_request_error" and answer["error"]["param"] == param, (body, answer)
    code, answer = await v1(
        "POST", "chat/completions", {"model": "nope", "messages": [{"role": "user", "content": "x"}]}
    )
    assert code == 404 and answer["error"]["code"] == "model_not_found"
    # A model that cannot load: a 503 in the same shape, the loader's error in the message.
    code, answer = await v1("POST", "completions", {"model": "missing", "prompt": "x"})
    assert code == 503 and answer["error"]["code"] == "model_unavailable", answer
    assert "failed to load" in answer["error"]["message"] and "is not a directory" in answer["error"]["message"]

    # Jupyter's token as OpenAI's clients send it, and a wrong one: refused in the same shape.
    token = jp_serverapp.identity_provider.token
    code, answer = await v1("GET", "models", headers={"Authorization": f"Bearer {token}"})
    assert code == 200 and answer["object"] == "list"
    code, answer = await v1("GET", "models", headers={"Authorization": "Bearer not-the-token"})
    assert code in (401, 403) and answer["error"]["type"] in ("authentication_error", "permission_error"), answer


@pytest.mark.slow  # a model host and a real server: CI runs it with -m slow (docs/install.md: the default suite stays within ten minutes)
async def test_a_client_gone_mid_stream_leaves_nothing_stuck(v1, jp_serverapp, jp_http_port, jp_base_url, evalsched):
    token = jp_serverapp.identity_provider.token

    def raw(stream: bool) -> bytes:
        body = json.dumps(
            {"model": "tiny-lm", "prompt": "The cat", "max_tokens": 40, "temperature": 0, "stream": stream}
        )
        return post_request(jp_base_url, "evalsched/v1/completions", token, body)

    request = raw(stream=True)
    # Gone before the answer: the request is cancelled in the model host (or answered to nobody).
    for _ in range(3):
        reader, writer = await send(jp_http_port, raw(stream=False))
        writer.transport.abort()
    # Gone mid-stream.
    for _ in range(3):
        reader, writer = await send(jp_http_port, request)
        head = await asyncio.wait_for(reader.readuntil(b"data: "), 60)
        assert b"200 OK" in head and b"text/event-stream" in head
        writer.transport.abort()  # gone, mid-stream
    # The next callers are answered, and the host has nothing queued.
    code, answer = await v1("POST", "completions", {"model": "tiny-lm", "prompt": "The cat", "max_tokens": 3})
    assert code == 200 and answer["usage"]["completion_tokens"] <= 3
    (described,) = [m for m in await evalsched.models.describe() if m["name"] == "tiny-lm"]
    assert described["failed_requests"] == 0 and described["load_count"] == 1
    # Each request the host saw was answered or, its client gone first, cancelled; nothing is
    # left queued. (Which of the two depends on timing: test_openai_stream holds the model.)
    figures = (await evalsched.models.ask("tiny-lm", {"op": "describe"}))["describe"]
    assert figures["requests"] >= 1 and figures["requests"] + figures["cancelled_requests"] >= 4
    assert figures["queued"] == 0


SHARED_RUN = """
import os
import time

import jupyter_evalsched


def episode(ctx, index):
    text = ctx.model("tiny-lm")(["The cat sat", "A dog"])
    assert len(text) == 2 and all(isinstance(t, str) for t in text), text
    # The same model through OpenAI's client, from the run's environment.
    client = jupyter_evalsched.openai_client(max_retries=0)
    done = client.completions.create(model="tiny-lm", prompt="The cat", max_tokens=4, temperature=0)
    assert done.usage.completion_tokens <= 4
    with open(os.environ["KEY_FILE"], "w") as f:
        f.write(os.environ["OPENAI_BASE_URL"] + " " + os.environ["OPENAI_API_KEY"])
    if index == 0:  # both runs are using the model now: wait until the kernel has used it too
        deadline = time.monotonic() + 120
        while not os.path.exists(os.environ["KERNEL_DONE"]):
            assert time.monotonic() < deadline, "the kernel never used the model"
            time.sleep(0.05)
    return {"ok": 1}
"""

# In a kernel: once both runs are in their first episode, the same model through OpenAI's client
# (the server found from EVALSCHED_URL and EVALSCHED_TOKEN, as a notebook's kernel finds it).
KERNEL_CODE = """
import json, os, time
import jupyter_evalsched

deadline = time.monotonic() + 120
while not all(os.path.exists(path) for path in {keys!r}):
    assert time.monotonic() < deadline, "the runs never started"
    time.sleep(0.05)
client = jupyter_evalsched.openai_client(max_retries=0)
done = client.completions.create(model="tiny-lm", prompt="The cat", max_tokens=4, temperature=0)
print(json.dumps([str(client.base_url), done.choices[0].text]))
open({done!r}, "w").close()
"""


@pytest.mark.slow  # heavy (a model host or a killed server); CI runs it with -m slow
async def test_runs_and_the_api_share_one_load(
    api, v1, wait_for, evalsched, tmp_path, reference, jp_serverapp, jp_http_port, jp_base_url
):
    """Two runs and a kernel use the model at once (each run's first episode waits for the
    kernel, which waits for both runs), and a tool calls the API meanwhile: one load."""
    from jupyter_client.manager import start_new_async_kernel

    kernel_done = str(tmp_path / "kernel-done")
    key_files = [str(tmp_path / f"key{number}") for number in range(2)]
    environment = {
        **os.environ,
        "EVALSCHED_URL": f"http://127.0.0.1:{jp_http_port}{jp_base_url}",
        "EVALSCHED_TOKEN": jp_serverapp.identity_provider.token,
    }
    environment.pop("OPENAI_BASE_URL", None), environment.pop("OPENAI_API_KEY", None)
    kernel, kernel_client = await start_new_async_kernel(kernel_name="python3", env=environment)
    try:
        printed: list[str] = []

        def output(message: dict) -> None:
            if message["msg_type"] == "stream" and message["content"]["name"] == "stdout":
                printed.append(message["content"]["text"])
            elif message["msg_type"] == "error":
                printed.append("\n".join(message["content"]["traceback"]))

        in_kernel = asyncio.ensure_future(
            kernel_client.execute_interactive(
                KERNEL_CODE.format(keys=key_files, done=kernel_done), timeout=180, output_hook=output
            )
        )
        ids = []
        for number in range(2):
            spec = {
                "source": SHARED_RUN,
                "episodes": 3,
                "models": ["tiny-lm"],
                "env": {"KEY_FILE": key_files[number], "KERNEL_DONE": kernel_done},
            }
            code, rec = await api("POST", "runs", spec)
            assert code == 201, rec
            ids.append(rec["id"])
        answers = await asyncio.gather(
            *(v1("POST", "completions", {"model": "tiny-lm", "prompt": "The cat", "max_tokens": 4}) for _ in range(4))
        )
        assert all(code == 200 for code, _ in answers), answers
        reply = await in_kernel
        assert reply["content"]["status"] == "ok", printed
        base_url, text = json.loads("".join(printed))
        assert base_url == f"http://127.0.0.1:{jp_http_port}{jp_base_url}evalsched/v1/"
        assert text == direct_greedy(reference, "The cat", 4)
        for run_id in ids:
            final = await wait_for(run_id, timeout=120)
            assert final["state"] == "succeeded", final
    finally:
        kernel_client.stop_channels()
        await kernel.shutdown_kernel(now=True)
    (described,) = [m for m in await evalsched.models.describe() if m["name"] == "tiny-lm"]
    assert described["load_count"] == 1 and described["requests"] >= 4 + 2 * 3 * 2 + 1

    # Each run had its own key, which ends with it.
    keys = [(tmp_path / f"key{n}").read_text().split()[1] for n in range(2)]
    assert keys[0] != keys[1] and all(key.startswith("esk-") for key in keys)
    code, answer = await v1("GET", "models", headers={"Authorization": f"Bearer {keys[0]}"})
    assert code == 403 and answer["error"]["type"] == "permission_error", answer
    forged = keys[0][:-4] + "0000"
    code, answer = await v1("GET", "models", headers={"Authorization": f"Bearer {forged}"})
    assert code == 403


def test_a_short_request_is_answered_before_the_long_one_it_shares_a_batch_with(tiny_lm_dir):
    """In the host's model: a batch answers each request as soon as it is done, and what it
    answers equals that request alone."""
    from jupyter_evalsched.shared_models.loaders import causal_lm

    lm = causal_lm(model=tiny_lm_dir)
    requests = [
        {"prompt": "The cat", "max_tokens": 60, "temperature": 0.0, "logprobs": 1},
        {"prompt": "The cat sat", "max_tokens": 0, "echo": True, "logprobs": 1},
        {"prompt": "A dog", "max_tokens": 2, "temperature": 0.0},
        {"prompt": "the cat " * 400, "max_tokens": 2},
    ]
    order: list[int] = []
    answers = lm.openai_batch([dict(r) for r in requests], on_done=lambda i, answer: order.append(i))
    assert sorted(order) == [0, 1, 2, 3] and order[-1] == 0, order  # the long one last
    assert order.index(2) < order.index(0)
    assert answers[3]["error"]["param"] == "prompt"
    assert answers[0]["completion_tokens"] == 60  # (this prompt never reaches an end-of-text)
    for request, answer in zip(requests[:3], answers[:3], strict=True):
        (alone,) = lm.openai_batch([dict(request)])
        assert alone["text"] == answer["text"] and alone["completion_tokens"] == answer["completion_tokens"]
        for a, b in zip(alone["logprobs"] or [], answer["logprobs"] or [], strict=True):
            assert a["token"] == b["token"] and (a["logprob"] is None or abs(a["logprob"] - b["logprob"]) < 1e-4)


@pytest.mark.slow  # a model host and a real server: CI runs it with -m slow (docs/install.md: the default suite stays within ten minutes)
async def test_what_grows_with_a_request_is_done_off_the_event_loop(v1, monkeypatch):
    """The server's event loop is every client's: a large body's parse, an answer's making (every
    token's log-probabilities of 64 prompts here, megabytes), the host's large reply read back and
    embeddings pooled run in threads. Recorded where each ran (this test runs on the server's
    loop); small bodies and replies may stay on it."""
    from jupyter_evalsched import openai_api
    from jupyter_evalsched.shared_models import manager as manager_module

    loop_thread = threading.current_thread()
    on_loop: defaultdict[str, list[bool]] = defaultdict(list)

    def recorded(name: str):
        real = getattr(openai_api, name)

        def wrapper(*args, **kwargs):
            on_loop[name].append(threading.current_thread() is loop_thread)
            return real(*args, **kwargs)

        monkeypatch.setattr(openai_api, name, wrapper)

    for name in ("parse_completion", "completion_body", "parse_embeddings", "embedding_vector"):
        recorded(name)
    large_replies: list[bool] = []

    class RecordingUnpickler(manager_module.PlainUnpickler):  # type: ignore[name-defined,misc]
        def __init__(self, file):
            if file.getbuffer().nbytes >= manager_module.UNPICKLE_ON_LOOP_BELOW:
                large_replies.append(threading.current_thread() is loop_thread)
            super().__init__(file)

    monkeypatch.setattr(manager_module, "PlainUnpickler", RecordingUnpickler)

    prompts = [[(i + j) % 500 + 5 for j in range(200)] for i in range(64)]
    body = json.dumps({"model": "tiny-lm", "prompt": prompts, "max_tokens": 0, "echo": True, "logprobs": 5})
    body += " " * (openai_api.PARSE_ON_LOOP_BELOW - len(body) + 1)  # (JSON may end in blanks)
    code, answer = await v1("POST", "completions", body)
    assert code == 200 and len(answer["choices"]) == 64, answer
    assert on_loop["parse_completion"] == [False] and on_loop["completion_body"] == [False]
    assert large_replies and not any(large_replies)

    code, answer = await v1("POST", "embeddings", {"model": "tiny-embed", "input": ["a cat", "a dog"]})
    assert code == 200 and len(answer["data"]) == 2, answer
    assert on_loop["parse_embeddings"] == [True]  # (a small body)
    assert on_loop["embedding_vector"] == [False, False]


def test_a_tiny_temperature_samples_greedily_instead_of_failing_the_batch(tiny_lm_dir):
    """A temperature too small to divide by (OpenAI's range starts at 0, so 1e-40 is valid)
    overflowed the tempered logits to a NaN, which failed the whole batch, every other caller's
    request in it included: it is read as greedy, beside a request that shares its batch."""
    from jupyter_evalsched.shared_models.loaders import causal_lm

    lm = causal_lm(model=tiny_lm_dir)
    greedy = {"prompt": "The cat", "max_tokens": 8, "temperature": 0.0}
    (want,) = lm.openai_batch([dict(greedy)])
    for temperature in (1e-40, 5e-324, 1e-6):
        other = {"prompt": "A dog", "max_tokens": 4, "temperature": 1.0, "seed": 1}
        got, beside = lm.openai_batch([{**greedy, "temperature": temperature}, other])
        assert "error" not in got and got["text"] == want["text"], (temperature, got)
        assert "error" not in beside and beside["completion_tokens"] == 4


@pytest.mark.slow  # a model host and a real server: CI runs it with -m slow (docs/install.md: the default suite stays within ten minutes)
async def test_prompts_as_strings_and_as_token_ids_score_the_same(v1, reference):
    """OpenAI's legacy completions take ``prompt`` as a string, a list of strings, a list of token
    ids or a list of such lists (lm-eval's local-completions sends the last): the same tokens,
    the same answers, with ``text_offset`` into the decoded text of a token prompt."""
    _, tokenizer = reference
    texts = PROMPTS[:2] + PROMPTS[5:]  # "héllo wörld": tokens inside a character
    ids = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]
    score = {"model": "tiny-lm", "echo": True, "max_tokens": 0, "logprobs": 1}
    as_texts = (await v1("POST", "completions", {**score, "prompt": texts}))[1]["choices"]
    shapes = {
        "a string": [(await v1("POST", "completions", {**score, "prompt": text}))[1]["choices"][0] for text in texts],
        "token ids": [(await v1("POST", "completions", {**score, "prompt": i}))[1]["choices"][0] for i in ids],
        "lists of token ids": (await v1("POST", "completions", {**score, "prompt": ids}))[1]["choices"],
    }
    for shape, choices in shapes.items():
        assert [c["text"] for c in choices] == texts, shape
        for choice, expected in zip(choices, as_texts, strict=True):
            got, want = choice["logprobs"], expected["logprobs"]
            assert (got["tokens"], got["text_offset"]) == (want["tokens"], want["text_offset"]), shape
            assert [list(top or {}) for top in got["top_logprobs"]] == [list(top or {}) for top in want["top_logprobs"]]
            for a, b in zip(got["token_logprobs"][1:], want["token_logprobs"][1:], strict=True):
                assert abs(a - b) < 1e-4, (shape, a, b)  # alone or padded in a batch: the same to float noise
    for text, choice in zip(texts, as_texts, strict=True):
        assert_scores(choice, text, direct_logprobs(reference, text))
    multibyte = shapes["token ids"][-1]["logprobs"]
    assert any(t.startswith("bytes:") for t in multibyte["tokens"])  # the case the offsets must get right

    # Generating after token ids: the echoed prompt is their decoded text, offsets continue it.
    code, answer = await v1(
        "POST",
        "completions",
        {
            "model": "tiny-lm",
            "prompt": [ids[0], ids[1]],
            "max_tokens": 5,
            "temperature": 0,
            "echo": True,
            "logprobs": 0,
        },
    )
    assert code == 200, answer
    for text, choice in zip(texts[:2], answer["choices"], strict=True):
        assert choice["text"] == text + direct_greedy(reference, text, 5)
        lp = choice["logprobs"]
        for token, offset in zip(lp["tokens"], lp["text_offset"], strict=True):
            assert choice["text"][offset : offset + len(token)] == token, (token, offset)
    # Token-id prompts that are not: an empty list, a list mixing ids and strings, floats, booleans.
    for prompt in ([], [[]], [1, "a"], [[1, 2.5]], [True, 2], [[1], []]):
        code, answer = await v1("POST", "completions", {**score, "prompt": prompt})
        assert code == 400 and answer["error"]["param"] == "prompt", (prompt, answer)


@pytest.mark.slow  # a model host and a real server: CI runs it with -m slow (docs/install.md: the default suite stays within ten minutes)
async def test_the_end_of_text_that_ends_a_generation_is_a_token_with_its_logprob(v1, reference):
    """A generation that ends with the end-of-text token: the text is without it, but the token is
    counted and has its log-probability, after the echoed prompt's (lm-eval reads an echoed
    prompt's scores as every entry but the last generated one)."""
    model, tokenizer = reference
    eos = tokenizer.eos_token_id
    # This random model's one sure end of text: after an end of text.
    with torch.inference_mode():
        logprobs = torch.log_softmax(model(torch.tensor([[eos]])).logits[0, -1].float(), dim=-1)
    assert int(logprobs.argmax()) == eos
    for prompt in ([eos], tokenizer.eos_token):
        code, answer = await v1(
            "POST",
            "completions",
            {"model": "tiny-lm", "prompt": prompt, "max_tokens": 1, "temperature": 0, "echo": True, "logprobs": 1},
        )
        assert code == 200, answer
        choice = answer["choices"][0]
        assert choice["finish_reason"] == "stop" and choice["text"] == tokenizer.eos_token
        assert answer["usage"] == {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}
        lp = choice["logprobs"]
        assert lp["tokens"] == [tokenizer.eos_token, tokenizer.eos_token]
        assert lp["token_logprobs"][0] is None and abs(lp["token_logprobs"][1] - float(logprobs[eos])) < 1e-4
        assert lp["text_offset"] == [0, len(tokenizer.eos_token)]
    # Without echo: no text, one token.
    code, answer = await v1(
        "POST", "completions", {"model": "tiny-lm", "prompt": [eos], "max_tokens": 4, "temperature": 0, "logprobs": 0}
    )
    choice = answer["choices"][0]
    assert (choice["text"], choice["finish_reason"], answer["usage"]["completion_tokens"]) == ("", "stop", 1)
    assert choice["logprobs"]["tokens"] == [tokenizer.eos_token] and choice["logprobs"]["text_offset"] == [0]
