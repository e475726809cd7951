"""The CLI and the Python client where a second review found them wanting: ``logs -f`` read the
whole log again at each tick (now from an offset), a base URL named like a JupyterLab page
(``/lab/``) was cut, and YAML spec errors had no position."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from jupyter_evalsched.client import EvalSchedClient, LocalServer

try:
    from .live_server import FAST_SERVER_ARGS, clean_queue, cli, cli_env, client, live_server, wait_state, wait_until
except ImportError:
    from live_server import (  # noqa: F401
        FAST_SERVER_ARGS,
        clean_queue,
        cli,
        cli_env,
        client,
        live_server,
        wait_state,
        wait_until,
    )


# --------------------------------------------------------------------------- 1: logs -f from an offset

# A run that writes its stdout in steps, each straight to the log (os.write on fd 1: no buffer),
# and after each waits for the test's gate file ``gate-<k>`` in ``params["gates"]``.
STEPPED = """
import os, time

def episode(ctx, index):
    steps = [bytes.fromhex(h) for h in ctx.params["steps"]]
    for k, data in enumerate(steps):
        os.write(1, data)
        if k == len(steps) - 1:
            break
        gate = os.path.join(ctx.params["gates"], f"gate-{k}")
        deadline = time.monotonic() + 120
        while not os.path.exists(gate):
            if time.monotonic() > deadline:
                raise RuntimeError(f"{gate} never came")
            time.sleep(0.01)
    return {}
