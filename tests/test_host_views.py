"""Issue #32, what each user sees of the others on a shared host: the Lab side panel (real
JupyterLab, real Chromium), the ipywidget and ``jupyter evalsched queue`` of a real server that
is a tenant of a real host ledger (served by an unprivileged system user on a virtual 24 GB GPU),
where another system user (bob, an agent: tests/host_ledger_agent.py) holds grants and runs a
process outside them. Each shows bob's holdings by his user name only, and nothing else of his.

The Lab server runs this checkout's code and lab extension (PYTHONPATH and JUPYTER_PATH point at
this repository), not whatever copy the environment has installed.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from host_ledger_users import PREFIX, Agent, Ledger, make_users
from test_lab_panel import PANEL, LabServer, _bin, _open_lab, _start, browser  # noqa: F401
from waiting import wait_until

from jupyter_evalsched.client import EvalSchedClient
from jupyter_evalsched.widget import QueueWidget

pytestmark = pytest.mark.timeout(240)

REPO = Path(__file__).resolve().parents[1]
BOB = PREFIX + "bob"
ME = "root"  # the tests (and so the Lab server) run as root


@pytest.fixture(scope="module")
def host(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """A host ledger, bob holding a run's grant (9000 MB) and a lease's (5000 MB) with a process
    outside them (2000 MB), and a Lab server of root's joined to the host ledger."""
    users = make_users()
    ledger = Ledger(users["ledger"], {"virtual_gpus": [24000], "reclaim_window_s": 0})
    ledger.start()
    bob = Agent(users["bob"], ledger.socket)
    lab = None
    spawned: list[int] = []
    try:
        bob.ok("connect")
        # His grants are tied to his run's process; his notebook's is outside them.
        run, notebook = bob.ok("spawn"), bob.ok("spawn")
        spawned += [run, notebook]
        for key, mb, kind in (("bob-secret-run", 9000, "run"), ("bob-secret-lease", 5000, "lease")):
            grant = bob.ok("request", key=key, vram_mb=mb, kind=kind)
            bob.ok("retie", grant=grant["id"], pids=[run])
        ledger.plant([{"pid": notebook, "gpu": 0, "used_mb": 2000}])
        root = tmp_path_factory.mktemp("tenant-lab")
        # This checkout's lab extension first on the Jupyter path, and its package first to import.
        extensions = root / "jupyter-path" / "labextensions"
        extensions.mkdir(parents=True)
        (extensions / "jupyter-evalsched").symlink_to(REPO / "jupyter_evalsched" / "labextension")
        lab = _start(
            root,
            env={
                "EVALSCHED_HOST_LEDGER": ledger.socket,
                "JUPYTER_PATH": str(root / "jupyter-path"),
                "PYTHONPATH": str(REPO),
            },
        )

        def bob_seen() -> dict | None:
            code, view = lab.request("GET", "evalsched/ledger")
            dev = view["devices"][0] if code == 200 and view["devices"] else {}
            outside = [p for p in dev.get("unmanaged_processes", []) if p.get("user") == BOB]
            return view if dev.get("users") and outside else None

        try:
            ledger_view = wait_until(bob_seen, timeout=30, message="the tenant never saw bob's holdings")
        except AssertionError as exc:
            raise AssertionError(
                f"{exc}: {lab.request('GET', 'evalsched/ledger')} {lab.request('GET', 'evalsched/status')} "
                f"{ledger.view()}\n{lab.log_tail()}"
            ) from None
        yield {"lab": lab, "ledger": ledger, "bob": bob, "view": ledger_view}
    finally:
        if lab is not None:
            lab.stop()
        for pid in spawned:  # they outlive the agent
            bob.ok("kill", pid=pid)
        bob.stop()
        ledger.stop()


def test_the_tenant_ledger_names_bob_and_nothing_else_of_his(host: dict[str, Any]) -> None:
    dev = host["view"]["devices"][0]
    assert dev["users"] == [{"user": BOB, "allocated_mb": 14000, "leases": 1, "runs": 1, "models": 0}]
    assert dev["free_mb"] == 24000 - 14000 - 2000
    assert "bob-secret" not in str(host["view"])
    code, status = host["lab"].request("GET", "evalsched/status")
    assert code == 200 and status["host_ledger"]["user"] == ME


