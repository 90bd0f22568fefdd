"""F4's second case on the real kubelet 1.34: a registered plugin that kubelet drops.

After a reboot the re-admission bridge registers ``nvidia.com/gpu`` first and the
real plugin (the double, a host service) replaces its endpoint; kubelet keeps the
bridge's stream. When that stream ends (the bridge killed: a crash, a stop or a
restart of gpuguard-readmit while kubelet runs), kubelet 1.34 disconnects the CURRENT
plugin and marks every device unhealthy: its podresources API reports 0 allocatable
GPUs, and nothing changes while gpuguard is held still (SIGSTOP), the plugin still
serving a socket made after kubelet's start. With gpuguard running, the plugin is
restarted (``plugin-not-allocatable``, then ``plugin-restarted`` with its cause and
reason), kubelet's allocatable comes back to the node's GPU count and a new pod gets
the free GPU from the plugin's own Allocate.

On kubelet 1.20, which has no GetAllocatableResources, the step says once that it
cannot ask (``plugin-allocatable-unchecked``) and acts on nothing for it.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from gpuguard.host.paths import DEVICE_PLUGINS_DIR, Root
from gpuguard.steps.device_plugin.podresources import Allocatable, read_allocatable
from integration.gpuguard_ns import events, paused, wait_for
from integration.harness import systemd_ns as systemd_ns
from integration.kubelet_node import (
    F1_PODS,
    PLUGIN,
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

pytestmark = pytest.mark.root

RESOURCE = "nvidia.com/gpu"
# no audit pass meanwhile: the bridge's process ending wakes the step; no cool-down
CONFIG = "[DevicePlugin]\nCoolDown=0\nRegistrationGrace=2s\n"
#: How long the dropped plugin is watched with gpuguard held still: it stays dropped.
STILL = 3.0


def allocatable(node: GpuNode) -> Allocatable:
    """Asked as the daemon does, under the node's root (the socket is connected through
    its directory's descriptor: the root's long path does not matter)."""
    got = read_allocatable(Root(node.ns.root), DEVICE_PLUGINS_DIR, timeout=2.0)
    assert not got.unchecked, got
    return got


def test_plugin_dropped_when_the_bridge_ends_is_restarted(
    systemd_ns: NsFactory, tmp_path: Path, api: Path
) -> None:
    node = boot(systemd_ns, tmp_path, api, gpuguard=True, kubelet="1.34", config=CONFIG)
    slots = two_gpu_pods(node)
    node.reboot(gpus_after(node, "none", slots["gpu-b"]))  # the plugin registers late
    node.wait_pods(lambda p: all(n in p and p[n].running for n in F1_PODS), 60, "GPU pods back")
    assert node.bridge_offers(), "the bridge registered at kubelet's start"
    gpus = len(node.inventory)
    wait_for(lambda: allocatable(node).counts.get(RESOURCE) == gpus, 30, "all GPUs")
    plugin_run = node.ns.unit_property(PLUGIN, "InvocationID")
    with paused(node.ns):
        # the bridge's stream ends (systemd starts it again: the new one stays away)
        assert node.ns.systemctl("kill", "-s", "KILL", READMIT).returncode == 0
        wait_for(lambda: allocatable(node).counts.get(RESOURCE, 0) == 0, 10, "0")
        time.sleep(STILL)  # the plugin does not know: it stays dropped
        assert allocatable(node).counts.get(RESOURCE, 0) == 0
        assert node.ns.unit_property(PLUGIN, "InvocationID") == plugin_run
    resumed = time.monotonic()
    wait_for(lambda: events(node.ns, "plugin-restarted"), 30, "gpuguard restarting the plugin")
    restarted_after = time.monotonic() - resumed
    found = events(node.ns, "plugin-not-allocatable")[0]
    assert found["RESOURCE"] == RESOURCE and found["GPUS"] == str(gpus), found
    assert found["ALLOCATABLE"] == "0", found
    (restarted,) = events(node.ns, "plugin-restarted")
    assert restarted["CAUSE"] == "not-allocatable" and restarted["METHOD"] == "systemd"
    assert f"0 allocatable {RESOURCE} of the node's {gpus} GPUs" in restarted["MESSAGE"]
    assert node.ns.unit_property(PLUGIN, "InvocationID") != plugin_run
    wait_for(lambda: allocatable(node).counts.get(RESOURCE) == gpus, 30, "GPUs back")
    back_after = time.monotonic() - resumed
    print(f"after gpuguard resumed: restart {restarted_after:.2f}s, GPUs back {back_after:.2f}s")
    wait_for(lambda: events(node.ns, "plugin-recovered"), 30, "the restart verified")

    def woken() -> list[str]:  # by the bridge's end: no audit pass in this test's minutes
        done = [e["REASONS"] for e in events(node.ns, "pass-complete") if int(e["ACTIONS"])]
        return [r for r in done if f"systemd: {READMIT} ended" in r]

    wait_for(woken, 10, "the pass the bridge's end woke, journaled")
    held = [node.running(n) for n in F1_PODS]
    node.write_pod(gpu_pod("gpu-c"))
    node.wait_pods(lambda p: "gpu-c" in p and p["gpu-c"].running, 60, "gpu-c running")
    c = node.running("gpu-c")
    assert node.plugin_allocations()[-1] == [c.visible]
    assert [g["minor"] for g in node.inventory if g["uuid"] == c.visible] == free_minor(node, held)
    assert len(events(node.ns, "plugin-restarted")) == 1  # once: never a loop


def test_kubelet_1_20_cannot_be_asked_said_once_never_acted_on(
    systemd_ns: NsFactory, tmp_path: Path, api: Path
) -> None:
    """kubelet 1.20 has no GetAllocatableResources: the step says so once (an info
    finding, not "OK") over many passes, restarts nothing, and still judges registration
    by the sockets' times (test_kubelet_plugin.py's F4)."""
    config = "[Daemon]\nAuditInterval=1s\n" + CONFIG
    node = boot(systemd_ns, tmp_path, api, gpuguard=True, kubelet="1.20", config=config)
    (said,) = wait_for(lambda: events(node.ns, "plugin-allocatable-unchecked"), 30, "unchecked")
    assert said["PODRESOURCES_SOCKET"].endswith("pod-resources/kubelet.sock")
    # kubelet's Go gRPC server's refusal, read from its trailers (HPACK)
    assert "code 12 UNIMPLEMENTED: unknown method GetAllocatableResources" in said["REASON"]
    time.sleep(STILL)  # three more audit passes: journaled once
    assert len(events(node.ns, "plugin-allocatable-unchecked")) == 1
    assert not events(node.ns, "plugin-restarted")
    assert not events(node.ns, "plugin-not-allocatable")
    print(f"kubelet 1.20: {said['REASON']}")
