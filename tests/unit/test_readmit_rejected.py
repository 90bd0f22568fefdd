"""The re-admission bridge's rejection watch (readmit/rejected.py, klog.py,
kubeletlog.py): rejections only from kubelet's own records, only of the pods the
checkpoint held at kubelet's start, every field within what the state file's reader
accepts, and what could not be read said."""

from __future__ import annotations

import json
import os
import sys
import types
from pathlib import Path
from typing import Any, List, Tuple

import pytest

from gpuguard.actuate.statefile import write_state
from gpuguard.checkpoint.codec import marshal
from gpuguard.checkpoint.model import Checkpoint, PodDevicesEntry
from gpuguard.config import parse_config
from gpuguard.host.paths import Root
from gpuguard.readmit import kubeletlog
from gpuguard.readmit.klog import Line, Scan, parse, scan
from gpuguard.readmit.kubeletlog import KubeletRun
from gpuguard.readmit.rejected import Rejection, RejectionWatch, held_pods, rejections
from gpuguard.readmit.state import (
    POD_MAX,
    SPEC,
    STATE_FILE,
    ReadmitState,
    Recorder,
    RejectedPod,
)
from gpuguard.steps.readmit.observe import observe
from gpuguard.steps.readmit.reconcile import judge

PID = 757
VICTIM = "5be161ab-85e5-5281-8e74-7c9c806b281d"
HELD = frozenset({VICTIM})
CHECKPOINT = "/var/lib/kubelet/device-plugins/kubelet_internal_checkpoint"


def klog(pid: int, text: str, file: str = "allocation_manager.go:702") -> str:
    """One klog text record, as kubelet 1.34 writes it."""
    return f"I1128 12:20:35.778873 {pid:7d} {file}] {text}"


def denied(uid: str = VICTIM, pod: str = "prod/victim-0", extra: str = "") -> str:
    return (
        f'"Pod admission denied" podUID="{uid}" pod="{pod}" reason="UnexpectedAdmissionError" '
        f'message="Allocate failed due to no healthy devices present; cannot allocate '
        f'unhealthy devices nvidia.com/gpu, which is unexpected"{extra}'
    )


def lines(*texts: str) -> Tuple[Line, ...]:
    return tuple(Line(t, 1764332435.8) for t in texts)


# -- forged lines are no records --------------------------------------------------------


def test_a_tenants_forged_probe_output_is_no_rejection() -> None:
    """A probe's multi-line output, logged at --v>=1 by kubelet itself (the same _PID,
    the same unit): each line a journal entry, behind a tab, or raw inside the value,
    even one that forges klog's whole header with kubelet's PID."""
    forged = denied(pod="prod/victim-0")
    log = lines(
        klog(
            PID,
            '"Probe failed" probeType="Readiness" pod="tenant/probe-0" output=<',
            "prober.go:107",
        ),
        "\t" + forged,
        "\t" + klog(PID, forged),
        forged,  # raw, no header
        klog(PID, forged),  # raw inside the value, the header forged too
        ' > containerName="c"',
    )
    state, found = scan(Scan(), log, PID, HELD)
    assert found.rejected == () and found.elsewhere == ()
    assert not state.in_block  # the value ended: kubelet's next record counts again
    _s, after = scan(state, lines(klog(PID, denied())), PID, HELD)
    assert [r.pod for r in after.rejected] == ["prod/victim-0"]
    # the same journal text as one block, as the old reader's regex saw it: nothing
    assert rejections("\n".join(t.text for t in log), PID) == []


def test_a_record_with_another_pid_in_its_header_is_not_kubelets() -> None:
    """A helper in kubelet's cgroup (systemd-cat, logger) or the previous kubelet."""
    assert rejections(klog(PID + 1, denied()), PID) == []
    assert [r.pod_uid for r in rejections(klog(PID, denied()), PID)] == [VICTIM]


