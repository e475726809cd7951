"""What the virtual probe's server tests check, on the NVML probe: the real ``NvmlProbe`` of a real
server, with the fake ``pynvml`` (tests/fake_nvml) as its library and no virtual GPUs. The shared
tests are imported from their modules and run here with this module's fixtures: a planted process
table becomes the fake's GPUs and their compute processes."""

from __future__ import annotations

import json
import os
import sys

import pytest
import test_leases
import test_observed
import test_primary
from fake_nvml import pynvml as fake
from live_server import cli
from rest import submit
from waiting import async_wait_until

from jupyter_evalsched.scheduler.gpus import NvmlProbe

# Unmanaged VRAM, observed peaks and enforcement of runs, leases charged max(lease, observed),
# kernels named by their notebook.
test_a_run_over_its_declaration_is_observed_and_warned_about = (
    test_observed.test_a_run_over_its_declaration_is_observed_and_warned_about
)
test_within_its_tolerance_a_run_gets_no_warning = test_observed.test_within_its_tolerance_a_run_gets_no_warning
test_with_enforcement_a_run_over_its_declaration_is_stopped = (
    test_observed.test_with_enforcement_a_run_over_its_declaration_is_stopped
)
test_auto_declares_the_highest_observed_peak_plus_the_margin = (
    test_observed.test_auto_declares_the_highest_observed_peak_plus_the_margin
)
test_unmanaged_vram_changes_are_ledger_events = test_leases.test_unmanaged_vram_changes_are_ledger_events
test_a_lease_holder_is_charged_the_larger_of_its_lease_and_its_use = (
    test_leases.test_a_lease_holder_is_charged_the_larger_of_its_lease_and_its_use
)
test_a_process_that_already_holds_vram_is_not_charged_twice_for_its_lease = (
    test_leases.test_a_process_that_already_holds_vram_is_not_charged_twice_for_its_lease
)
test_a_real_kernel_is_named_in_the_ledger_with_its_notebook = (
    test_leases.test_a_real_kernel_is_named_in_the_ledger_with_its_notebook
)
test_a_kernel_of_another_server_is_named_from_its_process = (
    test_leases.test_a_kernel_of_another_server_is_named_from_its_process
)


# test_primary's server has one GPU (its evalsched_config): so has theirs here.
@pytest.mark.parametrize("evalsched_config", [{"virtual_gpus": [24000]}])
async def test_unmanaged_vram_holds_back_a_run_until_it_goes(api, evalsched, plant_gpu_processes):
    await test_primary.test_unmanaged_vram_holds_back_a_run_until_it_goes(api, evalsched, plant_gpu_processes)


@pytest.mark.parametrize("evalsched_config", [{"virtual_gpus": [24000]}])
async def test_our_own_processes_are_never_counted_as_unmanaged(api, evalsched, plant_gpu_processes):
    await test_primary.test_our_own_processes_are_never_counted_as_unmanaged(api, evalsched, plant_gpu_processes)


@pytest.fixture
def nvml_state(tmp_path, monkeypatch):
    """The fake's state file; ``pynvml`` is the fake for this test's server (it runs in this process)."""
    path = str(tmp_path / "nvml.json")
    monkeypatch.setenv(fake.STATE_ENV, path)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    return path


@pytest.fixture
def jp_server_config(jp_server_config, nvml_state):
    """The shared tests' server, its virtual GPUs turned into the fake's GPUs, without processes."""
    app = dict(jp_server_config["EvalSchedApp"])
    app.pop("virtual_gpu_processes")
    fake.write_state(nvml_state, fake.state_from_table(app["virtual_gpus"], []))
    # No virtual GPUs: the app falls back to its gpu_probe_class. No reserve, so that the NVML GPUs
    # have the virtual ones' usable figures the shared tests assert.
    app.update(virtual_gpus=[], gpu_probe_class=NvmlProbe, reserve_vram_mb=0)
    return {**jp_server_config, "EvalSchedApp": app}


@pytest.fixture
def gpu_source():
    return "nvml"


def fake_state(path: str, table: list[dict]) -> dict:
    """The fake's GPUs as they are, with the compute processes of a virtual process table."""
    with open(path, encoding="utf-8") as f:
        sizes = [d["memory_mb"] for d in json.load(f)["devices"]]
    return fake.state_from_table(sizes, table)


@pytest.fixture
def plant_gpu_processes(nvml_state, evalsched):
    """The shared tests' ``plant(table)``: the table's entries become the fake's compute processes."""
    # Else these tests would pass on any probe, and prove nothing about this one.
    assert isinstance(evalsched.probe, NvmlProbe) and evalsched.probe.error is None, evalsched.probe.error

    def plant(entries: list[dict]) -> None:
        fake.write_state(nvml_state, fake_state(nvml_state, entries))

    return plant


async def ledger_when(api, check) -> dict:
    async def probe():
        code, ledger = await api("GET", "ledger")
        return ledger if check(ledger["devices"]) else None

    return await async_wait_until(probe, timeout=15)


