"""The one-to-one map from a recorded generation of GPUs to the GPUs now, and IDs through it."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuguard.checkpoint.history import Generation, GpuIdentity, MigIdentity
from gpuguard.host.inventory import Gpu, Inventory, MigDevice
from gpuguard.steps.checkpoint.deviceids import classify
from gpuguard.steps.checkpoint.gpumap import Gone, build_map


def old(
    uuid: str, bus: str, index: int, minor: int, mig: tuple[MigIdentity, ...] = ()
) -> GpuIdentity:
    return GpuIdentity(uuid, bus, index, minor, -1, mig)


def now(uuid: str, bus: str, index: int, minor: int, mig: tuple[MigDevice, ...] = ()) -> Gpu:
    return Gpu(uuid, index, minor, bus, mig)


def gmap(olds: list[GpuIdentity], news: list[Gpu]):  # type: ignore[no-untyped-def]
    return build_map(Generation(tuple(olds), 1.0), Inventory(tuple(news), "t"))


X, Y, Z = "0000:17:00.0", "0000:65:00.0", "0000:b1:00.0"


@pytest.mark.parametrize(
    "olds, news, expect",
    [
        # same boards, renumbered: by UUID
        ([old("GPU-a-0", X, 0, 0), old("GPU-b-0", Y, 1, 1)],
         [now("GPU-b-0", Y, 0, 0), now("GPU-a-0", X, 1, 1)], {"GPU-a-0": ("GPU-a-0", "uuid"),
                                                          "GPU-b-0": ("GPU-b-0", "uuid")}),
        # new UUIDs in the same slots (NVML's domain form): by PCI bus id
        ([old("GPU-a-0", X, 0, 0), old("GPU-b-0", Y, 1, 1)],
         [now("GPU-c-0", "00000000:65:00.0", 0, 0), now("GPU-d-0", "00000000:17:00.0", 1, 1)],
         {"GPU-a-0": ("GPU-d-0", "pci"), "GPU-b-0": ("GPU-c-0", "pci")}),
        # another machine's layout, same count and indices: by index
        ([old("GPU-a-0", X, 0, 0), old("GPU-b-0", Y, 1, 1)],
         [now("GPU-c-0", Z, 0, 0), now("GPU-d-0", "0000:ca:00.0", 1, 1)],
         {"GPU-a-0": ("GPU-c-0", "index"), "GPU-b-0": ("GPU-d-0", "index")}),
        # one gone for good, the other still in its slot
        ([old("GPU-a-0", X, 0, 0), old("GPU-b-0", Y, 1, 1)], [now("GPU-d-0", Y, 0, 0)],
         {"GPU-a-0": None, "GPU-b-0": ("GPU-d-0", "pci")}),
        # a slot changed and a GPU is gone: the index cannot pair them one to one
        ([old("GPU-a-0", X, 0, 0), old("GPU-b-0", Y, 1, 1), old("GPU-e-0", Z, 2, 2)],
         [now("GPU-c-0", "0000:ca:00.0", 0, 0), now("GPU-d-0", Y, 1, 1)],
         {"GPU-a-0": None, "GPU-b-0": ("GPU-d-0", "pci"), "GPU-e-0": None}),
    ],
)  # fmt: skip
def test_pairing_rules(olds, news, expect) -> None:  # type: ignore[no-untyped-def]
    m = gmap(olds, news)
    got = {x.old.uuid: (x.new.uuid, x.how) for x in m.matches}
    got.update({g.old.uuid: None for g in m.gone})
    assert got == expect


def test_a_bus_id_named_twice_never_pairs() -> None:
    # a broken inventory with one bus id twice: nothing pairs by it (the index may)
    m = gmap([old("GPU-a-0", X, 0, 0)], [now("GPU-c-0", X, 0, 0), now("GPU-d-0", X, 1, 1)])
    assert [g.old.uuid for g in m.gone] == ["GPU-a-0"]


def test_ids_translate_in_their_own_form() -> None:
    olds = [old("GPU-a-0", X, 0, 0, (MigIdentity("MIG-a1-0", 1, 0), MigIdentity("MIG-a2-0", 2, 0)))]
    news = [now("GPU-c-0", X, 3, 4, (MigDevice("MIG-c1-0", 1, 0), MigDevice("MIG-c2-0", 2, 0)))]
    m = gmap(olds, news)
    cases = {
        "GPU-a-0": "GPU-c-0",
        "GPU-a-0::3": "GPU-c-0::3",
        "MIG-a2-0": "MIG-c2-0",
        "MIG-GPU-a-0/1/0": "MIG-GPU-c-0/1/0",
        "MIG-GPU-a-0/1/0::1": "MIG-GPU-c-0/1/0::1",
        "0": "3",
        "0:1": "3:1",
        "0::2": "3::2",
    }
    for raw, new in cases.items():
        assert m.translate(classify(raw)) == (new, ""), raw
    assert m.minor_now(0) == (4, "")
    assert m.minor_now(7) == (None, "")


def test_what_cannot_be_mapped_says_why() -> None:
    olds = [
        old("GPU-a-0", X, 0, 0, (MigIdentity("MIG-a1-0", 1, 0), MigIdentity("MIG-a2-0", 2, 0))),
        old("GPU-b-0", Y, 1, 1),
    ]
    news = [now("GPU-c-0", X, 0, 0, (MigDevice("MIG-c1-0", 1, 0),))]  # b gone, a's layout smaller
    m = gmap(olds, news)
    for raw, why in (
        ("GPU-b-0", "is gone"),
        ("1", "is gone"),
        ("MIG-a2-0", "no MIG device gi 2 ci 0"),
        ("MIG-GPU-a-0/2/0", "no MIG device gi 2 ci 0"),
        ("0:0", "another MIG layout"),
        ("MIG-zz-0", "not in the recorded generation"),
    ):
        new, text = m.translate(classify(raw))
        assert new is None and why in text, (raw, text)
    assert m.minor_now(1)[0] is None and "gone" in m.minor_now(1)[1]
    assert isinstance(m.of_uuid("GPU-b-0"), Gone)


@st.composite
def before_after(draw: st.DrawFn) -> tuple[list[GpuIdentity], list[Gpu]]:
    n = draw(st.integers(1, 6))
    buses = [f"0000:{0x10 + i:02x}:00.0" for i in range(n + 3)]
    olds = [old(f"GPU-o{i}-0", buses[i], i, i) for i in range(n)]
    news = []
    perm = draw(st.permutations(range(n + 3)))
    for i in range(draw(st.integers(0, n + 2))):
        kind = draw(st.sampled_from(["same", "new-uuid", "new"]))
        uuid = f"GPU-o{i}-0" if kind == "same" and i < n else f"GPU-n{i}-0"
        bus = buses[perm[i]] if kind == "new" else buses[i]
        news.append(now(uuid, bus, i, draw(st.integers(0, 50)) * 10 + i))
    return olds, news


@settings(max_examples=300, deadline=None)
@given(before_after())
def test_the_map_is_one_to_one_and_total_over_the_old(pair) -> None:  # type: ignore[no-untyped-def]
    olds, news = pair
    m = gmap(olds, news)
    paired = [x.old.uuid for x in m.matches] + [g.old.uuid for g in m.gone]
    assert sorted(paired) == sorted(g.uuid for g in olds)  # each old GPU once
    targets = [x.new.uuid for x in m.matches]
    assert len(targets) == len(set(targets))  # never two old GPUs on one new
    for x in m.matches:
        if x.how == "uuid":
            assert x.old.uuid == x.new.uuid
        elif x.how == "pci":
            assert x.old.pci_bus_id == x.new.pci_bus_id
        else:
            assert x.old.index == x.new.index
