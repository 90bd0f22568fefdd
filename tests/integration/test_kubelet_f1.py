"""F1 on the real kubelet 1.20.2: two GPU pods, then a reboot in which the GPUs come
back with new UUIDs (integration/kubelet_node.py: the same PCI bus ids and indices).

Three cases: every GPU changed its UUID (``all``); only the GPU of pod ``gpu-b``
changed (``one``); every GPU changed and the one of ``gpu-b`` did not come back
(``gone``). Two GPU static pods hold one GPU each, out of three.

What kubelet 1.20 does (seen here): it re-admits its pods at start, before any plugin
has registered, and reuses a pod's checkpointed allocation without checking it.

* Without gpuguard the containers are started with the checkpointed, old
  ``NVIDIA_VISIBLE_DEVICES``; the runtime hook refuses them ("device error:
  GPU-...: unknown device") and they stay in CrashLoopBackOff.
* With gpuguard (it remaps an entry's old UUID to the new UUID of the same slot, by
  PCI bus id, from its GPU identity history): every pod that ran before runs again on
  the first kubelet start, with the GPU of the same slot, and nothing is allocated
  twice (a third pod gets the third GPU); with a GPU gone for good only its pod is
  left out.
* With gpuguard but without its state directory (lost with the reboot: no record of
  which UUID sat in which slot) it can only drop the stale entries: kubelet accepts
  the rewritten file, finds no allocation for the pods, and fails them for good before
  the plugin registers: ``UnexpectedAdmissionError ... Requested: 1, Available: 0``
  (:func:`test_f1_state_lost_pods_fail_admission`).

On cgroup v1 (hybrid) only: on these machines runc cannot create a pod sandbox in a
private unified hierarchy (the kernel keeps the cpu controller in v1, and containerd
gives every sandbox CPU shares: ``cpu.weight: no such file or directory``; see
harness/kubelet.py).

Each test prints its figures (``F1 figures: ...``: pods back / pods before, and the
seconds from kubelet's start to every GPU pod Running; run with ``-s``).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Dict, List, Optional

import pytest

from integration.harness import systemd_ns as systemd_ns
from integration.harness.pods import Pod
from integration.kubelet_node import (
    F1_CASES,
    F1_PODS,
    GpuNode,
    NsFactory,
    boot,
    f1_reboot,
    free_minor,
    gpu_pod,
)
from integration.kubelet_node import api as api

pytestmark = pytest.mark.root


def _figures(case: str, gpuguard: str, back: int, seconds: Optional[float]) -> None:
    """One line per run: pods back / pods before, seconds from kubelet's start."""
    took = f"{seconds:.1f}" if seconds is not None else "-"
    print(
        f"\nF1 figures: case={case} gpuguard={gpuguard} pods_back={back}/{len(F1_PODS)} "
        f"seconds_to_running={took}"
    )


def _crash_looping(pod: Pod, old_uuid: str) -> bool:
    waiting = [c["state"]["waiting"] for c in pod.containers.values() if "waiting" in c["state"]]
    return (
        bool(waiting)
        and waiting[0].get("reason") == "CrashLoopBackOff"
        and f"device error: {old_uuid}: unknown device" in pod.errors()
    )


@pytest.mark.parametrize("case", F1_CASES)
def test_f1_without_gpuguard_pods_crash_loop(
    systemd_ns: NsFactory, tmp_path: Path, api: Path, case: str
) -> None:
    node = boot(systemd_ns, tmp_path, api, gpuguard=False)
    slots, before, _t0 = f1_reboot(node, case)
    changed = [p for p in F1_PODS if case != "one" or p == "gpu-b"]
    pods = node.wait_pods(
        lambda p: all(n in p and _crash_looping(p[n], before[slots[n]]) for n in changed),
        90,
        f"{changed} in CrashLoopBackOff with the runtime hook's 'unknown device'",
    )
    if case == "one":  # the pod whose GPU kept its UUID runs on
        pods = node.wait_pods(lambda p: p["gpu-a"].running, 30, "gpu-a running")
    assert not any(pods[n].running for n in changed)
    _figures(case, "none", sum(pods[n].running for n in F1_PODS), None)


