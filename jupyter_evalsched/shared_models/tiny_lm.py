"""A tiny GPT-2-style causal language model, built offline, for tests, benchmarks and the demo.

``build_tiny_gpt2(directory)`` writes (once) a randomly initialised 2-layer GPT-2 (64 dims) and a
byte-level BPE tokenizer trained with ``tokenizers`` on text this package ships (the sentences of
``examples/data/sentence_pairs.jsonl`` and the tiny BERT's word list), with a chat template, both
saved with ``save_pretrained``. No hub, no download; the same seed gives the same files, so every
process that loads the directory computes the same logits. Serve it with the causal-LM loader::

    {"name": "tiny-lm", "loader": "jupyter_evalsched.shared_models.loaders:causal_lm",
     "model": build_tiny_gpt2("/some/cache/dir")}

or let ``load_tiny_lm`` build it on first use (``"loader": "...tiny_lm:load_tiny_lm"``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

EOS = "<|endoftext|>"
ROLE_TOKENS = ["<|system|>", "<|user|>", "<|assistant|>"]
VOCAB_SIZE = 512
CONTEXT = 256  # n_positions: small, so that a test can exceed it cheaply
# Each message is "<|role|>\ncontent<|endoftext|>\n"; the generation prompt opens the assistant's turn.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}" + EOS + "\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def training_text() -> list[str]:
    """The corpus the tokenizer learns from: text shipped inside this package, in a fixed order."""
    from .tiny import WORDS

    data = Path(__file__).resolve().parent.parent / "examples" / "data" / "sentence_pairs.jsonl"
    lines: list[str] = []
    for line in data.read_text(encoding="utf-8").splitlines():
        if line.strip():
            pair = json.loads(line)
            lines += [pair["a"], pair["b"]]
    lines.append(" ".join(WORDS))
    return lines


def build_tiny_gpt2(directory: str | os.PathLike, *, seed: int = 0) -> str:
    """Build the tiny causal LM into ``directory`` unless it is already there; return the path.

    Safe to call from several processes at once: each builds in a temporary sibling and renames
    it into place; the first rename wins and the others discard theirs.
    """
    directory = os.path.abspath(directory)
    if os.path.isfile(os.path.join(directory, "config.json")):
        return directory
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    # trim_offsets=False: a token's offsets cover its leading space, as its text does.
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=[EOS, *ROLE_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(training_text(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=EOS,
        eos_token=EOS,
        unk_token=EOS,
        pad_token=EOS,
        additional_special_tokens=ROLE_TOKENS,
        model_max_length=CONTEXT,
    )
    fast.chat_template = CHAT_TEMPLATE
    config = GPT2Config(
        vocab_size=tokenizer.get_vocab_size(),
        n_positions=CONTEXT,
        n_embd=64,
        n_layer=2,
        n_head=2,
        bos_token_id=tokenizer.token_to_id(EOS),
        eos_token_id=tokenizer.token_to_id(EOS),
        pad_token_id=tokenizer.token_to_id(EOS),
    )
    torch.manual_seed(seed)
    model = GPT2LMHeadModel(config).eval()

    from .tiny import save_into

    return save_into(directory, ".tiny-gpt2-", model, fast)


def load_tiny_lm(model: str | None = None, device: str = "cpu", dtype: str | None = None, **options):
    """Shared-model loader: build the tiny causal LM into ``model`` (a directory) if needed, then
    serve it as ``loaders.causal_lm`` does."""
    if not model:
        raise ValueError("load_tiny_lm needs 'model': the directory to build the tiny model in")
    from .loaders import causal_lm

    return causal_lm(model=build_tiny_gpt2(model), device=device, dtype=dtype, **options)
