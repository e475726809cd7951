"""Limits on reading a run's results back: a metric name's length (the runner drops a name too long
to record, so that ``summary.json`` and the run's ``job.json`` stay readable), ``GET /compare``
reading each run's ``episodes.jsonl`` as a stream, and ``GET /runs/{id}/episodes`` answering a page
at a time."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from rest import spec, submit

from jupyter_evalsched import contract, store
from jupyter_evalsched.contract import MAX_METRIC_NAME_CHARS
from jupyter_evalsched.runner.results import MetricAggregator, RunFiles

HERE = Path(__file__).resolve().parent

# An eval whose episodes return, besides a plain metric, a name whose JSON text is just under the
# server's read limit for a JSON file: written into summary.json and then into the run's record,
# it made a job.json the server could not read back (the run read as broken after a restart).
HUGE_NAME_EVAL = f"""
def episode(ctx, index):
    return {{"x" * {store.MAX_JSON_BYTES - 1300}: 1.0, "y" * {MAX_METRIC_NAME_CHARS + 1}: 2.0,
            "z" * {MAX_METRIC_NAME_CHARS}: 3.0, "accuracy": index / 2}}
"""


@pytest.mark.parametrize("workers", [1, 2])
async def test_a_metric_name_too_long_is_dropped_and_the_run_reads_back(api, wait_for, runs_dir, workers):
    run = await submit(api, {"source": HUGE_NAME_EVAL, "episodes": 3, "workers": workers, "cwd": "/"})
    rec = await wait_for(run["id"], timeout=120)
    assert rec["state"] == "succeeded", rec
    run_dir = runs_dir / run["id"]
    kept = {"z" * MAX_METRIC_NAME_CHARS, "accuracy"}
    summary = store.read_json_file(run_dir / contract.SUMMARY_FILE)
    assert set(summary["metrics"]) == kept and summary["metrics_dropped"] == 2, summary.get("metrics_dropped")
    assert summary["metrics"]["accuracy"]["mean"] == 0.5
    lines = [json.loads(line) for line in (run_dir / contract.EPISODES_FILE).read_text().splitlines()]
    assert [set(line["metrics"]) for line in lines] == [kept] * 3
    # The record as the server reads it back after a restart: job.json within the read limit.
    found = {f.run_id: f for f in store.RunStore(runs_dir).scan()}[run["id"]]
    assert found.job_problem is None and found.job is not None, found.job_problem
    assert set(found.job["metrics"]) == kept and found.job["state"] == "succeeded"
    assert any(w.startswith(contract.METRICS_CAPPED + ":") for w in rec["warnings"]), rec["warnings"]
    stderr = (run_dir / contract.STDERR_FILE).read_text()
    assert f"at most {MAX_METRIC_NAME_CHARS} characters" in stderr and stderr.count("longer than") == 1, stderr[-2000:]


def test_the_aggregator_drops_names_too_long_and_counts_them_once():
    agg = MetricAggregator(max_names=3)
    long_a, long_b = "a" * (MAX_METRIC_NAME_CHARS + 1), "b" * 10_000_000
    assert agg.keep({long_a: 1, "ok": 2, long_b: 3}) == {"ok": 2}
    assert agg.keep({long_a: 1, "ok": 2}) == {"ok": 2}
    assert agg.dropped == 2 and agg.too_long == 2
    agg.add({long_a: 1.0, "ok": 1.0})  # (as an earlier attempt's line may hold it)
    assert set(agg.summary()) == {"ok"} and agg.dropped == 2


# --------------------------------------------------------------------------- reading episodes.jsonl

MANY = f"{HERE / 'evals_sweep.py'}:many"
NOOP = "jupyter_evalsched.examples.basic:noop"


def hostile_lines(n: int, seed: int) -> list[bytes]:
    """``episodes.jsonl`` lines of every kind the readers meet: episodes (an index run twice, a
    metric that is null, not a number, a bool), garbage, a nested line, an array, blank lines."""
    lines = []
    for i in range(n):
        metrics = {"a": (i * 7 + seed) % 11 / 3, "b": i % 3 == 0, "c": None if i % 4 else 1.5, "s": "x"}
        lines.append(json.dumps({"index": i % (n - 2), "metrics": metrics, "attempt": 1}).encode())
        if i % 5 == 2:
            lines += [b"not json", b"[1, 2]", b"", b'{"index": ' * 50 + b"1" + b"}" * 50]
    return lines


def write_episodes(runs_dir: Path, run_id: str, lines: list[bytes], torn: bytes = b'{"index": 0, "metr') -> bytes:
    data = b"".join(line + b"\n" for line in lines) + torn
    (runs_dir / run_id / contract.EPISODES_FILE).write_bytes(data)
    return data


def whole_file_episodes(data: bytes) -> list[dict]:
    """The episodes as the server read them before it streamed: the whole file, parsed at once."""
    parsed = (store.parse_episode(line) for line in data[: data.rfind(b"\n") + 1].splitlines())
    return [item for item in parsed if item is not None]


def metrics_of(lines: list[dict]) -> dict[int, dict[str, float]]:
    """``{index: {metric: value}}`` of episode lines, as the server's comparison takes them."""
    from jupyter_evalsched.scheduler import compare

    metrics = compare.EpisodeMetrics()
    for line in lines:
        metrics.add(line)
    return metrics.by_index


