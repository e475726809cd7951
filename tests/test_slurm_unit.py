"""Unit tests of the SLURM executor (jupyter_evalsched.scheduler.slurm); no SLURM needed.

The SLURM commands are replaced by small fake programs in ``tmp_path`` that record their argv
(and, for sbatch, their environment) and answer with output captured from slurm 22.05 on a
single-node cluster (scripts/start_slurm.sh). The generated job script is executed by bash with
a fake "python" that dumps what it was given, so quoting is checked end to end.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from run_dirs import filled_spec

from jupyter_evalsched.scheduler.slurm import (
    SQUEUE_FORMAT,
    SlurmCli,
    SlurmCommands,
    SlurmConfig,
    SlurmError,
    SlurmJobState,
    parse_scontrol_job,
    parse_squeue,
    pending_reason,
    render_sbatch_script,
    sbatch_options,
    verdict,
)

# ----------------------------------------------------------------------------- captured output
# `squeue --noheader --states=all --jobs=... --Format=<SQUEUE_FORMAT>` on slurm 22.05.8. Jobs: 16
# `true`; 17 `exit 3`; 18 `kill -SEGV $$`; 19 running with a GPU; 20 afterok:17 with
# --kill-on-invalid-dep (cancelled by SLURM once 17 failed); 21 afterok:19; 22 scancel'ed while
# pending; 13 scancel'ed while running (first COMPLETING, then CANCELLED); 15 --time=1.
SQUEUE_REAL = """\
22|CANCELLED|Priority|0|n/a|(null)|
16|COMPLETED|None|0|localhost|(null)|
17|FAILED|NonZeroExitCode|768|localhost|(null)|
18|FAILED|JobLaunchFailure|11|localhost|(null)|
19|RUNNING|None|0|localhost|(null)|
20|CANCELLED|DependencyNeverSatisfied|0|n/a|afterok:17(failed)|
21|PENDING|Dependency|0|n/a|afterok:19(unfulfilled)|
13|COMPLETING|None|15|localhost|(null)|
15|TIMEOUT|TimeLimit|15|localhost|(null)|
"""

SCONTROL_FAILED_EXIT3 = (
    "JobId=17 JobName=wrap UserId=root(0) GroupId=root(0) MCS_label=N/A Priority=4294901743 Nice=0 "
    "Account=(null) QOS=(null) JobState=FAILED Reason=NonZeroExitCode Dependency=(null) Requeue=1 "
    "Restarts=0 BatchFlag=1 Reboot=0 ExitCode=3:0 RunTime=00:00:00 TimeLimit=UNLIMITED TimeMin=N/A "
    "SubmitTime=2026-11-29T09:07:16 EligibleTime=2026-11-29T09:07:16 AccrueTime=2026-11-29T09:07:16 "
    "StartTime=2026-11-29T09:07:16 EndTime=2026-11-29T09:07:16 Deadline=N/A SuspendTime=None "
    "SecsPreSuspend=0 LastSchedEval=2026-11-29T09:07:16 Scheduler=Main Partition=debug "
    "AllocNode:Sid=localhost:8611 ReqNodeList=(null) ExcNodeList=(null) NodeList=localhost "
    "BatchHost=localhost NumNodes=1 NumCPUs=1 NumTasks=1 CPUs/Task=1 ReqB:S:C:T=0:0:*:* "
    "TRES=cpu=1,mem=5736M,node=1,billing=1 Socks/Node=* NtasksPerN:B:S:C=0:0:*:* CoreSpec=* "
    "MinCPUsNode=1 MinMemoryCPU=5736M MinTmpDiskNode=0 Features=(null) DelayBoot=00:00:00 "
    "OverSubscribe=OK Contiguous=0 Licenses=(null) Network=(null) Command=(null) WorkDir=/tmp "
    "StdErr=/dev/null StdIn=/dev/null StdOut=/dev/null Power= \n"
)
SCONTROL_SEGV = (
    SCONTROL_FAILED_EXIT3.replace("JobId=17", "JobId=18")
    .replace("Reason=NonZeroExitCode", "Reason=JobLaunchFailure")
    .replace("ExitCode=3:0", "ExitCode=0:11")
)
SCONTROL_DEP_CANCELLED = (
    "JobId=20 JobName=wrap UserId=root(0) GroupId=root(0) MCS_label=N/A Priority=4294901740 Nice=0 "
    "Account=(null) QOS=(null) JobState=CANCELLED Reason=DependencyNeverSatisfied "
    "Dependency=afterok:17(failed) Requeue=1 Restarts=0 BatchFlag=1 Reboot=0 ExitCode=0:0 "
    "RunTime=00:00:00 TimeLimit=UNLIMITED TimeMin=N/A SubmitTime=2026-11-29T09:07:16 "
    "EligibleTime=Unknown AccrueTime=Unknown StartTime=2026-11-29T09:07:22 EndTime=2026-11-29T09:07:22 "
    "Deadline=N/A SuspendTime=None SecsPreSuspend=0 LastSchedEval=2026-11-29T09:07:16 Scheduler=Main "
    "Partition=debug AllocNode:Sid=localhost:8611 ReqNodeList=(null) ExcNodeList=(null) NodeList= "
    "NumNodes=1 NumCPUs=1 NumTasks=N/A CPUs/Task=1 ReqB:S:C:T=0:0:*:* TRES=cpu=1,mem=5736M,node=1,billing=1 "
    "Socks/Node=* NtasksPerN:B:S:C=0:0:*:* CoreSpec=* MinCPUsNode=1 MinMemoryCPU=5736M MinTmpDiskNode=0 "
    "Features=(null) DelayBoot=00:00:00 OverSubscribe=OK Contiguous=0 Licenses=(null) Network=(null) "
    "Command=(null) WorkDir=/tmp StdErr=/dev/null StdIn=/dev/null StdOut=/dev/null Power= "
    "KillOInInvalidDependent=Yes \n"
)
SCONTROL_PENDING = (
    "JobId=21 JobName=wrap UserId=root(0) GroupId=root(0) MCS_label=N/A Priority=4294901739 Nice=0 "
    "Account=(null) QOS=(null) JobState=PENDING Reason=Dependency Dependency=afterok:19(unfulfilled) "
    "Requeue=1 Restarts=0 BatchFlag=1 Reboot=0 ExitCode=0:0 RunTime=00:00:00 TimeLimit=UNLIMITED "
    "TimeMin=N/A SubmitTime=2026-11-29T09:07:16 EligibleTime=Unknown AccrueTime=Unknown "
    "StartTime=Unknown EndTime=Unknown Deadline=N/A NodeList= BatchHost= NumNodes=1 \n"
)
INVALID_JOB_ID = "slurm_load_jobs error: Invalid job id specified\n"


def make_spec(**scheduling) -> dict:
    spec = filled_spec(name="sleepy", entrypoint="jupyter_evalsched.examples.basic:sleepy", cwd="/tmp")
    for key in ("timeout_s", "cwd", "name"):
        if key in scheduling:
            spec[key] = scheduling.pop(key)
    spec["scheduling"].update(scheduling)
    return spec


# ----------------------------------------------------------------------------- fake commands

FAKE = """#!{python}
# A fake SLURM command: records its argv (and environment) and answers from a JSON plan.
import json, os, sys
here = {here!r}
name = {name!r}
with open(os.path.join(here, name + ".calls"), "a") as f:
    f.write(json.dumps({{"argv": sys.argv[1:], "env": dict(os.environ)}}) + "\\n")
