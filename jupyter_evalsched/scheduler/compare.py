"""Runs side by side (docs/reference.md, "Sweeps and comparison"). Pure functions of run records and
their episodes (from ``episodes.jsonl``).

For each run and metric: the mean over the episodes where the metric is a finite number, its
standard error (sample standard deviation / sqrt(n)) and n. Against the baseline run: the paired
differences over the episode indices both runs have (the same index means the same seed, so the
pairing removes the episodes' own variance), their mean, and a 95 % Student t interval,
mean ± t(0.975, n - 1) · sd / sqrt(n) (no interval below two pairs). The t quantile is computed
here (regularised incomplete beta, bisection): no scipy.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

from ..contract import MAX_METRIC_NAME_CHARS, MAX_METRIC_NAMES

# A whole sweep can be compared (sweeps.MAX_SWEEP_RUNS): what bounds a comparison is the time and
# the values it reads (below), not how many runs hold them.
MAX_COMPARE_RUNS = 1000
# The comparisons' worker processes (comparisons.py), how many comparisons are admitted at once (a
# 429 beyond), how long one may take from its admission (a 503 after), and how many episode metric
# values it may read in all (a 413 beyond).
COMPARE_WORKERS = 2
MAX_CONCURRENT_COMPARES = 4
COMPARE_TIMEOUT_S = 60.0
MAX_COMPARE_VALUES = 4_000_000


class EpisodeMetrics:
    """``{index: {metric: value}}`` of ``episodes.jsonl`` lines, taken one at a time (so that a
    run's file is read as a stream, never held whole), in ``by_index``; ``values`` counts the
    values held. A later line for an index (a later attempt ran it again) replaces an earlier
    one; non-finite values, non-numbers and names longer than MAX_METRIC_NAME_CHARS are left out
    (an index whose latest line holds no value is not in ``by_index``). At most ``max_names`` distinct metric names are kept (the first seen); the names beyond them
    are left out and listed in ``dropped`` (each once, up to MAX_DROPPED_LISTED)."""

    MAX_DROPPED_LISTED = 65536

    def __init__(self, max_names: int = MAX_METRIC_NAMES) -> None:
        self.by_index: dict[int, dict[str, float]] = {}
        self.values = 0
        self.max_names = max_names
        # Each name kept, mapped to its one copy: the lines' own copies are not held per episode.
        self._kept: dict[str, str] = {}
        self._left_out: dict[str, None] = {}

    @property
    def dropped(self) -> list[str]:
        return list(self._left_out)

    def add(self, line: Mapping[str, Any]) -> None:
        index = line.get("index")
        metrics = line.get("metrics")
        if type(index) is not int or not isinstance(metrics, Mapping):
            return
        kept = self._kept
        values = {}
        for name, value in metrics.items():
            value = _finite_float(value)
            if value is None:
                continue
            key = kept.get(name) if type(name) is str else None
            if key is None:
                key = str(name)
                if len(key) > MAX_METRIC_NAME_CHARS:
                    continue
                if len(kept) >= self.max_names:
                    if len(self._left_out) < self.MAX_DROPPED_LISTED:
                        self._left_out[key] = None
                    continue
                kept[key] = key
            values[key] = value
        # A line without a value replaces an earlier one as no entry at all (what the answer makes
        # of an empty one): what is held is bounded by the values, not by the lines.
        earlier = self.by_index.pop(index, None) if not values else self.by_index.get(index)
        if earlier is not None:
            self.values -= len(earlier)
        if values:
            self.by_index[index] = values
            self.values += len(values)


def _finite_float(value: object) -> float | None:
    """A metric value as a finite float, or None (not a number, not finite, or an int too large
    for a float)."""
    if not isinstance(value, int | float):  # (bool is an int: 1.0 or 0.0)
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


def _mean_sd(values: list[float]) -> tuple[float | None, float | None]:
    """Their mean and sample standard deviation; None for what is not a finite float (values near
    the float's limits overflow the sums): a comparison answers null there, never a 500 or a
    non-JSON ``Infinity``."""
    n = len(values)
    try:
        mean = math.fsum(values) / n
    except (OverflowError, ValueError):  # (ValueError: differences that overflowed both ways, inf - inf)
        return None, None
    if not math.isfinite(mean):
        return None, None
    if n < 2:
        return mean, None
    try:
        sd = math.sqrt(math.fsum((v - mean) ** 2 for v in values) / (n - 1))
    except (OverflowError, ValueError):
        return mean, None
    return mean, (sd if math.isfinite(sd) else None)


def summarize(values: list[float]) -> dict[str, float | int | None]:
    n = len(values)
    if n == 0:
        return {"mean": None, "stderr": None, "count": 0}
    mean, sd = _mean_sd(values)
    return {"mean": mean, "stderr": None if sd is None else sd / math.sqrt(n), "count": n}


def paired_delta(run: dict[int, float], baseline: dict[int, float]) -> dict[str, Any]:
    shared = sorted(run.keys() & baseline.keys())
    diffs = [run[i] - baseline[i] for i in shared]
    n = len(diffs)
    if n == 0:
        return {"mean": None, "ci95": None, "paired": 0}
    mean, sd = _mean_sd(diffs)
    if mean is None or sd is None:
        return {"mean": mean, "ci95": None, "paired": n}
    half = t_quantile(0.975, n - 1) * sd / math.sqrt(n)
    ci95 = [mean - half, mean + half]
    return {"mean": mean, "ci95": ci95 if all(math.isfinite(x) for x in ci95) else None, "paired": n}


def compare(
    runs: Sequence[tuple[Mapping[str, Any], dict[int, dict[str, float]]]], baseline_id: str | None = None
) -> dict[str, Any]:
    """The ``GET /evalsched/compare`` answer for ``runs`` (record, episode metrics), in order;
    the baseline is ``baseline_id`` or the first run."""
    if not runs:
        return {"params": [], "metrics": [], "metrics_dropped": 0, "baseline": None, "rows": []}
    base_index = 0
    if baseline_id is not None:
        ids = [record["id"] for record, _ in runs]
        base_index = ids.index(baseline_id)
    all_params = [dict(_params(record)) for record, _ in runs]
    # Ordered unions through dicts: a list's `in` made this quadratic in the names.
    names = list(dict.fromkeys(name for params in all_params for name in params))
    differing = [n for n in names if len({_key(p.get(n, _MISSING)) for p in all_params}) > 1]
    # One pass over each run's episodes: {metric: {index: value}}, indices ascending.
    per_run = [_by_metric(episodes) for _, episodes in runs]
    union: dict[str, None] = {}
    for by_metric in per_run:
        union.update(dict.fromkeys(by_metric))
    metrics = list(union)[:MAX_METRIC_NAMES]
    dropped = len(union) - len(metrics)
    base_by_metric = per_run[base_index]
    rows = []
    for (record, _), params, by_metric in zip(runs, all_params, per_run, strict=True):
        row_metrics = {}
        deltas = {}
        for metric in metrics:
            per_index = by_metric.get(metric, {})
            row_metrics[metric] = summarize(list(per_index.values()))
            deltas[metric] = paired_delta(per_index, base_by_metric.get(metric, {}))
        rows.append(
            {
                "id": record["id"],
                "name": record.get("name"),
                "state": record.get("state"),
                "params": {n: params.get(n) for n in differing},
                "metrics": row_metrics,
                "delta": deltas,
                "wall_s": wall_seconds(record),
                "peak_vram_mb": peak_vram_mb(record),
            }
        )
    return {
        "params": differing,
        "metrics": metrics,
        "metrics_dropped": dropped,
        "baseline": runs[base_index][0]["id"],
        "rows": rows,
    }


def _by_metric(episodes: Mapping[int, Mapping[str, float]]) -> dict[str, dict[int, float]]:
    out: dict[str, dict[int, float]] = {}
    for index in sorted(episodes):
        for name, value in episodes[index].items():
            column = out.get(name)
            if column is None:
                column = out[name] = {}
            column[index] = value
    return out


def wall_seconds(record: Mapping[str, Any]) -> float | None:
    started, finished = record.get("started_at"), record.get("finished_at")
    if not started or not finished:
        return None
    return round(_timestamp(finished) - _timestamp(started), 3)


def _timestamp(text: Any) -> float:
    """A record's ISO timestamp as ``runs.parse_timestamp`` reads it (now when it cannot be read),
    without importing :mod:`.runs`: its schemas import pydantic, about 0.2 s of a comparison
    worker's first comparison (the worker imports nothing but the standard library and this
    package's light modules: compare_worker.BOOTSTRAP)."""
    try:
        return datetime.fromisoformat(text).timestamp()
    except (TypeError, ValueError):
        return time.time()


def peak_vram_mb(record: Mapping[str, Any]) -> int | None:
    """The run's observed VRAM peak, summed over its GPUs (None when never observed)."""
    peaks = ((record.get("observed") or {}).get("peak_vram_mb")) or {}
    return sum(int(v) for v in peaks.values()) if peaks else None


_MISSING = object()


def _params(record: Mapping[str, Any]) -> Mapping[str, Any]:
    return record.get("params") or {}


def _key(value: Any) -> str:
    import json

    if value is _MISSING:
        return "\0missing"
    return json.dumps(value, sort_keys=True, default=str)


# ---------------------------------------------------------------------------- Student t


def t_quantile(p: float, df: int) -> float:
    """The ``p`` quantile (0.5 < p < 1) of Student's t with ``df`` degrees of freedom."""
    if df < 1:
        raise ValueError("df must be at least 1")
    lo, hi = 0.0, 1.0
    while t_cdf(hi, df) < p:
        hi *= 2.0
    for _ in range(100):
        mid = (lo + hi) / 2
        if t_cdf(mid, df) < p:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def t_cdf(t: float, df: int) -> float:
    x = df / (df + t * t)
    tail = 0.5 * _betainc(df / 2.0, 0.5, x)
    return 1.0 - tail if t >= 0 else tail


def _betainc(a: float, b: float, x: float) -> float:
    """The regularised incomplete beta function I_x(a, b) (continued fraction, Lentz)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x > (a + 1) / (a + b + 2):
        return 1.0 - _betainc(b, a, 1.0 - x)
    tiny = 1e-300
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    f = d
    for m in range(1, 500):
        for numerator in (
            m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
            -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1)),
        ):
            d = 1.0 + numerator * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + numerator / c
            c = c if abs(c) > tiny else tiny
            f *= c * d
        if abs(c * d - 1.0) < 1e-15:
            break
    return front * f / a
