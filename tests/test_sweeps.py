"""Sweeps and comparison (#18) over the REST API of a real server: the runs a sweep makes, its
cancel, and comparisons computed again here from the runs' episodes.jsonl."""

from __future__ import annotations

import asyncio
import json
import math
import os
import threading
from pathlib import Path

import pytest
from cli_subprocess import run_cli
from rest import SLEEPY, spec, submit
from waiting import async_wait_until

from jupyter_evalsched.scheduler import sweeps
from jupyter_evalsched.scheduler.compare import t_quantile
from jupyter_evalsched.store import StoreError

HERE = Path(__file__).resolve().parent
SCORED = f"{HERE / 'evals_sweep.py'}:scored"


@pytest.fixture
def evalsched_config():
    return {"cpu_slots": 16}


async def sweep(api, body, expect=201, headers=None):
    code, answer = await api("POST", "sweeps", body)
    assert code == expect, answer
    return answer


def params_of(runs_dir: Path, run_id: str) -> dict:
    return json.loads((runs_dir / run_id / "spec.json").read_text())["params"]


def episodes_of(runs_dir: Path, run_id: str) -> dict[int, dict]:
    lines = (runs_dir / run_id / "episodes.jsonl").read_text().splitlines()
    return {e["index"]: e["metrics"] for e in map(json.loads, lines)}


async def test_a_grid_makes_one_run_per_combination(api, wait_for, runs_dir):
    body = spec(entry=SCORED, episodes=2, params={"base": 1.0, "keep": "me"}, name="grid")
    body["sweep"] = {"temperature": [0.2, 0.7, 1.0], "k": [1, 5]}
    made = await sweep(api, body)
    assert made["id"].startswith("sweep-") and len(made["runs"]) == 6
    points = [(r["sweep_point"]["temperature"], r["sweep_point"]["k"]) for r in made["runs"]]
    assert points == [(0.2, 1), (0.2, 5), (0.7, 1), (0.7, 5), (1.0, 1), (1.0, 5)]
    for run in made["runs"]:
        assert run["sweep_id"] == made["id"]
        assert params_of(runs_dir, run["id"]) == {"base": 1.0, "keep": "me", **run["sweep_point"]}
    assert made["runs"][0]["name"] == "grid [temperature=0.2, k=1]"
    for run in made["runs"]:
        assert (await wait_for(run["id"]))["state"] == "succeeded"
    code, view = await api("GET", f"sweeps/{made['id']}")
    assert (
        code == 200
        and view["counts"] == {"succeeded": 6}
        and [r["id"] for r in view["runs"]] == [r["id"] for r in made["runs"]]
    )
    code, listing = await api("GET", "sweeps")
    assert code == 200 and listing["sweeps"][0]["id"] == made["id"] and listing["sweeps"][0]["runs"] == 6


async def test_a_list_sweep_and_runs_that_depend_on_a_sweeps_runs(api, wait_for, runs_dir):
    body = spec(entry=SCORED, episodes=1, params={"base": 0.0})
    body["sweep"] = [{"base": 1.0}, {"base": 2.0, "extra": True}, {"base": 3.0}]
    made = await sweep(api, body)
    assert [params_of(runs_dir, r["id"]) for r in made["runs"]] == [
        {"base": 1.0},
        {"base": 2.0, "extra": True},
        {"base": 3.0},
    ]
    after = await submit(api, spec(depends_on=[r["id"] for r in made["runs"]]))
    final = await wait_for(after["id"])
    assert final["state"] == "succeeded"
    ends = [(await wait_for(r["id"]))["finished_at"] for r in made["runs"]]
    assert all(end <= final["started_at"] for end in ends)


