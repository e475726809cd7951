"""The widgets' models follow a real server: queue, ledger, progress, cancel, close."""

from __future__ import annotations

import json
import os
import re
import threading
import time
from pathlib import Path

import pytest

from jupyter_evalsched.client import EvalSchedClientError
from jupyter_evalsched.widget import (
    RUN_PALETTE,
    QueueWidget,
    RunProgress,
    _RunRow,
    color_slot,
    ledger_html,
    run_color,
    run_row_html,
)

try:
    from .live_server import SLEEPY, clean_queue, client, live_server, wait_state, wait_until
except ImportError:
    from live_server import SLEEPY, clean_queue, client, live_server, wait_state, wait_until  # noqa: F401


def _big(name: str, sleep_s: float = 30, episodes: int = 1) -> dict:
    return {
        "name": name,
        "entrypoint": SLEEPY,
        "episodes": episodes,
        "params": {"sleep_s": sleep_s},
        "scheduling": {"marginal_vram_mb": 16000},
    }


def _rows(widget: QueueWidget) -> dict[str, _RunRow]:
    return {c.run_id: c for c in widget._rows_box.children if isinstance(c, _RunRow)}


def _feed_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("evalsched-")]


@pytest.mark.parametrize("use_events", [True, False], ids=["events", "polling"])
def test_queue_widget_follows_queue_and_ledger_then_stops_when_closed(client, clean_queue, use_events):
    widget = QueueWidget(client, use_events=use_events, poll_s=0.3)
    try:
        wait_until(lambda: widget.mode == ("live" if use_events else "polling"), timeout=10)
        ids = [client.submit(_big(f"w{i}"))["id"] for i in range(3)]
        # The model receives the new queue and ledger without being asked to.
        wait_until(
            lambda: len(widget.queue_view["running"]) == 2 and len(widget.queue_view["queued"]) == 1,
            timeout=10,
            message=f"widget saw {widget.queue_view}",
        )
        devices = widget.queue_view["ledger"]["devices"]
        wait_until(
            lambda: [d["allocated_mb"] for d in widget.queue_view["ledger"]["devices"]] == [16000, 16000], timeout=5
        )
        assert {d["index"] for d in devices} == {0, 1}
        # ... and renders it: bars name the runs, the queued row gives its reason.
        wait_until(lambda: "w0" in widget._ledger.value and "w1" in widget._ledger.value, timeout=5)
        rows = wait_until(lambda: (r := _rows(widget)) and ids[2] in r and r, timeout=5)
        # The pending reason is set by the admission pass after the submission's event.
        wait_until(lambda: "waiting_vram" in rows[ids[2]].label.value, timeout=2)
        # (A render made while ids[0] was admitted but still starting shows all of the above, and
        # its row as queued, bar hidden: the render after its start shows the bar.)
        wait_until(lambda: rows[ids[0]].bar.layout.visibility == "visible", timeout=5)

        # The cancel button of the queued run cancels it; the widget sees the change.
        rows[ids[2]].button.click()
        assert wait_state(client, ids[2], timeout=5)["state"] == "cancelled"
        wait_until(lambda: not widget.queue_view["queued"], timeout=5)

        widget.close()  # (joins the feed's thread: a render under way ends before it returns)
        count = widget.update_count
        assert widget.mode == "stopped" and not widget._feed.alive
        # Closed: further changes do not reach it, while they reach a widget that is open.
        control = QueueWidget(client, use_events=use_events, poll_s=0.3)
        try:
            client.cancel(ids[0])
            wait_until(lambda: ids[0] not in [r["id"] for r in control.queue_view["running"]], timeout=10)
        finally:
            control.close()
        assert widget.update_count == count
        assert len(widget.queue_view["running"]) == 2
    finally:
        widget.close()


