"""ipywidgets 8 views of the scheduler: :class:`QueueWidget` (queue, VRAM ledger, cancel buttons)
and :class:`RunProgress` (one run).

Live updates come from the client's :class:`~jupyter_evalsched.client.LiveFeed` (events with
polling fallback) on one background thread per widget, so the kernel is never blocked. All widget
mutations after construction happen on that thread (comm messages go out through ipykernel's
thread-safe IOPub socket); button clicks, which arrive on the kernel's main thread, only call REST
and wake the feed. The thread ends on ``close()``, when the widget's comm is gone
(``Widget.close_all()``), and at interpreter exit.

Importing this module registers :class:`RunProgress` as the notebook's view of a run and its
progress during ``RunHandle.wait()`` (the client never imports this module).
"""

from __future__ import annotations

import html
import os
import re
import time
import weakref
from collections.abc import Callable
from datetime import datetime
from typing import Any

import ipywidgets as widgets

from .client import (
    EvalSchedClient,
    EvalSchedClientError,
    LiveFeed,
    QueueTracker,
    RunHandle,
    RunTracker,
    elapsed_s,
    format_duration,
    format_metrics,
    metric_means,
    parse_time,
    register_notebook_progress,
)
from .client.formatting import (
    ending_line,
    is_other_users,
    model_figures,
    other_user_text,
    other_users,
    outside_text,
    pending_text,
    running_reason_code,
)
from .contract import (
    ABORTED,
    CANCELLED,
    FAILED,
    QUEUED,
    RESUMABLE_STATES,
    RUNNING,
    SCHEDULING_DEFAULTS,
    SUCCEEDED,
    TERMINAL_STATES,
)

__all__ = [
    "QueueWidget",
    "RunProgress",
    "RunProgressReporter",
    "ledger_html",
    "models_html",
    "run_row_html",
    "slurm_badge",
]


def _weakly(method: Callable[..., Any]) -> Callable[..., Any]:
    """``method`` as a callback that does not keep its widget alive (the feed's thread holds its
    callbacks); once the widget is gone it returns False, which ends the feed."""
    ref = weakref.WeakMethod(method)

    def call(*args: Any) -> Any:
        target = ref()
        return False if target is None else target(*args)

    return call


# --------------------------------------------------------------------------- rendering helpers


# The runs' categorical palette: the same colours, in the same order, as the Lab panel's
# (labextension/style/base.css, --jp-evalsched-c0 … c7), so a run has one colour in both.
RUN_PALETTE = ("#4e79a7", "#f28e2b", "#59a14f", "#b07aa1", "#76b7b2", "#e15759", "#edc948", "#9c755f")


def color_slot(run_id: str, slots: int = len(RUN_PALETTE)) -> int:
    """A run's slot in :data:`RUN_PALETTE`: the panel's ``colorSlot`` (labextension/src/format.ts)
    exactly, a 32-bit ``hash * 31 + code unit`` over the id's UTF-16 code units."""
    h = 0
    units = run_id.encode("utf-16-le")
    for i in range(0, len(units), 2):
        h = (h * 31 + int.from_bytes(units[i : i + 2], "little")) & 0xFFFFFFFF
    if h >= 0x80000000:  # JavaScript's `| 0`: a signed 32-bit integer
        h -= 0x100000000
    return abs(h) % slots


def run_color(run_id: str) -> str:
    """A run's colour in the GPU bars, the same as the panel's."""
    return RUN_PALETTE[color_slot(run_id)]


_STATE_COLORS = {
    QUEUED: "#888",
    RUNNING: "#1f77b4",
    SUCCEEDED: "#2ca02c",
    FAILED: "#d62728",
    CANCELLED: "#ff7f0e",
    ABORTED: "#9467bd",
}

_BAR_STYLES = {SUCCEEDED: "success", FAILED: "danger", ABORTED: "danger", CANCELLED: "warning", RUNNING: "info"}


def _badge(state: str) -> str:
    color = _STATE_COLORS.get(state, "#555")
    return (
        f"<span style='background:{color};color:white;border-radius:3px;padding:0 4px;"
        f"font-size:85%'>{html.escape(state)}</span>"
    )


def _esc(value: Any) -> str:
    return html.escape("" if value is None else str(value))


# A run's, lease's or sweep's id as the server makes them (the panel's LONG_ID, format.ts).
_LONG_ID = re.compile(r"\b(?:lease-|sweep-)?\d{8}T\d{6}(?:\.\d{6})?-([0-9a-f]{6})\b")


def short_ids_html(escaped: str) -> str:
    """``escaped`` (HTML) with every long id in it shortened to its random tail, the whole id in
    a tooltip, as the panel shows them: a whole id makes a reason lines longer."""
    return _LONG_ID.sub(lambda m: f"<span title='{m.group(0)}'>{m.group(1)}</span>", escaped)


def is_slurm(rec: dict) -> bool:
    """Whether a run executes under SLURM (never in this host's VRAM ledger, ``devices == []``)."""
    return rec.get("executor") == "slurm"


def slurm_text(rec: dict) -> str:
    """``SLURM 123 · RUNNING``; ``SLURM · PENDING`` or ``SLURM`` until sbatch answered."""
    job = rec.get("slurm_job_id")
    state = rec.get("slurm_state")
    return " · ".join(p for p in (f"SLURM {job}" if job not in (None, "") else "SLURM", state or "") if p)


