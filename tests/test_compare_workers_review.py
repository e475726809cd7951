"""The comparisons' worker processes as a demanding user and an adversary see them: an idle worker
is retired (its memory given back) and the next comparison starts a new one; the worker's
interpreter is not shaped by the user's environment (PYTHONPATH, the working directory, a
``sitecustomize`` that prints); it holds none of the server's sockets and reads only what the
server would; an answer or a request larger than a pipe's buffer goes through; a comparison cut
off by the server's stop says so."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from pathlib import Path
from types import SimpleNamespace

import pytest
from rest import spec, submit
from test_compare_limits import MANY, compared_once, ended
from waiting import async_wait_until

from jupyter_evalsched import contract
from jupyter_evalsched.scheduler import compare, compare_worker, comparisons
from jupyter_evalsched.store import RunStore


@pytest.fixture
def evalsched_config():
    return {"cpu_slots": 16}


# --------------------------------------------------------------------------- idle workers retire


async def test_an_idle_worker_is_retired_and_the_next_compare_starts_a_new_one(api, wait_for, evalsched, monkeypatch):
    monkeypatch.setattr(comparisons, "WORKER_IDLE_S", 3600.0, raising=False)
    rid, first, pid = await compared_once(api, wait_for, evalsched)
    code, again = await api("GET", "compare", params={"runs": rid})
    assert code == 200 and again == first
    assert evalsched.comparisons.workers() == {"idle": [pid], "busy": []}  # reused while comparisons come
    # Idle for no time at all: retired as soon as it is idle again, never while it answers.
    monkeypatch.setattr(comparisons, "WORKER_IDLE_S", 0.0, raising=False)
    code, again = await api("GET", "compare", params={"runs": rid})
    assert code == 200 and again == first
    await async_wait_until(lambda: ended(pid), timeout=30, message="the idle worker was not retired")
    await async_wait_until(lambda: evalsched.comparisons.workers() == {"idle": [], "busy": []}, timeout=30)
    # Each comparison after that gets a fresh worker, which retires in turn: none is answered 503.
    pids = set()
    for _ in range(3):
        code, again = await api("GET", "compare", params={"runs": rid})
        assert code == 200 and again == first, again
        pids.update(evalsched.comparisons.workers()["idle"])
    assert pid not in pids
    for each in pids:
        await async_wait_until(lambda each=each: ended(each), timeout=30, message=f"worker {each} was not retired")


# --------------------------------------------------------------------------- the worker's start


async def test_a_workers_comparison_loads_no_third_party_module(api, wait_for, evalsched):
    """A cold worker's first comparison (timestamps in its records: the runs' wall times) imports
    the standard library and the package's light modules only: the scheduler's run table pulled
    in pydantic, about 0.2 s of it."""
    _, answer, pid = await compared_once(api, wait_for, evalsched)
    assert answer["rows"][0]["wall_s"] is not None, answer
    maps = Path(f"/proc/{pid}/maps").read_text()
    assert "pydantic" not in maps and "site-packages" not in maps, maps


# --------------------------------------------------------------------------- the worker's environment

SITECUSTOMIZE = "print('hello from a sitecustomize of the user', flush=True)\n"
# A module of the standard library's name that the worker imports (the server imported it long ago).
SHADOW = "raise ImportError('a select.py of the user shadowed the standard library')\n"


@pytest.mark.parametrize("where", ["PYTHONPATH", "working directory"])
async def test_the_workers_interpreter_is_not_shaped_by_the_users_environment(
    api, wait_for, evalsched, monkeypatch, tmp_path, where
):
    run = await submit(api, spec(entry=MANY, episodes=2, params={"names": 3}))
    assert (await wait_for(run["id"]))["state"] == "succeeded"
    users = tmp_path / "users-files"
    users.mkdir()
    (users / "sitecustomize.py").write_text(SITECUSTOMIZE)
    (users / "select.py").write_text(SHADOW)
    if where == "PYTHONPATH":
        monkeypatch.setenv("PYTHONPATH", str(users))
    else:  # (a notebook's folder where the server was started, and "." in PYTHONPATH)
        monkeypatch.chdir(users)
        monkeypatch.setenv("PYTHONPATH", ".")
    code, answer = await api("GET", "compare", params={"runs": run["id"]})
    assert code == 200, answer
    assert answer["metrics"] and answer["rows"][0]["error"] is None, answer


async def test_the_worker_holds_none_of_the_servers_sockets(api, wait_for, evalsched):
    _, _, pid = await compared_once(api, wait_for, evalsched)
    held = {fd: os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")}
    assert not [target for target in held.values() if target.startswith("socket:")], held
    assert len(held) <= 4, held  # stdin, stdout (the answers), stderr, and the answers' own copy


async def test_the_worker_reads_only_what_the_server_would(api, wait_for, evalsched, runs_dir, tmp_path):
    """A run directory replaced by a link to elsewhere: its row says so, nothing is read there."""
    run = await submit(api, spec(entry=MANY, episodes=2, params={"names": 3}))
    assert (await wait_for(run["id"]))["state"] == "succeeded"
    elsewhere = tmp_path / "elsewhere"
    (runs_dir / run["id"]).rename(elsewhere)
    (runs_dir / run["id"]).symlink_to(elsewhere)
    code, answer = await api("GET", "compare", params={"runs": run["id"]})
    assert code == 200, answer
    (row,) = answer["rows"]
    assert "not a plain directory" in row["error"] and row["metrics"] == {}, row


# --------------------------------------------------------------------------- the pipes


def test_an_answer_and_a_request_larger_than_a_pipe_buffer_go_through(tmp_path):
    """A real worker: 1000 runs (a request of ~150 KB), four of them with 256 long metric names
    (an answer of ~1.5 MB); the same answer as computed in this process."""
    store = RunStore(tmp_path)
    names = [f"{i:03d}" + "m" * (contract.MAX_METRIC_NAME_CHARS - 3) for i in range(contract.MAX_METRIC_NAMES)]
    runs = []
    for i in range(1000):
        rid = f"run-{i:04d}"
        (tmp_path / rid).mkdir()
        (tmp_path / rid / contract.SPEC_FILE).write_text(json.dumps({"params": {"i": i}}))
        if i < 4:
            lines = (json.dumps({"index": e, "metrics": {n: e + i + k for k, n in enumerate(names)}}) for e in range(3))
            (tmp_path / rid / contract.EPISODES_FILE).write_text("".join(line + "\n" for line in lines))
        record = {"id": rid, "name": f"a run of a sweep, {i}", "state": "succeeded", "started_at": None}
        runs.append(SimpleNamespace(id=rid, record={**record, "finished_at": None, "observed": {}}))

    async def through_a_worker() -> bytes:
        comparing = comparisons.Comparisons(None, store)  # type: ignore[arg-type]
        try:
            return await comparing.compare(runs, "run-0000")  # type: ignore[arg-type]
        finally:
            comparing.close()

    body = asyncio.run(through_a_worker())
    assert len(body) > 1 << 20
    records = [comparisons._record(run) for run in runs]  # type: ignore[arg-type]
    expected = compare_worker.compare_runs(store, records, "run-0000", None, compare.MAX_COMPARE_VALUES, 60.0)
    assert json.loads(body) == expected


# --------------------------------------------------------------------------- the server's stop


async def test_a_compare_cut_off_by_the_servers_stop_says_so(api, wait_for, evalsched):
    rid, _, pid = await compared_once(api, wait_for, evalsched)
    os.kill(pid, signal.SIGSTOP)  # it takes the next request and answers nothing before the stop
    try:
        pending = asyncio.ensure_future(api("GET", "compare", params={"runs": rid}))
        await async_wait_until(lambda: evalsched.comparisons.workers()["busy"] == [pid], timeout=30)
        evalsched.comparisons.close()  # (what the scheduler's stop calls)
    finally:
        if not ended(pid):
            os.kill(pid, signal.SIGKILL)
    code, answer = await pending
    assert code == 503, answer
    assert "stopping" in answer["message"] and "killed by signal" not in answer["message"], answer
    assert ended(pid)
