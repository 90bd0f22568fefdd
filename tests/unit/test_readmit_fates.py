"""Reports that fit API pods: a rejected GPU pod's fate from the API server's pods of
the node (readmit/fates.py: replaced, by which pod, or lost), "at its start" only for a
rejection within klog.AT_START of kubelet's start, the first admission of this kubelet
run only (readmit/klog.py), the state file's new fields, and the daemon's finding that
clears once the pod runs again, is deleted, or is replaced and the replacement runs
(steps/readmit/reconcile.py)."""

from __future__ import annotations

import calendar
import io
import json
import time
from typing import Any, List

import pytest

from gpuguard.host.kubeapi import ApiPod, OwnerRef
from gpuguard.host.statefile import Obj
from gpuguard.journal.log import EventLog
from gpuguard.readmit import fates as ft
from gpuguard.readmit.klog import AT_START, Line, Scan, scan
from gpuguard.readmit.plan import READ, STANDALONE, UNREAD, ApiView
from gpuguard.readmit.state import SPEC, ReadmitState, RejectedPod, _parse, _render
from gpuguard.steps.readmit.reconcile import ReadmitView, judge

START = 1764332400.0  # kubelet's start (Unix time)
RS = OwnerRef("ReplicaSet", "gpu-web-5f7", "rs-uid", controller=True)
OLD = "a1b2c3d4-0000-4000-8000-000000000001"
NEW = "a1b2c3d4-0000-4000-8000-000000000002"
PID = 757


