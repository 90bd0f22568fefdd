"""Which container scopes still need their grant made durable, and what a reload's
re-grant did (pure: no OS access, no writes).

Never narrow: a scope that admits every device already (a privileged container's:
DevicePolicy=auto and no DeviceAllow= entries, so on v1 "a *:* rwm" and on v2 no device
program, or crun's allow-all one) has nothing to repair, and a DeviceAllow= on it would
turn "everything" into a closed list (systemd then admits the entries and its few
pseudo-devices: /dev/kmsg became EPERM in a privileged pod). Such a scope gets none,
whatever asked for it (the audit, the durable grant of a new or known container); its
layout's read says which they are (`AccessView.unconfined`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, AbstractSet, Mapping, Optional, Sequence

from gpuguard.model import Action
from gpuguard.steps.container_access.actions import UnitDropInRemove, V2ProgramReplace
from gpuguard.steps.container_access.reconcile import UnitDeviceAllow
from gpuguard.steps.container_access.view import AccessView
from gpuguard.steps.registry import CONTAINER_ACCESS

if TYPE_CHECKING:
    from gpuguard.reporting.status_figures import ReloadFigures

NAME = CONTAINER_ACCESS


def keep_open(
    view: AccessView,
    units: Sequence[UnitDeviceAllow],
    durable: Optional[Mapping[str, AbstractSet[str]]] = None,
    in_place: Sequence[Action] = (),
) -> list[UnitDeviceAllow]:
    """`units` without those that would narrow a scope that admits everything, nor
    those that only repeat what the scope's DeviceAllow= has (`durable`) while the
    runtime's own program that denies is repaired in place (`in_place`: the pass's
    V2ProgramReplace actions): setting it again would change nothing."""
    fixed = {a.container_id for a in in_place if isinstance(a, V2ProgramReplace)}
    out = []
    for a in units:
        if a.container_id in view.unconfined:
            continue
        if a.container_id in fixed and set(a.numbers) <= set((durable or {}).get(a.unit, ())):
            continue
        out.append(a)
    return out


def plan_durable(
    view: AccessView,
    planned: tuple[Action, ...],
    durable: Mapping[str, AbstractSet[str]],
    links: AbstractSet[str],
) -> tuple[UnitDeviceAllow, ...]:
    """Every DeviceAllow= to set: the planned ones (`planned`: the audit's, for denied
    nodes) kept by `keep_open`, then one for each GPU container whose scope does not
    carry its grant yet. Never for a scope that admits every device (module doc).

    `durable`: unit -> device numbers its DeviceAllow= already has (only units we
    know); `links`: the /dev/char paths that exist (systemd resolves through them).
    """
    units = [a for a in planned if isinstance(a, UnitDeviceAllow)]
    out = keep_open(view, units, durable, planned)
    already: dict[str, set[str]] = {}
    for a in units:
        already.setdefault(a.unit, set()).update(a.numbers)
    for c in view.containers:
        ent = view.entitlements.get(c.key)
        if c.unit is None or ent is None or not ent.readable or not ent.is_gpu_container:
            continue
        if c.container_id in view.unconfined:
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

    def figures(self) -> ReloadFigures:
        """For the status file (reporting/status_figures.py)."""
        from gpuguard.reporting.status_figures import ReloadFigures

        return ReloadFigures.of(
            signal=self.signal,
            containers=self.containers,
            checked=self.checked,
            first_write=self.first_write,
            last_write=self.last_write,
            cpu_ms=self.cpu_ms,
            cpu_wait_ms=self.cpu_wait_ms,
            restored=self.restored,
        )

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