def test_queue_cli_has_a_line_per_other_user(host: dict[str, Any]) -> None:
    lab = host["lab"]
    line = f"  user {BOB}: 14,000 MB (1 run, 1 lease); 2,000 MB outside the scheduler"

    def queue() -> subprocess.CompletedProcess | None:
        out = subprocess.run(
            [_bin("jupyter-evalsched"), "queue", "--url", lab.url, "--token", lab.token],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )
        assert out.returncode == 0, out.stderr
        return out if line in out.stdout.splitlines() else None

    # The view is the host ledger's as last refreshed (every second, and at each event): one
    # refreshed as the command ran may say a moment later what it says.
    try:
        out = wait_until(queue, timeout=30, message="the queue never showed bob's line")
    except AssertionError as exc:
        raise AssertionError(
            f"{exc}: {lab.request('GET', 'evalsched/status')} {host['ledger'].view()}\n{lab.log_tail()}\n"
            f"host ledger's log: {Path(host['ledger'].log).read_text()[-3000:]}"
        ) from None
    lines = out.stdout.splitlines()
    assert f"user {BOB} 2000 MB" in lines[0]  # the GPU's "other" VRAM is bob's, not a bare pid
    assert "bob-secret" not in out.stdout and "pid " not in out.stdout


def test_queue_widget_draws_bob_by_name(host: dict[str, Any]) -> None:
    lab = host["lab"]
    widget = QueueWidget(EvalSchedClient(lab.url, lab.token), use_events=False)
    try:

        def drawn() -> str | None:
            html = widget._ledger.value
            return html if f"data-user='{BOB}'" in html and "outside the scheduler" in html else None

        html = wait_until(drawn, timeout=30, message="the widget never drew bob's holdings")
        assert f"{BOB}: 14,000 MB (1 run, 1 lease)" in html
        assert f"{BOB}: 2,000 MB outside the scheduler" in html
        assert "data-seg-kind='user'" in html and "data-seg-kind='user-process'" in html
        assert "bob-secret" not in html and "pid " not in html
        assert "other users 14000 MB" in html
    finally:
        widget.close()


@pytest.mark.browser
def test_panel_shows_bob_by_name(host: dict[str, Any], browser: Any) -> None:  # noqa: F811
    lab = host["lab"]
    context, page, errors = _open_lab(browser, lab)
    try:
        gpu = page.locator(f'{PANEL} [data-testid="evalsched-gpu"][data-index="0"]')
        grants = gpu.locator(f'.jp-EvalSched-seg-user[data-user="{BOB}"]')
        grants.wait_for(state="attached")
        assert grants.get_attribute("data-mb") == "14000"
        assert grants.get_attribute("title") == f"{BOB}: 14,000 MB (1 run, 1 lease)"
        assert grants.get_attribute("data-user-runs") == "1" and grants.get_attribute("data-user-leases") == "1"
        # Bob's process outside his grants: labelled by his name once the panel knows who it is.
        outside = gpu.locator(f'.jp-EvalSched-seg-userProcess[data-user="{BOB}"]')
        outside.wait_for(state="attached")
        assert outside.get_attribute("data-mb") == "2000"
        assert outside.get_attribute("title") == f"{BOB}: 2,000 MB outside the scheduler"
        legend = gpu.locator(".jp-EvalSched-legend")
        text = legend.inner_text()
        assert f"{BOB}: 14,000 MB (1 run, 1 lease)" in text
        assert f"{BOB}: 2,000 MB outside the scheduler" in text
        assert "pid " not in text
        assert gpu.locator('.jp-EvalSched-seg[data-kind="reserved"]').count() == 0  # nothing lumped
        assert gpu.locator(".jp-EvalSched-seg-free").get_attribute("data-mb") == "8000"
        assert "bob-secret" not in gpu.inner_html()
        assert not errors.errors, errors.errors
    finally:
        context.close()
