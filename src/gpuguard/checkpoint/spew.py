"""Kubelet's checkpoint checksum: FNV-1a 32 over go-spew's `%#v` of the Data value.

Kubelet hashes `spew.ConfigState{SortKeys, SpewKeys, DisableMethods}.Sprintf("%#v",
data)` (pkg/util/hash.DeepHashObject). render() reproduces that string; checksum()
computes the same hash without a per-byte Python loop over the parts that repeat.

Why the speed-up is exact: FNV-1a's XOR only touches the low 8 bits of the state and
the multiply carries upward only, so hashing a segment of length m from state h gives
h * P**m + C(h & 255) (mod 2**32). C depends on the segment and the low byte alone: a
256-entry table per segment, computed for all 256 low bytes at once with 64-bit lanes
packed into one Python int. Segments that repeat (the constant parts of every entry,
identical device lists, the top-level protobuf fields of AllocResp values: the same
env for the same GPUs, the same /dev/nvidia* specs) then cost one step each; a cost
model decides which segments get a table. AllocResp bytes nobody repeats are hashed
through per-byte tables of the tokens " 0" .. " 255" (one step per byte).
"""

from __future__ import annotations

import struct
from collections import Counter
from typing import Any, Dict, List, Optional, Tuple, Union

from gpuguard.checkpoint.model import Checkpoint, PodDevicesEntry

OFFSET = 2166136261
PRIME = 16777619
MASK = 0xFFFFFFFF

_DEC = tuple(str(i) for i in range(256))
_TOP = "(checkpoint.checkpointData){PodDeviceEntries:([]checkpoint.PodDevicesEntry)"
_REG = " RegisteredDevices:(map[string][]string)"
_DEV = {"v1": " DeviceIDs:([]string)", "v2": " DeviceIDs:(checkpoint.DevicesPerNUMA)"}


def _first(pair: Tuple[Any, Any]) -> Any:
    return pair[0]


def _ids(ids: Optional[Tuple[str, ...]]) -> str:
    # spew writes strings raw (no quotes, no escapes) and a nil slice as <nil>.
    return "<nil>" if ids is None else "[" + " ".join(ids) + "]"


def _devices(e: PodDevicesEntry, fmt: str) -> str:
    if e.device_ids is None:
        return "<nil>"
    if e.shape not in (None, fmt):
        raise ValueError(f"pod {e.pod_uid}: {e.shape} device IDs in a {fmt} checkpoint")
    if fmt == "v1":
        return _ids(e.device_ids)  # type: ignore[arg-type]
    pairs = e.numa_pairs()
    if len({k for k, _ in pairs}) != len(pairs):
        raise ValueError(f"pod {e.pod_uid}: a NUMA node appears twice in DeviceIDs")
    # SortKeys sorts integer keys numerically: -1 0 1 2 10.
    return "map[" + " ".join(f"{k}:{_ids(v)}" for k, v in sorted(pairs, key=_first)) + "]"


def _registered(cp: Checkpoint) -> str:
    if cp.registered is None:
        return "<nil>"
    if len({k for k, _ in cp.registered}) != len(cp.registered):
        raise ValueError("a resource appears twice in RegisteredDevices")
    # String keys sort byte-wise; code-point order is the same as UTF-8 byte order.
    return "map[" + " ".join(f"{k}:{_ids(v)}" for k, v in sorted(cp.registered, key=_first)) + "]"


def render(cp: Checkpoint, *, v1_compat: bool = False) -> str:
    """The exact string kubelet hashes for `cp`.

    v1_compat: the string kubelet 1.20-1.30 hashes when it reads a v1 file. It spews
    the V1 types, then replaces the first "checkpointDataV1" and EVERY
    "PodDevicesEntryV1" (even inside IDs) with the v2 names; this differs from what
    1.11-1.19 hashed only when a string contains "PodDevicesEntryV1".
    """
    # The checksum's own segments: text, and AllocResp bodies (their brackets are in
    # the text around them): []uint8 under %#v is a list of decimal numbers (spew's
    # hexdump is %v/Sdump only).
    text = "".join(
        seg if isinstance(seg, str) else " ".join(map(_DEC.__getitem__, seg))
        for seg in _hash_segments(cp)
    )
    if v1_compat and cp.effective_format() == "v1":
        text = text.replace("PodDevicesEntryV1", "PodDevicesEntry")
    return text


def fnv1a_32(data: bytes, h: int = OFFSET) -> int:
    """FNV-1a 32 of `data`, continuing from state `h`."""
    # Two bytes per iteration, one mask: the fastest plain loop measured on CPython.
    n = len(data) & ~1
    for a, b in zip(data[0:n:2], data[1:n:2]):
        h = (((h ^ a) * PRIME) ^ b) * PRIME & MASK
    if n != len(data):
        h = (h ^ data[-1]) * PRIME & MASK
    return h