def test_only_a_pod_the_checkpoint_held_at_the_start_is_rejected_at_it() -> None:
    other = "0c7b1c6e-0000-4000-8000-000000000001"  # a new pod, judged later
    _s, found = scan(Scan(), lines(klog(PID, denied(other, "default/new-7d9f"))), PID, HELD)
    assert found.rejected == ()
    assert [r.pod_uid for r in found.elsewhere] == [other]
    assert rejections(klog(PID, denied(other, "default/new-7d9f")), PID, HELD) == []


def test_kubelet_1_36_adds_operation_add() -> None:
    (r,) = rejections(klog(PID, denied(extra=' operation="add"')), PID, HELD)
    assert (r.pod, r.reason) == ("prod/victim-0", "UnexpectedAdmissionError")
    text = (
        '"Pod admission denied" operation="add" podUID="' + VICTIM + '" pod="prod/victim-0" '
        'reason="UnexpectedAdmissionError" message="Allocate failed due to x"'
    )
    assert [r.pod for r in rejections(klog(PID, text), PID, HELD)] == ["prod/victim-0"]


def test_json_klog_rejection_and_first_admission() -> None:
    add = {"ts": 1764332435778.873, "caller": "kubelet/kubelet.go:2", "v": 0}
    add |= {"msg": "SyncLoop ADD", "source": "file", "pods": ["prod/victim-0"]}
    rej = {"ts": 1764332435800.0, "caller": "cm/allocation_manager.go:702", "v": 0}
    rej |= {"msg": "Pod admission denied", "podUID": VICTIM}
    rej |= {"pod": {"name": "victim-0", "namespace": "prod"}, "reason": "UnexpectedAdmissionError"}
    rej |= {"message": "Allocate failed due to no healthy devices present", "operation": "add"}
    flat = dict(rej, pod="prod/victim-1", podUID="u-1")
    state, found = scan(Scan(), lines(json.dumps(add), json.dumps(rej)), PID, HELD | {"u-1"})
    assert found.admitted == pytest.approx(1764332435.778873)
    assert [r.pod for r in found.rejected] == ["prod/victim-0"]
    _s, more = scan(state, lines(json.dumps(flat)), PID, HELD | {"u-1"})
    assert [r.pod for r in more.rejected] == ["prod/victim-1"]
    # a kubelet logging text never logs JSON: such a line is no record of it
    state, _f = scan(Scan(), lines(klog(PID, '"SyncLoop ADD" source="file"')), PID, HELD)
    _s, none = scan(state, lines(json.dumps(rej)), PID, HELD)
    assert none.rejected == ()


def test_a_pod_name_no_kubernetes_object_can_have_is_no_rejection() -> None:
    assert rejections(klog(PID, denied(pod="prod/" + "v" * 10_000)), PID) == []
    assert rejections(klog(PID, denied(pod="prod/Victim")), PID) == []
    assert rejections(klog(PID, denied(uid="u" * 65)), PID) == []
    long_ok = "n" * 63 + "/" + "p" * 253  # Kubernetes' own bounds: kept whole
    (r,) = rejections(klog(PID, denied(pod=long_ok)), PID)
    assert r.pod == long_ok and len(r.pod) <= POD_MAX


def test_the_first_admission_is_this_kubelets_own() -> None:
    """The previous kubelet's SyncLoop ADD (another PID) is never this one's."""
    old = Line(klog(PID - 3, '"SyncLoop ADD" source="file" pods=[]', "kubelet.go:2"), 1764332430.0)
    new = Line(
        "I1128 12:20:37.000001 " + f"{PID:7d}" + ' kubelet.go:2] "SyncLoop ADD" source="file"',
        1764332437.01,
    )
    _s, found = scan(Scan(), (old, new), PID, HELD)
    assert found.admitted == pytest.approx(1764332437.000001)


