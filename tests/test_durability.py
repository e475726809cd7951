"""What a 201 promises: the run survives (fsync mode: a power loss too), a retried submission
never makes a second run, and a shutdown loses no queued or admitted-but-unstarted run
(issue "Hardening II", items 8 and 9)."""

from __future__ import annotations

import asyncio
import http.server
import json
import os
import signal
import threading

import pytest
from proc_status import alive, ignores_signal
from rest import CRASH, NOOP, SLEEPY, spec, submit
from waiting import async_wait_until

from jupyter_evalsched.client import EvalSchedClient, LocalServer
from jupyter_evalsched.store import RunStore

# ----------------------------------------------------------------------------- fsync


def test_fsync_mode_makes_the_run_directory_and_its_rename_durable(tmp_path, monkeypatch):
    synced: list[str] = []
    real_fsync = os.fsync

    def recording_fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    store = RunStore(tmp_path / "runs", fsync=True)
    store.ensure()
    rid = "20260101T000000.000000-abcdef"
    store.create(rid, {"spec.json": b"{}", "job.json": b"{}"})
    root, run = str(tmp_path / "runs"), str(tmp_path / "runs" / rid)
    # The files, the staging directory (its entries), then the runs directory (the rename).
    assert (
        synced[-1] == root
        and any(p.endswith("spec.json") for p in synced)
        and any(p.endswith("job.json") for p in synced)
    )
    synced.clear()
    store.write_job(rid, {"state": "succeeded"})
    assert synced[-1] == run  # the rename of job.json
    synced.clear()
    store.mark_done(rid)
    assert synced == [run]  # _DONE's entry


def test_withdrawn_directories_leave_the_listing_at_once_durably_then_go(tmp_path, monkeypatch):
    """Directories written but never acknowledged (a sweep's points given up) are renamed out of
    the runs, that rename made durable with ``fsync``, then removed; one that is not there is
    logged, not raised; nothing is left, not even under a staging name."""
    synced: list[str] = []
    real_fsync = os.fsync

    def recording_fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    store = RunStore(tmp_path / "runs", fsync=True)
    store.ensure()
    kept, gone = "20260101T000000.000000-aaaaaa", "20260101T000000.000001-bbbbbb"
    for rid in (kept, gone):
        store.create(rid, {"spec.json": b"{}", "job.json": b"{}"})
    monkeypatch.setattr(os, "fsync", recording_fsync)
    store.withdraw([gone, "20260101T000000.000002-cccccc"])
    assert synced == [str(tmp_path / "runs")]
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == [kept]
    assert [f.run_id for f in store.scan()] == [kept]


# ----------------------------------------------------------------------------- Idempotency-Key


async def _post(jp_fetch, body, key=None):
    headers = {"Idempotency-Key": key} if key is not None else {}
    resp = await jp_fetch("evalsched", "runs", method="POST", body=json.dumps(body), headers=headers, raise_error=False)
    return resp.code, json.loads(resp.body), resp.headers


async def test_a_repeated_idempotency_key_answers_with_the_first_run(jp_fetch, evalsched, runs_dir):
    body = spec(entry=NOOP, env={"A": "1"}, params={"x": [1, 2]})
    code, first, _ = await _post(jp_fetch, body, "key-1")
    assert code == 201 and first["idempotency_key"] == "key-1"
    code, again, headers = await _post(jp_fetch, body, "key-1")
    assert code == 200 and again["id"] == first["id"] and headers["Idempotent-Replayed"] == "true"
    # Concurrent retries of one submission make one run too.
    answers = await asyncio.gather(*(_post(jp_fetch, body, "key-2") for _ in range(5)))
    assert sorted(code for code, _, _ in answers) == [200, 200, 200, 200, 201]
    assert len({rec["id"] for _, rec, _ in answers}) == 1
    assert len([p for p in runs_dir.iterdir() if not p.name.startswith(".")]) == 2

    code, err, _ = await _post(jp_fetch, {**body, "episodes": 2}, "key-1")
    assert code == 409 and "another spec" in err["message"]
    for bad in ("", "x" * 201, "tab\there", "é"):
        code, err, _ = await _post(jp_fetch, body, bad)
        assert code == 400 and "Idempotency-Key" in err["message"], (bad, err)


@pytest.mark.slow  # a server started, killed or restarted: CI runs it with -m slow (docs/install.md: the default suite stays within ten minutes)
def test_an_idempotency_key_survives_a_server_killed_mid_flight(tmp_path):
    """The retry reaches the server that took over (here: the same runs directory, another server
    with another root directory: a spec without ``cwd`` still matches)."""
    runs = str(tmp_path / "runs")
    with LocalServer(virtual_gpus="24000", runs_dir=runs) as server:
        first = server.client().submit(spec(entry=NOOP), idempotency_key="survives")
        server.process.send_signal(signal.SIGKILL)
        server.process.wait()
    with LocalServer(virtual_gpus="24000", runs_dir=runs) as again:
        replay = again.client().submit(spec(entry=NOOP), idempotency_key="survives")
        assert replay["id"] == first["id"]
        assert len(again.client().list()) == 1


