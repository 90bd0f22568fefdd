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

A library is loaded only if it is a regular file owned by root and writable by no one
else (gpuguard runs as root). pynvml keeps one library for the process; loading sets
its handle (under its lock) before ``nvmlInit``, so every NVML call goes through the
library found, and another one (a driver upgrade's new file) replaces it.
"""

from __future__ import annotations

import contextlib
import glob
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional

from gpuguard.host import safeio
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
MAX_LINKS = 40  # as the kernel's symlink limit

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
    for layout, droot in lookup.driver_roots():
        base = lookup.root.path(droot)
        if layout != HOST and not base.is_dir():
            continue
        env = os.environ.get("LD_LIBRARY_PATH", "") if layout == HOST else ""
        seen: set[str] = set()
        for d in _library_dirs(base, env if lookup.root.is_host else ""):
            if d in seen:
                continue
            seen.add(d)
            shown = os.path.join(d, LIBRARY)
            real = _resolve(base, shown)
            if real is not None and _trusted(real):
                return NvmlLibrary(
                    shown if droot == "/" else droot + shown, str(real), layout, droot
                )
    return None


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


def _resolve(base: Path, path: str) -> Optional[Path]:
    """`path` inside `base` with its symbolic links followed as a chroot would (an
    absolute target is the driver root's own, never the host's); None: not there."""
    parts = [p for p in path.split("/") if p]
    done: list[str] = []
    links = 0
    while parts:
        part = parts.pop(0)
        if part in (".", ""):
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
            links += 1
            if links > MAX_LINKS:
                return None
            target = os.readlink(here)
            if target.startswith("/"):
                done = []
            parts = [p for p in target.split("/") if p] + parts
            continue
        done.append(part)
    return base.joinpath(*done)


def _trusted(path: Path) -> bool:
    try:
        st = os.stat(path)
    except OSError:
        return False
    return (
        stat.S_ISREG(st.st_mode)
        and st.st_uid == 0
        and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    )


_loaded: list[str] = []  # the file pynvml's handle was loaded from (one process, one)


def load_into(pynvml: Any, lib: NvmlLibrary) -> None:
    """Make pynvml call `lib`: its handle set under its own lock, its cache of
    function pointers dropped when the library changes. OSError: not loadable."""
    import ctypes  # only where NVML is asked

    lock = getattr(pynvml, "libLoadLock", None) or contextlib.nullcontext()
    with lock:
        if _loaded and _loaded[0] == lib.real and pynvml.nvmlLib is not None:
            return
        handle = ctypes.CDLL(lib.real)
        pynvml.nvmlLib = handle
        cache = getattr(pynvml, "_nvmlGetFunctionPointer_cache", None)
        if cache is not None:  # the bindings cache each function of the library loaded
            cache.clear()
        _loaded[:] = [lib.real]