_LANE_ONES = sum(1 << (64 * j) for j in range(256))
_LANE_MASK = _LANE_ONES * MASK
_LANE_START = sum(j << (64 * j) for j in range(256))  # lane j starts at low byte j
_LANE_BYTE = tuple(_LANE_ONES * c for c in range(256))
_UNPACK = struct.Struct("<256Q")
_HIGH = MASK & ~0xFF

# A table: (P**len mod 2**32, lanes) with lanes[j] = fnv(data, j), and then
# fnv(data, h) == ((h & ~255) * P**len + lanes[h & 255]) mod 2**32: the high part of the
# state only ever gets multiplied (it has a zero low byte, so the XORs never touch it).
Table = Tuple[int, Tuple[int, ...]]


def _lanes(data: bytes, state: int = _LANE_START) -> int:
    for c in data:  # one step hashes `data` from all 256 low bytes at once
        state = ((state ^ _LANE_BYTE[c]) * PRIME) & _LANE_MASK
    return state


def _table(data: bytes) -> Table:
    return pow(PRIME, len(data), 1 << 32), _UNPACK.unpack(_lanes(data).to_bytes(2048, "little"))


# AllocResp values: a protobuf ContainerAllocateResponse. Cut at its top-level fields
# (envs, mounts, device specs, annotations), the pieces repeat across entries even when
# whole responses do not (the same /dev/nvidia* specs, the same env for the same GPUs).
# A piece is (first, bytes) and renders as "d d d" (first) or " d d d" (the others).
Piece = Tuple[bool, bytes]


def _varint_end(data: bytes, i: int) -> int:
    n = len(data)
    for k in range(i, min(n, i + 10)):
        if data[k] < 0x80:
            return k + 1
    return -1


def _field_ends(data: bytes) -> Optional[List[int]]:
    """End offsets of `data`'s top-level protobuf fields; None if it is not protobuf."""
    ends = []
    i, n = 0, len(data)
    while i < n:
        j = _varint_end(data, i)
        if j < 0:
            return None
        wire = data[i] & 7
        if wire == 2:
            k = _varint_end(data, j)
            if k < 0:
                return None
            size = 0
            for b in reversed(data[j:k]):
                size = size << 7 | (b & 0x7F)
            i = k + size
        elif wire == 0:
            i = _varint_end(data, j)
            if i < 0:
                return None
        elif wire in (1, 5):
            i = j + (8 if wire == 1 else 4)
        else:
            return None
        if i > n:
            return None
        ends.append(i)
    return ends


_pieces_cache: Dict[bytes, Tuple[Piece, ...]] = {}


def _pieces(data: bytes) -> Tuple[Piece, ...]:
    found = _pieces_cache.get(data)
    if found is None:
        if len(_pieces_cache) >= 4096:
            _pieces_cache.clear()
        ends = _field_ends(data) or [len(data)]
        start, out = 0, []
        for end in ends:
            out.append((start == 0, data[start:end]))
            start = end
        found = _pieces_cache[data] = tuple(out)
    return found


def _piece_text(piece: Piece) -> str:
    text = " ".join(map(_DEC.__getitem__, piece[1]))
    return text if piece[0] else " " + text


# Per-byte tables for the tokens " 0" .. " 255" an AllocResp renders as: with them a
# piece nobody repeats costs one table step per byte instead of ~3.7 character steps.
# Built once per process (about 2 ms), and only when a checksum has that much to hash.
_tokens: Optional[Tuple[Tuple[int, ...], Tuple[Tuple[int, ...], ...]]] = None


def _token_tables() -> Tuple[Tuple[int, ...], Tuple[Tuple[int, ...], ...]]:
    global _tokens
    if _tokens is None:
        prefix = {" ": _lanes(b" ")}
        mults, lanes = [], []
        for text in sorted((" " + d for d in _DEC), key=len):  # " 1" before " 12"
            prefix[text] = _lanes(text[-1:].encode(), prefix[text[:-1]])
        for d in _DEC:
            text = " " + d
            mults.append(pow(PRIME, len(text), 1 << 32))
            lanes.append(_UNPACK.unpack(prefix[text].to_bytes(2048, "little")))
        _tokens = tuple(mults), tuple(lanes)
    return _tokens


def _hash_piece(piece: Piece, h: int) -> int:
    first, data = piece
    if first:
        if not data:
            return h
        h = fnv1a_32(_DEC[data[0]].encode(), h)
        data = data[1:]
    mults, lanes = _token_tables()
    for c in data:
        h = ((h & _HIGH) * mults[c] + lanes[c][h & 255]) & MASK
    return h


