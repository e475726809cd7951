"""Fixes of a review of the OpenAI-compatible routes: a run's key answers only for the models
its spec declares (whose memory the scheduler admitted with it); a ``base64`` embedding that
float32 cannot hold is the model's failure, not a 500; stop strings are matched in time linear
in the text (their length bounded), and the streamed text is still cut where it must be; echo
scoring keeps no batch x length x vocabulary tensor, and answers what the model computes."""

from __future__ import annotations

import base64
import json
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from rest import spec, submit

from jupyter_evalsched.openai_keys import run_key
from jupyter_evalsched.openai_shapes import MAX_STOP_CHARS
from jupyter_evalsched.shared_models.stops import StopStrings
from jupyter_evalsched.shared_models.tiny_lm import build_tiny_gpt2

UPPER = "jupyter_evalsched.shared_models.testing:upper"
FLOAT32_MAX = struct.unpack("<f", b"\xff\xff\x7f\x7f")[0]  # 3.4028234663852886e38
VECTORS = {"fine": [1.0, 2.0], "huge": [1e39, 1.0], "edge": [FLOAT32_MAX, -FLOAT32_MAX], "tiny": [1e-50, 1.0]}


@pytest.fixture(scope="module")
def tiny_lm_dir(tmp_path_factory):
    return build_tiny_gpt2(tmp_path_factory.mktemp("review-models") / "tiny-gpt2")


@pytest.fixture
def evalsched_config(tiny_lm_dir):
    return {
        "models": [
            {"name": "declared", "loader": UPPER},
            {"name": "undeclared", "loader": UPPER},
            {
                "name": "listed",
                "loader": "jupyter_evalsched.shared_models.testing:listed_vectors",
                "options": {"vectors": VECTORS},
            },
            {
                "name": "tiny-lm",
                "loader": "jupyter_evalsched.shared_models.loaders:causal_lm",
                "model": tiny_lm_dir,
                "cpu_threads": 1,
            },
        ]
    }


async def test_a_runs_key_answers_only_for_the_models_its_spec_declares(
    jp_fetch, jp_serverapp, api, evalsched, wait_for
):
    """A run's key (``OPENAI_API_KEY``) is answered for the models its spec names in ``models``
    only: any other is OpenAI's 404 ``model_not_found`` before it is loaded (the scheduler never
    admitted its memory for the run); the server's own token keeps every model."""
    app = jp_serverapp.extension_manager.extension_points["jupyter_evalsched"].app

    async def v1(method: str, path: str, body=None, key: str | None = None) -> tuple[int, dict]:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        kwargs = {"body": json.dumps(body)} if body is not None else {}
        resp = await jp_fetch(
            "evalsched", "v1", *path.split("/"), method=method, headers=headers, raise_error=False, **kwargs
        )
        return resp.code, json.loads(resp.body)

    run = await submit(api, spec(sleep_s=60, models=["declared"]))
    await wait_for(run["id"], states=("running",))
    key = run_key(app.model_host.api_secret, run["id"])

    code, listed = await v1("GET", "models", key=key)
    assert code == 200 and [m["id"] for m in listed["data"]] == ["declared"], listed
    code, found = await v1("GET", "models/declared", key=key)
    assert code == 200 and found["id"] == "declared", found
    # A declared model is served (this one does not embed: the model's own 400, past the key).
    code, answer = await v1("POST", "embeddings", {"model": "declared", "input": "x"}, key=key)
    assert code == 400 and "does not produce embeddings" in answer["error"]["message"], answer

    for method, path, body in [
        ("GET", "models/undeclared", None),
        ("POST", "embeddings", {"model": "undeclared", "input": "x"}),
        ("POST", "completions", {"model": "undeclared", "prompt": "x"}),
        ("POST", "chat/completions", {"model": "undeclared", "messages": [{"role": "user", "content": "x"}]}),
    ]:
        code, answer = await v1(method, path, body, key=key)
        error = answer["error"]
        assert code == 404 and error["code"] == "model_not_found" and error["param"] == "model", (path, answer)
        assert "'undeclared'" in error["message"] and "'models'" in error["message"], error
    # Never loaded for the run: no VRAM the ledger did not count.
    (undeclared,) = [m for m in await app.model_host.describe() if m["name"] == "undeclared"]
    assert undeclared["load_count"] == 0, undeclared

    # The server's own token: every model, as before.
    code, listed = await v1("GET", "models")
    assert code == 200 and [m["id"] for m in listed["data"]] == ["declared", "undeclared", "listed", "tiny-lm"], listed
    code, answer = await v1("POST", "embeddings", {"model": "undeclared", "input": "x"})
    assert code == 400 and "does not produce embeddings" in answer["error"]["message"], answer

    code, _ = await api("POST", f"runs/{run['id']}/cancel")
    await wait_for(run["id"], states=("cancelled",))


