"""A generation's text decoded a token at a time (``shared_models/detokenize.py``) reads exactly as
decoding every prefix whole did, for byte-level BPE (GPT-2's) and for a SentencePiece-style
tokenizer (Llama's: a leading-space marker and byte fallback), in time linear in the tokens; and
the model host's answers built on it (pieces, offsets, stop strings, log-probabilities) are
right for text with characters split across tokens. Real tokenizers, built offline; a real tiny
GPT-2 whose token choice is scripted, so that the text is known."""

from __future__ import annotations

import json
import random
import re

import pytest
import torch
import transformers

from jupyter_evalsched.shared_models.causal import json_logprob, load_causal_lm
from jupyter_evalsched.shared_models.detokenize import REPLACEMENT, IncrementalText, offsets
from jupyter_evalsched.shared_models.tiny_lm import build_tiny_gpt2

# Characters the tokenizers' training text has none of: they are split into byte tokens.
TEXT = "café ж 🎉 naïve 日本語 hello world, résumé € 𝔘 done. stop here"


@pytest.fixture(scope="module")
def gpt2_tokenizer(tmp_path_factory):
    directory = build_tiny_gpt2(tmp_path_factory.getbasetemp() / "models" / "tiny-gpt2")
    return transformers.AutoTokenizer.from_pretrained(directory)


@pytest.fixture(scope="module")
def llama_style_tokenizer():
    """What Llama's ``tokenizer.json`` holds: ``▁`` for spaces (one before the text), BPE with
    byte fallback, and a decoder that strips the first space of whatever it decodes."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    corpus = ["the quick brown fox jumps over the lazy dog", "hello world, hello there.", "cafe naive done"] * 20
    specials = ["<unk>", "<s>", "</s>"]
    tokenizer = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tokenizer.pre_tokenizer = pre_tokenizers.Split("▁", behavior="merged_with_next")
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tokenizer.train_from_iterator(corpus, trainer=trainers.BpeTrainer(vocab_size=120, special_tokens=specials))
    # The byte tokens are ordinary tokens of the vocabulary, as in Llama's (not special ones,
    # which a decode that skips special tokens would drop).
    trained = json.loads(tokenizer.to_str())["model"]
    vocab = dict(trained["vocab"])
    for byte in range(256):
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    merges = [tuple(merge) if isinstance(merge, list) else tuple(merge.split(" ")) for merge in trained["merges"]]
    tokenizer.model = models.BPE(vocab, merges, byte_fallback=True, unk_token="<unk>", fuse_unk=True)
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


@pytest.fixture(params=["gpt2", "llama-style"])
def tokenizer(request, gpt2_tokenizer, llama_style_tokenizer):
    return gpt2_tokenizer if request.param == "gpt2" else llama_style_tokenizer


def run_is_whole(tokenizer) -> bool:
    """Whether a decode of a token prefix writes each complete character as itself. Byte-level
    BPE does; a byte-fallback decoder writes a run of byte tokens that ends inside a character as
    one U+FFFD per byte, the run's complete characters too (``日`` + half of ``本`` reads
    ``\ufffd\ufffd\ufffd\ufffd``): decoding prefixes whole then puts the next token's
    start before characters already complete, where decoding a token at a time does not."""
    return tokenizer.decode(tokenizer("日本", add_special_tokens=False)["input_ids"][:-1]).startswith("日")


def whole_prefix_pieces(decode, ids: list[int]) -> list[str]:
    """The reference: each token's piece from decoding every prefix whole (quadratic)."""
    pieces, emitted = [], ""
    for count in range(1, len(ids) + 1):
        prefix = decode(ids[:count])
        if prefix.endswith(REPLACEMENT) or not prefix.startswith(emitted):
            pieces.append("")
            continue
        pieces.append(prefix[len(emitted) :])
        emitted = prefix
    return pieces


def whole_prefix_offsets(decode, ids: list[int]) -> list[int]:
    return [len(decode(ids[:count]).rstrip(REPLACEMENT)) for count in range(len(ids))]


def sequences(tokenizer) -> list[list[int]]:
    """A text with split characters, and random token sequences (seeded): words of it encoded
    alone, mixed with any tokens of the vocabulary (special ones included, and GPT-2's stray
    bytes) but a byte-fallback tokenizer's byte tokens, which no encoding leaves stray."""

    def encode(text):
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    byte_tokens = {token for text, token in tokenizer.get_vocab().items() if re.fullmatch(r"<0x[0-9A-F]{2}>", text)}
    ordinary = [token for token in range(len(tokenizer)) if token not in byte_tokens]
    out = [encode(TEXT)]
    for seed in range(40):
        rng = random.Random(seed)
        ids: list[int] = []
        for _ in range(rng.randrange(1, 30)):
            if rng.random() < 0.5:
                ids += encode(rng.choice(TEXT.split()) + rng.choice([" ", "", ", "]))
            else:
                ids.append(rng.choice(ordinary))
        out.append(ids)
    return out