def slurm_badge(rec: dict) -> str:
    """The SLURM badge of a run (HTML), or ``""`` for a local run."""
    if not is_slurm(rec):
        return ""
    job = rec.get("slurm_job_id")
    return (
        f"<span class='jupyter-evalsched-slurm' data-slurm-job-id='{_esc(job or '')}' "
        f"data-slurm-state='{_esc(rec.get('slurm_state') or '')}' "
        f"title='runs under SLURM, not on this host&#x27;s GPUs' "
        f"style='background:#e6eef7;color:#1f4e79;border:1px solid #9bb7d4;border-radius:3px;"
        f"padding:0 4px;font-size:85%;white-space:nowrap'>{_esc(slurm_text(rec))}</span>"
    )


# A segment of a GPU bar is labelled inside when it is at least this share of the bar (as in the
# panel); every run, lease and holder is in the legend under its bar anyway.
_LABEL_MIN_SHARE = 0.12
_BAR_PX = 18  # the bar's height, one line of its 11 px labels
_LEASE_BG = "repeating-linear-gradient(45deg,#6a3d9a,#6a3d9a 6px,#8e63b5 6px,#8e63b5 12px)"
# Other users of a shared host (a host ledger), as in the panel: their grants solid, their
# processes outside them striped.
_USER_BG = "#37474f"
_USER_OUTSIDE_BG = "repeating-linear-gradient(135deg,#37474f,#37474f 3px,#9ba3a7 3px,#9ba3a7 6px)"


def _segment(kind: str, pct: float, background: str, title: str, label: str, attrs: str = "") -> str:
    """One segment of a GPU bar: its label (when given) on a line as tall as the bar, cut with an
    ellipsis where the segment is short, the whole of it in the tooltip."""
    text = (
        f"<span style='background:rgba(255,255,255,0.8);color:#111;border-radius:2px;padding:0 3px;"
        f"margin:0 2px;overflow:hidden;text-overflow:ellipsis;white-space:nowrap;min-width:0'>{_esc(label)}</span>"
        if label
        else ""
    )
    return (
        f"<div data-seg-kind='{kind}' {attrs} title='{_esc(title)}' style='display:flex;align-items:center;"
        f"flex:0 0 auto;width:{pct:.2f}%;height:{_BAR_PX}px;line-height:{_BAR_PX}px;font-size:11px;"
        f"background:{background};overflow:hidden;text-overflow:ellipsis;white-space:nowrap;"
        f"box-sizing:border-box'>{text}</div>"
    )


def _legend_item(background: str, text: str, title: str, attrs: str = "") -> str:
    return (
        f"<span {attrs} title='{_esc(title)}' style='display:inline-flex;align-items:center;gap:4px;"
        f"white-space:nowrap'><span style='display:inline-block;width:10px;height:10px;border-radius:2px;"
        f"border:1px solid #999;background:{background}'></span>{_esc(text)}</span>"
    )


