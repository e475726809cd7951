"""Review fixes of leases, the magics and the queue widget, against a real server subprocess, the
real CLI and an IPython shell: lease ids quoted in URLs, several leases sharing one process's
CUDA_VISIBLE_DEVICES, `lease -- CMD` passing on signals, cells that cannot run refused at
submission, `%eval_release` of the kernel's own leases, and the widget's running rows capped."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
from IPython.core.error import UsageError
from proc_status import alive

import jupyter_evalsched
from jupyter_evalsched.client import EvalSchedClientError, EvalSchedError
from jupyter_evalsched.client.lease import Lease, lease_path, looks_like_lease_id, visible_order
from jupyter_evalsched.magics import cell_problem

try:
    from .live_server import (
        clean_queue,
        cli,
        cli_env,
        client,
        interruptible_cli,
        ip,
        live_server,
        wait_state,
        wait_until,
    )
except ImportError:
    from live_server import (  # noqa: F401
        clean_queue,
        cli,
        cli_env,
        client,
        interruptible_cli,
        ip,
        live_server,
        wait_state,
        wait_until,
    )

NOOP = "jupyter_evalsched.examples.basic:noop"


def _finished_run(client) -> str:
    rid = client.submit({"entrypoint": NOOP, "episodes": 1})["id"]
    wait_state(client, rid)
    return rid


# --------------------------------------------------------------------------- 1. ids in URLs


def test_a_path_like_lease_id_never_reaches_another_resource(live_server, client, clean_queue, ip):
    rid = _finished_run(client)
    proc = cli(live_server, "release", f"../runs/{rid}")
    assert proc.returncode == 2 and "404" in proc.stderr, (proc.stdout, proc.stderr)
    assert client.get(rid)["id"] == rid  # before the fix: DELETE /evalsched/leases/../runs/<id>, the run deleted

    with pytest.raises(EvalSchedError) as caught:
        Lease(client, {"id": f"../runs/{rid}", "state": "granted"}).release()
    assert caught.value.status == 404
    for bad in ("..", ".", ""):
        with pytest.raises(EvalSchedClientError, match="is not a lease id"):
            lease_path(bad)
    assert lease_path("lease-1/2") == "leases/lease-1%2F2"

    with pytest.raises(UsageError) as refused:  # the magic stops the cell with one line
        ip.run_line_magic("eval_release", f"../runs/{rid}")
    assert str(refused.value) == f"eval_release: '../runs/{rid}' is not a lease id (lease-...)", refused.value
    assert client.get(rid)["id"] == rid


def test_eval_release_takes_several_ids(ip, client, clean_queue, capsys):
    held = [client.request("POST", "leases", body={"vram_mb": 1000, "label": f"l{i}"}) for i in range(2)]
    ip.run_line_magic("eval_release", " ".join(f"'{h['id']}'" for h in held))
    out = capsys.readouterr().out.splitlines()
    assert out == [f"lease {h['id']}: released" for h in held], out
    assert [client.request("GET", lease_path(h["id"]))["state"] for h in held] == ["ended", "ended"]


def test_lease_ids_look_like_the_servers():
    assert looks_like_lease_id("lease-20261201T193620.619700-28238d") and looks_like_lease_id("lease-123")
    for bad in ("../runs/x", "lease-", "lease-../x", "runs", "lease-1 2", ""):
        assert not looks_like_lease_id(bad), bad


# --------------------------------------------------------------------------- 2. CUDA_VISIBLE_DEVICES


def test_a_second_lease_keeps_the_first_leases_cuda_device(client, clean_queue, cuda_env):
    a = jupyter_evalsched.lease(14000, label="A", client=client, progress=False)
    b = jupyter_evalsched.lease(14000, label="B", client=client, progress=False)
    try:
        assert a.devices != b.devices  # 24000 MB GPUs: one each
        assert os.environ["CUDA_VISIBLE_DEVICES"] == f"{a.devices[0]},{b.devices[0]}"
        assert os.environ["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
        assert (a.cuda_device, b.cuda_device) == ("cuda:0", "cuda:1")
        a.release()
        # No longer pointing at a released lease's GPU; b renumbered with it.
        assert os.environ["CUDA_VISIBLE_DEVICES"] == str(b.devices[0]) and b.cuda_device == "cuda:0"
    finally:
        a.release(), b.release()
    assert "CUDA_VISIBLE_DEVICES" not in os.environ and "CUDA_DEVICE_ORDER" not in os.environ


def test_the_users_value_comes_back_and_an_ended_lease_is_forgotten(client, clean_queue, cuda_env, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,0")
    a = jupyter_evalsched.lease(14000, label="A", client=client, progress=False)
    assert os.environ["CUDA_VISIBLE_DEVICES"] == str(a.devices[0])
    client.request("DELETE", lease_path(a.id))  # ended elsewhere (as by its ttl): this process was not told
    b = jupyter_evalsched.lease(14000, label="B", client=client, progress=False)
    assert os.environ["CUDA_VISIBLE_DEVICES"] == str(b.devices[0]) and b.cuda_device == "cuda:0"
    b.release()
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "1,0" and "CUDA_DEVICE_ORDER" not in os.environ


def test_visible_order_appends_new_gpus_and_drops_released_ones():
    assert visible_order([], [[1], [0]]) == [1, 0]
    assert visible_order([1, 0], [[1], [0], [0, 2]]) == [1, 0, 2]
    assert visible_order([1, 0, 2], [[0, 2]]) == [0, 2]
    assert visible_order([1], [[1], [1]]) == [1]


# --------------------------------------------------------------------------- 3. lease -- CMD and signals


def _lease_cli(live_server, tmp_path, signum: int) -> tuple[subprocess.Popen, int, str]:
    """`jupyter-evalsched lease 1000 -- python -c ...` whose command wrote its pid: (the CLI, the
    command's pid, the lease id)."""
    pidfile, got = tmp_path / "child.pid", tmp_path / "got"
    # It notes the signal it gets, then dies of it (a SIGKILL, of PR_SET_PDEATHSIG, leaves no note).
    script = (
        "import os, signal, time\n"
        "def note(n, _frame):\n"
        f"    open({str(got)!r}, 'w').write(str(n)); signal.signal(n, signal.SIG_DFL); os.kill(os.getpid(), n)\n"
        "for n in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):\n"
        "    signal.signal(n, note)\n"
        f"open({str(pidfile)!r}, 'w').write(str(os.getpid()))\n"
        "time.sleep(120)\n"
    )
    argv = interruptible_cli("lease", "1000", "--label", f"sig{signum}", "--", sys.executable, "-c", script)
    # No controlling terminal (a session of its own, whatever runs pytest): no Ctrl-C reaches the
    # command from one, the CLI passes SIGINT on.
    proc = subprocess.Popen(
        argv,
        env=cli_env(live_server),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        wait_until(lambda: pidfile.exists() and pidfile.read_text().strip(), timeout=30, message="the command to start")
    except BaseException:
        proc.kill()
        raise
    child = int(pidfile.read_text())
    leases = [x for x in live_server.client().request("GET", "leases")["leases"] if x["pid"] == proc.pid]
    assert len(leases) == 1, leases
    return proc, child, leases[0]["id"]


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT])
def test_a_signal_to_the_cli_ends_the_command_then_the_lease(live_server, client, clean_queue, tmp_path, signum):
    proc, child, lease_id = _lease_cli(live_server, tmp_path, signum)
    try:
        proc.send_signal(signum)
        _out, err = proc.communicate(timeout=30)
        assert not alive(child), "the command runs on, its lease ended"
        assert (tmp_path / "got").read_text() == str(int(signum))  # the command got it itself
        assert proc.returncode == 128 + signum, err
        assert client.request("GET", lease_path(lease_id))["state"] == "ended"
    finally:
        if alive(child):
            os.kill(child, signal.SIGKILL)
        if proc.poll() is None:
            proc.kill()


