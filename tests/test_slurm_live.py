"""The SLURM executor against a real single-node SLURM (slurm 22.05 from Debian).

Needs the daemons that ``scripts/start_slurm.sh`` starts (CI runs it before the slow suite); the
tests fail, not skip, when SLURM is not up. Real run directories (``spec.json`` and
``shared_urls.json`` written here, as the server writes them) under a path with a blank in it,
real ``sbatch``/``squeue``/``scontrol``/``scancel``, the real runner.

The time-limit test needs SLURM's minute granularity (about 70 s on the test cluster), so its job
is submitted when the module starts and checked by the last test; the other tests run meanwhile
on the node's other CPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest
from run_dirs import filled_spec
from waiting import wait_until

from jupyter_evalsched.scheduler.slurm import SlurmCli, SlurmConfig, SlurmError, SlurmJobState, verdict

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

REPO_ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_JOB_WAIT_S = 180  # --time=1, plus slurmctld's 30 s time-limit sweep, plus KillWait

# Records what the job saw, then sleeps params["sleep_s"].
PROBE_EVAL = """
import json, os, socket, time

def episode(ctx, index):
    seen = {
        "pid": os.getpid(),
        "devices": ctx.devices,
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "cuda_device_order": os.environ.get("CUDA_DEVICE_ORDER"),
        "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
        "slurmd_nodename": os.environ.get("SLURMD_NODENAME"),
        "parent_pid_env": os.environ.get("EVALSCHED_PARENT_PID"),
        "probe": os.environ.get("PROBE"),
        "cwd": os.getcwd(),
        "after_done": {
            d: os.path.exists(os.path.join(ctx.run_dir, "..", d, "_DONE")) for d in ctx.params.get("after", [])
        },
    }
    with open(os.path.join(ctx.run_dir, "seen.json"), "w") as f:
        json.dump(seen, f)
    print("probe episode", index, flush=True)
    time.sleep(ctx.params.get("sleep_s", 0))
    return {"devices": len(ctx.devices)}
"""


def run_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    for name in ("PYTHONUNBUFFERED", "EVALSCHED_PARENT_PID", "EVALSCHED_DEVICES", "COVERAGE_PROCESS_START"):
        env.pop(name, None)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
    # What the local launcher would set: must not reach a SLURM job (the runner would check a
    # parent that is not its own, and ignore SLURM's GPUs).
    env["EVALSCHED_PARENT_PID"] = str(os.getpid())
    env["EVALSCHED_DEVICES"] = "1"
    env.update(extra)
    return env


class Runs:
    """Run directories and their SLURM jobs; whatever a failing test leaves is scancel'ed."""

    def __init__(self, root: Path, ex: SlurmCli) -> None:
        self.root = root
        self.ex = ex
        self.jobs: dict[str, str] = {}  # job id -> run id
        self.count = 0

    def make(self, **spec) -> tuple[str, Path, dict]:
        self.count += 1
        run_id = f"20261129T100000-{self.count:06d}"
        run_dir = self.root / run_id
        run_dir.mkdir(parents=True)
        spec = filled_spec(**spec)
        spec["cwd"] = spec["cwd"] or str(self.root.parent)
        (run_dir / "spec.json").write_text(json.dumps(spec))
        (run_dir / "shared_urls.json").write_text(json.dumps({"models": {}}))
        if spec["source"] is not None:
            (run_dir / "eval.py").write_text(spec["source"])
        return run_id, run_dir, spec

    def submit(self, deps: list[str] | None = None, env: dict | None = None, **spec) -> tuple[str, Path]:
        run_id, run_dir, spec = self.make(**spec)
        job_id = self.ex.submit(run_id, run_dir, spec, env or run_env(), deps or [])
        assert job_id.isdigit()
        self.jobs[job_id] = run_id
        return job_id, run_dir

    def wait(self, job_ids: list[str], timeout: float, until=lambda s: s.finished) -> dict[str, SlurmJobState]:
        """Poll until ``until`` holds for every job; checks that each poll is one squeue."""
        last: dict[str, SlurmJobState] = {}

        def polled() -> dict[str, SlurmJobState] | None:
            before = dict(self.ex.calls)
            states = self.ex.poll(job_ids)
            # pytest.fail, not assert: an AssertionError out of wait_until means "not there in time".
            if self.ex.calls["squeue"] != before.get("squeue", 0) + 1:
                pytest.fail(f"one poll was not one squeue: {before} -> {self.ex.calls}")
            if set(states) != set(job_ids):
                pytest.fail(f"the poll of {job_ids} answered for {sorted(states)}")
            last.clear()
            last.update(states)
            return states if all(until(s) for s in states.values()) else None

        try:
            return wait_until(polled, timeout=timeout, interval=0.25)
        except AssertionError:
            raise AssertionError(f"SLURM jobs not there after {timeout} s: {last}") from None

    def cleanup(self) -> None:
        for job_id in self.jobs:
            try:
                self.ex.cancel(job_id)
            except SlurmError:
                pass


