"""No GPU held twice, at any moment, across a GPU Operator node's reboot into new
UUIDs on the real kubelet (issue 42, item 3).

Two static GPU pods run on a node of four GPUs; the node reboots in the Operator's
layout (GpuNode.reboot(driver="late")) with a new UUID for every GPU. The re-admission
bridge vouches for the checkpoint's old UUIDs from PCI + history, kubelet re-admits the
pods on them; the driver then arrives with the new UUIDs and the real plugin registers
them at once, while gpuguard's daemon remaps the checkpoint by slot and restarts
kubelet. Throughout, new GPU pods keep arriving (one every 0.3 s once the driver is
there), each one a chance for kubelet to give a new pod the new UUID of a slot that a
re-admitted pod holds under its old one.

Every ~100 ms a sampler reads (a) each running container's visible GPUs
(``NVIDIA_VISIBLE_DEVICES``, what the runtime hook grants) and (b) kubelet's own
allocations (its checkpoint), each ID mapped to its PCI slot through the UUIDs before
and after the reboot. The test fails if any sample shows one slot held by two pods, or
if, in the end, an original pod does not run on its slot. The figures printed: the
samples taken, the new pods submitted and admitted, the slowest sample.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Set, Tuple

import pytest

from conftest import require_tool
from gpuguard.checkpoint import parse
from integration.harness import systemd_ns as systemd_ns
from integration.harness.kubelet import CHECKPOINT, NODE
from integration.harness.pods import Pod
from integration.kubelet_node import (
    DRIVER_ROOT,
    F1_PODS,
    READMIT,
    GpuNode,
    NsFactory,
    boot,
    gpu_pod,
    gpus_after,
    two_gpu_pods,
)
from integration.kubelet_node import api as api

pytestmark = pytest.mark.root

N_GPUS = 4  # two held by the original pods, two free: two new pods can be admitted
PERIOD = 0.1  # seconds between samples
SUBMIT_EVERY = 0.3  # seconds between new pods, once the driver is there
MAX_NEW = 30  # new pods submitted at most
RESOURCE = "nvidia.com/gpu"


@dataclass
class Sampler:
    """Samples every running container's and kubelet's allocated GPUs by slot, and
    submits new GPU pods, in a thread of its own until :meth:`stop`."""

    node: GpuNode
    slot_of: Mapping[str, str]  # UUID (before or after the reboot) -> PCI bus id
    names: Dict[str, str]  # pod UID -> pod name
    samples: int = 0
    submitted: List[str] = field(default_factory=list)
    violations: List[Tuple[float, str]] = field(default_factory=list)  # (monotonic, what)
    slowest: float = 0.0
    errors: List[str] = field(default_factory=list)
    at_driver: Dict[str, str] = field(default_factory=dict)  # pod -> phase, driver's arrival
    _env: Dict[str, Tuple[str, str]] = field(default_factory=dict)  # cid -> (pod, visible)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: Optional[threading.Thread] = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="held-twice-sampler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        assert self._thread is not None
        self._thread.join(30)

    def _run(self) -> None:
        last_submit = 0.0
        # from the driver's arrival on: the plugin registers then, and until the remap
        # kubelet holds the re-admitted pods on their old IDs. Nothing before it, so
        # that kubelet's re-admission at its start is not slowed by the sampling.
        while not self._stop.is_set() and not self.node.ns.path(DRIVER_ROOT).exists():
            self._stop.wait(0.02)
        for _ in range(5):  # kubelet's /pods read again if it did not answer
            if self._stop.is_set() or self.at_driver:
                break
            self.at_driver = {n: p.phase for n, p in self.node.pods().items()}
        while not self._stop.is_set():
            t = time.monotonic()
            if len(self.submitted) < MAX_NEW and t - last_submit >= SUBMIT_EVERY:
                name = f"new-{len(self.submitted)}"
                pod = gpu_pod(name)
                self.names[pod["metadata"]["uid"]] = name
                self.node.write_pod(pod)
                self.submitted.append(name)
                last_submit = t
            try:
                self.sample()
            except Exception as e:  # a container removed under the listing: next sample
                self.errors.append(repr(e)[:200])
            took = time.monotonic() - t
            self.slowest = max(self.slowest, took)
            self._stop.wait(max(0.0, PERIOD - took))

    def sample(self) -> None:
        self.samples += 1
        running = self.running_slots()
        allocated = self.allocated_slots()
        at = f"sample {self.samples}"
        for view, held in (("running containers", running), ("kubelet's allocations", allocated)):
            for slot, pods in sorted(held.items()):
                if len(pods) > 1:
                    what = f"{at}: {view}: slot {slot} held by {sorted(pods)}"
                    self.violations.append((time.monotonic(), what))

    def running_slots(self) -> Dict[str, Set[str]]:
        """slot -> the pods whose running containers see it (NVIDIA_VISIBLE_DEVICES)."""
        node = self.node
        tasks = node.tasks()
        held: Dict[str, Set[str]] = {}
        for cid, status in tasks.items():
            if status != "RUNNING":
                continue
            if cid not in self._env:
                got = self.container(cid)
                if got is None:
                    continue
                self._env[cid] = got
            pod, visible = self._env[cid]
            for u in filter(None, visible.split(",")):
                held.setdefault(self.slot_of.get(u, f"?{u}"), set()).add(pod)
        return held

    def container(self, cid: str) -> Optional[Tuple[str, str]]:
        text = self.node.ctr("containers", "info", cid, check=False)
        if not text:
            return None
        info: Dict[str, Any] = json.loads(text)
        labels = info.get("Labels") or {}
        if labels.get("io.cri-containerd.kind") != "container":
            return ("", "")  # a sandbox: no GPU
        env = info["Spec"]["process"].get("env") or []
        visible = dict(e.split("=", 1) for e in env if "=" in e).get("NVIDIA_VISIBLE_DEVICES", "")
        return labels["io.kubernetes.pod.name"].removesuffix(f"-{NODE}"), visible

    def allocated_slots(self) -> Dict[str, Set[str]]:
        """slot -> the pods kubelet's checkpoint allocates it to."""
        path = self.node.ns.path(CHECKPOINT)
        try:
            data = parse(path.read_bytes(), source="kubelet")
        except FileNotFoundError:
            return {}
        held: Dict[str, Set[str]] = {}
        for e in data.entries or ():
            if e.resource_name != RESOURCE:
                continue
            pod = self.names.get(e.pod_uid, e.pod_uid)
            for i in e.all_device_ids():
                held.setdefault(self.slot_of.get(i, f"?{i}"), set()).add(pod)
        return held


