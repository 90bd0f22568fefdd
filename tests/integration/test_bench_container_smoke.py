"""bench/bench_container_access.py runs end to end in a tiny configuration and prints
every figure (the values are the bench's business, not this test's)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import REPO
from integration.harness import require_systemd_ns

pytestmark = pytest.mark.root

FIGURES = (
    "(a) 5 scopes started in",
    "start -> durable DeviceAllow=: p50",
    "containers without a durable grant after 120 s: ",
    "(d) full audit pass, nothing to repair, 5 GPU containers: p50",
    "per container: p50",
    "(b) 5 containers x 5 daemon-reloads",
    "container-reloads without the GPU right after the reload returned: ",
    "real losses (re-granted by gpuguard): ",
    "(c) fast path only (DurableGrants=no), 5 new scopes, 5 reloads",  # v1, the default
    "reload returned -> every container restored: p50",
    "reload returned -> repair pass ended:        p50",
    "repair pass duration:",
    "Reloading(false) at a bare client (Reloading only)",  # --observers signal
    "Reloading(false) at a bare client (+ UnitNew)",
    "Reloading(false) at gpuguard",
    "gpuguard's last write",
    "daemon's fast path: 5 granted",
    "reconciler crashes: ",
)


SIGNAL = ("--observers", "signal")  # the breakdown's D-Bus clients too


def test_bench_prints_every_figure() -> None:
    require_systemd_ns()
    bench = str(REPO / "bench/bench_container_access.py")
    res = subprocess.run(
        [sys.executable, bench, "--quick", "--containers", "5", "--reloads", "5", *SIGNAL],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    missing = [f for f in FIGURES if f not in res.stdout]
    assert not missing, f"missing {missing} in:\n{res.stdout}"


def test_bench_v2_verdicts_prints_every_figure() -> None:
    from conftest import require_root, require_tool

    require_root()
    require_tool("/sys/fs/cgroup/unified/cgroup.procs")
    res = subprocess.run(
        [
            sys.executable,
            str(REPO / "bench/bench_v2_verdicts.py"),
            "--containers",
            "3",
            "--runs",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    figures = ("probe per node:", "probe per container:", "programs, first", "programs, next")
    for figure in figures:
        assert f"  {figure}" in res.stdout and "ms per container" in res.stdout, res.stdout
