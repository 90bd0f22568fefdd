"""Read and write the checkpoint exactly as kubelet's Go code does.

parse() mimics `json.Unmarshal` into kubelet's pre-filled structs (entries `[]`,
registered `{}`), including Go's quirks: case-insensitive field names, null leaves a
value untouched, a repeated key decodes into what is already there (maps merge, slice
elements are reused), invalid UTF-8 and lone surrogates become U+FFFD. Kubelet 1.20-1.30
tries the v2 types first and the v1 types when that fails; so do we. marshal() writes
the bytes Go's `json.Marshal` would.
"""

from __future__ import annotations

import base64
import codecs
import json
import re
from typing import Any, Dict, List, Optional, Tuple

from gpuguard.checkpoint import spew
from gpuguard.checkpoint.model import Checkpoint, PodDevicesEntry
from gpuguard.errors import BadInputError
from gpuguard.host.numparse import clip, cut, parse_decimal

NEXT_STEP = "restore a backup from /var/lib/gpuguard/backups or let kubelet rebuild it"


def _go_replace(exc: UnicodeError) -> Tuple[str, int]:
    # Go's decoder turns each byte of an invalid sequence into its own U+FFFD
    # (utf8.DecodeRune consumes one byte on error); Python's "replace" would
    # merge a truncated sequence into one.
    assert isinstance(exc, UnicodeDecodeError)
    return "\ufffd", exc.start + 1


codecs.register_error("gpuguard-go-utf8", _go_replace)

_SURROGATE = re.compile("[\ud800-\udfff]")
_UINT = re.compile(r"[0-9]+\Z")
_INT = re.compile(r"[+-]?[0-9]+\Z")  # strconv.ParseInt(s, 10, 64) syntax
_B64 = re.compile(r"(?:[A-Za-z0-9+/]{4})*(?:[A-Za-z0-9+/]{2}==|[A-Za-z0-9+/]{3}=)?\Z")


class _Obj(list):  # type: ignore[type-arg]
    """A JSON object as its (key, value) pairs, duplicates and order kept."""


class _Num(str):
    """A JSON number's text: Go checks it against the target type itself."""


class _TypeError(Exception):
    """Go's UnmarshalTypeError: valid JSON that does not fit kubelet's types."""


def _fold(name: str) -> str:
    # encoding/json matches field names with Unicode case folding: "checksum",
    # "CHECKSUM" and "Chec\u212asum" (Kelvin sign) all name Checksum.
    out = []
    for c in name:
        u = c.upper() if c < "\x80" else c.lower().upper()
        out.append(u if len(u) == 1 else c)
    return "".join(out)


def _fields(*names: str) -> Dict[str, str]:
    # Exact names first (the common case, no folding needed), then folded ones.
    return {**{_fold(n): n for n in names}, **{n: n for n in names}}


_TOP_FIELDS = _fields("Data", "Checksum", "BootID")
_DATA_FIELDS = _fields("PodDeviceEntries", "RegisteredDevices")
_ENTRY_FIELDS = _fields("PodUID", "ContainerName", "ResourceName", "DeviceIDs", "AllocResp")


def _clean(s: str) -> str:
    # Python's json keeps a lone \ud800 escape; Go writes U+FFFD for it.
    return _SURROGATE.sub("\ufffd", s) if _SURROGATE.search(s) else s


def _string(value: Any, old: str, where: str) -> str:
    if value is None:  # null into a Go string: no-op
        return old
    if not isinstance(value, str) or isinstance(value, _Num):
        raise _TypeError(f"{where} is not a string")
    return _clean(value)


def _strings(value: Any, old: Optional[List[str]], where: str) -> Optional[List[str]]:
    """A JSON array into a Go []string (nil for null); elements decode into old ones."""
    if value is None:
        return None
    if not isinstance(value, list) or isinstance(value, _Obj):
        raise _TypeError(f"{where} is not a list of strings")
    if not value:  # Go replaces a slice decoded from [] with a fresh empty one
        return _Slice([], 0)
    backing = old if old is not None else []
    for i, item in enumerate(value):
        if i == len(backing):
            backing.append("")
        backing[i] = _string(item, backing[i], where)
    # Go keeps the elements past the new length in the backing array (and reuses them
    # if a later duplicate key grows the slice again): keep them, remember the length.
    return _Slice(backing, len(value))


