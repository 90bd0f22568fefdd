"""The readmit step's judgement (pure): the GPU pods kubelet rejected at its start,
from the re-admission bridge's state (readmit/state.py), and whether each still is.

A rejected pod is a finding (``gpu-pod-rejected``, an error) until it runs again (a
process in one of its containers, or the API server says Running), is gone (kubelet
removed its pod directory, or the API server has it no more: the pod was deleted), or
its controller replaced it and the replacement runs (a process in one of its
containers). The finding says which (readmit/fates.py). kubelet's checkpoint is no
witness: a rejected pod's entry goes when any new pod gets a device, while the pod
itself stays Failed. A pod seen running since its rejection stays cleared for that
kubelet run, even once its containers end.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from gpuguard.model import Finding
from gpuguard.readmit.fates import DELETED, REPLACED, RUNNING, describe, fate_fields, fate_text
from gpuguard.readmit.state import ReadmitState

RECONCILER = "readmit"
K_REJECTED = "gpu-pod-rejected"
MARGIN = "readmit_margin_seconds:"  # a gauge's name, before its resource


@dataclass(frozen=True)
class ReadmitView:
    state: Optional[ReadmitState]
    unreadable: str  # why the bridge's state could not be used ("" when read or absent)
    alive: frozenset[str]  # rejected pod UIDs (and their replacements') with a running process
    present: frozenset[str]  # rejected pod UIDs whose pod directory exists
    pods_seen: bool = True  # kubelet's pods directory was there to look in
    kubelet_sock: Optional[float] = None  # kubelet's latest start (its socket's listener)


@dataclass(frozen=True)
class Judgement:
    findings: tuple[Finding, ...]
    cleared: frozenset[str]  # pod UIDs cleared for this kubelet run (the step keeps them)
    rejected: int  # pods still rejected
    # per resource, seconds from the bridge's devices healthy to kubelet's first admission
    margins: tuple[tuple[str, float], ...]
    # what kept the bridge from reading kubelet's rejections at this start ("" none):
    # the step's verdict is then unknown, never OK
    blind: str = ""


def judge(view: ReadmitView, cleared: frozenset[str]) -> Judgement:
    """``cleared``: pod UIDs already seen running again in this kubelet run."""
    s = view.state
    if s is None:
        return Judgement((), frozenset(), 0, ())
    now_cleared = set(cleared)
    findings = []
    for p in s.rejected:
        if p.pod_uid in now_cleared:
            continue
        gone = view.pods_seen and p.pod_uid not in view.present
        replaced = p.fate == REPLACED and p.replacement_uid in view.alive
        if p.pod_uid in view.alive or gone or replaced or p.fate in (RUNNING, DELETED):
            now_cleared.add(p.pod_uid)
            continue
        findings.append(
            Finding(
                K_REJECTED,
                RECONCILER,
                f"{describe(p, s.kubelet_started)} and it has not run since: "
                f"{p.reason}: {p.message}; {fate_text(p)}",
                {
                    **fate_fields(p),
                    "REASON": p.reason,
                    "KUBELET_MESSAGE": p.message,
                    "KUBELET_STARTED": f"{s.kubelet_started:.3f}",
                },
                "error",
            )
        )
    blind = (
        f"the re-admission bridge could not read kubelet's rejections at its start: {s.problem}"
        if s.problem
        else ""
    )
    return Judgement(tuple(findings), frozenset(now_cleared), len(findings), s.margins(), blind)
