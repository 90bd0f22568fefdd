"""NvmlProbe: the pure assessment of NVML results, the probe's child on this process,
and the step's wiring (NvmlProbe=no runs no probe; a failure is a restart decision)."""

from __future__ import annotations

import asyncio
import dataclasses
import io
import json
import os
import subprocess
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
from gpuguard.steps.device_plugin import DevicePluginStep, nvml_probe
from gpuguard.steps.device_plugin.actuate import PluginRestarter, RestartResult, Verification
from gpuguard.steps.device_plugin.nvml_probe import (
    NVML_LIBRARY,
    NvmlResult,
    library_candidates,
    plugin_cgroup_dirs,
    probe_nvml,
)
from gpuguard.steps.device_plugin.observe import PluginObservation
from gpuguard.steps.device_plugin.reconcile import (
    CAUSE_NVML,
    CAUSE_STALE,
    K_MISSING_DEVICE,
    K_NVML_FAILED,
    K_NVML_UNCHECKED,
    RestartPlugin,
    assess,
)

T0 = 1_700_000_000.0
CID = "c" * 64
GPU = "nvidia.com/gpu"
HOST = (
    NodeInfo("/dev/nvidia0", 195, 0, ROLE_OTHER, ctime=T0 - 100),
    NodeInfo("/dev/nvidiactl", 195, 255, ROLE_OTHER, ctime=T0 - 100),
    NodeInfo("/dev/nvidia-uvm", 510, 0, ROLE_OTHER, ctime=T0 - 100),
)

OK = NvmlResult(True, 0, "nvmlInit succeeded", "ok", "/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1")
UNKNOWN = NvmlResult(False, 999, "Unknown Error", "init", "/usr/lib64/libnvidia-ml.so.1")
NO_LIB = NvmlResult(False, None, f"cannot load {NVML_LIBRARY} in the plugin's filesystem", "load")
NO_NS = NvmlResult(
    False,
    None,
    "cannot enter the plugin's mount namespace: Operation not permitted (errno 1); "
    "gpuguard.service needs CAP_SYS_CHROOT for NvmlProbe=yes",
    "namespace",
)
TIMEOUT = NvmlResult(False, None, "the NVML probe timed out after 10s", "timeout")


def proc(pid: int = 4242, start: float = T0) -> ProcessInfo:
    return ProcessInfo(pid, start, "nvidia-device-plugin", "container", CID, "containerd", "p-1")


def plugin(
    name: str = "nvidia-gpu.sock", dev: tuple[NodeInfo, ...] = HOST, pid: int = 4242
) -> PluginInfo:
    res = "nvidia.com/" + name[len("nvidia-") : -len(".sock")]
    return PluginInfo(f"/var/lib/kubelet/device-plugins/{name}", res, T0, proc(pid), dev)


def observation(*plugins: PluginInfo, host: tuple[NodeInfo, ...] = HOST) -> PluginObservation:
    return PluginObservation(T0 + 600, host, tuple(plugins), None)


# -- assess() ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("result", "kinds", "causes", "healthy"),
    [
        (None, [], [], [GPU]),  # NvmlProbe=no, or the plugin was not probed
        (OK, [], [], [GPU]),
        (UNKNOWN, [K_NVML_FAILED], [CAUSE_NVML], []),
        (NO_LIB, [K_NVML_FAILED], [CAUSE_NVML], []),
        # the probe could not run: a warning, never a verdict on the plugin
        (NO_NS, [K_NVML_UNCHECKED], [], [GPU]),
        (TIMEOUT, [K_NVML_UNCHECKED], [], [GPU]),
    ],
)
def test_assess_nvml_results(
    result: Optional[NvmlResult], kinds: list[str], causes: list[str], healthy: list[str]
) -> None:
    nvml = {} if result is None else {GPU: result}
    r = assess(observation(plugin()), registration_grace=120, nvml=nvml)
    assert [f.kind for f in r.findings] == kinds
    assert [a.cause for a in r.actions] == causes
    assert list(r.healthy) == healthy


def test_failed_nvml_finding_and_restart_fields() -> None:
    r = assess(observation(plugin()), registration_grace=120, nvml={GPU: UNKNOWN})
    (f,) = r.findings
    assert f.severity == "error"
    assert f.fields["PLUGIN"] == GPU and f.fields["PLUGIN_PID"] == "4242"
    assert f.fields["NVML_ERROR"] == "Unknown Error" and f.fields["NVML_CODE"] == "999"
    assert f.fields["CONTAINER_ID"] == CID
    assert "Failed to initialize NVML: Unknown Error" in f.summary
    (a,) = r.actions
    assert a.identity == GPU and a.process.pid == 4242
    assert a.fields()["CAUSE"] == CAUSE_NVML
    assert "Unknown Error" in a.reason


