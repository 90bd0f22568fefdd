"""What a container scope's unit files say of its device access: systemd's intent,
which its cgroup shows only once systemd has applied it.

runc's systemd driver starts a container's scope with no device property and sets
`DevicePolicy=strict` and its `DeviceAllow=` list afterwards over the bus (systemd
writes them to /run/systemd/transient/UNIT.d/50-*.conf at once); systemd realizes the
cgroup later in its event loop. On a busy node the container's process can run, for a
moment, in a scope whose cgroup still admits every device while its unit already says
strict (systemd 252, runc 1.1: tests/integration/test_new_scope_fast_path.py). A scope
that admits every device is left alone (never narrow: steps/container_access/durable.py),
so the grant for a new scope asks what its unit says before it believes the cgroup.
"""

from __future__ import annotations

import itertools
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from gpuguard.host.paths import Root
from gpuguard.host.safeio import UnsafeFileError, read_text

TRANSIENT_DIR = "/run/systemd/transient"
MAX_FILE = 256 * 1024  # a DeviceAllow= list of every node of a large host fits
MAX_DROPINS = 64
POLICIES = frozenset({"auto", "closed", "strict"})
_CHAR = re.compile(r"/dev/char/([0-9]{1,7}):([0-9]{1,7})")


@dataclass(frozen=True)
class ScopeDevices:
    """A scope's device settings after its unit file and drop-ins, in systemd's order."""

    policy: str = "auto"  # systemd's default
    entries: int = 0  # DeviceAllow= entries left after the last empty one (a reset)
    # "MAJ:MIN" of the char devices those entries allow read and write by number
    # (/dev/char/MAJ:MIN, as runc writes the devices of a container's OCI spec)
    numbers: frozenset[str] = frozenset()

    @property
    def admits_all(self) -> bool:
        """`DevicePolicy=auto` without entries: systemd installs no device filter."""
        return self.policy == "auto" and self.entries == 0


def apply_unit_text(current: ScopeDevices, text: str) -> ScopeDevices:
    """`current` with one unit file's or drop-in's DevicePolicy=/DeviceAllow= lines applied
    (any section: systemd's transient files write them under the unit's type)."""
    policy, entries, numbers = current.policy, current.entries, set(current.numbers)
    for raw in text.split("\n"):
        key, sep, value = raw.strip().partition("=")
        if not sep:
            continue
        key, value = key.strip(), value.strip()
        if key == "DevicePolicy" and value in POLICIES:
            policy = value
        elif key == "DevicePolicy" and not value:
            policy = "auto"  # an empty assignment resets to the default
        elif key == "DeviceAllow":
            entries = entries + 1 if value else 0
            if not value:
                numbers.clear()
            number = _char_number(value)
            if number:
                numbers.add(number)
    return ScopeDevices(policy, entries, frozenset(numbers))


def _char_number(value: str) -> str:
    """ "MAJ:MIN" of a `/dev/char/MAJ:MIN` entry that allows read and write, else ""."""
    path, _, access = value.partition(" ")
    access = access.strip() or "rwm"  # systemd's default: every access
    m = _CHAR.fullmatch(path)
    if m is None or "r" not in access or "w" not in access:
        return ""
    return f"{int(m[1])}:{int(m[2])}"


def scope_devices(root: Root, unit: str) -> Optional[ScopeDevices]:
    """What `unit`'s transient file and its drop-ins set; None where `unit` has no
    transient file, one of them cannot be read, or it has more than MAX_DROPINS
    entries in its drop-in directory (the last ones decide; its cgroup is all there is
    to go by)."""
    base = root.path(TRANSIENT_DIR)
    files = [base / unit]
    dropins = base / f"{unit}.d"
    try:
        with os.scandir(dropins) as it:  # read no further than the bound
            listed = [e.name for e in itertools.islice(it, MAX_DROPINS + 1)]
    except OSError:
        listed = []
    if len(listed) > MAX_DROPINS:
        return None
    files += [dropins / n for n in sorted(n for n in listed if n.endswith(".conf"))]
    out = ScopeDevices()
    for path in files:
        text = _read(path)
        if text is None:
            return None
        out = apply_unit_text(out, text)
    return out


def _read(path: Path) -> Optional[str]:
    try:
        return read_text(path, what="systemd transient unit file", max_bytes=MAX_FILE)
    except UnsafeFileError:
        return None
