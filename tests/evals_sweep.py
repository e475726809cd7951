"""Evals for the sweep and comparison tests (#18), run as file entrypoints. Standard library only."""

import random


def scored(ctx, index):
    """``score`` = ``params["base"]`` + ``params["slope"]`` · index² + noise drawn from the
    episode's seed (so two runs share an episode's noise: with the same slope, paired differences
    are exactly the difference of their bases; with different slopes they spread), and ``step``
    = the index. Raises at episode ``params["fail_at"]`` when it is given."""
    if ctx.params.get("fail_at") is not None and index >= int(ctx.params["fail_at"]):
        raise RuntimeError(f"failing at episode {index} as asked")
    noise = random.Random(ctx.seed).random()
    trend = float(ctx.params.get("slope", 0.0)) * index * index
    return {"score": float(ctx.params.get("base", 0.0)) + trend + noise, "step": float(index)}


def spread(ctx, index):
    """``score`` = ``params["slope"]`` · index² + the episode seed's noise: paired differences of two
    runs with different slopes differ from episode to episode (a confidence interval with width)."""
    noise = random.Random(ctx.seed).random()
    return {"score": float(ctx.params.get("slope", 0.0)) * index * index + noise}


def many(ctx, index):
    """``params["names"]`` metrics per episode, ``m00000``, ``m00001``, ..."""
    return {f"m{i:05d}": float(index + i) for i in range(int(ctx.params["names"]))}
