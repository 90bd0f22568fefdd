"""Which container scopes still need their grant made durable, and what a reload's
re-grant did (pure: no OS access, no writes)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import AbstractSet, Mapping, Optional

from gpuguard.model import Action
from gpuguard.steps.container_access.actions import UnitDropInRemove
from gpuguard.steps.container_access.reconcile import UnitDeviceAllow
from gpuguard.steps.container_access.view import AccessView
from gpuguard.steps.registry import CONTAINER_ACCESS

NAME = CONTAINER_ACCESS


def plan_durable(
    view: AccessView,
    planned: tuple[Action, ...],
    durable: Mapping[str, AbstractSet[str]],
    links: AbstractSet[str],
) -> tuple[UnitDeviceAllow, ...]:
    """DeviceAllow= for GPU containers whose scope does not carry their grant yet.

    `durable`: unit -> device numbers its DeviceAllow= already has (only units we
    know); `links`: the /dev/char paths that exist (systemd resolves through them).
    """
    already = {a.unit: set(a.numbers) for a in planned if isinstance(a, UnitDeviceAllow)}
    out: list[UnitDeviceAllow] = []
    for c in view.containers:
        ent = view.entitlements.get(c.key)
        if c.unit is None or ent is None or not ent.readable or not ent.is_gpu_container:
            continue
        have = set(durable.get(c.unit, ())) | already.get(c.unit, set())
        todo = [n for n in ent.nodes if n.numbers not in have and n.dev_char in links]
        if not todo:
            continue
        out.append(
            UnitDeviceAllow(
                reconciler=NAME,
                reason="make the grant durable before any daemon-reload can wipe it",
                target=c.unit,
                unit=c.unit,
                devices=tuple((n.dev_char, "rw") for n in todo),
                pod_uid=c.pod_uid,
                container_id=c.container_id,
                nodes=tuple(n.path for n in todo),
                numbers=tuple(n.numbers for n in todo),
            )
        )
    return tuple(out)


def plan_dropin_removal(
    dropins: AbstractSet[str], live: AbstractSet[str]
) -> tuple[UnitDropInRemove, ...]:
    """The drop-ins of scopes not among `live` (the containers the pass found, and the
    scopes a fast path is handling): their containers are gone. The actuator checks
    again that the scope's cgroup is gone before it removes anything."""
    return tuple(
        UnitDropInRemove(
            reconciler=NAME,
            reason="its container scope is gone, and systemd never removes a drop-in",
            target=unit,
            unit=unit,
        )
        for unit in sorted(dropins - live)
    )


@dataclass(frozen=True)
class ReloadRepair:
    """What `on_reload` did, for the status file: the signal's arrival, the first and
    the last direct write (monotonic seconds), and how many containers it re-granted."""

    signal: float
    first_write: Optional[float]
    last_write: Optional[float]
    containers: int
    checked: int
    # The loop thread over the writes (on_reload's start to its sweep's end): on a CPU,
    # and runnable but waiting for one (host/threadclock.py; None where the kernel does not say)
    cpu_ms: Optional[float] = None
    cpu_wait_ms: Optional[float] = None
    restored: Optional[float] = None  # the last write that was done (not failed)

    def to_json(self) -> dict[str, object]:
        return {
            "signal": self.signal,
            "first_write": self.first_write,
            "last_write": self.last_write,
            "containers": self.containers,
            "checked": self.checked,
            "cpu_ms": self.cpu_ms,
            "cpu_wait_ms": self.cpu_wait_ms,
            "restored": self.restored,
        }
