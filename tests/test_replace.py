"""Replacing a file by an exchange of names (``runner.replace``): what readers and writers see is
``os.replace``'s, whatever stands at the name, and a run's intermediate summaries use it."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from jupyter_evalsched.runner import replace as replace_module
from jupyter_evalsched.runner.replace import RENAME_EXCHANGE, replace

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="renameat2 is Linux's")


@pytest.fixture
def exchanges(monkeypatch, tmp_path):
    """The flags of every renameat2 call ``replace`` makes that succeeds (the real call)."""
    assert replace_module.load(), "renameat2 should be found in this Linux C library"
    real = replace_module._renameat2
    assert real is not None
    (tmp_path / ".probe-a").touch()
    (tmp_path / ".probe-b").touch()
    exchanged = real(
        -100, os.fsencode(tmp_path / ".probe-a"), -100, os.fsencode(tmp_path / ".probe-b"), RENAME_EXCHANGE
    )
    assert exchanged == 0, "the tests' temporary directory should be on a file system that exchanges names"
    for name in (".probe-a", ".probe-b"):
        (tmp_path / name).unlink()
    calls: list[int] = []

    def recorded(*args):
        rc = real(*args)
        if rc == 0:
            calls.append(args[4])
        return rc

    monkeypatch.setattr(replace_module, "_renameat2", recorded)
    return calls


def _write(path: Path, text: str) -> None:
    path.write_text(text)


def test_replace_over_a_file_exchanges_the_names_and_removes_the_old(tmp_path, exchanges):
    _write(tmp_path / "job.json", "old")
    old_inode = os.stat(tmp_path / "job.json").st_ino
    _write(tmp_path / ".tmp", "new")
    new_inode = os.stat(tmp_path / ".tmp").st_ino
    replace(str(tmp_path / ".tmp"), str(tmp_path / "job.json"))
    assert exchanges == [RENAME_EXCHANGE]
    assert (tmp_path / "job.json").read_text() == "new"
    assert os.stat(tmp_path / "job.json").st_ino == new_inode != old_inode
    assert sorted(os.listdir(tmp_path)) == ["job.json"]


def test_replace_relative_to_a_directory_descriptor(tmp_path, exchanges):
    _write(tmp_path / "job.json", "old")
    _write(tmp_path / ".tmp", "new")
    dfd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        replace(".tmp", "job.json", dir_fd=dfd)
    finally:
        os.close(dfd)
    assert exchanges == [RENAME_EXCHANGE]
    assert (tmp_path / "job.json").read_text() == "new"
    assert sorted(os.listdir(tmp_path)) == ["job.json"]


def test_replace_of_a_missing_name_renames(tmp_path, exchanges):
    _write(tmp_path / ".tmp", "first")
    replace(str(tmp_path / ".tmp"), str(tmp_path / "job.json"))
    assert (tmp_path / "job.json").read_text() == "first"
    assert sorted(os.listdir(tmp_path)) == ["job.json"]


def test_replace_of_a_missing_source_fails_as_os_replace_does(tmp_path, exchanges):
    _write(tmp_path / "job.json", "old")
    with pytest.raises(FileNotFoundError):
        replace(str(tmp_path / ".tmp"), str(tmp_path / "job.json"))
    assert (tmp_path / "job.json").read_text() == "old"


def test_replace_never_follows_or_opens_what_stands_at_the_name(tmp_path, exchanges):
    """A link or a FIFO planted at the name is replaced, as os.replace replaces it: the link's
    target is untouched and the FIFO is never opened (which would block)."""
    target = tmp_path / "elsewhere"
    _write(target, "not ours")
    os.symlink(target, tmp_path / "job.json")
    os.mkfifo(tmp_path / "summary.json")
    for name in ("job.json", "summary.json"):
        _write(tmp_path / ".tmp", name)
        replace(str(tmp_path / ".tmp"), str(tmp_path / name))
        assert not os.path.islink(tmp_path / name)
        assert (tmp_path / name).read_text() == name
    assert exchanges == [RENAME_EXCHANGE] * 2
    assert target.read_text() == "not ours"
    assert sorted(os.listdir(tmp_path)) == ["elsewhere", "job.json", "summary.json"]


def test_a_directory_at_the_name_is_refused_as_os_replace_refuses_it(tmp_path, exchanges):
    """The exchange succeeds with a directory, whose unlink then fails: the names are exchanged
    back, and os.replace's own error is what the caller gets, both entries as they were."""
    (tmp_path / "job.json").mkdir()
    (tmp_path / "job.json" / "inside").write_text("kept")
    _write(tmp_path / ".tmp", "new")
    with pytest.raises(IsADirectoryError):
        replace(str(tmp_path / ".tmp"), str(tmp_path / "job.json"))
    assert exchanges == [RENAME_EXCHANGE, RENAME_EXCHANGE]
    assert (tmp_path / "job.json" / "inside").read_text() == "kept"
    assert (tmp_path / ".tmp").read_text() == "new"


