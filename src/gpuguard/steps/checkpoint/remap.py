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
device is already allocated to another pod. Nothing is then allocated twice.
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass, field, replace
from typing import Callable, List, Mapping, Optional, Sequence, Union

from gpuguard.checkpoint import allocresp
from gpuguard.checkpoint.history import History
from gpuguard.checkpoint.model import Checkpoint, PodDevicesEntry
from gpuguard.host.inventory import Inventory
from gpuguard.steps.checkpoint.deviceids import DeviceId, Matcher, classify
from gpuguard.steps.checkpoint.gpumap import GpuMap, build_map, describe, newest_knowing

VISIBLE = "NVIDIA_VISIBLE_DEVICES"
_UUIDISH = re.compile(
    r"(?<![0-9A-Za-z-])(MIG-GPU-[0-9A-Za-z]+(?:-[0-9A-Za-z]+)+/[0-9]{1,9}/[0-9]{1,9}"
    r"|(?:GPU|MIG)-[0-9A-Za-z]+(?:-[0-9A-Za-z]+)+)(?![0-9A-Za-z])"
)
_GPU_NODE = re.compile(r"/dev/nvidia([0-9]{1,7})\Z")
_CAPS = "/dev/nvidia-caps/"
_INDEX_FORMS = ("index", "mig-index")


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

    def old_ids(self) -> tuple[str, ...]:
        return self.old.all_device_ids()

    def new_ids(self) -> tuple[str, ...]:
        return self.new.all_device_ids()


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


def _whole(inputs: RemapInputs, maps: Sequence[GpuMap]) -> bool:
    if not maps or inputs.boot_time <= 0 or not maps[0].changed():
        return False
    newest = maps[0].generation
    return inputs.checkpoint_mtime < inputs.boot_time and newest.recorded_at < inputs.boot_time


class _Failed(Exception):
    pass


@dataclass
class _Translator:
    """Translates one entry's (or registered list's) IDs through its generation's map."""

    g: GpuMap
    older: Sequence[GpuMap]
    matcher: Matcher
    whole: bool
    rewritten: dict[bytes, Union[bytes, _Failed]] = field(default_factory=dict)
    translated: dict[str, Union[str, _Failed]] = field(default_factory=dict)
    nodes: dict[str, int] = field(default_factory=dict)
    how: Optional[str] = None  # how its GPUs were paired, for the journal

    def node_of(self, new_id: str, numa: Mapping[str, int]) -> int:
        """The NUMA node of the GPU behind a translated ID (-1: unknown), once per ID."""
        node = self.nodes.get(new_id)
        if node is None:
            node = self.nodes[new_id] = self.g.numa_now(_gpu_uuid(new_id, self), numa)
        return node

    def raw_id(self, raw: str) -> str:
        """id() of a raw ID, each translated once per plan."""
        done = self.translated.get(raw)
        if done is None:
            try:
                done = self.id(classify(raw))
            except _Failed as why:
                done = why
            self.translated[raw] = done
        if isinstance(done, _Failed):
            raise done
        return done

    def id(self, d: DeviceId) -> str:
        knows = (
            self.g.knows_index(int(d.key)) if d.form in _INDEX_FORMS else self.g.knows_uuid(d.key)
        )
        if knows and (self.whole or d.form not in _INDEX_FORMS):
            new, why = self.g.translate(d)
        elif self.matcher.exists(d):
            return d.raw
        elif d.form not in _INDEX_FORMS and (m := newest_knowing(self.older, [d])) is not None:
            new, why = m.translate(d)
        else:
            new, why = None, f"{d.raw} is not in the GPU identity history"
        if new is None:
            raise _Failed(why)
        return new

    def text(self, where: str, key: str, value: str) -> str:
        path = _GPU_NODE.match(value)
        if path and where != allocresp.DEVICE_PERMISSIONS:
            minor, why = self.g.minor_now(int(path.group(1)))
            if why:
                raise _Failed(f"its allocation names {why}")
            return value if minor is None else f"/dev/nvidia{minor}"
        if value.startswith(_CAPS) and any(m.old.minor != m.new.minor for m in self.g.matches):
            raise _Failed(
                f"its allocation names {value}, whose number follows its GPU's minor, which changed"
            )
        value = _UUIDISH.sub(self._token, value)
        if self.whole and (
            (where == allocresp.ENV and key == VISIBLE)
            or where in (allocresp.CDI_NAME, allocresp.ANNOTATION)
        ):
            value = ",".join(self._list_item(x) for x in value.split(","))
        return value

    def _token(self, m: re.Match[str]) -> str:
        d = classify(m.group(0))
        if not self.g.knows_uuid(d.key):
            return m.group(0)
        new, why = self.g.translate(d)
        if new is None:
            raise _Failed(f"its allocation names {why}")
        return new

    def _list_item(self, item: str) -> str:
        prefix, sep, name = item.rpartition("=")  # CDI: nvidia.com/gpu=0
        d = classify(name)
        if d.form not in _INDEX_FORMS or name != name.strip() or not self.g.knows_index(int(d.key)):
            return item
        new, why = self.g.translate(d)
        if new is None:
            raise _Failed(f"its allocation names {why}")
        return prefix + sep + new