def test_parse_reads_only_a_line_that_starts_with_the_header() -> None:
    assert parse(" " + klog(PID, denied())) is None
    assert parse("kubelet: " + klog(PID, denied())) is None
    rec = parse(klog(PID, denied()))
    assert rec is not None and rec.pid == PID and rec.get("pod") == "prod/victim-0"


# -- bounded at the source: no later write refused --------------------------------------


def test_a_10000_character_pod_name_then_a_real_rejection_and_a_raced_socket_reach_the_daemon(
    tmp_path: Path,
) -> None:
    root = Root(tmp_path)
    (tmp_path / "var/lib/kubelet/pods" / VICTIM).mkdir(parents=True)
    refused: List[str] = []

    def write(s: ReadmitState) -> None:
        write_state(root.path(STATE_FILE), SPEC, s)

    rec = Recorder(write, refused=refused.append)
    rec.kubelet_started("131:1764342378000000000", 1764342378.0, 1764342503.0)
    rec.rejected(RejectedPod("u" * 500, "prod/" + "v" * 10_000, "R" * 100, "m" * 5000, 1.0))
    rec.rejected(RejectedPod(VICTIM, "default/gpu-a", "UnexpectedAdmissionError", "Allocate", 2.0))
    rec.raced(("nvidia-gpu.sock", "x" * 1000))
    rec.decided("observe" * 10, "d" * 1000)
    rec.problem("p" * 1000)
    view = observe(root, CHECKPOINT)
    assert view.unreadable == "" and view.state is not None, view.unreadable
    assert VICTIM in {p.pod_uid for p in view.state.rejected}
    assert "nvidia-gpu.sock" in view.state.raced
    assert refused == []


def test_a_change_its_reader_would_refuse_is_not_taken(tmp_path: Path) -> None:
    """Beyond any field's bound (devices by the thousand, names of 256 characters,
    over the file's byte limit): that change is left out, said, and the next one is
    written."""
    root = Root(tmp_path)
    refused: List[str] = []
    rec = Recorder(lambda s: write_state(root.path(STATE_FILE), SPEC, s), refused=refused.append)
    rec.kubelet_started("1:2", 1.0, 2.0)
    many = tuple(f"{i:0256d}" for i in range(4096))
    for n in range(8):
        rec.registered(f"r{n}", many, 3.0)
    assert refused and "bytes" in refused[0]
    rec.raced(("nvidia-gpu.sock",))
    view = observe(root, CHECKPOINT)
    assert view.state is not None and view.state.raced == ("nvidia-gpu.sock",)


# -- what could not be read is said; the daemon's verdict is then unknown --------------


def test_a_problem_in_the_state_makes_the_readmit_verdict_unknown() -> None:
    from gpuguard.steps.readmit.reconcile import ReadmitView

    s = ReadmitState("1:2", 1.0, "offered", "x", problem="journalctl exited 1: x")
    j = judge(ReadmitView(s, "", frozenset(), frozenset()), frozenset())
    assert "journalctl exited 1" in j.blind
    assert (
        judge(
            ReadmitView(ReadmitState("1:2", 1.0, "offered", "x"), "", frozenset(), frozenset()),
            frozenset(),
        ).blind
        == ""
    )


def test_an_older_bridges_state_without_a_problem_is_read() -> None:
    data = SPEC.encode(ReadmitState("1:2", 1.0, "offered", "x"))
    doc = json.loads(data)
    del doc["problem"]
    assert SPEC.decode(json.dumps(doc).encode()).problem == ""


# -- the watch: its sources --------------------------------------------------------------


def _cfg(tmp_path: Path, text: str = "") -> Any:
    return parse_config("[Kubelet]\n" + text, source="t.conf")


def _checkpoint(root: Path, *uids: str) -> None:
    path = root / CHECKPOINT.lstrip("/")
    path.parent.mkdir(parents=True, exist_ok=True)
    entries = tuple(
        PodDevicesEntry(u, "main", "nvidia.com/gpu", ((0, ("GPU-" + u[:4],)),), b"\n\x03abc")
        for u in uids
    )
    path.write_bytes(marshal(Checkpoint("v2", entries, {}, 0)))


