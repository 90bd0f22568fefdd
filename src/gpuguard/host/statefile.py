"""gpuguard's own state files, read through one typed, versioned loader.

Every file gpuguard writes and reads back (the status file, the metrics values, the
kubelet hook's request and result, the hook's memo, the dropped-entries record, the
device plugin's restart budgets) is described once by a `StateFile`: its host path,
its format version, a parser from JSON into frozen dataclasses and a renderer back. A
reader gets the value or "absent/unknown" with one line saying why, never an
exception: the file is read through safeio (non-blocking, regular files only, no
links, bounded by the bytes read), decoded as strict UTF-8, parsed as JSON with every
number bounded (no 400-digit integer, no 1e400, no NaN) and no runaway nesting, and its
structure, depth, types and ranges checked field by field against its model (`Obj`:
a list where a number belongs is refused, a lone surrogate becomes U+FFFD). The
writer is `actuate/statefile.py` (atomic, in a checked state directory).

Adding a state file: a `StateFile` with a parse function that reads its fields
through `Obj` (each typed getter names the field in its error) and a render function
that writes the same fields; `load()` and `actuate.statefile.write_state()` do the rest.
"""

from __future__ import annotations

import errno
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Generic, Mapping, Optional, TypeVar

from gpuguard.host import safeio
from gpuguard.host.echo import clip, cut

T = TypeVar("T")
U = TypeVar("U")

MAX_STR = 256 * 1024  # a string field: far above any gpuguard writes
MAX_ITEMS = 100_000  # a list or object
MAX_INT_DIGITS = 20  # a JSON integer: anything gpuguard writes fits in 64 bits
TIME_MAX = 2.0**40  # a Unix time or duration in seconds: finite, far in the future


class SchemaError(ValueError):
    """A state file that is not what gpuguard writes; the message names the field."""


def _int(text: str) -> int:
    digits = text.lstrip("-")
    if len(digits) > MAX_INT_DIGITS:
        raise SchemaError(f"a {len(digits)}-digit number")
    return int(text)


def _float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise SchemaError(f"number {cut(text, 40)} is out of range")
    return value


def _constant(name: str) -> Any:
    raise SchemaError(f"{name} is not a number gpuguard writes")


