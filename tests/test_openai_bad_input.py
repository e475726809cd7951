"""Bad input to the OpenAI-compatible routes: each mistake is a 400 naming its field (checked
case by case on the parsers, then through a real server with a real model, with the raw bodies
a parser never sees), a fuzz of request bodies never gets anything but a 200 or an OpenAI-shaped
4xx, and the model host is left with nothing queued or failed."""

from __future__ import annotations

import json
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jupyter_evalsched.openai_shapes import (
    OpenAIError,
    parse_chat,
    parse_completion,
    parse_embeddings,
    stream_usage,
)
from jupyter_evalsched.shared_models.tiny_lm import build_tiny_gpt2

# What the handlers call on a body (the stream's options are read beside the parsers).
PARSERS = {
    "completions": lambda body: (parse_completion(body), stream_usage(body)),
    "chat/completions": lambda body: (parse_chat(body), stream_usage(body)),
    "embeddings": parse_embeddings,
}
USER = [{"role": "user", "content": "x"}]
C = {"model": "lm", "prompt": "x"}
CHAT = {"model": "lm", "messages": USER}
E = {"model": "lm", "input": "x"}

# (route, body, the param the 400 names)
CASES = [
    ("completions", None, None),
    ("completions", "a string", None),
    ("completions", [C], None),
    ("completions", {"prompt": "x"}, "model"),
    ("completions", {**C, "model": ""}, "model"),
    ("completions", {**C, "model": 3}, "model"),
    ("completions", {**C, "flavour": "sweet"}, "flavour"),
    ("completions", {**C, "n": 2}, "n"),
    ("completions", {**C, "best_of": 3}, "best_of"),
    ("completions", {**C, "n": True}, "n"),  # (true == 1 in Python)
    ("completions", {**C, "best_of": True}, "best_of"),
    ("completions", {**C, "n": 1.0}, "n"),
    ("completions", {**C, "frequency_penalty": False}, "frequency_penalty"),  # (false == 0)
    ("completions", {**C, "suffix": "end"}, "suffix"),
    ("completions", {**C, "logit_bias": {"5": 100}}, "logit_bias"),
    ("completions", {**C, "max_tokens": -1}, "max_tokens"),
    ("completions", {**C, "max_tokens": 1.5}, "max_tokens"),
    ("completions", {**C, "max_tokens": "5"}, "max_tokens"),
    ("completions", {**C, "max_tokens": True}, "max_tokens"),
    ("completions", {**C, "logprobs": 6}, "logprobs"),
    ("completions", {**C, "logprobs": -1}, "logprobs"),
    ("completions", {**C, "logprobs": True}, "logprobs"),
    ("completions", {**C, "temperature": -0.5}, "temperature"),
    ("completions", {**C, "temperature": 2.5}, "temperature"),
    ("completions", {**C, "temperature": "hot"}, "temperature"),
    ("completions", {**C, "top_p": 0}, "top_p"),
    ("completions", {**C, "top_p": 1.5}, "top_p"),
    ("completions", {**C, "seed": 2**70}, "seed"),
    ("completions", {**C, "seed": "7"}, "seed"),
    ("completions", {**C, "echo": "true"}, "echo"),
    ("completions", {**C, "stream": 1}, "stream"),
    ("completions", {**C, "stream": True, "stream_options": {"include_usage": "yes"}}, "stream_options"),
    ("completions", {**C, "stream": True, "stream_options": []}, "stream_options"),
    ("completions", {**C, "stop": ""}, "stop"),
    ("completions", {**C, "stop": [str(i) for i in range(17)]}, "stop"),  # at most 16
    ("completions", {**C, "stop": ["\n", "x" * 1001]}, "stop"),  # at most 1000 characters each
    ("chat/completions", {**CHAT, "stop": "x" * 1001}, "stop"),
    ("completions", {**C, "stop": [1]}, "stop"),
    ("completions", {**C, "prompt": None}, "prompt"),
    ("completions", {**C, "prompt": []}, "prompt"),
    ("completions", {**C, "prompt": [[]]}, "prompt"),
    ("completions", {**C, "prompt": [1, "a"]}, "prompt"),
    ("completions", {**C, "prompt": [1.5, 2]}, "prompt"),
    ("completions", {**C, "prompt": [True, False]}, "prompt"),
    ("completions", {**C, "prompt": {"text": "x"}}, "prompt"),
    ("completions", {**C, "prompt": ["x"] * 2049}, "prompt"),
    ("completions", {**C, "prompt": "\ud800"}, "prompt"),
    ("completions", {**C, "stop": ["\udfff"]}, "stop"),
    ("chat/completions", {"model": "lm"}, "messages"),
    ("chat/completions", {**CHAT, "messages": []}, "messages"),
    ("chat/completions", {**CHAT, "messages": "hi"}, "messages"),
    ("chat/completions", {**CHAT, "messages": [{"content": "x"}]}, "messages[0]"),
    ("chat/completions", {**CHAT, "messages": ["x"]}, "messages[0]"),
    ("chat/completions", {**CHAT, "messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ("chat/completions", {**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content"),
    ("chat/completions", {**CHAT, "n": 3}, "n"),
    ("chat/completions", {**CHAT, "prompt": "x"}, "prompt"),
    ("chat/completions", {**CHAT, "tools": [{"type": "function"}]}, "tools"),
    ("chat/completions", {**CHAT, "logprobs": "yes"}, "logprobs"),
    ("chat/completions", {**CHAT, "top_logprobs": 2}, "top_logprobs"),
    ("chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("chat/completions", {**CHAT, "max_completion_tokens": -2}, "max_completion_tokens"),
    ("chat/completions", {**CHAT, "max_tokens": -2}, "max_tokens"),
    ("chat/completions", {**CHAT, "n": True}, "n"),
    ("chat/completions", {**CHAT, "max_tokens": True, "max_completion_tokens": 5}, "max_tokens"),
    ("chat/completions", {**CHAT, "response_format": {"type": "json_object"}}, "response_format"),
    ("embeddings", {"model": "lm"}, "input"),
    ("embeddings", {**E, "input": []}, "input"),
    ("embeddings", {**E, "input": [1, 2]}, "input"),
    ("embeddings", {**E, "encoding_format": "int8"}, "encoding_format"),
    ("embeddings", {**E, "dimensions": 8}, "dimensions"),
    ("embeddings", {**E, "user": "me", "extra": 1}, "extra"),
]  # fmt: skip


@pytest.mark.parametrize(("route", "body", "param"), CASES, ids=[f"{r}-{i}" for i, (r, _, _) in enumerate(CASES)])
def test_each_mistake_is_a_400_naming_its_field(route, body, param):
    with pytest.raises(OpenAIError) as caught:
        PARSERS[route](body)
    assert caught.value.status == 400 and caught.value.param == param, caught.value.body()
    assert caught.value.body()["error"]["type"] == "invalid_request_error"
    json.dumps(caught.value.body())  # (what the server writes)


# Every number of the request shapes, with what it must be: a JSON boolean is neither, though
# Python's True equals 1 (and False 0, the penalties' default).
NUMBERS = [
    *[("completions", C, key, "an integer") for key in ("max_tokens", "logprobs", "seed", "n", "best_of")],
    *[("chat/completions", CHAT, key, "an integer") for key in ("max_tokens", "max_completion_tokens", "seed", "n")],
    ("chat/completions", {**CHAT, "logprobs": True}, "top_logprobs", "an integer"),
    # (max_tokens beside max_completion_tokens, which is used: still checked)
    ("chat/completions", {**CHAT, "max_completion_tokens": 5}, "max_tokens", "an integer"),
    *[
        (route, base, key, "a number")
        for route, base in (("completions", C), ("chat/completions", CHAT))
        for key in ("temperature", "top_p", "frequency_penalty", "presence_penalty")
    ],
]  # fmt: skip


@pytest.mark.parametrize("value", [True, False])
@pytest.mark.parametrize(
    ("route", "base", "param", "kind"), NUMBERS, ids=[f"{r}-{p}-{i}" for i, (r, _, p, _) in enumerate(NUMBERS)]
)
def test_a_boolean_is_refused_by_every_number_naming_it(route, base, param, kind, value):
    with pytest.raises(OpenAIError) as caught:
        PARSERS[route]({**base, param: value})
    assert (caught.value.status, caught.value.param) == (400, param), caught.value.body()
    assert caught.value.message == f"{param} must be {kind}", caught.value.body()


# Any JSON value, and bodies close to valid ones: a known field set to any JSON value.
JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12,
)
FIELDS = sorted(
    {"prompt", "messages", "input", "max_tokens", "temperature", "top_p", "seed", "stop", "echo"}
    | {"logprobs", "top_logprobs", "stream", "stream_options", "n", "encoding_format", "dimensions", "user"}
)
NEAR = st.fixed_dictionaries(
    {"model": st.just("lm")}, optional={name: JSON for name in FIELDS}
)  # fmt: skip


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(body=JSON | NEAR, route=st.sampled_from(sorted(PARSERS)))
def test_any_body_is_parsed_or_refused_with_a_400(body, route):
    try:
        PARSERS[route](body)
    except OpenAIError as exc:
        assert exc.status == 400
        json.dumps(exc.body())


# -- through a real server ------------------------------------------------------------------------


@pytest.fixture(scope="session")
def tiny_lm_dir(tmp_path_factory):
    return build_tiny_gpt2(tmp_path_factory.getbasetemp() / "models" / "tiny-gpt2")


@pytest.fixture
def evalsched_config(tiny_lm_dir):
    loader = "jupyter_evalsched.shared_models.loaders:causal_lm"
    return {"models": [{"name": "lm", "loader": loader, "model": tiny_lm_dir, "cpu_threads": 1}]}


def mutations(seed: int, count: int) -> list:
    """Bodies near valid ones: a field dropped, set to another type, or out of range."""
    rng = random.Random(seed)
    bases = [
        ("completions", {"model": "lm", "prompt": "The cat", "max_tokens": 2, "temperature": 0}),
        ("completions", {"model": "lm", "prompt": ["a", "b"], "max_tokens": 0, "echo": True, "logprobs": 1}),
        ("chat/completions", {"model": "lm", "messages": USER, "max_tokens": 2, "stream": True}),
        ("embeddings", {"model": "lm", "input": "x"}),
    ]
    values = [None, True, -1, 0, 3, 10**20, 1.5, -1e300, "", "x", [], [1], [[2]], {}, {"a": 1}, "\ud800"]
    out = []
    for _ in range(count):
        route, body = rng.choice(bases)
        body = dict(body)
        for _ in range(rng.randint(1, 2)):
            key = rng.choice([*body, "logprobs", "stop", "n", "top_logprobs", "seed", "stream", "zzz"])
            if rng.random() < 0.2:
                body.pop(key, None)
            else:
                body[key] = rng.choice(values)
        if body.get("max_tokens", 0) not in (None, True) and isinstance(body.get("max_tokens"), int):
            body["max_tokens"] = min(body["max_tokens"], 4)  # keep the valid ones short
        out.append((route, body))
    return out


async def test_the_server_answers_bad_input_with_an_openai_4xx_and_stays_whole(jp_fetch, evalsched):
    async def post(route: str, body: bytes):
        resp = await jp_fetch(
            "evalsched", "v1", *route.split("/"), method="POST", body=body, raise_error=False, request_timeout=300
        )
        return resp.code, resp.headers.get("Content-Type", ""), resp.body.decode()

    def check_error(route, body, code, kind, text):
        assert 400 <= code < 500, (route, body, code, text[:300])
        assert kind.startswith("application/json"), (route, body, kind)
        error = json.loads(text)["error"]
        assert set(error) == {"message", "type", "code", "param"} and error["type"] == "invalid_request_error"
        return error

    raw = [
        b"",
        b"null",
        b"{not json",
        b"[" * 100000 + b"]" * 100000,  # deeper than the parser goes
        b'{"model": "lm", "prompt": "x", "max_tokens": 1e999}',
        b'{"model": "lm", "prompt": "x", "temperature": NaN}',
        b'{"model": "lm", "prompt": "\\ud800"}',
        b'{"model": "lm", "prompt": "x", "\\udfff": 1}',
        b'{"model": "lm", "prompt": "x"',
        b"\xff\xfe not utf-8",
    ]
    for body in raw:
        check_error("completions", body, *(await post("completions", body)))
    for route, body, param in CASES:
        error = check_error(route, body, *(await post(route, json.dumps(body).encode())))
        assert error["param"] == param, (route, body, error)
    # What only the model knows: a prompt longer than its context (alone, in a list, in a stream),
    # a token outside its vocabulary.
    for body in (
        {**C, "prompt": "the cat " * 400},
        {**C, "prompt": ["fine", "the cat " * 400]},
        {**C, "prompt": ["fine", "the cat " * 400], "stream": True},
        {**C, "prompt": [[10**9]]},
        {**CHAT, "messages": [{"role": "user", "content": "the cat " * 400}], "stream": True},
    ):
        route = "chat/completions" if "messages" in body else "completions"
        error = check_error(route, body, *(await post(route, json.dumps(body).encode())))
        assert error["param"] in ("prompt", "messages"), (body, error)
    # Bodies near valid ones: a 200 or a 4xx, never anything else.
    statuses = set()
    for route, body in mutations(seed=31, count=60):
        code, kind, text = await post(route, json.dumps(body).encode())
        statuses.add(code)
        if code != 200:
            check_error(route, body, code, kind, text)
    assert 200 in statuses and 400 in statuses
    # The model host is whole: nothing failed, nothing queued, and it still answers.
    # (Greedy: sampled, the first token could be the end of text, one answer in a few hundred.)
    code, _, text = await post("completions", json.dumps({**C, "max_tokens": 2, "temperature": 0}).encode())
    assert code == 200 and json.loads(text)["usage"]["completion_tokens"] == 2
    figures = (await evalsched.models.ask("lm", {"op": "describe"}))["describe"]
    assert figures["failed_requests"] == 0 and figures["queued"] == 0


def test_a_token_that_is_part_of_a_character_has_the_bytes_it_stands_for():
    """A token that is half a character is named ``bytes:\\xf8`` (as OpenAI names one); its
    ``bytes`` are that byte, which a client joins with the next token's to rebuild the character.
    They were the bytes of the name (``b"bytes:\\\\xf8"``)."""
    from jupyter_evalsched.openai_shapes import chat_logprobs

    entries = [
        {"token": "bytes:\\xe6\\x97", "logprob": -0.5, "top": [("bytes:\\xe6\\x97", -0.5), ("h\u00e9", -2.0)]},
        {"token": "bytes:\\xa5", "logprob": -0.1, "top": None},
        {"token": "bytes:x", "logprob": -0.1, "top": None},  # (not a byte's name: its text)
    ]
    content = chat_logprobs(entries)["content"]
    assert bytes(content[0]["bytes"] + content[1]["bytes"]).decode() == "\u65e5"
    assert [t["bytes"] for t in content[0]["top_logprobs"]] == [[0xE6, 0x97], list("h\u00e9".encode())]
    assert content[2]["bytes"] == list(b"bytes:x")


def test_the_model_files_digest_follows_a_linked_directory_and_survives_a_loop(tmp_path):
    """A model directory whose tokenizer is a link to a directory elsewhere: a file rewritten
    there changes the digest (it did not: the walk did not follow links to directories, so the
    cache kept answering from the old files). A loop of links is walked once."""
    import os

    from jupyter_evalsched.openai_cache import model_digest

    real, model = tmp_path / "real", tmp_path / "model"
    real.mkdir()
    model.mkdir()
    (model / "config.json").write_text("{}")
    (real / "tok.json").write_text("{}")
    (model / "tokenizer").symlink_to(real)
    (real / "loop").symlink_to(model)  # back up: walked once
    before = model_digest(str(model))
    info = (real / "tok.json").stat()
    os.utime(real / "tok.json", ns=(info.st_atime_ns, info.st_mtime_ns + 10**9))
    assert model_digest(str(model)) != before


def test_a_model_file_whose_name_is_not_utf8_is_digested_and_loads(tmp_path):
    """``os.walk`` gives such a name with surrogates, which the digest's strict encoding refused:
    a UnicodeEncodeError in the model host's load, outside its guard, ended the host (exit 70) at
    every load of that model, for every user of it."""
    import os

    from jupyter_evalsched.openai_cache import model_digest
    from jupyter_evalsched.shared_models.host import _files_of

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    with open(os.path.join(os.fsencode(model), b"w\xff.bin"), "wb"):
        pass
    digest = model_digest(str(model))
    assert isinstance(digest, str) and _files_of(str(model)) == digest
    assert _files_of(str(tmp_path / "none")) is None


@pytest.mark.parametrize("route", ["completions", "chat/completions"])
def test_an_empty_stop_list_is_no_stop_sequence(route):
    """Harnesses send ``"stop": []`` for tasks without stop sequences: it is none, not an error."""
    if route == "completions":
        (request,) = parse_completion({**C, "stop": []})[2]
    else:
        request = parse_chat({**CHAT, "stop": []})[2]
    assert request["stop"] == []