class ParseCounter:
    """Counts the lines the server reads as JSON (store.parse_episode, wrapped)."""

    def __init__(self, monkeypatch) -> None:
        self.calls = 0
        parse = store.parse_episode

        def counted(line: bytes):
            self.calls += 1
            return parse(line)

        monkeypatch.setattr(store, "parse_episode", counted)


async def finished_runs(api, wait_for, n: int) -> list[str]:
    runs = [await submit(api, spec(entry=NOOP, episodes=1)) for _ in range(n)]
    for run in runs:
        assert (await wait_for(run["id"]))["state"] == "succeeded"
    return [run["id"] for run in runs]


async def test_compare_reads_episodes_as_a_stream_with_the_same_answers_and_its_limit(
    api, wait_for, runs_dir, monkeypatch
):
    from jupyter_evalsched.scheduler import compare

    ids = await finished_runs(api, wait_for, 2)
    data = {rid: write_episodes(runs_dir, rid, hostile_lines(40, seed)) for seed, rid in enumerate(ids)}
    code, answer = await api("GET", "compare", params={"runs": ",".join(ids)})
    assert code == 200, answer
    # The same answer as from each whole file parsed at once (the figures; records as the server has them).
    expected = compare.compare([({"id": rid}, metrics_of(whole_file_episodes(data[rid]))) for rid in ids], ids[0])
    assert answer["metrics"] == expected["metrics"] == ["a", "b", "c"]
    for row, want in zip(answer["rows"], expected["rows"], strict=True):
        assert (row["id"], row["metrics"], row["delta"], row["error"]) == (
            want["id"],
            want["metrics"],
            want["delta"],
            None,
        )
    assert answer["rows"][0]["metrics"]["a"]["count"] == 38  # (two indices were run twice: the later lines count)

    # The limit: 413 once the values held pass twice it while reading. (That the reading stops
    # at that line is counted where the parsing happens, in the worker's code:
    # test_compare_limits.py::test_the_worker_stops_reading_at_the_line_past_twice_the_value_limit.)
    held = sum(len(v) for v in metrics_of(whole_file_episodes(data[ids[0]])).values())
    assert held > 20
    monkeypatch.setattr(compare, "MAX_COMPARE_VALUES", 10)
    code, answer = await api("GET", "compare", params={"runs": ",".join(ids)})
    assert code == 413 and "MAX_COMPARE_VALUES" in answer["message"], answer
    monkeypatch.setattr(compare, "MAX_COMPARE_VALUES", held + 5)
    code, answer = await api("GET", "compare", params={"runs": ",".join(ids)})
    assert code == 413, answer  # the first run fits, the second passes it
    # The limit against what the runs finally hold (both runs as many values), as the whole files
    # were: index 0's first line held one value more than its later line does, which a count as
    # the lines come passes.
    monkeypatch.setattr(compare, "MAX_COMPARE_VALUES", 2 * held)
    code, answer = await api("GET", "compare", params={"runs": ",".join(ids)})
    assert code == 200, answer
    monkeypatch.setattr(compare, "MAX_COMPARE_VALUES", 2 * held - 1)
    code, answer = await api("GET", "compare", params={"runs": ",".join(ids)})
    assert code == 413, answer