plan = json.load(open(os.path.join(here, name + ".plan")))
key = sys.argv[-1] if name == "scontrol" else "*"
answer = plan.get(key, plan.get("*", {{}}))
sys.stdout.write(answer.get("stdout", ""))
sys.stderr.write(answer.get("stderr", ""))
sys.exit(answer.get("rc", 0))
"""


class Fakes:
    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        for name in ("sbatch", "squeue", "scontrol", "scancel"):
            path = root / name
            path.write_text(FAKE.format(python=sys.executable, here=str(root), name=name))
            path.chmod(0o755)
            self.plan(name, {"*": {}})

    def plan(self, name: str, plan: dict) -> None:
        (self.root / f"{name}.plan").write_text(json.dumps(plan))

    def calls(self, name: str) -> list[dict]:
        path = self.root / f"{name}.calls"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines()]

    @property
    def commands(self) -> SlurmCommands:
        return SlurmCommands(*(str(self.root / n) for n in ("sbatch", "squeue", "scontrol", "scancel")))


@pytest.fixture
def fakes(tmp_path) -> Fakes:
    return Fakes(tmp_path / "fake-slurm")


@pytest.fixture
def run_dir(tmp_path) -> Path:
    path = tmp_path / "runs" / "20261129T090000-000001"
    path.mkdir(parents=True)
    return path


def executor(fakes: Fakes, **config) -> SlurmCli:
    return SlurmCli(SlurmConfig(commands=fakes.commands, **config))


def script_options(script: str) -> list[str]:
    return [line[len("#SBATCH ") :] for line in script.splitlines() if line.startswith("#SBATCH ")]


# ----------------------------------------------------------------------------- submit


def test_submit_writes_script_runs_sbatch_and_returns_the_job_id(fakes, run_dir):
    fakes.plan("sbatch", {"*": {"stdout": "4242;evalsched\n"}})
    env = {
        "PATH": "/usr/bin:/bin",
        "HOME": "/root",
        "EVALSCHED_PARENT_PID": "123",  # the launcher's: the runner would check its parent
        "EVALSCHED_DEVICES": "0",
        "SLURM_JOB_ID": "77",  # a server running inside an allocation
        "SLURM_CONF": "/etc/slurm/slurm.conf",
        "HOSTNAME": "server-host",
        "MY_SETTING": "a b",
    }
    ex = executor(fakes)
    job_id = ex.submit("run-1", run_dir, make_spec(cpus=3, timeout_s=61), env, [])
    assert job_id == "4242"
    assert ex.calls == {"sbatch": 1}

    (call,) = fakes.calls("sbatch")
    script_path = run_dir / "slurm.sbatch"
    assert call["argv"][0] == "--parsable"
    assert call["argv"][-1] == str(script_path)
    argv_opts = call["argv"][1:-1]
    assert f"--output={run_dir}/stdout.log" in argv_opts
    assert f"--error={run_dir}/stderr.log" in argv_opts
    assert "--job-name=evalsched-sleepy" in argv_opts
    assert "--cpus-per-task=3" in argv_opts
    assert "--time=2" in argv_opts  # 61 s: rounded up to whole minutes
    assert "--chdir=/tmp" in argv_opts
    assert "--no-requeue" in argv_opts and "--open-mode=append" in argv_opts
    assert not any(o.startswith(("--gres", "--nice", "--dependency", "--partition", "--account")) for o in argv_opts)
    # The environment sbatch propagates to the job (--export=ALL) is the run's, cleaned.
    assert call["env"]["MY_SETTING"] == "a b"
    assert call["env"]["SLURM_CONF"] == "/etc/slurm/slurm.conf"
    for gone in ("EVALSCHED_PARENT_PID", "EVALSCHED_DEVICES", "SLURM_JOB_ID"):
        assert gone not in call["env"]

    script = script_path.read_text()
    assert script.startswith("#!/bin/bash\n")
    assert script_options(script) == argv_opts  # the same options, in the script for the record
    assert os.access(script_path, os.X_OK)
    assert f"\n{sys.executable} -m jupyter_evalsched.runner --run-dir {run_dir}\n" in script
    assert "export CUDA_VISIBLE_DEVICES=''" in script  # a CPU-only run sees no GPU
    for name in ("EVALSCHED_PARENT_PID=", "EVALSCHED_DEVICES=", "SLURM_JOB_ID=", "HOSTNAME=", "SLURM_CONF="):
        assert f"export {name}" not in script
    assert not list(run_dir.glob(".slurm.sbatch.*"))  # the temp file was renamed into place


def test_the_script_runs_the_runner_with_exactly_the_given_environment(fakes, tmp_path, run_dir):
    """Run the generated script with bash, "python" being a fake that dumps argv, cwd and env."""
    fake_python = tmp_path / "fake-python"
    dump = tmp_path / "dump.json"
    fake_python.write_text(
        f"#!{sys.executable}\nimport json, os, sys\n"
        f"json.dump({{'argv': sys.argv[1:], 'cwd': os.getcwd(), 'env': dict(os.environ)}}, open({str(dump)!r}, 'w'))\n"
        "open(os.path.join(sys.argv[-1], 'summary.json'), 'w').write('{\"status\": \"succeeded\"}')\n"
    )
    fake_python.chmod(0o755)
    cwd = tmp_path / "work dir with 'quotes'"
    cwd.mkdir()
    nasty = 'it\'s $HOME `uname` "q" \\ back\nline2 ; rm -rf /'
    env = {
        "PATH": os.environ["PATH"],
        "NASTY": nasty,
        "EMPTY": "",
        "UNICODE": "héllo wörld",
        "EVALSCHED_PARENT_PID": "1",
        "CUDA_VISIBLE_DEVICES": "0,1",
        "bad-name": "x",  # not a shell identifier: cannot be exported, skipped
    }
    spec = make_spec(cwd=str(cwd))
    script = render_sbatch_script("run-1", run_dir, spec, env, [], SlurmConfig(python=str(fake_python)))
    (run_dir / "slurm.sbatch").write_text(script)
    # The parent environment is almost empty: what the runner gets comes from the script's exports.
    proc = subprocess.run(
        ["/bin/bash", str(run_dir / "slurm.sbatch")],
        env={"EVALSCHED_PARENT_PID": "9"},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 0, proc.stderr
    got = json.loads(dump.read_text())
    assert got["argv"] == ["-m", "jupyter_evalsched.runner", "--run-dir", str(run_dir)]
    assert got["cwd"] == str(cwd)
    assert got["env"]["NASTY"] == nasty
    assert got["env"]["EMPTY"] == ""
    assert got["env"]["UNICODE"] == "héllo wörld"
    assert got["env"]["CUDA_VISIBLE_DEVICES"] == ""  # CPU-only: the given "0,1" is overridden
    assert "EVALSCHED_PARENT_PID" not in got["env"]  # unset even when inherited
    assert "bad-name" not in got["env"]


# What the fake runner does, by FAKE_RUNNER_MODE: finalize as succeeded or failed (exit 0), exit
# with a code, or die of a signal.
FAKE_RUNNER = """#!{python}
import json, os, signal, sys
mode = os.environ["FAKE_RUNNER_MODE"]
run_dir = sys.argv[-1]
if mode in ("succeeded", "failed"):
    with open(os.path.join(run_dir, "summary.json"), "w") as f:
        json.dump({{"run_id": "r", "status": mode, "error": None if mode == "succeeded" else
                   {{"type": "RuntimeError", "message": '"status": "succeeded"', "traceback": ""}}}}, f)
    open(os.path.join(run_dir, "_DONE"), "w").close()
    sys.exit(0)
