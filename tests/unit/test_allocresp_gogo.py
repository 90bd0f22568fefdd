"""The allocation-response walker reads field numbers as kubelet's gogo decoder does,
and refuses bytes on which that reading and the specification's disagree."""

from __future__ import annotations

import pytest

from gpuguard.checkpoint import allocresp
from gpuguard.checkpoint.allocresp import AllocRespError
from gpuguard.host.protowire import field as _len_field
from gpuguard.host.protowire import varint as _encode_varint


def _field(number: int, payload: bytes) -> bytes:
    return _encode_varint(number << 3 | 2) + _encode_varint(len(payload)) + payload


HIDDEN = _field(2**32 + 1, _len_field(1, b"NVIDIA_VISIBLE_DEVICES") + _len_field(2, b"GPU-dead-1"))


@pytest.mark.parametrize(
    "tail",
    [
        HIDDEN,  # kubelet: field 1, Envs; the specification: an unknown field
        _field(2**29, b"x"),  # past the largest valid number: gogo skips, others refuse
        _field(2**31 + 1, b"x"),  # int32() makes it negative: kubelet refuses the message
        _encode_varint(1 << 3 | 3) + _encode_varint(1 << 3 | 4),  # a group
        _encode_varint(7 << 3 | 4),  # an end-group tag alone
        # a 10-byte tag whose high bits fall off Go's uint64: field 1 to kubelet
        bytes([0x0A | 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x7E]) + b"\x00",
    ],
)
def test_bytes_the_readings_disagree_on_are_refused(tail: bytes) -> None:
    data = allocresp.encode(envs=(("NVIDIA_VISIBLE_DEVICES", "GPU-1111-2222"),)) + tail
    with pytest.raises(AllocRespError):
        allocresp.strings(data)
    with pytest.raises(AllocRespError):
        allocresp.rewrite(data, lambda w, k, v: v)


def test_a_valid_unknown_field_is_kept_byte_for_byte() -> None:
    data = allocresp.encode(envs=(("A", "GPU-1111-2222"),)) + _field(2**29 - 1, b"keep")
    out = allocresp.rewrite(data, lambda w, k, v: v.replace("1111", "3333"))
    assert out.endswith(_field(2**29 - 1, b"keep")) and b"3333" in out


def test_a_container_path_is_reported_with_its_host_path() -> None:
    data = allocresp.encode(devices=(("/dev/nvidia0", "/dev/nvidia3", "rw"),))
    assert allocresp.strings(data)[:2] == [
        (allocresp.DEVICE_CONTAINER, "/dev/nvidia3", "/dev/nvidia0"),
        (allocresp.DEVICE_HOST, "", "/dev/nvidia3"),
    ]
