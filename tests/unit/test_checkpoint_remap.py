"""F1 remap on real kubelet checkpoints: each pod entry gets the GPU now in its GPU's slot.

The fixtures are real files (tests/fixtures/kubelet-checkpoint, kubelet 1.20 with
NVIDIA's plugin: NVIDIA_VISIBLE_DEVICES and /dev/nvidia* device specs). The history
says which GPUs they were written under; the inventory what the node has now.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Optional, Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import CHECKPOINTS
from gpuguard.checkpoint import Checkpoint, PodDevicesEntry, allocresp, marshal, parse, verify
from gpuguard.checkpoint.history import History, generation_of
from gpuguard.checkpoint.spew import checksum
from gpuguard.host.inventory import Gpu, Inventory, MigDevice
from gpuguard.steps.checkpoint.gpumap import build_map
from gpuguard.steps.checkpoint.reconcile import DEFAULT_RESOURCES, analyse, plan
from gpuguard.steps.checkpoint.remap import RemapInputs

G0 = "GPU-77a702db-e37f-3a74-d46d-c5713f66058c"
G1 = "GPU-c1e9f249-b37b-81c2-a8d9-ba5ca0294841"
G2 = "GPU-9b341c59-f96b-ba85-c137-78c3652fea65"
OLD = (G0, G1, G2)  # the three Tesla P100 of the numa-blog fixtures, as indices 0-2
NUMA = (0, 1, 1)
BUS = ("00000000:04:00.0", "00000000:82:00.0", "00000000:83:00.0")
# The fixtures' device specs: G0 is /dev/nvidia0, G1 /dev/nvidia2, G2 /dev/nvidia1 (the
# remap checks that an answer names only the GPUs its entry holds, by minor too)
MINORS = (0, 2, 1)


def new_uuid(u: str) -> str:
    return "GPU-0" + u[5:]


def inventory(uuids: Sequence[Optional[str]], minors: Sequence[int] = MINORS) -> Inventory:
    return Inventory(
        tuple(Gpu(u, i, minors[i], BUS[i]) for i, u in enumerate(uuids) if u is not None),
        "test",
    )


def inputs(
    old: Optional[Inventory] = None,
    *,
    mtime: float = 5000.0,
    btime: float = 1000.0,
    numa: Optional[dict[str, int]] = None,
    recorded: float = 500.0,
) -> RemapInputs:
    old = old or inventory(OLD)
    n = {f"0000:{b[9:]}": NUMA[i] for i, b in enumerate(BUS)} if numa is None else numa
    h = History((generation_of(old.gpus, n, when=recorded, boot_id="b", source="t"),))
    return RemapInputs(h, "", "/var/lib/gpuguard/gpu-identity.json", n, mtime, btime)


def load(name: str) -> tuple[bytes, Checkpoint]:
    raw = (CHECKPOINTS / name).read_bytes()
    return raw, parse(raw, source=name)


def repaired(raw: bytes, a):  # type: ignore[no-untyped-def]
    (action,) = plan(a, path=Path("/ckpt"), raw=raw, policy="rewrite")
    out = parse(action.content, source="repaired")
    assert verify(out), "kubelet would reject the checksum"
    assert marshal(out, checksum=out.checksum) == action.content  # kubelet's own bytes
    return action, out


def env(e: PodDevicesEntry) -> str:
    assert e.alloc_resp is not None
    return next(v for w, k, v in allocresp.strings(e.alloc_resp) if k == "NVIDIA_VISIBLE_DEVICES")


@pytest.mark.parametrize("name", ["numa-blog-04.json", "numa-blog-09.json", "numa-blog-10.json"])
def test_all_gpus_changed_every_entry_remapped_none_dropped(name: str) -> None:
    raw, cp = load(name)
    a = analyse(cp, inventory([new_uuid(u) for u in OLD]), DEFAULT_RESOURCES, inputs())
    assert a.drops == () and len(a.remaps) == len(cp.entries or ())
    action, out = repaired(raw, a)
    for before, after in zip(cp.entries or (), out.entries or ()):
        assert after.all_device_ids() == tuple(new_uuid(i) for i in before.all_device_ids())
        assert env(after) == ",".join(new_uuid(u) for u in env(before).split(","))
        assert after.numa_nodes == before.numa_nodes  # same slots, same NUMA nodes
        # the device specs name the same minors: nothing else in the answer changed
        assert [x for x in allocresp.strings(after.alloc_resp or b"") if x[0] != "env"] == [
            x for x in allocresp.strings(before.alloc_resp or b"") if x[0] != "env"
        ]
    assert dict(out.registered or ())["nvidia.com/gpu"] == tuple(
        new_uuid(u) for u in dict(cp.registered or ())["nvidia.com/gpu"]
    )
    assert "remap: pod" in "\n".join(action.details())


def test_one_gpu_changed_only_its_entry_is_remapped() -> None:
    raw, cp = load("numa-blog-05.json")  # pod A on G0, pod B on G2
    a = analyse(cp, inventory([G0, G1, new_uuid(G2)]), DEFAULT_RESOURCES, inputs())
    assert [r.old.all_device_ids() for r in a.remaps] == [(G2,)]
    _, out = repaired(raw, a)
    entries = out.entries or ()
    assert entries[0] == (cp.entries or ())[0]  # byte for byte as it was
    assert entries[1].all_device_ids() == (new_uuid(G2),) and env(entries[1]) == new_uuid(G2)


def test_one_gpu_gone_for_good_only_its_pods_are_dropped_and_say_why() -> None:
    raw, cp = load("numa-blog-04.json")  # pod A on G0; pod B on G1+G2
    now = inventory([new_uuid(G0), None, new_uuid(G2)])  # GPU 1 gone, the others new UUIDs
    a = analyse(cp, now, DEFAULT_RESOURCES, inputs())
    assert [r.old.all_device_ids() for r in a.remaps] == [(G0,)]
    (d,) = a.drops
    assert d.entry.all_device_ids() == (G1, G2) and G1 in d.why and "gone" in d.why
    stale = [f for f in a.findings if f.kind == "checkpoint-stale-entry"]
    assert len(stale) == 1 and stale[0].fields["DROP_REASON"] == d.why
    _, out = repaired(raw, a)
    assert [e.all_device_ids() for e in out.entries or ()] == [(new_uuid(G0),)]
    assert dict(out.registered or ())["nvidia.com/gpu"] == (new_uuid(G0), new_uuid(G2))


def test_without_history_stale_entries_are_dropped_as_before_and_it_says_why() -> None:
    _raw, cp = load("numa-blog-04.json")
    now = inventory([new_uuid(u) for u in OLD])
    plain = analyse(cp, now, DEFAULT_RESOURCES)
    no_history = replace(inputs(), history=None)
    a = analyse(cp, now, DEFAULT_RESOURCES, no_history)
    assert a.repaired == plain.repaired and a.remaps == () and len(a.drops) == 2
    (why,) = [f for f in a.findings if f.kind == "checkpoint-remap-unavailable"]
    assert "no GPU identity history yet" in why.summary
    bad = replace(no_history, problem="/h: unusable (version is 2, not 1)")
    a = analyse(cp, now, DEFAULT_RESOURCES, bad)
    assert a.remaps == () and all("version is 2" in d.why for d in a.drops)


def test_the_new_gpu_numa_node_moves_the_entry() -> None:
    raw, cp = load("numa-blog-02.json")  # one pod, G0 on NUMA 0
    n = {"0000:04:00.0": 1, "0000:82:00.0": 1, "0000:83:00.0": 1}  # the board now on node 1
    a = analyse(cp, inventory([new_uuid(u) for u in OLD]), DEFAULT_RESOURCES, inputs(numa=n))
    _, out = repaired(raw, a)
    assert (out.entries or ())[0].device_ids == ((1, (new_uuid(G0),)),)
    # unknown NUMA (no sysfs): the key stays
    a = analyse(cp, inventory([new_uuid(u) for u in OLD]), DEFAULT_RESOURCES, inputs(numa={}))
    assert a.remaps[0].new.device_ids == ((0, (new_uuid(G0),)),)


def _index_checkpoint() -> tuple[bytes, Checkpoint]:
    """An index-strategy node: pod A on GPU 0, pod B on GPU 1, with device specs."""
    entries = tuple(
        PodDevicesEntry(
            f"pod-{i}", "app", "nvidia.com/gpu", ((NUMA[i], (str(i),)),),
            allocresp.encode(
                envs=(("NVIDIA_VISIBLE_DEVICES", str(i)),),
                devices=(("/dev/nvidiactl",) * 2 + ("rw",), (f"/dev/nvidia{i}",) * 2 + ("rw",)),
            ),
        )
        for i in (0, 1)
    )  # fmt: skip
    cp = Checkpoint("v2", entries, (("nvidia.com/gpu", ("0", "1", "2")),), 0)
    cp = replace(cp, checksum=checksum(cp))
    return marshal(cp), cp


def _renumbered() -> Inventory:
    # The same boards in the same slots, enumerated in another order after the reboot:
    # GPU 0 of the old numbering is index 1 (minor 1) now, and the other way round.
    return Inventory((Gpu(G1, 0, 0, BUS[1]), Gpu(G0, 1, 1, BUS[0]), Gpu(G2, 2, 2, BUS[2])), "test")


def test_written_before_this_boot_index_ids_and_minors_follow_their_gpu() -> None:
    raw, cp = _index_checkpoint()
    a = analyse(cp, _renumbered(), DEFAULT_RESOURCES, inputs())  # mtime 5000 < btime? no
    assert a.remaps == ()  # written in this boot: "0" may already be the new GPU 0
    numbered = inventory(OLD, (0, 1, 2))  # index i was /dev/nvidia<i>
    a = analyse(cp, _renumbered(), DEFAULT_RESOURCES, inputs(numbered, mtime=900.0, btime=1000.0))
    _, out = repaired(raw, a)
    e0, e1 = out.entries or ()
    assert (e0.all_device_ids(), e1.all_device_ids()) == (("1",), ("0",))
    assert env(e0) == "1" and env(e1) == "0"  # swapped at once, never chained
    hosts = [v for w, _k, v in allocresp.strings(e0.alloc_resp or b"") if w == "device.host_path"]
    assert hosts == ["/dev/nvidiactl", "/dev/nvidia1"]
    # a history recorded in this boot does not speak for a file written before it
    late = inputs(mtime=900.0, btime=1000.0, recorded=1500.0)
    assert analyse(cp, _renumbered(), DEFAULT_RESOURCES, late).remaps == ()


def test_a_stale_index_written_in_this_boot_is_dropped_not_guessed() -> None:
    _raw, cp = _index_checkpoint()
    now = Inventory((Gpu(G1, 0, 0, BUS[1]),), "test")  # only one GPU left: index 1 is stale
    a = analyse(cp, now, DEFAULT_RESOURCES, inputs())
    (d,) = a.drops
    assert d.entry.pod_uid == "pod-1" and "index IDs are remapped only" in d.why


def test_a_new_id_already_allocated_to_another_pod_is_not_given_twice() -> None:
    _raw, cp = load("numa-blog-05.json")  # pod A on G0, pod B on G2
    entries = cp.entries or ()
    # kubelet already gave pod A's old GPU, under its new UUID, to a new pod C
    c = replace(entries[0], pod_uid="pod-c", device_ids=((0, (new_uuid(G0),)),))
    cp = replace(cp, entries=(*entries, c))
    a = analyse(cp, inventory([new_uuid(G0), G1, G2]), DEFAULT_RESOURCES, inputs())
    (d,) = a.drops
    assert d.entry.pod_uid == entries[0].pod_uid and "already allocated to pod pod-c" in d.why
    assert a.remaps == ()


def test_a_device_two_entries_held_before_is_remapped_for_both() -> None:
    # an init container and an app container of one pod, and (in a hand-made file) two
    # pods holding one GPU: the remap keeps what was there and adds no sharing
    _raw, cp = load("numa-blog-02.json")
    (e,) = cp.entries or ()
    cp = replace(cp, entries=(e, replace(e, container_name="init"), replace(e, pod_uid="p2")))
    a = analyse(cp, inventory([new_uuid(u) for u in OLD]), DEFAULT_RESOURCES, inputs())
    assert len(a.remaps) == 3 and a.drops == ()


def test_v1_checkpoint_stays_v1() -> None:
    entry = PodDevicesEntry("p", "c", "nvidia.com/gpu", (G0,), allocresp.encode(
        envs=(("NVIDIA_VISIBLE_DEVICES", G0),)))  # fmt: skip
    cp = Checkpoint("v1", (entry,), (("nvidia.com/gpu", (G0,)),), 0)
    raw = marshal(replace(cp, checksum=checksum(cp)))
    cp = parse(raw, source="v1")
    a = analyse(cp, inventory([new_uuid(u) for u in OLD]), DEFAULT_RESOURCES, inputs())
    _, out = repaired(raw, a)
    assert out.format == "v1" and (out.entries or ())[0].device_ids == (new_uuid(G0),)


def test_mig_devices_follow_their_parent_and_caps_paths_refuse_a_new_minor() -> None:
    mig_old = (MigDevice("MIG-11111111-aaaa", 1, 0), MigDevice("MIG-22222222-aaaa", 2, 0))
    mig_new = (MigDevice("MIG-33333333-bbbb", 1, 0), MigDevice("MIG-44444444-bbbb", 2, 0))
    old = Inventory((Gpu(G0, 0, 0, BUS[0], mig_old),), "t")
    entries = (
        PodDevicesEntry("p1", "c", "nvidia.com/mig-1g.5gb", ((0, ("MIG-22222222-aaaa",)),),
                        allocresp.encode(envs=(("NVIDIA_VISIBLE_DEVICES", "MIG-22222222-aaaa"),))),
        PodDevicesEntry("p2", "c", "nvidia.com/mig-1g.5gb", ((0, ("MIG-11111111-aaaa",)),),
                        allocresp.encode(devices=(("/dev/nvidia-caps/nvidia-cap21",) * 2
                                                  + ("r",),))),
    )  # fmt: skip
    cp = Checkpoint("v2", entries, None, 0)
    raw = marshal(replace(cp, checksum=checksum(cp)))
    same_minor = Inventory((Gpu(new_uuid(G0), 0, 0, BUS[0], mig_new),), "t")
    a = analyse(parse(raw, source="m"), same_minor, DEFAULT_RESOURCES, inputs(old))
    assert [r.new.all_device_ids() for r in a.remaps] == [
        ("MIG-44444444-bbbb",),
        ("MIG-33333333-bbbb",),
    ]
    assert env(a.remaps[0].new) == "MIG-44444444-bbbb"
    new_minor = Inventory((Gpu(new_uuid(G0), 0, 5, BUS[0], mig_new),), "t")
    a = analyse(parse(raw, source="m"), new_minor, DEFAULT_RESOURCES, inputs(old))
    assert [d.entry.pod_uid for d in a.drops] == ["p2"] and "nvidia-cap21" in a.drops[0].why


def test_an_unreadable_allocation_response_is_dropped_not_half_rewritten() -> None:
    _raw, cp = load("numa-blog-02.json")
    (e,) = cp.entries or ()
    cp = replace(cp, entries=(replace(e, alloc_resp=b"\x0a\x05ab"),))
    a = analyse(cp, inventory([new_uuid(u) for u in OLD]), DEFAULT_RESOURCES, inputs())
    (d,) = a.drops
    assert "allocation response" in d.why


# -- properties --------------------------------------------------------------------


@st.composite
def scenes(draw: st.DrawFn) -> tuple[Checkpoint, Inventory, RemapInputs]:
    n = draw(st.integers(1, 6))
    old_uuids = [f"GPU-{i:08x}-0000-0000-0000-000000000000" for i in range(n)]
    old = Inventory(
        tuple(Gpu(u, i, i, f"0000:{0x10 + i:02x}:00.0") for i, u in enumerate(old_uuids)), "t"
    )
    # now: each old GPU kept, given a new UUID, or gone; a new GPU may appear
    now_gpus = []
    for i, u in enumerate(old_uuids):
        fate = draw(st.sampled_from(["same", "new-uuid", "gone"]))
        if fate != "gone":
            uuid = u if fate == "same" else f"GPU-{i:08x}-1111-0000-0000-000000000000"
            now_gpus.append(Gpu(uuid, len(now_gpus), len(now_gpus), f"0000:{0x10 + i:02x}:00.0"))
    if draw(st.booleans()):
        now_gpus.append(Gpu("GPU-ffffffff-2222-0000-0000-000000000000", len(now_gpus),
                            len(now_gpus), "0000:f0:00.0"))  # fmt: skip
    # pods hold disjoint sets of the old GPUs (as kubelet allocates them)
    order = draw(st.permutations(range(n)))
    entries, k = [], 0
    while k < n and draw(st.booleans()):
        size = draw(st.integers(1, n - k))
        ids = tuple(old_uuids[j] for j in order[k : k + size])
        k += size
        resp = allocresp.encode(
            envs=(("NVIDIA_VISIBLE_DEVICES", ",".join(ids)),),
            devices=tuple((f"/dev/nvidia{old_uuids.index(i)}",) * 2 + ("rw",) for i in ids),
        )
        entries.append(PodDevicesEntry(f"pod-{k}", "c", "nvidia.com/gpu", ((-1, ids),), resp))
    cp = Checkpoint("v2", tuple(entries), (("nvidia.com/gpu", tuple(old_uuids)),), 0)
    cp = parse(marshal(replace(cp, checksum=checksum(cp))), source="gen")
    return cp, Inventory(tuple(now_gpus), "t"), inputs(old, numa={})


@settings(max_examples=200, deadline=None)
@given(scenes())
def test_remap_properties(scene) -> None:  # type: ignore[no-untyped-def]
    cp, now, inp = scene
    a = analyse(cp, now, DEFAULT_RESOURCES, inp)
    # the same inputs always give the same plan (the dry-run prints what the run does)
    assert analyse(cp, now, DEFAULT_RESOURCES, inp) == a
    if a.repaired is None:  # nothing to do, or no GPU at all: nothing is touched
        assert (a.remaps == () and a.drops == ()) or (a.refused and not now.gpus)
        return
    raw = marshal(cp)
    _, out = repaired(raw, a)
    # nothing allocated twice
    held = [i for e in out.entries or () for i in e.all_device_ids()]
    assert len(held) == len(set(held))
    current = {g.uuid for g in now.gpus}
    assert set(held) <= current  # every device of the new file exists
    assert inp.history is not None
    pairs = {m.old.uuid: m.new.uuid for m in build_map(inp.history.generations[0], now).matches}
    for r in a.remaps:  # each remapped GPU is the one the map pairs (same slot, mostly)
        assert r.new_ids() == tuple(pairs[i] for i in r.old_ids())
        assert env(r.new) == ",".join(r.new_ids())
    for d in a.drops:  # only what cannot be mapped is dropped
        assert any(i not in current for i in d.entry.all_device_ids())
        assert "gone" in d.why