@pytest.mark.parametrize("use_events", [True, False], ids=["events", "polling"])
def test_queue_widget_reads_only_the_queued_runs_it_shows_and_counts_the_rest(client, clean_queue, use_events):
    widget = QueueWidget(client, use_events=use_events, poll_s=0.3, max_queued_rows=2)
    try:
        wait_until(lambda: widget.mode == ("live" if use_events else "polling"), timeout=10)
        ids = [client.submit(_big(f"l{i}"))["id"] for i in range(7)]  # two run, five wait
        wait_until(
            lambda: widget.queue_view.get("queued_total") == 5 and len(widget.queue_view["running"]) == 2,
            timeout=10,
            message=f"widget saw {widget.queue_view}",
        )
        # A read (not events alone) placed the head of the queue: the first two in admission order.
        wait_until(lambda: [r["id"] for r in widget.queue_view["queued"]] == ids[2:4], timeout=5)
        wait_until(lambda: "… and 3 more queued" in widget._more_queued.value, timeout=5)
        assert "5 queued" in widget._header.value and "Queued (5)" in widget._queued_title.value
        # The feed's thread sets the rows last in a render: waited for, not read half-way.
        # (The recently finished runs of earlier tests have rows too.)
        rows = wait_until(lambda: (r := _rows(widget)) and set(ids[:4]) <= set(r) and r, timeout=5)
        assert not set(ids[4:]) & set(rows)
    finally:
        widget.close()


def test_queue_widget_falls_back_to_polling_when_the_socket_fails(client, clean_queue, monkeypatch):
    def broken(*args, **kwargs):
        raise EvalSchedClientError("proxy dropped the WebSocket")

    monkeypatch.setattr(client, "events", broken)
    widget = QueueWidget(client, poll_s=0.3)
    try:
        wait_until(lambda: widget.mode == "polling", timeout=5)
        rid = client.submit(_big("polled"))["id"]
        wait_until(lambda: rid in [r["id"] for r in widget.queue_view["running"]], timeout=5)
        wait_until(lambda: "proxy dropped the WebSocket" in widget._header.value, timeout=5)
    finally:
        widget.close()
    assert not widget._feed.alive


def test_run_progress_follows_one_run_to_the_end(client, clean_queue):
    rec = client.submit({"entrypoint": SLEEPY, "episodes": 4, "params": {"sleep_s": 0.1}, "name": "followed"})
    progress = RunProgress(rec["id"], client)
    try:
        wait_until(lambda: progress.record["state"] == "succeeded", timeout=20)
        wait_until(lambda: not progress._feed.alive, timeout=5)  # it stops by itself at the end
        assert progress._bar.value == progress._bar.max == 4
        assert progress._bar.bar_style == "success"
        assert "score=" in progress._status.value and 0 <= progress.metrics["score"] < 1
        assert progress._button.disabled
    finally:
        progress.close()


def test_closing_widgets_leaves_no_threads(client):
    before = len(_feed_threads())
    widgets = [QueueWidget(client) for _ in range(3)]
    wait_until(lambda: all(w.mode == "live" for w in widgets), timeout=10)
    assert len(_feed_threads()) >= before + 3
    for w in widgets:
        w.close()
    wait_until(lambda: len(_feed_threads()) <= before, timeout=5)


def test_ledger_html_shows_baseline_runs_and_free():
    ledger = {
        "devices": [
            {
                "index": 0,
                "name": "A100",
                "total_mb": 40000,
                "baseline_mb": 14000,
                "usable_mb": 26000,
                "allocated_mb": 16000,
                "free_mb": 10000,
                "runs": [{"id": "r1", "marginal_vram_mb": 16000}],
            }
        ],
        "cpu_slots": {"total": 8, "allocated": 1},
    }
    html = ledger_html(ledger, {"r1": "<evil>"})
    assert "allocated 16000 / usable 26000 MB" in html and "models 14000 MB" in html
    assert "free 10000 MB" in html and "&lt;evil&gt;" in html and "<evil>" not in html
    assert "CPU slots: 1 / 8" in html


