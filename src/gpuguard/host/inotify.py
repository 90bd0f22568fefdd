"""inotify(7) through the C library (host/libc.py): the flags, a watch, and the events
of one read. Used by sources/transient.py (a scope's runtime properties) and
readmit/watch.py (kubelet's device-plugins directory)."""

from __future__ import annotations

import ctypes
import os
import struct

from gpuguard.host.libc import c_library

IN_CLOSE_WRITE = 0x00000008
IN_MOVED_TO = 0x00000080
IN_CREATE = 0x00000100
IN_Q_OVERFLOW = 0x00004000
IN_IGNORED = 0x00008000
IN_ONLYDIR = 0x01000000
IN_DONT_FOLLOW = 0x02000000  # a link in a watched directory is never followed
IN_ISDIR = 0x40000000
IN_NONBLOCK = os.O_NONBLOCK
IN_CLOEXEC = os.O_CLOEXEC
_EVENT = struct.Struct("iIII")  # wd, mask, cookie, len; then the name, NUL-padded

# a directory's new entries: created there, or renamed into it
DIR_MASK = IN_CREATE | IN_MOVED_TO | IN_ONLYDIR | IN_DONT_FOLLOW


class InotifyError(OSError):
    pass


def init() -> int:
    """A new non-blocking, close-on-exec inotify descriptor."""
    fd = int(c_library().inotify_init1(IN_NONBLOCK | IN_CLOEXEC))
    if fd < 0:
        e = ctypes.get_errno()
        raise InotifyError(e, f"inotify_init1: {os.strerror(e)}")
    return fd


def add_watch(fd: int, path: str, mask: int) -> int:
    """The watch descriptor of `path` on `fd`."""
    wd = int(c_library().inotify_add_watch(fd, os.fsencode(path), mask))
    if wd < 0:
        e = ctypes.get_errno()
        raise InotifyError(e, f"inotify_add_watch {path}: {os.strerror(e)}")
    return wd


def rm_watch(fd: int, wd: int) -> None:
    c_library().inotify_rm_watch(fd, wd)


def events(data: bytes) -> list[tuple[int, int, str]]:
    """(watch descriptor, mask, name) of each event in one read."""
    out, at = [], 0
    while at + _EVENT.size <= len(data):
        wd, mask, _cookie, size = _EVENT.unpack_from(data, at)
        at += _EVENT.size
        raw = data[at : at + size].split(b"\0", 1)[0]
        at += size
        out.append((wd, mask, os.fsdecode(raw)))
    return out
