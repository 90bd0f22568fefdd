"""analyse()/plan() as tables: which IDs are stale, what the repaired file is, byte for byte."""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path
from typing import Any, Optional, Sequence

import pytest

from conftest import CHECKPOINTS
from gpuguard.checkpoint import Checkpoint, PodDevicesEntry, marshal, parse, render, spew, verify
from gpuguard.checkpoint.spew import fnv1a_32
from gpuguard.host.inventory import Gpu, Inventory, MigDevice
from gpuguard.steps.checkpoint.reconcile import (
    DEFAULT_RESOURCES,
    DeleteCheckpoint,
    RewriteCheckpoint,
    analyse,
    plan,
    sha256,
)

REAL = CHECKPOINTS
A = "GPU-77a702db-e37f-3a74-d46d-c5713f66058c"
B = "GPU-9b341c59-f96b-ba85-c137-78c3652fea65"
C = "GPU-c1e9f249-b37b-81c2-a8d9-ba5ca0294841"
NEW = "GPU-5d3e2a10-7c4b-4f0e-9a61-2b8e4c1d7f93"
MA = "MIG-1f3a9c2e-5b7d-5e21-9a3b-2c4d6e8f0a1b"
MB = "MIG-2e4b8d1f-6c8e-5f32-8b4c-3d5e7f9a1b2c"
PATH = Path("/var/lib/kubelet/device-plugins/kubelet_internal_checkpoint")


def inv(*gpus: str, migs: Optional[dict[str, Sequence[tuple[str, int, int]]]] = None) -> Inventory:
    migs = migs or {}
    return Inventory(
        tuple(
            Gpu(
                u,
                i,
                i,
                f"00000000:{i + 16:02X}:00.0",
                tuple(MigDevice(*m) for m in migs.get(u, ())),
            )
            for i, u in enumerate(gpus)
        ),
        source="test-inventory",
    )


def entry(uid: str, ids: Sequence[str], resource: str = "nvidia.com/gpu") -> PodDevicesEntry:
    return PodDevicesEntry(uid, "main", resource, ((0, tuple(ids)),), b"\n\x03abc")


def cp_of(*entries: PodDevicesEntry, registered: Any = ()) -> Checkpoint:
    cp = Checkpoint("v2", tuple(entries), tuple(registered), 0)
    return dataclasses.replace(cp, checksum=spew.checksum(cp))


def stale_of(cp: Checkpoint, inventory: Inventory) -> tuple[list[str], list[tuple[str, str]]]:
    a = analyse(cp, inventory, DEFAULT_RESOURCES)
    return [cp.entries[i].pod_uid for i in a.stale_entries] if cp.entries else [], list(
        a.stale_registered
    )


