"""V2Remedy=restart-container never becomes a restart loop."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from gpuguard.config import Config
from gpuguard.log import EventLog
from gpuguard.oneshot import OneShotServices
from gpuguard.paths import Root
from gpuguard.steps.container_access import POD_RESTART_WINDOW, ContainerAccessStep
from gpuguard.steps.container_access.reconcile import RestartContainer


def _restart(pod: str) -> RestartContainer:
    return RestartContainer("container_access", "r", "c1", pod_uid=pod, container_id="c1")


def test_one_restart_per_pod_per_window(tmp_path: Path) -> None:
    now = [1000.0]
    step = ContainerAccessStep(clock=lambda: now[0])
    cfg = Config()
    cfg = dataclasses.replace(
        cfg, device_plugin=dataclasses.replace(cfg.device_plugin, crictl="/bin/true")
    )
    svc = OneShotServices(
        Root(tmp_path), cfg, EventLog(level="error"), dry_run=False, bus_address=""
    )
    assert step._other(_restart("pod-a"), svc).status == "done"  # type: ignore[arg-type]
    now[0] += 60
    second = step._other(_restart("pod-a"), svc)  # type: ignore[arg-type]
    assert second.status == "declined" and "already restarted" in second.detail
    assert step._other(_restart("pod-b"), svc).status == "done"  # type: ignore[arg-type]
    now[0] += POD_RESTART_WINDOW
    assert step._other(_restart("pod-a"), svc).status == "done"  # type: ignore[arg-type]


def test_a_failed_attempt_counts_too(tmp_path: Path) -> None:
    step = ContainerAccessStep(clock=lambda: 5.0)
    cfg = Config()
    cfg = dataclasses.replace(
        cfg, device_plugin=dataclasses.replace(cfg.device_plugin, crictl="/bin/false")
    )
    svc = OneShotServices(
        Root(tmp_path), cfg, EventLog(level="error"), dry_run=False, bus_address=""
    )
    assert step._other(_restart("pod-a"), svc).status == "failed"  # type: ignore[arg-type]
    assert step._other(_restart("pod-a"), svc).status == "declined"  # type: ignore[arg-type]
