"""One device-node model: the device plugin step's nodes and the host's NVIDIA nodes
are the same type from the same lister, and `numbers`/`key` mean one thing."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gpuguard.devices import nodes
from gpuguard.devices.nodes import DeviceNode, NvidiaMajors, list_nvidia_nodes
from gpuguard.devices.plugins import NodeInfo, list_nodes
from gpuguard.host.paths import Root
from unit.test_devices_support import fake_stat, make_node


def test_one_type_one_lister(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(nodes, "_stat", fake_stat)
    dev = tmp_path / "dev"
    make_node(dev / "nvidia0", 195, 0)
    make_node(dev / "nvidiactl", 195, 255)
    make_node(dev / "nvidia-uvm", 510, 0, kind="b")  # odd, but a plugin's view may be
    make_node(dev / "nvidia-caps/nvidia-cap1", 237, 1)
    os.symlink("nvidia0", dev / "nvidia1")  # a link is not a node
    plugin = list_nodes(dev)
    host = list_nvidia_nodes(Root(tmp_path), NvidiaMajors(195, 510, 237))
    assert NodeInfo is DeviceNode
    assert plugin is not None and all(type(n) is DeviceNode for n in plugin + host)
    assert [(n.path, n.key) for n in plugin] == [
        ("/dev/nvidia-uvm", ("b", 510, 0)),
        ("/dev/nvidia0", ("c", 195, 0)),
        ("/dev/nvidiactl", ("c", 195, 255)),
    ]
    assert all(n.ctime is not None and n.mode is None for n in plugin)
    # the host lister: character nodes only, nvidia-caps too, roles from the majors
    assert [(n.path, n.numbers, n.role) for n in host] == [
        ("/dev/nvidia0", "195:0", "gpu"),
        ("/dev/nvidiactl", "195:255", "ctl"),
        ("/dev/nvidia-caps/nvidia-cap1", "237:1", "cap"),
    ]
    assert all(n.ctime is None and n.mode == 0o666 for n in host)
    assert list_nodes(tmp_path / "missing") is None
