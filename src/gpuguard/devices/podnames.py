"""A pod's namespace and name, for people: read from what the container runtime keeps
next to each container, never from the API server (gpuguard has no credentials).

The runtime writes the OCI bundle of every running container (config.json), and its
CRI plugin puts the pod's identity into the bundle's annotations: containerd
`io.kubernetes.cri.sandbox-namespace`, `-name` and `-uid` (the same values kubelet
gave as the container's labels io.kubernetes.pod.namespace/name, which containerd keeps
in its metadata database), CRI-O `io.kubernetes.pod.namespace`/`name`/`uid`. A plain
file read, bounded; a container whose bundle is gone or unreadable simply has no
name, and the caller shows its pod UID as before.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Iterable, Mapping, Optional

from gpuguard.host.echo import cut
from gpuguard.host.paths import Root
from gpuguard.host.safeio import UnsafeFileError, read_bytes
from gpuguard.host.statefile import parse_json

# Where each runtime keeps a running container's OCI spec ({id}: the container id).
BUNDLES = (
    "/run/containerd/io.containerd.runtime.v2.task/k8s.io/{id}/config.json",
    "/run/containers/storage/overlay-containers/{id}/userdata/config.json",
)
MAX_SPEC = 4 * 1024 * 1024
_KEYS = (
    ("io.kubernetes.cri.sandbox-namespace", "io.kubernetes.cri.sandbox-name",
     "io.kubernetes.cri.sandbox-uid"),
    ("io.kubernetes.pod.namespace", "io.kubernetes.pod.name", "io.kubernetes.pod.uid"),
)  # fmt: skip


@dataclass(frozen=True)
class PodName:
    namespace: str
    name: str
    uid: str  # "" when the runtime did not record it

    def __str__(self) -> str:  # the runtime's annotations, echoed: cut and escaped
        return f"{cut(self.namespace, 63)}/{cut(self.name, 253)}"


def from_annotations(annotations: Mapping[str, object]) -> Optional[PodName]:
    for ns_key, name_key, uid_key in _KEYS:
        ns, name = annotations.get(ns_key), annotations.get(name_key)
        if isinstance(ns, str) and isinstance(name, str) and ns and name:
            uid = annotations.get(uid_key)
            return PodName(ns, name, uid if isinstance(uid, str) else "")
    return None


def pod_of_container(root: Root, container_id: str) -> Optional[PodName]:
    """The pod of a running container, from its runtime's bundle; None if unknown."""
    if not container_id or not container_id.isalnum():
        return None
    for pattern in BUNDLES:
        path = root.path(pattern.format(id=container_id))
        if not os.path.lexists(path):
            continue
        try:
            data, _st = read_bytes(path, what="OCI spec", max_bytes=MAX_SPEC)
            spec = parse_json(data)  # bounded numbers and nesting; SchemaError: ValueError
        except (UnsafeFileError, ValueError):
            continue
        annotations = spec.get("annotations") if isinstance(spec, dict) else None
        if isinstance(annotations, dict):
            found = from_annotations(annotations)
            if found is not None:
                return found
    return None


def pod_names(root: Root, container_ids: Iterable[str]) -> dict[str, PodName]:
    """container id -> its pod, for the containers whose runtime names it."""
    out: dict[str, PodName] = {}
    for cid in dict.fromkeys(container_ids):
        found = pod_of_container(root, cid)
        if found is not None:
            out[cid] = found
    return out


def name_pod(text: str, pod_uid: str, pod: Optional[PodName]) -> str:
    """`text` with "pod <uid>" read as "pod <namespace>/<name> (<uid>)"."""
    if pod is None or not pod_uid:
        return text
    return text.replace(f"pod {pod_uid}", f"pod {pod} ({pod_uid})", 1)
