"""Kubelet's checkpoint checksum: FNV-1a 32 over go-spew's `%#v` of the Data value.

Kubelet hashes `spew.ConfigState{SortKeys, SpewKeys, DisableMethods}.Sprintf("%#v",
data)` (pkg/util/hash.DeepHashObject). render() reproduces that string; checksum()
computes the same hash without a per-byte Python loop over the parts that repeat.

Why the speed-up is exact: FNV-1a's XOR only touches the low 8 bits of the state and
the multiply carries upward only, so hashing a segment of length m from state h gives
h * P**m + C(h & 255) (mod 2**32). C depends on the segment and the low byte alone: a
256-entry table per segment, computed for all 256 low bytes at once with 64-bit lanes
packed into one Python int. Segments that repeat (the constant parts of every entry,
identical AllocResp blobs, identical device lists) then cost one step each.
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


def _alloc(data: Optional[bytes]) -> str:
    # []uint8 under %#v is a list of decimal numbers (spew's hexdump is %v/Sdump only).
    return "<nil>" if data is None else "[" + " ".join(map(_DEC.__getitem__, data)) + "]"


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


# A rendering cut into segments; bytes stand for an AllocResp value still to render.
Segment = Union[str, bytes]


def _segments(cp: Checkpoint) -> List[Segment]:
    fmt = cp.effective_format()
    dev = _DEV[fmt]
    segs: List[Segment] = []
    if cp.entries is None:
        segs.append(_TOP + "<nil>" + _REG)
    elif not cp.entries:
        segs.append(_TOP + "[]" + _REG)
    else:
        lead = _TOP + "[{PodUID:(string)"
        for e in cp.entries:
            segs.append(lead)
            segs.append(e.pod_uid)  # unique per pod: not worth a table
            segs.append(
                f" ContainerName:(string){e.container_name}"
                f" ResourceName:(string){e.resource_name}{dev}{_devices(e, fmt)}"
                " AllocResp:([]uint8)"
            )
            segs.append(e.alloc_resp if e.alloc_resp is not None else "<nil>")
            lead = "} {PodUID:(string)"
        segs.append("}]" + _REG)
    segs.append(_registered(cp) + "}")
    return segs


def _text(seg: Segment) -> str:
    return _alloc(seg) if isinstance(seg, bytes) else seg


def render(cp: Checkpoint, *, v1_compat: bool = False) -> str:
    """The exact string kubelet hashes for `cp`.

    v1_compat: the string kubelet 1.20-1.30 hashes when it reads a v1 file. It spews
    the V1 types, then replaces the first "checkpointDataV1" and EVERY
    "PodDevicesEntryV1" (even inside IDs) with the v2 names; this differs from what
    1.11-1.19 hashed only when a string contains "PodDevicesEntryV1".
    """
    text = "".join(map(_text, _segments(cp)))
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


def _table(data: bytes) -> Tuple[int, List[int]]:
    """(P**len mod 2**32, C) with fnv(data, h) == (h * P**len + C[h & 255]) & MASK."""
    state = _LANE_START
    for c in data:  # one step hashes `data` from all 256 low bytes at once
        state = ((state ^ _LANE_BYTE[c]) * PRIME) & _LANE_MASK
    mult = pow(PRIME, len(data), 1 << 32)
    lanes = _UNPACK.unpack(state.to_bytes(256 * 8, "little"))
    return mult, [(v - j * mult) & MASK for j, v in enumerate(lanes)]


# A table costs about 30 plain hashes of its segment; build one only past that.
_TABLE_MIN_USES = 32
_TABLE_CACHE_MAX = 512
_tables: Dict[Segment, Tuple[int, List[int]]] = {}


def _cached_table(seg: Segment) -> Tuple[int, List[int]]:
    found = _tables.get(seg)
    if found is None:
        if len(_tables) >= _TABLE_CACHE_MAX:
            _tables.clear()
        found = _tables[seg] = _table(_text(seg).encode("utf-8"))
    return found


def checksum(cp: Checkpoint, *, v1_compat: bool = False) -> int:
    """Kubelet's checksum of `cp` (see render() for v1_compat)."""
    if v1_compat:
        return fnv1a_32(render(cp, v1_compat=True).encode("utf-8"))
    segs = _segments(cp)
    uses = Counter(segs)
    h = OFFSET
    for seg in segs:
        if uses[seg] >= _TABLE_MIN_USES or seg in _tables:
            mult, table = _cached_table(seg)
            h = (h * mult + table[h & 255]) & MASK
        else:
            h = fnv1a_32(_text(seg).encode("utf-8"), h)
    return h
