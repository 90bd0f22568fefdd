"""A GPU node (integration/kubelet_node.py) registered with a real API server
(harness/cluster.py) in its namespace: GPU workloads as fleets run them (a bare Pod, a
Deployment, a Job) placed by the scheduler, and the device plugin double as a
DaemonSet that kubelet itself starts, after a reboot too.

The plugin's DaemonSet pod waits for a gate file (:data:`GATE`, a hostPath) before it
serves, as NVIDIA's plugin waits for the toolkit's ready mark: a test holds the plugin
back after a reboot by removing the mark (:meth:`ApiNode.reboot`'s ``plugin_after``).
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from integration.harness.cluster import (
    CONTAINERD_CNI,
    ApiPod,
    Cluster,
    control_plane,
    require_cluster,
)
from integration.harness.kubelet import NODE
from integration.harness.pods import PLUGIN_SCRIPT, VENV_PYTHON, busybox_pod, plugin_pod
from integration.kubelet_node import READMIT, GpuNode, boot_on, gpus_after
from integration.kubelet_sites import HostSite, NsFactory, Site

GATE = "/run/gg-plugin-gate"
GATE_FILE = f"{GATE}/toolkit-ready"
PLUGIN_DS = "nvidia-device-plugin"
#: the plugin's container: wait for the gate file, then exec the plugin double
WAIT_THEN_EXEC = (
    "import os,sys,time\n"
    "while not os.path.exists(sys.argv[1]): time.sleep(0.1)\n"
    "os.execv(sys.argv[2], sys.argv[2:])\n"
)
WORKLOADS = ("gpu-bare", "gpu-deploy", "gpu-job")


def _template(name: str, gpus: int = 1, **spec: Any) -> Dict[str, Any]:
    """A pod template (metadata and spec) whose container ``work`` holds ``gpus``."""
    pod = busybox_pod(name, "", {"nvidia.com/gpu": gpus}, automountServiceAccountToken=False)
    return {"metadata": {"labels": {"app": name}}, "spec": {**pod["spec"], **spec}}


def bare_pod(name: str = "gpu-bare") -> Dict[str, Any]:
    t = _template(name)
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, **t["metadata"]},
        "spec": t["spec"],
    }


def deployment(name: str = "gpu-deploy", replicas: int = 1) -> Dict[str, Any]:
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": {"app": name}},
            "template": _template(name),
        },
    }


def job(name: str = "gpu-job", restart: str = "OnFailure", backoff: int = 2) -> Dict[str, Any]:
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name},
        "spec": {"backoffLimit": backoff, "template": _template(name, restartPolicy=restart)},
    }


def plugin_daemonset() -> Dict[str, Any]:
    """The plugin double's static pod (harness/pods.py) as a DaemonSet's template,
    hostNetwork and privileged, waiting for :data:`GATE_FILE`."""
    spec = plugin_pod("")["spec"]
    ctr = spec["containers"][0]
    ctr["command"] = [str(VENV_PYTHON), "-c", WAIT_THEN_EXEC, GATE_FILE, *ctr["command"]]
    assert str(PLUGIN_SCRIPT) in ctr["command"]
    ctr["volumeMounts"].append({"name": "gate", "mountPath": GATE, "readOnly": True})
    spec["volumes"].append(
        {"name": "gate", "hostPath": {"path": GATE, "type": "DirectoryOrCreate"}}
    )
    spec["automountServiceAccountToken"] = False
    labels = {"app": PLUGIN_DS}
    return {
        "apiVersion": "apps/v1",
        "kind": "DaemonSet",
        "metadata": {"name": PLUGIN_DS},
        "spec": {
            "selector": {"matchLabels": labels},
            "template": {"metadata": {"labels": labels}, "spec": spec},
        },
    }


@dataclass(frozen=True)
class Placed:
    """One GPU pod of a workload: its API identity and the slot its GPU is in."""

    workload: str
    name: str
    uid: str
    slot: str


class ApiNode:
    """The GPU node and its control plane."""

    def __init__(self, node: GpuNode, cluster: Cluster) -> None:
        self.node = node
        self.cluster = cluster
        self.ns = node.ns
        self._gate: Optional[threading.Timer] = None

    def of(self, workload: str, pods: Optional[Sequence[ApiPod]] = None) -> List[ApiPod]:
        """The workload's pods (label app=workload)."""
        return [p for p in pods or self.cluster.pods() if p.labels.get("app") == workload]

    def open_gate(self) -> None:
        gate = self.ns.path(GATE_FILE)
        gate.parent.mkdir(parents=True, exist_ok=True)
        gate.touch()

    def start_plugin(self) -> None:
        """The plugin's DaemonSet applied and its pod registered with kubelet."""
        self.open_gate()
        self.cluster.apply(plugin_daemonset())
        self.node.wait_registered(timeout=60)
        self.cluster.wait(lambda: self.cluster.allocatable(NODE) > 0, 60, "GPUs allocatable")

    def run(self, *objects: Mapping[str, Any], workloads: Sequence[str]) -> Dict[str, Placed]:
        """``objects`` applied; once every one of ``workloads`` has one pod Running,
        each pod and its GPU's slot."""
        self.cluster.apply(*objects)

        def up(pods: List[ApiPod]) -> bool:
            return all(any(p.running for p in self.of(w, pods)) for w in workloads)

        pods = self.cluster.wait_pods(up, 90, f"{list(workloads)} Running")
        return {w: self.placed(w, pods) for w in workloads}

    def placed(self, workload: str, pods: Optional[Sequence[ApiPod]] = None) -> Placed:
        (p,) = [p for p in self.of(workload, pods) if p.running]
        (c,) = [c for c in self.node.containers() if c.pod_uid == p.uid and c.status == "RUNNING"]
        return Placed(workload, p.name, p.uid, self.node.slot(c))

    def reboot(
        self,
        gpus: Sequence[Mapping[str, Any]],
        *,
        plugin_after: float = 0.0,
        while_down: Optional[Callable[[], None]] = None,
    ) -> float:
        """The node restarted with ``gpus`` (GpuNode.reboot's steps) while the control
        plane stays up (``while_down`` runs with kubelet stopped, its pods dead); the
        plugin's pod may run as soon as kubelet starts it, or ``plugin_after`` seconds
        after kubelet's start (its gate opened then, from a thread: :meth:`join_gate`).
        Returns time.monotonic() at kubelet's start."""
        node = self.node
        node.stop_kubelet()
        if node.gpuguard:
            self.ns.systemctl("stop", "gpuguard.service", READMIT)
        if plugin_after:
            self.ns.path(GATE_FILE).unlink()
        node.kill_all()
        if while_down is not None:
            while_down()
        node.set_gpus(gpus)
        if node.gpuguard:
            node.start_gpuguard()
        t0 = node.start_kubelet()
        if plugin_after:
            wait = max(t0 + plugin_after - time.monotonic(), 0.0)
            self._gate = threading.Timer(wait, self.open_gate)
            self._gate.daemon = True  # a test that failed first never waits for it
            self._gate.start()
        return t0

    def join_gate(self) -> None:
        if self._gate is not None:
            self._gate.join()

    # -- figures ---------------------------------------------------------------------------
    def kubelet_started_at(self) -> float:
        """kubelet's main process start in this run (monotonic seconds)."""
        us = self.ns.unit_property("kubelet.service", "ExecMainStartTimestampMonotonic")
        return int(us) / 1e6

    def started_at(self, uid: str) -> Optional[float]:
        """When this kubelet run saw the pod's ``work`` container start (its PLEG
        ContainerStarted event for the container's id; monotonic seconds)."""
        ids = {c.id for c in self.node.containers() if c.pod_uid == uid and c.name == "work"}
        inv = self.ns.unit_property("kubelet.service", "InvocationID")
        argv = ["journalctl", "--no-pager", "-o", "json", f"_SYSTEMD_INVOCATION_ID={inv}"]
        for line in self.ns.run(argv, timeout=30).stdout.splitlines():
            e = json.loads(line)
            msg = e.get("MESSAGE", "")
            if isinstance(msg, str) and "ContainerStarted" in msg and any(i in msg for i in ids):
                return int(e["__MONOTONIC_TIMESTAMP"]) / 1e6
        return None

    def bridge_margin_ms(self) -> Optional[float]:
        """The bridge's margin before kubelet's first admission (its state file:
        kubelet's first SyncLoop ADD, here the first API pod's, less its devices
        pushed healthy), in ms; None without gpuguard or before it is read."""
        if not self.node.gpuguard:
            return None
        from gpuguard.host.statefile import load
        from gpuguard.readmit.state import SPEC, STATE_FILE

        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            s = load(self.ns.path(STATE_FILE), SPEC).value
            if s is not None and s.first_admission is not None:
                m = dict(s.margins()).get("nvidia.com/gpu")
                return round(m * 1000, 1) if m is not None else None
            time.sleep(0.5)
        return None


