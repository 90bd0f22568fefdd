"""Where NVML's library is, and loading it by path into pynvml.

pynvml loads ``libnvidia-ml.so.1`` from the loader's path only. On a GPU Operator node
the driver is a container: its files, the library among them, are under its driver
root ``/run/nvidia/driver``, and the host's loader knows nothing of them. The lookup,
in order, each under ``--root``:

1. the host's loader path: ``LD_LIBRARY_PATH`` (on the real root only), the
   directories of ``/etc/ld.so.conf`` and its includes, then the usual library
   directories (``/usr/lib/<multiarch>``, ``/usr/lib64``, ``/usr/lib``, ``/lib*``);
2. the GPU Operator's driver root ``/run/nvidia/driver``, searched the same way
   (its own ``etc/ld.so.conf``, ``usr/lib*``, ``lib*``), its symbolic links resolved
   inside it, as the driver container's loader would;
3. ``[Inventory] DriverRoot=``, the same meaning as the NVIDIA container toolkit's
   ``root`` setting, searched the same way.

A library is loaded only if root alone controls it (gpuguard runs as root): a regular
file owned by root and writable by no one else, and every directory from the root down
to it, those its symbolic links lead through and those above the driver root included,
owned by root and writable by neither group nor others (host/pathtrust.py: a sticky
directory is not enough). A library refused so is said in the error, with the reason.

It is loaded by file descriptor: opened (``O_NOFOLLOW``, on the resolved path), its
fstat compared with the file checked (device, inode, owner, mode), then
``dlopen("/proc/self/fd/N")``: a rename between the check and the load cannot put
another file in its place. The descriptor stays open as long as the library is
pynvml's, so its number (the name glibc knows the library by) is never reused for
another file. pynvml loads ``libnvidia-ml.so.1`` by soname itself, from the loader's
path only; it keeps one library for the process, so loading sets its handle (under
its lock) before ``nvmlInit``: every NVML call goes through the library found, and
another one (a driver upgrade's new file) replaces it.
"""

from __future__ import annotations

import contextlib
import glob
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional

from gpuguard.host import pathtrust, safeio
from gpuguard.host.paths import Root

LIBRARY = "libnvidia-ml.so.1"
OPERATOR_DRIVER_ROOT = "/run/nvidia/driver"
# A GPU Operator node: its toolkit, installed on the host's disk, survives a reboot;
# /run/nvidia is made again by the driver container once it starts.
OPERATOR_MARKS = ("/usr/local/nvidia/toolkit", "/run/nvidia")
LIB_DIRS = (
    "/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib",
    "/lib/x86_64-linux-gnu", "/lib/aarch64-linux-gnu", "/lib64", "/lib",
)  # fmt: skip
MAX_CONF_FILES = 64  # ld.so.conf and its includes: a few files on any real system
MAX_CONF_BYTES = 64 * 1024
MAX_LINKS = pathtrust.MAX_LINKS

HOST, OPERATOR, CONFIGURED = "host", "gpu-operator", "driver-root"
LAYOUT_TEXT = {
    HOST: "the host's loader path",
    OPERATOR: "the GPU Operator's driver root",
    CONFIGURED: "[Inventory] DriverRoot=",
}


@dataclass(frozen=True)
class NvmlLibrary:
    """The library found: `shown` as the node names it, `real` the file to load (links
    resolved inside its driver root, under --root), and which layout it came from."""

    shown: str
    real: str
    layout: str
    driver_root: str
    # the file checked: (device, inode); the load refuses any other (0, 0: not known)
    identity: tuple[int, int] = (0, 0)

    def describe(self) -> str:
        where = LAYOUT_TEXT[self.layout]
        if self.layout != HOST:
            where += f" {self.driver_root}"
        return f"{self.shown} ({where})"


@dataclass(frozen=True)
class NvmlLookup:
    """Where to look: the root prefix and the configured driver root ("" for none)."""

    root: Root
    driver_root: str = ""

    def driver_roots(self) -> list[tuple[str, str]]:
        roots = [(HOST, "/"), (OPERATOR, OPERATOR_DRIVER_ROOT)]
        if self.driver_root and self.driver_root not in ("/", OPERATOR_DRIVER_ROOT):
            roots.append((CONFIGURED, self.driver_root.rstrip("/")))
        return roots

    def operator_node(self) -> bool:
        """The node expects its driver from a container (the Operator's, or a driver
        root configured): then a missing driver may still be on its way."""
        if self.driver_root and self.driver_root != "/":
            return True
        return any(os.path.isdir(self.root.path(m)) for m in OPERATOR_MARKS)


def find_library(lookup: NvmlLookup) -> Optional[NvmlLibrary]:
    """The first trusted libnvidia-ml.so.1 of the lookup's order, or None."""
    return search(lookup)[0]


