"""Pods named by namespace/name from the CRI annotations in a container's OCI bundle
(containerd and CRI-O), and the command line's use of them."""

from __future__ import annotations

import json
from pathlib import Path

from gpuguard.devices.podnames import BUNDLES, name_pod, pod_names, pod_of_container
from gpuguard.host.paths import Root

CID = "c" * 64
UID = "0dbd65af-6693-11eb-994b-246e9634b5c8"


def bundle(root: Path, pattern: str, cid: str, annotations: dict[str, object]) -> None:
    p = root / pattern.format(id=cid).lstrip("/")
    p.parent.mkdir(parents=True)
    p.write_text(json.dumps({"ociVersion": "1.0.2", "annotations": annotations}))


def test_containerd_and_crio_annotations(tmp_path: Path) -> None:
    bundle(
        tmp_path,
        BUNDLES[0],
        CID,
        {
            "io.kubernetes.cri.container-type": "container",
            "io.kubernetes.cri.sandbox-namespace": "ml",
            "io.kubernetes.cri.sandbox-name": "trainer-0",
            "io.kubernetes.cri.sandbox-uid": UID,
        },
    )
    other = "d" * 64
    bundle(
        tmp_path,
        BUNDLES[1],
        other,
        {"io.kubernetes.pod.namespace": "infer", "io.kubernetes.pod.name": "api-7f"},
    )
    names = pod_names(Root(tmp_path), [CID, other, "e" * 64])
    assert {k: str(v) for k, v in names.items()} == {CID: "ml/trainer-0", other: "infer/api-7f"}
    assert names[CID].uid == UID and names[other].uid == ""
    text = f"pod {UID} container {CID[:12]} was given /dev/nvidia0"
    assert name_pod(text, UID, names[CID]) == (
        f"pod ml/trainer-0 ({UID}) container {CID[:12]} was given /dev/nvidia0"
    )
    assert name_pod(text, UID, None) == text


def test_unreadable_or_hostile_bundles_name_nothing(tmp_path: Path) -> None:
    root = Root(tmp_path)
    assert pod_of_container(root, "../../etc") is None  # never a path
    bundle(tmp_path, BUNDLES[0], CID, {"io.kubernetes.cri.sandbox-name": "x"})  # no namespace
    assert pod_of_container(root, CID) is None
    p = tmp_path / BUNDLES[0].format(id=CID).lstrip("/")
    p.write_text("{not json")
    assert pod_of_container(root, CID) is None
    p.unlink()
    p.symlink_to("/etc/passwd")  # a link is not followed
    assert pod_of_container(root, CID) is None
