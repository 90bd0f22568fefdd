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
from typing import Mapping, Optional, Sequence

from gpuguard.checkpoint import Checkpoint, PodDevicesEntry, marshal
from gpuguard.host.echo import cut
from gpuguard.host.inventory import Inventory
from gpuguard.model import Action, Finding
from gpuguard.steps.checkpoint.deviceids import Matcher, classify
from gpuguard.steps.registry import CHECKPOINT

ID_MAX = 256  # characters of a device ID or resource echoed in a field

NAME = CHECKPOINT
DEFAULT_RESOURCES = ("nvidia.com/gpu", "nvidia.com/gpu.shared", "nvidia.com/mig-*")


def resource_matches(resource: str, patterns: Sequence[str]) -> bool:
    return any(fnmatch.fnmatchcase(resource, p) for p in patterns)


@dataclass(frozen=True)
class Analysis:
    findings: tuple[Finding, ...]
    stale_registered: tuple[tuple[str, str], ...]  # (resource, id)
    stale_entries: tuple[int, ...]  # positions in checkpoint.entries
    repaired: Optional[Checkpoint]  # None: nothing to change (or refused)
    refused: str = ""  # why a needed repair must not be made
    entries: tuple[PodDevicesEntry, ...] = ()  # the checkpoint's, for what a repair drops

    @property
    def stale(self) -> bool:
        return bool(self.stale_registered or self.stale_entries)


def analyse(cp: Checkpoint, inventory: Inventory, resources: Sequence[str]) -> Analysis:
    matcher = Matcher(inventory)
    findings: list[Finding] = []
    understood: dict[str, bool] = {}

    def gpu_resource(resource: str) -> bool:
        # A resource is ours if its name matches AND every ID in it has a known form:
        # one unknown ID means we do not understand the resource, so we keep out of it.
        return understood.setdefault(resource, resource_matches(resource, resources))

    all_ids: dict[str, list[str]] = {}
    for resource, reg in cp.registered or ():
        all_ids.setdefault(resource, []).extend(reg or ())
    for e in cp.entries or ():
        all_ids.setdefault(e.resource_name, []).extend(e.all_device_ids())
    for resource, found in all_ids.items():
        if not gpu_resource(resource):
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

    stale_reg: list[tuple[str, str]] = []
    new_registered: list[tuple[str, Optional[tuple[str, ...]]]] = []
    for resource, reg_ids in cp.registered or ():
        if reg_ids is None or not gpu_resource(resource):
            new_registered.append((resource, reg_ids))
            continue
        keep = tuple(i for i in reg_ids if matcher.exists(classify(i)))
        for i in reg_ids:
            if i not in keep:
                stale_reg.append((resource, i))
                findings.append(
                    Finding(
                        kind="checkpoint-stale-registered",
                        reconciler=NAME,
                        summary=f"registered device {cut(i)} ({cut(resource)}) is not on this host",
                        fields={"RESOURCE": cut(resource, ID_MAX), "DEVICE_ID": cut(i, ID_MAX)},
                    )
                )
        new_registered.append((resource, keep))

    stale_entries: list[int] = []
    for pos, e in enumerate(cp.entries or ()):
        if not gpu_resource(e.resource_name):
            continue
        gone = [i for i in e.all_device_ids() if not matcher.exists(classify(i))]
        if gone:
            stale_entries.append(pos)
            findings.append(
                Finding(
                    kind="checkpoint-stale-entry",
                    reconciler=NAME,
                    summary=f"pod {cut(e.pod_uid)} container {cut(e.container_name)} holds "
                    f"{cut(e.resource_name)} device(s) this host no longer has: "
                    f"{', '.join(cut(i) for i in gone[:8])}"
                    f"{f' (+{len(gone) - 8} more)' if len(gone) > 8 else ''}",
                    fields={
                        "POD_UID": e.pod_uid,
                        "CONTAINER_NAME": e.container_name,
                        "RESOURCE": e.resource_name,
                        "DEVICE_ID": cut(gone[0], ID_MAX),
                    },
                )
            )

    if not stale_reg and not stale_entries:
        return Analysis(tuple(findings), (), (), None, entries=tuple(cp.entries or ()))

    if not inventory.gpus:
        # Zero GPUs more likely means a driver that is not up than GPUs that all changed.
        why = (
            f"{inventory.source} reports no GPU at all; refusing to drop "
            f"{len(stale_entries)} pod entries and {len(stale_reg)} registered IDs"
        )
        findings.append(
            Finding(kind="checkpoint-refused", reconciler=NAME, summary=why, severity="error")
        )
        return Analysis(
            tuple(findings),
            tuple(stale_reg),
            tuple(stale_entries),
            None,
            why,
            entries=tuple(cp.entries or ()),
        )

    drop = set(stale_entries)
    entries = cp.entries
    if entries is not None:
        entries = tuple(e for pos, e in enumerate(entries) if pos not in drop)
    registered = tuple(new_registered) if cp.registered is not None else None
    repaired = dataclasses.replace(cp, entries=entries, registered=registered)
    return Analysis(
        tuple(findings),
        tuple(stale_reg),
        tuple(stale_entries),
        repaired,
        entries=tuple(cp.entries or ()),
    )


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

    @property
    def kind(self) -> str:
        return "checkpoint-repaired"

    def describe(self) -> str:
        return f"rewrite {self.target} without them ({self.reason})"

    def fields(self) -> Mapping[str, str]:
        return {
            "CHECKPOINT": str(self.path),
            "DROPPED_ENTRIES": str(self.dropped_entries),
            "DROPPED_REGISTERED": str(self.dropped_registered),
        }


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
        ),
    )
