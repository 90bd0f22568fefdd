"""Device ID forms found in kubelet checkpoints, and whether this host still has them.

Forms the NVIDIA device plugin (and forks) register:
  GPU-<uuid>                   a whole GPU
  MIG-<uuid>                   a MIG device (driver R470+)
  MIG-GPU-<uuid>/<gi>/<ci>     a MIG device, legacy form (older drivers)
  <id>::<n>                    replica <n> of <id> (time-slicing / sharing)
  <n>                          a GPU index (index ID strategies)
  <n>:<m>                      MIG device <m> of GPU index <n> (index strategy with MIG)
Anything else is "unknown" and its resource is never touched.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

from gpuguard.host.inventory import Inventory
from gpuguard.host.numparse import parse_decimal

# [0-9], never \d (which takes any Unicode digit), and bounded so every suffix fits
# parse_decimal(): an ID past the bounds is "unknown" and its resource left alone.
_LEGACY_MIG = re.compile(r"^MIG-(GPU-[0-9A-Za-z-]+)/([0-9]{1,9})/([0-9]{1,9})\Z")
_UUID_BODY = re.compile(r"^[0-9A-Za-z]+(-[0-9A-Za-z]+)+\Z")
_INDEX = re.compile(r"^[0-9]{1,4}\Z")
_MIG_INDEX = re.compile(r"^([0-9]{1,4}):([0-9]{1,4})\Z")
_REPLICA = re.compile(r"^(.+)::([0-9]{1,9})\Z")


@dataclass(frozen=True)
class DeviceId:
    raw: str
    form: str  # "gpu-uuid" | "mig-uuid" | "mig-legacy" | "index" | "mig-index" | "unknown"
    key: str  # the GPU or MIG UUID, or the index text
    gi: int = -1
    ci: int = -1
    replica: Optional[int] = None


def _num(digits: str) -> int:
    # The patterns above admit only 1-9 ASCII digits, which always parse.
    value = parse_decimal(digits)
    assert value is not None
    return value


def classify(raw: str) -> DeviceId:
    replica: Optional[int] = None
    base = raw
    m = _REPLICA.match(raw)
    if m:
        base, replica = m.group(1), _num(m.group(2))
    m = _LEGACY_MIG.match(base)
    if m:
        return DeviceId(raw, "mig-legacy", m.group(1), _num(m.group(2)), _num(m.group(3)), replica)
    if base.startswith("GPU-") and _UUID_BODY.match(base[4:]):
        return DeviceId(raw, "gpu-uuid", base, replica=replica)
    if base.startswith("MIG-") and _UUID_BODY.match(base[4:]):
        return DeviceId(raw, "mig-uuid", base, replica=replica)
    if _INDEX.match(base):
        return DeviceId(raw, "index", base, replica=replica)
    m = _MIG_INDEX.match(base)
    if m:
        return DeviceId(raw, "mig-index", m.group(1), ci=_num(m.group(2)), replica=replica)
    return DeviceId(raw, "unknown", base, replica=replica)


class Matcher:
    """Answers "does this host still have device X?" against one inventory."""

    def __init__(self, inventory: Inventory) -> None:
        self._gpus = inventory.by_uuid()
        self._migs = inventory.mig_uuids()
        self._by_index = {g.index: g for g in inventory.gpus}

    def exists(self, d: DeviceId) -> bool:
        if d.form == "gpu-uuid":
            return d.key in self._gpus
        if d.form == "mig-uuid":
            return d.key in self._migs
        if d.form == "mig-legacy":
            gpu = self._gpus.get(d.key)
            return gpu is not None and any(m.gi == d.gi and m.ci == d.ci for m in gpu.mig)
        if d.form == "index":
            return int(d.key) in self._by_index
        if d.form == "mig-index":
            gpu = self._by_index.get(int(d.key))
            # The plugin numbers a GPU's MIG devices 0..n-1 in its own order; all we can
            # check is that the GPU is there and has that many MIG devices.
            return gpu is not None and d.ci < len(gpu.mig)
        raise ValueError(f"cannot match an ID of unknown form: {d.raw}")