async def test_compare_leaves_out_metric_names_too_long_whatever_wrote_them(api, wait_for, runs_dir):
    (rid,) = await finished_runs(api, wait_for, 1)
    long_name = "n" * (MAX_METRIC_NAME_CHARS + 1)
    write_episodes(runs_dir, rid, [json.dumps({"index": 0, "metrics": {long_name: 1.0, "ok": 2.0}}).encode()])
    code, answer = await api("GET", "compare", params={"runs": rid})
    assert code == 200 and answer["metrics"] == ["ok"], answer


async def page(api, run_id: str, **params) -> dict:
    code, body = await api("GET", f"runs/{run_id}/episodes", params={k: str(v) for k, v in params.items()})
    assert code == 200, body
    assert set(body) == {"episodes", "next_offset", "total"}
    return body


async def test_episodes_come_in_pages_that_add_up_to_the_file(api, wait_for, runs_dir, monkeypatch):
    from jupyter_evalsched.handlers import EpisodesHandler

    (rid,) = await finished_runs(api, wait_for, 1)
    lines = hostile_lines(12, 0)
    data = write_episodes(runs_dir, rid, lines)
    everything = whole_file_episodes(data)
    assert len(lines) == 20 and len(everything) == 12

    # Without paging arguments: every episode; with one of them, the first page of the default size.
    whole = await page(api, rid)
    assert whole == {"episodes": everything, "next_offset": None, "total": 20}  # the torn line is not one
    monkeypatch.setattr(EpisodesHandler, "DEFAULT_LIMIT", 5)
    assert await page(api, rid) == whole
    first = await page(api, rid, offset=0)
    assert first["next_offset"] == 5 and first["total"] == 20
    assert first["episodes"] == whole_file_episodes(b"".join(line + b"\n" for line in lines[:5]))

    # Page by page: every episode once, in order; the lines before a page's offset are not parsed.
    got, offset, pages = [], 0, 0
    counter = ParseCounter(monkeypatch)
    while offset is not None:
        before = counter.calls
        body = await page(api, rid, offset=offset, limit=4)
        assert counter.calls - before <= 4, "only the page's own lines are read as JSON"
        assert body["total"] == 20
        got += body["episodes"]
        offset, pages = body["next_offset"], pages + 1
    assert got == everything and pages == 5

    # Past the end: an empty last page; the run appending makes the next one.
    assert await page(api, rid, offset=20) == {"episodes": [], "next_offset": None, "total": 20}
    assert await page(api, rid, offset=1000) == {"episodes": [], "next_offset": None, "total": 20}
    with open(runs_dir / rid / contract.EPISODES_FILE, "ab") as f:
        f.write(b'ics": {"a": 9.0}}\n')  # the torn line completed: line 20
    assert await page(api, rid, offset=20) == {
        "episodes": [{"index": 0, "metrics": {"a": 9.0}}],
        "next_offset": None,
        "total": 21,
    }