class _Slice(list):  # type: ignore[type-arg]
    """A Go slice: the visible elements plus reusable ones past its length."""

    def __init__(self, backing: List[Any], length: int) -> None:
        super().__init__(backing[:length])
        self.spare = backing[length:]

    def backing(self) -> List[Any]:
        return [*self, *self.spare]


def _old(value: Optional[List[Any]]) -> Optional[List[Any]]:
    return value.backing() if isinstance(value, _Slice) else value


def _b64(value: Any, old: Optional[bytes], where: str) -> Optional[bytes]:
    if value is None:
        return None
    if not isinstance(value, str) or isinstance(value, _Num):
        raise _TypeError(f"{where} is not a base64 string")
    text = value.replace("\r", "").replace("\n", "")  # Go's base64 skips CR and LF
    try:
        data = base64.b64decode(text, validate=True)
    except ValueError:  # binascii.Error, or a plain ValueError for non-ASCII text
        data = None
    # Python tolerates data after the padding; Go does not. A canonical round trip is
    # the fast proof, the pattern the slow one (Go ignores non-zero trailing bits).
    if data is None or (base64.b64encode(data) != text.encode() and not _B64.match(text)):
        raise _TypeError(f"{where} is not standard padded base64")
    return data


def _map(value: Any, old: Optional[Dict[Any, Any]], where: str, key: Any) -> Any:
    """A JSON object into a Go map: null gives nil, keys merge into an existing map."""
    if value is None:
        return None
    if not isinstance(value, _Obj):
        raise _TypeError(f"{where} is not an object")
    out = old if old is not None else {}
    for k, v in value:
        # Map values are decoded into a fresh zero value each time.
        out[key(_clean(k), where)] = _strings(v, None, f"{where}[{clip(k)}]")
    return out


def _numa_key(k: str, where: str) -> int:
    n = parse_decimal(k, lo=-(2**63), hi=2**63 - 1, signed=True) if _INT.match(k) else None
    if n is None:
        raise _TypeError(f"{where} has NUMA node key {clip(k)}, not an int64")
    return n


def _struct(value: Any, fields: Dict[str, str], where: str) -> List[Tuple[str, Any]]:
    """The (field, value) pairs Go assigns, in order; unknown keys are skipped."""
    if not isinstance(value, _Obj):
        raise _TypeError(f"{where} is not an object")
    out = []
    for k, v in value:
        name = fields.get(k) or fields.get(_fold(k))
        if name is not None:
            out.append((name, v))
    return out


def _entry(value: Any, e: Dict[str, Any], fmt: str, where: str) -> None:
    if value is None:  # null into a struct: no-op
        return
    for name, v in _struct(value, _ENTRY_FIELDS, where):
        if name == "DeviceIDs":
            old = e.get(name)
            if fmt == "v2":
                e[name] = _map(v, old, f"{where}.DeviceIDs", _numa_key)
            else:
                e[name] = _strings(v, _old(old), f"{where}.DeviceIDs")
        elif name == "AllocResp":
            e[name] = _b64(v, e.get(name), f"{where}.AllocResp")
        else:
            e[name] = _string(v, e.get(name, ""), f"{where}.{name}")


def _entries(value: Any, old: Optional[List[Dict[str, Any]]], fmt: str) -> Any:
    if value is None:
        return None
    if not isinstance(value, list) or isinstance(value, _Obj):
        raise _TypeError("Data.PodDeviceEntries is not a list")
    if not value:
        return _Slice([], 0)
    backing = _old(old) or []
    for i, item in enumerate(value):
        if i == len(backing):
            backing.append({})
        # Go decodes into the existing element: fields the object lacks keep old values.
        _entry(item, backing[i], fmt, f"Data.PodDeviceEntries[{i}]")
    return _Slice(backing, len(value))


