"""A scope's DeviceAllow= reset at runtime, repaired for that one scope at once.

A runtime's systemd driver (an update) or an operator's `systemctl set-property` can
set a running container scope's DeviceAllow= to a list without the GPU gpuguard made
durable; systemd applies it, and the container loses its GPU. No D-Bus signal says so:
the file systemd rewrites for it does (sources/transient.py, SCOPE_DEVICES_SET with the
unit). Waiting for the quiet period and a full pass over every container put the
repair behind whatever else the node was doing (a soak's p99: 3.6 s); this path looks
at the one scope named and, where it lost what gpuguard granted, sets it again through
the same actuator, then asks for the pass as the backstop.

What it restores is only what gpuguard itself granted that scope and recorded (the
step's `durable` record: numbers a pass judged the container entitled to), so it can
never grant more than a pass would. Whatever it cannot tell (no record, gpuguard's own
drop-in for the scope gone, no such known container, the unit's files unreadable, the
new-scope path still busy with it) is left to the pass, as before.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections import deque
from typing import (
    TYPE_CHECKING,
    AbstractSet,
    Awaitable,
    Callable,
    Mapping,
    Optional,
    Sequence,
    Union,
)

from gpuguard.actuate.dropins import DropInError, dropin_path
from gpuguard.devices.scopepolicy import ScopeDevices, scope_devices
from gpuguard.model import Outcome
from gpuguard.steps.container_access.actions import UnitDeviceAllow
from gpuguard.steps.container_access.durable import NAME
from gpuguard.steps.container_access.newscope import p50_p99

if TYPE_CHECKING:
    from gpuguard.devices.containers import ContainerCgroup
    from gpuguard.devices.entitlement import Entitlement
    from gpuguard.engine.passes import Services
    from gpuguard.host.systemd import Systemd

Grant = Callable[[UnitDeviceAllow, "Services", Optional["Systemd"]], Awaitable[Outcome]]
Known = Callable[[], Sequence[tuple["ContainerCgroup", "Entitlement"]]]
REASON = "its scope's DeviceAllow= was set at runtime without the GPU gpuguard had granted it"


def lost_grants(devices: ScopeDevices, granted: AbstractSet[str]) -> tuple[str, ...]:
    """The device numbers ("195:0") in `granted` that the scope's DeviceAllow= no longer
    lists with read and write access (sorted: one action, the same for the same loss)."""
    return tuple(sorted(n for n in granted if n not in devices.numbers))


def reset_action(
    c: ContainerCgroup, ent: Entitlement, lost: Sequence[str]
) -> Optional[UnitDeviceAllow]:
    """The durable grant again, for the nodes of `lost` the container is entitled to
    now (None: none of them is)."""
    nodes = [n for n in ent.nodes if n.numbers in lost]
    if not nodes or c.unit is None:
        return None
    return UnitDeviceAllow(
        reconciler=NAME,
        reason=REASON,
        target=c.unit,
        unit=c.unit,
        devices=tuple((n.dev_char, "rw") for n in nodes),
        pod_uid=c.pod_uid,
        container_id=c.container_id,
        nodes=tuple(n.path for n in nodes),
        numbers=tuple(n.numbers for n in nodes),
    )


def _has_dropin(svc: Services, unit: str) -> bool:
    try:
        return os.path.lexists(svc.root.path(dropin_path(unit)))
    except DropInError:  # not a container scope's name
        return False


class ScopeResets:
    """The fast path for SCOPE_DEVICES_SET: `on_devices_set` on the loop, the grant as
    a task. Latencies (event -> systemd's reply, ms) of the last repairs for status."""

    def __init__(
        self,
        durable: Mapping[str, AbstractSet[str]],
        grant: Grant,
        carry: Callable[[Outcome], None],
        known: Known,
        busy: Callable[[], AbstractSet[str]],
    ) -> None:
        self.durable, self.grant, self.carry = durable, grant, carry
        self.known, self.busy = known, busy
        self._tasks: set[asyncio.Task[None]] = set()
        self._inflight: set[str] = set()
        self._timings: deque[float] = deque(maxlen=256)
        self._fresh: deque[float] = deque(maxlen=1024)  # seconds, not yet in the metrics
        self.repaired = 0

    def on_devices_set(self, svc: Services, unit: str, again: Callable[[str], None]) -> bool:
        """True when this path took the event (a grant is on its way: it asks for the
        pass itself when done); False: mark the pass, as without it."""
        cfg = svc.config
        if not (cfg.devices.regrant and cfg.devices.durable_grants) or svc.systemd is None:
            return False
        granted = self.durable.get(unit)
        if not granted or unit in self.busy() or unit in self._inflight:
            return self._to_pass(svc, unit, "no grant of gpuguard's recorded, or one on its way")
        # gpuguard's drop-in is its own mark of the grant: where it is gone, someone took
        # the grant away on purpose (or made the scope anew), and the pass judges it.
        if not _has_dropin(svc, unit):
            return self._to_pass(svc, unit, "gpuguard's drop-in for it is gone")
        # Inline on the loop: a few hundred bytes of tmpfs, bounded (scopepolicy.py); a
        # thread hop would cost more than the read.
        devices = scope_devices(svc.root, unit)
        if devices is None:
            return self._to_pass(svc, unit, "its transient unit files could not be read")
        lost = lost_grants(devices, granted)
        if not lost:
            return self._to_pass(svc, unit, "its DeviceAllow= still lists gpuguard's grant")
        pair = next(((c, e) for c, e in self.known() if c.unit == unit), None)
        action = None if pair is None else reset_action(pair[0], pair[1], lost)
        if action is None:
            return self._to_pass(svc, unit, "not a GPU container the last pass knew entitled")
        self._inflight.add(unit)
        task = asyncio.ensure_future(self._repair(action, svc, time.monotonic(), again))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return True

    def _to_pass(self, svc: Services, unit: str, why: str) -> bool:
        svc.log.debug(f"{unit}: device properties set at runtime, left to the pass: {why}")
        return False

    async def _repair(
        self, action: UnitDeviceAllow, svc: Services, began: float, again: Callable[[str], None]
    ) -> None:
        try:
            outcome = await self.grant(action, svc, svc.systemd)
            svc.log.outcome(outcome)
            self.carry(outcome)
            if outcome.status == "done":
                self.repaired += 1
                took = time.monotonic() - began
                self._timings.append(took * 1000)
                self._fresh.append(took)
        except Exception as e:  # the pass repairs it: never the loop down
            svc.log.warning(f"{action.unit}: DeviceAllow= reset fast path failed ({e})")
        finally:
            self._inflight.discard(action.unit)
            again(f"systemd: {action.unit}: DeviceAllow= set at runtime")

    def take(self) -> list[float]:
        """The seconds of each repair since the last call (the metrics' histogram)."""
        out = list(self._fresh)
        self._fresh.clear()
        return out

    def status(self) -> dict[str, Union[int, list[float]]]:
        """Repairs made, and p50/p99 of event -> systemd's reply (ms)."""
        out: dict[str, Union[int, list[float]]] = {"repaired": self.repaired}
        figures = p50_p99(self._timings)
        if figures:
            out["repair_ms"] = figures
        return out
