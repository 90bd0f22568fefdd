"""The container access step's actuators: each honours dry-run, writes one rule per
write(2), and says what failed (the kernel's own verdicts: test_devices_cgroup_v1.py)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from gpuguard.engine.executor import ChangeExecutor
from gpuguard.model import Outcome
from gpuguard.steps.container_access.actuate import confirm_v1, device_allow_change, v1_change
from gpuguard.steps.container_access.reconcile import CgroupV1Allow, UnitDeviceAllow

RULES = ("c 195:0 rw", "c 195:255 rw")


def apply_allow(a: CgroupV1Allow, *, dry_run: bool) -> Outcome:
    """What the step does for each container: write, then read back."""
    return confirm_v1(ChangeExecutor(dry_run=dry_run).run(v1_change(a)))


def allow(cgroup: Path) -> CgroupV1Allow:
    return CgroupV1Allow("container_access", "denied", "c1", cgroup_dir=str(cgroup), rules=RULES)


def test_dry_run_writes_nothing(tmp_path: Path) -> None:
    (tmp_path / "devices.allow").write_text("")
    o = apply_allow(allow(tmp_path), dry_run=True)
    assert (o.status, o.detail) == ("dry-run", "would write c 195:0 rw; c 195:255 rw")
    assert (tmp_path / "devices.allow").read_text() == ""


def test_each_rule_is_written_and_read_back(tmp_path: Path) -> None:
    (tmp_path / "devices.allow").write_text("")
    (tmp_path / "devices.list").write_text("c 1:3 rwm\nc 195:0 rw\nc 195:255 rw\n")
    o = apply_allow(allow(tmp_path), dry_run=False)
    assert (o.status, o.detail) == ("done", "wrote c 195:0 rw; c 195:255 rw")
    assert (tmp_path / "devices.allow").read_text() == "".join(RULES)


def test_a_grant_undone_before_its_read_back_is_not_reported_done(tmp_path: Path) -> None:
    """systemd's re-apply (deny all, then its own allows) can undo the write at once."""
    (tmp_path / "devices.allow").write_text("")
    (tmp_path / "devices.list").write_text("c 1:3 rwm\nc 195:255 rw\n")
    o = apply_allow(allow(tmp_path), dry_run=False)
    assert o.status == "failed"
    assert "does not admit c 195:0 rw read back" in o.detail and "devices.list" in o.detail
    (tmp_path / "devices.list").write_text("a *:* rwm\n")  # allow mode: all admitted
    assert apply_allow(allow(tmp_path), dry_run=False).status == "done"


def test_a_container_gone_is_a_failure_naming_the_file(tmp_path: Path) -> None:
    o = apply_allow(allow(tmp_path / "gone"), dry_run=False)
    assert o.status == "failed" and f"{tmp_path}/gone/devices.allow does not exist" in o.detail


def test_device_allow_dry_run_and_bus_down() -> None:
    a = UnitDeviceAllow("container_access", "durable", "s", unit="cri-containerd-x.scope",
                        devices=(("/dev/char/195:0", "rw"),))  # fmt: skip
    dry = asyncio.run(ChangeExecutor(dry_run=True).run_async(device_allow_change(a, None, None)))
    assert (dry.status, dry.detail) == ("dry-run", "would set DeviceAllow= /dev/char/195:0")
    down = asyncio.run(ChangeExecutor(dry_run=False).run_async(device_allow_change(a, None, None)))
    assert (down.status, down.detail) == ("failed", "system bus down; the next pass retries")


def test_a_read_back_that_is_no_file_fails_at_once(tmp_path: Path) -> None:
    """devices.list read back as every other devices.list read: a FIFO in a fake root
    is refused (never waited on), a vanished one means the cgroup went away."""
    import os

    (tmp_path / "devices.allow").write_text("")
    os.mkfifo(tmp_path / "devices.list")
    o = apply_allow(allow(tmp_path), dry_run=False)
    assert o.status == "failed" and f"{tmp_path}/devices.list" in o.detail
    (tmp_path / "devices.list").unlink()
    o = apply_allow(allow(tmp_path), dry_run=False)
    assert o.status == "failed" and f"{tmp_path} is gone" in o.detail
