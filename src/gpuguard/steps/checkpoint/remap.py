"""F1 remap: give each pod entry the GPU now in its old GPU's place instead of dropping it.

Pure: from the checkpoint, the inventory and the recorded GPU generations
(checkpoint/history.py), decide per pod entry of a GPU resource whether it stays, is
remapped (its device IDs, NUMA key and allocation response rewritten through the
one-to-one map of gpumap.py) or is dropped, and why.

Which entries are remapped:
- an entry naming a UUID-form ID (GPU-, MIG-, MIG-GPU-) this host no longer has: through
  the newest generation that knows every such ID. Index-form IDs of such an entry are
  translated with it, since the entry is of that generation as a whole;
- when kubelet last wrote the checkpoint before this boot, the newest generation was
  recorded before this boot too, and the GPUs differ from it ("whole" mode): every entry,
  index-form IDs included (an index that still exists may name another GPU now), since
  the whole file was written under that generation. Index-form IDs are never remapped
  otherwise: whether "1" means the old or the new GPU 1 cannot be told.

An entry is dropped (today's F1 repair) when one of its devices cannot be mapped: its
GPU is gone for good, its MIG device is gone, the count would change (a MIG layout that
changed), its allocation response cannot be read or names such a device, or its new
device is already allocated to another pod (the same physical device, whatever the
form of its ID: remapguard.py), or its rewritten allocation response would name a GPU
the entry was not remapped to. Nothing is then allocated twice.

Every part of one entry goes through one generation (translate.py): the newest in the
whole mode, unless the entry names UUIDs only an older generation knows (it outlived a
generation unrepaired): then that older one, as for stale IDs.

Without a usable history, an entry that still holds a GPU this node has is left as it
is and reported, never dropped: dropping it would free that GPU in kubelet's accounting
while its container may still be using it (docs/checkpoint.md).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace
from typing import Callable, List, Mapping, Optional, Sequence

from gpuguard.checkpoint import allocresp
from gpuguard.checkpoint.history import History
from gpuguard.checkpoint.model import Checkpoint, PodDevicesEntry
from gpuguard.host.inventory import Inventory
from gpuguard.steps.checkpoint.deviceids import DeviceId, Matcher, classify
from gpuguard.steps.checkpoint.gpumap import GpuMap, build_map, describe, newest_knowing
from gpuguard.steps.checkpoint.remapguard import Claim, Devices, clashes, old_unit, stray
from gpuguard.steps.checkpoint.translate import (
    INDEX_FORMS,
    UUID_FORMS,
    Failed,
    Translator,
    Unknown,
)


@dataclass(frozen=True)
class RemapInputs:
    """What the remap needs from the host besides the checkpoint and the inventory."""

    history: Optional[History]
    problem: str  # why the history file is unusable ("" when usable or absent)
    path: str  # the history file, for messages
    numa: Mapping[str, int]  # current GPUs' NUMA nodes by bus id (known ones only)
    checkpoint_mtime: float
    boot_time: float  # 0: unknown


@dataclass(frozen=True)
class EntryRemap:
    pos: int
    old: PodDevicesEntry
    new: PodDevicesEntry
    how: str  # which generation, and how each GPU was paired
    # what the entry said before the remap, in today's numbering: the evidence its pod's
    # containers keep being judged by (checkpoint/dropped.py)
    evidence: tuple[str, ...] = ()
    # (old ID, new ID) in the old entry's order: a NUMA regrouping reorders the new
    # entry's lists, so its IDs cannot be paired with the old ones by position
    pairs: tuple[tuple[str, str], ...] = ()

    def old_ids(self) -> tuple[str, ...]:
        return tuple(o for o, _ in self.pairs) if self.pairs else self.old.all_device_ids()

    def new_ids(self) -> tuple[str, ...]:
        return tuple(n for _, n in self.pairs) if self.pairs else self.new.all_device_ids()


@dataclass(frozen=True)
class EntryDrop:
    pos: int
    entry: PodDevicesEntry
    why: str
    # what it was given, in today's numbering, as evidence for its pod's containers
    evidence: tuple[str, ...]


@dataclass(frozen=True)
class RemapResult:
    remaps: tuple[EntryRemap, ...]
    drops: tuple[EntryDrop, ...]
    registered: Optional[tuple[tuple[str, Optional[tuple[str, ...]]], ...]]
    registered_remaps: tuple[tuple[str, str, str], ...]  # (resource, old, new)
    registered_drops: tuple[tuple[str, str], ...]  # (resource, id)
    unavailable: str  # why no remap could be made at all ("" when a map was there)
    whole: bool
    # stale entries left as they are: without a history they still hold a present GPU
    kept: tuple[EntryDrop, ...] = ()
    # entries left alone whose answer kubelet and the wire format's specification read
    # differently (a hostile or broken plugin): reported, never rewritten
    ambiguous: tuple[EntryDrop, ...] = ()


def _whole(inputs: RemapInputs, maps: Sequence[GpuMap]) -> bool:
    if not maps or inputs.boot_time <= 0 or not maps[0].changed():
        return False
    newest = maps[0].generation
    return inputs.checkpoint_mtime < inputs.boot_time and newest.recorded_at < inputs.boot_time


def _regroup(
    t: Translator, e: PodDevicesEntry, numa: Mapping[str, int]
) -> tuple[PodDevicesEntry, tuple[tuple[str, str], ...]]:
    """`e` with its IDs translated and each moved to its new GPU's NUMA node if known,
    and the (old, new) pairs in `e`'s order."""
    if e.shape == "v1":
        pairs = tuple((i, t.raw_id(i)) for i in e.all_device_ids())
        return replace(e, device_ids=tuple(n for _, n in pairs)), pairs
    out: list[tuple[str, str]] = []
    groups: dict[int, Optional[list[str]]] = {}
    for node, listed in e.numa_pairs():
        if listed is None:  # a JSON null list stays null (it hashes differently from [])
            groups.setdefault(node, None)
            continue
        if groups.get(node) is None:
            groups[node] = []
        for raw in listed:
            new = t.raw_id(raw)
            out.append((raw, new))
            target = node
            if new != raw and numa:
                gpu = t.node_of(new, numa)
                target = gpu if gpu >= 0 else node
            group = groups.get(target)
            if group is None:
                group = groups[target] = []
            group.append(new)
    numa_ids = tuple(
        (n, None if v is None else tuple(v))
        for n, v in groups.items()
        if v is None or v or _had_empty(e, n)
    )
    return replace(e, device_ids=numa_ids), tuple(out)


