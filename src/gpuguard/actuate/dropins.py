"""A container scope's runtime drop-in: the one place gpuguard writes or removes a file
under /run/systemd/system.

A durable grant is systemd's SetUnitProperties(DeviceAllow=, runtime): systemd writes
its own drop-in and applies the setting. During a burst of container starts systemd
answers one call at a time, and its reply came up to 170 ms (p90) after the call
(bench/README.md, "A new container's window"); a daemon-reload in that time rebuilt the
container's device policy without its GPU. systemd reads every drop-in of a unit at each
reload and reexec, transient scopes included (checked on systemd 252 in both cgroup
layouts), so the grant is first written as a drop-in of gpuguard's own: durable within
microseconds of the container being judged. The call follows, for systemd's running
state.

- One file per scope, ``60-gpuguard-devices.conf``. Its name sorts after systemd's
  ``50-DeviceAllow.conf``, so a runtime that resets DeviceAllow= over the bus (runc's
  systemd driver on an update) does not take gpuguard's nodes away at the next reload.
- It holds DeviceAllow= lines only, each the /dev/char link of a node the container was
  given; a later grant for the same scope is added to it, and it never holds an empty
  DeviceAllow= (that would reset the list).
- Written atomically (temp file, fsync, rename) into a real directory owned by root,
  and read back before it counts. A file there that gpuguard did not write is refused,
  never overwritten.
- Removed once the scope's cgroup is gone (the pass plans it, this module checks again
  first). systemd never removes it; /run is emptied at boot.
"""

from __future__ import annotations

import errno
import os
import re
import stat
from pathlib import Path
from typing import Optional, Sequence

from gpuguard.actuate.files import UnsafeDirError, write_new
from gpuguard.devices.cgroupnames import ANY_CONTAINER_SCOPE, scope_of_dropin_dir
from gpuguard.host.paths import Root
from gpuguard.host.safeio import UnsafeFileError, read_bytes

DROPIN_DIR = "/run/systemd/system"
DROPIN_NAME = "60-gpuguard-devices.conf"
MAX_BYTES = 64 * 1024  # a few hundred nodes; more is not a file gpuguard wrote
HEADER = (
    "# Written by gpuguard: the GPU nodes this container was given, durable across\n"
    "# daemon-reload before systemd answered gpuguard's SetUnitProperties. gpuguard\n"
    "# removes it once the scope is gone.\n"
    "[Scope]\n"
)
_LINE = re.compile(r"DeviceAllow=(/dev/char/[0-9]{1,10}:[0-9]{1,10}) (r?w?m?)")

Device = tuple[str, str]  # ("/dev/char/195:0", "rw")


class DropInError(Exception):
    """The drop-in could not be written, read back or removed; nothing else changed."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


def dropin_path(unit: str) -> str:
    """The host path of `unit`'s drop-in; only a container scope's name is a path part."""
    if not ANY_CONTAINER_SCOPE.fullmatch(unit):
        raise DropInError(f"{unit!r} is not a container scope; no drop-in is written for it")
    return f"{DROPIN_DIR}/{unit}.d/{DROPIN_NAME}"


def would_write(root: Root, unit: str) -> Optional[Path]:
    """Where a grant for `unit` would be written (dry-run), None where none would be:
    not a container scope, or no systemd runtime unit directory."""
    try:
        path = root.path(dropin_path(unit))
    except DropInError:
        return None
    return path if os.path.isdir(root.path(DROPIN_DIR)) else None


def render(devices: Sequence[Device]) -> bytes:
    return (HEADER + "".join(f"DeviceAllow={d} {p}\n" for d, p in devices)).encode()


def parse(data: bytes, path: Path) -> list[Device]:
    """The DeviceAllow= lines of a drop-in gpuguard wrote; anything else is refused."""
    out: list[Device] = []
    for n, raw in enumerate(data.decode(errors="replace").splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#") or line == "[Scope]":
            continue
        m = _LINE.fullmatch(line)
        if m is None or not m.group(2):
            raise DropInError(
                f"{path}:{n}: {line[:80]!r} is not a line gpuguard writes; it leaves this "
                "file alone — remove it if nothing else needs it"
            )
        out.append((m.group(1), m.group(2)))
    return out


def read_dropin(root: Root, unit: str) -> Optional[list[Device]]:
    """What `unit`'s drop-in grants, None if there is none."""
    path = root.path(dropin_path(unit))
    try:
        data, _st = read_bytes(path, what="drop-in", max_bytes=MAX_BYTES)
    except UnsafeFileError as e:
        if not os.path.lexists(path):
            return None
        raise DropInError(e.message) from None
    return parse(data, path)


def write_device_dropin(root: Root, unit: str, devices: Sequence[Device]) -> str:
    """Add `devices` to `unit`'s drop-in (created if missing), atomically, and read it
    back. Returns its host path. Blocking: a few small syscalls on /run (tmpfs)."""
    if not devices:
        raise DropInError(f"{unit}: no device to grant; an empty DeviceAllow= resets the list")
    path = root.path(dropin_path(unit))
    if not os.path.isdir(root.path(DROPIN_DIR)):  # never made here: systemd's "booted" mark
        raise DropInError(f"{root.path(DROPIN_DIR)}: no such directory; is systemd running?")
    have = read_dropin(root, unit) or []
    merged = have + [d for d in devices if d not in have]
    if merged != have:
        try:
            write_new(path, render(merged), mode=0o644)
            os.chmod(path.parent, 0o755)  # like systemd's own drop-in directories
        except UnsafeDirError as e:
            raise DropInError(e.message) from None
        except OSError as e:
            raise DropInError(f"{path}: cannot write it ({e.strerror})") from None
    back = read_dropin(root, unit) or []
    lost = [d for d in devices if d not in back]
    if lost:
        raise DropInError(f"{path}: read back without {', '.join(d for d, _p in lost)}")
    return str(path)


def list_dropins(root: Root) -> frozenset[str]:
    """The container scopes that have a gpuguard drop-in, in a real directory (gpuguard
    makes no links: one there is not its own, and is not planned for removal)."""
    base = root.path(DROPIN_DIR)
    try:
        entries = list(os.scandir(base))
    except OSError:
        return frozenset()
    return frozenset(
        unit
        for e in entries
        if (unit := scope_of_dropin_dir(e.name))
        and e.is_dir(follow_symlinks=False)
        and os.path.lexists(base / e.name / DROPIN_NAME)
    )


def remove_dropin(root: Root, unit: str) -> str:
    """Remove `unit`'s drop-in (and its directory if nothing else is in it). The caller
    has checked that the scope is gone. Returns its host path."""
    path = root.path(dropin_path(unit))
    try:
        if not stat.S_ISDIR(os.lstat(path.parent).st_mode):  # a link: never unlink through it
            raise DropInError(f"{path.parent}: is not a directory; gpuguard leaves it alone")
    except FileNotFoundError:
        return str(path)
    read_dropin(root, unit)  # refuses a file gpuguard did not write, or a link
    try:
        path.unlink()
    except FileNotFoundError:
        pass
    except OSError as e:
        raise DropInError(f"{path}: cannot remove it ({e.strerror})") from None
    try:
        path.parent.rmdir()
    except OSError as e:
        if e.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOENT):
            raise DropInError(f"{path.parent}: cannot remove it ({e.strerror})") from None
    return str(path)
