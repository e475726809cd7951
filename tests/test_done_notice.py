"""A run's word that it is done (``runner.run.finish`` -> ``Launcher._noticed``): a run on the CPU
alone gives its slot to the next run at its ``_DONE``, before its process is gone; its verdict
still waits for the exit; a process that stays is killed; a GPU run keeps its devices until its
process is gone; the word without ``_DONE`` frees nothing. A real server, warm and cold runs."""

from __future__ import annotations

import json
import os
import signal
import socket
from pathlib import Path

import pytest
from proc_status import alive
from rest import NOOP, spec, submit

from jupyter_evalsched.runner import run as runner_run
from jupyter_evalsched.runner._proc import DONE_NOTICE
from jupyter_evalsched.scheduler import launcher as launcher_module

HERE = Path(__file__).resolve().parent
LINGER = f"{HERE / 'evals_linger.py'}:linger"
SAY_DONE_EARLY = f"{HERE / 'evals_linger.py'}:say_done_early"
CHILD_SAYS_DONE = f"{HERE / 'evals_linger.py'}:child_says_done"
ALL_CPUS = {"cpus": 8}  # conftest's cpu_slots: the second run waits for the first


@pytest.fixture(params=[False, True], ids=["warm", "cold"])
def fresh(request):
    return request.param


async def record(api, run_id: str) -> dict:
    code, rec = await api("GET", f"runs/{run_id}")
    assert code == 200, rec
    return rec


def final_summary(rec: dict) -> dict:
    return json.loads((Path(rec["run_dir"]) / "summary.json").read_text())


async def test_cpu_slot_goes_to_the_next_run_at_done(api, wait_for, monkeypatch, fresh):
    monkeypatch.setattr(launcher_module, "DONE_EXIT_GRACE_S", 600.0)  # (the next test's subject)
    a = await submit(api, spec(entry=LINGER, params={"linger_s": 120}, scheduling=ALL_CPUS, fresh_interpreter=fresh))
    b = await submit(api, spec(entry=NOOP, scheduling=ALL_CPUS, fresh_interpreter=fresh))
    started = await wait_for(b["id"], states=("running", "succeeded"))
    ra = await record(api, a["id"])
    # The next run started while the first one's process is still there, its verdict not read.
    assert ra["state"] == "running", ra
    assert alive(ra["pid"])
    assert (Path(ra["run_dir"]) / "_DONE").exists()
    assert ra["started_at"] < started["started_at"]
    assert (await wait_for(b["id"]))["state"] == "succeeded"
    os.kill(ra["pid"], signal.SIGKILL)
    ra = await wait_for(a["id"])
    assert ra["state"] == "succeeded", ra  # its own files say so
    # Its finished_at is its word (before the next run's start), not the kill.
    assert ra["finished_at"] <= started["started_at"]


async def test_a_process_that_stays_after_its_word_is_killed(api, wait_for, monkeypatch, fresh):
    monkeypatch.setattr(launcher_module, "DONE_EXIT_GRACE_S", 0.5)
    a = await submit(api, spec(entry=LINGER, params={"linger_s": 120}, fresh_interpreter=fresh))
    ra = await wait_for(a["id"], timeout=60)
    assert ra["state"] == "succeeded", ra  # the run's own files give its verdict
    assert ra["exit_code"] == -9
    assert not alive(ra["pid"])


async def test_gpu_run_keeps_its_devices_until_its_process_is_gone(api, wait_for, fresh):
    linger_s = 2.0
    a = await submit(api, spec(entry=LINGER, vram=20000, params={"linger_s": linger_s}, fresh_interpreter=fresh))
    await wait_for(a["id"], states=("running",))
    # (On both GPUs: one of them is the first run's.)
    b = await submit(api, spec(entry=NOOP, vram=20000, scheduling={"gpus": 2}, fresh_interpreter=fresh))
    rb = await wait_for(b["id"], timeout=linger_s + 30)
    ra = await wait_for(a["id"])
    assert (ra["state"], rb["state"]) == ("succeeded", "succeeded"), (ra, rb)
    assert ra["exit_code"] == 0
    # Ended (its process gone) a linger after its _DONE, and the next run started after that.
    done = final_summary(ra)["finished_at"]
    assert _seconds(done, ra["finished_at"]) >= linger_s * 0.9
    assert rb["started_at"] >= ra["finished_at"]


async def test_the_word_without_done_frees_nothing(api, wait_for, fresh):
    sleep_s = 1.5
    a = await submit(
        api,
        spec(entry=SAY_DONE_EARLY, sleep_s=sleep_s, scheduling=ALL_CPUS, fresh_interpreter=fresh),
    )
    await wait_for(a["id"], states=("running",))
    b = await submit(api, spec(entry=NOOP, scheduling=ALL_CPUS, fresh_interpreter=fresh))
    rb = await wait_for(b["id"], timeout=sleep_s + 30)
    ra = await wait_for(a["id"])
    assert (ra["state"], rb["state"]) == ("succeeded", "succeeded"), (ra, rb)
    assert rb["started_at"] >= ra["finished_at"]
    assert _seconds(ra["started_at"], ra["finished_at"]) >= sleep_s * 0.9


@pytest.mark.parametrize("how", ["exit", "word"])
async def test_a_child_the_eval_forked_frees_nothing(api, wait_for, how):
    """A child that leaves through the runner (it finalizes as the run) does not say the word;
    one that makes _DONE and says it is not the run's process, which the kernel tells."""
    sleep_s = 1.5
    a = await submit(api, spec(entry=CHILD_SAYS_DONE, params={"how": how, "sleep_s": sleep_s}, scheduling=ALL_CPUS))
    await wait_for(a["id"], states=("running",))
    b = await submit(api, spec(entry=NOOP, scheduling=ALL_CPUS))
    rb = await wait_for(b["id"], timeout=sleep_s + 30)
    ra = await wait_for(a["id"])
    assert (ra["state"], rb["state"]) == ("succeeded", "succeeded"), (ra, rb)
    assert rb["started_at"] >= ra["finished_at"]
    assert _seconds(ra["started_at"], ra["finished_at"]) >= sleep_s * 0.9


def test_the_runner_says_it_from_its_own_process_and_on_its_socket_only(monkeypatch, tmp_path):
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    ours.setblocking(False)
    monkeypatch.setattr(runner_run, "_done_notice", None)
    runner_run.set_done_notice(theirs.detach())
    fd = runner_run._done_notice[0]
    try:
        child = os.fork()
        if child == 0:  # a process the eval forked, ending through the runner
            runner_run._tell_done()
            os._exit(0)
        os.waitpid(child, 0)
        with pytest.raises(BlockingIOError):
            ours.recv(64)
        runner_run._tell_done()
        assert ours.recv(64) == DONE_NOTICE
        # The eval closed it and its number now names a file of the eval's: nothing written there.
        victim = tmp_path / "victim"
        other = os.open(victim, os.O_WRONLY | os.O_CREAT, 0o600)
        os.dup2(other, fd)
        os.close(other)
        runner_run._tell_done()
        assert victim.read_bytes() == b""
    finally:
        os.close(fd)
        ours.close()


def _seconds(earlier: str, later: str) -> float:
    from datetime import datetime

    return (datetime.fromisoformat(later) - datetime.fromisoformat(earlier)).total_seconds()