def _had_empty(e: PodDevicesEntry, node: int) -> bool:
    return any(n == node and not ids for n, ids in e.numa_pairs())


def _remap_entry(
    t: Translator, e: PodDevicesEntry, numa: Mapping[str, int], devices: Devices
) -> tuple[PodDevicesEntry, tuple[tuple[str, str], ...]]:
    new, pairs = _regroup(t, e, numa)
    if e.alloc_resp is not None:
        # Responses repeat across entries (the same GPUs, the same answer): rewrite once.
        done = t.rewritten.get(e.alloc_resp)
        if done is None:
            try:
                done = allocresp.rewrite(e.alloc_resp, t.text)
            except allocresp.AllocRespError as err:
                done = Failed(
                    f"its allocation response is not a ContainerAllocateResponse gpuguard can "
                    f"read as kubelet does ({err})"
                )
            except Failed as why:
                done = why
            t.rewritten[e.alloc_resp] = done
        if isinstance(done, Failed):
            raise done
        new = replace(new, alloc_resp=done)
    if new != e:  # the result names only the GPUs its IDs name now, or it is not made
        stray_why = stray(devices, new)
        if stray_why:
            raise Failed(stray_why)
    return new, pairs


def _evidence(t: Optional[Translator], e: PodDevicesEntry) -> tuple[str, ...]:
    """What an entry said before gpuguard touched it, as evidence now: its UUID-form IDs
    as they were (a stale one names no GPU now), its index-form IDs of an earlier
    numbering only once translated (the same number may name another GPU now)."""
    out = []
    for raw in e.all_device_ids():
        d = classify(raw)
        if t is None or not t.whole or d.form not in INDEX_FORMS:
            out.append(raw)
            continue
        with contextlib.suppress(Failed):  # gone: no evidence rather than a wrong one
            out.append(t.id(d))
    return tuple(out)