def boot_registered(
    site: Site, tmp: Path, api: Path, *, bridge_reads_api: bool, **kw: Any
) -> Tuple[GpuNode, Cluster]:
    """:func:`boot_on` ``site`` with the control plane started before kubelet, kubelet
    registered as Node ``gpunode``, Ready. ``bridge_reads_api``: gpuguard's configuration
    names kubelet's kubeconfig (the bridge asks the API server with kubelet's identity,
    host/kubeapi.py). ``extra_ro`` is bound beside the control plane's binaries."""
    bins = require_cluster()
    cp = control_plane(tmp / "cluster", bins, NODE)
    clusters: List[Cluster] = []

    def start(ns: Any) -> None:
        clusters.append(Cluster(ns, cp))
        clusters[0].start()

    node = boot_on(
        site,
        tmp,
        api,
        flags=[f"--kubeconfig={cp.node_kubeconfig}"],
        config=f"[Kubelet]\nKubeconfig={cp.node_kubeconfig}\n" if bridge_reads_api else "",
        extra_units=cp.units(),
        extra_ro={**cp.ro_binds(), **kw.pop("extra_ro", {})},
        containerd_extra=CONTAINERD_CNI,
        before_kubelet=start,
        **kw,
    )
    (cluster,) = clusters
    try:
        cluster.wait(lambda: cluster.node_ready(NODE), 90, f"Node {NODE} Ready")
    except AssertionError as e:
        raise AssertionError(f"{e}\n{node.log(lines=60)}") from None
    return node, cluster


