"""A run's own files are written by user code: huge, deeply nested, not JSON, not files at all.
None of it may jam the ledger, keep a run ``running`` without a process, stop the server from
starting, or make an endpoint answer 500 (issue "Hardening II", item 1)."""

from __future__ import annotations

import json
import os
import time

from rest import NOOP, spec, submit
from waiting import async_wait_until

NESTED = "[" * 100_000 + "]" * 100_000

# Writes its own summary.json (and, when asked, _DONE), then leaves without the runner's final word.
VANDAL = """
import os

def episode(ctx, index):
    with open(os.path.join(ctx.run_dir, ctx.params["file"]), "w") as f:
        f.write(ctx.params["content"] * ctx.params.get("times", 1))
    if ctx.params.get("done"):
        open(os.path.join(ctx.run_dir, "_DONE"), "w").close()
    os._exit(0)
"""


def vandal(file: str, content: str, vram: int = 16000, **params) -> dict:
    return {
        "source": VANDAL,
        "params": {"file": file, "content": content, **params},
        "scheduling": {"marginal_vram_mb": vram},
    }


async def test_a_nested_summary_ends_the_run_and_frees_its_gpu(api, wait_for, runs_dir):
    bad = await submit(api, vandal("summary.json", NESTED))
    waiting = await submit(api, spec(entry=NOOP, vram=16000))
    final = await wait_for(bad["id"])
    assert final["state"] == "failed" and final["reason"].startswith("exit_code:0: "), final
    assert (await wait_for(waiting["id"]))["state"] == "succeeded"  # the GPU was given back
    code, detail = await api("GET", f"runs/{bad['id']}")
    assert code == 200 and detail["summary"] is None
    assert "nested more than 64 levels deep" in detail["summary_error"]
    code, err = await api("POST", f"runs/{bad['id']}/cancel")
    assert code == 409, err
    assert (runs_dir / bad["id"] / "_DONE").exists()


async def test_a_run_that_finalized_with_an_unusable_summary_fails_saying_why(api, wait_for):
    rec = await submit(api, vandal("summary.json", NESTED, done=True))
    final = await wait_for(rec["id"])
    assert final["state"] == "failed"
    assert final["reason"] == (
        "exit_code:0: the run finalized but its result cannot be used: summary.json is nested more than 64 levels deep"
    )
    code, ledger = await api("GET", "ledger")
    assert all(d["allocated_mb"] == 0 for d in ledger["devices"]) and ledger["cpu_slots"]["allocated"] == 0


async def test_a_huge_summary_is_not_read(api, wait_for):
    rec = await submit(api, vandal("summary.json", "x" * 65536, times=272, done=True))  # 17 MB
    final = await wait_for(rec["id"])
    assert final["state"] == "failed" and "summary.json is 17825792 bytes" in final["reason"], final


async def test_a_fifo_summary_never_blocks_a_reader(api, wait_for, runs_dir):
    rec = await submit(api, spec(entry=NOOP))
    await wait_for(rec["id"])
    summary = runs_dir / rec["id"] / "summary.json"
    summary.unlink()
    os.mkfifo(summary)
    started = time.monotonic()
    code, detail = await api("GET", f"runs/{rec['id']}")
    assert code == 200 and detail["summary"] is None and "not a regular file" in detail["summary_error"]
    assert time.monotonic() - started < 5


async def test_nested_and_garbage_episode_lines_are_skipped(api, wait_for, runs_dir):
    rec = await submit(api, spec(entry=NOOP, episodes=2))
    await wait_for(rec["id"])
    path = runs_dir / rec["id"] / "episodes.jsonl"
    good = path.read_text().splitlines()
    path.write_text("\n".join([good[0], NESTED, "not json", json.dumps([1, 2]), good[1], '{"torn": ']))
    code, body = await api("GET", f"runs/{rec['id']}/episodes")
    assert code == 200 and [e["index"] for e in body["episodes"]] == [0, 1]


