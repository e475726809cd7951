"""Run directories written by hand, as the server would write them, for the runner and SLURM tests."""

from __future__ import annotations


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
