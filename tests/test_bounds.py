"""Issue #30 (Hardening III), items 3, 4 and 9: sizes bounded at validation, a warm hand-over
that cannot be sent starts the run cold (once), a cancel of a pending start ends the run at
once, sweeps capped in total size and built in slices off a loop that keeps answering, a limit
on concurrent sweep submissions, and one sweep per Idempotency-Key even when two submissions
with it overlap. A real server, real zygotes, real runs.

Tests are plain ``async def``: pytest-jupyter runs them on the server's loop, so a request that
blocks the loop delays the test's own requests too (which is what the liveness tests measure).
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path

import psutil
import pytest
from proc_status import alive
from rest import NOOP, SLEEPY, spec, submit
from waiting import async_wait_until

from jupyter_evalsched.scheduler.sweeps import MAX_SWEEP_JSON_CHARS, MAX_SWEEP_SUBMISSIONS
from jupyter_evalsched.schemas import (
    MAX_ENV_BYTES,
    MAX_ENV_NAME_CHARS,
    MAX_ENV_VALUE_BYTES,
    MAX_SPEC_JSON_CHARS,
)
from jupyter_evalsched.store import StoreError

FINGERPRINT = f"{Path(__file__).resolve().parent / 'evals_warm.py'}:fingerprint"


@pytest.fixture
def evalsched_config():
    return {"cpu_slots": 16, "warm_start": False}


async def status(api) -> dict:
    code, body = await api("GET", "status")
    assert code == 200, body
    return body


async def ready_zygote(api) -> dict:
    """The server's zygote once it is ready and holds its two spares."""

    async def ready():
        warm = (await status(api))["warm_start"]
        return next((z for z in warm["zygotes"] if z["state"] == "ready" and len(z["spares"]) == 2), None)

    return await async_wait_until(ready, timeout=30, message="no zygote became ready with its spares")


def run_processes(run_id: str) -> list[int]:
    """Live processes whose environment names the run."""
    needle = f"EVALSCHED_RUN_ID={run_id}".encode()
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.status() != psutil.STATUS_ZOMBIE and needle in Path(f"/proc/{proc.pid}/environ").read_bytes().split(
                b"\0"
            ):
                found.append(proc.pid)
        except (OSError, psutil.Error):
            continue
    return found


# ----------------------------------------------------------------------------- sizes bounded


def _env_filling(total: int) -> dict[str, str]:
    """Variables whose ``NAME=value`` pairs (each with its NUL) take exactly ``total`` bytes."""
    env: dict[str, str] = {}
    left = total
    i = 0
    while left:
        name = f"EVALSCHED_TEST_FILL_{i:03d}"
        room = min(left, MAX_ENV_VALUE_BYTES + len(name) + 2)
        env[name] = "v" * (room - len(name) - 2)
        left -= room
        i += 1
    return env


@pytest.mark.parametrize(
    ("label", "body", "field", "limit"),
    [
        ("one value of 300 KB", {"env": {"BIG": "x" * 300_000}}, "env", MAX_ENV_VALUE_BYTES),
        ("values over the total", {"env": _env_filling(MAX_ENV_BYTES + 1)}, "env", MAX_ENV_BYTES),
        ("a long name", {"env": {"N" * (MAX_ENV_NAME_CHARS + 1): "1"}}, "env", MAX_ENV_NAME_CHARS),
        # 1,000,000 characters of source (its own limit) that spec.json holds as 6,000,000
        # ("\u00e9" each): within the body limit as UTF-8, over the spec's.
        (
            "the whole spec",
            {"source": "\u00e9" * 1_000_000, "entrypoint": "eval.py:episode"},
            "spec",
            MAX_SPEC_JSON_CHARS,
        ),
    ],
)
async def test_oversized_fields_are_a_422_naming_the_field_and_the_limit(api, runs_dir, label, body, field, limit):
    payload = {"entrypoint": NOOP, **body}
    raw = json.dumps(payload, ensure_ascii=False).encode()
    assert len(raw) < MAX_SPEC_JSON_CHARS  # the body itself is not too large: the field is
    code, err = await api("POST", "runs", raw)
    assert code == 422, (label, code, str(err)[:300])
    assert err["message"].startswith(f"invalid spec: {field}"), err["message"][:300]
    assert str(limit) in err["message"], err["message"][:300]
    code, sweep_err = await api("POST", "sweeps", json.dumps({**payload, "sweep": {"k": [1]}}, ensure_ascii=False))
    assert code == 422 and str(limit) in sweep_err["message"], (code, str(sweep_err)[:300])
    assert (await api("GET", "runs"))[1]["total"] == 0


