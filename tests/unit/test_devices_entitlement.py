"""entitlement.py: nodes in the container's /dev, cross-checked, never more."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import pytest

from gpuguard.devices import nodes
from gpuguard.devices.containers import ContainerCgroup
from gpuguard.devices.entitlement import (
    Entitlement,
    VisibleDevices,
    compute_entitlement,
    parse_environ,
    parse_visible_devices,
    read_entitlement,
)
from gpuguard.devices.nodes import DeviceNode, NvidiaMajors, expected_nodes
from gpuguard.host.paths import Root
from unit.test_devices_support import fake_stat, make_node

MAJORS = NvidiaMajors(195, 237, 238)


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


GPUS = (
    Gpu("GPU-aaaa", 0, 0),
    Gpu("GPU-bbbb", 1, 1, (Mig("MIG-cccc", 1, 0),)),
)
HOST = expected_nodes(GPUS, MAJORS, {})


def _n(path: str, major: int, minor: int) -> DeviceNode:
    return DeviceNode(path, major, minor, nodes.classify(path, major, minor, MAJORS))


CTR_GPU0 = (
    _n("/dev/nvidia0", 195, 0),
    _n("/dev/nvidiactl", 195, 255),
    _n("/dev/nvidia-uvm", 237, 0),
    _n("/dev/nvidia-uvm-tools", 237, 1),
)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, VisibleDevices("unset")),
        ("", VisibleDevices("unset")),
        ("all", VisibleDevices("all")),
        ("none", VisibleDevices("none")),
        ("void", VisibleDevices("void")),
        ("/var/run/nvidia-container-devices", VisibleDevices("path")),
        ("0,1", VisibleDevices("list", ("0", "1"))),
        (" GPU-aaaa , MIG-cccc ,", VisibleDevices("list", ("GPU-aaaa", "MIG-cccc"))),
    ],
)
def test_parse_visible_devices(value: str | None, expected: VisibleDevices) -> None:
    assert parse_visible_devices(value) == expected


def test_parse_environ() -> None:
    raw = b"PATH=/bin\0NVIDIA_VISIBLE_DEVICES=GPU-aaaa\0BAD\0X=a=b\0\xff=\xfe\0"
    env = parse_environ(raw)
    assert env["NVIDIA_VISIBLE_DEVICES"] == "GPU-aaaa"
    assert env["X"] == "a=b"
    assert "BAD" not in env


def _ent(
    container_nodes: tuple[DeviceNode, ...],
    visible: str = "GPU-aaaa",
    ckpt: frozenset[str] | None = frozenset({"GPU-aaaa"}),
) -> Entitlement:
    return compute_entitlement(
        "uid", "cid", container_nodes, HOST, GPUS, parse_visible_devices(visible), ckpt
    )


def test_entitled_is_what_its_dev_holds() -> None:
    e = _ent(CTR_GPU0)
    assert [n.path for n in e.nodes] == [
        "/dev/nvidia0",
        "/dev/nvidiactl",
        "/dev/nvidia-uvm",
        "/dev/nvidia-uvm-tools",
    ]
    assert e.conflicts == () and e.missing == () and e.is_gpu_container
    assert "/dev/nvidia1" not in [n.path for n in e.nodes]  # never more than given


@pytest.mark.parametrize(
    ("visible", "ckpt", "conflict", "note"),
    [
        ("GPU-bbbb", frozenset({"GPU-bbbb"}), True, "neither"),  # both say GPU1
        ("none", frozenset({"1"}), True, "neither"),
        ("GPU-bbbb", frozenset({"GPU-aaaa"}), False, "NVIDIA_VISIBLE_DEVICES does not"),
        ("GPU-aaaa", frozenset({"GPU-bbbb"}), False, "checkpoint does not"),
        ("GPU-bbbb", None, False, "NVIDIA_VISIBLE_DEVICES does not"),  # no checkpoint entry
        ("all", frozenset({"GPU-bbbb"}), False, "checkpoint does not"),
        ("void", frozenset({"GPU-bbbb"}), False, "checkpoint does not"),
        ("0", frozenset({"0"}), False, None),  # index-based IDs
        ("GPU-AAAA", frozenset({"GPU-aaaa::3"}), False, None),  # case, replica suffix
    ],
)
def test_cross_checks(
    visible: str, ckpt: frozenset[str] | None, conflict: bool, note: str | None
) -> None:
    e = _ent(CTR_GPU0, visible, ckpt)
    gpu0 = HOST[0]
    assert (gpu0 in e.conflicts) is conflict
    assert (gpu0 in e.nodes) is not conflict
    if note:
        assert any(note in n for n in e.notes), e.notes
    else:
        assert e.notes == ()


@pytest.mark.parametrize("token", ["MIG-cccc", "MIG-GPU-bbbb/1/0", "1:0", "1"])
def test_mig_tokens_designate_parent(token: str) -> None:
    e = _ent((_n("/dev/nvidia1", 195, 1),), token, frozenset({"MIG-cccc"}))
    assert e.conflicts == ()


def test_unknown_and_missing_nodes() -> None:
    ctr = (_n("/dev/nvidia0", 195, 0), _n("/dev/nvidia7", 195, 7))  # 7: not on the host
    e = _ent(ctr)
    assert [n.path for n in e.nodes] == ["/dev/nvidia0"]
    assert any("matches no host node" in n for n in e.notes)
    # F3: ctl and uvm on the host but not in the container
    assert [n.path for n in e.missing] == [
        "/dev/nvidiactl",
        "/dev/nvidia-uvm",
        "/dev/nvidia-uvm-tools",
    ]


def test_non_gpu_container() -> None:
    e = _ent((), "unset", None)
    assert not e.is_gpu_container and e.missing == ()


def test_read_entitlement(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(nodes, "_stat", fake_stat)
    rootfs = tmp_path / "rootfs"
    make_node(rootfs / "dev/nvidia1", 195, 1)
    make_node(rootfs / "dev/nvidiactl", 195, 255)
    (tmp_path / "proc/42").mkdir(parents=True)
    (tmp_path / "proc/42/root").symlink_to(rootfs)
    (tmp_path / "proc/42/environ").write_bytes(b"NVIDIA_VISIBLE_DEVICES=GPU-bbbb\0")
    c = ContainerCgroup("uid", "cid", "containerd", "systemd", None, None, None, (41, 42))
    e = read_entitlement(Root(tmp_path), c, HOST, MAJORS, GPUS, {"uid": {"GPU-bbbb"}})
    assert [n.path for n in e.nodes] == ["/dev/nvidia1", "/dev/nvidiactl"]
    assert e.visible == VisibleDevices("list", ("GPU-bbbb",))
    gone = read_entitlement(
        Root(tmp_path),
        c.__class__("u", "c", "x", "cgroupfs", None, None, None, (9,)),
        HOST,
        MAJORS,
        GPUS,
        {},
    )
    assert not gone.readable and gone.nodes == ()


@pytest.mark.parametrize(
    ("comm", "on_host_dev", "why"),
    [
        ("runc:[2:INIT]", False, "still the runtime's init"),
        ("crun", False, "still the runtime's init"),
        ("sh", True, "still sees the host's /dev"),
        (None, True, "still sees the host's /dev"),  # comm unreadable: /dev decides
    ],
)
def test_never_judged_from_the_runtimes_init_or_the_hosts_dev(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    comm: Optional[str],
    on_host_dev: bool,
    why: str,
) -> None:
    """The host's /dev holds every GPU: a process still on it (runc init before it
    switches roots, keeping its PID after the exec) must give the container nothing,
    and a later process of the container that has its own /dev decides."""
    monkeypatch.setattr(nodes, "_stat", fake_stat)
    make_node(tmp_path / "dev/nvidia0", 195, 0)
    make_node(tmp_path / "dev/nvidia1", 195, 1)
    make_node(tmp_path / "dev/nvidiactl", 195, 255)
    proc = tmp_path / "proc/42"
    proc.mkdir(parents=True)
    if comm is not None:
        (proc / "comm").write_text(comm + "\n")
    if on_host_dev:
        (proc / "root").symlink_to(tmp_path)
    else:
        make_node(proc / "root/dev/nvidia1", 195, 1)
    c = ContainerCgroup("uid", "cid", "containerd", "systemd", None, None, None, (42,))
    e = read_entitlement(Root(tmp_path), c, HOST, MAJORS, GPUS, {})
    assert not e.readable and e.nodes == () and not e.is_gpu_container
    assert why in e.notes[0], e
    # the container's own process, next to it, is what it is judged by
    make_node(tmp_path / "proc/43/root/dev/nvidia1", 195, 1)
    make_node(tmp_path / "proc/43/root/dev/nvidiactl", 195, 255)
    both = dataclasses.replace(c, pids=(42, 43))
    e = read_entitlement(Root(tmp_path), both, HOST, MAJORS, GPUS, {})
    assert [n.path for n in e.nodes] == ["/dev/nvidia1", "/dev/nvidiactl"]
