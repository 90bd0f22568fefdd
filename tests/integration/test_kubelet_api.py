"""GPU pods as fleets run them, through a real API server, scheduler and controllers
(harness/cluster.py, integration/cluster_node.py), on kubelet 1.34.9 and 1.36.2 with
gpuguard installed (host driver: the GPUs are there when the node boots):

* a bare Pod, a Deployment (1 replica) and a Job (``backoffLimit: 2``) each holding one
  GPU, the device plugin double a DaemonSet (hostNetwork, privileged) that kubelet
  starts again after the reboot: every original pod runs again on its slot, none
  replaced (the same pod UIDs, the Job's one pod never failed), with the GPUs' UUIDs
  the same (1.34) or every one new (1.36);
* a Deployment's pod deleted through the API while the node is down, the plugin's pod
  held back 30 s after kubelet's start: no pod may fail with the bridge's Allocate
  (``Unimplemented``) and at most one be rejected (what kubelet does without gpuguard);
  the bridge's report of a rejected pod names its ReplicaSet's replacement, Running,
  or says it is lost.

The Job restarts its container in place (``restartPolicy: OnFailure``): a reboot kills
every container, and kubelet starts no container of a ``Never`` pod again (it ends
Failed whatever gpuguard does). Its ``backoffLimit`` is 2, not 0: the job controller
counts the restart a reboot makes (restartCount 1) against the limit, and with 0 it
fails the Job (BackoffLimitExceeded) after every reboot, gpuguard or not (measured). A
pod kubelet rejected would still show: Failed, counted, and a second pod made.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, List, Mapping, Optional

import pytest

from integration.cluster_node import (
    WORKLOADS,
    ApiNode,
    bare_pod,
    boot_api,
    deleted_pod_scenario,
    deployment,
    failed,
    job,
)
from integration.gpuguard_ns import wait_for
from integration.harness import systemd_ns as systemd_ns
from integration.harness.cluster import ApiPod, show_api
from integration.kubelet_node import READMIT, gpus_after
from integration.kubelet_node import api as api
from integration.kubelet_sites import NsFactory

pytestmark = pytest.mark.root


@pytest.mark.parametrize(("kubelet", "case"), [("1.34", "none"), ("1.36", "all")])
def test_api_pods_back_on_their_slots_after_reboot(
    systemd_ns: NsFactory, tmp_path: Path, api: Path, kubelet: str, case: str
) -> None:
    n = boot_api(systemd_ns, tmp_path, api, gpuguard=True, kubelet=kubelet)
    before = n.run(bare_pod(), deployment(), job(), workloads=WORKLOADS)
    uuids = {g["pci_bus_id"]: g["uuid"] for g in n.node.inventory}
    old = {p.uid: p.container_ids() for p in n.cluster.pods()}
    n.reboot(gpus_after(n.node, case, before["gpu-bare"].slot))
    uids = {p.uid for p in before.values()}

    def settled(pods: List[ApiPod]) -> bool:
        """Every pod Running in a container of this boot (the API's status until
        kubelet's first update is the last boot's), or one failed or replaced."""
        ours = [p for p in pods if p.labels.get("app") in WORKLOADS]
        back = [p for p in ours if p.running and p.container_ids() != old.get(p.uid)]
        return len(back) == len(uids) or bool(failed(ours)) or len(ours) > len(uids)

    pods = n.cluster.wait_pods(settled, 90, "the GPU pods Running again")
    ours = [p for p in pods if p.labels.get("app") in WORKLOADS]
    assert not failed(ours), show_api(ours)
    assert sorted(p.uid for p in ours) == sorted(uids), f"replaced: {show_api(ours)}"
    assert {w: n.placed(w, pods) for w in WORKLOADS} == before
    now = {g["pci_bus_id"]: g["uuid"] for g in n.node.inventory}
    changed = {slot for slot in now if now[slot] != uuids[slot]}
    assert changed == (set(now) if case == "all" else set())
    # the job controller has seen the pod of this boot ready: nothing failed, one pod
    jobs = n.cluster.wait(
        lambda: [j for j in [n.cluster.get("job", "gpu-job")] if j["status"].get("ready") == 1],
        30,
        "the Job's pod ready",
    )
    status = jobs[0]["status"]
    assert status.get("failed", 0) == 0 and status.get("active") == 1, status


def test_deleted_pod_no_pod_failed_by_the_bridge(
    systemd_ns: NsFactory, tmp_path: Path, api: Path
) -> None:
    """The pod kept runs again (the bridge re-admits it); of the replacements at most
    one is rejected (kubelet alone rejects the first: no device healthy yet, and the
    kept pod too), none fails with the bridge's Allocate (``Unimplemented``)."""
    n = boot_api(systemd_ns, tmp_path, api, gpuguard=True, kubelet="1.34", n_gpus=2)
    kept, pods = deleted_pod_scenario(n)
    unimplemented = [p for p in pods if "Unimplemented" in p.messages()]
    print(
        f"deleted-pod scenario: {len(failed(pods))} failed, "
        f"{len(unimplemented)} Unimplemented of {len(pods)} gpu-web pods"
    )
    assert not unimplemented, f"{len(unimplemented)} failed with Unimplemented: {show_api(pods)}"
    (again,) = [p for p in pods if p.uid == kept.uid]
    assert again.running, show_api(pods)
    assert len(failed(pods)) <= 1, f"{show_api(pods)}\n{bridge_journal(n)}"
    # the report of each pod kubelet rejected names its ReplicaSet's replacement, which
    # runs, or says it is lost (readmit/fates.py, from the API server's pods of the node)
    for p in failed(pods):
        said = wait_for(lambda p=p: fate_said(n, p.uid), 60, f"the bridge's word on {p.name}")
        print(f"{p.name}: {said['GPUGUARD_KIND']} {said['MESSAGE']}")
        (first,) = [e for e in n.ns.journal(READMIT) if e.get("GPUGUARD_KIND") == "readmit-rejected"
                    and e.get("POD_UID") == p.uid]  # fmt: skip
        assert first["POD"] == f"default/{p.name}", first
        if said["FATE"] == "lost":
            assert "it is lost" in said["MESSAGE"], said
            continue
        (by,) = [q for q in n.of("gpu-web") if q.uid == said["REPLACEMENT_UID"]]
        assert said["OWNER"] == p.owner and by.owner == p.owner, (said, show_api(pods))
        assert by.running and by.uid != kept.uid, show_api(pods)
        assert said["REPLACEMENT"] == f"default/{by.name}", said
        assert f"replaced it with default/{by.name} ({by.uid})" in said["MESSAGE"], said


def fate_said(n: ApiNode, uid: str) -> Optional[Mapping[str, Any]]:
    """The bridge's latest word on rejected pod ``uid``'s fate once settled: lost, or
    replaced by a pod the API server has Running (None before)."""
    time.sleep(0.5)  # a journal read per half second
    kinds = ("readmit-rejected", "readmit-pod-fate")
    said = [e for e in n.ns.journal(READMIT) if e.get("GPUGUARD_KIND") in kinds
            and e.get("POD_UID") == uid]  # fmt: skip
    if not said:
        return None
    last = said[-1]
    if last.get("FATE") == "lost":
        return last
    running = {q.uid for q in n.of("gpu-web") if q.running}
    return last if last.get("REPLACEMENT_UID") in running else None


def bridge_journal(n: ApiNode) -> str:
    """The re-admission bridge's journal of this boot, for a failure's message."""
    argv = ["journalctl", "--no-pager", "-o", "cat", "-u", READMIT]
    out = n.ns.run(argv, timeout=30).stdout
    return out if len(out) < 8000 else f"{out[:4000]}\n...\n{out[-4000:]}"