async def test_an_episodes_page_is_bounded_in_bytes_and_skips_a_line_too_long(api, wait_for, runs_dir, monkeypatch):
    (rid,) = await finished_runs(api, wait_for, 1)
    lines = [json.dumps({"index": i, "metrics": {"m": float(i)}}).encode() for i in range(6)]
    lines[2] = json.dumps({"index": 2, "metrics": {"m": 2.0}, "pad": "p" * 200}).encode()
    write_episodes(runs_dir, rid, lines, torn=b"")
    monkeypatch.setattr(store, "MAX_EPISODE_LINE_BYTES", 100)  # line 2 is longer: skipped, counted
    body = await page(api, rid)
    assert [e["index"] for e in body["episodes"]] == [0, 1, 3, 4, 5] and body["total"] == 6
    monkeypatch.setattr(store, "MAX_EPISODE_LINE_BYTES", 4096)
    monkeypatch.setattr(store, "MAX_EPISODES_PAGE_BYTES", len(lines[0]) * 2)  # two short lines a page
    body = await page(api, rid, offset=0)
    assert [e["index"] for e in body["episodes"]] == [0, 1] and body["next_offset"] == 2
    body = await page(api, rid, offset=2)  # a line over the page's bytes still makes a page of its own
    assert [e["index"] for e in body["episodes"]] == [2] and body["next_offset"] == 3


@pytest.mark.parametrize(
    ("params", "words"),
    [
        ({"offset": "-1"}, "'offset' must be between 0"),
        ({"offset": "x"}, "'offset' must be an integer"),
        ({"limit": "0"}, "'limit' must be between 1 and 100000"),
        ({"limit": "100001"}, "'limit' must be between 1 and 100000"),
        ({"limit": "1.5"}, "'limit' must be an integer"),
    ],
)
async def test_bad_paging_arguments_are_a_400_that_says_which(api, params, words):
    run = await submit(api, spec(entry=NOOP, episodes=1))
    code, body = await api("GET", f"runs/{run['id']}/episodes", params=params)
    assert code == 400 and words in body["message"], body


async def test_an_episodes_file_that_cannot_be_read_is_a_409(api, wait_for, runs_dir):
    (rid,) = await finished_runs(api, wait_for, 1)
    path = runs_dir / rid / contract.EPISODES_FILE
    path.unlink()
    path.symlink_to("/etc/passwd")
    code, body = await api("GET", f"runs/{rid}/episodes")
    assert code == 409 and contract.EPISODES_FILE in body["message"], body


async def test_the_python_client_pages_through_every_episode(
    api, wait_for, runs_dir, monkeypatch, jp_serverapp, jp_http_port, jp_base_url
):
    import asyncio

    from jupyter_evalsched.client import rest_client

    (rid,) = await finished_runs(api, wait_for, 1)
    data = write_episodes(runs_dir, rid, hostile_lines(12, 3))
    monkeypatch.setattr(rest_client, "MAX_EPISODES_PAGE", 3)
    client = rest_client.EvalSchedClient(
        f"http://127.0.0.1:{jp_http_port}{jp_base_url}", jp_serverapp.identity_provider.token
    )
    requests = []
    request = client.request
    monkeypatch.setattr(client, "request", lambda *a, **kw: requests.append(kw.get("query")) or request(*a, **kw))
    got = await asyncio.to_thread(client.episodes, rid)  # (a thread: the server runs on this loop)
    assert got == whole_file_episodes(data)
    assert len(requests) == 7 and requests[0] == {"offset": None, "limit": 3}, requests


# --------------------------------------------------------------------------- what the server keeps of summary.json

# The eval rewrites summary.json from an atexit handler: after the runner's final summary, before
# _DONE; the server reads that version and takes the run's record from it. A name of megabytes,
# figures that are not numbers and fields of its own must not reach job.json.
ATEXIT_REWRITE_EVAL = """
import atexit, json, os

def _rewrite(run_dir):
    path = os.path.join(run_dir, "summary.json")
    with open(path) as f:
        s = json.load(f)
    s["metrics"]["\\u00e9" * 6_000_000] = {"mean": 1.0, "std": 0.0, "min": 1.0, "max": 1.0, "count": 1, "skipped": 0}
    s["metrics"]["accuracy"].update(junk="j" * 100_000, mean="high", std=[1.0] * 1000, count=2**80, max=10**400)
    s["metrics"]["odd"] = ["not", "figures"]
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        json.dump(s, f, ensure_ascii=False)
    os.replace(path + ".tmp", path)

def episode(ctx, index):
    atexit.register(_rewrite, ctx.run_dir)
    return {"accuracy": 1.0}
"""


