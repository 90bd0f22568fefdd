"""Seed 002 on the real kubelet: the CPU manager's static policy and a GPU pod.

A Guaranteed pod with one whole CPU and one GPU gets an exclusive CPU; the CPU
manager's reconcile loop (every ``--cpu-manager-reconcile-period``) then updates the
container's cpuset through the runtime (CRI UpdateContainerResources: ``runc update``).
With the systemd cgroup driver runc sends the scope's device list to systemd with every
update, and systemd applies it again: the GPU that NVIDIA's legacy hook had granted
behind runc's back is gone at the first reconcile ("Failed to initialize NVML: Unknown
Error" in the container). With gpuguard, the container's scope gets a durable
``DeviceAllow=`` for its GPU as soon as it starts, and every update keeps it.

The verdict is the kernel's: a probe open of the GPU's node from the container's own
devices cgroup (EPERM: denied; ENXIO: allowed).

On cgroup v1 only, like every real-kubelet test (harness/kubelet.py says why).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, List

import pytest

from integration.harness import systemd_ns as systemd_ns
from integration.harness.kubelet import Container
from integration.kubelet_node import GpuNode, NsFactory, boot, gpu_pod, hook_log
from integration.kubelet_node import api as api

pytestmark = pytest.mark.root

#: both kubelets without gpuguard (harness/kubelet_versions.py: 1.34 gets the flags as
#: configuration); with gpuguard 1.20, the one whose reconcile rewrites the scope
KUBELETS = ("1.20", "1.34")
PERIOD = 2.0
FLAGS = (
    "--cpu-manager-policy=static",
    "--reserved-cpus=0",
    f"--cpu-manager-reconcile-period={PERIOD:g}s",
)


def _guaranteed_gpu_pod(node: GpuNode) -> tuple[Container, int]:
    """The pod running, granted its GPU by the hook; its container and GPU minor."""
    node.write_pod(gpu_pod("train", cpu="1", memory="64Mi"))
    node.wait_pods(lambda p: "train" in p and p["train"].running, 60, "the Guaranteed pod")
    c = node.running("train")
    assert [e["id"] for e in hook_log(node)] == [c.id], "the hook did not grant it"
    return c, next(g["minor"] for g in node.inventory if g["uuid"] == c.visible)


def _verdicts_over(node: GpuNode, c: Container, minor: int, seconds: float) -> List[Any]:
    """The kernel's verdicts on the container's GPU, sampled for ``seconds``."""
    out = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        out.append(node.verdicts(c)[minor])
        time.sleep(0.25)
    return out


def _cpus_set_at(node: GpuNode, c: Container) -> int:
    """When the scope's AllowedCPUs= was last set: runc's systemd driver sets it (with
    the scope's device list) at every CPU manager update, and systemd rewrites this."""
    dropin = node.ns.path(f"/run/systemd/transient/{c.scope}.d/50-AllowedCPUs.conf")
    return dropin.stat().st_mtime_ns


def _through_reconciles(node: GpuNode) -> List[Any]:
    """The Guaranteed GPU pod's verdicts on its GPU over 3 reconcile periods, at least
    one of which updated the container (1.20); none did (1.34: its CPU manager sends a
    container's cpuset again only when it changed)."""
    c, minor = _guaranteed_gpu_pod(node)
    mark = _cpus_set_at(node, c)
    seen = _verdicts_over(node, c, minor, 3 * PERIOD)
    updated = _cpus_set_at(node, c) > mark
    if node.kubelet.version == "1.20":
        assert updated, "no reconcile updated the container"
    else:
        assert not updated, "kubelet 1.34 updated an unchanged cpuset"
    return seen


@pytest.mark.parametrize("kubelet", KUBELETS)
def test_cpu_manager_takes_the_gpu_without_gpuguard(
    systemd_ns: NsFactory, tmp_path: Path, api: Path, kubelet: str
) -> None:
    node = boot(systemd_ns, tmp_path, api, gpuguard=False, flags=FLAGS, kubelet=kubelet)
    seen = _through_reconciles(node)
    if kubelet == "1.20":
        assert seen[-1] is False, f"still allowed after 3 reconcile periods: {seen}"
    else:  # no update, nothing taken (a daemon-reload still takes it: F2's tests)
        assert all(seen), f"denied at some point: {seen}"


@pytest.mark.parametrize("kubelet", ["1.20"])
def test_cpu_manager_keeps_the_gpu_with_gpuguard(
    systemd_ns: NsFactory, tmp_path: Path, api: Path, kubelet: str
) -> None:
    node = boot(systemd_ns, tmp_path, api, gpuguard=True, flags=FLAGS, kubelet=kubelet)
    seen = _through_reconciles(node)
    assert all(seen), f"denied at some point: {seen}"