def test_the_command_dies_with_a_sigkilled_cli(live_server, client, clean_queue, tmp_path):
    proc, child, lease_id = _lease_cli(live_server, tmp_path, signal.SIGKILL)
    try:
        proc.kill()
        proc.communicate(timeout=30)
        wait_until(lambda: not alive(child), timeout=15, message="the command to die with the CLI (PR_SET_PDEATHSIG)")
        wait_until(lambda: client.request("GET", lease_path(lease_id))["state"] == "ended", timeout=15)
    finally:
        if alive(child):
            os.kill(child, signal.SIGKILL)


# --------------------------------------------------------------------------- 4. cells that cannot run


@pytest.mark.parametrize(
    "cell, words",
    [
        ("def episode(ctx, index):\n    return {'score': (1}\n", "eval.py line 2: "),
        ("def episode(ctx, index)\n    return {}\n", "eval.py line 1: "),
        ("return 1\n", "'return' outside function"),
        ("def episod(ctx, index):\n    return {}\n", "defines no episode(ctx, index) at its top level"),
        ("def outer():\n    def episode(ctx, index):\n        return {}\n", "defines no episode(ctx, index)"),
    ],
)
def test_a_cell_that_cannot_run_is_refused_in_the_kernel(ip, client, clean_queue, cell, words):
    before = len(client.list())
    err = []
    for magic, line in (("eval_submit", "--episodes 1"), ("eval_sweep", "--sweep k=1,2")):
        with pytest.raises(UsageError) as refused:  # the magic stops the cell with one line
            ip.run_cell_magic(magic, line, cell)
        err.append(str(refused.value))
    assert err[0].startswith("eval_submit: %%eval_submit: ") and words in err[0] and "\n" not in err[0], err
    assert err[1].startswith("eval_sweep: %%eval_sweep: ") and words in err[1], err
    assert len(client.list()) == before


