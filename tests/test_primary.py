"""One scheduler per host (#9): several `jupyter server` processes of one user, one primary,
secondaries that delegate, failover on kill -9; VRAM held by processes we do not manage."""

from __future__ import annotations

import asyncio
import errno
import fcntl
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil
import pytest
from raw_http import post_request, send
from tornado import httpserver, netutil, web
from tornado.iostream import StreamClosedError
from waiting import async_wait_until, wait_until

from jupyter_evalsched.client import EvalSchedClient, EvalSchedError, LocalServer

SLEEPY = "jupyter_evalsched.examples.basic:sleepy"
GATE = f"{Path(__file__).resolve().parent / 'evals_observed.py'}:gate"  # runs until the test opens it
FAST = [
    "--EvalSchedApp.cancel_grace_s=2.0",
    "--EvalSchedApp.reconcile_interval_s=0.3",
    "--EvalSchedApp.progress_interval_s=0.05",
]


def psutil_alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def run(vram, episodes=1, sleep_s=0.02, **kw):
    return {
        "entrypoint": SLEEPY,
        "episodes": episodes,
        "params": {"sleep_s": sleep_s},
        "cwd": "/",
        "scheduling": {"marginal_vram_mb": vram},
        **kw,
    }


def final(client, run_id, timeout=30):
    return wait_until(
        lambda: (lambda r: r if r["state"] in ("succeeded", "failed", "cancelled", "aborted") else None)(
            client.get(run_id)
        ),
        timeout,
    )


@pytest.mark.slow  # a server started, killed or restarted: CI runs it with -m slow (docs/install.md: the default suite stays within ten minutes)
def test_two_servers_one_queue_and_failover(tmp_path):
    # Each LocalServer has its own runtime directory: the runs directory alone binds them.
    runs = str(tmp_path / "runs")
    first = LocalServer(virtual_gpus="24000", runs_dir=runs, extra_args=FAST)
    second = LocalServer(virtual_gpus="24000", runs_dir=runs, extra_args=FAST)
    try:
        a, b = first.client(), second.client()
        sa, sb = a.request("GET", "status"), b.request("GET", "status")
        assert (sa["role"], sb["role"]) == ("primary", "secondary")
        assert sb["primary"]["pid"] == first.process.pid
        assert "token" not in json.dumps(sb["primary"])

        # Runs submitted to either server land in one queue and one ledger.
        long_a = a.submit(run(16000, episodes=1000, sleep_s=0.1))
        queued_b = b.submit(run(16000))
        dependent = b.submit(run(1000, depends_on=[queued_b["id"]]))
        wait_until(lambda: a.get(long_a["id"])["state"] == "running")
        # The second server neither killed the first one's run nor counts its VRAM again.
        pid = a.get(long_a["id"])["pid"]
        assert psutil_alive(pid) and a.get(long_a["id"])["state"] == "running"
        qa, qb = a.queue(), b.queue()
        assert [r["id"] for r in qa["queued"]] == [r["id"] for r in qb["queued"]] == [queued_b["id"], dependent["id"]]
        assert qa["ledger"] == qb["ledger"] and qb["ledger"]["devices"][0]["allocated_mb"] == 16000
        assert qb["primary"]["pid"] == first.process.pid
        assert qb["queued"][0]["reason"].startswith("waiting_vram")

        # The primary dies hard: the secondary takes over, aborts its in-flight run, runs the queue.
        first.process.send_signal(signal.SIGKILL)
        first.process.wait()
        t0 = time.monotonic()
        wait_until(lambda: b.request("GET", "status")["role"] == "primary", timeout=15, ignore=(EvalSchedError,))
        took = time.monotonic() - t0
        # Primary now; its scheduler answers once recovery has read the runs directory.
        wait_until(lambda: b.request("GET", "status").get("started"), timeout=15, ignore=(EvalSchedError,))
        assert took < 5, f"failover took {took:.1f} s"
        assert b.get(long_a["id"])["state"] == "aborted"
        assert final(b, queued_b["id"])["state"] == "succeeded"
        assert final(b, dependent["id"])["state"] == "succeeded"
        assert b.queue()["primary"]["pid"] == second.process.pid
    finally:
        first.cleanup()
        second.cleanup()


@pytest.mark.slow  # a server started, killed or restarted: CI runs it with -m slow (docs/install.md: the default suite stays within ten minutes)
def test_secondary_forwards_errors_and_logs(tmp_path):
    runs = str(tmp_path / "runs")
    with (
        LocalServer(virtual_gpus="24000", runs_dir=runs, extra_args=FAST) as first,
        LocalServer(virtual_gpus="24000", runs_dir=runs, extra_args=FAST) as second,
    ):
        b = second.client()
        with pytest.raises(EvalSchedError) as err:
            b.submit(run(99999))
        assert err.value.status == 422 and "can never fit" in str(err.value)
        with pytest.raises(EvalSchedError) as err:
            b.get("no-such-run")
        assert err.value.status == 404
        rec = b.submit(run(0, episodes=2))
        assert final(b, rec["id"])["state"] == "succeeded"
        assert "score" in b.get(rec["id"])["summary"]["metrics"]
        events = b.events()
        try:
            first_event = next(iter(events))
            assert first_event["type"] == "snapshot" and first_event["queue"]["primary"]["pid"] == first.process.pid
        finally:
            events.close()
        # A queue view's limit reaches the primary, through REST and through the relayed socket.
        gate = b.submit(run(0, sleep_s=60))
        wait_until(lambda: b.get(gate["id"])["state"] == "running", timeout=15)  # not listed as starting
        held = [b.submit({**run(0), "depends_on": [gate["id"]]})["id"] for _ in range(3)]
        view = b.queue(limit=1)
        assert [r["id"] for r in view["queued"]] == held[:1] and view["queued_total"] == 3, view
        limited = b.events(queue_limit=2)
        try:
            snapshot = next(iter(limited))["queue"]
            assert [r["id"] for r in snapshot["queued"]] == held[:2] and snapshot["queued_total"] == 3
        finally:
            limited.close()
        b.cancel(gate["id"])


