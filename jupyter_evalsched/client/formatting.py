"""Plain-text pieces of a run record shared by the text progress bar, the CLI and the widget:
times, durations and metric means."""

from __future__ import annotations

from datetime import UTC, datetime


def parse_time(value: str | None) -> datetime | None:
    """An ISO 8601 time of a record (UTC assumed when it has no offset), or None."""
    if not value:
        return None
    try:
        dt = datetime.fromisoformat(value)
    except ValueError:
        return None
    return dt if dt.tzinfo else dt.replace(tzinfo=UTC)


def elapsed_s(record: dict) -> float | None:
    """Seconds a run has been running (or ran, once finished)."""
    start = parse_time(record.get("started_at"))
    if start is None:
        return None
    end = parse_time(record.get("finished_at")) or datetime.now(UTC)
    return max(0.0, (end - start).total_seconds())


def format_duration(seconds: float | None) -> str:
    """``4.2s`` under a minute, then ``MM:SS``, then ``H:MM:SS``; ``-`` for None."""
    if seconds is None:
        return "-"
    if seconds < 60:
        return f"{seconds:.1f}s"
    seconds = int(seconds)
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m:02d}:{s:02d}"


def metric_means(source: dict | None) -> dict[str, float]:
    """Per-metric means of a run record (its ``summary`` when present, else its ``metrics``) or
    of a ``summary.json`` dict."""
    source = source or {}
    if source.get("summary"):
        source = source["summary"]
    metrics = source.get("metrics") or {}
    return {
        name: stats["mean"]
        for name, stats in metrics.items()
        if isinstance(stats, dict) and isinstance(stats.get("mean"), (int, float))
    }


def format_metrics(source: dict | None, limit: int = 4) -> str:
    """``score=0.6804 acc=0.9`` from a run record or a summary."""
    means = metric_means(source)
    items = [f"{k}={v:.4g}" for k, v in list(means.items())[:limit]]
    if len(means) > limit:
        items.append("…")
    return " ".join(items)
