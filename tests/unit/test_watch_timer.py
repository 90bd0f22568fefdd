"""The device watch's tick (sources/timer.py WatchTimer): DEVICE_WATCH every interval,
none while the interval is 0, and a new interval (SIGHUP) takes effect without waiting
out the old one."""

from __future__ import annotations

import asyncio

from gpuguard.sources.timer import WatchTimer
from gpuguard.steps.events import Event, EventKind


def _ticks(first: float, then: float, seconds: float) -> tuple[int, int]:
    seen: list[Event] = []

    async def go() -> tuple[int, int]:
        t = WatchTimer(seen.append, first)
        task = asyncio.ensure_future(t.run())
        await asyncio.sleep(seconds)
        before = len(seen)
        t.set_interval(then)
        await asyncio.sleep(seconds)
        task.cancel()
        return before, len(seen) - before

    return asyncio.run(go())


def test_ticks_at_the_interval_and_are_device_watch_events() -> None:
    seen: list[Event] = []

    async def go() -> None:
        task = asyncio.ensure_future(WatchTimer(seen.append, 0.01).run())
        await asyncio.sleep(0.2)
        task.cancel()

    asyncio.run(go())
    assert len(seen) >= 3
    assert {e.kind for e in seen} == {EventKind.DEVICE_WATCH}


def test_zero_is_off_and_a_new_interval_starts_it() -> None:
    off, on = _ticks(0.0, 0.01, 0.2)
    assert off == 0 and on >= 3


def test_set_to_zero_stops_the_ticks() -> None:
    on, off = _ticks(0.01, 0.0, 0.2)
    assert on >= 3 and off <= 1  # at most the sleep already under way
