"""[Kubelet] RestartPolicy=: the daemon restarts a running kubelet only for the pods the
restart brings back (a pod this node runs whose entry the repair remaps), never for
what was stale when it started (an install, an upgrade), and journals the pods it is
for; an agent's unit (k3s, RKE2) is the whole agent, and says so.

A fake node with the real numa-blog-04 checkpoint (2 pods, 3 GPUs): the GPUs are
recorded in the history, then come back with new UUIDs in the same slots, so both
entries are remapped. kubelet's unit is active without gpuguard's drop-in, so the
restart is a stop, repair, start (the hook's verification is
tests/integration/test_kubelet_restart_token.py's).
"""

from __future__ import annotations

import asyncio
import io
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from gpuguard.config import Config, load_config
from gpuguard.engine.executor import ChangeExecutor
from gpuguard.host.inventory import Inventory, parse_inventory
from gpuguard.host.paths import Root
from gpuguard.host.systemd import UnitState
from gpuguard.journal.log import EventLog
from gpuguard.steps.checkpoint import analyse_checkpoint, check_checkpoint
from gpuguard.steps.checkpoint.kubelet import coordinate
from gpuguard.steps.checkpoint.report import CheckReport, CheckSettings
from unit.test_checkpoint_remap_cli import CHECKPOINT, HISTORY, NEW, OLD, inventory, make_root

POD_A = "513cb897-0262-4868-826f-aa943ee45a38"
POD_B = "94283d1b-ce5a-4797-bff8-0cf0c7143b2b"


class FakeSystemd:
    """kubelet's unit, active, without the drop-in; each job queued is recorded."""

    def __init__(self, unit: str) -> None:
        self.state = UnitState(unit, "loaded", "active", "", "", (), 1)
        self.jobs: list[str] = []

    async def unit_state(self, unit: str) -> UnitState:
        return self.state

    async def restart_unit(self, unit: str, **kw: Any) -> str:
        self.jobs.append(f"restart {unit}")
        return "done"

    async def stop_unit(self, unit: str, **kw: Any) -> str:
        self.jobs.append(f"stop {unit}")
        self.state = replace(self.state, active_state="inactive")
        return "done"

    async def start_unit(self, unit: str, **kw: Any) -> str:
        self.jobs.append(f"start {unit}")
        self.state = replace(self.state, active_state="active")
        return "done"


def gpus(uuids: list[str]) -> Inventory:
    return parse_inventory(inventory(uuids), source="nvml")


@pytest.fixture
def root(tmp_path: Path) -> Path:
    r = make_root(tmp_path / "node")
    s = settings(Config(), "kubelet.service", daemon=False)
    report = asyncio.run(check_checkpoint(Root(r), gpus(OLD), s, EventLog(level="error")))
    assert report.exit_code == 0 and (r / HISTORY).exists(), report.render()
    (r / "sys/fs/cgroup").mkdir(parents=True)
    (r / "sys/fs/cgroup/cgroup.controllers").write_text("cpu memory\n")
    return r


def running(root: Path, uid: str) -> None:
    """The pod's cgroup, as kubelet's systemd driver names it."""
    pod = f"kubepods-besteffort-pod{uid.replace('-', '_')}.slice"
    (root / "sys/fs/cgroup/kubepods.slice/kubepods-besteffort.slice" / pod).mkdir(parents=True)


def known(root: Path, uid: str) -> None:
    """The pod's directory, which kubelet keeps while it knows the pod."""
    (root / "var/lib/kubelet/pods" / uid).mkdir(parents=True)


def settings(cfg: Config, unit: str, daemon: bool = True, **kw: Any) -> CheckSettings:
    s = CheckSettings.from_config(
        cfg.kubelet,
        apply=ChangeExecutor(dry_run=False),
        reason="test",
        bus_address="",
        daemon=daemon,
        **kw,
    )
    return replace(s, kubelet_unit=unit)


def run(root: Path, s: CheckSettings) -> tuple[CheckReport, FakeSystemd, list[dict[str, Any]]]:
    out = io.StringIO()
    log = EventLog(stream=out, level="debug")
    r, inv = Root(root), gpus(NEW)
    report, actuator = analyse_checkpoint(r, inv, s, log)
    assert actuator is not None and report.actions[0].remaps  # type: ignore[attr-defined]
    sd = FakeSystemd(s.kubelet_unit)
    report = asyncio.run(coordinate(r, s, report, actuator, log, sd, inv))  # type: ignore[arg-type]
    return report, sd, [json.loads(line) for line in out.getvalue().splitlines()]