@pytest.mark.slow  # a server started, killed or restarted: CI runs it with -m slow (docs/install.md: the default suite stays within ten minutes)
def test_a_secondary_relays_a_models_stream_as_the_primary_sends_it(tmp_path):
    """The OpenAI routes through a secondary: a stream's first token reaches its client while the
    model is held before its second forward pass (the secondary used to read the primary's whole
    answer first, and to give up on one that took over 60 s), and the rest follows, ended by
    ``[DONE]``."""
    gate = tmp_path / "gate"
    with _primary_with_a_model_and_a_secondary(tmp_path, gate) as (first, second):
        conn, resp = _a_held_stream_through(first, second, gate)
        try:
            (gate / "hold-2").unlink()
            rest_of_it = resp.read().decode()
            assert rest_of_it.rstrip().endswith("data: [DONE]")
        finally:
            (gate / "hold-2").unlink(missing_ok=True)
            conn.close()


@contextmanager
def _primary_with_a_model_and_a_secondary(tmp_path: Path, gate: Path) -> Iterator[tuple[LocalServer, LocalServer]]:
    """Two servers on one runs directory: the first (the primary) with the gated tiny GPT-2."""
    runs = str(tmp_path / "runs")
    with (
        LocalServer(virtual_gpus="24000", runs_dir=runs, models=_gated_model(tmp_path, gate), extra_args=FAST) as first,
        LocalServer(virtual_gpus="24000", runs_dir=runs, extra_args=FAST) as second,
    ):
        yield first, second


def _gated_model(tmp_path: Path, gate: Path) -> list[dict]:
    """The models of a primary whose forward passes ``gate`` holds (testing:gated_causal_lm)."""
    from jupyter_evalsched.shared_models.tiny_lm import build_tiny_gpt2

    gate.mkdir()
    return [
        {
            "name": "gated",
            "loader": "jupyter_evalsched.shared_models.testing:gated_causal_lm",
            "model": build_tiny_gpt2(tmp_path / "tiny-gpt2"),
            "options": {"gate": str(gate)},
            "preload": True,
            "cpu_threads": 1,
        }
    ]


def _a_held_stream_through(first: LocalServer, second: LocalServer, gate: Path):
    """A completion stream asked of the secondary ``second``, whose first event has reached the
    client while ``first``, the primary, holds the model before its second forward pass."""
    import http.client

    assert second.client().request("GET", "status")["role"] == "secondary"
    wait_until(
        lambda: any(m["state"] == "loaded" for m in first.client().request("GET", "models")["models"]),
        timeout=120,
    )
    (gate / "hold-2").touch()
    url = second.url.split("://", 1)[1]
    host, _, rest = url.partition("/")
    conn = http.client.HTTPConnection(host, timeout=60)
    try:
        body = {"model": "gated", "prompt": "The cat", "max_tokens": 5, "temperature": 0, "stream": True}
        conn.request(
            "POST",
            "/" + rest + "evalsched/v1/completions",
            json.dumps(body),
            {"Authorization": f"Bearer {second.token}", "Content-Type": "application/json"},
        )
        resp = conn.getresponse()
        assert resp.status == 200 and resp.getheader("Content-Type").startswith("text/event-stream")
        assert resp.getheader("X-Evalsched-Primary") == str(first.process.pid)
        first_event = resp.readline()
        assert first_event.startswith(b"data: ") and json.loads(first_event[6:])["choices"][0]["text"]
        assert (gate / "calls").read_text().split() == ["1"]  # one pass made, the second held
    except BaseException:
        (gate / "hold-2").unlink(missing_ok=True)
        conn.close()
        raise
    return conn, resp


@pytest.mark.slow  # a server started, killed or restarted: CI runs it with -m slow (docs/install.md: the default suite stays within ten minutes)
def test_a_stream_the_primary_breaks_off_reaches_the_secondarys_client_as_an_error_and_incomplete(tmp_path):
    """The primary dies mid-stream: the secondary's client gets an error event, then a response
    that ends without its last chunk (the secondary used to end it well-formed, without
    ``[DONE]`` or an error: a whole, shorter answer to OpenAI's clients)."""
    import http.client

    gate = tmp_path / "gate"
    with _primary_with_a_model_and_a_secondary(tmp_path, gate) as (first, second):
        conn, resp = _a_held_stream_through(first, second, gate)
        try:
            first.process.kill()  # held before its second pass: nothing is released
            first.process.wait(timeout=60)
            lines = []
            while not any(line.startswith(b'data: {"error"') for line in lines):
                line = resp.readline()  # (a clean end would be b"" here)
                assert line, f"the stream ended cleanly, without an error event: {lines}"
                lines.append(line)
            error = json.loads(lines[-1][6:])["error"]
            assert error["type"] == "server_error" and f"pid {first.process.pid}" in error["message"], error
            assert not any(b"[DONE]" in line for line in lines), lines
            # ... and no terminating chunk: http.client sees the response end early (a reset,
            # should the kernel send one, says the same).
            with pytest.raises((http.client.IncompleteRead, ConnectionResetError)):
                rest = resp.read()
                pytest.fail(f"the stream ended cleanly after its error: {rest!r}")
            log = Path(second.log_path).read_text(errors="replace")
            assert "broke off its answer" in log and "Traceback" not in log, second.log_tail()
        finally:
            (gate / "hold-2").unlink(missing_ok=True)  # (a model host the kill left behind ends)
            conn.close()


class PasswordOnlyServer(LocalServer):
    """A server its users reach with a password only: no token is accepted."""

    def _wait_ready(self, runtime_dir: str, timeout: float) -> str:
        from jupyter_evalsched.client.discovery import normalize_base_url, read_server_file

        path = os.path.join(runtime_dir, f"jpserver-{self.process.pid}.json")
        info = wait_until(lambda: read_server_file(path), timeout, message="the server file")
        wait_until(lambda: (Path(self.runs_dir) / ".evalsched-primary.json").exists(), timeout)
        return normalize_base_url(info["url"])