def _slurm_problem() -> str | None:
    try:
        ping = subprocess.run(["scontrol", "ping"], capture_output=True, text=True, timeout=15)
        node = subprocess.run(
            ["sinfo", "--noheader", "--nodes=localhost", "--format=%T"], capture_output=True, text=True, timeout=15
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"the SLURM commands cannot run: {exc}"
    if "is UP" not in ping.stdout:
        return f"slurmctld does not answer: {ping.stdout.strip()} {ping.stderr.strip()}"
    state = node.stdout.strip()
    if state not in ("idle", "mixed", "allocated", "completing"):
        return f"node localhost is {state or 'not listed'!r}: {node.stderr.strip()}"
    return None


@pytest.fixture(scope="module")
def ex() -> SlurmCli:
    problem = _slurm_problem()
    if problem:
        pytest.fail(f"SLURM is not up ({problem}); start it with `bash scripts/start_slurm.sh` (as root)")
    return SlurmCli(SlurmConfig())


@pytest.fixture(scope="module")
def runs(ex, tmp_path_factory):
    runs = Runs(tmp_path_factory.mktemp("slurm-live") / "runs dir", ex)  # a blank on purpose
    yield runs
    runs.cleanup()


@pytest.fixture(scope="module", autouse=True)
def timeout_job(runs):
    """A run far longer than its 60 s timeout: SLURM must stop it at --time=1."""
    job_id, run_dir = runs.submit(
        entrypoint="jupyter_evalsched.examples.basic:sleepy", params={"sleep_s": 600}, timeout_s=60
    )
    return job_id, run_dir, time.monotonic()


# --------------------------------------------------------------------------- tests


def test_succeeded_gpu_and_cpu_runs(runs, ex):
    gpu_job, gpu_dir = runs.submit(source=PROBE_EVAL, episodes=2, scheduling={"marginal_vram_mb": 1000, "gpus": 1})
    cpu_job, cpu_dir = runs.submit(source=PROBE_EVAL, env=run_env(PROBE="a b 'c' $HOME"))
    states = runs.wait([gpu_job, cpu_job], timeout=60)
    for job_id, run_dir in ((gpu_job, gpu_dir), (cpu_job, cpu_dir)):
        st = states[job_id]
        assert (st.state, st.exit_code, st.signal, st.finished, st.node) == ("COMPLETED", 0, None, True, "localhost")
        assert (run_dir / "_DONE").exists(), (run_dir / "stderr.log").read_text()
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["status"] == "succeeded" and summary["error"] is None
        assert (run_dir / "slurm.sbatch").exists()
        assert "probe episode 0" in (run_dir / "stdout.log").read_text()
        seen = json.loads((run_dir / "seen.json").read_text())
        assert seen["slurm_job_id"] == job_id
        assert seen["slurmd_nodename"] == "localhost"
        assert seen["parent_pid_env"] is None  # the runner did not check a parent it does not have
        assert seen["cwd"] == str(runs.root.parent)
    gpu = json.loads((gpu_dir / "seen.json").read_text())
    # One of the two fake GPUs, chosen by SLURM; the runner took it from CUDA_VISIBLE_DEVICES.
    assert gpu["cuda_visible_devices"] in ("0", "1")
    assert gpu["devices"] == [int(gpu["cuda_visible_devices"])]
    assert gpu["cuda_device_order"] == "PCI_BUS_ID"
    assert json.loads((gpu_dir / "summary.json").read_text())["episodes_done"] == 2
    cpu = json.loads((cpu_dir / "seen.json").read_text())
    assert (cpu["cuda_visible_devices"], cpu["devices"]) == ("", [])
    assert cpu["probe"] == "a b 'c' $HOME"  # exported verbatim, not expanded


def test_failed_by_exception_is_finalized_by_the_runner(runs):
    job_id, run_dir = runs.submit(
        entrypoint="jupyter_evalsched.examples.basic:crash", params={"how": "exception"}, episodes=2
    )
    st = runs.wait([job_id], timeout=60)[job_id]
    # The runner finalized; the job script exits 1 for a failed run, so afterok does not fire.
    assert (st.state, st.exit_code, st.signal) == ("FAILED", 1, None)
    assert (run_dir / "_DONE").exists()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "failed"
    assert summary["error"]["type"] == "RuntimeError"
    assert "crash requested in episode 0" in summary["error"]["message"]


def test_runs_that_die_are_judged_by_verdict(runs):
    killed, killed_dir = runs.submit(entrypoint="jupyter_evalsched.examples.basic:crash", params={"how": "sigkill"})
    exited, exited_dir = runs.submit(
        entrypoint="jupyter_evalsched.examples.basic:crash", params={"how": "exit", "code": 3}
    )
    states = runs.wait([killed, exited], timeout=60)
    assert (states[killed].state, states[killed].signal, states[killed].popen_exit_code) == ("FAILED", 9, -9)
    assert (states[exited].state, states[exited].exit_code, states[exited].signal) == ("FAILED", 3, None)
    for run_dir in (killed_dir, exited_dir):
        assert not (run_dir / "_DONE").exists()  # not finalized: the server's job, with verdict()
    state, reason = verdict(states[killed])
    assert state == "failed" and reason.startswith("signal:SIGKILL: ")
    state, reason = verdict(states[exited])
    assert state == "failed" and reason.startswith("exit_code:3: ")


def test_cancel_through_scancel(runs, ex):
    job_id, run_dir = runs.submit(source=PROBE_EVAL, params={"sleep_s": 300})
    runs.wait([job_id], timeout=60, until=lambda s: s.state == "RUNNING" and (run_dir / "seen.json").exists())
    pid = json.loads((run_dir / "seen.json").read_text())["pid"]
    os.kill(pid, 0)  # the runner is alive

    ex.cancel(job_id)
    seen_states = set()

    def done(st: SlurmJobState) -> bool:
        seen_states.add(st.state)
        return st.finished

    st = runs.wait([job_id], timeout=30, until=done)[job_id]
    assert st_tuple(st) == ("CANCELLED", True)
    assert st.signal == 15
    # Finished means no process of the job is left: the run cannot write after we finalize.
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    assert not (run_dir / "_DONE").exists()
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "running"
    assert verdict(st) == ("cancelled", f"cancelled: SLURM job {job_id} was cancelled (scancel)")
    assert seen_states <= {"RUNNING", "COMPLETING", "CANCELLED"}
    ex.cancel(job_id)  # again, once it is over: not an error


def st_tuple(st: SlurmJobState) -> tuple[str, bool]:
    return st.state, st.finished


def test_dependency_chain_afterok(runs):
    first, first_dir = runs.submit(source=PROBE_EVAL, params={"sleep_s": 1})
    second, second_dir = runs.submit(deps=[first], source=PROBE_EVAL, params={"after": [first_dir.name]})
    failing, failing_dir = runs.submit(entrypoint="jupyter_evalsched.examples.basic:crash", params={"how": "exception"})
    blocked, blocked_dir = runs.submit(deps=[failing], source=PROBE_EVAL)

    states = runs.wait([first, second, failing, blocked], timeout=90)
    assert states[first].state == "COMPLETED" and states[second].state == "COMPLETED"
    # The second started only once the first had finished, _DONE included.
    assert json.loads((second_dir / "seen.json").read_text())["after_done"] == {first_dir.name: True}
    assert json.loads((second_dir / "summary.json").read_text())["status"] == "succeeded"

    # The failing run was finalized as failed by the runner: SLURM cancelled its dependent.
    assert (failing_dir / "_DONE").exists()
    st = states[blocked]
    assert (st.state, st.reason, st.dependency) == (
        "CANCELLED",
        "DependencyNeverSatisfied",
        f"afterok:{failing}(failed)",
    )
    assert not (blocked_dir / "summary.json").exists()  # it never started
    assert verdict(st, runs.jobs) == (
        "failed",
        f"dependency_failed:{failing_dir.name}: "
        f"SLURM job {blocked} was cancelled because its dependency did not succeed",
    )


def test_unknown_job_ids(runs, ex):
    known, _ = runs.submit(entrypoint="jupyter_evalsched.examples.basic:noop")
    before = dict(ex.calls)
    # A single unknown id: squeue fails with "Invalid job id"; scontrol does not know it either.
    assert ex.poll(["99999999"])["99999999"] == SlurmJobState("99999999", "UNKNOWN", "purged", None, None, True)
    # Mixed: squeue answers for the known one; scontrol is asked about the unknown one only.
    states = ex.poll([known, "99999998"])
    assert states["99999998"].state == "UNKNOWN"
    assert states[known].state in ("PENDING", "RUNNING", "COMPLETING", "COMPLETED")
    assert ex.calls["squeue"] - before.get("squeue", 0) == 2
    assert ex.calls["scontrol"] - before.get("scontrol", 0) == 2
    assert verdict(states["99999998"])[1].startswith("exit_code:unknown: ")
    runs.wait([known], timeout=60)


def test_sbatch_error_is_raised_with_slurms_message(runs, tmp_path):
    run_id, run_dir, spec = runs.make(entrypoint="jupyter_evalsched.examples.basic:noop")
    bad = SlurmCli(SlurmConfig(partition="no-such-partition"))
    with pytest.raises(SlurmError, match="(?i)invalid partition"):
        bad.submit(run_id, run_dir, spec, run_env(), [])


def test_timeout_at_the_slurm_time_limit(runs, timeout_job):
    """Last: its job was submitted when the module started."""
    job_id, run_dir, submitted = timeout_job
    left = TIMEOUT_JOB_WAIT_S - (time.monotonic() - submitted)
    st = runs.wait([job_id], timeout=max(left, 5))[job_id]
    assert (st.state, st.reason, st.finished) == ("TIMEOUT", "TimeLimit", True)
    assert time.monotonic() - submitted >= 55  # not before its minute
    assert not (run_dir / "_DONE").exists()
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "running"
    state, reason = verdict(st)
    assert state == "failed" and reason.startswith("timeout: ")
