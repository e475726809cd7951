"""Plain-text pieces of a run record shared by the text progress bar, the CLI and the widget:
times, durations, metric means and what a pending run or lease waits for."""

from __future__ import annotations

from datetime import UTC, datetime

from ..contract import CANCELLING, PREEMPTING, RUNNING


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


def format_rate(value: float | None) -> str:
    """Tokens per second as the panel writes them (modelFigures.ts): ``0``, ``8.5``, ``1234``."""
    value = float(value or 0.0)
    if value <= 0:
        return "0"
    return f"{value:.1f}" if value < 100 else f"{value:.0f}"


def model_figures(model: dict) -> list[str]:
    """``["12 requests", "340 tok/s", "batch 3.5"]``: a shared model's figures (``GET
    /evalsched/models``), short, as the widget, the panel and the demo write them."""
    requests = int(model.get("requests") or 0)
    batch = f"{float(model.get('mean_batch_size') or 0.0):.2f}".rstrip("0").rstrip(".")
    return [
        f"{requests} request{'' if requests == 1 else 's'}",
        f"{format_rate(model.get('tokens_per_s'))} tok/s",
        f"batch {batch}",
    ]


def _num(value: float | None, digits: int = 4) -> str:
    return "-" if value is None else f"{value:.{digits}g}"


def compare_table(answer: dict, limit_metrics: int = 3) -> str:
    """A ``GET /evalsched/compare`` answer as a plain-text table: each run's name and state, the
    differing parameters, each metric's mean ± stderr and its paired delta against the baseline
    with the 95 % interval."""
    params = list(answer.get("params") or [])
    metrics = list(answer.get("metrics") or [])[:limit_metrics]
    baseline = answer.get("baseline")
    header = ["run", "name", "state", *params]
    for m in metrics:
        header += [m, f"Δ{m} [95% CI] (n)"]
    header += ["wall", "peak VRAM"]
    rows = [header]
    for row in answer.get("rows") or []:
        mark = " *" if row.get("id") == baseline else ""
        cells = [f"{row.get('id')}{mark}", str(row.get("name") or "-"), str(row.get("state") or "?")]
        cells += [str((row.get("params") or {}).get(p)) for p in params]
        for m in metrics:
            stat = (row.get("metrics") or {}).get(m) or {}
            delta = (row.get("delta") or {}).get(m) or {}
            mean, err = stat.get("mean"), stat.get("stderr")
            cells.append(f"{_num(mean)} ± {_num(err, 2)}" if err is not None else _num(mean))
            ci = delta.get("ci95")
            if row.get("id") == baseline:
                cells.append("baseline")
            elif delta.get("mean") is None:
                cells.append("no shared episodes")
            else:
                interval = f" [{_num(ci[0])}, {_num(ci[1])}]" if ci else ""
                cells.append(f"{delta['mean']:+.4g}{interval} ({delta.get('paired', 0)})")
        cells.append(format_duration(row.get("wall_s")) if row.get("wall_s") is not None else "-")
        cells.append(f"{row['peak_vram_mb']} MB" if row.get("peak_vram_mb") is not None else "-")
        rows.append(cells)
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    more = len(answer.get("metrics") or []) - len(metrics)
    if more > 0:
        lines.append(f"(+{more} more metrics: --json shows all)")
    lines.append("* baseline: deltas are paired over the episodes both runs have (same seeds), t interval")
    return "\n".join(lines)


def ending_line(record: dict) -> str:
    """How a wait ends, in one line: the run, its state (and why, when it did not succeed), its
    time and its headline metric (the first, with its standard error when known)."""
    name = record.get("name") or record.get("id", "?")
    state = record.get("state", "?")
    text = f"{name}: {state}"
    if state != "succeeded" and record.get("reason"):
        text += f" ({record['reason']})"
    elapsed = elapsed_s(record)
    if elapsed is not None:
        text += f" in {format_duration(elapsed)}"
    summary = record.get("summary") or {}
    metrics = summary.get("metrics") or {}
    for metric, stats in metrics.items():
        if isinstance(stats, dict) and isinstance(stats.get("mean"), (int, float)):
            text += f" · {metric} = {stats['mean']:.4g}"
            std, count = stats.get("std"), stats.get("count")
            if isinstance(std, (int, float)) and isinstance(count, int) and count > 1:
                text += f" ± {std / (count - 1) ** 0.5:.2g}"  # the summary's std is the population's
            break
    return text


def holder_name(holder: dict) -> str:
    """Who a holder of a record's ``why`` is: ``run train``, ``kernel of analysis.ipynb``,
    ``pid 4242 (python)``."""
    kind, ident, name = holder.get("kind"), holder.get("id"), holder.get("name")
    if kind == "kernel":
        return f"kernel of {name}" if name else f"kernel {ident}"
    if kind == "process":
        return f"pid {ident}" + (f" ({name})" if name else "")
    return f"{kind} {name or ident}"  # a run or lease (by name, else id), a model, a user