if mode.startswith("exit"):
    sys.exit(int(mode[4:]))
os.kill(os.getpid(), getattr(signal, mode))
"""


@pytest.mark.parametrize(
    ("mode", "returncode"),
    [
        ("succeeded", 0),
        ("failed", 1),  # finalized as failed: non-zero, so that SLURM's afterok does not fire
        ("exit2", 2),
        ("exit74", 74),
        ("SIGKILL", -9),  # the shell dies of the runner's signal: SLURM records ExitCode 0:9
        ("SIGSEGV", -11),
        ("SIGTERM", -15),
    ],
)
def test_job_exit_status_reflects_the_run(tmp_path, run_dir, mode, returncode):
    fake_python = tmp_path / "fake-runner"
    fake_python.write_text(FAKE_RUNNER.format(python=sys.executable))
    fake_python.chmod(0o755)
    script = render_sbatch_script(
        "r",
        run_dir,
        make_spec(),
        {"PATH": os.environ["PATH"], "FAKE_RUNNER_MODE": mode},
        [],
        SlurmConfig(python=str(fake_python)),
    )
    (run_dir / "slurm.sbatch").write_text(script)
    proc = subprocess.run(["/bin/bash", str(run_dir / "slurm.sbatch")], capture_output=True, text=True, timeout=30)
    assert proc.returncode == returncode, proc.stderr
    assert ("afterok dependents do not start" in proc.stderr) == (mode == "failed")


def test_script_exits_66_when_cwd_is_missing(tmp_path, run_dir):
    script = render_sbatch_script("r", run_dir, make_spec(cwd=str(tmp_path / "gone")), {"PATH": "/bin"}, [])
    (run_dir / "slurm.sbatch").write_text(script)
    proc = subprocess.run(["/bin/bash", str(run_dir / "slurm.sbatch")], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 66
    assert "cannot enter the run cwd" in proc.stderr


@pytest.mark.parametrize(
    ("scheduling", "gres"),
    [
        ({"marginal_vram_mb": 8000, "gpus": 2}, "--gres=gpu:2"),
        ({"marginal_vram_mb": 1, "gpus": 1}, "--gres=gpu:1"),
        ({"marginal_vram_mb": 0, "exclusive_gpu": True, "gpus": 1}, "--gres=gpu:1"),
        ({"marginal_vram_mb": 0, "exclusive_gpu": False, "gpus": 2}, None),  # CPU-only: gpus ignored
    ],
)
def test_gpu_mapping(run_dir, scheduling, gres):
    opts = sbatch_options(run_dir, make_spec(**scheduling))
    assert [o for o in opts if o.startswith("--gres")] == ([gres] if gres else [])
    env = {"CUDA_VISIBLE_DEVICES": "3", "GPU_DEVICE_ORDINAL": "3", "PATH": "/bin"}
    script = render_sbatch_script("r", run_dir, make_spec(**scheduling), env, [])
    if gres:  # SLURM sets the visible devices of its allocation: ours must not override them
        assert "CUDA_VISIBLE_DEVICES" not in script and "GPU_DEVICE_ORDINAL" not in script
        assert "export CUDA_DEVICE_ORDER=PCI_BUS_ID" in script
    else:
        assert "export CUDA_VISIBLE_DEVICES=''" in script
        assert "CUDA_DEVICE_ORDER" not in script


@pytest.mark.parametrize(
    ("timeout_s", "time"),
    [(None, None), (0.5, "--time=1"), (59, "--time=1"), (60, "--time=1"), (60.01, "--time=2"), (3600, "--time=60")],
)
def test_timeout_maps_to_whole_minutes_rounded_up(run_dir, timeout_s, time):
    opts = sbatch_options(run_dir, make_spec(timeout_s=timeout_s))
    assert [o for o in opts if o.startswith("--time")] == ([time] if time else [])


@pytest.mark.parametrize(("priority", "nice"), [("high", None), ("normal", None), ("low", "--nice=100")])
def test_priority_maps_to_nice_never_negative(run_dir, priority, nice):
    opts = sbatch_options(run_dir, make_spec(priority=priority))
    assert [o for o in opts if o.startswith("--nice")] == ([nice] if nice else [])


def test_priority_nice_is_configurable(run_dir):
    config = SlurmConfig(nice={"high": 0, "normal": 50, "low": 100})
    assert "--nice=50" in sbatch_options(run_dir, make_spec(priority="normal"), config=config)


def test_dependencies_partition_account_and_extra_args(fakes, run_dir):
    fakes.plan("sbatch", {"*": {"stdout": "99\n"}})
    ex = executor(fakes, partition="gpu", account="lab", extra_sbatch_args=["--qos=short", "-C", "a100 80gb"])
    assert ex.submit("r", run_dir, make_spec(), {"PATH": "/bin"}, ["11", "12"]) == "99"
    argv = fakes.calls("sbatch")[0]["argv"]
    assert "--dependency=afterok:11:12" in argv
    assert "--kill-on-invalid-dep=yes" in argv
    assert "--partition=gpu" in argv and "--account=lab" in argv
    # As given, in order, last but for the server's comment (sbatch keeps the last --comment).
    assert argv[-5:-1] == ["--qos=short", "-C", "a100 80gb", "--comment=evalsched:r:1"]
    script = (run_dir / "slurm.sbatch").read_text()
    assert "#SBATCH --dependency=afterok:11:12\n" in script
    assert '#SBATCH --qos=short -C "a100 80gb"\n#SBATCH --comment=evalsched:r:1\n' in script  # extra args: one line


def test_paths_with_blanks_and_percent_are_quoted_and_escaped(tmp_path):
    run_dir = tmp_path / "my runs" / "100%" / "r1"
    run_dir.mkdir(parents=True)
    opts = sbatch_options(run_dir, make_spec(cwd=str(tmp_path / "my runs")))
    # --output is a filename pattern: "%" must be doubled, or "%" followed by a letter is replaced.
    assert f"--output={tmp_path}/my runs/100%%/r1/stdout.log" in opts
    script = render_sbatch_script("r1", run_dir, make_spec(cwd=str(tmp_path / "my runs")), {}, [])
    assert f'#SBATCH --output="{tmp_path}/my runs/100%%/r1/stdout.log"\n' in script
    assert f'#SBATCH --chdir="{tmp_path}/my runs"\n' in script


def test_values_that_cannot_go_into_a_script_are_refused(tmp_path):
    run_dir = tmp_path / 'quote"d'
    run_dir.mkdir()
    with pytest.raises(SlurmError, match="cannot write the sbatch option"):
        render_sbatch_script("r", run_dir, make_spec(), {}, [])
    with pytest.raises(SlurmError, match="backslash"):
        sbatch_options(tmp_path / "back\\slash", make_spec())
    with pytest.raises(SlurmError, match="not a SLURM job id"):
        sbatch_options(tmp_path, make_spec(), ["12;rm -rf /"])


def test_job_name_is_sanitized(run_dir):
    opts = sbatch_options(run_dir, make_spec(name="my eval: v2/α"))
    assert "--job-name=evalsched-my_eval__v2__" in opts


def test_sbatch_error_raises_with_its_stderr(fakes, run_dir):
    fakes.plan(
        "sbatch",
        {
            "*": {
                "rc": 1,
                "stderr": "sbatch: error: Batch job submission failed: "
                "Invalid account or account/partition combination specified\n",
            }
        },
    )
    with pytest.raises(SlurmError, match="Invalid account or account/partition") as info:
        executor(fakes).submit("r", run_dir, make_spec(), {}, [])
    assert "exit 1" in str(info.value)


def test_sbatch_garbage_answer_raises(fakes, run_dir):
    fakes.plan("sbatch", {"*": {"stdout": "Submitted batch job\n"}})
    with pytest.raises(SlurmError, match="no job id"):
        executor(fakes).submit("r", run_dir, make_spec(), {}, [])


def test_missing_sbatch_raises(tmp_path, run_dir):
    ex = SlurmCli(SlurmConfig(commands=SlurmCommands(sbatch=str(tmp_path / "no-such-sbatch"))))
    with pytest.raises(SlurmError, match="sbatch not found"):
        ex.submit("r", run_dir, make_spec(), {}, [])


def test_hung_command_times_out(tmp_path, run_dir):
    hang = tmp_path / "hang"
    hang.write_text("#!/bin/sh\nexec sleep 30\n")
    hang.chmod(0o755)
    ex = SlurmCli(SlurmConfig(commands=SlurmCommands(squeue=str(hang)), command_timeout_s=0.5))
    with pytest.raises(SlurmError, match="did not answer in 0.5 s"):
        ex.poll(["1"])


# ----------------------------------------------------------------------------- parsing


def test_parse_squeue_real_output():
    jobs = parse_squeue(SQUEUE_REAL)
    assert set(jobs) == {"13", "15", "16", "17", "18", "19", "20", "21", "22"}
    assert jobs["16"] == SlurmJobState("16", "COMPLETED", "None", 0, None, True, "localhost", None)
    assert jobs["17"] == SlurmJobState("17", "FAILED", "NonZeroExitCode", 3, None, True, "localhost", None)
    assert jobs["18"] == SlurmJobState("18", "FAILED", "JobLaunchFailure", 0, 11, True, "localhost", None)
    assert jobs["18"].popen_exit_code == -11
    assert jobs["19"] == SlurmJobState("19", "RUNNING", "None", None, None, False, "localhost", None)
    assert jobs["20"].state == "CANCELLED" and jobs["20"].finished
    assert jobs["20"].reason == "DependencyNeverSatisfied" and jobs["20"].dependency == "afterok:17(failed)"
    assert jobs["20"].node is None  # "n/a": it never ran
    assert jobs["21"] == SlurmJobState(
        "21", "PENDING", "Dependency", None, None, False, None, "afterok:19(unfulfilled)"
    )
    # Cancelled, but its processes are still being killed: not finished, the run may still write.
    assert jobs["13"].state == "COMPLETING" and not jobs["13"].finished
    assert jobs["15"] == SlurmJobState("15", "TIMEOUT", "TimeLimit", 0, 15, True, "localhost", None)
    assert jobs["22"].state == "CANCELLED" and jobs["22"].finished


def test_parse_squeue_rejects_other_formats():
    with pytest.raises(SlurmError, match="unexpected squeue output"):
        parse_squeue("16 COMPLETED None\n")


def test_parse_scontrol_real_output():
    assert parse_scontrol_job(SCONTROL_FAILED_EXIT3) == SlurmJobState(
        "17", "FAILED", "NonZeroExitCode", 3, None, True, "localhost", None
    )
    segv = parse_scontrol_job(SCONTROL_SEGV)
    assert (segv.state, segv.exit_code, segv.signal, segv.popen_exit_code) == ("FAILED", 0, 11, -11)
    dep = parse_scontrol_job(SCONTROL_DEP_CANCELLED)
    assert (dep.state, dep.reason, dep.dependency, dep.node) == (
        "CANCELLED",
        "DependencyNeverSatisfied",
        "afterok:17(failed)",
        None,
    )
    pending = parse_scontrol_job(SCONTROL_PENDING)
    assert (pending.state, pending.finished, pending.exit_code, pending.node) == ("PENDING", False, None, None)
    assert parse_scontrol_job("") is None


def test_parse_scontrol_free_text_reason():
    line = SCONTROL_FAILED_EXIT3.replace("Reason=NonZeroExitCode", "Reason=launch failed requeued held")
    assert parse_scontrol_job(line).reason == "launch failed requeued held"


# ----------------------------------------------------------------------------- poll


def test_poll_200_jobs_is_one_squeue_plus_scontrol_for_the_missing_only(fakes):
    ids = [str(1000 + i) for i in range(200)]
    listed = ids[:190]
    states = [
        "PENDING|Priority|0|n/a",
        "RUNNING|None|0|localhost",
        "COMPLETED|None|0|localhost",
        "FAILED|NonZeroExitCode|256|localhost",
    ]
    lines = [f"{job}|{states[i % 4]}|(null)|" for i, job in enumerate(listed)]
    fakes.plan("squeue", {"*": {"stdout": "\n".join(reversed(lines)) + "\n"}})  # squeue's own order
    plan = {}
    for job in ids[190:195]:  # finished between the two calls: scontrol still knows them
        plan[job] = {"stdout": SCONTROL_FAILED_EXIT3.replace("JobId=17", f"JobId={job}")}
    for job in ids[195:]:  # purged
        plan[job] = {"rc": 1, "stderr": INVALID_JOB_ID}
    fakes.plan("scontrol", plan)

    ex = executor(fakes)
    result = ex.poll(ids)
    assert ex.calls == {"squeue": 1, "scontrol": 10}
    (squeue_call,) = fakes.calls("squeue")
    assert f"--jobs={','.join(ids)}" in squeue_call["argv"]
    assert "--states=all" in squeue_call["argv"] and "--noheader" in squeue_call["argv"]
    assert f"--Format={SQUEUE_FORMAT}" in squeue_call["argv"]
    assert sorted(c["argv"][-1] for c in fakes.calls("scontrol")) == ids[190:]
    assert list(result) == ids
    assert result["1000"].state == "PENDING" and not result["1000"].finished
    assert result["1001"].state == "RUNNING" and result["1001"].node == "localhost"
    assert result["1002"].state == "COMPLETED" and result["1002"].exit_code == 0
    assert result["1003"].state == "FAILED" and result["1003"].exit_code == 1
    assert result["1190"].state == "FAILED" and result["1190"].exit_code == 3 and result["1190"].finished
    assert result["1199"] == SlurmJobState("1199", "UNKNOWN", "purged", None, None, True)

    # A second poll is again one squeue.
    ex.poll(ids[:190])
    assert ex.calls["squeue"] == 2 and ex.calls["scontrol"] == 10


def test_poll_when_squeue_knows_none_of_the_jobs(fakes):
    # squeue --jobs=<one purged id> fails with "Invalid job id"; that is an answer, not an error.
    fakes.plan("squeue", {"*": {"rc": 1, "stderr": INVALID_JOB_ID}})
    fakes.plan("scontrol", {"*": {"rc": 1, "stderr": INVALID_JOB_ID}})
    ex = executor(fakes)
    result = ex.poll(["31337"])
    assert result["31337"].state == "UNKNOWN" and result["31337"].finished
    assert ex.calls == {"squeue": 1, "scontrol": 1}


def test_poll_raises_when_slurm_cannot_be_asked(fakes):
    fakes.plan(
        "squeue",
        {"*": {"rc": 1, "stderr": "slurm_load_jobs error: Unable to contact slurm controller (connect failure)\n"}},
    )
    with pytest.raises(SlurmError, match="Unable to contact slurm controller"):
        executor(fakes).poll(["1", "2"])
    fakes.plan("squeue", {"*": {"stdout": ""}})
    fakes.plan(
        "scontrol", {"*": {"rc": 1, "stderr": "slurm_load_jobs error: Socket timed out on send/recv operation\n"}}
    )
    with pytest.raises(SlurmError, match="Socket timed out"):
        executor(fakes).poll(["1"])


def test_poll_nothing_runs_nothing(fakes):
    ex = executor(fakes)
    assert ex.poll([]) == {}
    assert ex.calls == {}


def test_poll_dedupes_and_validates_ids(fakes):
    fakes.plan("squeue", {"*": {"stdout": "5|RUNNING|None|0|localhost|(null)|\n"}})
    ex = executor(fakes)
    assert list(ex.poll(["5", "5"])) == ["5"]
    assert "--jobs=5" in fakes.calls("squeue")[0]["argv"]
    with pytest.raises(SlurmError, match="not a SLURM job id"):
        ex.poll(["5,6"])


# ----------------------------------------------------------------------------- cancel


def test_cancel_runs_scancel(fakes):
    ex = executor(fakes)
    ex.cancel("77")
    assert [c["argv"] for c in fakes.calls("scancel")] == [["77"]]
    fakes.plan(
        "scancel", {"*": {"rc": 1, "stderr": "scancel: error: Kill job error on job id 77: Access/permission denied\n"}}
    )
    with pytest.raises(SlurmError, match="permission denied"):
        ex.cancel("77")
    fakes.plan(
        "scancel", {"*": {"rc": 1, "stderr": "scancel: error: Kill job error on job id 78: Invalid job id specified\n"}}
    )
    ex.cancel("78")  # already gone: nothing to do


# ----------------------------------------------------------------------------- verdict


def job(state, reason="None", exit_code=0, sig=None, dependency=None, node="localhost"):
    return SlurmJobState("42", state, reason, exit_code, sig, True, node, dependency)


@pytest.mark.parametrize(
    ("slurm", "expected_state", "expected_prefix"),
    [
        (job("CANCELLED", exit_code=0, sig=15), "cancelled", "cancelled: SLURM job 42 was cancelled (scancel)"),
        (job("CANCELLED", "Priority", node=None), "cancelled", "cancelled: "),
        (job("TIMEOUT", "TimeLimit", 0, 15), "failed", "timeout: SLURM job 42 reached its SLURM time limit"),
        (job("DEADLINE"), "failed", "timeout: "),
        (
            job("NODE_FAIL", "NodeDown", 0, None),
            "failed",
            "exit_code:0: node failure (SLURM job 42: NODE_FAIL on node localhost)",
        ),
        (job("BOOT_FAIL", node=None), "failed", "exit_code:0: node failure"),
        (job("NODE_FAIL", sig=9), "failed", "signal:SIGKILL: node failure"),
        (job("OUT_OF_MEMORY", "OutOfMemory", 0, 9), "failed", "signal:SIGKILL: out of memory"),
        (job("FAILED", "NonZeroExitCode", 3), "failed", "exit_code:3: the run process exited with status 3"),
        (job("FAILED", "JobLaunchFailure", 0, 11), "failed", "signal:SIGSEGV: the run process was killed by SIGSEGV"),
        (job("FAILED", "NonZeroExitCode", 0, 9), "failed", "signal:SIGKILL: "),
        (job("FAILED", "NonZeroExitCode", 0, 100), "failed", "signal:SIG100: "),
        (job("COMPLETED"), "failed", "exit_code:0: the run process exited with status 0 without finalizing"),
        (job("PREEMPTED", sig=15), "failed", "signal:SIGTERM: SLURM job 42 was preempted"),
        (job("UNKNOWN", "purged", None), "failed", "exit_code:unknown: SLURM job 42 is no longer known"),
    ],
)
def test_verdict(slurm, expected_state, expected_prefix):
    state, reason = verdict(slurm)
    assert state == expected_state
    assert reason.startswith(expected_prefix), reason


def test_verdict_dependency_never_satisfied_names_the_run():
    slurm = job("CANCELLED", "DependencyNeverSatisfied", dependency="afterok:17(failed)", node=None)
    assert verdict(slurm, {"17": "20261129T090000-000003"}) == (
        "failed",
        "dependency_failed:20261129T090000-000003: SLURM job 42 was cancelled because its dependency did not succeed",
    )
    # Several dependencies: the one that failed is named.
    slurm = job("CANCELLED", "DependencyNeverSatisfied", dependency="afterok:16(unfulfilled),afterok:17(failed)")
    assert verdict(slurm, {"16": "a", "17": "b"})[1].startswith("dependency_failed:b: ")
    # Without a mapping, the SLURM job id.
    assert verdict(slurm)[1].startswith("dependency_failed:17: ")


def test_verdict_refuses_an_unfinished_job():
    with pytest.raises(ValueError, match="not finished"):
        verdict(SlurmJobState("1", "COMPLETING", "None", None, None, False))


def test_reasons_start_with_a_contract_code():
    codes = ("cancelled", "timeout", "exit_code:", "signal:SIG", "dependency_failed:")
    for s in (
        "CANCELLED",
        "TIMEOUT",
        "DEADLINE",
        "NODE_FAIL",
        "BOOT_FAIL",
        "OUT_OF_MEMORY",
        "FAILED",
        "COMPLETED",
        "PREEMPTED",
        "SPECIAL_EXIT",
        "REVOKED",
        "UNKNOWN",
    ):
        state, reason = verdict(job(s, sig=None, exit_code=1))
        assert state in ("failed", "cancelled")
        assert reason.startswith(codes), reason
        assert ": " in reason  # a code, then a sentence


def test_pending_reason():
    jobs = parse_squeue(SQUEUE_REAL)
    assert pending_reason(jobs["21"]) == "waiting_dependency: SLURM job 21 waits for afterok:19(unfulfilled)"
    waiting = SlurmJobState("5", "PENDING", "Resources", None, None, False)
    assert pending_reason(waiting) == "waiting_cpu: SLURM job 5 is pending in SLURM (reason Resources)"
    assert pending_reason(waiting, uses_gpu=True).startswith("waiting_gpu_exclusive: ")


# ----------------------------------------------------------------------------- what a job is given


async def test_a_job_gets_only_what_a_run_needs_of_the_server_environment(jp_serverapp, fakes, monkeypatch):
    """The server's tokens and keys stay on this host; the spec's env, the run_env, the paths and
    library settings travel; the script is owner-only."""
    from waiting import async_wait_until

    from jupyter_evalsched.scheduler.executors.slurm import SlurmExecutor
    from jupyter_evalsched.scheduler.runs import Run, new_record

    for name, value in {
        "JUPYTER_TOKEN": "user-token-1",
        "AWS_SECRET_ACCESS_KEY": "aws-secret-2",
        "HF_TOKEN": "hub-token-3",
        "EVALSCHED_TOKEN": "client-token-4",
        "SOME_SERVICE_PASSWORD": "password-5",
        "UNRELATED_SETTING": "unrelated-6",
        "HF_HOME": "/data/hf",
        "SITE_SCRATCH": "/scratch/site",
    }.items():
        monkeypatch.setenv(name, value)
    fakes.plan("sbatch", {"*": {"stdout": "77\n"}})
    await jp_serverapp.extension_manager.start_all_extensions()
    sched = jp_serverapp.extension_manager.extension_points["jupyter_evalsched"].app.scheduler
    slurm = SlurmExecutor(executor(fakes, export_env=["SITE_SCRATCH"]))
    slurm.bind(sched.context)
    spec = make_spec(cwd="/tmp")
    spec["env"] = {"WANDB_API_KEY": "asked-for-7"}  # named by the spec: it travels
    run_id = "20261201T000000.000000-aaaaaa"
    record = new_record(run_id, spec, seq=1, executor="slurm", run_dir=str(sched.store.run_dir(run_id)))
    sched.store.create(run_id, {"spec.json": json.dumps(spec).encode(), "job.json": json.dumps(record).encode()})
    run = Run(record=record, spec=spec, submitted_ts=0)
    sched.table.add(run)
    slurm.submit(run)
    await async_wait_until(lambda: run.record["slurm_job_id"] == "77", timeout=10)

    script_path = sched.store.run_dir(run_id) / "slurm.sbatch"
    script = script_path.read_text()
    assert oct(script_path.stat().st_mode & 0o777) == "0o700"
    sbatch_env = fakes.calls("sbatch")[0]["env"]
    for secret in ("user-token-1", "aws-secret-2", "hub-token-3", "client-token-4", "password-5", "unrelated-6"):
        assert secret not in script, secret
        assert secret not in sbatch_env.values(), secret
    assert "export HF_HOME=/data/hf" in script and "export SITE_SCRATCH=/scratch/site" in script
    assert "export WANDB_API_KEY=asked-for-7" in script and f"export EVALSCHED_RUN_ID={run_id}" in script
    assert "export PATH=" in script and sbatch_env["PATH"]


# ----------------------------------------------------------------------------- at a stop


async def _run_in_a_gated_sbatch(api, fakes, monkeypatch) -> dict:
    """A no-op SLURM run submitted through the API, its ``sbatch`` (``GATED_SBATCH``) under way."""
    from waiting import async_wait_until

    (fakes.root / "sbatch").write_text(GATED_SBATCH.format(python=sys.executable, here=str(fakes.root)))
    monkeypatch.setenv("PATH", f"{fakes.root}{os.pathsep}{os.environ['PATH']}")
    code, rec = await api(
        "POST", "runs", {"entrypoint": "jupyter_evalsched.examples.basic:noop", "executor": "slurm", "cwd": "/tmp"}
    )
    assert code == 201, rec
    await async_wait_until(lambda: (fakes.root / "sbatch.called").exists(), timeout=20)
    return rec


GATED_SBATCH = """#!{python}
# sbatch that says it was called, then answers job 77 once the test opens the gate.
import os, sys, time
here = {here!r}
open(os.path.join(here, "sbatch.called"), "w").close()
deadline = time.monotonic() + 20
while not os.path.exists(os.path.join(here, "gate")) and time.monotonic() < deadline:
    time.sleep(0.01)
