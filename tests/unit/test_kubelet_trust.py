"""gpuguard acts only for a kubelet it has reason to trust (devices/kubelettrust.py): a
process any local user can start and name `kubelet` never chooses the unit an F1
repair stops and starts, nor the configuration doctor reads. Fake roots: /proc/PID as
the kernel shows it, with `exe` a link to the executable inside the root."""

from __future__ import annotations

import asyncio
import io
import json
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from gpuguard.config import Config
from gpuguard.devices import kubelettrust
from gpuguard.devices.kubelettrust import exe_path_trusted, kubelet_unit, kubelets
from gpuguard.engine.executor import ChangeExecutor
from gpuguard.host.paths import Root
from gpuguard.host.systemd import UnitState
from gpuguard.journal.log import EventLog
from gpuguard.steps.checkpoint import analyse_checkpoint
from gpuguard.steps.checkpoint.kubelet import coordinate
from gpuguard.steps.checkpoint.report import CheckSettings
from unit.test_check_flow import CHECKPOINT, FIXTURE
from unit.test_checkpoint_hook_pending import inventory
from unit.test_doctor import check
from unit.test_doctor_kubelet import bare_node, doctor, process

UNITS = ("kubelet.service", "k3s.service", "k3s-agent.service", "rke2-agent.service")
ROOT_ONLY = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to chown a file")


@pytest.fixture(autouse=True)
def tests_uid_is_root(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kubelettrust, "ROOT_UID", os.getuid())


class RecordingSystemd:
    """Every unit loaded and inactive (kubelet not in a job): records what is asked."""

    def __init__(self) -> None:
        self.asked: list[str] = []
        self.jobs: list[tuple[str, str]] = []

    async def unit_state(self, unit: str) -> UnitState:
        self.asked.append(unit)
        return UnitState(unit, "loaded", "active", "running", "", (), 1)

    async def restart_unit(self, unit: str, **kw: Any) -> str:
        self.jobs.append(("restart", unit))
        return "done"

    async def stop_unit(self, unit: str, **kw: Any) -> str:
        self.jobs.append(("stop", unit))
        return "done"

    async def start_unit(self, unit: str, **kw: Any) -> str:
        self.jobs.append(("start", unit))
        return "done"


def hostile(root: Path, how: str) -> None:
    """A local user's process named kubelet in sshd.service (or in a kubelet unit but
    from an executable the user controls)."""
    if how == "sshd":
        process(root, 300, "kubelet", ["kubelet", "--config=/home/u/k.yaml"], "sshd.service")
    elif how == "home-exe":
        process(root, 300, "kubelet", ["kubelet"], "kubelet.service", exe="/home/u/kubelet")
    elif how == "writable-exe":
        process(root, 300, "kubelet", ["kubelet"], "kubelet.service")
        (root / "usr/bin/kubelet").chmod(0o777)
    elif how == "writable-dir":
        process(root, 300, "kubelet", ["kubelet"], "kubelet.service", exe="/opt/bin/kubelet")
        (root / "opt/bin").chmod(0o777)
    elif how == "user-owned":
        process(root, 300, "kubelet", ["kubelet"], "kubelet.service")
        os.chown(root / "proc/300", 1000, 1000)
    elif how == "user-exe":
        process(root, 300, "kubelet", ["kubelet"], "kubelet.service")
        os.chown(root / "usr/bin/kubelet", 1000, 1000)


HOW = ["sshd", "home-exe", "writable-exe", "writable-dir"]
HOW += [pytest.param(h, marks=ROOT_ONLY) for h in ("user-owned", "user-exe")]


@pytest.mark.parametrize("how", HOW)
def test_an_untrusted_kubelet_is_a_finding_never_a_job(tmp_path: Path, how: str) -> None:
    root = tmp_path / "node"
    (root / CHECKPOINT).parent.mkdir(parents=True)
    (root / CHECKPOINT).write_bytes(FIXTURE.read_bytes())  # stale: an F1 repair is planned
    hostile(root, how)
    (root / "proc/300/cmdline").write_bytes(b"kubelet\0")
    s = CheckSettings.from_config(
        Config().kubelet, apply=ChangeExecutor(), reason="t", bus_address=""
    )
    s = replace(s, kubelet_unit="", kubelet_units=("kubelet.service",))
    out = io.StringIO()
    log = EventLog(stream=out, level="debug")
    report, actuator = analyse_checkpoint(Root(root), inventory(), s, log)
    assert actuator is not None
    sd = RecordingSystemd()
    report = asyncio.run(coordinate(Root(root), s, report, actuator, log, sd, inventory()))  # type: ignore[arg-type]
    assert all(unit == "kubelet.service" for _verb, unit in sd.jobs), sd.jobs
    assert "sshd.service" not in sd.asked
    kinds = [json.loads(line)["kind"] for line in out.getvalue().splitlines()]
    assert "kubelet-process-untrusted" in kinds
    (finding,) = [f for f in report.findings if f.kind == "kubelet-process-untrusted"]
    assert "pid 300" in finding.summary and finding.fields["PID"] == "300"


