"""Which GPU of an earlier generation is which GPU now: a one-to-one map, and IDs through it.

The map pairs each GPU of a recorded generation (checkpoint/history.py) with at most one
GPU of the current inventory, never two with the same one:

1. the same UUID: the same board (its index or minor may have changed);
2. else the same PCI bus id, when that bus id names exactly one GPU on each side: the
   GPU in the same physical slot (a new board, or the same one with a new UUID);
3. else the same NVML index, but only when no GPU of either side has a bus id the other
   side has (an instance replaced by one whose PCI layout differs altogether) and both
   sides have the same number of GPUs with the same set of indices: one to one and
   unambiguous. On the same PCI layout an unpaired GPU is gone, whatever appeared.

A GPU left unpaired is gone for good, and says why. A MIG device follows its parent,
to the new parent's MIG device with the same (GPU instance, compute instance).

translate() turns one checkpoint device ID of the old generation into the same device's
ID now, in the same form (a replica suffix `::n` kept), or says why it cannot.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Mapping, Optional, Sequence, Union

from gpuguard.checkpoint.history import Generation, GpuIdentity, normal_bus_id
from gpuguard.host.inventory import Gpu, Inventory
from gpuguard.steps.checkpoint.deviceids import DeviceId


@dataclass(frozen=True)
class Match:
    old: GpuIdentity
    new: Gpu
    how: str  # "uuid" | "pci" | "index"


@dataclass(frozen=True)
class Gone:
    old: GpuIdentity
    why: str


@dataclass(frozen=True)
class GpuMap:
    generation: Generation
    matches: tuple[Match, ...]
    gone: tuple[Gone, ...]
    _by_uuid: dict[str, Union[Match, Gone]] = field(default_factory=dict, compare=False)
    _by_index: dict[int, Union[Match, Gone]] = field(default_factory=dict, compare=False)
    _by_minor: dict[int, Union[Match, Gone]] = field(default_factory=dict, compare=False)
    _mig: dict[str, tuple[GpuIdentity, int, int]] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        every: list[Union[Match, Gone]] = [*self.matches, *self.gone]
        for m in every:
            self._by_uuid[m.old.uuid] = m
            self._by_index[m.old.index] = m
            self._by_minor[m.old.minor] = m
            for mig in m.old.mig:
                self._mig[mig.uuid] = (m.old, mig.gi, mig.ci)

    def knows_uuid(self, uuid: str) -> bool:
        return uuid in self._by_uuid or uuid in self._mig

    def knows_index(self, index: int) -> bool:
        return index in self._by_index

    def of_minor(self, minor: int) -> Optional[Union[Match, Gone]]:
        return self._by_minor.get(minor)

    def of_index(self, index: int) -> Optional[Union[Match, Gone]]:
        return self._by_index.get(index)

    def of_uuid(self, uuid: str) -> Optional[Union[Match, Gone]]:
        return self._by_uuid.get(uuid)

    def changed(self) -> bool:
        """Whether any GPU is gone or differs now in UUID, index, minor or MIG devices."""
        return bool(self.gone) or any(
            m.new.uuid != m.old.uuid
            or m.new.index != m.old.index
            or m.new.minor != m.old.minor
            or tuple(sorted(x.uuid for x in m.new.mig)) != tuple(sorted(x.uuid for x in m.old.mig))
            for m in self.matches
        )

    def _parent(self, gpu: Union[Match, Gone, None], what: str) -> Union[Gpu, str]:
        if gpu is None:
            return f"{what} is not in the recorded generation"
        if isinstance(gpu, Gone):
            return f"{what} ({gpu.old.uuid}, PCI {gpu.old.pci_bus_id}) is gone: {gpu.why}"
        return gpu.new

    def translate(self, d: DeviceId) -> tuple[Optional[str], str]:
        """(the ID now, "") or (None, why not). The ID must be of this generation."""
        suffix = "" if d.replica is None else f"::{d.replica}"
        if d.form == "gpu-uuid":
            new = self._parent(self._by_uuid.get(d.key), d.key)
            return (new.uuid + suffix, "") if isinstance(new, Gpu) else (None, new)
        if d.form == "index":
            new = self._parent(self._by_index.get(int(d.key)), f"GPU index {d.key}")
            return (str(new.index) + suffix, "") if isinstance(new, Gpu) else (None, new)
        if d.form == "mig-uuid":
            found = self._mig.get(d.key)
            if found is None:
                return None, f"MIG device {d.key} is not in the recorded generation"
            parent, gi, ci = found
            new = self._parent(self._by_uuid.get(parent.uuid), f"its GPU {parent.uuid}")
            if not isinstance(new, Gpu):
                return None, new
            child = next((m for m in new.mig if (m.gi, m.ci) == (gi, ci)), None)
            if child is None:
                return None, f"{new.uuid} has no MIG device gi {gi} ci {ci} now"
            return child.uuid + suffix, ""
        if d.form == "mig-legacy":
            new = self._parent(self._by_uuid.get(d.key), d.key)
            if not isinstance(new, Gpu):
                return None, new
            if not any((m.gi, m.ci) == (d.gi, d.ci) for m in new.mig):
                return None, f"{new.uuid} has no MIG device gi {d.gi} ci {d.ci} now"
            return f"MIG-{new.uuid}/{d.gi}/{d.ci}{suffix}", ""
        if d.form == "mig-index":
            old = self._by_index.get(int(d.key))
            new = self._parent(old, f"GPU index {d.key}")
            if not isinstance(new, Gpu) or old is None:
                return None, str(new)
            if tuple(sorted((m.gi, m.ci) for m in new.mig)) != old.old.mig_layout():
                # MIG devices by index are numbered in the plugin's own order: only the
                # same layout keeps the number meaning the same device (and the count).
                return None, f"GPU index {d.key} has another MIG layout now"
            return f"{new.index}:{d.ci}{suffix}", ""
        return None, f"{d.raw} is of a form gpuguard does not remap"

    def minor_now(self, minor: int) -> tuple[Optional[int], str]:
        """The minor of the GPU that had `minor` in this generation (None: gone, or it
        had none here: the caller decides)."""
        m = self._by_minor.get(minor)
        if m is None:
            return None, ""
        if isinstance(m, Gone):
            return None, f"/dev/nvidia{minor} ({m.old.uuid}) is gone: {m.why}"
        return m.new.minor, ""

    def numa_now(self, uuid_now: str, numa: Mapping[str, int]) -> int:
        """The NUMA node of the current GPU `uuid_now` (-1: unknown)."""
        for m in self.matches:
            if m.new.uuid == uuid_now:
                return numa.get(normal_bus_id(m.new.pci_bus_id), -1)
        return -1


def build_map(gen: Generation, inventory: Inventory) -> GpuMap:
    """The one-to-one map from `gen` to `inventory` (the rules in the module's doc)."""
    now = list(inventory.gpus)
    matches: list[Match] = []
    left: list[GpuIdentity] = []
    by_uuid = {g.uuid: g for g in now}
    for old in gen.gpus:
        new = by_uuid.get(old.uuid)
        if new is not None:
            matches.append(Match(old, new, "uuid"))
        else:
            left.append(old)
    taken = {m.new.uuid for m in matches}
    free = [g for g in now if g.uuid not in taken]
    # A bus id only pairs when it names one GPU on each side (both sides as a whole).
    old_bus = Counter(g.pci_bus_id for g in gen.gpus)
    new_bus = Counter(normal_bus_id(g.pci_bus_id) for g in now)
    by_bus = {normal_bus_id(g.pci_bus_id): g for g in free}
    rest: list[GpuIdentity] = []
    for old in left:
        new = by_bus.get(old.pci_bus_id)
        if new is not None and old_bus[old.pci_bus_id] == 1 and new_bus[old.pci_bus_id] == 1:
            matches.append(Match(old, new, "pci"))
            free.remove(new)
        else:
            rest.append(old)
    gone: list[Gone] = []
    if rest:
        disjoint = not set(old_bus) & set(new_bus)
        if (
            disjoint
            and len(rest) == len(free)
            and {g.index for g in rest} == {g.index for g in free}
        ):
            by_index = {g.index: g for g in free}
            matches += [Match(old, by_index[old.index], "index") for old in rest]
        else:
            why = "no GPU has its UUID or its PCI bus id now" + (
                f", and the {len(rest)} such GPU(s) cannot be paired one to one by index "
                f"with the {len(free)} new one(s)"
                if disjoint
                else " (the other GPUs are in their slots: not a new PCI layout)"
            )
            gone = [Gone(old, why) for old in rest]
    return GpuMap(gen, tuple(matches), tuple(gone))


def describe(m: Match) -> str:
    """How a pairing was made, for humans."""
    if m.how == "uuid":
        return f"{m.new.uuid} (same GPU)"
    if m.how == "pci":
        return f"{m.new.uuid} (same PCI slot {m.old.pci_bus_id})"
    return f"{m.new.uuid} (same index {m.old.index}; PCI {m.old.pci_bus_id} -> {m.new.pci_bus_id})"


def newest_knowing(maps: Sequence[GpuMap], ids: Sequence[DeviceId]) -> Optional[GpuMap]:
    """The newest generation's map that knows every UUID-form ID of `ids` (by the GPU or
    MIG UUID they name); None when none does. `maps` newest first."""
    keys = [d.key for d in ids if d.form in ("gpu-uuid", "mig-uuid", "mig-legacy")]
    for m in maps:
        if all(m.knows_uuid(k) for k in keys):
            return m
    return None