def _generations(
    maps: Sequence[GpuMap], ids: Sequence[DeviceId], stale: Sequence[DeviceId], whole: bool
) -> list[tuple[GpuMap, bool]]:
    """The generations an entry may have been written under, most likely first, each
    with whether it is the whole file's. A board that kept its UUID is known to several
    generations, with the minor of each: the entry's answer tells which (plan())."""
    stale_uuids = [d for d in stale if d.form in UUID_FORMS]
    first = (
        [(maps[0], True)] if whole and all(maps[0].knows_uuid(d.key) for d in stale_uuids) else []
    )
    if any(d.form in INDEX_FORMS for d in (ids if whole else stale)):
        if first:
            return first
        raise Failed(
            "index IDs are remapped only when kubelet wrote the checkpoint before this boot, "
            "under the newest recorded generation (an index may name another GPU since)"
        )
    out = first + [(m, False) for m in maps if all(m.knows_uuid(d.key) for d in stale_uuids)]
    if not out:
        raise Unknown(f"{stale_uuids[0].raw} is not in the GPU identity history")
    return out


def plan(
    cp: Checkpoint,
    inventory: Inventory,
    in_scope: Callable[[str], bool],
    inputs: Optional[RemapInputs],
) -> RemapResult:
    matcher = Matcher(inventory)
    devices = Devices.of(inventory)
    history = inputs.history if inputs is not None else None
    maps = [build_map(g, inventory) for g in reversed(history.generations)] if history else []
    unavailable = _unavailable(inputs, maps, inventory)
    whole = inputs is not None and _whole(inputs, maps)
    numa = inputs.numa if inputs is not None else {}
    remaps: List[EntryRemap] = []
    drops: List[EntryDrop] = []
    kept: List[EntryDrop] = []
    ambiguous: List[EntryDrop] = []
    seen: dict[bytes, str] = {}
    claims: dict[int, Claim] = {}
    made: dict[tuple[int, bool], Translator] = {}

    def translator(g: GpuMap, whole: bool) -> Translator:
        key = (id(g), whole)
        if key not in made:
            made[key] = Translator(g, matcher, whole)
        return made[key]

    for pos, e in enumerate(cp.entries or ()):
        if not in_scope(e.resource_name) or e.shape is None:
            continue
        ids = [classify(i) for i in e.all_device_ids()]
        stale = [d for d in ids if not matcher.exists(d)]
        if not whole and not stale:
            why = _disagreement(e.alloc_resp, seen)
            if why:
                ambiguous.append(EntryDrop(pos, e, why, ()))
            continue
        t: Optional[Translator] = None
        try:
            if unavailable:
                raise Unknown(unavailable)
            tried: Optional[Failed] = None
            for g, entry_whole in _generations(maps, ids, stale, whole):
                t = translator(g, entry_whole)
                try:
                    new, pairs = _remap_entry(t, e, numa, devices)
                    break
                except Failed as why:  # the answer says another generation, maybe
                    tried = tried or why
            else:
                assert tried is not None
                raise tried
        except Unknown as why:
            if len(stale) < len(ids):  # never dropped with a GPU it holds that is here
                present = ", ".join(d.raw for d in ids if matcher.exists(d))
                kept.append(EntryDrop(pos, e, f"{why}; it still holds {present}", ()))
            else:
                drops.append(EntryDrop(pos, e, str(why), _evidence(t, e)))
            continue
        except Failed as why:
            drops.append(EntryDrop(pos, e, str(why), _evidence(t, e)))
            continue
        if new != e:
            if t.how is None:
                t.how = _how(t)
            remaps.append(EntryRemap(pos, e, new, t.how, _evidence(t, e), pairs))
            claims[pos] = Claim(pos, e.pod_uid, e.resource_name, tuple(
                (devices.unit(o) if o == n else old_unit(o, t.old_gpu(o)), devices.unit(n))
                for o, n in pairs
            ))  # fmt: skip
    remaps, drops = _no_double_allocation(cp, devices, remaps, drops, claims)
    reg, reg_remaps, reg_drops = _registered(cp, in_scope, matcher, maps, whole, unavailable)
    return RemapResult(
        tuple(remaps), tuple(sorted(drops, key=lambda d: d.pos)), reg,
        tuple(reg_remaps), tuple(reg_drops), unavailable, whole, tuple(kept), tuple(ambiguous),
    )  # fmt: skip


