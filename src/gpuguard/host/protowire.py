"""Protobuf's wire format, the little of it gpuguard speaks: varints and length-delimited
fields (strings, bytes, nested messages) out, length-delimited fields back in.

The re-admission bridge encodes deviceplugin v1beta1 messages (readmit/wire.py) and the
device plugin step decodes kubelet's podresources answer (steps/device_plugin/
podresources.py) with it, instead of python3-protobuf and code generated from kubelet's
``api.proto`` files: a few messages of strings and nested messages need no more.
"""

from __future__ import annotations

VARINT, FIXED64, LENGTH_DELIMITED, FIXED32 = 0, 1, 2, 5
_FIXED_SIZE = {FIXED64: 8, FIXED32: 4}


def varint(n: int) -> bytes:
    """`n` (>= 0) as a base-128 varint."""
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def field(number: int, payload: bytes) -> bytes:
    """A length-delimited field: a string's UTF-8, bytes, or an encoded message."""
    return varint(number << 3 | LENGTH_DELIMITED) + varint(len(payload)) + payload


def text(number: int, value: str) -> bytes:
    """A string field; nothing for "" (proto3 leaves a default value out)."""
    return field(number, value.encode()) if value else b""


def fields(data: bytes) -> dict[int, list[bytes]]:
    """Field number -> its length-delimited values, in order; varint and fixed-width
    fields are skipped. ValueError on a truncated message or a wire type proto3 does
    not have (groups, 6, 7)."""
    out: dict[int, list[bytes]] = {}
    i = 0

    def read_varint() -> int:
        nonlocal i
        shift = value = 0
        while True:
            if i >= len(data) or shift > 63:
                raise ValueError("truncated varint")
            b = data[i]
            i += 1
            value |= (b & 0x7F) << shift
            shift += 7
            if not b & 0x80:
                return value

    while i < len(data):
        key = read_varint()
        kind = key & 7
        if kind == VARINT:
            read_varint()
            continue
        n = _FIXED_SIZE.get(kind)
        if n is None:
            if kind != LENGTH_DELIMITED:
                raise ValueError(f"wire type {kind}")
            n = read_varint()
        if i + n > len(data):
            raise ValueError("truncated field")
        if kind == LENGTH_DELIMITED:
            out.setdefault(key >> 3, []).append(data[i : i + n])
        i += n
    return out
