"""A hostile review of the per-run line index of ``GET /runs/{id}/episodes`` (store.LineIndex):
``total`` and the pages count the file's complete lines as they are, whatever happened to the
bytes the index read before (docs/reference.md, "Episodes page by page")."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from rest import CRASH, spec, submit
from waiting import wait_until

from jupyter_evalsched import contract
from jupyter_evalsched.client import LocalServer


async def page(api, run_id: str, **params) -> dict:
    code, body = await api("GET", f"runs/{run_id}/episodes", params={k: str(v) for k, v in params.items()})
    assert code == 200, body
    return body


def complete_lines(data: bytes) -> list[bytes]:
    return data[: data.rfind(b"\n") + 1].split(b"\n")[:-1]


async def test_a_resumed_run_that_cut_off_a_torn_line_is_counted_again(api, wait_for, runs_dir):
    """An attempt that died while writing a line leaves it torn; the next attempt cuts it off
    (ftruncate to the last newline) and appends its own lines over those bytes. A page read
    between the two indexed the torn bytes as "a line not yet complete": the resumed run's lines
    there hold newlines that must be counted."""
    body = spec(CRASH, episodes=6, params={"how": "exit", "code": 3, "at": 3, "until_attempt": 1})
    rec = await submit(api, body)
    assert (await wait_for(rec["id"]))["state"] == "failed"
    path = runs_dir / rec["id"] / contract.EPISODES_FILE
    first = path.read_bytes()
    assert len(complete_lines(first)) == 3 and first.endswith(b"\n")
    # The torn line: longer than one line of the next attempt, shorter than its three.
    one = max(len(line) for line in complete_lines(first))
    with open(path, "ab") as f:
        f.write(b'{"index":3,"metrics":{"ok":1,"note":"' + b"x" * (one * 3 // 2))
    assert await page(api, rec["id"], offset=0) == {
        "episodes": [json.loads(line) for line in complete_lines(first)],
        "next_offset": None,
        "total": 3,
    }

    code, resumed = await api("POST", f"runs/{rec['id']}/resume")
    assert code == 200, resumed
    assert (await wait_for(rec["id"]))["state"] == "succeeded"
    data = path.read_bytes()
    assert len(complete_lines(data)) == 6 and len(data) > len(first) + one * 3 // 2 + 40
    got = await page(api, rec["id"], offset=0)
    assert got["total"] == 6 and [e["index"] for e in got["episodes"]] == [0, 1, 2, 3, 4, 5], got
    assert await page(api, rec["id"], offset=5) == {
        "episodes": [json.loads(complete_lines(data)[5])],
        "next_offset": None,
        "total": 6,
    }


def padded_line(index: int, length: int, tag: str) -> bytes:
    """An episode's line of ``length`` bytes with its newline."""
    head = b'{"index":%d,"metrics":{},"tag":"%s","pad":"' % (index, tag.encode())
    return head + b"p" * (length - len(head) - 3) + b'"}\n'


async def test_a_file_emptied_and_written_again_in_place_is_counted_again(api, wait_for, runs_dir):
    """The same file (its inode) emptied and written again, longer, by a writer that reopened it:
    the index's last line still ends with a newline where it did, but its lines are not those."""
    rec = await submit(api, spec(entry="jupyter_evalsched.examples.basic:noop", episodes=1))
    assert (await wait_for(rec["id"]))["state"] == "succeeded"
    path = runs_dir / rec["id"] / contract.EPISODES_FILE
    before = b"".join(padded_line(i, 100, "before") for i in range(4))
    path.write_bytes(before)
    got = await page(api, rec["id"], offset=0)
    assert got["total"] == 4 and [e["index"] for e in got["episodes"]] == [0, 1, 2, 3]

    # Two lines where there were four (a newline at the same last byte), then three more.
    after = padded_line(0, 150, "after") + padded_line(1, 250, "after")
    after += b"".join(padded_line(i, 100, "after") for i in range(2, 5))
    assert after[len(before) - 1 : len(before)] == b"\n"
    inode = path.stat().st_ino
    with open(path, "wb") as f:
        f.write(after)
    assert path.stat().st_ino == inode
    expected = [json.loads(line) for line in complete_lines(after)]
    assert await page(api, rec["id"], offset=0) == {"episodes": expected, "next_offset": None, "total": 5}
    assert await page(api, rec["id"], offset=3, limit=1) == {
        "episodes": expected[3:4],
        "next_offset": 4,
        "total": 5,
    }


def bytes_read() -> int:
    """The bytes this process (the server is in it) has read so far, from any file."""
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


