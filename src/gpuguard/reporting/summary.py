"""The one-screen summary at the top of `gpuguard status`: node verdict, last pass,
repairs in the last hour. Built from the daemon's status file, as the NPD conditions."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass
from typing import Literal, Optional, Sequence, Union

from gpuguard.host.echo import cut
from gpuguard.host.paths import Root
from gpuguard.reporting.container_row import ContainerRow
from gpuguard.reporting.npd import CONDITIONS, DEFAULT_MAX_AGE, OK, PROBLEM, evaluate
from gpuguard.reporting.status import Status
from gpuguard.steps.registry import READMIT

MESSAGE_MAX = 300  # characters of one problem in `gpuguard status`


Verdict = Literal["ok", "problem", "unknown"]
JsonValue = Union[None, bool, int, float, str, list["JsonValue"], dict[str, "JsonValue"]]
JsonDoc = dict[str, JsonValue]


@dataclass(frozen=True)
class LastPass:
    number: int
    age_s: Optional[float]
    reasons: tuple[str, ...]
    findings: int

    def to_json(self) -> JsonDoc:
        return {
            "number": self.number,
            "age_s": self.age_s,
            "reasons": list(self.reasons),
            "findings": self.findings,
        }


@dataclass(frozen=True)
class LastReload:
    """The reload fast path's last repair (status file `fast_paths.reload`)."""

    observe: bool
    containers: int
    checked: int
    repair_ms: Optional[float]
    via: Optional[str]

    def to_json(self) -> JsonDoc:
        return {
            "observe": self.observe,
            "containers": self.containers,
            "checked": self.checked,
            "repair_ms": self.repair_ms,
            "via": self.via,
        }


@dataclass(frozen=True)
class RejectedPod:
    """A GPU pod kubelet rejected at its start and not run since (the readmit step)."""

    pod: str
    pod_uid: str
    reason: str
    kubelet_message: str

    def to_json(self) -> JsonDoc:
        return {
            "pod": self.pod,
            "pod_uid": self.pod_uid,
            "reason": self.reason,
            "kubelet_message": self.kubelet_message,
        }


@dataclass(frozen=True)
class NodeSummary:
    """The node's verdict (unknown when the daemon's file cannot be read or any condition
    could not be judged; never ok about what no pass saw), why, the last pass, the
    repairs of the last hour (by kind, in the order first seen), the last reload's
    repair and the GPU pods kubelet rejected."""

    verdict: Verdict
    problems: tuple[str, ...]
    unknown: tuple[str, ...]
    last_pass: Optional[LastPass]
    repairs_last_hour: int
    repairs_by_kind: tuple[tuple[str, int], ...]
    last_reload: Optional[LastReload]
    rejected_pods: tuple[RejectedPod, ...]

    def to_json(self) -> JsonDoc:
        """The `summary` of `gpuguard status --json`."""
        return {
            "verdict": self.verdict,
            "problems": list(self.problems),
            "unknown": list(self.unknown),
            "last_pass": self.last_pass.to_json() if self.last_pass is not None else None,
            "repairs_last_hour": self.repairs_last_hour,
            "repairs_by_kind": dict(self.repairs_by_kind),
            "last_reload": self.last_reload.to_json() if self.last_reload is not None else None,
            "rejected_pods": [p.to_json() for p in self.rejected_pods],
        }


def summarize(
    status: Optional[Status],
    why: str,
    containers: Sequence[ContainerRow],
    now: Optional[float] = None,
) -> NodeSummary:
    """The node's summary from the daemon's status file and the containers read now."""
    now = time.time() if now is None else now
    problems, unknown = [], []
    if status is None:
        unknown.append(why)
    else:
        for c in CONDITIONS:
            code, msg = evaluate(c, status.steps, now, DEFAULT_MAX_AGE)
            if code == PROBLEM:
                problems.append(f"{c.type}: {msg}")
            elif code != OK:
                unknown.append(f"{c.type}: {msg}")
    denied = [r for r in containers if r.access == "denied"]
    if denied:
        problems.append(f"{len(denied)} GPU container(s) denied their devices now")
    unread = [r for r in containers if r.access == "unreadable"]
    if unread:
        unknown.append(f"{len(unread)} GPU container(s) could not be read now")
    last = status.last_pass if status is not None else None
    changes = status.recent_changes if status is not None else ()
    done = [c for c in changes if c.status == "done" and now - c.time <= 3600]
    verdict: Verdict = "problem" if problems else ("unknown" if unknown else "ok")
    return NodeSummary(
        verdict=verdict,
        problems=tuple(problems),
        unknown=tuple(unknown),
        last_pass=LastPass(
            number=last.number,
            age_s=round(now - last.ended, 1),
            reasons=tuple(last.reasons[:2]),
            findings=len(last.findings),
        )
        if last is not None
        else None,
        repairs_last_hour=len(done),
        repairs_by_kind=tuple(Counter(c.kind for c in done).items()),
        last_reload=_last_reload(status),
        rejected_pods=_rejected(status),
    )


