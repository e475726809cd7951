"""The CLI's discovery where a review found it wanting: a runtime file's token went to any
listener at the same port of another loopback address (another user's, on ``[::1]`` or
``127.0.0.2``); every CLI call probed every listed server with its own token, one after another
(a stale file's port is anyone's; a hung server added 2 s each); ``compare``'s warnings were on
stdout, and a run deleted meanwhile failed the whole command. Each through the real CLI."""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from jupyter_evalsched.client.socket_table import Listener, listening_uids, read_listeners

try:
    from .live_server import (
        CRASH,
        SLEEPY,
        clean_queue,
        cli,
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
        client,
        live_server,
        runtime_dir,
        server_file,
        wait_state,
        wait_until,
    )

NOBODY = 65534


def _port(server) -> int:
    return int(server.url.rsplit(":", 1)[1].strip("/"))


@pytest.fixture
def live_pids() -> Iterator[list[int]]:
    """Live processes whose pids runtime files may say (a listed server's pid must live)."""
    sleepers: list[subprocess.Popen] = []

    class Pids(list):
        def new(self) -> int:
            sleepers.append(subprocess.Popen(["sleep", "300"]))
            return sleepers[-1].pid

    yield Pids()
    for sleeper in sleepers:
        sleeper.kill()
        sleeper.wait()


# --------------------------------------------------------------------------- 1: another loopback address


