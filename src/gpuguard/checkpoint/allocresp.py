"""A checkpoint entry's AllocResp: the device plugin's protobuf ContainerAllocateResponse.

Kubelet stores the plugin's answer to Allocate and replays it whenever it (re)creates the
container, so after a GPU got a new identity the answer must name the new one too. The
message (k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1, api.proto) is small and stable:

    1 envs         map<string, string>          (entry: 1 key, 2 value)
    2 mounts       repeated Mount               (1 container_path, 2 host_path, 3 read_only)
    3 devices      repeated DeviceSpec          (1 container_path, 2 host_path, 3 permissions)
    4 annotations  map<string, string>
    5 cdi_devices  repeated CDIDevice           (1 name)

Read and written with a hand-written walk of the wire format rather than the protobuf
library: rewrite() changes only the strings it is asked to change and keeps every other
byte where it was (field order, unknown fields, a plugin's own encoding choices), which
a decode and re-encode through generated classes would not; and gpuguard needs no
protobuf runtime (a compiled extension) on every node for five fields. A message that
does not follow the wire format, or that gives one of the fields above a wire type Go's
generated decoder would reject, is an AllocRespError: kubelet itself skips such an
entry ("Can't unmarshal allocResp"), and gpuguard does not rewrite what it cannot read.

Field numbers are read as kubelet's gogo-generated decoder reads them: the tag is a
64-bit varint and `fieldNum := int32(wire >> 3)`, so field 2^32+1 IS field 1 (Envs) to
kubelet while a reader of the protobuf specification sees an unknown field, and
another decoder refuses it (the largest valid number is 2^29-1). Bytes on which such
readings disagree are an AllocRespError too (a tag past 2^29-1, a group, which gogo
skips and others check), so a variable hidden from one reading never survives a
rewrite made from the other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple

from gpuguard.host.protowire import field

LEN = 2  # the length-delimited wire type
VARINT = 0
_MAX_DEPTH_FIELDS = 100_000  # far above any real response (a few dozen fields)
MAX_FIELD = 2**29 - 1  # the protobuf specification's largest field number
_U64 = 2**64 - 1

# Where a string sits in the message, as rewrite() names it to its callback.
ENV = "env"  # key: the variable's name
ANNOTATION = "annotation"  # key: the annotation's name
MOUNT_CONTAINER, MOUNT_HOST = "mount.container_path", "mount.host_path"
DEVICE_CONTAINER, DEVICE_HOST = "device.container_path", "device.host_path"
DEVICE_PERMISSIONS = "device.permissions"
CDI_NAME = "cdi.name"

# (field number of the top-level message) -> the strings of its sub-message by number
_SUB: dict[int, dict[int, str]] = {
    2: {1: MOUNT_CONTAINER, 2: MOUNT_HOST},
    3: {1: DEVICE_CONTAINER, 2: DEVICE_HOST, 3: DEVICE_PERMISSIONS},
    5: {1: CDI_NAME},
}
_MAPS = {1: ENV, 4: ANNOTATION}
# Scalar fields of the sub-messages, with the wire type Go's decoder requires.
_SCALARS = {2: {3: VARINT}}  # Mount.read_only


class AllocRespError(ValueError):
    """The bytes are not a ContainerAllocateResponse gpuguard can read."""


class ReadingsDisagree(AllocRespError):
    """Bytes kubelet's decoder and another reading of the wire format read differently."""


# One string of the message: (where, key, value); key is the map key for envs and
# annotations, the host path of the same mount or device for a container path, ""
# elsewhere.
Text = Tuple[str, str, str]
Fix = Callable[[str, str, str], str]


@dataclass(frozen=True)
class _Field:
    number: int
    wire: int
    start: int  # of the tag
    body: int  # of the payload (after a length prefix)
    end: int


def _varint(data: bytes, i: int) -> Tuple[int, int]:
    """A varint read as kubelet's gogo decoder reads it, refusing what other decoders
    read otherwise (the writing side is host/protowire.py's)."""
    value = shift = 0
    for k in range(i, min(len(data), i + 10)):
        b = data[k]
        if shift == 63 and b > 1:  # past 64 bits: gogo drops the bits, others refuse
            raise ReadingsDisagree("a varint past 64 bits: decoders disagree on it")
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value & _U64, k + 1  # Go's uint64: the 10th byte's high bits fall off
        shift += 7
    raise AllocRespError("a varint runs past its end or past 10 bytes")


def _fields(data: bytes) -> List[_Field]:
    out = []
    i, n = 0, len(data)
    while i < n:
        tag, j = _varint(data, i)
        number, wire = tag >> 3, tag & 7
        gogo = (number & 0xFFFFFFFF) - (1 << 32 if number & 0x80000000 else 0)  # int32()
        if wire == 4:
            raise AllocRespError(f"an end-group tag (field {number}) outside a group")
        if number == 0 or gogo <= 0:
            raise AllocRespError(f"field number {number} (kubelet's decoder refuses it)")
        if number > MAX_FIELD:
            raise ReadingsDisagree(
                f"field number {number}, which kubelet's decoder reads as field {gogo} and "
                f"other decoders refuse: the readings disagree"
            )
        if wire == LEN:
            size, body = _varint(data, j)
            end = body + size
        elif wire == VARINT:
            body = j
            end = _varint(data, j)[1]
        elif wire in (1, 5):
            body = j
            end = j + (8 if wire == 1 else 4)
        elif wire == 3:  # kubelet's decoder skips a group unchecked, others match its end
            raise ReadingsDisagree(f"a group (field {number}): decoders disagree on groups")
        else:  # the undefined 6, 7
            raise AllocRespError(f"wire type {wire} (field {number})")
        if end > n:
            raise AllocRespError(f"field {number} runs past the end of the message")
        out.append(_Field(number, wire, i, body, end))
        if len(out) > _MAX_DEPTH_FIELDS:
            raise AllocRespError("too many fields")
        i = end
    return out


