"""Open the checkpoint safely and read it without changing anything.

Every problem is a BadInputError: one sentence with the path, what is wrong and what
to do next. load() is for inspection (a checksum mismatch is reported, not raised);
read_checkpoint() is the strict path a repair starts from.
"""

from __future__ import annotations

import errno
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from gpuguard.checkpoint import codec, spew
from gpuguard.checkpoint.model import Checkpoint
from gpuguard.errors import BadInputError

DEFAULT_MAX_BYTES = 16 * 1024 * 1024


@dataclass(frozen=True)
class Loaded:
    """A parsed checkpoint, its bytes and stat, and whether kubelet would accept it."""

    checkpoint: Checkpoint
    raw: bytes
    stat: os.stat_result
    computed: int  # the checksum kubelet computes for the data
    valid: bool  # kubelet accepts the stored checksum
    problem: str  # "" when valid, else the sentence read_checkpoint() raises


def _open_error(path: Path, e: OSError) -> BadInputError:
    if e.errno == errno.ELOOP:
        what = "is a symbolic link; gpuguard does not follow links here — point it at the real file"
    elif e.errno == errno.ENOENT:
        what = "does not exist — kubelet writes it once a device plugin registers"
    elif e.errno in (errno.EACCES, errno.EPERM):
        what = "cannot be read (permission denied) — run gpuguard as root"
    else:
        what = f"cannot be opened ({e.strerror}) — check the path and the file system"
    return BadInputError(f"{path}: {what}")


def _read(path: Path, max_bytes: int) -> tuple[bytes, os.stat_result]:
    # O_NOFOLLOW: a link could point anywhere; O_NONBLOCK: a FIFO must not hang us.
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise _open_error(path, e) from None
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise BadInputError(f"{path}: is a directory, not a checkpoint file — check the path")
        if not stat.S_ISREG(st.st_mode):
            raise BadInputError(
                f"{path}: is not a regular file (mode {stat.filemode(st.st_mode)}); "
                "refusing to read it — remove it while kubelet is stopped"
            )
        too_big = (
            f"{path}: is over the {max_bytes}-byte limit for a checkpoint; refusing to read "
            f"it — {codec.NEXT_STEP}"
        )
        if st.st_size > max_bytes:
            raise BadInputError(too_big)
        chunks = []
        left = max_bytes + 1  # one byte more tells us it grew past the limit
        while left > 0:
            try:
                chunk = os.read(fd, min(left, 1 << 20))
            except OSError as e:
                raise BadInputError(
                    f"{path}: read failed ({e.strerror}) — check the disk and try again"
                ) from None
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        data = b"".join(chunks)
        if len(data) > max_bytes:
            raise BadInputError(too_big)
        return data, st
    finally:
        os.close(fd)


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
