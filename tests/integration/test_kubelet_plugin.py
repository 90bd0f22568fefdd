"""F3 and F4 on the real kubelet, with the device plugin double speaking v1beta1 gRPC.

F3: the plugin runs as a privileged static pod (as NVIDIA's DaemonSet runs it) and
hands each GPU container its nodes as device specs (``passDeviceSpecs``), the control
nodes only where ``stat()`` finds them in its own /dev, which the runtime filled when
the plugin's container was made. It starts before nvidia_uvm is loaded; the module
loads later and its nodes appear (seed 004). Without gpuguard every GPU pod made after
that still lacks ``/dev/nvidia-uvm`` (CUDA's "unknown error": the kernel denies the
node in the pod's devices cgroup). With gpuguard, the plugin's container is stopped
through the runtime (``ctr task kill``: there is no crictl here), kubelet makes it again
with a /dev that has uvm, and the next GPU pod gets uvm.

F4: kubelet is restarted under a plugin (a host service) that never registers again,
like old or forked plugins. Without gpuguard the node has no GPU for new pods
(``UnexpectedAdmissionError``, Available: 0); with gpuguard the plugin is restarted
once the grace period is over, registers, and a new GPU pod runs.

On cgroup v1 only, like every real-kubelet test (harness/kubelet.py says why).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from integration.gpu_scopes import UVM_MAJOR
from integration.gpuguard_ns import events, wait_for
from integration.harness import systemd_ns as systemd_ns
from integration.harness.pods import plugin_pod
from integration.kubelet_node import PLUGIN, GpuNode, NsFactory, boot, gpu_pod
from integration.kubelet_node import api as api

pytestmark = pytest.mark.root

F3_CONFIG = "[Daemon]\nAuditInterval=1s\n[DevicePlugin]\nCoolDown=0\nRegistrationGrace=2s\n"
#: F4 runs on both kubelets (harness/kubelet_versions.py); F3 on 1.20
KUBELETS = ("1.20", "1.34")
F4_CONFIG = "[DevicePlugin]\nCoolDown=0\nRegistrationGrace=2s\n"
#: Without gpuguard nothing changes: look this long, longer than gpuguard takes.
QUIET = 6.0


def _plugin_pod_before_uvm(systemd_ns: NsFactory, tmp: Path, api: Path, gpuguard: bool) -> GpuNode:
    node = boot(systemd_ns, tmp, api, gpuguard=gpuguard, uvm=False, plugin=False, config=F3_CONFIG)
    node.write_pod(plugin_pod("6b1e1ad0-0000-4000-8000-00000000f300", ["--device-specs"]))
    node.wait_pods(
        lambda p: "nvidia-device-plugin" in p and p["nvidia-device-plugin"].running,
        60,
        "plugin pod",
    )
    node.wait_registered()
    assert not node.ns.path("/dev/nvidia-uvm").exists()
    return node


def _uvm_verdict(node: GpuNode, pod: str) -> bool | None:
    """Does the pod's devices cgroup admit /dev/nvidia-uvm (the kernel's answer)?"""
    from gpuguard.devices.probe import probe_open

    cgroup = node.devices_cgroup(node.running(pod))
    return probe_open(node.ns.fake_node(UVM_MAJOR, 0), [cgroup]).verdict


def test_f3_without_gpuguard_new_pods_lack_uvm(
    systemd_ns: NsFactory, tmp_path: Path, api: Path
) -> None:
    node = _plugin_pod_before_uvm(systemd_ns, tmp_path, api, gpuguard=False)
    node.load_uvm()
    time.sleep(QUIET)
    node.write_pod(gpu_pod("cuda"))
    node.wait_pods(lambda p: "cuda" in p and p["cuda"].running, 60, "the GPU pod")
    assert _uvm_verdict(node, "cuda") is False


def test_f3_with_gpuguard_plugin_restarted_new_pods_get_uvm(
    systemd_ns: NsFactory, tmp_path: Path, api: Path
) -> None:
    node = _plugin_pod_before_uvm(systemd_ns, tmp_path, api, gpuguard=True)
    before = node.running("nvidia-device-plugin")
    registered = node.registrations()
    node.load_uvm()
    wait_for(lambda: events(node.ns, "plugin-restarted"), 30, "gpuguard restarting the plugin")
    node.wait_registered(more_than=registered)
    after = node.running("nvidia-device-plugin")
    assert after.id != before.id
    (restart,) = events(node.ns, "plugin-restarted")
    assert restart["METHOD"] == "ctr", restart
    node.write_pod(gpu_pod("cuda"))
    node.wait_pods(lambda p: "cuda" in p and p["cuda"].running, 60, "the GPU pod")
    assert _uvm_verdict(node, "cuda") is True


def _kubelet_restarted_under_a_mute_plugin(
    systemd_ns: NsFactory, tmp: Path, api: Path, gpuguard: bool, kubelet: str
) -> GpuNode:
    node = boot(
        systemd_ns, tmp, api, gpuguard=gpuguard, plugin=False, config=F4_CONFIG, kubelet=kubelet
    )
    node.start_plugin("--no-reregister")
    node.write_pod(gpu_pod("gpu-a"))
    node.wait_pods(lambda p: "gpu-a" in p and p["gpu-a"].running, 60, "gpu-a")
    node.stop_kubelet()
    node.start_kubelet()
    return node


@pytest.mark.parametrize("kubelet", KUBELETS)
def test_f4_without_gpuguard_no_gpu_for_new_pods(
    systemd_ns: NsFactory, tmp_path: Path, api: Path, kubelet: str
) -> None:
    node = _kubelet_restarted_under_a_mute_plugin(
        systemd_ns, tmp_path, api, gpuguard=False, kubelet=kubelet
    )
    time.sleep(QUIET)
    assert node.registrations() == 0
    node.write_pod(gpu_pod("gpu-b"))
    pods = node.wait_pods(
        lambda p: "gpu-b" in p and p["gpu-b"].phase == "Failed", 30, "gpu-b failing"
    )
    assert pods["gpu-b"].reason == "UnexpectedAdmissionError", pods["gpu-b"]
    # 1.20: "... Requested: 1, Available: 0"; 1.34: "no healthy devices present"
    said = pods["gpu-b"].message
    assert "Available: 0" in said or "no healthy devices present" in said, said
    assert pods["gpu-a"].running  # what runs keeps running: only new pods are refused


@pytest.mark.parametrize("kubelet", KUBELETS)
def test_f4_with_gpuguard_plugin_restarted_new_pod_runs(
    systemd_ns: NsFactory, tmp_path: Path, api: Path, kubelet: str
) -> None:
    node = _kubelet_restarted_under_a_mute_plugin(
        systemd_ns, tmp_path, api, gpuguard=True, kubelet=kubelet
    )
    before = node.ns.unit_property(PLUGIN, "InvocationID")
    wait_for(lambda: events(node.ns, "plugin-recovered"), 40, "plugin recovered")
    node.wait_registered()
    assert node.ns.unit_property(PLUGIN, "InvocationID") != before
    (restarted,) = events(node.ns, "plugin-restarted")
    assert restarted["METHOD"] == "systemd", restarted
    node.write_pod(gpu_pod("gpu-b"))
    node.wait_pods(lambda p: all(n in p and p[n].running for n in ("gpu-a", "gpu-b")), 60, "both")
    # a kubelet restart with its GPU pod running: gpuguard's re-admission bridge
    # (kubelet 1.26+) left the plugin's registration alone
    assert node.bridge_offers() == []