def parse_json(data: bytes) -> Any:
    """`data` as JSON with bounded numbers; SchemaError otherwise. Depth: the parser's
    own recursion guard stops a deep document (RecursionError, a SchemaError here),
    and a model descends only into the structure it knows (a list or object where its
    schema wants a scalar is refused), so nothing nested deeper is ever walked."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise SchemaError(f"not UTF-8 (byte {e.start})") from None
    try:
        doc = json.loads(text, parse_int=_int, parse_float=_float, parse_constant=_constant)
    except SchemaError:
        raise
    except RecursionError:
        raise SchemaError("nested too deep") from None
    except ValueError as e:  # JSONDecodeError
        raise SchemaError(f"not JSON ({cut(str(e), 80)})") from None
    return doc


def _check_str(v: str, where: str, max_len: int) -> str:
    """`v` within its bound; a lone surrogate (JSON's "\\ud800", which no UTF-8 can
    carry, e.g. from an undecodable file name the writer echoed) becomes U+FFFD, so
    no reader fails printing it."""
    if len(v) > max_len:
        raise SchemaError(f"{where}: a string of {len(v)} characters (at most {max_len})")
    if v.isascii():  # O(1) in CPython: almost every string gpuguard writes
        return v
    try:
        v.encode("utf-8")
    except UnicodeEncodeError:
        return "".join("\ufffd" if 0xD800 <= ord(c) <= 0xDFFF else c for c in v)
    return v


_MISSING: Any = object()


class Obj:
    """A JSON object read field by field: each getter checks the type and range and
    raises SchemaError naming the field (`where`.key) otherwise."""

    def __init__(self, doc: Any, where: str = "document") -> None:
        if not isinstance(doc, dict):
            raise SchemaError(f"{where}: not an object")
        self.doc: Mapping[str, Any] = doc
        self.where = where

    def _get(self, key: str, default: Any) -> Any:
        if key in self.doc:
            return self.doc[key]
        if default is _MISSING:
            raise SchemaError(f"{self.where}.{key}: missing")
        return default

    def _at(self, key: str) -> str:
        return f"{self.where}.{key}"

    def has(self, key: str) -> bool:
        return key in self.doc

    def text(self, key: str, *, max_len: int = MAX_STR, default: Any = _MISSING) -> str:
        v = self.doc.get(key, _MISSING)
        if type(v) is str and v.isascii() and len(v) <= max_len:  # the common case, fast
            return v
        v = self._get(key, default)
        if not isinstance(v, str):
            raise SchemaError(f"{self._at(key)}: not a string")
        return _check_str(v, self._at(key), max_len)

    def opt_text(self, key: str, *, max_len: int = MAX_STR) -> Optional[str]:
        v = self._get(key, None)
        return None if v is None else self.text(key, max_len=max_len)

    def integer(
        self, key: str, *, lo: int = 0, hi: int = 2**63 - 1, default: Any = _MISSING
    ) -> int:
        v = self._get(key, default)
        if isinstance(v, bool) or not isinstance(v, int):
            raise SchemaError(f"{self._at(key)}: not an integer")
        if not lo <= v <= hi:
            raise SchemaError(f"{self._at(key)}: {clip(v)} is out of range [{lo}, {hi}]")
        return v

    def opt_integer(self, key: str, *, lo: int = 0, hi: int = 2**63 - 1) -> Optional[int]:
        return None if self._get(key, None) is None else self.integer(key, lo=lo, hi=hi)

    def real(
        self, key: str, *, lo: float = 0.0, hi: float = TIME_MAX, default: Any = _MISSING
    ) -> float:
        v = self.doc.get(key, _MISSING)
        if type(v) is float and lo <= v <= hi:  # the common case, fast
            return v
        v = self._get(key, default)
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise SchemaError(f"{self._at(key)}: not a number")
        if not lo <= v <= hi:
            raise SchemaError(f"{self._at(key)}: {clip(v)} is out of range [{lo}, {hi}]")
        return float(v)

    def opt_real(self, key: str, *, lo: float = 0.0, hi: float = TIME_MAX) -> Optional[float]:
        return None if self._get(key, None) is None else self.real(key, lo=lo, hi=hi)

    def flag(self, key: str, *, default: Any = _MISSING) -> bool:
        v = self._get(key, default)
        if not isinstance(v, bool):
            raise SchemaError(f"{self._at(key)}: not true or false")
        return v

    def obj(self, key: str) -> Obj:
        return Obj(self._get(key, _MISSING), self._at(key))

    def opt_obj(self, key: str) -> Optional[Obj]:
        v = self._get(key, None)
        return None if v is None else Obj(v, self._at(key))

    def items(
        self,
        key: str,
        item: Callable[[Any, str], U],
        *,
        max_items: int = MAX_ITEMS,
        default: Any = _MISSING,
    ) -> tuple[U, ...]:
        """A list field, each element through `item(value, where)`."""
        v = self._get(key, default)
        if not isinstance(v, list):
            raise SchemaError(f"{self._at(key)}: not a list")
        if len(v) > max_items:
            raise SchemaError(f"{self._at(key)}: {len(v)} items (at most {max_items})")
        at = self._at(key)
        return tuple(item(x, f"{at}[{i}]") for i, x in enumerate(v))

    def texts(
        self,
        key: str,
        *,
        max_items: int = MAX_ITEMS,
        default: Any = _MISSING,
        max_len: int = MAX_STR,
    ) -> tuple[str, ...]:
        return self.items(
            key, lambda v, w: string(v, w, max_len), max_items=max_items, default=default
        )

    def mapping(
        self,
        key: str,
        value: Callable[[Any, str], U],
        *,
        max_items: int = MAX_ITEMS,
        default: Any = _MISSING,
    ) -> dict[str, U]:
        """An object field used as a map: string keys, each value through `value`."""
        v = self._get(key, default)
        if not isinstance(v, dict):
            raise SchemaError(f"{self._at(key)}: not an object")
        if len(v) > max_items:
            raise SchemaError(f"{self._at(key)}: {len(v)} entries (at most {max_items})")
        out = {}
        at = self._at(key)
        for k, x in v.items():
            where = f"{at}[{k[:40]}]"  # escaped with the whole message (load())
            out[_check_str(k, where, 1024)] = value(x, where)
        return out


def string(v: Any, where: str, max_len: int = MAX_STR) -> str:
    """An element reader for `Obj.items`/`mapping`: a string."""
    if not isinstance(v, str):
        raise SchemaError(f"{where}: not a string")
    return _check_str(v, where, max_len)


def number(v: Any, where: str, lo: float = -TIME_MAX, hi: float = TIME_MAX) -> float:
    """An element reader: a finite number in [lo, hi]."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= hi:
        raise SchemaError(f"{where}: not a number in [{lo}, {hi}]")
    return float(v)


