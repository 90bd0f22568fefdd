"""What the kernel admits from inside a cgroup: every (type, major:minor, access) of a
set of device nodes, asked of the kernel itself, to prove gpuguard never narrows it.

A child placed in the cgroup (gpuguard.devices.cgroupchild, as the probe does) opens
each node for reading, for writing, for both, and makes one like it with mknod(2) in a
scratch directory: EPERM is the device cgroup's refusal (v1 devices.list or a BPF
program, both check before the driver), anything the driver or the filesystem answers
means the cgroup let it through. The nodes are fake ones made in a test directory
(never /dev); the driver behind a number answers what it answers (ENXIO for none).
"""

from __future__ import annotations

import errno
import os
import stat
import struct
from pathlib import Path
from typing import Dict, FrozenSet, Iterable, Sequence, Tuple

from gpuguard.devices import cgroupchild

Device = Tuple[str, int, int]  # ("c" or "b", major, minor)
Access = Tuple[str, int, int, str]  # a device and "r", "w", "rw" or "m"
ACCESSES = (("r", os.O_RDONLY), ("w", os.O_WRONLY), ("rw", os.O_RDWR))
FLAGS = os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
# what says the cgroup let an open or mknod through (the driver or fs answered)
PASSED = frozenset(
    {0, errno.ENXIO, errno.ENODEV, errno.EIO, errno.EBUSY, errno.EINVAL, errno.ENOMEDIUM}
)


def make_nodes(directory: Path, devices: Iterable[Device]) -> Dict[Device, Path]:
    """A node for each device in `directory` (a test directory, not mounted nodev)."""
    directory.mkdir(parents=True, exist_ok=True)
    out = {}
    for kind, ma, mi in devices:
        path = directory / f"{kind}{ma}-{mi}"
        if not path.exists():
            mode = stat.S_IFCHR if kind == "c" else stat.S_IFBLK
            os.mknod(path, mode | 0o666, os.makedev(ma, mi))
        out[(kind, ma, mi)] = path
    return out


def admitted(
    cgroups: Sequence[Path], nodes: Dict[Device, Path], scratch: Path
) -> FrozenSet[Access]:
    """Every access to `nodes` the kernel admits from inside `cgroups` (a process's v1
    devices and cgroup2 directories: where it stands); AssertionError when an answer is
    neither a refusal nor a pass (the test would prove nothing)."""
    scratch.mkdir(parents=True, exist_ok=True)
    items = list(nodes.items())

    def work() -> bytes:
        out = b""
        for i, ((kind, ma, mi), path) in enumerate(items):
            for _name, mode in ACCESSES:
                err = 0
                try:
                    os.close(os.open(path, mode | FLAGS))
                except OSError as e:
                    err = e.errno or 0
                out += struct.pack("<i", err)
            target = os.fsencode(scratch / f"mk{i}")
            err = 0
            try:
                kind_bits = stat.S_IFCHR if kind == "c" else stat.S_IFBLK
                os.mknod(target, kind_bits | 0o600, os.makedev(ma, mi))
                os.unlink(target)
            except OSError as e:
                err = e.errno or 0
            out += struct.pack("<i", err)
        return out

    r = cgroupchild.run_in_cgroups(cgroups, work, timeout=10)
    assert r.status == cgroupchild.DONE, f"{cgroups}: probe {r.status} {r.text}"
    names = [a for a, _m in ACCESSES] + ["m"]
    got = set()
    for i, (dev, _path) in enumerate(items):
        for j, name in enumerate(names):
            (err,) = struct.unpack_from("<i", r.data, 4 * (i * len(names) + j))
            assert err == errno.EPERM or err in PASSED, f"{dev} {name}: {os.strerror(err)}"
            if err != errno.EPERM:
                got.add((*dev, name))
    return frozenset(got)