def _listener_of_another_user(host: str, port: int) -> subprocess.Popen:
    """A listener of uid 65534 on ``host``:``port``; for each connection, a JSON line of the
    bytes it was sent (its request's head), then the connection closed."""
    # (This project's machines and CI run as root: a skip here would prove nothing.)
    if os.getuid() != 0 or not os.access("/usr/bin/python3", os.X_OK):
        pytest.fail("needs root and /usr/bin/python3, to listen as another user")
    code = (
        "import json, socket, struct, sys\n"
        "host, port = sys.argv[1], int(sys.argv[2])\n"
        "s = socket.socket(socket.AF_INET6 if ':' in host else socket.AF_INET); s.bind((host, port)); s.listen(8)\n"
        "print('listening', flush=True)\n"
        "while True:\n"
        "    c, _ = s.accept(); c.settimeout(10); got = b''\n"
        "    while b'\\r\\n\\r\\n' not in got:\n"
        "        more = c.recv(65536)\n"
        "        if not more: break\n"
        "        got += more\n"
        "    print(json.dumps(got.decode('latin-1')), flush=True)\n"
        # Closed with a reset: no TIME_WAIT that holds the port (on gVisor, of every address).
        "    c.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack('ii', 1, 0)); c.close()\n"
    )
    proc = subprocess.Popen(
        ["/usr/bin/python3", "-c", code, host, str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        user=NOBODY,
        cwd="/",
    )
    line = proc.stdout.readline()
    if line != "listening\n":
        proc.kill()
        proc.wait()
        pytest.fail(f"cannot listen on {host}:{port} as another user: {proc.stderr.read().strip()[-300:]}")
    return proc


@pytest.mark.parametrize("other_host", ["127.0.0.2", "::1"])
def test_a_runtime_files_token_goes_to_no_listener_of_another_user_at_another_loopback_address(
    live_server, live_pids, tmp_path, other_host
):
    """The user's server listens on 127.0.0.1:P, its runtime file says so; another user listens
    on ``other_host``:P. A URL that names ``other_host``:P names that other listener: it is sent
    no token (the kernel's tables say whose socket it is)."""
    port = _port(live_server)
    other = _listener_of_another_user(other_host, port)
    try:
        info = server_file(live_server)
        assert info["url"].startswith("http://127.0.0.1:") or info["url"].startswith("http://localhost:")
        runtime = runtime_dir(tmp_path / "runtime", info, newest_first=True)
        given = f"http://[{other_host}]:{port}/" if ":" in other_host else f"http://{other_host}:{port}/"
        env = {"JUPYTER_RUNTIME_DIR": str(runtime), "EVALSCHED_URL": given}
        proc = cli(live_server, "list", env=env, with_server=False)
        assert proc.returncode == 2, (proc.stdout, proc.stderr)  # (it answers nothing)
        sent = json.loads(other.stdout.readline())
        assert sent.startswith("GET /evalsched/"), sent
        assert live_server.token not in sent and "authorization" not in sent.lower(), sent
    finally:
        other.kill()
        other.wait()


def test_the_kernels_tables_tell_whose_socket_listens_where(live_server):
    """``read_listeners``: the user's server (127.0.0.1:P) as this user's, and another user's
    socket at the same port of ::1 as theirs; ``listening_uids`` of 127.0.0.1:P: this user alone."""
    port = _port(live_server)
    other = _listener_of_another_user("::1", port)
    try:
        listeners = read_listeners()
        assert listeners is not None
        assert Listener(ipaddress.ip_address("127.0.0.1"), port, os.getuid()) in listeners
        assert Listener(ipaddress.ip_address("::1"), port, NOBODY) in listeners
        assert listening_uids(ipaddress.ip_address("127.0.0.1"), port, listeners) == {os.getuid()}
        assert listening_uids(ipaddress.ip_address("::1"), port, listeners) == {NOBODY}
        assert listening_uids(ipaddress.ip_address("127.0.0.2"), port, listeners) == set()
    finally:
        other.kill()
        other.wait()


def test_a_wildcard_listener_serves_each_address_of_its_family_and_ipv6_ones_ipv4_too():
    v4, v6 = ipaddress.IPv4Address, ipaddress.IPv6Address
    listeners = [
        Listener(v4("0.0.0.0"), 8888, 1000),
        Listener(v6("::"), 9999, 1000),
        Listener(v4("127.0.0.1"), 7777, 1000),
        Listener(v6("::"), 7777, 2000),  # another user's on the IPv6 wildcard: IPv4 too, unless V6ONLY
        Listener(v6("::ffff:127.0.0.3"), 6666, 2000),
    ]
    assert listening_uids(v4("127.0.0.2"), 8888, listeners) == {1000}
    assert listening_uids(v6("::1"), 8888, listeners) == set()
    assert listening_uids(v4("127.0.0.2"), 9999, listeners) == {1000}
    assert listening_uids(v6("::1"), 9999, listeners) == {1000}
    assert listening_uids(v4("127.0.0.1"), 7777, listeners) == {1000, 2000}
    assert listening_uids(v4("127.0.0.3"), 6666, listeners) == {2000}


# --------------------------------------------------------------------------- 2: the servers not picked


@contextlib.contextmanager
def _recording_server(seen: list) -> Iterator[int]:
    """A server that answers as this extension does without a token (403, JSON), and records
    each request's path and Authorization header: its port."""

    class Refuses(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            seen.append((self.path, self.headers.get("Authorization")))
            body = b'{"message": "Forbidden", "reason": null}'
            self.send_response(403)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Refuses)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


HUNG = 10  # listed servers that never answer: 2 s each, one after another, before the fix


def test_the_servers_not_picked_are_sent_nothing_and_delay_nothing(live_server, live_pids, tmp_path):
    """The server picked is the newest that answers (with its token); the others listed are
    counted from their runtime files, never asked: ten that never answer delay nothing (they
    added 20 s, one after another), and none is sent a request, let alone a token."""
    alone = runtime_dir(tmp_path / "alone", server_file(live_server), newest_first=True)
    started = time.monotonic()
    proc = cli(live_server, "list", env={"JUPYTER_RUNTIME_DIR": str(alone)}, with_server=False)
    baseline = time.monotonic() - started
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr

    seen: list = []
    hung = socket.create_server(("127.0.0.1", 0), backlog=64)  # connections queue; none is answered
    with hung, _recording_server(seen) as refusing:
        hung_port = hung.getsockname()[1]
        infos = [server_file(live_server)]
        infos += [
            {"url": f"http://127.0.0.1:{hung_port}/h{i}/", "token": f"HUNG{i}", "pid": live_pids.new()}
            for i in range(HUNG)
        ]
        infos.append({"url": f"http://127.0.0.1:{refusing}/", "token": "NOT-PICKED-TOKEN", "pid": live_pids.new()})
        runtime = runtime_dir(tmp_path / "runtime", *infos, newest_first=True)
        started = time.monotonic()
        proc = cli(live_server, "list", env={"JUPYTER_RUNTIME_DIR": str(runtime)}, with_server=False)
        elapsed = time.monotonic() - started
        assert proc.returncode == 0, proc.stderr
        assert proc.stderr.splitlines() == [
            f"jupyter evalsched: using {live_server.url} ({2 + HUNG} servers found: --url to choose)"
        ], proc.stderr
        assert seen == []
        hung.setblocking(False)
        with pytest.raises(BlockingIOError):
            hung.accept()  # (nobody connected)
        assert elapsed < baseline + 6, (elapsed, baseline)  # (a generous bound: 20 s before)


def test_a_runtime_file_whose_port_another_user_listens_on_is_sent_no_token(live_server, live_pids, tmp_path):
    """The newest runtime file names a server that died; its pid lives on (reused), and another
    user listens on its port now. Its token goes nowhere: the file is passed over, and the
    user's own server (an older file) is picked."""
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()  # (a port free now: the other user's listener takes it)
    other = _listener_of_another_user("127.0.0.1", port)
    try:
        stale = {"url": f"http://127.0.0.1:{port}/", "token": "STALE-TOKEN", "pid": live_pids.new()}
        # The stale one newest.
        runtime = runtime_dir(tmp_path / "runtime", stale, server_file(live_server), newest_first=True)
        proc = cli(live_server, "list", env={"JUPYTER_RUNTIME_DIR": str(runtime)}, with_server=False)
        assert proc.returncode == 0 and proc.stdout.startswith("ID "), proc.stderr  # (the user's server's list)
        assert proc.stderr == "", proc.stderr  # (the file passed over is not counted either)
    finally:
        other.kill()
        out, _ = other.communicate()
    assert "STALE-TOKEN" not in out and "GET " not in out, out


# --------------------------------------------------------------------------- 3: compare


def _spec(name: str, entrypoint: str = SLEEPY) -> dict:
    return {"entrypoint": entrypoint, "name": name, "episodes": 1, "cwd": "/", "params": {}}


def test_compare_skips_the_entrypoint_check_of_a_run_deleted_meanwhile(live_server, client, clean_queue):
    """``compare ID...`` reads each run's record after the comparison (their entrypoints): a run
    deleted in between is left out of that check, not an error of the whole command. Its
    warnings go to stderr; stdout is the table alone."""
    a = client.submit(_spec("cmp-a"))
    crash = client.submit(
        {**_spec("cmp-crash", entrypoint=CRASH), "episodes": 2, "params": {"how": "exception", "at": 1}}
    )
    doomed = client.submit(_spec("cmp-doomed"))
    for rec in (a, crash, doomed):
        wait_state(client, rec["id"], timeout=60)
    target = live_server.url.rstrip("/")

    class DeletesAfterCompare(BaseHTTPRequestHandler):
        """Relays to the server; once it relayed the comparison, deletes ``doomed``."""

        def do_GET(self) -> None:
            req = urllib.request.Request(target + self.path, headers={"Authorization": self.headers["Authorization"]})
            try:
                with urllib.request.urlopen(req, timeout=30) as resp:
                    status, kind, body = resp.status, resp.headers["Content-Type"], resp.read()
            except urllib.error.HTTPError as e:
                status, kind, body = e.code, e.headers["Content-Type"], e.read()
            if self.path.startswith("/evalsched/compare"):
                client.delete(doomed["id"])
            self.send_response(status)
            self.send_header("Content-Type", kind or "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    relay = ThreadingHTTPServer(("127.0.0.1", 0), DeletesAfterCompare)
    relay.daemon_threads = True
    threading.Thread(target=relay.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{relay.server_address[1]}/"
        proc = cli(live_server, "compare", a["id"], crash["id"], doomed["id"], env={"EVALSCHED_URL": url})
    finally:
        relay.shutdown()
        relay.server_close()
    assert proc.returncode == 0, proc.stderr
    assert "cmp-doomed" in proc.stdout and "warning" not in proc.stdout, proc.stdout
    assert proc.stdout.splitlines()[0].split()[:3] == ["run", "name", "state"], proc.stdout
    warnings = [line for line in proc.stderr.splitlines() if line.startswith("warning: ")]
    assert any("entrypoints differ" in w and SLEEPY in w and CRASH in w for w in warnings), proc.stderr
    assert any("did not succeed" in w and "cmp-crash (failed)" in w for w in warnings), proc.stderr
