"""bench/bench_kubelet_api.py runs one round and prints its figure line (its values are
not checked: a benchmark reports, it does not assert)."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from conftest import REPO
from integration.harness import require_systemd_ns
from integration.harness.cluster import require_cluster
from integration.harness.kubelet_versions import unpack_prebuilt

pytestmark = pytest.mark.root

LINE = r"^scenario=reboot kubelet=1.34 case=none mode=gpuguard gpu-bare=(\d+\.\d+s|-)\("


def test_bench_kubelet_api_one_round_prints_its_figures() -> None:
    require_systemd_ns()
    require_cluster()
    unpack_prebuilt("1.34")
    argv = [sys.executable, str(REPO / "bench/bench_kubelet_api.py"), "--kubelets", "1.34"]
    argv += ["--cases", "none", "--scenarios", "reboot"]
    res = subprocess.run(argv, capture_output=True, text=True, timeout=300, check=False)
    assert res.returncode == 0, res.stdout + res.stderr
    assert re.search(LINE, res.stdout, re.M), res.stdout + res.stderr
    print(res.stdout)
