"""The periodic audit: every AuditInterval= seconds, every step may have work.

Catches what no event announces (a device rule rewritten by hand, a plugin gone stale
without a restart)."""

from __future__ import annotations

import asyncio
from typing import Callable

from gpuguard.steps.registry import ALL_STEPS

Mark = Callable[[frozenset[str], str, bool], None]


class AuditTimer:
    def __init__(self, mark: Mark, interval: float) -> None:
        self.mark = mark
        self.interval = interval  # re-read each round: SIGHUP may change it

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            self.mark(ALL_STEPS, "periodic audit", False)
