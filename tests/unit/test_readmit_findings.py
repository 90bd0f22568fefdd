"""The GPU pods kubelet rejects, named: the re-admission bridge's state file
(readmit/state.py: what it records, from which threads), kubelet's first admission in
its journal (readmit/rejected.py), the readmit step's judgement and clearing
(steps/readmit/), its metrics, and the device plugin step's rule for a plugin that
registered before the bridge (steps/device_plugin/reconcile.py). On a real kubelet
1.34: tests/integration/test_kubelet_readmit.py."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from gpuguard.actuate.statefile import write_state
from gpuguard.host.paths import Root
from gpuguard.host.statefile import load
from gpuguard.readmit.klog import Line
from gpuguard.readmit.rejected import first_admission, klog_unix
from gpuguard.readmit.state import (
    MAX_REJECTED,
    SPEC,
    STATE_FILE,
    ReadmitState,
    Recorder,
    Registration,
    RejectedPod,
)
from gpuguard.reporting.metrics_state import MetricsState
from gpuguard.steps.device_plugin.reconcile import CAUSE_UNREGISTERED, K_NOT_REGISTERED, assess
from gpuguard.steps.readmit.observe import observe
from gpuguard.steps.readmit.reconcile import K_REJECTED, ReadmitView, judge
from unit.test_plugins_health import HOST, T0, obs, plugin

UID_A = "5be161ab-85e5-5281-8e74-7c9c806b281d"
UID_B = "0f3c0a52-1b1e-4f5e-9d55-2b1a9c0c7d11"
MSG = "Allocate failed due to no healthy devices present; cannot allocate unhealthy devices"


def rejected(uid: str, pod: str) -> RejectedPod:
    return RejectedPod(uid, pod, "UnexpectedAdmissionError", MSG, 1764342380.0)


def state(*pods: RejectedPod, **kw: Any) -> ReadmitState:
    base = ReadmitState("131:1764342378000000000", 1764342378.0, "observe", "2 of 2", rejected=pods)
    return dataclasses.replace(base, **kw)


# -- the bridge's record -------------------------------------------------------------


def test_the_recorder_writes_each_change_and_keeps_an_early_stream() -> None:
    written: list[ReadmitState] = []
    rec = Recorder(written.append)
    rec.rejected(rejected(UID_A, "default/a"))  # before any kubelet start: nothing
    assert written == []
    rec.kubelet_started("131:5", 100.0, 225.0)
    rec.decided("offered", "2 of 2 GPU pods have no running process")
    rec.healthy("nvidia.com/gpu", 100.030)  # kubelet's ListAndWatch before Register returned
    rec.registered("nvidia.com/gpu", ("GPU-a", "GPU-b"), 100.031)
    rec.admitted(100.080)
    rec.raced(("nvidia-gpu.sock",))
    rec.rejected(rejected(UID_A, "default/a"))
    rec.rejected(rejected(UID_A, "default/a"))  # once per pod
    s = written[-1]
    assert s.registrations == (
        Registration("nvidia.com/gpu", 100.031, ("GPU-a", "GPU-b"), 100.030),
    )
    assert s.margin == pytest.approx(0.050) and s.registered_at == 100.031
    assert s.raced == ("nvidia-gpu.sock",) and [p.pod for p in s.rejected] == ["default/a"]
    assert s.decision == "offered" and s.watch_until == 225.0
    rec.kubelet_started("131:6", 300.0, 425.0)  # a new kubelet run starts a new list
    assert written[-1].rejected == () and written[-1].registrations == ()
    assert written[-1].margin is None


def test_the_recorder_keeps_the_newest_rejections_and_never_fails_the_bridge() -> None:
    def refuse(_s: ReadmitState) -> None:
        raise OSError("read-only file system")

    rec = Recorder(refuse)
    rec.kubelet_started("1:1", 1.0, 2.0)  # the write fails: the bridge goes on
    for i in range(MAX_REJECTED + 5):
        rec.rejected(rejected(f"uid-{i}", f"default/p{i}"))
    assert rec.state is not None and len(rec.state.rejected) == MAX_REJECTED
    assert rec.state.rejected[-1].pod_uid == f"uid-{MAX_REJECTED + 4}"


def test_the_state_file_reads_back(tmp_path: Path) -> None:
    s = state(rejected(UID_A, "default/a"), first_admission=1764342378.19)
    path = Root(tmp_path).path(STATE_FILE)
    write_state(path, SPEC, s)
    assert load(path, SPEC).value == s
    path.write_text('{"version": 1, "kubelet_sock": 5}')
    got = load(path, SPEC)
    assert got.value is None and "kubelet_sock: not a string" in got.why


# -- kubelet's first admission, from its journal ---------------------------------------


@pytest.mark.parametrize("tz_hours", [0, 1, -5, 5.5, 13, -11])
def test_a_klog_time_in_any_time_zone_is_read_as_unix_time(tz_hours: float) -> None:
    at = 1764342378.123456  # 2025-11-28 15:06:18.123456 UTC
    local = at + tz_hours * 3600
    sod = local % 86400
    h, m, s = int(sod // 3600), int(sod % 3600 // 60), sod % 60
    assert klog_unix(at + 0.004, h, m, s) == pytest.approx(at, abs=1e-6)  # received 4 ms later


def test_the_first_syncloop_add_is_kubelets_first_admission() -> None:
    # kubelet's journal entries (MESSAGE, and when journald received each)
    log = (
        Line(
            'I1128 15:06:18.040000     757 server.go:1] "Starting device plugin registration '
            'server"',
            1764342378.1,
        ),
        Line(
            'I1128 15:06:18.123456     757 kubelet.go:2] "SyncLoop ADD" source="file" '
            'pods=["default/gpu-a-gpunode"]',
            1764342378.13,
        ),
        Line(
            'I1128 15:06:18.190000     757 kubelet.go:2] "SyncLoop ADD" source="api" pods=[]',
            1764342378.2,
        ),
    )
    assert first_admission(log, 757) == pytest.approx(1764342378.123456)
    assert first_admission(log[:1], 757) is None


# -- the readmit step: named until it runs again or is gone ---------------------------


def test_each_rejected_pod_is_a_finding_until_it_runs_again_or_is_gone() -> None:
    s = state(rejected(UID_A, "default/gpu-a"), rejected(UID_B, "default/gpu-b"))
    both = frozenset({UID_A, UID_B})
    j = judge(ReadmitView(s, "", frozenset(), both), frozenset())
    assert [f.kind for f in j.findings] == [K_REJECTED, K_REJECTED] and j.rejected == 2
    f = j.findings[0]
    assert (f.fields["POD"], f.fields["POD_UID"], f.severity) == ("default/gpu-a", UID_A, "error")
    assert f.fields["REASON"] == "UnexpectedAdmissionError" and MSG in f.summary
    # gpu-a runs again, gpu-b was deleted (its pod directory gone)
    j = judge(ReadmitView(s, "", frozenset({UID_A}), frozenset({UID_A})), frozenset())
    assert j.findings == () and j.cleared == both and j.rejected == 0
    # gpu-a's containers ended later: still cleared for this kubelet run
    j2 = judge(ReadmitView(s, "", frozenset(), both), j.cleared)
    assert j2.findings == () and j2.cleared == both


def test_no_pod_is_taken_as_gone_when_kubelets_pods_directory_is_not_there() -> None:
    s = state(rejected(UID_A, "default/gpu-a"))
    j = judge(ReadmitView(s, "", frozenset(), frozenset(), pods_seen=False), frozenset())
    assert [f.fields["POD_UID"] for f in j.findings] == [UID_A]


def test_no_state_is_no_finding_and_the_margin_is_reported() -> None:
    assert judge(ReadmitView(None, "", frozenset(), frozenset()), frozenset()).findings == ()
    regs = (Registration("nvidia.com/gpu", 10.02, ("GPU-a",), 10.03),)
    s = state(registrations=regs, first_admission=10.10)
    ((resource, margin),) = judge(ReadmitView(s, "", frozenset(), frozenset()), frozenset()).margins
    assert resource == "nvidia.com/gpu" and margin == pytest.approx(0.07)


def test_the_step_observes_the_state_file_and_the_pod_directories(tmp_path: Path) -> None:
    root = Root(tmp_path)
    ckpt = "/var/lib/kubelet/device-plugins/kubelet_internal_checkpoint"
    view = observe(root, ckpt)
    assert view.state is None and view.unreadable == ""  # no bridge: nothing to say
    write_state(root.path(STATE_FILE), SPEC, state(rejected(UID_A, "default/gpu-a")))
    (tmp_path / "var/lib/kubelet/pods" / UID_A).mkdir(parents=True)
    view = observe(root, ckpt)
    assert view.present == {UID_A} and view.alive == frozenset() and view.pods_seen
    assert len(judge(view, frozenset()).findings) == 1
    (tmp_path / "var/lib/kubelet/pods" / UID_A).rmdir()
    assert judge(observe(root, ckpt), frozenset()).findings == ()
    root.path(STATE_FILE).write_text("{")
    view = observe(root, ckpt)
    assert view.state is None and "not JSON" in view.unreadable


# -- metrics -------------------------------------------------------------------------


def test_the_margin_gauge_is_absent_until_known() -> None:
    m = MetricsState(clock=lambda: 1.0)
    fams = m.to_values().families
    assert fams["gpuguard_readmit_margin_seconds"] == ()
    assert [s.value for s in fams["gpuguard_readmit_rejected_pods"]] == [0.0]


# -- the device plugin step: a plugin that registered before the bridge ---------------


@pytest.mark.parametrize(
    "sock_ctime, bridge, restarted",
    [
        (T0 + 10.020, T0 + 10.030, True),  # its socket predates the bridge's registration
        (T0 + 10.040, T0 + 10.030, False),  # it registered after the bridge: it serves
        (T0 + 10.020, None, False),  # no bridge in this kubelet run
    ],
)
def test_a_plugin_older_than_the_bridges_registration_registers_again(
    sock_ctime: float, bridge: float | None, restarted: bool
) -> None:
    o = obs(
        plugin(HOST, ctime=sock_ctime),
        kubelet_started=T0 + 10.0,
        bridge_registered=bridge,
        now=T0 + 200,
    )
    r = assess(o, registration_grace=120)
    assert (K_NOT_REGISTERED in [f.kind for f in r.findings]) == restarted
    assert [a.cause for a in r.actions] == ([CAUSE_UNREGISTERED] if restarted else [])
    if restarted:
        assert (
            "predates the registration of gpuguard's re-admission bridge" in r.findings[0].summary
        )
        # restarted, its new socket is newer than the bridge's registration: once only
        again = dataclasses.replace(o, plugins=(plugin(HOST, ctime=T0 + 205),), now=T0 + 210)
        assert assess(again, registration_grace=120).actions == ()


def test_a_kubelet_start_is_recorded_with_what_the_bridge_did(tmp_path: Path) -> None:
    from unit.test_readmit import _node

    _root, r, _bridge, _said = _node(tmp_path)
    written: list[ReadmitState] = []
    r.recorder = Recorder(written.append)
    sock = tmp_path / "var/lib/kubelet/device-plugins/kubelet.sock"
    sock.write_text("")  # its identity: a regular file does for the stat
    r.on_kubelet_start()
    s = written[-1]
    st = sock.stat()
    assert s.kubelet_sock == f"inode:{st.st_dev}:{st.st_ino}" and s.decision == "offered"
    assert [(g.resource, g.devices) for g in s.registrations] == [
        ("nvidia.com/gpu", ("GPU-a", "GPU-b"))
    ]
    _root, r, _bridge, _said = _node(tmp_path / "observe", "[Daemon]\nMode=observe\n")
    r.recorder = Recorder(written.append)
    r.on_kubelet_start()
    assert written[-1].decision == "observe" and written[-1].registrations == ()


def test_status_names_each_rejected_pod_and_the_condition_is_a_problem() -> None:
    import statusdoc
    from gpuguard.reporting.npd import BY_NAME, PROBLEM, evaluate
    from gpuguard.reporting.summary import render, summarize
    from gpuguard.steps.readmit.reconcile import judge as judged
    from unit.test_npd import steps

    s = state(rejected(UID_A, "default/gpu-a"), rejected(UID_B, "default/gpu-b"))
    found = judged(ReadmitView(s, "", frozenset(), frozenset({UID_A, UID_B})), frozenset())
    doc = {"steps": steps(readmit={"findings": [f.to_json() for f in found.findings]})}
    status = statusdoc.model(doc)
    summary = summarize(status, "", [])
    s = summary.to_json()
    assert s["verdict"] == "problem"
    assert [p["pod"] for p in s["rejected_pods"]] == ["default/gpu-a", "default/gpu-b"]
    text = "\n".join(render(summary))
    assert f"  rejected: default/gpu-a ({UID_A}) by kubelet at its start: Unexpected" in text
    code, msg = evaluate(BY_NAME["gpu-pods"], status.steps, status.steps["readmit"].ended, 600)
    assert code == PROBLEM and msg.startswith("kubelet rejected GPU pod default/gpu-a")
    assert msg.endswith("(+1 more)")


def test_the_device_plugin_step_reads_the_bridges_registration_of_this_kubelet_run(
    tmp_path: Path,
) -> None:
    from gpuguard.steps.device_plugin.observe import bridge_registered

    root = Root(tmp_path)
    assert bridge_registered(root, 100.0) is None  # no bridge
    regs = (Registration("nvidia.com/gpu", 100.03, ("GPU-a",), 100.04),)
    write_state(root.path(STATE_FILE), SPEC, state(registrations=regs))
    assert bridge_registered(root, 100.0) == 100.03
    assert bridge_registered(root, 200.0) is None  # an earlier kubelet run's
    assert bridge_registered(root, None) is None
