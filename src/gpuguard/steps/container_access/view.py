"""What the container access step knows of the host in a pass: the GPU containers, what
each was given and what its cgroup admits (pure records, filled by observe.py and the
two cgroup layouts, cgroupv1.py and cgroupv2.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Mapping, Optional

if TYPE_CHECKING:
    from gpuguard.devices.containers import ContainerCgroup
    from gpuguard.devices.entitlement import Entitlement
    from gpuguard.devices.rules import DeviceRules

AccessKey = tuple[str, str]  # (container_id, "MAJ:MIN")
Pair = tuple["ContainerCgroup", "Entitlement"]  # a GPU container and what it was given
Access = dict[AccessKey, Optional[bool]]  # True admitted, False denied, None unknown


@dataclass
class Readings:
    """What reading containers' device cgroups found, by container: the parts of an
    AccessView the layouts fill."""

    access: Access = field(default_factory=dict)
    # v1: each container's devices.list, parsed (the findings' causes)
    rules: dict[str, DeviceRules] = field(default_factory=dict)
    # container_id -> why its cgroup's files could not be read (it gets a finding)
    broken: dict[str, str] = field(default_factory=dict)
    # v2: the programs attached to a scope-less container's own cgroup (None: the
    # query failed), the containers with a bridge of gpuguard's, the (container, node)
    # pairs a program of systemd's itself denies, every program the kernel runs for it
    programs: dict[str, Optional[tuple[int, ...]]] = field(default_factory=dict)
    bridged: set[str] = field(default_factory=set)
    systemd_denies: set[AccessKey] = field(default_factory=set)
    effective: dict[str, tuple[int, ...]] = field(default_factory=dict)


@dataclass(frozen=True)
class AccessView:
    containers: tuple[ContainerCgroup, ...]
    entitlements: Mapping[tuple[str, str], Entitlement]
    access: Mapping[AccessKey, Optional[bool]]
    rules: Mapping[str, DeviceRules]
    # container_id -> why its own files could not be read: it gets a finding and is
    # neither judged nor granted anything; every other container goes on.
    broken: Mapping[str, str] = field(default_factory=dict)
    # device plugins' own containers: the plugin step judges their view of the nodes
    plugin_containers: frozenset[str] = frozenset()
    # v2 containers without a scope: the device programs attached to their own cgroup
    # (None: BPF_PROG_QUERY failed), for the in-place repair's checks (inplace.py)
    programs: Mapping[str, Optional[tuple[int, ...]]] = field(default_factory=dict)
    # v2 containers with a bridge of gpuguard's among their programs (bridge.py), and
    # the v2 (container, node) pairs that a program of systemd's itself denies
    bridged: frozenset[str] = frozenset()
    systemd_denies: frozenset[AccessKey] = frozenset()
    # v2 containers: the ids of every device program the kernel runs for their cgroup
    # (a failed bridge waits until these change: bridge.py)
    effective: Mapping[str, tuple[int, ...]] = field(default_factory=dict)

    @classmethod
    def of(
        cls,
        containers: tuple[ContainerCgroup, ...],
        entitlements: Mapping[tuple[str, str], Entitlement],
        r: Readings,
        *,
        broken: Optional[Mapping[str, str]] = None,
        plugin_containers: frozenset[str] = frozenset(),
    ) -> AccessView:
        """A view of `containers` from what their layouts read (`r`); `broken`: the
        containers whose own files could not be read (r.broken added)."""
        return cls(
            containers,
            entitlements,
            r.access,
            r.rules,
            {**(broken or {}), **r.broken},
            plugin_containers,
            r.programs,
            frozenset(r.bridged),
            frozenset(r.systemd_denies),
            r.effective,
        )