async def test_a_gpu_lost_mid_run_leaves_the_server_scheduling_on_the_others(api, nvml_state, plant_gpu_processes):
    state = fake_state(
        nvml_state, [{"pid": 999998, "gpu": 0, "used_mb": 3000}, {"pid": 999999, "gpu": 1, "used_mb": 1000}]
    )
    fake.write_state(nvml_state, state)
    await ledger_when(api, lambda d: (d[0]["unmanaged_mb"], d[1]["unmanaged_mb"]) == (3000, 1000))
    state["devices"][0]["lost"] = True
    state["devices"][1]["compute"][0]["used_mb"] = 5000
    fake.write_state(nvml_state, state)
    # The sweep goes on reading GPU 1; GPU 0 keeps what it held when NVML stopped answering.
    devices = (await ledger_when(api, lambda d: d[1]["unmanaged_mb"] == 5000))["devices"]
    assert devices[0]["unmanaged_mb"] == 3000
    rec = await submit(api, test_observed.spec(vram=1000))
    await test_observed.until(api, rec["id"], lambda r: r["state"] == "succeeded")
    code, doctor = await api("GET", "doctor")
    gpus = next(c for c in doctor["checks"] if c["name"] == "gpus")
    assert gpus["status"] == "degraded" and "GPU 0 processes: NVMLError_GpuIsLost: GPU is lost" in gpus["detail"]


async def test_a_run_listed_as_compute_and_graphics_is_observed_once(api, tmp_path, nvml_state, plant_gpu_processes):
    # Counted twice, it would be over its declaration: warned about, or killed with enforce_vram=kill.
    body, pid_file, gate = test_observed.gated(tmp_path, "both", 8000)
    rec = await submit(api, body)
    pid = await test_observed.running_pid(api, rec["id"], pid_file)
    gpu = (await test_observed.record(api, rec["id"]))["devices"][0]
    state = fake_state(nvml_state, [{"pid": pid, "gpu": gpu, "used_mb": 6000}])
    state["devices"][gpu]["graphics"] = [{"pid": pid, "used_mb": 6000}]
    fake.write_state(nvml_state, state)
    await observed_until_it_ends(api, rec["id"], gate, {str(gpu): 6000})


async def test_a_run_in_a_mig_instance_is_observed_on_its_gpu(api, tmp_path, nvml_state, plant_gpu_processes):
    body, pid_file, gate = test_observed.gated(tmp_path, "mig", 8000)
    rec = await submit(api, body)
    pid = await test_observed.running_pid(api, rec["id"], pid_file)
    gpu = (await test_observed.record(api, rec["id"]))["devices"][0]
    state = fake_state(nvml_state, [])
    instances = [None, {"memory_mb": 11968, "compute": [{"pid": pid, "used_mb": 5000}]}]
    state["devices"][gpu]["mig"] = {"enabled": True, "max": 7, "instances": instances}
    fake.write_state(nvml_state, state)
    await observed_until_it_ends(api, rec["id"], gate, {str(gpu): 5000})


async def observed_until_it_ends(api, run_id: str, gate, peaks: dict) -> None:
    await test_observed.until(api, run_id, lambda r: r["observed"] and r["observed"]["peak_vram_mb"])
    gate.touch()
    final = await test_observed.until(api, run_id, lambda r: r["state"] == "succeeded")
    assert final["observed"]["peak_vram_mb"] == peaks and final["warnings"] == []


async def test_process_lists_not_supported_are_in_the_doctor_and_the_gpus_stay(api, nvml_state, plant_gpu_processes):
    state = fake_state(nvml_state, [{"pid": 999999, "gpu": 0, "used_mb": 3000}])
    state["devices"][0]["processes_error"] = "NOT_SUPPORTED"
    fake.write_state(nvml_state, state)
    code, doctor = await api("GET", "doctor")
    gpus = next(c for c in doctor["checks"] if c["name"] == "gpus")
    assert gpus["status"] == "degraded" and "GPU 0 processes: NVMLError_NotSupported" in gpus["detail"]
    code, ledger = await api("GET", "ledger")
    assert [(d["usable_mb"], d["unmanaged_mb"]) for d in ledger["devices"]] == [(24000, 0), (24000, 0)]


def test_a_process_with_the_fake_first_on_its_path_reads_gpus_through_it(tmp_path):
    # The other way in: a fresh process whose ``import pynvml`` finds the fake (the doctor, no server).
    path = str(tmp_path / "nvml.json")
    state = fake.state_from_table([24000, 81920], [])
    state["devices"][1]["processes_error"] = "NOT_SUPPORTED"
    fake.write_state(path, state)
    env = {
        "PYTHONPATH": os.path.dirname(fake.__file__),
        fake.STATE_ENV: path,
        "EVALSCHED_VIRTUAL_GPUS": "",
        "JUPYTER_RUNTIME_DIR": str(tmp_path),
    }
    proc = cli(None, "doctor", "--json", with_server=False, env=env)
    gpus = next(c for c in json.loads(proc.stdout) if c["name"] == "gpus")
    assert gpus["status"] == "degraded", gpus
    assert gpus["detail"].startswith(
        "NVML, driver 550.54.15: 2 GPU(s): 0: NVIDIA Fake GPU 24000 MB; 1: NVIDIA Fake GPU 81920 MB; "
        "NVML fails on GPU 1 processes: NVMLError_NotSupported: Not Supported"
    )
