#!/usr/bin/env python3
"""Runs gpuguard with Python's tracemalloc on, for finding where its memory goes.

    memtrace.py daemon                  # as `gpuguard daemon`; SIGUSR2 writes a snapshot
    memtrace.py --compare A.pickle B.pickle [--top N]   # what grew from A to B, by line

Each SIGUSR2 writes `snap-N.pickle` (N = 0, 1, ...) into $GPUGUARD_MEMTRACE_DIR
(default /var/lib/gpuguard/memtrace: the daemon's state directory, writable under its
unit's ProtectSystem=strict). bench/soak.py --memtrace runs the daemon this way and
compares its first and last snapshots. tracemalloc slows every allocation: figures
taken with it on are for finding growth, never for timing.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tracemalloc
from pathlib import Path
from types import FrameType
from typing import List, Optional, Sequence

FRAMES = 12


def compare(first: Path, last: Path, top: int = 15) -> List[str]:
    """The ``top`` allocation sites that grew most from ``first`` to ``last``, each with
    its size now, its growth and the gpuguard frames that led there."""
    a = tracemalloc.Snapshot.load(str(first))
    b = tracemalloc.Snapshot.load(str(last))
    ignore = [tracemalloc.Filter(False, tracemalloc.__file__)]
    a, b = a.filter_traces(ignore), b.filter_traces(ignore)
    total_a = sum(s.size for s in a.statistics("filename"))
    total_b = sum(s.size for s in b.statistics("filename"))
    out = [f"traced: {total_a / 1024:.0f} KiB -> {total_b / 1024:.0f} KiB"]
    for diff in b.compare_to(a, "traceback")[:top]:
        if diff.size_diff <= 0:
            break
        ours = [f for f in diff.traceback if "gpuguard" in f.filename] or list(diff.traceback)
        where = " <- ".join(f"{_short(f.filename)}:{f.lineno}" for f in ours[-4:][::-1])
        out.append(
            f"  {diff.size_diff / 1024:+8.1f} KiB ({diff.count_diff:+d} blocks), "
            f"{diff.size / 1024:.1f} KiB now: {where}"
        )
    return out


def _short(filename: str) -> str:
    marker = "/gpuguard/"
    return filename[filename.rindex(marker) + 1 :] if marker in filename else filename


def run(argv: Sequence[str]) -> int:
    out = Path(os.environ.get("GPUGUARD_MEMTRACE_DIR", "/var/lib/gpuguard/memtrace"))
    out.mkdir(parents=True, exist_ok=True)
    tracemalloc.start(FRAMES)
    taken = [0]

    def dump(_sig: int, _frame: Optional[FrameType]) -> None:
        tracemalloc.take_snapshot().dump(str(out / f"snap-{taken[0]}.pickle"))
        taken[0] += 1

    signal.signal(signal.SIGUSR2, dump)
    from gpuguard.cli import main as gpuguard_main

    return gpuguard_main(list(argv))


def main(argv: Sequence[str]) -> int:
    if argv[:1] == ["--compare"]:
        ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
        ap.add_argument("--compare", nargs=2, type=Path, required=True)
        ap.add_argument("--top", type=int, default=15)
        args = ap.parse_args(list(argv))
        print("\n".join(compare(args.compare[0], args.compare[1], args.top)))
        return 0
    return run(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