def _regroup(t: _Translator, e: PodDevicesEntry, numa: Mapping[str, int]) -> PodDevicesEntry:
    """`e` with its IDs translated and each moved to its new GPU's NUMA node if known."""
    if e.shape == "v1":
        return replace(e, device_ids=tuple(t.raw_id(i) for i in e.all_device_ids()))
    groups: dict[int, Optional[list[str]]] = {}
    for node, listed in e.numa_pairs():
        if listed is None:  # a JSON null list stays null (it hashes differently from [])
            groups.setdefault(node, None)
            continue
        if groups.get(node) is None:
            groups[node] = []
        for raw in listed:
            new = t.raw_id(raw)
            target = node
            if new != raw and numa:
                gpu = t.node_of(new, numa)
                target = gpu if gpu >= 0 else node
            group = groups.get(target)
            if group is None:
                group = groups[target] = []
            group.append(new)
    pairs = tuple(
        (n, None if v is None else tuple(v))
        for n, v in groups.items()
        if v is None or v or _had_empty(e, n)
    )
    return replace(e, device_ids=pairs)


def _had_empty(e: PodDevicesEntry, node: int) -> bool:
    return any(n == node and not ids for n, ids in e.numa_pairs())


def _gpu_uuid(new_id: str, t: _Translator) -> str:
    """The current GPU's UUID behind a translated ID (for its NUMA node)."""
    d = classify(new_id)
    for m in t.g.matches:
        if d.form == "gpu-uuid" and d.key == m.new.uuid:
            return m.new.uuid
        if d.form in _INDEX_FORMS and d.key == str(m.new.index):
            return m.new.uuid
        if d.form == "mig-legacy" and d.key == m.new.uuid:
            return m.new.uuid
        if d.form == "mig-uuid" and any(x.uuid == d.key for x in m.new.mig):
            return m.new.uuid
    return ""


def _remap_entry(t: _Translator, e: PodDevicesEntry, numa: Mapping[str, int]) -> PodDevicesEntry:
    new = _regroup(t, e, numa)
    if e.alloc_resp is not None:
        # Responses repeat across entries (the same GPUs, the same answer): rewrite once.
        done = t.rewritten.get(e.alloc_resp)
        if done is None:
            try:
                done = allocresp.rewrite(e.alloc_resp, t.text)
            except allocresp.AllocRespError as err:
                done = _Failed(
                    f"its allocation response is not a ContainerAllocateResponse gpuguard can "
                    f"read ({err})"
                )
            except _Failed as why:
                done = why
            t.rewritten[e.alloc_resp] = done
        if isinstance(done, _Failed):
            raise done
        new = replace(new, alloc_resp=done)
    return new


def _evidence(t: Optional[_Translator], e: PodDevicesEntry) -> tuple[str, ...]:
    """What an entry said before gpuguard touched it, as evidence now: its UUID-form IDs
    as they were (a stale one names no GPU now), its index-form IDs of an earlier
    numbering only once translated (the same number may name another GPU now)."""
    out = []
    for raw in e.all_device_ids():
        d = classify(raw)
        if t is None or not t.whole or d.form not in _INDEX_FORMS:
            out.append(raw)
            continue
        with contextlib.suppress(_Failed):  # gone: no evidence rather than a wrong one
            out.append(t.id(d))
    return tuple(out)


