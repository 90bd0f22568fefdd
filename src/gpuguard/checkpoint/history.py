"""Each GPU's physical identity across boots: the history a checkpoint remap needs.

After a reboot or an instance replacement the GPUs may come back with new UUIDs (and new
indices or minors); the kubelet checkpoint still names the old ones. To give a pod the
GPU in the same physical slot, gpuguard must remember what the old ones were: per GPU
its UUID, PCI bus id, NVML index, minor, NUMA node and MIG devices (uuid, gi, ci).

The file (/var/lib/gpuguard/gpu-identity.json) holds the newest MAX_GENERATIONS
distinct sets of GPUs ("generations"), oldest first. A new generation is recorded only
after the checkpoint was reconciled against the GPUs then present (steps/checkpoint),
so at the first check after a reboot the newest generation is still the one the
checkpoint was written under.

Safe to lose: without it gpuguard drops stale entries as before, and says why. Never
trusted blindly: read through safeio (no links, no FIFOs, at most MAX_BYTES), and
anything that is not exactly what render() writes (version, types, ranges, bounds,
duplicates) is refused as a whole with one line saying what is wrong.
"""

from __future__ import annotations

import errno
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

from gpuguard.errors import BadInputError
from gpuguard.host import safeio
from gpuguard.host.numparse import clip, cut, parse_decimal

VERSION = 1
MAX_BYTES = 1024 * 1024
MAX_GENERATIONS = 4
MAX_GPUS = 256
MAX_MIG = 64  # MIG devices per GPU (7 GPU instances, a few compute instances each)
MAX_TEXT = 128  # a UUID is 40 characters, a bus id 16
MAX_INDEX = 2**31 - 1
MAX_MINOR = 2**20 - 1
NEXT_STEP = "gpuguard ignores it and records the GPUs anew at its next check"

_BUS = re.compile(r"^(?:([0-9a-fA-F]{1,8}):)?([0-9a-fA-F]{1,2}):([0-9a-fA-F]{1,2})\.([0-7])\Z")


def normal_bus_id(bus: str) -> str:
    """A PCI bus id in sysfs' form (0000:17:00.0) whatever NVML's (00000000:17:00.0);
    anything else lower-cased as it is."""
    m = _BUS.match(bus.strip())
    if not m:
        return bus.strip().lower()
    domain, b, d, f = m.groups()
    return f"{int(domain or '0', 16):04x}:{int(b, 16):02x}:{int(d, 16):02x}.{f}"


@dataclass(frozen=True)
class MigIdentity:
    uuid: str
    gi: int
    ci: int


@dataclass(frozen=True)
class GpuIdentity:
    uuid: str
    pci_bus_id: str  # normal_bus_id() form
    index: int
    minor: int
    numa_node: int = -1  # -1: unknown or none
    mig: tuple[MigIdentity, ...] = ()

    def mig_layout(self) -> tuple[tuple[int, int], ...]:
        return tuple(sorted((m.gi, m.ci) for m in self.mig))


@dataclass(frozen=True)
class Generation:
    gpus: tuple[GpuIdentity, ...]
    recorded_at: float  # Unix time
    boot_id: str = ""
    source: str = ""

    def identity(self) -> tuple[Any, ...]:
        """What makes two generations the same set of GPUs (NUMA and times aside)."""
        return tuple(
            sorted((g.uuid, g.pci_bus_id, g.index, g.minor, g.mig_layout(),
                    tuple(sorted(m.uuid for m in g.mig))) for g in self.gpus)
        )  # fmt: skip


@dataclass(frozen=True)
class History:
    generations: tuple[Generation, ...]  # oldest first

    @property
    def newest(self) -> Optional[Generation]:
        return self.generations[-1] if self.generations else None


class HistoryError(BadInputError):
    """The history file is unusable: treated as no history."""


def generation_of(
    gpus: Sequence[Any], numa: Mapping[str, int], *, when: float, boot_id: str, source: str
) -> Generation:
    """The generation of an inventory's GPUs (inventory.Gpu), NUMA nodes by bus id."""
    out = []
    for g in gpus:
        bus = normal_bus_id(g.pci_bus_id)
        mig = tuple(MigIdentity(m.uuid, m.gi, m.ci) for m in g.mig)
        out.append(GpuIdentity(g.uuid, bus, g.index, g.minor, numa.get(bus, -1), mig))
    return Generation(tuple(out), when, boot_id, source)


def advance(history: Optional[History], gen: Generation) -> Optional[History]:
    """The history with `gen` as its newest generation; None when it already is (nothing
    to write). A generation seen before moves to the end; the oldest fall off."""
    if not gen.gpus:
        return None  # never record "no GPU": more likely a driver not up than a change
    newest = history.newest if history is not None else None
    if newest is not None and newest.identity() == gen.identity():
        return None
    kept = [g for g in (history.generations if history else ()) if g.identity() != gen.identity()]
    return History(tuple([*kept, gen][-MAX_GENERATIONS:]))


def render(history: History) -> bytes:
    doc = {
        "version": VERSION,
        "generations": [
            {
                "recorded_at": round(g.recorded_at, 3),
                "boot_id": g.boot_id,
                "source": g.source,
                "gpus": [
                    {
                        "uuid": x.uuid,
                        "pci_bus_id": x.pci_bus_id,
                        "index": x.index,
                        "minor": x.minor,
                        "numa_node": x.numa_node,
                        "mig": [{"uuid": m.uuid, "gi": m.gi, "ci": m.ci} for m in x.mig],
                    }
                    for x in g.gpus
                ],
            }
            for g in history.generations
        ],
    }
    return (json.dumps(doc, indent=1, sort_keys=True) + "\n").encode()


