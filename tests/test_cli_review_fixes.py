"""The CLI, the magics and the Python client where a review found them wanting: following a run
through a server restart, the scheduler's 503 while it starts, token errors, spec files of the
wrong shape, ``lease -- CMD`` without a command, URLs copied from JupyterLab, ``logs -f --json``."""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import socket
import subprocess
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from IPython.core.error import UsageError

from jupyter_evalsched.client import (
    EvalSchedClient,
    EvalSchedError,
    LocalServer,
    SpecError,
    WaitTimeout,
    apply_spec_options,
    load_spec_file,
)
from jupyter_evalsched.client.discovery import _split_token_from_url
from jupyter_evalsched.client.errors import server_away
from jupyter_evalsched.client.sweep import SweepHandle

try:
    from .live_server import (
        FAST_SERVER_ARGS,
        SLEEPY,
        clean_queue,
        cli,
        client,
        interruptible_cli,
        ip,
        live_server,
        wait_until,
    )
except ImportError:
    from live_server import (  # noqa: F401
        FAST_SERVER_ARGS,
        SLEEPY,
        clean_queue,
        cli,
        client,
        interruptible_cli,
        ip,
        live_server,
        wait_until,
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _options(**given: Any) -> argparse.Namespace:
    """An argparse namespace of the submit flags, ``given`` set and the others None."""
    from jupyter_evalsched.client.spec import _SCHEDULING_FLAGS, _TOP_LEVEL_FLAGS

    names = [*_TOP_LEVEL_FLAGS, *_SCHEDULING_FLAGS, "params", "depends_on", "models"]
    return argparse.Namespace(**{**{name: None for name in names}, **given})


def _one_error_line(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    return proc.stderr


# --------------------------------------------------------------------------- a fake server


class FakeApi:
    """An HTTP server that answers ``/evalsched/...`` as ``answer(method, path)`` says
    (``(status, body, headers)``), on a port it keeps when stopped and started again."""

    def __init__(self, answer):
        self.answer = answer
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}/"
        self.requests: list[tuple[str, str]] = []
        self._server: ThreadingHTTPServer | None = None

    def start(self) -> FakeApi:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def _reply(self) -> None:
                fake.requests.append((self.command, self.path))
                status, body, headers = fake.answer(self.command, self.path)
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                for key, value in headers.items():
                    self.send_header(key, value)
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = _reply

            def log_message(self, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


STARTING = {"message": "the scheduler is starting (reading the runs directory); retry in a moment", "reason": None}


# --------------------------------------------------------------------------- 1: a server that goes away


class Notes:
    """A progress reporter that keeps what it is told."""

    def __init__(self) -> None:
        self.updates: list[dict] = []
        self.notes: list[str] = []
        self.finished: list[dict] = []

    def update(self, record: dict) -> None:
        self.updates.append(record)

    def finish(self, record: dict) -> None:
        self.finished.append(record)

    def note(self, text: str) -> None:
        self.notes.append(text)


def test_waits_poll_through_a_server_that_goes_away_and_comes_back():
    state = {"run": "running"}

    def answer(method: str, path: str):
        if path.startswith("/evalsched/runs/r1"):
            return 200, {"id": "r1", "state": state["run"], "progress": {"done": 0, "total": 1}}, {}
        if path.startswith("/evalsched/sweeps/sweep-1"):
            runs = [{"id": "r1", "state": state["run"], "progress": {"done": 0, "total": 1}}]
            return 200, {"id": "sweep-1", "runs": runs, "counts": {state["run"]: 1}}, {}
        return 404, {"message": "not found", "reason": None}, {}

    fake = FakeApi(answer).start()
    try:
        c = EvalSchedClient(fake.url, "t")
        run_notes, sweep_notes = Notes(), Notes()
        results: dict[str, Any] = {}

        def follow_run() -> None:
            results["run"] = c.handle("r1").wait(timeout=30, progress=run_notes)

        def follow_sweep() -> None:
            results["sweep"] = SweepHandle(c, "sweep-1").wait(timeout=30, progress=sweep_notes)

        threads = [threading.Thread(target=f, daemon=True) for f in (follow_run, follow_sweep)]
        for t in threads:
            t.start()
        wait_until(lambda: run_notes.updates and sweep_notes.updates, timeout=10)
        fake.stop()  # refused from now on
        wait_until(lambda: run_notes.notes and sweep_notes.notes, timeout=10, message="no note of the outage")
        assert "server unreachable" in run_notes.notes[0] and "Connection refused" in run_notes.notes[0]
        assert "server unreachable" in sweep_notes.notes[0]
        state["run"] = "succeeded"
        fake.start()
        for t in threads:
            t.join(15)
        assert results["run"]["state"] == "succeeded" and results["sweep"]["runs"][0]["state"] == "succeeded"
        assert run_notes.notes[-1] == "server answers again" and sweep_notes.notes[-1] == "server answers again"
    finally:
        fake.stop()


def test_a_wait_whose_server_never_answered_fails_at_once():
    c = EvalSchedClient(f"http://127.0.0.1:{_free_port()}/", "t")
    with pytest.raises(Exception) as caught:
        c.wait("r1", use_events=False)
    assert "Connection refused" in str(caught.value)


def test_a_wait_through_an_outage_still_times_out():
    fake = FakeApi(lambda m, p: (200, {"id": "r1", "state": "running"}, {})).start()
    c = EvalSchedClient(fake.url, "t")
    notes = Notes()
    reached = threading.Event()
    errors: list[BaseException] = []

    def follow() -> None:
        try:
            c.wait(
                "r1", timeout=3, use_events=False, poll_s=0.05, on_update=lambda r: reached.set(), on_note=notes.note
            )
        except BaseException as e:
            errors.append(e)

    t = threading.Thread(target=follow, daemon=True)
    t.start()
    assert reached.wait(10)
    fake.stop()
    t.join(15)
    assert errors and isinstance(errors[0], WaitTimeout) and notes.notes, (errors, notes.notes)


@pytest.mark.slow
def test_cli_and_python_follow_a_detached_run_through_a_server_restart(tmp_path):
    """wait, logs -f, wait sweep-…, queue --watch and RunHandle.wait keep following while the
    server is killed and started again on the same port, token and runs directory; each ends
    with the runs' real verdict."""
    runs, gate = tmp_path / "runs", tmp_path / "open"
    source = (
        "import os, time\n"
        "def episode(ctx, index):\n"
        "    print('started', flush=True)\n"
        "    deadline = time.monotonic() + 120\n"
        "    while not os.path.exists(ctx.params['gate']):\n"
        "        if time.monotonic() > deadline:\n"
        "            raise TimeoutError('the gate never opened')\n"
        "        time.sleep(0.02)\n"
        "    print('finished', flush=True)\n"
        "    return {'ok': 1}\n"
    )
    spec = {"source": source, "params": {"gate": str(gate)}, "detach": True, "cwd": str(tmp_path)}
    port, token = _free_port(), secrets.token_hex(16)
    server = LocalServer(virtual_gpus="24000", runs_dir=str(runs), extra_args=FAST_SERVER_ARGS, port=port, token=token)
    restarted = None
    procs: dict[str, subprocess.Popen] = {}
    out: dict[str, list[str]] = {}
    try:
        c = server.client()
        run = c.submit(spec)
        sweep = c.submit_sweep(spec, {"k": [1, 2]})
        wait_until(lambda: "started" in c.logs(run["id"]), timeout=30)

        env = {**os.environ, **server.env, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
        commands = {
            "wait": ["wait", run["id"]],
            "logs": ["logs", "-f", run["id"]],
            "sweep": ["wait", sweep["id"]],
            "queue": ["queue", "--watch", "--json", "--interval", "0.2"],
        }
        for name, args in commands.items():
            procs[name] = subprocess.Popen(
                interruptible_cli(*args),
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for stream in ("stdout", "stderr"):
                lines = out[f"{name}.{stream}"] = []
                pipe = getattr(procs[name], stream)
                threading.Thread(
                    target=lambda p=pipe, keep=lines: keep.extend(iter(p.readline, "")), daemon=True
                ).start()
        notes = Notes()
        result: dict[str, Any] = {}
        waiter = threading.Thread(
            target=lambda: result.update(c.handle(run["id"]).wait(timeout=120, progress=notes)), daemon=True
        )
        waiter.start()

        # Each has read the server: a progress line, the run's output, a view of the queue.
        wait_until(
            lambda: (
                out["wait.stderr"]
                and "started\n" in out["logs.stdout"]
                and out["sweep.stderr"]
                and out["queue.stdout"]
                and notes.updates
            ),
            timeout=30,
            message=f"not every follower read the server: {out}",
        )
        server.process.send_signal(signal.SIGKILL)
        server.process.wait()

        def told(name: str) -> bool:
            return any("server unreachable" in line for line in out[f"{name}.stderr"])

        wait_until(lambda: all(told(n) for n in commands) and notes.notes, timeout=30, message=f"{out}")
        assert all(p.poll() is None for p in procs.values()), {n: p.poll() for n, p in procs.items()}

        restarted = LocalServer(
            virtual_gpus="24000", runs_dir=str(runs), extra_args=FAST_SERVER_ARGS, port=port, token=token
        )
        gate.touch()
        for name in ("wait", "logs", "sweep"):
            assert procs[name].wait(60) == 0, (name, out)
        waiter.join(30)
        assert result.get("state") == "succeeded", result
        wait_until(lambda: "".join(out["wait.stdout"]).strip(), timeout=5)
        assert "succeeded" in "".join(out["wait.stdout"])
        logs = "".join(out["logs.stdout"])
        assert logs.count("started") == 1 and "finished" in logs, logs
        assert any("server answers again" in line for line in out["wait.stderr"]), out["wait.stderr"]

        def queue_idle() -> bool:
            views = [json.loads(line) for line in out["queue.stdout"] if line.strip()]
            return bool(views) and not views[-1]["running"] and not views[-1]["queued"]

        wait_until(queue_idle, timeout=30)
        procs["queue"].send_signal(signal.SIGINT)
        assert procs["queue"].wait(15) == 0, out["queue.stderr"]
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
        server.cleanup()
        if restarted is not None:
            restarted.cleanup()


# --------------------------------------------------------------------------- 2: the 503 of a starting scheduler


def test_reads_retry_the_503_of_a_starting_scheduler():
    def answer(method: str, path: str):
        if len([r for r in fake.requests if r[1].startswith("/evalsched/runs/r1")]) <= 2:
            return 503, STARTING, {"Retry-After": "0"}
        return 200, {"id": "r1", "state": "running"}, {}

    fake = FakeApi(answer).start()
    try:
        assert EvalSchedClient(fake.url, "t").get("r1")["state"] == "running"
        assert len(fake.requests) == 3
        proc = cli(None, "status", "r1", env={"EVALSCHED_URL": fake.url, "EVALSCHED_TOKEN": "t"}, with_server=False)
        assert proc.returncode == 0 and "running" in proc.stdout, proc.stderr
    finally:
        fake.stop()


def test_other_503s_and_other_methods_are_not_retried():
    """Only a GET is retried, and only for a starting scheduler's 503: a cancel (a widget's, on
    the kernel's thread) fails at once, as does a 503 with a Retry-After of something else (a
    proxy's) and one that waiting does not mend."""
    answers = {
        "/evalsched/runs/r1": (503, {"message": "the runs directory is not yours", "reason": None}, {}),
        "/evalsched/runs/r2": (503, {"message": "upstream busy", "reason": None}, {"Retry-After": "0"}),
        "/evalsched/runs/r3/cancel": (503, STARTING, {"Retry-After": "0"}),
    }
    fake = FakeApi(lambda m, p: answers[p.split("?")[0]]).start()
    try:
        client = EvalSchedClient(fake.url, "t")
        with pytest.raises(EvalSchedError, match="not yours"):
            client.get("r1")
        with pytest.raises(EvalSchedError, match="upstream busy"):
            client.get("r2")
        with pytest.raises(EvalSchedError, match="starting"):
            client.cancel("r3")
        assert len(fake.requests) == 3
    finally:
        fake.stop()
    # (A follower waits through any 503: even "cannot schedule its runs directory" passes, where
    # a start or a takeover failed for now, and is retried every 10 s.)
    assert server_away(EvalSchedError(503, "this server cannot schedule its runs directory: the disk is full"))


# --------------------------------------------------------------------------- 3, 4, 14: tokens


def test_a_post_with_a_wrong_token_says_so(live_server):
    for args in (("cancel", "some-run"), ("submit", SLEEPY)):
        err = _one_error_line(cli(live_server, *args, env={"EVALSCHED_TOKEN": "wrong"}))
        assert "wrong or missing token" in err and "_xsrf" not in err, err


def test_doctor_with_a_wrong_token_says_the_token_is_wrong(live_server):
    proc = cli(live_server, "doctor", env={"EVALSCHED_TOKEN": "wrong"})
    assert proc.returncode == 2, proc.stderr
    assert "refused the token" in proc.stdout and "--token" in proc.stdout, proc.stdout
    assert "start Jupyter" not in proc.stdout and "NVML" not in proc.stdout, proc.stdout


def test_a_wrong_token_without_a_url_is_told_refused(live_server):
    runtime = os.path.join(live_server._tmp, "runtime")
    for args in (("--token", "wrong", "queue"), ("--token", "wrong", "doctor")):
        proc = cli(live_server, *args, env={"JUPYTER_RUNTIME_DIR": runtime}, with_server=False)
        text = proc.stderr + proc.stdout
        assert proc.returncode == 2 and "token given was refused" in text and "none answers" not in text, text
    proc = cli(live_server, "queue", env={"JUPYTER_RUNTIME_DIR": runtime}, with_server=False)
    assert proc.returncode == 0, proc.stderr  # its own token, from its runtime file


# --------------------------------------------------------------------------- 5: doctor's fix lines


def test_doctor_fix_lines_say_what_to_set(tmp_path):
    args = [*FAST_SERVER_ARGS, "--EvalSchedApp.warm_start=False", "--EvalSchedApp.enforce_vram=off"]
    args.append("--EvalSchedApp.cgroups=False")
    with LocalServer(virtual_gpus="24000", runs_dir=str(tmp_path / "runs"), extra_args=args) as server:
        proc = cli(server, "doctor", "--json")
    checks = {c["name"]: c for c in json.loads(proc.stdout)}
    assert "EvalSchedApp.warm_start = True" in checks["warm_start"]["fix"], checks["warm_start"]
    assert "EvalSchedApp.enforce_vram = 'warn'" in checks["enforcement"]["fix"], checks["enforcement"]
    assert "EvalSchedApp.cgroups = True" in checks["cgroups"]["fix"], checks["cgroups"]
    assert "EvalSchedApp.cgroups = False" in checks["cgroups"]["detail"], checks["cgroups"]
    assert "cgroup_parent = 'off'" not in checks["cgroups"]["detail"]


# --------------------------------------------------------------------------- 6, 7: specs


def test_spec_fields_of_the_wrong_type_are_one_line_errors(live_server, tmp_path):
    bad_sched = tmp_path / "sched.json"
    bad_sched.write_text(json.dumps({"entrypoint": SLEEPY, "scheduling": "big"}))
    err = _one_error_line(cli(live_server, "submit", str(bad_sched), "--vram", "100"))
    assert "scheduling must be a mapping" in err and "--vram" in err, err
    # No flag touches it: the server says what is wrong (a 422), as one line.
    err = _one_error_line(cli(live_server, "submit", str(bad_sched)))
    assert "422" in err and "scheduling" in err, err

    list_params = tmp_path / "params.json"
    list_params.write_text(json.dumps({"entrypoint": SLEEPY, "params": [1, 2]}))
    err = _one_error_line(cli(live_server, "submit", str(list_params), "--param", "k=1"))
    assert "params must be a mapping" in err, err

    latin1 = tmp_path / "latin1.yaml"
    latin1.write_bytes("entrypoint: x:y\nname: caf\xe9\n".encode("latin-1"))
    err = _one_error_line(cli(live_server, "submit", str(latin1)))
    assert "not UTF-8" in err, err
    with pytest.raises(SpecError, match="not UTF-8"):
        load_spec_file(str(latin1))


def test_eval_submit_with_a_dict_spec_of_the_wrong_shape_says_one_line(ip):
    ip.user_ns["bad"] = {"entrypoint": SLEEPY, "scheduling": "big"}
    with pytest.raises(UsageError) as refused:  # the magic stops the cell with one line
        ip.run_line_magic("eval_submit", "bad --vram 100")
    err = str(refused.value)
    assert err.startswith("eval_submit: ") and "scheduling must be a mapping" in err, err


def test_a_string_depends_on_is_one_run_id():
    spec = apply_spec_options({"entrypoint": "m:f", "depends_on": "run-a"}, _options(depends_on=["run-b"]))
    assert spec["depends_on"] == ["run-a", "run-b"]
    spec = apply_spec_options({"entrypoint": "m:f", "models": "tiny"}, _options(models=["other"]))
    assert spec["models"] == ["tiny", "other"]
    with pytest.raises(SpecError, match="depends_on must be a list"):
        apply_spec_options({"entrypoint": "m:f", "depends_on": 3}, _options(depends_on=["run-b"]))


# --------------------------------------------------------------------------- 8: lease -- CMD


def test_lease_with_a_command_that_cannot_run_exits_as_a_shell_and_releases(live_server, client, clean_queue, tmp_path):
    not_executable = tmp_path / "script.sh"
    not_executable.write_text("#!/bin/sh\necho hi\n")
    for command, code, says in (
        (str(tmp_path / "missing"), 127, "command not found"),
        (str(not_executable), 126, "cannot run it"),
    ):
        proc = cli(live_server, "lease", "1000", "--", command, "arg")
        assert proc.returncode == code, (proc.returncode, proc.stderr)
        assert "Traceback" not in proc.stderr and says in proc.stderr, proc.stderr
        wait_until(lambda: not client.request("GET", "leases")["leases"], timeout=10, message="the lease was kept")


# --------------------------------------------------------------------------- 9, 10: magics


def test_eval_release_of_an_id_without_a_server_says_one_line(ip, monkeypatch, tmp_path):
    for var in ("EVALSCHED_URL", "EVALSCHED_TOKEN", "JPY_PARENT_PID"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(tmp_path / "no-runtime"))  # no server to find
    with pytest.raises(UsageError) as refused:  # the magic stops the cell with one line
        ip.run_line_magic("eval_release", "lease-123")
    err = str(refused.value)
    assert err.startswith("eval_release: no running Jupyter server found") and len(err.strip().splitlines()) == 1, err


def test_unload_ext_removes_every_magic(ip):
    ip.run_line_magic("unload_ext", "jupyter_evalsched")
    try:
        left = {
            name for kind in ("line", "cell") for name in ip.magics_manager.magics[kind] if name.startswith("eval_")
        }
        assert not left, left
    finally:
        ip.run_line_magic("load_ext", "jupyter_evalsched")


# --------------------------------------------------------------------------- 11, 12: waiting for a sweep


def test_wait_on_a_sweep_times_out_and_is_interrupted_as_a_run_is(live_server, client, clean_queue):
    spec = {"entrypoint": SLEEPY, "episodes": 1, "params": {"sleep_s": 60}}
    sweep = client.submit_sweep(spec, {"seed_offset": [1, 2]})
    proc = cli(live_server, "wait", sweep["id"], "--timeout", "0")
    assert proc.returncode == 1, proc.stderr
    assert f"sweep {sweep['id']} still" in proc.stderr and f"cancel {sweep['id']}" in proc.stderr, proc.stderr
    assert f"run {sweep['id']}" not in proc.stderr

    env = {**os.environ, **live_server.env, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    waiting = subprocess.Popen(
        interruptible_cli("wait", sweep["id"]),
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        first = waiting.stderr.readline()  # the progress bar: it is waiting
        assert "sweep" in first, first
        waiting.send_signal(signal.SIGINT)
        stdout, stderr = waiting.communicate(timeout=15)
    finally:
        if waiting.poll() is None:
            waiting.kill()
    assert waiting.returncode == 130, stderr
    assert f"`jupyter evalsched cancel {sweep['id']}`" in stderr and ".cancel()" not in stderr, stderr
    assert stdout == "", stdout  # no comparison of runs that have not ended


def test_wait_on_an_unknown_sweep_shows_no_progress(live_server):
    proc = cli(live_server, "wait", "sweep-nosuch")
    err = _one_error_line(proc)
    assert "404" in err and "succeeded" not in err and "0/0" not in err, err


# --------------------------------------------------------------------------- 13: URLs copied from Lab


def test_a_url_copied_from_jupyterlab_finds_the_api(live_server):
    url = live_server.url + "lab?token=" + live_server.token
    proc = cli(live_server, "queue", env={"EVALSCHED_URL": url}, with_server=False)
    assert proc.returncode == 0 and "QUEUED" in proc.stdout, proc.stderr
    proc = cli(live_server, "list", "--url", live_server.url + "lab/tree/notebook.ipynb", "--token", live_server.token)
    assert proc.returncode == 0, proc.stderr


def test_ui_paths_are_cut_from_a_url_and_base_urls_kept():
    cases = {
        "http://h:8888/lab?token=abc": ("http://h:8888/", "abc"),
        "http://h/user/alice/lab?token=t": ("http://h/user/alice/", "t"),
        "http://h/user/lab/lab/tree/x.ipynb": ("http://h/user/lab/", None),
        "http://h/prefix/notebooks/x.ipynb": ("http://h/prefix/", None),
        "http://h/base/tree": ("http://h/base/", None),
        "http://h/base/": ("http://h/base/", None),
        "h:8888": ("http://h:8888", None),
    }
    for url, expected in cases.items():
        assert _split_token_from_url(url) == expected, url


# --------------------------------------------------------------------------- 15: logs -f --json


def test_logs_follow_json_prints_json_lines(live_server, client, clean_queue):
    source = "def episode(ctx, index):\n    print(f'line {index}', flush=True)\n    return {}\n"
    rec = client.submit({"source": source, "episodes": 2, "cwd": "/"})
    proc = cli(live_server, "logs", "-f", "--json", rec["id"])
    assert proc.returncode == 0, proc.stderr
    chunks = [json.loads(line) for line in proc.stdout.splitlines()]
    assert chunks and all(set(c) == {"id", "stream", "text"} and c["id"] == rec["id"] for c in chunks), chunks
    assert "line 0" in "".join(c["text"] for c in chunks)
