"""Evals that put a FIFO, a symbolic link or a directory where the server opens a file of their
run directory (test_hostile_paths.py), run as file entrypoints (``<this file>:plant``). Standard
library only.

``params``: ``names`` (the run-directory entries to replace), ``kind`` (``fifo``, ``symlink``,
``dir``), ``link_to`` (what a symlink points at: a FIFO outside the run directory, so that a
server that followed it would block too), ``then`` (``exit0``, ``exit1``, ``wait``: wait until
killed, up to 60 s), ``attempts`` (plant in these attempts only; others succeed at once).
"""

import os
import shutil
import time


def place(path, kind, link_to):
    """Replace whatever is at ``path`` with a FIFO, a link to ``link_to`` or a directory."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.unlink(path)
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "symlink":
        os.symlink(link_to, path)
    else:
        os.mkdir(path)
        with open(os.path.join(path, "inside"), "w") as f:
            f.write("x")


def plant(ctx, index):
    if ctx.attempt not in ctx.params.get("attempts", [ctx.attempt]):
        return {"ok": 1}
    for name in ctx.params["names"]:
        place(os.path.join(ctx.run_dir, name), ctx.params["kind"], ctx.params["link_to"])
    then = ctx.params["then"]
    if then == "wait":
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            time.sleep(0.05)
        raise TimeoutError("never stopped")
    os._exit(0 if then == "exit0" else 1)