"""

EURO = "€".encode()  # three bytes: a step that ends within it leaves a character half written


def _stepped_run(client: EvalSchedClient, gates: Path, steps: list[bytes]) -> dict:
    gates.mkdir(exist_ok=True)
    spec = {
        "source": STEPPED,
        "episodes": 1,
        "cwd": "/",
        "params": {"steps": [s.hex() for s in steps], "gates": str(gates)},
    }
    return client.submit(spec)


def _log_path(client: EvalSchedClient, run_id: str, stream: str = "stdout") -> Path:
    return Path(wait_until(lambda: client.get(run_id).get("run_dir"), timeout=30)) / f"{stream}.log"


class _Output:
    """What a process writes to a pipe, collected as it comes."""

    def __init__(self, pipe) -> None:
        self.data = b""
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._read, args=(pipe,), daemon=True)
        self._thread.start()

    def _read(self, pipe) -> None:
        while chunk := os.read(pipe.fileno(), 65536):
            with self._lock:
                self.data += chunk

    def wait_for(self, data: bytes, timeout: float = 60) -> None:
        wait_until(lambda: data in self.data, timeout, message=f"{data!r} in the output")

    def done(self, timeout: float = 30) -> bytes:
        self._thread.join(timeout)
        return self.data


def _cli_process(live_server, *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "jupyter_evalsched.cli", *args],
        env=cli_env(live_server),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
    )


def test_logs_follow_prints_each_byte_once_a_split_character_whole_and_ends_with_the_run(
    live_server, client, clean_queue, tmp_path
):
    """Each step is printed once, as it comes (the test opens the next gate only once the CLI
    printed the step before); a step that ends within a character is printed without it, and
    the character comes whole with the next."""
    steps = [b"step one " + EURO[:2], EURO[2:] + b" ok\nstep two\n", b"x" * 70_000 + b"\n", "last: é\n".encode()]
    rec = _stepped_run(client, tmp_path / "gates", steps)
    proc = _cli_process(live_server, "logs", "-f", rec["id"])
    out, err = _Output(proc.stdout), _Output(proc.stderr)
    try:
        out.wait_for(b"step one ")
        (tmp_path / "gates" / "gate-0").touch()
        out.wait_for(b"step two\n")
        (tmp_path / "gates" / "gate-1").touch()
        out.wait_for(b"x" * 70_000 + b"\n")
        (tmp_path / "gates" / "gate-2").touch()
        assert proc.wait(60) == 0, err.done()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    printed = out.done()
    log = _log_path(client, rec["id"]).read_bytes()
    assert log == b"".join(steps)  # the run wrote nothing else there
    assert printed == log, printed[:200]
    assert "\ufffd" not in printed.decode("utf-8"), printed[:200]
    assert wait_state(client, rec["id"])["state"] == "succeeded"


def test_the_python_log_reader_reads_what_is_new_and_a_split_character_whole(
    live_server, client, clean_queue, tmp_path
):
    steps = [b"one " + EURO[:1], EURO[1:] + b" two\n", b"three\n"]
    rec = _stepped_run(client, tmp_path / "gates", steps)
    handle = client.handle(rec["id"])
    reader = handle.log_reader()
    wait_until(lambda: _log_path(client, rec["id"]).read_bytes() == steps[0], timeout=60, ignore=(FileNotFoundError,))
    assert reader.read() == "one "  # the half character is kept for the next read
    assert reader.read() == ""
    (tmp_path / "gates" / "gate-0").touch()
    wait_until(lambda: _log_path(client, rec["id"]).read_bytes() == b"".join(steps[:2]), timeout=60)
    assert reader.read() == "€ two\n"
    (tmp_path / "gates" / "gate-1").touch()
    wait_state(client, rec["id"])
    assert reader.read(final=True) == "three\n"
    assert reader.offset == len(b"".join(steps))

    tailing = client.log_reader(rec["id"], tail=1)
    assert tailing.read() == "three\n" and tailing.read() == ""


def test_logs_follow_starts_over_when_the_log_got_shorter(live_server, client, clean_queue, tmp_path):
    steps = [b"a long first version of the log\n" * 4, b"new\n"]
    rec = _stepped_run(client, tmp_path / "gates", steps)
    proc = _cli_process(live_server, "logs", "-f", rec["id"])
    out, err = _Output(proc.stdout), _Output(proc.stderr)
    try:
        out.wait_for(steps[0])
        os.truncate(_log_path(client, rec["id"]), 0)  # the run's next write lands at 0 (O_APPEND)
        (tmp_path / "gates" / "gate-0").touch()
        assert proc.wait(60) == 0, err.done()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert out.done() == steps[0] + b"new\n"
    assert b"stdout.log of run " + rec["id"].encode() + b" was rewritten" in err.done()


def _get(url: str, token: str) -> tuple[int, dict[str, str], bytes]:
    req = urllib.request.Request(url, headers={"Authorization": f"token {token}"})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def _check_the_logs_route(base: str, token: str, run_id: str, log: bytes) -> None:
    """``?offset=`` answers the bytes from there, and where the next read starts; beyond the end,
    nothing and the size; a bad offset is a JSON 400."""
    url = f"{base}evalsched/runs/{run_id}/logs?stream=stdout"
    size = str(len(log))
    for offset in (0, 3, len(log) - 2, len(log)):
        status, headers, body = _get(f"{url}&offset={offset}", token)
        assert status == 200 and headers["Content-Type"] == "text/plain; charset=utf-8", headers
        assert body == log[offset:], (offset, body)
        assert headers["X-Evalsched-Log-Offset"] == size and headers["X-Evalsched-Log-Size"] == size, headers
    status, headers, body = _get(f"{url}&offset={len(log) + 10}", token)  # a log that got shorter
    assert (status, body) == (200, b"") and headers["X-Evalsched-Log-Size"] == size, headers
    assert headers["X-Evalsched-Log-Offset"] == str(len(log) + 10), headers
    status, headers, body = _get(f"{url}&tail=1", token)  # the tail says where it ends too
    assert status == 200 and body == log.splitlines(keepends=True)[-1] and headers["X-Evalsched-Log-Offset"] == size
    status, headers, body = _get(url, token)  # as before: all of it
    assert status == 200 and body == log and headers["X-Evalsched-Log-Offset"] == size
    for query, says in (
        ("offset=-1", "'offset' must be between 0"),
        ("offset=abc", "'offset' must be an integer"),
        (f"offset={2**64}", "'offset' must be between 0"),
        ("offset=1&tail=2", "'tail' or 'offset', not both"),
    ):
        status, headers, body = _get(f"{url}&{query}", token)
        assert status == 400 and headers["Content-Type"].startswith("application/json"), (query, status, body)
        assert says in json.loads(body)["message"], (query, body)


def test_the_logs_route_answers_from_an_offset(live_server, client, clean_queue, tmp_path):
    steps = [b"first line\n", "second, a split €\nthird\n".encode()]
    rec = _stepped_run(client, tmp_path / "gates", steps)
    (tmp_path / "gates" / "gate-0").touch()
    assert wait_state(client, rec["id"])["state"] == "succeeded"
    log = b"".join(steps)
    _check_the_logs_route(live_server.url, live_server.token, rec["id"], log)
    # An offset within a character: the bytes from there, as they are.
    split = log.index(EURO) + 1
    assert client.log_part(rec["id"], offset=split).data == log[split:]


def test_a_secondary_server_relays_the_logs_route_headers(tmp_path):
    """A server that delegates to its host's primary keeps the route's headers: ``logs -f``
    through it reads from offsets as well."""
    runs = str(tmp_path / "runs")
    with (
        LocalServer(virtual_gpus="24000", runs_dir=runs, extra_args=FAST_SERVER_ARGS) as first,
        LocalServer(virtual_gpus="24000", runs_dir=runs, extra_args=FAST_SERVER_ARGS) as second,
    ):
        statuses = {s.url: s.client().request("GET", "status")["role"] for s in (first, second)}
        secondary = second if statuses[second.url] == "secondary" else first
        assert sorted(statuses.values()) == ["primary", "secondary"], statuses
        c = secondary.client()
        steps = [b"only \xe2\x82\xac line\n"]
        rec = _stepped_run(c, tmp_path / "gates", steps)
        assert wait_state(c, rec["id"])["state"] == "succeeded"
        # (The primary's text/plain, as APIHandler.finish would not keep it: it sets JSON.)
        _check_the_logs_route(secondary.url, secondary.token, rec["id"], steps[0])
        proc = subprocess.run(
            [sys.executable, "-m", "jupyter_evalsched.cli", "logs", "-f", rec["id"]],
            env=cli_env(secondary),
            capture_output=True,
            timeout=60,
        )
        assert proc.returncode == 0 and proc.stdout == steps[0], (proc.stdout, proc.stderr)


def test_the_log_reader_follows_a_server_that_answers_the_whole_log(tmp_path):
    """A server from before ``?offset=`` (no offset header): its answer is the whole log (its
    last 8 MiB) decoded with ``replace`` (a character half written: U+FFFD), whatever the query.
    The reader asks it for the log as such, never from an offset, and gives out the characters
    past those it gave (all of them again, for a log that got shorter)."""
    log = {"data": b"one " + EURO[:1]}
    asked: list[str] = []

    class OldLogs(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # as the logs route of the commit before offsets (store.tail_lines)
            asked.append(self.path)
            query = urllib.parse.parse_qs(urllib.parse.urlsplit(self.path).query)
            text = log["data"][-8 * 1024 * 1024 :].decode("utf-8", "replace")
            if "tail" in query:
                text = "".join(text.splitlines(keepends=True)[-int(query["tail"][0]) :])
            body = text.encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), OldLogs)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        c = EvalSchedClient(f"http://127.0.0.1:{server.server_address[1]}/", "t")
        rewritten = []
        reader = c.log_reader("r1")
        reader.on_rewritten = lambda: rewritten.append(True)
        assert reader.read() == "one "
        log["data"] += EURO[1:] + b" two\n"
        assert reader.read() == "€ two\n" and reader.read() == ""
        log["data"] = b"new\n"
        assert reader.read(final=True) == "new\n" and rewritten == [True]
        log["data"] = b"a\nb\n"
        assert c.log_reader("r1", tail=1).read() == "b\n"
        # A character cut at the end of a read: the U+FFFD in its place is not given out.
        log["data"] = b"caf\xc3"
        reader = c.log_reader("r1")
        assert reader.read() == "caf" and reader.legacy
        log["data"] += b"\xa9 ok\n"
        assert reader.read() + reader.read(final=True) == "é ok\n"
        assert not any("offset=" in path for path in asked), asked
    finally:
        server.shutdown()
        server.server_close()


@contextlib.contextmanager
def _serving(handler: type[BaseHTTPRequestHandler]) -> Iterator[str]:
    """An HTTP server of ``handler`` on a free port: its URL (no trailing slash)."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def _answer(handler: BaseHTTPRequestHandler, status: int, body: bytes, kind: str, headers=()) -> None:
    handler.send_response(status)
    handler.send_header("Content-Type", kind)
    handler.send_header("Content-Length", str(len(body)))
    for name, value in headers:
        handler.send_header(name, value)
    handler.end_headers()
    handler.wfile.write(body)


