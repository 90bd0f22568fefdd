"""Crash-safe file changes: timestamped backups with bounded retention, atomic replace.

The replace is the classic sequence, every step needed: write a temp file in the SAME
directory (rename is only atomic within a filesystem), give it the old file's mode and
owner, fsync it (data on disk before the name points at it), rename over the target,
fsync the directory (the rename itself on disk). A crash at any point leaves either the
old or the new file under the name, never a mix; a leftover temp file is removed by
the next run.
"""

from __future__ import annotations

import os
import secrets
import time
from pathlib import Path
from typing import Optional

TEMP_PREFIX = ".gpuguard-"


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_new(path: Path, data: bytes, *, mode: int = 0o600) -> None:
    """Write `path` atomically (it must not be half-written even if we crash)."""
    atomic_replace(path, data, mode=mode, uid=None, gid=None)


def atomic_replace(
    path: Path, data: bytes, *, mode: int, uid: Optional[int], gid: Optional[int]
) -> None:
    directory = path.parent
    tmp = directory / f"{TEMP_PREFIX}{path.name}.{secrets.token_hex(4)}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        view = memoryview(data)
        while view:
            n = os.write(fd, view)
            view = view[n:]
        os.fchmod(fd, mode)
        if uid is not None and gid is not None:
            os.fchown(fd, uid, gid)
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        tmp.unlink(missing_ok=True)
        raise
    os.close(fd)
    try:
        os.rename(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(directory)


def remove_stale_temps(directory: Path, name: str) -> list[Path]:
    """Remove temp files a crashed earlier run left beside `name`."""
    removed = []
    try:
        candidates = list(directory.glob(f"{TEMP_PREFIX}{name}.*"))
    except OSError:
        return []
    for p in candidates:
        try:
            p.unlink()
            removed.append(p)
        except OSError:
            pass
    return removed


def backup(src_data: bytes, src: Path, backup_dir: Path, *, keep: int) -> Path:
    """Store `src_data` (the bytes of `src` we are about to change) in `backup_dir`.

    Name: <file>.<UTC time to the microsecond>.<random>.bak, so names sort by age even
    within one second; the newest `keep` backups of that file are kept, and the one
    just written is never among those pruned.
    """
    backup_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    ns = time.time_ns()
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(ns // 10**9)) + f".{ns // 1000 % 10**6:06d}Z"
    dest = backup_dir / f"{src.name}.{stamp}.{secrets.token_hex(2)}.bak"
    write_new(dest, src_data, mode=0o600)
    prune_backups(backup_dir, src.name, keep=keep, protect=dest)
    return dest


def prune_backups(
    backup_dir: Path, name: str, *, keep: int, protect: Optional[Path] = None
) -> list[Path]:
    backups = sorted(
        (p for p in backup_dir.glob(f"{name}.*.bak") if p != protect), key=lambda p: p.name
    )
    if protect is not None:
        keep -= 1
    doomed = backups[: max(0, len(backups) - keep)]
    for p in doomed:
        p.unlink(missing_ok=True)
    return doomed
