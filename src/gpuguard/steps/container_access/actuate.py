"""The few cgroup file operations the device code needs (the actuator builds on these).

Control files are written with one write(2) per rule and without O_CREAT/O_TRUNC: the
kernel parses each write as one rule (devcgroup_access_write), and cgroupfs files
cannot be created or truncated anyway.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable

from gpuguard.devices.rules import DeviceRules, parse_devices_list
from gpuguard.errors import GpuguardError


class CgroupWriteError(GpuguardError):
    """A cgroup control file refused a write; the message names the file and the rule."""


def _write_lines(path: Path, lines: Iterable[str]) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        for line in lines:
            try:
                os.write(fd, line.encode())
            except OSError as e:
                raise CgroupWriteError(
                    f"{path}: writing {line!r} failed: {e.strerror}; the cgroup may be gone "
                    "or its parent may not allow the device"
                ) from None
    finally:
        os.close(fd)


def write_allow(cgroup_dir: Path, rules: Iterable[str]) -> None:
    """Append allow rules (``c 195:0 rw``) to a v1 devices cgroup's devices.allow."""
    try:
        _write_lines(cgroup_dir / "devices.allow", rules)
    except FileNotFoundError:
        raise CgroupWriteError(
            f"{cgroup_dir}/devices.allow does not exist: the container is gone or this "
            "is not a cgroup v1 devices directory"
        ) from None


def read_devices_list(cgroup_dir: Path) -> DeviceRules:
    """Parse the cgroup's devices.list (raises OSError if it vanished)."""
    return parse_devices_list((cgroup_dir / "devices.list").read_text())