def stamp(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


def pod(
    uid: str,
    name: str,
    phase: str = "Failed",
    owners: tuple[OwnerRef, ...] = (RS,),
    created: float = START - 600,
    mirror: str = "",
) -> ApiPod:
    return ApiPod(uid, "web", name, phase, False, owners, mirror, stamp(created))


def view(*pods: ApiPod, source: str = READ) -> ApiView:
    return ApiView(source, pods, "gpunode", f"{len(pods)} pods", 1.0)


REJECTED_AT = START + 1.5


# -- the fate, from the API server's pods -------------------------------------------------


def test_a_replicasets_new_pod_on_the_node_created_after_the_rejection_is_its_replacement() -> None:
    pods = (pod(OLD, "gpu-web-old"), pod(NEW, "gpu-web-new", "Running", created=START + 3))
    f = ft.judge(OLD, REJECTED_AT, view(*pods), 5.0)
    assert f == ft.Fate(ft.REPLACED, "ReplicaSet/gpu-web-5f7", "web/gpu-web-new", NEW, ft.RUNNING)
    assert f.settled


def test_a_pod_of_the_same_controller_made_before_the_rejection_is_no_replacement() -> None:
    """The Deployment's other pod (made long before) replaces nothing: waiting, then
    lost once FOLLOW has passed with none made."""
    pods = (pod(OLD, "gpu-web-old"), pod(NEW, "gpu-web-kept", "Running", created=START - 900))
    assert ft.judge(OLD, REJECTED_AT, view(*pods), 5.0).fate == ft.WAITING
    lost = ft.judge(OLD, REJECTED_AT, view(*pods), ft.FOLLOW)
    assert lost.fate == ft.LOST and lost.settled


def test_the_running_replacement_is_named_over_a_newer_pending_one() -> None:
    third = "a1b2c3d4-0000-4000-8000-000000000003"
    pods = (
        pod(OLD, "gpu-web-old"),
        pod(NEW, "gpu-web-run", "Running", created=START + 3),
        pod(third, "gpu-web-pend", "Pending", created=START + 9),
    )
    assert ft.judge(OLD, REJECTED_AT, view(*pods), 5.0).replacement_uid == NEW
    pending = ft.judge(OLD, REJECTED_AT, view(pods[0], pods[2]), 5.0)
    assert pending.fate == ft.REPLACED and not pending.settled  # a running one may follow


def test_a_pod_of_another_controller_or_a_non_controller_owner_replaces_nothing() -> None:
    other = OwnerRef("ReplicaSet", "gpu-api-1aa", "rs-other", controller=True)
    not_ctl = OwnerRef("ReplicaSet", "gpu-web-5f7", "rs-uid", controller=False)
    pods = (
        pod(OLD, "gpu-web-old"),
        pod(NEW, "gpu-api-x", "Running", (other,), START + 3),
        pod("u3", "gpu-web-y", "Running", (not_ctl,), START + 3),
    )
    assert ft.judge(OLD, REJECTED_AT, view(*pods), 5.0).fate == ft.WAITING


def test_bare_static_deleted_running_standalone_and_unread() -> None:
    assert ft.judge(OLD, REJECTED_AT, view(pod(OLD, "bare", owners=())), 0).fate == ft.LOST
    node = OwnerRef("Node", "gpunode", "node-uid", controller=True)
    mirror = pod("mirror-uid", "static-gpunode", owners=(node,), mirror=OLD)
    assert ft.judge(OLD, REJECTED_AT, view(mirror), 0).fate == ft.LOST
    assert ft.judge(OLD, REJECTED_AT, view(pod(NEW, "other")), 0).fate == ft.DELETED
    assert ft.judge(OLD, REJECTED_AT, view(pod(OLD, "a", "Running")), 0).fate == ft.RUNNING
    assert ft.judge(OLD, REJECTED_AT, view(source=STANDALONE), 0).fate == ft.LOST
    unread = ft.judge(OLD, REJECTED_AT, ApiView(UNREAD, detail="refused"), 0)
    assert unread.fate == "" and not unread.settled


def test_creation_timestamps_are_read_as_utc() -> None:
    assert ft.created_unix("2026-11-28T12:00:00Z") == calendar.timegm((2026, 11, 28, 12, 0, 0))
    assert ft.created_unix("") is None and ft.created_unix("yesterday") is None


# -- when kubelet rejected it, and this kubelet run's own records ---------------------------


def klog_at(t: float, text: str, pid: int = PID) -> Line:
    """A klog text record at Unix time ``t`` (UTC is kubelet's local time here)."""
    tm = time.gmtime(t)
    frac = round((t % 1) * 1e6)
    head = f"I{tm.tm_mon:02d}{tm.tm_mday:02d} {tm.tm_hour:02d}:{tm.tm_min:02d}:{tm.tm_sec:02d}"
    return Line(f"{head}.{frac:06d} {pid:7d} allocation_manager.go:702] {text}", t + 0.01)


def denied(uid: str, name: str) -> str:
    return (
        f'"Pod admission denied" podUID="{uid}" pod="web/{name}" '
        'reason="UnexpectedAdmissionError" message="Allocate failed due to requested number '
        'of devices unavailable for nvidia.com/gpu. Requested: 1, Available: 0"'
    )


def test_a_pod_bound_while_the_node_was_down_and_rejected_at_the_start_is_named() -> None:
    """Not held (bound to the node while it was down) but rejected 1.5 s in: named, at
    its start; a new pod rejected after AT_START only noted; a held pod rejected late is
    named with its own time, not at the start."""
    late = START + AT_START + 15
    ls = (
        klog_at(START + 1.5, denied(NEW, "gpu-web-new")),
        klog_at(late, denied("c3-0000", "gpu-web-later")),
        klog_at(late, denied(OLD, "gpu-web-held")),
    )
    _s, found = scan(Scan(), ls, PID, frozenset({OLD}), START)
    assert [(r.pod_uid, r.at) for r in found.rejected] == [
        (NEW, pytest.approx(START + 1.5)),
        (OLD, pytest.approx(late)),
    ]
    assert [r.pod_uid for r in found.elsewhere] == ["c3-0000"]
    # without kubelet's start told: only held pods, as before
    _s, found = scan(Scan(), ls, PID, frozenset({OLD}))
    assert [r.pod_uid for r in found.rejected] == [OLD]


def test_the_previous_kubelets_records_under_a_reused_pid_are_not_this_runs() -> None:
    """The same PID (a fresh PID namespace each boot) and journal: a SyncLoop ADD and a
    rejection from before kubelet's start are the previous kubelet's."""
    ls = (
        klog_at(START - 4.5, '"SyncLoop ADD" source="api" pods=["web/gpu-web-old"]'),
        klog_at(START - 4.4, denied(OLD, "gpu-web-old")),
        klog_at(START + 0.02, '"SyncLoop ADD" source="file" pods=[]'),
    )
    _s, found = scan(Scan(), ls, PID, frozenset({OLD}), START)
    assert found.admitted == pytest.approx(START + 0.02)
    assert found.rejected == () and found.elsewhere == ()
    _s, before = scan(Scan(), ls, PID, frozenset({OLD}))  # what it read before
    assert before.admitted == pytest.approx(START - 4.5)


def rejected(**kw: Any) -> RejectedPod:
    base = RejectedPod(OLD, "web/gpu-web-old", "UnexpectedAdmissionError", "Allocate failed", 2.0)
    return RejectedPod(**{**base.__dict__, **kw})


def test_only_a_rejection_at_the_start_is_said_to_be_at_its_start() -> None:
    assert ft.describe(rejected(at=START + 1.5), START).endswith("at its start")
    late = rejected(at=START + 21.7, at_start=False)
    assert (
        ft.describe(late, START) == "kubelet rejected GPU pod web/gpu-web-old 22 s after its start"
    )


# -- the journal entries -------------------------------------------------------------------


def entries(emit: Any) -> List[dict[str, Any]]:
    out = io.StringIO()
    emit(EventLog(stream=out, level="debug"))
    return [json.loads(line) for line in out.getvalue().splitlines()]


def fate_entries() -> List[dict[str, Any]]:
    """readmit-rejected while its ReplicaSet has not replaced it, then readmit-pod-fate
    naming the replacement, and a bare pod's, lost."""
    waiting = rejected(at=START + 1.5, fate=ft.WAITING, owner="ReplicaSet/gpu-web-5f7")
    replaced = ft.with_fate(
        waiting, ft.Fate(ft.REPLACED, "ReplicaSet/gpu-web-5f7", "web/gpu-web-new", NEW)
    )
    bare = rejected(pod_uid=NEW, pod="web/bare", at=START + 1.5, fate=ft.LOST)

    def emit(elog: EventLog) -> None:
        ft.say_rejected(elog, waiting, START)
        ft.say_fate(elog, replaced, START)
        ft.say_rejected(elog, bare, START)

    return entries(emit)


def test_the_journal_says_the_replacement_or_lost() -> None:
    first, fate, bare = fate_entries()
    assert first["kind"] == "readmit-rejected" and first["FATE"] == ft.WAITING
    assert "at its start" in first["msg"] and "has not replaced it" in first["msg"]
    assert first["POD"] == "web/gpu-web-old" and first["REASON"] == "UnexpectedAdmissionError"
    assert fate["kind"] == "readmit-pod-fate" and fate["REPLACEMENT_UID"] == NEW
    assert f"replaced it with web/gpu-web-new ({NEW})" in fate["msg"]
    assert "it is lost" in bare["msg"] and bare["FATE"] == ft.LOST


# -- the bridge follows the fate -----------------------------------------------------------


def test_the_bridge_follows_a_fate_until_the_replacement_runs() -> None:
    views = [view(pod(OLD, "gpu-web-old"))]
    said: List[tuple[str, str, str]] = []
    wanted: List[int] = []
    current = {OLD}
    f = ft.Fates(
        lambda: views[-1],
        lambda: wanted.append(1),
        lambda p, fate: said.append((p.pod_uid, fate.fate, fate.replacement_uid)),
        lambda uid: uid in current,
        every=3600.0,
    )
    f.thread = object()  # type: ignore[assignment]  # looked at by hand here
    assert f.add(rejected(at=REJECTED_AT)).fate == ft.WAITING and wanted
    f.look()
    assert said == []  # the same answer: nothing new to say
    views.append(
        view(pod(OLD, "gpu-web-old"), pod(NEW, "gpu-web-new", "Pending", created=START + 4))
    )
    f.look()
    f.look()
    views.append(
        view(pod(OLD, "gpu-web-old"), pod(NEW, "gpu-web-new", "Running", created=START + 4))
    )
    f.look()
    assert said == [(OLD, ft.REPLACED, NEW), (OLD, ft.REPLACED, NEW)]  # then running
    assert f.pods == {}  # settled: no more reads for it
    f.add(rejected(pod_uid="u9", at=REJECTED_AT))
    current.clear()  # kubelet started again
    f.look()
    assert f.pods == {}


# -- the state file and the daemon's finding -------------------------------------------------


def test_the_new_fields_round_trip_and_an_older_state_file_still_reads() -> None:
    p = rejected(at=START + 21.0, at_start=False, fate=ft.REPLACED, owner="ReplicaSet/x",
                 replacement="web/gpu-web-new", replacement_uid=NEW)  # fmt: skip
    s = ReadmitState("131:1", START, "offered", "", rejected=(p,))
    doc = _render(s)
    assert _parse(Obj(doc, "state")) == s
    for k in ("at", "at_start", "fate", "owner", "replacement", "replacement_uid"):
        del doc["rejected"][0][k]
    (old,) = _parse(Obj(doc, "state")).rejected
    assert old.at is None and old.at_start and old.fate == "" and SPEC.version == 1


def finding_view(p: RejectedPod, alive: frozenset[str] = frozenset()) -> ReadmitView:
    s = ReadmitState("131:1", START, "offered", "", rejected=(p,))
    return ReadmitView(s, "", alive, frozenset({p.pod_uid}))


def test_the_finding_names_the_replacement_and_clears_once_it_runs() -> None:
    p = rejected(at=START + 1.5, fate=ft.REPLACED, owner="ReplicaSet/gpu-web-5f7",
                 replacement="web/gpu-web-new", replacement_uid=NEW)  # fmt: skip
    (f,) = judge(finding_view(p), frozenset()).findings
    assert f"replaced it with web/gpu-web-new ({NEW})" in f.summary
    assert f.fields["REPLACEMENT_UID"] == NEW and f.fields["POD_UID"] == OLD
    assert "at its start" in f.summary
    j = judge(finding_view(p, frozenset({NEW})), frozenset())
    assert j.findings == () and OLD in j.cleared


def test_the_finding_says_lost_or_late_and_clears_when_the_api_server_deleted_it() -> None:
    lost = rejected(at=START + 30, at_start=False, fate=ft.LOST)
    (f,) = judge(finding_view(lost), frozenset()).findings
    assert "30 s after its start" in f.summary and "it is lost" in f.summary
    assert f.fields["AT_START"] == "no"
    for fate in (ft.DELETED, ft.RUNNING):
        assert judge(finding_view(rejected(fate=fate)), frozenset()).findings == ()
    waiting = rejected(fate=ft.WAITING, owner="ReplicaSet/gpu-web-5f7")
    (f,) = judge(finding_view(waiting), frozenset()).findings
    assert "has not replaced it on this node yet" in f.summary


def test_a_pod_missing_from_an_answer_older_than_its_rejection_is_not_taken_as_deleted() -> None:
    old_answer = ApiView(READ, (), "gpunode", "0 pods", at=time.monotonic() - 3)
    f = ft.Fates(lambda: old_answer, lambda: None, lambda _p, _f: None, every=3600.0)
    f.thread = object()  # type: ignore[assignment]  # looked at by hand here
    assert f.add(rejected(at=REJECTED_AT)).fate == "" and OLD in f.pods
    fresh = ApiView(READ, (), "gpunode", "0 pods", at=time.monotonic() + 1)
    assert ft.Fates.judged(rejected(), fresh, time.monotonic()).fate == ft.DELETED