def _text(data: bytes, f: _Field) -> str:
    # Go's decoder of this API does not check UTF-8; keep any byte as it is.
    return data[f.body : f.end].decode("utf-8", "surrogateescape")


def _sub(data: bytes, top: int, fix: Optional[Fix], out: List[Text]) -> Optional[bytes]:
    """A Mount, DeviceSpec or CDIDevice: its strings reported (and fixed: the new bytes,
    or None when nothing changed)."""
    names, scalars = _SUB[top], _SCALARS.get(top, {})
    parts: List[bytes] = []
    changed = False
    fields = _fields(data)
    # a container path's key is the host path of the same mount or device (the last
    # one, as Go keeps it): the caller tells the plugin's own name from a host path
    host = next((f for f in reversed(fields) if f.number == 2 and f.wire == LEN), None)
    host_path = "" if host is None or top == 5 else _text(data, host)
    for f in fields:
        where = names.get(f.number)
        if where is not None:
            if f.wire != LEN:
                raise AllocRespError(f"{where} has wire type {f.wire}")
            old = _text(data, f)
            key = host_path if f.number == 1 else ""
            out.append((where, key, old))
            new = fix(where, key, old) if fix is not None else old
            if new != old:
                parts.append(field(f.number, new.encode("utf-8", "surrogateescape")))
                changed = True
                continue
        elif f.number in scalars and f.wire != scalars[f.number]:
            raise AllocRespError(f"field {top}.{f.number} has wire type {f.wire}")
        parts.append(data[f.start : f.end])
    return b"".join(parts) if changed else None


def _map_entry(data: bytes, where: str, fix: Optional[Fix], out: List[Text]) -> Optional[bytes]:
    key = value = ""
    value_field: Optional[_Field] = None
    fields = _fields(data)
    for f in fields:
        if f.number in (1, 2) and f.wire != LEN:
            raise AllocRespError(f"a {where} entry has wire type {f.wire}")
        if f.number == 1:
            key = _text(data, f)
        elif f.number == 2:
            value, value_field = _text(data, f), f
    out.append((where, key, value))
    new = fix(where, key, value) if fix is not None else value
    if new == value:
        return None
    # Go keeps the last value of a repeated field: change that one, keep the rest.
    parts = []
    for f in fields:
        if f is value_field:
            parts.append(field(2, new.encode("utf-8", "surrogateescape")))
        else:
            parts.append(data[f.start : f.end])
    if value_field is None:  # an entry without a value: its value is ""
        parts.append(field(2, new.encode("utf-8", "surrogateescape")))
    return b"".join(parts)


def _walk(data: bytes, fix: Optional[Fix]) -> Tuple[List[Text], Optional[bytes]]:
    texts: List[Text] = []
    parts: List[bytes] = []
    changed = False
    for f in _fields(data):
        if f.number in _MAPS or f.number in _SUB:
            if f.wire != LEN:
                raise AllocRespError(f"field {f.number} has wire type {f.wire}")
            body = data[f.body : f.end]
            if f.number in _MAPS:
                new = _map_entry(body, _MAPS[f.number], fix, texts)
            else:
                new = _sub(body, f.number, fix, texts)
            if new is not None:
                parts.append(field(f.number, new))
                changed = True
                continue
        parts.append(data[f.start : f.end])
    return texts, (b"".join(parts) if changed else None)


def strings(data: bytes) -> List[Text]:
    """Every string of the response the API defines, in wire order: (where, key, value)."""
    return _walk(data, None)[0]


def rewrite(data: bytes, fix: Fix) -> bytes:
    """`data` with each string value replaced by fix(where, key, value). Strings fix()
    returns unchanged keep their bytes, and so does everything else; with no change at
    all the result is `data` itself. Map keys are never changed."""
    new = _walk(data, fix)[1]
    return data if new is None else new


def encode(
    envs: Tuple[Tuple[str, str], ...] = (),
    devices: Tuple[Tuple[str, str, str], ...] = (),
    mounts: Tuple[Tuple[str, str, bool], ...] = (),
    annotations: Tuple[Tuple[str, str], ...] = (),
    cdi_devices: Tuple[str, ...] = (),
) -> bytes:
    """A response in the field order Go's generated marshaller writes (envs, mounts,
    devices, annotations, CDI devices; map entries as given): for tests and benchmarks."""

    def kv(number: int, k: str, v: str) -> bytes:
        return field(number, field(1, k.encode()) + field(2, v.encode()))

    out = b"".join(kv(1, k, v) for k, v in envs)
    for container, host, ro in mounts:
        m = field(1, container.encode()) + field(2, host.encode())
        out += field(2, m + (b"\x18\x01" if ro else b""))
    for container, host, perms in devices:
        d = field(1, container.encode()) + field(2, host.encode())
        out += field(3, d + field(3, perms.encode()))
    out += b"".join(kv(4, k, v) for k, v in annotations)
    out += b"".join(field(5, field(1, name.encode())) for name in cdi_devices)
    return out
