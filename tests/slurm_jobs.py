"""The SLURM tests' own helpers (a real single-node SLURM: the daemons of
scripts/start_slurm.sh): runs that last, servers that poll often, what SLURM holds of a runs
directory's runs, the jobs a test leaves scancel'd, commands that wrap the real ones, and the
evalsched log's messages (``scancel_left`` and ``log_messages``: fixtures, conftest.py's)."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from live_server import wait_until

from jupyter_evalsched.client import LocalServer

SLEEPY = "jupyter_evalsched.examples.basic:sleepy"
TERMINAL = ("succeeded", "failed", "cancelled", "aborted")
FAST = ["--EvalSchedApp.reconcile_interval_s=0.5", "--EvalSchedApp.progress_interval_s=0.1"]
LIVE_JOB_STATES = ("PENDING", "RUNNING", "CONFIGURING", "SUSPENDED")
# The real commands, whatever a test puts first on PATH (its fakes).
SQUEUE, SCANCEL, SBATCH = (shutil.which(name) or name for name in ("squeue", "scancel", "sbatch"))


def long_run(**kw):
    """A SLURM run that lasts far longer than any test (it ends by scancel)."""
    return {"entrypoint": SLEEPY, "episodes": 1000, "params": {"sleep_s": 1}, "cwd": "/", "executor": "slurm", **kw}


def server(runs: Path, *extra: str) -> LocalServer:
    return LocalServer(
        virtual_gpus="24000", runs_dir=str(runs), env={"EVALSCHED_SLURM": "1"}, extra_args=[*FAST, *extra]
    )


def jobs_of(runs: Path) -> dict[str, list[tuple[str, str]]]:
    """What SLURM has of the runs under ``runs``, found by their job script: run id -> [(job id,
    state)], whatever the server recorded."""
    out = subprocess.run(
        [SQUEUE, "--noheader", "--states=all", f"--user={os.getuid()}", "--Format=JobID:|,State:|,Command:|"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    found: dict[str, list[tuple[str, str]]] = {}
    for line in out.splitlines():
        job_id, state, command = (line.split("|") + ["", "", ""])[:3]
        path = Path(command.strip())
        if path.name == "slurm.sbatch" and path.parent.parent == runs:
            found.setdefault(path.parent.name, []).append((job_id.strip(), state.strip()))
    return found


@pytest.fixture
def scancel_left(tmp_path):
    """SLURM jobs outlive the server: whatever a test left of its runs' jobs is scancel'd, and the
    jobs it made itself (``made``)."""
    made: list[str] = []
    yield made
    live = list(made)
    for jobs in jobs_of(tmp_path / "runs").values():
        live += [job for job, state in jobs if state in LIVE_JOB_STATES]
    if live:
        subprocess.run([SCANCEL, *live], check=False)


def final(client, run_id, timeout=120):
    return wait_until(lambda: (lambda r: r if r["state"] in TERMINAL else None)(client.get(run_id)), timeout)


def submitted_then_stopped(runs: Path, *extra: str, running: bool = False) -> tuple[str, str]:
    """A SLURM run handed over by a server that then stopped: (run id, job id)."""
    with server(runs, *extra) as srv:
        c = srv.client()
        rec = c.submit(long_run())
        job_id = wait_until(lambda: c.get(rec["id"])["slurm_job_id"], timeout=60)
        if running:
            wait_until(lambda: c.get(rec["id"])["state"] == "running", timeout=60)
    return rec["id"], job_id


def edit_record(runs: Path, run_id: str, **fields) -> dict:
    job_file = runs / run_id / "job.json"
    record = json.loads(job_file.read_text())
    record.update(fields)
    job_file.write_text(json.dumps(record))
    return record


def unrecorded(runs: Path, run_id: str) -> dict:
    """The record as it was before ``sbatch`` answered (the server stopped, or died, meanwhile)."""
    return edit_record(
        runs, run_id, state="queued", slurm_job_id=None, slurm_state=None, started_at=None, reason=None, why=None
    )


def sbatch(*args: str) -> str:
    out = subprocess.run([SBATCH, "--parsable", *args], capture_output=True, text=True, check=True).stdout
    return out.strip().split(";")[0]


GATED = """#!/bin/sh
# The real {name}; {what} waits for the gate (the test opens it once the stop stopped waiting).
case "$*" in *{marker}*) while [ ! -e "{here}/gate" ]; do sleep 0.01; done ;; esac
exec {real} "$@"
"""

FAILING = """#!/bin/sh
# The real {name}, except that {what} fails as with slurmctld down.
case "$*" in *{marker}*) echo "slurm_load_jobs error: Unable to contact slurm controller" >&2; exit 1 ;; esac
exec {real} "$@"
"""


def fake_command(directory: Path, template: str, name: str, marker: str, what: str) -> None:
    directory.mkdir(exist_ok=True)
    path = directory / name
    path.write_text(template.format(name=name, marker=marker, what=what, here=directory, real=shutil.which(name)))
    path.chmod(0o755)


class _Log(logging.Handler):
    """The evalsched log's messages; opens ``gate`` when the stop says it stopped waiting."""

    def __init__(self, gate: Path | None = None) -> None:
        super().__init__()
        self.gate = gate
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        self.messages.append(message)
        if self.gate is not None and "did not answer within" in message:
            self.gate.touch()


@pytest.fixture
def log_messages():
    handler = _Log()
    logging.getLogger("jupyter_evalsched").addHandler(handler)
    yield handler
    logging.getLogger("jupyter_evalsched").removeHandler(handler)