def ledger_html(ledger: dict | None, names: dict[str, str] | None = None, me: str | None = None) -> str:
    """One bar per GPU: shared-model baseline, each run's allocation, unmanaged VRAM, free; a
    legend under it names every run, lease and holder with its colour and MB. On a host shared
    through a host ledger, each other user's grants and processes are their own segments, by user
    name only; ``me`` is this server's user (``host_ledger.user`` of ``GET /evalsched/status``)."""
    if not ledger:
        return "<i>no ledger yet</i>"
    names = names or {}
    parts = []
    for dev in ledger.get("devices") or []:
        total = max(int(dev.get("total_mb") or 0), 1)
        baseline = int(dev.get("baseline_mb") or 0)
        unmanaged = int(dev.get("unmanaged_mb") or 0)
        usable = int(dev.get("usable_mb") or 0)
        allocated = int(dev.get("allocated_mb") or 0)
        free = int(dev.get("free_mb") or 0)
        # Shared models are holders in the ledger (each its own segment, in allocated_mb); a
        # ledger without ``models`` took their VRAM off usable_mb instead.
        models = [m for m in dev.get("models") or [] if m.get("state") == "held"]
        scale = max(total, unmanaged + usable if "models" in dev else baseline + unmanaged + usable, 1)
        segs: list[str] = []
        legend: list[str] = []

        def seg(
            kind: str,
            mb: int,
            background: str,
            title: str,
            label: str = "",
            attrs: str = "",
            scale: float = scale,
            segs: list[str] = segs,
        ) -> None:
            if mb > 0:
                shown = label if mb / scale >= _LABEL_MIN_SHARE else ""
                segs.append(_segment(kind, 100.0 * mb / scale, background, title, shown, attrs))

        for model in models:
            mb = int(model.get("vram_mb") or 0)
            title = f"shared model {model.get('name')}: {mb} MB"
            seg("model", mb, "#7f7f7f", title, str(model.get("name")), f"data-model='{_esc(model.get('name'))}'")
            legend.append(_legend_item("#7f7f7f", f"model {model.get('name')} {mb} MB", title))
        if baseline and "models" not in dev:
            seg("baseline", baseline, "#7f7f7f", f"shared models: {baseline} MB", "models")
            legend.append(_legend_item("#7f7f7f", f"models {baseline} MB", f"shared models: {baseline} MB"))
        # VRAM outside the scheduler, by who holds it (a notebook, through its kernel, else a pid);
        # what a lease holder uses beyond its lease is drawn beside its lease.
        named = 0
        # Other users of a shared host: their grants, then their processes outside them.
        theirs = other_users(dev, me)
        for entry in theirs:
            attrs = f"data-user='{_esc(entry['user'])}'"
            seg("user", entry["mb"], _USER_BG, other_user_text(entry), entry["user"], attrs)
            if entry["mb"] > 0:
                legend.append(_legend_item(_USER_BG, other_user_text(entry), other_user_text(entry), attrs))
        for entry in theirs:
            attrs = f"data-user='{_esc(entry['user'])}'"
            seg("user-process", entry["outside_mb"], _USER_OUTSIDE_BG, outside_text(entry), entry["user"], attrs)
            if entry["outside_mb"] > 0:
                legend.append(_legend_item(_USER_OUTSIDE_BG, outside_text(entry), outside_text(entry), attrs))
            named += entry["outside_mb"]
        for who, title, mb in unmanaged_by_holder(dev, me):
            full = f"{title}: {mb} MB (not managed by the scheduler)"
            seg("unmanaged", mb, "#bcbd22", full, who)
            legend.append(_legend_item("#bcbd22", f"{who} {mb} MB", full))
            named += mb
        over_leases = sum(int(x.get("over_lease_mb") or 0) for x in dev.get("leases") or [])
        other = unmanaged - named - over_leases
        seg("unmanaged", other, "#bcbd22", f"not managed by the scheduler: {other} MB", "other")
        if other > 0:
            legend.append(_legend_item("#bcbd22", f"other {other} MB", "not managed by the scheduler"))
        for item in dev.get("leases") or []:
            holder = lease_label(item)
            mb = int(item.get("vram_mb") or 0)
            lease_id = item.get("id")
            title = f"lease {lease_id} held by {holder}: {mb} MB"
            attrs = f"class='jupyter-evalsched-lease' data-lease-id='{_esc(lease_id)}'"
            seg("lease", mb, _LEASE_BG, title, holder, attrs)
            legend.append(
                _legend_item(_LEASE_BG, f"lease: {holder} {mb} MB", title, f"data-legend-lease-id='{_esc(lease_id)}'")
            )
            over = int(item.get("over_lease_mb") or 0)
            seg("over", over, "#d62728", f"{holder} uses {over} MB more than its lease", "over")
        runs = dev.get("runs") or []
        exclusive = dev.get("exclusive")
        for run in runs:
            rid = run.get("id", "?")
            mb = int(run.get("marginal_vram_mb") or 0)
            if exclusive == rid:
                mb = max(mb, allocated)
            label = names.get(rid) or rid
            title = f"{label} ({rid}): {mb} MB"
            color = run_color(rid)
            seg("run", mb, color, title, label, f"data-run-id='{_esc(rid)}'")
            legend.append(_legend_item(color, f"{label} {mb} MB", title, f"data-legend-run-id='{_esc(rid)}'"))
        seg("free", free, "#e8f4e8", f"free: {free} MB")
        used_pct = 100.0 * allocated / usable if usable else 0.0
        others_mb = sum(e["mb"] for e in theirs)
        excl = f" · exclusive: {_esc(names.get(exclusive, exclusive))}" if exclusive else ""
        parts.append(
            f"<div class='jupyter-evalsched-gpu' data-index='{_esc(dev.get('index'))}' style='margin:2px 0'>"
            f"<div><b>GPU {_esc(dev.get('index'))}</b> {_esc(dev.get('name', ''))} · "
            f"allocated {allocated} / usable {usable} MB ({used_pct:.0f}%) · free {free} MB"
            f"{f' · other users {others_mb} MB' if others_mb else ''}"
            f"{f' · models {baseline} MB' if baseline else ''}"
            f"{f' · other {unmanaged} MB' if unmanaged else ''}{excl}</div>"
            f"<div style='display:flex;height:{_BAR_PX}px;border:1px solid #999;border-radius:2px;"
            f"background:#f4f4f4;width:100%;max-width:640px;overflow:hidden'>{''.join(segs)}</div>"
            f"<div class='jupyter-evalsched-legend' style='display:flex;flex-wrap:wrap;gap:0 12px;"
            f"font-size:11px;line-height:18px;color:#444;max-width:640px'>{''.join(legend)}</div></div>"
        )
    if not parts:
        parts.append("<div><i>no GPUs: CPU-only runs</i></div>")
    cpu = ledger.get("cpu_slots") or {}
    if cpu:
        parts.append(f"<div>CPU slots: {int(cpu.get('allocated', 0))} / {int(cpu.get('total', 0))} in use</div>")
    return "".join(parts)


def lease_label(item: dict) -> str:
    """Who holds a lease: its label, else its notebook, else its pid."""
    if item.get("label"):
        return str(item["label"])
    if item.get("session_path"):
        return os.path.basename(str(item["session_path"]))
    return f"pid {item['pid']}" if item.get("pid") else str(item.get("id", "lease"))


