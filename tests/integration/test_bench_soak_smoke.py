"""bench/soak.py runs for a few seconds on 5 containers, on each cgroup layout, and
prints every figure (their values are the bench's business, not this test's)."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from conftest import REPO
from integration.harness import layout as layout
from integration.harness import require_systemd_ns

pytestmark = pytest.mark.root

NUM = r"-?\d+(?:\.\d+)?"
EXPECTED = [
    r"^gpuguard soak: 5 GPU containers, cgroup v[12], ",
    r"^events: \d+ in \d+ s: daemon-reload \d+, daemon-reexec \d+, container-replace \d+, "
    r"kubelet-restart \d+, dbus-restart \d+, cgroup-rewrite \d+",
    r"^access losses: \d+ ",
    r"^containers without their GPU at the end: \d+",
    r"^kernel verdicts at the end \(own GPU allowed, other denied\): \d+/5",
    r"^daemon restarts \(NRestarts\): \d+; main PIDs seen: \d+",
    rf"^RSS: start {NUM} MB, end {NUM} MB, max {NUM} MB",
    r"^open fds: start \d+, end \d+, max \d+",
    r"^passes run: \d+ .*reconciler crashes: \d+",
]


def test_soak_prints_every_figure(layout: str) -> None:
    require_systemd_ns()
    soak = [str(REPO / "bench/soak.py"), "--minutes", "0.1", "--containers", "5"]
    res = subprocess.run(
        [sys.executable, *soak, "--layout", layout],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    for pattern in EXPECTED:
        assert re.search(pattern, res.stdout, re.M), f"missing {pattern!r} in:\n{res.stdout}"