@pytest.mark.parametrize(
    ("bad", "where"),
    [
        ({}, "sweep"),
        ([], "sweep"),
        ({"t": []}, "sweep.t"),
        ({"t": [1, 1]}, "sweep.t"),
        ([{"t": 1}, {"t": 1}], "sweep.1"),
        ([{"t": 1}, 5], "sweep.1"),
        ({"t": list(range(40)), "k": list(range(40))}, "sweep"),
        ("temperature", "sweep"),
    ],
)
async def test_a_bad_sweep_is_a_precise_422_and_makes_no_run(api, bad, where):
    body = spec(entry=SCORED)
    body["sweep"] = bad
    answer = await sweep(api, body, expect=422)
    assert answer["message"].startswith(where), answer
    code, runs = await api("GET", "runs")
    assert runs["total"] == 0


async def test_a_point_that_makes_an_invalid_spec_is_refused_before_any_run(api):
    body = spec(entry=SCORED, name="x" * 190)
    body["sweep"] = {"t": ["a" * 50]}  # the run's name would pass the limit: it is cut, not refused
    made = await sweep(api, body)
    assert len(made["runs"][0]["name"]) <= 200
    body = spec(entry=f"{HERE / 'no_such_file.py'}:episode")
    body["sweep"] = {"t": [1, 2]}
    answer = await sweep(api, body, expect=422)
    assert "no_such_file.py" in answer["message"], answer
    assert (await api("GET", "runs"))[1]["total"] == 1  # the first sweep's run only


async def test_cancel_of_a_sweep_cancels_only_its_unfinished_runs(api, wait_for):
    body = spec(entry=SLEEPY, episodes=1)
    body["sweep"] = {"sleep_s": [0.01, 60.0]}
    made = await sweep(api, body)
    fast, slow = made["runs"]
    assert (await wait_for(fast["id"]))["state"] == "succeeded"
    await wait_for(slow["id"], states=("running",))
    code, view = await api("POST", f"sweeps/{made['id']}/cancel")
    assert code == 200
    assert (await wait_for(slow["id"]))["state"] == "cancelled"
    assert (await wait_for(fast["id"]))["state"] == "succeeded"
    code, view = await api("GET", f"sweeps/{made['id']}")
    assert view["counts"] == {"succeeded": 1, "cancelled": 1}
    assert (await api("GET", "sweeps/sweep-nope"))[0] == 404
    assert (await api("POST", "sweeps/sweep-nope/cancel"))[0] == 404


# Outlives the cancel's SIGTERM (the grace is long) until the test writes the release file, then
# dies of it, as a run slow to stop would. Says it ignores SIGTERM with a file named by its point.
STUBBORN = """\
import os, signal, time

def episode(ctx, index):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    open(os.path.join(ctx.params["ready"], str(ctx.params["point"])), "w").close()
    while not os.path.exists(ctx.params["release"]):
        time.sleep(0.02)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)
"""


# One CPU slot: one run of the sweep runs, the others wait queued.
@pytest.mark.parametrize("evalsched_config", [{"cpu_slots": 1, "cancel_grace_s": 3600.0}])
async def test_a_sweeps_cancel_answer_says_which_runs_are_still_ending(api, wait_for, jp_serverapp, tmp_path):
    """The sweep cancel's answer says which runs were signalled and still end (the view alone shows
    them ``running``, as if never cancelled): each run with ``cancel_requested`` as a run's cancel
    answers it, and their count; the CLI says how many."""
    ready, release = tmp_path / "ready", tmp_path / "release"
    ready.mkdir()
    body = {"source": STUBBORN, "episodes": 1, "params": {"ready": str(ready), "release": str(release)}}
    body["sweep"] = {"point": [0, 1, 2]}
    made = await sweep(api, body)
    ids = [r["id"] for r in made["runs"]]
    (point,) = await async_wait_until(lambda: os.listdir(ready), timeout=60, message="no run of the sweep started")
    running = made["runs"][int(point)]["id"]
    await wait_for(running, states=("running",))

    code, answer = await api("POST", f"sweeps/{made['id']}/cancel")
    assert code == 200, answer
    assert [r["id"] for r in answer["runs"]] == ids and answer["id"] == made["id"]
    assert answer["still_ending"] == 1 and answer["counts"] == {"running": 1, "cancelled": 2}, answer
    for run in answer["runs"]:
        if run["id"] == running:  # signalled, still running: it ignores SIGTERM, the grace is an hour
            assert (run["state"], run["cancel_requested"]) == ("running", True), run
        else:  # queued: ended at once
            assert (run["state"], run["cancel_requested"]) == ("cancelled", False), run
    code, out, err = await run_cli(jp_serverapp, "cancel", made["id"], "--json")
    assert code == 0 and json.loads(out)["still_ending"] == 1, (out, err)
    code, out, err = await run_cli(jp_serverapp, "cancel", made["id"])
    assert code == 0 and f"sweep {made['id']}: 1 run is still ending" in err, (out, err)
    assert len(out.splitlines()) == 3, out  # stdout: a line per run

    release.touch()
    assert (await wait_for(running))["state"] == "cancelled"
    code, answer = await api("POST", f"sweeps/{made['id']}/cancel")
    assert code == 200 and answer["still_ending"] == 0 and answer["counts"] == {"cancelled": 3}, answer
    assert [r["cancel_requested"] for r in answer["runs"]] == [False, False, False], answer
    code, out, err = await run_cli(jp_serverapp, "cancel", made["id"])
    assert code == 0 and f"sweep {made['id']}: no run still ending" in err, (out, err)


