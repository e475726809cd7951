"""What the kernel says about a process, for conditions the tests wait for (``tests/waiting.py``).

A test that must act only once a process has set a signal's disposition (an eval that ignores
SIGTERM, say) polls ``ignores_signal`` instead of sleeping and hoping the eval got that far. Also
here: a process in a state the kernel shows in an unusual way (``main_thread_exited``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
from waiting import wait_until

from jupyter_evalsched.runner._proc import process_start_time, stat_fields


def alive(pid: int | None) -> bool:
    """Whether ``pid`` is a live process (a zombie, exited but not reaped, is not)."""
    if not pid:
        return False
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


# A process whose main thread exits (libc's pthread_exit; ctypes lets the GIL go first) while
# another thread goes on.
MAIN_THREAD_EXITS = (
    "import ctypes, threading, time; threading.Thread(target=time.sleep, args=(120,)).start(); "
    "ctypes.CDLL(None).pthread_exit(None)"
)


def main_thread_exited(env: dict[str, str], code: str = MAIN_THREAD_EXITS) -> subprocess.Popen:
    """A process (in a session of its own; ``code``, Python, makes it) whose main thread has
    exited while another goes on: its ``/proc/<pid>`` shows a zombie, as for a process that
    ended, though the process runs. Returned once it is so; the caller kills it (killed here if
    it never gets there)."""
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, start_new_session=True)
    try:
        wait_until(lambda: (stat_fields(proc.pid) or [b"?"])[0] == b"Z", timeout=20)
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    return proc


def _status_field(pid: int, name: str) -> str | None:
    """A field of ``/proc/<pid>/status``; None when the process is gone."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key == name:
            return value.strip()
    return None


def ignores_signal(pid: int, sig: int = signal.SIGTERM) -> bool:
    """Whether the process's disposition of ``sig`` is SIG_IGN (the ``SigIgn`` mask); False
    when the process is gone."""
    mask = _status_field(pid, "SigIgn")
    return mask is not None and bool(int(mask, 16) & (1 << (sig - 1)))


class StaleGroup:
    """A process group as a run leaves it (a leader in a session of its own, and a child it
    started), for a restart to find; ``close`` kills what is left of it."""

    CODE = (
        "import subprocess, sys, time; "
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); "
        "print(child.pid, flush=True); time.sleep(120)"
    )

    def __init__(self) -> None:
        self.leader = subprocess.Popen(
            [sys.executable, "-c", self.CODE], stdout=subprocess.PIPE, start_new_session=True
        )
        try:
            assert self.leader.stdout is not None
            self.child = int(self.leader.stdout.readline())  # (the leader's first line)
            self.created = process_start_time(self.leader.pid)
            assert self.created is not None
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        try:
            os.killpg(self.leader.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.leader.wait()
        if self.leader.stdout is not None:
            self.leader.stdout.close()
