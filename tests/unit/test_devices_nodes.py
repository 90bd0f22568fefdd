"""nodes.py: /proc/devices, NVIDIA node listing, expected nodes; caps.py: MIG capability
minors; devchar.py: /dev/char links."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import pytest

from gpuguard.devices import nodes
from gpuguard.devices.caps import parse_cap_access, read_cap_minors
from gpuguard.devices.devchar import check_dev_char_links, dev_char_link
from gpuguard.devices.nodes import (
    NvidiaMajors,
    expected_nodes,
    list_nvidia_nodes,
    nvidia_majors,
    parse_proc_devices,
    read_loaded_modules,
    read_proc_devices,
)
from gpuguard.host.paths import Root
from unit.test_devices_support import fake_stat, make_node

# Driver >= 550.40 (nvidia/nvidiactl names; caps-imex-channels beside nvidia-caps, the
# pair that fooled a substring match in kubernetes-sigs/dra-driver-nvidia-gpu#304).
PROC_DEVICES_550 = """\
Character devices:
  1 mem
  4 /dev/vc/0
  4 tty
  4 ttyS
  5 /dev/tty
  5 /dev/console
  5 /dev/ptmx
  7 vcs
 10 misc
 13 input
 21 sg
 29 fb
128 ptm
136 pts
180 usb
189 usb_device
195 nvidia
195 nvidiactl
226 drm
234 nvidia-caps-imex-channels
238 nvidia-nvswitch
239 nvidia-nvlink
510 nvidia-uvm
511 nvidia-caps

Block devices:
  7 loop
  8 sd
  9 md
259 blkext
"""

# Before 550.40: nvidia-frontend; seed 004's uvm major 237.
PROC_DEVICES_OLD = """\
Character devices:
  1 mem
195 nvidia-frontend
237 nvidia-uvm
238 nvidia-caps

Block devices:
  8 sd
