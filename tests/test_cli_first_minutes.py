"""The CLI in a new user's first minutes (a review that used it so): a URL that says 127.0.0.1
where the runtime file says localhost, two servers running, compare's columns and warnings, the
queue's GPU bars, long metric names in ``status``, what ``cancel`` did, ``logs -f`` on a queued
or failed run. Each through the real CLI against a real server."""

from __future__ import annotations

import json
import queue
import subprocess
import sys
import threading

import pytest

from jupyter_evalsched.client import LocalServer
from jupyter_evalsched.client.discovery import same_local_server

try:
    from .live_server import (
        CRASH,
        SLEEPY,
        clean_queue,
        cli,
        cli_env,
        client,
        live_server,
        runtime_dir,
        server_file,
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
        live_server,
        runtime_dir,
        server_file,
        wait_state,
        wait_until,
    )

ACCURACY = "jupyter_evalsched.examples.basic:accuracy_toy"


def _spec(name: str, entrypoint: str = SLEEPY, vram: int = 0, episodes: int = 2, **params) -> dict:
    return {
        "entrypoint": entrypoint,
        "name": name,
        "episodes": episodes,
        "cwd": "/",
        "params": params,
        "scheduling": {"marginal_vram_mb": vram},
    }


def _blocking(spec: dict) -> dict:
    """``spec`` holding both GPUs whole: what queues every run that needs VRAM."""
    return {**spec, "scheduling": {"exclusive_gpu": True, "gpus": 2}}


# --------------------------------------------------------------------------- 1: 127.0.0.1 or localhost


@pytest.mark.parametrize(("listed_host", "given_host"), [("localhost", "127.0.0.1"), ("127.0.0.1", "localhost")])
def test_the_token_is_found_whichever_loopback_name_the_url_says(live_server, tmp_path, listed_host, given_host):
    """Jupyter prints both http://localhost:PORT/ and http://127.0.0.1:PORT/; its runtime file
    holds one of them. Either URL finds the token there."""
    info = server_file(live_server)
    port = live_server.url.rsplit(":", 1)[1].strip("/")
    info["url"] = f"http://{listed_host}:{port}/"
    runtime = runtime_dir(tmp_path / "runtime", info, newest_first=False)
    env = {"JUPYTER_RUNTIME_DIR": str(runtime), "EVALSCHED_URL": f"http://{given_host}:{port}/"}
    proc = cli(live_server, "list", env=env, with_server=False)
    assert proc.returncode == 0, proc.stderr
    assert "403" not in proc.stderr and "token" not in proc.stderr


def test_a_token_found_for_one_host_goes_to_no_other():
    """Two names of this host's loopback name one server where each address the URL's name
    resolves to is served by this user's sockets alone (``served``: told by the kernel's tables,
    test_cli_review_fixes_3); another user may listen at the same port of ::1 or 127.0.0.2."""
    this = "gpubox"
    asked = []

    def served(host, port):
        asked.append((host, port))
        return True

    assert same_local_server("http://[::1]:8888/", "http://localhost:8888/", this, served)
    assert same_local_server("http://localhost:8888/", "http://gpubox:8888/", this, served)  # on all interfaces
    assert same_local_server("http://LOCALHOST:80/", "http://127.0.0.1/", this, served)  # the default port, any case
    assert asked == [("::1", 8888), ("localhost", 8888), ("localhost", 80)]
    # Not served by this user alone (or it cannot be told): only the URL as listed.
    assert not same_local_server("http://[::1]:8888/", "http://localhost:8888/", this)
    assert not same_local_server("http://127.0.0.2:8888/", "http://127.0.0.1:8888/", this, lambda h, p: False)
    assert same_local_server("http://LOCALHOST:8888/", "http://localhost:8888/", this)  # one host name
    for given, listed in [
        ("http://otherbox:8888/", "http://localhost:8888/"),  # another host
        ("http://localhost:8888/", "http://otherbox:8888/"),
        ("http://gpubox:8888/", "http://localhost:8888/"),  # this host's name need not reach a loopback server
        ("http://localhost:8889/", "http://localhost:8888/"),  # another port
        ("https://localhost:8888/", "http://localhost:8888/"),  # another scheme
        ("http://localhost:8888/a/", "http://127.0.0.1:8888/"),  # another base path
        ("http://localhost:x/", "http://127.0.0.1:8888/"),  # no port at all
    ]:
        assert not same_local_server(given, listed, this, served), (given, listed)