def test_unloadable_library_names_it() -> None:
    r = assess(observation(plugin()), registration_grace=120, nvml={GPU: NO_LIB})
    (f,) = r.findings
    assert NVML_LIBRARY in f.fields["NVML_ERROR"] and "NVML_CODE" not in f.fields


def test_unchecked_is_a_warning_with_the_stage() -> None:
    r = assess(observation(plugin()), registration_grace=120, nvml={GPU: NO_NS})
    (f,) = r.findings
    assert f.severity == "warning" and f.fields["NVML_STAGE"] == "namespace"
    assert "CAP_SYS_CHROOT" in f.summary and r.actions == ()


def test_stale_view_keeps_its_cause_and_nvml_is_reported_too() -> None:
    stale = plugin(dev=HOST[:2])
    r = assess(observation(stale), registration_grace=120, nvml={GPU: UNKNOWN})
    assert sorted(f.kind for f in r.findings) == sorted([K_NVML_FAILED, K_MISSING_DEVICE])
    (a,) = r.actions
    assert a.cause == CAUSE_STALE


def test_no_driver_no_verdict() -> None:
    r = assess(observation(plugin(), host=()), registration_grace=120, nvml={GPU: UNKNOWN})
    assert r.findings == () and r.actions == ()


def test_results_apply_by_identity_only() -> None:
    a, b = plugin("nvidia-gpu.sock"), plugin("nvidia-mig-1g.10gb.sock", pid=4343)
    r = assess(observation(a, b), registration_grace=120, nvml={"nvidia.com/mig-1g.10gb": UNKNOWN})
    assert [x.identity for x in r.actions] == ["nvidia.com/mig-1g.10gb"]
    assert r.healthy == (GPU,)


# -- the probe itself ------------------------------------------------------------------


def _children() -> list[str]:
    try:
        text = Path(f"/proc/self/task/{os.getpid()}/children").read_text()
    except OSError:
        return []
    return text.split()


def test_probe_of_a_process_without_the_library() -> None:
    if any(Path(d, NVML_LIBRARY).exists() for d in nvml_probe.LIBRARY_DIRS):
        pytest.skip(f"{NVML_LIBRARY} is installed here")
    # a process of its own: this one may have mapped the tests' fake driver library
    plugin = subprocess.Popen(["sleep", "60"])
    try:
        before = _children()
        r = probe_nvml(plugin.pid, [], timeout=20)
        assert _children() == before  # reaped
    finally:
        plugin.kill()
        plugin.wait()
    assert r.ok is False and r.code is None and r.stage == "load" and r.failed
    assert NVML_LIBRARY in r.detail and "plugin's filesystem" in r.detail


def test_probe_that_cannot_join_the_cgroup_is_inconclusive(tmp_path: Path) -> None:
    r = probe_nvml(os.getpid(), [tmp_path / "no-such-cgroup"], timeout=20)
    assert r.stage == "cgroup" and not r.ok and not r.conclusive and not r.failed
    assert "no-such-cgroup" in r.detail


def test_probe_with_a_fifo_for_cgroup_procs_is_refused_at_once_and_reaped(
    tmp_path: Path,
) -> None:
    os.mkfifo(tmp_path / "cgroup.procs")  # opening it for writing would block forever
    before = _children()
    r = probe_nvml(os.getpid(), [tmp_path], timeout=30)
    assert r.stage == "cgroup" and not r.conclusive and "cgroup.procs" in r.detail
    assert _children() == before


def test_library_candidates_maps_then_ld_library_path_then_usual_dirs(tmp_path: Path) -> None:
    p = tmp_path / "proc/77"
    p.mkdir(parents=True)
    (p / "maps").write_text(
        "7f00-7f01 r-xp 00000000 08:01 12 /usr/lib64/libnvidia-ml.so.550.54.15\n"
        "7f01-7f02 r--p 00000000 08:01 12 /usr/lib64/libnvidia-ml.so.550.54.15\n"
        "7f02-7f03 r-xp 00000000 08:01 13 /usr/lib64/libc.so.6\n"
        "7f03-7f04 r-xp 00000000 08:01 14 /old/libnvidia-ml.so.1 (deleted)\n"
    )
    (p / "environ").write_bytes(b"PATH=/bin\0LD_LIBRARY_PATH=/usr/local/nvidia/lib64:rel:/opt/x\0")
    c = library_candidates(Root(tmp_path), 77)
    assert c[:3] == [
        "/usr/lib64/libnvidia-ml.so.550.54.15",
        "/usr/local/nvidia/lib64/libnvidia-ml.so.1",
        "/opt/x/libnvidia-ml.so.1",
    ]
    assert f"/usr/lib/{nvml_probe._ARCH}/{NVML_LIBRARY}" in c
    assert len(c) == len(set(c))


