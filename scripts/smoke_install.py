"""Smoke test of an installed jupyter-evalsched (scripts/check_packaging.sh runs it).

    .venv/bin/python scripts/smoke_install.py --venv /tmp/clean-venv [--workdir DIR] [--path PATH]

Starts the ``jupyter lab`` of VENV (a venv where the wheel and JupyterLab were installed, nothing
else) with one virtual 24000 MB GPU (``c.EvalSchedApp.virtual_gpus = [24000]`` in its config
file), a temporary runs directory (``--EvalSchedApp.runs_dir``), a token, a non-root base URL and
Jupyter directories of its own, then checks, as a user would see it:

* ``GET /evalsched/queue`` answers, with the virtual GPU in the ledger;
* ``GET /evalsched/status`` reports the installed distribution's version;
* a no-op run (``jupyter_evalsched.examples.basic:noop``) submitted over REST succeeds, and its
  directory is in the temporary runs directory;
* the JupyterLab side panel renders in Chromium: the ledger's GPU and the run, succeeded, with no
  page error of ours (Playwright from the interpreter running this script, Debian's Chromium).

Nothing of this repository is on the server's ``sys.path``: its working directory is a temporary
folder and PYTHONPATH is unset. Exit status 0 when everything held, 1 otherwise. Standard library
only, but for Playwright.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

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
BASE_URL = "/smoke/"
VRAM = 24000
NOOP = "jupyter_evalsched.examples.basic:noop"
PANEL = "#jupyter-evalsched-panel"
PANEL_TAB = '.lm-TabBar-tab[data-id="jupyter-evalsched-panel"]'


def log(message: str) -> None:
    print(f"smoke: {message}", flush=True)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """The clean venv's ``jupyter lab``; ``self.proc.pid`` is the server's own PID."""

    def __init__(self, venv: Path, work: Path, path: str) -> None:
        self.port = free_port()
        self.token = secrets.token_hex(16)
        self.url = f"http://127.0.0.1:{self.port}{BASE_URL}"
        self.runs_dir = work / "runs"
        dirs = {name: work / name for name in ("home", "config", "data", "runtime", "root")}
        for folder in dirs.values():
            folder.mkdir(parents=True, exist_ok=True)
        self.runs_dir.mkdir(parents=True, exist_ok=True)
        # The virtual GPU through a config file, as users configure the extension
        # (`c.EvalSchedApp.virtual_gpus`); the runs directory on the command line (below).
        (dirs["config"] / "jupyter_server_config.json").write_text(
            json.dumps({"EvalSchedApp": {"virtual_gpus": [VRAM]}})
        )
        # No "get notified about Jupyter news?" toast over the side panel.
        settings = dirs["config"] / "lab" / "user-settings" / "@jupyterlab" / "apputils-extension"
        settings.mkdir(parents=True, exist_ok=True)
        (settings / "notification.jupyterlab-settings").write_text(
            json.dumps({"fetchNews": "false", "checkForUpdates": False})
        )
        drop = ("EVALSCHED_", "JUPYTER_", "JPY_")
        env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
        for name in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV"):
            env.pop(name, None)
        env.update(
            HOME=str(dirs["home"]),
            JUPYTER_CONFIG_DIR=str(dirs["config"]),
            JUPYTER_DATA_DIR=str(dirs["data"]),
            JUPYTER_RUNTIME_DIR=str(dirs["runtime"]),
            JUPYTER_PLATFORM_DIRS="0",
            PATH=f"{venv / 'bin'}{os.pathsep}{path}",
            PYTHONUNBUFFERED="1",
        )
        self.log_path = work / "jupyter-lab.log"
        self._log = open(self.log_path, "wb")
        argv = [
            str(venv / "bin" / "jupyter-lab"),
            "--no-browser",
            "--ServerApp.ip=127.0.0.1",
            f"--ServerApp.port={self.port}",
            "--ServerApp.port_retries=0",
            f"--IdentityProvider.token={self.token}",
            f"--ServerApp.base_url={BASE_URL}",
            f"--ServerApp.root_dir={dirs['root']}",
            "--LabApp.news_url=",
            "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
            f"--EvalSchedApp.runs_dir={self.runs_dir}",
            *(["--allow-root"] if os.geteuid() == 0 else []),
        ]
        self.proc = subprocess.Popen(
            argv,
            cwd=dirs["root"],
            env=env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )

    def request(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        req = urllib.request.Request(
            self.url + path.lstrip("/"),
            data=None if body is None else json.dumps(body).encode(),
            method=method,
            headers={"Authorization": f"token {self.token}", "Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(req, timeout=30) as resp:
                raw, status = resp.read(), resp.status
        except urllib.error.HTTPError as err:
            raw, status = err.read(), err.code
        try:
            return status, json.loads(raw or b"null")
        except ValueError:
            return status, raw.decode(errors="replace")

    def wait_ready(self, timeout: float = 120.0) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"jupyter lab exited with {self.proc.returncode}")
            try:
                status, view = self.request("GET", "evalsched/queue")
                if status == 200:
                    return view
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            time.sleep(0.25)
        raise AssertionError(f"GET /evalsched/queue did not answer 200 within {timeout:g} s")

    def log_tail(self, lines: int = 40) -> str:
        self._log.flush()
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self._log.close()


def installed_version(venv: Path) -> str:
    out = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import importlib.metadata as m; print(m.version('jupyter-evalsched'))"],
        capture_output=True,
        text=True,
        check=True,
        cwd=tempfile.gettempdir(),
        env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
    )
    return out.stdout.strip()


def check_rest(server: Server, version: str) -> str:
    view = server.wait_ready()
    devices = (view.get("ledger") or {}).get("devices") or []
    assert [d.get("usable_mb") for d in devices] == [VRAM], f"ledger devices: {devices}"
    log(f"GET /evalsched/queue: 200, one virtual GPU of {VRAM} MB")

    status, body = server.request("GET", "evalsched/status")
    assert status == 200, (status, body)
    assert body.get("version") == version, f"/evalsched/status says {body.get('version')}, installed {version}"
    assert body.get("role") == "primary", body
    assert body.get("runs_dir") == str(server.runs_dir), (
        f"runs_dir {body.get('runs_dir')}, configured {server.runs_dir}"
    )
    log(f"GET /evalsched/status: version {version}, role primary, runs_dir {server.runs_dir}")

    status, record = server.request("POST", "evalsched/runs", {"name": "smoke-noop", "entrypoint": NOOP, "episodes": 3})
    assert status == 201, (status, record)
    run_id = record["id"]
    deadline = time.monotonic() + 60
    while True:
        status, record = server.request("GET", f"evalsched/runs/{run_id}")
        assert status == 200, (status, record)
        if record["state"] not in ("queued", "running"):
            break
        assert time.monotonic() < deadline, f"the no-op run is still {record['state']}: {record.get('reason')}"
        time.sleep(0.1)
    assert record["state"] == "succeeded", f"no-op run {record['state']}: {record.get('reason')}"
    assert (server.runs_dir / run_id / "_DONE").exists(), f"no _DONE in {server.runs_dir / run_id}"
    log(f"no-op run {run_id} succeeded ({record.get('progress')}), start {record.get('start')}")
    return run_id


def check_panel(server: Server, run_id: str, screenshot: Path) -> None:
    assert Path(CHROMIUM).exists(), f"{CHROMIUM} is not installed"
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.set_default_timeout(60_000)
            errors: list[str] = []
            page.on("pageerror", lambda exc: errors.append(f"pageerror: {exc}"))
            page.on(
                "console",
                lambda msg: (
                    errors.append(f"console: {msg.text}")
                    if msg.type == "error" and "evalsched" in msg.text.lower()
                    else None
                ),
            )
            try:
                page.goto(f"{server.url}lab?token={server.token}", wait_until="domcontentloaded")
                # The layout restorer may bring up another side panel first: wait for ours to be
                # attached, then make it visible through its tab.
                page.wait_for_selector(PANEL, state="attached")
                page.wait_for_selector(PANEL_TAB, state="visible")
                if not page.locator(PANEL).is_visible():
                    page.click(PANEL_TAB)
                page.wait_for_selector(PANEL, state="visible")
                page.wait_for_selector(f'{PANEL} .jp-EvalSched-gpu[data-index="0"][data-usable-mb="{VRAM}"]')
                page.wait_for_selector(f'{PANEL} .jp-EvalSched-run[data-run-id="{run_id}"][data-state="succeeded"]')
                page.locator(PANEL).screenshot(path=str(screenshot))
            except BaseException:
                page.screenshot(path=str(screenshot.with_name("smoke-failure.png")))
                raise
            assert errors == [], errors
        finally:
            browser.close()
    log(f"the panel rendered in Chromium: the GPU and the succeeded run ({screenshot})")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Smoke test of an installed jupyter-evalsched.")
    parser.add_argument("--venv", type=Path, required=True, help="the venv with the wheel and JupyterLab")
    parser.add_argument("--workdir", type=Path, help="where the server's directories go (default: a temporary one)")
    parser.add_argument("--path", default=os.environ.get("PATH", ""), help="PATH after the venv's bin (default: $PATH)")
    parser.add_argument("--no-browser", action="store_true", help="skip the Chromium check")
    args = parser.parse_args(argv)

    venv = args.venv.resolve()
    work = (args.workdir or Path(tempfile.mkdtemp(prefix="evalsched-smoke-"))).resolve()
    if work.exists() and args.workdir:
        shutil.rmtree(work)
    work.mkdir(parents=True, exist_ok=True)
    version = installed_version(venv)
    log(f"jupyter-evalsched {version} in {venv}")
    started = time.monotonic()
    server = Server(venv, work, args.path)
    try:
        run_id = check_rest(server, version)
        if not args.no_browser:
            check_panel(server, run_id, work / "panel.png")
    except BaseException as exc:
        print(f"smoke: FAILED: {exc!r}\n--- jupyter lab log ---\n{server.log_tail()}", file=sys.stderr)
        return 1
    finally:
        server.stop()
    log(f"passed in {time.monotonic() - started:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