def test_no_pod_to_bring_back_no_restart(root: Path) -> None:
    before = (root / CHECKPOINT).read_bytes()
    report, sd, journal = run(root, settings(Config(), "kubelet.service"))
    assert sd.jobs == [] and (root / CHECKPOINT).read_bytes() == before
    assert report.result.startswith("not repaired: left for kubelet's next start")
    assert "kubelet has no pod whose entry is remapped" in report.result
    assert "RestartPolicy=for-pods" in report.coordination
    assert not [e for e in journal if e["kind"].startswith("kubelet-")]


def test_a_running_pod_with_a_remapped_entry_gets_its_restart_journaled(root: Path) -> None:
    running(root, POD_B)
    report, sd, journal = run(root, settings(Config(), "kubelet.service"))
    assert sd.jobs == ["stop kubelet.service", "start kubelet.service"]
    assert report.result == "repaired" and NEW[1] in (root / CHECKPOINT).read_text()
    (stop,) = [e for e in journal if e["kind"] == "kubelet-stop"]
    assert stop["POD_UIDS"] == POD_B and f"for pod(s) {POD_B}" in stop["msg"]
    assert "KUBELET_AGENT" not in stop


def test_a_pod_kubelet_still_knows_counts_too(root: Path) -> None:
    """A static pod rejected at admission has no cgroup, but its directory, and a
    restart admits it again; a name that is no pod UID is never looked up as a path."""
    known(root, POD_A)
    (root / "var/lib/kubelet/pods/..").mkdir(parents=True, exist_ok=True)
    _report, sd, journal = run(root, settings(Config(), "kubelet.service"))
    (stop,) = [e for e in journal if e["kind"] == "kubelet-stop"]
    assert stop["POD_UIDS"] == POD_A and len(sd.jobs) == 2


def test_pods_stale_when_the_daemon_started_are_never_restarted_for(root: Path) -> None:
    running(root, POD_B)
    s = settings(Config(), "kubelet.service", restart_not_for=frozenset({POD_A, POD_B}))
    report, sd, _journal = run(root, s)
    assert sd.jobs == [] and "stale when gpuguard started" in report.result


def test_an_agents_restart_says_it_is_the_whole_agent(root: Path) -> None:
    running(root, POD_A)
    _report, sd, journal = run(root, settings(Config(), "k3s-agent.service"))
    assert sd.jobs == ["stop k3s-agent.service", "start k3s-agent.service"]
    (stop,) = [e for e in journal if e["kind"] == "kubelet-stop"]
    assert stop["KUBELET_AGENT"] == "1" and "the whole agent" in stop["msg"]


def _config(tmp_path: Path, policy: str) -> Config:
    conf = tmp_path / "gpuguard.conf"
    conf.write_text(f"[Kubelet]\nRestartPolicy={policy}\n")
    return load_config(Root(tmp_path), path=conf)


def test_for_pods_no_agent_leaves_an_agent_alone(root: Path, tmp_path: Path) -> None:
    running(root, POD_A)
    cfg = _config(tmp_path, "for-pods-no-agent")
    report, sd, _journal = run(root, settings(cfg, "rke2-agent.service"))
    assert sd.jobs == [] and "never restarts" in report.result
    report, sd, _journal = run(root, settings(cfg, "kubelet.service"))
    assert sd.jobs == ["stop kubelet.service", "start kubelet.service"]


def test_never_means_never_for_the_daemon_and_gpuguard_check(root: Path, tmp_path: Path) -> None:
    running(root, POD_A)
    cfg = _config(tmp_path, "never")
    for daemon in (True, False):
        report, sd, _journal = run(root, settings(cfg, "kubelet.service", daemon=daemon))
        assert sd.jobs == [] and "restarts are off" in report.coordination


def test_gpuguard_check_is_the_operators_own_request(root: Path) -> None:
    """`gpuguard check` (no gate): the operator asked, no running pod needed."""
    _report, sd, _journal = run(root, settings(Config(), "kubelet.service", daemon=False))
    assert sd.jobs == ["stop kubelet.service", "start kubelet.service"]
