"""The Python client and the CLI against a real server subprocess (see live_server.py)."""

from __future__ import annotations

import json
import os
import threading
import time

import pytest

from jupyter_evalsched.client import (
    EvalSchedClient,
    EvalSchedError,
    RunHandle,
    ServerNotFound,
    SpecError,
    WaitTimeout,
    apply_spec_options,
    load_spec_file,
    parse_param,
)

try:
    from .live_server import (
        CRASH,
        SLEEPY,
        clean_queue,
        cli,
        cli_env,
        client,
        interruptible_cli,
        live_server,
        wait_state,
        wait_until,
    )
except ImportError:
    from live_server import (  # noqa: F401
        CRASH,
        SLEEPY,
        clean_queue,
        cli,
        cli_env,
        client,
        interruptible_cli,
        live_server,
        wait_state,
        wait_until,
    )


def _sleepy(name: str, vram: int = 0, sleep_s: float = 0.05, episodes: int = 2, **sched) -> dict:
    return {
        "name": name,
        "entrypoint": SLEEPY,
        "episodes": episodes,
        "params": {"sleep_s": sleep_s},
        "scheduling": {"marginal_vram_mb": vram, **sched},
    }


# --------------------------------------------------------------------------- text output


def test_cli_tables_show_slurm_job_and_state():
    from jupyter_evalsched.cli import format_list, format_queue, format_slurm, format_where

    slurm = {
        "id": "s1",
        "name": "remote",
        "state": "running",
        "priority": "normal",
        "devices": [],
        "marginal_vram_mb": 16000,
        "progress": {"done": 1, "total": 4},
        "started_at": "2026-01-01T00:00:00+00:00",
        "executor": "slurm",
        "slurm_job_id": "123",
        "slurm_state": "RUNNING",
    }
    pending = {
        **slurm,
        "id": "s2",
        "state": "queued",
        "slurm_job_id": "124",
        "slurm_state": "PENDING",
        "reason": "waiting_cpu: SLURM job 124 submitted, not yet scheduled",
    }
    unsubmitted = {**slurm, "id": "s3", "state": "queued", "slurm_job_id": None, "slurm_state": None}
    local = {
        "id": "l1",
        "name": "here",
        "state": "running",
        "priority": "normal",
        "devices": [0, 1],
        "marginal_vram_mb": 8000,
        "progress": {"done": 0, "total": 2},
        "executor": "local",
    }
    assert format_slurm(slurm) == "slurm:123 RUNNING" and format_where(slurm) == "slurm:123 RUNNING"
    assert format_slurm(unsubmitted) == "slurm" and format_slurm(local) == ""
    # GPUs read as GPUs (a bare "0" reads as "no GPU"); a run that takes none is on the CPU.
    assert format_where(local) == "gpu0,gpu1" and format_where({"id": "x"}) == "cpu"
    assert format_where({"id": "q", "marginal_vram_mb": 8000}) == "-"  # queued: no GPU yet

    text = format_queue({"running": [slurm, local], "queued": [pending, unsubmitted], "ledger": None})
    running_row = next(line for line in text.splitlines() if line.startswith("s1 "))
    assert "slurm:123 RUNNING" in running_row and "1/4" in running_row
    assert "gpu0,gpu1" in next(line for line in text.splitlines() if line.startswith("l1 "))
    header = next(line for line in text.splitlines() if line.startswith("#"))
    assert header.split() == ["#", "ID", "NAME", "PRIORITY", "VRAM_MB", "SLURM", "REASON"]
    assert "slurm:124 PENDING" in next(line for line in text.splitlines() if " s2 " in line)

    listed = format_list([slurm, local]).splitlines()
    assert "SLURM" in listed[0].split()
    assert "slurm:123 RUNNING" in listed[1] and listed[2].split()[5] == "-"
    # Without a SLURM run the tables are as before: no SLURM column.
    assert "SLURM" not in format_list([local]) and "SLURM" not in format_queue(
        {"queued": [dict(local, state="queued")]}
    )


def test_tables_show_reasons_whole():
    from jupyter_evalsched.cli import format_list, format_queue

    reason = "waiting_vram: needs 16000 MB on 1 GPU; most free is 14000 MB (GPU 0); " + "lease lease-x holds 1 MB; " * 8
    rec = {"id": "q1", "name": "n" * 100, "state": "queued", "priority": "normal", "reason": reason.strip()}
    for text in (format_queue({"queued": [rec]}), format_list([rec])):
        assert reason.strip() in text, text  # the last column, never cut
        assert "n" * 100 not in text and "…" in text  # other columns still are cut


def test_the_queue_table_counts_the_queued_runs_it_does_not_list():
    from jupyter_evalsched.cli import format_queue

    head = [{"id": f"q{i}", "name": f"n{i}", "state": "queued", "priority": "normal"} for i in range(2)]
    text = format_queue({"queued": head, "queued_total": 12, "running": [], "ledger": None})
    assert "QUEUED (12, in admission order)" in text and "... and 10 more queued (--limit shows more)" in text
    whole = format_queue({"queued": head, "queued_total": 2, "running": [], "ledger": None})
    assert "QUEUED (2, in admission order)" in whole and "more queued" not in whole
    assert "QUEUED (2, in admission order)" in format_queue({"queued": head})  # an older server's view