def _decode(tree: Any, fmt: str) -> Dict[str, Any]:
    """Go's json.Unmarshal of `tree` into kubelet's pre-filled v1 or v2 Data struct."""
    top: Dict[str, Any] = {"entries": _Slice([], 0), "registered": {}, "checksum": None}
    if tree is None:
        return top
    for name, v in _struct(tree, _TOP_FIELDS, "the file"):
        if name == "Checksum":
            if v is None:
                continue
            n = parse_decimal(v) if isinstance(v, _Num) and _UINT.match(v) else None
            if n is None:
                raise _TypeError(f"Checksum {_show(v)} is not an unsigned 64-bit integer")
            top["checksum"] = n
        elif name == "BootID":
            if fmt == "v2":  # only the newest (v2-only) kubelets have this field
                top["boot_id"] = _string(v, top.get("boot_id", ""), "BootID")
        elif v is not None:
            for dname, dv in _struct(v, _DATA_FIELDS, "Data"):
                if dname == "PodDeviceEntries":
                    top["entries"] = _entries(dv, top["entries"], fmt)
                else:
                    top["registered"] = _map(
                        dv, top["registered"], "Data.RegisteredDevices", lambda k, _w: k
                    )
    return top


def _show(v: Any) -> str:
    if isinstance(v, (_Num, str)) and not isinstance(v, _Obj):
        return cut(str(v) if isinstance(v, _Num) else json.dumps(v))
    return "null" if v is None else type(v).__name__


def _ids(v: Optional[List[str]]) -> Optional[Tuple[str, ...]]:
    return None if v is None else tuple(v)


def _build(top: Dict[str, Any], fmt: str) -> Checkpoint:
    entries: Optional[Tuple[PodDevicesEntry, ...]] = None
    if top["entries"] is not None:
        out = []
        for e in top["entries"]:
            dev = e.get("DeviceIDs")
            if dev is None:
                ids: Any = None
            elif fmt == "v2":
                ids = tuple((k, _ids(v)) for k, v in dev.items())
            else:
                ids = tuple(dev)
            out.append(
                PodDevicesEntry(
                    e.get("PodUID", ""),
                    e.get("ContainerName", ""),
                    e.get("ResourceName", ""),
                    ids,
                    e.get("AllocResp"),
                )
            )
        entries = tuple(out)
    reg = top["registered"]
    registered = None if reg is None else tuple((k, _ids(v)) for k, v in reg.items())
    return Checkpoint(fmt, entries, registered, top["checksum"], top.get("boot_id") or None)


def _reject(_: str) -> Any:
    raise ValueError("NaN and Infinity are not JSON")


def _load_json(data: bytes) -> Any:
    text = data.decode("utf-8", "gpuguard-go-utf8")
    return json.loads(
        text, object_pairs_hook=_Obj, parse_int=_Num, parse_float=_Num, parse_constant=_reject
    )


def parse(data: bytes, *, source: str) -> Checkpoint:
    """The checkpoint in `data` as kubelet reads it; BadInputError naming `source`."""
    broken = f"kubelet cannot load it and will start with no device allocations — {NEXT_STEP}"
    if not data.strip(b" \t\r\n"):
        raise BadInputError(f"{source}: is empty; {broken}")
    try:
        tree = _load_json(data)
    except json.JSONDecodeError as e:
        cut = e.msg.startswith("Unterminated") or e.pos >= len(e.doc.rstrip())
        what = "is truncated" if cut else "is not valid JSON"
        raise BadInputError(f"{source}: {what} ({e.msg} at character {e.pos}); {broken}") from None
    except (ValueError, RecursionError) as e:
        raise BadInputError(f"{source}: is not valid JSON ({e}); {broken}") from None
    try:
        top, fmt = _decode(tree, "v2"), "v2"
    except _TypeError as v2_error:
        try:  # kubelet 1.20-1.30 retry a file that fails as v2 with the v1 types
            top, fmt = _decode(tree, "v1"), "v1"
        except _TypeError as v1_error:
            what = str(v2_error)
            if "DeviceIDs is not an object" in what and "DeviceIDs is not a list" in str(v1_error):
                what = "mixes v1 (list) and v2 (per-NUMA object) DeviceIDs"
            raise BadInputError(f"{source}: {what}; {broken}") from None
    if top["checksum"] is None:
        raise BadInputError(f"{source}: has no Checksum; {broken}")
    cp = _build(top, fmt)
    entries = cp.entries or ()
    if not entries:
        return Checkpoint("any", cp.entries, cp.registered, cp.checksum, cp.boot_id)
    if fmt == "v2" and all(e.device_ids is None for e in entries) and not verify(cp):
        # Nil DeviceIDs fit both types; kubelet settles it by which checksum matches.
        v1 = Checkpoint("v1", cp.entries, cp.registered, cp.checksum)
        if verify(v1):
            return v1
    return cp


