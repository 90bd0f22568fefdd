"""bench/bench_daemon.py --quick runs and prints every figure (their values are not checked:
a benchmark reports, it does not assert)."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from conftest import REPO
from integration.harness import require_systemd_ns

pytestmark = pytest.mark.root

NUM = r"-?\d+(?:\.\d+)?"
EXPECTED = [
    rf"^start to READY=1: {NUM} ms",
    rf"^RSS after start: {NUM} MB",
    r"^daemon-reloads: \d+, paired with exactly one pass: \d+, extra passes: \d+",
    rf"^reload returned -> pass start: n=\d+ p50={NUM} ms p99={NUM} ms max={NUM} ms",
    rf"^reload returned -> pass end: n=\d+ p50={NUM} ms p99={NUM} ms max={NUM} ms",
    rf"^RSS after \d+ reloads: {NUM} MB",
    rf"^idle CPU over {NUM} s: {NUM} % of one CPU \(utime\+stime\)",
]


def test_bench_daemon_quick_prints_its_figures() -> None:
    require_systemd_ns()
    res = subprocess.run(
        [sys.executable, str(REPO / "bench/bench_daemon.py"), "--quick"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    for pattern in EXPECTED:
        assert re.search(pattern, res.stdout, re.M), f"missing {pattern!r} in:\n{res.stdout}"
    print(res.stdout)


def test_bench_journal_quiet_prints_its_figure() -> None:
    require_systemd_ns()
    res = subprocess.run(
        [sys.executable, str(REPO / "bench/bench_journal_quiet.py"), "--passes", "3"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    pattern = rf"^lines per healthy pass at info or above: {NUM}; per node-day at the default"
    assert re.search(pattern, res.stdout, re.M), res.stdout
    print(res.stdout)
