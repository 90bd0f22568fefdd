"""The loop thread's CPU and run-queue time, from the kernel's own accounting."""

from __future__ import annotations

import time

import pytest

from gpuguard.host import threadclock
from gpuguard.host.threadclock import ThreadClock, thread_clock


def test_work_shows_as_time_on_a_cpu() -> None:
    start = thread_clock()
    if start is None:
        pytest.skip("this kernel keeps no schedstat")
    deadline = time.thread_time() + 0.05
    while time.thread_time() < deadline:
        pass
    end = thread_clock()
    assert end is not None
    spent = end.since(start)
    assert 0.04 <= spent.on_cpu < 5 and spent.waiting >= 0


def test_sleeping_is_neither() -> None:
    start = thread_clock()
    if start is None:
        pytest.skip("this kernel keeps no schedstat")
    time.sleep(0.1)
    end = thread_clock()
    assert end is not None and end.since(start).on_cpu < 0.05


def test_a_kernel_without_it_gives_none(monkeypatch, tmp_path) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(threadclock, "SCHEDSTAT", str(tmp_path / "absent"))
    assert thread_clock() is None
    (tmp_path / "odd").write_text("not numbers\n")
    monkeypatch.setattr(threadclock, "SCHEDSTAT", str(tmp_path / "odd"))
    assert thread_clock() is None
    assert ThreadClock(2.0, 1.0).since(ThreadClock(0.5, 0.25)) == ThreadClock(1.5, 0.75)
