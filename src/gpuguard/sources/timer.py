"""The periodic audit: every AuditInterval= seconds, an AUDIT event (every step looks).

Catches what no event announces (a device rule rewritten by hand, a plugin gone stale
without a restart)."""

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
