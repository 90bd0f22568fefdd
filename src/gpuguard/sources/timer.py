"""The periodic looks: every AuditInterval= seconds an AUDIT event (every step looks),
and every WatchInterval= a DEVICE_WATCH tick (the cheap look at the GPU containers'
device cgroups that a pass's full walk is too slow for).

Both catch what no event announces (a device rule rewritten by a runtime or by hand, a
plugin gone stale without a restart)."""

from __future__ import annotations

import asyncio
from typing import Callable

from gpuguard.steps.events import Event, EventKind

Emit = Callable[[Event], None]


class AuditTimer:
    def __init__(self, emit: Emit, interval: float) -> None:
        self.emit = emit
        self.interval = interval  # re-read each round: SIGHUP may change it

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            self.emit(Event(EventKind.AUDIT, "periodic audit"))


class WatchTimer:
    """Every WatchInterval= seconds, a DEVICE_WATCH tick (the steps' device watches:
    what no event announces, e.g. a v1 devices.list a runtime rewrote). 0: off."""

    def __init__(self, emit: Emit, interval: float) -> None:
        self.emit = emit
        self.interval = interval  # re-read each round: SIGHUP may change it
        self._changed = asyncio.Event()

    def set_interval(self, interval: float) -> None:
        self.interval = interval
        self._changed.set()  # an off watch waits for this, not for a long sleep

    async def run(self) -> None:
        tick = Event(EventKind.DEVICE_WATCH, "device watch")  # one object: 5 a second
        while True:
            if self.interval <= 0:
                self._changed.clear()
                await self._changed.wait()
                continue
            await asyncio.sleep(self.interval)
            if self.interval > 0:
                self.emit(tick)
