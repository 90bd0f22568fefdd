"""A container scope's drop-in (actuate/dropins.py), on fake roots: exactly the nodes
granted, added to and never reset, written atomically into a real directory, read back;
a file or directory gpuguard did not make is refused, never written through; removed
only once the scope is gone. And the durable grant writes it before its D-Bus call."""

from __future__ import annotations

import asyncio
import os
import stat
from pathlib import Path
from typing import Any

import pytest

from gpuguard.actuate.dropins import (
    DROPIN_NAME,
    DropInError,
    list_dropins,
    read_dropin,
    remove_dropin,
    write_device_dropin,
)
from gpuguard.engine.executor import ChangeExecutor
from gpuguard.host.paths import Root
from gpuguard.host.systemd import SystemdError
from gpuguard.steps.container_access.actuate import device_allow_change, dropin_remove_change
from gpuguard.steps.container_access.durable import plan_dropin_removal
from gpuguard.steps.container_access.reconcile import UnitDeviceAllow
from unit.test_new_scope_read import _scope

UNIT = f"cri-containerd-{'c' * 64}.scope"
GPU0, CTL = ("/dev/char/195:0", "rw"), ("/dev/char/195:255", "rw")


def _dir(root: Path, unit: str = UNIT) -> Path:
    return root / "run/systemd/system" / f"{unit}.d"


@pytest.fixture
def host(tmp_path: Path) -> Path:
    """A fake root with systemd's runtime unit directory, as a systemd host has."""
    (tmp_path / "run/systemd/system").mkdir(parents=True)
    return tmp_path


def test_written_with_exactly_the_nodes_and_added_to(host: Path) -> None:
    root = Root(host)
    path = write_device_dropin(root, UNIT, [GPU0])
    f = _dir(host) / DROPIN_NAME
    assert path == str(f)
    text = f.read_text()
    assert "[Scope]\nDeviceAllow=/dev/char/195:0 rw\n" in text
    assert [line for line in text.splitlines() if line.startswith("DeviceAllow")] == [
        "DeviceAllow=/dev/char/195:0 rw"
    ]
    assert stat.S_IMODE(f.stat().st_mode) == 0o644
    assert stat.S_IMODE(f.parent.stat().st_mode) == 0o755
    write_device_dropin(root, UNIT, [CTL, GPU0])  # a later grant: added, nothing reset
    assert read_dropin(root, UNIT) == [GPU0, CTL]
    ino = f.stat().st_ino
    write_device_dropin(root, UNIT, [GPU0])  # nothing new: not written again
    assert f.stat().st_ino == ino
    assert not [n for n in os.listdir(f.parent) if n != DROPIN_NAME]  # no temp file left


def test_nothing_or_not_a_scope_or_no_systemd_is_refused(tmp_path: Path) -> None:
    root = Root(tmp_path)
    with pytest.raises(DropInError, match="no such directory; is systemd running"):
        write_device_dropin(root, UNIT, [GPU0])  # systemd's "booted" mark is never made
    with pytest.raises(DropInError, match="empty DeviceAllow= resets"):
        write_device_dropin(root, UNIT, [])
    for unit in ("../../etc/x.scope", "kubelet.service", "cri-containerd-xyz.scope"):
        with pytest.raises(DropInError, match="not a container scope"):
            write_device_dropin(root, unit, [GPU0])
    assert not (tmp_path / "run").exists()


def test_a_file_gpuguard_did_not_write_is_left_alone(host: Path) -> None:
    d = _dir(host)
    d.mkdir(parents=True)
    (d / DROPIN_NAME).write_text("[Scope]\nDeviceAllow=\nDeviceAllow=/dev/sda rwm\n")
    with pytest.raises(DropInError, match="is not a line gpuguard writes"):
        write_device_dropin(Root(host), UNIT, [GPU0])
    with pytest.raises(DropInError, match="is not a line gpuguard writes"):
        remove_dropin(Root(host), UNIT)
    assert "/dev/sda" in (d / DROPIN_NAME).read_text()


def test_a_link_or_a_fifo_is_refused_and_nothing_written_through_it(host: Path) -> None:
    elsewhere = host / "elsewhere"
    elsewhere.mkdir()
    _dir(host).symlink_to(elsewhere)
    with pytest.raises(DropInError, match="symbolic link"):
        write_device_dropin(Root(host), UNIT, [GPU0])
    assert list(elsewhere.iterdir()) == []
    (elsewhere / DROPIN_NAME).write_text("[Scope]\nDeviceAllow=/dev/char/195:0 rw\n")
    with pytest.raises(DropInError, match="is not a directory; gpuguard leaves it alone"):
        remove_dropin(Root(host), UNIT)  # a file of its format, but through a link
    assert (elsewhere / DROPIN_NAME).is_file()
    assert list_dropins(Root(host)) == frozenset()  # not planned for removal at all
    other = f"cri-containerd-{'d' * 64}.scope"
    _dir(host, other).mkdir()
    os.mkfifo(_dir(host, other) / DROPIN_NAME)
    with pytest.raises(DropInError, match="not a regular file"):
        write_device_dropin(Root(host), other, [GPU0])