async def test_a_page_that_opened_the_file_before_another_page_extended_the_index_reads_no_more(
    api, wait_for, runs_dir, evalsched, monkeypatch
):
    """Two pages of a running run at once (the Lab panel and a notebook's widget): the one that
    opened the file first finds the index extended by the other over what the run appended since.
    It reads the file as it is now rather than index the whole file again."""
    rec = await submit(api, spec(entry="jupyter_evalsched.examples.basic:noop", episodes=1))
    assert (await wait_for(rec["id"]))["state"] == "succeeded"
    path = runs_dir / rec["id"] / contract.EPISODES_FILE
    lines = [padded_line(i, 200, "run") for i in range(100_000)]  # 20 MB
    path.write_bytes(b"".join(lines))
    assert (await page(api, rec["id"], offset=0, limit=1))["total"] == 100_000

    store = evalsched.store
    real = type(store)._episode_lines
    other_page_done = []

    def opened_then_overtaken(self, run_id):
        """This page's snapshot of the file, then the run appends and another page reads it all."""
        mine = real(self, run_id)
        if not other_page_done:
            other_page_done.append(True)
            with open(path, "ab") as f:
                f.write(padded_line(100_000, 200, "run"))
            assert self.episodes_page(run_id, 99_990, 100).total == 100_001
        return mine

    monkeypatch.setattr(type(store), "_episode_lines", opened_then_overtaken)
    before = bytes_read()
    got = await page(api, rec["id"], offset=99_999, limit=10)
    cost = bytes_read() - before
    assert other_page_done
    assert cost < 3 * 2**20, f"a page of 2 lines read {cost} bytes of a {path.stat().st_size}-byte file"
    # The file as it is now: with the line the run appended.
    assert [e["index"] for e in got["episodes"]] == [99_999, 100_000] and got["total"] == 100_001, got


async def test_an_indexed_file_replaced_by_a_link_is_refused_not_read(api, wait_for, runs_dir, tmp_path):
    """The run's index kept, its file then replaced by a link to another (longer) file: the page
    still opens it as every run file is opened (never through a link): a 409, nothing of it."""
    rec = await submit(api, spec(entry="jupyter_evalsched.examples.basic:noop", episodes=1))
    assert (await wait_for(rec["id"]))["state"] == "succeeded"
    path = runs_dir / rec["id"] / contract.EPISODES_FILE
    path.write_bytes(b"".join(padded_line(i, 100, "mine") for i in range(3)))
    assert (await page(api, rec["id"], offset=1))["total"] == 3
    secret = tmp_path / "secret.jsonl"
    secret.write_bytes(b"".join(padded_line(i, 100, "SECRET") for i in range(9)))
    path.unlink()
    path.symlink_to(secret)
    for params in ({"offset": "1"}, {}):
        code, body = await api("GET", f"runs/{rec['id']}/episodes", params=params)
        assert code == 409 and "SECRET" not in json.dumps(body), body


@pytest.mark.slow  # two servers started (CI runs it with -m slow)
def test_a_secondary_forwards_pages_as_the_primary_writes_them(tmp_path):
    """A secondary server of the same runs directory forwards the page: the same bytes as the
    primary's (kept as answer text: escapes, big integers, numbers written long), a large one
    (over 20 MiB) whole, the 413 and its message."""
    runs = str(tmp_path / "runs")
    with (
        LocalServer(virtual_gpus="24000", runs_dir=runs) as first,
        LocalServer(virtual_gpus="24000", runs_dir=runs) as second,
    ):
        a, b = first.client(), second.client()
        rec = b.submit({"entrypoint": "jupyter_evalsched.examples.basic:noop", "episodes": 1})
        wait_until(lambda: a.get(rec["id"])["state"] == "succeeded", timeout=30)
        path = Path(runs) / rec["id"] / contract.EPISODES_FILE
        odd = [
            '{"index":0,"metrics":{"m":1e15},"note":"é ☃ 🎉 \\ud800","big":123456789012345678901234567890}',
            '{"index":1,"metrics":{},"dup":1,"dup":2}',
            '{"index":2,"metrics":{"nan":NaN}}',
        ]
        long = b'{"index":3,"metrics":{},"x":[' + b",".join([b"1e15"] * 200_000) + b"]}"
        path.write_bytes("\n".join(odd).encode() + b"\n" + (long + b"\n") * 6)

        def raw(server, query):
            request = urllib.request.Request(
                f"{server.url}evalsched/runs/{rec['id']}/episodes?{query}",
                headers={"Authorization": f"token {server.token}"},
            )
            try:
                with urllib.request.urlopen(request, timeout=60) as answer:
                    return answer.status, answer.read()
            except urllib.error.HTTPError as exc:
                return exc.code, exc.read()

        for query in ("offset=0&limit=3", "offset=0&limit=100", "offset=3&limit=6", "limit=1", ""):
            code, text = raw(second, query)
            assert (code, text) == raw(first, query), query
            if code == 200:
                body = json.loads(text)
                assert text == json.dumps(body, separators=(",", ":")).encode() and body["total"] == 9
        code, text = raw(second, "offset=3&limit=6")
        assert code == 200 and len(text) > 20 * 2**20 and len(json.loads(text)["episodes"]) == 6
        assert (
            raw(second, "offset=0&limit=3")[1]
            == json.dumps(
                {"episodes": [json.loads(odd[0]), json.loads(odd[1])], "next_offset": 3, "total": 9},
                separators=(",", ":"),
            ).encode()
        )
