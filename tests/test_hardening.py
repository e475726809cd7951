"""Issue #7, fast part: runs that die, hostile input, the runs directory's boundaries, disk trouble.

Every test asserts what it claims with counts, processes and files; a test that finds a bug in the
package stays here and fails until the bug is fixed. The slow parts (server kills, load, fuzzing)
are in ``test_stress.py``.

Tests are plain ``async def`` (no asyncio mark): pytest-jupyter runs them on the server's loop.
"""

from __future__ import annotations

import asyncio
import errno
import json
import os
import stat
import subprocess
import threading
from pathlib import Path

import pytest
from proc_status import alive, ignores_signal
from rest import CRASH, NOOP, SLEEPY, spec, submit
from run_dirs import write_run_dir
from waiting import async_wait_until

# Evals that damage their own run directory or run out of (capped) memory. Written to a file in
# tmp_path and used as a file entrypoint ("vandal.py:<function>") with that directory as cwd.
VANDAL_SOURCE = r'''
import os, time

def _summary(ctx):
    return os.path.join(ctx.run_dir, "summary.json")

def delete_summary(ctx, index):
    try:
        os.remove(_summary(ctx))
    except FileNotFoundError:
        pass
    time.sleep(0.02)  # the eval's own work, while the summary is missing
    return {"x": index}

def garble_summary(ctx, index):
    with open(_summary(ctx), "wb") as f:
        f.write(b"\x00{garbage \xff\xfe not json")
    time.sleep(0.05)  # the eval's own work, while the garbage is there for the server's progress watcher
    return {"x": index}

def garble_then_exit(ctx, index):
    with open(_summary(ctx), "wb") as f:
        f.write(b"{\"status\": \"succeeded\", ")
    os._exit(0)

def summary_becomes_directory(ctx, index):
    os.remove(_summary(ctx))
    os.mkdir(_summary(ctx))
    os.mkdir(os.path.join(_summary(ctx), "inner"))  # a non-empty directory: os.replace cannot take its place
    return {"x": index}

def summary_symlink_then_exit(ctx, index):
    os.remove(_summary(ctx))
    os.symlink(ctx.params["target"], _summary(ctx))
    os._exit(0)

def escape_and_exit(ctx, index):
    """Fork a child that leaves the run's process group and session (setsid), then return."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.setsid()
        os.write(w, b"x")
        time.sleep(300)
        os._exit(0)
    os.read(r, 1)  # the child has left the group before the run ends
    return {"child_pid": pid}

def capped_oom(ctx, index):
    import resource
    limit = 400 * 1024 * 1024
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    hog = []
    while True:  # a real allocation loop that hits the cap: MemoryError, not the kernel's OOM killer
        hog.append(bytearray(16 * 1024 * 1024))
'''


@pytest.fixture
def evalsched_config():
    return {"cpu_slots": 16}


def only_run_dirs(runs_dir: Path) -> list[str]:
    """Names in the runs directory that are neither run directories nor the server's own files
    (its advertisement, the model hosts' logs): should be none."""
    from jupyter_evalsched.primary import INFO_NAME
    from jupyter_evalsched.schemas import is_valid_run_id
    from jupyter_evalsched.store import MODEL_LOGS_DIR

    return sorted(
        p.name
        for p in runs_dir.iterdir()
        if p.name not in (INFO_NAME, MODEL_LOGS_DIR)
        and not (p.is_dir() and not p.is_symlink() and is_valid_run_id(p.name))
    )


def run_dir_names(runs_dir: Path) -> list[str]:
    return sorted(p.name for p in runs_dir.iterdir() if not p.name.startswith("."))


@pytest.fixture
def raw_fetch(jp_serverapp, evalsched, http_server_client, jp_auth_header, jp_base_url):
    """A request with the path sent exactly as given (no escaping): ``(code, text)``."""

    async def fetch(method: str, path: str, body=None, headers=None):
        hdrs = dict(jp_auth_header)
        hdrs.update(headers or {})
        if body is None and method in ("POST", "PUT", "PATCH"):
            body = b""
        resp = await http_server_client.fetch(
            jp_base_url.rstrip("/") + "/evalsched/" + path,
            method=method,
            body=body,
            headers=hdrs,
            raise_error=False,
            request_timeout=20,
            allow_nonstandard_methods=True,
        )
        return resp.code, (resp.body or b"").decode("utf-8", "replace")

    return fetch


# ----------------------------------------------------------------------------- runs that die


