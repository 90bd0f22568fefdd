"""NVML out of the bridge's hot path (readmit/node.py, readmit/nvmlchild.py): one read
at most, before kubelet's start, in a child with a deadline; a hang or a crash there
is a reason, never the bridge's end; every later decision from PCI + history."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

from gpuguard.checkpoint import history
from gpuguard.checkpoint.history import Generation, GpuIdentity, History, MigIdentity
from gpuguard.host.inventory import Gpu, Inventory
from gpuguard.host.paths import GPU_HISTORY_FILE, Root
from gpuguard.readmit.node import NodeReader
from gpuguard.readmit.nvmlchild import read_in_child
from gpuguard.readmit.presence import DRIVER_NOT_LOADED, THIS_BOOT
from unit.doctor_support import pci_gpu

A = "GPU-aaaa"
BUS = "0000:17:00.0"


def node_root(tmp_path: Path, boot: str = "boot-old") -> Root:
    pci_gpu(tmp_path, BUS)
    gen = Generation((GpuIdentity(A, BUS, 0, 0, mig=(MigIdentity("MIG-1", 1, 0),)),), 1.0, boot)
    p = tmp_path / GPU_HISTORY_FILE.lstrip("/")
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_bytes(history.render(History((gen,))))
    b = tmp_path / "proc/sys/kernel/random/boot_id"
    b.parent.mkdir(parents=True, exist_ok=True)
    b.write_text("boot-now\n")
    return Root(tmp_path)


class Driver:
    def __init__(self, inv: Optional[Inventory]) -> None:
        self.inv = inv
        self.calls = 0

    def __call__(self, root: Root, driver_root: str) -> tuple[Optional[Inventory], str]:
        self.calls += 1
        return self.inv, "" if self.inv is not None else "no libnvidia-ml.so.1 (driver container)"


def test_nvml_is_read_once_before_kubelet_and_never_again(tmp_path: Path) -> None:
    drv = Driver(Inventory((Gpu(A, 0, 0, BUS),), "nvml", library="/usr/lib/libnvidia-ml.so.1"))
    reader = NodeReader(node_root(tmp_path), drv)
    first, problem = reader.read("", "", kubelet_started=False)
    assert (first.driver, problem) == (True, "")
    for _ in range(3):  # every REFRESH and kubelet start after: PCI + history
        later, _p = reader.read("", "", kubelet_started=False)
        assert later.evidence == DRIVER_NOT_LOADED and later.judge(A) == ""
    assert drv.calls == 1


def test_a_bridge_started_after_kubelet_never_asks_nvml(tmp_path: Path) -> None:
    drv = Driver(None)
    node, _p = NodeReader(node_root(tmp_path), drv).read("", "", kubelet_started=True)
    assert drv.calls == 0 and node.judge(A) == ""


def test_without_the_driver_pci_and_history_decide(tmp_path: Path) -> None:
    node, problem = NodeReader(node_root(tmp_path), Driver(None)).read("", "", False)
    assert node.evidence == DRIVER_NOT_LOADED and problem == ""
    assert node.judge(A) == "" and "never vouched" in node.judge("MIG-1")


def test_this_boot_s_history_knows_its_mig_devices(tmp_path: Path) -> None:
    node, _p = NodeReader(node_root(tmp_path, "boot-now"), Driver(None)).read("", "", True)
    assert node.evidence == THIS_BOOT and node.judge("MIG-1") == ""


def test_a_hung_nvml_reader_is_a_reason_not_the_bridge_s_hang() -> None:
    inv, why = read_in_child(Root(), "", [sys.executable, "-c", "import time; time.sleep(60)"], 1)
    assert inv is None and "no answer in 1s" in why


def test_a_crashing_nvml_reader_is_a_reason_not_the_bridge_s_crash() -> None:
    crash = "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)"
    inv, why = read_in_child(Root(), "", [sys.executable, "-c", crash])
    assert inv is None and why == "NVML's reader ended by signal 11"


def test_the_real_child_on_a_node_without_a_driver(tmp_path: Path) -> None:
    inv, why = read_in_child(Root(tmp_path), "")
    assert inv is None
    assert "libnvidia-ml" in why or "pynvml" in why, why


def test_the_child_answers_the_inventory_it_read(tmp_path: Path) -> None:
    doc = '{"gpus": [{"uuid": "GPU-aaaa", "index": 0, "minor": 0, "pci_bus_id": "0000:17:00.0"}]}'
    inv, why = read_in_child(Root(), "", [sys.executable, "-c", f"print({doc!r})"])
    assert why == "" and inv is not None and [g.uuid for g in inv.gpus] == [A]
