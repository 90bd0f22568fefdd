"""The kubelet device-manager checkpoint (kubelet_internal_checkpoint): read, check, write.

See docs in shared/docs/kubelet-checkpoint.md for the format and kubelet's behaviour.
"""

from __future__ import annotations

from gpuguard.checkpoint.codec import canonical, marshal, parse, verify
from gpuguard.checkpoint.model import Checkpoint, PodDevicesEntry
from gpuguard.checkpoint.reader import Loaded, load, read_checkpoint
from gpuguard.checkpoint.spew import checksum, render

__all__ = [
    "Checkpoint",
    "Loaded",
    "PodDevicesEntry",
    "canonical",
    "checksum",
    "load",
    "marshal",
    "parse",
    "read_checkpoint",
    "render",
    "verify",
]