class _FlakyPrimary(http.server.BaseHTTPRequestHandler):
    """Answers the first submission 503 (a server changing hands), the next 201."""

    seen: list[dict] = []

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        self.seen.append({"key": self.headers.get("Idempotency-Key")})
        first = len(self.seen) == 1
        body = json.dumps({"message": "changing hands"} if first else {"id": "r1", "state": "queued"}).encode()
        self.send_response(503 if first else 201)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_the_client_retries_a_submission_answered_503_with_the_same_key():
    _FlakyPrimary.seen = []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _FlakyPrimary)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        client = EvalSchedClient(f"http://127.0.0.1:{server.server_address[1]}/", "t")
        assert client.submit({"entrypoint": NOOP})["id"] == "r1"
        keys = [s["key"] for s in _FlakyPrimary.seen]
        assert len(keys) == 2 and keys[0] == keys[1] and len(keys[0]) >= 16
    finally:
        server.shutdown()


def test_a_refused_connection_is_not_retried():
    client = EvalSchedClient("http://127.0.0.1:9/", "t", submit_retry_s=30)
    from jupyter_evalsched.client import ServerNotFound

    with pytest.raises(ServerNotFound):
        client.submit({"entrypoint": NOOP})  # at once: the request never reached a server


# ----------------------------------------------------------------------------- shutdown


@pytest.fixture
def evalsched_config():
    return {"virtual_gpus": [24000]}


async def test_a_shutdown_keeps_queued_and_admitted_but_unstarted_runs_queued(api, evalsched, runs_dir, monkeypatch):
    """Admission is stopped first: a decision pending when the server stops starts nothing, and a
    run admitted but waiting for its model host goes back to the queue, not to ``aborted``."""
    started = asyncio.Event()

    async def slow_model_host(names):
        started.set()
        await asyncio.sleep(3600)

    local = evalsched.executors["local"]
    monkeypatch.setattr(local.models, "urls_for", slow_model_host)
    monkeypatch.setattr(evalsched.models, "names", lambda: ["m"])
    code, waiting_model = await api("POST", "runs", spec(entry=SLEEPY, models=["m"]))
    assert code == 201
    await asyncio.wait_for(started.wait(), 10)
    running = await api("POST", "runs", spec(entry=SLEEPY, vram=20000, episodes=1000, sleep_s=0.1))
    blocker = running[1]
    await async_wait_until(lambda: evalsched.get(blocker["id"]).record["pid"], timeout=10)
    queued = [(await api("POST", "runs", spec(entry=NOOP, vram=20000)))[1] for _ in range(2)]
    evalsched.request_admission()  # a decision pending when stop() begins
    await evalsched.stop()

    def state(rid):
        return json.loads((runs_dir / rid / "job.json").read_text())["state"]

    assert state(blocker["id"]) == "aborted"  # in flight: lost, as rule 4 accepts
    assert state(waiting_model["id"]) == "queued", "admitted, never started: back to the queue"
    assert [state(q["id"]) for q in queued] == ["queued", "queued"]
    assert not (runs_dir / waiting_model["id"] / "_DONE").exists()


@pytest.mark.parametrize("evalsched_config", [{"auto_resume": True}])
@pytest.mark.parametrize("detach", [False, True], ids=["attached", "detached"])
async def test_a_run_cancelled_in_its_grace_period_when_the_server_stops_ends_cancelled(
    api, evalsched, runs_dir, wait_for, detach
):
    """A cancelled run that ignores SIGTERM is waiting out its grace period when the server stops:
    the stop's kill ends it as the cancel asked, not ``aborted``, nor queued again to run at the
    next start (``auto_resume``). A detached run too: left running, it was re-attached by the
    next server, which knew nothing of the cancel, and ran on."""
    rec = await submit(api, spec(entry=CRASH, params={"how": "ignore_sigterm"}, detach=detach))
    pid = (await wait_for(rec["id"], states=("running",)))["pid"]
    await async_wait_until(lambda: ignores_signal(pid), message="the run never ignored SIGTERM")
    assert (await api("POST", f"runs/{rec['id']}/cancel"))[0] == 200
    await evalsched.stop()
    record = json.loads((runs_dir / rec["id"] / "job.json").read_text())
    assert record["state"] == "cancelled" and record["reason"].startswith("cancelled"), record
    assert (runs_dir / rec["id"] / "_DONE").exists()
    await async_wait_until(lambda: not alive(pid), timeout=5, message="the cancelled run outlived the stop")


def test_the_file_cache_tells_two_versions_of_one_tick_apart(tmp_path):
    """Timestamps tick coarsely: a summary replaced within one tick by another of the same size
    (episodes_done 2 -> 3) must not be answered from the cache. The replacement's inode differs."""
    from jupyter_evalsched.store import FileCache, atomic_write_json

    path = tmp_path / "summary.json"
    atomic_write_json(path, {"episodes_done": 2})
    cache = FileCache()
    assert cache.read_json(path) == {"episodes_done": 2}
    first = os.lstat(path)
    atomic_write_json(path, {"episodes_done": 3})
    os.utime(path, ns=(first.st_atime_ns, first.st_mtime_ns))  # the same tick, the same size
    assert os.lstat(path).st_size == first.st_size
    assert cache.read_json(path) == {"episodes_done": 3}
    assert cache.read_json(path, fresh=True) == {"episodes_done": 3}