def _relay_dropping_log_headers(target: str) -> type[BaseHTTPRequestHandler]:
    """A server before offsets that relays to its host's (newer) primary: the query goes through
    (``?offset=`` with it), the X-Evalsched-Log-* headers of the answer do not (its
    RELAYED_HEADERS), and the answer says application/json (APIHandler.finish)."""

    class Relay(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            status, _, body = _get(target + self.path.lstrip("/"), self.headers["Authorization"].split()[-1])
            _answer(self, status, body, "application/json")

        def log_message(self, *args) -> None:
            pass

    return Relay


def test_the_log_reader_through_an_older_relay_that_drops_the_offset_headers(
    live_server, client, clean_queue, tmp_path
):
    """An answer without the offset headers may be a part from the offset asked for (such a relay)
    or the whole log (an older server): the reader reads the whole log from then on, as
    ``logs -f`` did before offsets; nothing is lost or printed twice."""
    steps = [b"abc\n", "d€f\n".encode(), b"ghi\n"]
    rec = _stepped_run(client, tmp_path / "gates", steps)
    log = _log_path(client, rec["id"])
    with _serving(_relay_dropping_log_headers(live_server.url)) as relay:
        reader = EvalSchedClient(relay + "/", live_server.token).log_reader(rec["id"])
        wait_until(lambda: log.read_bytes() == steps[0], timeout=60, ignore=(FileNotFoundError,))
        assert reader.read() == "abc\n" and reader.legacy
        assert reader.read() == ""
        (tmp_path / "gates" / "gate-0").touch()
        wait_until(lambda: log.read_bytes() == b"".join(steps[:2]), timeout=60)
        assert reader.read() == "d€f\n"
        (tmp_path / "gates" / "gate-1").touch()
        assert wait_state(client, rec["id"])["state"] == "succeeded"
        assert reader.read(final=True) == "ghi\n"
        # The CLI through it (logs -f of an ended run: the whole log, once)
        proc = cli(live_server, "logs", "-f", rec["id"], "--url", relay + "/", "--token", live_server.token)
        assert proc.returncode == 0 and proc.stdout == b"".join(steps).decode(), (proc.stdout, proc.stderr)


def test_logs_follow_starts_from_the_last_8_mib_of_a_long_log(live_server, client, clean_queue, tmp_path):
    """As before offsets: the first read is the log's last 8 MiB (from the first whole character
    there), the later ones what comes after."""
    rec = _stepped_run(client, tmp_path / "gates", [b"start\n"])
    assert wait_state(client, rec["id"])["state"] == "succeeded"
    path = _log_path(client, rec["id"])
    with open(path, "ab") as f:  # 10 MiB of two-byte characters: the last 8 MiB start within one
        f.write("é".encode() * (5 * 1024 * 1024) + b"\n")
    window = path.read_bytes()[-8 * 1024 * 1024 :]
    assert window[0] == "é".encode()[1]
    expected = window[1:].decode()
    reader = client.log_reader(rec["id"])
    assert reader.read() == expected and reader.read() == ""
    with open(path, "ab") as f:
        f.write(b"more\n")
    assert reader.read(final=True) == "more\n"
    window = path.read_bytes()[-8 * 1024 * 1024 :]
    assert window[0] == "é".encode()[0]
    proc = cli(live_server, "logs", "-f", rec["id"])
    assert proc.returncode == 0 and proc.stdout == window.decode(), (len(proc.stdout), proc.stderr)


# --------------------------------------------------------------------------- 2: a base URL named like a page


@pytest.fixture(scope="module")
def lab_based_server():
    """A server served under ``/lab/``: its base URL is named like JupyterLab's page."""
    with LocalServer(virtual_gpus="24000", extra_args=[*FAST_SERVER_ARGS, "--ServerApp.base_url=/lab/"]) as server:
        assert server.url.endswith("/lab/"), server.url
        yield server


def test_a_server_served_under_lab_is_found_at_its_base_url(lab_based_server):
    server = lab_based_server
    root = server.url[: -len("lab/")]
    given = [
        server.url,  # as `jupyter server list` prints it
        server.url.rstrip("/"),
        server.url + "lab",  # JupyterLab's page of that server
        server.url + "lab/tree/x.ipynb",  # copied from the address bar
    ]
    for url in given:
        assert EvalSchedClient(url, server.token).base_url == server.url, url
        proc = cli(server, "queue", "--url", url, "--token", server.token)
        assert proc.returncode == 0 and "QUEUED" in proc.stdout, (url, proc.stderr)
    # The token in the URL, as the server prints it
    proc = cli(server, "list", env={"EVALSCHED_URL": server.url + "lab?token=" + server.token}, with_server=False)
    assert proc.returncode == 0, proc.stderr
    # A wrong token: said as such, at the server's base URL (not "no API at its root")
    proc = cli(server, "queue", "--url", server.url, "--token", "wrong")
    assert proc.returncode == 2 and "token" in proc.stderr and "no /evalsched/ API" not in proc.stderr, proc.stderr
    # Its root has no API: said there
    proc = cli(server, "queue", "--url", root, "--token", server.token)
    assert proc.returncode == 2 and f"no /evalsched/ API at {root}" in proc.stderr, proc.stderr


def test_a_page_url_of_a_server_at_the_root_is_still_cut(live_server):
    """JupyterLab's pages of a server at ``/`` (which answer HTML at any path under them) are
    not taken for its base URL."""
    for page in ("lab", "lab/", "lab/tree/x.ipynb", "tree/a/b", "lab/workspaces/auto-x/tree/x.ipynb"):
        assert EvalSchedClient(live_server.url + page, live_server.token).base_url == live_server.url, page
    proc = cli(live_server, "queue", "--url", live_server.url + "lab/tree/x.ipynb?token=" + live_server.token)
    assert proc.returncode == 0 and "QUEUED" in proc.stdout, proc.stderr


def test_no_request_takes_the_token_to_another_origin():
    """Discovery's probes follow no redirect (a redirect is not the API: an SSO proxy's login);
    the client's requests follow one, without the token where it leads to another origin."""
    seen: list[tuple[str, str | None]] = []

    class Elsewhere(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            seen.append((self.path, self.headers.get("Authorization")))
            _answer(self, 200, b'{"queued": [], "running": []}', "application/json")

        def log_message(self, *args) -> None:
            pass

    with _serving(Elsewhere) as elsewhere:

        class Proxy(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.path.startswith("/evalsched/queue"):  # moved to another host
                    _answer(self, 302, b"", "text/html", [("Location", elsewhere + self.path)])
                elif self.path.startswith("/evalsched/ledger"):  # moved on this one
                    _answer(self, 302, b"", "text/html", [("Location", "/evalsched/here")])
                elif self.path.startswith("/evalsched/here"):
                    body = json.dumps({"authorization": self.headers.get("Authorization")}).encode()
                    _answer(self, 200, body, "application/json")
                else:  # unknown paths: to the login host
                    _answer(self, 302, b"", "text/html", [("Location", elsewhere + "/login")])

            def log_message(self, *args) -> None:
                pass

        with _serving(Proxy) as url:
            c = EvalSchedClient(url + "/lab/tree/x.ipynb?token=SECRET")
            assert c.base_url == url + "/" and seen == [], seen
            assert c.queue() == {"queued": [], "running": []}
            assert seen == [("/evalsched/queue", None)], seen
            assert c.ledger() == {"authorization": "token SECRET"}


def test_a_server_under_lab_whose_scheduler_is_starting_keeps_its_base():
    """The extension's JSON 503 (starting, no primary) is the API answering there."""

    class Starting(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path.startswith("/lab/evalsched/"):
                body = json.dumps({"message": "the scheduler is starting", "reason": None}).encode()
                _answer(self, 503, body, "application/json", [("Retry-After", "1")])
            else:
                _answer(self, 404, b"<html>404</html>", "text/html")

        def log_message(self, *args) -> None:
            pass

    with _serving(Starting) as url:
        assert EvalSchedClient(url + "/lab/?token=t").base_url == url + "/lab/"


def test_the_base_found_is_kept_per_url_and_probes_wait_as_long_as_the_client():
    """Probing is done once per URL given in a process; a probe waits as long as the client's
    timeout, and the URL as given that does not answer in that time is kept (not cut)."""
    probes: list[str] = []
    released = threading.Event()

    class Server(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            probes.append(self.path)
            if self.path.startswith("/slow/lab/evalsched/"):
                time.sleep(2.5)  # past the fixed 2 s that probes waited, well within the client's 60 s
            if self.path.startswith("/hung/lab/evalsched/"):
                released.wait(120)  # never within the client's timeout
                return
            if self.path.split("/")[2:4] == ["lab", "evalsched"] or self.path.split("/")[2] == "evalsched":
                _answer(self, 200, b'{"queued": []}', "application/json")
            else:
                _answer(self, 404, b"<html>404</html>", "text/html")

        def log_message(self, *args) -> None:
            pass

    with _serving(Server) as url:
        try:
            given = url + "/root/tree/x.ipynb"
            assert EvalSchedClient(given, "t").base_url == url + "/root/"
            assert len(probes) == 2, probes
            assert EvalSchedClient(given, "t").base_url == url + "/root/" and len(probes) == 2, probes
            # (a page of a server at /slow/lab/: its base answers late)
            assert EvalSchedClient(url + "/slow/lab/tree/x.ipynb", "t", timeout=60).base_url == url + "/slow/lab/"
            assert EvalSchedClient(url + "/hung/lab", "t", timeout=1).base_url == url + "/hung/lab/"
        finally:
            released.set()


@pytest.mark.parametrize("page", ["lab?token=t", ""])
def test_a_port_that_speaks_no_http_is_one_error_line(live_server, page):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)

    def not_http() -> None:
        with contextlib.suppress(OSError):
            while True:
                conn, _ = listener.accept()
                with conn:
                    conn.recv(4096)
                    conn.sendall(b"SSH-2.0-OpenSSH_9.6\r\n")

    threading.Thread(target=not_http, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{listener.getsockname()[1]}/{page}"
        proc = cli(live_server, "queue", "--url", url, "--token", "t", with_server=False)
    finally:
        listener.close()
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "no HTTP server answers at" in lines[0], proc.stderr


# --------------------------------------------------------------------------- 3: where a spec file is wrong


@pytest.mark.parametrize(
    ("name", "text", "says"),
    [
        (
            "flow.yaml",
            "entrypoint: a:b\nepisodes: [1, 2\nname: x\n",
            "line 3, column 5: expected ',' or ']', but got ':' (while parsing a flow sequence, at line 2, column 11)",
        ),
        ("indent.yml", "entrypoint: a:b\n  episodes: 3\n", "line 2, column 11: mapping values are not allowed here"),
        ("control.yaml", 'name: "x\x01"\n', "line 1, column 9: unacceptable character #x0001"),
        ("spec.json", '{"entrypoint": "a:b",\n "episodes": 3,,\n}', "line 2, column 16: Expecting property name"),
    ],
)
def test_a_spec_file_that_does_not_parse_says_where(live_server, tmp_path, name, text, says):
    (tmp_path / name).write_text(text, encoding="utf-8")
    proc = cli(live_server, "submit", str(tmp_path / name))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and f"cannot parse spec file {tmp_path / name}: {says}" in lines[0], proc.stderr
