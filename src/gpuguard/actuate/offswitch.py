"""Setting and clearing the off switch (host/offswitch.py): `gpuguard disable` and
`gpuguard enable`. The file is world-readable (the metrics endpoint, which runs as a
dynamic user, reports it) and written atomically: a half-written switch is still set."""

from __future__ import annotations

import os
import time
from pathlib import Path

from gpuguard.actuate.files import atomic_replace
from gpuguard.host.offswitch import OFF_SWITCH
from gpuguard.host.paths import Root


def render(reason: str, who: str, now: float) -> bytes:
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(now))
    return (
        f"{reason}\n"
        f"# Set by `gpuguard disable` ({who}, {stamp}). While this file exists gpuguard\n"
        "# changes nothing: the daemon does not run, kubelet's pre-start hook and\n"
        "# `gpuguard check` only report. `gpuguard enable` removes it and starts the daemon.\n"
    ).encode()


def set_off_switch(root: Root, reason: str, who: str) -> Path:
    """Write the switch (replacing an earlier one). OSError when it cannot be written."""
    path = root.path(OFF_SWITCH)
    path.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
    if os.path.isdir(path) and not os.path.islink(path):
        return path  # already set, as a directory: nothing to write into it
    atomic_replace(path, render(reason, who, time.time()), mode=0o644, uid=None, gid=None)
    return path


def clear_off_switch(root: Root) -> bool:
    """Remove the switch; whether it was set. OSError when it cannot be removed (a
    directory someone made: removed only when empty)."""
    path = root.path(OFF_SWITCH)
    try:
        if os.path.isdir(path) and not os.path.islink(path):
            os.rmdir(path)
        else:
            os.unlink(path)
    except FileNotFoundError:
        return False
    return True
