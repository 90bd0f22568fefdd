"""DevicePluginStep's limits: cool-down from start, hourly budget (persisted), back-off,
dry-run, Restart=no, and a journal entry per decision (declined ones included)."""

from __future__ import annotations

import asyncio
import dataclasses
import io
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import pytest

import gpuguard.steps.device_plugin as step_mod
from gpuguard.actuate.containers import ContainerStopper
from gpuguard.config import Config, DevicePluginConfig
from gpuguard.devices.nodes import ROLE_OTHER
from gpuguard.devices.plugins import NodeInfo, PluginInfo
from gpuguard.devices.processes import ProcessInfo
from gpuguard.engine.executor import ChangeExecutor
from gpuguard.engine.oneshot import OneShotServices
from gpuguard.engine.passes import Work
from gpuguard.engine.snapshot import HostSnapshot
from gpuguard.host.paths import Root
from gpuguard.journal.log import EventLog
from gpuguard.model import Finding, Outcome
from gpuguard.steps.device_plugin import DevicePluginStep
from gpuguard.steps.device_plugin.actuate import PluginRestarter, RestartResult, Verification
from gpuguard.steps.device_plugin.observe import PluginObservation
from gpuguard.steps.device_plugin.reconcile import RestartPlugin

T0 = 1_700_000_000.0
CID = "a" * 64
HOST = (
    NodeInfo("/dev/nvidia0", 195, 0, ROLE_OTHER, ctime=T0 - 100),
    NodeInfo("/dev/nvidiactl", 195, 255, ROLE_OTHER, ctime=T0 - 100),
    NodeInfo("/dev/nvidia-uvm", 510, 0, ROLE_OTHER, ctime=T0 + 10),
)
STALE_VIEW = HOST[:2]


@dataclass
class Ctx:
    work: Work = field(default_factory=lambda: Work(frozenset({"device_plugin"}), ("test",), 0, 0))
    findings: list[Finding] = field(default_factory=list)
    outcomes: list[Outcome] = field(default_factory=list)
    followups: list[tuple[float, frozenset[str], str]] = field(default_factory=list)

    def recheck(self, after: float, why: str) -> None:
        # as PassContext.recheck, for the step it runs (the runner names it)
        self.followups.append((after, frozenset({"device_plugin"}), why))

    def host(self, svc: Any) -> HostSnapshot:
        return HostSnapshot(svc.root, "")  # a fresh read at every call, as a new pass


class FakeRestarter(PluginRestarter):
    def __init__(self, ok: bool = True) -> None:
        super().__init__(stopper=ContainerStopper(ctr="/nonexistent", crictl="/nonexistent"))
        self.ok = ok
        self.calls: list[RestartPlugin] = []

    async def restart(self, root: Root, action: RestartPlugin, systemd: Any) -> RestartResult:
        self.calls.append(action)
        return RestartResult(self.ok, "ctr", "fake")


class Clock:
    def __init__(self) -> None:
        self.t = T0 + 1000

    def __call__(self) -> float:
        return self.t


class Step(DevicePluginStep):
    """Observation from the test; everything else real."""

    def __init__(self, clock: Clock, restarter: FakeRestarter) -> None:
        super().__init__(restarter=restarter, clock=clock, backoff_base=60, verify_timeout=1)
        self.view: Optional[tuple[NodeInfo, ...]] = STALE_VIEW
        self.start = T0

    def observe(
        self, root: Root, cfg: DevicePluginConfig, unit_started: Any, snapshot: Any = None
    ) -> PluginObservation:
        proc = ProcessInfo(4242, self.start, "plugin", "container", CID, "containerd", "p1")
        sock = "/var/lib/kubelet/device-plugins/nvidia-gpu.sock"
        p = PluginInfo(sock, "nvidia.com/gpu", self.start, proc, self.view)
        return PluginObservation(self.clock(), HOST, (p,), None)