def test_listed_and_removed_with_its_empty_directory(host: Path) -> None:
    root = Root(host)
    other = f"crio-{'e' * 64}.scope"
    write_device_dropin(root, UNIT, [GPU0])
    write_device_dropin(root, other, [GPU0])
    (_dir(host, other) / "10-admin.conf").write_text("[Scope]\nCPUWeight=50\n")
    (host / "run/systemd/system/kubelet.service.d").mkdir()
    assert list_dropins(root) == {UNIT, other}
    remove_dropin(root, UNIT)
    assert not _dir(host).exists()
    remove_dropin(root, other)  # an admin's file beside it: the directory stays
    assert os.listdir(_dir(host, other)) == ["10-admin.conf"]
    assert list_dropins(root) == frozenset()


class Bus:
    """The durable grant's D-Bus call, recording whether the drop-in was there first."""

    def __init__(self, root: Path, fail: bool = False) -> None:
        self.root, self.fail = root, fail
        self.calls: list[tuple[str, bool]] = []

    async def set_unit_properties(self, unit: str, runtime: bool, props: Any) -> None:
        self.calls.append((unit, (_dir(self.root, unit) / DROPIN_NAME).is_file()))
        if self.fail:
            raise SystemdError("org.freedesktop.systemd1.Manager.SetUnitProperties: timeout")


def _allow(unit: str = UNIT) -> UnitDeviceAllow:
    return UnitDeviceAllow("container_access", "durable", unit, unit=unit, devices=(GPU0, CTL))


def test_the_grant_writes_its_drop_in_before_the_call(host: Path) -> None:
    bus = Bus(host)
    o = asyncio.run(
        ChangeExecutor(dry_run=False).run_async(device_allow_change(_allow(), bus, Root(host)))
    )  # type: ignore[arg-type]
    assert bus.calls == [(UNIT, True)]
    assert o.status == "done" and f"{_dir(host) / DROPIN_NAME} written first" in o.detail
    assert read_dropin(Root(host), UNIT) == [GPU0, CTL]


def test_a_failed_call_keeps_the_drop_in_and_says_so(host: Path) -> None:
    bus = Bus(host, fail=True)
    o = asyncio.run(
        ChangeExecutor(dry_run=False).run_async(device_allow_change(_allow(), bus, Root(host)))
    )  # type: ignore[arg-type]
    assert o.status == "failed" and "timeout" in o.detail and "written first" in o.detail
    assert read_dropin(Root(host), UNIT) == [GPU0, CTL]  # the container's own nodes


def test_no_drop_in_still_calls_systemd(tmp_path: Path) -> None:
    (tmp_path / "run/systemd").mkdir(parents=True)
    (tmp_path / "run/systemd/system").write_text("not a directory")
    bus = Bus(tmp_path)
    o = asyncio.run(
        ChangeExecutor(dry_run=False).run_async(device_allow_change(_allow(), bus, Root(tmp_path)))
    )  # type: ignore[arg-type]
    assert o.status == "done" and "no drop-in:" in o.detail and "is systemd running" in o.detail
    assert bus.calls == [(UNIT, False)]


def test_dry_run_says_what_the_real_run_writes_and_writes_nothing(host: Path) -> None:
    bus = Bus(host)
    o = asyncio.run(
        ChangeExecutor(dry_run=True).run_async(device_allow_change(_allow(), bus, Root(host)))
    )  # type: ignore[arg-type]
    assert o.status == "dry-run" and bus.calls == []
    assert o.detail == (
        f"would write {_dir(host) / DROPIN_NAME} and set DeviceAllow= "
        "/dev/char/195:0, /dev/char/195:255"
    )
    assert list((host / "run/systemd/system").iterdir()) == []
    # no systemd runtime unit directory: the real run writes no drop-in, nor says the dry run
    (host / "run/systemd/system").rmdir()
    o = asyncio.run(
        ChangeExecutor(dry_run=True).run_async(device_allow_change(_allow(), bus, Root(host)))
    )  # type: ignore[arg-type]
    assert o.detail == "would set DeviceAllow= /dev/char/195:0, /dev/char/195:255"


def test_removal_is_planned_for_scopes_not_live_and_checked_again(host: Path) -> None:
    root = Root(host)
    gone, back = f"cri-containerd-{'a' * 64}.scope", UNIT
    live = f"cri-containerd-{'b' * 64}.scope"
    for u in (gone, back, live):
        write_device_dropin(root, u, [GPU0])
    plan = plan_dropin_removal(list_dropins(root), {live})
    assert [a.unit for a in plan] == [gone, back]
    _scope(host, (42,), unit=back)  # started again after the pass looked
    by_unit = {a.unit: a for a in plan}
    dry = ChangeExecutor(dry_run=True).run(dropin_remove_change(by_unit[gone], root))
    assert dry.status == "dry-run" and (_dir(host, gone) / DROPIN_NAME).is_file()
    assert (
        ChangeExecutor(dry_run=False).run(dropin_remove_change(by_unit[back], root)).status
        == "skipped"
    )
    done = ChangeExecutor(dry_run=False).run(dropin_remove_change(by_unit[gone], root))
    assert done.status == "done" and str(_dir(host, gone)) in done.detail
    assert list_dropins(root) == {back, live}
