"""Open the checkpoint safely and read it without changing anything.

Every problem is a BadInputError: one sentence with the path, what is wrong and what
to do next. load() is for inspection (a checksum mismatch is reported, not raised);
read_checkpoint() is the strict path a repair starts from.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from gpuguard.checkpoint import codec, spew
from gpuguard.checkpoint.model import Checkpoint
from gpuguard.errors import BadInputError
from gpuguard.host import safeio

DEFAULT_MAX_BYTES = safeio.CHECKPOINT_MAX


@dataclass(frozen=True)
class Loaded:
    """A parsed checkpoint, its bytes and stat, and whether kubelet would accept it."""

    checkpoint: Checkpoint
    raw: bytes
    stat: os.stat_result
    computed: int  # the checksum kubelet computes for the data
    valid: bool  # kubelet accepts the stored checksum
    problem: str  # "" when valid, else the sentence read_checkpoint() raises


def _read(path: Path, max_bytes: int) -> tuple[bytes, os.stat_result]:
    # The shared safe reader: no links, no FIFOs (non-blocking open), regular files only.
    return safeio.read_bytes(
        path,
        what="checkpoint",
        max_bytes=max_bytes,
        missing="does not exist — kubelet writes it once a device plugin registers",
        next_step=codec.NEXT_STEP,
    )


def mismatch_message(path: Path, stored: int, computed: int) -> str:
    return (
        f"{path}: checksum mismatch (stored {stored}, computed {computed}); kubelet will "
        f"discard this file at its next start — {codec.NEXT_STEP}"
    )


def load(path: Path, *, max_bytes: int = DEFAULT_MAX_BYTES) -> Loaded:
    """Read and parse `path`; a wrong checksum is reported in the result, not raised."""
    raw, st = _read(path, max_bytes)
    cp = codec.parse(raw, source=str(path))
    computed = spew.checksum(cp)
    valid = computed == cp.checksum or codec.verify(cp)
    problem = "" if valid else mismatch_message(path, cp.checksum, computed)
    return Loaded(cp, raw, st, computed, valid, problem)


def read_checkpoint(
    path: Path, *, max_bytes: int = DEFAULT_MAX_BYTES, verify: bool = True
) -> tuple[Checkpoint, bytes, os.stat_result]:
    """(checkpoint, raw bytes, stat) of `path`; with verify, a mismatch raises too."""
    loaded = load(path, max_bytes=max_bytes)
    if verify and not loaded.valid:
        raise BadInputError(loaded.problem)
    return loaded.checkpoint, loaded.raw, loaded.stat
