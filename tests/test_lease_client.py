"""Leases, shared models and observed usage from the client side (#14, #15): the Python API, the
magics and the CLI against a real server subprocess, and a real kernel through nbclient."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading

import nbformat
import pytest
from IPython.core.error import UsageError
from nbclient import NotebookClient

import jupyter_evalsched
from jupyter_evalsched.client import EvalSchedError, LocalServer
from jupyter_evalsched.client.lease import LeaseTimeout
from jupyter_evalsched.scheduler.gpus import write_process_table

try:
    from .live_server import SLEEPY, clean_queue, cli, client, ip, live_server, wait_state, wait_until
except ImportError:
    from live_server import SLEEPY, clean_queue, cli, client, ip, live_server, wait_state, wait_until  # noqa: F401


def test_lease_as_a_context_manager_points_cuda_at_the_leased_gpu(client, clean_queue, cuda_env):
    with jupyter_evalsched.lease(14000, label="ctx", client=client) as held:
        assert held.state == "granted" and held.devices in ([0], [1])
        assert os.environ["CUDA_VISIBLE_DEVICES"] == str(held.devices[0]) and held.cuda_device == "cuda:0"
        assert os.environ["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
        assert held.record["pid"] == os.getpid()
        ledger = client.ledger()
        assert [x["label"] for d in ledger["devices"] for x in d["leases"]] == ["ctx"]
    assert client.request("GET", f"leases/{held.id}")["reason"].startswith("released")


def test_a_waiting_lease_times_out_or_is_interrupted_and_is_withdrawn(client, clean_queue, cuda_env):
    blocker = jupyter_evalsched.lease(exclusive_gpu=True, gpus=2, label="blocker", client=client)
    with pytest.raises(LeaseTimeout, match="was not granted within 0.3 s"):
        jupyter_evalsched.lease(1000, timeout=0.3, progress=False, client=client)
    assert [x["label"] for x in client.request("GET", "leases")["leases"]] == ["blocker"]

    # Ctrl-C as a terminal or a kernel's interrupt sends it: a real SIGINT to the main thread,
    # which also ends a blocking receive there, handled as Python does by default (whatever
    # handler an earlier test in this process left). `_thread.interrupt_main()` only set a flag,
    # and in full-suite runs on a fresh clone the wait never saw it.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    timer = threading.Timer(0.5, signal.pthread_kill, (threading.get_ident(), signal.SIGINT))
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            jupyter_evalsched.lease(1000, label="interrupted", progress=False, client=client)
    finally:
        timer.join()
        signal.signal(signal.SIGINT, previous)
    assert [x["label"] for x in client.request("GET", "leases")["leases"]] == ["blocker"]
    blocker.release()


def test_lease_magics(ip, live_server, clean_queue, capsys, cuda_env):
    held = ip.run_line_magic("eval_lease", "14000 --gpus 2 --label magic --ttl 600 --out L")
    assert held is not None and ip.user_ns["L"] is held and held.devices == [0, 1]
    out = capsys.readouterr().out
    assert out.startswith(f"lease {held.id}: 14000 MB on GPU 0, 1") and "cuda:0" in out
    assert held.record["ttl_s"] == 600 and held.record["label"] == "magic"
    with pytest.raises(UsageError) as refused:  # never fits: one line, no traceback
        ip.run_line_magic("eval_lease", "30000")
    err = str(refused.value)
    assert err.startswith("eval_lease: 422: vram_mb: can never fit") and "Traceback" not in err, err
    ip.run_line_magic("eval_release", "")
    assert capsys.readouterr().out.strip() == f"lease {held.id}: released"
    ip.run_line_magic("eval_release", "")
    assert capsys.readouterr().err.strip() == "eval_release: this kernel holds no lease"


def test_cli_lease_runs_a_command_under_the_lease_and_lists_leases(live_server, clean_queue):
    script = (
        "import json, os, urllib.request; "
        "print(json.dumps({'cuda': os.environ['CUDA_VISIBLE_DEVICES'], 'lease': os.environ['EVALSCHED_LEASE']}))"
    )
    proc = cli(live_server, "lease", "8000", "--label", "from a terminal", "--", sys.executable, "-c", script)
    assert proc.returncode == 0, proc.stderr
    seen = json.loads(proc.stdout)
    assert seen["cuda"] in ("0", "1") and seen["lease"].startswith("lease-")
    c = live_server.client()
    ended = c.request("GET", f"leases/{seen['lease']}")
    assert ended["state"] == "ended" and ended["label"] == "from a terminal"

    held = c.request("POST", "leases", body={"vram_mb": 2000, "label": "listed"})
    proc = cli(live_server, "leases")
    assert proc.returncode == 0 and held["id"] in proc.stdout and "listed" in proc.stdout, proc.stdout
    proc = cli(live_server, "queue")
    assert "LEASES (1)" in proc.stdout and "leases: listed:2000" in proc.stdout, proc.stdout
    proc = cli(live_server, "release", held["id"])
    assert proc.returncode == 0 and "ended" in proc.stdout and "released" in proc.stdout
    proc = cli(live_server, "release", "lease-nosuch")
    assert proc.returncode == 2 and "404" in proc.stderr


def test_cli_status_shows_observed_usage_and_warnings(live_server, clean_queue, tmp_path):
    c = live_server.client()
    rec = c.submit(
        {"entrypoint": SLEEPY, "episodes": 400, "params": {"sleep_s": 0.05}, "scheduling": {"marginal_vram_mb": 4000}}
    )
    rec = wait_until(lambda: (lambda r: r if r["pid"] else None)(c.get(rec["id"])), timeout=15)
    write_process_table(
        live_server.gpu_processes_file, [{"pid": rec["pid"], "gpu": rec["devices"][0], "used_mb": 6000}]
    )
    wait_until(lambda: c.get(rec["id"])["warnings"], timeout=15)
    proc = cli(live_server, "status", rec["id"])
    assert proc.returncode == 0, proc.stderr
    gpu = rec["devices"][0]
    assert f"peak VRAM GPU {gpu}: 6000 MB" in proc.stdout, proc.stdout
    assert f"over_vram: used 6000 MB on GPU {gpu}, declared 4000 MB" in proc.stdout
    c.cancel(rec["id"])


def test_cli_doctor_says_what_is_in_force(live_server):
    proc = cli(live_server, "doctor", "--json")
    assert proc.returncode in (0, 1), proc.stderr  # 1: something degraded (e.g. no byte code)
    checks = {item["name"]: item for item in json.loads(proc.stdout)}
    assert checks["server"]["status"] == "ok"
    assert checks["gpus"]["status"] == "ok" and "2 virtual GPU(s) of 24000, 24000 MB" in checks["gpus"]["detail"]
    assert checks["cgroups"]["status"] == "ok", checks["cgroups"]
    assert checks["scheduler"]["status"] == "ok" and live_server.runs_dir in checks["scheduler"]["detail"]
    assert {"ledger", "enforcement", "slurm", "runner", "runs disk"} <= set(checks)
    text = cli(live_server, "doctor")
    assert text.stdout.splitlines()[0].startswith("OK        server")


def test_cli_doctor_without_a_server_checks_the_host(live_server, tmp_path):
    proc = cli(live_server, "doctor", with_server=False, env={"JUPYTER_RUNTIME_DIR": str(tmp_path)})
    assert proc.returncode == 2, proc.stdout
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("ERROR     server")
    assert any(line.startswith("OK        cgroups") for line in lines), proc.stdout


def test_submit_with_vram_auto_without_history_says_what_to_do(live_server, tmp_path):
    # An eval of its own: no earlier run of it, whatever else ran on the shared server.
    (tmp_path / "fresh_eval.py").write_text("def episode(ctx, index):\n    return {}\n")
    proc = cli(live_server, "submit", "fresh_eval.py:episode", "--vram", "auto", cwd=str(tmp_path))
    assert proc.returncode == 2
    assert "'auto' needs an earlier succeeded run" in proc.stderr and "declare a number" in proc.stderr
    proc = cli(live_server, "submit", SLEEPY, "--vram", "lots")
    assert proc.returncode == 2 and "expected a number of MB or 'auto'" in proc.stderr


def test_model_of_an_unknown_name_is_a_clear_error(client):
    with pytest.raises(EvalSchedError, match="404: unknown shared model 'nope'"):
        jupyter_evalsched.model("nope", client=client)


# --------------------------------------------------------------------------- a real kernel (nbclient)

SHOUT = {"name": "shout", "loader": "jupyter_evalsched.shared_models.testing:upper", "max_wait_ms": 5}

EVAL = """
def episode(ctx, index):
    return {"ok": float(ctx.model("shout")(["run"]) == ["RUN"])}
"""


def test_a_notebook_kernel_uses_the_model_runs_use_without_a_second_load(tmp_path, monkeypatch):
    with LocalServer(virtual_gpus="24000", models=[SHOUT]) as server:
        for key, value in server.env.items():
            monkeypatch.setenv(key, value)
        monkeypatch.delenv("JPY_PARENT_PID", raising=False)
        c = server.client()
        runs = [c.submit({"source": EVAL, "episodes": 5, "models": ["shout"]}) for _ in range(2)]
        nb = nbformat.v4.new_notebook(
            cells=[
                nbformat.v4.new_code_cell(
                    "import jupyter_evalsched\n"
                    "shout = jupyter_evalsched.model('shout')\n"
                    "assert shout(['from', 'a', 'notebook']) == ['FROM', 'A', 'NOTEBOOK']\n"
                    "assert jupyter_evalsched.model('shout') is shout  # one client per kernel"
                ),
            ]
        )
        NotebookClient(nb, timeout=120, kernel_name="python3").execute()
        for run in runs:
            assert wait_state(c, run["id"], timeout=60)["state"] == "succeeded"
        shout = next(m for m in c.models() if m["name"] == "shout")
        assert shout["load_count"] == 1 and shout["requests"] >= 11, shout
