"""Device nodes and /dev/char links: the plan (pure) and the actuator (real mknod in a
temporary root, never the host's /dev)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from conftest import require_root
from gpuguard.engine.executor import ChangeExecutor
from gpuguard.host.inventory import Gpu, Inventory
from gpuguard.host.paths import Root
from gpuguard.journal.log import EventLog
from gpuguard.steps.device_nodes import apply_all, observe_nodes, plan_nodes
from gpuguard.steps.device_nodes.actuate import DeviceNodeActuator, modprobe_args
from gpuguard.steps.device_nodes.reconcile import CreateCharLink, CreateDeviceNode, plan

PROC_DEVICES = """Character devices:
  1 mem
195 nvidia
236 nvidia-caps
511 nvidia-uvm

Block devices:
  8 sd
"""

INV = Inventory(gpus=(Gpu("GPU-a", 0, 0, "0:0"), Gpu("GPU-b", 1, 1, "0:1")), source="test")


def _root(tmp_path: Path, proc_devices: str = PROC_DEVICES) -> Root:
    (tmp_path / "proc").mkdir()
    (tmp_path / "proc/devices").write_text(proc_devices)
    (tmp_path / "dev").mkdir()
    return Root(tmp_path)


def _mknod(root: Root, path: str, major: int, minor: int) -> None:
    os.mknod(root.path(path), stat.S_IFCHR | 0o666, os.makedev(major, minor))


def test_no_driver_means_nothing_to_do(tmp_path: Path) -> None:
    root = _root(tmp_path, "Character devices:\n  1 mem\n\nBlock devices:\n")
    view = observe_nodes(root, INV)
    assert not view.loaded
    assert plan_nodes(view, create_nodes=True, create_links=True) == ((), ())


def test_plan_creates_missing_nodes_and_links(tmp_path: Path) -> None:
    require_root()
    root = _root(tmp_path)
    _mknod(root, "/dev/nvidia0", 195, 0)  # one exists already
    findings, actions = plan_nodes(observe_nodes(root, INV), create_nodes=True, create_links=True)
    created = sorted(a.path for a in actions if isinstance(a, CreateDeviceNode))
    assert created == [
        "/dev/nvidia-uvm",
        "/dev/nvidia-uvm-tools",
        "/dev/nvidia1",
        "/dev/nvidiactl",
    ]
    links = sorted(a.link for a in actions if isinstance(a, CreateCharLink))
    assert links == [
        "/dev/char/195:0",
        "/dev/char/195:1",
        "/dev/char/195:255",
        "/dev/char/511:0",
        "/dev/char/511:1",
    ]
    assert findings == ()


def test_actuator_makes_them_with_numbers_modes_and_links(tmp_path: Path) -> None:
    require_root()
    root = _root(tmp_path)
    _, actions = plan_nodes(observe_nodes(root, INV), create_nodes=True, create_links=True)
    outcomes = apply_all(
        DeviceNodeActuator(root, EventLog(level="error")), actions, ChangeExecutor()
    )
    assert {o.status for o in outcomes} == {"done"}
    st = os.lstat(root.path("/dev/nvidia-uvm"))
    assert stat.S_ISCHR(st.st_mode) and os.major(st.st_rdev) == 511 and os.minor(st.st_rdev) == 0
    assert stat.S_IMODE(st.st_mode) == 0o666
    assert os.readlink(root.path("/dev/char/195:1")) == "../nvidia1"
    # a second pass has nothing to do
    assert plan_nodes(observe_nodes(root, INV), create_nodes=True, create_links=True) == ((), ())


def test_wrong_numbers_are_reported_never_replaced(tmp_path: Path) -> None:
    require_root()
    root = _root(tmp_path)
    _mknod(root, "/dev/nvidia1", 195, 7)
    findings, actions = plan_nodes(observe_nodes(root, INV), create_nodes=True, create_links=True)
    assert [f.kind for f in findings] == ["device-node-mismatch"]
    assert "/dev/nvidia1" not in [getattr(a, "path", "") for a in actions]
    assert "/dev/char/195:1" not in [getattr(a, "link", "") for a in actions]


def test_wrong_link_is_replaced_atomically(tmp_path: Path) -> None:
    require_root()
    root = _root(tmp_path)
    for name, mi in (("nvidia0", 0), ("nvidia1", 1), ("nvidiactl", 255)):
        _mknod(root, f"/dev/{name}", 195, mi)
    for name, mi in (("nvidia-uvm", 0), ("nvidia-uvm-tools", 1)):
        _mknod(root, f"/dev/{name}", 511, mi)
    root.path("/dev/char").mkdir()
    os.symlink("../nvidia1", root.path("/dev/char/195:0"))  # points at another GPU
    _, actions = plan_nodes(observe_nodes(root, INV), create_nodes=True, create_links=True)
    replace = [a for a in actions if isinstance(a, CreateCharLink) and a.replace]
    assert [a.link for a in replace] == ["/dev/char/195:0"]
    apply_all(DeviceNodeActuator(root, EventLog(level="error")), actions, ChangeExecutor())
    assert os.readlink(root.path("/dev/char/195:0")) == "../nvidia0"
    assert not [p for p in root.path("/dev/char").iterdir() if p.name.startswith(".")]


def test_switches_off_become_findings(tmp_path: Path) -> None:
    root = _root(tmp_path)
    findings, actions = plan_nodes(observe_nodes(root, INV), create_nodes=False, create_links=False)
    assert actions == ()
    assert {f.kind for f in findings} == {"device-node-missing"}


def test_dry_run_touches_nothing(tmp_path: Path) -> None:
    root = _root(tmp_path)
    _, actions = plan_nodes(observe_nodes(root, INV), create_nodes=True, create_links=True)
    before = sorted(p.name for p in root.path("/dev").iterdir())
    outcomes = apply_all(
        DeviceNodeActuator(root, EventLog(level="error")), actions, ChangeExecutor(dry_run=True)
    )
    assert {o.status for o in outcomes} == {"dry-run"}
    assert sorted(p.name for p in root.path("/dev").iterdir()) == before


@pytest.mark.parametrize(
    ("role", "minor", "args"),
    [
        ("gpu", 3, ["-c", "3"]),
        ("ctl", 255, ["-c", "0"]),
        ("uvm", 0, ["-u", "-c", "0"]),
        ("uvm-tools", 1, ["-u", "-c", "0"]),
        ("modeset", 254, ["-m"]),
        ("cap", 1, None),
    ],
)
def test_modprobe_args(role: str, minor: int, args: list[str] | None) -> None:
    a = CreateDeviceNode("device_nodes", "r", "/dev/x", path="/dev/x", minor=minor, role=role)
    assert modprobe_args(a) == args


def test_plan_is_pure_over_given_views() -> None:
    from gpuguard.devices.devchar import LinkState
    from gpuguard.devices.nodes import DeviceNode

    n = DeviceNode("/dev/nvidia0", 195, 0, "gpu")
    findings, actions = plan(
        [n], [n], [LinkState(n, "/dev/char/195:0", "ok")], create_nodes=True, create_links=True
    )
    assert findings == () and actions == ()
