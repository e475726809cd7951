"""A tiny BERT, built offline from a config, for tests, benchmarks and demos without a model hub.

``build_tiny_bert(directory)`` writes (once) a 2-layer BERT with hidden size 32 and a WordLevel
tokenizer into ``directory``; ``load_tiny`` is a shared-model loader that builds it if needed and
then loads it back through the real ``pipeline("feature-extraction", ...)`` path::

    {"name": "tiny", "loader": "jupyter_evalsched.shared_models.tiny:load_tiny",
     "model": "/some/cache/dir"}

The weights are random but fixed (seeded), so every process that loads the directory computes
the same outputs. The vocabulary covers the words of ``examples/data/sentence_pairs.jsonl``.
"""

from __future__ import annotations

import os
import shutil
import tempfile

SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
WORDS = """
a an the this that these those is are was were be been being am do does did have has had
i you he she it we they me him her us them my your his its our their mine yours
and or but if then so because while with without of in on at by for from to into over under
about after before between through during up down out off again very too also not no yes
cat cats dog dogs bird birds fish horse cow animal animals pet pets kitten puppy
man woman child children boy girl people person friend friends teacher doctor student
car cars bus train plane bike road street city town house home room kitchen garden door window
sun moon star sky rain snow wind weather cold hot warm day night morning evening today tomorrow
food bread cheese apple apples fruit water coffee tea milk dinner lunch breakfast soup cake
eat eats ate eating drink drinks drank run runs ran running walk walks walked sleep sleeps slept
read reads book books write writes wrote letter play plays played game music song sing sings
buy buys bought sell sells sold pay paid money price cheap expensive market shop store
big small large little old new young good bad happy sad fast slow quick quickly loud quiet
red blue green black white bright dark beautiful tired hungry angry
sat sits sitting mat chair table bed sofa floor
computer phone screen program code bug software data model network
stock stocks market markets fell rose shares investors company bank
football team won lost match goal player players score
meeting postponed cancelled moved week next last
learn learning study studies school university class lesson exam
doctor hospital medicine sick ill healthy
chef cooked meal pasta restaurant kitchen
""".split()


def vocabulary() -> list[str]:
    seen: dict[str, None] = {}
    for word in SPECIAL_TOKENS + WORDS:
        seen.setdefault(word, None)
    return list(seen)


def build_tiny_bert(directory: str, *, seed: int = 0) -> str:
    """Build the tiny model into ``directory`` unless it is already there; return the path.

    Safe to call from several processes at once: each builds in a temporary sibling and renames
    it into place; the first rename wins and the others discard theirs.
    """
    directory = os.path.abspath(directory)
    if os.path.isfile(os.path.join(directory, "config.json")):
        return directory
    import torch
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import BertConfig, BertModel, PreTrainedTokenizerFast

    vocab = {word: index for index, word in enumerate(vocabulary())}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Lowercase()])
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B [SEP]",
        special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])],
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        unk_token="[UNK]",
        pad_token="[PAD]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        mask_token="[MASK]",
        model_max_length=128,
    )
    config = BertConfig(
        vocab_size=len(vocab),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=128,
        pad_token_id=vocab["[PAD]"],
    )
    torch.manual_seed(seed)
    model = BertModel(config).eval()

    return save_into(directory, ".tiny-bert-", model, fast)


def save_into(directory: str, prefix: str, *parts) -> str:
    """``save_pretrained`` each of ``parts`` into a staging directory beside ``directory``, then
    rename it into place: several processes may build the same model at once, and the first
    rename wins (the others find a complete directory)."""
    parent = os.path.dirname(directory)
    os.makedirs(parent, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=prefix, dir=parent)
    try:
        for part in parts:
            part.save_pretrained(staging)
        try:
            os.rename(staging, directory)
        except OSError:
            if not os.path.isfile(os.path.join(directory, "config.json")):
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return directory


def load_tiny(model: str | None = None, device: str = "cpu", dtype: str | None = None, **options):
    """Shared-model loader: build the tiny BERT into ``model`` (a directory) if needed, then
    return ``pipeline("feature-extraction")`` over it (token embeddings, [1][tokens][32] each)."""
    if not model:
        raise ValueError("load_tiny needs 'model': the directory to build the tiny model in")
    path = build_tiny_bert(model)
    from transformers import pipeline

    if dtype is not None:
        options.setdefault("dtype", dtype)
    pipe = pipeline("feature-extraction", model=path, tokenizer=path, device=device, **options)

    return _TinyBertCaller(pipe)


class _TinyBertCaller:
    """The batch callable ``load_tiny`` returns; ``.pipeline`` is the transformers pipeline."""

    def __init__(self, pipeline):
        self.pipeline = pipeline

    def __call__(self, inputs: list, **kwargs):
        from .loaders import unpad_feature_extraction

        outputs = self.pipeline(inputs, **{"batch_size": len(inputs), **kwargs})
        return unpad_feature_extraction(self.pipeline, inputs, outputs, kwargs)
