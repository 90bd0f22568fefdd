"""The device ID forms NVIDIA's device plugin gives kubelet, parsed (pure).

kubelet's checkpoint holds the IDs the plugin reported, in whichever form its
configuration chose:

- ``DEVICE_ID_STRATEGY=uuid`` (the default): a GPU's UUID ``GPU-<uuid>``; a MIG
  device's ``MIG-<uuid>`` (drivers from R470), or ``MIG-GPU-<uuid>/<gi>/<ci>`` (older
  drivers: the parent's UUID and the instance placement);
- ``DEVICE_ID_STRATEGY=index``: a GPU's NVML index ``"0"``, ``"1"`` ...; a MIG device's
  ``"<gpu index>:<mig index>"``, the MIG index being the position NVML enumerates it
  at on its parent (``nvmlDeviceGetMigDeviceHandleByIndex``);
- time-slicing and MPS replicas (resources such as ``nvidia.com/gpu`` or, renamed,
  ``nvidia.com/gpu.shared``): the base ID of either form followed by ``::<replica>``,
  ``GPU-<uuid>::3`` or ``0::3``.

A replica is present exactly when its base device is: it is one share of that device.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

GPU_UUID = "gpu-uuid"
MIG_UUID = "mig-uuid"
MIG_LEGACY = "mig-legacy"  # MIG-GPU-<uuid>/<gi>/<ci>
GPU_INDEX = "gpu-index"
MIG_INDEX = "mig-index"
OTHER = "other"  # no NVIDIA form: judged as the exact ID it is

_REPLICA = re.compile(r"(.+)::(\d{1,9})")
_LEGACY = re.compile(r"MIG-(GPU-[0-9A-Za-z-]+)/(\d{1,9})/(\d{1,9})")
_INDEX = re.compile(r"(\d{1,9})")
_MIG_INDEX = re.compile(r"(\d{1,9}):(\d{1,9})")


@dataclass(frozen=True)
class DeviceId:
    """One checkpointed ID: its form, the base device it names and the replica."""

    raw: str
    form: str
    base: str  # the ID without its replica suffix
    replica: Optional[int] = None
    gpu_uuid: str = ""  # gpu-uuid, mig-legacy: the (parent) GPU's UUID
    gpu_index: Optional[int] = None  # gpu-index, mig-index
    mig_index: Optional[int] = None  # mig-index
    gi: Optional[int] = None  # mig-legacy
    ci: Optional[int] = None  # mig-legacy

    @property
    def is_mig(self) -> bool:
        return self.form in (MIG_UUID, MIG_LEGACY, MIG_INDEX)


def parse_id(raw: str) -> DeviceId:
    """The form of ``raw``; OTHER for anything that is none of NVIDIA's."""
    base, replica = raw, None
    m = _REPLICA.fullmatch(raw)
    if m:
        base, replica = m[1], int(m[2])
    legacy = _LEGACY.fullmatch(base)
    if legacy:
        return DeviceId(
            raw, MIG_LEGACY, base, replica, legacy[1], gi=int(legacy[2]), ci=int(legacy[3])
        )
    if base.startswith("GPU-") and len(base) > 4:
        return DeviceId(raw, GPU_UUID, base, replica, gpu_uuid=base)
    if base.startswith("MIG-") and len(base) > 4:
        return DeviceId(raw, MIG_UUID, base, replica)
    if _INDEX.fullmatch(base):
        return DeviceId(raw, GPU_INDEX, base, replica, gpu_index=int(base))
    mi = _MIG_INDEX.fullmatch(base)
    if mi:
        return DeviceId(raw, MIG_INDEX, base, replica, gpu_index=int(mi[1]), mig_index=int(mi[2]))
    return DeviceId(raw, OTHER, base, replica)