def unmanaged_by_holder(dev: dict, me: str | None = None) -> list[tuple[str, str, int]]:
    """``(label, title, MB)`` of a device's unmanaged VRAM not covered by a lease, by notebook
    (kernel) or process, largest first; other users' processes (see :func:`other_users`) are not
    among them."""
    titles: dict[str, str] = {}
    sizes: dict[str, int] = {}
    for proc in dev.get("unmanaged_processes") or []:
        if proc.get("lease_id") or is_other_users(proc, me):
            continue
        if proc.get("session_path"):
            label = os.path.basename(str(proc["session_path"]))
            title = f"{proc['session_path']} (kernel {proc.get('kernel_id')})"
        elif proc.get("kernel_id"):
            label, title = "kernel", f"kernel {proc['kernel_id']}"
        else:
            label, title = f"pid {proc.get('pid')}", f"pid {proc.get('pid')} {proc.get('name') or ''}".strip()
        titles.setdefault(label, title)
        sizes[label] = sizes.get(label, 0) + int(proc.get("used_mb") or 0)
    return sorted(((label, titles[label], mb) for label, mb in sizes.items()), key=lambda g: -g[2])


def _age(value: str | None) -> str:
    t = parse_time(value)
    if t is None:
        return "-"
    return format_duration((datetime.now(t.tzinfo) - t).total_seconds())


def attempt_text(rec: dict) -> str:
    """``attempt 2 · preempted ×1 · retry 1/3``: what a run's attempts say, empty for a first
    attempt with nothing to tell."""
    parts = []
    if (rec.get("attempt") or 1) > 1:
        parts.append(f"attempt {rec['attempt']}")
    if rec.get("preemptions"):
        parts.append(f"preempted ×{rec['preemptions']}")
    if rec.get("retries"):
        parts.append(f"retry {rec.get('retries_used') or 0}/{rec['retries']}")
    if rec.get("detach"):
        parts.append("detached")
    return " · ".join(parts)


def run_row_html(rec: dict, metrics: str = "", run_id: str | None = None) -> str:
    """The label of one run in the queue widget (HTML): state, name, id, priority, then the VRAM
    (and GPUs) of a local run or the SLURM badge of a SLURM run, then progress, reason, metrics."""
    run_id = run_id or rec.get("id")
    state = rec.get("state", "?")
    prog = rec.get("progress") or {}
    done, total = int(prog.get("done") or 0), int(prog.get("total") or 0)
    slurm = is_slurm(rec)
    details = []
    if state == RUNNING:
        details.append(f"{done}/{total} · {format_duration(elapsed_s(rec))}")
        if rec.get("devices") and not slurm:
            details.append("GPU\u00a0" + ",".join(str(d) for d in rec["devices"]))
        if running_reason_code(rec):  # (it is ending: a cancel signalled it, or a preemption)
            details.append(rec.get("reason") or "")
        if metrics:
            details.append(metrics)
    elif state == QUEUED:
        details.append(f"waiting {_age(rec.get('submitted_at'))}")
        if rec.get("reason"):
            details.append(pending_text(rec))
    else:
        details.append(format_duration(elapsed_s(rec)))
        if rec.get("reason") and state != SUCCEEDED:
            details.append(rec["reason"])
        if metrics:
            details.append(metrics)
    vram = int(rec.get("marginal_vram_mb") or 0)
    # A SLURM run is not on this host's GPUs: its job id and SLURM state instead of the VRAM.
    where = f" · {slurm_badge(rec)}" if slurm else (f" · {vram}\u00a0MB" if vram else "")
    observed = rec.get("observed") or {}
    peak = max((int(v) for v in (observed.get("peak_vram_mb") or {}).values()), default=0)
    if peak and not slurm:
        where += f" (seen {peak}\u00a0MB)"
    attempts = attempt_text(rec)
    if attempts:
        where += f" · {_esc(attempts)}"
    for warning in rec.get("warnings") or []:
        where += (
            f" <span class='jupyter-evalsched-warning' title='{_esc(warning)}' style='background:#fdecea;"
            f"color:#a4262c;border:1px solid #e8a1a3;border-radius:3px;padding:0 4px;font-size:85%'>"
            f"⚠ {_esc(warning.split(':', 1)[0])}</span>"
        )
    # Its own line height: the widget's 28 px would space wrapped lines far apart.
    return (
        f"<div style='line-height:1.5'>{_badge(state)} <b>{_esc(rec.get('name'))}</b> "
        f"<code style='font-size:80%'>{_esc(run_id)}</code>"
        f" · {_esc(rec.get('priority', SCHEDULING_DEFAULTS['priority']))}{where}"
        f" · <span style='color:#555'>{short_ids_html(_esc(' · '.join(details)))}</span></div>"
    )


_MODEL_STATE_COLORS = {"not_loaded": "#888", "loading": "#1f77b4", "loaded": "#2ca02c", "failed": "#d62728"}
MODELS_POLL_S = 2.0  # how often the widget re-reads the models' figures (no event says they changed)
HOST_USER_POLL_S = 5.0  # how often the widget asks who this server's user is, until the host ledger says


