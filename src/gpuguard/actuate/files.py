"""Crash-safe file changes: timestamped backups with bounded retention, atomic replace.

The replace is the classic sequence, every step needed: write a temp file in the SAME
directory (rename is only atomic within a filesystem), give it the old file's mode and
owner, fsync it (data on disk before the name points at it), rename over the target,
fsync the directory (the rename itself on disk). A crash at any point leaves either the
old or the new file under the name, never a mix; a leftover temp file is removed by
the next run.
"""

from __future__ import annotations

import contextlib
import errno
import fnmatch
import os
import stat
import time
from pathlib import Path
from typing import Optional

from gpuguard.errors import BadInputError

TEMP_PREFIX = ".gpuguard-"


def _token(n: int) -> str:
    """n random bytes in hex: secrets.token_hex's own definition, without importing
    secrets (hmac, base64, random), which kubelet's pre-start hook would load for it."""
    return os.urandom(n).hex()


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class UnsafeDirError(BadInputError):
    """A backup or state directory gpuguard refuses to write into; nothing was written."""


def _check_dir(path: Path, fd: int) -> None:
    st = os.fstat(fd)
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeDirError(f"{path}: is not a directory; remove it or fix the path")
    if st.st_uid not in (0, os.geteuid()):
        raise UnsafeDirError(
            f"{path}: is owned by uid {st.st_uid}, not root; gpuguard keeps its files only "
            "in directories root owns — fix the owner (chown root) or the path"
        )


def open_private_dir(path: Path) -> int:
    """An O_DIRECTORY fd of `path`, created 0700 if missing; the caller closes it.

    `path` and its parent (the state directory) must be real directories owned by root
    (or by us): a symbolic link, a regular file or another user's directory is refused
    with UnsafeDirError, so nothing is ever written through a link planted there.
    Every later operation goes through the fd, so the check cannot be raced."""
    parent = path.parent
    try:
        parent.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UnsafeDirError(f"{parent.parent}: cannot create it ({e.strerror})") from None
    pfd = -1
    try:
        for d in (parent, path):
            try:
                os.mkdir(d if pfd < 0 else d.name, 0o700, dir_fd=None if pfd < 0 else pfd)
            except FileExistsError:
                pass
            except OSError as e:
                raise UnsafeDirError(f"{d}: cannot create it ({e.strerror})") from None
            flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
            try:
                fd = os.open(d if pfd < 0 else d.name, flags, dir_fd=None if pfd < 0 else pfd)
            except OSError as e:
                # O_NOFOLLOW|O_DIRECTORY on a link says ENOTDIR: lstat names it right.
                try:
                    lst = os.lstat(d.name, dir_fd=pfd) if pfd >= 0 else os.lstat(d)
                    is_link = stat.S_ISLNK(lst.st_mode)
                except OSError:
                    is_link = False
                what = (
                    "is a symbolic link"
                    if is_link or e.errno == errno.ELOOP
                    else "is not a directory"
                    if e.errno == errno.ENOTDIR
                    else f"cannot be opened ({e.strerror})"
                )
                raise UnsafeDirError(
                    f"{d}: {what}; gpuguard writes its files only into a real directory "
                    "owned by root — remove it or fix the path"
                ) from None
            try:
                _check_dir(d, fd)
            except BaseException:
                os.close(fd)
                raise
            if pfd >= 0:
                os.close(pfd)
            pfd = fd
        return pfd
    except BaseException:
        if pfd >= 0:
            os.close(pfd)
        raise


def _write_at(dir_fd: int, name: str, data: bytes, *, mode: int) -> None:
    """Write `name` in the directory `dir_fd` atomically (temp file, fsync, rename)."""
    tmp = f"{TEMP_PREFIX}{name}.{_token(4)}"
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(tmp, flags, 0o600, dir_fd=dir_fd)
    try:
        view = memoryview(data)
        while view:
            n = os.write(fd, view)
            view = view[n:]
        os.fchmod(fd, mode)
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        os.unlink(tmp, dir_fd=dir_fd)
        raise
    os.close(fd)
    try:
        os.rename(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        os.unlink(tmp, dir_fd=dir_fd)
        raise
    os.fsync(dir_fd)


def write_new(path: Path, data: bytes, *, mode: int = 0o600) -> None:
    """Write `path` atomically (it must not be half-written even if we crash), in a
    state directory checked by open_private_dir()."""
    dir_fd = open_private_dir(path.parent)
    try:
        _write_at(dir_fd, path.name, data, mode=mode)
    finally:
        os.close(dir_fd)


def atomic_replace(
    path: Path, data: bytes, *, mode: int, uid: Optional[int], gid: Optional[int]
) -> None:
    directory = path.parent
    tmp = directory / f"{TEMP_PREFIX}{path.name}.{_token(4)}"
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
    just written is never among those pruned. A backup directory that is a link, a
    file or not root's is refused (UnsafeDirError) before anything is written.
    """
    dir_fd = open_private_dir(backup_dir)
    try:
        ns = time.time_ns()
        stamp = (
            time.strftime("%Y%m%dT%H%M%S", time.gmtime(ns // 10**9)) + f".{ns // 1000 % 10**6:06d}Z"
        )
        name = f"{src.name}.{stamp}.{_token(2)}.bak"
        _write_at(dir_fd, name, src_data, mode=0o600)
        _prune_at(dir_fd, src.name, keep=keep, protect=name)
    finally:
        os.close(dir_fd)
    return backup_dir / name


def _prune_at(dir_fd: int, name: str, *, keep: int, protect: Optional[str]) -> list[str]:
    pattern = f"{name}.*.bak"
    backups = sorted(
        n for n in os.listdir(dir_fd) if fnmatch.fnmatchcase(n, pattern) and n != protect
    )
    if protect is not None:
        keep -= 1
    doomed = backups[: max(0, len(backups) - keep)]
    for n in doomed:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(n, dir_fd=dir_fd)
    return doomed


def prune_backups(
    backup_dir: Path, name: str, *, keep: int, protect: Optional[Path] = None
) -> list[Path]:
    dir_fd = open_private_dir(backup_dir)
    try:
        doomed = _prune_at(
            dir_fd, name, keep=keep, protect=protect.name if protect is not None else None
        )
    finally:
        os.close(dir_fd)
    return [backup_dir / n for n in doomed]
