"""Each catalog entry that shows a field (@FIELD@) gets it from every way it is emitted.

`journalctl -x` fills @FIELD@ from the entry; a field the entry lacks is shown as the
literal "@FIELD@". Here each such kind is produced by its real emitter (the reconciler's
finding builder plus EventLog, the actuator, the daemon's pass) and the entry is checked.
The last test makes sure no kind that shows fields is left without a case here; besides,
tests/conftest.py checks every entry any test makes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import io
import json
import time
from pathlib import Path
from typing import Any, Callable

import pytest

from catalog_fields import shown
from gpuguard.config import load_config
from gpuguard.engine.daemon import Daemon
from gpuguard.engine.passes import PassContext, Work
from gpuguard.host.notify import Notifier
from gpuguard.host.paths import Root
from gpuguard.journal.catalog import KINDS
from gpuguard.journal.conditions import Conditions, log_findings
from gpuguard.journal.log import EventLog
from gpuguard.model import Finding
from gpuguard.readmit.state import ReadmitState, RejectedPod
from gpuguard.steps.checkpoint.actuate import CheckpointActuator
from gpuguard.steps.checkpoint.reconcile import DeleteCheckpoint, RewriteCheckpoint, sha256
from gpuguard.steps.device_plugin.podresources import Allocatable
from gpuguard.steps.device_plugin.reconcile import assess
from gpuguard.steps.readmit.exposure import judge_exposure
from gpuguard.steps.readmit.reconcile import ReadmitView, judge
from unit.test_container_findings import ALL_ALLOWED, OLD_UVM, _audit, _ent
from unit.test_devices_audit import CTL, GPU0, RUNC_LIST
from unit.test_plugins_nvml import GPU, NO_NS, UNKNOWN, observation, plugin
from unit.test_readmit_api import allocate_entries, readmit_api_entries, withdrawal_entries
from unit.test_readmit_fates import fate_entries

Entries = list[dict[str, Any]]


def logged(emit: Callable[[EventLog], None]) -> Entries:
    out = io.StringIO()
    emit(EventLog(stream=out, level="debug"))
    return [json.loads(line) for line in out.getvalue().splitlines()]


def findings(fs: tuple[Finding, ...]) -> Entries:
    return logged(lambda log: [log.finding(f) for f in fs])


def container_findings() -> Entries:
    denied, _ = _audit(_ent((GPU0, CTL)), RUNC_LIST)
    absent_and_stale, _ = _audit(_ent((GPU0, CTL, OLD_UVM)), ALL_ALLOWED)
    return findings(denied + absent_and_stale)


def plugin_findings() -> Entries:
    out = []
    for nvml in ({GPU: UNKNOWN}, {GPU: NO_NS}):
        stale = plugin(dev=())  # sees none of the host's nodes
        out += findings(assess(observation(stale), registration_grace=120, nvml=nvml).findings)
    # kubelet dropped the plugin (0 allocatable), and kubelet that cannot be asked
    sock = "/var/lib/kubelet/pod-resources/kubelet.sock"
    for alloc in (Allocatable(sock), Allocatable(sock, unchecked="no podresources socket")):
        o = observation(plugin())
        o = dataclasses.replace(o, kubelet_started=o.now - 610, gpus=1, allocatable=alloc)
        out += findings(assess(o, registration_grace=120).findings)
    return out


def readmit_findings() -> Entries:
    pod = RejectedPod("uid-1", "ml/train-0", "UnexpectedAdmissionError", "Allocate failed", 2.0)
    state = ReadmitState("131:1", 1.0, "observe", "1 of 1", rejected=(pod,))
    view = ReadmitView(state, "", alive=frozenset(), present=frozenset({"uid-1"}))
    off = ReadmitState("", 0.0, "off", "GPUGUARD_READMIT=off", off_cause="env-off")
    return findings(judge(view, frozenset()).findings + judge_exposure(off, False, "")[0])


def readmit_offers(tmp: Path) -> Entries:
    """The bridge at a kubelet start: offered (with its evidence and refusals)."""
    from gpuguard.checkpoint.codec import marshal
    from gpuguard.checkpoint.model import Checkpoint, PodDevicesEntry
    from gpuguard.config import load_config
    from gpuguard.host.paths import Root
    from gpuguard.readmit import Inputs, Readmit
    from unit.test_readmit import FakeBridge

    root = tmp / "readmit"
    plugins = root / "var/lib/kubelet/device-plugins"
    plugins.mkdir(parents=True)
    rows = [PodDevicesEntry(u, "main", "nvidia.com/gpu", ((0, (i,)),), b"") for u, i in
            (("pod-a", "GPU-a"), ("pod-b", "GPU-gone"))]  # fmt: skip
    (plugins / "kubelet_internal_checkpoint").write_bytes(
        marshal(Checkpoint("v2", tuple(rows), {}, 0))
    )

    def emit(log: EventLog) -> None:
        cfg = load_config(Root(root))
        inputs = Inputs(cfg, frozenset({"GPU-a"}), "")
        Readmit(Root(root), log, lambda: inputs, FakeBridge()).on_kubelet_start()  # type: ignore[arg-type]

    return logged(emit)


def bridge_ended() -> Entries:
    from gpuguard.readmit.ended import say_ended

    return logged(lambda log: [say_ended(log, ("nvidia.com/gpu",), h) for h in ("stop", "gone")])


def checkpoint_changes(tmp: Path) -> Entries:
    def emit(log: EventLog) -> None:
        act = CheckpointActuator(tmp / "backups", 5, log)
        for cls in (RewriteCheckpoint, DeleteCheckpoint):
            path = tmp / "kubelet_internal_checkpoint"
            path.write_bytes(b"{}")
            extra: dict[str, Any] = {"content": b"{ }"} if cls is RewriteCheckpoint else {}
            a = cls("checkpoint", "stale GPU IDs", str(path), path=path,
                    expected_sha256=sha256(b"{}"), **extra)  # fmt: skip
            assert act.apply(a).status == "done"

    return logged(emit)


def remap_changes(tmp: Path) -> Entries:
    """The remap's findings and per-entry entries, and the history's, through `gpuguard
    check` on a fake node whose GPUs come back with new UUIDs, one of them gone."""
    import contextlib

    from gpuguard import cli
    from unit.test_checkpoint_remap_cli import NEW, OLD, check_argv, make_root, set_gpus

    out = io.StringIO()
    orig = EventLog.auto
    EventLog.auto = classmethod(lambda cls, **kw: cls(level="debug", stream=out))  # type: ignore[method-assign,assignment]
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            root = make_root(tmp / "remap")
            for uuids in (OLD, [NEW[0], NEW[2]]):
                set_gpus(root, uuids)
                cli.main([*check_argv(root), "--dry-run"])  # the findings
                cli.main(check_argv(root))  # the changes, and the history recorded
            (root / "var/lib/gpuguard/gpu-identity.json").write_text("{")
            set_gpus(root, OLD)
            cli.main(check_argv(root))  # an unusable history: dropped as before
    finally:
        EventLog.auto = orig  # type: ignore[method-assign]
    return [json.loads(line) for line in out.getvalue().splitlines()]


def daemon_pass(tmp: Path) -> Entries:
    async def boom(svc: Any, ctx: PassContext) -> None:
        raise RuntimeError("unexpected host state")

    def emit(log: EventLog) -> None:
        root = Root(tmp / "root")
        d = Daemon(root=root, config=load_config(root), config_path=None, log=log,
                   notifier=Notifier(""), inventory_path=tmp / "none.json",
                   bus_address="unix:path=/nonexistent", steps={"boom": boom},
                   step_order=("boom",))  # fmt: skip
        now = time.monotonic()
        asyncio.run(d._run_pass(Work(frozenset({"boom"}), ("test",), now, now)))
        asyncio.run(d.inventory_reader.read())  # unavailable
        (tmp / "none.json").write_text('{"gpus": []}')
        asyncio.run(d.inventory_reader.read())  # available again
        d.inventory_reader._state(None, "/usr/lib64/libnvidia-ml.so.1 (the host's loader path)")

    return logged(emit)


def repair_loop(tmp: Path) -> Entries:
    """pass-backoff: two passes in a row that change something and find the same."""
    from gpuguard.model import Outcome
    from gpuguard.steps.container_access.reconcile import UnitDeviceAllow

    async def same(svc: Any, ctx: PassContext) -> None:
        ctx.findings.append(Finding("container-device-denied", "same", "still denied"))
        ctx.outcomes.append(Outcome(UnitDeviceAllow("same", "again", "x.scope"), "done", "set"))

    def emit(log: EventLog) -> None:
        root = Root(tmp / "loop")
        d = Daemon(root=root, config=load_config(root), config_path=None, log=log,
                   notifier=Notifier(""), inventory_path=tmp / "none.json",
                   bus_address="unix:path=/nonexistent", steps={"same": same},
                   step_order=("same",))  # fmt: skip
        now = time.monotonic()
        for _ in range(2):
            asyncio.run(d._run_pass(Work(frozenset({"same"}), ("test",), now, now)))

    return logged(emit)


def strays() -> Entries:
    from gpuguard.steps.container_access.reconcile import stray_findings

    cg = "/sys/fs/cgroup/kubepods.slice/kubepods-pod1.slice/other-1.scope"
    return findings(stray_findings(((cg, (42, 43), ("/dev/nvidia0", "/dev/nvidiactl")),)))


def conditions() -> Entries:
    def emit(log: EventLog) -> None:
        c = Conditions()
        fs, _ = _audit(_ent((GPU0, CTL)), ALL_ALLOWED)
        log_findings(log, c, "container_access", fs)
        log_findings(log, c, "container_access", [])

    return logged(emit)


def inplace_held_back() -> Entries:
    """container-program-unexpected / -repair-backoff: the in-place repair's checks."""
    from gpuguard.steps.container_access.inplace import Backoff, hold_back
    from gpuguard.steps.container_access.reconcile import V2ProgramReplace

    a = V2ProgramReplace("container_access", "lost", "/cg", cgroup_dir="/cg", container_id="c")
    b = Backoff()
    b.record("/cg", (7,), False, "frozen", 0.0)
    return findings(
        hold_back([a], {"c": (7, 8)}, {}, 0.0)[1] + hold_back([a], {"c": (7,)}, b.failures, 1.0)[1]
    )