def verify(cp: Checkpoint) -> bool:
    """Whether kubelet accepts the stored checksum."""
    if spew.checksum(cp) == cp.checksum:
        return True
    return cp.effective_format() == "v1" and spew.checksum(cp, v1_compat=True) == cp.checksum


def _escape(text: str) -> str:
    # Go's encoder is HTML-safe and escapes the JavaScript line separators.
    for raw, esc in (
        ("<", "\\u003c"),
        (">", "\\u003e"),
        ("&", "\\u0026"),
        ("\u2028", "\\u2028"),
        ("\u2029", "\\u2029"),
    ):
        if raw in text:
            text = text.replace(raw, esc)
    return text


def _b64out(data: Optional[bytes]) -> Optional[str]:
    return None if data is None else base64.b64encode(data).decode("ascii")


def _json_ids(ids: Optional[Tuple[str, ...]]) -> Optional[List[str]]:
    return None if ids is None else list(ids)


def marshal(cp: Checkpoint, *, checksum: Optional[int] = None) -> bytes:
    """The bytes kubelet writes for `cp` (Go json.Marshal), with a fresh checksum
    unless `checksum` is given. A v1 checkpoint is written as 1.11-1.19 wrote it."""
    fmt = cp.effective_format()
    if checksum is None:
        checksum = spew.checksum(cp)
    if not 0 <= checksum < 2**64:
        raise ValueError(f"checksum {checksum} is not an unsigned 64-bit integer")
    if fmt == "v1" and cp.boot_id:
        raise ValueError("v1 checkpoints have no BootID")
    entries = None
    if cp.entries is not None:
        entries = []
        for e in cp.entries:
            spew._devices(e, fmt)  # the same shape checks as the checksum
            dev: Any = e.device_ids
            if dev is not None and fmt == "v2":
                # Go sorts map keys by their text: "-1" < "0" < "10" < "2".
                dev = {str(k): _json_ids(v) for k, v in sorted(dev, key=lambda p: str(p[0]))}
            elif dev is not None:
                dev = list(dev)
            entries.append(
                {
                    "PodUID": e.pod_uid,
                    "ContainerName": e.container_name,
                    "ResourceName": e.resource_name,
                    "DeviceIDs": dev,
                    "AllocResp": _b64out(e.alloc_resp),
                }
            )
    reg = None
    if cp.registered is not None:
        reg = {k: _json_ids(v) for k, v in sorted(cp.registered, key=lambda p: p[0])}
        if len(reg) != len(cp.registered):
            raise ValueError("a resource appears twice in RegisteredDevices")
    doc: Dict[str, Any] = {
        "Data": {"PodDeviceEntries": entries, "RegisteredDevices": reg},
        "Checksum": checksum,
    }
    if cp.boot_id:  # `json:",omitempty"`
        doc["BootID"] = cp.boot_id
    text = json.dumps(doc, ensure_ascii=False, separators=(",", ":"))
    return _escape(text).encode("utf-8")


def canonical(data: bytes, *, source: str) -> bytes:
    """`data` as kubelet would write it back (its stored checksum kept)."""
    cp = parse(data, source=source)
    return marshal(cp, checksum=cp.checksum)
