"""The v2 bridge's plan (pure): which scopes get a bridge, for which nodes, and the
actions journaled for it: the attach, the DeviceAllow= that follows, the detach.
What a bridge is and why it is safe: bridge.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping, Optional, Sequence

from gpuguard.steps.container_access.inplace import Failure
from gpuguard.steps.container_access.observe import AccessView
from gpuguard.steps.container_access.reconcile import (
    RECONCILER,
    AccessKey,
    ContainerDeviceAction,
    UnitDeviceAllow,
)

if TYPE_CHECKING:
    from gpuguard.devices.containers import ContainerCgroup
    from gpuguard.devices.entitlement import Entitlement
    from gpuguard.devices.nodes import DeviceNode

ACTION_ATTACH = "v2-bridge-attach"
ACTION_DETACH = "v2-bridge-detach"


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
    ent: Optional[Entitlement],
    access: Mapping[AccessKey, Optional[bool]],
    failures: Mapping[str, Failure],
    effective: Optional[tuple[int, ...]],
    now: float,
) -> tuple[DeviceNode, ...]:
    """The entitled nodes a bridge gives back to `c` (none: no bridge): on a v2 systemd
    scope, those its cgroup denies (verdicts False; unknown ones wait for the pass),
    unless the back-off holds the cgroup with the programs it runs now (`effective`)."""
    if c.unit is None or c.cgroup_v2 is None or c.cgroup_v1_devices is not None:
        return ()
    if ent is None or not ent.readable:
        return ()
    denied = tuple(n for n in ent.nodes if access.get((c.container_id, n.numbers)) is False)
    f = failures.get(str(c.cgroup_v2))
    if not denied or (f is not None and f.holds(effective, now)):
        return ()
    return denied


def bridge_actions(
    c: ContainerCgroup, denied: Sequence[DeviceNode]
) -> tuple[BridgeAttach, UnitDeviceAllow]:
    """A bridge for `denied` on `c`, and the DeviceAllow= that follows it."""
    assert c.unit is not None and c.cgroup_v2 is not None
    what = ", ".join(n.path for n in denied)
    common = dict(
        reconciler=RECONCILER,
        pod_uid=c.pod_uid,
        container_id=c.container_id,
        nodes=tuple(n.path for n in denied),
        numbers=tuple(n.numbers for n in denied),
    )
    bridge = BridgeAttach(
        reason=f"{what} denied on the scope's cgroup v2: stand in for systemd's program "
        "until the DeviceAllow= that follows is applied",
        target=str(c.cgroup_v2),
        cgroup_dir=str(c.cgroup_v2),
        unit=c.unit,
        **common,  # type: ignore[arg-type]
    )
    allow = UnitDeviceAllow(
        reason=f"re-grant {what} given to the container and denied by its cgroup",
        target=c.unit,
        unit=c.unit,
        devices=tuple((n.dev_char, "rw") for n in denied),
        **common,  # type: ignore[arg-type]
    )
    return bridge, allow


def bridge_targets(
    view: AccessView, failures: Mapping[str, Failure], now: float
) -> list[tuple[ContainerCgroup, tuple[DeviceNode, ...]]]:
    """Each v2 scope of `view` to bridge, with the nodes (`bridge_nodes`)."""
    out = []
    for c in view.containers:
        if c.container_id in view.broken:
            continue
        ent = view.entitlements.get(c.key)
        denied = bridge_nodes(
            c, ent, view.access, failures, view.effective.get(c.container_id), now
        )
        if denied:
            out.append((c, denied))
    return out


def plan_bridges(
    view: AccessView, failures: Mapping[str, Failure], now: float
) -> tuple[tuple[BridgeAttach, UnitDeviceAllow], ...]:
    """A bridge, and the DeviceAllow= that follows it, for each v2 scope in `view` whose
    cgroup denies entitled nodes (verdicts False; unknown ones wait for the pass)."""
    return tuple(bridge_actions(c, d) for c, d in bridge_targets(view, failures, now))


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
