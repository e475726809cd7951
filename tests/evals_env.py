"""Evals for the warm-environment tests (issue #30): what a run sees of its time zone, its
environment and the random generators a preloaded module made. File entrypoints."""

import json
import os
import time


def clock_and_env(ctx, index):
    """The run's zone, ``MY_FLAG`` and two draws of the preload ``warm_iter`` (when preloaded or
    importable), written to ``params["out"]``."""
    local = time.localtime(1_700_000_000)
    out = {
        "tzname": list(time.tzname),
        "timezone": time.timezone,
        "gmtoff": local.tm_gmtoff,
        "strftime": time.strftime("%Z %z", local),
        "flag": os.environ.get("MY_FLAG"),
    }
    try:
        import warm_iter

        out["draws"] = warm_iter.draw()
    except ImportError:
        pass
    with open(ctx.params["out"], "w") as f:
        json.dump(out, f)
    return {"ok": 1}
