"""One writer of the checkpoint around one kubelet restart: while kubelet's unit is
starting, stopping or has a job queued, and has gpuguard's pre-start drop-in, the
daemon's pass (or a person's `gpuguard check`) leaves the repair to that hook and looks
again later, instead of writing the file beside it. The daemon's first pass is the
exception for a queued start job: kubelet's start waits for gpuguard's own
(After=gpuguard.service), so the first pass still repairs directly at boot."""

from __future__ import annotations

import asyncio
import io
import json
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Optional

import pytest

from gpuguard.config import Config
from gpuguard.engine.executor import ChangeExecutor
from gpuguard.engine.oneshot import OneShotServices
from gpuguard.engine.passes import PassContext, Work
from gpuguard.host.inventory import Inventory, parse_inventory
from gpuguard.host.paths import Root
from gpuguard.host.systemd import UnitState
from gpuguard.journal.log import EventLog
from gpuguard.steps.checkpoint import CheckpointStep, analyse_checkpoint
from gpuguard.steps.checkpoint.kubelet import coordinate
from gpuguard.steps.checkpoint.report import CheckReport, CheckSettings
from unit.test_check_flow import CHECKPOINT, FIXTURE, INVENTORY, MOVED

UNIT = "kubelet.service"
DROPIN = f"/usr/lib/systemd/system/{UNIT}.d/10-gpuguard.conf"


class FakeSystemd:
    """kubelet's unit as systemd would report it; any job queued is recorded."""

    def __init__(self, active: str, job: bool = False, dropin: bool = True) -> None:
        self.state = UnitState(
            UNIT, "loaded", active, "", "", (DROPIN,) if dropin else (), 1, job_pending=job
        )
        self.jobs: list[str] = []

    async def unit_state(self, unit: str) -> UnitState:
        return self.state

    async def restart_unit(self, unit: str, **kw: Any) -> str:
        self.jobs.append("restart")
        return "done"

    async def stop_unit(self, unit: str, **kw: Any) -> str:
        self.jobs.append("stop")
        return "done"

    async def start_unit(self, unit: str, **kw: Any) -> str:
        self.jobs.append("start")
        return "done"


@pytest.fixture
def root(tmp_path: Path) -> Path:
    r = tmp_path / "node"
    (r / CHECKPOINT).parent.mkdir(parents=True)
    (r / CHECKPOINT).write_bytes(FIXTURE.read_bytes())
    (r / "proc/1").mkdir(parents=True)
    (r / "proc/1/comm").write_text("systemd\n")
    return r


def inventory() -> Inventory:
    return parse_inventory(INVENTORY, source="test")


def settings(**kw: Any) -> CheckSettings:
    s = CheckSettings.from_config(
        Config().kubelet, apply=ChangeExecutor(), reason="test", bus_address=""
    )
    return replace(s, kubelet_unit=UNIT, **kw)


def check(root: Path, sd: FakeSystemd, s: CheckSettings) -> tuple[CheckReport, list[str]]:
    out = io.StringIO()
    log = EventLog(stream=out, level="debug")
    r = Root(root)
    report, actuator = analyse_checkpoint(r, inventory(), s, log)
    assert actuator is not None, "a stale checkpoint: a repair is planned"
    done = coordinate(r, s, report, actuator, log, sd, inventory())  # type: ignore[arg-type]
    report = asyncio.run(done)
    return report, [json.loads(line)["kind"] for line in out.getvalue().splitlines()]


@pytest.mark.parametrize(
    ("active", "job"),
    [("activating", False), ("deactivating", False), ("inactive", True), ("active", True)],
)
def test_a_restart_under_way_is_left_to_the_hook(root: Path, active: str, job: bool) -> None:
    sd = FakeSystemd(active, job)
    report, kinds = check(root, sd, settings())
    assert report.hook_pending and not report.outcomes and sd.jobs == []
    assert "pre-start hook" in report.coordination and active in report.coordination
    assert (root / CHECKPOINT).read_bytes() == FIXTURE.read_bytes()  # not written
    assert not (root / "var/lib/gpuguard/backups").exists()
    assert "checkpoint-repaired" not in kinds


def test_without_the_drop_in_a_stopped_kubelet_is_repaired_directly(root: Path) -> None:
    sd = FakeSystemd("inactive", job=True, dropin=False)  # no hook will run
    report, kinds = check(root, sd, settings())
    assert not report.hook_pending and [o.status for o in report.outcomes] == ["done"]
    assert MOVED not in (root / CHECKPOINT).read_text() and "checkpoint-repaired" in kinds


def test_at_boot_a_start_job_waiting_for_gpuguard_does_not_defer(root: Path) -> None:
    # the daemon's first pass: kubelet's start job waits for gpuguard.service
    sd = FakeSystemd("inactive", job=True)
    report, _kinds = check(root, sd, settings(kubelet_waits=True))
    assert not report.hook_pending and [o.status for o in report.outcomes] == ["done"]
    assert "repair directly" in report.coordination
    assert MOVED not in (root / CHECKPOINT).read_text()
    # but a unit already in its start (the hook may be running) is still left to it
    (root / CHECKPOINT).write_bytes(FIXTURE.read_bytes())
    report, _kinds = check(root, FakeSystemd("activating"), settings(kubelet_waits=True))
    assert report.hook_pending and (root / CHECKPOINT).read_bytes() == FIXTURE.read_bytes()


def test_the_daemon_looks_again_after_leaving_it_to_the_hook(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from gpuguard.steps import checkpoint as step_module

    async def pending(*args: Any, **kw: Any) -> CheckReport:
        return CheckReport(
            checkpoint="c", kubelet=f"{UNIT} is activating", hook_pending=True, exit_code=1
        )

    monkeypatch.setattr(step_module, "check_checkpoint", pending)

    async def load() -> Optional[Inventory]:
        return inventory()

    now = time.monotonic()
    ctx = PassContext(Work(frozenset({"checkpoint"}), ("test",), now, now), load)
    ctx.step = "checkpoint"  # as the runner sets it
    svc = OneShotServices(Root(root), Config(), EventLog(level="error"), ChangeExecutor(), "")
    asyncio.run(CheckpointStep()(svc, ctx))
    (again,) = ctx.followups
    assert again.step == "checkpoint" and again.delay == CheckpointStep.HOOK_RECHECK
    assert not ctx.findings and not ctx.outcomes  # nothing refused: it is the hook's