@pytest.mark.parametrize("refusal", [errno.EINVAL, errno.EPERM, errno.ENOSYS])
def test_where_the_exchange_is_refused_it_is_os_replace_from_then_on(tmp_path, monkeypatch, refusal):
    """A file system that refuses the flag (NFS: EINVAL), a seccomp filter (EPERM), an old kernel:
    os.replace, and no more tries in this process."""
    assert replace_module.load()
    calls = []

    def refused(*args):
        calls.append(args)
        return -1

    monkeypatch.setattr(replace_module, "_renameat2", refused)
    monkeypatch.setattr(replace_module, "_get_errno", lambda: refusal)
    _write(tmp_path / "job.json", "old")
    for text in ("new", "newer"):
        _write(tmp_path / ".tmp", text)
        replace(str(tmp_path / ".tmp"), str(tmp_path / "job.json"))
        assert (tmp_path / "job.json").read_text() == text
    assert len(calls) == 1 and replace_module._renameat2 is None
    assert sorted(os.listdir(tmp_path)) == ["job.json"]


def test_a_name_with_a_nul_is_refused_before_anything_moves(tmp_path, exchanges):
    _write(tmp_path / "job.json", "old")
    _write(tmp_path / ".tmp", "new")
    with pytest.raises(ValueError, match="null"):
        replace(str(tmp_path / ".tmp") + "\0ignored", str(tmp_path / "job.json"))
    assert exchanges == []
    assert (tmp_path / "job.json").read_text() == "old"


def test_a_failed_exchange_back_is_an_error_and_the_new_file_stays(tmp_path, monkeypatch, exchanges):
    real = replace_module._renameat2
    tries = []

    def second_fails(*args):
        tries.append(args)
        return real(*args) if len(tries) == 1 else -1

    monkeypatch.setattr(replace_module, "_renameat2", second_fails)
    monkeypatch.setattr(replace_module, "_get_errno", lambda: errno.EBUSY)
    (tmp_path / "job.json").mkdir()
    _write(tmp_path / ".tmp", "new")
    with pytest.raises(OSError) as raised:
        replace(str(tmp_path / ".tmp"), str(tmp_path / "job.json"))
    assert raised.value.errno == errno.EBUSY
    assert (tmp_path / "job.json").read_text() == "new"
    assert (tmp_path / ".tmp").is_dir()


def test_readers_see_the_old_summary_or_the_new_never_none(tmp_path, exchanges):
    """Between the exchange and the unlink the name always holds a whole summary."""
    from jupyter_evalsched.runner.results import write_json_atomic

    target = tmp_path / "summary.json"
    write_json_atomic(str(target), {"i": 0}, fsync=False)
    stop = threading.Event()
    seen: list[object] = []

    def writer() -> None:
        for i in range(1, 2000):
            write_json_atomic(str(target), {"i": i, "pad": "x" * (i % 7 * 300)}, fsync=False, exchange=True)
        stop.set()

    thread = threading.Thread(target=writer)
    thread.start()
    while not stop.is_set():
        try:
            seen.append(json.loads(target.read_bytes())["i"])
        except FileNotFoundError:
            seen.append("missing")
    thread.join()
    assert "missing" not in seen
    assert len(exchanges) == 1999
    assert json.loads(target.read_bytes())["i"] == 1999
    assert sorted(os.listdir(tmp_path)) == ["summary.json"]


def test_a_runs_intermediate_summaries_are_exchanged_and_its_final_one_renamed(tmp_path, exchanges):
    """The final summary keeps the file system's write at its rename (old or new after a power
    loss, without fsync too); the server's job.json is not written here at all."""
    from jupyter_evalsched.runner.results import RunFiles

    files = RunFiles(str(tmp_path), "r1", episodes_total=3)
    files.write_initial_summary()
    for index in range(3):
        files.record_episode(index, {"x": float(index)}, "2026-12-05T00:00:00Z", "2026-12-05T00:00:01Z", 0)
    assert exchanges == [RENAME_EXCHANGE] * 2  # after episodes 0 and 1 (the initial one had none to replace)
    files.finalize("succeeded", None)
    assert exchanges == [RENAME_EXCHANGE] * 2
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "succeeded" and summary["episodes_done"] == 3
    assert sorted(os.listdir(tmp_path)) == ["episodes.jsonl", "summary.json"]


def test_a_run_that_fsyncs_renames_every_summary(tmp_path, monkeypatch, exchanges):
    """With ``fsync`` a run fsyncs an intermediate summary once a second at most: the rename over
    the last is what keeps the others whole across a power loss, as it did."""
    from jupyter_evalsched.runner import results
    from jupyter_evalsched.runner.results import RunFiles

    monkeypatch.setattr(results, "DURABLE", True)
    files = RunFiles(str(tmp_path), "r1", episodes_total=4)
    files.write_initial_summary()
    for index in range(4):
        files.record_episode(index, {"x": 1.0}, "2026-12-05T00:00:00Z", "2026-12-05T00:00:01Z", 0)
    files.finalize("succeeded", None)
    assert exchanges == []
    assert json.loads((tmp_path / "summary.json").read_text())["episodes_done"] == 4


def test_a_fresh_interpreter_does_not_import_ctypes_for_it(tmp_path):
    """A cold run (no zygote) replaces its summary with os.replace rather than import ctypes."""
    code = (
        "import sys\n"
        "from jupyter_evalsched.runner.results import write_json_atomic\n"
        f"write_json_atomic({str(tmp_path / 's.json')!r}, {{'a': 1}}, fsync=False, exchange=True)\n"
        f"write_json_atomic({str(tmp_path / 's.json')!r}, {{'a': 2}}, fsync=False, exchange=True)\n"
        "print('ctypes' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
    assert json.loads((tmp_path / "s.json").read_text()) == {"a": 2}
