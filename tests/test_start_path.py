"""What the way from admission to a run's start reads and skips: a run's create time read without
psutil (what the zygote reports of each process it forks), the spec of a fresh submission kept
from its spec.json write to its first start; and, at a warm run's end, its exit code read before
its zygote reaps it."""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys

import psutil
import pytest

from jupyter_evalsched.runner._proc import process_start_time
from jupyter_evalsched.scheduler import runs as runs_module
from jupyter_evalsched.scheduler.launcher import is_same_process, process_create_time, zombie_exit_code
from jupyter_evalsched.scheduler.runs import RunTable
from jupyter_evalsched.store import RunFileError, RunStore, new_run_id


def test_process_start_time_is_psutils_create_time():
    for pid in (1, os.getpid()):
        assert process_start_time(pid) == pytest.approx(psutil.Process(pid).create_time(), abs=0.01)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        created = process_create_time(child.pid)
        assert created == pytest.approx(psutil.Process(child.pid).create_time(), abs=0.01)
        assert is_same_process(child.pid, created)
    finally:
        child.kill()
        child.wait()
    assert process_start_time(child.pid) is None  # reaped: gone
    assert process_create_time(child.pid) is None


def _store_with_run(tmp_path, spec: dict) -> tuple[RunStore, str]:
    store = RunStore(tmp_path / "runs")
    store.ensure()
    run_id = new_run_id()
    store.create(run_id, {"spec.json": json.dumps(spec).encode(), "job.json": b"{}"})
    return store, run_id


class _Run:  # full_spec reads the id alone
    def __init__(self, run_id: str) -> None:
        self.id = run_id


def test_a_fresh_spec_is_used_once_then_spec_json_is_read(tmp_path):
    store, run_id = _store_with_run(tmp_path, {"on": "disk"})
    table = RunTable(store)
    kept = {"as": "submitted"}
    table.remember_spec(run_id, kept, 20)
    assert table.full_spec(_Run(run_id)) is kept  # the first start: no read
    assert table.full_spec(_Run(run_id)) == {"on": "disk"}  # a later attempt: the file
    (store.run_dir(run_id) / "spec.json").write_text("[]")
    with pytest.raises(RunFileError):
        table.full_spec(_Run(run_id))


def test_only_the_latest_small_specs_are_kept(tmp_path, monkeypatch):
    monkeypatch.setattr(runs_module, "FRESH_SPECS", 3)
    store, run_id = _store_with_run(tmp_path, {"on": "disk"})
    table = RunTable(store)
    table.remember_spec(run_id, {"big": True}, runs_module.FRESH_SPEC_MAX_BYTES + 1)
    assert table.full_spec(_Run(run_id)) == {"on": "disk"}
    table.remember_spec(run_id, {"kept": 0}, 10)
    for i in range(3):  # three newer ones push it out
        table.remember_spec(f"other-{i}", {"kept": i + 1}, 10)
    assert table.full_spec(_Run(run_id)) == {"on": "disk"}
    table.remember_spec(run_id, {"kept": "again"}, 10)
    table.remove(run_id)  # a deleted run's spec goes with it
    assert table.full_spec(_Run(run_id)) == {"on": "disk"}


def test_zombie_exit_code_reads_another_process_child_only_until_it_is_reaped():
    """A forked run is the zygote's child, not the server's: the server reads its exit code from
    /proc while the zygote has not reaped it, and the pidfd proves the read was of that process."""
    helper = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import os, sys\n"
            "r, w = os.pipe()\n"
            "pid = os.fork()\n"
            "if pid == 0:\n"
            "    os.read(r, 1)\n"  # alive until told
            "    os._exit(7)\n"
            "print(pid, flush=True)\n"
            "sys.stdin.readline(); os.write(w, b'x')\n"  # exit now
            "sys.stdin.readline(); os.waitpid(pid, 0); print('reaped', flush=True)\n"  # reap now
            "sys.stdin.readline()\n",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert helper.stdout is not None and helper.stdin is not None
        child = int(helper.stdout.readline())
        pidfd = os.pidfd_open(child)
        try:
            assert zombie_exit_code(child, pidfd) is None  # alive
            helper.stdin.write("\n")
            helper.stdin.flush()
            assert select.select([pidfd], [], [], 30)[0], "the child did not exit"
            assert zombie_exit_code(child, pidfd) == 7  # exited, not reaped: read
            helper.stdin.write("\n")
            helper.stdin.flush()
            assert helper.stdout.readline().strip() == "reaped"
            assert zombie_exit_code(child, pidfd) is None  # reaped: whatever has its pid now, not read
        finally:
            os.close(pidfd)
    finally:
        helper.kill()
        helper.wait()