class Said:
    def __init__(self) -> None:
        self.rejected: List[Rejection] = []
        self.admitted: List[float] = []
        self.problems: List[str] = []
        self.notes: List[Tuple[str, str]] = []

    def watch(self, root: Root, pid: int = PID) -> RejectionWatch:
        return RejectionWatch(
            root,
            "kubelet.service",
            self.rejected.append,
            self.admitted.append,
            self.problems.append,
            lambda level, text: self.notes.append((level, text)),
            runs=lambda _r, unit, _f: KubeletRun(unit, pid, 5_000_000),
            every=0.0,
        )


def test_held_pods_are_the_checkpoints_gpu_pods(tmp_path: Path) -> None:
    _checkpoint(tmp_path, VICTIM, "Other_Pod")
    held, why = held_pods(Root(tmp_path), _cfg(tmp_path))
    assert why == "" and held == {VICTIM, "other-pod"}
    assert held_pods(Root(tmp_path / "none"), _cfg(tmp_path)) == (frozenset(), "")
    (tmp_path / CHECKPOINT.lstrip("/")).write_bytes(b"not a checkpoint")
    held, why = held_pods(Root(tmp_path), _cfg(tmp_path))
    assert held is None and why.startswith("kubelet's checkpoint:")


def test_the_log_file_is_read_from_its_position_at_kubelets_start(tmp_path: Path) -> None:
    """RKE2: kubelet.log keeps every earlier run (another boot's kubelet may have had
    the same PID): only what came after kubelet.sock counts."""
    _checkpoint(tmp_path, VICTIM)
    log = tmp_path / "var/lib/rancher/rke2/agent/logs/kubelet.log"
    log.parent.mkdir(parents=True)
    log.write_text(
        klog(PID, '"SyncLoop ADD" source="file"', "kubelet.go:2")
        + "\n"
        + klog(PID, denied())
        + "\n"
    )
    log.chmod(0o644)
    said = Said()
    watch = said.watch(Root(tmp_path))
    w = watch.begin(_cfg(tmp_path, "LogFile=/var/lib/rancher/rke2/agent/logs/kubelet.log"))
    watch.follow(w, rounds=1)
    assert said.rejected == [] and said.admitted == [] and said.problems == []
    with log.open("a") as f:
        f.write(klog(PID, '"SyncLoop ADD" source="file"', "kubelet.go:2") + "\n")
        f.write(klog(PID, denied()) + "\n" + klog(PID, denied(extra=" partial")))  # no newline yet
    watch.follow(w, rounds=1)
    assert [r.pod_uid for r in said.rejected] == [VICTIM] and len(said.admitted) == 1


def test_a_log_file_others_may_write_is_not_read_and_said(tmp_path: Path) -> None:
    log = tmp_path / "kubelet.log"
    log.write_text("")
    log.chmod(0o666)
    said = Said()
    watch = said.watch(Root(tmp_path))
    w = watch.begin(_cfg(tmp_path, "LogFile=/kubelet.log"))
    with log.open("a") as f:
        f.write(klog(PID, denied()) + "\n")
    os.chmod(log, 0o666)
    watch.follow(w, rounds=2)
    assert said.rejected == []
    (problem,) = said.problems
    assert "only root may write" in problem and "kubelet.log" in problem


def test_no_kubelet_process_in_its_unit_is_said(tmp_path: Path) -> None:
    said = Said()
    watch = said.watch(Root(tmp_path), pid=0)
    watch.follow(watch.begin(_cfg(tmp_path)), rounds=1)
    (problem,) = said.problems
    assert problem.startswith("kubelet's records cannot be told from others")


