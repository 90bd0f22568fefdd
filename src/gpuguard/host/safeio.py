"""The one way gpuguard reads a file that an operator or another program controls.

Every such read (checkpoint, inventory, configuration and drop-ins, status file, cgroup
and /proc files) goes through read_bytes()/read_text(), so none can hang or exhaust
the daemon: the open is non-blocking (a FIFO must not block us), by default does not
follow a symbolic link in the last component (a link could point anywhere), only a
regular file is read (a FIFO, a device such as /dev/zero, a directory or a socket is
refused), and no more than the cap for its kind is read. The bound is the bytes read,
never st_size: sysfs attributes report 4096 whatever they hold, procfs and cgroupfs
files 0, so a check of the reported size refused every real sysfs attribute (the PCI
GPU count was 0 on every kernel) and passed any /proc file. read_attr() is the reader
of one kernel attribute (sysfs, procfs, cgroupfs): a page at most, as the kernel
serves it.

Problems are UnsafeFileError (a BadInputError): one line with the path, what is wrong
and the next step. `errno` tells a caller a vanished file (ENOENT) from a bad one.
"""

from __future__ import annotations

import errno as _errno
import os
import stat
from pathlib import Path
from typing import Optional

from gpuguard.errors import BadInputError

# Caps per kind of file: far above any real one, low enough that a hostile one costs
# the daemon nothing.
CHECKPOINT_MAX = 16 * 1024 * 1024
INVENTORY_MAX = 4 * 1024 * 1024
CONFIG_MAX = 1024 * 1024
STATUS_MAX = 4 * 1024 * 1024
CGROUP_MAX = 1024 * 1024  # devices.list, cgroup.procs: a few KB on a busy node
PROC_MAX = 4 * 1024 * 1024  # /proc/devices, mountinfo, environ, cmdline
ATTR_MAX = 4096  # one sysfs/procfs attribute: the kernel serves at most a page
STATE_MAX = 4 * 1024 * 1024  # a gpuguard state file (status, metrics, hook records)
# os.read(fd, n) allocates n bytes before the kernel fills any. Reading every cgroup and
# /proc file in 1 MiB requests had glibc hand out (and, its threshold for mmap raised by
# the first such block freed, keep in its heaps) a megabyte per read, hundreds a pass,
# the main source of the daemon's RSS growth under events (bench/README.md). The first
# request is what the file's size says, or a few pages (the kernel reports 0 or 4096 for
# its own files), the next one four times larger when it was filled, up to
# READ_CHUNK_MAX.
READ_CHUNK_MIN = 16 * 1024
READ_CHUNK_MAX = 1024 * 1024


class UnsafeFileError(BadInputError):
    """A file gpuguard refuses to read, or cannot; `errno` is 0 unless open/read failed."""

    def __init__(self, message: str, *, errno: int = 0) -> None:
        super().__init__(message)
        self.errno = errno


def _open_error(path: Path, what: str, e: OSError, missing: str) -> UnsafeFileError:
    if e.errno == _errno.ELOOP:
        text = "is a symbolic link; gpuguard does not follow links here — point it at the real file"
    elif e.errno == _errno.ENOENT:
        text = missing
    elif e.errno in (_errno.EACCES, _errno.EPERM):
        text = "cannot be read (permission denied) — run gpuguard as root"
    elif e.errno == _errno.ENXIO:  # a socket, or a FIFO opened for writing elsewhere
        text = f"is not a regular file; refusing to read it as a {what} — check the path"
    else:
        text = f"cannot be opened ({e.strerror}) — check the path and the file system"
    return UnsafeFileError(f"{path}: {text}", errno=e.errno or 0)


def read_bytes(
    path: Path,
    *,
    what: str,
    max_bytes: int,
    follow: bool = False,
    missing: str = "does not exist — check the path",
    next_step: str = "check what wrote it",
) -> tuple[bytes, os.stat_result]:
    """The bytes and stat of the regular file `path` (a `what`, e.g. "configuration")."""
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow else os.O_NOFOLLOW)
    try:
        fd = os.open(path, flags)
    except OSError as e:
        raise _open_error(path, what, e, missing) from None
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise UnsafeFileError(f"{path}: is a directory, not a {what} file — check the path")
        if not stat.S_ISREG(st.st_mode):
            raise UnsafeFileError(
                f"{path}: is not a regular file (mode {stat.filemode(st.st_mode)}); refusing "
                f"to read it as a {what} — replace it with a regular file or fix the path"
            )
        too_big = (
            f"{path}: is over the {max_bytes}-byte limit for a {what}; refusing to read it "
            f"— {next_step}"
        )
        chunks = []
        left = max_bytes + 1  # one byte more tells us it grew past the limit
        size = min(max(READ_CHUNK_MIN, st.st_size + 1), READ_CHUNK_MAX)
        while left > 0:
            asked = min(left, size)
            try:
                chunk = os.read(fd, asked)
            except OSError as e:
                raise UnsafeFileError(
                    f"{path}: read failed ({e.strerror}) — check the disk and try again",
                    errno=e.errno or 0,
                ) from None
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
            if len(chunk) == asked:  # more may follow: a larger request
                size = min(size * 4, READ_CHUNK_MAX)
        data = b"".join(chunks)
        if len(data) > max_bytes:
            raise UnsafeFileError(too_big)
        return data, st
    finally:
        os.close(fd)


