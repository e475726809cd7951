"""The magics through a real IPython shell, against a real server subprocess."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading

import pytest
from IPython.core.error import UsageError

from jupyter_evalsched.client import SPEC_FLAGS, RunHandle

try:
    from .live_server import SLEEPY, clean_queue, client, ip, live_server, wait_state, wait_until
except ImportError:
    from live_server import SLEEPY, clean_queue, client, ip, live_server, wait_state, wait_until  # noqa: F401


def _spec(handle: RunHandle) -> dict:
    with open(os.path.join(handle.run_dir, "spec.json"), encoding="utf-8") as f:
        return json.load(f)


def test_every_flag_is_documented(ip):
    doc = ip.find_line_magic("eval_submit").__doc__
    for flag_args, _ in SPEC_FLAGS:
        assert flag_args[0] in doc
    assert "--out" in doc and "%%eval_submit" in doc
    assert "--poll" in ip.find_line_magic("eval_queue").__doc__


def test_line_magic_flags_become_the_spec(ip, client, clean_queue, tmp_path):
    dep = ip.run_line_magic("eval_submit", f"{SLEEPY} --episodes 1 --param sleep_s=0.01 --out first")
    assert isinstance(dep, RunHandle) and ip.user_ns["first"] is dep
    wait_state(client, dep.id)
    h = ip.run_line_magic(
        "eval_submit",
        f"{SLEEPY} --name 'my run' --episodes 3 --vram 1000 --gpus 2 --cpus 2 --priority high "
        "--exclusive --depends-on first --param sleep_s=0.01 --param tag=hello "
        "--param cfg='{\"a\": [1, 2]}' --workers 2 --timeout 60 --seed 5 --memory 2048 --preemptible "
        "--retries 2 --retry-on signal --retry-on oom",
    )
    assert isinstance(h, RunHandle)
    spec = _spec(h)
    assert spec["name"] == "my run" and spec["episodes"] == 3 and spec["workers"] == 2
    assert spec["seed"] == 5 and spec["timeout_s"] == 60
    assert spec["params"] == {"sleep_s": 0.01, "tag": "hello", "cfg": {"a": [1, 2]}}
    assert spec["depends_on"] == [dep.id]  # a handle's variable name stands for its id
    assert spec["scheduling"] == {
        "marginal_vram_mb": 1000,
        "gpus": 2,
        "exclusive_gpu": True,
        "priority": "high",
        "cpus": 2,
        "memory_mb": 2048,
        "preemptible": True,
    }
    assert spec["retries"] == 2 and spec["retry_on"] == ["signal", "oom"] and spec["detach"] is False
    assert spec["cwd"] == str(tmp_path)
    final = h.wait(timeout=30, progress=False)
    assert final["state"] == "succeeded" and final["summary"]["episodes_done"] == 3


def test_spec_from_dict_and_files(ip, clean_queue, tmp_path):
    ip.user_ns["base_spec"] = {"entrypoint": SLEEPY, "episodes": 2, "params": {"sleep_s": 0.01, "k": 1}}
    h = ip.run_line_magic("eval_submit", "base_spec --param k=2 --priority low")
    assert _spec(h)["params"] == {"sleep_s": 0.01, "k": 2} and h.record()["priority"] == "low"
    assert ip.user_ns["base_spec"]["params"]["k"] == 1  # not modified

    (tmp_path / "s.json").write_text(json.dumps({"entrypoint": SLEEPY, "name": "from-json"}))
    (tmp_path / "s.yaml").write_text(f"entrypoint: {SLEEPY}\nname: from-yaml\nepisodes: 2\n")
    assert ip.run_line_magic("eval_submit", "s.json").record()["name"] == "from-json"
    hy = ip.run_line_magic("eval_submit", "s.yaml --episodes 1")
    assert hy.record()["name"] == "from-yaml" and _spec(hy)["episodes"] == 1


def test_cell_magic_source_and_underscore(ip, clean_queue):
    cell = (
        "import math\n"
        "def episode(ctx, index):\n"
        "    print('hello from', index)\n"
        "    return {'value': index * ctx.params['k'], 'root': math.sqrt(index)}\n"
    )
    result = ip.run_cell(f"%%eval_submit --episodes 4 --param k=2 --name cellrun\n{cell}", store_history=True)
    assert result.success
    ip.run_cell("h = _", store_history=True)
    h = ip.user_ns["h"]
    assert isinstance(h, RunHandle) and result.result is h
    final = h.wait(timeout=30, progress=False)
    assert final["state"] == "succeeded", final
    assert final["summary"]["metrics"]["value"]["mean"] == pytest.approx((0 + 2 + 4 + 6) / 4)
    with open(os.path.join(h.run_dir, "eval.py"), encoding="utf-8") as f:
        assert f.read() == cell
    assert "hello from 3" in h.logs()
    df = h.episodes()
    assert list(df["value"]) == [0, 2, 4, 6]


def _refusal(ip, magic: str, line: str, cell: str | None = None) -> str:
    """The message of the UsageError a refused magic raises."""
    with pytest.raises(UsageError) as caught:
        if cell is None:
            ip.run_line_magic(magic, line)
        else:
            ip.run_cell_magic(magic, line, cell)
    message = str(caught.value)
    assert "\n" not in message and caught.value.__cause__ is None and caught.value.__suppress_context__, message
    return message


def test_errors_are_one_line_without_traceback(ip, capsys, monkeypatch):
    cases = [
        (
            f"{SLEEPY} --vram -5",
            "eval_submit: 422: scheduling.marginal_vram_mb: Value error, must be between 0 and 16777216 MB, or 'auto'",
        ),
        (f"{SLEEPY} --vram 30000", "eval_submit: 422: "),  # never fits on 24000 MB GPUs
        (f"{SLEEPY} --model nosuchmodel", "eval_submit: 422: "),
        (f"{SLEEPY} --depends-on 00000000T000000.000000-000000", "eval_submit: 422: "),
        ("undefined_name", "eval_submit: 'undefined_name' is neither a spec file"),
        ("missing.yaml", "eval_submit: cannot read spec file missing.yaml"),
        (f"{SLEEPY} --out 1bad", "eval_submit: --out expects a variable name"),
    ]
    for line, expected in cases:
        assert _refusal(ip, "eval_submit", line).startswith(expected), line
        assert capsys.readouterr().err == "", line  # the message is the exception's, printed by IPython

    ip.user_ns["not_a_dict"] = [1, 2]
    assert "is a list, not a dict spec" in _refusal(ip, "eval_submit", "not_a_dict")
    assert "the cell is empty" in _refusal(ip, "eval_submit", "", "   \n")
    assert _refusal(ip, "eval_sweep", f"{SLEEPY} --episodes 2").startswith("eval_sweep: %eval_sweep needs --sweep")
    assert _refusal(ip, "eval_queue", "--out 1bad").startswith("eval_queue: --out expects a variable name")
    assert _refusal(ip, "eval_lease", "30000").startswith("eval_lease: 422: vram_mb: can never fit")
    assert _refusal(ip, "eval_lease", "1000 --out 1bad").startswith("eval_lease: --out expects a variable name")
    assert _refusal(ip, "eval_release", "'unclosed") == "eval_release: cannot split the arguments: No closing quotation"
    assert _refusal(ip, "eval_release", "nope") == "eval_release: 'nope' is not a lease id (lease-...)"

    # In a cell, IPython shows the one line, `UsageError: eval_submit: 422: ...`, with no traceback.
    result = ip.run_cell(f"%eval_submit {SLEEPY} --vram 30000")
    assert isinstance(result.error_in_exec, UsageError)
    out = capsys.readouterr()
    assert out.out == "" and out.err == f"UsageError: {result.error_in_exec}\n", out
    assert out.err.startswith("UsageError: eval_submit: 422: ")

    # Bad flags: IPython's UsageError too, one line and no traceback.
    result = ip.run_cell(f"%eval_submit {SLEEPY} --episodes many")
    assert not result.success and isinstance(result.error_in_exec, UsageError)
    out = capsys.readouterr()
    assert "UsageError" in out.err + out.out and "Traceback" not in out.err + out.out
    # A mistyped flag, or a mistyped choice: what was probably meant.
    for line, hint in (
        (f"{SLEEPY} --priorty 3", "did you mean --priority instead of --priorty?"),
        (f"{SLEEPY} --episods 3 --vram 10", "did you mean --episodes instead of --episods?"),
        (f"{SLEEPY} --priority hihg", "did you mean 'high'?"),
    ):
        result = ip.run_cell(f"%eval_submit {line}")
        out = capsys.readouterr()
        assert not result.success and hint in out.err + out.out, (line, out)

    monkeypatch.setenv("EVALSCHED_URL", "http://127.0.0.1:9/")
    assert _refusal(ip, "eval_submit", SLEEPY).startswith("eval_submit: cannot reach http://127.0.0.1:9/")


def test_a_refused_submission_stops_the_cell(ip, capsys, tmp_path):
    # An eval that never ran, so that --vram auto has nothing to go by, whatever ran before.
    (tmp_path / "never_ran.py").write_text("def episode(ctx, index):\n    return {}\n")
    for name in ("h5", "after"):
        ip.user_ns.pop(name, None)
    result = ip.run_cell(
        f"h5 = %eval_submit {tmp_path / 'never_ran.py'}:episode --episodes 3 --vram auto\nh5.wait()\nafter = True\n"
    )
    # Before: the magic printed a line and returned None, and `h5.wait()` failed with
    # AttributeError: 'NoneType' object has no attribute 'wait'.
    assert isinstance(result.error_in_exec, UsageError), result.error_in_exec
    message = str(result.error_in_exec)
    assert message.startswith("eval_submit: 422: scheduling.marginal_vram_mb: 'auto' needs an earlier succeeded run")
    assert "h5" not in ip.user_ns and "after" not in ip.user_ns  # nothing after the magic ran
    out = capsys.readouterr()
    assert out.out == "" and out.err == f"UsageError: {message}\n", out

    # And user code can still catch it.
    result = ip.run_cell(
        "from IPython.core.error import UsageError\n"
        "try:\n"
        f"    h5 = %eval_submit {SLEEPY} --vram 30000\n"
        "except UsageError as e:\n"
        "    caught = str(e)\n"
    )
    assert result.success and ip.user_ns["caught"].startswith("eval_submit: 422: ") and "h5" not in ip.user_ns


def test_an_interrupted_eval_lease_stops_the_cell_and_withdraws(ip, client, clean_queue, capsys, monkeypatch):
    for name in ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER"):  # put back as they were afterwards
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    blocker = client.request("POST", "leases", body={"exclusive_gpu": True, "gpus": 2, "label": "blocker"})
    main = threading.get_ident()

    def waiting_for_the_grant() -> bool:
        frame = sys._current_frames().get(main)
        while frame is not None and frame.f_code.co_name != "_wait_for_grant":
            frame = frame.f_back
        return frame is not None

    def interrupt_once_waiting():  # Ctrl-C, as the kernel's interrupt sends it, once lease() waits
        wait_until(waiting_for_the_grant, timeout=60, message="the lease never waited")
        signal.pthread_kill(main, signal.SIGINT)

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    interrupter = threading.Thread(target=interrupt_once_waiting)
    ip.user_ns.pop("L", None)
    ip.user_ns.pop("after", None)
    interrupter.start()
    try:
        result = ip.run_cell("L = %eval_lease 1000 --label interrupted --timeout 120\nafter = True\n")
    finally:
        interrupter.join()
        signal.signal(signal.SIGINT, previous)
    assert isinstance(result.error_in_exec, UsageError), result.error_in_exec
    assert str(result.error_in_exec) == "eval_lease: stopped waiting; the request was withdrawn"
    assert "L" not in ip.user_ns and "after" not in ip.user_ns
    err = capsys.readouterr().err  # the waiting reason, then the one line
    assert err.splitlines()[-1] == "UsageError: eval_lease: stopped waiting; the request was withdrawn", err
    assert "Traceback" not in err, err
    assert [x["id"] for x in client.request("GET", "leases")["leases"]] == [blocker["id"]]


def test_eval_release_releases_the_others_then_stops_the_cell(ip, client, clean_queue, capsys, monkeypatch):
    for name in ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER"):  # put back as they were afterwards
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    held = ip.run_line_magic("eval_lease", "1000 --label release-me")
    capsys.readouterr()
    message = _refusal(ip, "eval_release", f"lease-nosuch {held.id}")
    assert message.startswith("eval_release: 404: no lease with id 'lease-nosuch'") and held.id not in message, message
    assert capsys.readouterr().out == f"lease {held.id}: released\n"
    assert held.refresh()["state"] == "ended"


def test_handle_methods(ip, capsys, clean_queue):
    h = ip.run_line_magic("eval_submit", f"{SLEEPY} --episodes 3 --param sleep_s=0.05 --seed 9")
    assert h.status() in ("queued", "running", "succeeded")
    assert h.record()["id"] == h.id
    final = h.wait(timeout=30)  # with the text progress bar (no kernel here)
    assert final["state"] == "succeeded"
    # A cell's last line `h.wait()` shows one line under the progress bar, not the whole record;
    # the record is a dict all the same.
    from IPython.lib.pretty import pretty

    shown = pretty(final)
    assert "\n" not in shown and len(shown) < 300 and "'state': 'succeeded'" in shown and h.id in shown, shown
    assert isinstance(final, dict) and json.loads(json.dumps(final))["summary"]["episodes_done"] == 3
    assert "summary" in repr(dict(final))
    err = capsys.readouterr().err
    assert "3/3" in err and "succeeded" in err and "score=" in err
    assert h.summary()["metrics"]["score"]["count"] == 3
    assert len(h.episodes()) == 3
    assert isinstance(h.logs(), str) and isinstance(h.logs("stderr", tail=2), str)
    assert os.path.isdir(h.run_dir)

    long = ip.run_line_magic("eval_submit", f"{SLEEPY} --episodes 1 --param sleep_s=30")
    assert long.cancel()["state"] in ("running", "cancelled")
    assert long.wait(timeout=20, progress=False)["state"] == "cancelled"


def test_eval_queue_widget(ip, capsys):
    ip.run_line_magic("eval_queue", "--out qw --poll")
    widget = ip.user_ns["qw"]
    try:
        assert widget.mode in ("starting", "polling")
        assert widget.queue_view["ledger"]["devices"][0]["usable_mb"] == 24000
    finally:
        widget.close()
    assert not widget._feed.alive


def test_magic_detach_flag(ip, live_server, clean_queue):
    handle = ip.run_line_magic("eval_submit", "jupyter_evalsched.examples.basic:noop --detach --retries 1")
    rec = handle.wait(timeout=30, progress=False)
    assert rec["state"] == "succeeded" and rec["detach"] is True and rec["retries"] == 1
