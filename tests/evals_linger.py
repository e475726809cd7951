"""Evals for a run's word that it is done (``runner.run.finish``): processes that stay after it,
and one that says it without being done."""

from __future__ import annotations

import os
import stat
import time


def linger(ctx, index):
    """One quick episode; the process then stays ``linger_s`` after its ``_DONE`` (and its word),
    as a process whose teardown is slow would (``os._exit`` delayed in this process only)."""
    seconds = float(ctx.params["linger_s"])
    real_exit = os._exit

    def late_exit(code):
        time.sleep(seconds)
        real_exit(code)

    os._exit = late_exit
    return {"x": 1.0}


def say_done_early(ctx, index):
    """Writes the runner's word on every socket this process holds, mid-run, then works on."""
    _write_word()
    time.sleep(float(ctx.params["sleep_s"]))
    return {"x": 1.0}


def child_says_done(ctx, index):
    """Forks a child that ends before the run does: ``how`` "exit" leaves through the runner (a
    ``SystemExit`` in the child finalizes it as the run, ``_DONE`` and all); "word" makes
    ``_DONE`` and writes the runner's word itself. The run works on for ``sleep_s``."""
    pid = os.fork()
    if pid == 0:
        if ctx.params["how"] == "exit":
            raise SystemExit(0)
        open(os.path.join(ctx.run_dir, "_DONE"), "w").close()
        _write_word()
        os._exit(0)
    os.waitpid(pid, 0)
    time.sleep(float(ctx.params["sleep_s"]))
    return {"x": 1.0}


def _write_word():
    for name in os.listdir("/proc/self/fd"):
        try:
            fd = int(name)
            if stat.S_ISSOCK(os.fstat(fd).st_mode):
                os.write(fd, b'{"op":"done"}')
        except OSError:
            pass
