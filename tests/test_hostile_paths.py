"""No open by the server of a path a run can write may block or follow a link (issue #30,
"Hardening III", items 1 and 2).

Real runs put a FIFO, a symbolic link (to a FIFO outside: following it would block too) or a
directory where the server opens a file of their run directory, at each point of a run's life
(progress, end, retry, preemption, restart), and the server (a subprocess: a blocked event loop
must not block the test) answers ``/api/status`` within a second throughout; each such run fails
``run_file``. A non-finite number in ``summary.json`` or ``job.json`` is refused where it is read.
"""

from __future__ import annotations

import json
import os
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from run_dirs import write_run_dir
from waiting import async_wait_until, wait_until

from jupyter_evalsched.client import LocalServer
from jupyter_evalsched.client.errors import EvalSchedError

EVALS = str(Path(__file__).with_name("evals_hostile.py"))
KINDS = ("fifo", "symlink", "dir")
ANSWER_WITHIN_S = 1.0  # a liveness bound, not a speed test: a blocked loop never answers at all
SERVER_ARGS = [
    "--EvalSchedApp.cancel_grace_s=2.0",
    "--EvalSchedApp.reconcile_interval_s=0.5",
    "--EvalSchedApp.progress_interval_s=0.05",
    "--EvalSchedApp.preempt_min_runtime_s=0",
    "--EvalSchedApp.preempt_grace_s=20",
    "--EvalSchedApp.retry_backoff_s=0",
]
NONFINITE_SUMMARY = (
    '{"status":"succeeded","episodes_done":1,"episodes_total":1,"metrics":{"m":{"mean":1e999,"count":1}}}'
)


class Liveness:
    """A thread that asks the server for ``/api/status`` (and for the tracked runs' records and
    logs, which read run files) all along; ``check()`` raises if any answer took longer than
    ``ANSWER_WITHIN_S`` or never came."""

    def __init__(self, server: LocalServer) -> None:
        self.base = server.url.rstrip("/")
        self.token = server.token
        self.run_ids: list[str] = []
        self.failures: list[str] = []
        self.answers = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _get(self, path: str) -> None:
        req = urllib.request.Request(self.base + path, headers={"Authorization": f"token {self.token}"})
        started = time.monotonic()
        try:
            with urllib.request.urlopen(req, timeout=ANSWER_WITHIN_S) as resp:
                body = resp.read()
            if path.endswith("/status") or "/logs" not in path:
                json.loads(body, parse_constant=_refuse)  # strict JSON: no NaN, no Infinity
        except urllib.error.HTTPError:
            pass  # an answer (a run's 4xx) is an answer
        except Exception as exc:
            self.failures.append(f"GET {path}: {type(exc).__name__}: {exc} after {time.monotonic() - started:.2f} s")
            return
        self.answers += 1

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._get("/api/status")
            self._get("/evalsched/status")
            for run_id in list(self.run_ids):
                self._get(f"/evalsched/runs/{run_id}")
                self._get(f"/evalsched/runs/{run_id}/logs?lines=5")
            self._stop.wait(0.1)

    def __enter__(self) -> Liveness:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)

    def check(self) -> None:
        assert not self.failures, "the server stopped answering:\n" + "\n".join(self.failures[:10])
        assert self.answers > 0


def _refuse(name: str) -> None:
    raise ValueError(f"{name} in an answer")


@pytest.fixture(scope="module")
def outside_fifo(tmp_path_factory):
    path = tmp_path_factory.mktemp("outside") / "elsewhere.fifo"
    os.mkfifo(path)
    return str(path)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    runs = tmp_path_factory.mktemp("hostile") / "runs"
    srv = LocalServer(virtual_gpus="10000", cpu_slots=16, runs_dir=str(runs), extra_args=SERVER_ARGS)
    try:
        yield srv
    finally:
        srv.cleanup()


