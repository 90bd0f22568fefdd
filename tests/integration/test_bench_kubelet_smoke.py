"""bench/bench_kubelet_f1.py runs one round and prints its figure line (its values are
not checked: a benchmark reports, it does not assert)."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from conftest import REPO
from integration.harness import require_systemd_ns
from integration.harness.kubelet import kubelet_binary

pytestmark = pytest.mark.root

LINE = r"^stack=host case=one gpuguard=yes pods_back=\d/2 seconds_to_running=(\d+\.\d|-) "


def test_bench_kubelet_f1_one_round_prints_its_figures() -> None:
    require_systemd_ns()
    kubelet_binary()
    argv = [sys.executable, str(REPO / "bench/bench_kubelet_f1.py"), "--cases", "one"]
    res = subprocess.run(
        [*argv, "--modes", "gpuguard"], capture_output=True, text=True, timeout=300, check=False
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert re.search(LINE, res.stdout, re.M), res.stdout + res.stderr
    print(res.stdout)
