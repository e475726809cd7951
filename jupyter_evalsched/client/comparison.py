"""``jupyter_evalsched.compare(...)``: runs side by side as a pandas DataFrame, with a plot.

The figures are the server's (``GET /evalsched/compare``: means over the episodes, standard
errors, paired deltas against a baseline with a 95 % Student t interval); this module only
lays them out. pandas is imported when a comparison is made, matplotlib when one is plotted.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .rest_client import EvalSchedClient


def compare(
    client: EvalSchedClient,
    runs: list[Any] | None = None,
    *,
    sweep: Any = None,
    baseline: Any = None,
) -> Any:
    """The runs (ids, handles or records) or a sweep (an id or a :class:`SweepHandle`) side by
    side: a :class:`Comparison` (a pandas DataFrame), one row per run (indexed by run id) with
    ``name``, ``state``, the parameters whose values differ, for each metric ``<m>`` (its mean),
    ``<m>_stderr``, ``<m>_delta`` (paired, against the baseline: the first run unless
    ``baseline`` names another), ``<m>_ci_low``/``<m>_ci_high`` (its 95 % interval) and
    ``<m>_paired`` (the episodes paired), then ``wall_s`` and ``peak_vram_mb``. A metric named
    like a parameter is ``metric:<m>``. ``.plot(metric, x=param)`` draws the metric against a
    parameter."""
    sweep_id = getattr(sweep, "id", sweep)
    return frame(client.compare(runs=runs, sweep=sweep_id, baseline=baseline))


def frame(answer: dict[str, Any]) -> Any:
    """A ``GET /evalsched/compare`` answer as a :class:`Comparison`."""
    return _frame_class().from_answer(answer)


@functools.lru_cache(maxsize=1)
def _frame_class() -> Any:
    import pandas as pd

    class Comparison(pd.DataFrame):
        """A comparison as a DataFrame; ``.params``, ``.metrics`` and ``.baseline`` say what it
        compares, ``.plot(metric, x=param)`` draws it (any other call of ``plot`` is pandas')."""

        _metadata = ["params", "metrics", "baseline"]

        @property
        def _constructor(self) -> type:
            return Comparison

        @classmethod
        def from_answer(cls, answer: dict[str, Any]) -> Comparison:
            params: list[str] = list(answer.get("params") or [])
            metrics: list[str] = list(answer.get("metrics") or [])
            # A metric named like a parameter (or a fixed column) gets "metric:" in front.
            taken = {"id", "name", "state", "wall_s", "peak_vram_mb", *params}
            column = {m: (f"metric:{m}" if m in taken else m) for m in metrics}
            rows = []
            for row in answer.get("rows") or []:
                out: dict[str, Any] = {"id": row["id"], "name": row.get("name"), "state": row.get("state")}
                for name in params:
                    out[name] = (row.get("params") or {}).get(name)
                for metric in metrics:
                    stat = (row.get("metrics") or {}).get(metric) or {}
                    delta = (row.get("delta") or {}).get(metric) or {}
                    ci = delta.get("ci95") or [None, None]
                    c = column[metric]
                    out[c] = stat.get("mean")
                    out[f"{c}_stderr"] = stat.get("stderr")
                    out[f"{c}_delta"] = delta.get("mean")
                    out[f"{c}_ci_low"], out[f"{c}_ci_high"] = ci
                    out[f"{c}_paired"] = delta.get("paired", 0)
                out["wall_s"] = row.get("wall_s")
                out["peak_vram_mb"] = row.get("peak_vram_mb")
                rows.append(out)
            columns = ["id", "name", "state", *params]
            for metric in metrics:
                c = column[metric]
                columns += [c, *(f"{c}_{s}" for s in ("stderr", "delta", "ci_low", "ci_high", "paired"))]
            columns += ["wall_s", "peak_vram_mb"]
            frame = cls(rows, columns=columns).set_index("id")
            frame.params, frame.metrics, frame.baseline = params, [column[m] for m in metrics], answer.get("baseline")
            return frame

        def plot(self, metric: str | None = None, x: str | None = None, ax: Any = None, **kwargs: Any) -> Any:
            """``metric`` (its mean, with its standard error as error bars) against the
            parameter ``x`` (default: the first that differs), one line per combination of the
            other differing parameters. Without ``metric``: pandas' own ``DataFrame.plot``."""
            if metric is None or metric not in (self.metrics or []):
                if metric is not None and kwargs.get("kind") is None and metric in self.columns:
                    return pd.DataFrame(self).plot(metric, x=x, ax=ax, **kwargs)
                if metric is not None:
                    raise KeyError(f"no metric {metric!r}; the metrics are {', '.join(self.metrics) or 'none'}")
                return pd.DataFrame(self).plot(x=x, ax=ax, **kwargs)
            import matplotlib.pyplot as plt

            params = list(self.params or [])
            x = x or (params[0] if params else None)
            if ax is None:
                _, ax = plt.subplots()
            others = [p for p in params if p != x]
            frame = pd.DataFrame(self)
            groups = frame.groupby(others, dropna=False, sort=False) if others else [((), frame)]
            for key, group in groups:
                key = key if isinstance(key, tuple) else (key,)
                if x is not None:
                    group = group.sort_values(x, key=_sortable)
                    xs = group[x].tolist()
                else:
                    xs = list(group.index)
                label = ", ".join(f"{p}={v}" for p, v in zip(others, key, strict=False)) or None
                ax.errorbar(
                    xs, group[metric], yerr=group[f"{metric}_stderr"].fillna(0.0), marker="o", capsize=3, label=label
                )
            ax.set_xlabel(x or "run")
            ax.set_ylabel(f"{metric} (mean ± stderr)")
            if others:
                ax.legend(title=", ".join(others))
            return ax

    return Comparison


def _sortable(column: Any) -> Any:
    """Numbers sort as numbers, anything else by its text."""
    try:
        return column.astype(float)
    except (TypeError, ValueError):
        return column.astype(str)


def __getattr__(name: str) -> Any:
    if name == "Comparison":  # built on first use: pandas is imported only then
        return _frame_class()
    raise AttributeError(name)
