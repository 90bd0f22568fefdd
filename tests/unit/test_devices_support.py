"""Shared helpers for the test_devices_* unit tests (no tests here): fake device nodes.

`fake_stat` stands in for gpuguard.devices.nodes._stat so tests need no CAP_MKNOD.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path


def make_node(path: Path, major: int, minor: int, kind: str = "c", mode: int = 0o666) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"FAKEDEV {kind} {major} {minor} {mode:o}")


def fake_stat(path: Path, follow_symlinks: bool) -> os.stat_result:
    st = os.stat(path, follow_symlinks=follow_symlinks)
    if not stat.S_ISREG(st.st_mode) or st.st_size > 64:
        return st
    text = Path(path).read_text()
    if not text.startswith("FAKEDEV "):
        return st
    _, kind, major, minor, mode = text.split()
    fmt = stat.S_IFCHR if kind == "c" else stat.S_IFBLK
    fields = list(st)
    fields[stat.ST_MODE] = fmt | int(mode, 8)
    result = os.stat_result(fields, {"st_rdev": os.makedev(int(major), int(minor))})
    return result
