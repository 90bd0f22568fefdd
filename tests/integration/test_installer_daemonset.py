"""deploy/'s installer DaemonSet rolled out by the real controller-manager onto a real
kubelet node: installed, upgraded through the DaemonSet's rolling update, and rolled
back with ``kubectl rollout undo``, a GPU container running throughout.

The node is Debian 13's root (integration/kubelet_sites.RootSite: its own systemd as
PID 1 of private namespaces, its containerd and runc, a copy-on-write copy of the
cached debootstrap, so its dpkg database is the test's), kubelet 1.34.9 registered as
Node ``gpunode`` with the control plane of harness/cluster.py started inside it. The
installer images are this checkout's two builds (the second with a version suffix, as
test_fleet_installer's upgrade) made by deploy/build-image and imported into the
node's containerd: no registry is reachable, and the manifests' ``IfNotPresent`` finds
them there. ``kubectl apply -k`` applies deploy/ through an overlay that sets the
image, as a fleet's repository would; the pod's ``hostPID`` shows it the root's PID
namespace, so the entrypoint's default target, PID 1, is the root's systemd and
apt-get installs into the root. The node gets gpuguard's configuration before the
first rollout (the fake driver's registration, the GPU list), as configuration
management puts it on a fleet's node.

At each step: the DaemonSet's one pod is the controller's, on the node, Ready and on
that step's image (its revision hash the first one's again after the undo), the
rollout complete (``minReadySeconds`` honoured), the root has that version installed
and gpuguard.service active, kubelet was never restarted, and the GPU pod's container
(the same one, never restarted) was allowed its GPU, and no other, at every look
while the step ran.
"""

from __future__ import annotations

import hashlib
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import pytest

from integration.cluster_node import bare_pod, boot_registered
from integration.fleet_node import installed
from integration.gpu_scopes import FAKE_DRIVER
from integration.harness.cluster import INNER as CLUSTER_INNER
from integration.harness.cluster import (
    ApiPod,
    Cluster,
    require_cluster,
    show_api,
)
from integration.harness.kubelet import NODE, Container
from integration.installer_images import Buildah, build_image, save_image
from integration.kubelet_node import GpuNode
from integration.kubelet_node import api as api
from integration.kubelet_sites import CONFIG_DROPIN, RootSite
from integration.pkgroot import built_packages, require_pkgroot_tools, source_version

pytestmark = pytest.mark.root

REPO = Path(__file__).resolve().parents[2]
SUITE = "trixie"
UPGRADE_SUFFIX = "+test1"  # as test_fleet_installer: one build per pytest run
IMAGES = "/run/gg-installer-images"  # the two archives, read-only inside the node
OVERLAY = "/run/gg-installer-overlay"  # the fleet's kustomization over deploy/
NAMESPACE = "gpuguard-system"
DS = "gpuguard-installer"
HOST_DPKG_STATUS = Path("/var/lib/dpkg/status")
GPU_LIST = "[Inventory]\nFile=/etc/gpuguard/inventory.json\n"


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def overlay(tag: str) -> str:
    """A kustomization over this checkout's deploy/ (relative: kustomize refuses an
    absolute root) that sets the installer's image, as a fleet's repository does."""
    repo = "../" * len(Path(OVERLAY).parts[1:]) + str(REPO.relative_to("/"))
    name, version = tag.rsplit(":", 1)
    return (
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n"
        f"resources:\n  - {repo}/deploy\n"
        f"images:\n  - name: gpuguard-installer\n    newName: {name}\n    newTag: {version}\n"
    )


