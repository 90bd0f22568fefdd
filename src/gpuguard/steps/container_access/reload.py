"""The v1 re-grant right after a daemon-reload: the last pass's v1 GPU containers,
each read and, where an entitled node is denied, written at once, one after another
(the first has its GPU back before the second is read).

Only the reads and the writes are on this path. The actions and outcomes the journal
needs are built after the last write (`V1Write.outcome`: ~10 us each, about as much as
the write itself), and every write is read back after that (actuate.confirm_v1).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, AbstractSet, Callable, Mapping, Optional, Sequence

from gpuguard.model import Outcome
from gpuguard.steps.container_access.actuate import write_grants
from gpuguard.steps.container_access.reconcile import AccessKey, v1_allow
from gpuguard.steps.container_access.settle import outside_apply

if TYPE_CHECKING:
    from gpuguard.devices.containers import ContainerCgroup
    from gpuguard.devices.entitlement import Entitlement
    from gpuguard.devices.nodes import DeviceNode
    from gpuguard.devices.rules import DeviceRules

Pair = tuple["ContainerCgroup", "Entitlement"]
# AccessObserver.read_v1: the pairs' devices.list read into access, rules and broken
ReadV1 = Callable[
    [Sequence[Pair], dict[AccessKey, Optional[bool]], dict[str, "DeviceRules"], dict[str, str]],
    None,
]


@dataclass(frozen=True)
class V1Write:
    """One container's re-grant: the nodes written, when, and how it went."""

    container: ContainerCgroup
    denied: tuple[DeviceNode, ...]
    at: float  # time.monotonic() right after the write
    status: str
    detail: str

    def outcome(self) -> Outcome:
        c = self.container
        assert c.cgroup_v1_devices is not None
        return Outcome(v1_allow(c, c.cgroup_v1_devices, self.denied), self.status, self.detail)


def regrant(
    c: ContainerCgroup,
    ent: Entitlement,
    access: Mapping[AccessKey, Optional[bool]],
    *,
    dry_run: bool,
) -> Optional[V1Write]:
    """Write back every entitled node `access` judges denied (False) on `c`'s v1
    devices cgroup; None when there is nothing to write."""
    if c.cgroup_v1_devices is None:
        return None
    denied = tuple(n for n in ent.nodes if access.get((c.container_id, n.numbers)) is False)
    if not denied:
        return None
    rules = [n.allow_line("rw") for n in denied]
    status, detail = write_grants(c.cgroup_v1_devices, rules, dry_run=dry_run)
    return V1Write(c, denied, time.monotonic(), status, detail)


@dataclass
class V1Sweep:
    """What a sweep read (for the journal's audit after it) and wrote."""

    access: dict[AccessKey, Optional[bool]] = field(default_factory=dict)
    rules: dict[str, DeviceRules] = field(default_factory=dict)
    broken: dict[str, str] = field(default_factory=dict)
    writes: list[V1Write] = field(default_factory=list)


def sweep_v1(
    pairs: Sequence[Pair],
    read: ReadV1,
    durable: Mapping[str, AbstractSet[str]],
    *,
    dry_run: bool,
) -> V1Sweep:
    """Each of `pairs` read, then re-granted what it lost. A denial the scope's
    DeviceAllow= covers (`durable`, as gpuguard set it) is judged unknown and left to
    the full pass's settled re-read: a read inside systemd's own deny-all-then-allow
    apply is no loss (settle.py)."""
    s = V1Sweep()
    for pair in pairs:
        c, ent = pair
        seen: dict[AccessKey, Optional[bool]] = {}
        read((pair,), seen, s.rules, s.broken)
        seen = outside_apply((c,), {c.key: ent}, seen, durable, frozenset()) or seen
        s.access.update(seen)
        w = regrant(c, ent, seen, dry_run=dry_run)
        if w is not None:
            s.writes.append(w)
    return s
