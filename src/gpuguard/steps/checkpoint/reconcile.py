"""F1: a kubelet checkpoint that names GPUs this host no longer has.

analyse() decides which registered IDs and which pod entries are stale; plan() turns
that into one action (rewrite or delete) that an actuator applies while kubelet is
stopped. Only resources matching the configured patterns are examined, and within
them only IDs of a form we understand: anything else is left exactly as it is.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

from gpuguard.checkpoint import Checkpoint, PodDevicesEntry, marshal
from gpuguard.host.echo import cut
from gpuguard.host.inventory import Inventory
from gpuguard.model import Action, Finding
from gpuguard.steps.checkpoint import remap
from gpuguard.steps.checkpoint.deviceids import Matcher, classify
from gpuguard.steps.checkpoint.remap import EntryDrop, EntryRemap, RemapInputs
from gpuguard.steps.registry import CHECKPOINT

ID_MAX = 256  # characters of a device ID or resource echoed in a field

NAME = CHECKPOINT
DEFAULT_RESOURCES = ("nvidia.com/gpu", "nvidia.com/gpu.shared", "nvidia.com/mig-*")


def resource_matches(resource: str, patterns: Sequence[str]) -> bool:
    return any(fnmatch.fnmatchcase(resource, p) for p in patterns)


@dataclass(frozen=True)
class Analysis:
    findings: tuple[Finding, ...]
    stale_registered: tuple[tuple[str, str], ...]  # (resource, id) dropped
    stale_entries: tuple[int, ...]  # positions in checkpoint.entries that are dropped
    repaired: Optional[Checkpoint]  # None: nothing to change (or refused)
    refused: str = ""  # why a needed repair must not be made
    entries: tuple[PodDevicesEntry, ...] = ()  # the checkpoint's, for what a repair drops
    remaps: tuple[EntryRemap, ...] = ()  # entries given the GPU now in their GPU's place
    drops: tuple[EntryDrop, ...] = ()  # the dropped entries, each with why
    registered_remaps: tuple[tuple[str, str, str], ...] = ()  # (resource, old, new)
    unavailable: str = ""  # why no remap could be made ("" when the history could serve)
    kept: tuple[EntryDrop, ...] = ()  # stale entries left: they hold a present GPU

    @property
    def stale(self) -> bool:
        return bool(
            self.stale_registered or self.stale_entries or self.remaps or self.registered_remaps
        )


def _unknown_ids(cp: Checkpoint, resources: Sequence[str]) -> tuple[dict[str, bool], list[Finding]]:
    """Which resources are ours: the name matches AND every ID has a known form (one
    unknown ID means we do not understand the resource, so we keep out of it)."""
    understood: dict[str, bool] = {}
    findings: list[Finding] = []
    all_ids: dict[str, list[str]] = {}
    for resource, reg in cp.registered or ():
        all_ids.setdefault(resource, []).extend(reg or ())
    for e in cp.entries or ():
        all_ids.setdefault(e.resource_name, []).extend(e.all_device_ids())
    for resource, found in all_ids.items():
        understood[resource] = resource_matches(resource, resources)
        if not understood[resource]:
            continue
        unknown = sorted({i for i in found if classify(i).form == "unknown"})
        if unknown:
            understood[resource] = False
            findings.append(
                Finding(
                    kind="checkpoint-unknown-id",
                    reconciler=NAME,
                    severity="info",
                    summary=f"resource {cut(resource)} has IDs of an unknown form "
                    f"({', '.join(cut(u) for u in unknown[:3])}); left untouched",
                    fields={
                        "RESOURCE": cut(resource, ID_MAX),
                        "DEVICE_ID": cut(unknown[0], ID_MAX),
                    },
                )
            )
    return understood, findings


def _entry_fields(e: PodDevicesEntry) -> dict[str, str]:
    return {
        "POD_UID": cut(e.pod_uid, ID_MAX),
        "CONTAINER_NAME": cut(e.container_name, ID_MAX),
        "RESOURCE": cut(e.resource_name, ID_MAX),
    }


def _ids(ids: Sequence[str], shown: int = 8) -> str:
    """Device IDs for a message: each cut, at most `shown` of them and how many more."""
    more = f" (+{len(ids) - shown} more)" if len(ids) > shown else ""
    return ", ".join(cut(i) for i in ids[:shown]) + more


def analyse(
    cp: Checkpoint,
    inventory: Inventory,
    resources: Sequence[str],
    remap_inputs: Optional[RemapInputs] = None,
) -> Analysis:
    """Which entries stay, are remapped to the GPUs now in their GPUs' places, or are
    dropped (remap.py); without `remap_inputs` (no history consulted) every entry that
    names a device this host no longer has is dropped."""
    understood, findings = _unknown_ids(cp, resources)

    def gpu_resource(resource: str) -> bool:
        return understood.get(resource, False)

    result = remap.plan(cp, inventory, gpu_resource, remap_inputs)
    entries = tuple(cp.entries or ())
    for resource, i in result.registered_drops:
        findings.append(
            Finding(
                kind="checkpoint-stale-registered",
                reconciler=NAME,
                summary=f"registered device {cut(i)} ({cut(resource)}) is not on this host",
                fields={"RESOURCE": cut(resource, ID_MAX), "DEVICE_ID": cut(i, ID_MAX)},
            )
        )
    for r in result.remaps:
        old, new = r.old_ids(), r.new_ids()
        findings.append(
            Finding(
                kind="checkpoint-entry-remap",
                reconciler=NAME,
                summary=f"pod {cut(r.old.pod_uid)} container {cut(r.old.container_name)} "
                f"holds {cut(r.old.resource_name)} {_ids(old)}; the same GPU(s) are now "
                f"{_ids(new)}",
                fields={
                    **_entry_fields(r.old),
                    "OLD_DEVICE_IDS": cut(",".join(old), ID_MAX),
                    "NEW_DEVICE_IDS": cut(",".join(new), ID_MAX),
                },
            )
        )
    matcher = Matcher(inventory)
    for d in result.drops:
        e = d.entry
        gone = [i for i in e.all_device_ids() if not matcher.exists(classify(i))]
        why = f"; not remapped: {d.why}" if remap_inputs is not None else ""
        held = (
            f"device(s) this host no longer has: {_ids(gone)}" if gone else _ids(e.all_device_ids())
        )
        findings.append(
            Finding(
                kind="checkpoint-stale-entry",
                reconciler=NAME,
                summary=f"pod {cut(e.pod_uid)} container {cut(e.container_name)} holds "
                f"{cut(e.resource_name)} {held}{why}",
                fields={
                    **_entry_fields(e),
                    "DEVICE_ID": cut((gone or list(e.all_device_ids()) or [""])[0], ID_MAX),
                    "DROP_REASON": d.why,
                },
            )
        )
    for k in result.kept:  # no history: never dropped while it holds a present GPU
        gone = [i for i in k.entry.all_device_ids() if not matcher.exists(classify(i))]
        findings.append(
            Finding(
                kind="checkpoint-entry-kept",
                reconciler=NAME,
                summary=f"pod {cut(k.entry.pod_uid)} container {cut(k.entry.container_name)} "
                f"holds {cut(k.entry.resource_name)} device(s) this host no longer has: "
                f"{_ids(gone)}; left as it is, not dropped: {k.why}",
                fields={**_entry_fields(k.entry), "DEVICE_ID": cut(gone[0], ID_MAX)},
            )
        )
    for k in result.ambiguous:  # not stale: left alone, and said
        findings.append(
            Finding(
                kind="checkpoint-allocresp-ambiguous",
                reconciler=NAME,
                summary=f"pod {cut(k.entry.pod_uid)} container {cut(k.entry.container_name)}: "
                f"{cut(k.why, 300)}; left as it is, never rewritten",
                fields={**_entry_fields(k.entry)},
            )
        )
    for resource, old_id, new_id in result.registered_remaps:  # pending until written
        findings.append(
            Finding(
                kind="checkpoint-stale-registered",
                reconciler=NAME,
                summary=f"registered device {cut(old_id)} ({cut(resource)}) is not on this "
                f"host; the same GPU is now {cut(new_id)}",
                fields={"RESOURCE": cut(resource, ID_MAX), "DEVICE_ID": cut(old_id, ID_MAX)},
            )
        )
    if (result.drops or result.kept) and result.unavailable and remap_inputs is not None:
        findings.append(
            Finding(
                kind="checkpoint-remap-unavailable",
                reconciler=NAME,
                severity="info",
                summary=f"stale pod entries are dropped, not remapped: {result.unavailable}",
                fields={"REASON": result.unavailable},
            )
        )
    stale_reg = tuple(result.registered_drops)
    dropped = tuple(d.pos for d in result.drops)
    base = Analysis(
        tuple(findings),
        stale_reg,
        dropped,
        None,
        entries=entries,
        remaps=result.remaps,
        drops=result.drops,
        registered_remaps=result.registered_remaps,
        unavailable=result.unavailable,
        kept=result.kept,
    )
    if not base.stale:
        return base
    if not inventory.gpus:
        # Zero GPUs more likely means a driver that is not up than GPUs that all changed.
        why = (
            f"{inventory.source} reports no GPU at all; refusing to drop "
            f"{len(dropped)} pod entries and {len(stale_reg)} registered IDs"
        )
        findings.append(
            Finding(kind="checkpoint-refused", reconciler=NAME, summary=why, severity="error")
        )
        return dataclasses.replace(base, findings=tuple(findings), refused=why)
    drop = set(dropped)
    changed = {r.pos: r.new for r in result.remaps}
    new_entries = cp.entries
    if new_entries is not None:
        new_entries = tuple(
            changed.get(pos, e) for pos, e in enumerate(new_entries) if pos not in drop
        )
    repaired = dataclasses.replace(cp, entries=new_entries, registered=result.registered)
    return dataclasses.replace(base, repaired=repaired)


@dataclass(frozen=True)
class RewriteCheckpoint(Action):
    """Replace the checkpoint with `content` (kubelet's bytes, fresh checksum)."""

    path: Path = Path()
    content: bytes = b""
    expected_sha256: str = ""  # the file must still be what we analysed
    dropped_entries: int = 0
    dropped_registered: int = 0
    # The pod entries it removes: recorded before the write (checkpoint/dropped.py)
    dropped: tuple[PodDevicesEntry, ...] = ()
    # Each entry given the GPU now in its old GPU's place, each dropped one with why
    # (journaled one by one once the file is written), and the registered IDs remapped.
    remaps: tuple[EntryRemap, ...] = ()
    drops: tuple[EntryDrop, ...] = ()
    registered_remaps: tuple[tuple[str, str, str], ...] = ()

    @property
    def kind(self) -> str:
        return "checkpoint-repaired"

    def describe(self) -> str:
        if self.remaps or self.registered_remaps:
            return f"rewrite {self.target} ({self.reason})"
        return f"rewrite {self.target} without them ({self.reason})"

    def fields(self) -> Mapping[str, str]:
        return {
            "CHECKPOINT": str(self.path),
            "DROPPED_ENTRIES": str(self.dropped_entries),
            "DROPPED_REGISTERED": str(self.dropped_registered),
            "REMAPPED_ENTRIES": str(len(self.remaps)),
        }

    def details(self) -> tuple[str, ...]:
        """One line per remap and drop, as the dry-run prints them and the real run makes
        them (and journals them)."""
        out = [
            f"remap: pod {r.old.pod_uid} container {r.old.container_name} "
            f"{r.old.resource_name}: {','.join(r.old_ids())} -> {','.join(r.new_ids())}"
            for r in self.remaps
        ]
        out += [
            f"remap: registered {res}: {old} -> {new}" for res, old, new in self.registered_remaps
        ]
        out += [
            f"drop:  pod {d.entry.pod_uid} container {d.entry.container_name} "
            f"{d.entry.resource_name}: {','.join(d.entry.all_device_ids())} ({d.why})"
            for d in self.drops
        ]
        return tuple(out)

    def to_json(self) -> dict[str, Any]:
        out = super().to_json()
        out["remaps"] = [
            {
                "pod_uid": r.old.pod_uid,
                "container_name": r.old.container_name,
                "resource": r.old.resource_name,
                "old_device_ids": list(r.old_ids()),
                "new_device_ids": list(r.new_ids()),
                "how": r.how,
            }
            for r in self.remaps
        ]
        out["registered_remaps"] = [
            {"resource": res, "old": old, "new": new} for res, old, new in self.registered_remaps
        ]
        out["drops"] = [
            {
                "pod_uid": d.entry.pod_uid,
                "container_name": d.entry.container_name,
                "resource": d.entry.resource_name,
                "device_ids": list(d.entry.all_device_ids()),
                "why": d.why,
            }
            for d in self.drops
        ]
        return out


@dataclass(frozen=True)
class DeleteCheckpoint(Action):
    """Remove the checkpoint (Policy=delete: what Alibaba's gpuops does)."""

    path: Path = Path()
    expected_sha256: str = ""
    dropped: tuple[PodDevicesEntry, ...] = ()  # every pod entry: recorded before the delete

    @property
    def kind(self) -> str:
        return "checkpoint-deleted"

    def describe(self) -> str:
        return f"delete {self.target} (Policy=delete; {self.reason})"

    def fields(self) -> Mapping[str, str]:
        return {"CHECKPOINT": str(self.path)}


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def plan(analysis: Analysis, *, path: Path, raw: bytes, policy: str) -> tuple[Action, ...]:
    """The action that repairs `path` (whose current bytes are `raw`), or none."""
    if analysis.repaired is None or policy == "report":
        return ()
    reason = (
        f"{len(analysis.stale_entries)} pod entries and {len(analysis.stale_registered)} "
        "registered IDs name devices this host no longer has"
    )
    if analysis.remaps or analysis.registered_remaps:
        parts = [
            f"{n} {what} {verb}"
            for n, what, verb in (
                (len(analysis.remaps), "pod entries", "remapped"),
                (len(analysis.registered_remaps), "registered IDs", "remapped"),
                (len(analysis.stale_entries), "pod entries", "dropped"),
                (len(analysis.stale_registered), "registered IDs", "dropped"),
            )
            if n
        ]
        reason = (
            f"{', '.join(parts)}: the GPUs now in their GPUs' places, from the GPU identity "
            "history; what cannot be mapped is dropped"
        )
    if policy == "delete":
        return (
            DeleteCheckpoint(
                NAME,
                reason,
                str(path),
                path=path,
                expected_sha256=sha256(raw),
                dropped=analysis.entries,
            ),
        )
    if policy != "rewrite":
        raise ValueError(f"unknown checkpoint policy {policy!r}")
    return (
        RewriteCheckpoint(
            NAME,
            reason,
            str(path),
            path=path,
            content=marshal(analysis.repaired),
            expected_sha256=sha256(raw),
            dropped_entries=len(analysis.stale_entries),
            dropped_registered=len(analysis.stale_registered),
            dropped=tuple(analysis.entries[i] for i in analysis.stale_entries),
            remaps=analysis.remaps,
            drops=analysis.drops,
            registered_remaps=analysis.registered_remaps,
        ),
    )
