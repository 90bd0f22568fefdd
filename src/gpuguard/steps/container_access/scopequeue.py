"""The queue of new container scopes waiting for their fast path (one grant each).

A burst of container starts (a node filling up, a deployment scaled to 200) must get
one grant per scope without flooding systemd, which handles D-Bus calls one at a time:
- a scope is queued once: a second announcement while it waits or is handled is dropped;
- at most `concurrency` are handled at once; the rest wait their turn, in order;
- a scope that is not ready yet (its process has not switched to the container's /dev)
  is tried again after a short back-off, without holding a slot meanwhile, and given
  up after `give_up_after` seconds (the full pass is the backstop);
- one scope's error is that scope's: it is reported and the others go on;
- past `capacity` waiting scopes, new ones are left to the full pass.
Holds no host knowledge: the handler says "done" or "not ready yet".
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from typing import Awaitable, Callable

# Handled: True (finished, whatever was decided), False (not ready yet: try again).
Handler = Callable[[str], Awaitable[bool]]
GiveUp = Callable[[str, str], None]  # (key, why): left to the full pass
Failed = Callable[[str, BaseException], None]

# A retry is a few reads of one scope's files (~0.1-0.3 ms): cheap enough to look every
# 20 ms (a runtime takes 0.1-1 s to get there). Once found ready the grant is durable
# within a millisecond (its drop-in), so this wait is most of a new container's window:
# 200 starts in a burst, ready -> durable p50 19-21 ms with 50 ms, 6-8 ms with 20 (v2).
RETRY_DELAYS = (0.005, 0.01, 0.02)  # then every 20 ms until give-up


class ScopeQueue:
    def __init__(
        self,
        handle: Handler,
        *,
        on_give_up: GiveUp,
        on_error: Failed,
        concurrency: int = 8,
        capacity: int = 4096,
        give_up_after: float = 10.0,
        retry_delays: tuple[float, ...] = RETRY_DELAYS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.handle = handle
        self.on_give_up = on_give_up
        self.on_error = on_error
        self.concurrency = concurrency
        self.capacity = capacity
        self.give_up_after = give_up_after
        self.retry_delays = retry_delays
        self.clock = clock
        self._ready: deque[str] = deque()
        self._first_seen: dict[str, float] = {}  # every key queued, waiting or handled
        self._attempts: dict[str, int] = {}
        self._running = 0
        self._tasks: set[asyncio.Task[None]] = set()
        self._timers: dict[str, asyncio.TimerHandle] = {}
        self.handled = 0  # finished keys, for the status file and tests
        self.peak_running = 0

    def add(self, key: str) -> bool:
        """Queue `key`; False when it is already queued or the queue is full."""
        if key in self._first_seen:
            return False
        if len(self._first_seen) >= self.capacity:
            self.on_give_up(key, f"more than {self.capacity} new scopes waiting")
            return False
        self._first_seen[key] = self.clock()
        self._ready.append(key)
        self._start_more()
        return True

    def busy(self) -> frozenset[str]:
        """Every key queued, waiting for a retry or being handled."""
        return frozenset(self._first_seen)

    @property
    def idle(self) -> bool:
        return not self._first_seen

    def _start_more(self) -> None:
        while self._ready and self._running < self.concurrency:
            key = self._ready.popleft()
            self._running += 1
            self.peak_running = max(self.peak_running, self._running)
            task = asyncio.ensure_future(self._work(key))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _work(self, key: str) -> None:
        try:
            finished = await self.handle(key)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # this scope's error only: the others go on
            finished = True
            self.on_error(key, e)
        finally:
            self._running -= 1
        if finished:
            self._finish(key)
        else:
            self._retry_later(key)
        self._start_more()

    def _finish(self, key: str) -> None:
        self._first_seen.pop(key, None)
        self._attempts.pop(key, None)
        self.handled += 1

    def _retry_later(self, key: str) -> None:
        first = self._first_seen.get(key)
        if first is None:  # stopped meanwhile
            return
        if self.clock() - first >= self.give_up_after:
            self._finish(key)
            self.on_give_up(key, f"not ready after {self.give_up_after:.0f}s")
            return
        n = self._attempts.get(key, 0)
        self._attempts[key] = n + 1
        delay = self.retry_delays[min(n, len(self.retry_delays) - 1)]
        loop = asyncio.get_running_loop()
        self._timers[key] = loop.call_later(delay, self._due, key)

    def _due(self, key: str) -> None:
        self._timers.pop(key, None)
        if key in self._first_seen:
            self._ready.append(key)
            self._start_more()
