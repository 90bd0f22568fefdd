"""The AllocResp codec: real plugin answers read, strings rewritten, every other byte kept."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import CHECKPOINTS
from gpuguard.checkpoint import allocresp, parse
from gpuguard.checkpoint.allocresp import AllocRespError

FIXTURES = sorted(CHECKPOINTS.glob("*.json"))


def _responses() -> list[bytes]:
    out = []
    for path in FIXTURES:
        cp = parse(path.read_bytes(), source=str(path))
        out += [e.alloc_resp for e in cp.entries or () if e.alloc_resp is not None]
    return out


def test_the_real_fixtures_read_as_nvidia_plugin_answers() -> None:
    answers = _responses()
    assert len(answers) >= 16
    for data in answers:
        texts = allocresp.strings(data)
        envs = [(k, v) for w, k, v in texts if w == allocresp.ENV]
        assert envs and envs[0][0] == "NVIDIA_VISIBLE_DEVICES"
        # identity rewrite: the very same bytes
        assert allocresp.rewrite(data, lambda w, k, v: v) is data


def test_numa_blog_answer_in_full() -> None:
    cp = parse((CHECKPOINTS / "numa-blog-01.json").read_bytes(), source="f")
    (e,) = cp.entries or ()
    assert e.alloc_resp is not None
    texts = allocresp.strings(e.alloc_resp)
    assert texts[0] == (
        "env",
        "NVIDIA_VISIBLE_DEVICES",
        "GPU-c1e9f249-b37b-81c2-a8d9-ba5ca0294841,GPU-9b341c59-f96b-ba85-c137-78c3652fea65",
    )
    hosts = [v for w, _k, v in texts if w == allocresp.DEVICE_HOST]
    assert hosts == [
        "/dev/nvidiactl",
        "/dev/nvidia-uvm",
        "/dev/nvidia-uvm-tools",
        "/dev/nvidia-modeset",
        "/dev/nvidia1",
        "/dev/nvidia2",
    ]


def test_rewrite_changes_only_the_strings_asked() -> None:
    data = allocresp.encode(
        envs=(("NVIDIA_VISIBLE_DEVICES", "GPU-a"), ("OTHER", "GPU-a")),
        devices=(("/dev/nvidia1", "/dev/nvidia1", "rw"),),
        mounts=(("/usr/bin/x", "/usr/bin/x", True),),
        annotations=(("cdi.k8s.io/p", "nvidia.com/gpu=GPU-a"),),
        cdi_devices=("nvidia.com/gpu=GPU-a",),
    )

    def fix(where: str, key: str, value: str) -> str:
        if where == allocresp.ENV and key == "NVIDIA_VISIBLE_DEVICES":
            return "GPU-bb"
        if where in (allocresp.DEVICE_HOST, allocresp.DEVICE_CONTAINER):
            return value.replace("1", "3")
        if where == allocresp.CDI_NAME:
            return "nvidia.com/gpu=GPU-bb"
        return value

    out = allocresp.rewrite(data, fix)
    assert allocresp.strings(out) == [
        ("env", "NVIDIA_VISIBLE_DEVICES", "GPU-bb"),
        ("env", "OTHER", "GPU-a"),
        ("mount.container_path", "/usr/bin/x", "/usr/bin/x"),  # key: its host path
        ("mount.host_path", "", "/usr/bin/x"),
        ("device.container_path", "/dev/nvidia3", "/dev/nvidia3"),
        ("device.host_path", "", "/dev/nvidia3"),
        ("device.permissions", "", "rw"),
        ("annotation", "cdi.k8s.io/p", "nvidia.com/gpu=GPU-a"),
        ("cdi.name", "", "nvidia.com/gpu=GPU-bb"),
    ]
    # the mount's read_only flag survives
    assert b"\x18\x01" in out


def test_unknown_fields_keep_their_bytes_and_place() -> None:
    unknown_top = b"\x30\x07"  # field 6, varint 7: a newer API's field
    unknown_in_device = b"\x22\x02hi"  # field 4 inside a DeviceSpec
    dev = b"\x0a\x0c/dev/nvidia1\x12\x0c/dev/nvidia1" + unknown_in_device
    data = unknown_top + b"\x1a" + bytes([len(dev)]) + dev
    out = allocresp.rewrite(data, lambda w, k, v: v.replace("nvidia1", "nvidia2"))
    assert out.startswith(unknown_top)
    assert out.endswith(unknown_in_device)
    assert [v for _w, _k, v in allocresp.strings(out)] == ["/dev/nvidia2", "/dev/nvidia2"]


@pytest.mark.parametrize(
    "data, what",
    [
        (b"\x0a", "runs past"),  # a length missing
        (b"\x0a\x05ab", "runs past"),  # shorter than its length
        (b"\x08\x01", "wire type 0"),  # envs as a varint: Go's decoder refuses it
        (b"\x1a\x02\x08\x01", "wire type 0"),  # a device's container_path as a varint
        (b"\x0b", "group"),
        (b"\x00\x00", "field number 0"),
        (b"\x0a" + b"\xff" * 11, "varint"),
        (b"\x12\x04\x1a\x02hi", "wire type 2"),  # Mount.read_only as bytes
    ],
)
def test_what_go_would_refuse_is_refused(data: bytes, what: str) -> None:
    with pytest.raises(AllocRespError, match=what):
        allocresp.rewrite(data, lambda w, k, v: v)


def test_a_map_entry_repeated_value_the_last_one_changes() -> None:
    entry = b"\x0a\x01K\x12\x01a\x12\x01b"  # key K, value a, then value b (Go keeps b)
    data = b"\x0a" + bytes([len(entry)]) + entry
    assert allocresp.strings(data) == [("env", "K", "b")]
    out = allocresp.rewrite(data, lambda w, k, v: "c" if v == "b" else v)
    assert allocresp.strings(out) == [("env", "K", "c")]
    assert b"\x12\x01a" in out  # the earlier value kept as it was


text = st.text(st.characters(blacklist_categories=("Cs",)), max_size=12)
pairs = st.lists(st.tuples(text, text), max_size=4).map(tuple)


@settings(max_examples=150, deadline=None)
@given(
    envs=pairs,
    devices=st.lists(st.tuples(text, text, text), max_size=4).map(tuple),
    mounts=st.lists(st.tuples(text, text, st.booleans()), max_size=3).map(tuple),
    annotations=pairs,
    cdi=st.lists(text, max_size=3).map(tuple),
)
def test_round_trip_and_rewrite_property(envs, devices, mounts, annotations, cdi) -> None:  # type: ignore[no-untyped-def]
    data = allocresp.encode(envs, devices, mounts, annotations, cdi)
    texts = allocresp.strings(data)
    assert [v for w, _k, v in texts if w == allocresp.ENV] == [v for _k, v in envs]
    assert [v for w, _k, v in texts if w == allocresp.CDI_NAME] == list(cdi)
    assert allocresp.rewrite(data, lambda w, k, v: v) is data
    upper = allocresp.rewrite(data, lambda w, k, v: v + "X")
    assert [v for _w, _k, v in allocresp.strings(upper)] == [v + "X" for _w, _k, v in texts]
    # map keys are never changed
    maps = (allocresp.ENV, allocresp.ANNOTATION)
    assert [k for w, k, _v in allocresp.strings(upper) if w in maps] == [
        k for w, k, _v in texts if w in maps
    ]


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=64))
def test_any_bytes_read_or_refused_never_crash(data: bytes) -> None:
    try:
        out = allocresp.rewrite(data, lambda w, k, v: v)
    except AllocRespError:
        return
    assert out is data