async def test_a_mixed_batch_of_dying_runs_leaves_server_and_siblings_untouched(
    api, wait_for, runs_dir, tmp_path, evalsched
):
    """Fifteen runs that die or vandalise their own files, submitted concurrently with four
    well-behaved siblings: each bad run ends with the right state and reason, every sibling
    succeeds with all its episodes, no process outlives its run, the server keeps answering."""
    evaldir = tmp_path / "evals"
    evaldir.mkdir()
    (evaldir / "vandal.py").write_text(VANDAL_SOURCE)
    secret = tmp_path / "outside-summary.json"
    secret.write_text(json.dumps({"status": "succeeded", "episodes_done": 99, "secret": "TOPSECRET"}))

    def crash(how, **params):
        return spec(entry=CRASH, params={"how": how, **params})

    def vandal(fn, episodes=1, **params):
        return spec(entry=f"vandal.py:{fn}", episodes=episodes, cwd=str(evaldir), params=params)

    # name -> (spec, expected state, expected reason prefix or None)
    bad = {
        "exception": (crash("exception"), "failed", "exception: RuntimeError"),
        "memoryerror": (crash("memoryerror"), "failed", "exception: MemoryError"),
        "capped_oom": (vandal("capped_oom"), "failed", "exception: MemoryError"),
        "sys_exit": (crash("sys_exit", code=5), "failed", "exception: SystemExit"),
        "os_exit": (crash("exit", code=3), "failed", "exit_code:3"),
        "segfault": (crash("segfault"), "failed", "signal:SIGSEGV"),
        "sigkill": (crash("sigkill"), "failed", "signal:SIGKILL"),
        "ignore_sigterm": (crash("ignore_sigterm"), "cancelled", "cancelled"),
        "fork_and_exit": (crash("fork_and_exit"), "succeeded", None),
        "escape_and_exit": (vandal("escape_and_exit"), "succeeded", None),
        "delete_summary": (vandal("delete_summary", episodes=4), "succeeded", None),
        "garble_summary": (vandal("garble_summary", episodes=4), "succeeded", None),
        "garble_then_exit": (vandal("garble_then_exit"), "failed", "exit_code:0"),
        "summary_dir": (vandal("summary_becomes_directory"), "failed", "run_file: summary.json is a directory"),
        "summary_symlink": (
            vandal("summary_symlink_then_exit", target=str(secret)),
            "failed",
            "run_file: summary.json is a symbolic link",
        ),
    }
    siblings_spec = [spec(episodes=6, sleep_s=0.1, scheduling={"marginal_vram_mb": v}) for v in (0, 4000, 8000, 0)]

    # Submit everything at once, interleaved: siblings before, among and after the bad runs.
    names = list(bad)
    bodies = (
        [siblings_spec[0]]
        + [bad[n][0] for n in names[:7]]
        + [siblings_spec[1], siblings_spec[2]]
        + [bad[n][0] for n in names[7:]]
        + [siblings_spec[3]]
    )
    recs = await asyncio.gather(*(submit(api, b) for b in bodies))
    sib_recs = [recs[0], recs[8], recs[9], recs[-1]]
    bad_recs = dict(zip(names, recs[1:8] + recs[10:-1], strict=False))
    assert len({r["id"] for r in recs}) == len(bodies) == 19

    # The run that ignores SIGTERM: cancel it once it ignores SIGTERM (the kernel says so).
    ign = bad_recs["ignore_sigterm"]["id"]
    ign_pid = (await wait_for(ign, states=("running",)))["pid"]
    assert ign_pid, "a running run without a pid"
    await async_wait_until(lambda: ignores_signal(ign_pid), message=f"run {ign} (pid {ign_pid}) never ignored SIGTERM")
    code, _ = await api("POST", f"runs/{ign}/cancel")
    assert code == 200

    finals = {n: await wait_for(r["id"], timeout=60) for n, r in bad_recs.items()}
    sib_finals = [await wait_for(r["id"], timeout=60) for r in sib_recs]

    problems = []
    for n, (_, state, reason) in bad.items():
        got = finals[n]
        if got["state"] != state or (reason is not None and not (got["reason"] or "").startswith(reason)):
            problems.append(f"{n}: expected {state} {reason!r}, got {got['state']} {got['reason']!r}")
        if reason is None and got["reason"] is not None:
            problems.append(f"{n}: a succeeded run has reason {got['reason']!r}")
    assert not problems, "\n".join(problems)

    # Siblings never noticed: every one succeeded with all 6 episodes, each line once.
    for r in sib_finals:
        assert r["state"] == "succeeded" and r["progress"] == {"done": 6, "total": 6}, r
        lines = (runs_dir / r["id"] / "episodes.jsonl").read_text().splitlines()
        assert sorted(json.loads(x)["index"] for x in lines) == list(range(6))

    # The vandals: the runner rewrote its own summary after the damage; the garbage and the
    # planted symlink were never served as a summary (the outside file's content never leaks).
    for n in ("delete_summary", "garble_summary"):
        assert finals[n]["summary"]["status"] == "succeeded" and finals[n]["progress"] == {"done": 4, "total": 4}, (
            finals[n]
        )
    assert finals["garble_then_exit"]["summary"] is None
    assert finals["summary_symlink"]["summary"] is None
    assert "TOPSECRET" not in json.dumps(finals["summary_symlink"])
    assert (runs_dir / bad_recs["summary_symlink"]["id"] / "summary.json").is_symlink()  # left as the eval made it
    assert json.loads(secret.read_text())["secret"] == "TOPSECRET"  # and the target is untouched

    # No process outlives its run: every run's pid is gone, and so is the forked stray child.
    orphans = []
    for n in ("fork_and_exit", "escape_and_exit"):
        code, eps = await api("GET", f"runs/{bad_recs[n]['id']}/episodes")
        child = int(eps["episodes"][0]["metrics"]["child_pid"])
        try:
            await async_wait_until(lambda: not alive(child), timeout=2)
        except AssertionError:
            orphans.append(f"{n}: the child {child} forked by the finished run is still alive")
            os.kill(child, 9)  # this test's own cleanup
    assert not orphans, orphans
    for r in list(finals.values()) + sib_finals:
        assert not alive(r["pid"]), f"run {r['id']} ({r['name']}) pid {r['pid']} still alive"

    # Every terminal run directory has _DONE; the server still answers and holds nothing.
    for r in list(finals.values()) + sib_finals:
        assert (runs_dir / r["id"] / "_DONE").exists(), r["id"]
    code, queue = await api("GET", "queue")
    assert code == 200 and queue["queued"] == [] and queue["running"] == []
    assert (
        all(d["allocated_mb"] == 0 for d in queue["ledger"]["devices"])
        and queue["ledger"]["cpu_slots"]["allocated"] == 0
    )
    code, listing = await api("GET", "runs", params={"limit": 1000})
    assert code == 200 and listing["total"] == 19
    counts = evalsched.counts
    assert (counts["queued"], counts["running"], counts["total"]) == (0, 0, 19), counts


# ----------------------------------------------------------------------------- hostile input