"""


@dataclass(frozen=True)
class Mig:
    uuid: str
    gi: int
    ci: int


@dataclass(frozen=True)
class Gpu:
    uuid: str
    index: int
    minor: int
    mig: tuple[Mig, ...] = ()


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (PROC_DEVICES_550, NvidiaMajors(195, 510, 511)),
        (PROC_DEVICES_OLD, NvidiaMajors(195, 237, 238)),
        ("Character devices:\n  1 mem\n", NvidiaMajors(None, None, None)),
        ("", NvidiaMajors(None, None, None)),
        # a block driver with an NVIDIA-like name is not a character major
        ("Character devices:\n\nBlock devices:\n195 nvidia\n", NvidiaMajors(None, None, None)),
        ("Character devices:\n234 nvidia-caps-imex-channels\n", NvidiaMajors(None, None, None)),
        ("garbage\n195 nvidia\n", NvidiaMajors(None, None, None)),  # no section header
    ],
)
def test_nvidia_majors(text: str, expected: NvidiaMajors) -> None:
    assert nvidia_majors(parse_proc_devices(text)) == expected


def test_parse_proc_devices_sections() -> None:
    p = parse_proc_devices(PROC_DEVICES_550)
    assert (4, "/dev/vc/0") in p.char
    assert p.block[0] == (7, "loop")
    assert p.char_major("nvidia-caps") == 511


@pytest.mark.parametrize(
    ("text", "minor"),
    [
        ("DeviceFileMinor: 12\nDeviceFileMode: 256\nDeviceFileModify: 1\n", 12),
        ("DeviceFileMode: 292\nDeviceFileMinor: 2\n", 2),
        ("DeviceFileMinor: x\n", None),
        ("", None),
    ],
)
def test_parse_cap_access(text: str, minor: int | None) -> None:
    assert parse_cap_access(text) == minor


@pytest.fixture
def fake_nodes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(nodes, "_stat", fake_stat)


def _host(tmp_path: Path) -> Root:
    dev = tmp_path / "dev"
    make_node(dev / "nvidia0", 195, 0)
    make_node(dev / "nvidia1", 195, 1)
    make_node(dev / "nvidiactl", 195, 255)
    make_node(dev / "nvidia-uvm", 510, 0)
    make_node(dev / "nvidia-uvm-tools", 510, 1)
    make_node(dev / "nvidia-caps" / "nvidia-cap1", 511, 1, mode=0o400)
    make_node(dev / "nvidia-nvswitch0", 238, 0)
    make_node(dev / "null", 1, 3)
    (dev / "nvidia-weird").mkdir()  # not a node
    (dev / "nvidia-link").symlink_to("nvidia0")  # not a node itself
    return Root(tmp_path)


def test_list_nvidia_nodes(tmp_path: Path, fake_nodes: None) -> None:
    root = _host(tmp_path)
    got = {
        n.path: (n.numbers, n.role, n.mode)
        for n in list_nvidia_nodes(root, NvidiaMajors(195, 510, 511))
    }
    assert got == {
        "/dev/nvidia0": ("195:0", "gpu", 0o666),
        "/dev/nvidia1": ("195:1", "gpu", 0o666),
        "/dev/nvidiactl": ("195:255", "ctl", 0o666),
        "/dev/nvidia-uvm": ("510:0", "uvm", 0o666),
        "/dev/nvidia-uvm-tools": ("510:1", "uvm-tools", 0o666),
        "/dev/nvidia-caps/nvidia-cap1": ("511:1", "cap", 0o400),
        "/dev/nvidia-nvswitch0": ("238:0", "other", 0o666),
    }


def test_list_nvidia_nodes_missing_dev(tmp_path: Path) -> None:
    assert list_nvidia_nodes(Root(tmp_path), NvidiaMajors(195, None, None)) == ()


def test_expected_nodes_with_mig() -> None:
    gpus = [Gpu("GPU-b", 1, 1), Gpu("GPU-a", 0, 0, (Mig("MIG-x", 1, 0),))]
    caps = {"gpu0/mig/gi1/access": 21, "gpu0/mig/gi1/ci0/access": 22, "mig/config": 1}
    got = expected_nodes(gpus, NvidiaMajors(195, 510, 511), caps, modeset=True)
    assert [(n.path, n.numbers, n.role) for n in got] == [
        ("/dev/nvidia0", "195:0", "gpu"),
        ("/dev/nvidia1", "195:1", "gpu"),
        ("/dev/nvidiactl", "195:255", "ctl"),
        ("/dev/nvidia-modeset", "195:254", "modeset"),
        ("/dev/nvidia-uvm", "510:0", "uvm"),
        ("/dev/nvidia-uvm-tools", "510:1", "uvm-tools"),
        ("/dev/nvidia-caps/nvidia-cap1", "511:1", "cap"),
        ("/dev/nvidia-caps/nvidia-cap21", "511:21", "cap"),
        ("/dev/nvidia-caps/nvidia-cap22", "511:22", "cap"),
    ]
    assert got[-1].cap == "gpu0/mig/gi1/ci0/access"
    assert [dev_char_link(n) for n in got[:1]] == [("/dev/char/195:0", "../nvidia0")]
    assert dev_char_link(got[-1]) == ("/dev/char/511:22", "../nvidia-caps/nvidia-cap22")
    assert got[0].allow_line() == "c 195:0 rw"


def test_expected_nodes_without_uvm_module() -> None:
    got = expected_nodes([Gpu("GPU-a", 0, 0)], NvidiaMajors(195, None, None), {})
    assert [n.path for n in got] == ["/dev/nvidia0", "/dev/nvidiactl"]
    assert expected_nodes([Gpu("GPU-a", 0, 0)], NvidiaMajors(None, None, None), {}) == ()


def test_read_cap_minors(tmp_path: Path) -> None:
    base = tmp_path / "proc/driver/nvidia/capabilities"
    (base / "gpu0/mig/gi1/ci0").mkdir(parents=True)
    (base / "mig").mkdir()
    (base / "mig/config").write_text("DeviceFileMinor: 1\nDeviceFileMode: 256\n")
    (base / "mig/monitor").write_text("DeviceFileMinor: 2\nDeviceFileMode: 292\n")
    (base / "gpu0/mig/gi1/access").write_text("DeviceFileMinor: 21\n")
    (base / "gpu0/mig/gi1/ci0/access").write_text("DeviceFileMinor: 22\n")
    (base / "gpu0/mig/gi1/README").write_text("nothing\n")
    assert read_cap_minors(Root(tmp_path)) == {
        "mig/config": 1,
        "mig/monitor": 2,
        "gpu0/mig/gi1/access": 21,
        "gpu0/mig/gi1/ci0/access": 22,
    }
    assert read_cap_minors(Root(tmp_path / "none")) == {}


def test_dev_char_links(tmp_path: Path, fake_nodes: None) -> None:
    root = _host(tmp_path)
    char = tmp_path / "dev/char"
    char.mkdir()
    (char / "195:0").symlink_to("../nvidia0")  # udev style
    (char / "195:1").symlink_to("/dev/nvidia1")  # nvidia-ctk style, resolved under root
    (char / "195:255").symlink_to("../nvidia0")  # wrong device
    (char / "510:1").symlink_to("../gone")
    want = expected_nodes([Gpu("a", 0, 0), Gpu("b", 1, 1)], NvidiaMajors(195, 510, None), {})
    states = {s.link: s.state for s in check_dev_char_links(root, want)}
    assert states == {
        "/dev/char/195:0": "ok",
        "/dev/char/195:1": "ok",
        "/dev/char/195:255": "wrong",
        "/dev/char/510:0": "missing",
        "/dev/char/510:1": "wrong",
    }


def test_readers(tmp_path: Path) -> None:
    (tmp_path / "proc").mkdir()
    (tmp_path / "proc/devices").write_text(PROC_DEVICES_OLD)
    (tmp_path / "proc/modules").write_text(
        "nvidia_uvm 1531904 0 - Live 0x0000000000000000 (POE)\n"
        "nvidia_modeset 1314816 0 - Live 0x0000000000000000 (POE)\n"
    )
    assert nvidia_majors(read_proc_devices(Root(tmp_path))).uvm == 237
    assert "nvidia_modeset" in read_loaded_modules(Root(tmp_path))
    assert read_proc_devices(Root(tmp_path / "x")).char == ()
    assert read_loaded_modules(Root(tmp_path / "x")) == frozenset()


def test_real_stat_is_default() -> None:
    st = nodes._stat(Path("/dev/null"), True)
    assert (os.major(st.st_rdev), os.minor(st.st_rdev)) == (1, 3)
