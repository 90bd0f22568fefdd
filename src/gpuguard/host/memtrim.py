"""Memory the daemon freed handed back to the kernel: after a pass, at most every 2 s,
and 2 s after the last pass of a burst when no pass follows it.

The daemon's Python objects stay flat under sustained events (bench/soak.py --memtrace:
the traced heap grew 47 KiB in 5 minutes of one event a second), yet its RSS grew by
about 0.4 MB a minute: each burst (a daemon-reload's hundreds of D-Bus signals, a pass
over every container) raises the C heap's high-water mark, and glibc gives freed pages
in the middle of its heaps back only when asked (`malloc_trim`: it releases every whole
free page of every arena, not only the top). A full collection goes first: cyclic
garbage (an exception's frames, a finished task's) lives until one, and pins pages of
both heaps (Python's own arenas and the C heap) that the trim could otherwise release.
After start-up's objects are frozen (engine/gcpause.py) it walks only what passes
created: about a millisecond. A trim skipped because the last was too recent is made
when it is due, on the running loop, so the RSS of a node gone quiet is what the daemon
holds, not what its last burst left behind; never inside a fast path's repair window
(the collector is paused there): it waits for the window to close.

Where the C library has no `malloc_trim` (musl), this does nothing.
"""

from __future__ import annotations

import asyncio
import ctypes
import gc
import time
from typing import Callable, Optional

from gpuguard.host.libc import function

TRIM_INTERVAL = 2.0  # seconds between two trims at most; one costs 1-2 ms (0.1 % CPU)
WINDOW_RETRY = 1.0  # seconds: a trim due inside a repair window is tried again after
# glibc serves a block this large or larger from its own mmap, given back when freed. Its
# default moves the threshold up to the largest block freed so far (up to 32 MiB), after
# which a pass's big transient buffers (the status document's JSON, a long file read)
# were carved out of the heap and left holes there that later small blocks pinned.
MMAP_THRESHOLD = 64 * 1024
_M_MMAP_THRESHOLD = -3  # mallopt's parameter number (malloc.h)


def _libc_function(name: str, *argtypes: type) -> Optional[Callable[..., int]]:
    """The C library's `name` returning an int, None where it has none (musl)."""
    return function(name, argtypes=argtypes, restype=ctypes.c_int)


def fix_mmap_threshold(size: int = MMAP_THRESHOLD) -> bool:
    """Blocks of `size` bytes or more from mmap, at a threshold that no longer moves
    (the daemon calls it once at start). False where the C library has no mallopt."""
    mallopt = _libc_function("mallopt", ctypes.c_int, ctypes.c_int)
    return mallopt is not None and bool(mallopt(_M_MMAP_THRESHOLD, size))


class MemoryTrim:
    """`after_pass()`: collect and trim now if the last trim is `interval` old, else
    once it is (a timer on the running loop, if there is one); `trims` counts them."""

    def __init__(
        self,
        interval: float = TRIM_INTERVAL,
        clock: Callable[[], float] = time.monotonic,
        collect: Callable[[], object] = gc.collect,
    ) -> None:
        self.interval, self.clock, self.collect = interval, clock, collect
        self._trim = _libc_function("malloc_trim", ctypes.c_size_t)
        self._last: Optional[float] = None
        self._later: Optional[asyncio.TimerHandle] = None
        self.trims = 0

    @property
    def available(self) -> bool:
        return self._trim is not None

    @property
    def deferred(self) -> bool:
        """A trim is waiting for its time."""
        return self._later is not None

    def after_pass(self) -> bool:
        """True when it trimmed now."""
        if self._trim is None:
            return False
        now = self.clock()
        if self._last is not None and now - self._last < self.interval:
            self._defer(self._last + self.interval - now)
            return False
        self._run(now)
        return True

    def cancel(self) -> None:
        """No trim later (the daemon's loop is ending)."""
        if self._later is not None:
            self._later.cancel()
            self._later = None

    def _defer(self, delay: float) -> None:
        if self._later is not None:
            return  # one is already waiting: it trims what this pass freed too
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # no loop (a one-shot command): the next pass trims
        self._later = loop.call_later(delay, self._due)

    def _due(self) -> None:
        self._later = None
        if not gc.isenabled():  # a repair window (engine/gcpause.py): after it
            self._defer(WINDOW_RETRY)
            return
        self._run(self.clock())

    def _run(self, now: float) -> None:
        if self._trim is None:
            return
        self._last = now
        self.collect()
        self._trim(0)
        self.trims += 1
