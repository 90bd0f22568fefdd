"""A path only root controls: every directory from the root down to the file, each
symbolic link on the way resolved and the directories it leads through checked too.

What gpuguard loads into itself (NVML's library, host/nvmllib.py) or believes (the
podresources socket, steps/device_plugin/podresources.py) must not be replaceable by
another user: a root-owned file in a directory anyone may write can be renamed away
and another put in its place; the same for any directory above it. So each directory
the lookup passes (the root prefix itself, each one below it, and those a link's
target leads through) must be owned by root and writable by neither its group nor
others; a sticky world-writable directory (``/tmp``) is refused too (it keeps others
from renaming root's file, not from placing theirs where a link or a lookup leads).

Links are followed as a chroot would: an absolute target is under ``base``, never the
host's own root (a driver container's ``/usr/lib/...`` links, GPU Operator layout).
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from gpuguard.host.echo import cut

MAX_LINKS = 40  # as the kernel's symlink limit


class Untrusted(Exception):
    """A directory or link on the way that someone other than root controls: the
    one-line reason, with the path."""


@dataclass(frozen=True)
class Resolved:
    """The file `path` leads to, its links resolved (`real`, under base), and its
    lstat (the file itself: never a link)."""

    real: Path
    st: os.stat_result


def dir_problem(st: os.stat_result) -> str:
    """Why a directory is not root's alone ("" when it is)."""
    if not stat.S_ISDIR(st.st_mode):
        return "not a directory"
    if st.st_uid != 0:
        return f"a directory owned by uid {st.st_uid}"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        who = "others" if st.st_mode & stat.S_IWOTH else "its group"
        sticky = " (sticky is not enough)" if st.st_mode & stat.S_ISVTX else ""
        return f"a directory writable by {who}{sticky}"
    return ""


def resolve(base: Path, path: str, *, follow_last: bool = True) -> Optional[Resolved]:
    """`path` (absolute, inside `base`) with every directory on the way checked.
    None: it does not exist; Untrusted: someone besides root could change where it
    leads, or (``follow_last`` False) its last component is a symbolic link."""
    try:  # the root prefix itself may be a link (/proc/PID/root): the caller's choice
        _check_dir(base, base, os.stat(base))
    except OSError as e:
        raise Untrusted(f"{_shown(base, base)}: {e.strerror}") from None
    parts = [p for p in path.split("/") if p]
    done: list[str] = []
    links = 0
    while parts:
        part = parts.pop(0)
        if part == ".":
            continue
        if part == "..":
            if done:
                done.pop()
            continue
        here = base.joinpath(*done, part)
        try:
            st = os.lstat(here)
        except OSError:
            return None
        if stat.S_ISLNK(st.st_mode):
            if not parts and not follow_last:
                raise Untrusted(f"{_shown(base, here)}: a symbolic link")
            links += 1
            if links > MAX_LINKS:
                raise Untrusted(f"{_shown(base, here)}: more than {MAX_LINKS} symbolic links")
            target = os.readlink(here)
            if target.startswith("/"):
                done = []
            parts = [p for p in target.split("/") if p] + parts
            continue
        if parts:  # a directory on the way
            _check_dir(base, here, st)
        done.append(part)
        if not parts:
            return Resolved(base.joinpath(*done), st)
    return None  # the path named base itself: no file


def _check_dir(base: Path, here: Path, st: Optional[os.stat_result] = None) -> None:
    if st is None:
        try:
            st = os.lstat(here)
        except OSError as e:
            raise Untrusted(f"{_shown(base, here)}: {e.strerror}") from None
    why = dir_problem(st)
    if why:
        raise Untrusted(f"{_shown(base, here)}: {why}")


def _shown(base: Path, here: Path) -> str:
    rel = os.path.relpath(here, base)
    return cut("/" if rel == "." else "/" + rel, 200)
