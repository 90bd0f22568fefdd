"""Checkpoint entries gpuguard dropped, kept as evidence for the pods still running.

The container_access step cross-checks a container's GPU nodes against the pod's
checkpoint entries (devices/entitlement.py): a GPU that both NVIDIA_VISIBLE_DEVICES and
the checkpoint contradict is a conflict and is never granted. When the checkpoint
repair drops a pod's entry (it named a GPU this host no longer has), that record would
vanish with it, and a later read would turn the conflict into a grant (issue 10). So
the repair records every entry it drops, before it writes the checkpoint, in
/var/lib/gpuguard/checkpoint-dropped.json, and the evidence a pass decides from is the
checkpoint's entries plus these records: what the checkpoint said before gpuguard
touched it.

The newest MAX_RECORDS records are kept: a pod UID is never reused, so an old record
cannot speak for a new pod, and a node runs a few hundred pods at most.

An entry the repair remapped to the GPUs now in its GPUs' places (steps/checkpoint/
remap.py) is recorded the same way, with `remapped_to`, the IDs it was given instead:
while the checkpoint still holds exactly those for that container, the evidence is the
record's (what the entry said before), not the new IDs. So a container that ran before
the remap is judged as the check before the repair judged it, and a remap never makes
evidence for a GPU the old entry did not name. A record's `device_ids` are the IDs as
they read today (an index of an earlier numbering only once translated, never an index
that now names another GPU); `original_ids` are what the checkpoint said, for people.
"""

from __future__ import annotations

import errno
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from gpuguard.checkpoint.model import PodDevicesEntry
from gpuguard.errors import BadInputError
from gpuguard.host import safeio

MAX_RECORDS = 4096
MAX_BYTES = 8 * 1024 * 1024
VERSION = 1
NEXT_STEP = (
    "move it aside (it lists the device IDs of checkpoint entries gpuguard dropped) "
    "and run gpuguard again"
)


@dataclass(frozen=True)
class DroppedEntry:
    pod_uid: str
    container_name: str
    resource_name: str
    device_ids: tuple[str, ...]
    dropped_at: str  # UTC, e.g. 2026-11-23T02:41:02Z
    original_ids: tuple[str, ...] = ()  # as the checkpoint named them, when they differ
    remapped_to: tuple[str, ...] = ()  # a remapped entry: the IDs it holds since

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "pod_uid": self.pod_uid,
            "container_name": self.container_name,
            "resource_name": self.resource_name,
            "device_ids": list(self.device_ids),
            "dropped_at": self.dropped_at,
        }
        if self.original_ids and self.original_ids != self.device_ids:
            out["original_ids"] = list(self.original_ids)
        if self.remapped_to:
            out["remapped_to"] = list(self.remapped_to)
        return out


def dropped_from(entries: Iterable[PodDevicesEntry], when: str) -> tuple[DroppedEntry, ...]:
    return tuple(
        DroppedEntry(e.pod_uid, e.container_name, e.resource_name, e.all_device_ids(), when)
        for e in entries
    )


def merge(
    old: Sequence[DroppedEntry], new: Sequence[DroppedEntry], *, keep: int = MAX_RECORDS
) -> tuple[DroppedEntry, ...]:
    """Old records then new ones, a repeated record once (its newest copy), newest `keep`."""
    out: dict[tuple[str, str, str, tuple[str, ...]], DroppedEntry] = {}
    for r in (*old, *new):
        k = (r.pod_uid, r.container_name, r.resource_name, r.device_ids)
        out.pop(k, None)
        out[k] = r
    records = tuple(out.values())
    return records[max(0, len(records) - keep) :]


def pod_device_ids(
    entries: Iterable[PodDevicesEntry], dropped: Iterable[DroppedEntry] = ()
) -> dict[str, frozenset[str]]:
    """pod UID -> every device ID its checkpoint entries name, dropped ones included."""
    dropped = tuple(dropped)
    remapped = {(r.pod_uid, r.container_name, r.resource_name, r.remapped_to) for r in dropped}
    out: dict[str, set[str]] = {}
    for e in entries:
        ids = e.all_device_ids()
        if (e.pod_uid, e.container_name, e.resource_name, ids) in remapped:
            continue  # what gpuguard wrote: its record says what the entry said before
        out.setdefault(e.pod_uid, set()).update(ids)
    for r in dropped:
        out.setdefault(r.pod_uid, set()).update(r.device_ids)
    return {pod: frozenset(ids) for pod, ids in out.items()}


def render(records: Sequence[DroppedEntry]) -> bytes:
    doc = {"version": VERSION, "dropped": [r.to_json() for r in records]}
    return (json.dumps(doc, indent=1) + "\n").encode()


def _str(d: Mapping[str, Any], key: str, where: str) -> str:
    v = d.get(key)
    if not isinstance(v, str):
        raise ValueError(f"{where}: {key} is not a string")
    return v


def parse(raw: bytes, source: str) -> tuple[DroppedEntry, ...]:
    """The records of `raw`; any deviation from what render() writes is a BadInputError."""
    try:
        doc = json.loads(raw.decode("utf-8"))
        if not isinstance(doc, dict) or doc.get("version") != VERSION:
            raise ValueError(f"not a version {VERSION} record file")
        items = doc.get("dropped")
        if not isinstance(items, list):
            raise ValueError("'dropped' is not a list")
        out = []
        for i, d in enumerate(items):
            where = f"record {i + 1}"
            if not isinstance(d, dict):
                raise ValueError(f"{where} is not an object")
            ids = d.get("device_ids")
            if not isinstance(ids, list) or not all(isinstance(x, str) for x in ids):
                raise ValueError(f"{where}: device_ids is not a list of strings")
            orig, moved = d.get("original_ids", []), d.get("remapped_to", [])
            for name, v in (("original_ids", orig), ("remapped_to", moved)):
                if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
                    raise ValueError(f"{where}: {name} is not a list of strings")
            out.append(
                DroppedEntry(
                    _str(d, "pod_uid", where),
                    _str(d, "container_name", where),
                    _str(d, "resource_name", where),
                    tuple(ids),
                    _str(d, "dropped_at", where),
                    tuple(orig),
                    tuple(moved),
                )
            )
    except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeError too
        raise BadInputError(f"{source}: unreadable ({str(e)[:200]}); {NEXT_STEP}") from None
    return tuple(out)


def read(path: Path) -> tuple[DroppedEntry, ...]:
    """The records in `path`; () when it does not exist. Never follows a link, never
    blocks on a FIFO, never reads past MAX_BYTES (safeio's reader)."""
    try:
        raw, _st = safeio.read_bytes(path, what="dropped-entries record", max_bytes=MAX_BYTES)
    except safeio.UnsafeFileError as e:
        if e.errno == errno.ENOENT:
            return ()
        raise BadInputError(f"{e.message}; {NEXT_STEP}") from None
    return parse(raw, str(path))