# (name, entries as (uid, resource, ids), registered, inventory, stale uids, stale registered)
TABLE: list[tuple[str, Any, Any, Inventory, list[str], list[tuple[str, str]]]] = [
    (
        "gpu uuid gone",
        [("p1", "nvidia.com/gpu", [A]), ("p2", "nvidia.com/gpu", [B, C])],
        [("nvidia.com/gpu", (A, B, C))],
        inv(A, B, NEW),
        [],  # p2 still holds B: without a history it is left, never dropped with B
        [("nvidia.com/gpu", C)],
    ),
    (
        "all present",
        [("p1", "nvidia.com/gpu", [A]), ("p2", "nvidia.com/gpu", [B, C])],
        [("nvidia.com/gpu", (A, B, C))],
        inv(C, B, A),
        [],
        [],
    ),
    (
        "mig uuid",
        [("p1", "nvidia.com/mig-1g.5gb", [MA]), ("p2", "nvidia.com/mig-1g.5gb", [MB])],
        [("nvidia.com/mig-1g.5gb", (MA, MB))],
        inv(A, migs={A: [(MA, 1, 0)]}),
        ["p2"],
        [("nvidia.com/mig-1g.5gb", MB)],
    ),
    (
        "legacy mig",
        [
            ("p1", "nvidia.com/mig-1g.5gb", [f"MIG-{A}/1/0"]),
            ("p2", "nvidia.com/mig-1g.5gb", [f"MIG-{A}/2/0"]),
            ("p3", "nvidia.com/mig-1g.5gb", [f"MIG-{B}/1/0"]),
        ],
        [],
        inv(A, migs={A: [(MA, 1, 0)]}),
        ["p2", "p3"],
        [],
    ),
    (
        "replicas",
        [
            ("p1", "nvidia.com/gpu.shared", [f"{A}::0", f"{A}::3"]),
            ("p2", "nvidia.com/gpu.shared", [f"{B}::1"]),
        ],
        [("nvidia.com/gpu.shared", (f"{A}::0", f"{A}::3", f"{B}::0", f"{B}::1"))],
        inv(A),
        ["p2"],
        [("nvidia.com/gpu.shared", f"{B}::0"), ("nvidia.com/gpu.shared", f"{B}::1")],
    ),
    (
        # GPU B (index 1) disappeared: C is now index 1 and index 2 is gone. Index IDs can
        # only be checked for existence, so "1" stays (it now means C).
        "index ids shift",
        [
            ("p0", "nvidia.com/gpu", ["0"]),
            ("p1", "nvidia.com/gpu", ["1"]),
            ("p2", "nvidia.com/gpu", ["2"]),
        ],
        [("nvidia.com/gpu", ("0", "1", "2"))],
        inv(A, C),
        ["p2"],
        [("nvidia.com/gpu", "2")],
    ),
    (
        "mig index",
        [("p1", "nvidia.com/mig-1g.5gb", ["0:0"]), ("p2", "nvidia.com/mig-1g.5gb", ["0:1"])],
        [],
        inv(A, migs={A: [(MA, 1, 0)]}),
        ["p2"],
        [],
    ),
    (
        "resource outside the patterns",
        [("p1", "aliyun.com/gpu", [B]), ("p2", "amd.com/gpu", ["whatever"])],
        [("aliyun.com/gpu", (B,))],
        inv(A),
        [],
        [],
    ),
    (
        "one unknown-form id keeps the whole resource out",
        [("p1", "nvidia.com/gpu", [B]), ("p2", "nvidia.com/gpu", ["tegra"])],
        [("nvidia.com/gpu", (A, B, "tegra"))],
        inv(A),
        [],
        [],
    ),
]


@pytest.mark.parametrize(
    ("entries", "registered", "inventory", "stale", "stale_reg"),
    [row[1:] for row in TABLE],
    ids=[row[0] for row in TABLE],
)
def test_analyse_table(
    entries: Any,
    registered: Any,
    inventory: Inventory,
    stale: list[str],
    stale_reg: list[tuple[str, str]],
) -> None:
    cp = cp_of(*(entry(u, ids, r) for u, r, ids in entries), registered=registered)
    assert stale_of(cp, inventory) == (stale, stale_reg)
    a = analyse(cp, inventory, DEFAULT_RESOURCES)
    if not stale and not stale_reg:
        assert a.repaired is None and not a.stale
        assert plan(a, path=PATH, raw=marshal(cp), policy="rewrite") == ()
        return
    assert a.repaired is not None and a.refused == ""
    kept = [e.pod_uid for e in a.repaired.entries or ()]
    assert kept == [e.pod_uid for e in cp.entries or () if e.pod_uid not in stale]
    # Untouched entries are the same values, in the same order.
    assert [e for e in cp.entries or () if e.pod_uid in kept] == list(a.repaired.entries or ())
    reg = a.repaired.registered_dict()
    for res, ids in cp.registered or ():
        assert reg[res] == tuple(i for i in ids or () if (res, i) not in stale_reg)
    out = marshal(a.repaired)
    back = parse(out, source="repaired")
    assert verify(back) and back.entries == a.repaired.entries
    assert stale_of(back, inventory) == ([], [])  # the repair is complete


