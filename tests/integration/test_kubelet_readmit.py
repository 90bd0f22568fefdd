"""gpuguard's re-admission bridge on the real kubelet 1.34 (src/gpuguard/readmit/),
beyond the F1 cases of test_kubelet_f1.py (``host-1.34-*``: the plugin a host service
registering once kubelet has judged its pods, 0.3-1 s after its registration server):

* a fast plugin, started with kubelet, racing the bridge and kubelet's re-admission;
* the plugin as a privileged static pod (NVIDIA's DaemonSet's way): after a reboot in
  which every GPU changed its UUID, kubelet re-admits both GPU pods on their slots
  (the bridge reported their remapped GPUs healthy), starts the plugin's pod, and a
  new GPU pod gets the one free GPU: from the plugin, since the bridge serves no
  Allocate;
* observe mode: the bridge registers nothing and says what it would have reported;
  kubelet then rejects the pods as it does without gpuguard, and the bridge names each
  (``readmit-rejected``: namespace/name and kubelet's reason); the daemon makes each a
  finding (``gpuguard status``, ``gpuguard npd gpu-pods``, the metrics) until the pod
  is deleted;
* kubelet 1.20 (harness/kubelet_versions.py): the bridge stays off, told by the kubelet
  unit's executable's ``--version``.

The kubelet restart under running pods (the bridge must stay away from the plugin's
registration) is test_kubelet_plugin.py's F4 with gpuguard on 1.34.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List, Mapping, Tuple

import pytest

from gpuguard.readmit.state import STATE_FILE
from integration.gpuguard_ns import GPUGUARD, status, wait_for
from integration.harness import systemd_ns as systemd_ns
from integration.harness.kubelet import MANIFESTS
from integration.harness.pods import plugin_pod
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

PLUGIN_POD = "nvidia-device-plugin"


def test_plugin_as_static_pod_every_pod_back_on_its_slot(
    systemd_ns: NsFactory, tmp_path: Path, api: Path
) -> None:
    node = boot(systemd_ns, tmp_path, api, gpuguard=True, plugin=False, kubelet="1.34")
    node.write_pod(plugin_pod("6b1e1ad0-0000-4000-8000-00000000f134"))
    node.wait_pods(lambda p: PLUGIN_POD in p and p[PLUGIN_POD].running, 60, "plugin pod")
    node.wait_registered()
    slots = two_gpu_pods(node)
    node.reboot(gpus_after(node, "all", slots["gpu-b"]), plugin="pod")
    node.wait_pods(
        lambda p: all(n in p and p[n].running for n in (*F1_PODS, PLUGIN_POD)),
        60,
        "GPU pods and the plugin's pod Running again",
        never=lambda p: any(n in p and p[n].phase == "Failed" for n in F1_PODS),
    )
    held = [node.running(n) for n in F1_PODS]
    assert {c.pod: node.slot(c) for c in held} == slots
    (offer,) = node.bridge_offers()
    assert sorted(offer["DEVICES"].split(",")) == sorted(c.visible for c in held)
    node.write_pod(gpu_pod("gpu-c"))
    node.wait_pods(lambda p: "gpu-c" in p and p["gpu-c"].running, 60, "gpu-c running")
    c = node.running("gpu-c")
    assert [g["minor"] for g in node.inventory if g["uuid"] == c.visible] == free_minor(node, held)
    ids = [i for v in node.checkpoint_ids().values() for i in v]
    assert len(ids) == len(set(ids)), node.checkpoint_ids()


def test_fast_plugin_racing_the_bridge(systemd_ns: NsFactory, tmp_path: Path, api: Path) -> None:
    """The plugin started with kubelet, already waiting for kubelet.sock: it registers
    20-60 ms after kubelet's registration server, about when the bridge does and maybe
    before kubelet's re-admission. Every pod comes back on its slot; a new pod gets the
    free GPU from the plugin, after the plugin's restart where the bridge said it may
    have registered after the plugin (``readmit-raced``)."""
    node = boot(systemd_ns, tmp_path, api, gpuguard=True, kubelet="1.34")
    slots = two_gpu_pods(node)
    node.reboot(gpus_after(node, "all", slots["gpu-b"]), plugin="fast")
    node.wait_pods(
        lambda p: all(n in p and p[n].running for n in F1_PODS),
        60,
        "both GPU pods Running again",
        never=lambda p: any(n in p and p[n].phase == "Failed" for n in F1_PODS),
    )
    held = [node.running(n) for n in F1_PODS]
    assert {c.pod: node.slot(c) for c in held} == slots
    if readmit_events(node, "readmit-raced"):
        # the plugin may have registered first and been replaced by the bridge: named
        # in the journal, and restarting the plugin (the remedy it names) mends it
        seen = node.registrations()
        node.ns.systemctl("restart", PLUGIN)
        node.wait_registered(more_than=seen)
    node.write_pod(gpu_pod("gpu-c"))
    node.wait_pods(lambda p: "gpu-c" in p and p["gpu-c"].running, 60, "gpu-c running")
    c = node.running("gpu-c")
    assert node.plugin_allocations()[-1] == [c.visible]
    assert [g["minor"] for g in node.inventory if g["uuid"] == c.visible] == free_minor(node, held)
    caps = node.kubelet.capacities(node.kubelet_log())
    assert caps and max(caps) <= len(node.inventory), caps


def test_observe_mode_registers_nothing(systemd_ns: NsFactory, tmp_path: Path, api: Path) -> None:
    node = boot(
        systemd_ns, tmp_path, api, gpuguard=True, kubelet="1.34", config="[Daemon]\nMode=observe\n"
    )
    slots = two_gpu_pods(node)
    # the plugin once kubelet judged the pods (a fast one may register before kubelet's
    # re-admission, which then needs no bridge)
    node.reboot(gpus_after(node, "none", slots["gpu-b"]))
    pods = node.wait_pods(
        lambda p: all(n in p and p[n].phase == "Failed" for n in F1_PODS), 60, "pods Failed"
    )
    assert all(pods[n].reason == "UnexpectedAdmissionError" for n in F1_PODS), pods
    assert node.bridge_offers() == []
    (seen,) = wait_for(lambda: readmit_events(node, "readmit-observe"), 10, "the observe entry")
    assert sorted(seen["DEVICES"].split(",")) == sorted(slot_uuids(node, slots))
    # and the pods kubelet rejected are named, with kubelet's reason

    def named() -> List[str]:
        return sorted(e["POD"] for e in readmit_events(node, "readmit-rejected"))

    want = [f"default/{n}-gpunode" for n in F1_PODS]
    wait_for(lambda: named() == want, 30, "the rejected pods named")
    # ... where a finding would be: the daemon's status, NPD's condition, the metrics
    wait_for(lambda: rejected_in_status(node) == want, 30, "the daemon's findings")
    code, out = gg(node, "npd", "gpu-pods")
    assert code == 1 and out.startswith("kubelet rejected GPU pod default/gpu-"), out
    code, out = gg(node, "status")
    assert "\nnode:       PROBLEM\n" in "\n" + out and code == 1, out
    assert sum(line.startswith("  rejected: default/gpu-") for line in out.splitlines()) == 2
    code, text = gg(node, "metrics")
    assert "gpuguard_readmit_rejected_pods 2.0" in text, text
    assert 'gpuguard_node_condition_status{condition="GPUPodsRejected",status="true"} 1.0' in text
    state = json.loads(node.ns.path(STATE_FILE).read_text())
    assert state["decision"] == "observe" and state["registrations"] == []
    assert state["first_admission"] is not None  # kubelet's first SyncLoop ADD, read back
    assert state["problem"] == ""  # kubelet's own journal entries were read
    # a rejected pod deleted (its manifest removed: kubelet removes its pod directory) is
    # no longer named; the other one still is
    node.ns.path(f"{MANIFESTS}/{F1_PODS[0]}.json").unlink()
    wait_for(lambda: rejected_in_status(node) == want[1:], 90, "gpu-a's finding cleared")
    assert gg(node, "npd", "gpu-pods")[0] == 1


def rejected_in_status(node: GpuNode) -> List[str]:
    step = status(node.ns).get("steps", {}).get("readmit", {})
    return sorted(f["fields"]["POD"] for f in step.get("findings", ()))


def gg(node: GpuNode, *argv: str) -> Tuple[int, str]:
    r = node.ns.run([str(GPUGUARD), *argv])
    return r.returncode, r.stdout


def slot_uuids(node: GpuNode, slots: Dict[str, str]) -> List[str]:
    return [g["uuid"] for g in node.inventory if g["pci_bus_id"] in slots.values()]


def readmit_events(node: GpuNode, kind: str) -> List[Mapping[str, Any]]:
    return [e for e in node.ns.journal(READMIT) if e.get("GPUGUARD_KIND") == kind]


def test_off_for_kubelet_1_20(systemd_ns: NsFactory, tmp_path: Path, api: Path) -> None:
    node = boot(systemd_ns, tmp_path, api, gpuguard=True, kubelet="1.20", plugin=False)
    (off,) = wait_for(lambda: readmit_events(node, "readmit-off"), 10, "the bridge's off entry")
    assert "kubelet 1.20 re-admits its pods without a device plugin" in off["MESSAGE"], off
    assert node.ns.unit_property(READMIT, "ActiveState") == "inactive"
    assert node.ns.unit_property(READMIT, "Result") == "success"
