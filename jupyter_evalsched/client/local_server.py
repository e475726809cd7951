""":class:`LocalServer`: a private ``jupyter server`` subprocess with the extension, for the demo,
the tests and the notebooks."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

from .discovery import normalize_base_url, probe_api, read_server_file
from .errors import ServerNotFound
from .rest_client import EvalSchedClient


class LocalServer:
    """A ``jupyter server`` subprocess with the extension enabled, for the demo, tests and notebooks.

    Isolated: its own runtime and runs directories (temporary unless given), a random port, a
    random token (in its private config file, never on its command line), virtual GPUs; ``port``
    and ``token`` given, those (to start a server again where its clients point).
    ``models`` (a list of dicts) goes to ``EvalSchedApp.models`` through the same file. Use it as
    a context manager, or call :meth:`stop`.
    """

    def __init__(
        self,
        *,
        virtual_gpus: str | None = "24000,24000",
        cpu_slots: int | None = 8,
        runs_dir: str | None = None,
        models: list[dict] | None = None,
        env: dict[str, str] | None = None,
        extra_args: list[str] | None = None,
        startup_timeout: float = 60.0,
        log_path: str | None = None,
        gpu_processes: bool = False,
        port: int | None = None,
        token: str | None = None,
    ):
        self._tmp = tempfile.mkdtemp(prefix="evalsched-server-")
        # With ``gpu_processes``, the virtual GPU process table the server reads (as it would NVML):
        # write it with jupyter_evalsched.scheduler.gpus.write_process_table.
        self.gpu_processes_file = os.path.join(self._tmp, "gpu_processes.json") if gpu_processes else None
        self.runs_dir = runs_dir or os.path.join(self._tmp, "runs")
        self.root_dir = os.path.join(self._tmp, "root")
        runtime_dir = os.path.join(self._tmp, "runtime")
        config_dir = self.config_dir = os.path.join(self._tmp, "config")
        for folder in (self.root_dir, config_dir):
            os.makedirs(folder, exist_ok=True)
        os.chmod(config_dir, 0o700)
        # A given port and token: a server started again where clients already point (a restart).
        self.port = port or 0
        self.token = token or secrets.token_hex(16)
        self.log_path = log_path or os.path.join(self._tmp, "server.log")
        # The token goes in a config file of its own (0600, in a 0700 folder), not the command
        # line: /proc/<pid>/cmdline is readable by every user of the host, and the token is the
        # server's whole authentication (kernels, terminals).
        config: dict[str, Any] = {"IdentityProvider": {"token": self.token}}
        if models is not None:
            config["EvalSchedApp"] = {"models": models}
        config_file = os.path.join(config_dir, "jupyter_server_config.json")
        with open(os.open(config_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w", encoding="utf-8") as f:
            json.dump(config, f)

        server_env = self._server_env(runtime_dir, config_dir, virtual_gpus, cpu_slots)
        if self.gpu_processes_file is not None:
            server_env["EVALSCHED_VIRTUAL_GPU_PROCESSES"] = self.gpu_processes_file
        server_env.update(env or {})
        self._log = open(self.log_path, "wb")
        self.process = subprocess.Popen(
            self._command(extra_args or []),
            env=server_env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd=self.root_dir,
        )
        try:
            self.url = self._wait_ready(runtime_dir, startup_timeout)
        except BaseException:
            self.stop()
            raise

    def _server_env(
        self, runtime_dir: str, config_dir: str, virtual_gpus: str | None, cpu_slots: int | None
    ) -> dict[str, str]:
        server_env = dict(os.environ)
        server_env.update(
            {
                "JUPYTER_RUNTIME_DIR": runtime_dir,
                "JUPYTER_CONFIG_DIR": config_dir,  # the user's own config stays out of it
                "EVALSCHED_RUNS_DIR": self.runs_dir,
                "PYTHONUNBUFFERED": "1",
            }
        )
        for var in ("EVALSCHED_URL", "EVALSCHED_TOKEN", "JPY_PARENT_PID"):
            server_env.pop(var, None)
        if virtual_gpus is not None:
            server_env["EVALSCHED_VIRTUAL_GPUS"] = virtual_gpus
        if cpu_slots is not None:
            server_env["EVALSCHED_CPU_SLOTS"] = str(cpu_slots)
        # The server must import the same jupyter_evalsched as this client, installed or not:
        # the folder that holds the package (three levels above this file) goes first.
        pkg_parent = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        server_env["PYTHONPATH"] = os.pathsep.join(
            [pkg_parent] + [p for p in server_env.get("PYTHONPATH", "").split(os.pathsep) if p]
        )
        return server_env

    def _command(self, extra_args: list[str]) -> list[str]:
        return [
            sys.executable,
            "-m",
            "jupyter_server",
            "--no-browser",
            "--ip=127.0.0.1",
            f"--ServerApp.port={self.port}",
            "--ServerApp.port_retries=0",
            f"--ServerApp.root_dir={self.root_dir}",
            "--ServerApp.jpserver_extensions={'jupyter_evalsched': True}",
            *(["--allow-root"] if hasattr(os, "geteuid") and os.geteuid() == 0 else []),
            *extra_args,
        ]

    def _wait_ready(self, runtime_dir: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        info_path = os.path.join(runtime_dir, f"jpserver-{self.process.pid}.json")
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise ServerNotFound(
                    f"jupyter server exited with code {self.process.returncode} "
                    f"before answering; its log: {self.log_path}\n{self.log_tail()}"
                )
            info = read_server_file(info_path)
            if info is not None and probe_api(normalize_base_url(info["url"]), self.token, timeout=1.0):
                return normalize_base_url(info["url"])
            time.sleep(0.1)
        raise ServerNotFound(
            f"jupyter server did not answer /evalsched/ within {timeout:g} s; "
            f"its log: {self.log_path}\n{self.log_tail()}"
        )

    def log_tail(self, lines: int = 30) -> str:
        try:
            with open(self.log_path, encoding="utf-8", errors="replace") as f:
                return "".join(f.readlines()[-lines:])
        except OSError:
            return ""

    def client(self, **kwargs: Any) -> EvalSchedClient:
        return EvalSchedClient(self.url, self.token, **kwargs)

    @property
    def env(self) -> dict[str, str]:
        """What a kernel or a CLI subprocess needs to find this server."""
        return {"EVALSCHED_URL": self.url, "EVALSCHED_TOKEN": self.token}

    def stop(self, timeout: float = 15.0) -> None:
        proc = getattr(self, "process", None)
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        log = getattr(self, "_log", None)
        if log is not None and not log.closed:
            log.close()

    def cleanup(self) -> None:
        """Stop, then remove the temporary directory (runs included, unless given)."""
        self.stop()
        shutil.rmtree(self._tmp, ignore_errors=True)

    def __enter__(self) -> LocalServer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.cleanup()
