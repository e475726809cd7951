"""Evals for the observed-usage tests (#15), run as file entrypoints (``<this file>:gate`` ...).
Standard library only."""

import os
import time


def gate(ctx, index):
    """Write this process's pid to ``params["pid_file"]``, then wait (up to 60 s) for the file
    ``params["gate"]`` to exist: the test decides when the run ends, and it ends succeeded."""
    pid_file = ctx.params.get("pid_file")
    if pid_file:
        with open(pid_file + ".tmp", "w") as f:
            f.write(str(os.getpid()))
        os.replace(pid_file + ".tmp", pid_file)
    deadline = time.monotonic() + 60
    while not os.path.exists(ctx.params["gate"]):
        if time.monotonic() > deadline:
            raise TimeoutError("the gate never opened")
        time.sleep(0.01)
    return {"ok": 1}


def escape(ctx, index):
    """Double-fork a grandchild that calls setsid(), clears its environment and sleeps; write its
    pid to ``params["pid_file"]``, then sleep until cancelled."""
    read_end, write_end = os.pipe()
    child = os.fork()
    if child == 0:
        os.close(read_end)
        os.setsid()
        grandchild = os.fork()
        if grandchild == 0:
            os.write(write_end, str(os.getpid()).encode())
            os.close(write_end)
            os.execve("/bin/sleep", ["sleep", "300"], {})
        os._exit(0)
    os.close(write_end)
    os.waitpid(child, 0)
    pid = os.read(read_end, 64).decode()
    os.close(read_end)
    with open(ctx.params["pid_file"] + ".tmp", "w") as f:
        f.write(pid)
    os.replace(ctx.params["pid_file"] + ".tmp", ctx.params["pid_file"])
    time.sleep(300)
    return {}


def hog(ctx, index):
    """Touch ``params["mb"]`` MB of memory, a megabyte at a time."""
    chunks = []
    for _ in range(int(ctx.params["mb"])):
        chunks.append(bytearray(1024 * 1024))
        chunks[-1][::4096] = b"x" * len(chunks[-1][::4096])
    return {"mb": len(chunks)}