def plan(
    cp: Checkpoint,
    inventory: Inventory,
    in_scope: Callable[[str], bool],
    inputs: Optional[RemapInputs],
) -> RemapResult:
    matcher = Matcher(inventory)
    history = inputs.history if inputs is not None else None
    maps = [build_map(g, inventory) for g in reversed(history.generations)] if history else []
    unavailable = _unavailable(inputs, maps, inventory)
    whole = inputs is not None and _whole(inputs, maps)
    numa = inputs.numa if inputs is not None else {}
    remaps: List[EntryRemap] = []
    drops: List[EntryDrop] = []
    made: dict[tuple[int, bool], _Translator] = {}

    def translator(g: GpuMap, whole: bool) -> _Translator:
        key = (id(g), whole)
        if key not in made:
            made[key] = _Translator(g, [m for m in maps if m is not g], matcher, whole)
        return made[key]

    for pos, e in enumerate(cp.entries or ()):
        if not in_scope(e.resource_name) or e.shape is None:
            continue
        ids = [classify(i) for i in e.all_device_ids()]
        stale = [d for d in ids if not matcher.exists(d)]
        if not whole and not stale:
            continue
        t: Optional[_Translator] = None
        try:
            if unavailable:
                raise _Failed(unavailable)
            if whole:
                t = translator(maps[0], True)
            else:
                if any(d.form in _INDEX_FORMS for d in stale):
                    raise _Failed(
                        "index IDs are remapped only when kubelet wrote the checkpoint before "
                        "this boot (an index may name another GPU since)"
                    )
                g = newest_knowing(maps, stale)
                if g is None:
                    raise _Failed(f"{stale[0].raw} is not in the GPU identity history")
                t = translator(g, False)
            new = _remap_entry(t, e, numa)
        except _Failed as why:
            drops.append(EntryDrop(pos, e, str(why), _evidence(t, e)))
            continue
        if new != e:
            if t.how is None:
                t.how = _how(t)
            remaps.append(EntryRemap(pos, e, new, t.how, _evidence(t, e)))
    remaps, drops = _no_double_allocation(cp, remaps, drops)
    reg, reg_remaps, reg_drops = _registered(cp, in_scope, matcher, maps, whole, unavailable)
    return RemapResult(
        tuple(remaps), tuple(sorted(drops, key=lambda d: d.pos)), reg,
        tuple(reg_remaps), tuple(reg_drops), unavailable, whole,
    )  # fmt: skip


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


def _how(t: Optional[_Translator]) -> str:
    if t is None:
        return ""
    pairs = (
        "; ".join(f"{m.old.uuid} -> {describe(m)}" for m in t.g.matches if m.how != "uuid")
        or "same GPUs, new numbering"
    )
    mode = "checkpoint written before this boot" if t.whole else "stale IDs"
    return f"generation recorded at {t.g.generation.recorded_at:.0f} ({mode}): {pairs}"


def _no_double_allocation(
    cp: Checkpoint, remaps: List[EntryRemap], drops: List[EntryDrop]
) -> tuple[List[EntryRemap], List[EntryDrop]]:
    """Drop each remapped entry whose new device another pod holds under another old ID
    (kubelet gave it away since): a remap never makes two pods share a device that did
    not already."""
    changed = {r.pos for r in remaps}
    gone = {d.pos for d in drops}
    # (resource, device now) -> {the ID it is held by: the pods holding it so}
    holders: dict[tuple[str, str], dict[str, set[str]]] = {}
    for pos, e in enumerate(cp.entries or ()):
        if pos not in changed and pos not in gone:
            for i in e.all_device_ids():
                holders.setdefault((e.resource_name, i), {}).setdefault(i, set()).add(e.pod_uid)
    kept: List[EntryRemap] = []
    for r in remaps:
        pairs = list(zip(r.old_ids(), r.new_ids()))
        clash = next(
            (
                (new, pod)
                for old, new in pairs
                for by, pods in holders.get((r.new.resource_name, new), {}).items()
                if by != old
                for pod in pods
                if pod != r.new.pod_uid
            ),
            None,
        )
        if clash is not None:
            why = f"its device's new ID {clash[0]} is already allocated to pod {clash[1]}"
            drops.append(EntryDrop(r.pos, r.old, why, r.evidence))
            continue
        kept.append(r)
        for old, new in pairs:
            holders.setdefault((r.new.resource_name, new), {}).setdefault(old, set()).add(
                r.new.pod_uid
            )
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
                g = maps[0] if whole else newest_knowing(maps, [d])
                if g is not None and (whole or d.form not in _INDEX_FORMS):
                    try:
                        new = _Translator(g, maps[1:], matcher, whole).id(d)
                    except _Failed:
                        new = None
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
