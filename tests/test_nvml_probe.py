"""The NVML probe's real code against a faithful fake of ``pynvml`` (tests/fake_nvml): devices,
processes (compute and graphics, MIG), and what NVML does wrong on real hosts (containers, a GPU
lost, a driver missing or older than the bindings)."""

from __future__ import annotations

import inspect
import logging
import sys

import pytest
from fake_nvml import pynvml as fake

from jupyter_evalsched.doctor import gpu_check
from jupyter_evalsched.scheduler.gpus import GpuInfo, GpuProcess, NvmlProbe
from jupyter_evalsched.scheduler.ledger import account

A100 = {"name": "NVIDIA A100-SXM4-80GB", "memory_mb": 81920}
L4 = {"name": "NVIDIA L4", "memory_mb": 23034}


@pytest.fixture
def nvml(tmp_path, monkeypatch):
    """``nvml(devices, **top)``: the fake's GPUs from now on (also mid-test)."""
    path = str(tmp_path / "nvml.json")
    monkeypatch.setenv(fake.STATE_ENV, path)

    def set_state(devices: list[dict], **top) -> None:
        fake.write_state(path, {"driver": "550.54.15", "devices": devices, **top})

    return set_state


def proc(pid: int, used_mb: int | None, name: str | None = None) -> dict:
    return {"pid": pid, "used_mb": used_mb, **({"name": name} if name else {})}


def test_the_fake_has_the_real_bindings_names_and_parameters():
    # What makes it faithful: the probe can only call what the fake has, and the fake has only
    # what the installed nvidia-ml-py has, with the same parameters.
    functions = [name for name in dir(fake) if name.startswith("nvml") and callable(getattr(fake, name))]
    assert len(functions) >= 20
    for name in functions:
        assert hasattr(fake.real, name), f"the real bindings have no {name}"
        ours, theirs = inspect.signature(getattr(fake, name)), inspect.signature(getattr(fake.real, name))
        assert list(ours.parameters) == list(theirs.parameters), name


def test_devices_by_nvml_index_with_their_total_in_mib(nvml):
    nvml([A100, L4])
    probe = NvmlProbe(nvml=fake)
    assert probe.error is None and probe.problem is None
    assert probe.devices() == [
        GpuInfo(index=0, name="NVIDIA A100-SXM4-80GB", total_mb=81920),
        GpuInfo(index=1, name="NVIDIA L4", total_mb=23034),
    ]
    assert probe.driver_version() == "550.54.15"
    assert gpu_check(probe)["status"] == "ok"
    assert "2 GPU(s): 0: NVIDIA A100-SXM4-80GB 81920 MB; 1: NVIDIA L4 23034 MB" in gpu_check(probe)["detail"]


def test_without_an_argument_the_probe_imports_pynvml(nvml, monkeypatch):
    nvml([L4])
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    assert NvmlProbe().devices()[0].total_mb == 23034


def test_a_process_in_both_lists_is_counted_once_at_its_larger_figure(nvml):
    # nvidia-smi's "C+G": one process, one figure for its memory on the GPU, listed twice. Summing
    # would count VRAM that does not exist as unmanaged.
    nvml(
        [
            {
                **A100,
                "compute": [proc(10, 4000), proc(12, 1000)],
                "graphics": [proc(10, 5000), proc(11, 300, "/usr/lib/xorg/Xorg")],
            },
            {**L4, "compute": [proc(10, 700)]},  # the same process on another GPU is another figure
        ]
    )
    processes = NvmlProbe(nvml=fake).processes()
    assert sorted(processes, key=lambda p: (p.device, p.pid)) == [
        GpuProcess(pid=10, device=0, used_mb=5000),
        GpuProcess(pid=11, device=0, used_mb=300, name="/usr/lib/xorg/Xorg"),  # as NVML names it
        GpuProcess(pid=12, device=0, used_mb=1000),
        GpuProcess(pid=10, device=1, used_mb=700),
    ]
    assert account(processes).unmanaged[0].mb == 6300


def test_a_process_whose_memory_nvml_cannot_tell_is_listed_at_0_mb(nvml):
    nvml([{**A100, "compute": [proc(10, None), proc(11, 2048)]}])
    assert NvmlProbe(nvml=fake).processes() == [GpuProcess(10, 0, 0), GpuProcess(11, 0, 2048)]


def test_process_lists_not_supported_leave_the_gpus_and_are_said_once(nvml, caplog):
    # What a container without the host's PID namespace may get: the GPUs, but no process lists.
    nvml(
        [{**A100, "processes_error": "NOT_SUPPORTED", "compute": [proc(10, 4000)]}, {**L4, "compute": [proc(11, 1000)]}]
    )
    probe = NvmlProbe(nvml=fake)
    caplog.set_level(logging.WARNING, logger="jupyter_evalsched.scheduler.gpus")
    for _ in range(3):
        assert probe.processes() == [GpuProcess(11, 1, 1000)]
    assert [d.index for d in probe.devices()] == [0, 1]
    assert probe.problem == "GPU 0 processes: NVMLError_NotSupported: Not Supported"
    assert [r.getMessage() for r in caplog.records] == ["NVML: GPU 0 processes: NVMLError_NotSupported: Not Supported"]
    check = gpu_check(probe)
    assert check["status"] == "degraded" and "GPU 0 processes: NVMLError_NotSupported" in check["detail"]
    assert "--pid=host" in check["fix"]


