"""What a remap must never do, checked on its result: give a pod a GPU another pod
holds, or leave an allocation response naming a GPU its entry was not remapped to.

Both compare physical devices, never ID strings: one resource may hold a GPU as `0` in
one entry and as `GPU-…` in another (an index-strategy plugin's entries next to a
UUID one), and a MIG device as `MIG-…` or `MIG-GPU-…/gi/ci`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

from gpuguard.checkpoint import allocresp
from gpuguard.checkpoint.model import PodDevicesEntry
from gpuguard.host.inventory import Gpu, Inventory
from gpuguard.steps.checkpoint.deviceids import DeviceId, classify
from gpuguard.steps.checkpoint.translate import GPU_NODE, INDEX_FORMS, UUIDISH, VISIBLE, host_path


@dataclass(frozen=True)
class Devices:
    """The current inventory, looked up by what checkpoint IDs name."""

    by_uuid: dict[str, Gpu]
    by_mig: dict[str, Gpu]
    by_index: dict[int, Gpu]
    minors: dict[int, Gpu]
    # stray()'s verdicts by (answer, GPUs held): answers repeat across entries
    verdicts: dict[tuple[bytes, frozenset[str]], str] = field(default_factory=dict)

    @classmethod
    def of(cls, inv: Inventory) -> Devices:
        return cls(
            {g.uuid: g for g in inv.gpus},
            {m.uuid: g for g in inv.gpus for m in g.mig},
            {g.index: g for g in inv.gpus},
            {g.minor: g for g in inv.gpus},
        )

    def gpu(self, d: DeviceId) -> Optional[Gpu]:
        """The GPU (a MIG device's parent) an ID names now; None: none."""
        if d.form in ("gpu-uuid", "mig-legacy"):
            return self.by_uuid.get(d.key)
        if d.form == "mig-uuid":
            return self.by_mig.get(d.key)
        if d.form in INDEX_FORMS:
            return self.by_index.get(int(d.key))
        return None

    def unit(self, raw: str) -> str:
        """The physical device an ID names now: GPU, MIG device and replica."""
        d = classify(raw)
        gpu = self.gpu(d)
        if gpu is None:
            return f"?{raw}"
        return f"{gpu.uuid}|{_sub(d, gpu)}|{'' if d.replica is None else d.replica}"


def _sub(d: DeviceId, gpu: Optional[Gpu]) -> str:
    if d.form == "mig-uuid":
        return d.key
    if d.form == "mig-legacy":
        mig = (
            None
            if gpu is None
            else next((m for m in gpu.mig if (m.gi, m.ci) == (d.gi, d.ci)), None)
        )
        return mig.uuid if mig is not None else f"{d.gi}/{d.ci}"
    return f"#{d.ci}" if d.form == "mig-index" else ""


def old_unit(raw: str, old_gpu: str) -> str:
    """The physical device an ID of an older generation named (`old_gpu`: the UUID of
    the GPU behind an index ID in that generation)."""
    d = classify(raw)
    base = old_gpu if d.form in INDEX_FORMS else d.key
    return f"old:{base}|{_sub(d, None)}|{'' if d.replica is None else d.replica}"


def stray(devices: Devices, e: PodDevicesEntry) -> str:
    """Why `e`'s allocation response names a device other than the GPUs its IDs name
    now ("" when it names only those): a UUID this node does not have or another GPU's,
    a host `/dev/nvidiaN` of another GPU, an index another GPU has."""
    held = frozenset(g.uuid for g in (devices.gpu(classify(i)) for i in e.all_device_ids()) if g)
    key = (e.alloc_resp or b"", held)
    why = devices.verdicts.get(key)
    if why is None:
        why = devices.verdicts[key] = _stray(devices, held, e.alloc_resp or b"")
    return why


def _stray(devices: Devices, held: frozenset[str], resp: bytes) -> str:
    for where, key, value in allocresp.strings(resp):
        for token in UUIDISH.findall(value):
            gpu = devices.gpu(classify(token))
            if gpu is None:
                return f"its allocation names {token}, which this node does not have"
            if gpu.uuid not in held:
                return f"its allocation names {token}, a GPU its entry does not hold"
        path = GPU_NODE.match(value)
        if path and host_path(where, key, value):
            gpu = devices.minors.get(int(path.group(1)))
            if gpu is None or gpu.uuid not in held:
                return f"its allocation names {value}, a device its entry does not hold"
        if (where == allocresp.ENV and key == VISIBLE) or where == allocresp.CDI_NAME:
            for item in value.split(","):
                d = classify(item.rpartition("=")[2])
                if d.form in INDEX_FORMS:
                    gpu = devices.gpu(d)
                    if gpu is None or gpu.uuid not in held:
                        return f"its allocation names GPU {item}, which its entry does not hold"
    return ""


@dataclass(frozen=True)
class Claim:
    """One remapped entry's devices: (what it held before, what it holds now) per ID."""

    pos: int
    pod: str
    resource: str
    pairs: Sequence[tuple[str, str]]  # (physical unit before, physical unit now)


def clashes(holders: dict[tuple[str, str], dict[str, set[str]]], c: Claim) -> Optional[str]:
    """The pod already holding one of `c`'s new devices under another old one, if any;
    `c` is then recorded as a holder when there is none."""
    for before, now in c.pairs:
        for by, pods in holders.get((c.resource, now), {}).items():
            if by != before and any(p != c.pod for p in pods):
                return next(p for p in sorted(pods) if p != c.pod)
    for before, now in c.pairs:
        holders.setdefault((c.resource, now), {}).setdefault(before, set()).add(c.pod)
    return None