@pytest.mark.parametrize(
    "cell",
    [
        "def episode(ctx, index):\n    return {}\n",
        "async def episode(ctx, index):\n    return {}\n",
        "import functools\nepisode = functools.partial(lambda ctx, index, k: {}, k=1)\n",
        "from jupyter_evalsched.examples.basic import noop as episode\n",
        "try:\n    import numpy\nexcept ImportError:\n    pass\nif True:\n    def episode(ctx, index):\n        return {}\n",
        "from jupyter_evalsched.examples.basic import *\n",
        "def make():\n    global episode\n    episode = lambda ctx, index: {}\nmake()\n",
        "class episode:\n    def __init__(self, ctx, index):\n        pass\n",
    ],
)
def test_cells_that_bind_episode_pass_the_kernels_check(cell):
    assert cell_problem(cell) is None


def test_the_server_refuses_a_source_that_does_not_compile(client, clean_queue):
    before = len(client.list())
    bad = "import math\n\ndef episode(ctx, index):\n    return {'score': math.sqrt(index)\n"
    for submit in (
        lambda: client.submit({"source": bad, "episodes": 1}),
        lambda: client.submit_sweep({"source": bad, "episodes": 1}, {"k": [1, 2]}),
    ):
        with pytest.raises(EvalSchedError) as caught:
            submit()
        e = caught.value
        assert e.status == 422 and e.detail, e
        detail = [d for d in e.detail if d["loc"] == ["source"]]
        assert len(detail) == 1 and detail[0]["type"] == "syntax_error", e.detail
        assert detail[0]["msg"].startswith("eval.py line 4: ") and "never closed" in detail[0]["msg"], detail
    for bad in ("x = 1\x00\n", "def episode(ctx, index):\n  return {}\n   x = 1\n"):  # a NUL byte, an indent
        with pytest.raises(EvalSchedError) as caught:
            client.submit({"source": bad, "episodes": 1})
        assert [d["type"] for d in caught.value.detail if d["loc"] == ["source"]] == ["syntax_error"], caught.value
    assert len(client.list()) == before
    # Compiled, never run: a source that would fail when run is the run's business.
    runs_and_fails = "raise SystemExit(3)\ndef episode(ctx, index):\n    return {}\n"
    rid = client.submit({"source": runs_and_fails, "episodes": 1})["id"]
    assert wait_state(client, rid)["state"] == "failed"


# --------------------------------------------------------------------------- 5. %eval_release of the kernel's leases


def test_eval_release_ends_the_kernels_leases_and_says_which_had_ended(ip, client, clean_queue, capsys, cuda_env):
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        not_mine = client.request("POST", "leases", body={"vram_mb": 1000, "pid": other.pid, "label": "other"})
        ip.run_cell("import jupyter_evalsched; h = jupyter_evalsched.lease(1000, label='api', progress=False)")
        ended = ip.run_line_magic("eval_lease", "1000 --label magic")
        client.request("DELETE", lease_path(ended.id))  # as its ttl would
        capsys.readouterr()
        ip.run_line_magic("eval_release", "")
        out = sorted(capsys.readouterr().out.splitlines())
        h = ip.user_ns["h"]
        assert out == sorted(
            [f"lease {h.id}: released", f"lease {ended.id}: already ended (released: released through the API)"]
        ), out
        assert h.refresh()["state"] == "ended"
        assert client.request("GET", lease_path(not_mine["id"]))["state"] == "granted"  # another process's
        ip.run_line_magic("eval_release", "")
        assert capsys.readouterr().err.strip() == "eval_release: this kernel holds no lease"
    finally:
        other.kill()
        other.wait()


# --------------------------------------------------------------------------- 6. the widget at scale


class _ViewOnlyClient:
    base_url = "http://view-only/"

    def queue(self, limit=None):
        return {"queued": [], "running": [], "ledger": None}

    def list(self, **kwargs):
        return []

    def models(self):
        return []

    def request(self, *args, **kwargs):
        return {}


def test_the_queue_widget_caps_its_running_rows():
    pytest.importorskip("ipywidgets")
    from jupyter_evalsched.widget import QueueWidget, _RunRow

    running = [
        {
            "id": f"20261207T111100.{i:06d}-abcdef",
            "state": "running",
            "name": f"point {i}",
            "executor": "slurm",
            "slurm_job_id": str(1000 + i),
            "slurm_state": "RUNNING",
            "progress": {"done": 1, "total": 10},
            "started_at": "2026-12-07T11:00:00Z",
        }
        for i in range(2000)
    ]
    widget = QueueWidget(_ViewOnlyClient(), live=False, max_running_rows=30)
    try:
        widget.show_view({"queued": [], "queued_total": 0, "running": running, "ledger": None})
        rows = [c for c in widget._rows_box.children if isinstance(c, _RunRow)]
        assert [r.run_id for r in rows] == [r["id"] for r in running[:30]]
        assert len(widget._rows) == 30
        assert any("… and 1970 more running" in getattr(c, "value", "") for c in widget._rows_box.children)
        assert "2000 running" in widget._header.value and "Running (2000)" in widget._running_title.value
        widget.show_view({"queued": [], "queued_total": 0, "running": running[:10], "ledger": None})
        assert len([c for c in widget._rows_box.children if isinstance(c, _RunRow)]) == 10
        assert not any("more running" in getattr(c, "value", "") for c in widget._rows_box.children)
    finally:
        widget.close()