class FakeReader:
    """systemd.journal.Reader's surface the watch uses, over entries of two PIDs."""

    made: List[FakeReader] = []

    def __init__(self) -> None:
        self.matches: dict[str, str] = {}
        self.boot = False
        self.seek: float = -1.0
        self.entries = [
            (1_000_000, PID, klog(PID, denied())),  # an earlier kubelet, same PID
            (6_000_000, PID + 9, klog(PID, denied())),  # systemd-cat in its cgroup
            (7_000_000, PID, klog(PID, denied())),
        ]
        self.at = -1
        FakeReader.made.append(self)

    def this_boot(self) -> None:
        self.boot = True

    def add_match(self, **kw: str) -> None:
        self.matches.update(kw)

    def seek_monotonic(self, seconds: float) -> None:
        self.seek = seconds

    def process(self) -> int:
        return 0

    def _next(self) -> bool:
        while True:
            self.at += 1
            if self.at >= len(self.entries):
                return False
            mono, pid, _t = self.entries[self.at]
            if str(pid) == self.matches.get("_PID") and mono >= self.seek * 1e6:
                return True

    def _get_monotonic(self) -> Tuple[int, bytes]:
        return self.entries[self.at][0], b"\0" * 16

    def _get(self, field: str) -> bytes:
        assert field == "MESSAGE"
        return self.entries[self.at][2].encode()

    def _get_realtime(self) -> int:
        return 1764332435_800000

    def close(self) -> None:
        pass


def test_the_journal_is_read_on_trusted_fields_from_this_kubelets_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = types.ModuleType("systemd.journal")
    fake.Reader = FakeReader  # type: ignore[attr-defined]
    pkg = types.ModuleType("systemd")
    pkg.journal = fake  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "systemd", pkg)
    monkeypatch.setitem(sys.modules, "systemd.journal", fake)
    _checkpoint(tmp_path, VICTIM)
    said = Said()
    watch = said.watch(Root(tmp_path))
    watch.follow(watch.begin(_cfg(tmp_path)), rounds=1)
    (r,) = FakeReader.made
    assert r.matches == {"_SYSTEMD_UNIT": "kubelet.service", "_PID": str(PID)} and r.boot
    assert r.seek == 5.0  # the unit's ExecMainStartTimestampMonotonic
    assert [x.pod_uid for x in said.rejected] == [VICTIM] and said.notes == []


def test_without_python3_systemd_journalctl_is_said_once_and_its_failure_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import subprocess

    calls: List[List[str]] = []

    def run(argv: List[str], **_kw: Any) -> subprocess.CompletedProcess[str]:
        calls.append(list(argv))
        if len(calls) == 1:
            entry = {
                "__CURSOR": "c1",
                "__MONOTONIC_TIMESTAMP": "6000000",
                "MESSAGE": klog(PID, denied()),
            }
            return subprocess.CompletedProcess(argv, 0, json.dumps(entry) + "\n", "")
        return subprocess.CompletedProcess(argv, 1, "", "Failed to open journal: Bad message\n")

    monkeypatch.setattr(kubeletlog, "have_reader", lambda: False)
    monkeypatch.setattr(kubeletlog.commands, "run", run)
    _checkpoint(tmp_path, VICTIM)
    said = Said()
    watch = said.watch(Root(tmp_path))
    watch.follow(watch.begin(_cfg(tmp_path)), rounds=3)
    watch.follow(watch.begin(_cfg(tmp_path)), rounds=1)
    assert [x.pod_uid for x in said.rejected] == [VICTIM]
    assert [lvl for lvl, _t in said.notes] == ["notice"]  # once per process
    assert "_SYSTEMD_UNIT=kubelet.service" in calls[0] and f"_PID={PID}" in calls[0]
    assert not any(a.startswith("--grep") for a in calls[0])  # no PCRE2 needed
    assert "--after-cursor=c1" in calls[1]
    assert said.problems == ["journalctl exited 1: Failed to open journal: Bad message"] * 2