async def test_a_base64_embedding_beyond_float32_is_the_models_failure_not_a_500(jp_fetch, evalsched):
    """``encoding_format: "base64"`` is float32: a value beyond its range (``1e39``, which
    ``float`` carries as it is) was struct's OverflowError, a 500. It is the model's failure,
    as a value that is no finite number is: a 502 naming the input and the encoding that carries
    it, never an infinity the client would compute NaN from. Values float32 holds (its largest,
    one that rounds to 0) are answered."""

    async def embeddings(inputs: list[str], encoding: str) -> tuple[int, dict]:
        body = json.dumps({"model": "listed", "input": inputs, "encoding_format": encoding})
        resp = await jp_fetch("evalsched", "v1", "embeddings", method="POST", body=body, raise_error=False)
        return resp.code, json.loads(resp.body, parse_constant=lambda name: pytest.fail(f"{name} in the answer"))

    resp = await jp_fetch(
        "evalsched",
        "v1",
        "embeddings",
        method="POST",
        body=json.dumps({"model": "listed", "input": ["fine", "huge"], "encoding_format": "base64"}),
        raise_error=False,
    )
    # The same request fails the same way: OpenAI's clients, told so, do not send it twice more.
    assert resp.code == 502 and resp.headers.get("x-should-retry") == "false", dict(resp.headers)
    code, answer = await embeddings(["fine", "huge"], "base64")
    assert code == 502 and answer["error"]["code"] == "model_error", answer
    assert answer["error"]["type"] == "server_error", answer
    message = answer["error"]["message"]
    assert "its embedding of input 1 holds a value beyond float32's range" in message, message
    assert "'float' gives it as it is" in message, message

    code, answer = await embeddings(["fine", "huge"], "float")
    assert code == 200 and [d["embedding"] for d in answer["data"]] == [[1.0, 2.0], [1e39, 1.0]], answer

    code, answer = await embeddings(["edge", "tiny", "fine"], "base64")
    assert code == 200, answer
    decoded = [list(struct.unpack("<2f", base64.b64decode(d["embedding"]))) for d in answer["data"]]
    assert decoded == [[FLOAT32_MAX, -FLOAT32_MAX], [0.0, 1.0], [1.0, 2.0]], decoded


# -- stop strings ----------------------------------------------------------------------------


def held_back(text: str, stops: list[str]) -> int:
    """What a stream holds back, by definition: the longest end of ``text`` that is the start of
    a stop string (shorter than it)."""
    return max((size for stop in stops for size in range(1, len(stop)) if text.endswith(stop[:size])), default=0)


@settings(max_examples=300, deadline=None)
@given(
    stops=st.lists(st.text("ab\ufffd", min_size=1, max_size=7), min_size=1, max_size=4),
    steps=st.lists(st.tuples(st.text("abc", max_size=4), st.text("ab\ufffd", max_size=2)), max_size=14),
)
def test_stop_strings_agree_with_their_definition_token_by_token(stops, steps):
    """After each token (its settled piece, then the text of a token that ends inside a character,
    not kept), ``StopStrings`` says a stop string ended exactly when one first occurs in the text
    so far, and holds back what the definition does."""
    matcher, text = StopStrings(stops), ""
    for piece, pending in steps:
        found = matcher.feed(piece) or matcher.ends_in(pending)
        assert found == any(stop in text + piece + pending for stop in stops), (text, piece, pending)
        if found:
            return
        text += piece
        assert matcher.held == held_back(text, stops), text


def sse(body: bytes) -> list:
    return [
        line[len("data: ") :] if line == "data: [DONE]" else json.loads(line[len("data: ") :])
        for line in body.decode().split("\n\n")
        if line.startswith("data: ")
    ]


