"""The remap under hostile and unusual checkpoints: one generation per entry, container
paths left to the plugin, physical GPUs compared, old and new IDs paired as translated,
and no present GPU taken away without a history.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional, Sequence

from gpuguard.checkpoint import Checkpoint, PodDevicesEntry, allocresp, marshal, parse
from gpuguard.checkpoint.history import Generation, GpuIdentity, History
from gpuguard.checkpoint.spew import checksum
from gpuguard.host import protowire
from gpuguard.host.inventory import Gpu, Inventory
from gpuguard.steps.checkpoint.reconcile import DEFAULT_RESOURCES, analyse
from gpuguard.steps.checkpoint.remap import RemapInputs

BUS = ("0000:04:00.0", "0000:82:00.0", "0000:83:00.0")


def uuid(gen: str, i: int) -> str:
    return f"GPU-{gen * 8}-0000-0000-0000-00000000000{i}"


def generation(tag: str, minors: Sequence[int], when: float) -> Generation:
    gpus = tuple(GpuIdentity(uuid(tag, i), BUS[i], i, minor, -1) for i, minor in enumerate(minors))
    return Generation(gpus, when, "b", "t")


def now(tag: str, minors: Sequence[int] = (0, 1, 2)) -> Inventory:
    return Inventory(tuple(Gpu(uuid(tag, i), i, m, BUS[i]) for i, m in enumerate(minors)), "t")


def inputs(
    *gens: Generation,
    mtime: float = 5000.0,
    btime: float = 1000.0,
    numa: Optional[dict[str, int]] = None,
) -> RemapInputs:
    return RemapInputs(History(gens), "", "/h", numa or {}, mtime, btime)


def entry(
    pod: str, ids: Sequence[str], minors: Sequence[int], node: int = -1, **kw: str
) -> PodDevicesEntry:
    resp = allocresp.encode(
        envs=(("NVIDIA_VISIBLE_DEVICES", ",".join(ids)),),
        devices=tuple(
            (kw.get("container", f"/dev/nvidia{m}"), f"/dev/nvidia{m}", "rw") for m in minors
        ),
    )
    return PodDevicesEntry(pod, "c", "nvidia.com/gpu", ((node, tuple(ids)),), resp)


def checkpoint(*entries: PodDevicesEntry) -> Checkpoint:
    cp = Checkpoint("v2", entries, (("nvidia.com/gpu", ()),), 0)
    cp = replace(cp, checksum=checksum(cp))
    return parse(marshal(cp), source="t")


def texts(e: PodDevicesEntry, where: str) -> list[str]:
    return [v for w, _k, v in allocresp.strings(e.alloc_resp or b"") if w == where]


def physical(inv: Inventory, e: PodDevicesEntry) -> set[str]:
    """The current GPUs an entry's IDs, env and device host paths name."""
    by_index = {str(g.index): g.uuid for g in inv.gpus}
    by_minor = {f"/dev/nvidia{g.minor}": g.uuid for g in inv.gpus}
    out = {by_index.get(i, i) for i in e.all_device_ids()}
    for v in texts(e, "env"):
        out |= {by_index.get(i, i) for i in v.split(",")}
    out |= {by_minor.get(p, p) for p in texts(e, "device.host_path")}
    return out


def test_an_entry_of_an_older_generation_is_translated_through_that_generation_only() -> None:
    # Generation A (oldest): A0 minor 1, A1 minor 0. Generation B (newest): B0 minor 0,
    # B1 minor 1, same slots. Now C, same slots. Kubelet wrote the file before this boot
    # (whole mode); pod-y's entry survived from generation A with its own answer.
    a, b = generation("a", (1, 0, 2), 100.0), generation("b", (0, 1, 2), 500.0)
    inv = now("c")
    x = entry("pod-x", [uuid("b", 1)], [1])
    y = entry("pod-y", [uuid("a", 0)], [1])  # A0 was /dev/nvidia1 in its generation
    cp = checkpoint(x, y)
    got = analyse(cp, inv, DEFAULT_RESOURCES, inputs(a, b, mtime=900.0))
    out = {r.new.pod_uid: r.new for r in got.remaps}
    assert physical(inv, out["pod-x"]) == {uuid("c", 1)}
    # remapped through generation A as a whole: every part names C0, A0's slot now
    assert physical(inv, out["pod-y"]) == {uuid("c", 0)} and got.drops == ()
    assert texts(out["pod-y"], "device.host_path") == ["/dev/nvidia0"]


def test_a_device_spec_container_path_is_the_plugins_name_not_a_host_minor() -> None:
    # The plugin names the device /dev/nvidia0 inside the container whatever its host
    # minor; minor 0 of the recorded generation is a GPU gone since: no reason to drop.
    old = generation("a", (0, 1, 2), 500.0)
    inv = Inventory((Gpu(uuid("c", 1), 1, 1, BUS[1]), Gpu(uuid("c", 2), 2, 2, BUS[2])), "t")
    e = entry("pod-x", [uuid("a", 1)], [1], container="/dev/nvidia0")
    got = analyse(checkpoint(e), inv, DEFAULT_RESOURCES, inputs(old))
    assert got.drops == ()
    (r,) = got.remaps
    assert texts(r.new, "device.container_path") == ["/dev/nvidia0"]
    assert texts(r.new, "device.host_path") == ["/dev/nvidia1"]


def test_a_container_path_equal_to_its_host_path_follows_the_new_minor() -> None:
    old = generation("a", (0, 1, 2), 500.0)
    inv = now("c", (1, 0, 2))  # same slots, minors swapped
    e = entry("pod-x", [uuid("a", 0)], [0])
    (r,) = analyse(checkpoint(e), inv, DEFAULT_RESOURCES, inputs(old)).remaps
    assert (
        texts(r.new, "device.container_path")
        == texts(r.new, "device.host_path")
        == ["/dev/nvidia1"]
    )