async def test_a_retried_sweep_submission_answers_with_the_same_runs(api, jp_fetch):
    body = spec(entry=SCORED)
    body["sweep"] = {"base": [1.0, 2.0]}
    answers = []
    for _ in range(2):
        resp = await jp_fetch(
            "evalsched",
            "sweeps",
            method="POST",
            body=json.dumps(body),
            headers={"Idempotency-Key": "abc-1"},
            raise_error=False,
        )
        answers.append((resp.code, json.loads(resp.body)))
    (first_code, first), (second_code, second) = answers
    assert (first_code, second_code) == (201, 200)
    assert second["id"] == first["id"] and [r["id"] for r in second["runs"]] == [r["id"] for r in first["runs"]]


# t(0.975, 4) and t(0.975, 5), from a printed table.
T975_DF4 = 2.7764451051977987
T975_DF5 = 2.5705818366147395


def mean(xs):
    return math.fsum(xs) / len(xs)


def stderr(xs):
    m = mean(xs)
    return math.sqrt(math.fsum((x - m) ** 2 for x in xs) / (len(xs) - 1) / len(xs))


async def test_compare_a_sweep_matches_its_episodes(api, wait_for, runs_dir):
    # Two slopes: a run's paired differences against a baseline of the other slope spread from
    # episode to episode, so its 95 % interval has width and is checked against the t table.
    body = spec(entry=SCORED, episodes=6, params={"label": "same"})
    body["sweep"] = {"base": [0.0, 0.5, 2.0], "slope": [0.0, 0.25]}
    made = await sweep(api, body)
    for run in made["runs"]:
        assert (await wait_for(run["id"]))["state"] == "succeeded"
    baseline = made["runs"][1]["id"]  # base 0.0, slope 0.25
    code, cmp = await api("GET", "compare", params={"sweep": made["id"], "baseline": baseline})
    assert code == 200, cmp
    assert cmp["params"] == ["base", "slope"] and cmp["baseline"] == baseline
    assert cmp["metrics"] == ["score", "step"]
    base_eps = episodes_of(runs_dir, baseline)
    widths = []
    for row, run in zip(cmp["rows"], made["runs"], strict=True):
        assert row["id"] == run["id"] and row["params"] == run["sweep_point"]
        eps = episodes_of(runs_dir, run["id"])
        scores = [eps[i]["score"] for i in sorted(eps)]
        stat = row["metrics"]["score"]
        assert stat["count"] == 6
        assert stat["mean"] == pytest.approx(mean(scores), abs=1e-12)
        assert stat["stderr"] == pytest.approx(stderr(scores), abs=1e-12)
        diffs = [eps[i]["score"] - base_eps[i]["score"] for i in sorted(eps)]
        delta = row["delta"]["score"]
        assert delta["paired"] == 6 and delta["mean"] == pytest.approx(mean(diffs), abs=1e-12)
        half = T975_DF5 * stderr(diffs)  # t(0.975, 5) from a printed table, not from the code
        assert delta["ci95"] == pytest.approx([mean(diffs) - half, mean(diffs) + half], abs=1e-9)
        widths.append((run["sweep_point"]["slope"], delta["ci95"][1] - delta["ci95"][0]))
        assert row["wall_s"] is not None and row["wall_s"] >= 0
    # The other slope's rows have spread (1.96 for t, or n for sqrt(n), would fail them); the
    # baseline's own slope pairs to a constant difference: no width.
    assert all(width > 1.0 for slope, width in widths if slope == 0.0), widths
    assert all(width == pytest.approx(0.0, abs=1e-9) for slope, width in widths if slope == 0.25), widths