def _deep(n: int) -> str:
    return '{"entrypoint": "a:b", "params": {"x": ' + "[" * n + "]" * n + "}}"


HOSTILE_BODIES = [
    # (label, raw body, expected status)
    ("not json", b"{nope", 400),
    ("invalid utf-8", b'{"entrypoint": "\xff\xfe"}', 400),
    ("empty body", b"", 400),
    ("a list", b"[]", 422),
    ("a string", b'"x"', 422),
    ("null", b"null", 422),
    ("deep json 100000", _deep(100_000).encode(), 400),
    ("deep params 200", _deep(200).encode(), 422),
    ("NaN episodes", b'{"entrypoint": "a:b", "episodes": NaN}', 400),
    ("Infinity vram", b'{"entrypoint": "a:b", "scheduling": {"marginal_vram_mb": Infinity}}', 400),
    ("NaN in params", b'{"entrypoint": "a:b", "params": {"x": NaN}}', 400),
    ("huge float in params", b'{"entrypoint": "a:b", "params": {"x": 1e999}}', 422),
]

HOSTILE_SPECS = [
    # (label, spec, expected status)
    ("missing entrypoint", {}, 422),
    ("negative vram", {"entrypoint": NOOP, "scheduling": {"marginal_vram_mb": -1}}, 422),
    ("huge vram", {"entrypoint": NOOP, "scheduling": {"marginal_vram_mb": 10**30}}, 422),
    ("vram larger than any gpu", {"entrypoint": NOOP, "scheduling": {"marginal_vram_mb": 24001}}, 422),
    ("float vram", {"entrypoint": NOOP, "scheduling": {"marginal_vram_mb": 1.5}}, 422),
    ("negative episodes", {"entrypoint": NOOP, "episodes": -1}, 422),
    ("huge episodes", {"entrypoint": NOOP, "episodes": 10**40}, 422),
    ("episodes a string", {"entrypoint": NOOP, "episodes": "many"}, 422),
    ("episodes a list", {"entrypoint": NOOP, "episodes": [1]}, 422),
    # Strict types: nothing is coerced (a boolean is not a number, a numeric string is not a number).
    ("episodes true", {"entrypoint": NOOP, "episodes": True}, 422),
    ("episodes 2.0", {"entrypoint": NOOP, "episodes": 2.0}, 422),
    ("vram a numeric string", {"entrypoint": NOOP, "scheduling": {"marginal_vram_mb": "100"}}, 422),
    ("vram true", {"entrypoint": NOOP, "scheduling": {"marginal_vram_mb": True}}, 422),
    ("timeout true", {"entrypoint": NOOP, "timeout_s": True}, 422),
    ("timeout a numeric string", {"entrypoint": NOOP, "timeout_s": "10"}, 422),
    ("exclusive 1", {"entrypoint": NOOP, "scheduling": {"exclusive_gpu": 1}}, 422),
    ("exclusive 'true'", {"entrypoint": NOOP, "scheduling": {"exclusive_gpu": "true"}}, 422),
    ("gpus true", {"entrypoint": NOOP, "scheduling": {"marginal_vram_mb": 1, "gpus": True}}, 422),
    ("cpus a numeric string", {"entrypoint": NOOP, "scheduling": {"cpus": "1"}}, 422),
    ("workers false", {"entrypoint": NOOP, "workers": False}, 422),
    ("seed a numeric string", {"entrypoint": NOOP, "seed": "7"}, 422),
    ("env value a number", {"entrypoint": NOOP, "env": {"A": 1}}, 422),
    ("params over 1,000,000 characters", {"entrypoint": NOOP, "params": {"x": "y" * 1_000_001}}, 422),
    ("too many gpus", {"entrypoint": NOOP, "scheduling": {"marginal_vram_mb": 1, "gpus": 3}}, 422),
    ("zero gpus", {"entrypoint": NOOP, "scheduling": {"gpus": 0}}, 422),
    ("too many cpus", {"entrypoint": NOOP, "scheduling": {"cpus": 17}}, 422),
    ("negative cpus", {"entrypoint": NOOP, "scheduling": {"cpus": -1}}, 422),
    ("priority unknown", {"entrypoint": NOOP, "scheduling": {"priority": "urgent"}}, 422),
    ("scheduling a string", {"entrypoint": NOOP, "scheduling": "fast"}, 422),
    ("exclusive a dict", {"entrypoint": NOOP, "scheduling": {"exclusive_gpu": {}}}, 422),
    ("unknown field", {"entrypoint": NOOP, "rm": "-rf /"}, 422),
    ("name an int", {"entrypoint": NOOP, "name": 5}, 422),
    ("name with NUL", {"entrypoint": NOOP, "name": "a\x00b"}, 422),
    ("name blank", {"entrypoint": NOOP, "name": "   "}, 422),
    ("name too long", {"entrypoint": NOOP, "name": "x" * 10_000}, 422),
    ("entrypoint without function", {"entrypoint": "os.path"}, 422),
    ("entrypoint with NUL", {"entrypoint": "a\x00b:c"}, 422),
    ("entrypoint an int", {"entrypoint": 7}, 422),
    ("entrypoint file missing", {"entrypoint": "no_such_file.py:episode"}, 422),
    ("entrypoint absolute file missing", {"entrypoint": "/no/such/file.py:episode"}, 422),
    ("entrypoint escaping file missing", {"entrypoint": "../../../../no/such.py:episode"}, 422),
    ("params a list", {"entrypoint": NOOP, "params": [1, 2]}, 422),
    ("params a string", {"entrypoint": NOOP, "params": "x=1"}, 422),
    ("env value an int", {"entrypoint": NOOP, "env": {"A": 1}}, 422),
    ("env name with =", {"entrypoint": NOOP, "env": {"A=B": "1"}}, 422),
    ("env value with NUL", {"entrypoint": NOOP, "env": {"A": "x\x00y"}}, 422),
    ("env a list", {"entrypoint": NOOP, "env": ["A=1"]}, 422),
    ("cwd not a directory", {"entrypoint": NOOP, "cwd": "/etc/hostname"}, 422),
    ("cwd missing", {"entrypoint": NOOP, "cwd": "/no/such/dir"}, 422),
    ("cwd with NUL", {"entrypoint": NOOP, "cwd": "/tmp\x00/x"}, 422),
    ("cwd an int", {"entrypoint": NOOP, "cwd": 0}, 422),
    ("timeout negative", {"entrypoint": NOOP, "timeout_s": -5}, 422),
    ("timeout zero", {"entrypoint": NOOP, "timeout_s": 0}, 422),
    ("timeout huge", {"entrypoint": NOOP, "timeout_s": 1e300}, 422),
    ("seed huge", {"entrypoint": NOOP, "seed": 2**70}, 422),
    ("workers zero", {"entrypoint": NOOP, "workers": 0}, 422),
    ("workers huge", {"entrypoint": NOOP, "workers": 10**6}, 422),
    ("depends_on path", {"entrypoint": NOOP, "depends_on": ["../etc"]}, 422),
    ("depends_on absolute", {"entrypoint": NOOP, "depends_on": ["/etc/passwd"]}, 422),
    ("depends_on unknown", {"entrypoint": NOOP, "depends_on": ["20200101T000000.000000-abcdef"]}, 422),
    ("depends_on a string", {"entrypoint": NOOP, "depends_on": "x"}, 422),
    ("models unknown", {"entrypoint": NOOP, "models": ["gpt-17"]}, 422),
    ("models path", {"entrypoint": NOOP, "models": ["../x"]}, 422),
    ("source an int", {"source": 3}, 422),
    ("source with a foreign entrypoint", {"source": "def episode(ctx, i): return {}", "entrypoint": "os:getcwd"}, 422),
]


