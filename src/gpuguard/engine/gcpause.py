"""Python's cyclic garbage collector kept out of the reload's repair window.

A full collection walks every object the daemon holds (modules, the configuration, the
last pass's view: tens of thousands) and took about 20 ms in a process smaller than the
daemon, longer than the whole repair of 200 containers after a daemon-reload; young
collections run every few hundred allocations (a sweep of 200 containers triggered
about seven, 0.1-0.6 ms each) and any of them can escalate into a full one. The
window's own garbage is bounded by the number of containers, so its collection waits
until the window closes. Objects that live as long as the daemon are frozen after
start-up (`gc.freeze`): later full collections do not walk them again.
"""

from __future__ import annotations

import contextlib
import gc
from typing import Iterator


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """No automatic collection inside the block (as it was after it, also on error)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def freeze_long_lived() -> None:
    """Collect once, then move everything alive to the permanent generation: called
    when start-up is over, so later collections walk only what passes create."""
    gc.collect()
    gc.freeze()


def thaw() -> None:
    """Undo `freeze_long_lived` (the daemon's run ended: in a process that goes on, a
    test's, what was frozen is collected as usual again)."""
    gc.unfreeze()