class Fleet:
    """The node, its control plane, and the GPU container watched throughout."""

    def __init__(self, node: GpuNode, cluster: Cluster) -> None:
        self.node = node
        self.cluster = cluster
        self.ns = node.ns
        self.kubelet = self.ns.unit_property("kubelet.service", "InvocationID")
        self.gpu: Optional[Container] = None
        self.minor = -1
        self.looks = 0

    def apply(self, tag: str) -> None:
        d = self.ns.path(OVERLAY)
        d.mkdir(parents=True, exist_ok=True)
        (d / "kustomization.yaml").write_text(overlay(tag))
        self.cluster.kubectl("apply", "-k", OVERLAY)

    def start_gpu_pod(self) -> None:
        self.cluster.apply(bare_pod())
        self.cluster.wait_pods(
            lambda ps: any(p.running for p in ps if p.name == "gpu-bare"), 90, "gpu-bare Running"
        )
        self.gpu = self.node.running("gpu-bare")
        (g,) = [g for g in self.node.inventory if g["uuid"] == self.gpu.visible]
        self.minor = int(g["minor"])
        self.look()

    def look(self) -> None:
        """The GPU container, the same one still running, is allowed its GPU and denied
        every other (the kernel's answer from its devices cgroup)."""
        assert self.gpu is not None
        assert self.node.tasks().get(self.gpu.id) == "RUNNING", "the GPU container stopped"
        verdicts = self.node.verdicts(self.gpu)
        want = {m: m == self.minor for m in verdicts}
        assert verdicts == want, f"GPU container {self.gpu.id[:12]}: {verdicts}, want {want}"
        self.looks += 1

    def installer_pods(self) -> List[ApiPod]:
        return [
            p for p in self.cluster.pods(NAMESPACE) if p.labels.get("app.kubernetes.io/name") == DS
        ]

    def rolled_out(self, tag: str) -> Optional[Tuple[ApiPod, Dict[str, Any]]]:
        """The DaemonSet's rollout of ``tag`` complete (kubectl rollout status's test:
        observed, updated, available after minReadySeconds) and its one pod Ready."""
        ds = self.cluster.get("daemonset", DS, namespace=NAMESPACE)
        st, spec = ds.get("status", {}), ds["spec"]["template"]["spec"]
        if spec["containers"][0]["image"] != tag:
            return None
        done = (
            st.get("observedGeneration") == ds["metadata"]["generation"]
            and st.get("desiredNumberScheduled") == 1
            and st.get("updatedNumberScheduled") == 1
            and st.get("numberAvailable") == 1
        )
        pods = [p for p in self.installer_pods() if not p.deleting]
        if not done or len(pods) != 1:
            return None
        (pod,) = pods
        ready = pod.conditions.get("Ready", {}).get("status") == "True"
        return (pod, ds) if ready and pod.containers["installer"]["image"] == tag else None

    def roll(self, tag: str, timeout: float = 180) -> Tuple[ApiPod, Dict[str, Any], float]:
        """Until ``tag`` is rolled out, looking at the GPU container all the while;
        the pod, the DaemonSet, and the seconds it took."""
        t0 = time.monotonic()
        deadline = t0 + timeout
        while time.monotonic() < deadline:
            self.look()
            got = self.rolled_out(tag)
            if got is not None:
                return (*got, time.monotonic() - t0)
            time.sleep(0.5)
        raise AssertionError(
            f"{tag} not rolled out in {timeout}s: {show_api(self.installer_pods())}\n"
            f"{self.node.log('kubelet.service', lines=30)}"
        )

    def check_node(self, pod: ApiPod, version: str) -> None:
        assert pod.owner == f"DaemonSet/{DS}" and pod.node == NODE, show_api([pod])
        assert installed(self.ns) == f"install ok installed {version}"  # type: ignore[arg-type]
        self.ns.wait_active("gpuguard.service", timeout=30)
        # the installer never restarts kubelet (its pods would be judged again)
        assert self.ns.unit_property("kubelet.service", "InvocationID") == self.kubelet
        self.look()


def boot_fleet(tmp: Path, api: Path, images: Path) -> Tuple[GpuNode, Cluster]:
    return boot_registered(
        RootSite(SUITE),
        tmp,
        api,
        bridge_reads_api=False,  # preseed_config names kubelet's identity
        gpuguard=False,  # the DaemonSet installs it
        n_gpus=2,
        kubelet="1.34",
        extra_ro={IMAGES: images},
    )