async def test_hostile_bodies_get_a_clear_4xx(api, runs_dir, tmp_path):
    failures = []
    for label, body, expected in HOSTILE_BODIES + [(lbl, json.dumps(s).encode(), e) for lbl, s, e in HOSTILE_SPECS]:
        code, text = await api("POST", "runs", body, raw=True)
        try:
            err = json.loads(text)
        except ValueError:
            err = None
        if code != expected or not isinstance(err, dict) or not err.get("message"):
            failures.append(f"{label}: expected {expected} with a JSON message, got {code} {text[:200]!r}")
        elif expected == 422 and label not in ("a list", "a string", "null") and not err.get("detail"):
            failures.append(f"{label}: a 422 without field errors: {text[:200]!r}")
    assert not failures, "\n".join(failures)
    code, listing = await api("GET", "runs")
    assert listing["total"] == 0, "a hostile submission was accepted"
    assert only_run_dirs(runs_dir) == [] and run_dir_names(runs_dir) == []


async def test_huge_body_is_413(api, runs_dir):
    big = {"entrypoint": NOOP, "params": {"blob": "x" * (4 * 1024 * 1024 + 10)}}
    code, err = await api("POST", "runs", big)
    assert code == 413 and "bytes" in err["message"], (code, err)
    code, listing = await api("GET", "runs")
    assert listing["total"] == 0 and only_run_dirs(runs_dir) == []


async def test_odd_but_valid_input_is_accepted_or_fails_with_a_reason(api, wait_for, runs_dir, tmp_path):
    """Unicode and path-like names are labels, never paths; a module that does not exist is a
    failed run with a reason; nothing appears outside the run directories."""
    names = ["ünïcødé 🚀 評価", "../../etc/passwd", "/etc/shadow", "%2e%2e%2f", "..", "C:\\Windows\\x", "a/b/c"]
    recs = [await submit(api, spec(entry=NOOP, name=n)) for n in names]
    assert [r["name"] for r in recs] == names
    missing = await submit(api, spec(entry="no_such_module_xyz.sub:episode"))
    bad_func = await submit(api, spec(entry="jupyter_evalsched.examples.basic:no_such_function"))
    finals = [await wait_for(r["id"]) for r in recs]
    assert all(f["state"] == "succeeded" for f in finals), [(f["name"], f["state"], f["reason"]) for f in finals]
    m = await wait_for(missing["id"])
    assert (
        m["state"] == "failed"
        and m["reason"].startswith("exception: ModuleNotFoundError")
        and "no_such_module_xyz" in m["reason"]
    ), m
    b = await wait_for(bad_func["id"])
    assert b["state"] == "failed" and b["reason"].startswith("exception:") and "no_such_function" in b["reason"], b
    assert only_run_dirs(runs_dir) == []
    assert run_dir_names(runs_dir) == sorted(r["id"] for r in recs + [missing, bad_func])
    for r in recs:
        assert set(os.listdir(runs_dir / r["id"])) <= {
            "spec.json",
            "shared_urls.json",
            "job.json",
            "summary.json",
            "episodes.jsonl",
            "stdout.log",
            "stderr.log",
            "_DONE",
        }


BAD_IDS = [
    "..",
    "%2e%2e",
    "%2E%2E",
    ".",
    "..%2Fetc",
    "%2e%2e%2fetc%2fpasswd",
    "%2Fetc%2Fpasswd",
    "%00",
    "x%00y",
    "%2e%2e%2f%2e%2e%2f%2e%2e%2fetc",
    "..%5c..%5cetc",
    "%25%32%65%25%32%65",
    "a" * 300,
    "%F0%9F%9A%80",
    "spec.json",
    "job.json",
    "_DONE",
    "%20..",
    "...",
    "-",
    "a%2Fb",
]
# Not UTF-8 once percent-decoded: tornado refuses them with a 400 before any handler code runs.
NON_UTF8_IDS = ["%C0%AE%C0%AE", "%FF", "%FF%2F..%2Fetc"]