def search(lookup: NvmlLookup) -> tuple[Optional[NvmlLibrary], tuple[str, ...]]:
    """(the first trusted libnvidia-ml.so.1 of the lookup's order or None, the reasons
    libraries found on the way were refused)."""
    refused: list[str] = []
    top = lookup.root.path("/")
    for layout, droot in lookup.driver_roots():
        if layout == HOST:
            base: Optional[Path] = top
        else:
            try:
                found = pathtrust.resolve(top, droot)
            except pathtrust.Untrusted as e:
                if lookup.root.path(droot).is_dir():
                    refused.append(f"driver root {droot}: {e}")
                continue
            base = found.real if found is not None and stat.S_ISDIR(found.st.st_mode) else None
        if base is None:
            continue
        env = os.environ.get("LD_LIBRARY_PATH", "") if layout == HOST else ""
        seen: set[str] = set()
        for d in _library_dirs(base, env if lookup.root.is_host else ""):
            if d in seen:
                continue
            seen.add(d)
            shown = os.path.join(d, LIBRARY)
            named = shown if droot == "/" else droot + shown
            try:
                got = pathtrust.resolve(base, shown)
            except pathtrust.Untrusted as e:
                if os.path.lexists(base.joinpath(shown.lstrip("/"))):
                    refused.append(f"{named}: {e}")
                continue
            if got is None:
                continue
            why = file_problem(got.st)
            if why:
                refused.append(f"{named}: {why}")
                continue
            ident = (got.st.st_dev, got.st.st_ino)
            return NvmlLibrary(named, str(got.real), layout, droot, ident), tuple(refused)
    return None, tuple(refused)


def file_problem(st: os.stat_result) -> str:
    """Why a library file is not root's alone ("" when it is)."""
    if not stat.S_ISREG(st.st_mode):
        return "not a regular file"
    if st.st_uid != 0:
        return f"owned by uid {st.st_uid}"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return "writable by others than root"
    return ""


def where_looked(lookup: NvmlLookup) -> str:
    return ", ".join(
        LAYOUT_TEXT[layout] + ("" if layout == HOST else f" {droot}")
        for layout, droot in lookup.driver_roots()
    )


def _library_dirs(base: Path, ld_library_path: str) -> Iterator[str]:
    for d in ld_library_path.split(":"):
        if d.startswith("/"):
            yield os.path.normpath(d)
    yield from _conf_dirs(base)
    yield from LIB_DIRS


def _conf_dirs(base: Path) -> Iterator[str]:
    """The directories /etc/ld.so.conf names, includes followed (globs, bounded)."""
    todo, read = ["/etc/ld.so.conf"], 0
    while todo and read < MAX_CONF_FILES:
        name = todo.pop(0)
        read += 1
        try:
            text = safeio.read_text(
                base.joinpath(name.lstrip("/")), what="loader configuration",
                max_bytes=MAX_CONF_BYTES, follow=True,
            )  # fmt: skip
        except safeio.UnsafeFileError:
            continue  # the loader would skip it too
        for line in text.splitlines():
            line = line.split("#", 1)[0].strip()
            if line.startswith("include"):
                pattern = line[len("include") :].strip()
                if not pattern.startswith("/"):
                    pattern = os.path.join(os.path.dirname(name), pattern)
                found = glob.glob(str(base.joinpath(pattern.lstrip("/"))))
                todo += ["/" + os.path.relpath(p, base) for p in sorted(found)]
            elif line.startswith("/"):
                yield os.path.normpath(line.split()[0])


# the library pynvml's handle was loaded from (one process, one): its path, identity
# and the descriptor it was loaded through (kept open: its number names the library)
_loaded: list[tuple[str, tuple[int, int], int]] = []


def open_checked(lib: NvmlLibrary) -> int:
    """A descriptor of exactly the file the lookup checked; OSError: not it (any more)."""
    fd = os.open(lib.real, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        why = file_problem(st)
        if not why and lib.identity != (0, 0) and (st.st_dev, st.st_ino) != lib.identity:
            why = "replaced since it was checked"
        if why:
            raise OSError(f"{lib.real}: {why}")
    except BaseException:
        os.close(fd)
        raise
    return fd


def load_into(pynvml: Any, lib: NvmlLibrary) -> None:
    """Make pynvml call `lib`, loaded through a descriptor of the file checked: its
    handle set under pynvml's own lock, its cache of function pointers dropped when
    the library changes. OSError: not loadable, or not the file checked."""
    import ctypes  # only where NVML is asked

    lock = getattr(pynvml, "libLoadLock", None) or contextlib.nullcontext()
    with lock:
        if _loaded and _loaded[0][:2] == (lib.real, lib.identity) and pynvml.nvmlLib is not None:
            return
        fd = open_checked(lib)
        try:
            handle = ctypes.CDLL(f"/proc/self/fd/{fd}")
        except BaseException:
            os.close(fd)
            raise
        pynvml.nvmlLib = handle
        cache = getattr(pynvml, "_nvmlGetFunctionPointer_cache", None)
        if cache is not None:  # the bindings cache each function of the library loaded
            cache.clear()
        # the earlier library's descriptor stays open: glibc may keep it loaded under
        # its /proc/self/fd name, which must never name another file
        _loaded[:] = [(lib.real, lib.identity, fd)]