async def test_compare_pairs_only_the_episodes_both_runs_have(api, wait_for, runs_dir):
    full = await submit(api, spec(entry=SCORED, episodes=8, params={"base": 1.0, "slope": 0.0}))
    short = await submit(api, spec(entry=SCORED, episodes=8, params={"base": 3.0, "slope": 0.1, "fail_at": 5}))
    assert (await wait_for(full["id"]))["state"] == "succeeded"
    assert (await wait_for(short["id"]))["state"] == "failed"
    code, cmp = await api("GET", "compare", params={"runs": f"{full['id']},{short['id']}"})
    assert code == 200, cmp
    assert cmp["params"] == ["base", "slope", "fail_at"] and cmp["baseline"] == full["id"]
    row = cmp["rows"][1]
    assert row["params"] == {"base": 3.0, "slope": 0.1, "fail_at": 5}
    assert row["metrics"]["score"]["count"] == 5 and row["delta"]["score"]["paired"] == 5
    a, b = episodes_of(runs_dir, full["id"]), episodes_of(runs_dir, short["id"])
    diffs = [b[i]["score"] - a[i]["score"] for i in sorted(b)]
    # 2 + 0.1 * i**2 over i = 0..4: the pairs spread, so the interval (t with 4 degrees) has width
    assert row["delta"]["score"]["mean"] == pytest.approx(mean(diffs)) == pytest.approx(2.6)
    half = T975_DF4 * stderr(diffs)
    assert half > 0.5
    assert row["delta"]["score"]["ci95"] == pytest.approx([2.6 - half, 2.6 + half], abs=1e-9)
    assert cmp["rows"][0]["delta"]["score"] == {"mean": 0.0, "ci95": [0.0, 0.0], "paired": 8}
    assert cmp["rows"][0]["params"] == {"base": 1.0, "slope": 0.0, "fail_at": None}


async def test_compare_refuses_what_it_cannot_answer(api):
    run = await submit(api, spec(entry=SCORED))
    assert (await api("GET", "compare"))[0] == 422
    assert (await api("GET", "compare", params={"runs": run["id"], "sweep": "sweep-x"}))[0] == 422
    assert (await api("GET", "compare", params={"runs": "nope"}))[0] == 404
    assert (await api("GET", "compare", params={"sweep": "sweep-nope"}))[0] == 404
    code, answer = await api("GET", "compare", params={"runs": run["id"], "baseline": "other"})
    assert code == 422 and "baseline" in answer["message"]


def test_t_quantiles_match_the_tables():
    for df, expected in [(1, 12.7062047), (2, 4.3026527), (5, 2.5705818), (9, 2.2621572), (30, 2.0422725)]:
        assert t_quantile(0.975, df) == pytest.approx(expected, abs=1e-6)


def held_at_the_second_chunk(evalsched, monkeypatch) -> tuple[list[str], threading.Event]:
    """Chunks of 3 points; from now on, the ids of the run directories the writer's thread
    assembles, in order, the 4th (the second chunk's first) waiting until the event is set."""
    monkeypatch.setattr(sweeps, "SWEEP_CHUNK_POINTS", 3)
    store = evalsched.submissions.store
    assemble = store.assemble
    release = threading.Event()
    made: list[str] = []

    def held(run_id, files):  # (in the writer's thread)
        made.append(run_id)
        if len(made) == 4:
            release.wait(30)
        return assemble(run_id, files)

    monkeypatch.setattr(store, "assemble", held)
    return made, release


