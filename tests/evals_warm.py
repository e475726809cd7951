"""Evals for the warm-start tests (#17), run as file entrypoints (``<this file>:fingerprint``).
The standard library, and psutil (as the server sees a process)."""

import json
import os
import random
import signal
import sys
import threading

import psutil


def fingerprint(ctx, index):
    """What a run's process looks like to the eval, written to ``params["out"]``."""
    fds = sorted(int(fd) for fd in os.listdir("/proc/self/fd"))
    handlers = {
        name: str(signal.getsignal(getattr(signal, name))) for name in ("SIGINT", "SIGTERM", "SIGCHLD", "SIGPIPE")
    }
    umask = os.umask(0)
    os.umask(umask)
    with open("/proc/self/environ", "rb") as f:
        block = f.read()
    import ctypes

    getenv = ctypes.CDLL(None).getenv
    getenv.restype = ctypes.c_char_p
    getenv.argtypes = [ctypes.c_char_p]
    out = {
        "environ": dict(os.environ),
        "proc_environ": dict(e.decode().split("=", 1) for e in block.split(b"\0") if e),
        # What C code reads (getenv) where it differs from os.environ: nothing, warm or cold.
        "c_getenv_differs": sorted(os.fsdecode(k) for k, v in os.environb.items() if getenv(k) != v),
        "cwd": os.getcwd(),
        "argv": list(sys.argv),
        "path": list(sys.path),
        "random": random.random(),
        "fds": fds,
        "tasks": len(os.listdir("/proc/self/task")),
        "threads": threading.active_count(),
        "handlers": handlers,
        "umask": umask,
        "stdin": os.readlink("/proc/self/fd/0"),
        "sid_is_pid": os.getsid(0) == os.getpid(),
        "main_module": getattr(sys.modules["__main__"], "__spec__", None) is not None,
        "pid": os.getpid(),
        "create_time": psutil.Process().create_time(),  # what the record's pid_create_time must be
    }
    with open(ctx.params["out"], "w") as f:
        json.dump(out, f)
    return {"ok": 1}


def read_value(ctx, index):
    """The VALUE of the module named ``params["module"]`` (preloaded, or imported now)."""
    module = __import__(ctx.params["module"])
    return {"value": float(module.VALUE)}


def escape_fork_only(ctx, index):
    """Fork a child that leaves the run's process group and session (setsid) and sleeps, without
    exec: only its (inherited) environment in /proc says whose it is. Its pid goes to
    ``params["pid_file"]``; the run then ends."""
    read_end, write_end = os.pipe()
    child = os.fork()
    if child == 0:
        os.setsid()
        os.write(write_end, b"x")
        import time

        time.sleep(300)
        os._exit(0)
    os.read(read_end, 1)
    with open(ctx.params["pid_file"], "w") as f:
        f.write(str(child))
    return {"child": child}


def numpy_state(ctx, index):
    """numpy's global generator and a BLAS product (its thread pool) in the run."""
    import numpy

    a = numpy.arange(40000, dtype=float).reshape(200, 200)
    return {"random": float(numpy.random.random()), "trace": float(numpy.trace(a @ a))}


_OWN = []  # the run's own temporary directory: finalized at the run's exit


def finalizers(ctx, index):
    """The preloaded ``warm_tempdir``'s directory (the zygote's), and one of the run's own, to
    ``params["out"]``: after the run, the first must still exist and the second must not."""
    import tempfile

    import warm_tempdir

    _OWN.append(tempfile.TemporaryDirectory(prefix="evalsched-run-own-"))
    with open(ctx.params["out"], "w") as f:
        json.dump({"zygotes": warm_tempdir.HELD.name, "own": _OWN[-1].name}, f)
    return {"ok": 1}


def exit_without_finishing(ctx, index):
    """Wait for ``params["path"]`` (``wait_for_path``), then leave with exit code
    ``params["code"]`` before the runner can finalize (or wait there to be killed)."""
    wait_for_path(ctx, index)
    os._exit(ctx.params["code"])


def at_exit_sees(ctx, index):
    """Registers an ``atexit`` handler that writes to ``params["out"]`` whether the run's ``_DONE``
    exists when it runs, and what the final summary says then."""
    import atexit

    def look() -> None:
        with open(os.path.join(ctx.run_dir, "summary.json")) as f:
            status = json.load(f)["status"]
        with open(ctx.params["out"], "w") as f:
            json.dump({"done": os.path.exists(os.path.join(ctx.run_dir, "_DONE")), "status": status}, f)

    atexit.register(look)
    return {"ok": 1}


def wait_for_path(ctx, index):
    """Wait until ``params["path"]`` exists (the test creates it when it is ready), at most 60 s."""
    import time

    deadline = time.monotonic() + 60
    while not os.path.exists(ctx.params["path"]):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{ctx.params['path']} never appeared")
        time.sleep(0.01)
    return {"ok": 1}


def made_after_the_fork(ctx, index):
    """Whether the interpreter's AST node classes were made in this process (they are then among
    the objects the collector tracks) or inherited from the zygote (which froze them: not listed
    by ``gc.get_objects``). An import of ``_ast`` makes them where no ``compile`` did yet."""
    import _ast
    import gc

    made_here = any(o is _ast.FunctionDef for o in gc.get_objects())
    return {"ast_classes_made_here": float(made_here)}
