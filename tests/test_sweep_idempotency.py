"""A sweep's Idempotency-Key over the REST API of a real server (docs/reference.md, "Sweeps and
comparison"): its own namespace beside plain runs' keys, the same key with another sweep, the
cancel of a sweep under way across a restart, and run names made from points that hold what a
name may not (control characters, lone surrogates)."""

from __future__ import annotations

import asyncio
import json

import pytest
from rest import NOOP, SLEEPY, spec, submit

from jupyter_evalsched.scheduler import sweeps
from jupyter_evalsched.scheduler.submission import SweepKey


@pytest.fixture
def evalsched_config():
    return {"cpu_slots": 16}


@pytest.fixture
def restart(jp_serverapp):
    """``await restart()``: the scheduler stops (its runs end) and a fresh one starts on the same
    runs directory, knowing only what it reads there."""
    app = jp_serverapp.extension_manager.extension_points["jupyter_evalsched"].app

    async def restarted():
        old = app.scheduler
        await app._step_down()
        await app._take_over_if_free()
        assert app.scheduler is not old and app.scheduler.started
        return app.scheduler

    return restarted


async def settled(wait_for, runs):
    for run in runs:
        await wait_for(run["id"])


# ----------------------------------------------------------------------------- namespaces


async def test_a_plain_runs_key_is_never_a_sweeps_point_nor_the_reverse(jp_fetch, api, wait_for, restart):
    """A plain submission under ``kk#1`` is not a replay of point 1 of the sweep under ``kk``,
    and point 0 of the sweep under ``jj`` is not the plain run under ``jj#0``; each key answers
    its own run(s) again, also after a restart (the index rebuilt from the records)."""

    async def post(path, body, key):
        resp = await jp_fetch("evalsched", path, method="POST", body=json.dumps(body),
                              headers={"Idempotency-Key": key}, raise_error=False)  # fmt: skip
        return resp.code, json.loads(resp.body)

    body = {**spec(entry=NOOP), "sweep": {"a": [1, 2]}}
    code, made = await post("sweeps", body, "kk")
    assert code == 201, made
    ids = [run["id"] for run in made["runs"]]
    plain = spec(entry=NOOP, sleep_s=0.01)
    code, after = await post("runs", plain, "kk#1")  # not a replay of the sweep's run
    assert code == 201 and after["id"] not in ids and after["sweep_id"] is None, after
    code, before = await post("runs", plain, "jj#0")
    assert code == 201, before
    code, other = await post("sweeps", body, "jj")  # its point 0 is not that run
    assert code == 201 and before["id"] not in [run["id"] for run in other["runs"]], other
    assert [run["sweep_id"] for run in other["runs"]] == [other["id"]] * 2
    code, view = await api("GET", f"sweeps/{other['id']}")
    assert [run["id"] for run in view["runs"]] == [run["id"] for run in other["runs"]], view
    await settled(wait_for, [after, before, *made["runs"], *other["runs"]])

    for _ in range(2):  # the same keys again, then after a restart (the index rebuilt from the records)
        for key, answer in (("kk", made), ("jj", other)):
            code, again = await post("sweeps", body, key)
            assert code == 200 and [r["id"] for r in again["runs"]] == [r["id"] for r in answer["runs"]], again
        for key, answer in (("kk#1", after), ("jj#0", before)):
            code, again = await post("runs", plain, key)
            assert code == 200 and again["id"] == answer["id"], again
        await restart()


# ----------------------------------------------------------------------------- another sweep


async def test_a_sweeps_key_with_other_points_is_a_conflict(jp_fetch, api, wait_for, restart):
    """The key of a sweep with other points (more, fewer, others) answers 409 and makes
    nothing; with the same body it answers the same runs; also after a restart."""

    async def post(body):
        resp = await jp_fetch("evalsched", "sweeps", method="POST", body=json.dumps(body),
                              headers={"Idempotency-Key": "ext1"}, raise_error=False)  # fmt: skip
        return resp.code, json.loads(resp.body)

    base = spec(entry=NOOP)
    code, made = await post({**base, "sweep": {"a": [1, 2]}})
    assert code == 201, made
    ids = [run["id"] for run in made["runs"]]
    await settled(wait_for, made["runs"])
    others = [{"a": [1, 2, 3]}, [{"a": 1}], {"a": [1, 5]}, {"a": [2, 1]}]
    for _ in range(2):  # then after a restart
        for sweep in others:
            code, answer = await post({**base, "sweep": sweep})
            assert code == 409 and "already used for sweep" in answer["message"], (sweep, code, answer)
        code, view = await api("GET", f"sweeps/{made['id']}")
        assert [run["id"] for run in view["runs"]] == ids, view
        code, again = await post({**base, "sweep": [{"a": 1}, {"a": 2}]})  # the same points, as a list
        assert code == 200 and [run["id"] for run in again["runs"]] == ids, again
        await restart()


