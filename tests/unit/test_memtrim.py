"""The C heap's freed pages handed back after a pass, at most once per interval and
once more when the interval is up, a full collection first, and glibc's mmap threshold
fixed (host/memtrim.py), where the C library has malloc_trim and mallopt."""

from __future__ import annotations

import asyncio
import ctypes.util
import subprocess
import sys

import pytest

from gpuguard.engine.gcpause import collector_paused
from gpuguard.host import memtrim
from gpuguard.host.memtrim import MemoryTrim


def nothing() -> None:
    """No full collection: in a test process it can outlast the intervals used here."""


def test_trims_at_most_once_per_interval() -> None:
    now = [100.0]
    trim = MemoryTrim(interval=60.0, clock=lambda: now[0])
    if not trim.available:
        pytest.skip("this C library has no malloc_trim")
    assert trim.after_pass()  # the first pass trims
    now[0] += 59.0
    assert not trim.after_pass()
    now[0] += 1.0
    assert trim.after_pass()
    assert trim.trims == 2


def test_glibc_has_it() -> None:
    if "musl" in (ctypes.util.find_library("c") or ""):
        pytest.skip("musl: nothing to trim with")
    assert MemoryTrim().available  # Debian's and RHEL's glibc: the daemon's hosts


def test_collects_before_each_trim() -> None:
    collected: list[int] = []
    trim = MemoryTrim(interval=10.0, clock=lambda: 0.0, collect=lambda: collected.append(1))
    if not trim.available:
        pytest.skip("this C library has no malloc_trim")
    trim.after_pass()
    assert collected == [1]


def test_a_skipped_trim_is_made_when_due_on_the_loop() -> None:
    """The last pass of a burst came 2 s after a trim: its garbage goes back 8 s later,
    though no pass follows; passes in between arm no second timer."""

    async def burst() -> tuple[int, int, bool]:
        loop = asyncio.get_running_loop()
        trim = MemoryTrim(interval=0.2, clock=loop.time, collect=nothing)
        if not trim.available:
            pytest.skip("this C library has no malloc_trim")
        assert trim.after_pass()
        assert not trim.after_pass() and trim.deferred
        assert not trim.after_pass()  # the waiting timer covers this one
        before = trim.trims
        await asyncio.sleep(0.4)
        return before, trim.trims, trim.deferred

    before, after, waiting = asyncio.run(burst())
    assert (before, after, waiting) == (1, 2, False)


def test_a_due_trim_waits_out_a_repair_window() -> None:
    """The collector is paused (a fast path's window, engine/gcpause.py): no collection
    and no trim inside it; the trim follows once the window has closed."""

    async def window() -> tuple[int, int]:
        loop = asyncio.get_running_loop()
        trim = MemoryTrim(interval=0.05, clock=loop.time, collect=nothing)
        if not trim.available:
            pytest.skip("this C library has no malloc_trim")
        trim.after_pass()
        trim.after_pass()  # deferred by 0.05 s
        with collector_paused():
            await asyncio.sleep(0.2)
            inside = trim.trims
        await asyncio.sleep(memtrim.WINDOW_RETRY + 0.2)
        return inside, trim.trims

    assert asyncio.run(window()) == (1, 2)


def test_cancel_drops_the_waiting_trim() -> None:
    async def stop() -> int:
        loop = asyncio.get_running_loop()
        trim = MemoryTrim(interval=0.05, clock=loop.time, collect=nothing)
        if not trim.available:
            pytest.skip("this C library has no malloc_trim")
        trim.after_pass()
        trim.after_pass()
        trim.cancel()
        await asyncio.sleep(0.15)
        return trim.trims

    assert asyncio.run(stop()) == 1


def test_outside_a_loop_the_next_pass_trims() -> None:
    now = [0.0]
    trim = MemoryTrim(interval=10.0, clock=lambda: now[0])
    if not trim.available:
        pytest.skip("this C library has no malloc_trim")
    trim.after_pass()
    assert not trim.after_pass() and not trim.deferred


def test_the_mmap_threshold_is_fixed_where_glibc_is() -> None:
    """In a child: the setting is the whole process's."""
    if "musl" in (ctypes.util.find_library("c") or ""):
        pytest.skip("musl: no mallopt")
    code = "from gpuguard.host.memtrim import fix_mmap_threshold as f; print(f(), f(1 << 20))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["True", "True"]