def test_unknown_form_is_reported_and_nothing_planned() -> None:
    cp = cp_of(entry("p1", [B]), entry("p2", ["tegra"]))
    a = analyse(cp, inv(A), DEFAULT_RESOURCES)
    assert a.repaired is None and not a.stale
    kinds = [f.kind for f in a.findings]
    assert kinds == ["checkpoint-unknown-id"]
    assert "tegra" in a.findings[0].summary


def test_tegra_fixture_untouched() -> None:
    raw = (REAL / "gpu-lab-tegra.json").read_bytes()
    cp = parse(raw, source="tegra")
    a = analyse(cp, inv(A), DEFAULT_RESOURCES)
    assert a.repaired is None and not a.stale
    assert [f.kind for f in a.findings] == ["checkpoint-unknown-id"]


def test_zero_gpu_inventory_is_refused() -> None:
    cp = cp_of(entry("p1", [A]), registered=[("nvidia.com/gpu", (A,))])
    a = analyse(cp, inv(), DEFAULT_RESOURCES)
    assert a.repaired is None and a.stale and "no GPU" in a.refused
    assert a.stale_entries == (0,) and a.stale_registered == (("nvidia.com/gpu", A),)
    assert any(f.kind == "checkpoint-refused" and f.severity == "error" for f in a.findings)
    for policy in ("rewrite", "delete", "report"):
        assert plan(a, path=PATH, raw=b"x", policy=policy) == ()


def test_policies() -> None:
    cp = cp_of(entry("p1", [A]), entry("p2", [B]), registered=[("nvidia.com/gpu", (A, B))])
    raw = marshal(cp)
    a = analyse(cp, inv(A), DEFAULT_RESOURCES)
    assert a.repaired is not None
    (rw,) = plan(a, path=PATH, raw=raw, policy="rewrite")
    assert isinstance(rw, RewriteCheckpoint)
    assert rw.content == marshal(a.repaired) and rw.expected_sha256 == sha256(raw)
    assert (rw.dropped_entries, rw.dropped_registered) == (1, 1)
    assert rw.kind == "checkpoint-repaired" and rw.path == PATH
    assert rw.fields()["DROPPED_ENTRIES"] == "1"
    (rm,) = plan(a, path=PATH, raw=raw, policy="delete")
    assert isinstance(rm, DeleteCheckpoint) and rm.expected_sha256 == sha256(raw)
    assert rm.kind == "checkpoint-deleted" and "Policy=delete" in rm.describe()
    assert plan(a, path=PATH, raw=raw, policy="report") == ()
    with pytest.raises(ValueError, match="policy"):
        plan(a, path=PATH, raw=raw, policy="shred")


def _kubelet_bytes(data: dict[str, Any], spew_text: str) -> bytes:
    """What kubelet writes: compact Go JSON with the checksum of `spew_text`."""
    doc = {"Data": data, "Checksum": fnv1a_32(spew_text.encode())}
    return json.dumps(doc, separators=(",", ":")).encode()


TOP = "(checkpoint.checkpointData){PodDeviceEntries:([]checkpoint.PodDevicesEntry)"
REG = " RegisteredDevices:(map[string][]string)"


def test_null_entries_and_emptied_registered_byte_for_byte() -> None:
    # The Alibaba fixture: PodDeviceEntries null, one registered GPU that is gone now.
    raw = (REAL / "alibaba-ack-gpuops.json").read_bytes()
    cp = parse(raw, source="alibaba")
    a = analyse(cp, inv(A), DEFAULT_RESOURCES)
    assert a.repaired is not None and a.repaired.entries is None
    expected = _kubelet_bytes(
        {"PodDeviceEntries": None, "RegisteredDevices": {"nvidia.com/gpu": []}},
        TOP + "<nil>" + REG + "map[nvidia.com/gpu:[]]}",
    )
    assert marshal(a.repaired) == expected