# ----------------------------------------------------------------------------- warm hand-over

WARM = {"warm_start": True, "cpu_slots": 16}
# The server's own run_env (not a spec's: it is not bounded) makes every start message larger than
# one datagram of the zygote's socket (SOCK_SEQPACKET, about 208 KB by default).
HUGE_RUN_ENV = {f"EVALSCHED_TEST_HUGE_{i}": "x" * 60_000 for i in range(4)}


@pytest.mark.parametrize("evalsched_config", [{**WARM, "run_env": HUGE_RUN_ENV}])
async def test_a_start_that_cannot_be_handed_over_starts_cold_once_and_keeps_the_spares(api, wait_for):
    zygote = await ready_zygote(api)
    rec = await submit(api, spec(entry=NOOP))
    final = await wait_for(rec["id"], timeout=20)
    assert final["state"] == "succeeded" and final["start"] == "cold", final
    assert "hand-over" in final["start_detail"] and "Message too long" in final["start_detail"], final

    # No storm: the spare given the failed hand-over leaves with the cgroup it had prepared for the
    # run (its limits were written) and is replaced once; the other spare still waits, and the
    # zygote forked no run.
    async def replaced() -> bool:
        after = next(z for z in (await status(api))["warm_start"]["zygotes"] if z["pid"] == zygote["pid"])
        return len(after["spares"]) == 2

    await async_wait_until(replaced, timeout=10, message="the spare was not replaced")
    after = next(z for z in (await status(api))["warm_start"]["zygotes"] if z["pid"] == zygote["pid"])
    assert len(set(after["spares"]) & set(zygote["spares"])) == 1 and after["forks"] == 0, (zygote, after)
    assert all(psutil.Process(pid).ppid() == zygote["pid"] for pid in after["spares"])


@pytest.mark.parametrize("evalsched_config", [WARM])
async def test_a_spec_env_at_its_limit_still_starts_warm_and_shows_in_proc(api, wait_for, tmp_path):
    """Also in ``/proc/<pid>/environ``, where clean-up without cgroups finds a run's leftovers."""
    await ready_zygote(api)
    env = _env_filling(MAX_ENV_BYTES)
    out = tmp_path / "fp.json"
    rec = await submit(api, spec(entry=FINGERPRINT, env=env, params={"out": str(out)}))
    final = await wait_for(rec["id"], timeout=20)
    assert final["state"] == "succeeded" and final["start"] == "warm", final
    shown = json.loads(out.read_text())["proc_environ"]
    assert shown.get("EVALSCHED_RUN_ID") == rec["id"] and all(shown.get(k) == v for k, v in env.items())


class TestPendingStart:
    """A zygote still preloading (held by a flag file): a run admitted meanwhile waits for its
    fork. A cancel then ends it at once."""

    @pytest.fixture
    def hold_flag(self, tmp_path):
        path = tmp_path / "preload"
        path.mkdir()
        (path / "warm_slow.py").write_text(
            "import os, time\n"
            "FLAG = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'hold.flag')\n"
            "deadline = time.monotonic() + 60\n"
            "while os.path.exists(FLAG) and time.monotonic() < deadline:\n"
            "    time.sleep(0.02)\n"
        )
        flag = path / "hold.flag"
        flag.touch()
        yield flag
        flag.unlink(missing_ok=True)

    @pytest.fixture
    def evalsched_config(self, hold_flag):
        return {**WARM, "run_env": {"PYTHONPATH": str(hold_flag.parent)}, "preload_modules": ["warm_slow"]}

    async def test_a_cancel_of_a_pending_start_ends_the_run_at_once(self, api, wait_for, runs_dir, hold_flag):
        assert [z["state"] for z in (await status(api))["warm_start"]["zygotes"]] == ["starting"]
        rec = await submit(api, spec(entry=SLEEPY, episodes=100, sleep_s=0.2))

        async def admitted() -> bool:  # queued, starting: waiting for its fork (#30)
            return ((await api("GET", f"runs/{rec['id']}"))[1]["why"] or {}).get("code") == "starting"

        await async_wait_until(admitted, timeout=10, message="the run was not admitted")
        code, _ = await api("POST", f"runs/{rec['id']}/cancel")
        assert code == 200
        final = await wait_for(rec["id"], timeout=5)
        assert final["state"] == "cancelled" and final["pid"] is None, final
        assert (runs_dir / rec["id"] / "_DONE").exists()
        # Still preloading: the cancel did not wait for the fork.
        assert {z["state"] for z in (await status(api))["warm_start"]["zygotes"]} == {"starting"}
        hold_flag.unlink()
        await ready_zygote(api)
        assert run_processes(rec["id"]) == []
        assert (await api("GET", f"runs/{rec['id']}"))[1]["state"] == "cancelled"
        again = await submit(api, spec(entry=NOOP))
        final = await wait_for(again["id"], timeout=20)
        assert final["state"] == "succeeded" and final["start"] == "warm", final


