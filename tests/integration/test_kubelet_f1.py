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

Two stacks run the same test bodies (integration/kubelet_sites.py): ``host``, this
machine's own systemd 252, containerd 1.6 and runc 1.1 in a systemd namespace with
gpuguard from this checkout, every case; and ``trixie``, Debian 13's root booted with
its own systemd 257, containerd 1.7 (its CRI plugin serving kubelet 1.20's v1alpha2)
and runc 1.1.15, gpuguard installed from its .deb, the cases of :data:`ROOT_RUNS`.

On cgroup v1 (hybrid) only: on these machines runc cannot create a pod sandbox in a
private unified hierarchy (the kernel keeps the cpu controller in v1, and containerd
gives every sandbox CPU shares: ``cpu.weight: no such file or directory``; see
harness/kubelet.py).

Each test prints its figures (``F1 figures: ...``: pods back / pods before, and the
seconds from kubelet's start to every GPU pod Running; run with ``-s``) and writes
them, with the versions its node ran, to ``build/stacks/f1-STACK-LAYOUT-CASE-MODE.json``
(docs/support-matrix.md's F1 matrix is rendered from them: scripts/stack-matrix).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from types import TracebackType
from typing import Any, Callable, Dict, List, Optional, Tuple, Type

import pytest

from integration.harness import systemd_ns as systemd_ns
from integration.harness.pods import Pod
from integration.harness.sysns import REPO
from integration.kubelet_node import (
    F1_CASES,
    F1_PODS,
    GpuNode,
    NsFactory,
    Site,
    boot,
    boot_on,
    f1_reboot,
    free_minor,
    gpu_pod,
)
from integration.kubelet_node import api as api
from integration.kubelet_node import sites as sites

pytestmark = pytest.mark.root

RESULTS = REPO / "build" / "stacks"
#: The cases a debootstrapped root runs (the host's stack runs every case): without
#: gpuguard the failure once, with gpuguard every case (about 20 s each here).
ROOT_RUNS: Dict[str, Dict[str, Tuple[str, ...]]] = {
    "trixie": {"none": ("all",), "yes": F1_CASES},
}
#: The cases kubelet 1.34 runs on the host's stack (stack ``host-1.34``): without
#: gpuguard no GPU changed (every pod fails all the same: the baseline), with it no
#: GPU, one and all changed, and one gone.
K134_RUNS: Dict[str, Tuple[str, ...]] = {"none": ("none",), "yes": ("none", "one", "all", "gone")}


def runs(mode: str) -> List[Any]:
    """(stack, case) of the tests of ``mode`` ("none": without gpuguard, "yes": with)."""
    out = [pytest.param("host", c, id=f"host-{c}") for c in F1_CASES]
    for stack, modes in ROOT_RUNS.items():
        out += [pytest.param(stack, c, id=f"{stack}-{c}") for c in modes[mode]]
    out += [pytest.param("host-1.34", c, id=f"host-1.34-{c}") for c in K134_RUNS[mode]]
    return out


def _boot(sites: Callable[[str], Site], stack: str, tmp: Path, api: Path, **kw: Any) -> GpuNode:
    """The node of ``stack``: a site's name, ``-1.34`` for kubelet 1.34 (else 1.20)."""
    site, _, version = stack.partition("-")
    return boot_on(sites(site), tmp, api, kubelet=version or "1.20", **kw)


class F1Run:
    """One test's outcome for the stack matrix: its figures, the versions its node ran,
    and whether it passed (a test that fails records "fail"), written on exit."""

    def __init__(self, request: pytest.FixtureRequest, stack: str, case: str, mode: str) -> None:
        self.node: Optional[GpuNode] = None
        self.doc: Dict[str, Any] = {
            "scenario": "f1",
            "stack": stack,
            "layout": "v1",
            "case": case,
            "gpuguard": mode,
            "pods_before": len(F1_PODS),
            "pods_back": 0,
            "seconds": None,
            "outcome": "",
            "test": request.node.nodeid,
        }
        self.path = RESULTS / f"f1-{stack}-v1-{case}-{mode}.json"
        self.path.unlink(missing_ok=True)

    def done(self, back: int, seconds: Optional[float], outcome: str) -> None:
        self.doc.update(pods_back=back, outcome=outcome)
        self.doc["seconds"] = round(seconds, 1) if seconds is not None else None
        d = self.doc
        _figures(d["case"], d["gpuguard"], back, seconds, d["stack"])

    def __enter__(self) -> F1Run:
        return self

    def __exit__(
        self,
        kind: Optional[Type[BaseException]],
        exc: Optional[BaseException],
        _tb: Optional[TracebackType],
    ) -> None:
        if isinstance(exc, pytest.skip.Exception):
            return  # not run here (no root or a tool missing): no result either way
        node = self.node
        self.doc.update(
            suite=node.versions.get("release", "") if node else "",
            versions={k: v for k, v in (node.versions if node else {}).items() if k != "release"},
            install=node.install if node else "",
            result="fail" if exc else "pass",
        )
        if exc:
            self.doc["outcome"] = (
                f"{kind.__name__ if kind else ''}: {str(exc).splitlines()[0][:300]}"
            )
        RESULTS.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(self.doc, indent=1, sort_keys=True) + "\n")


def _figures(
    case: str, gpuguard: str, back: int, seconds: Optional[float], stack: str = "host"
) -> None:
    """One line per run: pods back / pods before, seconds from kubelet's start."""
    took = f"{seconds:.1f}" if seconds is not None else "-"
    print(
        f"\nF1 figures: stack={stack} case={case} gpuguard={gpuguard} "
        f"pods_back={back}/{len(F1_PODS)} seconds_to_running={took}"
    )


def _crash_looping(pod: Pod, old_uuid: str) -> bool:
    waiting = [c["state"]["waiting"] for c in pod.containers.values() if "waiting" in c["state"]]
    return (
        bool(waiting)
        and waiting[0].get("reason") == "CrashLoopBackOff"
        and f"device error: {old_uuid}: unknown device" in pod.errors()
    )


@pytest.mark.parametrize(("stack", "case"), runs("none"))
def test_f1_without_gpuguard_pods_crash_loop(
    sites: Callable[[str], Site],
    tmp_path: Path,
    api: Path,
    request: pytest.FixtureRequest,
    stack: str,
    case: str,
) -> None:
    with F1Run(request, stack, case, "none") as run:
        node = run.node = _boot(sites, stack, tmp_path, api, gpuguard=False)
        slots, before, _t0 = f1_reboot(node, case)
        if node.kubelet.version != "1.20":
            _all_fail_admission(node, run)
            return
        changed = [p for p in F1_PODS if case != "one" or p == "gpu-b"]
        pods = node.wait_pods(
            lambda p: all(n in p and _crash_looping(p[n], before[slots[n]]) for n in changed),
            90,
            f"{changed} in CrashLoopBackOff with the runtime hook's 'unknown device'",
        )
        if case == "one":  # the pod whose GPU kept its UUID runs on
            pods = node.wait_pods(lambda p: p["gpu-a"].running, 30, "gpu-a running")
        assert not any(pods[n].running for n in changed)
        back = sum(pods[n].running for n in F1_PODS)
        run.done(back, None, f"{', '.join(changed)} CrashLoopBackOff (unknown device)")


def _all_fail_admission(node: GpuNode, run: F1Run) -> None:
    """kubelet 1.26+ without gpuguard: it re-admits its pods before any plugin has
    reported a healthy device, and rejects every GPU pod for good, GPUs changed or not
    (upstream kubernetes #125579, #133382)."""
    pods = node.wait_pods(
        lambda p: all(n in p and p[n].phase == "Failed" for n in F1_PODS), 60, "pods Failed"
    )
    for name in F1_PODS:
        assert pods[name].reason == "UnexpectedAdmissionError", pods[name]
        assert "no healthy devices present" in pods[name].message, pods[name]
    run.done(0, None, "every GPU pod UnexpectedAdmissionError (no healthy devices present)")


def _still_there(case: str) -> List[str]:
    """The pods whose GPU is still on the node after the reboot of ``case``."""
    return [p for p in F1_PODS if case != "gone" or p != "gpu-b"]


def _gpu_pods_back(node: GpuNode, case: str, t0: float) -> Tuple[Dict[str, Pod], float]:
    """Wait for the target outcome: every pod whose GPU is still there Running (fail at
    once when one fails for good), the others left out; the pods, and the seconds from
    kubelet's start."""
    back = _still_there(case)

    def done(p: Dict[str, Pod]) -> bool:
        return all(n in p and p[n].running for n in back)

    def failed(p: Dict[str, Pod]) -> bool:  # a static pod failed at admission never returns
        return any(n in p and p[n].phase == "Failed" for n in back)

    try:
        pods = node.wait_pods(done, 60, f"{back} Running again", never=failed)
    except AssertionError:
        print("\nF1: a pod failed for good: not every pod came back")
        if node.gpuguard:
            print(node.log("gpuguard-readmit.service", lines=20))
        raise
    return pods, time.monotonic() - t0


@pytest.mark.parametrize(("stack", "case"), runs("yes"))
def test_f1_with_gpuguard_every_pod_back_on_its_slot(
    sites: Callable[[str], Site],
    tmp_path: Path,
    api: Path,
    request: pytest.FixtureRequest,
    stack: str,
    case: str,
) -> None:
    with F1Run(request, stack, case, "yes") as run:
        node = run.node = _boot(sites, stack, tmp_path, api, gpuguard=True)
        slots, before, t0 = f1_reboot(node, case)
        pods, seconds = _gpu_pods_back(node, case, t0)
        held = []
        for name in _still_there(case):
            c = node.running(name)
            assert node.made_by(c) == "runc", f"{name}: {node.made_by(c)}"
            assert node.slot(c) == slots[name], f"{name} moved from {slots[name]} to {node.slot(c)}"
            assert c.visible != before[slots[name]] or case in ("one", "none")
            mine = next(g["minor"] for g in node.inventory if g["uuid"] == c.visible)
            verdicts = node.verdicts(c)
            assert verdicts[mine] is True, f"{name}: its GPU denied: {verdicts}"
            assert all(v is False for m, v in verdicts.items() if m != mine), verdicts
            held.append(c)
        outcome = f"{', '.join(_still_there(case))} Running on its slot's GPU"
        if case == "gone":  # left out, and says why
            b = pods["gpu-b"]
            assert (b.phase, b.reason) == ("Failed", "UnexpectedAdmissionError")
            outcome += ", gpu-b (its GPU gone) UnexpectedAdmissionError"
        # nothing allocated twice: a new pod gets the one GPU nobody holds
        node.write_pod(gpu_pod("gpu-c"))
        node.wait_pods(lambda p: "gpu-c" in p and p["gpu-c"].running, 60, "gpu-c running")
        c = node.running("gpu-c")
        free = free_minor(node, held)
        assert [g["minor"] for g in node.inventory if g["uuid"] == c.visible] == free
        ids = [i for v in node.checkpoint_ids().values() for i in v]
        assert len(ids) == len(set(ids)), f"a GPU allocated twice: {node.checkpoint_ids()}"
        # ... and it got it from the real plugin, which had registered after the reboot
        allocs = node.plugin_allocations()
        assert allocs and allocs[-1] == [c.visible], f"gpu-c: {c.visible}, plugin: {allocs}"
        if node.kubelet.version != "1.20":
            _bridge_vouched_only_held_gpus(node, held)
        run.done(len(held), seconds, outcome)


def _bridge_vouched_only_held_gpus(node: GpuNode, held: List[Any]) -> None:
    """kubelet 1.26+: gpuguard's bridge reported healthy exactly the GPUs of the pods
    that came back, at this kubelet start, and kubelet never counted more GPUs than the
    node has."""
    (offer,) = node.bridge_offers()
    assert sorted(offer["DEVICES"].split(",")) == sorted(c.visible for c in held), offer
    caps = node.kubelet.capacities(node.kubelet_log())
    assert caps and max(caps) <= len(node.inventory), caps


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