@dataclass(frozen=True)
class StateFile(Generic[T]):
    """One state file: where it lives, its version, and how it maps to its model."""

    path: str  # host path (through paths.Root); a caller may read another path
    what: str  # in messages: "status file", "kubelet hook memo"
    version: int
    parse: Callable[[Obj], T]  # the body, after the version was checked
    render: Callable[[T], dict[str, Any]]  # the body, without the version
    max_bytes: int = safeio.STATE_MAX
    mode: int = 0o644
    dir_mode: int = 0o700  # of its directory, when the writer creates it
    version_key: str = "version"
    next_step: str = "gpuguard writes it again at its next run; move it aside if this stays"

    def decode(self, data: bytes) -> T:
        """The model of `data`; SchemaError when it is not this file at this version."""
        doc = Obj(parse_json(data))
        found = doc.doc.get(self.version_key)
        if found != self.version or isinstance(found, bool):
            raise SchemaError(
                f"{self.version_key} {clip(found, 24)}, this gpuguard reads version "
                f"{self.version} (written by another gpuguard version?)"
            )
        return self.parse(doc)

    def encode(self, value: T) -> bytes:
        body = self.render(value)
        doc = {self.version_key: self.version, **body}
        return (json.dumps(doc, indent=1, sort_keys=True, allow_nan=False) + "\n").encode()

    def refuses(self, value: T) -> tuple[bytes, str]:
        """(the bytes of `value`, "") or (b"", why its own reader would refuse them): the
        one check a writer makes, so nothing is written that load() then discards."""
        try:
            data = self.encode(value)
        except ValueError as e:  # a NaN or an infinity: JSON has none
            return b"", cut(str(e), 200)
        if len(data) > self.max_bytes:
            return b"", f"{len(data)} bytes, its reader reads at most {self.max_bytes}"
        try:
            self.decode(data)
        except SchemaError as e:
            return b"", cut(str(e), 200)
        return data, ""


@dataclass(frozen=True)
class Loaded(Generic[T]):
    """A state file's value, or why there is none: `absent` (no file: nothing written
    yet) or `why` (one line: unreadable, unsafe or not what gpuguard writes)."""

    value: Optional[T]
    why: str = ""
    absent: bool = False


def load(path: Path, spec: StateFile[T]) -> Loaded[T]:
    """The state file at `path` (a Root-mapped path) read and checked; never raises for
    what the file holds."""
    try:
        data, _st = safeio.read_bytes(
            path, what=spec.what, max_bytes=spec.max_bytes, next_step=spec.next_step
        )
    except safeio.UnsafeFileError as e:
        if e.errno in (errno.ENOENT, errno.ENOTDIR):
            return Loaded(None, f"{path}: absent", absent=True)
        return Loaded(None, cut(e.message, 400))
    try:
        return Loaded(spec.decode(data))
    except SchemaError as e:
        return Loaded(None, cut(f"{path}: not a gpuguard {spec.what} ({e}); {spec.next_step}", 400))


def load_or_none(
    path: Path, spec: StateFile[T], warn: Optional[Callable[[str], None]] = None
) -> Optional[T]:
    """load()'s value; a file that is there and unusable is said once through `warn`
    (the journal), and is then treated as absent."""
    got = load(path, spec)
    if got.value is None and not got.absent and warn is not None:
        warn(f"ignoring {got.why}")
    return got.value