# ----------------------------------------------------------------------------- cancelled


def paused_after_the_first_chunk(evalsched, monkeypatch) -> tuple[asyncio.Event, asyncio.Event]:
    """Chunks of 3 points; the next sweep submission pauses once its first chunk's runs are
    made (the first event set) until the second event is set."""
    monkeypatch.setattr(sweeps, "SWEEP_CHUNK_POINTS", 3)
    submissions = evalsched.submissions
    settle = submissions._settle_chunk
    paused, resume = asyncio.Event(), asyncio.Event()

    async def settled_then_paused(*args):
        await settle(*args)
        if not paused.is_set():
            paused.set()
            await resume.wait()

    monkeypatch.setattr(submissions, "_settle_chunk", settled_then_paused)
    return paused, resume


@pytest.mark.parametrize("when", ["queued", "finished"])
async def test_a_sweep_cancelled_while_it_is_submitted_makes_no_more_runs_after_a_restart(
    jp_fetch, api, evalsched, wait_for, monkeypatch, restart, when
):
    """A sweep cancelled while its submission still makes its runs: a retry under its key makes
    no more runs (409), also once another scheduler reads the runs directory (the cancel is kept
    in the runs directory, not in a run's record: a delete of any of its runs loses nothing;
    "queued": its runs were cancelled; "finished": all of them ended before it came)."""
    hold = await submit(api, spec(entry=SLEEPY, sleep_s=60.0))
    paused, resume = paused_after_the_first_chunk(evalsched, monkeypatch)
    body = {**spec(entry=NOOP), "sweep": {"k": list(range(9))}}
    if when == "queued":
        body["depends_on"] = [hold["id"]]

    async def post():
        resp = await jp_fetch("evalsched", "sweeps", method="POST", body=json.dumps(body),
                              headers={"Idempotency-Key": "cancelled-then-restarted"}, raise_error=False)  # fmt: skip
        return resp.code, json.loads(resp.body)

    submitting = asyncio.ensure_future(post())
    await asyncio.wait_for(paused.wait(), 30)
    sweep_id = (await api("GET", "sweeps"))[1]["sweeps"][0]["id"]
    if when == "finished":
        for run in evalsched.sweep_view(sweep_id)["runs"]:
            assert (await wait_for(run["id"]))["state"] == "succeeded"
    code, view = await api("POST", f"sweeps/{sweep_id}/cancel")
    assert code == 200 and len(view["runs"]) == 3, view
    resume.set()
    code, answer = await submitting
    assert code == 409 and "was cancelled while it was submitted" in answer["message"], answer
    assert (await post())[0] == 409
    assert (await api("POST", f"runs/{hold['id']}/cancel"))[0] == 200
    last = view["runs"][-1]["id"]
    await wait_for(last)
    assert (await api("DELETE", f"runs/{last}"))[0] == 204

    await restart()
    code, answer = await post()
    assert code == 409 and "was cancelled while it was submitted" in answer["message"], answer
    code, view = await api("GET", f"sweeps/{sweep_id}")
    assert len(view["runs"]) == 2 and view["counts"] == {"cancelled" if when == "queued" else "succeeded": 2}, view


@pytest.mark.parametrize("cancelled", [True, False])
async def test_a_sweep_whose_runs_were_all_deleted_is_not_made_again_where_it_was_cancelled(
    jp_fetch, api, wait_for, restart, cancelled
):
    """A sweep whose runs are all deleted, then its submission retried under its key (a client
    that lost the first answer retries it): where the sweep was cancelled, the retry is a 409
    that names it and makes nothing (its user cancelled it), also after a restart; where it was
    not, the key went with its runs, as a plain run's does, and the retry makes a new sweep."""
    key = f"deleted-{cancelled}"
    body = {**spec(entry=NOOP), "sweep": {"k": [1, 2, 3]}}

    async def post():
        resp = await jp_fetch("evalsched", "sweeps", method="POST", body=json.dumps(body),
                              headers={"Idempotency-Key": key}, raise_error=False)  # fmt: skip
        return resp.code, json.loads(resp.body)

    code, made = await post()
    assert code == 201, made
    await settled(wait_for, made["runs"])
    if cancelled:
        assert (await api("POST", f"sweeps/{made['id']}/cancel"))[0] == 200
    for run in made["runs"]:
        assert (await api("DELETE", f"runs/{run['id']}"))[0] == 204
    assert (await api("GET", f"sweeps/{made['id']}"))[0] == 404
    for _ in range(2):  # then after a restart (nothing of the sweep is left in the runs directory)
        before = (await api("GET", "runs"))[1]["total"]
        code, answer = await post()
        if not cancelled:
            assert code == 201 and answer["id"] != made["id"] and len(answer["runs"]) == 3, answer
            return
        assert code == 409, answer
        assert made["id"] in answer["message"] and "cancelled" in answer["message"], answer
        assert (await api("GET", "runs"))[1]["total"] == before
        assert (await api("GET", "sweeps"))[1]["sweeps"] == []
        await restart()