def sweep_poster(jp_fetch, body: dict, key: str):
    """``await post()``: the sweep submitted under the Idempotency-Key ``key``; (code, answer)."""

    async def post():
        resp = await jp_fetch("evalsched", "sweeps", method="POST", body=json.dumps(body),
                              headers={"Idempotency-Key": key}, raise_error=False)  # fmt: skip
        return resp.code, json.loads(resp.body)

    return post


@pytest.mark.parametrize(("points", "assembled"), [(50, 6), (4, 4)], ids=["midway", "at-its-last-point"])
async def test_a_sweep_cancelled_while_it_is_submitted_makes_no_more_runs(
    api, jp_fetch, evalsched, monkeypatch, runs_dir, points, assembled
):
    """The cancel of a sweep whose submission is still making its runs (a large one takes
    seconds) stops it: its submission answers 409 saying so, every run made is cancelled, and
    neither it nor a retry under its Idempotency-Key makes the rest (they were all made, and
    ran, after a cancel answered 200). Points are written a chunk at a time (3 here): the runs of
    the chunk under way that were not in the table yet when the cancel came are not made (their
    directories, written, are removed), and no later chunk is begun."""
    made, release = held_at_the_second_chunk(evalsched, monkeypatch)
    body = {**spec(entry=SLEEPY, episodes=1, params={"sleep_s": 60.0}), "sweep": {"k": list(range(points))}}
    post = sweep_poster(jp_fetch, body, "cancelled-sweep")
    submitting = asyncio.ensure_future(post())
    await async_wait_until(lambda: len(made) == 4, timeout=30, message="the sweep's 4th run is not being made")
    sweep_id = (await api("GET", "sweeps"))[1]["sweeps"][0]["id"]
    cancelling = asyncio.ensure_future(api("POST", f"sweeps/{sweep_id}/cancel"))

    def cancelled() -> bool:  # (in the table: the API waits for their records, which the writer holds)
        return evalsched.sweep_view(sweep_id)["counts"].get("cancelled") == 3

    await async_wait_until(cancelled, timeout=30, message="the cancel did not come")
    release.set()
    code, answer = await submitting
    assert code == 409 and answer["message"].startswith(f"sweep {sweep_id} was cancelled while it was submitted"), (
        code, answer)  # fmt: skip
    assert (await cancelling)[0] == 200
    code, answer = await post()  # the client retries: no more runs made (points are left unmade)
    assert code == 409, answer
    code, view = await api("GET", f"sweeps/{sweep_id}")
    assert len(view["runs"]) == 3 and view["counts"] == {"cancelled": 3}, view
    assert len(made) == assembled  # (no directory of a later chunk was even begun)

    def only_its_runs_on_disk() -> bool:
        return sorted(p.name for p in runs_dir.iterdir() if not p.name.startswith(".evalsched")) == sorted(
            run["id"] for run in view["runs"]
        )

    assert only_its_runs_on_disk()  # (removed, staging name and all, before the submission answered)


