"""Container images made here, with no registry: busybox-static in one layer.

:func:`busybox_image` writes an OCI image layout as a tar (``oci-layout``,
``index.json``, ``blobs/sha256/...``) that ``ctr images import`` reads; the index
names the image (``io.containerd.image.name``), so kubelet finds it by that name with
``imagePullPolicy: Never``. The layer is uncompressed (its digest is its diff id) and
built deterministically (fixed mtimes, sorted entries), so the same busybox gives the
same image. ``lib`` and ``lib64`` link into ``usr``: a pod that mounts the host's /usr
can run the host's python3 (the device plugin double does).
"""

from __future__ import annotations

import hashlib
import io
import json
import shutil
import tarfile
from pathlib import Path
from typing import Any, Dict, List, Mapping, Sequence, Tuple

APPLETS = ("sh", "sleep", "cat", "ls", "echo", "mknod", "stat", "env", "true")
DIRS = ("proc", "sys", "dev", "tmp", "etc", "usr", "var", "run")


def _layer(busybox: Path, extra: Mapping[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:

        def add(name: str, kind: bytes, *, data: bytes = b"", link: str = "", mode: int) -> None:
            info = tarfile.TarInfo(name)
            info.type, info.mode, info.mtime = kind, mode, 0
            info.linkname, info.size = link, len(data)
            tar.addfile(info, io.BytesIO(data) if data else None)

        add("bin", tarfile.DIRTYPE, mode=0o755)
        add("bin/busybox", tarfile.REGTYPE, data=busybox.read_bytes(), mode=0o755)
        for app in APPLETS:
            add(f"bin/{app}", tarfile.SYMTYPE, link="busybox", mode=0o777)
        for d in DIRS:
            add(d, tarfile.DIRTYPE, mode=0o1777 if d == "tmp" else 0o755)
        add("lib", tarfile.SYMTYPE, link="usr/lib", mode=0o777)
        add("lib64", tarfile.SYMTYPE, link="usr/lib64", mode=0o777)
        for name, data in extra.items():
            add(name, tarfile.REGTYPE, data=data, mode=0o755)
    return buf.getvalue()


def _blob(blobs: Dict[str, bytes], data: bytes) -> Dict[str, Any]:
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    blobs[digest] = data
    return {"digest": digest, "size": len(data)}


def busybox_image(
    dest: Path, images: Sequence[Tuple[str, List[str]]], extra: Mapping[str, bytes] = {}
) -> Path:
    """One tar holding each ``(name, entrypoint)`` image, all on the busybox layer
    (with ``extra``'s executables, path -> content, in it)."""
    busybox = Path(shutil.which("busybox") or "/bin/busybox")
    layer = _layer(busybox, extra)
    blobs: Dict[str, bytes] = {}
    layer_desc = {"mediaType": "application/vnd.oci.image.layer.v1.tar", **_blob(blobs, layer)}
    manifests = []
    for name, entrypoint in images:
        config = {
            "architecture": "amd64",
            "os": "linux",
            "config": {"Env": ["PATH=/bin:/usr/bin"], "Entrypoint": entrypoint},
            "rootfs": {"type": "layers", "diff_ids": [layer_desc["digest"]]},
        }
        config_desc = {
            "mediaType": "application/vnd.oci.image.config.v1+json",
            **_blob(blobs, json.dumps(config, sort_keys=True).encode()),
        }
        manifest = {
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": config_desc,
            "layers": [layer_desc],
        }
        desc = _blob(blobs, json.dumps(manifest, sort_keys=True).encode())
        manifests.append(
            {
                "mediaType": "application/vnd.oci.image.manifest.v1+json",
                **desc,
                "platform": {"architecture": "amd64", "os": "linux"},
                "annotations": {
                    "io.containerd.image.name": name,
                    "org.opencontainers.image.ref.name": name.rsplit(":", 1)[1],
                },
            }
        )
    index = {"schemaVersion": 2, "manifests": manifests}
    files = {
        "oci-layout": json.dumps({"imageLayoutVersion": "1.0.0"}).encode(),
        "index.json": json.dumps(index, sort_keys=True).encode(),
        **{f"blobs/sha256/{d.split(':')[1]}": b for d, b in blobs.items()},
    }
    with tarfile.open(dest, "w") as tar:
        for name in ("blobs", "blobs/sha256"):
            info = tarfile.TarInfo(name)
            info.type, info.mode = tarfile.DIRTYPE, 0o755
            tar.addfile(info)
        for name, data in sorted(files.items()):
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), 0o644
            tar.addfile(info, io.BytesIO(data))
    return dest