def models_html(models: list[dict]) -> str:
    """The shared models of the host, one line each: name, state, its OpenAI endpoint and model
    id (selected whole with one click, to copy), requests, tokens/s and mean batch size."""
    if not models:
        return ""
    lines = [f"<b>Shared models ({len(models)})</b>"]
    for model in models:
        state = str(model.get("state") or "?")
        color = _MODEL_STATE_COLORS.get(state, "#555")
        badge = (
            f"<span style='background:{color};color:white;border-radius:3px;padding:0 4px;"
            f"font-size:85%'>{_esc(state)}</span>"
        )
        endpoint = model.get("endpoint")
        where = (
            f" · <code class='jupyter-evalsched-endpoint' style='user-select:all;font-size:80%' "
            f"title='OpenAI base URL; the model id is {_esc(model.get('name'))}'>{_esc(endpoint)}</code>"
            if endpoint
            else ""
        )
        error = model.get("error") or {}
        failure = (
            f" · <span style='color:#d62728'>{_esc(error.get('type'))}: {_esc(error.get('message'))}</span>"
            if state == "failed" and error
            else ""
        )
        lines.append(
            f"<div class='jupyter-evalsched-model' data-model='{_esc(model.get('name'))}' style='line-height:1.5'>"
            f"{badge} <b>{_esc(model.get('name'))}</b>{where}"
            f" · <span style='color:#555'>{_esc(' · '.join(model_figures(model)))}</span>{failure}</div>"
        )
    return "".join(lines)


class _RunRow(widgets.HBox):
    """One run in the queue widget: label, progress bar, cancel button."""

    def __init__(self, run_id: str, on_cancel):
        self.run_id = run_id
        # Fixed columns: the label takes what is left, the bar and the button (sized to its text,
        # never shrunk) keep their widths, so bars line up from row to row.
        self.label = widgets.HTML(layout=widgets.Layout(flex="1 1 auto", min_width="0"))
        self.bar = widgets.IntProgress(min=0, max=1, value=0, layout=widgets.Layout(width="160px", flex="0 0 160px"))
        self.button = widgets.Button(
            description="Cancel",
            icon="times",
            tooltip=f"cancel {run_id}",
            layout=widgets.Layout(width="auto", flex="0 0 auto", overflow="visible"),
        )
        self.button.on_click(lambda _b: on_cancel(run_id))
        super().__init__(
            children=[self.label, self.bar, self.button], layout=widgets.Layout(align_items="center", width="100%")
        )

    def update(self, rec: dict, metrics: str) -> None:
        state = rec.get("state", "?")
        prog = rec.get("progress") or {}
        done, total = int(prog.get("done") or 0), int(prog.get("total") or 0)
        self.label.value = run_row_html(rec, metrics, self.run_id)
        with self.bar.hold_sync():
            self.bar.max = max(total, 1)
            self.bar.value = min(done, max(total, 1))
            self.bar.bar_style = _BAR_STYLES.get(state, "")
        self.bar.layout.visibility = "visible" if state != QUEUED else "hidden"
        terminal = state in TERMINAL_STATES
        self.button.layout.visibility = "hidden" if terminal else "visible"
        self.button.disabled = terminal

    def close(self) -> None:
        for child in (self.label, self.bar, self.button):
            child.close()
        super().close()


# --------------------------------------------------------------------------- the queue widget