def gpu_count() -> Entries:
    from gpuguard.steps.gpu_count.reconcile import GpuCounts
    from gpuguard.steps.gpu_count.reconcile import findings as count_findings

    return findings(tuple(count_findings(GpuCounts(pci=4, nvml=3, registered=3))))


def plugin_restarts() -> Entries:
    """plugin-restarted / -declined come from DevicePluginStep._journal: the same fields
    as the step passes them (the action's, plus METHOD or REASON)."""
    from gpuguard.steps.device_plugin import DevicePluginStep

    (a,) = assess(observation(plugin(dev=())), registration_grace=120).actions

    def emit(log: EventLog) -> None:
        step = DevicePluginStep()
        step._journal(log, "plugin-restarted", a, "restarted", "notice", METHOD="ctr")
        step._journal(log, "plugin-restart-declined", a, "not", "info", REASON="budget")

    return logged(emit)


def unit_jobs() -> Entries:
    """unit-job-failed comes from the unit-job actuator, for every caller's job."""
    from gpuguard.actuate.units import UnitJob, UnitJobs
    from unit.test_unit_jobs import FakeSystemd

    def emit(log: EventLog) -> None:
        for sd in (FakeSystemd("failed"), FakeSystemd(error="bus gone")):
            jobs = UnitJobs(sd, log)  # type: ignore[arg-type]
            asyncio.run(jobs.run(UnitJob("restart", "kubelet.service", "now", "kubelet-restart")))

    return logged(emit)