# ----------------------------------------------------------------------------- sweeps


async def test_a_sweep_over_the_total_size_is_a_422_naming_the_limit(api, runs_dir):
    blob = "b" * 900_000
    points = MAX_SWEEP_JSON_CHARS // len(blob) + 5
    body = {**spec(entry=NOOP, params={"blob": blob}), "sweep": {"k": list(range(points))}}
    code, err = await api("POST", "sweeps", body)
    assert code == 422, (code, str(err)[:300])
    assert err["message"].startswith("sweep") and str(MAX_SWEEP_JSON_CHARS) in err["message"], err["message"]
    assert (await api("GET", "runs"))[1]["total"] == 0
    assert [p.name for p in runs_dir.iterdir() if not p.name.startswith(".")] == []
    # A point's params are bounded as a spec's are.
    body = {**spec(entry=NOOP, params={"blob": blob}), "sweep": [{"more": "m" * 200_000}]}
    code, err = await api("POST", "sweeps", body)
    assert code == 422 and err["detail"][0]["loc"][:2] == ["sweep", 0] and "1000000" in err["message"], err


async def _status_latencies_while(jp_fetch, task: asyncio.Future) -> list[float]:
    """How long each ``/api/status`` took while ``task`` ran."""
    latencies = []
    while not task.done():
        started = time.monotonic()
        await jp_fetch("api", "status")
        latencies.append(time.monotonic() - started)
    return latencies


async def _sweep_liveness(api, jp_fetch, wait_for, points: int, params: dict) -> None:
    blocker = await submit(api, spec(entry=SLEEPY, episodes=1000, sleep_s=0.2))
    await wait_for(blocker["id"], states=("running",))
    # Its runs wait for the blocker: none runs while the answers are timed.
    body = {**spec(entry=NOOP, params=params, depends_on=[blocker["id"]]), "sweep": {"k": list(range(points))}}
    task = asyncio.ensure_future(api("POST", "sweeps", body))
    latencies = await _status_latencies_while(jp_fetch, task)
    code, made = task.result()
    assert code == 201 and len(made["runs"]) == points, (code, str(made)[:300])
    # A liveness bound, not a speed one: the unsliced submission blocked the loop for 31 s; 3 s
    # leaves room for a loaded 2-core host.
    assert len(latencies) >= 3 and max(latencies) < 3.0, latencies
    await api("POST", f"sweeps/{made['id']}/cancel")
    await api("POST", f"runs/{blocker['id']}/cancel")


async def test_the_server_answers_while_a_heavy_sweep_is_submitted(api, jp_fetch, wait_for):
    """40 points of about 0.8 MB of params each (many numbers: costly to validate again)."""
    await _sweep_liveness(api, jp_fetch, wait_for, 40, {"w": [0.5] * 200_000})


@pytest.mark.slow
async def test_the_server_answers_while_a_1000_point_sweep_is_submitted(api, jp_fetch, wait_for):
    await _sweep_liveness(api, jp_fetch, wait_for, 1000, {"w": [0.5] * 5_000})


@pytest.fixture
def held_creates(evalsched, monkeypatch):
    """Run directories are created only once ``release`` is set; ``calls`` counts the tries."""
    store = evalsched.submissions.store
    assemble = store.assemble
    release = threading.Event()
    calls: list[str] = []

    def held(run_id, files):
        calls.append(run_id)
        release.wait(30)
        return assemble(run_id, files)

    monkeypatch.setattr(store, "assemble", held)
    yield release, calls
    release.set()


async def test_concurrent_sweep_submissions_beyond_the_limit_are_a_429(api, jp_fetch, evalsched, held_creates):
    release, calls = held_creates
    body = {**spec(entry=NOOP), "sweep": {"k": [1, 2]}}
    first = [asyncio.ensure_future(api("POST", "sweeps", body)) for _ in range(MAX_SWEEP_SUBMISSIONS)]
    # Each sweep's runs (its 2 points: one chunk) are with the writer, whose one thread is held
    # in the first of them.
    creating = evalsched.submissions._creating
    await async_wait_until(lambda: len(creating) == 2 * MAX_SWEEP_SUBMISSIONS, timeout=10, message="not all in flight")
    resp = await asyncio.wait_for(
        jp_fetch("evalsched", "sweeps", method="POST", body=json.dumps(body), raise_error=False), 10
    )
    err = json.loads(resp.body)
    assert resp.code == 429 and resp.headers.get("Retry-After") and str(MAX_SWEEP_SUBMISSIONS) in err["message"], (
        resp.code,
        err,
    )
    release.set()
    answers = await asyncio.gather(*first)
    assert [code for code, _ in answers] == [201] * MAX_SWEEP_SUBMISSIONS, answers
    assert (await api("GET", "runs"))[1]["total"] == 2 * MAX_SWEEP_SUBMISSIONS


