"""MIG capability device minors, from /proc/driver/nvidia/capabilities.

MIG capabilities are ``/dev/nvidia-caps/nvidia-cap<N>`` on the dynamic ``nvidia-caps``
major, N being ``DeviceFileMinor:`` in /proc/driver/nvidia/capabilities/.../access
(gpu<minor>/mig/gi<G>/access, .../gi<G>/ci<C>/access, mig/config, mig/monitor), as
nvidia-modprobe reads them. nodes.expected_nodes turns them into nodes.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Optional

from gpuguard.devices.nodes import MAX_MINOR
from gpuguard.host.numparse import parse_decimal
from gpuguard.host.paths import Root
from gpuguard.host.safeio import UnsafeFileError, read_kernel_text

log = logging.getLogger(__name__)

CAPS_PROC_DIR = "/proc/driver/nvidia/capabilities"


def parse_cap_access(text: str) -> Optional[int]:
    """``DeviceFileMinor: N`` from a capability file (the first one, as nvidia-modprobe)."""
    for line in text.split("\n"):
        key, sep, value = line.partition(":")
        if sep and key.strip() == "DeviceFileMinor":
            return parse_decimal(value.strip(), hi=MAX_MINOR)
    return None


def read_cap_minors(root: Root, max_depth: int = 6) -> dict[str, int]:
    """Capability path (relative to /proc/driver/nvidia/capabilities) -> device minor."""
    base = root.path(CAPS_PROC_DIR)
    out: dict[str, int] = {}

    def walk(d: Path, rel: str, depth: int) -> None:
        if depth > max_depth:
            return
        try:
            entries = sorted(os.scandir(d), key=lambda e: e.name)
        except OSError:
            return
        for e in entries:
            r = f"{rel}{e.name}"
            try:
                if e.is_dir(follow_symlinks=False):
                    walk(Path(e.path), r + "/", depth + 1)
                elif e.is_file(follow_symlinks=False):
                    text = read_kernel_text(Path(e.path), what="capability file")
                    minor = parse_cap_access(text or "")
                    if minor is not None:
                        out[r] = minor
            except OSError as err:
                log.debug("skipping %s: %s", e.path, err.strerror)
            except UnsafeFileError as err:
                log.debug("skipping %s", err.message)

    walk(base, "", 0)
    return out


def mig_cap_paths(gpu_minor: int, gi: int, ci: int) -> tuple[str, str]:
    """The capabilities a MIG device (GPU instance gi, compute instance ci) needs."""
    gi_path = f"gpu{gpu_minor}/mig/gi{gi}/access"
    return gi_path, f"gpu{gpu_minor}/mig/gi{gi}/ci{ci}/access"