# -- the typed loader -------------------------------------------------------------------


def _int(text: str) -> int:
    value = parse_decimal(text, lo=-(2**63), hi=2**63 - 1, signed=True)
    if value is None:
        raise ValueError(f"number {clip(text)} is out of range")
    return value


def _obj(v: Any, where: str, keys: Sequence[str]) -> dict[str, Any]:
    if not isinstance(v, dict):
        raise ValueError(f"{where} is not an object")
    missing = [k for k in keys if k not in v]
    if missing:
        raise ValueError(f"{where} lacks {missing[0]!r}")
    return v


def _text(d: Mapping[str, Any], key: str, where: str, *, empty: bool = False) -> str:
    v = d[key]
    if not isinstance(v, str) or len(v) > MAX_TEXT or (not v and not empty):
        raise ValueError(f"{where}.{key} is not a string of 1 to {MAX_TEXT} characters")
    return v


def _num(d: Mapping[str, Any], key: str, where: str, lo: int, hi: int) -> int:
    v = d[key]
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        raise ValueError(f"{where}.{key} is not a whole number {lo}..{hi}")
    return v


def _list(v: Any, where: str, most: int) -> list[Any]:
    if not isinstance(v, list):
        raise ValueError(f"{where} is not a list")
    if len(v) > most:
        raise ValueError(f"{where} has {len(v)} items, more than {most}")
    return v


def _unique(values: Sequence[Any], what: str, where: str) -> None:
    if len(set(values)) != len(values):
        raise ValueError(f"{where}: a {what} is listed twice")


def _gpu(v: Any, where: str) -> GpuIdentity:
    d = _obj(v, where, ("uuid", "pci_bus_id", "index", "minor", "numa_node", "mig"))
    migs = []
    for j, m in enumerate(_list(d["mig"], f"{where}.mig", MAX_MIG)):
        mw = f"{where}.mig[{j}]"
        md = _obj(m, mw, ("uuid", "gi", "ci"))
        migs.append(
            MigIdentity(_text(md, "uuid", mw), _num(md, "gi", mw, 0, MAX_INDEX),
                        _num(md, "ci", mw, 0, MAX_INDEX))
        )  # fmt: skip
    _unique([m.uuid for m in migs], "MIG uuid", where)
    _unique([(m.gi, m.ci) for m in migs], "MIG (gi, ci)", where)
    return GpuIdentity(
        _text(d, "uuid", where),
        normal_bus_id(_text(d, "pci_bus_id", where)),
        _num(d, "index", where, 0, MAX_INDEX),
        _num(d, "minor", where, 0, MAX_MINOR),
        _num(d, "numa_node", where, -1, 4095),
        tuple(migs),
    )


def _generation(v: Any, where: str) -> Generation:
    d = _obj(v, where, ("recorded_at", "boot_id", "source", "gpus"))
    when = d["recorded_at"]
    if isinstance(when, bool) or not isinstance(when, (int, float)) or not 0 <= when < 2**40:
        raise ValueError(f"{where}.recorded_at is not a time")
    gpus = tuple(
        _gpu(g, f"{where}.gpus[{i}]")
        for i, g in enumerate(_list(d["gpus"], f"{where}.gpus", MAX_GPUS))
    )
    if not gpus:
        raise ValueError(f"{where} has no GPU")
    for what, key in (("UUID", "uuid"), ("bus id", "pci_bus_id"), ("index", "index"),
                      ("minor", "minor")):  # fmt: skip
        _unique([getattr(g, key) for g in gpus], what, where)
    _unique([m.uuid for g in gpus for m in g.mig] + [g.uuid for g in gpus], "UUID", where)
    return Generation(
        gpus, float(when), _text(d, "boot_id", where, empty=True),
        _text(d, "source", where, empty=True),
    )  # fmt: skip


def parse(raw: bytes, source: str) -> History:
    """The history in `raw`; HistoryError (one line naming `source`) for anything else."""
    try:
        doc = json.loads(raw.decode("utf-8"), parse_int=_int, parse_constant=_reject)
        top = _obj(doc, "the file", ("version", "generations"))
        if top["version"] != VERSION or isinstance(top["version"], bool):
            raise ValueError(f"version is {clip(top['version'])}, not {VERSION}")
        gens = _list(top["generations"], "generations", MAX_GENERATIONS)
        out = tuple(_generation(g, f"generations[{i}]") for i, g in enumerate(gens))
    except RecursionError:
        raise HistoryError(f"{source}: nested too deeply; {NEXT_STEP}") from None
    except (ValueError, TypeError) as e:  # JSONDecodeError and UnicodeError are ValueErrors
        raise HistoryError(f"{source}: unusable ({cut(str(e), 200)}); {NEXT_STEP}") from None
    return History(out)


def _reject(name: str) -> Any:
    raise ValueError(f"{name} is not a number here")


def read(path: Path) -> tuple[Optional[History], str]:
    """(history, "") when usable; (None, "") when there is none; (None, why) when the
    file is unusable (a link, a FIFO, too big, malformed): then there is no history."""
    try:
        raw, _st = safeio.read_bytes(
            path, what="GPU identity history", max_bytes=MAX_BYTES, next_step=NEXT_STEP
        )
    except safeio.UnsafeFileError as e:
        if e.errno == errno.ENOENT:
            return None, ""
        return None, e.message
    try:
        return parse(raw, str(path)), ""
    except HistoryError as e:
        return None, e.message
