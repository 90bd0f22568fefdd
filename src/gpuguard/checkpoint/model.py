"""The kubelet device-manager checkpoint as immutable values.

Everything Go can tell apart is kept apart here, because the checksum depends on it:
null vs empty lists and maps, the order of entries and of device lists. Changes are
made with dataclasses.replace and then written with codec.marshal (fresh checksum).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Tuple, Union

# v2 (kubelet 1.20+): DevicesPerNUMA, a Go map[int64][]string; pairs kept in file order.
NumaDevices = Tuple[Tuple[int, Optional[Tuple[str, ...]]], ...]
# v1 (kubelet 1.11-1.19): a plain []string.
PlainDevices = Tuple[str, ...]
DeviceIDs = Union[NumaDevices, PlainDevices]
Registered = Tuple[Tuple[str, Optional[Tuple[str, ...]]], ...]

FORMATS = ("v1", "v2", "any")


@dataclass(frozen=True)
class PodDevicesEntry:
    """One container's allocation of one resource (Go's PodDevicesEntry)."""

    pod_uid: str
    container_name: str
    resource_name: str
    # None is a Go nil (JSON null or missing). v2: (numa_node, ids) pairs; v1: ids.
    # An empty tuple means `{}` in a v2 checkpoint and `[]` in a v1 one.
    device_ids: Optional[DeviceIDs]
    # The device plugin's protobuf ContainerAllocateResponse; None is a Go nil.
    alloc_resp: Optional[bytes]

    @property
    def shape(self) -> Optional[str]:
        """ "v1" or "v2" when the device IDs say which, else None (nil or empty)."""
        if not self.device_ids:
            return None
        return "v2" if isinstance(self.device_ids[0], tuple) else "v1"

    @property
    def numa_nodes(self) -> tuple[int, ...]:
        """The NUMA node keys in file order (-1: no topology); () for v1 entries."""
        if self.shape != "v2":
            return ()
        return tuple(node for node, _ in self.numa_pairs())

    def numa_pairs(self) -> NumaDevices:
        """The v2 (node, ids) pairs; raises TypeError on a v1 entry with devices."""
        if self.shape == "v1":
            raise TypeError("a v1 entry has no NUMA nodes")
        return self.device_ids or ()  # type: ignore[return-value]

    def all_device_ids(self) -> tuple[str, ...]:
        """Every device ID in file order (NUMA groups concatenated for v2)."""
        shape = self.shape
        if shape is None:
            return ()
        if shape == "v1":
            return self.device_ids  # type: ignore[return-value]
        out: list[str] = []
        for _, ids in self.numa_pairs():
            out.extend(ids or ())
        return tuple(out)


@dataclass(frozen=True)
class Checkpoint:
    """The whole file (Go's checkpoint.Data)."""

    # "v1" | "v2" | "any": "any" when no pod entry says which (both hash the same).
    format: str
    entries: Optional[Tuple[PodDevicesEntry, ...]]  # None: JSON null
    registered: Optional[Registered]  # resource -> ids in file order; None: JSON null
    checksum: int  # as stored (Go uint64)
    boot_id: Optional[str] = None  # newest kubelets' BootID; None when absent or ""

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise ValueError(f"checkpoint format must be one of {FORMATS}, not {self.format!r}")

    def effective_format(self) -> str:
        """ "v1" or "v2": the format this checkpoint is hashed and written as.

        An "any" checkpoint that was given entries later takes their shape; entries
        whose device IDs are nil or empty say nothing, and then the newest (v2) wins.
        """
        if self.format != "any":
            return self.format
        for e in self.entries or ():
            if e.shape is not None:
                return e.shape
        return "v2"

    def registered_dict(self) -> Dict[str, Optional[Tuple[str, ...]]]:
        """RegisteredDevices as a dict (file order kept); {} for null."""
        return dict(self.registered or ())

    def all_device_ids(self) -> tuple[str, ...]:
        """Every device ID held by a pod entry, in file order, duplicates kept."""
        out: list[str] = []
        for e in self.entries or ():
            out.extend(e.all_device_ids())
        return tuple(out)
