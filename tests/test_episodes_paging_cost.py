"""What a page of ``GET /runs/{id}/episodes`` costs: about its own lines, not the file (every page
read the whole ``episodes.jsonl`` to count ``total`` and passed over ``offset`` lines from its
start: paging through a large file was quadratic), and memory of about its answer's size, not of
its lines parsed (16 MiB of ``[],`` took 416 MiB). The run's index of where its lines start must
keep the contract: ``offset`` and ``total`` count complete lines, whatever the file does meanwhile
(grows, shrinks, is replaced)."""

from __future__ import annotations

import json
import os
import tracemalloc
from pathlib import Path

import pytest
from rest import spec, submit

from jupyter_evalsched import contract, store

NOOP = "jupyter_evalsched.examples.basic:noop"
MiB = 1 << 20


async def finished_run(api, wait_for) -> str:
    run = await submit(api, spec(entry=NOOP, episodes=1))
    assert (await wait_for(run["id"]))["state"] == "succeeded"
    return run["id"]


def episodes_file(runs_dir: Path, run_id: str) -> Path:
    return runs_dir / run_id / contract.EPISODES_FILE


def runner_lines(start: int, n: int) -> list[bytes]:
    """Lines as the runner writes them."""
    return [
        json.dumps(
            {
                "index": i,
                "metrics": {"accuracy": i / 7, "loss": 1 / (i + 1)},
                "started_at": "2026-01-01T00:00:00.000000+00:00",
                "finished_at": "2026-01-01T00:00:01.000000+00:00",
                "worker": 4242,
                "attempt": 1,
            },
            separators=(",", ":"),
        ).encode()
        for i in range(start, start + n)
    ]


def mixed_lines(n: int, tag: str) -> list[bytes]:
    """Episodes among lines that are none: garbage, an array, a blank line, one too long to read."""
    lines: list[bytes] = []
    for i in range(n):
        lines.append(json.dumps({"index": i, "metrics": {"m": i / 3}, "tag": tag}).encode())
        if i % 4 == 1:
            lines += [b"not json", b"[1, 2]", b"", b'{"index": 1, "pad": "' + b"p" * 400 + b'"}']
    return lines


def expected_page(data: bytes, offset: int, limit: int) -> dict:
    """The page as the contract says, from the whole file: its complete lines counted, the
    episodes of lines ``offset`` to ``offset + limit``."""
    complete = data[: data.rfind(b"\n") + 1].split(b"\n")[:-1]
    total = len(complete)
    episodes = []
    for raw in complete[offset : offset + limit]:
        item = None if len(raw) > store.MAX_EPISODE_LINE_BYTES else store.parse_episode(raw)
        if item is not None:
            episodes.append(item)
    following = offset + limit if offset + limit < total else None
    return {"episodes": episodes, "next_offset": following, "total": total}


async def page(api, run_id: str, **params) -> dict:
    code, body = await api("GET", f"runs/{run_id}/episodes", params={k: str(v) for k, v in params.items()})
    assert code == 200, body
    return body


async def every_page_agrees(api, run_id: str, data: bytes) -> None:
    total = expected_page(data, 0, 1)["total"]
    for limit in (1, 3, 8):
        for offset in range(total + 2):
            got = await page(api, run_id, offset=offset, limit=limit)
            assert got == expected_page(data, offset, limit), (offset, limit)


