"""A GPU Operator node's reboot on the real kubelets 1.34 and 1.36, with gpuguard's
re-admission bridge (src/gpuguard/readmit/).

Two static GPU pods run, gpuguard recording each GPU's slot in its identity history;
then the node reboots in the Operator's layout (GpuNode.reboot(driver="late")): no
driver on the host, the driver container's root (``/run/nvidia/driver``, the fake NVML
library) and the GPU list arriving 8 s after kubelet's start, the device plugin after
them. Until then the node shows its GPUs only on the PCI bus: the bridge vouches for
the checkpointed GPUs from PCI + history ("driver not loaded"), kubelet re-admits the
pods on them, and their containers start once the driver is there (the runtime hook
fails them before, as NVIDIA's does without a driver; kubelet retries).

* the same UUIDs: every pod Running again on its slot, the bridge's evidence PCI +
  history; the figures printed are the seconds from kubelet's start and from the
  driver's arrival to every pod Running (docs/checkpoint.md's bridge section);
* new UUIDs (1.34, 1.36): the pods were re-admitted on the old ones; when the driver
  arrives the daemon's checkpoint step (the inventory change wakes it, as on kubelet
  1.20: test_kubelet_late_driver.py) remaps them by slot, records the new UUIDs in the
  history and restarts kubelet through its hook; the bridge, reading its PCI view
  again for the changed history, offers the remapped UUIDs at that start, and every
  pod runs on its slot's new GPU.

The node's sandboxes run a one-process ``/pause`` (harness/kubelet.py's real_pause),
so that a pod whose containers failed to start is not taken for a running one.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Dict

import pytest

from conftest import require_tool
from gpuguard.readmit.presence import DRIVER_NOT_LOADED, THIS_BOOT
from integration.harness import systemd_ns as systemd_ns
from integration.harness.pods import Pod
from integration.kubelet_node import (
    F1_PODS,
    READMIT,
    NsFactory,
    boot,
    gpus_after,
    two_gpu_pods,
)
from integration.kubelet_node import api as api

pytestmark = pytest.mark.root


@pytest.mark.parametrize(
    ("kubelet", "case"), [("1.34", "all"), ("1.34", "none"), ("1.36", "all"), ("1.36", "none")]
)
def test_operator_reboot_every_pod_back_on_its_slot(
    systemd_ns: NsFactory, tmp_path: Path, api: Path, kubelet: str, case: str
) -> None:
    require_tool("gcc")
    node = boot(systemd_ns, tmp_path, api, gpuguard=True, kubelet=kubelet, pci=True)
    slots = two_gpu_pods(node)
    before = {g["pci_bus_id"]: g["uuid"] for g in node.inventory}
    t0 = node.reboot(gpus_after(node, case, slots["gpu-b"]), driver="late")

    def back(p: Dict[str, Pod]) -> bool:
        return all(n in p and p[n].running for n in F1_PODS)

    try:
        node.wait_pods(
            back,
            90,
            f"{F1_PODS} Running again after the driver arrived",
            never=lambda p: any(n in p and p[n].phase == "Failed" for n in F1_PODS),
        )
    except AssertionError:
        print(node.log(READMIT, 60), node.log("gpuguard.service", 120), sep="\n")
        # the three units' gpuguard lines in time order: the hook's (kubelet.service's
        # ExecStartPre) against the bridge's view at that kubelet start
        argv = ["journalctl", "--no-pager", "-o", "short-precise", "-n", "600",
                "-u", "kubelet.service", "-u", READMIT, "-u", "gpuguard.service"]  # fmt: skip
        print("\n".join(x for x in node.ns.run(argv).stdout.splitlines() if "gpuguard" in x))
        print(node.ns.path("/var/lib/gpuguard/gpu-identity.json").read_text()[:4000])
        raise
    t = time.monotonic()
    print(f"\noperator-reboot figures: kubelet={kubelet} uuids={case} "
          f"pods_back={len(F1_PODS)}/{len(F1_PODS)} "
          f"seconds_from_kubelet_start={t - t0:.1f} "
          f"seconds_from_driver={t - node.driver_at:.1f}")  # fmt: skip
    held = []
    for name in F1_PODS:
        c = node.running(name)
        assert node.slot(c) == slots[name], f"{name} moved from {slots[name]} to {node.slot(c)}"
        assert (c.visible == before[slots[name]]) == (case == "none"), (c.visible, before)
        held.append(c.visible)
    assert len(set(held)) == len(held)
    # the bridge vouched at kubelet's first start of the boot, before the driver: from
    # the PCI bus and the history, never from the GPU list it could not see
    offered = [e for e in node.ns.journal(READMIT) if e.get("GPUGUARD_KIND") == "readmit-offered"]
    evidence = [str(e.get("EVIDENCE", "")) for e in offered]
    assert any(e in (DRIVER_NOT_LOADED, THIS_BOOT) for e in evidence), evidence
