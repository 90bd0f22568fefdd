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

An entry the repair remapped to the GPUs now in its GPUs' places (steps/checkpoint/
remap.py) is recorded the same way, with `remapped_to`, the IDs it was given instead:
while the checkpoint still holds exactly those for that container, the evidence is the
record's (what the entry said before) in their place, not the new IDs. So a container
that ran before the remap is judged as the check before the repair judged it, and a
remap never makes evidence for a GPU the old entry did not name. A record's
`device_ids` are the IDs as they read today (an index of an earlier numbering only once
translated, never an index that now names another GPU); `original_ids` are what the
checkpoint said, for people.

The newest MAX_RECORDS records are kept: a pod UID is never reused, so an old record
cannot speak for a new pod, and a node runs a few hundred pods at most.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

from gpuguard.checkpoint.model import PodDevicesEntry
from gpuguard.errors import BadInputError
from gpuguard.host.echo import cut
from gpuguard.host.paths import DROPPED_ENTRIES_FILE
from gpuguard.host.statefile import Obj, SchemaError, StateFile, load

MAX_RECORDS = 4096
MAX_IDS = 4096  # device IDs of one entry
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
    """pod UID -> the device IDs the checkpoint gives it: its live entries, an entry
    that is exactly what a remap wrote read as its record (what it said before the
    remap, in its place); for a pod the checkpoint no longer names at all, the entries
    gpuguard dropped from it (what the checkpoint said before gpuguard touched it).
    Never a union: a record can stand in for an entry, never widen a live one (see
    recorded_device_ids)."""
    dropped = tuple(dropped)
    wrote = {(r.pod_uid, r.container_name, r.resource_name, r.remapped_to): r for r in dropped}
    live: dict[str, set[str]] = {}
    for e in entries:
        ids = e.all_device_ids()
        r = wrote.get((e.pod_uid, e.container_name, e.resource_name, ids)) if ids else None
        live.setdefault(e.pod_uid, set()).update(r.device_ids if r is not None else ids)
    out = {pod: frozenset(ids) for pod, ids in live.items()}
    for pod, recorded in recorded_device_ids(dropped).items():
        if pod not in live:
            out[pod] = recorded
    return out


def recorded_device_ids(dropped: Iterable[DroppedEntry]) -> dict[str, frozenset[str]]:
    """pod UID -> every device ID its dropped entries named: evidence that can keep a
    running container's existing access from being judged a conflict, never a grant."""
    out: dict[str, set[str]] = {}
    for r in dropped:
        out.setdefault(r.pod_uid, set()).update(r.device_ids)
    return {pod: frozenset(ids) for pod, ids in out.items()}


def _entry(v: Any, where: str) -> DroppedEntry:
    o = Obj(v, where)
    return DroppedEntry(
        o.text("pod_uid", max_len=256),
        o.text("container_name", max_len=1024),
        o.text("resource_name", max_len=1024),
        o.texts("device_ids", max_items=MAX_IDS, max_len=1024),
        o.text("dropped_at", max_len=64),
        o.texts("original_ids", max_items=MAX_IDS, max_len=1024, default=[]),
        o.texts("remapped_to", max_items=MAX_IDS, max_len=1024, default=[]),
    )


SPEC: StateFile[tuple[DroppedEntry, ...]] = StateFile(
    path=DROPPED_ENTRIES_FILE,
    what="dropped-entries record",
    version=VERSION,
    parse=lambda o: o.items("dropped", _entry, max_items=MAX_RECORDS),
    render=lambda records: {"dropped": [r.to_json() for r in records]},
    max_bytes=MAX_BYTES,
    mode=0o600,
    next_step=NEXT_STEP,
)


def render(records: Sequence[DroppedEntry]) -> bytes:
    return SPEC.encode(tuple(records))


def parse(raw: bytes, source: str) -> tuple[DroppedEntry, ...]:
    """The records of `raw`; any deviation from what render() writes is a BadInputError."""
    try:
        return SPEC.decode(raw)
    except SchemaError as e:
        raise BadInputError(cut(f"{source}: unreadable ({e}); {NEXT_STEP}", 500)) from None


def read(path: Path) -> tuple[DroppedEntry, ...]:
    """The records in `path`; () when it does not exist. Never follows a link, never
    blocks on a FIFO, never reads past MAX_BYTES (the state-file loader)."""
    got = load(path, SPEC)
    if got.value is not None:
        return got.value
    if got.absent:
        return ()
    raise BadInputError(got.why)
