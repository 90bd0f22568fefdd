"""`npd checkpoint` (and the status and metrics behind it) never says "names only
devices this node has" while a remap, or any other checkpoint repair, is not applied."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest

from gpuguard.model import Finding
from gpuguard.reporting.npd import BY_NAME, OK, PROBLEM, evaluate
from gpuguard.reporting.status import OutcomeRecord, StepResult
from gpuguard.steps.checkpoint.reconcile import DEFAULT_RESOURCES, analyse
from gpuguard.steps.registry import CHECKPOINT
from unit.test_remap_hardening import checkpoint, entry, generation, inputs, now, uuid

COND = BY_NAME["checkpoint"]


def judged(findings: tuple[Finding, ...], status: str) -> int:
    outcome = OutcomeRecord("checkpoint-repaired", CHECKPOINT, "/ckpt", "stale", status)
    st = StepResult(3, time.time(), None, findings, (outcome,) if status else (), {})
    return evaluate(COND, {CHECKPOINT: st}, time.time(), 600.0)[0]


def remap_findings() -> tuple[Finding, ...]:
    old = generation("a", (0, 1, 2), 500.0)
    cp = checkpoint(entry("pod-x", [uuid("a", 0)], [0]))
    cp = replace(cp, registered=(("nvidia.com/gpu", (uuid("a", 0), uuid("a", 1))),))
    return analyse(cp, now("c"), DEFAULT_RESOURCES, inputs(old)).findings


@pytest.mark.parametrize("status", ["dry-run", "declined", "failed", ""])
def test_a_pending_remap_is_a_problem(status: str) -> None:
    found = remap_findings()
    assert {f.kind for f in found} >= {"checkpoint-entry-remap"}
    assert judged(found, status) == PROBLEM
    assert judged(found, "done") == OK


def test_a_remapped_registered_id_is_a_finding() -> None:
    found = [f for f in remap_findings() if f.kind == "checkpoint-stale-registered"]
    assert sorted(f.fields["DEVICE_ID"] for f in found) == [uuid("a", 0), uuid("a", 1)]
    assert all("is now" in f.summary for f in found)
    only = tuple(found)
    assert judged(only, "dry-run") == PROBLEM


def test_an_entry_left_stale_stays_a_problem_after_the_rest_is_repaired() -> None:
    cp = checkpoint(entry("pod-x", [uuid("c", 0), uuid("a", 1)], [0, 1]))
    cp = replace(cp, registered=(("nvidia.com/gpu", (uuid("a", 1),)),))
    a = analyse(cp, now("c"), DEFAULT_RESOURCES, replace(inputs(), history=None))
    assert a.repaired is not None  # the stale registered ID goes
    assert judged(a.findings, "done") == PROBLEM
