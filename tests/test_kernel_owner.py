"""Issue #30 (11): a process of another user with a ``kernel-<id>.json`` argument is not named
as our kernel (nor are the processes below it). Real processes, one started as another user."""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import sys
import uuid

import pytest
from proc_status import alive
from waiting import wait_until

from jupyter_evalsched.scheduler.kernels import identify, kernel_of_process

OTHER = "evsched_other"


@pytest.fixture
def other_user() -> pwd.struct_passwd:
    # (This project's machines and CI run as root, with useradd: a skip here would prove nothing.)
    assert os.geteuid() == 0, "this test starts a process as another user: run the suite as root"
    try:
        return pwd.getpwnam(OTHER)
    except KeyError:
        assert shutil.which("useradd"), "this test makes another user with useradd"
        subprocess.run(["useradd", "-m", OTHER], check=True, capture_output=True)
        return pwd.getpwnam(OTHER)


def fake_kernel(kernel_id: str, **kw) -> subprocess.Popen:
    """A process whose command line names a kernel connection file, as a kernel's does; it starts
    a child below it (what a kernel's GPU work would be)."""
    code = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); time.sleep(60)"
    return subprocess.Popen(["/usr/bin/python3", "-c", code, f"/tmp/kernel-{kernel_id}.json"], **kw)


def children_of(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(p) for p in f.read().split()]


def started_below(pid: int) -> bool:
    """A child is there and has exec'd its own program: between fork and exec, a child's command
    line is still its parent's, kernel file and all, and it would be named as a kernel itself."""
    try:
        children = children_of(pid)
        if not children:
            return False
        with open(f"/proc/{children[0]}/cmdline", "rb") as f:
            return b"kernel-" not in f.read()
    except OSError:
        return False


def test_another_users_process_is_not_our_kernel(other_user):
    theirs_id, ours_id = str(uuid.uuid4()), str(uuid.uuid4())
    theirs = fake_kernel(theirs_id, user=other_user.pw_uid, group=other_user.pw_gid, extra_groups=[], cwd="/")
    ours = fake_kernel(ours_id)
    try:
        wait_until(lambda: started_below(theirs.pid) and started_below(ours.pid), timeout=10)
        assert kernel_of_process(ours.pid).kernel_id == ours_id
        assert kernel_of_process(theirs.pid) is None
        below_theirs, below_ours = children_of(theirs.pid)[0], children_of(ours.pid)[0]
        named = identify([theirs.pid, below_theirs, ours.pid, below_ours])
        assert set(named) == {ours.pid, below_ours}, named
        assert named[below_ours].kernel_id == ours_id and named[below_ours].pid == ours.pid
    finally:
        for proc in (theirs, ours):
            for child in children_of(proc.pid) if alive(proc.pid) else []:
                os.kill(child, 9)
            proc.kill()
            proc.wait()


def test_our_own_processes_are_still_named(tmp_path):
    kernel_id = str(uuid.uuid4())
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", f"kernel-{kernel_id}.json"])
    try:
        wait_until(lambda: kernel_of_process(proc.pid) is not None, timeout=10)
        assert kernel_of_process(proc.pid).kernel_id == kernel_id
    finally:
        proc.kill()
        proc.wait()
