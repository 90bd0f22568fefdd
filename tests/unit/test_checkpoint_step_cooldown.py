"""The daemon's checkpoint step restarts kubelet at most once per cool-down, also when
the restart job failed or was canceled (kubelet stopped meanwhile: a flapping kubelet
made every pass try again before)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any, List, Optional

import pytest

from gpuguard.config import Config
from gpuguard.engine.executor import ChangeExecutor
from gpuguard.engine.oneshot import OneShotServices
from gpuguard.engine.passes import PassContext, Work
from gpuguard.errors import KubeletError
from gpuguard.host import aio
from gpuguard.host.inventory import Inventory, parse_inventory
from gpuguard.host.paths import Root
from gpuguard.journal.log import EventLog
from gpuguard.steps import checkpoint as check
from gpuguard.steps.checkpoint import CheckpointStep, CheckReport

INVENTORY = parse_inventory(
    {"gpus": [{"uuid": "GPU-1", "index": 0, "minor": 0, "pci_bus_id": "00000000:10:00.0"}]},
    source="test",
)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _ctx() -> PassContext:
    async def load() -> Optional[Inventory]:
        return INVENTORY

    now = time.monotonic()
    return PassContext(Work(frozenset({"checkpoint"}), ("test",), now, now), load)


def _run_passes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, outcome: str, times: List[float]
) -> List[bool]:
    """Run one pass at each clock time; return restart_kubelet as each pass offered it."""
    offered: List[bool] = []

    async def fake_check(*args: Any, **kw: Any) -> CheckReport:
        settings = args[2]
        offered.append(settings.restart_kubelet)
        if settings.restart_kubelet:
            kw["on_restart"]()  # as check_checkpoint does just before it restarts kubelet
        if settings.restart_kubelet and outcome == "canceled":
            raise KubeletError("checkpoint: kubelet restart job ended with 'canceled'")
        report = CheckReport(checkpoint="checkpoint")
        if settings.restart_kubelet:
            report.coordination = "restart kubelet.service through systemd"
        return report

    monkeypatch.setattr(check, "check_checkpoint", fake_check)
    clock = Clock()
    step = CheckpointStep(clock=clock)
    svc = OneShotServices(Root(tmp_path), Config(), EventLog(level="error"), ChangeExecutor(), "")
    for t in times:
        clock.now = t
        asyncio.run(step(svc, _ctx()))
    return offered


@pytest.mark.parametrize("outcome", ["done", "canceled"])
def test_one_restart_per_cooldown(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, outcome: str
) -> None:
    cd = CheckpointStep.COOLDOWN
    offered = _run_passes(tmp_path, monkeypatch, outcome, [1000, 1001, 1002, 1000 + cd + 1])
    assert offered == [True, False, False, True]


def test_the_daemons_first_pass_never_restarts_kubelet(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What is stale when the daemon starts (an install, an upgrade, its own restart) is
    left to kubelet's next start, said once, and its pods are never restarted for by a
    later pass (RestartPolicy=for-pods); once the checkpoint is healthy that is over."""
    from gpuguard.checkpoint import PodDevicesEntry
    from gpuguard.steps.checkpoint.reconcile import RewriteCheckpoint

    offered: List[Any] = []
    stale = [True]

    async def fake_check(*args: Any, **kw: Any) -> CheckReport:
        s = args[2]
        offered.append((s.restart_kubelet, s.restart_gate, s.restart_not_for))
        report = CheckReport(checkpoint="c", kubelet="kubelet.service is active")
        if stale[0]:
            entry = PodDevicesEntry("pod-1", "app", "nvidia.com/gpu", (("0", ("GPU-0",)),), b"")
            report.actions = [RewriteCheckpoint("checkpoint", "stale", "c", dropped=(entry,))]
        if not s.restart_kubelet:
            report.result = "not repaired: kubelet must be restarted to apply the repair"
        return report

    monkeypatch.setattr(check, "check_checkpoint", fake_check)
    step = CheckpointStep(clock=Clock())
    svc = OneShotServices(Root(tmp_path), Config(), EventLog(level="error"), ChangeExecutor(), "")
    first_pass_done = aio.Event()  # made in the loop that uses it (Python 3.9)
    svc.first_pass_done = first_pass_done  # type: ignore[attr-defined]
    ctx = _ctx()
    ctx.step = "checkpoint"  # as the runner sets it
    asyncio.run(step(svc, ctx))
    assert offered == [(False, "for-pods", frozenset())]
    assert not ctx.followups  # no restart "right after the start" either
    (left,) = ctx.findings
    assert "stale when gpuguard started" in left.summary and "next start" in left.summary
    first_pass_done.set()
    asyncio.run(step(svc, _ctx()))
    assert offered[-1] == (True, "for-pods", frozenset({"pod-1"}))
    stale[0] = False
    asyncio.run(step(svc, _ctx()))  # healthy: what was stale at the start is gone
    stale[0] = True
    asyncio.run(step(svc, _ctx()))
    assert offered[-1] == (True, "for-pods", frozenset())