async def test_path_like_run_ids_are_404_on_every_endpoint(raw_fetch, api, runs_dir, tmp_path):
    victim = await submit(api, spec(entry=SLEEPY, episodes=100, sleep_s=0.1))
    failures = []
    for bad in BAD_IDS:
        for method, suffix in (
            ("GET", ""),
            ("DELETE", ""),
            ("POST", "/cancel"),
            ("GET", "/logs"),
            ("GET", "/logs?stream=stderr&tail=5"),
            ("GET", "/episodes"),
        ):
            code, text = await raw_fetch(method, f"runs/{bad}{suffix}")
            if code != 404:
                failures.append(f"{method} runs/{bad}{suffix}: {code} {text[:120]!r}")
            if "root:" in text or "TOPSECRET" in text:
                failures.append(f"{method} runs/{bad}{suffix}: leaked file content")
    for bad in NON_UTF8_IDS:
        for method, suffix in (
            ("GET", ""),
            ("DELETE", ""),
            ("POST", "/cancel"),
            ("GET", "/logs"),
            ("GET", "/episodes"),
        ):
            code, text = await raw_fetch(method, f"runs/{bad}{suffix}")
            if code not in (400, 404) or "message" not in json.loads(text or "{}"):
                failures.append(f"{method} runs/{bad}{suffix}: {code} {text[:120]!r}")
    # Traversal through the victim's id (a run addressing another run's files) is refused too.
    vid = victim["id"]
    for path in (
        f"runs/{vid}%2F..%2F{vid}/cancel",
        f"runs/x%2F..%2F{vid}/cancel",
        f"runs/{vid}%2fspec.json",
        f"runs/{vid}/..%2F{vid}/cancel",
    ):
        code, text = await raw_fetch("POST" if path.endswith("cancel") else "GET", path)
        if code != 404:
            failures.append(f"{path}: {code} {text[:120]!r}")
    assert not failures, "\n".join(failures)
    code, rec = await api("GET", f"runs/{vid}")
    assert rec["state"] in ("queued", "running"), "a request through a forged id reached the victim"
    code, rec = await api("POST", f"runs/{vid}/cancel")
    assert code == 200
    assert only_run_dirs(runs_dir) == []


async def test_bad_query_parameters_are_400(raw_fetch, api):
    rec = await submit(api, spec(entry=NOOP))
    rid = rec["id"]
    cases = [
        "runs?limit=-1",
        "runs?limit=0",
        "runs?limit=abc",
        "runs?limit=1e3",
        "runs?limit=100001",
        "runs?limit=99999999999999999999999",
        "runs?state=bogus",
        "runs?state=queued,..%2Fetc",
        f"runs/{rid}/logs?stream=/etc/passwd",
        f"runs/{rid}/logs?stream=..%2Fstdout",
        f"runs/{rid}/logs?tail=-1",
        f"runs/{rid}/logs?tail=x",
        f"runs/{rid}/logs?tail=10000000000",
    ]
    failures = []
    for path in cases:
        code, text = await raw_fetch("GET", path)
        if code != 400 or "message" not in json.loads(text or "{}"):
            failures.append(f"{path}: {code} {text[:120]!r}")
    assert not failures, "\n".join(failures)


async def test_wrong_methods_and_content_types_are_not_500(raw_fetch, api):
    rec = await submit(api, spec(entry=NOOP))
    rid = rec["id"]
    failures = []
    for method, path in (
        ("PUT", "runs"),
        ("PATCH", f"runs/{rid}"),
        ("DELETE", "queue"),
        ("POST", "ledger"),
        ("POST", "queue"),
        ("GET", f"runs/{rid}/cancel"),
        ("DELETE", "runs"),
        ("POST", "openapi.json"),
    ):
        code, text = await raw_fetch(method, path, body=b"{}" if method in ("PUT", "PATCH", "POST") else None)
        if not 400 <= code < 500:
            failures.append(f"{method} {path}: {code}")
    code, text = await raw_fetch(
        "POST",
        "runs",
        body=json.dumps(spec(entry=NOOP)).encode(),
        headers={"Content-Type": "text/plain; charset=latin-1"},
    )
    if code not in (201, 400, 415, 422):
        failures.append(f"POST runs as text/plain: {code} {text[:120]!r}")
    assert not failures, "\n".join(failures)


# ----------------------------------------------------------------------------- the runs directory's boundaries


