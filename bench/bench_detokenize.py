"""What one generation's text costs the model host's batcher thread, by its length: decoding a
token at a time (``shared_models/detokenize.py``, what the host does now) against decoding every
prefix whole (what it did before: quadratic), measured in the same run, alternating.

    .venv/bin/python bench/bench_detokenize.py [--tokens 1000,2000,4000,8000] [--rounds 3]

An in-process breakdown, labelled as such: the tokenizer is the tiny GPT-2's (byte-level BPE,
``shared_models/tiny_lm.py``), the text a mix of words and characters split across tokens; per
token, both do what a streamed request with a stop string and ``logprobs`` needs (its piece, its
offset, the stop-string check), and once at the end the answer's pieces. No model runs: a
forward pass costs the same either way. The thread is shared by every caller of the model, so
this time is added to every request batched with the long one.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from jupyter_evalsched.shared_models.detokenize import REPLACEMENT, IncrementalText
from jupyter_evalsched.shared_models.stops import StopStrings
from jupyter_evalsched.shared_models.tiny_lm import build_tiny_gpt2

TEXT = "café ж 🎉 naïve 日本語 hello world, résumé € the quick brown fox jumps over the lazy dog. "
STOPS = ["<|stop|>", "\n\n\n"]


def a_token_at_a_time(decode, ids: list[int]) -> int:
    text, stops = IncrementalText(decode), StopStrings(STOPS)
    starts = []
    for token in ids:
        starts.append(text.reach)
        text.add(token)
        if stops.feed(text.pieces[-1]) or stops.ends_in(text.pending.rstrip(REPLACEMENT)):  # (as causal.py)
            break
    return len(text.pieces) + len(starts)


def every_prefix_whole(decode, ids: list[int]) -> int:
    pieces, emitted, starts = [], "", []
    for count in range(1, len(ids) + 1):
        prefix = decode(ids[:count])  # the stream's piece, the stop check: one decode
        if any(stop in prefix for stop in STOPS):
            break
        starts.append(len(decode(ids[: count - 1]).rstrip(REPLACEMENT)))  # the offset
        if prefix.endswith(REPLACEMENT) or not prefix.startswith(emitted):
            pieces.append("")
            continue
        pieces.append(prefix[len(emitted) :])
        emitted = prefix
    return len(pieces) + len(starts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", default="1000,2000,4000,8000")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    import transformers

    with tempfile.TemporaryDirectory() as scratch:
        tokenizer = transformers.AutoTokenizer.from_pretrained(build_tiny_gpt2(Path(scratch) / "lm"))

    def decode(ids):
        return tokenizer.decode(ids, skip_special_tokens=True)

    unit = tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    print("In-process breakdown: one generation's text work in the batcher thread (no model), tiny GPT-2 tokenizer")
    print(f"{'tokens':>7} {'token at a time':>16} {'every prefix':>13} {'ratio':>7}")
    for n in (int(x) for x in args.tokens.split(",")):
        ids = (unit * (n // len(unit) + 1))[:n]
        new, old = [], []
        for round_ in range(args.rounds):
            order = [(a_token_at_a_time, new), (every_prefix_whole, old)]
            for way, into in order if round_ % 2 == 0 else reversed(order):
                start = time.perf_counter()
                way(decode, ids)
                into.append(time.perf_counter() - start)
        fast, slow = statistics.median(new), statistics.median(old)
        print(f"{n:>7} {fast * 1000:>13.1f} ms {slow * 1000:>10.0f} ms {fast / slow:>6.3f}x")


if __name__ == "__main__":
    main()
