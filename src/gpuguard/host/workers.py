"""The daemon's worker threads: a fixed few, not one per CPU.

Every blocking read the daemon makes (a pass's observation, a settled re-read, a new
scope's cgroup, the inventory) runs in asyncio's default executor. Left to asyncio,
that pool grows to min(32, CPUs + 4) threads as bursts come (20 on a 16-CPU node), and
glibc gives each new thread its own malloc arena: a soak on 2 CPUs saw a third and a
fourth arena appear after ten minutes, each holding 1-2 MB that `malloc_trim` could not
give back (chunks still live, scattered), so the RSS kept stepping up with the node's
size and the daemon's age. A pass runs one step at a time and the fast paths each wait
on one read, so a few threads are never the bottleneck; the unit also caps the arenas
(`MALLOC_ARENA_MAX=2` in gpuguard.service) for whatever threads libraries start.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

# One for a pass's reads, one for a fast path's, one for a hung NVML read (up to its
# 30 s timeout, engine/inventory_reader.py) not to stall both.
WORKERS = 3


def worker_pool(workers: int = WORKERS) -> ThreadPoolExecutor:
    """The executor main() hands the daemon (engine/daemon.py sets it as the default)."""
    return ThreadPoolExecutor(max_workers=workers, thread_name_prefix="gpuguard-io")