def _write_run(runs_dir, run_id, *, state="running", job=None, spec_text=None, summary=None, done=False):
    run = runs_dir / run_id
    run.mkdir(parents=True)
    record = {
        "id": run_id,
        "name": "x",
        "state": state,
        "reason": None,
        "priority": "normal",
        "submitted_at": "2026-01-01T00:00:00.000000+00:00",
        "progress": {"done": 0, "total": 1},
        "marginal_vram_mb": 8000,
        "devices": [0],
        "depends_on": [],
        "seq": 1,
    }
    (run / "job.json").write_text(job if job is not None else json.dumps(record))
    cwd_spec = {"entrypoint": NOOP, "episodes": 1, "cwd": "/", "scheduling": {"marginal_vram_mb": 8000}}
    (run / "spec.json").write_text(spec_text if spec_text is not None else json.dumps(cwd_spec))
    if summary is not None:
        (run / "summary.json").write_text(summary)
    if done:
        (run / "_DONE").touch()
    return run


async def test_recovery_survives_hostile_files_and_reports_broken_directories(jp_serverapp, jp_fetch, runs_dir):
    """Before the server starts: a run that finalized with a nested summary, a job.json nested too
    deep, a job.json that is not a record, a spec.json that is garbage under a queued record, an
    empty job.json (said to be empty, not only not JSON)."""
    finalized = "20260101T000000.000001-aaaaaa"
    nested_job = "20260101T000000.000002-bbbbbb"
    not_record = "20260101T000000.000003-cccccc"
    bad_spec = "20260101T000000.000004-dddddd"
    empty_job = "20260101T000000.000005-eeeeee"  # (what a hard reset leaves of a write not on disk yet)
    _write_run(runs_dir, finalized, summary=NESTED, done=True)
    _write_run(runs_dir, nested_job, job=NESTED)
    _write_run(runs_dir, not_record, job=json.dumps({"state": 5, "seq": "x"}))
    _write_run(runs_dir, bad_spec, state="queued", spec_text="{" * 10)
    _write_run(runs_dir, empty_job, job="")

    await jp_serverapp.extension_manager.start_all_extensions()

    async def api(method, path):
        resp = await jp_fetch("evalsched", *path.split("/"), method=method, raise_error=False)
        return resp.code, json.loads(resp.body or b"null")

    code, rec = await api("GET", f"runs/{finalized}")
    assert code == 200 and rec["state"] == "failed", rec
    assert "summary.json is nested more than 64 levels deep" in rec["reason"]
    code, rec = await api("GET", f"runs/{bad_spec}")
    assert code == 200 and rec["state"] == "failed" and "spec.json is not valid JSON" in rec["reason"], rec
    assert (runs_dir / bad_spec / "_DONE").exists()
    code, status = await api("GET", "status")
    broken = {b["id"]: b["problem"] for b in status["broken_runs"]}
    assert set(broken) == {nested_job, not_record, empty_job}
    assert "nested more than 72 levels deep" in broken[nested_job] and "not a run record" in broken[not_record]
    assert broken[empty_job].startswith("job.json is not valid JSON: the file is empty (a write that never reached")
    code, err = await api("GET", f"runs/{nested_job}")
    assert code == 409 and "DELETE" in err["message"]
    code, ledger = await api("GET", "ledger")
    assert ledger["devices"][0]["allocated_mb"] == 0  # nothing held by what could not be read
    code, _ = await api("DELETE", f"runs/{nested_job}")
    assert code == 204 and not (runs_dir / nested_job).exists()
    code, status = await api("GET", "status")
    assert [b["id"] for b in status["broken_runs"]] == [not_record, empty_job]
    # The server schedules as usual.
    resp = await jp_fetch("evalsched", "runs", method="POST", body=json.dumps({"entrypoint": NOOP}), raise_error=False)
    assert resp.code == 201
    run_id = json.loads(resp.body)["id"]

    async def succeeded():
        return (await api("GET", f"runs/{run_id}"))[1]["state"] == "succeeded"

    await async_wait_until(succeeded, timeout=30)