def test_the_trusted_kubelets_unit_is_chosen_and_the_hostile_one_reported(tmp_path: Path) -> None:
    root = tmp_path
    process(root, 200, "kubelet", ["kubelet"], "sshd.service")  # lower pid: first before
    process(root, 900, "kubelet", ["/usr/bin/kubelet"], "kubelet.service")
    found = kubelets(Root(root), UNITS)
    assert [p.pid for p in found.trusted] == [900]
    assert [r.process.pid for r in found.refused] == [200]
    assert "not one of [Systemd] KubeletUnits=" in found.refused[0].why
    assert kubelet_unit(Root(root), UNITS)[0] == "kubelet.service"
    # with only the hostile one, the unit is still one of the candidates, never its own
    os.remove(root / "proc/900/comm")
    assert kubelet_unit(Root(root), UNITS) == (
        "kubelet.service",
        "no trusted kubelet process in a systemd service; the first of [Systemd] KubeletUnits=",
    )


@pytest.mark.parametrize(
    ("path", "trusted"),
    [
        ("/usr/bin/kubelet", True),
        ("/var/lib/rancher/rke2/data/v1.30.1-rke2r1-abc/bin/kubelet", True),
        ("/var/lib/rancher/k3s/data/abc/bin/k3s", True),
        ("/var/lib/rancher/k3s/data/a/b/bin/k3s", False),  # `*` is one component
        ("/home/u/kubelet", False),
        ("/tmp/kubelet", False),
        ("/usr/bin/kubelet2", False),
    ],
)
def test_install_paths(path: str, trusted: bool) -> None:
    assert exe_path_trusted(path) is trusted


def test_doctor_reads_no_configuration_from_an_untrusted_kubelet(tmp_path: Path) -> None:
    root = bare_node(tmp_path)
    hostile_config = "/home/u/k.yaml"
    (root / "home/u").mkdir(parents=True)
    (root / "home/u/k.yaml").write_text("cgroupDriver: cgroupfs\n")
    process(root, 300, "kubelet", ["kubelet", f"--config={hostile_config}"], "sshd.service")
    report = doctor(root)
    verdict, evidence, _ = check(report, "kubelet-cgroup-driver")
    assert hostile_config not in evidence and verdict != "ok"
    assert "kubelet (pid 300) in sshd.service ignored" in evidence
    _v, evidence, fix = check(report, "kubelet-dropin")
    assert "sshd.service" not in evidence + fix


def test_a_users_kubelet_starting_is_no_kubelet_restart_for_the_plugin_step(
    tmp_path: Path,
) -> None:
    """F4 judges a plugin unregistered when its socket predates kubelet's latest start:
    a user's process named kubelet, started after the socket, would get every plugin
    restarted once the grace period is over."""
    from gpuguard.steps.device_plugin.observe import kubelet_started

    root = tmp_path
    sockets = root / "var/lib/kubelet/device-plugins"
    sockets.mkdir(parents=True)
    (sockets / "kubelet.sock").write_text("")
    made = (sockets / "kubelet.sock").stat().st_ctime
    (root / "proc").mkdir(exist_ok=True)
    (root / "proc/stat").write_text(f"btime {int(made)}\n")
    ticks = os.sysconf("SC_CLK_TCK") * 3600  # an hour after the socket was made
    for pid, unit in ((300, "sshd.service"), (900, "kubelet.service")):
        process(root, pid, "kubelet", ["kubelet"], unit)
        fields = ["S"] + ["0"] * 18 + [str(ticks)] + ["0"] * 10
        (root / f"proc/{pid}/stat").write_text(f"{pid} (kubelet) {' '.join(fields)}\n")
    os.remove(root / "proc/900/comm")  # the trusted one not running: only the user's
    sock = "/var/lib/kubelet/device-plugins"
    assert kubelet_started(Root(root), sock, units=UNITS) == pytest.approx(made)
    (root / "proc/900/comm").write_text("kubelet\n")  # a trusted kubelet that started
    assert kubelet_started(Root(root), sock, units=UNITS) == pytest.approx(int(made) + 3600)