def boot_api(
    factory: NsFactory, tmp: Path, api: Path, *, gpuguard: bool, kubelet: str, n_gpus: int = 3
) -> ApiNode:
    """A GPU node whose kubelet (``kubelet``: "1.34", "1.36") is registered as Node
    ``gpunode`` with the control plane started before it, Ready, the plugin's
    DaemonSet's pod registered."""
    node, cluster = boot_registered(
        HostSite(factory),
        tmp,
        api,
        bridge_reads_api=True,
        gpuguard=gpuguard,
        n_gpus=n_gpus,
        plugin=False,
        kubelet=kubelet,
    )
    out = ApiNode(node, cluster)
    out.start_plugin()
    return out


def failed(pods: Sequence[ApiPod]) -> List[ApiPod]:
    return [p for p in pods if p.phase == "Failed"]


def deleted_pod_scenario(n: ApiNode) -> Tuple[ApiPod, List[ApiPod]]:
    """Two Deployment pods on the node's two GPUs; one deleted (forced, as fleets'
    controllers do) while the node is down and its replacement bound to the node; the
    plugin's pod 30 s late. (Deleted with a grace period, the pod stays Terminating on
    the node, holding its GPU for the scheduler, until kubelet confirms; its
    replacement waits Pending meanwhile: measured.) The pod kept, and the Deployment's
    pods once it has two Running again (or 60 s after the plugin registered)."""
    n.run(deployment("gpu-web", replicas=2), workloads=())
    n.cluster.wait_pods(
        lambda ps: sum(p.running for p in n.of("gpu-web", ps)) == 2, 90, "two gpu-web pods"
    )
    (victim, kept) = n.of("gpu-web")

    def delete() -> None:
        n.cluster.kubectl(
            "delete", "pod", victim.name, "--grace-period=0", "--force", "--wait=false"
        )
        n.cluster.wait_pods(
            lambda ps: any(
                p.uid not in (victim.uid, kept.uid) and p.node == NODE for p in n.of("gpu-web", ps)
            ),
            60,
            "the replacement bound to the node",
        )

    n.reboot(gpus_after(n.node, "none", ""), plugin_after=30, while_down=delete)
    n.join_gate()
    n.node.wait_registered(timeout=60)
    with contextlib.suppress(AssertionError):  # the failed ones are counted
        n.cluster.wait_pods(
            lambda ps: sum(p.running for p in n.of("gpu-web", ps)) == 2, 60, "two gpu-web pods"
        )
    return kept, n.of("gpu-web")
