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
    """Double-fork a grandchild that calls setsid(), clears its environment (``params["keep_env"]``:
    keeps it) and sleeps; write its pid to ``params["pid_file"]``, then sleep until cancelled."""
    env = dict(os.environ) if ctx.params.get("keep_env") else {}
    read_end, write_end = os.pipe()
    child = os.fork()
    if child == 0:
        os.close(read_end)
        os.setsid()
        grandchild = os.fork()
        if grandchild == 0:
            # The pipe is closed by the exec itself (close-on-exec): its end of file tells the
            # parent that the grandchild is sleep, its environment cleared, not about to be.
            os.write(write_end, str(os.getpid()).encode())
            os.execve("/bin/sleep", ["sleep", "300"], env)
        os._exit(0)
    os.close(write_end)
    os.waitpid(child, 0)
    pid = b""
    while chunk := os.read(read_end, 64):
        pid += chunk
    pid = pid.decode()
    os.close(read_end)
    with open(ctx.params["pid_file"] + ".tmp", "w") as f:
        f.write(pid)
    os.replace(ctx.params["pid_file"] + ".tmp", ctx.params["pid_file"])
    time.sleep(300)
    return {}


def hog(ctx, index):
    """Touch ``params["mb"]`` MB of memory, a megabyte at a time (first writing the run's
    ``/proc/self/cgroup`` to ``params["cgroup_file"]`` when given)."""
    if ctx.params.get("cgroup_file"):
        with open("/proc/self/cgroup") as f, open(ctx.params["cgroup_file"], "w") as out:
            out.write(f.read())
    chunks = []
    for _ in range(int(ctx.params["mb"])):
        chunks.append(bytearray(1024 * 1024))
        chunks[-1][::4096] = b"x" * len(chunks[-1][::4096])
    return {"mb": len(chunks)}


def leave(ctx, index):
    """Leave the run's cgroup: write this process's pid to each file of ``params["procs"]`` (the
    server's own cgroup.procs, one per hierarchy), then fork a child that calls setsid() and a
    grandchild that is orphaned (its parent exits) and calls setsid(); both sleep. Write
    ``{"run": pid, "child": pid, "orphan": pid, "left": [files written]}`` to
    ``params["pid_file"]``, then sleep until cancelled."""
    import json

    left = []
    for procs in ctx.params["procs"]:
        with open(procs, "w") as f:
            f.write(str(os.getpid()))
        left.append(procs)
    read_end, write_end = os.pipe()
    child = os.fork()
    if child == 0:
        os.close(read_end)
        os.setsid()
        os.write(write_end, f"{os.getpid()}\n".encode())
        time.sleep(300)
        os._exit(0)
    middle = os.fork()
    if middle == 0:
        os.close(read_end)
        orphan = os.fork()
        if orphan == 0:
            os.setsid()
            os.write(write_end, f"{os.getpid()}\n".encode())
            time.sleep(300)
        os._exit(0)
    os.close(write_end)
    os.waitpid(middle, 0)
    pids = []
    with os.fdopen(read_end) as f:
        while len(pids) < 2:
            pids.append(int(f.readline()))
    child_pid = child
    orphan_pid = next(p for p in pids if p != child)
    with open(ctx.params["pid_file"] + ".tmp", "w") as f:
        json.dump({"run": os.getpid(), "child": child_pid, "orphan": orphan_pid, "left": left}, f)
    os.replace(ctx.params["pid_file"] + ".tmp", ctx.params["pid_file"])
    time.sleep(300)
    return {}


def stubborn(ctx, index):
    """A run slow to stop: it ignores SIGTERM (a cancel's) from the moment it writes
    ``params["ready"]`` until the test writes ``params["release"]``, then dies of SIGTERM."""
    import signal

    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    open(ctx.params["ready"], "w").close()
    while not os.path.exists(ctx.params["release"]):
        time.sleep(0.02)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)
