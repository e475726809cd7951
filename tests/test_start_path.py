"""What the way from admission to a run's start reads and skips: a run's create time read without
psutil (what the zygote reports of each process it forks), and the spec of a fresh submission
kept from its spec.json write to its first start."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import psutil
import pytest

from jupyter_evalsched.runner._proc import process_start_time
from jupyter_evalsched.scheduler import runs as runs_module
from jupyter_evalsched.scheduler.launcher import is_same_process, process_create_time
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