def preseed_config(node: GpuNode, kubeconfig: str) -> None:
    """gpuguard's configuration before its package, as RootSite.install_gpuguard writes
    it before apt-get (the package starts the daemon at once): the GPU list, the fake
    driver's registration, kubelet's identity for the bridge's API reads."""
    for inner, text in {
        CONFIG_DROPIN: f"{GPU_LIST}[Kubelet]\nKubeconfig={kubeconfig}\n",
        **{f"/etc/systemd/system/{k}": v for k, v in FAKE_DRIVER.items()},
    }.items():
        p = node.ns.path(inner)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    node.ns.systemctl("daemon-reload")


def test_installer_daemonset_installs_upgrades_and_rolls_back(tmp_path: Path, api: Path) -> None:
    require_pkgroot_tools()
    from conftest import require_tool

    require_tool("buildah", "busybox")
    require_cluster()
    host_dpkg = sha256(HOST_DPKG_STATUS) if HOST_DPKG_STATUS.exists() else ""
    t0 = time.monotonic()
    buildah = Buildah(tmp_path / "buildah")
    images = tmp_path / "images"
    images.mkdir()
    tags = {}
    for step, suffix in (("base", ""), ("upgrade", UPGRADE_SUFFIX)):
        tags[step] = build_image(buildah, built_packages(suffix), suffix)
        save_image(buildah, tags[step], images / f"{step}.tar")
    versions = {"base": f"{source_version()}-1", "upgrade": f"{source_version(UPGRADE_SUFFIX)}-1"}
    built = time.monotonic() - t0

    node, cluster = boot_fleet(tmp_path, api, images)
    fleet = Fleet(node, cluster)
    for step in tags:
        node.ctr("images", "import", f"{IMAGES}/{step}.tar")
    assert installed(node.ns) == "not known to dpkg"  # type: ignore[arg-type]
    preseed_config(node, f"{CLUSTER_INNER}/node.kubeconfig")
    # GPU feature discovery's label: the DaemonSet's node affinity
    cluster.kubectl("label", "node", NODE, "nvidia.com/gpu.present=true")
    fleet.start_gpu_pod()
    booted = time.monotonic() - t0 - built

    fleet.apply(tags["base"])
    first, ds, install_s = fleet.roll(tags["base"])
    fleet.check_node(first, versions["base"])
    revision = first.labels["controller-revision-hash"]
    gpuguard = node.ns.unit_property("gpuguard.service", "InvocationID")

    fleet.apply(tags["upgrade"])
    second, ds, upgrade_s = fleet.roll(tags["upgrade"])
    assert second.uid != first.uid and second.labels["controller-revision-hash"] != revision
    fleet.check_node(second, versions["upgrade"])
    assert node.ns.unit_property("gpuguard.service", "InvocationID") != gpuguard

    cluster.kubectl("rollout", "undo", f"daemonset/{DS}", "-n", NAMESPACE)
    third, ds, undo_s = fleet.roll(tags["base"])
    assert third.uid not in (first.uid, second.uid)
    assert third.labels["controller-revision-hash"] == revision, "undo made a new template"
    fleet.check_node(third, versions["base"])
    assert ds["spec"]["minReadySeconds"] >= 1  # deploy/'s value, not the test's

    pods = [p for p in cluster.pods() if p.name == "gpu-bare"]
    assert [p.running for p in pods] == [True], show_api(pods)
    print(
        f"installer DaemonSet on {SUITE}, kubelet 1.34.9: images built {built:.0f} s, node "
        f"booted {booted:.0f} s; rollouts (incl. minReadySeconds "
        f"{ds['spec']['minReadySeconds']} s): install {install_s:.0f} s, upgrade "
        f"{upgrade_s:.0f} s, undo {undo_s:.0f} s; GPU access looked at {fleet.looks} times"
    )
    if host_dpkg:
        assert sha256(HOST_DPKG_STATUS) == host_dpkg, "the host's dpkg database changed"