async def test_pages_keep_counting_complete_lines_as_the_file_grows_shrinks_or_is_replaced(
    api, wait_for, runs_dir, monkeypatch
):
    rid = await finished_run(api, wait_for)
    path = episodes_file(runs_dir, rid)
    # Marks (where a line starts) every few lines, each at its own place in a line, and a line
    # too long to read among them.
    monkeypatch.setattr(store, "EPISODE_MARK_BYTES", 97)
    monkeypatch.setattr(store, "MAX_EPISODE_LINE_BYTES", 300)
    data = b"".join(line + b"\n" for line in mixed_lines(12, "first")) + b'{"index": 99, "metr'
    path.write_bytes(data)
    await every_page_agrees(api, rid, data)

    # The run appends: the torn line completed, then more; what was indexed is kept, the rest read.
    more = b'ics": {}}\n' + b"".join(line + b"\n" for line in mixed_lines(6, "more"))
    with open(path, "ab") as f:
        f.write(more)
    data += more
    await every_page_agrees(api, rid, data)

    # Shrunk in place (the same file): fewer lines, counted again.
    data = data[: len(data) // 3]
    with open(path, "r+b") as f:
        f.truncate(len(data))
    await every_page_agrees(api, rid, data)

    # Rewritten in place, longer, its lines elsewhere than before.
    data = b"".join(line + b"\n" for line in mixed_lines(15, "rewritten-in-place-with-longer-lines"))
    with open(path, "r+b") as f:
        f.write(data)
    await every_page_agrees(api, rid, data)

    # Replaced by another file (renamed over it), as long as it was.
    data = data.replace(b"rewritten-in-place-with-longer-lines", b"REPLACED-by-another-file-of-same-size")
    (path.parent / "new.jsonl").write_bytes(data)
    os.replace(path.parent / "new.jsonl", path)
    await every_page_agrees(api, rid, data)

    # Emptied, then gone: an empty page.
    path.write_bytes(b"")
    assert await page(api, rid, offset=0) == {"episodes": [], "next_offset": None, "total": 0}
    path.unlink()
    assert await page(api, rid, offset=3) == {"episodes": [], "next_offset": None, "total": 0}


def bytes_read() -> int:
    """The bytes this process (the server is in it) has read so far, from any file."""
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


async def test_a_page_reads_about_its_own_lines_not_the_whole_file(api, wait_for, runs_dir):
    rid = await finished_run(api, wait_for)
    path = episodes_file(runs_dir, rid)
    lines = runner_lines(0, 80_000)  # about 16 MiB, and a line of 3 MiB being written
    torn = b'{"index":-1,"metrics":{},"pad":"' + b"p" * 3 * MiB
    path.write_bytes(b"".join(line + b"\n" for line in lines) + torn)
    size = path.stat().st_size
    assert size > 18 * MiB

    first = await page(api, rid, offset=0, limit=100)  # (the first page counts the lines once)
    assert first["total"] == 80_000 and first["next_offset"] == 100

    for offset in (100, 40_000, 79_950, 80_000):
        before = bytes_read()
        body = await page(api, rid, offset=offset, limit=100)
        cost = bytes_read() - before
        assert [e["index"] for e in body["episodes"]] == list(range(offset, min(offset + 100, 80_000)))
        assert body["total"] == 80_000
        assert cost < 3 * MiB, f"a page of 100 lines at {offset} read {cost} bytes of a {size}-byte file"

    # The run appends 2 MiB: the next page reads those (and the long line, the page passes over it
    # from the line before), not the file again.
    with open(path, "ab") as f:
        f.write(b'"}\n' + b"".join(line + b"\n" for line in runner_lines(80_000, 10_000)))
    before = bytes_read()
    body = await page(api, rid, offset=80_001, limit=100)
    cost = bytes_read() - before
    assert body["total"] == 90_001 and body["episodes"][0]["index"] == 80_000
    assert cost < 8 * MiB, f"a page after 2 MiB appended read {cost} bytes of a {path.stat().st_size}-byte file"


async def test_a_page_of_hostile_lines_holds_about_its_answer_in_memory(api, wait_for, runs_dir):
    rid = await finished_run(api, wait_for)
    # Episodes padded with empty arrays: 3 bytes each on disk, 64 in memory once parsed.
    pad = b"[]," * 5000 + b"[]"
    line = b'{"index":0,"metrics":{},"pad":[' + pad + b"]}"
    episodes_file(runs_dir, rid).write_bytes((line + b"\n") * (2 * MiB // len(line)))

    tracemalloc.start()
    try:
        code, text = await api("GET", f"runs/{rid}/episodes", raw=True)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert code == 200 and len(text) > 2 * MiB - len(line)
    # The lines parsed all at once: about 40 MiB; as answer text: its size, twice, and one line.
    assert peak < 16 * MiB, f"a page of 2 MiB of lines peaked at {peak / MiB:.1f} MiB"
    assert len(json.loads(text)["episodes"]) == 2 * MiB // len(line)


async def test_a_page_ends_before_its_answer_passes_its_bound(api, wait_for, runs_dir, monkeypatch):
    rid = await finished_run(api, wait_for)
    # Numbers written short that the answer writes long ("1e15" as "1000000000000000.0").
    lines = [b'{"index":%d,"metrics":{"m":1e15},"x":[1e15,1e15,1e15]}' % i for i in range(6)]
    episodes_file(runs_dir, rid).write_bytes(b"".join(line + b"\n" for line in lines))
    one = len(json.dumps(store.parse_episode(lines[0]), separators=(",", ":")))
    assert one > 2 * len(lines[0])
    monkeypatch.setattr(store, "MAX_EPISODES_ANSWER_BYTES", 2 * one + 1)  # two episodes and a comma

    got, offset = [], 0
    while offset is not None:
        code, text = await api("GET", f"runs/{rid}/episodes", params={"offset": str(offset)}, raw=True)
        assert code == 200, text
        body = json.loads(text)
        # The answer is as json.dumps of it writes it (the episodes were kept as their text).
        assert text == json.dumps(body, separators=(",", ":"))
        assert len(body["episodes"]) == (2 if offset < 6 else 0) and body["total"] == 6
        got += [e["index"] for e in body["episodes"]]
        offset = body["next_offset"]
    assert got == list(range(6))

    # One episode longer than the bound still makes a page of its own.
    monkeypatch.setattr(store, "MAX_EPISODES_ANSWER_BYTES", one // 2)
    body = await page(api, rid, offset=0)
    assert [e["index"] for e in body["episodes"]] == [0] and body["next_offset"] == 1

    # Without paging arguments: a 413 that says how to page, never a part of them.
    code, body = await api("GET", f"runs/{rid}/episodes")
    assert code == 413 and "?offset=0&limit=" in body["message"] and "of their JSON" in body["message"], body


@pytest.mark.parametrize("note", ["ascii", "é ü ☃ 🎉", '"quoted" \\ back\tslash'])
async def test_an_answer_is_written_as_before(api, wait_for, runs_dir, note):
    rid = await finished_run(api, wait_for)
    lines = [
        json.dumps({"index": i, "metrics": {"a": 0.1 * i, "n": None}, "note": note}, ensure_ascii=False).encode()
        for i in range(3)
    ]
    episodes_file(runs_dir, rid).write_bytes(b"".join(line + b"\n" for line in lines) + b'{"torn"')
    code, text = await api("GET", f"runs/{rid}/episodes", raw=True)
    assert code == 200
    episodes = [json.loads(line) for line in lines]
    assert text == json.dumps({"episodes": episodes, "next_offset": None, "total": 3}, separators=(",", ":"))


async def test_a_deleted_runs_index_is_forgotten_with_it(api, wait_for, evalsched):
    run_id = await finished_run(api, wait_for)
    await page(api, run_id, offset=0, limit=1)
    assert evalsched.store.episode_indexes.get(run_id) is not None
    code, _ = await api("DELETE", f"runs/{run_id}")
    assert code in (200, 204)
    assert evalsched.store.episode_indexes.get(run_id) is None