# --------------------------------------------------------------------------- 2: two servers


@pytest.fixture(scope="module")
def second_server():
    server = LocalServer(virtual_gpus="24000", cpu_slots=2)
    yield server
    server.cleanup()


def test_with_two_servers_the_cli_says_which_it_uses(live_server, second_server, tmp_path):
    infos = server_file(live_server), server_file(second_server)
    runtime = runtime_dir(tmp_path / "runtime", *infos, newest_first=False)  # the second newer
    env = {"JUPYTER_RUNTIME_DIR": str(runtime)}
    proc = cli(live_server, "list", env=env, with_server=False)
    assert proc.returncode == 0, proc.stderr
    note = f"jupyter evalsched: using {second_server.url} (2 servers found: --url to choose)"
    assert proc.stderr.splitlines() == [note]
    # With --json too (on stderr: stdout stays JSON).
    proc = cli(live_server, "--json", "list", env=env, with_server=False)
    assert proc.returncode == 0 and isinstance(json.loads(proc.stdout), list)
    assert proc.stderr.splitlines() == [note]
    # A server named: no note.
    named = dict(env, EVALSCHED_URL=live_server.url, EVALSCHED_TOKEN=live_server.token)
    proc = cli(live_server, "list", env=named, with_server=False)
    assert proc.returncode == 0 and proc.stderr == ""
    # One server found: no note.
    alone = runtime_dir(tmp_path / "alone", server_file(second_server), newest_first=False)
    proc = cli(live_server, "list", env={"JUPYTER_RUNTIME_DIR": str(alone)}, with_server=False)
    assert proc.returncode == 0 and proc.stderr == ""


# --------------------------------------------------------------------------- 3: compare


def test_compare_shows_names_and_states_and_warns_of_different_or_failed_runs(live_server, client, clean_queue):
    a = client.submit(_spec("sleepy-a"))
    b = client.submit(_spec("sleepy-b", seed_offset=7))
    toy = client.submit(_spec("toy-c", entrypoint=ACCURACY))
    crash = client.submit({**_spec("crash-d", entrypoint=CRASH), "params": {"how": "exception", "at": 1}})
    for rec in (a, b, toy, crash):
        wait_state(client, rec["id"], timeout=60)

    same = cli(live_server, "compare", a["id"], b["id"])
    assert same.returncode == 0, same.stderr
    header = same.stdout.splitlines()[0].split()
    assert header[:3] == ["run", "name", "state"]
    assert "sleepy-a" in same.stdout and "sleepy-b" in same.stdout and "succeeded" in same.stdout
    assert "warning" not in same.stdout + same.stderr

    mixed = cli(live_server, "compare", a["id"], toy["id"], crash["id"])
    assert mixed.returncode == 0, mixed.stderr
    assert "warning" not in mixed.stdout, mixed.stdout  # (on stderr: stdout is the table, for scripts)
    warnings = [line for line in mixed.stderr.splitlines() if line.startswith("warning: ")]
    assert any("entrypoints differ" in w and SLEEPY in w and ACCURACY in w for w in warnings), mixed.stderr
    assert any("did not succeed" in w and "crash-d (failed)" in w for w in warnings), mixed.stderr


# --------------------------------------------------------------------------- 4: the queue's GPU bars


def test_the_queue_labels_gpu_bars_with_run_names(live_server, client, clean_queue):
    rec = client.submit(_spec("bar-label", vram=1000, episodes=1, sleep_s=60))
    wait_state(client, rec["id"], states={"running"}, timeout=60)
    proc = cli(live_server, "queue")
    assert proc.returncode == 0, proc.stderr
    (bar,) = [line for line in proc.stdout.splitlines() if line.startswith("GPU") and "runs:" in line]
    assert "runs: bar-label:1000" in bar and rec["id"] not in bar


# --------------------------------------------------------------------------- 5: status's metric names