def plant(names, kind, link_to, then, attempts=(1, 2), **kw) -> dict:
    """A spec whose run replaces ``names`` in its directory with a ``kind``, in ``attempts``."""
    params = {"names": names, "kind": kind, "link_to": link_to, "then": then, "attempts": list(attempts)}
    body = {
        "entrypoint": f"{EVALS}:plant",
        "episodes": 1,
        "params": params,
        "scheduling": {"marginal_vram_mb": 0},
    }
    body["scheduling"].update(kw.pop("scheduling", {}))
    body.update(kw)
    return body


def settled(client, run_id: str, timeout: float = 45) -> dict:
    return wait_until(
        lambda: (rec := client.get(run_id))["state"] in ("succeeded", "failed", "cancelled", "aborted") and rec,
        timeout=timeout,
        message=f"run {run_id} did not end",
    )


def test_no_run_file_blocks_the_server_during_a_runs_life(server, outside_fifo):
    from evals_hostile import place

    client = server.client(timeout=10)
    expected: dict[str, str] = {}  # run id -> the start of its reason
    with Liveness(server) as live:
        # submission: a lease is written under .leases, which a user can replace
        leases = Path(server.runs_dir) / ".leases"
        for kind in KINDS:
            place(str(leases), kind, outside_fifo)
            try:
                granted = client.request("POST", "leases", body={"vram_mb": 100, "label": kind})
            except EvalSchedError as exc:  # refused, it cannot be written there: an answer all the same
                assert exc.status >= 500 and "runs directory" in str(exc), exc
            else:
                client.request("DELETE", f"leases/{granted['id']}")
            place(str(leases), "dir", outside_fifo)
        for kind in KINDS:
            cases = {
                # progress and end: read at every look, and when the process is gone
                "summary.json": plant(["summary.json"], kind, outside_fifo, "exit0"),
                # end: the run says it finalized through something that is not a file
                "_DONE": plant(["_DONE"], kind, outside_fifo, "exit0"),
                # retry: the logs are opened again for the next attempt
                "stdout.log": plant(["stdout.log", "stderr.log"], kind, outside_fifo, "exit1", attempts=[1], retries=1),
            }
            for name, body in cases.items():
                rec = client.submit(body)
                live.run_ids.append(rec["id"])
                start = "could not start the run: cannot open the run's log files: " if name == "stdout.log" else ""
                expected[rec["id"]] = f"run_file: {start}{name} is "
        # preemption: _STOP is created in the run directory of the run to stop (one GPU: one at a time)
        for kind in KINDS:
            low = client.submit(
                plant(["_STOP"], kind, outside_fifo, "wait", scheduling={"marginal_vram_mb": 10000, "priority": "low"})
            )
            live.run_ids.append(low["id"])
            stop = Path(server.runs_dir) / low["id"] / "_STOP"
            wait_until(lambda: os.path.lexists(stop), timeout=45, message="the eval never planted _STOP")
            high = client.submit(
                {
                    "entrypoint": "jupyter_evalsched.examples.basic:noop",
                    "scheduling": {"marginal_vram_mb": 10000, "priority": "high"},
                }
            )
            assert settled(client, high["id"])["state"] == "succeeded"
            expected[low["id"]] = "run_file: _STOP is "
        finals = {run_id: settled(client, run_id) for run_id in expected}
    live.check()
    wrong = {
        run_id: (rec["state"], rec["reason"])
        for run_id, rec in finals.items()
        if rec["state"] != "failed" or not (rec["reason"] or "").startswith(expected[run_id])
    }
    assert not wrong, f"expected run_file failures: {wrong}"
    # The server's verdict is on disk, _DONE (the server's own, a regular file) last.
    for run_id in expected:
        run_dir = Path(server.runs_dir) / run_id
        assert json.loads((run_dir / "job.json").read_text())["state"] == "failed"
        wait_until(lambda: (run_dir / "_DONE").is_file() and not (run_dir / "_DONE").is_symlink())
    # A run that failed on its logs tried again first.
    retried = [r for run_id, r in finals.items() if "log files" in expected[run_id]]
    assert all(r["attempt"] == 2 for r in retried), [r["attempt"] for r in retried]