async def test_a_summary_rewritten_by_the_eval_cannot_make_job_json_unreadable(api, wait_for, runs_dir):
    run = await submit(api, {"source": ATEXIT_REWRITE_EVAL, "episodes": 1, "cwd": "/"})
    rec = await wait_for(run["id"], timeout=120)
    run_dir = runs_dir / run["id"]
    assert (run_dir / contract.SUMMARY_FILE).stat().st_size > 10 * 2**20  # (what the eval made of it)
    assert rec["state"] == "succeeded", rec
    # The figures the runner writes, as numbers or null, and nothing else; the name too long dropped.
    assert rec["metrics"] == {
        "accuracy": {"mean": None, "std": None, "min": 1.0, "max": None, "count": None, "skipped": 0},
        "odd": None,
    }
    (warning,) = [w for w in rec["warnings"] if w.startswith(contract.METRICS_CAPPED + ":")]
    assert "1 metric names" in warning and f"longer than {MAX_METRIC_NAME_CHARS} characters" in warning, warning
    assert (run_dir / contract.JOB_FILE).stat().st_size < 64 * 1024
    # After a restart: the record reads back.
    found = {f.run_id: f for f in store.RunStore(runs_dir).scan()}[run["id"]]
    assert found.job_problem is None and found.job is not None, found.job_problem
    assert found.job["metrics"] == rec["metrics"]


def test_the_record_keeps_only_bounded_figures_and_timestamps_of_a_summary():
    from jupyter_evalsched.scheduler.runs import record_metrics, summary_timestamp

    names = {f"m{i}": {"mean": i, "count": i, "skipped": True, "extra": 1} for i in range(300)}
    kept, left_out = record_metrics({"n" * (MAX_METRIC_NAME_CHARS + 1): {}, **names})
    assert len(kept) == contract.MAX_METRIC_NAMES and left_out == 1 + 300 - contract.MAX_METRIC_NAMES
    assert kept["m3"] == {"mean": 3.0, "count": 3, "skipped": None}
    assert record_metrics({"a": {"min": float("nan"), "max": -1.5, "count": -1}}) == (
        {"a": {"min": None, "max": -1.5, "count": None}},
        0,
    )
    assert record_metrics(["a"]) == ({}, 0)
    assert record_metrics({"plain": 0.5, "big": 10**400, "text": "x" * 10**6}) == (
        {"plain": 0.5, "big": None, "text": None},
        0,
    )
    assert summary_timestamp("2026-01-02T03:04:05.123456+00:00") == "2026-01-02T03:04:05.123456+00:00"
    for bad in ("2026-01-02T03:04:05" + " " * 100, "yesterday", 17, ["2026-01-02"], None):
        assert summary_timestamp(bad) is None


def test_a_resumed_attempt_says_once_that_a_name_is_too_long(tmp_path, capfd):
    long_name = "L" * (MAX_METRIC_NAME_CHARS + 1)
    # The first attempt's line holds such a name (an older runner, or the eval, wrote it).
    line = {"index": 0, "metrics": {long_name: 1.0, "ok": 1.0}, "attempt": 1}
    (tmp_path / contract.EPISODES_FILE).write_text(json.dumps(line) + "\n")
    files = RunFiles(str(tmp_path), "r1", episodes_total=3, attempt=2)
    assert files.aggregator.too_long == 1
    capfd.readouterr()
    files.record_episode(1, {long_name: 2.0, "ok": 2.0}, "t0", "t1", 1)
    files.record_episode(2, {"M" * 1000: 2.0, "ok": 3.0}, "t0", "t1", 1)
    err = capfd.readouterr().err
    assert err.count("returned a metric name longer than") == 1 and "episode 1 " in err, err
    files.finalize("succeeded", None)


# --------------------------------------------------------------------------- comparisons: time and memory


# (The deadline's count of lines that are not episodes is tested where it is kept, in the worker's
# code: test_compare_limits.py::test_the_workers_deadline_counts_lines_that_are_not_episodes.)