def test_the_double_allocation_guard_compares_physical_gpus_not_strings() -> None:
    # One resource holds index and UUID IDs: pod-c was given index 0 (GPU C0 now) after
    # the change; pod-a's stale A0 would be remapped to C0: the same GPU, twice.
    old = generation("a", (0, 1, 2), 500.0)
    inv = now("c")
    a = entry("pod-a", [uuid("a", 0)], [0])
    c = entry("pod-c", ["0"], [0])
    got = analyse(checkpoint(a, c), inv, DEFAULT_RESOURCES, inputs(old))
    assert got.remaps == ()
    (d,) = got.drops
    assert d.entry.pod_uid == "pod-a" and "pod-c" in d.why


def test_numa_regrouping_keeps_each_old_id_paired_with_its_own_new_id() -> None:
    # A0 and A1 under NUMA 0; now C1 sits on node 0 and C0 on node 1: the new groups
    # list C1 before C0, and the pairs must still read A0 -> C0, A1 -> C1.
    old = generation("a", (0, 1, 2), 500.0)
    inv = now("c")
    e = entry("pod-x", [uuid("a", 0), uuid("a", 1)], [0, 1], node=0)
    numa = {BUS[0]: 1, BUS[1]: 0, BUS[2]: 0}
    (r,) = analyse(checkpoint(e), inv, DEFAULT_RESOURCES, inputs(old, numa=numa)).remaps
    assert dict(r.new.numa_pairs()) == {0: (uuid("c", 1),), 1: (uuid("c", 0),)}
    assert dict(zip(r.old_ids(), r.new_ids())) == {
        uuid("a", 0): uuid("c", 0),
        uuid("a", 1): uuid("c", 1),
    }
    # pod-q held A1 too (shared before): both remapped, no clash; paired by position,
    # A0 -> C1 would have read as a clash with pod-q's A1 -> C1
    q = entry("pod-q", [uuid("a", 1)], [1])
    got = analyse(checkpoint(q, e), inv, DEFAULT_RESOURCES, inputs(old, numa=numa))
    assert got.drops == () and len(got.remaps) == 2
    # and another pod holding C1 under its own ID now is a clash
    other = entry("pod-o", [uuid("c", 1)], [1])
    got = analyse(checkpoint(e, other), inv, DEFAULT_RESOURCES, inputs(old, numa=numa))
    assert got.remaps == () and "pod-o" in got.drops[0].why


def test_without_history_a_present_gpu_is_never_dropped_with_a_changed_one() -> None:
    # No history yet: pod-x holds C0 (still here) and A1 (changed). The entry stays as it
    # is (kubelet then refuses it or replays it as before), reported; nothing of C0 is
    # taken away and nothing is handed out twice.
    inv = now("c")
    e = entry("pod-x", [uuid("c", 0), uuid("a", 1)], [0, 1])
    cp = checkpoint(e, entry("pod-y", [uuid("a", 2)], [2]))
    got = analyse(cp, inv, DEFAULT_RESOURCES, replace(inputs(), history=None))
    assert [d.entry.pod_uid for d in got.drops] == ["pod-y"]
    assert got.remaps == ()
    kept = [f for f in got.findings if f.fields.get("POD_UID") == "pod-x"]
    assert kept and "still" in kept[0].summary


def test_an_answer_kubelet_reads_otherwise_is_reported_and_never_rewritten() -> None:
    # field 2^32+1: kubelet's decoder reads it as field 1, an env NVIDIA_VISIBLE_DEVICES
    hidden = (
        bytes.fromhex("8a8080808001")
        + bytes([36])
        + protowire.field(1, b"NVIDIA_VISIBLE_DEVICES")
        + protowire.field(2, b"GPU-dead-0000-0000")
    )
    old = generation("a", (0, 1, 2), 500.0)
    inv = now("c")
    healthy = entry("pod-h", [uuid("c", 0)], [0])
    healthy = replace(healthy, alloc_resp=(healthy.alloc_resp or b"") + hidden)
    stale = entry("pod-s", [uuid("a", 1)], [1])
    stale = replace(stale, alloc_resp=(stale.alloc_resp or b"") + hidden)
    got = analyse(checkpoint(healthy, stale), inv, DEFAULT_RESOURCES, inputs(old))
    assert got.remaps == ()
    (d,) = got.drops
    assert d.entry.pod_uid == "pod-s" and "reads as field 1" in d.why
    (f,) = [f for f in got.findings if f.kind == "checkpoint-allocresp-ambiguous"]
    assert f.fields["POD_UID"] == "pod-h"


def test_a_board_known_to_two_generations_is_read_with_the_minors_its_answer_names() -> None:
    # A1 kept its UUID from generation A (minor 1) into B (minor 0); pod-x was allocated
    # under A (/dev/nvidia1). Generation B, the newest knowing A1, would read its
    # /dev/nvidia1 as another board; A reads it as A1's: remapped, not dropped.
    a1 = uuid("a", 1)
    a = Generation((GpuIdentity(uuid("a", 0), BUS[0], 0, 0), GpuIdentity(a1, BUS[1], 1, 1)),
                   100.0, "b", "t")  # fmt: skip
    b = Generation((GpuIdentity(uuid("b", 0), BUS[0], 1, 1), GpuIdentity(a1, BUS[1], 0, 0)),
                   500.0, "b", "t")  # fmt: skip
    inv = now("c")
    (r,) = analyse(checkpoint(entry("pod-x", [uuid("a", 1)], [1])), inv, DEFAULT_RESOURCES,
                   inputs(a, b)).remaps  # fmt: skip
    assert physical(inv, r.new) == {uuid("c", 1)}