def decode_utf8(data: bytes, path: Path, what: str) -> str:
    """`data` as UTF-8; an error names the line (counted in "\\n", as editors do)."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise UnsafeFileError(f"{path}:{line}: not valid UTF-8; save the {what} as UTF-8") from None


def read_text(
    path: Path,
    *,
    what: str,
    max_bytes: int,
    follow: bool = False,
    missing: str = "does not exist — check the path",
) -> str:
    """read_bytes() decoded as strict UTF-8."""
    data, _st = read_bytes(path, what=what, max_bytes=max_bytes, follow=follow, missing=missing)
    return decode_utf8(data, path, what)


def read_kernel_text(path: Path, *, what: str, max_bytes: int = PROC_MAX) -> Optional[str]:
    """A cgroup or /proc file as text (bad bytes replaced); None when it vanished.

    For files the kernel writes: gone (ENOENT, ESRCH) is routine (the process or cgroup
    went away); anything else (a FIFO in a fake root, a link, too big) raises."""
    try:
        data, _st = read_bytes(path, what=what, max_bytes=max_bytes)
    except UnsafeFileError as e:
        if e.errno in (_errno.ENOENT, _errno.ESRCH, _errno.ENOTDIR):
            return None
        raise
    return data.decode("utf-8", errors="replace")


def read_attr(path: Path, *, what: str = "kernel attribute") -> Optional[str]:
    """One sysfs, procfs or cgroupfs attribute (``vendor``, ``class``, ``comm``) as
    stripped text, bad bytes replaced; None when it vanished or cannot be read (a
    device unbound meanwhile, EACCES, EIO from a device gone off the bus). A FIFO, a
    link or an attribute over a page (ATTR_MAX) in a fake root raises UnsafeFileError."""
    try:
        data, _st = read_bytes(path, what=what, max_bytes=ATTR_MAX)
    except UnsafeFileError as e:
        if e.errno in (_errno.ENOENT, _errno.ESRCH, _errno.ENOTDIR, _errno.EACCES, _errno.EIO):
            return None
        raise
    return data.decode("utf-8", errors="replace").strip()


def proc_bytes(path: Path, *, max_bytes: int = PROC_MAX) -> bytes:
    """A /proc file's bytes for readers that treat any failure as "unknown": every
    refusal (a FIFO or link in a fake root, too big) is an OSError like a vanished
    process, so their `except OSError` covers it."""
    try:
        data, _st = read_bytes(path, what="/proc file", max_bytes=max_bytes)
    except UnsafeFileError as e:
        raise OSError(e.errno or _errno.EINVAL, e.message) from None
    return data


def proc_text(path: Path, *, max_bytes: int = PROC_MAX) -> str:
    """proc_bytes() as text, bad bytes replaced."""
    return proc_bytes(path, max_bytes=max_bytes).decode("utf-8", errors="replace")


def read_range(
    path: Path,
    *,
    what: str,
    offset: int,
    max_bytes: int,
    missing: str = "does not exist — check the path",
) -> tuple[bytes, os.stat_result]:
    """At most `max_bytes` of the regular file `path` from byte `offset` (a log another
    program appends to, read on from where the last read ended), and its stat. The
    same open as read_bytes(): non-blocking, no link followed, a regular file only;
    nothing past the bound is read (b"" at or past its end)."""
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOFOLLOW
    try:
        fd = os.open(path, flags)
    except OSError as e:
        raise _open_error(path, what, e, missing) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafeFileError(
                f"{path}: is not a regular file (mode {stat.filemode(st.st_mode)}); refusing "
                f"to read it as a {what} — replace it with a regular file or fix the path"
            )
        chunks = []
        left = max(0, min(max_bytes, st.st_size - offset))
        at = offset
        while left > 0:
            try:
                chunk = os.pread(fd, min(left, READ_CHUNK_MAX), at)
            except OSError as e:
                raise UnsafeFileError(
                    f"{path}: read failed ({e.strerror}) — check the disk and try again",
                    errno=e.errno or 0,
                ) from None
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
            at += len(chunk)
        return b"".join(chunks), st
    finally:
        os.close(fd)