def test_status_keeps_long_metric_names_apart_from_their_values(live_server, client, clean_queue):
    rec = client.submit(_spec("toy", entrypoint=ACCURACY, episodes=3))
    assert wait_state(client, rec["id"], timeout=60)["state"] == "succeeded"
    proc = cli(live_server, "status", rec["id"])
    assert proc.returncode == 0, proc.stderr
    metric_lines = [line for line in proc.stdout.splitlines() if line.startswith("metric ")]
    assert {line.split()[1] for line in metric_lines} == {"accuracy", "answer_length"}, proc.stdout
    # One column for the values: where each begins.
    starts = {len(line) - len(line.split(None, 2)[2]) for line in metric_lines}
    assert len(starts) == 1, proc.stdout


# --------------------------------------------------------------------------- 6: cancel


def test_cancel_says_what_it_did(live_server, client, clean_queue):
    running = client.submit(_spec("long", vram=1000, episodes=1, sleep_s=60))
    wait_state(client, running["id"], states={"running"}, timeout=60)
    proc = cli(live_server, "cancel", running["id"])
    assert proc.returncode == 0, proc.stderr
    assert "cancelling" in proc.stdout and " running" not in proc.stdout, proc.stdout

    blocker = client.submit(_blocking(_spec("blocker", episodes=1, sleep_s=60)))
    wait_state(client, blocker["id"], states={"running"}, timeout=60)
    queued = client.submit(_spec("waiting", vram=1000))
    proc = cli(live_server, "cancel", queued["id"])
    assert proc.returncode == 0, proc.stderr
    assert "cancelled: cancelled with jupyter evalsched cancel while queued" in proc.stdout


def test_a_sweeps_cancel_lists_its_running_runs_as_cancelling(live_server, client, clean_queue):
    sweep = client.submit_sweep(_spec("sw", vram=1000, episodes=1, sleep_s=60), {"k": [1, 2]})
    for rec in sweep["runs"]:
        wait_state(client, rec["id"], states={"running"}, timeout=60)
    proc = cli(live_server, "cancel", sweep["id"])
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == 2 and all("cancelling" in line and " running" not in line for line in lines), proc.stdout


# --------------------------------------------------------------------------- 7: logs -f


def test_logs_follow_says_why_a_run_is_queued_and_exits_with_its_verdict(live_server, client, clean_queue):
    blocker = client.submit(_blocking(_spec("the-blocker", episodes=1, sleep_s=60)))
    wait_state(client, blocker["id"], states={"running"}, timeout=60)
    waiting = client.submit(_spec("waits", vram=1000))
    follower = subprocess.Popen(
        [sys.executable, "-m", "jupyter_evalsched.cli", "logs", waiting["id"], "-f"],
        env=cli_env(live_server),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines: queue.Queue[str | None] = queue.Queue()

    def read_stderr() -> None:
        for line in follower.stderr:
            lines.put(line)
        lines.put(None)

    reader = threading.Thread(target=read_stderr, daemon=True)
    reader.start()
    try:
        first = lines.get(timeout=60)  # the queued note comes before anything else
        assert first is not None and first.startswith(f"(run {waiting['id']} is queued: "), first
        assert "the-blocker" in first, first
        client.cancel(blocker["id"])
        assert follower.wait(timeout=90) == 0
    finally:
        if follower.poll() is None:
            follower.kill()
            follower.wait()
    reader.join(30)
    rest = []
    while (line := lines.get(timeout=5)) is not None:
        rest.append(line)
    # Said once, and again only when it changed.
    said = [first] + [line for line in rest if "is queued" in line]
    assert all(x != y for x, y in zip(said, said[1:], strict=False)), said

    crashed = client.submit({**_spec("crashes", entrypoint=CRASH), "params": {"how": "exception"}})
    assert wait_state(client, crashed["id"], timeout=60)["state"] == "failed"
    proc = cli(live_server, "logs", crashed["id"], "-f")
    assert proc.returncode == 1, proc.stderr
    assert f"run {crashed['id']} failed" in proc.stderr
    # Without -f, `logs` prints what there is: 0.
    assert cli(live_server, "logs", crashed["id"]).returncode == 0