def entries(monkeypatch, obj, name: str) -> list[int]:
    """Counts the calls of the coroutine method ``obj.name`` (one entry per call, as it starts:
    it runs up to its first wait in the step that enters it)."""
    entered: list[int] = []
    method = getattr(obj, name)

    async def counted(*args, **kwargs):
        entered.append(1)
        return await method(*args, **kwargs)

    monkeypatch.setattr(obj, name, counted)
    return entered


def keyed_post(jp_fetch, path: str, body: dict, key: str):
    """A function that POSTs ``body`` with the Idempotency-Key ``key``."""
    text = json.dumps(body)
    return lambda: jp_fetch(
        "evalsched", path, method="POST", body=text, headers={"Idempotency-Key": key}, raise_error=False
    )


async def test_two_overlapping_sweep_submissions_with_one_key_make_one_sweep(
    api, jp_fetch, evalsched, held_creates, monkeypatch
):
    release, calls = held_creates
    entered = entries(monkeypatch, evalsched.submissions, "submit_sweep")
    post = keyed_post(jp_fetch, "sweeps", {**spec(entry=NOOP), "sweep": {"k": [1, 2, 3]}}, "same-1")

    a = asyncio.ensure_future(post())
    await async_wait_until(lambda: len(calls) == 1, timeout=10, message="the first submission is not writing")
    b = asyncio.ensure_future(post())
    await async_wait_until(lambda: len(entered) == 2, timeout=10, message="the second submission did not arrive")
    release.set()
    first, second = await asyncio.gather(a, b)
    answers = sorted([(first.code, json.loads(first.body)), (second.code, json.loads(second.body))], key=lambda x: x[0])
    (code_again, replay), (code_new, made) = answers
    assert (code_again, code_new) == (200, 201), answers
    assert replay["id"] == made["id"] and [r["id"] for r in replay["runs"]] == [r["id"] for r in made["runs"]]
    code, listing = await api("GET", "runs")
    assert listing["total"] == 3, [r["sweep_id"] for r in listing["runs"]]


async def test_deeply_nested_sweep_values_are_a_4xx_never_a_500(api):
    failures = []
    for depth in range(900, 1000, 4):
        value = "[" * depth + "1" + "]" * depth
        body = '{"entrypoint": "' + NOOP + '", "sweep": {"x": [' + value + "]}}"
        code, text = await api("POST", "sweeps", body, raw=True)
        if code not in (400, 422):
            failures.append((depth, code, text[:200]))
        body = '{"entrypoint": "' + NOOP + '", "sweep": [{"x": ' + value + "}]}"
        code, text = await api("POST", "sweeps", body, raw=True)
        if code not in (400, 422):
            failures.append((depth, code, text[:200]))
    assert not failures, failures
    assert (await api("GET", "runs"))[1]["total"] == 0


async def test_submissions_waiting_on_one_key_whose_first_failed_make_one_run(api, jp_fetch, evalsched, monkeypatch):
    """The same class for single runs: two submissions wait for a first with their key; that
    one fails (503), and of the two waiting, one makes the run and the other answers with it."""
    store = evalsched.submissions.store
    assemble = store.assemble
    release = threading.Event()
    calls: list[str] = []

    def first_fails(run_id, files):
        calls.append(run_id)
        if len(calls) == 1:
            release.wait(30)
            raise StoreError("the runs directory is full (test)")
        return assemble(run_id, files)

    monkeypatch.setattr(store, "assemble", first_fails)
    entered = entries(monkeypatch, evalsched.submissions, "submit")
    post = keyed_post(jp_fetch, "runs", spec(entry=NOOP), "one-1")

    try:
        first = asyncio.ensure_future(post())
        await async_wait_until(lambda: len(calls) == 1, timeout=10, message="the first submission is not writing")
        waiting = [asyncio.ensure_future(post()) for _ in range(2)]
        await async_wait_until(lambda: len(entered) == 3, timeout=10, message="the others did not arrive")
    finally:
        release.set()
    assert (await first).code == 503
    answers = sorted((r.code, json.loads(r.body)) for r in await asyncio.gather(*waiting))
    assert [code for code, _ in answers] == [200, 201], answers
    assert answers[0][1]["id"] == answers[1][1]["id"], answers
    assert (await api("GET", "runs"))[1]["total"] == 1