# What this test finds today (kubelets 1.34.9 and 1.36.2, every run): the plugin
# registers the new UUIDs 0.3-0.6 s after the driver's arrival, into the kubelet that
# re-admitted the pods on their old IDs: its in-use set holds only the old IDs, so every
# new UUID is free to it, and it admits new pods onto the slots the re-admitted pods
# hold (3-4 new pods on 4 GPUs, 2 of them held). The re-admitted pods' containers never
# start on the old IDs (the runtime hook knows no such GPU), so no two running
# containers share a GPU; but the daemon's remap then finds the new UUID allocated to
# a new pod and refuses it (remapguard.py): that original pod loses its GPU for good.
# No mechanism holds the plugin's registration, or kubelet's allocation, until the remap.
HELD_TWICE = pytest.mark.xfail(
    strict=True,
    raises=AssertionError,
    reason="kubelet gives new pods the new UUIDs of slots its re-admitted pods hold "
    "under their old IDs, between the plugin's registration and gpuguard's remap",
)


@pytest.mark.parametrize("kubelet", [pytest.param(k, marks=HELD_TWICE) for k in ("1.34", "1.36")])
def test_operator_reboot_no_gpu_held_twice(
    systemd_ns: NsFactory, tmp_path: Path, api: Path, kubelet: str
) -> None:
    require_tool("gcc")
    node = boot(systemd_ns, tmp_path, api, gpuguard=True, kubelet=kubelet, pci=True, n_gpus=N_GPUS)
    slots = two_gpu_pods(node)
    after = gpus_after(node, "all", slots["gpu-b"])
    slot_of = {g["uuid"]: g["pci_bus_id"] for g in node.inventory}
    slot_of |= {g["uuid"]: g["pci_bus_id"] for g in after}
    names = {gpu_pod(n)["metadata"]["uid"]: n for n in F1_PODS}
    sampler = Sampler(node, slot_of, names)
    sampler.start()
    back_failed: Optional[AssertionError] = None
    try:
        node.reboot(after, driver="late")

        def back(p: Dict[str, Pod]) -> bool:
            return all(n in p and p[n].running for n in F1_PODS)

        node.wait_pods(back, 90, f"{F1_PODS} Running again after the driver arrived")
        time.sleep(5)  # new pods still arriving once the originals are back
    except AssertionError as e:
        back_failed = e
    finally:
        sampler.stop()
    pods = node.pods()
    admitted = [n for n in sampler.submitted if n in pods and pods[n].phase != "Failed"]
    first = sampler.violations[0][0] - node.driver_at if sampler.violations else 0.0
    print(f"\nheld-twice figures: kubelet={kubelet} gpus={N_GPUS} samples={sampler.samples} "
          f"new_pods={len(sampler.submitted)} admitted={len(admitted)} "
          f"violations={len(sampler.violations)} "
          f"of_running_containers={sum('running containers' in w for _t, w in sampler.violations)} "
          f"first_violation_s_after_driver={first:.1f} "
          f"slowest_sample_s={sampler.slowest:.2f} "
          f"sample_errors={len(sampler.errors)}")  # fmt: skip
    if sampler.violations or back_failed is not None:
        print(node.log(READMIT, 60), node.log("gpuguard.service", 120), sep="\n")
    lost = {n: sampler.at_driver.get(n, "") for n in F1_PODS}
    if any(phase in ("Failed", "") for phase in lost.values()):
        # kubelet's re-admission at its start, before the driver (the bridge's
        # registration too late for it), not what this test samples: no xfail
        pytest.fail(f"the original pods were not re-admitted before the driver: {lost}")
    assert not sampler.violations, [what for _t, what in sampler.violations[:10]]
    if back_failed is not None:
        raise back_failed
    assert sampler.samples > 0
    for name in F1_PODS:
        c = node.running(name)
        assert node.slot(c) == slots[name], f"{name} moved from {slots[name]} to {node.slot(c)}"
    # the sampler saw what it was there to see: the original pods' containers running
    assert set(F1_PODS) <= {p for held in sampler.running_slots().values() for p in held}
