"""V2Remedy=restart-container never becomes a restart loop; it stops the container with
the one container stopper (actuate/containers.py), whose clients here are stand-ins."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from gpuguard.actuate.containers import ContainerStopper
from gpuguard.config import Config
from gpuguard.engine.executor import ChangeExecutor
from gpuguard.engine.oneshot import OneShotServices
from gpuguard.host.paths import Root
from gpuguard.journal.log import EventLog
from gpuguard.steps.container_access import ContainerAccessStep
from gpuguard.steps.container_access.actuate import POD_RESTART_WINDOW
from gpuguard.steps.container_access.fullpass import remedy
from gpuguard.steps.container_access.reconcile import RestartContainer


def _restart(pod: str) -> RestartContainer:
    return RestartContainer("container_access", "r", "c1", pod_uid=pod, container_id="c1")


def other(step: ContainerAccessStep, a: RestartContainer, svc: Any) -> Any:  # an Outcome
    return asyncio.run(remedy(step.state, a, svc))


def stopper(crictl: str) -> ContainerStopper:
    # No ctr to fall back to: a test never reaches a real containerd.
    return ContainerStopper(crictl=crictl, cri_endpoint="unix:///nonexistent", ctr="/nonexistent")


def test_one_restart_per_pod_per_window(tmp_path: Path) -> None:
    now = [1000.0]
    step = ContainerAccessStep(clock=lambda: now[0], stopper=stopper("/bin/true"))
    cfg = Config()
    svc = OneShotServices(
        Root(tmp_path),
        cfg,
        EventLog(level="error"),
        apply=ChangeExecutor(dry_run=False),
        bus_address="",
    )
    assert other(step, _restart("pod-a"), svc).status == "done"
    now[0] += 60
    second = other(step, _restart("pod-a"), svc)
    assert second.status == "declined" and "already restarted" in second.detail
    assert other(step, _restart("pod-b"), svc).status == "done"
    now[0] += POD_RESTART_WINDOW
    assert other(step, _restart("pod-a"), svc).status == "done"


def test_a_failed_attempt_counts_too(tmp_path: Path) -> None:
    step = ContainerAccessStep(clock=lambda: 5.0, stopper=stopper("/bin/false"))
    cfg = Config()
    svc = OneShotServices(
        Root(tmp_path),
        cfg,
        EventLog(level="error"),
        apply=ChangeExecutor(dry_run=False),
        bus_address="",
    )
    assert other(step, _restart("pod-a"), svc).status == "failed"
    assert other(step, _restart("pod-a"), svc).status == "declined"


def test_the_stop_gives_the_runtime_a_stop_timeout(tmp_path: Path) -> None:
    """The one stopper: crictl stop with --timeout (the old crictl-only path had none)."""
    argv = tmp_path / "argv"
    crictl = tmp_path / "crictl"
    crictl.write_text(f'#!/bin/sh\necho "$@" > {argv}\n')
    crictl.chmod(0o755)
    res = asyncio.run(stopper(str(crictl)).stop("c" * 64))
    assert (res.ok, res.method) == (True, "crictl")
    assert argv.read_text().split() == [
        "--runtime-endpoint", "unix:///nonexistent", "stop", "--timeout", "10", "c" * 64
    ]  # fmt: skip


def test_no_client_is_a_failure_naming_them() -> None:
    res = asyncio.run(stopper("/nonexistent-crictl").stop("c1"))
    assert (res.ok, res.method) == (False, "none")
    assert "/nonexistent-crictl" in res.detail and "/nonexistent" in res.detail
