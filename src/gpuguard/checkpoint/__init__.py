"""The kubelet device-manager checkpoint (kubelet_internal_checkpoint): read, check, write.

The format, the checksum and how kubelet reads and writes the file: docs/checkpoint-format.md.
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
