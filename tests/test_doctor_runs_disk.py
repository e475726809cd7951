"""The doctor's ``runs disk`` check: a file system of ext4's driver without a journal slows file
creation in the runs directory as runs come faster (every run replaces three files, and the
kernel skips the free inodes freed in the last minute at every new one), so the doctor says so,
with the fix; where the kernel's files cannot be read, it says it does not know.

The kernel's own files (mountinfo, /sys/dev/block, /sys/fs/ext4, /proc/fs/jbd2) are laid out in
a directory for each case; the last test reads this host's."""

from __future__ import annotations

import os

import pytest

from jupyter_evalsched.doctor import mount_of, runs_disk_check

MOUNTINFO = b"""\
22 1 252:0 / / rw,relatime shared:1 - ext4 /dev/vda rw
30 22 0:26 / /dev/shm rw,nosuid,nodev shared:4 - tmpfs tmpfs rw
41 22 252:16 / /data rw,relatime shared:9 - ext4 /dev/mapper/vg-data rw
42 41 0:40 / /data/my\\040runs rw,relatime shared:10 - tmpfs tmpfs rw
43 41 0:41 / /data/a\\011b\\134c rw,relatime - tmpfs tmpfs rw
44 22 0:42 / /mnt/caf\xe9 rw,relatime - tmpfs tmpfs rw
45 22 0:43 / /srv rw - tmpfs tmpfs rw
46 45 252:32 / /srv rw - ext2 /dev/vdc rw
"""


def test_the_mount_that_holds_a_path_is_the_longest_prefix():
    assert mount_of("/", MOUNTINFO) == ("/", "ext4", "252:0", "/dev/vda")
    assert mount_of("/home/u/runs", MOUNTINFO)[:3] == ("/", "ext4", "252:0")
    assert mount_of("/dev/shm/runs", MOUNTINFO)[:3] == ("/dev/shm", "tmpfs", "0:26")
    assert mount_of("/data/runs", MOUNTINFO) == ("/data", "ext4", "252:16", "/dev/mapper/vg-data")
    assert mount_of("/data/my runs/x", MOUNTINFO)[:2] == ("/data/my runs", "tmpfs")  # (\040: a space)
    assert mount_of("/data/a\tb\\c/x", MOUNTINFO)[:2] == ("/data/a\tb\\c", "tmpfs")  # (a tab, a backslash)
    assert mount_of(os.fsdecode(b"/mnt/caf\xe9/x"), MOUNTINFO)[1] == "tmpfs"  # (a name not in UTF-8)
    assert mount_of("/srv/runs", MOUNTINFO)[:2] == ("/srv", "ext2")  # (the overmount, listed after)
    assert mount_of("/database", MOUNTINFO)[0] == "/"  # (a prefix of the name is not a parent)
    assert mount_of("/x", b"garbage\n\n1 2 3\n") is None


@pytest.fixture
def kernel(tmp_path):
    """A mountinfo, /sys/dev/block, /sys/fs/ext4 and /proc/fs/jbd2 of our own: vda (/), dm-1
    (/data) and vdc (/srv, ext2 served by ext4's driver)."""
    (tmp_path / "mountinfo").write_bytes(MOUNTINFO)
    block = tmp_path / "block"
    block.mkdir()
    os.symlink("../../devices/pci0000:00/0000:00:05.0/virtio2/block/vda", block / "252:0")
    os.symlink("../../devices/virtual/block/dm-1", block / "252:16")
    os.symlink("../../devices/pci0000:00/0000:00:07.0/virtio4/block/vdc", block / "252:32")

    def doctor(runs_dir: str, tasks: dict[str, str | None], journals: list[str] | None = None) -> dict:
        """``tasks``: device -> its journal_task's text (None: a kernel without the file); each
        device named is ext4's. ``journals``: /proc/fs/jbd2's entries (None: no such directory)."""
        ext4 = tmp_path / f"ext4-{len(list(tmp_path.iterdir()))}"
        for device, task in tasks.items():
            (ext4 / device).mkdir(parents=True)
            if task is not None:
                (ext4 / device / "journal_task").write_text(task + "\n")
        jbd2 = tmp_path / f"jbd2-{len(list(tmp_path.iterdir()))}"
        if journals is not None:
            jbd2.mkdir()
            for name in journals:
                (jbd2 / name).mkdir()
        return runs_disk_check(runs_dir, str(tmp_path / "mountinfo"), str(block), str(ext4), str(jbd2))

    return doctor