def _still_there(case: str) -> List[str]:
    """The pods whose GPU is still on the node after the reboot of ``case``."""
    return [p for p in F1_PODS if case != "gone" or p != "gpu-b"]


def _gpu_pods_back(node: GpuNode, case: str, t0: float) -> Dict[str, Pod]:
    """Wait for the target outcome: every pod whose GPU is still there Running (fail at
    once when one fails for good), the others left out; print the figures."""
    back = _still_there(case)

    def done(p: Dict[str, Pod]) -> bool:
        return all(n in p and p[n].running for n in back)

    def failed(p: Dict[str, Pod]) -> bool:  # a static pod failed at admission never returns
        return any(n in p and p[n].phase == "Failed" for n in back)

    try:
        pods = node.wait_pods(done, 60, f"{back} Running again", never=failed)
    except AssertionError:
        _figures(case, "yes", 0, None)  # a pod failed for good: not every pod came back
        raise
    _figures(case, "yes", len(back), time.monotonic() - t0)
    return pods


@pytest.mark.parametrize("case", F1_CASES)
def test_f1_with_gpuguard_every_pod_back_on_its_slot(
    systemd_ns: NsFactory, tmp_path: Path, api: Path, case: str
) -> None:
    node = boot(systemd_ns, tmp_path, api, gpuguard=True)
    slots, before, t0 = f1_reboot(node, case)
    pods = _gpu_pods_back(node, case, t0)
    held = []
    for name in _still_there(case):
        c = node.running(name)
        assert node.slot(c) == slots[name], f"{name} moved from {slots[name]} to {node.slot(c)}"
        assert c.visible != before[slots[name]] or case == "one"
        mine = next(g["minor"] for g in node.inventory if g["uuid"] == c.visible)
        verdicts = node.verdicts(c)
        assert verdicts[mine] is True, f"{name}: its GPU denied: {verdicts}"
        assert all(v is False for m, v in verdicts.items() if m != mine), verdicts
        held.append(c)
    if case == "gone":  # left out, and says why
        assert (pods["gpu-b"].phase, pods["gpu-b"].reason) == ("Failed", "UnexpectedAdmissionError")
    # nothing allocated twice: a new pod gets the one GPU nobody holds
    node.write_pod(gpu_pod("gpu-c"))
    node.wait_pods(lambda p: "gpu-c" in p and p["gpu-c"].running, 60, "gpu-c running")
    c = node.running("gpu-c")
    assert [g["minor"] for g in node.inventory if g["uuid"] == c.visible] == free_minor(node, held)
    ids = [i for v in node.checkpoint_ids().values() for i in v]
    assert len(ids) == len(set(ids)), f"a GPU allocated twice: {node.checkpoint_ids()}"


@pytest.mark.parametrize("case", ("all", "one"))
def test_f1_state_lost_pods_fail_admission(
    systemd_ns: NsFactory, tmp_path: Path, api: Path, case: str
) -> None:
    """gpuguard without its record of the GPUs (state directory lost with the reboot):
    it can only drop the stale entries, and kubelet 1.20 then fails the re-admitted
    pods whose GPU changed for good; with one changed, the other pod runs. Without the
    remap it is the outcome with the state directory intact, too."""
    node = boot(systemd_ns, tmp_path, api, gpuguard=True)
    _slots, before, _t0 = f1_reboot(node, case, lose_state=True)
    failing = ["gpu-a", "gpu-b"] if case == "all" else ["gpu-b"]
    kept = [n for n in F1_PODS if n not in failing]
    pods = node.wait_pods(
        lambda p: (
            all(n in p and p[n].phase == "Failed" for n in failing)
            and all(n in p and p[n].running for n in kept)
        ),
        60,
        f"{failing} Failed, {kept} running",
    )
    for name in failing:
        assert pods[name].reason == "UnexpectedAdmissionError", pods[name]
        assert "Requested: 1, Available: 0" in pods[name].message, pods[name]
    # kubelet accepted the rewritten file: no stale ID left, no checksum complaint
    stale = set(before.values()) - {g["uuid"] for g in node.inventory}
    ids = {i for v in node.checkpoint_ids().values() for i in v}
    assert not ids & stale, ids
    assert "checksum" not in node.log(lines=400).lower()
    _figures(case, "drop", len(kept), None)
