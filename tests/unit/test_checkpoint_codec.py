"""Rendering, parsing and marshalling rules, as tables (Go behaviour each row mimics)."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest

from gpuguard.checkpoint import Checkpoint, PodDevicesEntry, marshal, parse, render, verify
from gpuguard.checkpoint.spew import checksum, fnv1a_32

TOP = "(checkpoint.checkpointData){PodDeviceEntries:([]checkpoint.PodDevicesEntry)"
REG = " RegisteredDevices:(map[string][]string)"


def entry(dev: object, alloc: object = None) -> PodDevicesEntry:
    return PodDevicesEntry("u", "c", "r", dev, alloc)  # type: ignore[arg-type]


def one(e: PodDevicesEntry, fmt: str = "v2") -> Checkpoint:
    return Checkpoint(fmt, (e,), (), 0)


def body(dev: str, alloc: str = "<nil>", devtype: str = "checkpoint.DevicesPerNUMA") -> str:
    return (
        f"{TOP}[{{PodUID:(string)u ContainerName:(string)c ResourceName:(string)r "
        f"DeviceIDs:({devtype}){dev} AllocResp:([]uint8){alloc}}}]{REG}map[]}}"
    )


@pytest.mark.parametrize(
    ("cp", "expected"),
    [
        (Checkpoint("any", None, None, 0), f"{TOP}<nil>{REG}<nil>}}"),
        (Checkpoint("any", (), (), 0), f"{TOP}[]{REG}map[]}}"),
        (Checkpoint("v1", (), (), 0), f"{TOP}[]{REG}map[]}}"),
        (
            Checkpoint("any", (), (("b", ("2", "1")), ("a", None), ("B", ())), 0),
            f"{TOP}[]{REG}map[B:[] a:<nil> b:[2 1]]}}",
        ),
        (one(entry(None)), body("<nil>")),
        (one(entry(())), body("map[]")),
        (
            one(entry(((10, ("x",)), (2, None), (-1, ()), (0, ("y", "z"))))),
            body("map[-1:[] 0:[y z] 2:<nil> 10:[x]]"),
        ),
        (one(entry((), b"")), body("map[]", "[]")),
        (one(entry((), b"\x00\x0a\xff")), body("map[]", "[0 10 255]")),
        (one(entry(("b", "a"), None), "v1"), body("[b a]", devtype="[]string")),
        (one(entry((), None), "v1"), body("[]", devtype="[]string")),
        (one(entry(None), "v1"), body("<nil>", devtype="[]string")),
        (
            one(PodDevicesEntry('q"<\n', "é ", "]", ((0, ("a b",)),), None)),
            f'{TOP}[{{PodUID:(string)q"<\n ContainerName:(string)é  ResourceName:(string)] '
            f"DeviceIDs:(checkpoint.DevicesPerNUMA)map[0:[a b]] AllocResp:([]uint8)<nil>}}]"
            f"{REG}map[]}}",
        ),
    ],
)
def test_render(cp: Checkpoint, expected: str) -> None:
    assert render(cp) == expected
    assert checksum(cp) == fnv1a_32(expected.encode())


@pytest.mark.parametrize(
    ("data", "expected"),
    [(b"", 2166136261), (b"a", 0xE40C292C), (b"foobar", 0xBF9CF968), (b"ab", 0x4D2505CA)],
)
def test_fnv1a_32_known_vectors(data: bytes, expected: int) -> None:
    assert fnv1a_32(data) == expected


def test_v1_and_v2_hash_the_same_without_entries() -> None:
    for entries in (None, ()):
        v1 = Checkpoint("v1", entries, (("r", ("a",)),), 0)
        assert checksum(v1) == checksum(dataclasses.replace(v1, format="v2"))


def test_repeated_segments_use_tables_and_agree() -> None:
    e = entry(((0, ("GPU-1",)),), bytes(range(256)) * 3)
    cp = Checkpoint("v2", tuple(dataclasses.replace(e, pod_uid=str(i)) for i in range(100)), (), 0)
    assert checksum(cp) == fnv1a_32(render(cp).encode())


def doc(entries: object = None, registered: object = None, **top: object) -> dict[str, object]:
    data: dict[str, object] = {}
    if entries is not None:
        data["PodDeviceEntries"] = entries
    if registered is not None:
        data["RegisteredDevices"] = registered
    return {"Data": data, **top}


def signed(text: str) -> bytes:
    """`text` (JSON with a placeholder checksum 0) with the right checksum put in."""
    cp = parse(text.encode(), source="t")
    return re.sub('"(checksum)":0', f'"\\1":{checksum(cp)}', text, flags=re.I).encode()


E = '{"PodUID":"u","ContainerName":"c","ResourceName":"r","DeviceIDs":%s,"AllocResp":%s}'


@pytest.mark.parametrize(
    ("text", "fmt", "entries", "registered"),
    [
        ('{"Data":{},"Checksum":0}', "any", (), ()),  # kubelet pre-fills [] and {}
        ('{"Checksum":0}', "any", (), ()),
        ('{"Data":null,"Checksum":0}', "any", (), ()),
        (
            '{"Data":{"PodDeviceEntries":null,"RegisteredDevices":null},"Checksum":0}',
            "any",
            None,
            None,
        ),
        ('{"data":{"poddeviceentries":null},"CHECKSUM":0,"Other":[1,{"x":null}]}', "any", None, ()),
        (
            '{"Data":{"RegisteredDevices":{"b":["1"],"a":null,"b":["2"]}},"Checksum":0}',
            "any",
            (),
            (("b", ("2",)), ("a", None)),
        ),
        (
            '{"Data":{"RegisteredDevices":{"a":["1"]},"RegisteredDevices":{"b":[]}},"Checksum":0}',
            "any",
            (),
            (("a", ("1",)), ("b", ())),
        ),  # Go merges into the existing map
        (
            '{"Data":{"PodDeviceEntries":['
            + E % ('{"1":["a"],"-1":null,"01":["b"]}', '""')
            + ']},"Checksum":0}',
            "v2",
            ((("u", "c", "r", ((1, ("b",)), (-1, None)), b""),)),
            (),
        ),
        (
            '{"Data":{"PodDeviceEntries":[' + E % ('["b","a"]', "null") + ']},"Checksum":0}',
            "v1",
            ((("u", "c", "r", ("b", "a"), None),)),
            (),
        ),
        (
            '{"Data":{"PodDeviceEntries":[' + E % ("[]", '"AQ==\\r\\n"') + ']},"Checksum":0}',
            "v1",
            ((("u", "c", "r", (), b"\x01"),)),
            (),
        ),
        (
            '{"Data":{"PodDeviceEntries":[{"PodUID":null,"poduid":"x","PodUID":null}]},'
            '"Checksum":0}',
            "v2",
            ((("x", "", "", None, None),)),
            (),
        ),
        (
            '{"Data":{"PodDeviceEntries":[{"PodUID":"a","DeviceIDs":{"0":["x"]}}],'
            '"PodDeviceEntries":[{"ContainerName":"b","DeviceIDs":{"1":["y"]}}]},"Checksum":0}',
            "v2",
            ((("a", "b", "", ((0, ("x",)), (1, ("y",))), None),)),
            (),
        ),  # element reuse
        (
            '{"Data":{"PodDeviceEntries":[{"PodUID":"a\\ud800b\\udc00\\ud83d\\ude00"}]},'
            '"Checksum":0}',
            "v2",
            ((("a\ufffdb\ufffd\U0001f600", "", "", None, None),)),
            (),
        ),
    ],
)
def test_parse_like_go(text: str, fmt: str, entries: object, registered: object) -> None:
    raw = signed(text)
    cp = parse(raw, source="t")
    assert cp.format == fmt
    if entries is None:
        assert cp.entries is None
    else:
        assert cp.entries is not None
        got = tuple(
            (e.pod_uid, e.container_name, e.resource_name, e.device_ids, e.alloc_resp)
            for e in cp.entries
        )
        assert got == entries
    assert cp.registered == registered
    assert verify(cp)
    again = marshal(cp)
    back = parse(again, source="t")  # map order becomes Go's sorted order
    assert back.registered_dict() == cp.registered_dict() and back.checksum == cp.checksum
    assert [dict(e.numa_pairs()) if e.shape == "v2" else e for e in back.entries or ()] == [
        dict(e.numa_pairs()) if e.shape == "v2" else e for e in cp.entries or ()
    ]
    assert marshal(parse(again, source="t")) == again  # canonical is a fixed point


def test_invalid_utf8_becomes_one_replacement_per_byte() -> None:
    raw = b'{"Data":{"RegisteredDevices":{"r":["a\xe2\x82Xb\xed\xa0\x80"]}},"Checksum":0}'
    cp = parse(raw, source="t")
    assert cp.registered == (("r", ("a\ufffd\ufffdXb\ufffd\ufffd\ufffd",)),)


def test_nil_device_ids_resolved_by_checksum() -> None:
    v1 = Checkpoint("v1", (entry(None),), (), 0)
    raw = marshal(v1)
    assert parse(raw, source="t").format == "v1"
    v2 = dataclasses.replace(v1, format="v2")
    assert parse(marshal(v2), source="t").format == "v2"


def test_v1_compat_checksum_of_kubelet_1_20() -> None:
    e = PodDevicesEntry("PodDevicesEntryV1", "c", "r", ("a",), None)
    writer = Checkpoint("v1", (e,), (), 0)
    compat = render(writer, v1_compat=True)
    assert "PodDevicesEntryV1" not in compat and compat != render(writer)
    stored = fnv1a_32(compat.encode())
    assert verify(dataclasses.replace(writer, checksum=stored))
    assert verify(dataclasses.replace(writer, checksum=checksum(writer)))


@pytest.mark.parametrize(
    ("value", "escaped"),
    [
        ("<>&", "\\u003c\\u003e\\u0026"),
        ("\u2028\u2029", "\\u2028\\u2029"),
        ('"\\', '\\"\\\\'),
        ("\n\r\t\b\f\x01\x1f\x7f", "\\n\\r\\t\\b\\f\\u0001\\u001f\x7f"),
        ("é€😀", "é€😀"),
    ],
)
def test_marshal_escapes_like_go(value: str, escaped: str) -> None:
    cp = Checkpoint("any", (), ((value, (value,)),), 7)
    out = marshal(cp, checksum=7).decode()
    reg = f'{{"{escaped}":["{escaped}"]}}'
    assert out == f'{{"Data":{{"PodDeviceEntries":[],"RegisteredDevices":{reg}}},"Checksum":7}}'
    assert parse(out.encode(), source="t").registered == cp.registered


def test_marshal_layout() -> None:
    e = PodDevicesEntry("u", "c", "r", ((2, ("b",)), (10, ("a",)), (-1, None)), b"\xfb\xff")
    cp = Checkpoint("v2", (e,), (("z", None), ("a", ())), 0, boot_id="boot")
    out = marshal(cp)
    assert out == (
        b'{"Data":{"PodDeviceEntries":[{"PodUID":"u","ContainerName":"c","ResourceName":"r",'
        b'"DeviceIDs":{"-1":null,"10":["a"],"2":["b"]},"AllocResp":"+/8="}],'
        b'"RegisteredDevices":{"a":[],"z":null}},"Checksum":'
        + str(checksum(cp)).encode()
        + b',"BootID":"boot"}'
    )
    back = parse(out, source="t")
    assert back.boot_id == "boot" and verify(back)
    assert b"BootID" not in marshal(dataclasses.replace(cp, boot_id=None))
    v1 = Checkpoint("v1", (PodDevicesEntry("u", "c", "r", ("b", "a"), None),), None, 0)
    assert json.loads(marshal(v1))["Data"]["PodDeviceEntries"][0]["DeviceIDs"] == ["b", "a"]


@pytest.mark.parametrize(
    "bad",
    [
        Checkpoint("v2", (entry(("a",)),), (), 0),  # v1 ids in a v2 checkpoint
        Checkpoint("v1", (entry(((0, ("a",)),)),), (), 0),
        Checkpoint("v2", (entry(((0, ("a",)), (0, ("b",)))),), (), 0),  # duplicate NUMA key
        Checkpoint("any", (), (("a", ()), ("a", None)), 0),
        Checkpoint("v1", (), (), 0, boot_id="b"),
    ],
)
def test_marshal_refuses_what_go_cannot_hold(bad: Checkpoint) -> None:
    with pytest.raises(ValueError):
        marshal(bad)


def test_bad_format_name() -> None:
    with pytest.raises(ValueError):
        Checkpoint("v3", (), (), 0)


def test_any_checkpoint_given_entries_takes_their_shape() -> None:
    cp = Checkpoint("any", (), (), 0)
    assert dataclasses.replace(cp, entries=(entry(("a",)),)).effective_format() == "v1"
    assert dataclasses.replace(cp, entries=(entry(None),)).effective_format() == "v2"
