"""V2Remedy=inplace on bad input: several programs on one cgroup are never replaced, and a
failed replacement is not retried on every pass (steps/container_access/inplace.py).

Pure tables with a fake clock: the table of failures, the programs each pass observes,
and which actions `hold_back` lets through and which findings it gives instead."""

from __future__ import annotations

from gpuguard.model import Action
from gpuguard.steps.container_access.inplace import (
    BASE,
    CAP,
    FINDING_BACKOFF,
    FINDING_UNEXPECTED,
    Backoff,
    hold_back,
)
from gpuguard.steps.container_access.reconcile import V2ProgramReplace, V2ReportOnly

CG = "/sys/fs/cgroup/kubepods/burstable/podabc/" + "c" * 64
CID = "c" * 64


def _replace(cg: str = CG, cid: str = CID) -> V2ProgramReplace:
    return V2ProgramReplace(
        reconciler="container_access",
        reason="test",
        target=cg,
        cgroup_dir=cg,
        pod_uid="abc",
        container_id=cid,
        nodes=("/dev/nvidia0",),
        numbers=("195:0",),
    )


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _pass(
    backoff: Backoff, clock: Clock, programs: tuple[int, ...] | None
) -> tuple[tuple[Action, ...], list[str]]:
    actions, findings = hold_back([_replace()], {CID: programs}, backoff.failures, clock())
    return actions, [f.kind for f in findings]


def test_a_single_program_with_no_failure_is_replaced() -> None:
    actions, kinds = _pass(Backoff(), Clock(), (17,))
    assert actions == (_replace(),) and kinds == []


def test_several_programs_are_never_replaced_and_say_why() -> None:
    other = V2ReportOnly(reconciler="container_access", reason="r", target="t")
    actions, findings = hold_back([_replace(), other], {CID: (17, 18)}, {}, 0.0)
    assert actions == (other,)  # other actions pass untouched
    (f,) = findings
    assert f.kind == FINDING_UNEXPECTED and f.severity == "error"
    assert CG in f.summary and CID[:12] in f.summary and "17, 18" in f.summary
    assert "restart the container" in f.summary and "\n" not in f.summary
    assert f.fields["BPF_PROGRAMS"] == "17, 18" and f.fields["CGROUP"] == CG


def test_a_failure_holds_back_until_the_backoff_ends() -> None:
    clock, b = Clock(), Backoff()
    b.record(CG, (17,), False, f"{CG}: BPF_PROG_QUERY failed: Operation not permitted", clock())
    for dt in (0.0, 1.0, BASE - 0.01):  # every pass within the back-off: held, with a finding
        clock.now = 1000.0 + dt
        actions, kinds = _pass(b, clock, (17,))
        assert actions == () and kinds == [FINDING_BACKOFF]
    _, findings = hold_back([_replace()], {CID: (17,)}, b.failures, clock())
    assert "failed 1 time(s)" in findings[0].summary
    assert "Operation not permitted" in findings[0].summary and CG in findings[0].summary
    assert findings[0].fields["FAILURES"] == "1"
    clock.now = 1000.0 + BASE
    actions, kinds = _pass(b, clock, (17,))
    assert actions == (_replace(),) and kinds == []


def test_the_backoff_doubles_up_to_its_cap_and_clears_on_success() -> None:
    clock, b = Clock(), Backoff()
    waits = []
    for _ in range(10):
        b.record(CG, (17,), False, "frozen", clock())
        waits.append(b.failures[CG].wait)
        clock.now += b.failures[CG].wait  # retried as soon as allowed, failing again
    assert waits[:3] == [BASE, 2 * BASE, 4 * BASE] and max(waits) == CAP == waits[-1]
    b.record(CG, (17,), True, "done", clock())
    assert _pass(b, clock, (17,)) == ((_replace(),), [])


def test_a_program_change_is_retried_at_once_and_counts_afresh() -> None:
    clock, b = Clock(), Backoff()
    b.record(CG, (17,), False, "unknown shape", clock())
    b.record(CG, (17,), False, "unknown shape", clock())
    actions, kinds = _pass(b, clock, (21,))  # runc attached a new program meanwhile
    assert actions == (_replace(),) and kinds == []
    b.record(CG, (21,), False, "unknown shape", clock())
    assert b.failures[CG].count == 1 and b.failures[CG].wait == BASE


def test_a_failed_query_is_a_key_too() -> None:
    clock, b = Clock(), Backoff()
    b.record(CG, None, False, "BPF_PROG_QUERY failed", clock())
    assert _pass(b, clock, None)[1] == [FINDING_BACKOFF]
    _, findings = hold_back([_replace()], {CID: None}, b.failures, clock())
    assert findings[0].fields["BPF_PROGRAMS"] == "none readable"
    assert _pass(b, clock, (17,))[1] == []  # readable now: a change, retried


def test_another_cgroup_is_not_held_and_gone_cgroups_are_forgotten() -> None:
    clock, b = Clock(), Backoff()
    b.record(CG, (17,), False, "frozen", clock())
    other = CG.replace("podabc", "podxyz")
    actions, findings = hold_back(
        [_replace(other, "d" * 64)], {"d" * 64: (17,)}, b.failures, clock()
    )
    assert len(actions) == 1 and findings == ()
    b.keep_only({other})
    assert b.failures == {}