def test_what_a_comparison_holds_is_bounded_by_its_values_not_its_lines():
    from jupyter_evalsched.scheduler import compare

    held = compare.EpisodeMetrics()
    held.add({"index": 7, "metrics": {"a": 1.0}})
    for i in range(10_000):
        held.add({"index": i, "metrics": {"s": "x", "n": None}})
    assert held.by_index == {} and held.values == 0  # (index 7's later line, without a value, replaced it)
    held.add({"index": 3, "metrics": {"a": 2.0}})
    assert held.by_index == {3: {"a": 2.0}} and held.values == 1
    # The answer is the one with the empty episodes held.
    with_empty = {3: {"a": 2.0}, 5: {}, 7: {}}
    record = {"id": "r", "params": {}}
    assert compare.compare([(record, held.by_index)]) == compare.compare([(record, with_empty)])


async def test_a_comparison_within_the_limit_is_answered_though_an_index_held_more(
    api, wait_for, runs_dir, monkeypatch
):
    from jupyter_evalsched.scheduler import compare

    (rid,) = await finished_runs(api, wait_for, 1)
    lines = [b'{"index":0,"metrics":{"a":1,"b":2,"c":3}}', b'{"index":0,"metrics":{"a":1}}']
    write_episodes(runs_dir, rid, lines, torn=b"")
    monkeypatch.setattr(compare, "MAX_COMPARE_VALUES", 2)  # the run holds 1 value in the end
    code, answer = await api("GET", "compare", params={"runs": rid})
    assert code == 200 and answer["rows"][0]["metrics"]["a"]["count"] == 1, answer
    monkeypatch.setattr(compare, "MAX_COMPARE_VALUES", 0)
    code, answer = await api("GET", "compare", params={"runs": rid})
    assert code == 413, answer


# --------------------------------------------------------------------------- episodes: clients from before pages


async def test_a_plain_get_of_the_episodes_answers_all_or_a_413_that_says_how_to_page(
    api, wait_for, runs_dir, monkeypatch
):
    (rid,) = await finished_runs(api, wait_for, 1)
    lines = [json.dumps({"index": i, "metrics": {"m": 1.0}}).encode() for i in range(1500)]
    write_episodes(runs_dir, rid, lines, torn=b"")
    # What a client from before pages does: a GET without paging arguments, body["episodes"].
    code, body = await api("GET", f"runs/{rid}/episodes")
    assert code == 200 and [e["index"] for e in body["episodes"]] == list(range(1500)), code
    assert body["next_offset"] is None and body["total"] == 1500
    # With either argument: pages.
    assert (await page(api, rid, limit=1000))["next_offset"] == 1000
    assert (await page(api, rid, offset=0))["next_offset"] == 1000
    # More than one page's bytes: a 413 that says how to page, never a part of them.
    monkeypatch.setattr(store, "MAX_EPISODES_PAGE_BYTES", sum(map(len, lines)) - 1)
    code, body = await api("GET", f"runs/{rid}/episodes")
    assert code == 413 and "?offset=0&limit=" in body["message"] and "next_offset" in body["message"], body
    assert (await page(api, rid, offset=1000))["episodes"][-1]["index"] == 1499


async def test_a_page_bounds_the_bytes_of_lines_as_they_are_in_the_file(api, wait_for, runs_dir, monkeypatch):
    (rid,) = await finished_runs(api, wait_for, 1)
    # Characters beyond ASCII as the file holds them (2 bytes each), escaped in the answer (6 bytes).
    lines = [json.dumps({"index": i, "metrics": {}, "note": "é" * 100}, ensure_ascii=False).encode() for i in range(4)]
    write_episodes(runs_dir, rid, lines, torn=b"")
    monkeypatch.setattr(store, "MAX_EPISODES_PAGE_BYTES", sum(map(len, lines)))
    code, body = await api("GET", f"runs/{rid}/episodes")
    assert code == 200 and len(body["episodes"]) == 4 and body["next_offset"] is None
    assert (
        len(json.dumps(body).encode()) > 2 * store.MAX_EPISODES_PAGE_BYTES
    )  # (the answer's own size is not bounded by it)
