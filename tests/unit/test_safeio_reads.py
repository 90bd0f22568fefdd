"""How safeio reads (host/safeio.py): small requests for small files, growing ones for
large files, and the cap exact at every size. os.read(fd, n) allocates n bytes up
front: 1 MiB requests for every cgroup and /proc file fed the daemon's RSS growth."""

from __future__ import annotations

import os
from pathlib import Path
from typing import List

import pytest

from gpuguard.host import safeio
from gpuguard.host.safeio import READ_CHUNK_MAX, READ_CHUNK_MIN, UnsafeFileError, read_bytes


@pytest.fixture
def requests(monkeypatch: pytest.MonkeyPatch) -> List[int]:
    asked: List[int] = []
    real = os.read

    def read(fd: int, n: int) -> bytes:
        asked.append(n)
        return real(fd, n)

    monkeypatch.setattr(safeio.os, "read", read)
    return asked


def test_a_small_file_is_read_with_a_small_request(tmp_path: Path, requests: List[int]) -> None:
    f = tmp_path / "devices.list"
    f.write_bytes(b"c 195:0 rw\n" * 20)
    data, _ = read_bytes(f, what="devices.list", max_bytes=safeio.CGROUP_MAX)
    assert data == b"c 195:0 rw\n" * 20
    assert requests == [READ_CHUNK_MIN, READ_CHUNK_MIN]  # the data, then the end


def test_a_file_reported_empty_grows_its_requests(tmp_path: Path, requests: List[int]) -> None:
    """procfs and cgroupfs report size 0: the requests grow fourfold from the minimum;
    here the file's size is known, so the first request covers it whole."""
    f = tmp_path / "big"
    body = os.urandom(3 * 1024 * 1024 + 5)
    f.write_bytes(body)
    data, _ = read_bytes(f, what="checkpoint", max_bytes=safeio.CHECKPOINT_MAX)
    assert data == body
    assert requests[0] == READ_CHUNK_MAX and max(requests) == READ_CHUNK_MAX


def test_requests_grow_fourfold_while_they_are_filled(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    asked: List[int] = []
    feed = [b"x" * READ_CHUNK_MIN, b"y" * 4 * READ_CHUNK_MIN, b"z" * 100, b""]

    def read(fd: int, n: int) -> bytes:
        asked.append(n)
        return feed.pop(0)

    f = tmp_path / "mountinfo"
    f.write_bytes(b"")  # size 0, as the kernel reports for its own files
    monkeypatch.setattr(safeio.os, "read", read)
    data, _ = read_bytes(f, what="mountinfo", max_bytes=safeio.PROC_MAX)
    assert len(data) == 5 * READ_CHUNK_MIN + 100
    # a short read (100 bytes) asks no more the next time: that one is usually the end
    assert asked == [READ_CHUNK_MIN, 4 * READ_CHUNK_MIN, 16 * READ_CHUNK_MIN, 16 * READ_CHUNK_MIN]


@pytest.mark.parametrize("size", [100, READ_CHUNK_MIN, READ_CHUNK_MIN + 1, 200_000])
def test_the_cap_is_exact_at_every_size(tmp_path: Path, size: int) -> None:
    f = tmp_path / "f"
    f.write_bytes(b"a" * size)
    assert len(read_bytes(f, what="file", max_bytes=size)[0]) == size
    with pytest.raises(UnsafeFileError, match="limit"):
        read_bytes(f, what="file", max_bytes=size - 1)
