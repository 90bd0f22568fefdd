"""The remap over generated GPU histories (several generations) and checkpoints.

The generator knows the truth the remap must find: GPUs sit in PCI slots; each
generation, and the node now, gives each occupied slot a UUID (kept, or new), an index
and a minor. Pods hold slots, written under one generation (UUID IDs of any
generation; index IDs only under the generation the whole file was written in), with
the answer NVIDIA's plugin gives (NVIDIA_VISIBLE_DEVICES, /dev/nvidiaN device specs,
CDI names). Pods of different generations may claim one slot (kubelet gave it away
after the change), and one resource holds UUID and index IDs. Whatever is drawn:

- a remap never puts a pod on a physical GPU another pod holds that it did not share
  before;
- every remapped ID, UUID in the answer, host device path and index names the GPU now
  in the slot its entry held: no part of an entry names a GPU it was not remapped to;
- the plan is the same every time, the dry-run writes nothing and the real run writes
  exactly the planned bytes (what the dry-run printed).
"""

from __future__ import annotations

import io
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional

from hypothesis import event, given
from hypothesis import strategies as st

from fuzz.budget import budget
from gpuguard.checkpoint import Checkpoint, PodDevicesEntry, allocresp, marshal, parse, verify
from gpuguard.checkpoint.history import Generation, GpuIdentity, History
from gpuguard.checkpoint.spew import checksum
from gpuguard.engine.executor import ChangeExecutor
from gpuguard.host.inventory import Gpu, Inventory
from gpuguard.journal.log import EventLog
from gpuguard.steps.checkpoint.actuate import CheckpointActuator
from gpuguard.steps.checkpoint.reconcile import DEFAULT_RESOURCES, analyse, plan
from gpuguard.steps.checkpoint.remap import RemapInputs
from gpuguard.steps.checkpoint.remapguard import Devices
from gpuguard.steps.checkpoint.translate import GPU_NODE, UUIDISH

BTIME = 1000.0
RESOURCE = "nvidia.com/gpu"


def bus(slot: int) -> str:
    return f"0000:{0x10 + slot:02x}:00.0"


@dataclass(frozen=True)
class Layout:
    """One generation (or now): slot -> (uuid, index, minor)."""

    slots: dict[int, tuple[str, int, int]]

    def gpus(self) -> tuple[Gpu, ...]:
        return tuple(Gpu(u, i, m, bus(s)) for s, (u, i, m) in sorted(self.slots.items()))


@st.composite
def layout(draw: st.DrawFn, n: int, tag: int, before: Optional[Layout]) -> Layout:
    present = [s for s in range(n) if draw(st.integers(0, 5)) > 0] or [0]
    order = draw(st.permutations(present))
    minors = draw(st.permutations(range(len(present))))
    out = {}
    for k, s in enumerate(order):
        old = before.slots.get(s) if before is not None else None
        keep = old is not None and draw(st.booleans())
        uuid = old[0] if keep and old else f"GPU-{tag:02x}{s:02x}0000-aaaa-bbbb-cccc-dddddddddddd"
        out[s] = (uuid, k, minors[k])
    return Layout(out)


@dataclass(frozen=True)
class Scene:
    gens: tuple[Layout, ...]  # oldest first
    now: Layout
    whole: bool
    cp: Checkpoint
    written: dict[str, int]  # pod -> the generation its entry was written under (-1: now)


def _entry(
    pod: str, lay: Layout, slots: list[int], index: bool, plugin_name: bool
) -> PodDevicesEntry:
    ids = [str(lay.slots[s][1]) if index else lay.slots[s][0] for s in slots]
    devices = tuple(
        ("/dev/nvidia0" if plugin_name else f"/dev/nvidia{lay.slots[s][2]}",
         f"/dev/nvidia{lay.slots[s][2]}", "rw")
        for s in slots
    )  # fmt: skip
    resp = allocresp.encode(
        envs=(("NVIDIA_VISIBLE_DEVICES", ",".join(ids)),),
        devices=(("/dev/nvidiactl", "/dev/nvidiactl", "rw"), *devices),
        cdi_devices=tuple(f"nvidia.com/gpu={i}" for i in ids),
    )
    return PodDevicesEntry(pod, "c", RESOURCE, ((-1, tuple(ids)),), resp)


@st.composite
def scenes(draw: st.DrawFn) -> Scene:
    n = draw(st.integers(1, 4))
    gens: list[Layout] = []
    for g in range(draw(st.integers(1, 3))):
        gens.append(draw(layout(n, g + 1, gens[-1] if gens else None)))
    now = draw(layout(n, 0x40, gens[-1]))
    whole = draw(st.booleans())
    entries, written = [], {}
    held: dict[int, set[int]] = {}  # writer generation -> slots its pods hold
    for p in range(draw(st.integers(0, 5))):
        choices = list(range(len(gens))) + ([] if whole else [-1])
        k = draw(st.sampled_from(choices))
        lay = now if k == -1 else gens[k]
        free = [s for s in lay.slots if s not in held.get(k, set())]
        if not free:
            continue
        slots = draw(st.lists(st.sampled_from(free), min_size=1, max_size=2, unique=True))
        held.setdefault(k, set()).update(slots)
        # index IDs only where their numbering is the file's own
        index = draw(st.booleans()) and (k == -1 or (whole and k == len(gens) - 1))
        pod = f"pod-{p}"
        entries.append(_entry(pod, lay, slots, index, draw(st.booleans())))
        written[pod] = k
    cp = Checkpoint("v2", tuple(entries), ((RESOURCE, ()),), 0)
    cp = parse(marshal(replace(cp, checksum=checksum(cp))), source="gen")
    return Scene(tuple(gens), now, whole, cp, written)