sys.stdout.write("77\\n")
"""


@pytest.mark.parametrize("evalsched_config", [{"slurm_enabled": True}])
@pytest.mark.parametrize("cancel", [False, True], ids=["queued", "cancelled"])
async def test_a_stop_waits_for_the_sbatch_under_way_and_sends_a_cancel_asked_meanwhile(
    api, evalsched, runs_dir, fakes, monkeypatch, cancel
):
    """The server stops while ``sbatch`` has not answered. The stop used to go on without it: the
    job's id never reached the run's record, so the next server handed the run to SLURM again (two
    jobs of one run), and a cancel asked meanwhile, which waits for that id, was never sent."""
    import threading

    rec = await _run_in_a_gated_sbatch(api, fakes, monkeypatch)
    if cancel:
        code, answer = await api("POST", f"runs/{rec['id']}/cancel")
        assert code == 200, answer
    # The gate opens only once the stop has begun (it does not wait for a timer: a stop that
    # does not wait for sbatch blocks in the I/O pool's shutdown until then, and returns first).
    opener = threading.Timer(0.3, (fakes.root / "gate").touch)
    opener.start()
    try:
        await evalsched.stop()
    finally:
        opener.cancel()
    record = json.loads((runs_dir / rec["id"] / "job.json").read_text())
    assert record["slurm_job_id"] == "77", record
    assert record["state"] == "queued", record  # SLURM has the job: the next server tracks it
    scancels = [c["argv"] for c in fakes.calls("scancel")]
    assert scancels == ([["77"]] if cancel else []), scancels


@pytest.mark.parametrize("evalsched_config", [{"slurm_enabled": True}])
async def test_a_run_cancelled_while_its_sbatch_ran_says_it_is_ending_once_it_has_a_job(
    api, evalsched, fakes, monkeypatch
):
    """Cancelled while ``sbatch`` ran: once the job id is known, the job is scancel'd and the
    record says the run is ending (it said ``waiting_cpu: SLURM job 77 submitted, not yet
    scheduled``, a job nobody would wait for)."""
    from waiting import async_wait_until

    rec = await _run_in_a_gated_sbatch(api, fakes, monkeypatch)
    code, answer = await api("POST", f"runs/{rec['id']}/cancel")
    assert code == 200 and answer["state"] == "queued" and answer["cancel_requested"], answer
    (fakes.root / "gate").touch()
    run = evalsched.get(rec["id"])
    await async_wait_until(lambda: run.record["slurm_job_id"] == "77", timeout=20)
    assert run.record["why"]["code"] == "cancelling", run.record
    assert run.record["reason"].endswith("scancel of SLURM job 77 asked; it ends once SLURM says the job ended")
    await async_wait_until(lambda: [c["argv"] for c in fakes.calls("scancel")] == [["77"]], timeout=20)