def untrusted_kubelet() -> Entries:
    from gpuguard.devices.kubeletproc import KubeletProcess
    from gpuguard.devices.kubelettrust import Refused

    p = KubeletProcess(4242, "kubelet", ("kubelet",), "sshd.service")
    return findings((Refused(p, "it runs as uid 1000, not root").finding("checkpoint"),))


@pytest.fixture(scope="module")
def entries(tmp_path_factory: pytest.TempPathFactory) -> Entries:
    tmp = tmp_path_factory.mktemp("emitters")
    return (
        container_findings()
        + plugin_findings()
        + readmit_findings()
        + readmit_offers(tmp)
        + bridge_ended()
        + checkpoint_changes(tmp)
        + remap_changes(tmp)
        + daemon_pass(tmp)
        + repair_loop(tmp)
        + strays()
        + conditions()
        + plugin_restarts()
        + unit_jobs()
        + gpu_count()
        + inplace_held_back()
        + untrusted_kubelet()
        + readmit_api_entries(tmp / "readmit")
        + withdrawal_entries()
        + allocate_entries()
        + fate_entries()
    )


SHOWING = sorted(k for k in KINDS if shown(k))


@pytest.mark.parametrize("kind", SHOWING)
def test_every_entry_carries_the_fields_its_catalog_shows(entries: Entries, kind: str) -> None:
    mine = [e for e in entries if e["kind"] == kind]
    assert mine, f"no case here emits {kind}: add one"
    for e in mine:
        carried = {k.upper() for k in e}  # JSON lines: "traceback" is TRACEBACK
        assert shown(kind) <= carried, (kind, sorted(shown(kind) - carried), e)