async def test_a_sweep_under_way_when_its_scheduler_steps_down_is_cancelled_before_the_lock_is_released(
    api, jp_fetch, jp_serverapp, evalsched, monkeypatch, runs_dir
):
    """A scheduler that stops while a sweep is submitted (a shutdown; here a step-down, the same
    stop, after which the runs directory's lock is let go and the server takes over again) begins
    no more of the sweep's chunks, and the runs it made are cancelled, as for any failure, before
    the lock is let go. (Its writer closed, the later chunks were written on the event loop, by
    path, after the release, where the next primary, which had read the runs directory, did not
    know them, and the submission answered 201.) It answers 503; a retry under its
    Idempotency-Key, served by the next primary, answers the cancelled runs and makes the rest, in
    the order of the points."""
    app = jp_serverapp.extension_manager.extension_points["jupyter_evalsched"].app
    made, release = held_at_the_second_chunk(evalsched, monkeypatch)
    stop_admission = evalsched.admission.stop

    def stopped_then_released() -> None:  # the stop's first step; the chunk under way then goes on
        stop_admission()
        release.set()

    monkeypatch.setattr(evalsched.admission, "stop", stopped_then_released)

    def state(run_id: str) -> str:
        return json.loads((runs_dir / run_id / "job.json").read_text())["state"]

    release_lock = app.role.release
    at_release: dict[str, str] = {}

    def released() -> None:
        at_release.update({run_id: state(run_id) for run_id in made})
        release_lock()

    monkeypatch.setattr(app.role, "release", released)
    hold = await submit(api, spec(entry=SLEEPY, sleep_s=60.0, scheduling={"cpus": 16}))  # every CPU slot
    made.clear()
    body = {**spec(entry=SLEEPY, episodes=1, params={"sleep_s": 0.01}), "sweep": {"k": list(range(9))}}
    post = sweep_poster(jp_fetch, body, "sweep-across-a-step-down")

    submitting = asyncio.ensure_future(post())
    await async_wait_until(lambda: len(made) == 4, timeout=30, message="the sweep's 4th run is not being made")
    await app._step_down()
    code, answer = await submitting
    assert code == 503 and "the 6 runs of its 9 that this submission made are cancelled" in answer["message"], (
        code,
        answer,
    )
    assert len(made) == 6  # no third chunk begun
    assert at_release == {run_id: "cancelled" for run_id in made}  # on disk before the lock was let go
    assert sorted(p.name for p in runs_dir.iterdir() if not p.name.startswith(".evalsched")) == sorted(
        [*made, hold["id"]]
    )

    await app._take_over_if_free()  # the next primary: a fresh scheduler, which reads the runs directory
    assert app.scheduler is not evalsched and app.scheduler.started
    code, answer = await post()
    assert code == 201, answer
    runs = answer["runs"]
    assert [run["sweep_point"] for run in runs] == [{"k": k} for k in range(9)]
    assert {run["id"] for run in runs[:6]} == set(made) and {run["state"] for run in runs[:6]} == {"cancelled"}
    assert not {run["id"] for run in runs[6:]} & set(made) and "cancelled" not in {run["state"] for run in runs[6:]}
    seqs = [run["seq"] for run in runs]
    assert seqs == sorted(seqs)


def writer_batches(evalsched, monkeypatch) -> list[int]:
    """The size of each batch of run directories the writer's thread writes, from now on."""
    store = evalsched.submissions.store
    create_many = store.create_many
    batches: list[int] = []

    def counted(runs):  # (in the writer's thread)
        batches.append(len(runs))
        return create_many(runs)

    monkeypatch.setattr(store, "create_many", counted)
    return batches


async def test_a_sweeps_directories_are_written_a_chunk_at_a_time_in_the_order_of_its_points(
    api, evalsched, monkeypatch
):
    """A sweep's points are not made one after another, each waited for: each chunk of them
    reaches the writer's thread as one batch (one wake-up of it, one directory fsync where fsync
    is on), and their runs keep the order of the points, in the answer and in ``seq``."""
    batches = writer_batches(evalsched, monkeypatch)
    points = 2 * sweeps.SWEEP_CHUNK_POINTS + 5
    hold = await submit(api, spec(entry=SLEEPY, episodes=1, params={"sleep_s": 60.0}))
    batches.clear()
    body = {**spec(entry=SLEEPY, episodes=1, params={"sleep_s": 0.01}), "depends_on": [hold["id"]],
            "sweep": {"k": list(range(points))}}  # fmt: skip
    made = await sweep(api, body)
    assert [run["sweep_point"] for run in made["runs"]] == [{"k": k} for k in range(points)]
    seqs = [run["seq"] for run in made["runs"]]
    assert seqs == sorted(seqs) and len(set(seqs)) == points
    assert sum(batches) == points and len(batches) <= 6, batches  # one at a time: 133 batches
    assert (await api("POST", f"runs/{hold['id']}/cancel"))[0] == 200