@pytest.mark.parametrize("write", ["held", "refused"])
async def test_a_sweep_whose_runs_are_deleted_while_its_cancel_is_written(
    jp_fetch, api, wait_for, evalsched, monkeypatch, write
):
    """The cancel writes the list of cancelled sweeps (in the I/O pool) before the sweep counts
    as cancelled: its runs all deleted meanwhile, a retry of its submission under its key is a
    409 already ("held": the write waits here until the retry is answered). A write the disk
    refuses cancels nothing ("refused": a 503): the key then goes with the runs, as for a sweep
    never cancelled, and the retry makes a new sweep."""
    import threading

    from jupyter_evalsched.store import StoreError

    key = f"being-written-{write}"
    body = {**spec(entry=NOOP), "sweep": {"k": [1, 2]}}

    async def post():
        resp = await jp_fetch("evalsched", "sweeps", method="POST", body=json.dumps(body),
                              headers={"Idempotency-Key": key}, raise_error=False)  # fmt: skip
        return resp.code, json.loads(resp.body)

    code, made = await post()
    assert code == 201, made
    await settled(wait_for, made["runs"])
    entered, release, real = threading.Event(), threading.Event(), evalsched.store.write_cancelled_sweeps

    def held_or_refused(cancelled):
        if write == "refused":
            raise StoreError("no space left on device")
        entered.set()
        release.wait(60)
        real(cancelled)

    monkeypatch.setattr(evalsched.store, "write_cancelled_sweeps", held_or_refused)
    cancel = asyncio.ensure_future(api("POST", f"sweeps/{made['id']}/cancel"))
    try:
        if write == "refused":
            code, err = await cancel
            assert code == 503 and "no space left" in err["message"], err
        else:
            assert await asyncio.to_thread(entered.wait, 60)
        for run in made["runs"]:
            assert (await api("DELETE", f"runs/{run['id']}"))[0] == 204
        code, answer = await post()
        if write == "refused":
            assert code == 201 and answer["id"] != made["id"], answer
            return
        assert code == 409 and made["id"] in answer["message"] and "cancelled" in answer["message"], answer
    finally:
        release.set()
    await cancel
    code, answer = await post()
    assert code == 409 and made["id"] in answer["message"], answer


async def test_a_cancel_of_a_whole_sweep_leaves_its_records_as_they_are(jp_fetch, api, wait_for):
    """A sweep whose points were all made keeps the keys its runs recorded when cancelled
    (its retry answers them: nothing is left to refuse)."""
    body = {**spec(entry=NOOP), "sweep": {"k": [1, 2]}}
    resp = await jp_fetch("evalsched", "sweeps", method="POST", body=json.dumps(body),
                          headers={"Idempotency-Key": "whole"}, raise_error=False)  # fmt: skip
    made = json.loads(resp.body)
    await settled(wait_for, made["runs"])
    code, view = await api("POST", f"sweeps/{made['id']}/cancel")
    assert code == 200 and [r["idempotency_key"] for r in view["runs"]] == [r["idempotency_key"] for r in made["runs"]]


def test_a_sweeps_recorded_key_reads_back():
    for key in (SweepKey("k", 0), SweepKey("a#1", 3, 10, "0123456789abcdef")):
        assert SweepKey.parse(key.text()) == key
    assert SweepKey.parse("kk#0") == SweepKey("kk", 0)  # (a record made before the digest was kept)
    assert SweepKey.parse("kk#1#2 3:abc") == SweepKey("kk#1", 2, 3, "abc")
    for text in ("kk", "#0", "kk#x", "kk#0 x:abc", "kk#0 3:", "kk#0 3:abc other", "kk#0 3:abc cancelled"):
        assert SweepKey.parse(text) is None, text


