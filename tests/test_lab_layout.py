"""What a user sees, measured in a real JupyterLab and a real Chromium: in a populated state (runs
on two virtual GPUs, a running and a finished sweep, a lease with a long name, a failed run, a run
waiting for VRAM, long names everywhere) no label or button of the panel, of the ``%eval_queue``
widget in a notebook, or of the compare view is clipped, no name breaks inside a word, every
segment of a GPU bar is labelled or in its legend, and a run has one colour in the widget and the
panel.

Clipping is measured, not eyeballed: an element whose text overflows its own box (scroll size over
client size) or the box of an ancestor that hides overflow, unless it ends in an ellipsis with the
whole text in a tooltip; a word laid out over two lines (a Range per word, its client rects).
Reuses the servers and helpers of tests/test_lab_panel.py.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from lab_failures import ARTIFACTS, failure_report
from test_lab_panel import (
    CHROMIUM,
    CHROMIUM_ARGS,
    COMPARE,
    CRASH,
    PANEL,
    PANEL_TAB,
    SLEEPY,
    SWEEP,
    TOY,
    UI_TIMEOUT_MS,
    LabServer,
    PageErrors,
    _all_ended,
    _create_lease,
    _kill,
    _sleeper,
    _start,
    _submit_sweep,
    _wait_sweep,
    _write_user_settings,
)
from waiting import wait_until

# Chromium pages on JupyterLab, about 15 s each: CI runs them with -m slow (docs/install.md: the
# default suite stays within ten minutes).
pytestmark = [pytest.mark.browser, pytest.mark.slow]


@pytest.fixture
def browser() -> Iterator[Any]:
    """Chromium, launched as tests/test_lab_panel.py launches it (function scope: see there)."""
    assert Path(CHROMIUM).exists(), f"{CHROMIUM} is not installed: run scripts/setup.sh"
    from playwright import sync_api

    with sync_api.sync_playwright() as pw:
        chromium = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        yield chromium
        chromium.close()


LEASE_LABEL = "exploration-of-long-context-retrieval"
LONG_RUN = "retrieval-eval-over-very-long-documents"
RUNNING_SWEEP = "needle-in-a-haystack-at-every-depth"
FINISHED_SWEEP = "long-context-retrieval-grid"
FAILED_RUN = "failing-eval-with-an-unusually-long-name"
WAITING_RUN = "waits-for-the-lease-to-end-before-starting"

# Every element with text of its own (and every button) under `root`: clipped in its own box, or
# by an ancestor that hides overflow (up to the first scroll container: scrolling is not clipping),
# unless an ellipsis is shown with the whole text in a tooltip; words laid out over two lines.
MEASURE_JS = r"""
([rootSel]) => {
  const root = document.querySelector(rootSel);
  if (!root) { return [{ why: 'no root', el: rootSel }]; }
  const problems = [];
  const shown = el => {
    const r = el.getBoundingClientRect();
    const s = getComputedStyle(el);
    return r.width > 0 && r.height > 0 && s.visibility !== 'hidden';
  };
  const ownText = el => Array.from(el.childNodes)
    .filter(n => n.nodeType === Node.TEXT_NODE).map(n => n.textContent).join('').trim();
  const describe = el => `${el.tagName.toLowerCase()}.${[...el.classList].join('.')}`;
  const text = el => (el.textContent || '').trim();
  const hides = v => v === 'hidden' || v === 'clip';
  const scrolls = v => v === 'auto' || v === 'scroll';
  // An intentional ellipsis (one line cut with text-overflow, or lines clamped): the element or an
  // ancestor ends in one, and a tooltip of the element or of an ancestor close by carries the
  // whole text.
  const excused = el => {
    let ellipsis = false, titled = false;
    let e = el;
    for (let i = 0; e && i < 4; i++, e = e.parentElement) {
      const s = getComputedStyle(e);
      if ((s.textOverflow === 'ellipsis' && s.whiteSpace.startsWith('nowrap'))
          || (s.webkitLineClamp && s.webkitLineClamp !== 'none')) { ellipsis = true; }
      if ((e.title || '').includes(text(el))) { titled = true; }
    }
    return ellipsis && titled;
  };
  // A select shows its chosen option's text: cut where the select is narrower, unless the select's
  // tooltip carries it.
  const canvas = document.createElement('canvas').getContext('2d');
  for (const el of root.querySelectorAll('select')) {
    const option = el.selectedOptions[0];
    if (!shown(el) || !option) { continue; }
    const s = getComputedStyle(el);
    canvas.font = `${s.fontWeight} ${s.fontSize} ${s.fontFamily}`;
    const need = canvas.measureText(option.text).width;
    const room = el.clientWidth - parseFloat(s.paddingLeft) - parseFloat(s.paddingRight) - 16;
    if (need > room && !(el.title || '').includes(option.text.replace(/ \([0-9a-f]{6}\)$/, ''))) {
      problems.push({ el: describe(el), text: option.text, why: `select cut: ${Math.round(need)} > ${Math.round(room)}` });
    }
  }
  for (const el of root.querySelectorAll('*')) {
    if (el.closest('svg') || !shown(el)) { continue; }
    const own = ownText(el);
    const button = el.tagName === 'BUTTON';
    if (!own && !(button && text(el))) { continue; }
    const s = getComputedStyle(el);
    const item = { el: describe(el), text: text(el).slice(0, 80) };
    if (s.display !== 'inline') {
      // (An element that scrolls — a log, a traceback — shows the rest on scrolling.)
      if (el.scrollWidth > el.clientWidth + 1 && !scrolls(s.overflowX) && !excused(el)) {
        problems.push({ ...item, why: `clipped across: ${el.scrollWidth} > ${el.clientWidth}` });
      }
      if (el.scrollHeight > el.clientHeight + 1 && !scrolls(s.overflowY) && !excused(el)) {
        problems.push({ ...item, why: `clipped down: ${el.scrollHeight} > ${el.clientHeight}` });
      }
    }
    const r = el.getBoundingClientRect();
    for (let a = el.parentElement; a && a !== document.body; a = a.parentElement) {
      const as = getComputedStyle(a);
      if (scrolls(as.overflowX) || scrolls(as.overflowY)) { break; }
      if (!hides(as.overflowX) && !hides(as.overflowY)) { continue; }
      const ar = a.getBoundingClientRect();
      const out = r.right > ar.right + 1 || r.left < ar.left - 1
        || r.bottom > ar.bottom + 1 || r.top < ar.top - 1;
      if (out && !excused(el)) {
        problems.push({ ...item, why: `clipped by ${describe(a)}` });
        break;
      }
    }
    // Words laid out over two lines (a line break inside a word).
    for (const node of el.childNodes) {
      if (node.nodeType !== Node.TEXT_NODE) { continue; }
      for (const m of node.textContent.matchAll(/[\p{L}\p{N}_]+(?:[.=][\p{L}\p{N}_]+)*/gu)) {
        const range = document.createRange();
        range.setStart(node, m.index);
        range.setEnd(node, m.index + m[0].length);
        const tops = [...range.getClientRects()].filter(q => q.width > 0).map(q => Math.round(q.top));
        if (tops.length && Math.max(...tops) - Math.min(...tops) > 2) {
          problems.push({ ...item, why: `the word "${m[0]}" breaks over two lines` });
        }
      }
    }
  }
  return problems;
}
"""


def _measure(page: Any, root: str) -> list[dict]:
    return page.evaluate(MEASURE_JS, [root])


def _explain(problems: list[dict]) -> str:
    return "\n".join(f"{p.get('why')}: {p.get('el')} {p.get('text', '')!r}" for p in problems)


def _wait_state(server: LabServer, run_id: str, state: str, timeout: float = 120.0) -> dict:
    last: dict = {}

    def check() -> bool:
        last["record"] = server.run(run_id)
        return last["record"]["state"] == state

    try:
        wait_until(check, timeout=timeout, interval=0.2)
    except AssertionError:
        raise AssertionError(f"{run_id} is not {state}: {last.get('record')}") from None
    return last["record"]


@pytest.fixture(scope="module")
def busy(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    """A server with two 24 GB virtual GPUs in a populated state, and what is in it."""
    server = _start(tmp_path_factory.mktemp("layout"), env={"EVALSCHED_VIRTUAL_GPUS": "24000,24000"})
    holder = _sleeper()
    try:
        lease = _create_lease(server, vram_mb=6000, pid=holder.pid, label=LEASE_LABEL)
        wait_until(lambda: server.lease(lease["id"])["state"] == "granted", timeout=30, interval=0.1)
        finished = _submit_sweep(
            server,
            {
                "name": FINISHED_SWEEP,
                "entrypoint": TOY,
                "episodes": 3,
                "sweep": {"skill": [0.3, 0.6, 0.9], "context_tokens": [4096, 131072]},
            },
        )
        _wait_sweep(server, finished["id"], _all_ended)
        failed = server.submit({"name": FAILED_RUN, "entrypoint": CRASH, "episodes": 2, "params": {"how": "exception"}})
        _wait_state(server, failed["id"], "failed")
        slow = {"entrypoint": SLEEPY, "episodes": 2000, "params": {"sleep_s": 0.5}}
        long_run = server.submit({**slow, "name": LONG_RUN, "scheduling": {"marginal_vram_mb": 9000}})
        running = _submit_sweep(
            server,
            {
                **slow,
                "name": RUNNING_SWEEP,
                "scheduling": {"marginal_vram_mb": 5000},
                "sweep": {"depth": [0.25, 0.75]},
            },
        )
        for run_id in [long_run["id"], *(r["id"] for r in running["runs"])]:
            _wait_state(server, run_id, "running")
        # Every GPU holds at least 5,000 MB now: 20,000 MB fits on none.
        waiting = server.submit({**slow, "name": WAITING_RUN, "scheduling": {"marginal_vram_mb": 20000}})
        wait_until(lambda: (server.run(waiting["id"]).get("why") or {}).get("code") == "waiting_vram", timeout=30)
        yield {
            "server": server,
            "lease": lease["id"],
            "finished_sweep": finished["id"],
            "finished_runs": [r["id"] for r in finished["runs"]],
            "running_sweep": running["id"],
            "running": [long_run["id"], *(r["id"] for r in running["runs"])],
            "failed": failed["id"],
            "waiting": waiting["id"],
        }
    finally:
        server.stop()
        _kill(holder)


def _panel_ready(page: Any, state: dict) -> None:
    page.wait_for_selector(f'{PANEL} .jp-EvalSched-conn[data-mode="live"]')
    for run_id in state["running"]:
        page.wait_for_selector(f'{PANEL} .jp-EvalSched-seg[data-run-id="{run_id}"]')
    page.wait_for_selector(
        f'{PANEL} .jp-EvalSched-run[data-run-id="{state["waiting"]}"][data-reason-code="waiting_vram"]'
    )
    page.wait_for_selector(f'{PANEL} .jp-EvalSched-run[data-run-id="{state["failed"]}"][data-state="failed"]')
    page.wait_for_selector(f'{PANEL} [data-testid="evalsched-lease-row"][data-lease-id="{state["lease"]}"]')


def test_panel_layout(busy: dict, browser: Any) -> None:
    """The panel: nothing clipped, no name broken inside a word; run segments labelled and in the
    legend; the reason of a run waiting for a lease names it with a short id; section counts
    count the rows shown."""
    server = busy["server"]
    _write_user_settings(server, {})
    context, page, errors = _open(browser, server)
    try:
        with failure_report(server, "lab-layout-panel-failure.png", lambda: page):
            _panel_ready(page, busy)
            # The running sweep expanded: its runs as rows too.
            sweep = page.locator(f'{SWEEP}[data-sweep-id="{busy["running_sweep"]}"]')
            sweep.locator('[data-testid="evalsched-sweep-toggle"]').click()
            sweep.locator('[data-testid="evalsched-sweep-runs"] .jp-EvalSched-run').first.wait_for(state="visible")

            # The failed run's detail open: its fields and error too.
            failed = page.locator(f'{PANEL} .jp-EvalSched-run[data-run-id="{busy["failed"]}"]')
            failed.locator('[data-testid="evalsched-details"]').click()
            failed.locator(".jp-EvalSched-detail").wait_for(state="visible")

            problems = _measure(page, PANEL)
            assert problems == [], _explain(problems)

            # Every run segment: in its GPU's legend, by name; labelled when it is wide enough.
            for run_id in busy["running"]:
                seg = page.locator(f'{PANEL} .jp-EvalSched-seg[data-run-id="{run_id}"]')
                name = server.run(run_id)["name"]
                item = page.locator(f'{PANEL} .jp-EvalSched-legendItem[data-legend-run-id="{run_id}"]')
                assert item.count() == 1, f"no legend entry for run {run_id}"
                assert item.get_attribute("title") and run_id in item.get_attribute("title")
                swatch_class = item.locator(".jp-EvalSched-swatch").get_attribute("class") or ""
                seg_class = seg.get_attribute("class") or ""
                slot = next(c for c in seg_class.split() if c.startswith("jp-EvalSched-c"))
                assert slot in swatch_class.split(), (slot, swatch_class)
                share = page.evaluate(
                    "([s]) => { const el = document.querySelector(s); return el.offsetWidth / el.parentElement.clientWidth; }",
                    [f'{PANEL} .jp-EvalSched-seg[data-run-id="{run_id}"]'],
                )
                if share >= 0.12:
                    label = seg.locator(".jp-EvalSched-segLabel")
                    assert label.count() == 1, f"run {run_id}'s segment ({share:.0%} of the bar) has no label"
                    assert label.inner_text() in name or name.startswith(label.inner_text().rstrip("…"))

            # The waiting run's reason names the lease (and the runs) with short ids, whole ids
            # only in tooltips: a whole id made the reason several lines longer.
            reason = page.locator(
                f'{PANEL} .jp-EvalSched-run[data-run-id="{busy["waiting"]}"] [data-testid="evalsched-reason"]'
            )
            text = reason.inner_text()
            for long_id in [busy["lease"], *busy["running"]]:
                assert long_id not in text, (long_id, text)
            short = busy["lease"].rsplit("-", 1)[1]
            assert short in text, text
            assert reason.locator(f'[title*="{busy["lease"]}"]').count() >= 1

            # Section counts: the rows shown (a sweep is one row), the runs in them in the tooltip.
            for section in ("running", "queued", "finished"):
                rows = page.locator(
                    f'{PANEL} .jp-EvalSched-list[data-section="{section}"] > .jp-EvalSched-run,'
                    f' {PANEL} .jp-EvalSched-list[data-section="{section}"] > .jp-EvalSched-sweep'
                ).count()
                count = page.locator(f'{PANEL} section[data-section="{section}"] .jp-EvalSched-count').text_content()
                assert count == str(rows), (section, count, rows)

            running = page.locator(f'{PANEL} section[data-section="running"] .jp-EvalSched-count')
            assert running.get_attribute("title") == "3 runs in 2 rows"

            page.evaluate(f"document.querySelector('{PANEL} .jp-EvalSched-body').scrollTop = 0")
            ARTIFACTS.mkdir(exist_ok=True)
            page.locator(PANEL).screenshot(path=str(ARTIFACTS / "lab-layout-panel.png"))
            # The README's and the guide's picture of the panel.
            if os.environ.get("EVALSCHED_DOC_SCREENSHOTS"):
                shots = Path(os.environ["EVALSCHED_DOC_SCREENSHOTS"])
                shots.mkdir(parents=True, exist_ok=True)
                page.locator(PANEL).screenshot(path=str(shots / "panel.png"))
            assert errors.errors == []
    finally:
        context.close()


def _open(browser: Any, server: LabServer, height: int = 1000) -> tuple[Any, Any, PageErrors]:
    """A page of JupyterLab with a fresh layout (``?reset``: not the one an earlier test left, a
    notebook open) and the panel shown."""
    context = browser.new_context(viewport={"width": 1400, "height": height})
    page = context.new_page()
    page.set_default_timeout(UI_TIMEOUT_MS)
    errors = PageErrors(page)
    page.goto(f"{server.url}lab?reset&token={server.token}", wait_until="domcontentloaded", timeout=60_000)
    page.wait_for_selector(PANEL, state="attached", timeout=60_000)
    page.wait_for_selector(PANEL_TAB, state="visible", timeout=60_000)
    _show_panel(page)
    return context, page, errors


def _show_panel(page: Any) -> None:
    """Until the panel is shown (a click on its tab while the layout is still being restored may
    be undone by the restorer: click again)."""

    def shown() -> bool:
        if not page.locator(PANEL).is_visible():
            page.click(PANEL_TAB)
            page.wait_for_timeout(500)
        return page.locator(PANEL).is_visible()

    wait_until(shown, timeout=60, interval=1)


def _notebook(server: LabServer, name: str, source: str) -> None:
    cell = {"cell_type": "code", "execution_count": None, "metadata": {}, "outputs": [], "source": source}
    nb = {
        "cells": [cell],
        "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}},
        "nbformat": 4,
        "nbformat_minor": 5,
    }
    (server.root / "work" / name).write_text(json.dumps(nb))


WIDGET = ".jupyter-evalsched-queue"


def test_widget_layout(busy: dict, browser: Any) -> None:
    """The ``%eval_queue`` widget in a notebook in Lab: nothing clipped (its Cancel buttons read
    "Cancel"), the labels in its GPU bars are as tall as a line, progress bars line up, and each
    run has the colour the panel gives it."""
    server = busy["server"]
    _write_user_settings(server, {})
    _notebook(server, "queue-widget.ipynb", "%load_ext jupyter_evalsched\n%eval_queue")
    context, page, errors = _open(browser, server, height=1400)  # the whole widget in its picture
    try:
        with failure_report(server, "lab-layout-widget-failure.png", lambda: page):
            _panel_ready(page, busy)
            page.goto(f"{server.url}lab/tree/queue-widget.ipynb?token={server.token}", wait_until="domcontentloaded")
            page.wait_for_selector(PANEL, state="attached", timeout=60_000)
            cell = page.locator(".jp-Notebook .jp-Cell .jp-InputArea-editor").first
            cell.wait_for(state="visible", timeout=60_000)
            page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle']", timeout=60_000)
            widget = page.locator(WIDGET)

            def ran() -> bool:
                # Run the cell in place (again, if a first try came before the kernel was ready).
                dialog = page.locator(".jp-Dialog")
                if dialog.count() and dialog.is_visible():  # "Select Kernel": the default one
                    dialog.locator("button.jp-mod-accept").click()
                    dialog.wait_for(state="detached")
                if page.locator(".jp-Notebook .jp-OutputArea-output").count() == 0:
                    cell.click()
                    page.keyboard.press("Control+Enter")
                return widget.count() > 0

            wait_until(ran, timeout=90, interval=5)
            widget.wait_for(state="visible", timeout=60_000)
            for run_id in busy["running"]:
                page.wait_for_function(
                    "([sel, id]) => (document.querySelector(sel)?.textContent || '').includes(id)", arg=[WIDGET, run_id]
                )
            _show_panel(page)
            page.wait_for_selector(f'{PANEL} .jp-EvalSched-seg[data-run-id="{busy["running"][0]}"]')

            problems = _measure(page, WIDGET)
            assert problems == [], _explain(problems)

            # The bars' labels are as tall as a line of their font.
            heights = page.evaluate(
                """([root]) => [...document.querySelectorAll(`${root} [data-seg-kind]`)]
                     .filter(el => el.textContent.trim())
                     .map(el => { const s = getComputedStyle(el);
                       // A line of its font: its line height, and at least 1.15 × its size (a
                       // squeezed line height would hide a clipped label).
                       const lh = Math.max(1.15 * parseFloat(s.fontSize),
                         s.lineHeight === 'normal' ? 0 : parseFloat(s.lineHeight));
                       return { text: el.textContent.trim(), h: el.clientHeight, lh, font: parseFloat(s.fontSize) }; })""",
                [WIDGET],
            )
            assert heights, "no labelled segment in the widget's GPU bars"
            for item in heights:
                assert item["h"] >= item["lh"] - 0.5 and item["font"] >= 9, item

            # Each running run: a segment labelled or in the legend by its name, in the panel's colour.
            for run_id in busy["running"]:
                name = server.run(run_id)["name"]
                seg = f'{WIDGET} [data-seg-kind="run"][data-run-id="{run_id}"]'
                legend = page.locator(f'{WIDGET} [data-legend-run-id="{run_id}"]')
                assert legend.count() == 1 and name in legend.inner_text(), run_id
                colors = page.evaluate(
                    "([a, b]) => [a, b].map(s => getComputedStyle(document.querySelector(s)).backgroundColor)",
                    [seg, f'{PANEL} .jp-EvalSched-seg[data-run-id="{run_id}"]'],
                )
                assert colors[0] == colors[1], (run_id, colors)

            # Progress bars (hidden ones hold their place) line up from row to row; every Cancel
            # button reads "Cancel".
            lefts = page.evaluate(
                f"() => [...document.querySelectorAll('{WIDGET} .widget-hprogress')]"
                ".map(el => Math.round(el.getBoundingClientRect().left))"
            )
            assert len(lefts) >= 3 and len(set(lefts)) == 1, lefts
            buttons = widget.locator("button")
            for i in range(buttons.count()):
                if buttons.nth(i).is_visible():
                    assert "Cancel" in buttons.nth(i).inner_text()

            ARTIFACTS.mkdir(exist_ok=True)
            widget.screenshot(path=str(ARTIFACTS / "lab-layout-widget.png"))
            if os.environ.get("EVALSCHED_DOC_SCREENSHOTS"):
                shots = Path(os.environ["EVALSCHED_DOC_SCREENSHOTS"])
                shots.mkdir(parents=True, exist_ok=True)
                widget.screenshot(path=str(shots / "widget.png"))
            assert errors.errors == []
    finally:
        context.close()


def test_compare_layout(busy: dict, browser: Any) -> None:
    """The compare view of a finished sweep: nothing clipped, names whole, and the table scrolls
    inside its own container instead of widening the view."""
    server = busy["server"]
    _write_user_settings(server, {})
    context, page, errors = _open(browser, server)
    try:
        with failure_report(server, "lab-layout-compare-failure.png", lambda: page):
            _panel_ready(page, busy)
            sweep_id = busy["finished_sweep"]
            page.locator(f'{SWEEP}[data-sweep-id="{sweep_id}"] [data-testid="evalsched-sweep-compare"]').click()
            root = f'{COMPARE}[data-sweep-id="{sweep_id}"]'
            page.wait_for_selector(f'{root}[data-status="ready"]')

            problems = _measure(page, root)
            assert problems == [], _explain(problems)
            sizes = page.evaluate(
                """([root]) => { const view = document.querySelector(root);
                     const host = view.querySelector('table').parentElement;
                     const hs = getComputedStyle(host);
                     return { view: [view.scrollWidth, view.clientWidth], host: [host.scrollWidth, host.clientWidth],
                              hostOverflow: hs.overflowX,
                              sticky: getComputedStyle(view.querySelector('td')).position }; }""",
                [root],
            )
            assert sizes["view"][0] <= sizes["view"][1] + 1, sizes  # the view itself never scrolls sideways
            if sizes["host"][0] > sizes["host"][1] + 1:
                # Wider than the view: it scrolls in its own box, the run column staying in view.
                assert sizes["hostOverflow"] in ("auto", "scroll"), sizes
                assert sizes["sticky"] == "sticky", sizes
            ARTIFACTS.mkdir(exist_ok=True)
            page.locator(root).screenshot(path=str(ARTIFACTS / "lab-layout-compare.png"))
            assert errors.errors == []
    finally:
        context.close()
