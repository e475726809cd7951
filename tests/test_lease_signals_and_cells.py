"""Review fixes of `lease -- CMD`'s Ctrl-C, of the leases a process forgets and of the kernel's
check of %%eval_submit cells, with a real server subprocess, real pseudo-terminals and an IPython
shell: a Ctrl-C at the terminal reaches the command once whatever the CLI's stdin is; a lease
the server no longer knows (404) is forgotten, one whose server does not answer does not hold up
the next lease for the client's timeout; cells the kernel cannot tell about are not refused."""

from __future__ import annotations

import copy
import os
import pty
import select
import signal
import socket
import subprocess
import sys
import time
import types

import pytest
from IPython.core.error import UsageError

import jupyter_evalsched
from jupyter_evalsched.client import EvalSchedError
from jupyter_evalsched.client.lease import lease_path
from jupyter_evalsched.magics import cell_problem
from jupyter_evalsched.scheduler.leases import KEEP_ENDED

try:
    from .live_server import clean_queue, cli_env, client, interruptible_cli, ip, live_server, wait_until
except ImportError:
    from live_server import clean_queue, cli_env, client, interruptible_cli, ip, live_server, wait_until  # noqa: F401


# --------------------------------------------------------------------------- the kernel's cell check


DEEP = ["x = " + "1+" * 200000 + "1\n", "x = " + "-" * 100000 + "1\n"]


@pytest.mark.parametrize("nested", DEEP)
def test_a_cell_too_deeply_nested_is_refused_with_one_line(ip, client, nested):
    cell = "def episode(ctx, index):\n    return {}\n" + nested
    assert cell_problem(cell) == "the cell does not compile: eval.py: too deeply nested to compile"
    before = len(client.list())
    with pytest.raises(UsageError) as refused:
        ip.run_cell_magic("eval_submit", "--episodes 1", cell)
    assert "too deeply nested to compile" in str(refused.value) and "\n" not in str(refused.value)
    assert len(client.list()) == before


@pytest.mark.parametrize(
    "cell",
    [
        "def f(ctx, index):\n    return {}\nglobals()['episode'] = f\n",
        "def f(ctx, index):\n    return {}\nglobals().update(episode=f)\n",
        "def f(ctx, index):\n    return {}\nvars()['episode'] = f\n",
        "exec('def episode(ctx, index):\\n    return {}\\n')\n",
        "import sys\ndef f(ctx, index):\n    return {}\nsetattr(sys.modules[__name__], 'episode', f)\n",
        "import sys\ndef f(ctx, index):\n    return {}\nsys.modules[__name__].__dict__['episode'] = f\n",
        "def f(ctx, index):\n    return {}\ndef __getattr__(name):\n    return f\n",
        "def f(ctx, index):\n    return {}\nmatch f:\n    case episode:\n        pass\n",
        "def f(ctx, index):\n    return {}\nmatch (f, 1):\n    case (episode, *rest):\n        pass\n",
        "def f(ctx, index):\n    return {}\nmatch {'e': f}:\n    case {'e': episode}:\n        pass\n",
    ],
)
def test_cells_that_bind_episode_as_python_does_pass_the_kernels_check(cell, monkeypatch):
    module = types.ModuleType("evalsched_cell_probe")
    monkeypatch.setitem(sys.modules, module.__name__, module)  # as the runner imports eval.py
    exec(compile(cell, "eval.py", "exec"), module.__dict__)  # it works
    assert callable(module.episode)  # (a module __getattr__ included)
    assert cell_problem(cell) is None


def test_a_cell_that_binds_no_episode_is_still_refused():
    # A match pattern binds other names; a method of another object called `modules` is no module's.
    cell = "def f(ctx, index):\n    return {}\nmatch f:\n    case g:\n        pass\nx = [m for m in model.modules()]\n"
    assert "defines no episode(ctx, index)" in (cell_problem(cell) or "")


# --------------------------------------------------------------------------- Ctrl-C at a terminal


def _in_a_terminal(argv: list[str], env: dict) -> tuple[int, int]:
    """Start ``argv`` as a terminal session's foreground job (a new pseudo-terminal, its
    controlling one) with its stdin from /dev/null, as ``... < /dev/null`` typed there: (pid, the
    terminal's master fd)."""
    pid, master = pty.fork()
    if pid == 0:  # pragma: no cover (the child)
        try:
            null = os.open(os.devnull, os.O_RDONLY)
            os.dup2(null, 0)
            os.execve(argv[0], argv, env)
        finally:
            os._exit(127)
    return pid, master


def _drain(master: int, pid: int, until: float) -> tuple[bytes, int | None]:
    """What the terminal shows, until ``pid`` exits (its wait status) or ``until`` passes (None)."""
    shown = b""
    while time.monotonic() < until:
        ready, _, _ = select.select([master], [], [], 0.2)
        if ready:
            try:
                shown += os.read(master, 4096)
            except OSError:  # the terminal's other side is closed: the child is gone
                pass
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return shown, status
    return shown, None