def _disagreement(resp: Optional[bytes], seen: dict[bytes, str]) -> str:
    """Why kubelet would read an answer otherwise than gpuguard ("" when it would not)."""
    if resp is None:
        return ""
    why = seen.get(resp)
    if why is None:
        try:
            allocresp.strings(resp)
            why = ""
        except allocresp.ReadingsDisagree as e:
            why = f"its allocation response is read otherwise by kubelet: {e}"
        except allocresp.AllocRespError:
            why = ""  # kubelet skips it too
        seen[resp] = why
    return why


def _unavailable(inputs: Optional[RemapInputs], maps: Sequence[GpuMap], inv: Inventory) -> str:
    if inputs is None:
        return "no GPU identity history was consulted"
    if inputs.problem:
        return f"the GPU identity history is unusable: {inputs.problem}"
    if not maps:
        return f"no GPU identity history yet ({inputs.path} is recorded at the first check)"
    if not inv.gpus:
        return "the inventory has no GPU"
    return ""


def _how(t: Optional[Translator]) -> str:
    if t is None:
        return ""
    pairs = (
        "; ".join(f"{m.old.uuid} -> {describe(m)}" for m in t.g.matches if m.how != "uuid")
        or "same GPUs, new numbering"
    )
    mode = "checkpoint written before this boot" if t.whole else "stale IDs"
    return f"generation recorded at {t.g.generation.recorded_at:.0f} ({mode}): {pairs}"


def _no_double_allocation(
    cp: Checkpoint,
    devices: Devices,
    remaps: List[EntryRemap],
    drops: List[EntryDrop],
    claims: Mapping[int, Claim],
) -> tuple[List[EntryRemap], List[EntryDrop]]:
    """Drop each remapped entry whose new device another pod holds under another old
    one (kubelet gave it away since): a remap never makes two pods share a physical
    device that they did not share already."""
    changed = {r.pos for r in remaps}
    gone = {d.pos for d in drops}
    # (resource, device now) -> {the device it was held as: the pods holding it so}
    holders: dict[tuple[str, str], dict[str, set[str]]] = {}
    for pos, e in enumerate(cp.entries or ()):
        if pos not in changed and pos not in gone:
            for i in e.all_device_ids():
                unit = devices.unit(i)
                holders.setdefault((e.resource_name, unit), {}).setdefault(unit, set()).add(
                    e.pod_uid
                )
    kept: List[EntryRemap] = []
    for r in remaps:
        pod = clashes(holders, claims[r.pos])
        if pod is not None:
            why = f"its new device is already allocated to pod {pod} (the same physical GPU)"
            drops.append(EntryDrop(r.pos, r.old, why, r.evidence))
            continue
        kept.append(r)
    return kept, drops


def _registered(
    cp: Checkpoint,
    in_scope: Callable[[str], bool],
    matcher: Matcher,
    maps: Sequence[GpuMap],
    whole: bool,
    unavailable: str,
) -> tuple[
    Optional[tuple[tuple[str, Optional[tuple[str, ...]]], ...]],
    List[tuple[str, str, str]],
    List[tuple[str, str]],
]:
    if cp.registered is None:
        return None, [], []
    out: list[tuple[str, Optional[tuple[str, ...]]]] = []
    remaps: list[tuple[str, str, str]] = []
    drops: list[tuple[str, str]] = []
    for resource, ids in cp.registered:
        if ids is None or not in_scope(resource):
            out.append((resource, ids))
            continue
        keep: list[str] = []
        for raw in ids:
            d = classify(raw)
            new: Optional[str] = None
            if not unavailable and (whole or not matcher.exists(d)):
                index = d.form in INDEX_FORMS
                g = maps[0] if whole and (index or maps[0].knows_uuid(d.key)) else None
                g = g or (None if index else newest_knowing(maps, [d]))
                if g is not None:
                    with contextlib.suppress(Failed):
                        new = Translator(g, matcher, whole and g is maps[0]).id(d)
            if new is None and matcher.exists(d) and not whole:
                new = raw
            if new is None:
                drops.append((resource, raw))
                continue
            if new != raw:
                remaps.append((resource, raw, new))
            if new not in keep:
                keep.append(new)
        out.append((resource, tuple(keep)))
    return tuple(out), remaps, drops
