"""Writes only to what they should: kernel control files and device nodes.

A cgroup control file (``devices.allow``, ``cgroup.procs``) is opened for writing with
O_NOFOLLOW (a ``devices.allow`` that is a link to a file outside the root is refused,
never written through), O_NONBLOCK (a FIFO in its place cannot hang the daemon: the
open fails at once with ENXIO when no reader waits, and what opens is checked next)
and is used only when it is a regular file (what cgroupfs shows; a FIFO, a device or
a socket is refused). A write to a cgroupfs file is the kernel parsing one rule: it
cannot block, so non-blocking regular files are the whole timeout.

Device nodes and /dev/char links are created only in directories that are the
directories they claim to be: no component below the root may be a symbolic link
(``/dev/char`` linked to ``/etc`` would put gpuguard's links there), and a node's mode
is set on the node just created, never through a link put in its place.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from gpuguard.errors import GpuguardError
from gpuguard.host.paths import Root

WRITE_FLAGS = os.O_WRONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


class UnsafeWriteError(GpuguardError):
    """A target gpuguard refuses to write: a link, a FIFO, a device, outside the root."""


def open_control_file(path: Path) -> int:
    """A write fd of the control file `path`; the caller closes it. FileNotFoundError
    when it is gone (the cgroup went away); UnsafeWriteError for what is not a
    regular file, or is a link."""
    try:
        fd = os.open(path, WRITE_FLAGS)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise UnsafeWriteError(
                f"{path}: is a symbolic link; gpuguard never writes a control file through "
                "a link — remove it (a cgroup file is never a link)"
            ) from None
        if e.errno == errno.ENXIO:  # a FIFO without a reader, a socket
            raise UnsafeWriteError(
                f"{path}: is not a regular file (a FIFO or socket); refusing to write it"
            ) from None
        raise
    try:
        st = os.fstat(fd)
    except OSError:
        os.close(fd)
        raise
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise UnsafeWriteError(
            f"{path}: is not a regular file (mode {stat.filemode(st.st_mode)}); refusing to "
            "write a cgroup rule to it"
        )
    return fd


def check_real_dir(root: Root, directory: Path) -> None:
    """UnsafeWriteError when `directory` (under `root`) is not the directory its path
    names: a component below the root that is a symbolic link (or `..`) resolves
    elsewhere. A directory that does not exist yet is judged by its existing part."""
    base = os.path.realpath(root.prefix)
    try:
        rel = directory.relative_to(root.prefix)
    except ValueError:
        raise UnsafeWriteError(f"{directory}: is outside {root.prefix}") from None
    expected = os.path.join(base, *rel.parts) if rel.parts else base
    probe, want = Path(directory), expected
    while not os.path.lexists(probe) and probe != root.prefix:
        probe, want = probe.parent, os.path.dirname(want)
    if os.path.realpath(probe) != want:
        raise UnsafeWriteError(
            f"{directory}: a directory on its path is a symbolic link (it resolves to "
            f"{os.path.realpath(probe)}); gpuguard writes nothing through a link — "
            "remove the link"
        )


def chmod_node(path: Path, mode: int, numbers: tuple[int, int]) -> None:
    """Set `mode` on the character device `path` (MAJ, MIN = `numbers`), through an
    O_PATH handle of the node itself: a link swapped in its place is refused, never
    followed."""
    fd = os.open(path, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISCHR(st.st_mode) or (os.major(st.st_rdev), os.minor(st.st_rdev)) != numbers:
            raise UnsafeWriteError(
                f"{path}: is not the character device {numbers[0]}:{numbers[1]} gpuguard "
                "just made; left as it is"
            )
        os.chmod(f"/proc/self/fd/{fd}", mode)
    finally:
        os.close(fd)