async def test_a_stop_string_across_tokens_cuts_the_stream_where_it_cuts_the_answer(jp_fetch, evalsched):
    """A stop string that starts inside one generated token and ends inside a later one, beside
    one that matches the text's start but never completes (held back, then released): the
    stream's text is the greedy text cut before the stop string, the same as without ``stream``,
    and finishes with ``stop``. A stop string over ``MAX_STOP_CHARS`` is a 400 naming ``stop``."""

    async def completions(body: dict) -> tuple[int, bytes]:
        resp = await jp_fetch("evalsched", "v1", "completions", method="POST", body=json.dumps(body), raise_error=False)
        return resp.code, resp.body

    for seed in range(1, 9):  # (sampled: the tiny model's greedy text repeats one token)
        base = {"model": "tiny-lm", "prompt": "The cat sat", "max_tokens": 40, "temperature": 1, "seed": seed}
        code, raw = await completions({**base, "logprobs": 0})
        assert code == 200, raw
        (choice,) = json.loads(raw)["choices"]
        full, tokens, starts = choice["text"], choice["logprobs"]["tokens"], choice["logprobs"]["text_offset"]
        # Three tokens of 2+ characters in a row: from the first's second character to the
        # third's first, a stop string that starts inside one token and ends inside another.
        words = [len(t) >= 2 and not t.startswith("bytes:") and "\ufffd" not in t for t in tokens]
        runs = [k for k in range(len(tokens) - 3) if all(words[k : k + 3])]
        if runs and full.find(stop := full[starts[runs[0]] + 1 : starts[runs[0] + 2] + 1]) == starts[runs[0]] + 1:
            break
    else:
        pytest.fail("no seed generates three word tokens in a row")
    cut = full.find(stop)
    never = full[: cut + 1] + "\u2603"  # the text's own start, then a character it never holds
    expected = full[:cut]

    code, raw = await completions({**base, "stop": [never, stop]})
    (choice,) = json.loads(raw)["choices"]
    assert code == 200 and (choice["text"], choice["finish_reason"]) == (expected, "stop"), (choice, stop)

    code, raw = await completions({**base, "stop": [never, stop], "stream": True})
    assert code == 200, raw
    chunks = sse(raw)
    assert chunks[-1] == "[DONE]", chunks
    choices = [c for chunk in chunks[:-1] for c in chunk["choices"]]
    assert "".join(c["text"] for c in choices) == expected, (choices, stop)
    assert choices[-1]["finish_reason"] == "stop", choices

    code, raw = await completions({**base, "stop": ["x" * (MAX_STOP_CHARS + 1)]})
    error = json.loads(raw)["error"]
    assert code == 400 and error["param"] == "stop", error
    assert f"at most {MAX_STOP_CHARS} characters long (one is {MAX_STOP_CHARS + 1})" in error["message"], error


# -- echo scoring ----------------------------------------------------------------------------

SCORED = ["The cat sat on the mat.", "x", "A dog", "Stocks fell sharply today because investors were worried.", ""]


def direct_scores(tiny_lm_dir: str, prompts: list[str], top: int) -> list[list]:
    """Each prompt's token log-probabilities and top ``top``, from the model alone, one prompt at
    a time: ``[None, (logprob, [(token, logprob), ...]), ...]``."""
    import torch
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_lm_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_lm_dir).eval()
    answers = []
    for prompt in prompts:
        ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        if not ids:
            answers.append([])
            continue
        with torch.no_grad():
            logprobs = torch.log_softmax(model(torch.tensor([ids])).logits[0, :-1].float(), dim=-1)
        scores: list = [None]
        for position, token in enumerate(ids[1:]):
            best = torch.topk(logprobs[position], top)
            pairs = list(zip(best.indices.tolist(), best.values.tolist(), strict=True))
            scores.append((float(logprobs[position, token]), pairs))
        answers.append(scores)
    return answers


def assert_close(got: list, expected: list) -> None:
    assert len(got) == len(expected)
    for mine, theirs in zip(got, expected, strict=True):
        if theirs is None:
            assert mine is None
            continue
        assert mine[0] == pytest.approx(theirs[0], abs=1e-5)
        assert [t for t, _ in mine[1]] == [t for t, _ in theirs[1]]
        assert [v for _, v in mine[1]] == pytest.approx([v for _, v in theirs[1]], abs=1e-5)