class _ViewOnlyClient:
    """Stands in for a server that has nothing: the widgets below render views fed to them."""

    base_url = "http://test.invalid/"

    def queue(self, limit: int | None = None) -> dict:
        return {"queued": [], "running": [], "ledger": None}

    def list(self, **_kw) -> list:
        return []


def _slurm_run(rid: str, state: str, job: str | None, slurm_state: str | None, **extra) -> dict:
    return {
        "id": rid,
        "name": rid,
        "state": state,
        "priority": "normal",
        "reason": None,
        "submitted_at": "2026-01-01T00:00:00+00:00",
        "started_at": None,
        "finished_at": None,
        "devices": [],
        "marginal_vram_mb": 16000,
        "progress": {"done": 1, "total": 4},
        "executor": "slurm",
        "slurm_job_id": job,
        "slurm_state": slurm_state,
        **extra,
    }


def test_queue_widget_shows_slurm_runs_with_job_id_and_state():
    view = {
        "running": [
            _slurm_run("s1", "running", "123", "RUNNING", started_at="2026-01-01T00:00:05+00:00"),
            {
                "id": "l1",
                "name": "l1",
                "state": "running",
                "priority": "normal",
                "devices": [0],
                "marginal_vram_mb": 8000,
                "progress": {"done": 0, "total": 2},
                "executor": "local",
                "started_at": "2026-01-01T00:00:05+00:00",
            },
        ],
        "queued": [
            _slurm_run(
                "s2", "queued", "124", "PENDING", reason="waiting_cpu: SLURM job 124 submitted, not yet scheduled"
            ),
            _slurm_run("s3", "queued", None, None),
        ],
        "ledger": {
            "devices": [
                {
                    "index": 0,
                    "name": "GPU",
                    "total_mb": 24000,
                    "usable_mb": 24000,
                    "allocated_mb": 8000,
                    "free_mb": 16000,
                    "runs": [{"id": "l1", "marginal_vram_mb": 8000}],
                }
            ]
        },
    }
    widget = QueueWidget(_ViewOnlyClient(), live=False)
    try:
        widget.show_view(
            view, finished=[_slurm_run("s0", "succeeded", "122", "COMPLETED", finished_at="2026-01-01T00:01:00+00:00")]
        )
        rows = _rows(widget)
        assert set(rows) == {"s0", "s1", "s2", "s3", "l1"}
        running = rows["s1"].label.value
        assert "SLURM 123 · RUNNING" in running and "jupyter-evalsched-slurm" in running
        assert "data-slurm-job-id='123'" in running and "16000 MB" not in running
        assert "SLURM 124 · PENDING" in rows["s2"].label.value
        assert "waiting_cpu" in rows["s2"].label.value
        assert ">SLURM<" in rows["s3"].label.value  # sbatch has not answered: no job id yet
        assert "SLURM 122 · COMPLETED" in rows["s0"].label.value
        # A local run keeps its VRAM and GPU text and has no badge.
        local = rows["l1"].label.value
        assert "8000\u00a0MB" in local and "GPU\u00a00" in local and "SLURM" not in local  # no break inside
        # SLURM runs are not on this host's GPUs: not in the ledger bars.
        assert "s1" not in widget._ledger.value
    finally:
        widget.close()
    assert run_row_html(_slurm_run("s4", "running", "9", "COMPLETING")).count("SLURM 9 · COMPLETING") == 1


def test_run_progress_shows_the_slurm_badge():
    progress = RunProgress(_slurm_run("s5", "running", "125", "RUNNING"), _ViewOnlyClient(), live=False)
    try:
        assert "SLURM 125 · RUNNING" in progress._status.value
        progress.update({**progress.record, "state": "succeeded", "slurm_state": "COMPLETED"})
        assert "SLURM 125 · COMPLETED" in progress._status.value
        progress.update({"id": "s5", "state": "running", "executor": "local", "devices": [0]})
        assert "SLURM" not in progress._status.value
    finally:
        progress.close()


