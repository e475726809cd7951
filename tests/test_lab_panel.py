"""The JupyterLab side panel, in a real JupyterLab and a real Chromium.

A `jupyter lab` subprocess (random port, token, non-root base URL, isolated Jupyter directories,
virtual 24 GB GPU) serves the prebuilt `jupyter-evalsched` lab extension and the server extension.
Playwright drives Debian's Chromium: the panel must show the ledger, the queue with its pending
reason, progress, metrics, logs, finished runs, and cancel runs through a confirmation dialog,
live over the event socket and, when told not to use it, by polling the REST API; leases (drawn in
the ledger, listed, released through a confirmation dialog), the VRAM of other processes per
holder (a notebook kernel, a pid, a lease holder's excess) and a run's over_vram warning, fed by
the virtual GPU process table (EVALSCHED_VIRTUAL_GPU_PROCESSES); attempts: Resume of a failed run,
a preempted run and an automatic retry (on a server of their own, with preemption and back-off
short enough to watch). A server without the server extension checks that the panel says so.

Needs: the package installed (``pip install -e .``) with the lab extension built and linked
(``jupyter labextension develop --overwrite .``), /usr/bin/chromium and the playwright package.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import psutil
import pytest
from lab_failures import ARTIFACTS, failure_report
from waiting import wait_until

pytestmark = pytest.mark.browser

REPO = Path(__file__).resolve().parents[1]
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--headless",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
BASE_URL = "/lab-test/"
PANEL = "#jupyter-evalsched-panel"
PANEL_TAB = '.lm-TabBar-tab[data-id="jupyter-evalsched-panel"]'
VRAM = 24000
SLEEPY = "jupyter_evalsched.examples.basic:sleepy"
CRASH = "jupyter_evalsched.examples.basic:crash"
# Outlives a cancel's SIGTERM until the test writes its release file, then dies of it.
STUBBORN = f"{Path(__file__).resolve().parent / 'evals_observed.py'}:stubborn"
# Generous: runs are real subprocesses and CI machines have two cores.
UI_TIMEOUT_MS = 30_000


def _bin(name: str) -> str:
    """An executable of this interpreter's environment (the venv), whatever PATH says."""
    candidate = Path(sys.executable).parent / name
    return str(candidate) if candidate.exists() else name


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _isolated_env(root: Path) -> dict[str, str]:
    """Environment of a server: own HOME, Jupyter config/data/runtime dirs and runs dir.

    The venv's share/jupyter (where the lab extension is linked) and etc/jupyter (which enables
    the server extension) stay on the Jupyter paths: they come from sys.prefix, not from HOME.
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith(("EVALSCHED_", "JUPYTER_"))}
    dirs = {name: root / name for name in ("home", "config", "data", "runtime", "runs", "work")}
    for path in dirs.values():
        path.mkdir(parents=True, exist_ok=True)
    processes = _process_table_path(root)
    if not processes.exists():
        processes.write_text("[]")
    env.update(
        HOME=str(dirs["home"]),
        JUPYTER_CONFIG_DIR=str(dirs["config"]),
        JUPYTER_DATA_DIR=str(dirs["data"]),
        JUPYTER_RUNTIME_DIR=str(dirs["runtime"]),
        JUPYTER_PLATFORM_DIRS="0",
        EVALSCHED_VIRTUAL_GPUS=str(VRAM),
        EVALSCHED_RUNS_DIR=str(dirs["runs"]),
        EVALSCHED_CPU_SLOTS="4",
        EVALSCHED_VIRTUAL_GPU_PROCESSES=str(processes),
        PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        PYTHONUNBUFFERED="1",
    )
    return env


def _process_table_path(root: Path) -> Path:
    """The virtual GPU process table of a server: `[{"pid", "gpu", "used_mb"}]`, re-read on change."""
    return root / "gpu-processes.json"


class LabServer:
    """A `jupyter lab` subprocess; this object holds the server's own PID (no shell between)."""

    def __init__(self, root: Path, *, evalsched: bool = True, env: dict[str, str] | None = None) -> None:
        self.root = root
        self.port = _free_port()
        self.token = secrets.token_hex(16)
        self.url = f"http://127.0.0.1:{self.port}{BASE_URL}"
        self.env = {**_isolated_env(root), **(env or {})}
        if not evalsched:
            # The user config dir has the last word over the venv's conf.d auto-enable file.
            (root / "config" / "jupyter_server_config.json").write_text(
                json.dumps({"ServerApp": {"jpserver_extensions": {"jupyter_evalsched": False}}})
            )
        # No "get notified about Jupyter news?" toast over the side panel.
        _write_settings(
            self, "@jupyterlab/apputils-extension", "notification", {"fetchNews": "false", "checkForUpdates": False}
        )
        self.log_path = root / "jupyter-lab.log"
        self._log = open(self.log_path, "wb")
        argv = [
            sys.executable,
            "-m",
            "jupyterlab",
            "--no-browser",
            "--allow-root",
            "--ServerApp.ip=127.0.0.1",
            f"--ServerApp.port={self.port}",
            "--ServerApp.port_retries=0",
            f"--IdentityProvider.token={self.token}",
            f"--ServerApp.base_url={BASE_URL}",
            f"--ServerApp.root_dir={root / 'work'}",
            "--LabApp.news_url=",
            "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
        ]
        # exec semantics: Popen of the interpreter itself, so self.proc.pid is the server's PID.
        self.proc = subprocess.Popen(
            argv,
            cwd=root / "work",
            env=self.env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    # -- REST helpers (token auth, like any client of the contract) --------------------------

    def request(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(
            self.url + path.lstrip("/"),
            data=data,
            method=method,
            headers={"Authorization": f"token {self.token}", "Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(req, timeout=30) as resp:
                raw = resp.read()
                status = resp.status
                ctype = resp.headers.get("Content-Type", "")
        except urllib.error.HTTPError as err:
            raw = err.read()
            status = err.code
            ctype = err.headers.get("Content-Type", "")
        if "json" in ctype:
            return status, json.loads(raw or b"null")
        return status, raw.decode(errors="replace")

    def submit(self, spec: dict) -> dict:
        status, record = self.request("POST", "evalsched/runs", spec)
        assert status == 201, (status, record)
        return record

    def run(self, run_id: str) -> dict:
        status, record = self.request("GET", f"evalsched/runs/{run_id}")
        assert status == 200, (status, record)
        return record

    def lease(self, lease_id: str) -> dict:
        status, record = self.request("GET", f"evalsched/leases/{lease_id}")
        assert status == 200, (status, record)
        return record

    def set_gpu_processes(self, entries: list[dict]) -> None:
        """Replace the virtual GPU process table (atomically: the server re-reads it on change)."""
        path = _process_table_path(self.root)
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(json.dumps(entries))
        os.replace(tmp, path)

    def wait_ready(self, *, evalsched: bool, timeout: float = 90.0) -> None:
        def ready() -> bool:
            if self.proc.poll() is not None:
                raise AssertionError(f"jupyter lab exited with {self.proc.returncode}")
            status, _ = self.request("GET", "api/status")
            if status == 200 and evalsched:
                status, _ = self.request("GET", "evalsched/queue")
            return status == 200

        try:
            wait_until(
                ready,
                timeout=timeout,
                interval=0.25,
                message="jupyter lab not ready",
                ignore=(urllib.error.URLError, ConnectionError, OSError),
            )
        except AssertionError as exc:
            raise AssertionError(f"{exc}:\n{self.log_tail()}") from None

    def log_tail(self, lines: int = 60) -> str:
        self._log.flush()
        text = self.log_path.read_text(errors="replace")
        return "\n".join(text.splitlines()[-lines:])

    def stop(self) -> None:
        """Stop this server (and only it): SIGTERM, then SIGKILL after a grace period."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self._log.close()


def _start(root: Path, *, evalsched: bool = True, env: dict[str, str] | None = None) -> LabServer:
    server = LabServer(root, evalsched=evalsched, env=env)
    try:
        server.wait_ready(evalsched=evalsched)
    except BaseException:
        server.stop()
        raise
    return server


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LabServer]:
    server = _start(tmp_path_factory.mktemp("lab"))
    yield server
    server.stop()


@pytest.fixture
def browser() -> Iterator[Any]:
    # Function scope on purpose: Playwright's sync API runs an event loop of its own, and
    # pytest-jupyter's autouse loop fixture (tests/conftest.py) must not see it running when it
    # closes its loop after each test.
    assert Path(CHROMIUM).exists(), f"{CHROMIUM} is not installed: run scripts/setup.sh"
    from playwright import sync_api

    with sync_api.sync_playwright() as pw:
        chromium = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        yield chromium
        chromium.close()


class PageErrors:
    """Uncaught page errors and console errors of our own code, checked at the end of a test."""

    def __init__(self, page: Any) -> None:
        self.errors: list[str] = []
        page.on("pageerror", lambda exc: self.errors.append(f"pageerror: {exc}"))
        page.on(
            "console",
            lambda msg: (
                self.errors.append(f"console: {msg.text}")
                if msg.type == "error" and "evalsched" in msg.text.lower()
                else None
            ),
        )


def _open_lab(
    browser: Any, server: LabServer, prepare: Callable[[Any], None] | None = None
) -> tuple[Any, Any, PageErrors]:
    """A page of JupyterLab with the panel visible; ``prepare(context)`` runs before it loads."""
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    if prepare is not None:
        prepare(context)
    page = context.new_page()
    page.set_default_timeout(UI_TIMEOUT_MS)
    errors = PageErrors(page)
    page.goto(f"{server.url}lab?token={server.token}", wait_until="domcontentloaded", timeout=60_000)
    # The layout restorer may bring up another side panel first: wait for ours to be attached,
    # then make it visible through its tab in the side bar.
    page.wait_for_selector(PANEL, state="attached", timeout=60_000)
    page.wait_for_selector(PANEL_TAB, state="visible", timeout=60_000)
    # The restorer can also act after our click (a loaded host: seen once), closing the side bar
    # the click opened: click again until the panel stays shown.
    for _ in range(5):
        if page.locator(PANEL).is_visible():
            break
        page.click(PANEL_TAB)
        try:
            page.wait_for_selector(PANEL, state="visible", timeout=5_000)
        except Exception:  # playwright's TimeoutError: look again
            continue
        page.wait_for_timeout(300)  # then look again: still shown, or closed by the restorer
    page.wait_for_selector(PANEL, state="visible")
    return context, page, errors


def _run(page: Any, run_id: str, state: str | None = None) -> Any:
    selector = f'{PANEL} .jp-EvalSched-run[data-run-id="{run_id}"]'
    if state:
        selector += f'[data-state="{state}"]'
    return page.locator(selector)


def _wait_run(page: Any, run_id: str, state: str, section: str | None = None) -> Any:
    locator = _run(page, run_id, state)
    locator.wait_for(state="visible")
    if section:
        assert locator.get_attribute("data-section") == section
    return locator


def _wait_reason(page: Any, run_id: str, code: str, state: str | None = None) -> Any:
    """Until a run's row shows a reason of ``code``: its ``why`` code (``data-reason-code``), or,
    from a server that sends no ``why``, its reason string (shown as it is) starting with it."""
    selector = f'{PANEL} .jp-EvalSched-run[data-run-id="{run_id}"]'
    if state:
        selector += f'[data-state="{state}"]'
    page.wait_for_function(
        """([sel, code]) => {
             const row = document.querySelector(sel);
             const reason = row && row.querySelector('[data-testid="evalsched-reason"]');
             return !!row && (row.dataset.reasonCode === code
               || (!!reason && !reason.hidden && reason.textContent.startsWith(code)));
           }""",
        arg=[selector, code],
    )
    return page.locator(selector)


def _reason_text(row: Any) -> str:
    return row.locator('[data-testid="evalsched-reason"]').inner_text()


def _gpu(page: Any, index: int = 0) -> Any:
    return page.locator(f'{PANEL} .jp-EvalSched-gpu[data-index="{index}"]')


def _wait_gpu(page: Any, *, allocated: int, runs: str | None = None, index: int = 0) -> None:
    selector = f'{PANEL} .jp-EvalSched-gpu[data-index="{index}"][data-allocated-mb="{allocated}"]'
    if runs is not None:
        selector += f'[data-runs="{runs}"]'
    page.wait_for_selector(selector)


def _confirm_dialog(page: Any, accept: bool, title: str = "Cancel run?") -> None:
    dialog = page.locator(".jp-Dialog")
    dialog.wait_for(state="visible")
    assert title in dialog.inner_text()
    if accept:
        dialog.locator("button.jp-mod-warn").click()
    else:
        dialog.locator("button.jp-mod-reject").click()
    dialog.wait_for(state="detached")


def _write_settings(server: LabServer, package: str, plugin: str, settings: dict) -> None:
    """JupyterLab user settings (read by the server on each page load)."""
    path = Path(server.env["JUPYTER_CONFIG_DIR"]) / "lab" / "user-settings" / package
    path.mkdir(parents=True, exist_ok=True)
    (path / f"{plugin}.jupyterlab-settings").write_text(json.dumps(settings))


def _write_user_settings(server: LabServer, settings: dict) -> None:
    """Settings of our plugin (schema/plugin.json)."""
    _write_settings(server, "jupyter-evalsched", "plugin", settings)


def _set_theme(server: LabServer, theme: str) -> None:
    _write_settings(server, "@jupyterlab/apputils-extension", "themes", {"theme": theme})


def _wait_idle(server: LabServer, timeout: float = 60.0) -> None:
    """Until nothing is queued or running (tests of the module share one server)."""
    last: dict = {}

    def idle() -> bool:
        status, view = server.request("GET", "evalsched/queue")
        if status != 200:  # pytest.fail, not assert: an AssertionError out of wait_until means "busy"
            pytest.fail(f"GET evalsched/queue: {status} {view}")
        last["view"] = view
        return not view["queued"] and not view["running"]

    try:
        wait_until(idle, timeout=timeout, interval=0.2)
    except AssertionError:
        raise AssertionError(f"the scheduler is still busy: {last.get('view')}") from None


def test_panel_live(lab: LabServer, browser: Any) -> None:
    """Over the event socket: ledger, queue with reason, progress, metrics, logs, cancel."""
    _write_user_settings(lab, {})
    context, page, errors = _open_lab(browser, lab)
    try:
        with failure_report(lab, "lab-panel-live-failure.png", lambda: page):
            page.wait_for_selector(f'{PANEL} .jp-EvalSched-conn[data-mode="live"]')
            gpu = _gpu(page)
            gpu.wait_for(state="visible")
            assert gpu.get_attribute("data-usable-mb") == str(VRAM)
            assert gpu.get_attribute("data-allocated-mb") == "0"
            assert gpu.get_attribute("data-free-mb") == str(VRAM)
            assert page.locator(f"{PANEL} .jp-EvalSched-banner").is_hidden()

            # -- admission against the ledger: the second 16 GB run waits for VRAM ---------------
            spec = {
                "entrypoint": SLEEPY,
                "episodes": 5,
                "params": {"sleep_s": 0.4},
                "scheduling": {"marginal_vram_mb": 16000},
            }
            first = lab.submit({**spec, "name": "first-16g"})
            second = lab.submit({**spec, "name": "second-16g"})
            a, b = first["id"], second["id"]

            _wait_run(page, a, "running", "running")
            _wait_gpu(page, allocated=16000, runs=a)
            seg = gpu.locator(f'.jp-EvalSched-seg[data-run-id="{a}"]')
            assert seg.get_attribute("data-mb") == "16000"
            assert a in (seg.get_attribute("title") or "") and "first-16g" in (seg.get_attribute("title") or "")
            queued = _wait_run(page, b, "queued", "queued")
            _wait_reason(page, b, "waiting_vram")
            assert "waiting_vram" in queued.locator(".jp-EvalSched-reason").inner_text()
            assert queued.locator(".jp-EvalSched-position").inner_text() == "#1"

            # progress of the running run moves (done/total), then it succeeds with its metrics
            page.wait_for_function(
                """([sel]) => { const el = document.querySelector(sel);
                     return el && Number(el.dataset.progressDone) >= 1 && el.dataset.progressTotal === '5'; }""",
                arg=[f'{PANEL} .jp-EvalSched-run[data-run-id="{a}"]'],
            )
            done_a = _wait_run(page, a, "succeeded", "finished")
            assert done_a.get_attribute("data-progress-done") == "5"
            score = done_a.locator('.jp-EvalSched-metric[data-metric="score"]')
            score.wait_for(state="visible")
            assert 0.0 <= float(score.get_attribute("data-value")) < 1.0

            # the queued run is admitted when the first one leaves the ledger
            _wait_run(page, b, "running", "running")
            _wait_gpu(page, allocated=16000, runs=b)
            _wait_run(page, b, "succeeded", "finished")
            _wait_gpu(page, allocated=0, runs="")
            assert lab.run(b)["state"] == "succeeded"

            # -- detail: summary metrics and the tail of the logs -------------------------------
            printer = lab.submit(
                {
                    "name": "printer",
                    "source": "def episode(ctx, index):\n"
                    "    print(f'hello from episode {index}', flush=True)\n"
                    "    return {'value': index * 1.5}\n",
                    "episodes": 3,
                }
            )
            p = printer["id"]
            row = _wait_run(page, p, "succeeded", "finished")
            row.locator('[data-testid="evalsched-details"]').click()
            detail = row.locator(".jp-EvalSched-detail")
            detail.wait_for(state="visible")
            detail.locator('tr[data-metric="value"]').wait_for(state="visible")
            assert detail.locator('tr[data-metric="value"] td').nth(1).inner_text() == "1.5"  # mean of 0, 1.5, 3
            log = detail.locator('[data-testid="evalsched-log"]')
            page.wait_for_function(
                "([sel]) => (document.querySelector(sel)?.textContent || '').includes('hello from episode 2')",
                arg=[f'{PANEL} .jp-EvalSched-run[data-run-id="{p}"] [data-testid="evalsched-log"]'],
            )
            assert "hello from episode 0" in log.inner_text()
            # the same detail in a main-area tab
            detail.locator('[data-testid="evalsched-open-tab"]').click()
            tab = page.locator(f'.jp-MainAreaWidget[id="jupyter-evalsched-run-{p}"]')
            tab.wait_for(state="visible")
            tab.locator('tr[data-metric="value"]').wait_for(state="visible")
            page.wait_for_function(
                "([sel]) => (document.querySelector(sel)?.textContent || '').includes('hello from episode 2')",
                arg=[f'.jp-MainAreaWidget[id="jupyter-evalsched-run-{p}"] [data-testid="evalsched-log"]'],
            )

            # -- cancel: a queued run, then a running one (after first keeping it) -------------
            long_spec = {
                "entrypoint": SLEEPY,
                "episodes": 400,
                "params": {"sleep_s": 0.25},
                "scheduling": {"marginal_vram_mb": 16000},
            }
            c = lab.submit({**long_spec, "name": "long-running"})["id"]
            d = lab.submit(
                {**long_spec, "name": "long-queued", "scheduling": {**long_spec["scheduling"], "priority": "high"}}
            )["id"]
            _wait_run(page, c, "running", "running")
            _wait_run(page, d, "queued", "queued")
            _wait_reason(page, d, "waiting_vram")
            _wait_gpu(page, allocated=16000, runs=c)
            page.wait_for_function(
                "([sel]) => Number(document.querySelector(sel)?.dataset.progressDone) >= 2",
                arg=[f'{PANEL} .jp-EvalSched-run[data-run-id="{c}"]'],
            )
            _run(page, c).locator('.jp-EvalSched-metric[data-metric="score"]').wait_for(state="visible")

            ARTIFACTS.mkdir(exist_ok=True)
            page.locator(PANEL).screenshot(path=str(ARTIFACTS / "lab-panel.png"))
            # (The docs' picture of the panel is taken in a fuller state: tests/test_lab_layout.py.)

            _run(page, d).locator('[data-testid="evalsched-cancel"]').click()
            _confirm_dialog(page, accept=True)
            cancelled_d = _wait_run(page, d, "cancelled", "finished")
            assert _reason_text(cancelled_d).startswith("cancelled")
            assert lab.run(d)["state"] == "cancelled"

            # "Keep it" sends no cancel. Every cancel request of c the page sends is recorded from
            # here; the one accepted below is sent later by the same page, so once it is seen, a
            # cancel sent on "Keep it" would have been seen too (the page's requests arrive in order).
            def is_cancel_of_c(request: Any) -> bool:
                return request.method == "POST" and urlsplit(request.url).path.endswith(f"/evalsched/runs/{c}/cancel")

            cancels_of_c: list[str] = []
            page.on("request", lambda request: cancels_of_c.append(request.url) if is_cancel_of_c(request) else None)
            _run(page, c).locator('[data-testid="evalsched-cancel"]').click()
            _confirm_dialog(page, accept=False)
            assert lab.run(c)["state"] == "running"
            assert _run(page, c, "running").is_visible()

            _run(page, c).locator('[data-testid="evalsched-cancel"]').click()
            with page.expect_request(is_cancel_of_c):
                _confirm_dialog(page, accept=True)
            assert len(cancels_of_c) == 1, f"a cancel was sent when the dialog said 'Keep it': {cancels_of_c}"
            cancelled_c = _wait_run(page, c, "cancelled", "finished")
            assert _reason_text(cancelled_c).startswith("cancelled")
            assert cancelled_c.locator('[data-testid="evalsched-cancel"]').is_hidden()
            _wait_gpu(page, allocated=0, runs="")
            record = lab.run(c)
            assert record["state"] == "cancelled" and record["reason"].startswith("cancelled")
            assert 2 <= record["progress"]["done"] < 400

            # -- a run slow to stop says it is ending until its process has gone ---------------
            ready, release = lab.root / "stubborn-ready", lab.root / "stubborn-release"
            params = {"ready": str(ready), "release": str(release)}
            e = lab.submit({"name": "stubborn", "entrypoint": STUBBORN, "episodes": 1, "params": params})["id"]
            wait_until(ready.exists, timeout=60)
            _wait_run(page, e, "running", "running").locator('[data-testid="evalsched-cancel"]').click()
            _confirm_dialog(page, accept=True)
            ending = _wait_reason(page, e, "cancelling", "running")
            badge = ending.locator(".jp-EvalSched-state")
            assert (badge.inner_text(), badge.get_attribute("data-state")) == ("cancelling", "cancelling")
            reason = ending.locator('[data-testid="evalsched-reason"]')
            assert reason.locator(".jp-EvalSched-reasonCode").inner_text() == "cancelling"
            assert (
                reason.locator(".jp-EvalSched-reasonText")
                .inner_text()
                .startswith("cancelled from the Lab panel; SIGTERM sent to its process group; SIGKILL if it still runs")
            ), _reason_text(ending)
            assert ending.locator('[data-testid="evalsched-cancel"]').is_hidden()  # (asked already)
            release.touch()
            ended = _wait_run(page, e, "cancelled", "finished")
            assert ended.locator(".jp-EvalSched-state").inner_text() == "cancelled"
            assert _reason_text(ended).startswith("cancelled")

            assert page.locator(f'{PANEL} .jp-EvalSched-conn[data-mode="live"]').is_visible()
            assert errors.errors == []
    finally:
        context.close()
        _write_user_settings(lab, {})


@pytest.mark.slow  # a Chromium page on JupyterLab: CI runs it with -m slow (docs/install.md: the default suite stays within ten minutes)
def test_panel_polling_fallback(lab: LabServer, browser: Any) -> None:
    """Without the event socket the panel polls GET /evalsched/queue and still follows runs."""
    _wait_idle(lab)
    _write_user_settings(lab, {"useWebSocket": False, "refreshInterval": 0.5})
    _set_theme(lab, "JupyterLab Dark")
    context, page, errors = _open_lab(browser, lab)
    try:
        with failure_report(lab, "lab-panel-polling-failure.png", lambda: page):
            page.wait_for_selector(f'{PANEL} .jp-EvalSched-conn[data-mode="polling"]')
            _gpu(page).wait_for(state="visible")
            spec = {
                "entrypoint": SLEEPY,
                "episodes": 8,
                "params": {"sleep_s": 0.4},
                "scheduling": {"marginal_vram_mb": 20000},
            }
            x = lab.submit({**spec, "name": "poll-a"})["id"]
            y = lab.submit({**spec, "name": "poll-b"})["id"]
            _wait_run(page, x, "running", "running")
            _wait_gpu(page, allocated=20000, runs=x)
            _wait_run(page, y, "queued", "queued")
            _wait_reason(page, y, "waiting_vram")
            page.wait_for_selector('body[data-jp-theme-light="false"]', state="attached")
            ARTIFACTS.mkdir(exist_ok=True)
            page.locator(PANEL).screenshot(path=str(ARTIFACTS / "lab-panel-dark.png"))
            _wait_run(page, x, "succeeded", "finished")
            _wait_run(page, y, "running", "running")
            _wait_run(page, y, "succeeded", "finished")
            _wait_gpu(page, allocated=0, runs="")
            # earlier runs of the module are listed as recently finished too (REST list, newest first)
            finished = page.locator(f'{PANEL} .jp-EvalSched-list[data-section="finished"] .jp-EvalSched-run')
            ids = [finished.nth(i).get_attribute("data-run-id") for i in range(finished.count())]
            assert ids[:2] == [y, x]

            # the submit form: a spec the server rejects shows its field errors, a valid one runs
            page.locator(f"{PANEL} .jp-EvalSched-submit > summary").click()
            form = page.locator(f"{PANEL} .jp-EvalSched-form")
            form.locator('[data-testid="evalsched-submit-entrypoint"]').fill("not an entrypoint")
            form.locator('[data-testid="evalsched-submit"]').click()
            message = form.locator(".jp-EvalSched-formMessage.jp-mod-error")
            message.wait_for(state="visible")
            assert "entrypoint" in message.inner_text()
            form.locator('[data-testid="evalsched-submit-entrypoint"]').fill(SLEEPY)
            form.locator('[data-testid="evalsched-submit-name"]').fill("from-the-form")
            form.locator('[data-testid="evalsched-submit-episodes"]').fill("2")
            form.locator('[data-testid="evalsched-submit-params"]').fill('{"sleep_s": 0.1}')
            form.locator('[data-testid="evalsched-submit"]').click()
            page.wait_for_function(
                "([sel]) => /Submitted \\S+ \\(/.test(document.querySelector(sel)?.textContent || '')",
                arg=[f"{PANEL} .jp-EvalSched-formMessage"],
            )
            submitted = re.search(r"Submitted (\S+) \(", form.locator(".jp-EvalSched-formMessage").inner_text()).group(
                1
            )
            _wait_run(page, submitted, "succeeded", "finished")
            record = lab.run(submitted)
            assert record["name"] == "from-the-form" and record["progress"] == {"done": 2, "total": 2}
            assert page.locator(f'{PANEL} .jp-EvalSched-conn[data-mode="polling"]').is_visible()
            assert errors.errors == []
    finally:
        context.close()
        _write_user_settings(lab, {})
        _set_theme(lab, "JupyterLab Light")


def _sleeper() -> subprocess.Popen:
    """A process of no consequence, to hold a lease or VRAM in the virtual process table."""
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=10)


def _create_lease(server: LabServer, **body: Any) -> dict:
    status, record = server.request("POST", "evalsched/leases", body)
    assert status == 201, (status, record)
    return record


def _kernel_pid(server: LabServer, kernel_id: str) -> int | None:
    """The pid of a kernel of the server (its connection file is on its command line)."""
    for proc in psutil.Process(server.proc.pid).children(recursive=True):
        try:
            cmdline = proc.cmdline()
        except psutil.Error:
            continue
        if any(f"kernel-{kernel_id}.json" in part for part in cmdline):
            return proc.pid
    return None


def _lease_row(page: Any, lease_id: str) -> Any:
    return page.locator(f'{PANEL} [data-testid="evalsched-lease-row"][data-lease-id="{lease_id}"]')


@pytest.mark.slow  # a Chromium page on JupyterLab: CI runs it with -m slow (docs/install.md: the default suite stays within ten minutes)
def test_panel_leases(lab: LabServer, browser: Any) -> None:
    """A lease is drawn in the ledger and listed; a run that cannot fit beside it waits naming it;
    Release asks first, then ends the lease, and the run starts."""
    _wait_idle(lab)
    _write_user_settings(lab, {})
    holder = _sleeper()
    label = "analysis-lease"
    lease_id: str | None = None
    context = page = None
    try:
        with failure_report(lab, "lab-panel-lease-failure.png", lambda: page):
            lease = _create_lease(lab, vram_mb=14000, pid=holder.pid, label=label)
            lease_id = lease["id"]
            wait_until(lambda: lab.lease(lease_id)["state"] == "granted", timeout=30, interval=0.1)
            context, page, errors = _open_lab(browser, lab)
            page.wait_for_selector(f'{PANEL} .jp-EvalSched-conn[data-mode="live"]')

            # -- the ledger: the lease's own segment, labelled with who holds it ------------------
            _wait_gpu(page, allocated=14000, runs="")
            gpu = _gpu(page)
            assert gpu.get_attribute("data-leases") == lease_id
            seg = gpu.locator(f'.jp-EvalSched-seg[data-lease-id="{lease_id}"]')
            seg.wait_for(state="visible")
            assert seg.get_attribute("data-kind") == "lease"
            assert seg.get_attribute("data-mb") == "14000"
            assert seg.get_attribute("data-holder") == label
            assert seg.inner_text() == label
            title = seg.get_attribute("title") or ""
            for needle in (lease_id, label, "14,000 MB", f"pid {holder.pid}"):
                assert needle in title, (needle, title)
            assert gpu.locator(f'.jp-EvalSched-legendItem[data-legend-lease-id="{lease_id}"]').is_visible()

            # -- the Leases list: holder, state, size, GPU, pid, and a Release button ------------
            row = _lease_row(page, lease_id)
            row.wait_for(state="visible")
            assert row.get_attribute("data-state") == "granted"
            assert row.locator('[data-testid="evalsched-lease-holder"]').inner_text() == label
            text = row.inner_text()
            for needle in ("granted", "14,000 MB × 1 GPU", "GPU 0", f"pid {holder.pid}", lease_id):
                assert needle in text, (needle, text)
            release = row.locator('[data-testid="evalsched-lease-release"]')
            assert release.is_visible()

            # -- a run that cannot fit beside it waits, and its reason names the lease ----------
            run_id = lab.submit(
                {
                    "name": "after-the-lease",
                    "entrypoint": SLEEPY,
                    "episodes": 2,
                    "params": {"sleep_s": 0.2},
                    "scheduling": {"marginal_vram_mb": 16000},
                }
            )["id"]
            queued = _wait_run(page, run_id, "queued", "queued")
            _wait_reason(page, run_id, "waiting_vram")
            # The lease named by its label and a short id, the whole id in a tooltip.
            page.wait_for_function(
                "([sel, id]) => { const el = document.querySelector(sel);"
                " return !!el && (el.textContent || '').includes(id.split('-').pop())"
                " && [...el.querySelectorAll('[title]')].some(t => t.title.includes(id)); }",
                arg=[f'{PANEL} .jp-EvalSched-run[data-run-id="{run_id}"] [data-testid="evalsched-reason"]', lease_id],
            )
            assert label in queued.locator('[data-testid="evalsched-reason"]').inner_text()
            ARTIFACTS.mkdir(exist_ok=True)
            page.locator(PANEL).screenshot(path=str(ARTIFACTS / "lab-panel-lease.png"))

            # -- Release asks first: "Keep it" sends nothing; confirmed, one DELETE --------------
            def is_release(request: Any) -> bool:
                return request.method == "DELETE" and urlsplit(request.url).path.endswith(
                    f"/evalsched/leases/{lease_id}"
                )

            releases: list[str] = []
            page.on("request", lambda request: releases.append(request.url) if is_release(request) else None)
            release.click()
            _confirm_dialog(page, accept=False, title="Release lease?")
            assert lab.lease(lease_id)["state"] == "granted"
            assert row.is_visible()
            release.click()
            with page.expect_request(is_release):
                _confirm_dialog(page, accept=True, title="Release lease?")
            assert len(releases) == 1, f"a release was sent when the dialog said 'Keep it': {releases}"

            # the lease leaves the list and the ledger, and the run it held back starts
            row.wait_for(state="detached")
            seg.wait_for(state="detached")
            page.wait_for_selector(f'{PANEL} .jp-EvalSched-gpu[data-index="0"][data-leases=""]')
            page.wait_for_selector(
                f'{PANEL} .jp-EvalSched-run[data-run-id="{run_id}"]:is([data-state="running"], [data-state="succeeded"])'
            )
            ended = lab.lease(lease_id)
            assert ended["state"] == "ended" and ended["reason"].startswith("released"), ended
            _wait_run(page, run_id, "succeeded", "finished")
            page.locator(f'{PANEL} .jp-EvalSched-section[data-section="leases"] .jp-EvalSched-empty').wait_for(
                state="visible"
            )
            assert page.locator(f'{PANEL} .jp-EvalSched-conn[data-mode="live"]').is_visible()
            assert errors.errors == []
    finally:
        if context is not None:
            context.close()
        if lease_id is not None:
            lab.request("DELETE", f"evalsched/leases/{lease_id}")
        _kill(holder)


@pytest.mark.slow  # a Chromium page on JupyterLab: CI runs it with -m slow (docs/install.md: the default suite stays within ten minutes)
def test_panel_unmanaged_by_holder(lab: LabServer, browser: Any) -> None:
    """VRAM the scheduler does not manage, per holder: a notebook kernel (by its notebook), another
    process (by pid), and what a lease holder uses beyond its lease (beside the lease). No event
    says when the process table changes: the panel re-reads the ledger while live."""
    _wait_idle(lab)
    _write_user_settings(lab, {"refreshInterval": 1})
    plain, leaser = _sleeper(), _sleeper()
    session_id: str | None = None
    lease_id: str | None = None
    context = page = None
    try:
        with failure_report(lab, "lab-panel-unmanaged-failure.png", lambda: page):
            status, session = lab.request(
                "POST",
                "api/sessions",
                {
                    "path": "analysis-gpu.ipynb",
                    "name": "analysis-gpu.ipynb",
                    "type": "notebook",
                    "kernel": {"name": "python3"},
                },
            )
            assert status == 201, (status, session)
            session_id, kernel_id = session["id"], session["kernel"]["id"]
            kernel_pid = wait_until(lambda: _kernel_pid(lab, kernel_id), timeout=60, interval=0.1, message="no kernel")
            lease_id = _create_lease(lab, vram_mb=2000, pid=leaser.pid, label="small-lease")["id"]
            lab.set_gpu_processes(
                [
                    {"pid": plain.pid, "gpu": 0, "used_mb": 4000},
                    {"pid": kernel_pid, "gpu": 0, "used_mb": 5000},
                    {"pid": leaser.pid, "gpu": 0, "used_mb": 2600},  # 600 MB over its lease
                ]
            )

            def seen() -> dict | None:
                status, ledger = lab.request("GET", "evalsched/ledger")
                assert status == 200, (status, ledger)
                device = ledger["devices"][0]
                return device if device["unmanaged_mb"] == 4000 + 5000 + 600 else None

            device = wait_until(seen, timeout=30, interval=0.1, message="the server does not see the process table")
            entry = next(p for p in device["unmanaged_processes"] if p["pid"] == kernel_pid)
            assert entry["kernel_id"] == kernel_id, entry
            session_path = entry["session_path"]
            assert session_path and session_path.endswith("analysis-gpu.ipynb"), entry

            context, page, errors = _open_lab(browser, lab)
            page.wait_for_selector(f'{PANEL} .jp-EvalSched-conn[data-mode="live"]')
            page.wait_for_selector(f'{PANEL} .jp-EvalSched-gpu[data-index="0"][data-unmanaged-mb="9600"]')
            gpu = _gpu(page)

            notebook = gpu.locator('.jp-EvalSched-seg[data-holder-kind="kernel"]')
            notebook.wait_for(state="visible")
            assert notebook.get_attribute("data-holder") == "analysis-gpu.ipynb"
            assert notebook.get_attribute("data-mb") == "5000"
            assert notebook.get_attribute("data-kernel-id") == kernel_id
            assert notebook.get_attribute("data-session-path") == session_path
            assert notebook.inner_text() == "analysis-gpu.ipynb"
            title = notebook.get_attribute("title") or ""
            assert session_path in title and kernel_id in title, title

            other = gpu.locator(f'.jp-EvalSched-seg[data-holder-kind="process"][data-pids="{plain.pid}"]')
            assert other.get_attribute("data-holder") == f"pid {plain.pid}"
            assert other.get_attribute("data-mb") == "4000"
            assert other.inner_text() == f"pid {plain.pid}"

            lease_seg = gpu.locator(f'.jp-EvalSched-seg[data-lease-id="{lease_id}"]')
            assert lease_seg.get_attribute("data-mb") == "2000"
            over = gpu.locator(f'.jp-EvalSched-seg[data-over-lease-id="{lease_id}"]')
            assert over.get_attribute("data-kind") == "over"
            assert over.get_attribute("data-mb") == "600"
            assert "small-lease" in (over.get_attribute("title") or "")
            # the excess is drawn right beside its lease
            assert (
                page.evaluate(
                    "([sel]) => document.querySelector(sel)?.nextElementSibling?.dataset.overLeaseId",
                    [f'{PANEL} .jp-EvalSched-seg[data-lease-id="{lease_id}"]'],
                )
                == lease_id
            )
            # the legend says what each colour is
            for kind in ("lease", "over", "kernel", "unmanaged"):
                assert gpu.locator(f'.jp-EvalSched-legendItem[data-kind="{kind}"]').count() >= 1, kind
            badge = _lease_row(page, lease_id).locator('[data-testid="evalsched-lease-over"]')
            badge.wait_for(state="visible")
            assert "600 MB" in badge.inner_text()
            ARTIFACTS.mkdir(exist_ok=True)
            page.locator(PANEL).screenshot(path=str(ARTIFACTS / "lab-panel-unmanaged.png"))

            # the processes let go of their VRAM: the panel follows without a reload
            lab.set_gpu_processes([])
            page.wait_for_selector(f'{PANEL} .jp-EvalSched-gpu[data-index="0"][data-unmanaged-mb="0"]')
            assert gpu.locator('.jp-EvalSched-seg[data-unmanaged="true"]').count() == 0
            assert gpu.locator(".jp-EvalSched-seg[data-over-lease-id]").count() == 0
            badge.wait_for(state="detached")
            assert errors.errors == []
    finally:
        lab.set_gpu_processes([])
        if context is not None:
            context.close()
        if lease_id is not None:
            lab.request("DELETE", f"evalsched/leases/{lease_id}")
        if session_id is not None:
            lab.request("DELETE", f"api/sessions/{session_id}")
        _kill(plain)
        _kill(leaser)
        _write_user_settings(lab, {})


@pytest.mark.slow  # a Chromium page on JupyterLab: CI runs it with -m slow (docs/install.md: the default suite stays within ten minutes)
def test_panel_run_warning(lab: LabServer, browser: Any) -> None:
    """A run seen using more VRAM than it declared shows a warning badge at once; its detail shows
    the observed peaks, their source, its host memory limit and the warning."""
    _wait_idle(lab)
    _write_user_settings(lab, {})
    context = page = None
    run_id: str | None = None
    try:
        with failure_report(lab, "lab-panel-warning-failure.png", lambda: page):
            context, page, errors = _open_lab(browser, lab)
            page.wait_for_selector(f'{PANEL} .jp-EvalSched-conn[data-mode="live"]')
            run_id = lab.submit(
                {
                    "name": "greedy",
                    "entrypoint": SLEEPY,
                    "episodes": 400,
                    "params": {"sleep_s": 0.25},
                    "scheduling": {"marginal_vram_mb": 8000, "memory_mb": 2048},
                }
            )["id"]
            row = _wait_run(page, run_id, "running", "running")
            pid = wait_until(lambda: lab.run(run_id)["pid"], timeout=30, interval=0.1)
            badge = row.locator('[data-testid="evalsched-warning"]')
            assert "over_vram" not in (row.get_attribute("data-warnings") or "")
            lab.set_gpu_processes([{"pid": pid, "gpu": 0, "used_mb": 10000}])
            expected = "over_vram: used 10000 MB on GPU 0, declared 8000 MB"
            page.wait_for_function(
                "([sel]) => (document.querySelector(sel)?.dataset.warnings || '').split(',').includes('over_vram')",
                arg=[f'{PANEL} .jp-EvalSched-run[data-run-id="{run_id}"]'],
            )
            assert badge.is_visible()
            assert "⚠" in badge.inner_text()
            assert expected in (badge.get_attribute("title") or "")
            assert expected in lab.run(run_id)["warnings"]

            row.locator('[data-testid="evalsched-details"]').click()
            detail = row.locator(".jp-EvalSched-detail")
            detail.wait_for(state="visible")
            detail.locator('dd[data-field="observed_vram"]').wait_for(state="visible")
            assert detail.locator('dd[data-field="observed_vram"]').inner_text() == "GPU 0: 10,000 MB"
            assert detail.locator('dd[data-field="observed_source"]').inner_text() == "virtual GPUs"
            assert detail.locator('dd[data-field="memory_mb"]').inner_text() == "2,048 MB"
            warning = detail.locator('.jp-EvalSched-warning[data-code="over_vram"]')
            assert warning.is_visible() and "declared 8000 MB" in warning.inner_text()
            ARTIFACTS.mkdir(exist_ok=True)
            page.locator(PANEL).screenshot(path=str(ARTIFACTS / "lab-panel-warning.png"))
            assert errors.errors == []
    finally:
        lab.set_gpu_processes([])
        if run_id is not None:
            lab.request("POST", f"evalsched/runs/{run_id}/cancel")
        if context is not None:
            context.close()


def _row_selector(run_id: str) -> str:
    return f'{PANEL} .jp-EvalSched-run[data-run-id="{run_id}"]'


def _watch_row(page: Any, run_id: str) -> None:
    """Record in the page every (state, attempt, reason code, Resume hidden) that the run's row
    shows, from now on: transitions shorter than a poll of the test are kept too."""
    page.evaluate(
        """([sel, id]) => {
             const seen = ((window.__evalschedSeen = window.__evalschedSeen || {})[id] = []);
             const note = () => {
               const row = document.querySelector(sel);
               if (!row) { return; }
               const resume = row.querySelector('.jp-EvalSched-runMeta [data-testid="evalsched-resume"]');
               const now = { state: row.dataset.state, attempt: row.dataset.attempt,
                             reason: (row.querySelector('[data-testid="evalsched-reason"]') || {}).textContent || '',
                             resumeHidden: !!(resume && resume.hidden) };
               const last = seen[seen.length - 1];
               if (!last || JSON.stringify(last) !== JSON.stringify(now)) { seen.push(now); }
             };
             note();
             new MutationObserver(note).observe(document.querySelector('#jupyter-evalsched-panel'), {
               subtree: true, childList: true, attributes: true,
               attributeFilter: ['data-state', 'data-attempt', 'data-reason-code', 'hidden'] });
           }""",
        [_row_selector(run_id), run_id],
    )


def _seen(page: Any, run_id: str) -> list[dict]:
    return page.evaluate("(id) => window.__evalschedSeen[id]", run_id)


@pytest.mark.slow  # a Chromium page on JupyterLab: CI runs it with -m slow (docs/install.md: the default suite stays within ten minutes)
def test_panel_resume(lab: LabServer, browser: Any) -> None:
    """A run that failed (exit code 3 in episode 2 of its first attempt) has a Resume button; a
    refusal shows the server's message; resumed (no dialog), it is queued again under the same id,
    runs attempt 2 from episode 2 and succeeds: the row says `attempt 2` and has no Resume button,
    the detail shows how attempt 1 ended."""
    _wait_idle(lab)
    _write_user_settings(lab, {})
    context = page = None
    try:
        with failure_report(lab, "lab-panel-resume-failure.png", lambda: page):
            context, page, errors = _open_lab(browser, lab)
            page.wait_for_selector(f'{PANEL} .jp-EvalSched-conn[data-mode="live"]')
            run_id = lab.submit(
                {
                    "name": "crash-once",
                    "entrypoint": CRASH,
                    "episodes": 4,
                    # sleep_s: the second attempt runs long enough to be seen running
                    "params": {"how": "exit", "code": 3, "at": 2, "until_attempt": 1, "sleep_s": 0.3},
                }
            )["id"]
            row = _wait_run(page, run_id, "failed", "finished")
            _wait_reason(page, run_id, "exit_code:3", "failed")
            assert row.get_attribute("data-attempt") == "1"
            assert row.locator('[data-testid="evalsched-reason"]').inner_text().startswith("exit_code:3")
            first = lab.run(run_id)
            assert first["state"] == "failed" and first["attempt"] == 1, first
            assert first["reason"].startswith("exit_code:3") and first["progress"]["done"] == 2, first
            resume = row.locator('.jp-EvalSched-runMeta [data-testid="evalsched-resume"]')
            assert resume.is_visible() and resume.inner_text() == "Resume"
            assert row.locator('[data-testid="evalsched-cancel"]').is_hidden()
            for badge in ("attempt", "preemptions", "retries", "detached"):  # a plain first attempt
                assert row.locator(f'[data-testid="evalsched-{badge}"]').count() == 0, badge

            # -- the detail in a tab has its own Resume (no run row beside it; inline, the row's) ----
            row.locator('[data-testid="evalsched-details"]').click()
            inline = row.locator(".jp-EvalSched-detail")
            inline.wait_for(state="visible")
            assert inline.locator('[data-testid="evalsched-resume"]').count() == 0
            inline.locator('[data-testid="evalsched-open-tab"]').click()
            row.locator('[data-testid="evalsched-details"]').click()
            inline.wait_for(state="detached")
            tab = page.locator(f'.jp-MainAreaWidget[id="jupyter-evalsched-run-{run_id}"]')
            tab_resume = tab.locator('[data-testid="evalsched-resume"]')
            tab_resume.wait_for(state="visible")

            # -- a refusal (409) shows the server's message; the run stays failed ------------------
            refusal = f"run {run_id} cannot be resumed: refused by the test"
            # (makeRequest appends a cache-busting query to every request)
            resume_path = re.compile(rf"/evalsched/runs/{re.escape(run_id)}/resume(\?.*)?$")
            page.route(resume_path, lambda route: route.fulfill(status=409, json={"message": refusal}))
            tab_resume.click()
            dialog = page.locator(".jp-Dialog")
            dialog.wait_for(state="visible")
            assert f"Cannot resume {run_id}" in dialog.inner_text() and refusal in dialog.inner_text()
            dialog.locator("button.jp-mod-reject").click()
            dialog.wait_for(state="detached")
            page.unroute(resume_path)
            assert lab.run(run_id)["state"] == "failed"
            assert row.get_attribute("data-state") == "failed" and resume.is_visible() and tab_resume.is_visible()

            # -- Resume: no dialog, one POST, the same id queued again as attempt 2 ----------------
            _watch_row(page, run_id)

            def is_resume(response: Any) -> bool:
                return response.request.method == "POST" and urlsplit(response.url).path.endswith(
                    f"/evalsched/runs/{run_id}/resume"
                )

            with page.expect_response(is_resume) as answer:
                resume.click()
            assert answer.value.status == 200
            queued = answer.value.json()
            assert queued["id"] == run_id and queued["state"] == "queued" and queued["attempt"] == 2, queued
            assert page.locator(".jp-Dialog").count() == 0

            done = _wait_run(page, run_id, "succeeded", "finished")
            page.wait_for_selector(f'{_row_selector(run_id)}[data-state="succeeded"][data-attempt="2"]')
            seen = _seen(page, run_id)
            first_seen = {k: v for k, v in seen[0].items() if k != "reason"}
            assert first_seen == {"state": "failed", "attempt": "1", "resumeHidden": False}, seen
            assert seen[0]["reason"].startswith("exit_code:3"), seen
            after = seen[1:]
            states = [s["state"] for s in after]
            assert states[0] in ("queued", "running") and "running" in states and states[-1] == "succeeded", seen
            assert "failed" not in states, seen  # never back to failed (no stale record undid the resume)
            assert all(s["attempt"] == "2" and s["resumeHidden"] for s in after), seen

            assert done.locator('[data-testid="evalsched-attempt"]').inner_text() == "attempt 2"
            assert done.locator('.jp-EvalSched-runMeta [data-testid="evalsched-resume"]').is_hidden()
            assert done.locator('[data-testid="evalsched-preemptions"]').count() == 0
            assert done.locator('[data-testid="evalsched-retries"]').count() == 0

            # -- the detail: the attempt, and how attempt 1 ended ---------------------------------
            done.locator('[data-testid="evalsched-details"]').click()
            detail = done.locator(".jp-EvalSched-detail")
            detail.wait_for(state="visible")
            entries = detail.locator('[data-testid="evalsched-history-entry"]')
            entries.first.wait_for(state="visible")
            assert entries.count() == 1
            entry = entries.first
            assert entry.get_attribute("data-attempt") == "1"
            assert entry.get_attribute("data-state") == "failed"
            assert entry.get_attribute("data-episodes-done") == "2"
            text = entry.inner_text()
            for needle in ("attempt 1", "failed", "exit_code:3", "2 episodes done"):
                assert needle in text, (needle, text)
            assert detail.locator('dd[data-field="attempt"]').inner_text() == "2"
            assert detail.locator('dd[data-field="start"]').inner_text().startswith("warm: forked by zygote")
            # the tab follows: no Resume, the same history
            tab_resume.wait_for(state="hidden")
            assert tab.locator(
                '[data-testid="evalsched-history-entry"][data-attempt="1"][data-state="failed"]'
            ).is_visible()
            ARTIFACTS.mkdir(exist_ok=True)
            page.locator(PANEL).screenshot(path=str(ARTIFACTS / "lab-panel-resume.png"))

            final = lab.run(run_id)
            assert final["state"] == "succeeded" and final["attempt"] == 2, final
            assert final["progress"] == {"done": 4, "total": 4}, final
            assert [(e["attempt"], e["state"], e["episodes_done"]) for e in final["history"]] == [(1, "failed", 2)], (
                final
            )
            assert final["history"][0]["reason"].startswith("exit_code:3"), final
            # a succeeded run cannot be resumed: 409 with a message (what the button would show)
            status, body = lab.request("POST", f"evalsched/runs/{run_id}/resume")
            assert status == 409 and isinstance(body, dict) and body.get("message"), (status, body)
            assert errors.errors == []
    finally:
        if context is not None:
            context.close()


@pytest.mark.slow  # a Chromium page on JupyterLab: CI runs it with -m slow (docs/install.md: the default suite stays within ten minutes)
def test_panel_preemption_and_retry(tmp_path: Path, browser: Any) -> None:
    """A preemptible low-lane run is told to stop at its next episode boundary for a high-lane run
    that cannot fit beside it: its running row says so (`preempting:<id>`, in words); it is queued
    again as attempt 2 with `preempted ×1`, resumes after the high-lane run and succeeds, and its
    detail shows how attempt 1 ended. A detached run allowed one automatic retry fails, waits out
    its back-off (`retrying`, with a countdown to `retry_at`, `retry 1/1`), then succeeds."""
    config = tmp_path / "config"
    config.mkdir(parents=True, exist_ok=True)
    # A run may be preempted at once (the default waits for it to have run 60 s); a short back-off.
    (config / "jupyter_server_config.json").write_text(
        json.dumps({"EvalSchedApp": {"preempt_min_runtime_s": 0, "retry_backoff_s": 3}})
    )
    server = _start(tmp_path)
    context = page = None
    try:
        with failure_report(server, "lab-panel-preemption-failure.png", lambda: page):
            context, page, errors = _open_lab(browser, server)
            page.wait_for_selector(f'{PANEL} .jp-EvalSched-conn[data-mode="live"]')
            low = server.submit(
                {
                    "name": "low-preemptible",
                    "entrypoint": SLEEPY,
                    "episodes": 3,
                    # long episodes: told to stop just after a boundary, it runs on for most of one
                    "params": {"sleep_s": 1.0},
                    "scheduling": {"marginal_vram_mb": 16000, "priority": "low"},
                }
            )
            assert low["preemptible"] is True, low  # the low lane's default
            low_id = low["id"]
            _wait_run(page, low_id, "running", "running")
            _watch_row(page, low_id)
            wait_until(lambda: server.run(low_id)["progress"]["done"] >= 1, timeout=30, interval=0.05)
            high_id = server.submit(
                {
                    "name": "high-lane",
                    "entrypoint": SLEEPY,
                    "episodes": 3,
                    "params": {"sleep_s": 0.4},
                    "scheduling": {"marginal_vram_mb": 16000, "priority": "high"},
                }
            )["id"]

            # -- running, told to stop: the reason shows on the running row, in words ------------
            row = _wait_reason(page, low_id, "preempting", "running")
            reason = row.locator('[data-testid="evalsched-reason"]')
            text = reason.inner_text()
            # The run it makes room for by a short id, the whole id in a tooltip.
            short = high_id.rsplit("-", 1)[1]
            assert reason.is_visible() and f"preempting:{short}" in text, text
            assert high_id not in text and reason.locator(f'[title="{high_id}"]').count() >= 1, text
            if reason.get_attribute("data-structured") == "true":
                # In words only from `why` (a reason string without it is shown as it is).
                assert row.get_attribute("data-reason-arg") == high_id
                assert f"being preempted for {short}" in text, text

            # -- queued again, attempt 2, preempted once; no Resume (it is not finished) ---------
            page.wait_for_selector(f'{_row_selector(low_id)}[data-state="queued"][data-attempt="2"]')
            assert row.locator('[data-testid="evalsched-preemptions"]').inner_text() == "preempted ×1"
            assert row.locator('[data-testid="evalsched-attempt"]').inner_text() == "attempt 2"
            assert row.locator('.jp-EvalSched-runMeta [data-testid="evalsched-resume"]').is_hidden()
            ARTIFACTS.mkdir(exist_ok=True)
            page.locator(PANEL).screenshot(path=str(ARTIFACTS / "lab-panel-preempted.png"))

            _wait_run(page, high_id, "succeeded", "finished")
            done = _wait_run(page, low_id, "succeeded", "finished")
            assert done.locator('[data-testid="evalsched-preemptions"]').inner_text() == "preempted ×1"
            assert done.locator('[data-testid="evalsched-attempt"]').inner_text() == "attempt 2"
            seen = _seen(page, low_id)
            states = [(s["state"], s["attempt"]) for s in seen]
            assert states[0] == ("running", "1") and ("queued", "2") in states and states[-1] == ("succeeded", "2"), (
                seen
            )
            assert all(s["resumeHidden"] for s in seen), seen

            done.locator('[data-testid="evalsched-details"]').click()
            detail = done.locator(".jp-EvalSched-detail")
            entry = detail.locator('[data-testid="evalsched-history-entry"]')
            entry.first.wait_for(state="visible")
            assert entry.count() == 1
            assert entry.get_attribute("data-attempt") == "1"
            assert entry.get_attribute("data-state") == "preempted"
            assert f"preempted_by:{high_id}" in entry.inner_text()
            assert detail.locator('dd[data-field="preemptions"]').inner_text() == "1 time"

            final = server.run(low_id)
            assert final["state"] == "succeeded" and final["preemptions"] == 1 and final["attempt"] == 2, final
            assert final["progress"] == {"done": 3, "total": 3}, final
            assert [(e["attempt"], e["state"]) for e in final["history"]] == [(1, "preempted")], final

            # -- an automatic retry: failed, queued in back-off until retry_at, then attempt 2 ------
            retried = server.submit(
                {
                    "name": "retried",
                    "entrypoint": CRASH,
                    "episodes": 2,
                    "params": {"how": "exit", "code": 3, "at": 0, "until_attempt": 1},
                    "retries": 1,
                    "detach": True,
                }
            )
            assert retried["retries"] == 1 and retried["detach"] is True, retried
            retried_id = retried["id"]
            _watch_row(page, retried_id)  # from before its row appears: it fails at once
            _wait_reason(page, retried_id, "retrying", "queued")
            row = _run(page, retried_id)
            assert row.locator('[data-testid="evalsched-retries"]').inner_text() == "retry 1/1"
            assert row.locator('[data-testid="evalsched-attempt"]').inner_text() == "attempt 2"
            assert row.locator('[data-testid="evalsched-detached"]').inner_text() == "detached"
            countdown = row.locator('[data-testid="evalsched-retry-at"]')
            assert countdown.get_attribute("data-retry-at") == server.run(retried_id)["retry_at"]
            assert re.fullmatch(r"retry in 0:0[1-3]|retrying now", countdown.inner_text()), countdown.inner_text()
            page.locator(PANEL).screenshot(path=str(ARTIFACTS / "lab-panel-retrying.png"))
            done = _wait_run(page, retried_id, "succeeded", "finished")
            assert done.locator('[data-testid="evalsched-retries"]').inner_text() == "retry 1/1"
            assert done.locator('.jp-EvalSched-runMeta [data-testid="evalsched-resume"]').is_hidden()
            states = [s["state"] for s in _seen(page, retried_id)]
            assert "queued" in states and states[-1] == "succeeded" and "failed" not in states, states
            final = server.run(retried_id)
            assert final["attempt"] == 2 and final["retries_used"] == 1 and final["retry_at"] is None, final
            assert [(e["attempt"], e["state"]) for e in final["history"]] == [(1, "failed")], final
            assert errors.errors == []
    finally:
        if context is not None:
            context.close()
        server.stop()


# What the panel reads that an older server (before leases, observed usage and attempts) does not send.
_NEWER_RUN_FIELDS = (
    "observed",
    "warnings",
    "marginal_vram_source",
    "memory_mb",
    "attempt",
    "preemptions",
    "preemptible",
    "retries",
    "retries_used",
    "retry_at",
    "detach",
    "history",
    "start",
    "start_detail",
)
_NEWER_DEVICE_FIELDS = ("leases", "unmanaged_processes")


def _as_older_server(route: Any) -> None:
    """Answer a REST read of the scheduler as an older server would: without the newer fields."""
    response = route.fetch()
    if response.status != 200 or "json" not in response.headers.get("content-type", ""):
        route.fulfill(response=response)
        return
    body = response.json()

    def strip_run(record: dict) -> None:
        for key in _NEWER_RUN_FIELDS:
            record.pop(key, None)

    def strip_ledger(ledger: dict) -> None:
        for device in ledger.get("devices", []):
            for key in _NEWER_DEVICE_FIELDS:
                device.pop(key, None)

    if "queued" in body:  # the queue view
        body.pop("leases", None)
        for record in body["queued"] + body["running"]:
            strip_run(record)
        strip_ledger(body["ledger"])
    elif "cpu_slots" in body:  # the ledger
        strip_ledger(body)
    elif "runs" in body:  # a list of runs
        for record in body["runs"]:
            strip_run(record)
    elif "id" in body:  # a run
        strip_run(body)
    route.fulfill(response=response, json=body)


@pytest.mark.slow  # a Chromium page on JupyterLab: CI runs it with -m slow (docs/install.md: the default suite stays within ten minutes)
def test_panel_older_server(lab: LabServer, browser: Any) -> None:
    """Against a server that predates leases, observed usage and attempts (their fields stripped
    from its answers, polling), the panel shows what it is told: no Leases section, a lease's VRAM
    as allocated, unmanaged VRAM as one segment, a run as its first attempt, and no errors."""
    _wait_idle(lab)
    _write_user_settings(lab, {"useWebSocket": False, "refreshInterval": 0.5})
    holder, plain = _sleeper(), _sleeper()
    lease_id: str | None = None
    context = page = None
    try:
        with failure_report(lab, "lab-panel-older-server-failure.png", lambda: page):
            lease_id = _create_lease(lab, vram_mb=6000, pid=holder.pid, label="not-shown")["id"]
            lab.set_gpu_processes([{"pid": plain.pid, "gpu": 0, "used_mb": 3000}])
            wait_until(
                lambda: lab.request("GET", "evalsched/ledger")[1]["devices"][0]["unmanaged_mb"] == 3000,
                timeout=30,
                interval=0.1,
            )
            context, page, errors = _open_lab(
                browser,
                lab,
                lambda ctx: ctx.route(
                    re.compile(r"/evalsched/(queue|ledger|runs)(/[^/?]+)?(\?.*)?$"), _as_older_server
                ),
            )
            page.wait_for_selector(f'{PANEL} .jp-EvalSched-conn[data-mode="polling"]')
            page.wait_for_selector(
                f'{PANEL} .jp-EvalSched-gpu[data-index="0"][data-allocated-mb="6000"][data-unmanaged-mb="3000"]'
            )
            gpu = _gpu(page)
            assert gpu.locator(".jp-EvalSched-seg[data-lease-id]").count() == 0
            allocated = gpu.locator('.jp-EvalSched-seg[data-kind="run"]')
            assert allocated.get_attribute("data-mb") == "6000" and "Allocated" in (
                allocated.get_attribute("title") or ""
            )
            unmanaged = gpu.locator('.jp-EvalSched-seg[data-unmanaged="true"]')
            assert unmanaged.count() == 1 and unmanaged.get_attribute("data-mb") == "3000"
            assert gpu.locator('.jp-EvalSched-legendItem[data-kind="unmanaged"]').is_visible()
            assert page.locator(f'{PANEL} .jp-EvalSched-section[data-section="leases"]').is_hidden()

            run_id = lab.submit({"name": "old-style", "entrypoint": SLEEPY, "episodes": 2, "params": {"sleep_s": 0.1}})[
                "id"
            ]
            row = _wait_run(page, run_id, "succeeded", "finished")
            row.locator('[data-testid="evalsched-details"]').click()
            detail = row.locator(".jp-EvalSched-detail")
            detail.locator('dd[data-field="executor"]').wait_for(state="visible")
            for field in (
                "observed_vram",
                "observed_source",
                "memory_mb",
                "marginal_vram_source",
                "attempt",
                "preemptions",
            ):
                assert detail.locator(f'[data-field="{field}"]').count() == 0, field
            assert row.locator('[data-testid="evalsched-warning"]').count() == 0
            # no attempts: the first one, no badge, no history
            assert row.get_attribute("data-attempt") == "1"
            assert row.locator(".jp-EvalSched-badge").count() == 0
            assert detail.locator('[data-testid="evalsched-history-entry"]').count() == 0
            assert errors.errors == []
    finally:
        lab.set_gpu_processes([])
        if context is not None:
            # A read in flight through the route would otherwise meet its response disposed by the
            # close, and raise at the browser's teardown (seen once in CI).
            context.unroute_all(behavior="ignoreErrors")
            context.close()
        if lease_id is not None:
            lab.request("DELETE", f"evalsched/leases/{lease_id}")
        _kill(holder)
        _kill(plain)
        _write_user_settings(lab, {})


def _with_why(why: dict) -> Callable[[Any], None]:
    """Answer the queue view as a server that sends ``why`` does: every queued run with ``why``."""

    def handle(route: Any) -> None:
        response = route.fetch()
        if response.status != 200 or "json" not in response.headers.get("content-type", ""):
            route.fulfill(response=response)
            return
        body = response.json()
        if "queued" in body:
            for record in body["queued"]:
                record["why"] = why
        route.fulfill(response=response, json=body)

    return handle


@pytest.mark.slow  # a Chromium page on JupyterLab: CI runs it with -m slow (docs/install.md: the default suite stays within ten minutes)
def test_panel_reasons_from_why(lab: LabServer, browser: Any) -> None:
    """A queued run's reason comes from its ``why`` (here added to the server's answers, polling):
    the code as the head, the holders by name (a lease by its label, a kernel by its notebook),
    not from the reason string."""
    _wait_idle(lab)
    _write_user_settings(lab, {"useWebSocket": False, "refreshInterval": 0.5})
    holder = _sleeper()
    lease_id: str | None = None
    run_id: str | None = None
    context = page = None
    try:
        with failure_report(lab, "lab-panel-why-failure.png", lambda: page):
            lease_id = _create_lease(lab, vram_mb=14000, pid=holder.pid, label="why-holder")["id"]
            why = {
                "code": "waiting_vram",
                "arg": None,
                "detail": "needs 16,000 MB on one GPU",
                "holders": [
                    {"kind": "lease", "id": lease_id, "name": "why-holder", "gpu": 0, "mb": 14000},
                    {"kind": "kernel", "id": "k-1", "name": "work/analysis.ipynb", "gpu": 0, "mb": None},
                ],
            }
            context, page, errors = _open_lab(
                browser, lab, lambda ctx: ctx.route(re.compile(r"/evalsched/queue(\?.*)?$"), _with_why(why))
            )
            page.wait_for_selector(f'{PANEL} .jp-EvalSched-conn[data-mode="polling"]')
            run_id = lab.submit(
                {
                    "name": "held-back",
                    "entrypoint": SLEEPY,
                    "episodes": 1,
                    "params": {"sleep_s": 0.1},
                    "scheduling": {"marginal_vram_mb": 16000},
                }
            )["id"]
            row = _wait_run(page, run_id, "queued", "queued")
            page.wait_for_selector(f'{_row_selector(run_id)}[data-reason-code="waiting_vram"]')
            reason = row.locator('[data-testid="evalsched-reason"]')
            assert reason.get_attribute("data-structured") == "true"
            assert reason.locator(".jp-EvalSched-reasonCode").inner_text() == "waiting_vram"
            assert "needs 16,000 MB on one GPU" in reason.inner_text()
            holders = reason.locator(".jp-EvalSched-reasonHolder")
            assert holders.count() == 2
            assert holders.nth(0).inner_text() == f"why-holder ({lease_id.rsplit('-', 1)[1]})"  # name, short id
            assert lease_id in (holders.nth(0).get_attribute("title") or "")
            assert holders.nth(0).get_attribute("data-kind") == "lease"
            assert holders.nth(0).get_attribute("data-holder-id") == lease_id
            assert "14,000 MB" in (holders.nth(0).get_attribute("title") or "")
            assert holders.nth(1).inner_text() == "analysis.ipynb"
            assert holders.nth(1).get_attribute("data-kind") == "kernel"
            assert row.get_attribute("data-reason-arg") == ""
            page.locator(PANEL).screenshot(path=str(ARTIFACTS / "lab-panel-why.png"))

            # The lease released, the run starts and ends: its finished row has no why.
            assert lab.request("DELETE", f"evalsched/leases/{lease_id}")[0] == 204
            lease_id = None
            done = _wait_run(page, run_id, "succeeded", "finished")
            assert done.get_attribute("data-reason-code") == ""
            assert errors.errors == []
    finally:
        if context is not None:
            # As in the test above: a poll in flight through the route would otherwise meet its
            # response disposed by the close, and raise at the browser's teardown (seen in CI).
            context.unroute_all(behavior="ignoreErrors")
            context.close()
        if run_id is not None and lab.run(run_id)["state"] in ("queued", "running"):
            lab.request("POST", f"evalsched/runs/{run_id}/cancel")
        if lease_id is not None:
            lab.request("DELETE", f"evalsched/leases/{lease_id}")
        _kill(holder)
        _write_user_settings(lab, {})


@pytest.mark.slow  # a Chromium page on JupyterLab: CI runs it with -m slow (docs/install.md: the default suite stays within ten minutes)
@pytest.mark.parametrize("live", [True, False], ids=["live", "polling"])
def test_panel_reads_the_head_of_a_long_queue(lab: LabServer, browser: Any, live: bool) -> None:
    """With ``queueLimit`` 3 and 7 runs queued, the panel asks for 3 (the socket's snapshot and
    every read of the queue), lists them in admission order and counts the other 4."""
    _wait_idle(lab)
    _write_user_settings(
        lab, {"queueLimit": 3} if live else {"queueLimit": 3, "useWebSocket": False, "refreshInterval": 0.5}
    )
    gate_id: str | None = None
    context = page = None
    asked: list[str] = []
    try:
        with failure_report(lab, "lab-panel-long-queue-failure.png", lambda: page):
            gate_id = lab.submit(
                {
                    "name": "gate",
                    "entrypoint": SLEEPY,
                    "episodes": 1,
                    "params": {"sleep_s": 120},
                    "scheduling": {"cpus": 0},
                }
            )["id"]

            def note(ctx: Any) -> None:  # every read of the queue and every socket, from the page's start
                ctx.on("request", lambda req: "/evalsched/queue" in req.url and asked.append(req.url))
                ctx.on("page", lambda p: p.on("websocket", lambda ws: asked.append(ws.url)))

            context, page, errors = _open_lab(browser, lab, note)
            mode = "live" if live else "polling"
            page.wait_for_selector(f'{PANEL} .jp-EvalSched-conn[data-mode="{mode}"]')
            waiting = [
                lab.submit(
                    {
                        "name": f"w{i}",
                        "entrypoint": SLEEPY,
                        "episodes": 1,
                        "depends_on": [gate_id],
                        "scheduling": {"cpus": 0},
                    }
                )["id"]
                for i in range(7)
            ]
            more = page.locator(f'{PANEL} [data-testid="evalsched-queued-more"]')
            page.wait_for_function(
                "el => el && !el.hidden && el.textContent.includes('4 more queued')",
                arg=more.element_handle(),
            )
            for rid in waiting[:3]:
                _wait_run(page, rid, "queued", "queued")
            for rid in waiting[3:]:
                assert _run(page, rid).count() == 0
            count = page.locator(f'{PANEL} .jp-EvalSched-section[data-section="queued"] .jp-EvalSched-count').first
            assert count.get_attribute("data-runs") == "7", count.get_attribute("data-runs")
            reads = [u for u in asked if "/evalsched/queue" in u]
            assert reads and all("limit=3" in u for u in reads), asked
            if live:
                sockets = [u for u in asked if "/evalsched/events" in u]
                assert sockets and all("limit=3" in u for u in sockets), asked

            # The gate cancelled, its dependents fail: the queue empties and the count goes.
            assert lab.request("POST", f"evalsched/runs/{gate_id}/cancel")[0] == 200
            gate_id = None
            page.wait_for_function("el => el.hidden", arg=more.element_handle())
            for rid in waiting:
                _wait_run(page, rid, "failed")
            assert errors.errors == []
    finally:
        if context is not None:
            context.close()
        if gate_id is not None:
            lab.request("POST", f"evalsched/runs/{gate_id}/cancel")
        _write_user_settings(lab, {})


@pytest.mark.slow  # a Chromium page on JupyterLab: CI runs it with -m slow (docs/install.md: the default suite stays within ten minutes)
def test_panel_without_server_extension(tmp_path: Path, browser: Any) -> None:
    """The server extension disabled: /evalsched/ answers 404 and the panel says so."""
    server = _start(tmp_path, evalsched=False)
    try:
        status, _ = server.request("GET", "evalsched/queue")
        assert status == 404
        context, page, _errors = _open_lab(browser, server)
        try:
            banner = page.locator(f'{PANEL} .jp-EvalSched-banner[data-kind="missing"]')
            banner.wait_for(state="visible")
            assert "jupyter_evalsched server extension is not enabled" in banner.inner_text()
            assert page.locator(f"{PANEL} .jp-EvalSched-gpu").count() == 0
        finally:
            context.close()
    finally:
        server.stop()


def test_browser_check(tmp_path: Path) -> None:
    """JupyterLab's own check: the server starts with every extension and the page config builds."""
    env = _isolated_env(tmp_path)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "jupyterlab.browser_check",
            "--no-chrome-test",
            "--allow-root",
            f"--ServerApp.port={_free_port()}",
            f"--ServerApp.root_dir={tmp_path / 'work'}",
        ],
        cwd=tmp_path / "work",
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    assert "Test Complete" in output, output[-4000:]
    assert re.search(r"jupyter_evalsched \| extension was successfully loaded", output), output[-4000:]


def test_labextension_listed(tmp_path: Path) -> None:
    """`jupyter labextension list` finds jupyter-evalsched, enabled and OK."""
    env = _isolated_env(tmp_path)
    proc = subprocess.run(
        [_bin("jupyter"), "labextension", "list"],
        cwd=tmp_path,
        env={**env, "NO_COLOR": "1"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    output = re.sub(r"\x1b\[[0-9;]*m", "", proc.stdout + proc.stderr)
    assert proc.returncode == 0, output
    line = next((ln for ln in output.splitlines() if "jupyter-evalsched" in ln), None)
    assert line is not None, output
    assert re.search(r"jupyter-evalsched v\S+ enabled\s+OK", line), line
    # The prebuilt bundle is really there (not a dangling link): its remote entry exists.
    ext = Path(sys.prefix) / "share" / "jupyter" / "labextensions" / "jupyter-evalsched"
    meta = json.loads((ext / "package.json").read_text())
    assert meta["name"] == "jupyter-evalsched"
    assert (ext / meta["jupyterlab"]["_build"]["load"]).is_file()
    assert (ext / "schemas" / "jupyter-evalsched" / "plugin.json").is_file()


def test_slurm_badge_helpers_without_a_browser(tmp_path: Path) -> None:
    """The SLURM badge text of a run row (`SLURM 123 · RUNNING`), from the compiled helpers in
    `labextension/lib/format.js`, run by Node (no browser, no server); and the shipped bundle has
    the badge (`.jp-EvalSched-slurm`) and the detail rows."""
    node = shutil.which("node")
    assert node, "node is needed (it builds the lab extension too)"
    src = REPO / "labextension" / "src" / "format.ts"
    lib = REPO / "labextension" / "lib" / "format.js"
    assert lib.exists() and lib.stat().st_mtime >= src.stat().st_mtime, (
        "labextension/lib is missing or older than src: run `cd labextension && jlpm build`"
    )
    module = tmp_path / "format.mjs"  # an ES module; lib/ has no package.json of its own
    module.write_text(lib.read_text())
    script = tmp_path / "check.mjs"
    script.write_text(
        "import { executorOf, isSlurm, slurmLabel } from './format.mjs';\n"
        "const runs = [\n"
        "  { executor: 'slurm', slurm_job_id: '123', slurm_state: 'RUNNING' },\n"
        "  { executor: 'slurm', slurm_job_id: '124', slurm_state: 'PENDING' },\n"
        "  { executor: 'slurm', slurm_job_id: null, slurm_state: null },\n"
        "  { executor: 'local' },\n"
        "  {},\n"
        "];\n"
        "console.log(JSON.stringify(runs.map(r => [executorOf(r), isSlurm(r), isSlurm(r) ? slurmLabel(r) : ''])));\n"
    )
    proc = subprocess.run([node, str(script)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == [
        ["slurm", True, "SLURM 123 · RUNNING"],
        ["slurm", True, "SLURM 124 · PENDING"],
        ["slurm", True, "SLURM"],
        ["local", False, ""],
        ["local", False, ""],
    ]
    static = REPO / "jupyter_evalsched" / "labextension" / "static"
    bundle = "\n".join(p.read_text(errors="replace") for p in static.glob("*.js"))
    for needle in ("jp-EvalSched-slurm", "data-slurm-job-id", "SLURM job", "SLURM state", "Executor"):
        assert needle in bundle, f"{needle!r} not in the built lab extension: rebuild it"


def test_attempt_badge_helpers_without_a_browser(tmp_path: Path) -> None:
    """The badges of a run row (`attempt N`, `preempted ×N`, `retry k/n`, `detached`), the
    attempts history and when Resume applies, from the compiled
    helpers in `labextension/lib/format.js`, run by Node; an older server's record (none of the
    fields) gets no badge, attempt 1 and no history. The shipped bundle has the button and badges."""
    node = shutil.which("node")
    assert node, "node is needed (it builds the lab extension too)"
    src = REPO / "labextension" / "src" / "format.ts"
    lib = REPO / "labextension" / "lib" / "format.js"
    assert lib.exists() and lib.stat().st_mtime >= src.stat().st_mtime, (
        "labextension/lib is missing or older than src: run `cd labextension && jlpm build`"
    )
    module = tmp_path / "format.mjs"
    module.write_text(lib.read_text())
    script = tmp_path / "check.mjs"
    script.write_text(
        "import { attemptOf, historyOf, isResumable, retryInSeconds, runBadges }"
        " from './format.mjs';\n"
        "const records = [\n"
        "  {},\n"
        "  { attempt: 1, preemptions: 0, retries: 0, retries_used: 0, detach: false, history: [] },\n"
        "  { attempt: 3, preemptions: 2, retries: 3, retries_used: 1, detach: true },\n"
        "  { attempt: 2, preemptions: 1, retries: 0 },\n"
        "  { attempt: 'x', preemptions: -1, retries: null, detach: 'yes' },\n"
        "];\n"
        "const out = {\n"
        "  badges: records.map(r => runBadges(r).map(b => [b.kind, b.text])),\n"
        "  attempts: records.map(attemptOf),\n"
        "  history: historyOf({ history: [\n"
        "    { attempt: 2, state: 'preempted', reason: 'preempted_by:r-9', episodes_done: 3 },\n"
        "    { attempt: 1, state: 'failed', reason: 'exit_code:3', started_at: 'a', finished_at: 'b',\n"
        "      episodes_done: 2 },\n"
        "    'junk'] }).map(e => [e.attempt, e.state, e.reason, e.episodes_done]),\n"
        "  noHistory: historyOf({ history: 'nope' }),\n"
        "  resumable: ['failed', 'aborted', 'cancelled', 'succeeded', 'queued', 'running'].map(isResumable),\n"
        "  retryIn: [retryInSeconds('2030-01-01T00:00:10.000000+00:00', Date.parse('2030-01-01T00:00:00Z')),\n"
        "            retryInSeconds('2030-01-01T00:00:10+00:00', Date.parse('2030-01-01T00:01:00Z')),\n"
        "            retryInSeconds(null)],\n"
        "};\n"
        "console.log(JSON.stringify(out));\n"
    )
    proc = subprocess.run([node, str(script)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["badges"] == [
        [],
        [],
        [["attempt", "attempt 3"], ["preemptions", "preempted ×2"], ["retries", "retry 1/3"], ["detached", "detached"]],
        [["attempt", "attempt 2"], ["preemptions", "preempted ×1"]],
        [],
    ]
    assert out["attempts"] == [1, 1, 3, 2, 1]
    assert out["history"] == [[1, "failed", "exit_code:3", 2], [2, "preempted", "preempted_by:r-9", 3]]
    assert out["noHistory"] == []
    assert out["resumable"] == [True, True, True, False, False, False]
    assert out["retryIn"] == [10, 0, None]
    static = REPO / "jupyter_evalsched" / "labextension" / "static"
    bundle = "\n".join(p.read_text(errors="replace") for p in static.glob("*.js"))
    for needle in ("evalsched-resume", "evalsched-history-entry", "jp-EvalSched-badge", "evalsched-retry-at"):
        assert needle in bundle, f"{needle!r} not in the built lab extension: rebuild it"


# ---------------------------------------------------------------------------- sweeps, comparison,
# notifications

TOY = "jupyter_evalsched.examples.basic:accuracy_toy"
SWEEP = f'{PANEL} [data-testid="evalsched-sweep"]'
COMPARE = '[data-testid="evalsched-compare"]'


def _submit_sweep(server: LabServer, body: dict) -> dict:
    status, view = server.request("POST", "evalsched/sweeps", body)
    assert status == 201, (status, view)
    return view


def _wait_sweep(server: LabServer, sweep_id: str, done: Callable[[dict], bool], timeout: float = 120.0) -> dict:
    """Until ``done(GET /evalsched/sweeps/{id})``; returns that view."""
    last: dict = {}

    def check() -> bool:
        status, view = server.request("GET", f"evalsched/sweeps/{sweep_id}")
        if status != 200:
            pytest.fail(f"GET evalsched/sweeps/{sweep_id}: {status} {view}")
        last["view"] = view
        return done(view)

    try:
        wait_until(check, timeout=timeout, interval=0.2)
    except AssertionError:
        raise AssertionError(f"sweep {sweep_id} not as expected: {last.get('view')}") from None
    return last["view"]


def _all_ended(view: dict) -> bool:
    return all(r["state"] in ("succeeded", "failed", "cancelled", "aborted") for r in view["runs"])


def _sweep_label(view: dict, name: str) -> str:
    """What the panel names a sweep: its runs' ``sweep_name`` (``name``, as submitted); a server
    that does not send ``sweep_name`` yet leaves the panel only the sweep's id."""
    names = {r.get("sweep_name") for r in view["runs"]}
    if names == {None}:
        return view["id"]
    assert names == {name}, names
    return name


def _sweep_row(page: Any, sweep_id: str, attrs: str = "") -> Any:
    return page.locator(f'{SWEEP}[data-sweep-id="{sweep_id}"]{attrs}')


def _show_panel(page: Any) -> None:
    if not page.locator(PANEL).is_visible():
        page.click(PANEL_TAB)
    page.wait_for_selector(PANEL, state="visible")


def _shown(x: float | None) -> str:
    """A number as the panel's formatNumber shows it (about four significant digits)."""
    if x is None:
        return "–"
    if float(x).is_integer() and abs(x) < 1e9:
        return str(int(x))
    assert 1e-3 <= abs(x) < 1e6, x  # the exponent form is not emulated here
    return repr(float(f"{x:.4g}"))


@pytest.mark.slow  # a Chromium page on JupyterLab: CI runs it with -m slow (docs/install.md: the default suite stays within ten minutes)
def test_panel_sweep_rows(lab: LabServer, browser: Any) -> None:
    """A sweep is one row (its name, runs per state, episodes over all its runs) that expands to
    its runs as ordinary run rows labelled with their points; its runs are not listed on their
    own. Cancel sweep (behind a confirmation) cancels what is unfinished and leaves the rest."""
    _wait_idle(lab)
    _write_user_settings(lab, {})
    context, page, errors = _open_lab(browser, lab)
    try:
        with failure_report(lab, "lab-panel-sweep-failure.png", lambda: page):
            page.wait_for_selector(f'{PANEL} .jp-EvalSched-conn[data-mode="live"]')
            grid = {"skill": [0.3, 0.6, 0.9], "label": ["a", "b"]}
            view = _submit_sweep(lab, {"name": "toy-grid", "entrypoint": TOY, "episodes": 4, "sweep": grid})
            sweep_id, runs = view["id"], view["runs"]
            assert len(runs) == 6 and all(r["sweep_id"] == sweep_id for r in runs)
            _wait_sweep(lab, sweep_id, _all_ended)

            row = _sweep_row(page, sweep_id, '[data-count-succeeded="6"]')
            row.wait_for(state="visible")
            assert _sweep_row(page, sweep_id).count() == 1
            assert row.get_attribute("data-section") == "finished"
            assert row.get_attribute("data-state") == "succeeded"
            assert row.get_attribute("data-runs") == "6"
            assert json.loads(row.get_attribute("data-counts")) == {"succeeded": 6}
            assert (row.get_attribute("data-progress-done"), row.get_attribute("data-progress-total")) == ("24", "24")
            assert row.locator('[data-testid="evalsched-sweep-name"]').inner_text() == _sweep_label(view, "toy-grid")
            assert "6 succeeded" in row.locator('[data-testid="evalsched-sweep-counts"]').inner_text()
            assert row.locator('[data-testid="evalsched-sweep-cancel"]').is_hidden()  # nothing unfinished
            assert row.locator('[data-testid="evalsched-sweep-compare"]').is_visible()
            # its runs are not listed on their own
            for run in runs:
                assert page.locator(f'{PANEL} .jp-EvalSched-run[data-run-id="{run["id"]}"]').count() == 0

            # -- expanded: its runs as run rows, labelled with their points, in submission order ----
            row.locator('[data-testid="evalsched-sweep-toggle"]').click()
            children = row.locator('[data-testid="evalsched-sweep-runs"] .jp-EvalSched-run')
            page.wait_for_function(
                "([sel]) => document.querySelectorAll(sel).length === 6",
                arg=[f'{SWEEP}[data-sweep-id="{sweep_id}"] [data-testid="evalsched-sweep-runs"] .jp-EvalSched-run'],
            )
            assert row.get_attribute("data-expanded") == "true"
            expected = [f"skill={s}, label={label}" for s in (0.3, 0.6, 0.9) for label in ("a", "b")]
            assert [children.nth(i).get_attribute("data-point") for i in range(6)] == expected
            assert [children.nth(i).get_attribute("data-run-id") for i in range(6)] == [r["id"] for r in runs]
            for i in range(6):
                child = children.nth(i)
                assert child.get_attribute("data-sweep-id") == sweep_id
                assert child.get_attribute("data-state") == "succeeded"
                assert child.get_attribute("data-section") == "finished"
                assert child.locator('[data-testid="evalsched-run-name"]').inner_text() == expected[i]
                assert child.locator('.jp-EvalSched-metric[data-metric="accuracy"]').count() == 1
            # an ordinary run row: its inline detail opens
            children.nth(0).locator('[data-testid="evalsched-details"]').click()
            children.nth(0).locator('.jp-EvalSched-detail dd[data-field="executor"]').wait_for(state="visible")
            row.locator('[data-testid="evalsched-sweep-toggle"]').click()
            children.first.wait_for(state="detached")
            assert row.get_attribute("data-expanded") == "false"

            # -- a sweep with a long point: listed among the running; Cancel sweep -----------------
            view = _submit_sweep(
                lab, {"name": "sleepy-sweep", "entrypoint": SLEEPY, "episodes": 1, "sweep": {"sleep_s": [0.01, 60]}}
            )
            sleepy_id = view["id"]
            quick, slow = (r["id"] for r in view["runs"])
            row = _sweep_row(page, sleepy_id, '[data-count-succeeded="1"][data-count-running="1"]')
            row.wait_for(state="visible")
            assert row.get_attribute("data-section") == "running"
            assert row.get_attribute("data-state") == "running"
            assert json.loads(row.get_attribute("data-counts")) == {"running": 1, "succeeded": 1}
            in_running = f'{PANEL} .jp-EvalSched-list[data-section="running"] [data-sweep-id="{sleepy_id}"]'
            assert page.locator(in_running).count() == 1
            cancel = row.locator('[data-testid="evalsched-sweep-cancel"]')
            assert cancel.is_visible()
            cancel.click()
            _confirm_dialog(page, False, "Cancel sweep?")  # kept: nothing changes
            assert lab.run(slow)["state"] == "running"
            cancel.click()
            _confirm_dialog(page, True, "Cancel sweep?")
            row = _sweep_row(page, sleepy_id, '[data-count-succeeded="1"][data-count-cancelled="1"]')
            row.wait_for(state="visible")
            page.wait_for_selector(
                f'{SWEEP}[data-sweep-id="{sleepy_id}"][data-section="finished"][data-state="cancelled"]'
            )
            assert row.locator('[data-testid="evalsched-sweep-cancel"]').is_hidden()
            assert lab.run(quick)["state"] == "succeeded" and lab.run(slow)["state"] == "cancelled"
            status, server_view = lab.request("GET", f"evalsched/sweeps/{sleepy_id}")
            assert status == 200 and server_view["counts"] == {"succeeded": 1, "cancelled": 1}
            assert errors.errors == []
    finally:
        context.close()


@pytest.mark.slow  # a Chromium page on JupyterLab: CI runs it with -m slow (docs/install.md: the default suite stays within ten minutes)
def test_panel_compare(lab: LabServer, browser: Any) -> None:
    """Compare on a finished sweep opens a tab: one row per run whose means, standard errors and
    deltas are the server's (GET /evalsched/compare), the baseline marked and selectable (the
    deltas follow it), a metric selector, and a chart with one point per run against the first
    differing parameter, one line per value of the other. Runs selected in the panel compare too;
    an error of the server is shown in the view."""
    _wait_idle(lab)
    _write_user_settings(lab, {})
    view = _submit_sweep(
        lab,
        {
            "name": "toy-compare",
            "entrypoint": TOY,
            "episodes": 6,
            "sweep": {"skill": [0.3, 0.6, 0.9], "label": ["a", "b"]},
        },
    )
    sweep_id, runs = view["id"], view["runs"]
    ids = [r["id"] for r in runs]
    _wait_sweep(lab, sweep_id, _all_ended)
    context, page, errors = _open_lab(browser, lab)
    try:
        with failure_report(lab, "lab-panel-compare-failure.png", lambda: page):
            row = _sweep_row(page, sweep_id, '[data-count-succeeded="6"]')
            row.wait_for(state="visible")
            row.locator('[data-testid="evalsched-sweep-compare"]').click()
            compare = page.locator(f'{COMPARE}[data-sweep-id="{sweep_id}"]')
            page.wait_for_selector(f'{COMPARE}[data-sweep-id="{sweep_id}"][data-status="ready"]')
            assert page.locator(f'.jp-MainAreaWidget[id="jupyter-evalsched-compare-{sweep_id}"]').is_visible()

            def check_table(baseline: str) -> dict:
                status, expected = lab.request("GET", f"evalsched/compare?sweep={sweep_id}&baseline={baseline}")
                assert status == 200, expected
                assert expected["baseline"] == baseline
                assert compare.get_attribute("data-baseline") == baseline
                rows = compare.locator('[data-testid="evalsched-compare-row"]')
                assert rows.count() == 6
                assert [rows.nth(i).get_attribute("data-run-id") for i in range(6)] == ids
                assert set(expected["params"]) == {"skill", "label"}
                assert set(expected["metrics"]) >= {"accuracy", "answer_length"}
                for want in expected["rows"]:
                    ui = compare.locator(f'[data-testid="evalsched-compare-row"][data-run-id="{want["id"]}"]')
                    assert ui.get_attribute("data-baseline") == str(want["id"] == baseline).lower()
                    for param in expected["params"]:
                        cell = ui.locator(f'td[data-field="param"][data-param="{param}"]')
                        assert cell.inner_text() == str(want["params"][param])
                    for metric in expected["metrics"]:
                        stat, delta = want["metrics"][metric], want["delta"][metric]
                        mean = ui.locator(f'td[data-metric="{metric}"][data-field="mean"]')
                        assert float(mean.get_attribute("data-value")) == stat["mean"]
                        text = _shown(stat["mean"])
                        if stat["stderr"] is not None:
                            text += f" ± {_shown(stat['stderr'])}"
                        assert mean.inner_text() == text
                        cell = ui.locator(f'td[data-metric="{metric}"][data-field="delta"]')
                        assert float(cell.get_attribute("data-value")) == delta["mean"]
                        assert cell.get_attribute("data-paired") == str(delta["paired"]) == "6"
                        if want["id"] == baseline:
                            assert cell.inner_text() == "baseline"
                        else:
                            lo, hi = delta["ci95"]
                            assert float(cell.get_attribute("data-ci-lo")) == lo
                            assert float(cell.get_attribute("data-ci-hi")) == hi
                            assert f"[{_shown(lo)}, {_shown(hi)}] (6)" in cell.inner_text()
                            assert cell.inner_text().lstrip("+").startswith(_shown(delta["mean"]))
                    wall = ui.locator('td[data-field="wall_s"]')
                    assert float(wall.get_attribute("data-value")) == want["wall_s"]
                tag = compare.locator('[data-testid="evalsched-compare-baseline-tag"]')
                assert tag.count() == 1
                assert (
                    compare.locator(
                        f'[data-run-id="{baseline}"] [data-testid="evalsched-compare-baseline-tag"]'
                    ).count()
                    == 1
                )
                return expected

            first = check_table(ids[0])  # the first run by default
            assert compare.locator('[data-testid="evalsched-compare-baseline"]').input_value() == ids[0]

            # -- the chart: the metric against skill (numeric), one line per label ------------------
            metric = compare.get_attribute("data-metric")
            assert metric == first["metrics"][0]
            chart = compare.locator('[data-testid="evalsched-compare-chart"]')
            assert chart.get_attribute("data-x-param") == first["params"][0]
            assert chart.get_attribute("data-x-kind") == ("numeric" if first["params"][0] == "skill" else "categorical")
            points = chart.locator('[data-testid="evalsched-compare-point"]')
            assert points.count() == 6
            assert sorted(points.nth(i).get_attribute("data-run-id") for i in range(6)) == sorted(ids)
            means = {r["id"]: r["metrics"][metric]["mean"] for r in first["rows"]}
            for i in range(6):
                point = points.nth(i)
                assert float(point.get_attribute("data-y")) == means[point.get_attribute("data-run-id")]
            assert chart.get_attribute("data-series") == "2"
            assert compare.locator('[data-testid="evalsched-compare-legend"] .jp-EvalSched-legendItem').count() == 2
            assert chart.locator("polyline").count() == 2
            ARTIFACTS.mkdir(exist_ok=True)
            compare.screenshot(path=str(ARTIFACTS / "lab-compare-sweep.png"))

            # -- another metric ----------------------------------------------------------------------
            other = next(m for m in first["metrics"] if m != metric)
            compare.locator('[data-testid="evalsched-compare-metric"]').select_option(other)
            page.wait_for_selector(f'{COMPARE}[data-sweep-id="{sweep_id}"] svg[data-metric="{other}"]')
            other_means = {r["id"]: r["metrics"][other]["mean"] for r in first["rows"]}
            for i in range(points.count()):
                point = points.nth(i)
                assert float(point.get_attribute("data-y")) == other_means[point.get_attribute("data-run-id")]

            # -- another baseline: re-read with &baseline=, the deltas follow -------------------------
            compare.locator('[data-testid="evalsched-compare-baseline"]').select_option(ids[-1])
            page.wait_for_selector(
                f'{COMPARE}[data-sweep-id="{sweep_id}"][data-baseline="{ids[-1]}"][data-status="ready"]'
            )
            second = check_table(ids[-1])
            before = {r["id"]: r["delta"]["accuracy"]["mean"] for r in first["rows"]}
            after = {r["id"]: r["delta"]["accuracy"]["mean"] for r in second["rows"]}
            assert before[ids[-1]] != 0 or after[ids[0]] != 0  # the toy's skills differ: so do the deltas
            assert after[ids[-1]] == 0 and before[ids[0]] == 0
            assert compare.get_attribute("data-metric") == other  # the chosen metric stays

            # -- an error of the server is shown in the view, never thrown ------------------------
            failing = re.compile(r"/evalsched/compare(\?.*)?$")
            page.route(
                failing,
                lambda route: route.fulfill(
                    status=422, json={"message": "the baseline 'x' is not one of the compared runs"}
                ),
            )
            compare.locator('[data-testid="evalsched-compare-refresh"]').click()
            message = compare.locator('[data-testid="evalsched-compare-message"]')
            message.wait_for(state="visible")
            assert "is not one of the compared runs" in message.inner_text()
            assert compare.get_attribute("data-status") == "error" and compare.get_attribute("data-error") == "422"
            assert compare.locator('[data-testid="evalsched-compare-row"]').count() == 0
            page.unroute(failing)
            compare.locator('[data-testid="evalsched-compare-refresh"]').click()
            page.wait_for_selector(f'{COMPARE}[data-sweep-id="{sweep_id}"][data-status="ready"]')
            assert message.is_hidden() and compare.locator('[data-testid="evalsched-compare-row"]').count() == 6

            # -- runs selected in the panel: Compare (2), the first selected is the baseline ------------
            _show_panel(page)
            row.locator('[data-testid="evalsched-sweep-toggle"]').click()
            children = row.locator('[data-testid="evalsched-sweep-runs"] .jp-EvalSched-run')
            children.nth(5).wait_for(state="visible")
            selection = page.locator(f'{PANEL} [data-testid="evalsched-selection"]')
            assert selection.is_hidden()
            children.nth(4).locator('[data-testid="evalsched-select"]').check()
            page.wait_for_selector(f'{PANEL} [data-testid="evalsched-selection"][data-count="1"]')
            assert page.locator(f'{PANEL} [data-testid="evalsched-compare-selected"]').is_disabled()
            children.nth(1).locator('[data-testid="evalsched-select"]').check()
            button = page.locator(f'{PANEL} [data-testid="evalsched-compare-selected"]')
            assert button.inner_text() == "Compare (2)" and button.is_enabled()
            button.click()
            picked = f"{ids[4]},{ids[1]}"
            pair = page.locator(f'{COMPARE}[data-runs="{picked}"]')
            page.wait_for_selector(f'{COMPARE}[data-runs="{picked}"][data-status="ready"]')
            assert pair.get_attribute("data-baseline") == ids[4]
            rows = pair.locator('[data-testid="evalsched-compare-row"]')
            assert [rows.nth(i).get_attribute("data-run-id") for i in range(rows.count())] == [ids[4], ids[1]]
            status, expected = lab.request("GET", f"evalsched/compare?runs={picked}")
            assert status == 200
            for want in expected["rows"]:
                cell = pair.locator(f'[data-run-id="{want["id"]}"] td[data-metric="accuracy"][data-field="mean"]')
                assert float(cell.get_attribute("data-value")) == want["metrics"]["accuracy"]["mean"]
            assert pair.locator('[data-testid="evalsched-compare-point"]').count() == 2
            _show_panel(page)
            page.locator(f'{PANEL} [data-testid="evalsched-selection-clear"]').click()
            selection.wait_for(state="hidden")
            assert children.nth(4).locator('[data-testid="evalsched-select"]').is_checked() is False
            ARTIFACTS.mkdir(exist_ok=True)
            page.screenshot(path=str(ARTIFACTS / "lab-panel-compare.png"))
            assert errors.errors == []
    finally:
        context.close()


def _notified(page: Any, entry: str) -> None:
    """Until the panel says what it decided for a run or sweep that ended (`<id>:<decision>`)."""
    page.wait_for_function(
        "([sel, entry]) => (document.querySelector(sel)?.dataset.notified || '').split(' ').includes(entry)",
        arg=[PANEL, entry],
    )


def _toast(page: Any, text: str) -> Any:
    return page.locator(".Toastify__toast", has=page.locator(".jp-toast-message", has_text=text))


@pytest.mark.slow  # a Chromium page on JupyterLab: CI runs it with -m slow (docs/install.md: the default suite stays within ten minutes)
def test_panel_failure_notification(lab: LabServer, browser: Any) -> None:
    """With the default setting a run that fails while the page watches is an error notification
    naming it, whose Open opens the run's tab; with notifications off, none."""
    _wait_idle(lab)
    _write_user_settings(lab, {})
    context, page, errors = _open_lab(browser, lab)
    try:
        with failure_report(lab, "lab-panel-notification-failure.png", lambda: page):
            page.wait_for_selector(f'{PANEL}[data-notifications="failures"] .jp-EvalSched-conn[data-mode="live"]')
            name = f"crash-notify-{secrets.token_hex(3)}"
            run_id = lab.submit({"name": name, "entrypoint": CRASH, "episodes": 1, "params": {"how": "exception"}})[
                "id"
            ]
            _wait_run(page, run_id, "failed", "finished")
            _notified(page, f"{run_id}:error")
            toast = _toast(page, name)
            toast.wait_for(state="visible")
            assert "failed" in toast.inner_text()
            assert page.locator(".jp-Notification-Toast-error", has_text=name).count() == 1
            toast.locator(".jp-toast-button", has_text="Open").click()
            page.locator(f'.jp-MainAreaWidget[id="jupyter-evalsched-run-{run_id}"]').wait_for(state="visible")
            toast.wait_for(state="detached")  # an action closes its toast
            assert errors.errors == []
    finally:
        context.close()

    _write_user_settings(lab, {"notifications": "off"})
    context, page, errors = _open_lab(browser, lab)
    try:
        with failure_report(lab, "lab-panel-notification-off-failure.png", lambda: page):
            page.wait_for_selector(f'{PANEL}[data-notifications="off"] .jp-EvalSched-conn[data-mode="live"]')
            name = f"crash-quiet-{secrets.token_hex(3)}"
            run_id = lab.submit({"name": name, "entrypoint": CRASH, "episodes": 1, "params": {"how": "exception"}})[
                "id"
            ]
            _wait_run(page, run_id, "failed", "finished")
            # The deterministic signal: the panel saw it end and decided not to notify (the toast,
            # had there been one, is emitted in the same call).
            _notified(page, f"{run_id}:suppressed")
            assert page.locator(".jp-toast-message", has_text=name).count() == 0
            assert page.locator(".Toastify__toast").count() == 0
            assert errors.errors == []
    finally:
        context.close()
        _write_user_settings(lab, {})


@pytest.mark.slow  # a Chromium page on JupyterLab: CI runs it with -m slow (docs/install.md: the default suite stays within ten minutes)
def test_panel_sweep_notification(lab: LabServer, browser: Any) -> None:
    """Under `all`, a sweep's runs do not notify on their own: the sweep does, once, when its last
    run ends; its Open shows the sweep's row in the panel, expanded."""
    _wait_idle(lab)
    _write_user_settings(lab, {"notifications": "all"})
    context, page, errors = _open_lab(browser, lab)
    try:
        with failure_report(lab, "lab-panel-sweep-notification-failure.png", lambda: page):
            page.wait_for_selector(f'{PANEL}[data-notifications="all"] .jp-EvalSched-conn[data-mode="live"]')
            name = f"sweep-notify-{secrets.token_hex(3)}"
            view = _submit_sweep(
                lab, {"name": name, "entrypoint": SLEEPY, "episodes": 2, "sweep": {"sleep_s": [0.05, 0.3]}}
            )
            sweep_id = view["id"]
            _notified(page, f"{sweep_id}:success")
            for run in view["runs"]:
                _notified(page, f"{run['id']}:sweep")
            label = _sweep_label(view, name)
            toast = _toast(page, label)
            toast.wait_for(state="visible")
            assert "2 succeeded" in toast.inner_text()
            assert page.locator(".jp-Notification-Toast-success", has_text=label).count() == 1
            notified = (page.locator(PANEL).get_attribute("data-notified") or "").split()
            assert notified.count(f"{sweep_id}:success") == 1
            assert not any(e.startswith(r["id"]) and not e.endswith(":sweep") for e in notified for r in view["runs"])
            toast.locator(".jp-toast-button", has_text="Open").click()
            _sweep_row(page, sweep_id, '[data-expanded="true"][data-count-succeeded="2"]').wait_for(state="visible")
            page.wait_for_function(
                "([sel]) => document.querySelectorAll(sel).length === 2",
                arg=[f'{SWEEP}[data-sweep-id="{sweep_id}"] [data-testid="evalsched-sweep-runs"] .jp-EvalSched-run'],
            )
            assert errors.errors == []
    finally:
        context.close()
        _write_user_settings(lab, {})


@pytest.mark.slow  # a Chromium page on JupyterLab: CI runs it with -m slow (docs/install.md: the default suite stays within ten minutes)
def test_panel_shared_models(tmp_path: Path, browser: Any) -> None:
    """A host with a shared model (the tiny causal LM, built offline): the panel's Shared models
    section shows its row with its state, its OpenAI endpoint (and a Copy button), requests,
    tokens/s and mean batch size, and follows a request made through the API by itself."""
    from jupyter_evalsched.shared_models.tiny_lm import build_tiny_gpt2

    model_dir = build_tiny_gpt2(tmp_path / "tiny-gpt2")
    config = tmp_path / "config"
    config.mkdir(parents=True, exist_ok=True)
    declaration = {"name": "tiny-lm", "loader": "jupyter_evalsched.shared_models.loaders:causal_lm"}
    (config / "jupyter_server_config.json").write_text(
        json.dumps({"EvalSchedApp": {"models": [{**declaration, "model": model_dir, "cpu_threads": 1}]}})
    )
    server = _start(tmp_path)
    context = page = None
    try:
        with failure_report(server, "lab-panel-models-failure.png", lambda: page):
            context, page, errors = _open_lab(browser, server)
            row = page.locator(f'{PANEL} [data-testid="evalsched-model-row"][data-model="tiny-lm"]')
            row.wait_for(state="visible")
            assert page.locator(f'{PANEL} section[data-section="models"]').is_visible()
            endpoint = row.locator('[data-testid="evalsched-model-endpoint"]').inner_text()
            assert endpoint.startswith("http://") and endpoint.endswith(f":{server.port}{BASE_URL}evalsched/v1"), (
                endpoint
            )
            assert row.locator('[data-testid="evalsched-model-copy"]').is_visible()
            figures = row.locator('[data-testid="evalsched-model-figures"]')
            assert "0 requests" in figures.inner_text() and "tok/s" in figures.inner_text()
            assert "batch" in figures.inner_text()

            # The first request loads the model: on a busy machine longer than server.request waits.
            request = urllib.request.Request(
                f"{server.url}evalsched/v1/completions",
                data=json.dumps({"model": "tiny-lm", "prompt": "The cat", "max_tokens": 2}).encode(),
                method="POST",
                headers={"Authorization": f"Bearer {server.token}", "Content-Type": "application/json"},
            )
            with urllib.request.urlopen(request, timeout=180) as response:
                assert response.status == 200
            # Read again by the panel on its own (no event says a model's figures changed).
            page.wait_for_selector(
                f'{PANEL} [data-testid="evalsched-model-row"][data-model="tiny-lm"][data-state="loaded"][data-requests="1"]'
            )
            text = figures.inner_text()
            assert "1 request" in text and "batch 1" in text, text
            assert row.locator('[data-testid="evalsched-model-state"]').inner_text() == "loaded"
            assert errors.errors == []
    finally:
        if context is not None:
            context.close()
        server.stop()