def _inputs(s: Scene) -> RemapInputs:
    gens = tuple(
        Generation(tuple(GpuIdentity(u, bus(sl), i, m, -1) for sl, (u, i, m) in g.slots.items()),
                   100.0 + k, "b", "t")
        for k, g in enumerate(s.gens)
    )  # fmt: skip
    mtime = 900.0 if s.whole else 5000.0
    return RemapInputs(History(gens), "", "/h", {}, mtime, BTIME)


def _slot_of_uuid(s: Scene) -> dict[str, int]:
    out = {}
    for lay in (*s.gens, s.now):
        out.update({u: sl for sl, (u, _i, _m) in lay.slots.items()})
    return out


def _old_slot(s: Scene, pod: str, raw: str) -> int:
    k = s.written[pod]
    lay = s.now if k == -1 else s.gens[k]
    if raw.startswith("GPU-"):
        return _slot_of_uuid(s)[raw]
    return next(sl for sl, (_u, i, _m) in lay.slots.items() if str(i) == raw)


def _old_board(s: Scene, pod: str, raw: str) -> str:
    """The UUID of the board an ID named when its entry was written."""
    k = s.written[pod]
    lay = s.now if k == -1 else s.gens[k]
    return raw if raw.startswith("GPU-") else lay.slots[_old_slot(s, pod, raw)][0]


def _expected_slots(s: Scene, pod: str, raw: str) -> set[int]:
    """The slots now the GPU an ID names may be paired to: its own slot, unless the
    node came back with another PCI layout altogether and the same indices (then the
    same index, as docs/checkpoint.md's third rule pairs them), judged from any
    generation that knows the board (a kept UUID is known to several)."""
    k = s.written[pod]
    own = [s.now if k == -1 else s.gens[k]]
    if raw.startswith("GPU-"):
        own += [g for g in s.gens if any(u == raw for u, _i, _m in g.slots.values())]
    out = set()
    slot = _old_slot(s, pod, raw)
    for lay in own:
        old_idx = {i for _u, i, _m in lay.slots.values()}
        new_idx = {i for _u, i, _m in s.now.slots.values()}
        if set(lay.slots) & set(s.now.slots) or old_idx != new_idx:
            out.add(slot)
            continue
        index = lay.slots[slot][1]
        out |= {sl for sl, (_u, i, _m) in s.now.slots.items() if i == index}
    return out


def _now_slot(s: Scene, raw: str) -> Optional[int]:
    for sl, (u, i, _m) in s.now.slots.items():
        if raw in (u, str(i)):
            return sl
    return None


@given(scenes())
@budget(100)
def test_remap_over_generations(s: Scene) -> None:
    inv = Inventory(s.now.gpus(), "t")
    inp = _inputs(s)
    a = analyse(s.cp, inv, DEFAULT_RESOURCES, inp)
    event(f"whole={s.whole} remaps={min(len(a.remaps), 2)} drops={min(len(a.drops), 2)}")
    assert analyse(s.cp, inv, DEFAULT_RESOURCES, inp) == a  # dry-run and run plan alike
    devices = Devices.of(inv)
    minors = {f"/dev/nvidia{m}": sl for sl, (_u, _i, m) in s.now.slots.items()}
    indices = {str(i): sl for sl, (_u, i, _m) in s.now.slots.items()}
    out = parse(marshal(a.repaired), source="r").entries or () if a.repaired else s.cp.entries or ()
    before: dict[str, list[PodDevicesEntry]] = {}
    for e in s.cp.entries or ():
        before.setdefault(e.pod_uid, []).append(e)
    for r in a.remaps:
        slots = set()
        for old, new in r.pairs:
            if old != new:  # each translated ID names the GPU now in its slot
                assert _now_slot(s, new) in _expected_slots(s, r.old.pod_uid, old), (old, new)
            slot = _now_slot(s, new)
            assert slot is not None
            slots.add(slot)
            if old == new:
                continue
            # no other pod holds it now, unless both held that very board before
            board = _old_board(s, r.old.pod_uid, old)
            for e in out:
                if e.pod_uid != r.new.pod_uid and not any(
                    board == _old_board(s, e.pod_uid, i)
                    for x in before.get(e.pod_uid, ())
                    for i in x.all_device_ids()
                ):
                    assert devices.unit(new) not in {devices.unit(i) for i in e.all_device_ids()}
        for where, key, value in allocresp.strings(r.new.alloc_resp or b""):
            for token in UUIDISH.findall(value):
                assert _now_slot(s, token) in slots, (token, value)
            if GPU_NODE.match(value) and (where == allocresp.DEVICE_HOST or value == key):
                assert minors.get(value) in slots, value
            if where == allocresp.ENV or where == allocresp.CDI_NAME:
                for item in value.split(","):
                    name = item.rpartition("=")[2]
                    if name.isdigit():
                        assert indices.get(name) in slots, value
    if a.repaired is None:
        return
    assert verify(parse(marshal(a.repaired), source="r"))
    (action,) = plan(a, path=Path("/ckpt"), raw=marshal(s.cp), policy="rewrite")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kubelet_internal_checkpoint"
        path.write_bytes(marshal(s.cp))
        (action,) = plan(a, path=path, raw=marshal(s.cp), policy="rewrite")
        log = EventLog(stream=io.StringIO())
        for dry in (True, False):
            actuator = CheckpointActuator(Path(tmp) / "backups", 3, log)
            outcome = ChangeExecutor(dry_run=dry).run(actuator.change(action))
            assert outcome.status == ("dry-run" if dry else "done"), outcome.detail
            assert path.read_bytes() == (marshal(s.cp) if dry else action.content)
