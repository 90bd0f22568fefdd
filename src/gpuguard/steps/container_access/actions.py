"""The container access step's actions, planned by reconcile.py: which container, which
nodes, and which kind of repair (the step's actuators carry them out).

Actions re-grant exactly the entitled nodes that are denied, never anything else:

- ``CgroupV1Allow``: write ``c MAJ:MIN rw`` to the container's devices.allow (fast,
  2-5 ms for 200 cgroups, but the next runc update / daemon-reload wipes it);
- ``UnitDeviceAllow``: runtime ``DeviceAllow=/dev/char/MAJ:MIN rw`` on the container's
  systemd scope (durable across reloads; needs the /dev/char link to exist, F2);
- ``V2ProgramReplace`` (``V2Remedy=inplace``): cgroup v2 without a systemd scope, where
  the device policy is runc's BPF program: replace it with one admitting its previous
  rules plus exactly these nodes (actuate/bpf.py);
- ``V2ReportOnly`` / ``RestartContainer``: the same case with ``V2Remedy=report`` or
  ``restart-container``; a restart is only executed when the operator configured it;
- ``UnitDropInRemove``: the drop-in a durable grant wrote for a scope that is gone
  (actuate/dropins.py; systemd never removes it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

from gpuguard.model import Action

ACTION_V1_ALLOW = "cgroup-v1-allow"
ACTION_UNIT_ALLOW = "unit-device-allow"
ACTION_V2_REPORT = "v2-report-only"
ACTION_RESTART = "restart-container"
ACTION_V2_REPLACE = "v2-program-replace"
ACTION_DROPIN_REMOVE = "unit-dropin-remove"


def _join(items: Sequence[str]) -> str:
    return ",".join(items)


@dataclass(frozen=True)
class ContainerDeviceAction(Action):
    """Base of this module's actions: which container and which nodes."""

    pod_uid: str = ""
    container_id: str = ""
    nodes: tuple[str, ...] = ()  # host paths, e.g. /dev/nvidia0
    numbers: tuple[str, ...] = ()  # "195:0", same order as nodes

    def fields(self) -> Mapping[str, str]:
        return {
            "POD_UID": self.pod_uid,
            "CONTAINER_ID": self.container_id,
            "DEVICE": _join(self.nodes),
            "DEVICE_NUMBERS": _join(self.numbers),
        }


@dataclass(frozen=True)
class CgroupV1Allow(ContainerDeviceAction):
    cgroup_dir: str = ""  # the container's v1 devices directory (under the root)
    rules: tuple[str, ...] = ()  # lines for devices.allow, one write each
    # the cgroups above it written first, the scope down (its process below the scope:
    # a v1 cgroup admits only what its parent does)
    through: tuple[str, ...] = ()

    @property
    def kind(self) -> str:
        return ACTION_V1_ALLOW

    def fields(self) -> Mapping[str, str]:
        return {**super().fields(), "CGROUP": self.cgroup_dir}


@dataclass(frozen=True)
class UnitDeviceAllow(ContainerDeviceAction):
    unit: str = ""
    devices: tuple[tuple[str, str], ...] = ()  # (("/dev/char/195:0", "rw"), ...)
    runtime: bool = True  # SetUnitProperties(runtime=true): gone at reboot, like the scope

    @property
    def kind(self) -> str:
        return ACTION_UNIT_ALLOW

    def fields(self) -> Mapping[str, str]:
        return {**super().fields(), "UNIT": self.unit}


@dataclass(frozen=True)
class V2ReportOnly(ContainerDeviceAction):
    cgroup_dir: str = ""

    @property
    def kind(self) -> str:
        return ACTION_V2_REPORT

    def fields(self) -> Mapping[str, str]:
        return {**super().fields(), "CGROUP": self.cgroup_dir}


@dataclass(frozen=True)
class V2ProgramReplace(ContainerDeviceAction):
    """Replace the cgroup's device program: its previous rules + read/write on ``numbers``.

    ``program_id``: which one (a runtime's program next to systemd's in a scope; 0: the
    one program attached, a scope-less container's); ``probe_dir``: where the
    container's process is, whose opens prove it (default: ``cgroup_dir``)."""

    cgroup_dir: str = ""
    program_id: int = 0
    probe_dir: str = ""

    @property
    def kind(self) -> str:
        return ACTION_V2_REPLACE

    def fields(self) -> Mapping[str, str]:
        extra = {"BPF_PROGRAM": str(self.program_id)} if self.program_id else {}
        return {**super().fields(), "CGROUP": self.cgroup_dir, **extra}


@dataclass(frozen=True)
class RestartContainer(ContainerDeviceAction):
    """Placeholder remedy: the runtime actuator stops the container (kubelet recreates
    it with a fresh device policy) only when configured to."""

    runtime_name: str = ""

    @property
    def kind(self) -> str:
        return ACTION_RESTART

    def fields(self) -> Mapping[str, str]:
        return {**super().fields(), "RUNTIME": self.runtime_name}


@dataclass(frozen=True)
class UnitDropInRemove(Action):
    """The drop-in gpuguard wrote with a scope's durable grant, once the scope is gone."""

    unit: str = ""

    @property
    def kind(self) -> str:
        return ACTION_DROPIN_REMOVE

    def fields(self) -> Mapping[str, str]:
        return {"UNIT": self.unit}