def test_empty_entries_and_null_lists_preserved_byte_for_byte() -> None:
    cp = cp_of(registered=[("nvidia.com/gpu", (A, B)), ("nvidia.com/mig-1g.5gb", None)])
    cp = dataclasses.replace(cp, entries=(), checksum=0)
    cp = dataclasses.replace(cp, checksum=spew.checksum(cp))
    a = analyse(cp, inv(A), DEFAULT_RESOURCES)
    assert a.repaired is not None and a.repaired.entries == ()
    expected = _kubelet_bytes(
        {
            "PodDeviceEntries": [],
            "RegisteredDevices": {"nvidia.com/gpu": [A], "nvidia.com/mig-1g.5gb": None},
        },
        TOP + "[]" + REG + f"map[nvidia.com/gpu:[{A}] nvidia.com/mig-1g.5gb:<nil>]}}",
    )
    assert marshal(a.repaired) == expected


def test_entry_with_null_device_ids_and_alloc_is_kept_as_is() -> None:
    odd = PodDevicesEntry("p0", "main", "nvidia.com/gpu", None, None)
    cp = cp_of(odd, entry("p1", [B]), registered=[("nvidia.com/gpu", (A, B))])
    a = analyse(cp, inv(A), DEFAULT_RESOURCES)
    assert a.repaired is not None and a.repaired.entries == (odd,)
    back = parse(marshal(a.repaired), source="r")
    assert back.entries == (odd,) and verify(back)
    assert b'"DeviceIDs":null,"AllocResp":null' in marshal(a.repaired)


def test_v1_file_stays_v1() -> None:
    e1 = PodDevicesEntry("p1", "c", "nvidia.com/gpu", (A,), b"x")
    e2 = PodDevicesEntry("p2", "c", "nvidia.com/gpu", (B, A), b"y")
    cp = Checkpoint("v1", (e1, e2), (("nvidia.com/gpu", (B, A)),), 0)
    raw = marshal(cp)
    cp = parse(raw, source="v1")
    assert cp.format == "v1" and verify(cp)
    a = analyse(cp, inv(A), DEFAULT_RESOURCES)
    assert a.repaired is not None and a.repaired.format == "v1"
    out = marshal(a.repaired)
    assert b'"DeviceIDs":["' in out and b'"DeviceIDs":{' not in out
    back = parse(out, source="v1 repaired")
    # p2 still holds A: left as it is, never dropped with A
    assert back.format == "v1" and verify(back) and back.entries == (e1, e2)
    assert back.registered == (("nvidia.com/gpu", (A,)),)


def test_order_of_entries_and_registered_ids_is_kept() -> None:
    # numa-blog-05 registers C, A, B: not sorted (kubelet's map order); keep it.
    raw = (REAL / "numa-blog-05.json").read_bytes()
    cp = parse(raw, source="05")
    assert cp.registered == (("nvidia.com/gpu", (C, A, B)),)
    a = analyse(cp, inv(C, B, NEW), DEFAULT_RESOURCES)
    assert a.repaired is not None
    assert a.repaired.registered == (("nvidia.com/gpu", (C, B)),)
    assert [e.all_device_ids() for e in a.repaired.entries or ()] == [(B,)]
    many = cp_of(*(entry(f"p{i}", [(A, B, C)[i % 3]]) for i in range(12)))
    a = analyse(many, inv(A, C), DEFAULT_RESOURCES)
    assert a.repaired is not None
    assert [e.pod_uid for e in a.repaired.entries or ()] == [
        f"p{i}" for i in range(12) if i % 3 != 1
    ]


FIXTURES = sorted(REAL.glob("*.json"))


def _uuids(cp: Checkpoint) -> list[str]:
    ids = list(cp.all_device_ids())
    for _, reg in cp.registered or ():
        ids += reg or ()
    return sorted({i for i in ids if i.startswith("GPU-")})


