"""The one-screen summary at the top of `gpuguard status`: node verdict, last pass,
repairs in the last hour. Built from the daemon's status file, as the NPD conditions."""

from __future__ import annotations

import time
from collections import Counter
from typing import Any, Mapping, Optional, Sequence

from gpuguard.host.echo import cut
from gpuguard.host.paths import Root
from gpuguard.reporting.npd import CONDITIONS, DEFAULT_MAX_AGE, OK, PROBLEM, evaluate
from gpuguard.reporting.status import Status
from gpuguard.steps.registry import READMIT

MESSAGE_MAX = 300  # characters of one problem in `gpuguard status`


def summarize(
    status: Optional[Status],
    why: str,
    containers: Sequence[Mapping[str, Any]],
    now: Optional[float] = None,
) -> dict[str, Any]:
    """{"verdict": ok|problem|unknown, "problems": [...], "unknown": [...], "last_pass": ...,
    "repairs_last_hour": n, "repairs_by_kind": {...}}. Unknown when the daemon's file
    cannot be read, or any condition could not be judged; never ok about what no pass
    saw."""
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
    denied = [r for r in containers if r.get("access") == "denied"]
    if denied:
        problems.append(f"{len(denied)} GPU container(s) denied their devices now")
    unread = [r for r in containers if r.get("access") == "unreadable"]
    if unread:
        unknown.append(f"{len(unread)} GPU container(s) could not be read now")
    last = status.last_pass if status is not None else None
    changes = status.recent_changes if status is not None else ()
    done = [c for c in changes if c.status == "done" and now - c.time <= 3600]
    return {
        "verdict": "problem" if problems else ("unknown" if unknown else "ok"),
        "problems": problems,
        "unknown": unknown,
        "last_pass": {
            "number": last.number,
            "age_s": round(now - last.ended, 1),
            "reasons": list(last.reasons[:2]),
            "findings": len(last.findings),
        }
        if last is not None
        else None,
        "repairs_last_hour": len(done),
        "repairs_by_kind": dict(Counter(c.kind for c in done)),
        "last_reload": _last_reload(status),
        "rejected_pods": _rejected(status),
    }


def _rejected(status: Optional[Status]) -> list[dict[str, str]]:
    """The GPU pods kubelet rejected at its start and not run since (the readmit step)."""
    st = status.steps.get(READMIT) if status is not None else None
    if st is None:
        return []
    return [
        {k.lower(): f.fields.get(k, "") for k in ("POD", "POD_UID", "REASON", "KUBELET_MESSAGE")}
        for f in st.findings
        if f.kind == "gpu-pod-rejected"
    ]


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


def _last_reload(status: Optional[Status]) -> Optional[dict[str, Any]]:
    """The reload fast path's last repair (status file `fast_paths.reload`)."""
    r = status.fast_paths.reload if status is not None else None
    if status is None or r is None:
        return None
    return {
        "observe": status.mode == "observe",
        "containers": r.containers,
        "checked": r.checked,
        "repair_ms": round((r.restored - r.signal) * 1000, 1) if r.restored is not None else None,
        "via": status.reload_signal.last_via or None,
    }


def render(s: Mapping[str, Any]) -> list[str]:
    lines = [f"node:       {s['verdict'].upper()}"]
    lines += [f"  problem:  {cut(p, MESSAGE_MAX)}" for p in s["problems"]]
    lines += [f"  unknown:  {cut(u, MESSAGE_MAX)}" for u in s["unknown"]]
    last = s["last_pass"]
    if last is None:
        lines.append("last pass:  none")
    else:
        age = "?" if last["age_s"] is None else f"{last['age_s']:.0f}s ago"
        lines.append(
            f"last pass:  {age} (pass {last['number']}: {', '.join(last['reasons'])}), "
            f"{last['findings']} finding(s)"
        )
    r = s.get("last_reload")
    if r is not None:
        via = f" (signal via {r['via']})" if r.get("via") else ""
        if r.get("observe"):  # plans only: nothing was tried, nothing re-granted
            what = (
                f"observe mode: {r['containers']} of {r['checked']} known GPU container(s) "
                "had lost a device; re-granting them was planned, not tried"
                if r["containers"]
                else f"none of {r['checked']} known GPU container(s) had lost a device"
            )
        elif r["repair_ms"] is not None:
            what = (
                f"{r['containers']} of {r['checked']} known GPU container(s) re-granted on "
                f"the signal, the last {r['repair_ms']:.1f} ms after it"
            )
        elif r["containers"]:
            what = f"{r['containers']} re-grant(s) tried on the signal, none read back done"
        else:
            what = f"none of {r['checked']} known GPU container(s) had lost a device"
        lines.append(f"last reload: {what}{via}")
    for p in s.get("rejected_pods", ()):
        what = f"{p['pod']} ({p['pod_uid']}) by kubelet at its start: {p['reason']}"
        lines.append(f"  rejected: {cut(what + ': ' + p['kubelet_message'], MESSAGE_MAX)}")
    kinds = ", ".join(f"{n} {k}" for k, n in sorted(s["repairs_by_kind"].items()))
    lines.append(
        f"repairs:    {s['repairs_last_hour']} in the last hour" + (f" ({kinds})" if kinds else "")
    )
    return lines


def node_summary(root: Root, containers: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    from gpuguard.reporting.npd import read_status

    status, why = read_status(root)
    return summarize(status, why, containers)
