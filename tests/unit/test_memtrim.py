"""The C heap's freed pages handed back after a pass, at most once per interval
(host/memtrim.py), through glibc's malloc_trim where the C library has it."""

from __future__ import annotations

import ctypes.util

import pytest

from gpuguard.host.memtrim import MemoryTrim


def test_trims_at_most_once_per_interval() -> None:
    now = [100.0]
    trim = MemoryTrim(interval=60.0, clock=lambda: now[0])
    if not trim.available:
        pytest.skip("this C library has no malloc_trim")
    assert trim.after_pass()  # the first pass trims
    now[0] += 59.0
    assert not trim.after_pass()
    now[0] += 1.0
    assert trim.after_pass()
    assert trim.trims == 2


def test_glibc_has_it() -> None:
    if "musl" in (ctypes.util.find_library("c") or ""):
        pytest.skip("musl: nothing to trim with")
    assert MemoryTrim().available  # Debian's and RHEL's glibc: the daemon's hosts