@pytest.mark.parametrize("path", FIXTURES, ids=lambda p: p.name)
def test_real_fixtures_with_synthetic_inventories(path: Path) -> None:
    raw = path.read_bytes()
    cp = parse(raw, source=path.name)
    gpus = _uuids(cp)
    if not gpus:  # tegra: nothing we understand
        assert analyse(cp, inv(A), DEFAULT_RESOURCES).repaired is None
        return
    # Every GPU still there (in another order): nothing to do.
    a = analyse(cp, inv(*reversed(gpus)), DEFAULT_RESOURCES)
    assert a.repaired is None and not a.stale and a.findings == ()
    # Each GPU in turn replaced by a new one.
    for gone in gpus:
        inventory = inv(*[g if g != gone else NEW for g in gpus])
        a = analyse(cp, inventory, DEFAULT_RESOURCES)
        holders = [i for i, e in enumerate(cp.entries or ()) if gone in e.all_device_ids()]
        # an entry still holding another, present GPU is left (no history to remap it)
        kept = [i for i in holders if set((cp.entries or ())[i].all_device_ids()) != {gone}]
        holders = [i for i in holders if i not in kept]
        assert list(a.stale_entries) == holders
        assert [k.pos for k in a.kept] == kept
        assert a.stale_registered == (("nvidia.com/gpu", gone),)
        assert a.repaired is not None
        out = marshal(a.repaired)
        back = parse(out, source="repaired")
        assert verify(back) and back.checksum == spew.checksum(a.repaired)
        assert (back.entries, back.registered) == (a.repaired.entries, a.repaired.registered)
        # with no entry left, nothing says v1 or v2 any more: both hash the same
        assert back.format == ("v2" if back.entries else "any")
        assert (gone in out.decode()) == bool(kept)
        assert spew.checksum(back) == fnv1a_32(render(back).encode())
        assert analyse(back, inventory, DEFAULT_RESOURCES).repaired is None
        (action,) = plan(a, path=PATH, raw=raw, policy="rewrite")
        assert isinstance(action, RewriteCheckpoint) and action.content == out
        assert action.dropped_entries == len(holders)


def _alloc(rng: random.Random, ids: Sequence[str], unique: bool) -> bytes:
    env = b"\n\x16NVIDIA_VISIBLE_DEVICES\x12" + bytes([41 * len(ids) - 1]) + ",".join(ids).encode()
    msg = b"\n" + bytes([len(env)]) + env
    for dev in (b"/dev/nvidiactl", b"/dev/nvidia-uvm"):
        spec = b"\n" + bytes([len(dev)]) + dev + b"\x12" + bytes([len(dev)]) + dev + b"\x1a\x02rw"
        msg += b"\x1a" + bytes([len(spec)]) + spec
    if unique:
        msg += b'"' + bytes([16]) + rng.randbytes(16)
    return msg


@pytest.mark.parametrize("tokens", [False, True])
@pytest.mark.parametrize("unique", [False, True])
def test_large_checkpoint_checksum_matches_the_plain_rendering(unique: bool, tokens: bool) -> None:
    """The table/token shortcuts of spew.checksum agree with hashing the whole string."""
    rng = random.Random(7)
    gpus = [A, B, C, NEW]
    entries = []
    for n in range(400):
        ids = rng.sample(gpus, rng.choice((1, 1, 2)))
        resp: Optional[bytes] = _alloc(rng, ids, unique)
        if n % 50 == 0:
            resp = None if n % 100 else rng.randbytes(30)  # nil, and bytes that are no protobuf
        entries.append(
            PodDevicesEntry(f"pod-{n}", f"c{n % 3}", "nvidia.com/gpu", ((0, tuple(ids)),), resp)
        )
    cp = Checkpoint("v2", tuple(entries), (("nvidia.com/gpu", tuple(gpus)),), 0)
    spew.clear_caches()
    if tokens:
        spew._token_tables()
    assert spew.checksum(cp) == fnv1a_32(render(cp).encode())
    assert spew.checksum(cp) == fnv1a_32(render(cp).encode())  # with warm caches too
    a = analyse(
        dataclasses.replace(cp, checksum=spew.checksum(cp)), inv(A, B, C), DEFAULT_RESOURCES
    )
    assert a.repaired is not None
    assert verify(parse(marshal(a.repaired), source="big"))
    spew.clear_caches()