def test_feed_thread_updates_reach_a_real_kernels_frontend(live_server, clean_queue, monkeypatch, tmp_path):
    """In a real ipykernel, comm messages sent by the feed thread reach the frontend: nbclient
    records the widget state it receives, and the row of a run that finished while the kernel
    slept (nothing on the main thread touched the widget) says ``succeeded``."""
    import nbformat
    from nbclient import NotebookClient

    for key, value in live_server.env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("JPY_PARENT_PID", raising=False)
    repo = str(__import__("pathlib").Path(__file__).resolve().parents[1])
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([repo, os.environ.get("PYTHONPATH", "")]))
    nb = nbformat.v4.new_notebook(
        cells=[
            nbformat.v4.new_code_cell("%load_ext jupyter_evalsched\n%eval_queue --out w"),
            nbformat.v4.new_code_cell(
                f"h = %eval_submit {SLEEPY} --name in-kernel --episodes 3 --param sleep_s=0.2\n"
                "import time\n"
                "def row_says_succeeded():  # rendered by the feed's thread, nothing here touches w\n"
                "    rows = [c for c in w._rows_box.children if getattr(c, 'run_id', None) == h.id]\n"
                "    return any('>succeeded<' in r.label.value for r in rows)\n"
                "deadline = time.monotonic() + 30\n"
                "while not row_says_succeeded() and time.monotonic() < deadline:\n"
                "    time.sleep(0.05)\n"
                "# A trait's value is set before its comm message is sent: one more whole render\n"
                "# (update_count goes up after its messages) before the cell ends.\n"
                "n = w.update_count\n"
                "while w.update_count <= n and time.monotonic() < deadline:\n"
                "    time.sleep(0.05)\n"
                "print(h.id, w.mode)"
            ),
            nbformat.v4.new_code_cell("w.close()"),
        ]
    )
    NotebookClient(
        nb, timeout=60, kernel_name="python3", store_widget_state=True, resources={"metadata": {"path": str(tmp_path)}}
    ).execute()
    run_id, mode = nb.cells[1].outputs[-1]["text"].split()
    assert mode == "live"
    states = nb.metadata["widgets"]["application/vnd.jupyter.widget-state+json"]["state"]
    labels = [m["state"].get("value", "") for m in states.values() if m.get("model_name") == "HTMLModel"]
    row = [v for v in labels if run_id in v and "in-kernel" in v and "<code" in v]
    assert row and ">succeeded<" in row[-1], row