def test_the_terminal_is_told_from_dev_tty_not_from_stdin():
    probe = [sys.executable, "-c", "from jupyter_evalsched.cli import _terminal_signals_it_too as t; print(t())"]
    pid, master = _in_a_terminal(probe, cli_env(None))
    try:
        shown, status = _drain(master, pid, time.monotonic() + 60)
    finally:
        os.close(master)
    assert status == 0 and shown.split() == [b"True"], shown
    # No controlling terminal (a service, setsid): no Ctrl-C comes from one.
    alone = subprocess.run(
        probe, env=cli_env(None), stdin=subprocess.DEVNULL, capture_output=True, start_new_session=True
    )
    assert alone.stdout.split() == [b"False"], alone


# The command notes each SIGINT; a SIGTERM (which the CLI passes on after any SIGINT it passed on:
# Python runs its handlers in signal order) makes it write how many it got and exit 3.
COUNTER = r"""
import os, signal, sys, time
log = sys.argv[1]
got = []
def note(n, _frame):
    got.append(n)
    with open(log, "a") as f:
        f.write(f"SIGINT {len(got)}\n")
def done(n, _frame):
    with open(log, "a") as f:
        f.write(f"SIGTERM after {len(got)}\n")
    os._exit(3)
signal.signal(signal.SIGINT, note)
signal.signal(signal.SIGTERM, done)
with open(log, "a") as f:
    f.write("ready\n")
while True:
    time.sleep(0.1)
"""


def test_a_ctrl_c_at_the_terminal_reaches_the_command_once_with_stdin_redirected(
    live_server, client, clean_queue, tmp_path
):
    log, script = tmp_path / "log", tmp_path / "counter.py"
    script.write_text(COUNTER)
    argv = interruptible_cli("lease", "1000", "--label", "ctrl-c", "--", sys.executable, str(script), str(log))
    pid, master = _in_a_terminal(argv, cli_env(live_server))
    try:
        wait_until(lambda: log.exists() and "ready" in log.read_text(), timeout=60, message="the command to start")
        os.write(master, b"\x03")  # Ctrl-C at the terminal: SIGINT to its foreground job, CLI and command
        wait_until(lambda: "SIGINT 1" in log.read_text(), timeout=30, message="the command's SIGINT")
        os.kill(pid, signal.SIGTERM)  # passed on after any SIGINT the CLI passed on
        shown, status = _drain(master, pid, time.monotonic() + 60)
        assert status is not None and os.WIFEXITED(status) and os.WEXITSTATUS(status) == 3, shown
        assert log.read_text().splitlines()[1:] == ["SIGINT 1", "SIGTERM after 1"], log.read_text()
        assert not [x for x in client.request("GET", "leases")["leases"] if x["label"] == "ctrl-c"]
    finally:
        os.close(master)
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except (OSError, ChildProcessError):
            pass


# --------------------------------------------------------------------------- leases a process forgets


def test_a_lease_the_server_pruned_is_forgotten(live_server, client, clean_queue, cuda_env):
    a = jupyter_evalsched.lease(1000, label="pruned", client=client, progress=False)
    client.request("DELETE", lease_path(a.id))  # ended elsewhere, this process not told
    for _ in range(KEEP_ENDED):  # then as many newer ended leases as the server keeps
        rec = client.request("POST", "leases", body={"vram_mb": 1, "label": "churn", "pid": os.getpid()})
        client.request("DELETE", lease_path(rec["id"]))
    with pytest.raises(EvalSchedError) as gone:
        client.request("GET", lease_path(a.id))
    assert gone.value.status == 404
    b = jupyter_evalsched.lease(1000, label="after", client=client, progress=False)
    try:
        # a's GPU is no longer among those this process sees: b's is cuda:0.
        assert os.environ["CUDA_VISIBLE_DEVICES"] == str(b.devices[0]) and b.cuda_device == "cuda:0"
    finally:
        b.release()
    assert "CUDA_VISIBLE_DEVICES" not in os.environ  # a forgotten: no lease of this process is left
    assert a.state == "ended"
    a.release()  # (nothing to end: no 404 from the server)


def test_a_lease_whose_server_does_not_answer_does_not_hold_up_the_next(live_server, client, clean_queue, cuda_env):
    silent = socket.socket()  # accepts connections (the kernel's backlog), never answers
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    mute = copy.copy(client)
    mute.base_url = f"http://127.0.0.1:{silent.getsockname()[1]}/"
    mute.timeout = 120.0  # the client's own timeout: lease() must not wait that long per held lease
    a = jupyter_evalsched.lease(1000, label="mute", client=client, progress=False)
    a.client = mute
    try:
        started = time.monotonic()
        b = jupyter_evalsched.lease(1000, label="next", client=client, progress=False)
        waited = time.monotonic() - started
        try:
            assert waited < mute.timeout / 2, waited
            # Unsure whether a ended: it is kept, its GPU still visible before b's.
            kept = dict.fromkeys([a.devices[0], b.devices[0]])  # (one GPU once)
            assert os.environ["CUDA_VISIBLE_DEVICES"] == ",".join(map(str, kept))
        finally:
            b.release()
    finally:
        a.client = client
        a.release()
        silent.close()
    assert "CUDA_VISIBLE_DEVICES" not in os.environ