class QueueWidget(widgets.VBox):
    """The host's queue: running runs with progress, elapsed time and latest metrics; queued runs in
    admission order with their pending reason; recently finished runs; one VRAM bar per GPU; a
    cancel button per run. Updates live in a background thread; ``close()`` stops it.

    ``queue_view`` holds the latest queue view (queued, running, ledger) as received, and
    ``update_count`` counts renders: both are there for programs and tests.
    """

    def __init__(
        self,
        client: EvalSchedClient | None = None,
        *,
        finished_limit: int = 8,
        max_queued_rows: int = 50,
        max_running_rows: int = 50,
        poll_s: float = 1.0,
        safety_poll_s: float = 3.0,
        use_events: bool = True,
        live: bool = True,
    ):
        self.client = client if client is not None else EvalSchedClient()
        self.finished_limit = finished_limit
        self.max_queued_rows = max_queued_rows
        self.max_running_rows = max_running_rows  # a 2000-point SLURM sweep runs 2000 at once
        self.update_count = 0
        self._summaries: dict[str, tuple[Any, float, dict | None]] = {}  # id -> (progress, t, summary)
        self._rows: dict[str, _RunRow] = {}
        self._last_render = 0.0
        self._dirty = False
        self._closed = False
        self._action_error: str | None = None
        self._models: list[dict] = []
        self._models_read_at = -MODELS_POLL_S  # monotonic; the first tick reads them
        # This server's user on a host shared through a host ledger (other users are shown by name).
        self._host_user: str | None = None
        self._host_user_read_at = -HOST_USER_POLL_S

        self._header = widgets.HTML()
        self._ledger = widgets.HTML()
        self._models_box = widgets.HTML()
        self._running_title = widgets.HTML()
        self._queued_title = widgets.HTML()
        self._finished_title = widgets.HTML()
        self._more_queued = widgets.HTML()
        self._more_running = widgets.HTML()
        self._rows_box = widgets.VBox(layout=widgets.Layout(width="100%"))
        super().__init__(
            children=[self._header, self._ledger, self._models_box, self._rows_box], layout=widgets.Layout(width="100%")
        )
        self.add_class("jupyter-evalsched-queue")

        # Only the queued runs it shows are read: ten thousand queued are megabytes at each read.
        self._tracker = QueueTracker(
            _weakly(self._on_change), finished_limit=finished_limit, queue_limit=max_queued_rows
        )
        self._feed = LiveFeed(
            self.client,
            self._tracker,
            use_events=use_events,
            poll_s=poll_s,
            safety_poll_s=safety_poll_s,
            on_tick=_weakly(self._on_tick),
            name="evalsched-widget",
        )
        self._feed.read_now()  # filled the moment it is displayed
        if live:
            self._read_models()
            self._read_host_user()
        self._render()
        if live:
            self._feed.start()

    @property
    def queue_view(self) -> dict:
        """The latest queue view: ``queued`` (the first ``max_queued_rows`` in admission order;
        ``queued_total`` counts them all), ``running``, ``ledger``."""
        return self._tracker.view

    @property
    def finished(self) -> list[dict]:
        """The runs that finished most recently, latest first."""
        return self._tracker.finished

    @property
    def models(self) -> list[dict]:
        """The shared models and their figures, as last read (``GET /evalsched/models``)."""
        return self._models

    @property
    def error(self) -> str | None:
        """Why the last cancel or REST read failed, if it did."""
        return self._action_error or self._feed.error

    # ---- feed callbacks (background thread)

    def _on_change(self, _view: dict) -> None:
        self._dirty = True

    def _on_tick(self) -> bool:
        if self._closed or self.comm is None:  # closed, or Widget.close_all()
            return False
        if self._fetch_running_summaries():
            self._dirty = True
        if time.monotonic() - self._models_read_at >= MODELS_POLL_S and self._read_models():
            self._dirty = True
        if self._read_host_user():
            self._dirty = True
        # Re-render at most 4 times a second, and once a second anyway for the elapsed clocks.
        since = time.monotonic() - self._last_render
        if (self._dirty and since >= 0.25) or since >= 1.0:
            self._render()
        return True

    # ---- data

    def show_view(
        self,
        view: dict,
        finished: list[dict] | None = None,
        models: list[dict] | None = None,
        host_user: str | None = None,
    ) -> None:
        """Render ``view`` (a ``GET /evalsched/queue`` answer: queued, running, ledger) and, when
        given, ``finished`` records, ``models`` (``GET /evalsched/models``' list) and ``host_user``
        (this server's user on a shared host), as if they had just been read; for programs and
        tests, with ``live=False`` (a live widget replaces them at its next refresh)."""
        self._tracker.set_view(view, finished)
        if models is not None:
            self._models = list(models)
        if host_user is not None:
            self._host_user = host_user
        self._render()

    def _read_host_user(self) -> bool:
        """On a host shared through a host ledger (the ledger's devices list ``users``), read this
        server's user from ``GET /evalsched/status`` once (again every few seconds until the link
        says it); True when it was learnt."""
        if self._host_user is not None or time.monotonic() - self._host_user_read_at < HOST_USER_POLL_S:
            return False
        ledger = self.queue_view.get("ledger") or {}
        if not any("users" in dev for dev in ledger.get("devices") or []):
            return False
        self._host_user_read_at = time.monotonic()
        try:
            user = (self.client.request("GET", "status").get("host_ledger") or {}).get("user")
        except (EvalSchedClientError, AttributeError, TypeError):
            return False
        if not isinstance(user, str) or not user:
            return False
        self._host_user = user
        return True

    def _read_models(self) -> bool:
        """Re-read the shared models' figures (they change with no event); True when they changed.
        A server without shared models (or too old to list them) shows none."""
        self._models_read_at = time.monotonic()
        try:
            models = self.client.models()
        except (EvalSchedClientError, KeyError, TypeError):
            models = []
        if models == self._models:
            return False
        self._models = models
        return True

    def _fetch_running_summaries(self, budget: int = 8) -> bool:
        """Latest metrics of running runs whose records do not carry them (older servers):
        re-read the run's summary when its progress moved, at most once a second per run."""
        changed = False
        now = time.monotonic()
        live_ids = set()
        for rec in (self.queue_view.get("running") or [])[: self.max_running_rows]:  # the rows shown
            rid = rec.get("id")
            if "metrics" in rec:
                continue
            live_ids.add(rid)
            progress = rec.get("progress")
            seen = self._summaries.get(rid)
            if budget <= 0 or (seen and (seen[0] == progress or now - seen[1] < 1.0)):
                continue
            if not (progress or {}).get("done"):
                continue
            budget -= 1
            try:
                summary = self.client.get(rid).get("summary")
            except EvalSchedClientError:
                summary = seen[2] if seen else None
            self._summaries[rid] = (progress, now, summary)
            changed = True
        for rid in list(self._summaries):
            if rid not in live_ids:
                del self._summaries[rid]
        return changed

    # ---- rendering

    def _names(self) -> dict[str, str]:
        names = {}
        for key in ("queued", "running"):
            for rec in self.queue_view.get(key) or []:
                names[rec.get("id")] = rec.get("name") or rec.get("id")
        return names

    def _row(self, rec: dict) -> _RunRow:
        rid = rec["id"]
        row = self._rows.get(rid)
        if row is None:
            row = self._rows[rid] = _RunRow(rid, self._cancel)
        return row

    def _header_html(self, running: int, queued: int) -> str:
        mode = self._feed.mode
        status = {
            "live": "<span style='color:#2ca02c'>● live</span>",
            "polling": "<span style='color:#ff7f0e'>● polling</span>",
            "stopped": "<span style='color:#888'>■ stopped</span>",
        }.get(mode, "<span style='color:#888'>○ connecting</span>")
        err = self.error or (self._feed.last_error if mode == "polling" else None)
        return (
            f"<b>Evaluation queue</b> · {_esc(self.client.base_url)} · {status}"
            f" · {running} running · {queued} queued"
            + (f"<br><span style='color:#d62728'>{_esc(err)}</span>" if err else "")
        )

    def _render(self) -> None:
        if self._closed:
            return
        self._last_render = time.monotonic()
        self._dirty = False
        view = self.queue_view
        running = list(view.get("running") or [])
        queued = list(view.get("queued") or [])
        queued_total = max(view.get("queued_total") or 0, len(queued))
        active_ids = {r.get("id") for r in running} | {q.get("id") for q in queued}
        finished = [f for f in self.finished if f.get("id") not in active_ids][: self.finished_limit]

        self._header.value = self._header_html(len(running), queued_total)
        self._ledger.value = ledger_html(view.get("ledger"), self._names(), self._host_user)
        models = models_html(self._models)
        if models != self._models_box.value:
            self._models_box.value = models
        self._models_box.layout.display = "" if models else "none"

        children: list[widgets.Widget] = []
        self._running_title.value = f"<b>Running ({len(running)})</b>"
        children.append(self._running_title)
        # Rows (and their elapsed clocks, re-sent every second) for the first ones only, as for
        # the queued: one comm message per row and second is what a large sweep would cost.
        for rec in running[: self.max_running_rows]:
            fetched = self._summaries.get(rec["id"])
            row = self._row(rec)
            row.update(rec, format_metrics(fetched[2] if fetched else rec, limit=3))
            children.append(row)
        if len(running) > self.max_running_rows:
            self._more_running.value = f"<i>… and {len(running) - self.max_running_rows} more running</i>"
            children.append(self._more_running)
        self._queued_title.value = f"<b>Queued ({queued_total})</b> <span style='color:#555'>in admission order</span>"
        children.append(self._queued_title)
        listed = queued[: self.max_queued_rows]
        for rec in listed:
            row = self._row(rec)
            row.update(rec, "")
            children.append(row)
        if queued_total > len(listed):
            self._more_queued.value = f"<i>… and {queued_total - len(listed)} more queued</i>"
            children.append(self._more_queued)
        if finished:
            self._finished_title.value = "<b>Recently finished</b>"
            children.append(self._finished_title)
            for rec in finished:
                row = self._row(rec)
                row.update(rec, format_metrics(rec, limit=3))
                children.append(row)

        shown = {c.run_id for c in children if isinstance(c, _RunRow)}
        for rid in [r for r in self._rows if r not in shown]:
            self._rows.pop(rid).close()
        if tuple(children) != tuple(self._rows_box.children):
            self._rows_box.children = tuple(children)
        self.update_count += 1

    # ---- actions

    def _cancel(self, run_id: str) -> None:
        # Runs on the kernel's main thread (comm message); only REST here, the feed re-renders.
        try:
            self.client.cancel(run_id, by="widget")
            self._action_error = None
        except EvalSchedClientError as e:
            self._action_error = f"cancel {run_id}: {e}"
        self._feed.wake()

    def refresh(self) -> None:
        """Re-read the queue now (the background thread does this by itself)."""
        self._feed.wake()

    @property
    def mode(self) -> str:
        """``live`` (events), ``polling`` (REST fallback), ``starting`` or ``stopped``."""
        return self._feed.mode

    def close(self) -> None:
        """Stop live updates and close the widget and its children."""
        if self._closed:
            return
        self._closed = True
        self._feed.stop(join=True)
        for row in list(self._rows.values()):
            row.close()
        self._rows.clear()
        for w in (
            self._header,
            self._ledger,
            self._models_box,
            self._running_title,
            self._queued_title,
            self._finished_title,
            self._more_queued,
            self._more_running,
            self._rows_box,
        ):
            w.close()
        super().close()