def test_interpreter_exit_with_live_widgets_is_clean(live_server, clean_queue, tmp_path):
    """A kernel that shuts down with widgets still open exits at once and prints nothing."""
    import subprocess
    import sys

    script = (
        "import time\n"
        "from jupyter_evalsched.client import EvalSchedClient\n"
        "from jupyter_evalsched.widget import QueueWidget, RunProgress\n"
        "c = EvalSchedClient()\n"
        f"rec = c.submit({{'entrypoint': {SLEEPY!r}, 'episodes': 1, 'params': {{'sleep_s': 30}}}})\n"
        "widgets = [QueueWidget(c), QueueWidget(c, use_events=False), RunProgress(rec['id'], c)]\n"
        "deadline = time.monotonic() + 10\n"
        "while not all(w.mode in ('live', 'polling') for w in widgets) and time.monotonic() < deadline:\n"
        "    time.sleep(0.02)\n"
        "assert all(w.mode in ('live', 'polling') for w in widgets), [w.mode for w in widgets]\n"
        "print('ok', flush=True)\n"
    )
    env = dict(os.environ, **live_server.env)
    repo = str(__import__("pathlib").Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join([repo, env.get("PYTHONPATH", "")])
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=30, cwd=str(tmp_path)
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok" and proc.stderr == ""
    assert time.monotonic() - started < 10


def test_run_rows_tell_attempts():
    first = {"id": "a", "name": "n", "state": "running", "progress": {"done": 1, "total": 4}, "attempt": 1}
    assert "attempt" not in run_row_html(first) and "preempted" not in run_row_html(first)
    again = {**first, "attempt": 3, "preemptions": 1, "retries": 2, "retries_used": 1, "detach": True}
    row = run_row_html(again)
    assert "attempt 3 · preempted ×1 · retry 1/2 · detached" in row


def test_run_progress_resumes_a_failed_run_and_follows_it(client, clean_queue):
    rec = client.submit(
        {
            "entrypoint": "jupyter_evalsched.examples.basic:crash",
            "episodes": 3,
            "params": {"how": "exit", "code": 3, "at": 1, "until_attempt": 1},
            "name": "resumable",
        }
    )
    progress = RunProgress(rec["id"], client)
    try:
        wait_until(lambda: progress.record["state"] == "failed", timeout=20)
        # The feed's thread sets the record first, then the buttons.
        wait_until(
            lambda: progress._resume_button.layout.display == "" and progress._button.layout.visibility == "hidden",
            timeout=5,
        )
        progress._resume_button.click()
        wait_until(lambda: progress.record["state"] == "succeeded", timeout=20)
        assert progress.record["attempt"] == 2 and progress._resume_button.layout.display == "none"
        assert "attempt 2" in progress._status.value
        wait_until(lambda: not progress._feed.alive, timeout=5)
        progress._resume_button.click()  # refused now (it succeeded): the error is shown, nothing breaks
        assert "cannot be resumed" in progress._status.value
    finally:
        progress.close()


def test_a_queued_row_names_what_holds_it_from_its_why():
    from jupyter_evalsched.contract import Holder, Why

    why = Why("waiting_vram", "needs 16000 MB on 1 GPU", holders=[Holder("lease", "lease-1", "notes.ipynb", 0, 20000)])
    rec = {"id": "q", "name": "waits", "state": "queued", "progress": {}, "reason": why.reason, "why": why.as_dict()}
    assert "waiting_vram: behind lease notes.ipynb (GPU 0, 20000 MB); needs 16000 MB on 1 GPU" in run_row_html(rec)
    # A record without a why shows its reason as it is.
    assert "waiting_cpu: needs 3 CPU slots" in run_row_html(
        {**rec, "why": None, "reason": "waiting_cpu: needs 3 CPU slots"}
    )


RUN_COLORS = Path(__file__).resolve().parents[1] / "labextension" / "src" / "__tests__" / "fixtures" / "run-colors.json"


def test_run_colors_match_the_panel():
    """One colour rule for a run in the widget and in the Lab panel: the ids and slots of the
    fixture the panel's Jest test reads too, and the palette of the panel's stylesheet."""
    fixture = json.loads(RUN_COLORS.read_text())
    assert list(RUN_PALETTE) == fixture["palette"]
    css = (RUN_COLORS.parents[3] / "style" / "base.css").read_text()
    panel = re.search(r"\.jp-EvalSched \{(.*?)\}", css, re.S).group(1)
    assert re.findall(r"--jp-evalsched-c(\d): (#[0-9a-f]{6});", panel) == [
        (str(i), c) for i, c in enumerate(RUN_PALETTE)
    ]
    for case in fixture["cases"]:
        assert color_slot(case["id"]) == case["slot"], case["id"]
        assert run_color(case["id"]) == case["color"]


def test_ledger_html_labels_and_legends_every_run():
    """Each run's segment: its colour, its name inside when it is wide enough, and an entry in the
    legend under the bar (with its MB) whatever its width."""
    ledger = {
        "devices": [
            {
                "index": 0,
                "name": "A100",
                "total_mb": 40000,
                "usable_mb": 40000,
                "allocated_mb": 20500,
                "free_mb": 19500,
                "runs": [{"id": "big", "marginal_vram_mb": 20000}, {"id": "tiny", "marginal_vram_mb": 500}],
                "leases": [{"id": "lease-1", "label": "exploration-of-long-context-retrieval", "vram_mb": 0}],
            }
        ]
    }
    html = ledger_html(ledger, {"big": "big-run", "tiny": "tiny-run"})
    big = re.search(r"<div data-seg-kind='run' data-run-id='big'[^>]*>(.*?)</div>", html).group(0)
    assert f"background:{run_color('big')}" in big and ">big-run</span>" in big
    tiny = re.search(r"<div data-seg-kind='run' data-run-id='tiny'[^>]*>(.*?)</div>", html).group(0)
    assert "tiny-run" not in tiny.split(">", 1)[1]  # too narrow for a label: only its tooltip
    for rid, text in (("big", "big-run 20000 MB"), ("tiny", "tiny-run 500 MB")):
        item = re.search(rf"<span data-legend-run-id='{rid}'.*?</span>(.*?)</span>", html)
        assert item and item.group(1) == text, html


def test_run_row_names_ids_short_in_reasons():
    """A reason names a lease or run by a short id (the whole id in a tooltip), as the panel does:
    whole ids made a reason several lines long."""
    lease = "lease-20261203T063805.937217-3eda47"
    rec = {
        "id": "20261203T063806.448589-41dfab",
        "name": "waits",
        "state": "queued",
        "reason": f"waiting_vram: lease {lease} (exploration) holds 6000 MB on GPU 0",
    }
    html = run_row_html(rec)
    assert f"lease <span title='{lease}'>3eda47</span> (exploration)" in html
    assert html.count(lease) == 1  # only in the tooltip
    assert ">20261203T063806.448589-41dfab</code>" in html  # the row's own id stays whole


def _shared_host_device(**extra) -> dict:
    """A GPU of a server that is a tenant of a host ledger: bob holds grants and a process outside
    them; the server's own notebook is root's."""
    return {
        "index": 0,
        "name": "virtual",
        "total_mb": 24000,
        "baseline_mb": 0,
        "usable_mb": 24000,
        "allocated_mb": 4000,
        "free_mb": 24000 - 4000 - 3000 - 14000,
        "unmanaged_mb": 3000,
        "exclusive": None,
        "runs": [{"id": "r1", "marginal_vram_mb": 4000}],
        "leases": [],
        "users": [{"user": "bob", "allocated_mb": 14000, "runs": 2, "leases": 1}],
        "unmanaged_processes": [
            {"pid": 11, "gpu": 0, "used_mb": 1000, "name": "python", "session_path": "w/mine.ipynb", "user": "root"},
            {"pid": 77, "gpu": 0, "used_mb": 2000, "user": "bob"},
        ],
        **extra,
    }


def test_ledger_html_draws_other_users_by_name_and_a_ledger_without_them_as_before():
    ledger = {"devices": [_shared_host_device()], "cpu_slots": {"total": 4, "allocated": 0}}
    html = ledger_html(ledger, {"r1": "mine"}, me="root")
    assert "data-seg-kind='user' data-user='bob'" in html
    assert "bob: 14,000 MB (2 runs, 1 lease)" in html
    assert "data-seg-kind='user-process' data-user='bob'" in html
    assert "bob: 2,000 MB outside the scheduler" in html and "pid 77" not in html
    assert "mine.ipynb 1000 MB" in html  # this user's own notebook, as before
    assert "other users 14000 MB" in html and ">other 0" not in html
    # Before the server's user is known: bob's grants by name, his process by pid.
    html = ledger_html(ledger, {"r1": "mine"})
    assert "bob: 14,000 MB (2 runs, 1 lease)" in html and "pid 77 2000 MB" in html
    # Without a host ledger (no users, no process of another user): exactly as before.
    plain = _shared_host_device(users=[], unmanaged_processes=[], free_mb=17000, unmanaged_mb=3000)
    assert ledger_html({"devices": [plain]}, me="root") == ledger_html({"devices": [dict(plain, users=None)]})
    assert "data-user" not in ledger_html({"devices": [plain]}, me="root")