async def test_a_sweep_whose_point_cannot_be_written_leaves_none_of_its_runs_to_run_and_its_retry_keeps_their_order(
    api, jp_fetch, evalsched, monkeypatch, runs_dir
):
    """A point whose directory cannot be made (the disk refuses it) fails the submission with a
    503 that says why: the runs made before it are cancelled, none queued, and those written
    after it in its chunk are not made (their directories removed). The client's retry under its
    Idempotency-Key answers the runs made before that point as they are (cancelled) and makes
    the rest, that point on, in the order of the points."""
    store = evalsched.submissions.store
    assemble = store.assemble
    calls: list[str] = []

    def refusing(run_id, files):  # (in the writer's thread) the 5th directory, once: the disk is full
        calls.append(run_id)
        if len(calls) == 5:
            raise StoreError("the runs directory's disk is full (ENOSPC)")
        return assemble(run_id, files)

    monkeypatch.setattr(store, "assemble", refusing)
    hold = await submit(api, spec(entry=SLEEPY, episodes=1, params={"sleep_s": 60.0}))
    calls.clear()
    body = {**spec(entry=SLEEPY, episodes=1, params={"sleep_s": 0.01}), "depends_on": [hold["id"]],
            "sweep": {"k": list(range(10))}}  # fmt: skip

    async def post():
        resp = await jp_fetch("evalsched", "sweeps", method="POST", body=json.dumps(body),
                              headers={"Idempotency-Key": "refused-once"}, raise_error=False)  # fmt: skip
        return resp.code, json.loads(resp.body)

    code, answer = await post()
    assert code == 503 and "disk is full" in answer["message"], (code, answer)
    code, listed = await api("GET", "sweeps")
    sweep_id = listed["sweeps"][0]["id"]
    code, view = await api("GET", f"sweeps/{sweep_id}")
    assert [run["sweep_point"]["k"] for run in view["runs"]] == [0, 1, 2, 3], view
    assert view["counts"] == {"cancelled": 4}, view

    def only_made_runs_on_disk() -> bool:
        names = {p.name for p in runs_dir.iterdir() if not p.name.startswith(".evalsched")}
        return names == {hold["id"], *(run["id"] for run in view["runs"])}

    assert only_made_runs_on_disk()  # (removed, staging name and all, before the submission answered)
    code, again = await post()
    assert code == 201 and again["id"] == sweep_id, (code, again)
    assert [run["sweep_point"]["k"] for run in again["runs"]] == list(range(10))
    assert [run["state"] for run in again["runs"]] == ["cancelled"] * 4 + ["queued"] * 6
    code, view = await api("GET", f"sweeps/{sweep_id}")  # (listed by seq)
    assert [run["id"] for run in view["runs"]] == [run["id"] for run in again["runs"]], view
    assert (await api("POST", f"runs/{hold['id']}/cancel"))[0] == 200


async def test_a_sweep_of_large_points_is_written_in_smaller_chunks(api, evalsched, monkeypatch):
    """A chunk holds at most ``SWEEP_CHUNK_CHARS`` of specs: points of 600 kB each are written a
    point at a time (each chunk's records and files are made in one turn of the event loop)."""
    batches = writer_batches(evalsched, monkeypatch)
    hold = await submit(api, spec(entry=SLEEPY, episodes=1, params={"sleep_s": 60.0}))
    batches.clear()
    body = {**spec(entry=SLEEPY, episodes=1, params={"sleep_s": 0.01, "blob": "x" * 600_000}),
            "depends_on": [hold["id"]], "sweep": {"k": [0, 1, 2]}}  # fmt: skip
    made = await sweep(api, body)
    assert [run["sweep_point"] for run in made["runs"]] == [{"k": 0}, {"k": 1}, {"k": 2}]
    assert batches == [1, 1, 1], batches
    assert (await api("POST", f"runs/{hold['id']}/cancel"))[0] == 200


