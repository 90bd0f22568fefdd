"""Where a burst of the event loop's time went: on a CPU, or runnable and waiting for
one. The kernel keeps both per thread: CLOCK_THREAD_CPUTIME_ID (time.thread_time, exact
to the call) and the run-queue wait in /proc/thread-self/schedstat (CONFIG_SCHED_INFO;
its CPU field is only brought up to date at the scheduler's ticks, so it is not used).
The reload fast path records both, so that a slow repair on a busy node tells its own
work from the node's contention (bench/README.md, "Where the v2 reload sweep's time
goes")."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional

SCHEDSTAT = "/proc/thread-self/schedstat"  # the calling thread's own: not a host path


@dataclass(frozen=True)
class ThreadClock:
    on_cpu: float  # seconds
    waiting: float  # seconds runnable but not running

    def since(self, start: ThreadClock) -> ThreadClock:
        return ThreadClock(self.on_cpu - start.on_cpu, self.waiting - start.waiting)


def thread_clock() -> Optional[ThreadClock]:
    """The calling thread's totals so far; None where the kernel does not keep them."""
    try:
        with open(SCHEDSTAT, "rb") as f:
            waiting = f.read(128).split()[1]
        return ThreadClock(time.thread_time(), int(waiting) / 1e9)
    except (OSError, ValueError, IndexError):
        return None
