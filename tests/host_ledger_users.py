"""Real users, a real host ledger and real tenants for the host ledger's tests (issue #32).

``users()`` makes three system users with useradd (once per machine: names unlikely to clash);
:class:`Ledger` runs ``jupyter evalsched host-ledger`` as the unprivileged one on virtual GPUs;
:class:`Agent` is a tenant (tests/host_ledger_agent.py) started as another user.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from waiting import wait_until

from jupyter_evalsched.host_ledger.client import status
from jupyter_evalsched.scheduler.gpus import write_process_table

REPO = Path(__file__).resolve().parents[1]
AGENT = REPO / "tests" / "host_ledger_agent.py"
ROLES = ("ledger", "alice", "bob")
PREFIX = "evhl32_"


def make_users() -> dict[str, pwd.struct_passwd]:
    # (This project's machines and CI run as root, with useradd: a skip here would prove nothing.)
    assert os.geteuid() == 0, "these tests start processes as other users: run them as root"
    # The venv's python lives under /root/.pyenv: other users must be able to pass through /root
    # (a throwaway machine's /root is 0700).
    os.chmod("/root", os.stat("/root").st_mode | 0o001)
    out = {}
    for role in ROLES:
        name = PREFIX + role
        try:
            out[role] = pwd.getpwnam(name)
        except KeyError:
            assert shutil.which("useradd"), "these tests make users with useradd"
            subprocess.run(["useradd", "-m", name], check=True, capture_output=True)
            out[role] = pwd.getpwnam(name)
    check = as_user(out["alice"], [sys.executable, "-c", "import jupyter_evalsched.host_ledger.client"])
    proc = subprocess.run(check.pop("args"), capture_output=True, text=True, timeout=60, **check)
    assert proc.returncode == 0, f"another user cannot import the package (site-packages, PYTHONPATH): {proc.stderr}"
    return out


def as_user(pw: pwd.struct_passwd, args: list[str]) -> dict:
    """Popen keyword arguments that run ``args`` as ``pw``."""
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": pw.pw_dir, "PYTHONPATH": str(REPO), "LANG": "C.UTF-8"}
    return {"args": args, "user": pw.pw_uid, "group": pw.pw_gid, "extra_groups": [], "cwd": "/", "env": env}


class Ledger:
    """A host ledger served by the ledger user, in a directory of its own (as RuntimeDirectory=)."""

    def __init__(self, pw: pwd.struct_passwd, config: dict) -> None:
        self.pw = pw
        self.dir = tempfile.mkdtemp(prefix="evhl-", dir="/tmp")
        os.chmod(self.dir, 0o755)
        os.chown(self.dir, pw.pw_uid, pw.pw_gid)
        self.socket = os.path.join(self.dir, "ledger.sock")
        self.config = os.path.join(self.dir, "config.json")
        self.state_file = f"{self.socket}.state.json"
        self.processes_table = os.path.join(self.dir, "gpu_processes.json")  # absent: no processes
        with open(self.config, "w", encoding="utf-8") as f:
            json.dump({"virtual_gpu_processes": self.processes_table, **config}, f)
        os.chmod(self.config, 0o644)
        self.proc: subprocess.Popen | None = None
        self.log = os.path.join(self.dir, "ledger.log")

    def popen(self, open_files: tuple[int, int] | None = None) -> subprocess.Popen:
        """``jupyter evalsched host-ledger`` on this socket and policy, as the ledger user (its
        stdout a pipe, its log the ledger's); ``open_files``: its RLIMIT_NOFILE (soft, hard) as
        it starts, as a unit's LimitNOFILE= would set it."""
        args = [sys.executable, "-m", "jupyter_evalsched.cli", "host-ledger", "--socket", self.socket]
        if open_files is not None:
            assert shutil.which("prlimit"), "this test starts the ledger under prlimit (util-linux): install it"
            args = ["prlimit", f"--nofile={open_files[0]}:{open_files[1]}", "--", *args]
        kw = as_user(self.pw, [*args, "--config", self.config])
        with open(self.log, "a") as log:
            return subprocess.Popen(kw.pop("args"), stdout=subprocess.PIPE, stderr=log, text=True, **kw)

    def start(self, open_files: tuple[int, int] | None = None) -> None:
        self.proc = self.popen(open_files)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()  # the ready event (or nothing: it failed)
        assert '"ready"' in line, f"the host ledger did not start: {Path(self.log).read_text()[-2000:]}"

    def kill9(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill9()
        shutil.rmtree(self.dir, ignore_errors=True)

    def plant(self, entries: list[dict]) -> None:
        """What the virtual probe reports from the next sweep on, as NVML would."""
        write_process_table(self.processes_table, entries)
        os.chmod(self.processes_table, 0o644)

    def view(self) -> dict:
        """The whole view (the tests run as root, an admin)."""
        return status(self.socket)


class Agent:
    """A tenant started as a user; commands answer asynchronously, by tag."""

    def __init__(self, pw: pwd.struct_passwd, socket: str) -> None:
        self.pw = pw
        kw = as_user(pw, [sys.executable, str(AGENT), socket])
        self.proc = subprocess.Popen(
            kw.pop("args"), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw
        )
        self.results: dict[int, dict] = {}
        self.cond = threading.Condition()
        self.tags = 0
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            message = json.loads(line)
            with self.cond:
                self.results[message["tag"]] = message
                self.cond.notify_all()

    def send(self, do: str, **fields) -> int:
        self.tags += 1
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"tag": self.tags, "do": do, **fields}) + "\n")
        self.proc.stdin.flush()
        return self.tags

    def done(self, tag: int) -> bool:
        with self.cond:
            return tag in self.results

    def result(self, tag: int, timeout: float = 10.0) -> dict:
        with self.cond:
            if not self.cond.wait_for(lambda: tag in self.results, timeout):
                stderr = ""
                if self.proc.poll() is not None and self.proc.stderr is not None:
                    stderr = self.proc.stderr.read()
                raise AssertionError(f"{self.pw.pw_name}'s agent did not answer command {tag} in {timeout} s {stderr}")
            return self.results[tag]

    def call(self, do: str, timeout: float = 10.0, **fields) -> dict:
        return self.result(self.send(do, **fields), timeout)

    def ok(self, do: str, **fields):
        answer = self.call(do, **fields)
        assert "result" in answer, answer
        return answer["result"]

    def kill9(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)


def grant_ids(view: dict, user: str | None = None) -> set[str]:
    return {g["id"] for g in view["grants"] if user is None or g["user"] == user}


def assert_never_over(view: dict) -> None:
    """No GPU granted past its usable VRAM, and the grants add up to what each GPU shows."""
    for dev in view["devices"]:
        held = [g for g in view["grants"] if dev["index"] in g["devices"]]
        total = sum(dev["usable_mb"] if g["exclusive"] else g["vram_mb"] for g in held)
        assert total == dev["allocated_mb"], (dev, held)
        assert dev["allocated_mb"] + dev["unmanaged_mb"] <= dev["usable_mb"], dev


def wait_for_view(ledger: Ledger, predicate, timeout: float = 10.0) -> dict:
    return wait_until(lambda: (lambda v: v if predicate(v) else None)(ledger.view()), timeout=timeout)