# ----------------------------------------------------------------------------- names


async def test_points_that_hold_control_characters_or_lone_surrogates_make_printable_names(api):
    """What POST /runs takes as params a sweep takes as points: the names the server makes of
    them show control characters and lone surrogates escaped (a name may not hold them)."""
    values = ["Q: 2+2?\nA:", "bell\x07", "del\x7f", "half\ud800"]
    assert (await api("POST", "runs", spec(entry=NOOP, params={"q": values[0], "w\udfff": values[3]})))[0] == 201
    body = {**spec(entry=NOOP), "name": "ctl", "sweep": {"q": values, "w\udfff": [1]}}
    code, made = await api("POST", "sweeps", body)
    assert code == 201, made
    assert [run["name"] for run in made["runs"]] == [
        "ctl [q=Q: 2+2?\\nA:, w\\udfff=1]",
        "ctl [q=bell\\x07, w\\udfff=1]",
        "ctl [q=del\\x7f, w\\udfff=1]",
        "ctl [q=half\\ud800, w\\udfff=1]",
    ]
    assert [run["sweep_point"]["q"] for run in made["runs"]] == values  # the params themselves as given


def test_a_point_label_escapes_what_is_not_printable_and_keeps_the_rest():
    assert sweeps.point_label({"t": 0.2, "s": "plain é ✓ \\n", "l": ["\n"]}) == 't=0.2, s=plain é ✓ \\n, l=["\\n"]'
    assert sweeps.point_label({"s": "\t\r\x1b\x85"}) == "s=\\t\\r\\x1b\\x85"
    assert sweeps.run_name("n", {"s": "x" * 50 + "\n"}) == "n [s=" + "x" * 39 + "…]"


async def test_two_cancels_at_once_keep_both_sweeps_cancelled_on_disk(api, evalsched, runs_dir, monkeypatch):
    """Each cancel writes the list of the sweeps cancelled before it answers. Two at once wrote on
    two threads of the I/O pool, and the older list could land last: the first cancel's write is
    held here until the second cancel has had its turn, and the file must still hold both."""
    import threading

    from jupyter_evalsched.store import CANCELLED_SWEEPS_FILE

    made = [
        (await api("POST", "sweeps", {**spec(entry=SLEEPY, sleep_s=60.0), "sweep": {"k": [1, 2]}}))[1] for _ in range(2)
    ]
    release, real = threading.Event(), evalsched.store.write_cancelled_sweeps
    calls = []

    def held_first(ids):
        calls.append(list(ids))
        if len(calls) == 1:
            release.wait(10)
        real(ids)

    monkeypatch.setattr(evalsched.store, "write_cancelled_sweeps", held_first)
    first = asyncio.ensure_future(api("POST", f"sweeps/{made[0]['id']}/cancel"))
    second = asyncio.ensure_future(api("POST", f"sweeps/{made[1]['id']}/cancel"))
    await asyncio.sleep(0.3)  # (the second's write, were it not kept behind the first, would land now)
    release.set()
    assert [code for code, _ in await asyncio.gather(first, second)] == [200, 200]
    on_disk = json.loads((runs_dir / CANCELLED_SWEEPS_FILE).read_text())
    # (whichever cancel reached the server first: both)
    assert sorted(e["sweep_id"] for e in on_disk[-2:]) == sorted([made[0]["id"], made[1]["id"]]), (on_disk, calls)
    assert oct((runs_dir / CANCELLED_SWEEPS_FILE).stat().st_mode & 0o777) == "0o600"


def test_the_cancelled_sweeps_file_reads_back_with_its_keys_and_as_first_written(tmp_path):
    """Each sweep with its submission's key; an id alone (the file as first written, before the
    keys were kept) has none; an entry of another form is skipped."""
    from jupyter_evalsched.store import CANCELLED_SWEEPS_FILE, RunStore

    store = RunStore(tmp_path / "runs")
    store.ensure()
    store.write_cancelled_sweeps([("sweep-a", "k1"), ("sweep-b", None)])
    assert store.read_cancelled_sweeps() == [("sweep-a", "k1"), ("sweep-b", None)]
    (tmp_path / "runs" / CANCELLED_SWEEPS_FILE).write_text(
        json.dumps(["sweep-old", {"sweep_id": "sweep-c", "idempotency_key": "k2"}, 3, {"idempotency_key": "k"}])
    )
    assert store.read_cancelled_sweeps() == [("sweep-old", None), ("sweep-c", "k2")]