def holder_text(holder: dict) -> str:
    """A holder and what it holds: ``run train (GPU 0, 16000 MB)``."""
    where = []
    if holder.get("gpu") is not None:
        where.append(f"GPU {holder['gpu']}")
    if holder.get("mb"):
        where.append(f"{holder['mb']} MB")
    return holder_name(holder) + (f" ({', '.join(where)})" if where else "")


def _why_head(why: dict) -> str:
    return why["code"] if why.get("arg") is None else f"{why['code']}:{why['arg']}"


def _preposition(why: dict) -> str:
    return "for" if why["code"] == "preempting" else "behind"


def pending_text(record: dict, holders: int = 3) -> str:
    """What a queued run or lease waits for, from its ``why``: its code, who holds it back (the
    first ``holders`` of them), then the sentence: ``waiting_vram: behind run train (GPU 0, 16000
    MB); needs 16000 MB on 1 GPU; ...``. Its ``reason`` as it is when it has no why or no holders
    (a record of an older server, an end)."""
    why = record.get("why")
    if not isinstance(why, dict) or not why.get("holders"):
        return record.get("reason") or ""
    named = [holder_text(h) for h in why["holders"][:holders]]
    more = len(why["holders"]) - len(named)
    if more > 0:
        named.append(f"{more} more")
    text = f"{_why_head(why)}: {_preposition(why)} {', '.join(named)}"
    return text + (f"; {why['detail']}" if why.get("detail") else "")


def running_reason_code(record: dict) -> str | None:
    """What is ending a running run, from its ``why``: ``cancelling`` (a cancel signalled it) or
    ``preempting``; None for any other run (a running run's reason says nothing else)."""
    why = record.get("why")
    code = why.get("code") if isinstance(why, dict) else None
    return code if record.get("state") == RUNNING and code in (CANCELLING, PREEMPTING) else None


def pending_head(record: dict) -> str:
    """The short form, for a progress line: ``waiting_vram, behind run train``; the code alone
    without a why (a record of an older server)."""
    why = record.get("why")
    if not isinstance(why, dict):
        return (record.get("reason") or "").split(": ")[0]
    first = (why.get("holders") or [None])[0]
    return _why_head(why) + (f", {_preposition(why)} {holder_name(first)}" if first else "")


def other_users(device: dict, me: str | None) -> list[dict]:
    """What the other users of a host shared through a host ledger hold on a ledger ``device``, by
    user name only: ``{"user", "mb"`` (their grants), ``"runs", "leases", "models", "outside_mb"`` (their
    processes outside any grant)``}``, largest first. ``me`` is this server's user
    (``host_ledger.user`` of ``GET /evalsched/status``); unknown, no process counts as another
    user's. Empty without a host ledger (no ``users``)."""
    per: dict[str, dict] = {}

    def entry(user: str) -> dict:
        return per.setdefault(user, {"user": user, "mb": 0, "runs": 0, "leases": 0, "models": 0, "outside_mb": 0})

    for item in device.get("users") or []:
        if not isinstance(item, dict) or not item.get("user") or item["user"] == me:
            continue
        e = entry(str(item["user"]))
        e["mb"] += max(0, int(item.get("allocated_mb") or 0))
        e["runs"] += max(0, int(item.get("runs") or 0))
        e["leases"] += max(0, int(item.get("leases") or 0))
        e["models"] += max(0, int(item.get("models") or 0))
    for proc in device.get("unmanaged_processes") or []:
        if is_other_users(proc, me):
            entry(str(proc["user"]))["outside_mb"] += max(0, int(proc.get("used_mb") or 0))
    held = [e for e in per.values() if e["mb"] > 0 or e["outside_mb"] > 0]
    return sorted(held, key=lambda e: (-(e["mb"] + e["outside_mb"]), e["user"]))


def is_other_users(proc: dict, me: str | None) -> bool:
    """Whether an unmanaged process belongs to another user of a shared host (it carries a
    ``user`` that is not ``me``; nobody's is when ``me`` is unknown)."""
    return bool(me) and bool(proc.get("user")) and proc.get("user") != me


def other_user_text(entry: dict) -> str:
    """``bob: 14,000 MB (2 runs, 1 lease, 1 model)``: another user's grants on one GPU, by name only."""
    what = [
        f"{n} {word}{'' if n == 1 else 's'}"
        for n, word in ((entry["runs"], "run"), (entry["leases"], "lease"), (entry.get("models", 0), "model"))
        if n > 0
    ]
    return f"{entry['user']}: {entry['mb']:,} MB" + (f" ({', '.join(what)})" if what else "")


def outside_text(entry: dict) -> str:
    """``bob: 2,000 MB outside the scheduler``: another user's processes outside their grants."""
    return f"{entry['user']}: {entry['outside_mb']:,} MB outside the scheduler"
