"""Shared fixtures: a real Jupyter server (pytest-jupyter) with the extension and virtual GPUs.

The suite runs as root, with pytest's temporary directories where it puts them (under /tmp): the
host ledgers some tests start in process keep their socket in one, and a ledger refuses a
directory that another user may change, or one below such a directory (``--basetemp`` in a
group-writable place would fail them)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from slurm_jobs import log_messages, scancel_left  # noqa: F401 (the SLURM tests' fixtures)
from waiting import async_wait_until, reached_state

from jupyter_evalsched.scheduler.gpus import write_process_table

pytest_plugins = ("pytest_jupyter.jupyter_server",)

VIRTUAL_GPUS = [24000, 24000]


@pytest.fixture
def evalsched_config():
    """Override in a test module to change the extension's traitlets."""
    return {}


@pytest.fixture
def runs_dir(tmp_path):
    path = tmp_path / "runs"
    return path


@pytest.fixture
def gpu_processes_file(tmp_path):
    """The virtual GPU process table the test server's probe reads (absent until a test plants)."""
    return tmp_path / "gpu_processes.json"


@pytest.fixture
def plant_gpu_processes(gpu_processes_file):
    """``plant([{"pid": ..., "gpu": 0, "used_mb": 5000}, ...])``: what the virtual probe reports
    from its next sweep on, as NVML would report processes holding VRAM."""

    def plant(entries: list[dict]) -> None:
        write_process_table(str(gpu_processes_file), entries)

    return plant


@pytest.fixture
def gpu_source():
    """What runs' records say observed their VRAM: the probe's ``source`` (test_nvml_server: "nvml")."""
    return "virtual"


@pytest.fixture
def jp_server_config(runs_dir, evalsched_config, gpu_processes_file):
    cfg = {
        "runs_dir": str(runs_dir),
        "virtual_gpus": VIRTUAL_GPUS,
        "virtual_gpu_processes": str(gpu_processes_file),
        "cpu_slots": 8,
        "cancel_grace_s": 2.0,
        "reconcile_interval_s": 0.5,
        "progress_interval_s": 0.05,
        # Off in this process, which hosts hundreds of servers one after another: each start's
        # full collection would scan the whole test session (test_startup_freeze.py turns it on;
        # the servers started as subprocesses keep the default).
        "freeze_startup_objects": False,
    }
    cfg.update(evalsched_config)
    return {
        "ServerApp": {"jpserver_extensions": {"jupyter_evalsched": True}},
        "EvalSchedApp": cfg,
    }


@pytest.fixture
def evalsched(jp_serverapp, jp_asyncio_loop):
    """The extension's scheduler, started. pytest-jupyter never runs the server's IO loop
    start-up hook, so the extensions' async start is driven here, on the test's loop."""
    jp_asyncio_loop.run_until_complete(jp_serverapp.extension_manager.start_all_extensions())
    point = jp_serverapp.extension_manager.extension_points["jupyter_evalsched"]
    return point.app.scheduler


@pytest.fixture
def api(jp_fetch, evalsched):
    """JSON helper over jp_fetch: ``await api("POST", "runs", body)`` -> (status, parsed body)."""

    async def call(method: str, path: str, body=None, params=None, raw: bool = False, timeout: float | None = None):
        kwargs = {"method": method, "raise_error": False}
        if timeout is not None:  # the client's own limit (tornado's default: 20 s)
            kwargs["request_timeout"] = timeout
        if body is not None:
            kwargs["body"] = body if isinstance(body, (str, bytes)) else json.dumps(body)
        elif method in ("POST", "PUT", "PATCH"):
            kwargs["body"] = b""
        if params:
            kwargs["params"] = params
        resp = await jp_fetch("evalsched", *path.split("/"), **kwargs)
        text = resp.body.decode() if resp.body else ""
        if raw:
            return resp.code, text
        return resp.code, (json.loads(text) if text else None)

    return call


@pytest.fixture
def wait_for(api):
    """``await wait_for(run_id, states=...)``: the run's record once its state is one of
    ``states`` (by default: any terminal state)."""

    async def wait(run_id: str, states=("succeeded", "failed", "cancelled", "aborted"), timeout: float = 30.0):
        answer: dict = {}

        async def settled() -> bool:
            answer["code"], answer["rec"] = await api("GET", f"runs/{run_id}")
            return answer["code"] != 200 or reached_state(answer["rec"], states)

        try:
            await async_wait_until(settled, timeout=timeout)
        except AssertionError:
            rec = answer.get("rec") or {}
            raise AssertionError(
                f"run {run_id} still {rec.get('state')} ({rec.get('reason')}) after {timeout}s"
            ) from None
        assert answer["code"] == 200, answer["rec"]
        return answer["rec"]

    return wait


@pytest.fixture
def holder():
    """Start a process that stands for a notebook kernel; killed at the end."""
    procs: list[subprocess.Popen] = []

    def start(*argv: str, env: dict | None = None) -> subprocess.Popen:
        cmd = list(argv) or [sys.executable, "-c", "import time; time.sleep(300)"]
        proc = subprocess.Popen(cmd, env={**os.environ, **(env or {})})
        procs.append(proc)
        return proc

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# ----------------------------------------------------------------------------- the host ledger
# (tests/test_host_*.py, test_jupyterhub.py): real system users, made once per session (CI runs
# as root), and a host ledger served by its own unprivileged user on virtual GPUs. A test module
# parametrizes ``ledger_config`` for another policy.


@pytest.fixture(scope="session")
def users():
    from host_ledger_users import make_users

    return make_users()


@pytest.fixture
def ledger_config():
    return {"virtual_gpus": [24000], "reclaim_window_s": 0}


@pytest.fixture
def ledger(users, ledger_config):
    from host_ledger_users import Ledger

    served = Ledger(users["ledger"], ledger_config)
    served.start()
    yield served
    served.stop()


@pytest.fixture
def agents(users, ledger):
    """``agents("alice")`` (a role of ``users``, or a ``pwd`` entry): a client of ``ledger`` run
    as that user, connected; all stopped at the test's end."""
    from host_ledger_users import Agent

    made = []

    def make(role):
        user = users[role] if isinstance(role, str) else role
        agent = Agent(user, ledger.socket)
        made.append(agent)
        hello = agent.ok("connect")
        assert hello["user"] == user.pw_name and hello["uid"] == user.pw_uid
        return agent

    yield make
    for agent in made:
        agent.stop()


# --------------------------------------------------------------------------- leases in this process


def _forget_leases_held() -> None:
    """Forget every lease ``jupyter_evalsched.client.lease`` counts as held by this process, and
    what CUDA_VISIBLE_DEVICES was before the first (a test that left one would otherwise shape
    the next test's variable, or have its own variable put back over the next test's)."""
    from jupyter_evalsched.client import lease

    with lease._held_lock:
        lease._held.clear()
        lease._saved_env = None


@pytest.fixture
def cuda_env(monkeypatch):
    """For tests of ``lease()``, which sets CUDA_VISIBLE_DEVICES and CUDA_DEVICE_ORDER in this
    process: both unset and no lease counted as held, before and after (setenv first, so that the
    undo restores what was there, absence included)."""
    for name in ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER"):
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    _forget_leases_held()
    yield
    _forget_leases_held()  # before monkeypatch puts the variables back