def test_plugin_cgroup_dirs_v1_devices_and_v2(tmp_path: Path) -> None:
    (tmp_path / "proc/88").mkdir(parents=True)
    (tmp_path / "proc/88/cgroup").write_text(
        "12:devices:/kubepods/besteffort/podx/abc\n"
        "5:memory:/kubepods/besteffort/podx/abc\n"
        "0::/kubepods/besteffort/podx/abc\n"
    )
    v1 = tmp_path / "sys/fs/cgroup/devices/kubepods/besteffort/podx/abc"
    v2 = tmp_path / "sys/fs/cgroup/unified/kubepods/besteffort/podx/abc"
    v1.mkdir(parents=True)
    v2.mkdir(parents=True)
    (tmp_path / "sys/fs/cgroup/devices/devices.list").write_text("a *:* rwm\n")
    (tmp_path / "sys/fs/cgroup/unified/cgroup.controllers").write_text("")
    assert plugin_cgroup_dirs(Root(tmp_path), 88) == [v1, v2]
    assert plugin_cgroup_dirs(Root(tmp_path), 99) == []


# -- the step's wiring -------------------------------------------------------------------


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
    def __init__(self) -> None:
        super().__init__(stopper=ContainerStopper(ctr="/nonexistent", crictl="/nonexistent"))
        self.calls: list[RestartPlugin] = []

    async def restart(self, root: Root, action: RestartPlugin, systemd: Any) -> RestartResult:
        self.calls.append(action)
        return RestartResult(True, "ctr", "fake")


class Step(DevicePluginStep):
    """Two sockets served by one process, with a complete /dev."""

    def __init__(self, restarter: FakeRestarter) -> None:
        super().__init__(restarter=restarter, clock=lambda: T0 + 1000, verify_timeout=1)

    def observe(
        self, root: Root, cfg: DevicePluginConfig, unit_started: Any, snapshot: Any = None
    ) -> PluginObservation:
        return observation(plugin("nvidia-gpu.sock"), plugin("nvidia-gpu.shared.sock"))


@pytest.fixture
def probes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []

    def fake_probe(pid: int, dirs: Any, **kw: Any) -> NvmlResult:
        calls.append(pid)
        return UNKNOWN

    async def fake_verify(
        root: Root, sd: str, ident: str, old: ProcessInfo, *a: Any, **k: Any
    ) -> Verification:
        new = dataclasses.replace(old, pid=old.pid + 1, start=old.start + 5)
        return Verification("recovered", PluginInfo("/x", ident, 0, new, HOST), (), 0.1)

    monkeypatch.setattr(nvml_probe, "probe_nvml", fake_probe)
    monkeypatch.setattr(nvml_probe, "plugin_cgroup_dirs", lambda root, pid: [])
    monkeypatch.setattr(step_mod, "verify", fake_verify)
    return calls


def run(tmp_path: Path, **dp: Any) -> tuple[Ctx, FakeRestarter, list[dict[str, Any]]]:
    cfg = Config(device_plugin=dataclasses.replace(DevicePluginConfig(), **dp))
    out = io.StringIO()
    svc = OneShotServices(
        Root(tmp_path),
        cfg,
        EventLog(stream=out, level="debug"),
        apply=ChangeExecutor(dry_run=False),
        bus_address="",
    )
    r = FakeRestarter()
    ctx = Ctx()
    asyncio.run(Step(r)(svc, ctx))  # type: ignore[arg-type]
    return ctx, r, [json.loads(line) for line in out.getvalue().splitlines()]


def test_nvml_probe_off_runs_no_probe(tmp_path: Path, probes: list[int]) -> None:
    assert DevicePluginConfig().nvml_probe is False  # the default
    ctx, r, _journal = run(tmp_path)
    assert probes == [] and ctx.findings == [] and r.calls == []


def test_nvml_failure_is_a_restart_decision(tmp_path: Path, probes: list[int]) -> None:
    ctx, r, journal = run(tmp_path, nvml_probe=True, cool_down=0.0)
    assert probes == [4242]  # one probe per process, not per socket
    assert [f.kind for f in ctx.findings] == [K_NVML_FAILED, K_NVML_FAILED]
    assert [a.cause for a in r.calls] == [CAUSE_NVML, CAUSE_NVML]
    restarted = [e for e in journal if e["kind"] == "plugin-restarted"]
    assert restarted and restarted[0]["CAUSE"] == CAUSE_NVML


def test_nvml_failure_respects_the_cool_down(tmp_path: Path, probes: list[int]) -> None:
    ctx, r, journal = run(tmp_path, nvml_probe=True, cool_down=3600.0)
    assert r.calls == [] and {o.status for o in ctx.outcomes} == {"declined"}
    declined = [e for e in journal if e["kind"] == "plugin-restart-declined"]
    assert {e["REASON"] for e in declined} == {"cool-down"}
    assert {e["CAUSE"] for e in declined} == {CAUSE_NVML}