@pytest.mark.parametrize("chunk_positions", [3, 40])
def test_echo_scores_are_the_models_own_in_passes_and_chunks_of_bounded_memory(
    tiny_lm_dir, monkeypatch, chunk_positions
):
    """The prompts to score, in the model host's model: grouped into forward passes whose logits
    stay within the budget (here two prompts' worth) and their log-probabilities computed in
    blocks of ``chunk_positions`` positions' worth (3: a few positions of one prompt at a time;
    40: several prompts at a time), every figure equals the model's own, computed one prompt at a
    time; the largest tensor the scoring makes past the forward pass is one block."""
    import torch

    from jupyter_evalsched.shared_models import causal
    from jupyter_evalsched.shared_models.loaders import causal_lm

    lm = causal_lm(model=tiny_lm_dir)
    ids = [lm.tokenizer(prompt, add_special_tokens=False)["input_ids"] for prompt in SCORED]
    expected = direct_scores(tiny_lm_dir, SCORED, 3)
    vocab = lm.model.config.vocab_size
    longest = max(map(len, ids))
    monkeypatch.setattr(causal, "SCORE_LOGITS_BYTES", 2 * longest * vocab * 4)
    monkeypatch.setattr(causal, "SCORE_CHUNK_BYTES", chunk_positions * vocab * 4)
    sizes: list[tuple[int, ...]] = []
    passes: list[tuple[int, int]] = []
    real_log_softmax, real_forward = torch.log_softmax, lm.model.forward

    def log_softmax(tensor, *args, **kwargs):
        sizes.append(tuple(tensor.shape))
        return real_log_softmax(tensor, *args, **kwargs)

    def forward(*args, **kwargs):
        passes.append(tuple(kwargs["input_ids"].shape))
        return real_forward(*args, **kwargs)

    monkeypatch.setattr(torch, "log_softmax", log_softmax)
    monkeypatch.setattr(lm.model, "forward", forward)
    for got, theirs in zip(lm._score(ids, 3), expected, strict=True):
        assert_close(got, theirs)
    # Every prompt in one pass (the empty one in none), each pass's logits within the budget.
    assert sum(rows for rows, _ in passes) == 4 and len(passes) >= 2, passes
    assert all(rows * length * vocab * 4 <= causal.SCORE_LOGITS_BYTES for rows, length in passes), passes
    assert sizes and all(rows * positions <= chunk_positions and v == vocab for rows, positions, v in sizes), sizes
    assert (max(rows for rows, _, _ in sizes) > 1) == (chunk_positions >= longest), sizes  # (rows at once)
    assert lm._score([[5], [7], []], 3) == [[None], [None], []]  # (one token each: nothing to score)


async def test_echo_scoring_through_the_route_answers_the_models_figures(jp_fetch, evalsched, tiny_lm_dir):
    """``echo`` with ``logprobs`` and ``max_tokens: 0`` (what loglikelihood evaluations send),
    prompts of different lengths in one request: each token's log-probability and its top ones
    are the model's own, computed directly."""
    body = {"model": "tiny-lm", "prompt": SCORED, "max_tokens": 0, "echo": True, "logprobs": 3}
    resp = await jp_fetch("evalsched", "v1", "completions", method="POST", body=json.dumps(body))
    choices = json.loads(resp.body)["choices"]
    expected = direct_scores(tiny_lm_dir, SCORED, 3)
    for choice, theirs in zip(choices, expected, strict=True):
        logprobs = choice["logprobs"]
        assert choice["text"] == SCORED[choice["index"]]
        assert logprobs["token_logprobs"][:1] == [None][: len(theirs)]
        assert logprobs["token_logprobs"][1:] == pytest.approx([t[0] for t in theirs[1:]], abs=1e-5)
        for tops, (_, pairs) in zip(logprobs["top_logprobs"][1:], theirs[1:], strict=True):
            assert sorted(tops.values(), reverse=True) == pytest.approx([v for _, v in pairs], abs=1e-5)


def test_a_stop_string_with_a_replacement_character_waits_for_the_character_to_settle(tiny_lm_dir):
    """A text that ends inside a character shows U+FFFD in its place until the character's next
    bytes come: a stop string holding U+FFFD must not match that placeholder (it cut "dinner"
    followed by a character of three tokens at "dinne"). The stopped text is the whole text cut
    before the stop string's first place in it, as the non-streamed answer cuts it."""
    from jupyter_evalsched.shared_models.loaders import causal_lm

    lm = causal_lm(model=tiny_lm_dir)
    base = {"prompt": "A", "max_tokens": 30, "temperature": 2.0, "top_p": 1.0}
    for seed, stops in (
        (929, ["ay\ufffd", "ay", "r\ufffd", "r\u2603"]),
        (791, ["\ufffd\ufffd,\x0c2", "b\u2603", "\ufffd\ufffd"]),
    ):
        (full,) = lm.openai_batch([{**base, "seed": seed}])
        (stopped,) = lm.openai_batch([{**base, "seed": seed, "stop": stops}])
        text = full["text"]
        cut = min((text.find(stop) for stop in stops if stop in text), default=len(text))
        assert stopped["text"] == text[:cut], (seed, text, stops, stopped)