@pytest.mark.slow  # a server started, killed or restarted: CI runs it with -m slow (docs/install.md: the default suite stays within ten minutes)
def test_a_secondary_reaches_a_primary_whose_users_log_in_with_a_password(tmp_path):
    from jupyter_server.auth import passwd

    runs = str(tmp_path / "runs")
    password_only = [
        *FAST,
        "--ServerApp.identity_provider_class=jupyter_server.auth.identity.PasswordIdentityProvider",
        f"--PasswordIdentityProvider.hashed_password={passwd('a long passphrase')}",
        "--PasswordIdentityProvider.token=",
    ]
    with (
        PasswordOnlyServer(virtual_gpus="24000", runs_dir=runs, extra_args=password_only) as first,
        LocalServer(virtual_gpus="24000", runs_dir=runs, extra_args=FAST) as second,
    ):
        with pytest.raises(EvalSchedError) as refused:
            EvalSchedClient(first.url, first.token).queue()  # its users' door is closed to tokens
        assert refused.value.status == 403
        b = second.client()
        assert b.request("GET", "status")["role"] == "secondary"
        rec = b.submit(run(1000, episodes=2))
        assert final(b, rec["id"])["state"] == "succeeded"
        assert b.queue()["primary"]["pid"] == first.process.pid


@pytest.fixture
def evalsched_config():
    return {"virtual_gpus": [24000], "promotion_interval_s": 0.1}


# ----------------------------------------------------------------------------- the runs directory's lock


async def test_a_deleted_advertisement_is_written_again(api, evalsched, runs_dir):
    info = runs_dir / ".evalsched-primary.json"
    first = json.loads(info.read_text())
    info.unlink()
    await async_wait_until(info.exists, timeout=5)
    again = json.loads(info.read_text())
    assert again["pid"] == first["pid"] == os.getpid() and again["secret"] == first["secret"]
    assert oct(info.stat().st_mode & 0o777) == "0o600"


async def test_a_moved_runs_directory_suspends_its_primary_which_writes_nothing_at_the_old_path(
    api, evalsched, jp_serverapp, runs_dir
):
    """The runs directory is renamed under its primary: the server stops scheduling (503 and
    status ``unavailable``, saying where the directory went and what to do); its running run ends
    (it writes by path too), and nothing is ever written at the old path: neither a new runs
    directory nor, once someone copies it back there, anything in the copy (not the ended run's
    record)."""
    gate = runs_dir.with_name("gate")
    spec = {"entrypoint": GATE, "episodes": 1, "params": {"gate": str(gate)}, "cwd": "/"}
    code, rec = await api("POST", "runs", {**spec, "scheduling": {"marginal_vram_mb": 8000}})
    assert code == 201, rec
    started = await async_wait_until(lambda: _then(_record(api, rec["id"]), lambda r: r["pid"] and r), timeout=5)
    old = runs_dir.with_name("runs-old")
    os.rename(runs_dir, old)

    async def unavailable():
        code, status = await api("GET", "status")
        return status if code == 200 and status["role"] == "unavailable" else None

    status = await async_wait_until(unavailable, timeout=10)
    assert f"was moved to {old}" in status["error"] and f"EvalSchedApp.runs_dir={old}" in status["error"], status
    for method, path, body in (("GET", "runs", None), ("POST", "runs", run(0)), ("GET", f"runs/{rec['id']}", None)):
        code, err = await api(method, path, body)
        assert code == 503 and f"was moved to {old}" in err["message"], (method, path, code, err)
    assert not runs_dir.exists()
    # Someone copies it back to the old path: a write by path would land in the copy.
    shutil.copytree(old, runs_dir, symlinks=True)
    copied = sorted(p.name for p in runs_dir.iterdir())
    job = runs_dir / rec["id"] / "job.json"
    record_copied = job.read_bytes()
    # The run ends (its terminal record is a write the server would make) and role checks go by.
    gate.touch()
    await async_wait_until(lambda: not psutil_alive(started["pid"]), timeout=30)
    app = jp_serverapp.extension_manager.extension_points["jupyter_evalsched"].app
    checks = app._watch.callback_time / 1000
    await asyncio.sleep(3 * checks + 1)  # (several role checks and reconciles: a negative check)
    assert sorted(p.name for p in runs_dir.iterdir()) == copied
    assert job.read_bytes() == record_copied and json.loads(record_copied)["state"] == "running"
    code, status = await api("GET", "status")
    assert status["role"] == "unavailable" and app.role.is_primary  # the moved directory stays locked


