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
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from gpuguard import __version__
from gpuguard.errors import BadInputError
from gpuguard.host import safeio
from gpuguard.host.inventory import Inventory
from gpuguard.host.paths import STATE_DIR, Root
from gpuguard.host.statefile import Loaded, Obj, SchemaError, StateFile, load

MEMO = f"{STATE_DIR}/kubelet-hook.memo.json"
MEMO_MAX = 64 * 1024
FORMAT = 1
_SHA256 = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class MemoKey:
    """What the hook's verdict depends on; equal keys: the verdict stands."""

    gpuguard: str
    checkpoint: str
    checkpoint_sha256: str
    inventory: str
    resources: tuple[str, ...]


def _sha(o: Obj, key: str) -> str:
    v = o.text(key, max_len=64)
    if not _SHA256.fullmatch(v):
        raise SchemaError(f"{key}: not a sha256")
    return v


SPEC: StateFile[MemoKey] = StateFile(
    path=MEMO,
    what="kubelet hook memo",
    version=FORMAT,
    parse=lambda o: MemoKey(
        o.text("gpuguard", max_len=64),
        o.text("checkpoint", max_len=4096),
        _sha(o, "checkpoint_sha256"),
        _sha(o, "inventory"),
        o.texts("resources", max_items=256, max_len=256),
    ),
    render=lambda k: {
        "gpuguard": k.gpuguard,
        "checkpoint": k.checkpoint,
        "checkpoint_sha256": k.checkpoint_sha256,
        "inventory": k.inventory,
        "resources": list(k.resources),
    },
    max_bytes=MEMO_MAX,
    mode=0o600,
    version_key="format",
)


def inventory_identity(inventory: Inventory) -> str:
    """sha256 of the GPUs' identities, in a canonical order: what the analysis reads."""
    gpus = sorted((g.uuid, g.index, g.minor, sorted(m.uuid for m in g.mig)) for g in inventory.gpus)
    return hashlib.sha256(json.dumps(gpus).encode()).hexdigest()


def memo_key(
    checkpoint_path: str, checkpoint_sha256: str, inventory: Inventory, resources: Sequence[str]
) -> MemoKey:
    return MemoKey(
        __version__,
        checkpoint_path,
        checkpoint_sha256,
        inventory_identity(inventory),
        tuple(sorted(resources)),
    )


def read_memo(root: Root) -> Loaded[MemoKey]:
    """The recorded key; none when missing, unsafe or malformed (then: the full check,
    and `why` for the journal when it was there and unusable)."""
    return load(root.path(MEMO), SPEC)


def unchanged(root: Root, key: MemoKey, unusable: Optional[list[str]] = None) -> bool:
    got = read_memo(root)
    if got.value is None and not got.absent and unusable is not None:
        unusable.append(got.why)
    return got.value == key


def write_memo(root: Root, key: MemoKey) -> bool:
    """Record a verified healthy state; False when it cannot be written (a read-only or
    unsafe state directory: the next start then simply takes the full check)."""
    from gpuguard.actuate.statefile import write_state

    try:
        write_state(root.path(MEMO), SPEC, key)
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