async def test_symlinks_planted_in_a_run_directory_are_never_followed(api, wait_for, runs_dir, tmp_path):
    """stdout.log -> /etc/passwd, stderr.log and episodes.jsonl and summary.json -> files outside:
    the logs, episodes and summary endpoints serve none of their content and never a 500.
    DELETE removes the links and the run directory, and nothing outside it."""
    rec = await submit(api, spec(entry=SLEEPY, episodes=2, sleep_s=0.01))
    final = await wait_for(rec["id"])
    assert final["state"] == "succeeded"
    run = runs_dir / rec["id"]
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.log").write_text("TOPSECRET line\n" * 5)
    (outside / "secret.jsonl").write_text(json.dumps({"index": 0, "metrics": {"TOPSECRET": 1}}) + "\n")
    (outside / "summary.json").write_text(json.dumps({"status": "succeeded", "TOPSECRET": True}))
    (outside / "keep" / "deep").mkdir(parents=True)
    (outside / "keep" / "deep" / "file").write_text("must survive")
    for name, target in (
        ("stdout.log", "/etc/passwd"),
        ("stderr.log", outside / "secret.log"),
        ("episodes.jsonl", outside / "secret.jsonl"),
        ("summary.json", outside / "summary.json"),
    ):
        (run / name).unlink()
        os.symlink(target, run / name)
    os.symlink(outside / "keep", run / "linked-dir")
    os.symlink(outside, run / "linked-outside")

    failures = []
    for path, params in (
        ("logs", {}),
        ("logs", {"stream": "stderr"}),
        ("logs", {"tail": "3"}),
        ("logs", {"stream": "stderr", "tail": "2"}),
        ("episodes", {}),
        ("", {}),
    ):
        code, text = await api("GET", f"runs/{rec['id']}/{path}".rstrip("/"), params=params or None, raw=True)
        if code >= 500:
            failures.append(f"GET {path or 'record'} {params}: {code} {text[:200]!r}")
        if "root:" in text or "TOPSECRET" in text:
            failures.append(f"GET {path or 'record'} {params}: served the content behind a symlink")
    assert not failures, "\n".join(failures)
    code, detail = await api("GET", f"runs/{rec['id']}")
    assert code == 200 and detail["summary"] is None

    code, _ = await api("DELETE", f"runs/{rec['id']}")
    assert code == 204
    assert not run.exists() and not os.path.lexists(run)
    assert (outside / "keep" / "deep" / "file").read_text() == "must survive"
    assert sorted(p.name for p in outside.iterdir()) == ["keep", "secret.jsonl", "secret.log", "summary.json"]
    assert Path("/etc/passwd").exists()
    assert only_run_dirs(runs_dir) == []


async def test_run_directory_planted_as_a_symlink_is_not_served(api, wait_for, runs_dir, tmp_path, evalsched):
    """A run's directory replaced by a symlink to elsewhere while the server runs: its files are
    not read through the link, and DELETE removes the link only."""
    rec = await submit(api, spec(entry=NOOP))
    await wait_for(rec["id"])
    run = runs_dir / rec["id"]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "stdout.log").write_text("TOPSECRET\n")
    (elsewhere / "summary.json").write_text(json.dumps({"TOPSECRET": 1}))
    (elsewhere / "episodes.jsonl").write_text(json.dumps({"TOPSECRET": 1}) + "\n")
    import shutil

    shutil.rmtree(run)
    os.symlink(elsewhere, run)
    for path in ("", "/logs", "/episodes"):
        code, text = await api("GET", f"runs/{rec['id']}{path}", raw=True)
        assert code < 500 and "TOPSECRET" not in text, (path, code, text[:200])
    code, _ = await api("DELETE", f"runs/{rec['id']}")
    assert code in (204, 404, 409, 503)
    assert sorted(p.name for p in elsewhere.iterdir()) == ["episodes.jsonl", "stdout.log", "summary.json"]


async def test_modes_are_owner_only(api, wait_for, runs_dir):
    """The runs directory and run directories are 0700, every file in a run directory 0600."""
    recs = [
        await submit(api, spec(entry=SLEEPY, episodes=2, sleep_s=0.01)),
        await submit(
            api, {"source": "def episode(ctx, index):\n    print('hi')\n    return {'v': index}\n", "episodes": 2}
        ),
        await submit(api, spec(entry=CRASH, params={"how": "exit"})),
    ]
    for r in recs:
        await wait_for(r["id"])
    assert stat.S_IMODE(os.stat(runs_dir).st_mode) == 0o700
    wrong = []
    for r in recs:
        d = runs_dir / r["id"]
        if stat.S_IMODE(os.lstat(d).st_mode) != 0o700:
            wrong.append(f"{d.name}: {oct(stat.S_IMODE(os.lstat(d).st_mode))}")
        names = os.listdir(d)
        assert {"spec.json", "job.json", "stdout.log", "stderr.log", "_DONE"} <= set(names)
        for name in names:
            mode = stat.S_IMODE(os.lstat(d / name).st_mode)
            if mode != 0o600:
                wrong.append(f"{d.name}/{name}: {oct(mode)}")
    assert not wrong, wrong


# ----------------------------------------------------------------------------- disk trouble


def _mount(*args: str) -> None:
    subprocess.run(["mount", *args], check=True, capture_output=True)


def _umount(path: Path) -> None:
    for _ in range(3):
        if subprocess.run(["mountpoint", "-q", str(path)]).returncode != 0:
            return
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


@pytest.fixture
def tiny_runs_dir(runs_dir):
    """The runs directory on a 512 KB tmpfs (the scheduler writes to it as to any directory)."""
    runs_dir.mkdir(parents=True, exist_ok=True)
    _mount("-t", "tmpfs", "-o", "size=512k,mode=0700", "tmpfs", str(runs_dir))
    yield runs_dir
    _umount(runs_dir)


@pytest.fixture
def remountable_runs_dir(runs_dir):
    """The runs directory as a bind mount of itself, which the test can remount read-only."""
    runs_dir.mkdir(parents=True, exist_ok=True)
    _mount("--bind", str(runs_dir), str(runs_dir))
    yield runs_dir
    _umount(runs_dir)