def test_one_list_not_supported_is_an_empty_list(nvml, monkeypatch):
    # Not Supported on one list only (a GPU without graphics) is no problem: the other is read.
    nvml([{**A100, "compute": [proc(10, 4000)]}])

    def unsupported(handle):
        raise fake.NVMLError(fake.NVML_ERROR_NOT_SUPPORTED)

    monkeypatch.setattr(fake, "nvmlDeviceGetGraphicsRunningProcesses", unsupported)
    probe = NvmlProbe(nvml=fake)
    assert probe.processes() == [GpuProcess(10, 0, 4000)] and probe.problem is None


@pytest.mark.parametrize("privileged", [False, True])
def test_a_mig_gpu_is_one_device_holding_the_processes_of_its_instances(nvml, privileged):
    mig = {
        "enabled": True,
        "max": 7,
        "instances": [
            {"memory_mb": 9856, "compute": [proc(20, 3000)], "graphics": [proc(20, 3000)]},
            None,  # an empty slot
            {"memory_mb": 9856, "compute": [proc(21, 1500), proc(22, None)]},
        ],
    }
    nvml([{**L4, "compute": [proc(10, 100)]}, {**A100, "mig": mig}], privileged=privileged)
    probe = NvmlProbe(nvml=fake)
    # The whole GPU, once: runs are placed by GPU index (CUDA_VISIBLE_DEVICES), not by MIG instance.
    assert probe.devices() == [
        GpuInfo(index=0, name="NVIDIA L4", total_mb=23034),
        GpuInfo(index=1, name="NVIDIA A100-SXM4-80GB", total_mb=81920),
    ]
    # From the instances' lists: the parent's need privileges, and would count them twice with them.
    assert sorted(probe.processes(), key=lambda p: p.pid) == [
        GpuProcess(10, 0, 100),
        GpuProcess(20, 1, 3000),
        GpuProcess(21, 1, 1500),
        GpuProcess(22, 1, 0),
    ]
    assert probe.problem is None


def test_a_mig_capable_gpu_with_mig_off_is_read_as_any_gpu(nvml):
    nvml([{**A100, "compute": [proc(10, 100)], "mig": {"enabled": False, "max": 7, "instances": []}}])
    assert NvmlProbe(nvml=fake).processes() == [GpuProcess(10, 0, 100)]


def test_a_gpu_lost_mid_run_keeps_its_last_processes_and_the_others_go_on(nvml, caplog):
    nvml([{**A100, "compute": [proc(10, 4000)]}, {**L4, "compute": [proc(11, 1000)]}])
    probe = NvmlProbe(nvml=fake)
    assert len(probe.devices()) == 2 and len(probe.processes()) == 2
    caplog.set_level(logging.WARNING, logger="jupyter_evalsched.scheduler.gpus")
    nvml([{**A100, "lost": True}, {**L4, "compute": [proc(11, 1000), proc(12, 2000)]}])
    # What GPU 0 held is not shown free because NVML stopped answering about it.
    for _ in range(2):
        assert probe.processes() == [GpuProcess(10, 0, 4000), GpuProcess(11, 1, 1000), GpuProcess(12, 1, 2000)]
    assert probe.problem == "GPU 0 processes: NVMLError_GpuIsLost: GPU is lost"
    assert probe.devices() == [GpuInfo(index=1, name="NVIDIA L4", total_mb=23034)]
    assert "GPU 0: NVMLError_GpuIsLost" in probe.problem
    assert gpu_check(probe)["status"] == "degraded"
    assert len([r for r in caplog.records if "GPU 0 processes" in r.getMessage()]) == 1
    nvml([{**A100, "compute": []}, {**L4}])  # back (after a reset): its processes are read again
    assert probe.processes() == [] and probe.devices()[0].index == 0 and probe.problem is None


@pytest.mark.parametrize(
    "init_error, error",
    [
        ("LIBRARY_NOT_FOUND", "NVMLError_LibraryNotFound: NVML Shared Library Not Found"),
        ("DRIVER_NOT_LOADED", "NVMLError_DriverNotLoaded: Driver Not Loaded"),
    ],
)
def test_a_missing_driver_is_a_host_without_gpus_that_says_why(nvml, init_error, error):
    nvml([A100], init_error=init_error)
    probe = NvmlProbe(nvml=fake)
    assert (probe.error, probe.devices(), probe.processes(), probe.driver_version()) == (error, [], [], None)
    check = gpu_check(probe)
    assert check["status"] == "degraded" and f"NVML unavailable ({error})" in check["detail"]


def test_a_driver_older_than_the_bindings_is_read_through_the_v2_lists(nvml):
    # The unversioned lists call _v3, which a driver before R510 lacks: the bindings then raise
    # NVMLLibraryMismatchError, which is no NVMLError.
    missing = ["nvmlDeviceGetComputeRunningProcesses_v3", "nvmlDeviceGetGraphicsRunningProcesses_v3"]
    nvml([{**A100, "compute": [proc(10, 4000)], "graphics": [proc(11, 10)]}], missing_functions=missing)
    probe = NvmlProbe(nvml=fake)
    assert probe.processes() == [GpuProcess(10, 0, 4000), GpuProcess(11, 0, 10)]
    assert probe.problem is None
