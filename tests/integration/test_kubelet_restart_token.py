"""A kubelet restart that gpuguard itself asks for, on the real kubelet: the token's
round trip through the pre-start hook (docs/checkpoint.md, "Only verified outcomes").

The node reboots with new GPU UUIDs, and its GPUs come up only after kubelet has
started: the pre-start hook found none, so it left the checkpoint alone (an inventory
without GPUs never makes gpuguard drop anything: a ``not-repaired`` record, with no
token since nobody asked) and kubelet runs on the stale file.
When the driver is up, the daemon's next pass finds the stale checkpoint under a
running kubelet whose unit has gpuguard's drop-in, with the two pods kubelet still has
remapped (the late driver: RestartPolicy=for-pods restarts for them): it writes a
token, restarts kubelet through systemd, and reports the repair only because the
hook's record carries that token and says ``repaired``, and the file kubelet runs on
names no stale GPU.

On cgroup v1 only, like every real-kubelet test (harness/kubelet.py says why).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List

import pytest

from integration.gpuguard_ns import events, status, wait_for
from integration.harness import systemd_ns as systemd_ns
from integration.kubelet_node import PLUGIN, GpuNode, NsFactory, boot, gpu_pod, gpus
from integration.kubelet_node import api as api

pytestmark = pytest.mark.root

RESULT = "/run/gpuguard/kubelet-hook.result"
REQUEST = "/run/gpuguard/kubelet-hook.request"


def _repairs(node: GpuNode) -> List[Dict[str, Any]]:
    """The checkpoint repairs in the daemon's status file (status "done": verified)."""
    changes = status(node.ns).get("recent_changes", [])
    return [c for c in changes if c["kind"] == "checkpoint-repaired"]


def test_restart_requested_by_gpuguard_is_verified_by_its_token(
    systemd_ns: NsFactory, tmp_path: Path, api: Path
) -> None:
    node = boot(systemd_ns, tmp_path, api, gpuguard=True, config="[Daemon]\nAuditInterval=1s\n")
    for name in ("gpu-a", "gpu-b"):
        node.write_pod(gpu_pod(name))
    node.wait_pods(lambda p: all(n in p and p[n].running for n in ("gpu-a", "gpu-b")), 60, "pods")
    old = {g["uuid"] for g in node.inventory}
    new = gpus(len(old))

    # the reboot, with the GPUs not up yet when kubelet starts
    node.stop_kubelet()
    node.ns.systemctl("stop", PLUGIN, "gpuguard.service")
    node.kill_all()
    node.set_gpus([])  # the GPUs not up yet: NVML lists none, no GPU nodes
    node.start_gpuguard()
    node.start_kubelet()
    first = json.loads(node.ns.path(RESULT).read_text())
    assert (first["token"], first["outcome"]) == ("", "not-repaired"), first
    run = node.ns.unit_property("kubelet.service", "InvocationID")

    node.set_gpus(new)  # the GPUs are up: the next audit pass sees the stale file
    wait_for(lambda: events(node.ns, "kubelet-restart"), 30, "gpuguard restarting kubelet")
    done = wait_for(lambda: _repairs(node), 30, "the verified repair in the daemon's status")
    assert [c["status"] for c in done] == ["done"], done  # "done" only once verified
    record = json.loads(node.ns.path(RESULT).read_text())
    assert record["outcome"] == "repaired" and record["token"], record
    assert record["before_sha256"] != record["after_sha256"]
    assert not node.ns.path(REQUEST).exists()
    (restart,) = events(node.ns, "kubelet-restart")
    assert restart["UNIT"] == "kubelet.service", restart
    # RestartPolicy=for-pods: the restart is for the two pods kubelet still has, whose
    # entries are remapped to the GPUs now in their slots
    assert sorted(restart["POD_UIDS"].split(",")) == sorted(
        gpu_pod(n)["metadata"]["uid"] for n in ("gpu-a", "gpu-b")
    ), restart
    assert not events(node.ns, "checkpoint-repair-unverified")
    # the repair itself was the hook's, in kubelet's own journal
    hook = [e for e in node.ns.journal("kubelet.service") if e.get("GPUGUARD_KIND")]
    assert [e["GPUGUARD_KIND"] for e in hook if e["GPUGUARD_KIND"] == "checkpoint-repaired"] == [
        "checkpoint-repaired"
    ]
    node.ns.wait_active("kubelet.service")
    assert node.ns.unit_property("kubelet.service", "InvocationID") != run
    ids = {i for v in node.checkpoint_ids().values() for i in v}
    assert not ids & old, f"kubelet runs on stale IDs: {ids & old}"
