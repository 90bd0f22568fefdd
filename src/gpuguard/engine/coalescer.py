"""Coalesces marks into passes: one at a time, after a quiet period.

The daemon calls mark(steps, why, urgent) for each event a source emits (the steps the
registry wakes on it) and each follow-up a step asked for. A pass starts once no mark arrived for
the quiet period (the timer restarts on every mark, so a daemon-reload's burst of
hundreds of signals becomes one pass), but never later than max_delay after the
first pending mark. Urgent marks (systemd's Reloading end, a reexec) use the short
quiet period, and the pass they bring says so (`Work.urgent`). Marks arriving during
a pass are kept for the next one. While held (systemd is in the middle of a reload:
units are in flux) no pass starts, up to max_hold.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Awaitable, Callable, Optional

from gpuguard.engine.passes import Work
from gpuguard.host import aio

RunPass = Callable[[Work], Awaitable[None]]


class Coalescer:
    def __init__(
        self,
        run_pass: RunPass,
        *,
        quiet: float = 0.15,
        urgent_quiet: float = 0.005,
        max_delay: float = 2.0,
        max_hold: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.run_pass = run_pass
        self.quiet = quiet
        self.urgent_quiet = urgent_quiet
        self.max_delay = max_delay
        self.max_hold = max_hold
        self.clock = clock
        self._pending: set[str] = set()
        self._reasons: list[str] = []
        self._first: Optional[float] = None
        self._last = 0.0
        self._urgent = False
        self._held_since: Optional[float] = None
        self._wake = aio.Event()  # made in main, before the loop runs (aio.py)
        self._stopping = False
        self.passes = 0
        self.running = False
        self.pass_started = 0.0

    def mark(self, reconcilers: frozenset[str], why: str, urgent: bool = False) -> None:
        now = self.clock()
        if self._first is None:
            self._first = now
        self._last = now
        self._pending |= reconcilers
        # a burst needs no more than a sample in the journal, each reason once
        if len(self._reasons) < 64 and why not in self._reasons:
            self._reasons.append(why)
        self._urgent = self._urgent or urgent
        self._wake.set()

    def hold(self, on: bool) -> None:
        self._held_since = self.clock() if on else None
        self._wake.set()

    def stop(self) -> None:
        """Finish the pass in progress (if any), then return from run()."""
        self._stopping = True
        self._wake.set()

    @property
    def pending(self) -> bool:
        return bool(self._pending)

    def _deadline(self) -> float:
        assert self._first is not None
        quiet = self.urgent_quiet if self._urgent else self.quiet
        due = min(self._last + quiet, self._first + self.max_delay)
        if self._held_since is not None:
            due = max(due, self._held_since + self.max_hold)
        return due

    async def run(self) -> None:
        while not self._stopping:
            if not self._pending:
                self._wake.clear()
                await self._wake.wait()
                continue
            delay = self._deadline() - self.clock()
            if delay > 0:
                self._wake.clear()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), timeout=delay)
                continue  # recompute: a new mark may have moved the deadline
            assert self._first is not None
            work = Work(
                frozenset(self._pending),
                tuple(self._reasons),
                self._first,
                self._last,
                urgent=self._urgent,
            )
            self._pending.clear()
            self._reasons.clear()
            self._first = None
            self._urgent = False
            self.running = True
            self.pass_started = self.clock()
            try:
                await self.run_pass(work)
            finally:
                self.running = False
                self.passes += 1