def _fill(path: Path) -> Path:
    filler = path / ".filler"
    with open(filler, "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 4096)
        except OSError as exc:
            assert exc.errno == errno.ENOSPC
    return filler


async def test_full_disk_gives_503_and_the_scheduler_keeps_serving(tiny_runs_dir, api, wait_for, evalsched):
    runs_dir = tiny_runs_dir
    before = await submit(api, spec(entry=NOOP))
    assert (await wait_for(before["id"]))["state"] == "succeeded"
    long = await submit(api, spec(entry=SLEEPY, episodes=400, sleep_s=0.02))
    await wait_for(long["id"], states=("running",))

    filler = _fill(runs_dir)
    statuses = []
    for _ in range(5):
        code, err = await api("POST", "runs", spec(entry=NOOP))
        statuses.append(code)
        assert code == 503, (code, err)
        assert "full" in err["message"] and str(runs_dir) in err["message"], err
    # Everything else keeps working while the disk is full.
    for path in (
        "queue",
        "ledger",
        "runs",
        f"runs/{before['id']}",
        f"runs/{before['id']}/logs",
        f"runs/{before['id']}/episodes",
        "openapi.json",
    ):
        code, _ = await api("GET", path, raw=True)
        assert code == 200, path
    # The running run cannot write its files: it ends failed with a reason, not silently.
    final = await wait_for(long["id"], timeout=30)
    assert final["state"] == "failed" and final["reason"], final
    assert not [p for p in runs_dir.iterdir() if p.name.startswith(".staging-")], (
        "a refused submission left a staging dir"
    )

    filler.unlink()
    after = await submit(api, spec(entry=NOOP))
    assert (await wait_for(after["id"]))["state"] == "succeeded"
    code, listing = await api("GET", "runs")
    assert sorted(r["id"] for r in listing["runs"]) == sorted([before["id"], long["id"], after["id"]])
    # Once there is room again, the run that ended while the disk was full is recorded on disk
    # (by a later sweep's retry): job.json says failed and _DONE exists, so a restart cannot
    # resurrect it as 'aborted'. _DONE is written after job.json: wait for it, then check both.
    await async_wait_until(
        (runs_dir / long["id"] / "_DONE").exists, message="the run that ended on a full disk has no _DONE"
    )
    job = json.loads((runs_dir / long["id"] / "job.json").read_text())
    assert job["state"] == "failed", job["state"]


async def test_a_resume_the_full_disk_refuses_is_503_and_leaves_the_run_as_it_was(tiny_runs_dir, api, wait_for):
    """Its ``_DONE`` is removed before its queued record is written; where that write failed, the
    resume answered 200 "queued" (and the run ran again) while ``job.json`` still said failed,
    with no ``_DONE``: a terminal record without it."""
    runs_dir = tiny_runs_dir
    rec = await submit(api, spec(entry=CRASH, params={"how": "exception"}))
    assert (await wait_for(rec["id"]))["state"] == "failed"
    filler = _fill(runs_dir)
    try:
        code, err = await api("POST", f"runs/{rec['id']}/resume")
        assert code == 503 and "full" in err["message"], (code, err)
        code, now = await api("GET", f"runs/{rec['id']}")
        assert code == 200 and now["state"] == "failed" and now["attempt"] == 1, now
        assert json.loads((runs_dir / rec["id"] / "job.json").read_text())["state"] == "failed"
        assert (runs_dir / rec["id"] / "_DONE").exists()
    finally:
        filler.unlink()
    code, again = await api("POST", f"runs/{rec['id']}/resume")
    assert code == 200 and again["state"] == "queued" and again["attempt"] == 2, (code, again)
    final = await wait_for(rec["id"])
    assert final["state"] == "failed" and final["attempt"] == 2, final


async def test_read_only_runs_dir_gives_503_and_the_scheduler_keeps_serving(remountable_runs_dir, api, wait_for):
    runs_dir = remountable_runs_dir
    before = await submit(api, spec(entry=NOOP))
    assert (await wait_for(before["id"]))["state"] == "succeeded"
    _mount("-o", "remount,ro,bind", str(runs_dir))
    try:
        with pytest.raises(OSError):
            (runs_dir / "probe").write_text("x")
        for _ in range(3):
            code, err = await api("POST", "runs", spec(entry=NOOP))
            assert code == 503 and "not writable" in err["message"], (code, err)
        for path in ("queue", "ledger", "runs", f"runs/{before['id']}", f"runs/{before['id']}/logs"):
            code, _ = await api("GET", path, raw=True)
            assert code == 200, path
        code, err = await api("DELETE", f"runs/{before['id']}")
        assert code == 503 and err["message"], (code, err)
    finally:
        _mount("-o", "remount,rw,bind", str(runs_dir))
    after = await submit(api, spec(entry=NOOP))
    assert (await wait_for(after["id"]))["state"] == "succeeded"
    code, listing = await api("GET", "runs")
    assert listing["total"] == 2 and only_run_dirs(runs_dir) == []


async def test_run_directory_removed_while_queued_or_running(api, wait_for, runs_dir, evalsched):
    import shutil

    blocker = await submit(api, spec(entry=SLEEPY, vram=24000, episodes=20, sleep_s=0.05, scheduling={"gpus": 2}))
    queued = await submit(api, spec(entry=NOOP, vram=24000))
    running = await submit(api, spec(entry=SLEEPY, episodes=200, sleep_s=0.02))
    await wait_for(blocker["id"], states=("running",))
    await wait_for(running["id"], states=("running",))
    code, rec = await api("GET", f"runs/{queued['id']}")
    assert rec["state"] == "queued"

    def remove(path):
        # The running run writes into its directory meanwhile: a file made between rmtree's
        # listing and its rmdir is ENOTEMPTY, so remove again, as `rm -rf` would be run again.
        for _ in range(100):
            try:
                shutil.rmtree(path)
                return
            except FileNotFoundError:
                return
            except OSError as exc:
                if exc.errno != errno.ENOTEMPTY:
                    raise
        raise AssertionError(f"{path} could not be removed")

    remove(runs_dir / queued["id"])
    remove(runs_dir / running["id"])

    q = await wait_for(queued["id"], timeout=20)
    r = await wait_for(running["id"], timeout=20)
    assert q["state"] in ("failed", "aborted") and q["reason"], q
    assert r["state"] in ("failed", "aborted") and r["reason"], r
    print(
        f"\nrun directory removed while queued: {q['state']} {q['reason']!r}; while running: {r['state']} {r['reason']!r}"
    )
    assert not alive(r["pid"])
    # The sweep and everything else keep going: the blocker finishes, a new run succeeds.
    assert (await wait_for(blocker["id"]))["state"] == "succeeded"
    new = await submit(api, spec(entry=NOOP))
    assert (await wait_for(new["id"]))["state"] == "succeeded"
    for rid in (queued["id"], running["id"]):
        for path in (f"runs/{rid}", f"runs/{rid}/logs", f"runs/{rid}/episodes"):
            code, text = await api("GET", path, raw=True)
            assert code == 200, (path, code, text[:200])
        code, _ = await api("DELETE", f"runs/{rid}")
        assert code == 204
    assert not (runs_dir / queued["id"]).exists() and not (runs_dir / running["id"]).exists()
    code, listing = await api("GET", "runs")
    assert sorted(x["id"] for x in listing["runs"]) == sorted([blocker["id"], new["id"]])
    assert evalsched.counts["running"] == 0 and evalsched.counts["queued"] == 0


# ----------------------------------------------------------------------------- restart: the recovery window


async def test_requests_during_recovery_never_claim_runs_are_gone(jp_serverapp, jp_fetch, runs_dir, monkeypatch):
    """While a restarted server is still reading its runs directory (slow on a big directory or
    a slow disk: simulated by delaying the read), the API must not answer as if the runs did
    not exist: a run is either served or the answer is 503 (starting), never 404 / an empty
    listing / an empty queue."""
    from jupyter_evalsched.scheduler.service import Scheduler

    run_id = "20260101T000000.000000-abcdef"
    run = runs_dir / run_id
    write_run_dir(run, run_id, None, None, entrypoint=NOOP, state="queued", started_at=None)
    original = Scheduler._read_runs_dir
    reading, release = threading.Event(), threading.Event()

    def slow_read(self):  # in the scheduler's thread pool: held until the requests below are answered
        reading.set()
        release.wait(30)
        return original(self)

    monkeypatch.setattr(Scheduler, "_read_runs_dir", slow_read)
    starting = asyncio.ensure_future(jp_serverapp.extension_manager.start_all_extensions())
    answers = {}
    try:
        await async_wait_until(reading.is_set, message="start-up never read the runs directory")
        assert not starting.done(), "start-up did not wait for the runs directory"
        for path in (f"runs/{run_id}", "runs", "queue"):
            resp = await jp_fetch("evalsched", *path.split("/"), raise_error=False)
            answers[path] = (resp.code, json.loads(resp.body or b"null"))
    finally:
        release.set()
    await starting
    wrong = []
    code, body = answers[f"runs/{run_id}"]
    if code != 503 and not (code == 200 and body["id"] == run_id):
        wrong.append(f"GET runs/{run_id} during recovery: {code} {body}")
    code, body = answers["runs"]
    if code != 503 and not (code == 200 and body["total"] == 1):
        wrong.append(f"GET runs during recovery: {code} {body}")
    code, body = answers["queue"]
    if code != 503 and not (code == 200 and [r["id"] for r in body["queued"] + body["running"]] == [run_id]):
        wrong.append(f"GET queue during recovery: {code} {json.dumps(body)[:200]}")
    assert not wrong, "\n".join(wrong)
    resp = await jp_fetch("evalsched", "runs", run_id, raise_error=False)
    assert resp.code == 200


async def test_lone_surrogates_anywhere_in_a_spec_never_give_a_500(api, wait_for, runs_dir, evalsched, tmp_path):
    r"""JSON may carry ``\ud800`` (a lone surrogate): valid JSON, but not encodable as UTF-8, so
    it cannot become a file's content, a path or an environment variable. Each field holding one
    gets a 4xx, or a run that ends with a reason; nothing is left holding resources."""
    cases = {
        "name": {"entrypoint": NOOP, "name": "x\ud800"},
        "source": {"source": "def episode(ctx, index):\n    return {}  # \ud800\n"},
        "env value": {"entrypoint": NOOP, "env": {"A": "\ud800"}},
        "env name": {"entrypoint": NOOP, "env": {"A\ud800": "1"}},
        "cwd": {"entrypoint": NOOP, "cwd": "/tmp/\ud800"},
        "entrypoint module": {"entrypoint": "mod\ud800:episode"},
        "entrypoint file": {"entrypoint": "f\ud800.py:episode"},
        "params": {"entrypoint": NOOP, "params": {"k\ud800": "v\udfff"}},
    }
    failures, accepted = [], {}
    for label, body in cases.items():
        raw = json.dumps(body)  # ensure_ascii: the surrogate travels as the escape \ud800
        assert "\\ud800" in raw or "\\udfff" in raw
        code, text = await api("POST", "runs", raw, raw=True)
        if code >= 500 or not (code == 201 or 400 <= code < 500):
            failures.append(f"{label}: {code} {text[:200]!r}")
        elif code == 201:
            accepted[label] = json.loads(text)["id"]
        elif "message" not in json.loads(text):
            failures.append(f"{label}: {code} without a message")
    for label, rid in accepted.items():
        try:
            final = await wait_for(rid, timeout=10)
        except AssertionError as exc:
            failures.append(f"{label}: accepted (201), then {exc}")
            continue
        if final["state"] != "succeeded" and not final["reason"]:
            failures.append(f"{label}: ended {final['state']} without a reason")
    assert not failures, "\n".join(failures)
    # Nothing is left holding a slot or a GPU, and the server still takes ordinary work.
    code, queue = await api("GET", "queue")
    assert queue["running"] == [] and queue["queued"] == [], [
        (r["name"], r["state"]) for r in queue["running"] + queue["queued"]
    ]
    assert queue["ledger"]["cpu_slots"]["allocated"] == 0
    ok = await submit(api, spec(entry=NOOP))
    assert (await wait_for(ok["id"]))["state"] == "succeeded"
    assert only_run_dirs(runs_dir) == []
