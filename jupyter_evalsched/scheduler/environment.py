"""The environment a run process starts with: the server's, the host's ``run_env``, the spec's
``env``, then the variables that tie the run to this scheduler (docs/reference.md,
"Environment variables")."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence


def run_environment(
    run_id: str,
    *layers: Mapping[str, str],
    devices: Sequence[int] | None,
    parent_pid: int | None,
    fsync: bool,
    base: Mapping[str, str] | None = None,
    attempt: int = 1,
    detach: bool = False,
) -> dict[str, str]:
    """``base`` (the server's environment) updated by each layer, then the run's own variables.

    ``devices`` None: the devices are not ours to give (SLURM sets them from its allocation).
    ``parent_pid`` None: the run's parent is not this server (SLURM's step daemon), so the runner
    must not check it. ``detach``: the run arms no death signal (it outlives the server).
    """
    env = dict(os.environ if base is None else base)
    for layer in layers:
        env.update(layer)
    if devices is not None:
        indices = ",".join(str(d) for d in devices)
        env["CUDA_VISIBLE_DEVICES"] = indices  # "" for a CPU-only run: it sees no GPU
        env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"  # the indices then match NVML's
        env["EVALSCHED_DEVICES"] = indices
    env["EVALSCHED_RUN_ID"] = run_id  # also how clean-up finds a run's escaped descendants
    env.pop("EVALSCHED_PARENT_PID", None)
    env.pop("EVALSCHED_DETACH", None)
    # Set by the launcher for a run that has a cgroup; not one inherited (a server started inside
    # a run), which would name another run's cgroup, or none that exists any more.
    env.pop("EVALSCHED_CGROUP_PROCS", None)
    if detach:
        env["EVALSCHED_DETACH"] = "1"
    elif parent_pid is not None:
        env["EVALSCHED_PARENT_PID"] = str(parent_pid)
    env["EVALSCHED_ATTEMPT"] = str(attempt)
    env["PYTHONUNBUFFERED"] = "1"
    if fsync:
        env["EVALSCHED_FSYNC"] = "1"
    return env
