"""The kubelet device-manager checkpoint (kubelet_internal_checkpoint): read, check, write.

The format, the checksum and how kubelet reads and writes the file: docs/checkpoint-format.md.

Modules (docs/architecture.md has the map of the packages):

- kubelet checkpoint codec: parse as kubelet does, go-spew checksum, marshal
  byte-identical (`codec.py`, `spew.py`, `model.py`); the safe read (`reader.py`); a pod
  entry's protobuf allocation response read and rewritten string by string
  (`allocresp.py`); the GPU identity history, its typed loader and generations
  (`history.py`); the record of dropped and remapped entries (`dropped.py`)
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