@pytest.fixture
def held_lock(runs_dir):
    """The runs directory's lock, held by the test: the server under test is a secondary."""
    runs_dir.mkdir(mode=0o700, parents=True)
    fd = os.open(runs_dir, os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    yield runs_dir
    os.close(fd)


@pytest.fixture
def stand_in_primary(held_lock, jp_asyncio_loop):
    """A listener posing as the primary's internal one; it records what reaches it."""
    seen: list[dict] = []

    class Capture(web.RequestHandler):
        def get(self, path):
            seen.append({"path": path, "authorization": self.request.headers.get("Authorization")})
            self.write({"queued": [], "running": [], "ledger": {"devices": [], "cpu_slots": {}}, "primary": None})

    server, info = _advertised_stand_in(held_lock, web.Application([(r"/(.*)", Capture)]))
    yield info, seen
    server.stop()


def _advertised_stand_in(runs_dir: Path, app: web.Application) -> tuple[httpserver.HTTPServer, Path]:
    """``app`` served on a loopback port and advertised in ``runs_dir`` as its primary (by this
    process, which serves it: a secondary forwards only to a live advertiser)."""
    sockets = netutil.bind_sockets(0, "127.0.0.1")
    server = httpserver.HTTPServer(app)
    server.add_sockets(sockets)
    port = sockets[0].getsockname()[1]
    info = runs_dir / ".evalsched-primary.json"
    advert = {"url": "http://x/", "internal_url": f"http://127.0.0.1:{port}/", "secret": "s3cret",
              "pid": os.getpid(), "hostname": "h", "runs_dir": str(runs_dir), "since": time.time()}  # fmt: skip
    fd = os.open(info, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(advert, f)
    return server, info


async def test_a_secondary_forwards_only_to_an_advertisement_of_its_own_user(stand_in_primary, api):
    info, seen = stand_in_primary
    code, _ = await api("GET", "queue")
    assert code == 200 and seen[-1] == {"path": "evalsched/queue", "authorization": "token s3cret"}
    forwarded = len(seen)

    os.chown(info, 65534, 65534)  # another user's advertisement
    code, err = await api("GET", "queue")
    assert code == 503 and "owned by uid 65534, not by you" in err["message"], err
    os.chown(info, os.getuid(), os.getgid())

    os.chmod(info, 0o644)
    code, err = await api("GET", "queue")
    assert code == 503 and "mode 600" in err["message"], err
    os.chmod(info, 0o600)

    target = info.with_name("elsewhere.json")
    os.rename(info, target)
    os.symlink(target, info)
    code, err = await api("GET", "queue")
    assert code == 503 and "symbolic link" in err["message"], err
    code, status = await api("GET", "status")
    assert status["role"] == "secondary" and "symbolic link" in status["error"]
    assert len(seen) == forwarded, "a request was forwarded to an advertisement that is not to be trusted"


@pytest.fixture
def lock_held_by_a_child(runs_dir):
    """The runs directory's lock, held by a process of this user other than the test's (as an
    older version's primary holds it): the server under test is a secondary."""
    runs_dir.mkdir(mode=0o700, parents=True)
    code = (
        "import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_RDONLY | os.O_DIRECTORY); "
        "fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB); print('held', flush=True); time.sleep(600)"
    )
    holder = subprocess.Popen([sys.executable, "-c", code, str(runs_dir)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        yield holder
    finally:
        holder.kill()
        holder.wait()


async def test_an_advertisement_without_a_start_is_forwarded_to_only_where_its_pid_holds_the_lock(
    lock_held_by_a_child, api, runs_dir
):
    """An advertisement an older version wrote names its primary by pid alone: once that primary
    died, a later process of this user may have its pid, and the primary's port is free for any
    user to listen on. Such an advertisement is forwarded to only while its pid holds the runs
    directory's lock: this process (alive, this user's) does not, and is refused with a 503 that
    says why; the process that holds it is forwarded to."""
    seen: list[str] = []

    class Capture(web.RequestHandler):
        def get(self, path):
            seen.append(path)
            self.write({"queued": [], "running": [], "ledger": {"devices": [], "cpu_slots": {}}, "primary": None})

    server, info = _advertised_stand_in(runs_dir, web.Application([(r"/(.*)", Capture)]))
    try:
        advert = json.loads(info.read_text())
        assert "start" not in advert and advert["pid"] == os.getpid()
        code, err = await api("GET", "queue")
        assert code == 503 and f"({os.getpid()}) does not hold the lock" in err["message"], err
        assert seen == [], "a request was forwarded to a pid that is not the primary's"

        # (a new file, not rewritten in place: the advertisement is cached by its inode and mtime)
        fresh = info.with_name("fresh.json")
        fd = os.open(fresh, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({**advert, "pid": lock_held_by_a_child.pid}, f)
        os.replace(fresh, info)
        code, _ = await api("GET", "queue")
        assert code == 200 and seen == ["evalsched/queue"]
    finally:
        server.stop()


NOBODY = 65534


@pytest.fixture
def listener_of_another_user(held_lock):
    """A loopback listener of uid 65534 (root starts it), advertised as the primary's internal
    one by this process (alive, holding the lock): what a primary's freed port becomes when
    another user listens there between a secondary's check of the advertisement and its connect.
    It answers nothing; for each connection it prints how many bytes it was sent."""
    if os.getuid() != 0 or not os.access("/usr/bin/python3", os.X_OK):
        pytest.fail("needs root and /usr/bin/python3, to listen as another user (as this project's CI has)")
    from jupyter_evalsched.primary import _start_ticks

    code = (
        "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen(8); "
        "print(s.getsockname()[1], flush=True)\n"
        "while True:\n    c, _ = s.accept(); print(len(c.recv(65536)), flush=True); c.close()"
    )
    listener = subprocess.Popen(
        ["/usr/bin/python3", "-c", code], stdout=subprocess.PIPE, text=True, user=NOBODY, cwd="/"
    )
    try:
        port = listener.port = int(listener.stdout.readline())
        advert = {"url": "http://x/", "internal_url": f"http://127.0.0.1:{port}/", "secret": "s3cret",
                  "pid": os.getpid(), "hostname": "h", "runs_dir": str(held_lock), "since": time.time(),
                  "start": _start_ticks("self")}  # fmt: skip
        fd = os.open(held_lock / ".evalsched-primary.json", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(advert, f)
        yield listener
    finally:
        listener.kill()
        listener.wait()


async def test_a_secondary_sends_nothing_to_a_socket_of_another_user_at_the_primarys_port(
    listener_of_another_user, api, v1_fetch
):
    """The advertisement is checked before a forward, the connection made after (turns of the
    loop, an address look-up in a thread): a primary gone meanwhile leaves its port to whoever
    listens there first. The socket a forward reaches is checked before a byte is sent: another
    user's is a 503 that says so, for a REST forward and an OpenAI route's relay alike, and it
    is sent nothing (neither the request nor the link's secret)."""
    code, err = await api("GET", "queue")
    assert code == 503 and f"is uid {NOBODY}'s, not this user's" in err["message"], err
    code, _, text = await v1_fetch({"model": "m", "prompt": "a prompt of the user's"})
    assert code == 503 and f"is uid {NOBODY}'s, not this user's" in json.loads(text)["error"]["message"], text
    for _ in range(2):  # (one line per connection, once the listener has read it to its end)
        assert await asyncio.to_thread(listener_of_another_user.stdout.readline) == "0\n"


async def test_the_events_relay_sends_nothing_to_a_socket_of_another_user_at_the_primarys_port(
    listener_of_another_user, jp_ws_fetch, evalsched
):
    """The events WebSocket of a secondary relays the primary's: its connection is checked as a
    forward's, before the upgrade request (with the link's secret) is sent. Another user's
    socket closes the client's WebSocket with a reason that says so, and is sent nothing."""
    ws = await jp_ws_fetch("evalsched", "events")
    assert await ws.read_message() is None
    assert await asyncio.to_thread(listener_of_another_user.stdout.readline) == "0\n"  # (bytes it was sent)
    assert ws.close_code == 1011 and f"is uid {NOBODY}'s, not this user's" in (ws.close_reason or ""), ws.close_reason


@pytest.mark.parametrize("table", ["sock_diag", "/proc/net/tcp"])
def test_the_owner_of_a_connections_other_end_is_read_from_the_kernel(listener_of_another_user, monkeypatch, table):
    """``peer_uid``: the uid of the socket a loopback connection reached (before it is accepted:
    the listener's), by sock_diag, else (netlink refused) from /proc/net/tcp."""
    import socket

    from jupyter_evalsched import internal

    if table == "/proc/net/tcp":

        def refused(*args):
            raise PermissionError("netlink refused")

        monkeypatch.setattr(internal, "_diag_uid", refused)
    ours = socket.create_server(("127.0.0.1", 0))
    with ours, socket.create_connection(ours.getsockname()) as to_ours:
        assert internal.peer_uid(to_ours) == os.getuid()
    with socket.create_connection(("127.0.0.1", listener_of_another_user.port)) as to_theirs:
        assert internal.peer_uid(to_theirs) == NOBODY


def test_a_sock_diag_error_falls_back_to_proc_net_tcp(monkeypatch):
    """A kernel without tcp_diag answers every sock_diag request with an error (ENOENT, as for
    no such socket): ``peer_uid`` then reads /proc/net/tcp, which tells. (The netlink answer is
    faked: this host's kernel has tcp_diag.)"""
    import socket
    import struct

    from jupyter_evalsched import internal

    class WithoutTcpDiag:
        def __init__(self, *args):
            self.request = b""

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def settimeout(self, seconds):
            pass

        def send(self, data):
            self.request = data

        def recv(self, size):  # nlmsghdr (NLMSG_ERROR) + nlmsgerr (-ENOENT, the request's header)
            return struct.pack("=IHHII", 36, 2, 0, 1, 0) + struct.pack("=i", -errno.ENOENT) + self.request[:16]

    real_socket = socket.socket
    ours = socket.create_server(("127.0.0.1", 0))
    with ours, socket.create_connection(ours.getsockname()) as to_ours:
        monkeypatch.setattr(
            internal.socket,
            "socket",
            lambda family=-1, *a, **k: (
                WithoutTcpDiag() if family == socket.AF_NETLINK else real_socket(family, *a, **k)
            ),
        )
        assert internal.peer_uid(to_ours) == os.getuid()
        with pytest.raises(FileNotFoundError):
            internal._diag_uid(to_ours.getsockname()[:2], to_ours.getpeername()[:2])


class HeldAnswers:
    """What a stand-in primary that holds its answers saw: each answer waits for ``release``
    (a stream's first event is sent at once); ``gone`` is set when a relay's connection closes
    before its answer was written, ``ended`` when an answer was written (or failed to be)."""

    def __init__(self) -> None:
        self.asked = asyncio.Event()
        self.release = asyncio.Event()
        self.gone = asyncio.Event()
        self.ended = asyncio.Event()
        self.server: httpserver.HTTPServer | None = None


@pytest.fixture
def holding_primary(held_lock, jp_asyncio_loop):
    """A stand-in primary for the OpenAI routes whose answers wait for ``release``."""
    held = HeldAnswers()

    class Held(web.RequestHandler):
        async def post(self, path):
            stream = json.loads(self.request.body).get("stream")
            held.asked.set()
            if stream:
                self.set_header("Content-Type", "text/event-stream")
                self.write('data: {"choices": [{"index": 0, "text": "The"}]}\n\n')
                await self.flush()
            await held.release.wait()
            try:
                self.write("data: [DONE]\n\n" if stream else {"choices": [{"index": 0, "text": "The end"}]})
                await self.flush()
            except StreamClosedError:
                pass  # (the relay went away: nobody to answer)
            finally:
                held.ended.set()

        def on_connection_close(self):
            if not held.ended.is_set():
                held.gone.set()

    held.server, _ = _advertised_stand_in(held_lock, web.Application([(r"/(.*)", Held)]))
    yield held
    held.release.set()
    held.server.stop()


@pytest.fixture
def server_log(jp_serverapp):
    """The records the server under test and tornado log, kept by a handler on both loggers
    (tornado's are children of Jupyter's, whose propagation to the root, and so to caplog, is
    pytest-jupyter's choice): a check of the log never passes for having seen nothing."""
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if not any(kept is record for kept in records):  # (tornado's propagate to Jupyter's)
                records.append(record)

    keep = Keep(logging.DEBUG)
    loggers = {logging.getLogger("tornado"), jp_serverapp.log}
    for logger in loggers:
        logger.addHandler(keep)
    yield records
    for logger in loggers:
        logger.removeHandler(keep)


async def _post_openai(port: int, base_url: str, token: str, body: dict):
    """A completions request sent raw (the test aborts its connection): (reader, writer)."""
    return await send(port, post_request(base_url, "evalsched/v1/completions", token, json.dumps(body)))


async def test_a_secondary_relays_the_openai_routes_answers_whole(holding_primary, server_log, v1_fetch):
    """The relay's own connection to the primary: a plain answer and a stream reach the client
    whole, with the primary's status and headers; a primary that does not answer is a 503."""
    holding_primary.release.set()
    code, headers, text = await v1_fetch({"model": "m", "prompt": "x"})
    assert code == 200 and headers["X-Evalsched-Primary"] == str(os.getpid()), (code, text)
    assert json.loads(text) == {"choices": [{"index": 0, "text": "The end"}]}
    code, headers, text = await v1_fetch({"model": "m", "prompt": "x", "stream": True})
    assert code == 200 and headers["Content-Type"].startswith("text/event-stream"), (code, text)
    assert text == 'data: {"choices": [{"index": 0, "text": "The"}]}\n\ndata: [DONE]\n\n'
    assert holding_primary.server is not None
    holding_primary.server.stop()  # (no longer listening)
    code, headers, text = await v1_fetch({"model": "m", "prompt": "x"})
    error = json.loads(text)["error"]
    assert code == 503 and f"(pid {os.getpid()}) is not answering" in error["message"], (code, text)
    loud = [r for r in server_log if r.levelno >= logging.ERROR or r.exc_info]
    assert not loud, [f"{r.levelname} {r.getMessage()}" for r in loud]


@pytest.fixture
def v1_fetch(jp_fetch, evalsched):
    """``await v1_fetch(body)``: a completions request -> (status, headers, text)."""

    async def fetch(body: dict):
        resp = await jp_fetch("evalsched", "v1", "completions", method="POST", body=json.dumps(body), raise_error=False)
        return resp.code, resp.headers, resp.body.decode()

    return fetch


async def test_a_client_gone_mid_stream_through_a_secondary_ends_the_relay_quietly(
    holding_primary, server_log, jp_fetch, evalsched, jp_serverapp, jp_http_port, jp_base_url, monkeypatch
):  # (jp_fetch: with which the server listens)
    """The secondary's client disconnects after a stream's first event; the primary's next part
    then meets no client: the relay ends without an ERROR or a traceback in the server's log (it
    used to raise in tornado's streaming callback, which tornado logs as an uncaught exception)."""
    from jupyter_evalsched import openai_api

    finished = asyncio.Event()
    on_finish = openai_api.OpenAIHandler.on_finish

    def observed_finish(handler):
        on_finish(handler)
        finished.set()

    monkeypatch.setattr(openai_api.OpenAIHandler, "on_finish", observed_finish)
    body = {"model": "m", "prompt": "x", "stream": True}
    reader, writer = await _post_openai(jp_http_port, jp_base_url, jp_serverapp.identity_provider.token, body)
    head = await asyncio.wait_for(reader.readuntil(b"data: "), 60)
    assert b"200 OK" in head and f"X-Evalsched-Primary: {os.getpid()}".encode() in head, head
    writer.transport.abort()  # gone, mid-stream
    holding_primary.release.set()  # the primary's next part, for nobody
    await async_wait_until(holding_primary.ended.is_set, timeout=60, message="the primary's answer is written")
    await async_wait_until(finished.is_set, timeout=60, message="the secondary's request is over")
    loud = [r for r in server_log if r.levelno >= logging.ERROR or r.exc_info]
    assert not loud, [f"{r.levelname} {r.getMessage()}" for r in loud]


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
async def test_a_client_gone_through_a_secondary_closes_its_request_to_the_primary(
    holding_primary, server_log, jp_fetch, evalsched, jp_serverapp, jp_http_port, jp_base_url, stream
):
    """A client of the secondary disconnects while the primary still makes its answer: the
    secondary closes its own connection to the primary at once (whose handler then cancels the
    request in its model host), not after the answer (plain) or at its next part (a stream)."""
    body = {"model": "m", "prompt": "x", "stream": stream}
    reader, writer = await _post_openai(jp_http_port, jp_base_url, jp_serverapp.identity_provider.token, body)
    if stream:
        await asyncio.wait_for(reader.readuntil(b"data: "), 60)
    else:
        await asyncio.wait_for(holding_primary.asked.wait(), 60)
    writer.transport.abort()
    # (liveness: the answer is held meanwhile, and would be until the test ends)
    await async_wait_until(holding_primary.gone.is_set, timeout=60, message="the primary sees its relay gone")
    assert not holding_primary.ended.is_set()
    loud = [r for r in server_log if r.levelno >= logging.ERROR or r.exc_info]
    assert not loud, [f"{r.levelname} {r.getMessage()}" for r in loud]


@pytest.fixture
def shared_runs_dir(runs_dir):
    runs_dir.mkdir(parents=True)
    os.chmod(runs_dir, 0o770)


async def test_a_runs_directory_writable_by_others_is_refused_with_the_fix(shared_runs_dir, api, runs_dir):
    code, err = await api("GET", "queue")
    assert code == 503 and "writable by other users" in err["message"] and "chmod go-w" in err["message"], err
    code, status = await api("GET", "status")
    assert status["role"] == "unavailable" and "writable by other users" in status["error"]
    assert not (runs_dir / ".evalsched-primary.json").exists()


@pytest.fixture
def foreign_runs_dir(runs_dir):
    runs_dir.mkdir(parents=True, mode=0o700)
    os.chown(runs_dir, 65534, 65534)


async def test_a_runs_directory_of_another_user_is_refused(foreign_runs_dir, api, runs_dir):
    code, err = await api("GET", "runs")
    assert code == 503 and "owned by uid 65534, not by you" in err["message"], err
    assert list(runs_dir.iterdir()) == []  # nothing written there


@pytest.fixture
def runs_dir_is_a_file(runs_dir):
    runs_dir.parent.mkdir(parents=True, exist_ok=True)
    runs_dir.write_text("not a directory")


async def test_an_unusable_runs_directory_is_a_503_that_says_why(runs_dir_is_a_file, api):
    code, err = await api("POST", "runs", run(0))
    assert code == 503 and "is not a directory" in err["message"], err


@pytest.fixture
def failing_start(monkeypatch):
    from jupyter_evalsched.scheduler.service import Scheduler

    async def broken(self):
        raise RuntimeError("recovery exploded")

    monkeypatch.setattr(Scheduler, "start", broken)


async def test_a_primary_whose_scheduler_cannot_start_releases_the_lock(failing_start, api, runs_dir):
    code, err = await api("GET", "queue")
    assert code == 503 and "RuntimeError: recovery exploded" in err["message"], err
    fd = os.open(runs_dir, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # free: another server could take over
    finally:
        os.close(fd)


async def _device(api) -> dict:
    code, ledger = await api("GET", "ledger")
    return ledger["devices"][0]


async def _record(api, run_id: str) -> dict:
    code, rec = await api("GET", f"runs/{run_id}")
    return rec


async def test_unmanaged_vram_holds_back_a_run_until_it_goes(api, evalsched, plant_gpu_processes):
    plant_gpu_processes([{"pid": 999999, "gpu": 0, "used_mb": 10000, "name": "a notebook kernel"}])
    # The sweep (0.5 s here) reads the probe.
    dev = await async_wait_until(lambda: _then(_device(api), lambda d: d["unmanaged_mb"] == 10000 and d))
    assert (dev["unmanaged_mb"], dev["free_mb"]) == (10000, 14000)
    assert dev["unmanaged_processes"] == [
        {
            "pid": 999999,
            "gpu": 0,
            "used_mb": 10000,
            "name": "a notebook kernel",
            "kernel_id": None,
            "session_path": None,
            "lease_id": None,
        }
    ]
    code, rec = await api("POST", "runs", run(16000))
    assert code == 201
    rec = await _record(api, rec["id"])  # admission decided before the 201
    assert rec["state"] == "queued"
    assert "10000 MB held by processes outside the scheduler" in rec["reason"]
    plant_gpu_processes([])
    await async_wait_until(
        lambda: _then(_record(api, rec["id"]), lambda r: r["state"] in ("running", "succeeded")), timeout=5
    )


async def test_our_own_processes_are_never_counted_as_unmanaged(api, evalsched, plant_gpu_processes):
    code, rec = await api("POST", "runs", run(8000, episodes=40, sleep_s=0.05))
    rec = await async_wait_until(lambda: _then(_record(api, rec["id"]), lambda r: r["pid"] and r), timeout=5)
    # NVML would list our run with its real usage; it must not be counted a second time. A foreign
    # process beside it shows when the sweep has read the probe.
    plant_gpu_processes([{"pid": rec["pid"], "gpu": 0, "used_mb": 7000}, {"pid": 999999, "gpu": 0, "used_mb": 1000}])
    dev = await async_wait_until(lambda: _then(_device(api), lambda d: d["unmanaged_mb"] and d))
    assert (dev["allocated_mb"], dev["unmanaged_mb"], dev["free_mb"]) == (8000, 1000, 15000)
    await api("POST", f"runs/{rec['id']}/cancel")


async def _then(awaitable, check):
    """``check(await awaitable)``: a predicate over an API answer, for async_wait_until."""
    return check(await awaitable)


@pytest.mark.slow  # a server started, killed or restarted: CI runs it with -m slow (docs/install.md: the default suite stays within ten minutes)
def test_a_server_restarted_on_the_moved_runs_directory_recovers_its_runs(tmp_path):
    """What the error says to do works: the server stopped on the moved directory, a server
    started with ``runs_dir`` set to its new path has its runs; the old path was never made again."""
    runs, moved = tmp_path / "runs", tmp_path / "moved"
    server = LocalServer(runs_dir=str(runs), extra_args=["--EvalSchedApp.promotion_interval_s=0.2"])
    try:
        c = server.client()
        rec = c.submit(run(0))
        wait_until(lambda: c.get(rec["id"])["state"] == "succeeded", timeout=30)
        os.rename(runs, moved)
        status = wait_until(
            lambda: _then_sync(c.request("GET", "status"), lambda s: s["role"] == "unavailable"), timeout=10
        )
        assert f"EvalSchedApp.runs_dir={moved}" in status["error"], status
        with pytest.raises(EvalSchedError) as err:
            c.get(rec["id"])
        assert err.value.status == 503 and f"was moved to {moved}" in err.value.message
        server.stop()
    finally:
        server.cleanup()
    assert not runs.exists()
    with LocalServer(runs_dir=str(moved)) as again:
        assert again.client().get(rec["id"])["state"] == "succeeded"


def _then_sync(value, check):
    return value if check(value) else None


@pytest.mark.parametrize("another_holds_the_runs_directory", [False, True])
def test_a_server_whose_settings_failed_part_way_takes_nothing_and_exits_on_sigterm(
    tmp_path, another_holds_the_runs_directory
):
    """A setting that fails part-way through the extension's settings (a SLURM section that does
    not parse) leaves it loaded without a scheduler, and jupyter_server starts and stops it all
    the same. It takes no runs directory, and the server exits on SIGTERM: its stop raised
    (no scheduler), the server's shutdown stopped there, and it ran on, as primary and as
    secondary alike."""
    runs, root = tmp_path / "runs", tmp_path / "root"
    runs.mkdir(mode=0o700)
    root.mkdir()
    config = tmp_path / "config.py"
    config.write_text(
        "c.ServerApp.jpserver_extensions = {'jupyter_evalsched': True}\n"
        f"c.EvalSchedApp.runs_dir = {str(runs)!r}\n"
        "c.EvalSchedApp.virtual_gpus = [24000]\n"
        "c.EvalSchedApp.slurm_enabled = True\n"
        "c.EvalSchedApp.slurm = {'partiton': 'gpu'}\n"  # (a typo: not a SLURM setting)
        f"c.ServerApp.root_dir = {str(root)!r}\n"
        "c.ServerApp.open_browser = False\n"
        "c.ServerApp.allow_root = True\n"
    )
    env = {
        **os.environ,
        "JUPYTER_RUNTIME_DIR": str(tmp_path / "runtime"),
        "JUPYTER_CONFIG_DIR": str(tmp_path / "jupyter-config"),
    }
    log = tmp_path / "server.log"
    holder = os.open(runs, os.O_RDONLY | os.O_DIRECTORY)
    try:
        if another_holds_the_runs_directory:
            fcntl.flock(holder, fcntl.LOCK_EX)
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "jupyter_server",
                    f"--config={config}",
                    "--port=0",
                    "--ServerApp.port_retries=0",
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
            )
        try:
            wait_until(lambda: b"is running at" in log.read_bytes() or proc.poll() is not None, timeout=60)
            assert proc.poll() is None, log.read_text()
            assert b"extension failed loading" in log.read_bytes()
            if not another_holds_the_runs_directory:
                fcntl.flock(holder, fcntl.LOCK_EX | fcntl.LOCK_NB)  # (raises if the server took it)
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pytest.fail(f"the server still runs 30 s after SIGTERM:\n{log.read_text()[-3000:]}")
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    finally:
        os.close(holder)


@pytest.mark.parametrize("offered", ["s3cret", "s3cre", "\xe9", "s3cr\xe9t", "", "\udce9"])
def test_the_internal_listener_takes_its_secret_alone_and_any_other_token_is_refused(offered):
    """A token with a character beyond ASCII raised TypeError in ``compare_digest``: a 500, with a
    traceback in the log, for any local user who sent one, where any other wrong token is a 403."""
    from types import SimpleNamespace

    from jupyter_evalsched.internal import SECONDARY_USER, SecretIdentityProvider

    provider = SecretIdentityProvider(secret="s3cret")
    handler = SimpleNamespace(request=SimpleNamespace(headers={"Authorization": f"token {offered}"}))
    user = provider.get_user(handler)
    assert (user.username if user else None) == (SECONDARY_USER if offered == "s3cret" else None)


def test_requests_go_only_to_a_primary_whose_process_still_runs(tmp_path):
    """A primary killed leaves its advertisement, and its loopback port free until a server takes
    over: a secondary forwarded to that port all the same, so any user of the host listening there
    was sent the requests (their specs, their prompts) and could answer them. Only the advertising
    process, alive (its pid and its start, in clock ticks after boot: no step of the wall clock
    moves it), is forwarded to; and a primary that stops removes its advertisement first."""
    from jupyter_evalsched.primary import HostRole, _start_ticks

    runs = tmp_path / "runs"
    runs.mkdir(mode=0o700)
    role = HostRole(runs)
    assert role.try_acquire()
    role.advertise("http://127.0.0.1:1/", "http://127.0.0.1:2/", "s3cret")
    assert role.forward_target() is not None and role.forward_target().pid == os.getpid()

    def advertised_by(pid: int, start: int | None) -> None:
        info = json.loads(role.info_path.read_text())
        role.info_path.write_text(json.dumps({**info, "pid": pid, "start": start}))

    gone = subprocess.Popen(["true"])
    gone.wait()
    advertised_by(gone.pid, 1)
    assert role.primary() is not None and role.forward_target() is None
    assert role.problem and f"({gone.pid}) is gone" in role.problem
    later = subprocess.Popen(["sleep", "30"])
    try:
        advertised_by(later.pid, _start_ticks(later.pid) - 1)  # another process given the same pid
        assert role.forward_target() is None
        advertised_by(later.pid, _start_ticks(later.pid))
        assert role.forward_target() is not None
        # An advertisement written before the start was in it (an older version's): its pid, alive
        # and this user's, is not proof enough (the primary died and its pid was given again)...
        advertised_by(later.pid, None)
        assert role.forward_target() is None and "does not hold the lock" in (role.problem or "")
        advertised_by(os.getpid(), None)  # ...unless that pid holds the runs directory's lock
        assert role.forward_target() is not None
    finally:
        later.kill()
        later.wait()
    role.advertise("http://127.0.0.1:1/", "http://127.0.0.1:2/", "s3cret")
    role.unadvertise()
    assert not role.info_path.exists() and role.is_primary  # (the lock is still held)
    # A suspension's runs directory was moved: the advertisement goes from where it now is (a
    # server started on the new path is a secondary there, and would forward to the freed port).
    role.advertise("http://127.0.0.1:1/", "http://127.0.0.1:2/", "s3cret")
    moved = tmp_path / "moved"
    os.rename(runs, moved)
    assert not role.still_holds() and (moved / role.info_path.name).exists()
    role.unadvertise()
    assert not (moved / role.info_path.name).exists()
    role.release()


def test_the_lock_of_an_advertisement_without_a_start_is_the_runs_directorys_own(tmp_path):
    """``_holds_flock`` (an older version's advertisement) asks whether the pid holds the lock on
    the runs directory itself, not on some file with its inode number: a directory of another
    file system (here two fresh tmpfs mounts, whose first directories have the same inode
    number) locked by the pid is not the runs directory's lock. In a mount namespace of its own,
    which goes with the process."""
    if os.getuid() != 0 or shutil.which("unshare") is None or shutil.which("mount") is None:
        pytest.fail("needs root, unshare and mount, to mount two file systems (as this project's CI has)")
    code = (
        "import fcntl, json, os, subprocess, sys\n"
        "from jupyter_evalsched.primary import _holds_flock\n"
        "dirs = []\n"
        "for name in ('runs-fs', 'other-fs'):\n"
        "    mount = os.path.join(sys.argv[1], name); os.mkdir(mount)\n"
        "    subprocess.run(['mount', '-t', 'tmpfs', '-o', 'mode=700', 'tmpfs', mount], check=True)\n"
        "    dirs.append(os.path.join(mount, 'd')); os.mkdir(dirs[-1], 0o700)\n"
        "runs, other = dirs\n"
        "same_inode = os.stat(runs).st_ino == os.stat(other).st_ino\n"
        "fd = os.open(other, os.O_RDONLY | os.O_DIRECTORY); fcntl.flock(fd, fcntl.LOCK_EX)\n"
        "other_locked = _holds_flock(os.getpid(), runs)\n"
        "fd = os.open(runs, os.O_RDONLY | os.O_DIRECTORY); fcntl.flock(fd, fcntl.LOCK_EX)\n"
        "print(json.dumps([same_inode, other_locked, _holds_flock(os.getpid(), runs)]))\n"
    )
    done = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", sys.executable, "-c", code, str(tmp_path)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0 and "unshare failed" in done.stderr:
        pytest.fail(f"no mount namespace here: {done.stderr.strip()}")
    assert done.returncode == 0, done.stderr
    same_inode, other_locked, runs_locked = json.loads(done.stdout)
    if not same_inode:
        pytest.fail(
            "this kernel numbers tmpfs inodes across mounts: no two directories share one (the case is not made)"
        )
    assert not other_locked, (
        "a lock on another file system's directory of the same inode number was taken for the runs directory's"
    )
    assert runs_locked