def test_a_non_finite_summary_fails_the_run_and_nothing_sends_infinity(server, tmp_path):
    client = server.client(timeout=10)
    source = (
        "import os\n"
        "def episode(ctx, index):\n"
        "    d = ctx.run_dir\n"
        f"    open(os.path.join(d, 'summary.json'), 'w').write({NONFINITE_SUMMARY!r})\n"
        "    open(os.path.join(d, '_DONE'), 'w').close()\n"
        "    os._exit(0)\n"
    )
    with Liveness(server) as live:
        rec = client.submit({"source": source, "scheduling": {"marginal_vram_mb": 0}})
        live.run_ids.append(rec["id"])
        final = settled(client, rec["id"])
        after = client.submit({"entrypoint": "jupyter_evalsched.examples.basic:noop"})
        assert settled(client, after["id"])["state"] == "succeeded"  # the server goes on
    live.check()
    assert final["state"] == "failed"
    assert final["reason"] == (
        "exit_code:0: the run finalized but its result cannot be used: "
        "summary.json is not valid JSON: 1e999 is not a finite number"
    ), final["reason"]
    on_disk = json.loads((Path(server.runs_dir) / rec["id"] / "job.json").read_text())
    assert on_disk["state"] == "failed"


def test_a_restart_meets_hostile_run_files(tmp_path, outside_fifo):
    """Run directories as a dead server and its runs left them: the new server starts, answers
    within a second throughout, and fails each run with what is wrong."""
    runs = tmp_path / "runs"
    runs.mkdir(mode=0o700)
    expected: dict[str, str] = {}
    from evals_hostile import place

    for i, kind in enumerate(KINDS):
        # a running run (its process gone) whose _DONE is not a file: recovery judges it
        rid = f"20260101T000000.00000{i}-aaaaa{i}"
        write_run_dir(runs / rid, rid, None, None, seq=1 + i)
        place(str(runs / rid / "_DONE"), kind, outside_fifo)
        expected[rid] = "run_file: _DONE is "
        # a queued run whose logs are not files: opened when it starts
        rid = f"20260101T000000.00001{i}-bbbbb{i}"
        write_run_dir(
            runs / rid, rid, None, None, state="queued", seq=10 + i, entrypoint="jupyter_evalsched.examples.basic:noop"
        )
        place(str(runs / rid / "stdout.log"), kind, outside_fifo)
        expected[rid] = "run_file: could not start the run: cannot open the run's log files: stdout.log is "
    # a run that finalized with a non-finite number in its summary
    nonfinite = "20260101T000000.000020-cccccc"
    write_run_dir(runs / nonfinite, nonfinite, None, None, seq=20)
    (runs / nonfinite / "summary.json").write_text(NONFINITE_SUMMARY)
    (runs / nonfinite / "_DONE").touch()
    expected[nonfinite] = "exit_code:unknown: the run finalized but its result cannot be used: summary.json is not"
    # a job.json with one: a broken directory, not a server that cannot start
    broken = "20260101T000000.000021-dddddd"
    write_run_dir(runs / broken, broken, None, None, seq=21)
    (runs / broken / "job.json").write_text(
        (runs / broken / "job.json").read_text().replace('"seq": 21', '"seq": 1e999')
    )
    # entries no server made: named like a run, a lease file; never opened as files
    for i, kind in enumerate(KINDS):
        place(str(runs / f"20260101T000000.00003{i}-eeeee{i}"), kind, outside_fifo)
        (runs / ".leases").mkdir(exist_ok=True)
        place(str(runs / ".leases" / f"20260101T000000.00004{i}-fffff{i}.json"), kind, outside_fifo)

    srv = LocalServer(
        virtual_gpus="10000", cpu_slots=16, runs_dir=str(runs), extra_args=SERVER_ARGS, startup_timeout=30
    )
    try:
        client = srv.client(timeout=10)
        with Liveness(srv) as live:
            live.run_ids.extend(expected)
            finals = {rid: settled(client, rid) for rid in expected}
            status = client.request("GET", "status")
        live.check()
    finally:
        srv.cleanup()
    wrong = {
        rid: (rec["state"], rec["reason"])
        for rid, rec in finals.items()
        if rec["state"] != "failed" or not (rec["reason"] or "").startswith(expected[rid])
    }
    assert not wrong, wrong
    problems = {b["id"]: b["problem"] for b in status["broken_runs"]}
    assert "1e999 is not a finite number" in problems[broken], problems


