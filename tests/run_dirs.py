"""Run directories written by hand, as the server would write them, for the runner and SLURM tests."""

from __future__ import annotations

import json
import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def runner_env(**extra: str) -> dict[str, str]:
    """The environment a runner started by a test gets: this session's, less what belongs to
    the launcher (the runner must flush on its own), the repository first on the path."""
    env = dict(os.environ)
    for name in ("PYTHONUNBUFFERED", "EVALSCHED_PARENT_PID", "EVALSCHED_DEVICES", "COVERAGE_PROCESS_START"):
        env.pop(name, None)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
    env.update(extra)
    return env


def filled_spec(**fields) -> dict:
    """A ``spec.json`` as the server writes it: every field present, defaults filled in.
    ``scheduling`` given here is merged over the defaults."""
    spec = {
        "name": None,
        "entrypoint": None,
        "source": None,
        "episodes": 1,
        "params": {},
        "workers": 1,
        "seed": 0,
        "models": [],
        "env": {},
        "cwd": None,
        "timeout_s": None,
        "depends_on": [],
        "scheduling": {"marginal_vram_mb": 0, "gpus": 1, "exclusive_gpu": False, "priority": "normal", "cpus": 1},
    }
    scheduling = fields.pop("scheduling", {})
    spec.update(fields)
    spec["scheduling"].update(scheduling)
    if spec["entrypoint"] is None and spec["source"] is not None:
        spec["entrypoint"] = "eval.py:episode"
    if spec["name"] is None:
        spec["name"] = spec["entrypoint"].rpartition(":")[2]
    return spec


def write_run_dir(run_dir: Path, run_id: str, pid: int | None, pid_create_time: float | None, **extra) -> None:
    """A run directory as a server leaves it (``spec.json``, ``job.json``): by default running
    as ``pid``; ``extra`` overrides record fields (``entrypoint`` goes to the spec)."""
    run_dir.mkdir(parents=True)
    spec = {
        "entrypoint": extra.pop("entrypoint", "x:y"),
        "episodes": extra.get("progress", {}).get("total", 1),
        "cwd": "/",
        # The spec is where a run's scheduling is read from (the record repeats it for readers).
        "scheduling": {k: extra[k] for k in ("marginal_vram_mb", "priority") if k in extra},
    }
    if extra.get("detach"):
        spec["detach"] = True
    (run_dir / "spec.json").write_text(json.dumps(spec))
    record = {
        "id": run_id,
        "name": "x",
        "state": "running",
        "reason": None,
        "priority": "normal",
        "submitted_at": "2026-01-01T00:00:00.000000+00:00",
        "started_at": "2026-01-01T00:00:01.000000+00:00",
        "finished_at": None,
        "pid": pid,
        "pid_create_time": pid_create_time,
        "devices": [],
        "exit_code": None,
        "progress": {"done": 0, "total": 1},
        "marginal_vram_mb": 0,
        "depends_on": [],
        "seq": 1,
    }
    record.update(extra)
    (run_dir / "job.json").write_text(json.dumps(record))
