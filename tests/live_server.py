"""A real ``jupyter server`` subprocess with the extension, for client, CLI, magic and widget tests.

pytest-jupyter's ``jp_serverapp`` runs the server on the test's own event loop, where a blocking
urllib client would deadlock it; these tests need the server in another process. Import the
fixtures into a test module (``from live_server import live_server, client``); the modules share
one server (about 4 s to start) and leave it idle after each test (``clean_queue``).
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from waiting import reached_state, wait_until  # the one wait_until; re-exported for the modules that use this one

from jupyter_evalsched.client import TERMINAL_STATES, EvalSchedClient, LocalServer
from jupyter_evalsched.scheduler.gpus import write_process_table

__all__ = [
    "CRASH",
    "SLEEPY",
    "clean_queue",
    "cli",
    "cli_env",
    "client",
    "ip",
    "live_server",
    "runtime_dir",
    "server_file",
    "wait_state",
    "wait_until",
]

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SLEEPY = "jupyter_evalsched.examples.basic:sleepy"
CRASH = "jupyter_evalsched.examples.basic:crash"

# Fast timings for tests; the defaults suit production.
FAST_SERVER_ARGS = [
    "--EvalSchedApp.cancel_grace_s=2.0",
    "--EvalSchedApp.reconcile_interval_s=0.5",
    "--EvalSchedApp.progress_interval_s=0.05",
]


_shared: LocalServer | None = None


def _stop_shared() -> None:
    global _shared
    if _shared is not None:
        _shared.cleanup()
        _shared = None


@pytest.fixture(scope="session")
def live_server(request):
    """One server for every module that imports this fixture (each import is its own fixture
    definition to pytest, hence the module-level singleton). Tests that submit runs use
    ``clean_queue`` so that each starts on an idle host."""
    global _shared
    if _shared is None:
        _shared = LocalServer(virtual_gpus="24000,24000", cpu_slots=8, extra_args=FAST_SERVER_ARGS, gpu_processes=True)
        request.addfinalizer(_stop_shared)
    return _shared


@pytest.fixture
def client(live_server) -> EvalSchedClient:
    return live_server.client()


@pytest.fixture
def ip(live_server, monkeypatch, tmp_path):
    """An IPython shell (IPython's test app, one per process) with ``%load_ext jupyter_evalsched``,
    pointed at the live server, in a fresh working directory."""
    from IPython.testing import globalipapp

    monkeypatch.setenv("EVALSCHED_URL", live_server.url)
    monkeypatch.setenv("EVALSCHED_TOKEN", live_server.token)
    monkeypatch.chdir(tmp_path)
    globalipapp.start_ipython()  # once per process; later calls are no-ops
    shell = globalipapp.get_ipython()
    shell.run_line_magic("load_ext", "jupyter_evalsched")
    yield shell
    shell.run_line_magic("unload_ext", "jupyter_evalsched")


@pytest.fixture
def clean_queue(live_server):
    """Release the leases and cancel the runs a test left, so that the next one starts on an empty host."""
    yield
    c = live_server.client()
    view = c.queue()
    for rec in view.get("leases") or []:
        try:
            c.request("DELETE", f"leases/{rec['id']}")
        except Exception:
            pass
    for rec in view["queued"] + view["running"]:
        try:
            c.cancel(rec["id"])
        except Exception:
            pass
    if live_server.gpu_processes_file:
        write_process_table(live_server.gpu_processes_file, [])
    wait_until(lambda: not (c.queue()["queued"] or c.queue()["running"] or c.queue()["leases"]), timeout=15)


def wait_state(client: EvalSchedClient, run_id: str, states=TERMINAL_STATES, timeout: float = 20.0) -> dict:
    holder = {}

    def reached():
        holder["rec"] = client.get(run_id)
        return reached_state(holder["rec"], states)

    wait_until(reached, timeout, message=f"run {run_id} did not reach {sorted(states)} in {timeout} s")
    return holder["rec"]


# The CLI as a terminal runs it, whatever this test runner inherited: a job started in the
# background by a non-interactive shell ignores SIGINT, and so would the CLI it starts (Python
# installs its Ctrl-C handler only where SIGINT is at its default).
_INTERRUPTIBLE_CLI = (
    "import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
    "sys.argv = ['jupyter-evalsched', *sys.argv[1:]]; runpy.run_module('jupyter_evalsched.cli', run_name='__main__')"
)


def interruptible_cli(*args: str) -> list[str]:
    """The argv of ``jupyter-evalsched args...`` that a SIGINT interrupts, as Ctrl-C would."""
    return [sys.executable, "-c", _INTERRUPTIBLE_CLI, *args]


def cli_env(live_server: LocalServer | None, **extra: str) -> dict[str, str]:
    """The environment of a CLI subprocess: this session's, less what names another server (or the
    kernel's parent), plus ``live_server``'s (None: none) and ``extra``, the repository first on
    the path."""
    env = {k: v for k, v in os.environ.items() if k not in ("EVALSCHED_URL", "EVALSCHED_TOKEN", "JPY_PARENT_PID")}
    if live_server is not None:
        env.update(live_server.env)
    env.update(extra)
    env["PYTHONPATH"] = os.pathsep.join([REPO] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    return env


def cli(
    live_server,
    *args: str,
    env: dict | None = None,
    cwd: str | None = None,
    timeout: float = 60,
    with_server: bool = True,
) -> subprocess.CompletedProcess:
    """Run ``jupyter-evalsched`` (``python -m jupyter_evalsched.cli``) as a real subprocess."""
    return subprocess.run(
        [sys.executable, "-m", "jupyter_evalsched.cli", *args],
        env=cli_env(live_server if with_server else None, **(env or {})),
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


# --------------------------------------------------------------------------- runtime files


def server_file(server: LocalServer) -> dict:
    """What ``server``'s runtime file (``jpserver-PID.json``) says."""
    (path,) = glob.glob(os.path.join(server._tmp, "runtime", "jpserver-*.json"))
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def runtime_dir(path: Path, *infos: dict, newest_first: bool) -> Path:
    """``path`` made a runtime directory listing ``infos`` as ``jpserver-PID.json`` files, 100 s
    apart: the first the newest (``newest_first``) or the oldest."""
    path.mkdir(parents=True, exist_ok=True)
    for age, info in enumerate(infos if newest_first else reversed(infos)):
        file = path / f"jpserver-{info['pid']}.json"
        file.write_text(json.dumps(info))
        os.utime(file, (1_700_000_000 - age * 100, 1_700_000_000 - age * 100))
    return path