@pytest.mark.parametrize(
    ("sizes", "points", "chars", "expected"),
    [
        ([10] * 5, 2, 100, [(0, 2), (2, 4), (4, 5)]),
        ([10] * 5, 64, 25, [(0, 2), (2, 4), (4, 5)]),
        ([10, 500, 10, 10], 64, 100, [(0, 1), (1, 2), (2, 4)]),
        ([500], 64, 100, [(0, 1)]),
        ([], 64, 100, []),
    ],
)
def test_chunks_are_bounded_by_points_and_by_characters(sizes, points, chars, expected):
    assert [(r.start, r.stop) for r in sweeps.chunks(sizes, points, chars)] == expected


async def test_a_finished_sweep_cancelled_still_answers_a_retry_of_its_submission(api, jp_fetch, wait_for):
    """A cancel of a sweep whose submission is over (all its runs made) changes nothing for a
    retry of that submission under its Idempotency-Key: the same runs, answered again."""
    body = {**spec(entry=SLEEPY, episodes=1, params={"sleep_s": 0.01}), "sweep": {"k": [1, 2]}}

    async def post():
        resp = await jp_fetch("evalsched", "sweeps", method="POST", body=json.dumps(body),
                              headers={"Idempotency-Key": "done-sweep"}, raise_error=False)  # fmt: skip
        return resp.code, json.loads(resp.body)

    code, made = await post()
    assert code == 201, made
    for run in made["runs"]:
        assert (await wait_for(run["id"]))["state"] == "succeeded"
    assert (await api("POST", f"sweeps/{made['id']}/cancel"))[0] == 200
    code, again = await post()
    assert code == 200 and [r["id"] for r in again["runs"]] == [r["id"] for r in made["runs"]], again


async def test_a_cancel_also_ends_the_runs_its_submission_made_while_the_cancel_was_written(
    api, evalsched, monkeypatch
):
    """A sweep cancelled while its submission was under way: the cancel's list goes to disk
    first, and the runs the submission made meanwhile (its next chunk) were never cancelled:
    they ran. Here the submission's second chunk is made while the cancel's write is held."""
    cancel_writing, release = threading.Event(), threading.Event()
    real_write, real_create = evalsched.store.write_cancelled_sweeps, evalsched.store.create_many
    creates = []

    def held_write(cancelled):
        cancel_writing.set()
        release.wait(60)
        real_write(cancelled)

    def create_after_the_cancel(runs):
        creates.append(len(runs))
        if len(creates) == 2:  # (the second chunk: once the cancel is being written)
            cancel_writing.wait(60)
        return real_create(runs)

    monkeypatch.setattr(evalsched.store, "create_many", create_after_the_cancel)
    monkeypatch.setattr(evalsched.store, "write_cancelled_sweeps", held_write)
    body = {**spec(sleep_s=600), "sweep": {"k": list(range(sweeps.SWEEP_CHUNK_POINTS + 8))}}
    posting = asyncio.ensure_future(api("POST", "sweeps", body))
    cancel = None
    try:
        made = await async_wait_until(
            lambda: [r for r in evalsched.table if r.record.get("sweep_id")], timeout=60, message="no chunk made"
        )
        sweep_id = made[0].record["sweep_id"]
        cancel = asyncio.ensure_future(api("POST", f"sweeps/{sweep_id}/cancel"))
        assert await asyncio.to_thread(cancel_writing.wait, 60)
        code, answer = await posting  # (every point made: the cancel is not on disk yet)
        assert code == 201 and len(answer["runs"]) == len(body["sweep"]["k"]), answer
    finally:
        release.set()
    code, answer = await cancel
    assert code == 200, answer
    left = [(r["id"], r["state"]) for r in answer["runs"] if r["state"] != "cancelled" and not r["cancel_requested"]]
    assert left == [], f"runs of the cancelled sweep left to run: {left}"
