"""The re-admission bridge's withdrawal on the real kubelet 1.34 (readmit/withdraw.py).

After a reboot with the device plugin not there yet (a DaemonSet's pod whose image is
still pulling, a plugin waiting for its toolkit), the bridge's healthy devices are the
node's allocatable; once kubelet has re-admitted both GPU pods on them, the bridge
reports them unhealthy (``readmit-withdrawn``): kubelet's podresources API then counts 0
allocatable GPUs, so no scheduler could place a pod on a device the bridge cannot
allocate, and the re-admitted pods keep running in the same containers. The plugin
registers later, kubelet's allocatable is the node's GPUs again and the plugin serves a
new pod the free GPU; the bridge's Allocate is never asked (``readmit-allocate``) and
the withdrawal is sent once.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from gpuguard.host.paths import DEVICE_PLUGINS_DIR, Root
from gpuguard.steps.device_plugin.podresources import read_allocatable
from integration.gpuguard_ns import wait_for
from integration.harness import systemd_ns as systemd_ns
from integration.kubelet_node import (
    F1_PODS,
    READMIT,
    GpuNode,
    NsFactory,
    boot,
    free_minor,
    gpu_pod,
    gpus_after,
    two_gpu_pods,
)
from integration.kubelet_node import api as api
from integration.test_kubelet_readmit import readmit_events

pytestmark = pytest.mark.root

RESOURCE = "nvidia.com/gpu"


def allocatable(node: GpuNode) -> int:
    got = read_allocatable(Root(node.ns.root), DEVICE_PLUGINS_DIR, timeout=2.0)
    assert not got.unchecked, got
    return got.counts.get(RESOURCE, 0)


def test_withdrawn_once_the_pods_are_back_they_keep_running_and_the_plugin_serves(
    systemd_ns: NsFactory, tmp_path: Path, api: Path
) -> None:
    node = boot(systemd_ns, tmp_path, api, gpuguard=True, kubelet="1.34")
    slots = two_gpu_pods(node)
    node.reboot(gpus_after(node, "none", slots["gpu-b"]), plugin="none")
    try:
        node.wait_pods(
            lambda p: all(n in p and p[n].running for n in F1_PODS),
            60,
            "both GPU pods Running again",
            never=lambda p: any(n in p and p[n].phase == "Failed" for n in F1_PODS),
        )
    except AssertionError as e:
        said = [f"{x.get('GPUGUARD_KIND')}: {x.get('MESSAGE')}" for x in node.ns.journal(READMIT)]
        raise AssertionError(f"{e}\nthe bridge said:\n" + "\n".join(said)) from None
    before = {n: node.running(n).id for n in F1_PODS}
    (offer,) = node.bridge_offers()
    (gone,) = wait_for(lambda: readmit_events(node, "readmit-withdrawn"), 40, "the withdrawal")
    assert gone["PENDING"] == "" and gone["DEVICES"] == offer["DEVICES"], gone
    print(f"\nwithdrawal: {gone['MESSAGE']}")  # the figure: seconds after kubelet's start
    assert allocatable(node) == 0  # nothing the bridge cannot allocate
    node.start_plugin()
    wait_for(lambda: allocatable(node) == len(node.inventory), 30, "the plugin's GPUs")
    assert {n: node.running(n).id for n in F1_PODS} == before  # the same containers
    node.write_pod(gpu_pod("gpu-c"))
    node.wait_pods(lambda p: "gpu-c" in p and p["gpu-c"].running, 60, "gpu-c running")
    c = node.running("gpu-c")
    held = [node.running(n) for n in F1_PODS]
    assert [g["minor"] for g in node.inventory if g["uuid"] == c.visible] == free_minor(node, held)
    assert not readmit_events(node, "readmit-allocate")
    assert len(readmit_events(node, "readmit-withdrawn")) == 1
