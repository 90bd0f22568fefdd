"""deploy/: the manifests validate against the Kubernetes API schema (offline, the
OpenAPI schemas shipped by kubernetes-validate), the kustomizations name files
that exist and the image version the packages carry, and the DaemonSet asks for
what the installer needs and no more."""

from __future__ import annotations

import copy
import re
import subprocess
from pathlib import Path
from typing import Any, Dict, List, Tuple

import kubernetes_validate
import pytest
import yaml

import gpuguard

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
MANIFESTS = ["namespace.yaml", "serviceaccount.yaml", "daemonset.yaml", "uninstall/daemonset.yaml"]
#: The oldest schema kubernetes-validate ships, and the newest.
K8S_VERSIONS = ["1.25.0", kubernetes_validate.latest_version()]


def load(name: str) -> Dict[str, Any]:
    doc = yaml.safe_load((DEPLOY / name).read_text())
    assert isinstance(doc, dict)
    return doc


def pod_spec(name: str) -> Dict[str, Any]:
    spec: Dict[str, Any] = load(name)["spec"]["template"]["spec"]
    return spec


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("name", MANIFESTS)
def test_manifest_validates(name: str, version: str) -> None:
    kubernetes_validate.validate(load(name), version, strict=True)


@pytest.mark.parametrize(
    "path, value",
    [
        (("spec", "template", "spec", "hostPID"), "yes"),
        (("spec", "updateStrategy", "rollingUpdate", "maxUnavailble"), 1),
        (("spec", "template", "spec", "containers"), [{"image": "x"}]),
    ],
)
def test_validation_catches_a_broken_daemonset(path: List[str], value: object) -> None:
    doc = copy.deepcopy(load("daemonset.yaml"))
    node = doc
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(doc, K8S_VERSIONS[-1], strict=True)


@pytest.mark.parametrize("kustomization", ["kustomization.yaml", "uninstall/kustomization.yaml"])
def test_kustomization_names_existing_files_and_the_package_version(kustomization: str) -> None:
    k = load(kustomization)
    base = (DEPLOY / kustomization).parent
    for res in k["resources"]:
        assert (base / res).is_file(), res
    # The image tag is the release being prepared (__version__ less .devN), as its
    # package is versioned; a development build's tag is set with `kustomize edit`.
    release = re.sub(r"\.dev\d+$", "", gpuguard.__version__.split("+")[0])
    tag = f"{release}-1"
    assert k["images"] == [{"name": "gpuguard-installer", "newTag": tag}]
    ds = next(load(str((base / r).relative_to(DEPLOY))) for r in k["resources"] if "daemon" in r)
    assert ds["spec"]["template"]["spec"]["containers"][0]["image"] == f"gpuguard-installer:{tag}"


def test_gpu_nodes_only_with_gpu_taints_tolerated() -> None:
    spec = pod_spec("daemonset.yaml")
    terms = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"
    ]
    # Terms are ORed: GFD's label or NFD's PCI vendor 10de, each with the opt-out.
    gpu_keys = set()
    for term in terms:
        exprs = {e["key"]: e for e in term["matchExpressions"]}
        assert exprs.pop("gpuguard.io/installer") == {
            "key": "gpuguard.io/installer",
            "operator": "NotIn",
            "values": ["skip"],
        }
        ((key, expr),) = exprs.items()
        assert (expr["operator"], expr["values"]) == ("In", ["true"])
        gpu_keys.add(key)
    assert gpu_keys == {"nvidia.com/gpu.present", "feature.node.kubernetes.io/pci-10de.present"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec[
        "tolerations"
    ]
    assert "nodeSelector" not in spec


def test_least_privilege_that_works() -> None:
    ds = load("daemonset.yaml")
    spec = ds["spec"]["template"]["spec"]
    assert ds["spec"]["updateStrategy"]["rollingUpdate"]["maxUnavailable"] == 1
    assert spec["hostPID"] is True
    for key in ("hostNetwork", "hostIPC", "priorityClassName", "initContainers"):
        assert key not in spec, key
    assert spec["automountServiceAccountToken"] is False
    (c,) = spec["containers"]
    assert c["securityContext"] == {"privileged": True, "readOnlyRootFilesystem": True}
    assert set(c["resources"]) == {"requests", "limits"}
    # No host path is mounted: the host is reached only through PID 1's namespaces.
    assert [v["emptyDir"]["medium"] for v in spec["volumes"]] == ["Memory"]
    probe = c["readinessProbe"]["exec"]["command"]
    assert probe[-1] == "/run/gpuguard-installer/status"
    assert [m["mountPath"] for m in c["volumeMounts"]] == ["/run/gpuguard-installer"]
    sa = load("serviceaccount.yaml")
    assert sa["automountServiceAccountToken"] is False
    assert spec["serviceAccountName"] == sa["metadata"]["name"]
    ns = load("namespace.yaml")
    assert ds["metadata"]["namespace"] == ns["metadata"]["name"] == sa["metadata"]["namespace"]
    assert ns["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "privileged"


def test_uninstall_daemonset_is_the_same_pod_with_uninstall() -> None:
    install, remove = load("daemonset.yaml"), load("uninstall/daemonset.yaml")
    assert remove["spec"]["template"]["spec"]["containers"][0]["args"] == ["uninstall"]
    assert install["spec"]["template"]["spec"]["containers"][0]["args"] == ["install"]
    # Different names and selectors: both may exist while one replaces the other.
    assert remove["metadata"]["name"] != install["metadata"]["name"]
    assert remove["spec"]["selector"] != install["spec"]["selector"]
    for doc in (install, remove):
        doc["metadata"]["name"] = "x"
        doc["metadata"]["labels"]["app.kubernetes.io/name"] = "x"
        doc["spec"]["selector"]["matchLabels"]["app.kubernetes.io/name"] = "x"
        doc["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/name"] = "x"
        doc["spec"]["template"]["spec"]["containers"][0]["args"] = []
    assert remove == install


@pytest.mark.parametrize(
    "present, message",
    [
        ((), "no gpuguard_*_all.deb in"),
        (("gpuguard_1.0-1_all.deb",), "need exactly one gpuguard-*.noarch.rpm"),
        (
            ("gpuguard_1.0-1_all.deb", "gpuguard_1.1-1_all.deb", "gpuguard-1.0-1.noarch.rpm"),
            "several .deb files",
        ),
    ],
)
def test_build_image_names_what_is_missing(
    present: Tuple[str, ...], message: str, tmp_path: Path
) -> None:
    from conftest import require_tool

    require_tool("buildah", "busybox")
    for name in present:
        (tmp_path / name).write_bytes(b"")
    res = subprocess.run(
        [str(DEPLOY / "build-image")],
        env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "DIST": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert res.returncode == 2, res
    (line,) = res.stderr.splitlines()
    assert line.startswith("build-image: ") and message in line, line
    assert str(tmp_path) in line
