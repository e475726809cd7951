"""Evals for tests/test_cgroup_ahead.py: what a run sees of its cgroup at its first instruction."""

from __future__ import annotations

import json
import os


def where_am_i(ctx, index):
    """At its top, before anything else: ``/proc/self/cgroup``, its pid, whether that pid is listed
    in each of its cgroups (``params["parents"]``: hierarchy -> the namespace directory) and the
    memory limit the kernel holds for it there; written to ``params["out"]``."""
    with open("/proc/self/cgroup") as f:
        lines = f.read().splitlines()
    pid = os.getpid()
    out = {"pid": pid, "lines": lines, "leaf": {}, "listed": {}, "limit": None}
    for key, ns_dir in ctx.params["parents"].items():
        controller = "" if key in ("v2", "unified") else key
        path = next((line.split(":", 2)[2] for line in lines if line.split(":", 2)[1] == controller), "")
        parent, leaf = os.path.split(path)
        out["leaf"][key] = leaf if os.path.basename(parent) == os.path.basename(ns_dir) else None
        try:
            with open(os.path.join(ns_dir, leaf, "cgroup.procs")) as f:
                out["listed"][key] = pid in {int(p) for p in f.read().split()}
        except OSError:
            out["listed"][key] = False
        if key == "memory":
            with open(os.path.join(ns_dir, leaf, "memory.limit_in_bytes")) as f:
                out["limit"] = int(f.read())
    with open(ctx.params["out"], "w") as f:
        json.dump(out, f)
    return {}