def test_pending_reasons_are_told_from_why_naming_the_holders():
    import io

    from jupyter_evalsched.cli import format_leases, format_queue
    from jupyter_evalsched.client.formatting import pending_head, pending_text
    from jupyter_evalsched.client.progress import TextProgress
    from jupyter_evalsched.contract import Holder, Why

    why = Why(
        "waiting_vram",
        "needs 16000 MB on 1 GPU; most free is 4000 MB (GPU 0); 20000 MB held by kernel of work/a.ipynb",
        holders=[
            Holder("run", "r1", "train llama", 0, 20000),
            Holder("kernel", "k1", "work/a.ipynb", 1, 20000),
            Holder("process", "4242", "python", 1, 100),
            Holder("lease", "lease-1", None, 1, 50),
        ],
    )
    queued = {"id": "q1", "name": "waits", "state": "queued", "priority": "normal", "reason": why.reason}
    queued["why"] = why.as_dict()
    assert pending_text(queued) == (
        "waiting_vram: behind run train llama (GPU 0, 20000 MB), kernel of work/a.ipynb (GPU 1, 20000 MB), "
        "pid 4242 (python) (GPU 1, 100 MB), 1 more; " + why.detail
    )
    assert pending_head(queued) == "waiting_vram, behind run train llama"
    assert "queued (waiting_vram, behind run train llama)" in TextProgress(stream=io.StringIO()).line(queued)
    row = next(line for line in format_queue({"queued": [queued]}).splitlines() if " q1 " in line)
    assert "behind run train llama (GPU 0, 20000 MB)" in row, row
    preempting = Why("preempting", "stops at its next episode boundary", arg="h", holders=[Holder("run", "h", "high")])
    assert pending_text({"reason": preempting.reason, "why": preempting.as_dict()}).startswith(
        "preempting:h: for run high; stops"
    )
    lease_why = Why("reserved_for", "GPU 0 held for an older job", arg="big", holders=[Holder("run", "big", "Big")])
    lease = {
        "id": "lease-2",
        "state": "queued",
        "vram_mb": 1000,
        "reason": lease_why.reason,
        "why": lease_why.as_dict(),
    }
    assert "reserved_for:big: behind run Big; GPU 0 held" in format_leases([lease])
    # Without a why (an end, or a record of an older server): the reason as it is.
    ended = {"state": "failed", "reason": "exit_code:3: the run process exited", "why": None}
    assert pending_text(ended) == ended["reason"] and pending_text({"reason": None}) == ""
    assert pending_head({"state": "queued", "reason": "waiting_cpu: needs 3 CPU slots"}) == "waiting_cpu"


# --------------------------------------------------------------------------- discovery


@pytest.fixture
def no_env(monkeypatch, tmp_path):
    for var in ("EVALSCHED_URL", "EVALSCHED_TOKEN", "JPY_PARENT_PID"):
        monkeypatch.delenv(var, raising=False)
    runtime = tmp_path / "runtime"
    runtime.mkdir()
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(runtime))
    return runtime


def _server_file(runtime, live_server, pid: int, token: str | None = None):
    info = {
        "url": live_server.url,
        "token": live_server.token if token is None else token,
        "pid": pid,
        "base_url": "/",
        "root_dir": live_server.root_dir,
    }
    (runtime / f"jpserver-{pid}.json").write_text(json.dumps(info))


def test_no_server_is_one_actionable_line(no_env):
    with pytest.raises(ServerNotFound) as err:
        EvalSchedClient()
    text = str(err.value)
    assert "\n" not in text and "EVALSCHED_URL" in text and "EVALSCHED_TOKEN" in text


def test_env_then_explicit_args(no_env, monkeypatch, live_server):
    monkeypatch.setenv("EVALSCHED_URL", live_server.url.rstrip("/"))
    monkeypatch.setenv("EVALSCHED_TOKEN", live_server.token)
    c = EvalSchedClient()
    assert c.base_url == live_server.url and c.queue()["ledger"]["devices"]
    # Explicit arguments win over the environment.
    with pytest.raises(ServerNotFound, match="cannot reach http://127.0.0.1:9/"):
        EvalSchedClient("http://127.0.0.1:9", "x").queue()
    # A token in the URL (as Jupyter prints it) is understood.
    monkeypatch.delenv("EVALSCHED_TOKEN")
    monkeypatch.setenv("EVALSCHED_URL", f"{live_server.url}lab?token={live_server.token}")
    assert EvalSchedClient().token == live_server.token


def test_wrong_token_is_a_readable_403(live_server):
    with pytest.raises(EvalSchedError) as err:
        EvalSchedClient(live_server.url, "wrong-token").queue()
    assert err.value.status == 403 and "token" in str(err.value)


def test_discovery_through_parent_pid_runtime_file(no_env, monkeypatch, live_server):
    pid = live_server.process.pid
    _server_file(no_env, live_server, pid)
    monkeypatch.setenv("JPY_PARENT_PID", str(pid))
    c = EvalSchedClient()
    assert (c.base_url, c.token) == (live_server.url, live_server.token)
    assert "running" in c.queue()