def test_ext4_without_a_journal_is_degraded_with_the_fix(kernel):
    check = kernel("/data/runs", {"vda": "jbd2/vda-8", "dm-1": "<none>"})
    assert check["name"] == "runs disk" and check["status"] == "degraded", check
    assert check["detail"].startswith("/data/runs is on ext4 (/data) without a journal (/dev/mapper/vg-data)")
    assert "EvalSchedApp.runs_dir" in check["fix"] and "tune2fs -O has_journal /dev/mapper/vg-data" in check["fix"]
    # ext2, served by ext4's driver, has none either.
    assert kernel("/srv/runs", {"vdc": "<none>"})["status"] == "degraded"


def test_ext4_with_a_journal_or_another_file_system_is_ok(kernel):
    check = kernel("/home/u/runs", {"vda": "jbd2/vda-8", "dm-1": "<none>"})
    assert check["status"] == "ok" and check["detail"] == "/home/u/runs is on ext4 (/), with a journal", check
    check = kernel("/dev/shm/runs", {"vda": "<none>"})
    assert check["status"] == "ok" and check["detail"] == "/dev/shm/runs is on tmpfs (/dev/shm)", check
    # ext4's name, but not ext4's driver (no /sys/fs/ext4 entry): not judged.
    assert kernel("/home/u/runs", {})["status"] == "ok"


def test_a_kernel_without_journal_task_is_told_by_proc_fs_jbd2(kernel):
    assert kernel("/data/runs", {"dm-1": None}, ["vda-8", "dm-1-8"])["status"] == "ok"
    assert kernel("/data/runs", {"dm-1": None}, ["vda-8"])["status"] == "degraded"
    assert kernel("/data/runs", {"dm-1": None}, [])["status"] == "degraded"
    # An external journal's entry is its own device's name: whose it is, not known.
    check = kernel("/data/runs", {"dm-1": None}, ["sdb1"])
    assert check["status"] == "ok" and "whether it has a journal is not known" in check["detail"], check
    # No /proc/fs/jbd2 (hidden /proc/fs, or no journal anywhere: not told apart): not known.
    check = kernel("/data/runs", {"dm-1": None}, None)
    assert check["status"] == "ok" and "not known" in check["detail"], check


def test_what_cannot_be_read_is_said_and_not_degraded(tmp_path):
    check = runs_disk_check("/x", str(tmp_path / "none"))
    assert check["status"] == "ok" and "not known" in check["detail"], check
    (tmp_path / "mountinfo").write_bytes(MOUNTINFO)
    check = runs_disk_check("/data/runs", str(tmp_path / "mountinfo"), str(tmp_path / "nowhere"))
    assert check["status"] == "ok" and check["detail"] == "/data/runs is on ext4 (/data)", check


async def test_the_servers_doctor_checks_its_runs_directorys_disk(api, runs_dir):
    code, doctor = await api("GET", "doctor")
    assert code == 200
    [check] = [c for c in doctor["checks"] if c["name"] == "runs disk"]
    assert check["detail"].startswith(f"{runs_dir} is on "), check
    assert check["status"] in ("ok", "degraded") and (check["status"] == "ok") == (check["fix"] is None), check
    # This host's own word, where it has one: /sys/fs/ext4/<device>/journal_task.
    with open("/proc/self/mountinfo", "rb") as f:
        point, fstype, devno, source = mount_of(str(runs_dir), f.read())
    try:
        device = os.path.basename(os.readlink(f"/sys/dev/block/{devno}"))
        with open(f"/sys/fs/ext4/{device}/journal_task") as f:
            unjournaled = f.read().strip() == "<none>"
    except OSError:
        return
    assert check["status"] == ("degraded" if unjournaled else "ok"), check