@pytest.mark.parametrize("skip_special", [True, False])
def test_pieces_and_offsets_read_as_decoding_every_prefix_whole(tokenizer, skip_special):
    def decode(ids):
        return tokenizer.decode(ids, skip_special_tokens=skip_special)

    split = 0
    for ids in sequences(tokenizer):
        text = IncrementalText(decode)
        reaches = []
        for token in ids:
            reaches.append(text.reach)
            text.add(token)
        assert text.pieces == whole_prefix_pieces(decode, ids), ids
        assert reaches == offsets(decode, ids) == sorted(reaches)
        whole, settled = decode(ids), "".join(text.pieces)
        assert text.length == len(settled)
        if run_is_whole(tokenizer):
            assert reaches == whole_prefix_offsets(decode, ids), ids
            assert whole == settled + text.pending, ids  # what is not settled yet is pending
        else:  # the same wherever no prefix ends inside a character
            assert all(
                reach == offset
                for count, (reach, offset) in enumerate(zip(reaches, whole_prefix_offsets(decode, ids), strict=True))
                if REPLACEMENT not in decode(ids[:count])
            ), ids
            assert REPLACEMENT in whole or whole == settled + text.pending, ids
        split += sum(1 for piece in text.pieces if piece == "")
    assert split > 0  # the cases that matter were there: tokens that end inside a character


def test_decoding_a_long_generation_costs_time_linear_in_its_tokens(gpt2_tokenizer):
    """Counted, not timed: how many tokens the decoder is handed for 4,000 tokens (decoding every
    prefix whole hands it 8 million)."""
    ids = (gpt2_tokenizer(TEXT, add_special_tokens=False)["input_ids"] * 200)[:4000]
    handed = 0

    def decode(part):
        nonlocal handed
        handed += len(part)
        return gpt2_tokenizer.decode(part, skip_special_tokens=True)

    text = IncrementalText(decode)
    for token in ids:
        text.add(token)
    assert handed < 10 * len(ids), handed
    assert "".join(text.pieces) + text.pending == gpt2_tokenizer.decode(ids, skip_special_tokens=True)


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    return load_causal_lm(build_tiny_gpt2(tmp_path_factory.getbasetemp() / "models" / "tiny-gpt2"))


def scripted(lm, monkeypatch, text: str) -> list[int]:
    """The real model runs; the token each step picks is the next of ``text``'s tokens."""
    script = lm.tokenizer(text, add_special_tokens=False)["input_ids"]
    picks = {}

    def pick(logits, state):
        taken = picks.setdefault(id(state), iter(script))
        return next(taken, lm.eos_id)

    monkeypatch.setattr(lm, "_pick", pick)
    return script


def run(lm, request: dict) -> tuple[dict, list[dict]]:
    deltas: list[dict] = []
    [answer] = lm.openai_batch([dict(request)], on_delta=lambda index, delta: deltas.append(delta))
    return answer, deltas


@pytest.mark.parametrize("echo", [False, True])
def test_an_answer_with_split_characters_streams_as_it_reads_whole(lm, monkeypatch, echo):
    """Stream and plain answers agree on the pieces, the text and every token's offset; each
    offset points at its token's text; a stop string spanning tokens cuts the text."""
    script = scripted(lm, monkeypatch, TEXT)
    assert sum(1 for token in script if REPLACEMENT in lm.tokenizer.decode([token])) >= 3
    request = {"prompt": "Say:", "max_tokens": len(script) + 3, "logprobs": 2, "echo": echo, "stop": [". stop"]}
    plain, _ = run(lm, request)
    streamed, deltas = run(lm, {**request, "stream": True})
    want = TEXT[: TEXT.index(". stop")]
    assert plain["text"] == streamed["text"] == want
    assert plain["finish_reason"] == "stop"
    assert "".join(plain["pieces"]) == want
    assert "".join(piece for delta in deltas[1:] for piece in delta["pieces"]) == want
    head = len(plain["prompt_text"]) if echo else 0
    generated = plain["logprobs"][len(deltas[0]["logprobs"] or []) :]
    streamed_entries = [entry for delta in deltas[1:] for entry in delta["logprobs"]]
    assert [e["offset"] for e in streamed_entries] == [e["offset"] for e in generated]
    for entry in generated:
        if not entry["token"].startswith("bytes:"):  # a piece of a character has no text of its own
            start = entry["offset"] - head
            assert want[start : start + len(entry["token"])] == entry["token"], entry


def test_a_generation_that_stops_inside_a_character_keeps_its_start(lm, monkeypatch):
    """Stopped by its length after half a character, the text ends with U+FFFD, as decoding
    the tokens whole gives, and the pieces add up to it."""
    script = scripted(lm, monkeypatch, "ok 🎉")
    half = next(n for n in range(1, len(script) + 1) if lm.tokenizer.decode(script[:n]).endswith(REPLACEMENT))
    answer, deltas = run(lm, {"prompt": "x", "max_tokens": half, "temperature": 0.0, "stream": True})
    assert answer["text"] == lm.tokenizer.decode(script[:half]) and answer["text"].endswith(REPLACEMENT)
    assert "".join(answer["pieces"]) == answer["text"]
    assert "".join(piece for delta in deltas[1:] for piece in delta["pieces"]) == answer["text"]


def test_a_log_probability_that_is_no_number_is_sent_as_valid_json(lm, monkeypatch):
    """A forward pass that overflows (float16) gives NaN logits: the answer stays JSON (NaN is
    null, -inf a very low number), for the generated tokens and the echoed prompt alike."""
    forward = lm.model.forward

    def overflowing(*args, **kwargs):
        out = forward(*args, **kwargs)
        out.logits = torch.full_like(out.logits, float("nan"))
        return out

    monkeypatch.setattr(lm.model, "forward", overflowing)
    answer, _ = run(lm, {"prompt": "a b c", "max_tokens": 3, "logprobs": 2, "echo": True})
    json.dumps(answer, allow_nan=False)  # raises on NaN or infinity
    assert answer["logprobs"][-1]["logprob"] is None
    assert [json_logprob(v) for v in (float("-inf"), float("nan"), float("inf"), -1.5)] == [-9999.0, None, None, -1.5]
