"""bench/bench_fleet.py runs and prints every figure (values are reported, not checked)."""

from __future__ import annotations

import re
import subprocess
import sys

from conftest import REPO

NUM = r"\d+(?:\.\d+)?"


def test_bench_fleet_prints_its_figures() -> None:
    res = subprocess.run(
        [sys.executable, str(REPO / "bench/bench_fleet.py"), "--runs", "2", "--containers", "20"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    for name in (
        "npd answer in-process",
        r"gpuguard npd end to end \(new process\)",
        "status summary in-process",
        r"metrics update \+ export \(2 files\)",
        "metrics rendered for a scrape",
    ):
        assert re.search(rf"^{name}: n=2 p50={NUM} ms p95={NUM} ms$", res.stdout, re.M), res.stdout


def test_bench_metrics_http_prints_its_figures() -> None:
    res = subprocess.run(
        [
            sys.executable,
            str(REPO / "bench/bench_metrics_http.py"),
            "--scrapes",
            "2",
            "--idle",
            "5",
            "--slow",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    for name in ("alone", r"beside 5 idle \+ 2 slow"):
        pattern = rf"^{name} +p50 +{NUM} ms +p99 +{NUM} ms +max +{NUM} ms$"
        assert re.search(pattern, res.stdout, re.M), res.stdout
