"""The off switch: while /etc/gpuguard/disabled exists, gpuguard changes nothing.

One file, because an operator turns a fleet off in an incident with one command
(`gpuguard disable`, which writes it) and configuration management with one file
resource; the package never ships nor overwrites it, so it survives upgrades and
reboots. Whatever is at the path counts, whatever its content or type: an empty file,
a directory, a file gpuguard cannot read all mean "off" (the operator wanted it off;
guessing otherwise would be the wrong failure). The first line of a regular file is
the reason shown in `gpuguard status`, `doctor`, the journal and the metrics.

Every writer checks it: gpuguard.service and gpuguard-trigger.service do not start
(ConditionPathExists=!), a running daemon stops before its next pass or fast path,
kubelet's pre-start hook and `gpuguard check` change nothing. Reading it costs one
lstat while it is absent.
"""

from __future__ import annotations

import os
import stat
import time
from dataclasses import dataclass
from typing import Optional

from gpuguard.host.echo import cut
from gpuguard.host.paths import Root
from gpuguard.host.safeio import UnsafeFileError, read_bytes

OFF_SWITCH = "/etc/gpuguard/disabled"
MAX_BYTES = 64 * 1024
REASON_MAX = 200


@dataclass(frozen=True)
class OffSwitch:
    path: str  # the host path, /etc/gpuguard/disabled
    reason: str  # its first line, "" when it has none
    since: float  # its mtime, 0.0 when unknown

    def describe(self) -> str:
        when = (
            time.strftime(" since %Y-%m-%d %H:%M:%S %Z", time.localtime(self.since))
            if self.since
            else ""
        )
        why = f": {self.reason}" if self.reason else ""
        return f"gpuguard is disabled ({self.path}{when}){why}"

    def to_json(self) -> dict[str, object]:
        return {"path": self.path, "reason": self.reason, "since": self.since}


def read_off_switch(root: Root) -> Optional[OffSwitch]:
    """The off switch, None while it is not set."""
    path = root.path(OFF_SWITCH)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    except OSError as e:  # cannot even look: that is not "on"
        return OffSwitch(OFF_SWITCH, f"(cannot read it: {e.strerror}; taken as set)", 0.0)
    if not stat.S_ISREG(st.st_mode):
        return OffSwitch(OFF_SWITCH, "", st.st_mtime)
    try:
        data, _st = read_bytes(path, what="off switch", max_bytes=MAX_BYTES)
    except UnsafeFileError:
        return OffSwitch(OFF_SWITCH, "", st.st_mtime)
    return OffSwitch(OFF_SWITCH, first_line(data), st.st_mtime)


def first_line(data: bytes) -> str:
    """The reason: the first non-empty line that is not a comment, one line, bounded."""
    for raw in data.decode("utf-8", errors="replace").splitlines():
        line = " ".join(raw.split())
        if line and not line.startswith("#"):
            return cut(line, REASON_MAX)
    return ""
