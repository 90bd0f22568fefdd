"""bench/bench_apply_window.py runs end to end (one round per trigger) and prints a line
per trigger (the windows themselves are the bench's business, not this test's)."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from conftest import REPO, require_tool
from integration.harness import require_systemd_ns
from integration.harness.runc_env import REQUIRED_TOOLS

pytestmark = pytest.mark.root


def test_bench_apply_window_prints_a_line_per_trigger() -> None:
    require_systemd_ns()
    require_tool(*REQUIRED_TOOLS)
    res = subprocess.run(
        [sys.executable, str(REPO / "bench/bench_apply_window.py"), "-n", "1"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    for trigger in ("runc update", "daemon-reload", "daemon-reexec"):
        line = rf"^{trigger}: \d+ window\(s\) in 1 round\(s\), ms: (none seen|[\d.]+(, [\d.]+)*)$"
        assert re.search(line, res.stdout, re.M), f"no {trigger!r} line in:\n{res.stdout}"