@pytest.fixture
def verdict(monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """What verification will say: recovered / still-stale / timeout."""
    box = {"status": "recovered"}

    async def fake_verify(
        root: Root, sock_dir: str, ident: str, old: ProcessInfo, *a: Any, **k: Any
    ) -> Verification:
        new = dataclasses.replace(old, pid=old.pid + 1, start=old.start + 5)
        p = PluginInfo("/x/nvidia-gpu.sock", ident, 0, new, HOST)
        missing = ("/dev/nvidia-uvm",) if box["status"] == "still-stale" else ()
        return Verification(box["status"], None if box["status"] == "timeout" else p, missing, 0.1)

    monkeypatch.setattr(step_mod, "verify", fake_verify)
    return box


def make(tmp_path: Path, **dp: Any) -> tuple[OneShotServices, io.StringIO]:
    cfg = Config(device_plugin=dataclasses.replace(DevicePluginConfig(), **dp))
    out = io.StringIO()
    return OneShotServices(
        Root(tmp_path),
        cfg,
        EventLog(stream=out, level="debug"),
        apply=ChangeExecutor(dry_run=False),
        bus_address="",
    ), out


def entries(out: io.StringIO, kind: str) -> list[dict[str, Any]]:
    return [e for e in map(json.loads, out.getvalue().splitlines()) if e["kind"] == kind]


def run(step: DevicePluginStep, svc: OneShotServices) -> Ctx:
    ctx = Ctx()
    asyncio.run(step(svc, ctx))  # type: ignore[arg-type]
    return ctx


def test_stale_plugin_is_restarted_and_verified(tmp_path: Path, verdict: dict[str, str]) -> None:
    svc, out = make(tmp_path)
    r, clock = FakeRestarter(), Clock()
    ctx = run(Step(clock, r), svc)
    assert len(r.calls) == 1 and r.calls[0].process.container_id == CID
    assert [o.status for o in ctx.outcomes] == ["done"]
    assert entries(out, "plugin-missing-device") and entries(out, "plugin-restarted")
    (rec,) = entries(out, "plugin-recovered")
    assert rec["CONTAINER_ID"] == CID and rec["NEW_PLUGIN_PID"] == "4243"


def test_cool_down_counts_from_the_plugin_start(tmp_path: Path, verdict: dict[str, str]) -> None:
    svc, out = make(tmp_path, cool_down=300.0)
    r, clock = FakeRestarter(), Clock()
    s = Step(clock, r)
    s.start = clock.t - 299  # still starting
    ctx = run(s, svc)
    assert r.calls == [] and ctx.outcomes[0].status == "declined"
    (d,) = entries(out, "plugin-restart-declined")
    assert d["REASON"] == "cool-down" and d["level"] == "notice"
    run(s, svc)  # the same decline again: logged, quieter
    assert [e["level"] for e in entries(out, "plugin-restart-declined")] == ["notice", "info"]
    clock.t += 2
    run(s, svc)
    assert len(r.calls) == 1


def test_cool_down_end_is_asked_for_and_the_budget_still_holds(
    tmp_path: Path, verdict: dict[str, str]
) -> None:
    verdict["status"] = "still-stale"  # the restarted plugin comes back without uvm too
    svc, out = make(tmp_path, cool_down=300.0, max_restarts_per_hour=1)
    r, clock = FakeRestarter(), Clock()
    s = Step(clock, r)
    s.start = clock.t - 120  # uvm loaded soon after the plugin started: the boot case
    ctx = run(s, svc)
    assert r.calls == [] and ctx.outcomes[0].status == "declined"
    ((after, names, why),) = ctx.followups
    assert after == pytest.approx(180.2) and names == {"device_plugin"} and "cool-down" in why
    clock.t += after  # the follow-up pass, at the moment the cool-down ends
    ctx = run(s, svc)
    assert len(r.calls) == 1 and ctx.followups == []
    s.start = clock.t + 5  # the restarted plugin, still stale, is in its own cool-down
    clock.t += 10
    ctx = run(s, svc)
    assert len(r.calls) == 1 and ctx.outcomes[-1].status == "declined"
    (again,) = [f for f in ctx.followups if "cool-down" in f[2]]
    clock.t += again[0]  # its cool-down over: the hourly budget (1) declines it now
    ctx = run(s, svc)
    assert len(r.calls) == 1 and ctx.outcomes[-1].status == "declined"
    assert entries(out, "plugin-restart-declined")[-1]["REASON"] == "budget"
    assert not [f for f in ctx.followups if "cool-down" in f[2]]  # nothing more asked for


def test_budget_per_hour_then_declined_and_persisted(
    tmp_path: Path, verdict: dict[str, str]
) -> None:
    verdict["status"] = "still-stale"  # a plugin that keeps coming back without uvm
    svc, out = make(tmp_path, cool_down=0.0, max_restarts_per_hour=2)
    r, clock = FakeRestarter(), Clock()
    s = Step(clock, r)
    s.backoff_base = 0.0
    for _ in range(5):
        run(s, svc)
        clock.t += 60
    assert len(r.calls) == 2
    assert len(entries(out, "plugin-restart-failed")) == 2
    reasons = [e["REASON"] for e in entries(out, "plugin-restart-declined")]
    assert reasons == ["budget"] * 3
    # A new daemon (new step object) reads the budget back: still declined.
    r2 = FakeRestarter()
    s2 = Step(clock, r2)
    run(s2, svc)
    assert r2.calls == []
    saved = json.loads((tmp_path / "var/lib/gpuguard/plugin-restarts.json").read_text())
    assert len(saved["plugins"]["nvidia.com/gpu"]["restarts"]) == 2
    # An hour after the first restart, one more is allowed.
    clock.t += 3600
    run(s2, svc)
    assert len(r2.calls) == 1


def test_backoff_after_failed_attempts(tmp_path: Path, verdict: dict[str, str]) -> None:
    svc, out = make(tmp_path, cool_down=0.0, max_restarts_per_hour=100)
    r, clock = FakeRestarter(ok=False), Clock()
    s = Step(clock, r)
    times = []
    for _ in range(12):
        before = len(r.calls)
        run(s, svc)
        if len(r.calls) > before:
            times.append(clock.t)
        clock.t += 30
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert gaps == sorted(gaps) and gaps[0] >= 60 and gaps[1] >= 120  # 60, 120, 240...
    assert "back-off" in {e["REASON"] for e in entries(out, "plugin-restart-declined")}


def test_restart_off_and_dry_run_decline_with_a_journal_entry(
    tmp_path: Path, verdict: dict[str, str]
) -> None:
    for kw, dry, code, status in [
        ({"restart": False}, False, "disabled", "declined"),
        ({"max_restarts_per_hour": 0}, False, "disabled", "declined"),
        ({}, True, "dry-run", "dry-run"),
    ]:
        svc, out = make(tmp_path, cool_down=0.0, **kw)
        svc.apply = ChangeExecutor(dry_run=dry)
        r = FakeRestarter()
        ctx = run(Step(Clock(), r), svc)
        assert r.calls == [] and ctx.outcomes[0].status == status
        assert entries(out, "plugin-restart-declined")[0]["REASON"] == code


def test_timeout_leaves_a_pending_verification_then_fails_at_the_deadline(
    tmp_path: Path, verdict: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    verdict["status"] = "timeout"
    svc, out = make(tmp_path, cool_down=0.0, registration_grace=120.0)
    r, clock = FakeRestarter(), Clock()
    s = Step(clock, r)
    monkeypatch.setattr(step_mod, "check_new_plugin", lambda *a, **k: (None, ()))
    ctx = run(s, svc)
    assert ctx.outcomes[0].status == "done" and "no new plugin yet" in ctx.outcomes[0].detail
    clock.t += 60
    ctx = run(s, svc)
    assert ctx.outcomes[0].status == "declined"
    assert entries(out, "plugin-restart-declined")[-1]["REASON"] == "pending"
    clock.t += 100
    run(s, svc)
    assert entries(out, "plugin-restart-failed")
    assert len(r.calls) == 1


def test_healthy_plugin_nothing_logged_but_remembered(
    tmp_path: Path, verdict: dict[str, str]
) -> None:
    svc, _out = make(tmp_path)
    r, clock = FakeRestarter(), Clock()
    s = Step(clock, r)
    s.view = HOST
    ctx = run(s, svc)
    assert ctx.findings == [] and ctx.outcomes == [] and r.calls == []
    saved = json.loads((tmp_path / "var/lib/gpuguard/plugin-restarts.json").read_text())
    assert saved["plugins"]["nvidia.com/gpu"]["last"]["container_id"] == CID


def test_unreadable_state_file_starts_afresh(tmp_path: Path, verdict: dict[str, str]) -> None:
    f = tmp_path / "var/lib/gpuguard/plugin-restarts.json"
    f.parent.mkdir(parents=True)
    f.write_text("{not json")
    svc, out = make(tmp_path, cool_down=0.0)
    r = FakeRestarter()
    run(Step(Clock(), r), svc)
    assert len(r.calls) == 1 and "unreadable" in out.getvalue()


class ServiceStep(Step):
    """A plugin run as a host service, restarted by the real restarter through systemd."""

    def observe(
        self, root: Root, cfg: DevicePluginConfig, unit_started: Any, snapshot: Any = None
    ) -> PluginObservation:
        proc = ProcessInfo(4242, self.start, "plugin", "service", unit="fake-plugin.service")
        sock = "/var/lib/kubelet/device-plugins/nvidia-gpu.sock"
        p = PluginInfo(sock, "nvidia.com/gpu", self.start, proc, self.view)
        return PluginObservation(self.clock(), HOST, (p,), None)


@pytest.mark.parametrize("result", ["done", "failed"])
def test_a_host_service_restart_is_journaled_once_by_the_unit_job_actuator(
    tmp_path: Path, verdict: dict[str, str], monkeypatch: pytest.MonkeyPatch, result: str
) -> None:
    from gpuguard.steps.device_plugin import actuate
    from unit.test_unit_jobs import FakeSystemd

    monkeypatch.setattr(actuate, "still_running", lambda root, p: True)
    svc, out = make(tmp_path)
    sd = FakeSystemd(result)
    svc = dataclasses.replace(svc, client=sd)  # type: ignore[arg-type]
    restarter = PluginRestarter(stopper=ContainerStopper(ctr="/nonexistent", crictl="/nonexistent"))
    ctx = run(ServiceStep(Clock(), restarter), svc)  # type: ignore[arg-type]
    assert ("RestartUnit", "fake-plugin.service", {"timeout": 30.0}) in sd.calls
    restarted = entries(out, "plugin-restarted")
    failed = entries(out, "unit-job-failed")
    if result == "done":
        assert [o.status for o in ctx.outcomes] == ["done"] and not failed
        (e,) = restarted  # the actuator's, not a second one from the step
        assert (e["METHOD"], e["UNIT"], e["PLUGIN"], e["JOB_RESULT"]) == (
            "systemd", "fake-plugin.service", "nvidia.com/gpu", "done")  # fmt: skip
        assert e["GPUGUARD_RECONCILER"] == "device_plugin" and "because" in e["msg"]
    else:
        assert [o.status for o in ctx.outcomes] == ["failed"] and not restarted
        assert len(failed) == 1 and len(entries(out, "plugin-restart-failed")) == 1
