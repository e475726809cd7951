"""The doctor's ``runs disk`` check: ext4 without a journal slows file creation in the runs
directory as runs come faster (every run replaces three files, and the kernel checks each inode
freed in the last minute at every new one), so the doctor says so, with the fix.

The kernel's own files (mountinfo, /sys/dev/block, /proc/fs/jbd2) are laid out in a directory
for each case; the last test reads this host's."""

from __future__ import annotations

import os

import pytest

from jupyter_evalsched.doctor import mount_of, runs_disk_check

MOUNTINFO = """\
22 1 252:0 / / rw,relatime shared:1 - ext4 /dev/vda rw
30 22 0:26 / /dev/shm rw,nosuid,nodev shared:4 - tmpfs tmpfs rw
41 22 252:16 / /data rw,relatime shared:9 - ext4 /dev/vdb rw
42 41 0:40 / /data/my\\040runs rw,relatime shared:10 - tmpfs tmpfs rw
"""


def test_the_mount_that_holds_a_path_is_the_longest_prefix(tmp_path):
    assert mount_of("/", MOUNTINFO) == ("/", "ext4", "252:0")
    assert mount_of("/home/u/runs", MOUNTINFO) == ("/", "ext4", "252:0")
    assert mount_of("/dev/shm/runs", MOUNTINFO) == ("/dev/shm", "tmpfs", "0:26")
    assert mount_of("/data/runs", MOUNTINFO) == ("/data", "ext4", "252:16")
    assert mount_of("/data/my runs/x", MOUNTINFO) == ("/data/my runs", "tmpfs", "0:40")  # (\040: a space)
    assert mount_of("/database", MOUNTINFO) == ("/", "ext4", "252:0")  # (a prefix of the name is not a parent)
    assert mount_of("/x", "garbage\n\n1 2 3\n") is None


@pytest.fixture
def kernel(tmp_path):
    """A mountinfo, /sys/dev/block and /proc/fs/jbd2 of our own: vda (/) and vdb (/data)."""
    (tmp_path / "mountinfo").write_text(MOUNTINFO)
    block = tmp_path / "block"
    block.mkdir()
    os.symlink("../../devices/pci0000:00/0000:00:05.0/virtio2/block/vda", block / "252:0")
    os.symlink("../../devices/pci0000:00/0000:00:06.0/virtio3/block/vdb", block / "252:16")
    jbd2 = tmp_path / "jbd2"
    jbd2.mkdir()

    def doctor(runs_dir: str, journals: list[str] | None) -> dict:
        for entry in jbd2.iterdir():
            entry.rmdir()
        for name in journals or []:
            (jbd2 / name).mkdir()
        where = str(jbd2) if journals is not None else str(tmp_path / "no-jbd2")
        return runs_disk_check(runs_dir, str(tmp_path / "mountinfo"), str(block), where)

    return doctor


def test_ext4_without_a_journal_is_degraded_with_the_fix(kernel):
    check = kernel("/data/runs", ["vda-8"])  # (the other disk has one)
    assert check["name"] == "runs disk" and check["status"] == "degraded", check
    assert check["detail"].startswith("/data/runs is on ext4 (/data) without a journal (vdb)"), check
    assert "EvalSchedApp.runs_dir" in check["fix"] and "tune2fs -O has_journal /dev/vdb" in check["fix"]
    # No jbd2 at all: no ext4 mount of the host has a journal.
    assert kernel("/home/u/runs", None)["status"] == "degraded"


def test_ext4_with_a_journal_or_another_file_system_is_ok(kernel):
    check = kernel("/home/u/runs", ["vda-8"])
    assert check["status"] == "ok" and check["detail"] == "/home/u/runs is on ext4 (/), with a journal", check
    check = kernel("/dev/shm/runs", [])
    assert check["status"] == "ok" and check["detail"] == "/dev/shm/runs is on tmpfs (/dev/shm)", check


def test_what_cannot_be_read_is_said_and_not_degraded(kernel, tmp_path):
    check = runs_disk_check("/x", str(tmp_path / "none"))
    assert check["status"] == "ok" and "not known" in check["detail"], check
    check = runs_disk_check("/data/runs", str(tmp_path / "mountinfo"), str(tmp_path / "nowhere"))
    assert check["status"] == "ok" and "whether it has a journal is not known" in check["detail"], check


async def test_the_servers_doctor_checks_its_runs_directorys_disk(api, runs_dir):
    code, doctor = await api("GET", "doctor")
    assert code == 200
    [check] = [c for c in doctor["checks"] if c["name"] == "runs disk"]
    assert check["detail"].startswith(f"{os.path.realpath(runs_dir)} is on ") or check["detail"].startswith(
        f"{runs_dir} is on "
    ), check
    with open("/proc/self/mountinfo") as f:
        point, fstype, devno = mount_of(str(runs_dir), f.read())
    journals = os.listdir("/proc/fs/jbd2") if os.path.isdir("/proc/fs/jbd2") else []
    device = os.path.basename(os.readlink(f"/sys/dev/block/{devno}")) if fstype == "ext4" else None
    unjournaled = fstype == "ext4" and not any(j.rpartition("-")[0] == device for j in journals)
    assert check["status"] == ("degraded" if unjournaled else "ok"), check
