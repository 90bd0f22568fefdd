"""Protobuf's wire format as gpuguard writes and reads it (host/protowire.py)."""

from __future__ import annotations

import pytest

from gpuguard.host.protowire import field, fields, text, varint


@pytest.mark.parametrize(
    ("n", "encoded"),
    [(0, b"\x00"), (1, b"\x01"), (127, b"\x7f"), (128, b"\x80\x01"), (300, b"\xac\x02")],
)
def test_varints_as_protobuf_documents_them(n: int, encoded: bytes) -> None:
    assert varint(n) == encoded


def test_fields_round_trip_in_order_and_nested() -> None:
    inner = text(1, "GPU-a") + text(2, "Healthy")
    data = field(1, inner) + field(1, b"") + text(3, "x" * 300) + text(4, "")
    got = fields(data)
    assert got == {1: [inner, b""], 3: [b"x" * 300]}  # "" is left out, as proto3 does
    assert fields(got[1][0]) == {1: [b"GPU-a"], 2: [b"Healthy"]}


def test_varint_and_fixed_width_fields_are_skipped() -> None:
    data = varint(2 << 3) + varint(1 << 40) + varint(9 << 3 | 1) + bytes(8)
    data += varint(9 << 3 | 5) + bytes(4) + text(1, "a")
    assert fields(data) == {1: [b"a"]}


@pytest.mark.parametrize(
    "data",
    [
        text(1, "abc")[:-1],  # a value shorter than its length
        b"\x0a\x80",  # a length varint cut short
        b"\x80" * 11,  # a varint longer than 64 bits
        varint(1 << 3 | 3),  # a group: not in proto3
        varint(1 << 3 | 1) + bytes(7),  # a fixed64 cut short
    ],
)
def test_malformed_messages_are_value_errors(data: bytes) -> None:
    with pytest.raises(ValueError):
        fields(data)
