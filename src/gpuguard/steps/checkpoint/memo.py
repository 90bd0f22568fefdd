"""The kubelet hook's memo: the last checkpoint and GPU inventory verified healthy.

Kubelet's ExecStartPre= hook runs at every kubelet start; on a healthy node the
checkpoint and the GPUs are the same as at the previous start, so re-parsing and
re-analysing the file proves nothing new. The memo records what a full check found
healthy, keyed by what the verdict depends on: the sha256 of the checkpoint's bytes
(never its mtime: a file rewritten within the same tick, or restored with its old
mtime, must not pass), the inventory's identity (UUIDs, indices, minors, MIG UUIDs),
the resources checked, the file's path and gpuguard's version. Any difference, or a
memo that is missing, unreadable or malformed, means the full check.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Optional, Sequence

from gpuguard import __version__
from gpuguard.errors import BadInputError
from gpuguard.host import safeio
from gpuguard.host.inventory import Inventory
from gpuguard.host.paths import STATE_DIR, Root

MEMO = f"{STATE_DIR}/kubelet-hook.memo.json"
MEMO_MAX = 64 * 1024
FORMAT = 1


def inventory_identity(inventory: Inventory) -> str:
    """sha256 of the GPUs' identities, in a canonical order: what the analysis reads."""
    gpus = sorted((g.uuid, g.index, g.minor, sorted(m.uuid for m in g.mig)) for g in inventory.gpus)
    return hashlib.sha256(json.dumps(gpus).encode()).hexdigest()


def memo_key(
    checkpoint_path: str, checkpoint_sha256: str, inventory: Inventory, resources: Sequence[str]
) -> dict[str, Any]:
    return {
        "format": FORMAT,
        "gpuguard": __version__,
        "checkpoint": checkpoint_path,
        "checkpoint_sha256": checkpoint_sha256,
        "inventory": inventory_identity(inventory),
        "resources": sorted(resources),
    }


def read_memo(root: Root) -> Optional[dict[str, Any]]:
    """The recorded key; None when missing, unsafe or malformed (then: the full check)."""
    try:
        data, _st = safeio.read_bytes(root.path(MEMO), what="kubelet hook memo", max_bytes=MEMO_MAX)
        doc = json.loads(data)
    except (BadInputError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def unchanged(root: Root, key: dict[str, Any]) -> bool:
    return read_memo(root) == key


def write_memo(root: Root, key: dict[str, Any]) -> bool:
    """Record a verified healthy state; False when it cannot be written (a read-only or
    unsafe state directory: the next start then simply takes the full check)."""
    from gpuguard.actuate.files import write_new

    try:
        write_new(root.path(MEMO), (json.dumps(key, sort_keys=True) + "\n").encode())
    except (OSError, BadInputError):
        return False
    return True


def checkpoint_sha256(path: Path) -> Optional[tuple[bytes, str]]:
    """The checkpoint's bytes and their sha256 through safeio; None when it cannot be
    read safely (the full check then says why)."""
    try:
        raw, _st = safeio.read_bytes(path, what="checkpoint", max_bytes=safeio.CHECKPOINT_MAX)
    except BadInputError:
        return None
    return raw, digest(raw)


def digest(raw: bytes) -> str:
    return hashlib.sha256(raw).hexdigest()