@pytest.mark.parametrize(
    "evalsched_config", [{"models": [{"name": "upper", "loader": "jupyter_evalsched.shared_models.testing:upper"}]}]
)
async def test_a_cancel_while_the_model_host_is_awaited_ends_the_run_at_once(api, evalsched, runs_dir, monkeypatch):
    """The same class before a cold start: a run admitted and waiting for its model host."""
    local = evalsched.executors["local"]
    host_answers = asyncio.Event()
    urls_for = local.models.urls_for
    asked: list[list[str]] = []

    async def held(names):
        asked.append(list(names))
        await host_answers.wait()
        return await urls_for(names)

    monkeypatch.setattr(local.models, "urls_for", held)
    rec = await submit(api, spec(entry=SLEEPY, episodes=100, sleep_s=0.2, models=["upper"]))
    await async_wait_until(lambda: asked, timeout=10, message="the run did not wait for its model host")
    code, answer = await api("POST", f"runs/{rec['id']}/cancel")
    assert code == 200 and answer["state"] == "cancelled" and answer["pid"] is None, answer
    assert (runs_dir / rec["id"] / "_DONE").exists()
    host_answers.set()
    await async_wait_until(lambda: rec["id"] not in local._starting, timeout=10, message="its start is still awaited")
    assert (await api("GET", f"runs/{rec['id']}"))[1]["state"] == "cancelled" and run_processes(rec["id"]) == []


@pytest.mark.parametrize("evalsched_config", [WARM])
async def test_a_cancel_while_a_spare_holds_the_start_kills_that_spare_and_ends_the_run(api, wait_for, runs_dir):
    """The start was handed to a spare that has not answered (stopped here, as a busy host could
    keep it): the cancel ends the run at once, and the spare, which may have become the run
    already, is killed; the zygote replaces it."""
    zygote = await ready_zygote(api)
    spares = [psutil.Process(pid) for pid in zygote["spares"]]
    for spare in spares:
        spare.suspend()
    try:
        rec = await submit(api, spec(entry=SLEEPY, episodes=100, sleep_s=0.2))

        async def handed() -> bool:  # a spare was given it (it is not held as a spare any more)
            warm = (await status(api))["warm_start"]["zygotes"]
            return len(next(z for z in warm if z["pid"] == zygote["pid"])["spares"]) < 2

        await async_wait_until(handed, timeout=10, message="the start was not handed to a spare")
        code, answer = await api("POST", f"runs/{rec['id']}/cancel")
        assert code == 200 and answer["state"] == "cancelled" and answer["pid"] is None, answer
        assert (runs_dir / rec["id"] / "_DONE").exists()
        await async_wait_until(
            lambda: sum(not alive(s.pid) for s in spares) == 1,  # (gone between two looks: gone)
            timeout=10,
            message="the spare given the run was not killed",
        )
    finally:
        for spare in spares:
            try:
                spare.resume()
            except psutil.NoSuchProcess:
                pass
    await ready_zygote(api)
    assert run_processes(rec["id"]) == [] and (await api("GET", f"runs/{rec['id']}"))[1]["state"] == "cancelled"
    again = await submit(api, spec(entry=NOOP))
    final = await wait_for(again["id"], timeout=20)
    assert final["state"] == "succeeded" and final["start"] == "warm", final


def test_params_at_the_depth_limit_are_read_back_from_spec_json_and_job_json(tmp_path):
    """What validation accepts, the store reads back: params nested MAX_PARAMS_DEPTH levels deep
    (under ``params`` in spec.json, under ``sweep_point`` in job.json) parse again."""
    from jupyter_evalsched.schemas import MAX_PARAMS_DEPTH, EvalSpec
    from jupyter_evalsched.store import SPEC_JSON_DEPTH, parse_json

    value: object = 1
    for _ in range(MAX_PARAMS_DEPTH - 1):
        value = [value]
    spec = EvalSpec.model_validate({"entrypoint": "m:f", "params": {"deep": value}})
    text = spec.model_dump_json()
    assert parse_json(text, "spec.json", SPEC_JSON_DEPTH)["params"]["deep"] == value
    job = json.dumps({"sweep_point": {"deep": value}})
    assert parse_json(job, "job.json", SPEC_JSON_DEPTH)["sweep_point"]["deep"] == value