def _rejected(status: Optional[Status]) -> tuple[RejectedPod, ...]:
    """The GPU pods kubelet rejected at its start and not run since (the readmit step)."""
    st = status.steps.get(READMIT) if status is not None else None
    if st is None:
        return ()
    return tuple(
        RejectedPod(
            pod=f.fields.get("POD", ""),
            pod_uid=f.fields.get("POD_UID", ""),
            reason=f.fields.get("REASON", ""),
            kubelet_message=f.fields.get("KUBELET_MESSAGE", ""),
        )
        for f in st.findings
        if f.kind == "gpu-pod-rejected"
    )


def named_containers(status: Optional[Status]) -> frozenset[str]:
    """The container IDs the daemon's latest step results name (CONTAINER_ID)."""
    if status is None:
        return frozenset()
    return frozenset(
        f.fields["CONTAINER_ID"]
        for step in status.steps.values()
        for f in step.findings
        if f.fields.get("CONTAINER_ID")
    )


def _last_reload(status: Optional[Status]) -> Optional[LastReload]:
    """The reload fast path's last repair (status file `fast_paths.reload`)."""
    r = status.fast_paths.reload if status is not None else None
    if status is None or r is None:
        return None
    return LastReload(
        observe=status.mode == "observe",
        containers=r.containers,
        checked=r.checked,
        repair_ms=round((r.restored - r.signal) * 1000, 1) if r.restored is not None else None,
        via=status.reload_signal.last_via or None,
    )


def render(s: NodeSummary) -> list[str]:
    lines = [f"node:       {s.verdict.upper()}"]
    lines += [f"  problem:  {cut(p, MESSAGE_MAX)}" for p in s.problems]
    lines += [f"  unknown:  {cut(u, MESSAGE_MAX)}" for u in s.unknown]
    last = s.last_pass
    if last is None:
        lines.append("last pass:  none")
    else:
        age = "?" if last.age_s is None else f"{last.age_s:.0f}s ago"
        lines.append(
            f"last pass:  {age} (pass {last.number}: {', '.join(last.reasons)}), "
            f"{last.findings} finding(s)"
        )
    r = s.last_reload
    if r is not None:
        via = f" (signal via {r.via})" if r.via else ""
        if r.observe:  # plans only: nothing was tried, nothing re-granted
            what = (
                f"observe mode: {r.containers} of {r.checked} known GPU container(s) "
                "had lost a device; re-granting them was planned, not tried"
                if r.containers
                else f"none of {r.checked} known GPU container(s) had lost a device"
            )
        elif r.repair_ms is not None:
            what = (
                f"{r.containers} of {r.checked} known GPU container(s) re-granted on "
                f"the signal, the last {r.repair_ms:.1f} ms after it"
            )
        elif r.containers:
            what = f"{r.containers} re-grant(s) tried on the signal, none read back done"
        else:
            what = f"none of {r.checked} known GPU container(s) had lost a device"
        lines.append(f"last reload: {what}{via}")
    for p in s.rejected_pods:
        what = f"{p.pod} ({p.pod_uid}) by kubelet at its start: {p.reason}"
        lines.append(f"  rejected: {cut(what + ': ' + p.kubelet_message, MESSAGE_MAX)}")
    kinds = ", ".join(f"{n} {k}" for k, n in sorted(s.repairs_by_kind))
    lines.append(
        f"repairs:    {s.repairs_last_hour} in the last hour" + (f" ({kinds})" if kinds else "")
    )
    return lines


def node_summary(root: Root, containers: Sequence[ContainerRow]) -> NodeSummary:
    from gpuguard.reporting.npd import read_status

    status, why = read_status(root)
    return summarize(status, why, containers)
