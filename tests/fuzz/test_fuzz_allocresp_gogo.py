"""Differential: the AllocResp walker against a model of kubelet's gogo-generated decoder.

`gogo_envs` follows the generated `ContainerAllocateResponse.Unmarshal` and `skipApi`
of k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1 (api.pb.go): a 64-bit tag varint,
`fieldNum := int32(wire >> 3)`, end-group and non-positive numbers refused, Envs map
entries read without a wire-type check, unknown fields skipped (groups included).
Whatever bytes are drawn (valid envs, unknown fields with numbers up to 2^64, groups,
stray bytes), when the walker reads a message, kubelet reads the same environment: a
variable can never be hidden from the walker and seen by kubelet.
"""

from __future__ import annotations

from typing import Optional

from hypothesis import assume, event, example, given
from hypothesis import strategies as st

from fuzz.budget import budget
from gpuguard.checkpoint import allocresp
from gpuguard.checkpoint.allocresp import AllocRespError
from gpuguard.host.protowire import varint as _encode_varint


class GoError(Exception):
    pass


def _uvarint(data: bytes, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if shift >= 64:
            raise GoError("ErrIntOverflow")
        if i >= len(data):
            raise GoError("unexpected EOF")
        b = data[i]
        i += 1
        value |= ((b & 0x7F) << shift) & (2**64 - 1)
        if b < 0x80:
            return value, i
        shift += 7


def _int32(v: int) -> int:
    v &= 0xFFFFFFFF
    return v - 2**32 if v & 0x80000000 else v


def _int64(v: int) -> int:
    return v - 2**64 if v & (1 << 63) else v


def _skip(data: bytes) -> int:
    i, depth = 0, 0
    while i < len(data):
        wire, i = _uvarint(data, i)
        wt = wire & 7
        if wt == 0:
            _, i = _uvarint(data, i)
        elif wt == 1:
            i += 8
        elif wt == 2:
            n, i = _uvarint(data, i)
            if _int64(n) < 0:
                raise GoError("ErrInvalidLength")
            i += _int64(n)
        elif wt == 3:
            depth += 1
        elif wt == 4:
            if depth == 0:
                raise GoError("unexpected end of group")
            depth -= 1
        elif wt == 5:
            i += 4
        else:
            raise GoError("illegal wireType")
        if depth == 0:
            return i
    raise GoError("unexpected EOF")


def _length(data: bytes, i: int, end: int) -> tuple[int, int]:
    n, i = _uvarint(data, i)
    n = _int64(n)
    if n < 0 or i + n > end:
        raise GoError("bad length")
    return i + n, i


def gogo_envs(data: bytes) -> Optional[dict[bytes, bytes]]:
    """The Envs kubelet reads; None when it refuses the message (or it has a field this
    model does not decode: mounts, devices, annotations, CDI devices)."""
    envs: dict[bytes, bytes] = {}
    i, n = 0, len(data)
    while i < n:
        pre = i
        wire, i = _uvarint(data, i)
        num, wt = _int32(wire >> 3), wire & 7
        if wt == 4 or num <= 0:
            raise GoError("illegal tag")
        if num == 1:
            if wt != 2:
                raise GoError("wrong wireType for Envs")
            post, i = _length(data, i, n)
            key = value = b""
            while i < post:
                epre = i
                w, i = _uvarint(data, i)
                f = _int32(w >> 3)
                if f in (1, 2):
                    end, i = _length(data, i, post)
                    if f == 1:
                        key = data[i:end]
                    else:
                        value = data[i:end]
                    i = end
                else:
                    skip = _skip(data[epre:])
                    if epre + skip > post:
                        raise GoError("EOF")
                    i = epre + skip
            envs[key] = value
            i = post
        elif num in (2, 3, 4, 5):
            return None
        else:
            skip = _skip(data[pre:])
            if pre + skip > n:
                raise GoError("EOF")
            i = pre + skip
    return envs


def _tag(num: int, wt: int) -> bytes:
    return _encode_varint(((num << 3) | wt) & (2**64 - 1))


numbers = st.one_of(
    st.integers(6, 20),
    st.integers(6, 20), st.sampled_from([2**29 - 1, 2**29, 2**31 - 1, 2**31, 2**32 + 1,
                                         2**32 + 4, 2**61 - 1]),
)  # fmt: skip


@st.composite
def pieces(draw: st.DrawFn) -> bytes:
    kind = draw(st.sampled_from(["env"] * 4 + ["unknown"] * 3 + ["group", "raw"]))
    if kind == "env":
        k, v = draw(st.binary(max_size=6)), draw(st.binary(max_size=6))
        body = _tag(1, 2) + _encode_varint(len(k)) + k + _tag(2, 2) + _encode_varint(len(v)) + v
        return _tag(draw(st.sampled_from([1, 2**32 + 1])), 2) + _encode_varint(len(body)) + body
    if kind == "unknown":
        num, wt = draw(numbers), draw(st.sampled_from([0, 1, 2, 5]))
        payload = {0: b"\x01", 1: b"\x00" * 8, 2: b"\x02hi", 5: b"\x00" * 4}[wt]
        return _tag(num, wt) + payload
    if kind == "group":
        num = draw(numbers)
        return _tag(num, 3) + _tag(draw(numbers), 0) + b"\x01" + _tag(num, 4)
    return draw(st.binary(max_size=4))


_ENTRY = _tag(1, 2) + bytes([22]) + b"NVIDIA_VISIBLE_DEVICES" + _tag(2, 2) + bytes([10])
HIDDEN = _tag(2**32 + 1, 2) + bytes([36]) + _ENTRY + b"GPU-dead-1"  # kubelet: field 1


@given(st.lists(pieces(), max_size=6).map(b"".join))
@example(HIDDEN)
@budget(400)
def test_the_walker_reads_the_envs_kubelet_reads(data: bytes) -> None:
    try:
        texts = allocresp.strings(data)
    except AllocRespError:
        event("refused by the walker")
        return  # refused: never rewritten, the entry dropped with why
    try:
        kubelet = gogo_envs(data)
    except GoError:
        event("refused by kubelet only")
        return  # kubelet skips the entry itself
    assume(kubelet is not None)
    event("read by both: envs compared")
    mine = {}
    for where, key, value in texts:
        if where == allocresp.ENV:
            mine[key.encode("utf-8", "surrogateescape")] = value.encode("utf-8", "surrogateescape")
    assert mine == kubelet
