"""Memory the daemon freed handed back to the kernel, at most every 10 s, after a pass.

The daemon's Python objects stay flat under sustained events (bench/soak.py --memtrace:
the traced heap grew 47 KiB in 5 minutes of one event a second), yet its RSS grew by
about 0.4 MB a minute: each burst (a daemon-reload's hundreds of D-Bus signals, a pass
over every container) raises the C heap's high-water mark, and glibc gives freed pages
in the middle of its heaps back only when asked (`malloc_trim`: it releases every whole
free page of every arena, not only the top). Asked after a pass, every 10 s at most,
the RSS follows what the daemon holds instead of its busiest moment so far.

Where the C library has no `malloc_trim` (musl), this does nothing.
"""

from __future__ import annotations

import ctypes
import time
from typing import Callable, Optional

TRIM_INTERVAL = 10.0  # seconds between two trims at most; one costs about a millisecond


def _malloc_trim() -> Optional[Callable[[int], int]]:
    try:
        fn = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
    return fn


class MemoryTrim:
    """`after_pass()`: trim if the last trim is TRIM_INTERVAL old; `trims` counts them."""

    def __init__(
        self, interval: float = TRIM_INTERVAL, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.interval, self.clock = interval, clock
        self._trim = _malloc_trim()
        self._last: Optional[float] = None
        self.trims = 0

    @property
    def available(self) -> bool:
        return self._trim is not None

    def after_pass(self) -> bool:
        """True when it trimmed now."""
        if self._trim is None:
            return False
        now = self.clock()
        if self._last is not None and now - self._last < self.interval:
            return False
        self._last = now
        self._trim(0)
        self.trims += 1
        return True
