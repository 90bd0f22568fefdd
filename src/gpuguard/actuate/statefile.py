"""The one writer of gpuguard's state files (host/statefile.py describes each).

A state file is rendered from its model by its `StateFile` and written atomically
(temp file, fsync, rename) into a state directory that must be a real directory owned
by root (actuate.files.write_new: never through a link, never into another user's
directory). Its parent (`/run/gpuguard`, `/var/lib/gpuguard`) is created when missing,
with the spec's `dir_mode` (the runtime directory stays readable by the metrics
server, the state directory is root's alone), as the unit's RuntimeDirectory= and
StateDirectory= would (kubelet's hook runs outside gpuguard.service).
"""

from __future__ import annotations

from pathlib import Path
from typing import TypeVar

from gpuguard.actuate.files import write_new
from gpuguard.errors import BadInputError
from gpuguard.host.statefile import StateFile

T = TypeVar("T")


class UnreadableStateError(BadInputError):
    """The value would make a file its own reader refuses: not written."""


def write_state(path: Path, spec: StateFile[T], value: T) -> None:
    """Write `value` to `path` (a Root-mapped path, normally spec.path's). Raises
    OSError, UnsafeDirError or UnreadableStateError (BadInputErrors) when it cannot;
    nothing is half-written, and nothing its reader (host/statefile.load) would refuse
    is written at all: the file on disk stays as it was."""
    data, why = spec.refuses(value)
    if why:
        raise UnreadableStateError(
            f"{path}: not written: gpuguard's own reader would refuse this {spec.what} ({why})"
        )
    path.parent.mkdir(mode=spec.dir_mode, parents=True, exist_ok=True)
    write_new(path, data, mode=spec.mode)
