"""The v2 bridge's plan (pure): which scopes get a bridge, for which nodes, and the
actions journaled for it: the attach, the DeviceAllow= that follows, the detach.
What a bridge is and why it is safe: bridge.py. Only the v2 layout (cgroupv2.py) plans
bridges, for its own containers; it says which cgroup's programs decide for each
(`dir_of`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Mapping, Optional, Sequence

from gpuguard.steps.container_access.inplace import Failure
from gpuguard.steps.container_access.reconcile import (
    ContainerDeviceAction,
    UnitDeviceAllow,
    subject,
)
from gpuguard.steps.container_access.view import AccessKey, AccessView

if TYPE_CHECKING:
    from gpuguard.devices.containers import ContainerCgroup
    from gpuguard.devices.entitlement import Entitlement
    from gpuguard.devices.nodes import DeviceNode

ACTION_ATTACH = "v2-bridge-attach"
ACTION_DETACH = "v2-bridge-detach"

DirOf = Callable[["ContainerCgroup"], Path]  # the cgroup whose programs decide for it


@dataclass(frozen=True)
class BridgeAttach(ContainerDeviceAction):
    cgroup_dir: str = ""
    unit: str = ""

    @property
    def kind(self) -> str:
        return ACTION_ATTACH

    def fields(self) -> Mapping[str, str]:
        return {
            **super().fields(),
            "CGROUP": self.cgroup_dir,
            "UNIT": self.unit,
            "CGROUP_LAYOUT": "v2",
            "DEVICE_MECHANISM": "scope-device-allow",
        }


@dataclass(frozen=True)
class BridgeDetach(BridgeAttach):
    @property
    def kind(self) -> str:
        return ACTION_DETACH


def bridge_nodes(
    c: ContainerCgroup,
    cgroup_dir: Path,
    ent: Optional[Entitlement],
    access: Mapping[AccessKey, Optional[bool]],
    failures: Mapping[str, Failure],
    effective: Optional[tuple[int, ...]],
    now: float,
) -> tuple[DeviceNode, ...]:
    """The entitled nodes a bridge gives back to `c` (none: no bridge): in a systemd
    scope, those its cgroup (`cgroup_dir`) denies (verdicts False; unknown ones wait for
    the pass), unless the back-off holds the cgroup with the programs it runs now
    (`effective`)."""
    if c.unit is None or ent is None or not ent.readable:
        return ()
    denied = tuple(n for n in ent.nodes if access.get((c.container_id, n.numbers)) is False)
    f = failures.get(str(cgroup_dir))
    if not denied or (f is not None and f.holds(effective, now)):
        return ()
    return denied


def bridge_actions(
    c: ContainerCgroup, cgroup_dir: Path, denied: Sequence[DeviceNode]
) -> tuple[BridgeAttach, UnitDeviceAllow]:
    """A bridge for `denied` on `c`'s `cgroup_dir`, and the DeviceAllow= that follows."""
    assert c.unit is not None, "a container in a scope"
    what = ", ".join(n.path for n in denied)
    bridge = BridgeAttach(
        reason=f"{what} denied on the scope's cgroup v2: stand in for systemd's program "
        "until the DeviceAllow= that follows is applied",
        target=str(cgroup_dir),
        cgroup_dir=str(cgroup_dir),
        unit=c.unit,
        **subject(c, denied),
    )
    allow = UnitDeviceAllow(
        reason=f"re-grant {what} given to the container and denied by its cgroup",
        target=c.unit,
        unit=c.unit,
        devices=tuple((n.dev_char, "rw") for n in denied),
        **subject(c, denied),
    )
    return bridge, allow


def bridge_targets(
    view: AccessView, failures: Mapping[str, Failure], now: float, dir_of: DirOf
) -> list[tuple[ContainerCgroup, Path, tuple[DeviceNode, ...]]]:
    """Each scope of `view` (v2 containers) to bridge: its cgroup and the nodes
    (`bridge_nodes`)."""
    out = []
    for c in view.containers:
        if c.container_id in view.broken:
            continue
        ent = view.entitlements.get(c.key)
        cg = dir_of(c)
        eff = view.effective.get(c.container_id)
        denied = bridge_nodes(c, cg, ent, view.access, failures, eff, now)
        if denied:
            out.append((c, cg, denied))
    return out


def plan_bridges(
    view: AccessView, failures: Mapping[str, Failure], now: float, dir_of: DirOf
) -> tuple[tuple[BridgeAttach, UnitDeviceAllow], ...]:
    """A bridge, and the DeviceAllow= that follows it, for each scope in `view` (v2
    containers) whose cgroup denies entitled nodes (verdicts False; unknown ones wait
    for the pass)."""
    targets = bridge_targets(view, failures, now, dir_of)
    return tuple(bridge_actions(c, cg, d) for c, cg, d in targets)


def detach_of(a: BridgeAttach, reason: str) -> BridgeDetach:
    return BridgeDetach(
        reconciler=a.reconciler,
        reason=reason,
        target=a.target,
        cgroup_dir=a.cgroup_dir,
        unit=a.unit,
        pod_uid=a.pod_uid,
        container_id=a.container_id,
        nodes=a.nodes,
        numbers=a.numbers,
    )
