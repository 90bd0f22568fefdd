"""The directories of a cgroup tree and the processes in them: listed without following
links, read through the bounded reader (host/safeio.py), never raising on a tree that
changes while it is read (a directory gone is an empty one).

A runtime may run a container's process below the cgroup it names for it: crun (1.8 and
newer, systemd driver) in ``SCOPE/container``. `find_processes` follows them down a
few levels; `populated` says whether a cgroup2 directory holds any process at all, so a
container whose processes are deeper than that is told apart from an empty one.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Optional

from gpuguard.host.numparse import clip, parse_decimal
from gpuguard.host.safeio import CGROUP_MAX, UnsafeFileError, read_kernel_text

log = logging.getLogger(__name__)

MAX_PID = 2**22  # the kernel's PID_MAX_LIMIT
# Where a runtime puts the container's process below its scope: crun one level down
# (SCOPE/container); a container that makes cgroups of its own may add more.
SUB_DEPTH = 2
SUB_MAX = 32  # sub-cgroups read at most, per container


def read_pids(cgroup_dir: Path) -> tuple[int, ...]:
    """cgroup.procs of a v1 or v2 directory; () if it vanished.

    Anything but PIDs, one per line, raises UnsafeFileError naming the file (the caller
    charges it to this container only)."""
    path = cgroup_dir / "cgroup.procs"
    text = read_kernel_text(path, what="cgroup.procs", max_bytes=CGROUP_MAX)
    if text is None:
        return ()
    pids = []
    for lineno, word in enumerate(text.split("\n"), 1):
        if not word:
            continue
        pid = parse_decimal(word, hi=MAX_PID)
        if pid == 0:  # a process outside our PID namespace: the kernel shows 0
            continue
        if pid is None:
            raise UnsafeFileError(
                f"{path}:{lineno}: {clip(word)} is not a process ID; the kernel writes one "
                "PID per line — check what wrote this file"
            )
        pids.append(pid)
    return tuple(pids)


def dir_names(d: str) -> list[str]:
    """Names of `d`'s child directories ([] when it vanished; an odd entry skipped)."""
    out = []
    try:
        with os.scandir(d) as it:
            for e in it:
                try:
                    if e.is_dir(follow_symlinks=False):
                        out.append(e.name)
                except OSError:
                    log.debug("skipping %s: cannot stat it", e.path)
    except OSError as err:
        log.debug("cannot list %s: %s", d, err.strerror)
    return out


def subdirs(d: Path) -> list[tuple[str, Path]]:
    """Child directories, sorted; [] with a debug reason when ``d`` vanished or is odd."""
    return sorted((name, d / name) for name in dir_names(os.fspath(d)))


def find_processes(top: Path) -> tuple[Optional[Path], tuple[int, ...]]:
    """The cgroup at or below `top` that holds the container's processes, and those:
    `top` itself when it holds any, else the first sub-cgroup that does (breadth-first,
    by name: crun's ``container``), within `SUB_DEPTH` levels and `SUB_MAX` reads.
    (None, ()) when none does. Raises UnsafeFileError as read_pids does."""
    level = [top]
    seen = 0
    for depth in range(SUB_DEPTH + 1):
        below: list[Path] = []
        for d in level:
            if seen >= SUB_MAX:
                return None, ()
            seen += 1
            pids = read_pids(d)
            if pids:
                return d, pids
            if depth < SUB_DEPTH:
                below += [p for _n, p in subdirs(d)]
        level = below
    return None, ()


def populated(cgroup2_dir: Path) -> bool:
    """cgroup.events says ``populated 1``: a process is in it or below (cgroup2 only;
    False where the file is absent, as on v1 or in a fake root)."""
    try:
        text = read_kernel_text(cgroup2_dir / "cgroup.events", what="cgroup.events")
    except UnsafeFileError:
        return False
    return "populated 1" in (text or "").splitlines()