# --------------------------------------------------------------------------- one run


class RunProgress(widgets.VBox):
    """One run: a progress bar with state, elapsed time, reason and latest metrics, and a cancel
    button (a resume button once it failed, was aborted or cancelled). ``live=True`` follows the
    run in a background thread until it ends (and again after a resume); ``live=False`` leaves the
    updates to the caller (``update(record)``), as ``RunHandle.wait`` does."""

    def __init__(
        self,
        run: RunHandle | str | dict,
        client: EvalSchedClient | None = None,
        *,
        live: bool = True,
        poll_s: float = 1.0,
        safety_poll_s: float = 5.0,
    ):
        if isinstance(run, RunHandle):
            self.handle = run
        else:
            self.handle = RunHandle(client if client is not None else EvalSchedClient(), run)
        self.client = self.handle.client
        self.run_id = self.handle.id
        self.record: dict = dict(self.handle.last_record or {"id": self.run_id, "state": QUEUED})
        self.update_count = 0
        self._closed = False
        self._action_error: str | None = None

        self._title = widgets.HTML()
        self._bar = widgets.IntProgress(min=0, max=1, value=0, layout=widgets.Layout(width="240px"))
        self._status = widgets.HTML(layout=widgets.Layout(flex="1 1 auto"))
        # Buttons sized to their text and never shrunk (a shrunk one reads "✕ Ca…").
        self._button = widgets.Button(
            description="Cancel", icon="times", layout=widgets.Layout(width="auto", flex="0 0 auto")
        )
        self._button.on_click(lambda _b: self._cancel())
        self._resume_button = widgets.Button(
            description="Resume", icon="redo", layout=widgets.Layout(width="auto", flex="0 0 auto", display="none")
        )
        self._resume_button.on_click(lambda _b: self._resume())
        super().__init__(
            children=[
                self._title,
                widgets.HBox(
                    [self._bar, self._status, self._button, self._resume_button],
                    layout=widgets.Layout(align_items="center"),
                ),
            ]
        )
        self.add_class("jupyter-evalsched-run")

        self._live = live
        self._poll_s, self._safety_poll_s = poll_s, safety_poll_s
        self._feed = self._new_feed(self.record)
        if live:
            self._feed.read_now()
        self.update(self._tracker.record)
        if live and self.record.get("state") not in TERMINAL_STATES:
            self._feed.start()

    def update(self, record: dict) -> None:
        """Show ``record`` (a run record, with or without ``summary``)."""
        if self._closed:
            return
        if "summary" not in record and "summary" in self.record:
            record = {**record, "summary": self.record.get("summary")}
        self.record = record
        state = record.get("state", "?")
        prog = record.get("progress") or {}
        done, total = int(prog.get("done") or 0), int(prog.get("total") or 0)
        self._title.value = (
            f"<b>{_esc(record.get('name') or self.run_id)}</b> <code style='font-size:80%'>{_esc(self.run_id)}</code>"
        )
        with self._bar.hold_sync():
            self._bar.max = max(total, 1)
            self._bar.value = min(done, max(total, 1)) if total else (1 if state == SUCCEEDED else 0)
            self._bar.bar_style = _BAR_STYLES.get(state, "")
        self._status.value = self._status_html(record)
        terminal = state in TERMINAL_STATES
        self._button.disabled = terminal
        self._button.layout.visibility = "hidden" if terminal else "visible"
        self._resume_button.layout.display = "" if state in RESUMABLE_STATES else "none"
        self.update_count += 1

    def _status_html(self, record: dict) -> str:
        state = record.get("state", "?")
        prog = record.get("progress") or {}
        done, total = int(prog.get("done") or 0), int(prog.get("total") or 0)
        parts = [
            f"{done}/{total}" if total else "",
            format_duration(elapsed_s(record))
            if record.get("started_at")
            else f"waiting {_age(record.get('submitted_at'))}",
        ]
        if record.get("reason") and state != SUCCEEDED:
            parts.append(pending_text(record))
        parts.append(attempt_text(record))
        metrics = format_metrics(record)
        if metrics:
            parts.append(metrics)
        slurm = f"{slurm_badge(record)} " if is_slurm(record) else ""
        error = self._action_error or self._feed.error
        shown_error = f" <span style='color:#d62728'>{_esc(error)}</span>" if error else ""
        return f"{_badge(state)} {slurm}{_esc(' · '.join(p for p in parts if p))}{shown_error}"

    @property
    def metrics(self) -> dict[str, float]:
        return metric_means(self.record)

    def _on_tick(self) -> bool:
        if self._closed or self.comm is None:  # closed, or Widget.close_all()
            return False
        if self.record.get("state") == RUNNING:
            self.update(self.record)  # the elapsed clock
        return True

    def _new_feed(self, record: dict) -> LiveFeed:
        self._tracker = RunTracker(self.run_id, _weakly(self.update), record=record)
        return LiveFeed(
            self.client,
            self._tracker,
            on_tick=_weakly(self._on_tick),
            name=f"evalsched-run-{self.run_id}",
            poll_s=self._poll_s,
            safety_poll_s=self._safety_poll_s,
        )

    def _cancel(self) -> None:
        try:
            self.update(self.client.cancel(self.run_id, by="widget"))
            self._action_error = None
        except EvalSchedClientError as e:
            self._action_error = str(e)
            self.update(self.record)
        self._feed.wake()

    def _resume(self) -> None:
        """Queue the run again; a live widget follows its next attempt to its end."""
        try:
            record = self.client.resume(self.run_id)
        except EvalSchedClientError as e:
            self._action_error = str(e)
            self.update(self.record)
            return
        self._action_error = None
        self.update(record)
        if self._live and not self._closed:
            self._feed.stop(join=True)
            self._feed = self._new_feed(record)  # the old tracker is done with the ended attempt
            self._feed.start()

    @property
    def mode(self) -> str:
        return self._feed.mode

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._feed.stop(join=True)
        for w in (self._title, self._bar, self._status, self._button, self._resume_button):
            w.close()
        for child in self.children:
            child.close()
        super().close()


class RunProgressReporter:
    """``RunHandle.wait()``'s progress in a notebook: a :class:`RunProgress` that the wait's own
    feed updates (``live=False``: no second feed)."""

    def __init__(self, handle: RunHandle):
        from IPython.display import display

        self.widget = RunProgress(handle, live=False)
        display(self.widget)

    def update(self, record: dict) -> None:
        self.widget.update(record)

    def finish(self, record: dict) -> None:
        if record:
            self.widget.update(record)
            if record.get("state") in TERMINAL_STATES:
                # Plain text under the widget: a saved notebook shows how the run ended even where
                # widgets do not render.
                print(ending_line(record))


register_notebook_progress(RunProgressReporter, RunProgress)
