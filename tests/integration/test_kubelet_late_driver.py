"""F1 on a GPU Operator node, on the real kubelet 1.20.2: after the reboot the driver
is a pod, so it arrives after kubelet has started and re-admitted its pods, and the
device plugin registers after it.

The node (integration/kubelet_node.py) runs two GPU pods with gpuguard recording the
GPUs' slots; then it reboots with every GPU back under a new UUID and no driver:
gpuguard's configuration names the driver root (`DriverRoot=/run/nvidia/driver`, as
the Operator's), which is empty, so kubelet's pre-start hook finds no NVML and leaves
the checkpoint alone, and the re-admitted pods fail on their old UUIDs. Then the
driver's root appears with libnvidia-ml.so.1 (the fake driver library, tests/fakenvml,
through the real pynvml) naming the new GPUs, with no uevent, and the plugin starts.

gpuguard sees NVML (its wait poll), the inventory change wakes the checkpoint step,
the entries are remapped to the GPUs now in their slots and kubelet is restarted
through its hook: every pod is Running again on its slot's GPU. The figure printed is
the seconds from the driver's arrival to every pod Running.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Dict, List

import pytest

import fakenvml
from conftest import require_tool
from fakenvml import FakeGpu
from gpuguard.host.paths import Root
from gpuguard.steps.checkpoint import kubelet_hook as kh
from integration.harness import systemd_ns as systemd_ns
from integration.harness.pods import Pod
from integration.kubelet_node import F1_PODS, GpuNode, NsFactory, boot, gpus_after, two_gpu_pods
from integration.kubelet_node import api as api

pytestmark = pytest.mark.root

DRIVER_ROOT = "/run/nvidia/driver"
LIB_DIR = "usr/lib/x86_64-linux-gnu"
CONFIG = f"[Inventory]\nDriverRoot={DRIVER_ROOT}\n"


def driver_arrives(node: GpuNode) -> float:
    """The driver pod's root appears at once, its library naming the node's GPUs."""
    staging = node.ns.path("/run/nvidia/.driver")
    lib_dir = staging / LIB_DIR
    fakenvml.build(lib_dir)
    gpus = [FakeGpu(g["uuid"], g["minor"], g["pci_bus_id"]) for g in node.inventory]
    fakenvml.write_conf(lib_dir, gpus)
    t = time.monotonic()
    staging.rename(node.ns.path(DRIVER_ROOT))
    return t


def test_late_driver_every_pod_back_on_its_slot(
    systemd_ns: NsFactory, tmp_path: Path, api: Path
) -> None:
    require_tool("gcc")
    node = boot(systemd_ns, tmp_path, api, gpuguard=True)
    slots = two_gpu_pods(node)  # gpuguard records which UUID sits in which slot
    before = {g["pci_bus_id"]: g["uuid"] for g in node.inventory}

    # the reboot: GPUs back with new UUIDs, the driver not there yet, NVML for gpuguard
    node.stop_kubelet()
    node.ns.systemctl("stop", "nvidia-device-plugin.service")
    node.ns.systemctl("stop", "gpuguard.service")
    node.kill_all()
    node.set_gpus(gpus_after(node, "all", slots["gpu-b"]))
    node.ns.path("/etc/gpuguard/gpuguard.conf").write_text(CONFIG)
    node.ns.path("/run/nvidia").mkdir(parents=True, exist_ok=True)
    node.start_gpuguard()
    node.start_kubelet()
    names = [*F1_PODS]
    node.wait_pods(lambda p: all(n in p and p[n].phase for n in names), 60, "re-admission")
    hook = kh.read_result(Root(node.ns.root))  # kubelet's pre-start hook: nothing to ask
    assert hook is not None and hook.outcome == kh.SKIPPED, hook
    assert "driver container has not started" in hook.detail, hook

    t_driver = driver_arrives(node)
    # the plugin's pod starts once the driver is there; gpuguard may restart kubelet
    # around its registration (F4 then: gpuguard restarts the plugin), so no wait here
    node.ns.systemctl("start", "nvidia-device-plugin.service")

    def back(p: Dict[str, Pod]) -> bool:
        return all(n in p and p[n].running for n in F1_PODS)

    node.wait_pods(back, 120, f"{F1_PODS} Running again after the driver arrived")
    seconds = time.monotonic() - t_driver
    print(f"\nlate-driver F1 figures: pods_back={len(F1_PODS)}/{len(F1_PODS)} "
          f"seconds_from_driver_to_running={seconds:.1f}")  # fmt: skip
    held: List[str] = []
    for name in F1_PODS:
        c = node.running(name)
        assert node.slot(c) == slots[name], f"{name} moved from {slots[name]} to {node.slot(c)}"
        assert c.visible != before[slots[name]]
        held.append(c.visible)
    assert len(set(held)) == len(held)
    journal = node.log("gpuguard.service", lines=400)
    assert "NVML: /run/nvidia/driver/" in journal, journal