def test_discovery_through_running_servers_prefers_one_with_the_api(no_env, live_server):
    # A live process whose "server" has no /evalsched/ API (the URL refuses connections) ...
    _server_file(no_env, live_server, os.getpid())
    (no_env / f"jpserver-{os.getpid()}.json").write_text(
        json.dumps({"url": "http://127.0.0.1:9/", "token": "", "pid": os.getpid()})
    )
    # ... a dead one, and the real one.
    _server_file(no_env, live_server, 2**22 + 12345)
    _server_file(no_env, live_server, live_server.process.pid)
    c = EvalSchedClient()
    assert (c.base_url, c.token) == (live_server.url, live_server.token)


def test_the_discovery_probe_asks_for_no_queued_run():
    """A server with a long queue answers the probe with a small view (a long one made it time out)."""
    import http.server
    import threading

    from jupyter_evalsched.client.discovery import probe_api

    asked: list[str] = []

    class Capture(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            asked.append(self.path)
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass

    httpd = http.server.HTTPServer(("127.0.0.1", 0), Capture)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        assert probe_api(f"http://127.0.0.1:{httpd.server_address[1]}/base/", "t")
    finally:
        httpd.shutdown()
        httpd.server_close()
    assert asked == ["/base/evalsched/queue?limit=0"]


# --------------------------------------------------------------------------- spec building


def test_param_parsing_and_spec_options(tmp_path):
    assert parse_param("k=3") == ("k", 3)
    assert parse_param("k=0.5") == ("k", 0.5)
    assert parse_param('cfg={"a": [1, 2]}') == ("cfg", {"a": [1, 2]})
    assert parse_param("s=hello world") == ("s", "hello world")
    assert parse_param("flag=true") == ("flag", True)
    assert parse_param("eq=a=b") == ("eq", "a=b")
    with pytest.raises(SpecError):
        parse_param("novalue")

    class Opts:
        name = "n"
        episodes = 4
        vram = 100
        gpus = 2
        cpus = 3
        priority = "high"
        exclusive = True
        depends_on = ["r1", "r1", "r2"]
        params = ["x=1", "y=str"]
        models = ["m"]
        workers = 2
        timeout = 9.5
        seed = 7
        executor = "local"

    base = {"entrypoint": "a:b", "params": {"x": 0, "keep": 1}, "scheduling": {"cpus": 1}, "depends_on": ["r0"]}
    spec = apply_spec_options(base, Opts, default_cwd="/somewhere")
    assert spec == {
        "entrypoint": "a:b",
        "name": "n",
        "episodes": 4,
        "workers": 2,
        "seed": 7,
        "timeout_s": 9.5,
        "executor": "local",
        "params": {"x": 1, "keep": 1, "y": "str"},
        "depends_on": ["r0", "r1", "r2"],
        "models": ["m"],
        "scheduling": {"cpus": 3, "marginal_vram_mb": 100, "gpus": 2, "priority": "high", "exclusive_gpu": True},
        "cwd": "/somewhere",
    }
    assert base["params"] == {"x": 0, "keep": 1}  # the caller's dict is not modified

    (tmp_path / "sub").mkdir()
    (tmp_path / "s.yaml").write_text("entrypoint: a:b\ncwd: sub\nparams: {k: 1}\n")
    assert load_spec_file(str(tmp_path / "s.yaml"))["cwd"] == str(tmp_path / "sub")
    (tmp_path / "bad.json").write_text("{nope")
    with pytest.raises(SpecError, match="cannot parse spec file"):
        load_spec_file(str(tmp_path / "bad.json"))
    (tmp_path / "list.yaml").write_text("- 1\n")
    with pytest.raises(SpecError, match="must contain a mapping"):
        load_spec_file(str(tmp_path / "list.yaml"))


# --------------------------------------------------------------------------- REST


def test_submit_wait_and_read_results(client, clean_queue):
    rec = client.submit(_sleepy("results", episodes=3, sleep_s=0.05) | {"seed": 11})
    assert rec["state"] in ("queued", "running") and rec["name"] == "results"
    handle = client.handle(rec)
    seen = []
    final = client.wait(rec["id"], timeout=30, on_update=lambda r: seen.append(r["state"]))
    assert final["state"] == "succeeded" and seen[-1] == "succeeded"
    assert final["summary"]["episodes_done"] == 3
    score = final["summary"]["metrics"]["score"]
    assert score["count"] == 3 and 0.0 <= score["min"] <= score["mean"] <= score["max"] < 1.0

    assert handle.status() == "succeeded"
    assert handle.summary()["metrics"]["score"]["mean"] == pytest.approx(score["mean"])
    df = handle.episodes()
    assert list(df["index"]) == [0, 1, 2] and df["score"].between(0, 1).all()
    assert df["score"].mean() == pytest.approx(score["mean"])
    assert isinstance(handle.logs(), str) and isinstance(handle.logs("stderr", tail=5), str)
    assert handle.run_dir and os.path.isfile(os.path.join(handle.run_dir, "_DONE"))
    assert rec["id"] in [r["id"] for r in client.list(state="succeeded")]
    assert rec["id"] not in [r["id"] for r in client.list(state=["queued", "running"])]
    assert len(client.list(limit=1)) == 1
    assert "paths" in client.openapi() and client.models() == []
    assert client.ledger()["cpu_slots"]["total"] == 8

    client.delete(rec["id"])
    with pytest.raises(EvalSchedError) as err:
        client.get(rec["id"])
    assert err.value.status == 404


def test_http_errors_are_one_readable_line(client, clean_queue):
    with pytest.raises(EvalSchedError) as err:
        client.submit({"entrypoint": SLEEPY, "scheduling": {"marginal_vram_mb": -1}})
    assert err.value.status == 422
    assert (
        str(err.value) == "422: scheduling.marginal_vram_mb: Value error, must be between 0 and 16777216 MB, or 'auto'"
    )
    assert err.value.detail and err.value.detail[0]["loc"][-1] == "marginal_vram_mb"

    with pytest.raises(EvalSchedError) as err:  # can never fit on two 24000 MB GPUs
        client.submit({"entrypoint": SLEEPY, "scheduling": {"marginal_vram_mb": 30000}})
    assert err.value.status == 422 and "\n" not in str(err.value) and str(err.value).startswith("422: ")

    for bad in ("nope", "../etc", "a/b"):
        with pytest.raises(EvalSchedError) as err:
            client.get(bad)
        assert err.value.status == 404, bad

    done = client.submit({"entrypoint": "jupyter_evalsched.examples.basic:noop"})
    wait_state(client, done["id"])
    with pytest.raises(EvalSchedError) as err:
        client.cancel(done["id"])
    assert err.value.status == 409

    blocker = client.submit(_sleepy("blocker", sleep_s=30, episodes=1))
    with pytest.raises(EvalSchedError) as err:
        client.delete(blocker["id"])
    assert err.value.status == 409


def test_wait_timeout_and_handle_cancel(client, clean_queue):
    handle = client.handle(client.submit(_sleepy("long", sleep_s=30, episodes=1)))
    with pytest.raises(WaitTimeout) as err:
        handle.wait(timeout=0.5, progress=False)
    assert err.value.record["state"] in ("queued", "running")
    assert handle.cancel()["state"] in ("running", "cancelled")
    final = handle.wait(timeout=20, progress=False)
    assert final["state"] == "cancelled" and final["reason"].startswith("cancelled")


def test_queue_ledger_seen_by_two_clients_and_the_cli(live_server, client, clean_queue):
    other = live_server.client()  # an independent client object
    ids = [client.submit(_sleepy(f"big{i}", vram=16000, sleep_s=30, episodes=1))["id"] for i in range(3)]
    view = wait_until(lambda: (v := other.queue()) and len(v["running"]) == 2 and v, timeout=10)
    assert sorted(r["id"] for r in view["running"]) == sorted(ids[:2])
    assert [q["id"] for q in view["queued"]] == [ids[2]]
    assert view["queued"][0]["reason"].startswith("waiting_vram")
    devices = view["ledger"]["devices"]
    assert [d["allocated_mb"] for d in devices] == [16000, 16000]
    assert [d["free_mb"] for d in devices] == [8000, 8000]
    assert client.ledger()["devices"] == devices

    proc = cli(live_server, "queue", "--json")
    assert proc.returncode == 0, proc.stderr
    cli_view = json.loads(proc.stdout)
    assert [q["id"] for q in cli_view["queued"]] == [ids[2]]
    assert cli_view["ledger"]["devices"] == devices
    text = cli(live_server, "queue")
    assert text.returncode == 0 and "GPU 0 [" in text.stdout and "waiting_vram" in text.stdout
    head = cli(live_server, "queue", "--limit", "0")
    assert head.returncode == 0 and "QUEUED (1, in admission order)" in head.stdout, head.stdout
    assert ids[2] not in head.stdout and "... and 1 more queued" in head.stdout
    assert other.queue(limit=0)["queued_total"] == 1
    refused = cli(live_server, "queue", "--limit", "-1")
    assert refused.returncode == 2 and "must be between 0 and 100000" in refused.stderr

    # Cancelling a queued run is immediate; the others see it.
    assert client.cancel(ids[2])["state"] == "cancelled"
    assert other.queue()["queued"] == []


@pytest.mark.parametrize("backend", ["websocket-client", "tornado"])
def test_event_stream(client, clean_queue, backend):
    with client.events(backend=backend) as stream:
        first = stream.next_event(timeout=5)
        assert first["type"] == "snapshot" and {"queued", "running", "ledger"} <= set(first["queue"])
        rec = client.submit(_sleepy("events", sleep_s=0.05, episodes=2))
        states = []
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and "succeeded" not in states:
            event = stream.next_event(timeout=0.5)
            if event and event["type"] == "run" and event["run"]["id"] == rec["id"]:
                states.append(event["run"]["state"])
        assert "running" in states and states[-1] == "succeeded"

        # close() from another thread ends a blocked iteration promptly.
        threading.Timer(0.3, stream.close).start()
        started = time.monotonic()
        for _ in stream:
            pass
        assert time.monotonic() - started < 5 and stream.closed


# --------------------------------------------------------------------------- CLI


def test_cli_submit_wait_status_logs_list(live_server, client, clean_queue, tmp_path):
    proc = cli(
        live_server,
        "--json",
        "submit",
        SLEEPY,
        "--episodes",
        "2",
        "--param",
        "sleep_s=0.05",
        "--name",
        "from cli",
        "--priority",
        "high",
        "--seed",
        "3",
        cwd=str(tmp_path),
    )
    assert proc.returncode == 0, proc.stderr
    rec = json.loads(proc.stdout)
    assert rec["name"] == "from cli" and rec["priority"] == "high"

    waited = cli(live_server, "wait", rec["id"])
    assert waited.returncode == 0, waited.stderr
    assert "succeeded" in waited.stdout and "score=" in waited.stdout

    status = cli(live_server, "status", rec["id"], "--json")
    assert json.loads(status.stdout)["summary"]["episodes_done"] == 2
    human = cli(live_server, "status", rec["id"])
    assert "state" in human.stdout and "metric score" in human.stdout
    spec = json.loads(open(os.path.join(rec["run_dir"], "spec.json")).read())
    assert spec["cwd"] == str(tmp_path) and spec["params"] == {"sleep_s": 0.05} and spec["seed"] == 3

    listed = cli(live_server, "list", "--state", "succeeded", "--json")
    assert rec["id"] in [r["id"] for r in json.loads(listed.stdout)]
    assert rec["id"] in cli(live_server, "list", "--limit", "5").stdout

    logs = cli(live_server, "logs", rec["id"], "--stream", "stderr", "--tail", "3")
    assert logs.returncode == 0

    cancel = cli(live_server, "cancel", rec["id"])
    assert cancel.returncode == 2 and cancel.stderr.startswith("jupyter evalsched: error: 409: ")
    assert cancel.stderr.count("\n") == 1


def test_cli_spec_file_with_flag_overrides_and_failed_wait(live_server, clean_queue, tmp_path):
    (tmp_path / "spec.yaml").write_text(
        f"entrypoint: {CRASH}\nname: crashes\nparams: {{how: exception}}\nepisodes: 2\n"
    )
    proc = cli(
        live_server,
        "submit",
        "spec.yaml",
        "--param",
        "at=1",
        "--param",
        "sleep_s=0.01",
        "--wait",
        "--json",
        cwd=str(tmp_path),
    )
    assert proc.returncode == 1, proc.stderr  # the run failed: wait says so
    final = json.loads(proc.stdout)
    assert final["state"] == "failed" and final["reason"].startswith("exception")
    spec = json.loads(open(os.path.join(final["run_dir"], "spec.json")).read())
    assert spec["params"] == {"how": "exception", "at": 1, "sleep_s": 0.01}

    # `logs` of the failed run (nothing on its stdout) tells why, with its traceback and how to
    # read all of its stderr: never nothing with exit 0.
    logs = cli(live_server, "logs", final["id"])
    assert logs.returncode == 0 and logs.stdout == ""
    assert f"run {final['id']} failed: exception: RuntimeError: crash requested in episode 1" in logs.stderr
    assert "Traceback (most recent call last):" in logs.stderr
    assert f"jupyter evalsched logs {final['id']} --stream stderr" in logs.stderr
    # `status` does not show the runner's clean exit (0) as if it meant success.
    status = cli(live_server, "status", final["id"])
    assert "exit_code" not in status.stdout and "reason           exception: RuntimeError" in status.stdout
    assert f"logs {final['id']} --stream stderr" in status.stdout


def test_cancel_says_who_cancelled(live_server, client, clean_queue):
    """The reason of a cancelled run names who asked: the CLI, the Lab panel (its `?by=panel`),
    Python; a plain REST call stays "through the API"; another `by` is a 400."""
    blocker = client.submit(_sleepy("blocker", sleep_s=30, episodes=1, exclusive_gpu=True, gpus=2))
    queued = [client.submit(_sleepy(f"q{i}", vram=1000)) for i in range(4)]
    proc = cli(live_server, "cancel", queued[0]["id"])
    assert proc.returncode == 0, proc.stderr
    expected = {
        queued[0]["id"]: "cancelled: cancelled with jupyter evalsched cancel while queued",
        queued[1]["id"]: "cancelled: cancelled from the Lab panel while queued",
        queued[2]["id"]: "cancelled: cancelled from Python (cancel()) while queued",
        queued[3]["id"]: "cancelled: cancelled through the API while queued",
        blocker["id"]: "cancelled: cancelled from the Lab panel",
    }
    client.cancel(queued[1]["id"], by="panel")
    client.handle(queued[2]["id"]).cancel()
    client.cancel(queued[3]["id"])
    with pytest.raises(EvalSchedError) as err:
        client.cancel(blocker["id"], by="someone")
    assert err.value.status == 400 and "panel" in str(err.value)
    client.cancel(blocker["id"], by="panel")
    for run_id, reason in expected.items():
        assert wait_state(client, run_id)["reason"] == reason


def test_every_misplaced_known_field_gets_a_422_saying_where_it_belongs(client):
    """Each field of the spec's scheduling at the top level, and each top-level field under
    scheduling: the 422 names the section it belongs in, with the shape to write; a typo, the field
    it is probably a typo of."""
    from jupyter_evalsched.schemas import EvalSpec, Scheduling

    def refused(spec: dict) -> EvalSchedError:
        with pytest.raises(EvalSchedError) as err:
            client.submit({"entrypoint": SLEEPY, **spec})
        assert err.value.status == 422
        return err.value

    for field in Scheduling.model_fields:
        err = refused({field: 1})
        hint = f'{field} belongs under scheduling: {{"scheduling": {{"{field}": ...}}}}'
        assert hint in err.message and hint in err.detail[0]["msg"] and hint in str(err), err.message
    for field in EvalSpec.model_fields:
        if field == "scheduling":
            continue
        err = refused({"scheduling": {field: 1}})
        assert f'{field} belongs at the top level: {{"{field}": ...}}' in err.message, err.message
    assert "did you mean episodes?" in refused({"episods": 3}).message
    assert 'did you mean marginal_vram_mb, which belongs under scheduling: {"scheduling": {"marginal_vram_mb"' in (
        refused({"vram": 16000}).message
    )
    assert "did you mean" not in refused({"zzz": 1}).message  # nothing close: the plain error
    with pytest.raises(EvalSchedError) as err:
        client.submit_sweep({"entrypoint": SLEEPY, "gpus": 2}, {"k": [1, 2]})
    assert 'gpus belongs under scheduling: {"scheduling": {"gpus": ...}}' in err.value.message


def test_cli_mistyped_flags_and_commands_get_a_did_you_mean(tmp_path):
    for args, hint in (
        (("submit", SLEEPY, "--priorty", "3"), "did you mean --priority instead of --priorty?"),
        (("stauts", "x"), "did you mean 'status'?"),
        (("submit", SLEEPY, "--priority", "hihg"), "did you mean 'high'?"),
    ):
        proc = cli(None, *args, with_server=False, cwd=str(tmp_path))
        assert proc.returncode == 2 and hint in proc.stderr, (args, proc.stderr)


def test_cli_errors_exit_2_with_one_line(live_server, tmp_path):
    cases = [
        (("submit", SLEEPY, "--vram", "-1"), "422: scheduling.marginal_vram_mb"),
        (("submit", "not-an-entrypoint"), "neither a spec file"),
        (("submit", "missing.yaml"), "cannot read spec file"),
        (("submit", "--episodes", "2"), "submit needs a spec file, an entrypoint or --source-file"),
        (("status", "../etc"), "404: "),
        (("logs", "nope"), "404: "),
    ]
    for args, expected in cases:
        proc = cli(live_server, *args, cwd=str(tmp_path))
        assert proc.returncode == 2, (args, proc.stderr)
        assert expected in proc.stderr and proc.stderr.count("\n") == 1, (args, proc.stderr)
    usage = cli(live_server, "wait")
    assert usage.returncode == 2 and "usage:" in usage.stderr
    env = {"JUPYTER_RUNTIME_DIR": str(tmp_path)}
    lost = cli(live_server, "list", env=env, with_server=False)
    assert lost.returncode == 2 and "EVALSCHED_URL" in lost.stderr and lost.stderr.count("\n") == 1


def test_cli_logs_follow(live_server, clean_queue, tmp_path):
    source = (
        "import time\n"
        "def episode(ctx, index):\n"
        "    print(f'line {index}', flush=True)\n"
        "    time.sleep(0.2)\n"
        "    return {'i': index}\n"
    )
    (tmp_path / "printer.py").write_text(source)
    rec = json.loads(
        cli(live_server, "--json", "submit", "--source-file", "printer.py", "--episodes", "4", cwd=str(tmp_path)).stdout
    )
    proc = cli(live_server, "logs", rec["id"], "-f", timeout=30)
    assert proc.returncode == 0
    assert [line for line in proc.stdout.splitlines() if line.startswith("line ")] == [
        "line 0",
        "line 1",
        "line 2",
        "line 3",
    ]


def _words(text: str) -> str:
    return " ".join(text.split())


@pytest.mark.slow  # a server started, killed or restarted: CI runs it with -m slow (docs/install.md: the default suite stays within ten minutes)
def test_cli_demo(tmp_path):
    # Piped, in an 80-column terminal's environment: every line fits, nothing is cut.
    proc = cli(
        None,
        "demo",
        "--sleep",
        "0.3",
        "--episodes",
        "3",
        with_server=False,
        cwd=str(tmp_path),
        timeout=180,
        # The tiny causal LM the demo serves is built here (offline), not in the user's cache.
        env={"COLUMNS": "80", "XDG_CACHE_HOME": str(tmp_path / "cache")},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    frames, final = proc.stdout.split("final:")
    assert final.count("succeeded") == 7
    # The demo serves the tiny model: its run called it with the openai client, through the
    # run's OPENAI_BASE_URL, and the model's endpoint and figures close the demo.
    row = final.split("\nopenai ", 1)[1].split("\nshared model", 1)[0]  # its metrics may be under it
    assert "succeeded" in row and "openai_client=1" in row and "completion_tokens=" in row, final
    assert (tmp_path / "cache" / "jupyter_evalsched" / "tiny-gpt2" / "config.json").is_file()
    assert "shared model tiny-lm (loaded) at http://" in _words(final), final
    assert "/evalsched/v1: 3 requests · " in _words(final) and " tok/s · batch " in _words(final), final
    # Queueing really happened: the log shows VRAM and exclusive waits and the dependency.
    assert "waiting_vram" in proc.stdout and "waiting_gpu_exclusive" in proc.stdout
    assert "waiting_dependency: run big-a (" in _words(proc.stdout)
    # A notebook's lease held VRAM at first: the ledger drew it, and the reasons it held back say
    # so whole (wrapped, not cut).
    assert "leases: demo notebook:10000" in _words(proc.stdout) and "10000 MB for 'demo notebook'" in proc.stderr
    assert "(demo notebook) holds 10000 MB on GPU 0" in _words(proc.stdout)
    assert "…" not in proc.stdout and max(len(line) for line in proc.stdout.splitlines()) < 80
    # The last frame is drawn after the last run ended: every GPU is free again.
    last = frames.strip().split("\nt=")[-1]
    assert "held whole by" not in last and "runs:" not in last, last
    assert last.count("0/24000 MB") == 2, last


def test_demo_frames_show_each_pending_reason_whole(live_server, client, clean_queue):
    """The demo's frame, from the server's answers while the demo's runs wait (a lease held,
    exclusive and dependent runs queued), at 80 and 120 columns and piped: each reason whole."""
    from jupyter_evalsched.cli import PIPED_WIDTH, demo_frame, demo_plan

    lease = client.request("POST", "leases", body={"vram_mb": 10000, "label": "demo notebook", "pid": os.getpid()})
    ids: dict[str, str] = {}
    for label, spec in demo_plan(30.0, 1):
        spec["depends_on"] = [ids[d[1:]] if d.startswith("@") else d for d in spec.get("depends_on", [])]
        ids[label] = client.submit(spec)["id"]

    def settled():
        view = client.queue()
        records = {rid: client.get(rid) for rid in ids.values()}
        waiting = [r for r in records.values() if r["state"] == "queued"]
        # (big-a started, and after-a says so: on a busy host big-a can still be starting when
        # every queued run has its reason)
        started = records[ids["big-a"]]["state"] == "running" and "is running" in (
            records[ids["after-a"]]["reason"] or ""
        )
        return (view, records) if waiting and all(r["reason"] for r in waiting) and started else None

    view, records = wait_until(settled, timeout=15)
    reasons = [r["reason"] for r in records.values() if r["state"] == "queued"]
    assert any("holds 10000 MB on GPU" in r for r in reasons), reasons  # the lease, named in a reason
    after = records[ids["after-a"]]["reason"]
    assert after == f"waiting_dependency: run big-a ({ids['big-a']}) is running", after
    for width in (79, 119, PIPED_WIDTH - 1):  # 80 and 120 columns (the last one left free), piped
        text, _ = demo_frame(view, ids, records, 1.0, width)
        assert "…" not in text
        assert max(len(line) for line in text.splitlines()) <= width, text
        for reason in reasons:
            assert _words(reason) in _words(text), (width, reason, text)
        rows = {line.split()[0]: line.split() for line in text.splitlines() if line.split()[:1] in ([k] for k in ids)}
        # GPUS reads as GPUs: gpu<index> when it has one, cpu for a run that takes none.
        assert rows["big-a"][1] == "running" and rows["big-a"][-2] in ("gpu0", "gpu1"), rows["big-a"]
        assert rows["after-a"][-2] == "cpu", rows["after-a"]
    client.request("DELETE", f"leases/{lease['id']}")


def test_run_handle_repr_and_html(client, clean_queue):
    handle = client.handle(client.submit({"entrypoint": "jupyter_evalsched.examples.basic:noop", "name": "tiny"}))
    assert isinstance(handle, RunHandle) and handle.id in repr(handle)
    handle.wait(timeout=20, progress=False)
    assert "succeeded" in handle._repr_html_() and "tiny" in handle._repr_html_()


def test_interrupting_wait_stops_waiting_not_the_run(client, clean_queue, monkeypatch, capsys):
    from jupyter_evalsched import client as client_module

    handle = client.handle(client.submit(_sleepy("interrupted", sleep_s=30, episodes=1)))
    wait_state(client, handle.id, states={"running"}, timeout=10)
    requests = []
    real_request = client.request

    def recorded_request(method, path, **kwargs):
        requests.append((method, path))
        return real_request(method, path, **kwargs)

    monkeypatch.setattr(client, "request", recorded_request)

    def interrupted(self, timeout=None):
        raise KeyboardInterrupt  # what Ctrl-C / "interrupt the kernel" raises inside the wait

    monkeypatch.setattr(client_module.EventStream, "next_event", interrupted)
    record = handle.wait()
    assert record["state"] == "running"
    assert "stopped waiting" in capsys.readouterr().err
    monkeypatch.undo()
    # Nothing asked the server to cancel the run, and it still runs.
    assert not [path for method, path in requests if path.endswith("/cancel")], requests
    assert handle.status() == "running"


def test_cli_wait_ctrl_c_leaves_the_run_running(live_server, client, clean_queue):
    import select
    import signal
    import subprocess

    rec = client.submit(_sleepy("ctrl-c", sleep_s=30, episodes=1))
    proc = subprocess.Popen(
        interruptible_cli("wait", rec["id"]),
        env=cli_env(live_server),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        # The first progress line says that the CLI has imported, connected and is waiting.
        wait_until(lambda: select.select([proc.stderr], [], [], 0)[0], timeout=30, message="no progress line")
        assert "ctrl-c" in proc.stderr.readline()
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err
    assert "stopped waiting" in err and "Traceback" not in err
    assert client.get(rec["id"])["state"] == "running"


def test_jupyter_evalsched_command(live_server):
    import shutil
    import subprocess
    import sys

    bindir = os.path.dirname(sys.executable)
    assert shutil.which("jupyter-evalsched", path=bindir), "the package is not installed here: run scripts/setup.sh"
    env = dict(os.environ, **live_server.env)
    env["PATH"] = bindir + os.pathsep + env.get("PATH", "")
    for cmd in (["jupyter", "evalsched"], ["jupyter-evalsched"]):
        proc = subprocess.run([*cmd, "queue", "--json"], env=env, capture_output=True, text=True, timeout=30)
        assert proc.returncode == 0, proc.stderr
        assert "ledger" in json.loads(proc.stdout)


def test_non_root_base_url(tmp_path):
    """JupyterHub serves every server under a prefix: REST, events and the CLI must all use it."""
    from jupyter_evalsched.client import LocalServer

    with LocalServer(virtual_gpus="8000", cpu_slots=2, extra_args=["--ServerApp.base_url=/user/a@b/"]) as server:
        assert server.url.endswith("/user/a%40b/") or server.url.endswith("/user/a@b/"), server.url
        c = server.client()
        with c.events() as stream:
            assert stream.next_event(timeout=5)["type"] == "snapshot"
        rec = c.submit({"entrypoint": "jupyter_evalsched.examples.basic:noop", "episodes": 2})
        assert c.wait(rec["id"], timeout=20)["state"] == "succeeded"
        proc = cli(server, "wait", rec["id"], cwd=str(tmp_path))
        assert proc.returncode == 0, proc.stderr


# --------------------------------------------------------------------------- attempts


def test_cli_attempt_flags_and_resume(live_server, client, clean_queue):
    crash = "jupyter_evalsched.examples.basic:crash"
    proc = cli(
        live_server,
        "submit",
        crash,
        "--episodes",
        "3",
        "--param",
        "how=exit",
        "--param",
        "at=1",
        "--param",
        "until_attempt=1",
        "--retry-on",
        "signal",
        "--retries",
        "2",
        "--no-preemptible",
        "--priority",
        "low",
        "--json",
    )
    assert proc.returncode == 0, proc.stderr
    rec = json.loads(proc.stdout)
    spec = json.loads(open(os.path.join(rec["run_dir"], "spec.json")).read())
    assert spec["retries"] == 2 and spec["retry_on"] == ["signal"] and spec["scheduling"]["preemptible"] is False
    assert rec["preemptible"] is False and rec["retries"] == 2
    # exit_code is not in its retry_on: it fails; resume then finishes it.
    failed = client.handle(rec).wait(timeout=30, progress=False)
    assert failed["state"] == "failed" and failed["attempt"] == 1 and failed["reason"].startswith("exit_code:3")
    proc = cli(live_server, "resume", rec["id"], "--wait", "--quiet")
    assert proc.returncode == 0, proc.stderr
    status = cli(live_server, "status", rec["id"])
    assert "attempt 2" in status.stdout and "attempt 1" in status.stdout and "exit_code:3" in status.stdout
    assert client.get(rec["id"])["state"] == "succeeded"
    again = cli(live_server, "resume", rec["id"])
    assert again.returncode != 0 and "succeeded" in again.stderr and "Traceback" not in again.stderr
    bad = cli(live_server, "submit", crash, "--retry-on", "bogus")
    assert bad.returncode == 2 and "invalid choice" in bad.stderr


def test_queue_ledger_has_a_line_per_other_user_of_a_shared_host():
    from jupyter_evalsched.cli import format_ledger

    dev = {
        "index": 0,
        "usable_mb": 24000,
        "allocated_mb": 4000,
        "free_mb": 3000,
        "unmanaged_mb": 3000,
        "runs": [{"id": "r1", "marginal_vram_mb": 4000}],
        "users": [
            {"user": "bob", "allocated_mb": 14000, "runs": 2, "leases": 1},
            {"user": "carol", "allocated_mb": 0, "runs": 0, "leases": 0},
        ],
        "unmanaged_processes": [
            {"pid": 11, "gpu": 0, "used_mb": 1000, "session_path": "w/mine.ipynb", "user": "root"},
            {"pid": 77, "gpu": 0, "used_mb": 1500, "user": "bob"},
            {"pid": 78, "gpu": 0, "used_mb": 500, "user": "carol"},
        ],
    }
    lines = format_ledger({"devices": [dev]}, me="root").splitlines()
    assert lines[1:3] == [
        "  user bob: 14,000 MB (2 runs, 1 lease); 1,500 MB outside the scheduler",
        "  user carol: 500 MB outside the scheduler",
    ]
    assert "other 3000 MB: user bob 1500 MB, mine.ipynb 1000 MB, user carol 500 MB" in lines[0]
    assert "pid 7" not in "\n".join(lines)
    # Without a host ledger: the same text as before, no user lines.
    plain = {k: v for k, v in dev.items() if k != "users"}
    plain["unmanaged_processes"] = [{"pid": 11, "gpu": 0, "used_mb": 1000, "session_path": "w/mine.ipynb"}]
    assert [line for line in format_ledger({"devices": [plain]}, me="root").splitlines() if "user" in line] == []


# --------------------------------------------------------------------------- the local server


def test_the_local_servers_token_is_not_on_its_command_line(live_server, client):
    """Every user of the host can read a process's command line (``ps``, /proc/<pid>/cmdline):
    the demo server's token (its whole authentication) is in its private config file instead,
    readable by its owner only, and it works."""
    with open(f"/proc/{live_server.process.pid}/cmdline", "rb") as f:
        command = f.read()
    assert live_server.token.encode() not in command
    config = os.path.join(live_server.config_dir, "jupyter_server_config.json")
    assert os.stat(config).st_mode & 0o077 == 0
    assert isinstance(client.ledger(), dict)  # (the client's requests carry the token)
