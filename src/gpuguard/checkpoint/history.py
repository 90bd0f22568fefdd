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

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

from gpuguard.errors import BadInputError
from gpuguard.host.numparse import cut
from gpuguard.host.paths import GPU_HISTORY_FILE
from gpuguard.host.statefile import Obj, SchemaError, StateFile, load

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
    out = History(tuple([*kept, gen][-MAX_GENERATIONS:]))
    # past MAX_BYTES (many GPUs with many MIG devices): the oldest generations give way,
    # so the newest is still written (a generation that is itself unwritable is not)
    while len(out.generations) > 1 and len(SPEC.encode(out)) > MAX_BYTES:
        out = History(out.generations[1:])
    return out


def _render(history: History) -> dict[str, Any]:
    return {
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


# -- the typed loader (host/statefile.py) ---------------------------------------------


def _unique(values: Sequence[Any], what: str, where: str) -> None:
    if len(set(values)) != len(values):
        raise SchemaError(f"{where}: the same {what} is listed twice")


def _text(o: Obj, key: str, *, empty: bool = False) -> str:
    v = o.text(key, max_len=MAX_TEXT)
    if not v and not empty:
        raise SchemaError(f"{o.where}.{key}: empty")
    return v


def _mig(v: Any, where: str) -> MigIdentity:
    o = Obj(v, where)
    return MigIdentity(
        _text(o, "uuid"), o.integer("gi", hi=MAX_INDEX), o.integer("ci", hi=MAX_INDEX)
    )


def _gpu(v: Any, where: str) -> GpuIdentity:
    o = Obj(v, where)
    migs = o.items("mig", _mig, max_items=MAX_MIG)
    _unique([m.uuid for m in migs], "MIG uuid", where)
    _unique([(m.gi, m.ci) for m in migs], "MIG (gi, ci)", where)
    return GpuIdentity(
        _text(o, "uuid"),
        normal_bus_id(_text(o, "pci_bus_id")),
        o.integer("index", hi=MAX_INDEX),
        o.integer("minor", hi=MAX_MINOR),
        o.integer("numa_node", lo=-1, hi=4095),
        migs,
    )


def _generation(v: Any, where: str) -> Generation:
    o = Obj(v, where)
    when = o.real("recorded_at")
    boot, source = _text(o, "boot_id", empty=True), _text(o, "source", empty=True)
    gpus = o.items("gpus", _gpu, max_items=MAX_GPUS)
    if not gpus:
        raise SchemaError(f"{where}: no GPU")
    for what, key in (("UUID", "uuid"), ("bus id", "pci_bus_id"), ("index", "index"),
                      ("minor", "minor")):  # fmt: skip
        _unique([getattr(g, key) for g in gpus], what, where)
    _unique([m.uuid for g in gpus for m in g.mig] + [g.uuid for g in gpus], "UUID", where)
    return Generation(gpus, when, boot, source)


SPEC: StateFile[History] = StateFile(
    path=GPU_HISTORY_FILE,
    what="GPU identity history",
    version=VERSION,
    parse=lambda o: History(o.items("generations", _generation, max_items=MAX_GENERATIONS)),
    render=_render,
    max_bytes=MAX_BYTES,
    mode=0o600,
    next_step=NEXT_STEP,
)


def render(history: History) -> bytes:
    return SPEC.encode(history)


def unwritable(history: History) -> str:
    """Why `history` must not be written ("" when it may): what parse() would refuse
    in the bytes render() makes of it (a bus id twice once normalised, an empty one, a
    UUID past MAX_TEXT characters, more than MAX_BYTES). The one validation of both the
    writer (actuate/statefile.write_state, through SPEC) and the reader."""
    return SPEC.refuses(history)[1]


def parse(raw: bytes, source: str) -> History:
    """The history in `raw`; HistoryError (one line naming `source`) for anything else."""
    try:
        return SPEC.decode(raw)
    except SchemaError as e:
        raise HistoryError(f"{source}: unusable ({cut(str(e), 200)}); {NEXT_STEP}") from None


def read(path: Path) -> tuple[Optional[History], str]:
    """(history, "") when usable; (None, "") when there is none; (None, why) when the
    file is unusable (a link, a FIFO, too big, malformed): then there is no history."""
    got = load(path, SPEC)
    return got.value, "" if got.absent else got.why