# The cost model, in units of one plain FNV step of one character (~80 ns on CPython
# 3.11): a table costs ~17 per character of its segment plus ~100 once, then ~2 a use.
_LANE_COST = 17
_TABLE_FIXED = 100
_STEP_COST = 2
_TOKENS_WORTH = 40_000  # AllocResp bytes to hash by tokens before building them pays off
_TABLE_CACHE_MAX = 4096
_tables: Dict[Union[str, Piece], Table] = {}


def _worth_a_table(size: int, uses: int) -> bool:
    return uses * size > _LANE_COST * size + _TABLE_FIXED + _STEP_COST * uses


def _cached_table(key: Union[str, Piece]) -> Table:
    found = _tables.get(key)
    if found is None:
        if len(_tables) >= _TABLE_CACHE_MAX:
            _tables.clear()
        text = key if isinstance(key, str) else _piece_text(key)
        found = _tables[key] = _table(text.encode("utf-8"))
    return found


# A checksum segment: constant or repeated text, or (bytes) one AllocResp value's body.
Segment = Union[str, bytes]


def _hash_segments(cp: Checkpoint) -> List[Segment]:
    """The rendering of `cp` cut where the parts that repeat across entries begin/end."""
    fmt = cp.effective_format()
    dev = _DEV[fmt]
    segs: List[Segment] = []
    if cp.entries is None:
        segs.append(_TOP + "<nil>" + _REG)
    elif not cp.entries:
        segs.append(_TOP + "[]" + _REG)
    else:
        lead = _TOP + "[{PodUID:(string)"
        devices: Dict[Any, str] = {}
        for e in cp.entries:
            segs.append(lead)
            segs.append(e.pod_uid)  # unique per pod: not worth a table
            segs.append(
                f" ContainerName:(string){e.container_name}"
                f" ResourceName:(string){e.resource_name}{dev}"
            )
            key = e.device_ids
            text = devices.get(key)
            if text is None:
                text = devices[key] = _devices(e, fmt)
            if e.alloc_resp is None:
                segs.append(text + " AllocResp:([]uint8)<nil>")
                lead = "} {PodUID:(string)"
            else:
                segs.append(text + " AllocResp:([]uint8)[")
                segs.append(e.alloc_resp)
                lead = "]} {PodUID:(string)"
        segs.append(("]" if lead[0] == "]" else "") + "}]" + _REG)
    segs.append(_registered(cp) + "}")
    return segs


def checksum(cp: Checkpoint, *, v1_compat: bool = False) -> int:
    """Kubelet's checksum of `cp` (see render() for v1_compat)."""
    if v1_compat:
        return fnv1a_32(render(cp, v1_compat=True).encode("utf-8"))
    segs = _hash_segments(cp)
    uses = Counter(segs)
    tables: Dict[str, Table] = {}
    piece_uses: Counter[Piece] = Counter()
    cuts = {seg: _pieces(seg) for seg in uses if isinstance(seg, bytes)}
    for seg, n in uses.items():
        if isinstance(seg, bytes):
            for piece in cuts[seg]:
                piece_uses[piece] += n
        elif seg in _tables or _worth_a_table(len(seg), n):
            tables[seg] = _cached_table(seg)
    # Each AllocResp value: its pieces, each with a table or None (hash it plainly).
    programs: Dict[bytes, List[Tuple[Optional[Table], Piece]]] = {}
    plain_bytes = 0
    for seg, n in uses.items():
        if isinstance(seg, bytes):
            program = programs[seg] = []
            for piece in cuts[seg]:
                if piece in _tables or _worth_a_table(4 * len(piece[1]), piece_uses[piece]):
                    program.append((_cached_table(piece), piece))
                else:
                    program.append((None, piece))
                    plain_bytes += n * len(piece[1])
    tokens = _tokens is not None or plain_bytes > _TOKENS_WORTH
    h = OFFSET
    for seg in segs:
        if isinstance(seg, str):
            t = tables.get(seg)
            if t is None:
                h = fnv1a_32(seg.encode("utf-8"), h)
            else:
                h = ((h & _HIGH) * t[0] + t[1][h & 255]) & MASK
            continue
        for t, piece in programs[seg]:
            if t is not None:
                h = ((h & _HIGH) * t[0] + t[1][h & 255]) & MASK
            elif tokens:
                h = _hash_piece(piece, h)
            else:
                h = fnv1a_32(_piece_text(piece).encode("utf-8"), h)
    return h


def clear_caches() -> None:
    """Forget every table and cut (benchmarks: make a run pay what a fresh process pays)."""
    global _tokens
    _tables.clear()
    _pieces_cache.clear()
    _tokens = None