# --------------------------------------------------------------------------- the helpers, one by one


@pytest.mark.parametrize("kind", KINDS)
def test_open_run_file_never_opens_anything_but_a_regular_file(tmp_path, outside_fifo, kind):
    from evals_hostile import place

    from jupyter_evalsched.store import UnsafeRunFile, open_log, open_run_file, read_json_file

    path = tmp_path / "f"
    place(str(path), kind, outside_fifo)
    for flags in (os.O_RDONLY, os.O_WRONLY | os.O_CREAT, os.O_WRONLY | os.O_CREAT | os.O_APPEND):
        with pytest.raises(UnsafeRunFile, match="not a regular file"):
            open_run_file(path, flags)
    with pytest.raises(UnsafeRunFile):
        open_log(path)
    with pytest.raises(UnsafeRunFile):
        read_json_file(path)
    # A directory swapped for a link is not gone through either.
    real = tmp_path / "real"
    real.mkdir()
    (real / "x.json").write_text("{}")
    (tmp_path / "link").symlink_to(real)
    with pytest.raises(UnsafeRunFile, match="not a plain directory"):
        open_run_file(tmp_path / "link" / "x.json")


@pytest.mark.parametrize("kind", KINDS)
def test_the_servers_done_replaces_whatever_the_run_left(tmp_path, outside_fifo, kind):
    from evals_hostile import place

    from jupyter_evalsched.store import RunStore, UnsafeRunFile

    store = RunStore(tmp_path / "runs")
    store.ensure()
    run_id = "20260101T000000.000001-aaaaaa"
    store.create(run_id, {"spec.json": b"{}"})
    done = store.file(run_id, "_DONE")
    place(str(done), kind, outside_fifo)
    assert store.done_exists(run_id)
    with pytest.raises(UnsafeRunFile, match="_DONE is a"):
        store.done_marked(run_id)
    store.mark_done(run_id)
    assert done.is_file() and not done.is_symlink() and store.done_marked(run_id)
    place(str(done), kind, outside_fifo)
    store.unmark_done(run_id)  # a resume removes it, a directory too
    assert not os.path.lexists(done)
    stop = store.file(run_id, "_STOP")
    place(str(stop), kind, outside_fifo)
    with pytest.raises(UnsafeRunFile):
        store.write_stop(run_id)
    store.clear_stop(run_id)
    assert not os.path.lexists(stop)
    assert os.path.exists(outside_fifo)  # a link is removed, never what it points at


def test_non_finite_numbers_are_refused_where_run_files_are_read(tmp_path):
    from jupyter_evalsched.store import RunFileError, parse_episode, parse_json

    for text in ("1e999", "-1e999", "NaN", "Infinity", '{"a": [1, 2e400]}'):
        with pytest.raises(RunFileError, match="not a finite number|not a JSON number"):
            parse_json(text, "summary.json")
    assert parse_json('{"a": 1.5e300, "b": -0.0}', "summary.json") == {"a": 1.5e300, "b": -0.0}
    lines = [
        parse_episode(b'{"index": 0, "metrics": {"m": 1e999}}'),
        parse_episode(b'{"index": 1, "metrics": {"m": null}}'),
    ]
    assert [e and e["index"] for e in lines] == [None, 1]


