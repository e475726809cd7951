"""A user's own ``jupyter server``, started as that system user, joined to a host ledger (issue #32).

:class:`UserServer` is what a user on a shared GPU host runs (``jupyter lab`` on a workstation,
a spawned single-user server): a real ``jupyter server`` subprocess as that user, with the
extension and ``EVALSCHED_HOST_LEDGER`` naming the host ledger's socket, in a directory of its own
that the user owns. The test, as root, talks to it over its REST API with its token.
"""

from __future__ import annotations

import json
import os
import pwd
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
from typing import Any

from host_ledger_users import as_user
from waiting import wait_until

# Fast timings for tests (as tests/live_server.py); the defaults suit production.
FAST_ARGS = [
    "--EvalSchedApp.cancel_grace_s=2.0",
    "--EvalSchedApp.reconcile_interval_s=0.5",
    "--EvalSchedApp.progress_interval_s=0.2",
]


class UserServer:
    """``jupyter server`` as ``pw``, a tenant of the host ledger at ``socket``."""

    def __init__(self, pw: pwd.struct_passwd, socket: str, virtual_gpus: str, cpu_slots: int = 8) -> None:
        self.pw = pw
        self.name = pw.pw_name
        self.dir = tempfile.mkdtemp(prefix=f"evhl-{pw.pw_name}-", dir="/tmp")
        os.chown(self.dir, pw.pw_uid, pw.pw_gid)
        os.chmod(self.dir, 0o700)
        self.runtime_dir = os.path.join(self.dir, "runtime")
        self.root_dir = os.path.join(self.dir, "root")
        self.runs_dir = os.path.join(self.dir, "runs")
        config_dir = os.path.join(self.dir, "config")
        for folder in (self.root_dir, config_dir):
            os.makedirs(folder)
            os.chown(folder, pw.pw_uid, pw.pw_gid)
        self.token = secrets.token_hex(16)
        self.log_path = os.path.join(self.dir, "server.log")
        kw = as_user(
            pw,
            [
                sys.executable,
                "-m",
                "jupyter_server",
                "--no-browser",
                "--ip=127.0.0.1",
                "--ServerApp.port=0",
                "--ServerApp.port_retries=0",
                f"--IdentityProvider.token={self.token}",
                f"--ServerApp.root_dir={self.root_dir}",
                "--ServerApp.jpserver_extensions={'jupyter_evalsched': True}",
                *FAST_ARGS,
            ],
        )
        kw["env"].update(
            {
                "JUPYTER_RUNTIME_DIR": self.runtime_dir,
                "JUPYTER_CONFIG_DIR": config_dir,
                "EVALSCHED_RUNS_DIR": self.runs_dir,
                "EVALSCHED_HOST_LEDGER": socket,
                "EVALSCHED_VIRTUAL_GPUS": virtual_gpus,
                "EVALSCHED_CPU_SLOTS": str(cpu_slots),
                "PYTHONUNBUFFERED": "1",
            }
        )
        kw["cwd"] = self.root_dir
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                kw.pop("args"), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, **kw
            )
        try:
            self.url = wait_until(self._ready, timeout=90, message=f"{self.name}'s server never answered")
        except BaseException:
            self.stop()
            raise

    def _ready(self) -> str | None:
        assert self.proc.poll() is None, f"{self.name}'s server exited: {self.log_tail()}"
        try:
            with open(os.path.join(self.runtime_dir, f"jpserver-{self.proc.pid}.json"), encoding="utf-8") as f:
                info = json.load(f)
        except (OSError, ValueError):
            return None
        url = info["url"].rstrip("/") + "/"
        try:
            # Not /status, which answers while the scheduler still reads its runs directory: a
            # request that recovery holds back (503 until then), so that the first submission is taken.
            code, _ = _call(url, self.token, "GET", "evalsched/runs")
        except OSError:
            return None
        return url if code == 200 else None

    def log_tail(self, lines: int = 40) -> str:
        try:
            with open(self.log_path, encoding="utf-8", errors="replace") as f:
                return "".join(f.readlines()[-lines:])
        except OSError:
            return ""

    def api(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        """``/evalsched/<path>`` as this user (its token): (status, JSON)."""
        return _call(self.url, self.token, method, f"evalsched/{path}", body)

    def ok(self, method: str, path: str, body: Any = None, expect: int = 200) -> Any:
        code, answer = self.api(method, path, body)
        assert code == expect, (self.name, method, path, code, answer)
        return answer

    def submit(self, body: dict) -> dict:
        return self.ok("POST", "runs", body, expect=201)

    def connected(self) -> dict:
        def up():
            status = self.ok("GET", "status")["host_ledger"]
            return status if status["connected"] else None

        return wait_until(up, timeout=30, message=f"{self.name}'s server never joined the host ledger")

    def kill9(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.kill9()

    def cleanup(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


def _call(base: str, token: str, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(base + path, data=data, method=method)
    request.add_header("Authorization", f"token {token}")
    if data is not None:
        request.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            raw = response.read()
            return response.status, json.loads(raw) if raw else None
    except urllib.error.HTTPError as exc:
        raw = exc.read()
        try:
            return exc.code, json.loads(raw)
        except ValueError:
            return exc.code, raw.decode(errors="replace")


def sleepy(vram_mb: int, sleep_s: float, **fields: Any) -> dict:
    """A run of ``sleep_s`` seconds that asks ``vram_mb`` on one GPU."""
    return {
        "entrypoint": "jupyter_evalsched.examples.basic:sleepy",
        "episodes": 1,
        "params": {"sleep_s": sleep_s},
        "scheduling": {"marginal_vram_mb": vram_mb},
        **fields,
    }