def test_a_record_that_cannot_be_written_is_that_runs_problem(tmp_path):
    from jupyter_evalsched.scheduler.runs import Run, RunTable, new_record
    from jupyter_evalsched.store import RunStore

    store = RunStore(tmp_path / "runs")
    store.ensure()
    table = RunTable(store)
    run_id = "20260101T000000.000001-aaaaaa"
    spec = {"name": "y", "entrypoint": "x:y", "episodes": 1, "scheduling": {}}
    store.create(run_id, {"spec.json": json.dumps(spec).encode()})
    record = new_record(run_id, spec, seq=1, executor="local", run_dir=str(store.run_dir(run_id)))
    run = Run(record=record, spec=spec, submitted_ts=time.time())
    table.add(run)
    run.record["metrics"] = {"m": float("inf")}  # however it got there
    assert table.save(run) is False and table.has_unwritten  # no exception: retried later
    run.record["metrics"] = {}
    table.retry_unwritten()
    assert not table.has_unwritten and json.loads(store.file(run_id, "job.json").read_text())["id"] == run_id


async def test_a_run_that_cannot_be_recovered_fails_and_the_server_starts(
    jp_serverapp, jp_fetch, runs_dir, monkeypatch
):
    from jupyter_evalsched.scheduler.executors.local import LocalExecutor

    bad, good = "20260101T000000.000001-aaaaaa", "20260101T000000.000002-bbbbbb"
    write_run_dir(runs_dir / bad, bad, None, None, seq=1)
    write_run_dir(
        runs_dir / good, good, None, None, state="queued", seq=2, entrypoint="jupyter_evalsched.examples.basic:noop"
    )
    recover = LocalExecutor.recover

    def recover_or_raise(self, run, done):
        if run.id == bad:
            raise RuntimeError("boom")
        return recover(self, run, done)

    monkeypatch.setattr(LocalExecutor, "recover", recover_or_raise)
    await jp_serverapp.extension_manager.start_all_extensions()

    async def get(path):
        resp = await jp_fetch("evalsched", *path.split("/"), raise_error=False)
        return resp.code, json.loads(resp.body)

    code, rec = await get(f"runs/{bad}")
    assert code == 200 and rec["state"] == "failed", rec
    assert rec["reason"] == "exception: the server could not recover the run: RuntimeError: boom"
    code, _ = await get("status")
    assert code == 200

    async def good_succeeded():
        return (await get(f"runs/{good}"))[1]["state"] == "succeeded"

    await async_wait_until(good_succeeded, timeout=30)


@pytest.mark.parametrize("kind", KINDS)
def test_a_model_hosts_log_that_is_not_a_file_is_never_opened(tmp_path, outside_fifo, kind):
    from types import SimpleNamespace

    from evals_hostile import place

    from jupyter_evalsched.shared_models.manager import ModelHostManager

    manager = ModelHostManager([], log_dir=str(tmp_path / ".models"))
    (tmp_path / ".models").mkdir()
    place(manager.log_path("m"), kind, outside_fifo)
    assert manager._tail(SimpleNamespace(config=SimpleNamespace(name="m"))) == ""


@pytest.mark.parametrize("kind", ["fifo", "symlink"])
def test_a_models_folder_that_is_not_a_folder_does_not_stop_the_start(tmp_path, outside_fifo, kind):
    import asyncio

    from evals_hostile import place

    from jupyter_evalsched.shared_models.manager import ModelHostManager

    place(str(tmp_path / ".models"), kind, outside_fifo)
    manager = ModelHostManager([], log_dir=str(tmp_path / ".models"), socket_parent=str(tmp_path))

    async def start_stop():
        await manager.start()
        await manager.stop()

    asyncio.run(start_stop())
