"""The one-screen summary at the top of `gpuguard status`: node verdict, last pass,
repairs in the last hour. Built from the daemon's status file, as the NPD conditions."""

from __future__ import annotations

import time
from collections import Counter
from typing import Any, Mapping, Optional, Sequence

from gpuguard.host.paths import Root
from gpuguard.reporting.npd import CONDITIONS, DEFAULT_MAX_AGE, OK, PROBLEM, evaluate


def summarize(
    doc: Optional[Mapping[str, Any]],
    why: str,
    containers: Sequence[Mapping[str, Any]],
    now: Optional[float] = None,
) -> dict[str, Any]:
    """{"verdict": ok|problem|unknown, "problems": [...], "unknown": [...], "last_pass": ...,
    "repairs_last_hour": n, "repairs_by_kind": {...}}."""
    now = time.time() if now is None else now
    problems, unknown = [], []
    if doc is None:
        unknown.append(why)
    else:
        for c in CONDITIONS:
            code, msg = evaluate(c, doc, now, DEFAULT_MAX_AGE)
            if code == PROBLEM:
                problems.append(f"{c.type}: {msg}")
            elif code != OK:
                unknown.append(f"{c.type}: {msg}")
    denied = [r for r in containers if r.get("access") == "denied"]
    if denied:
        problems.append(f"{len(denied)} GPU container(s) denied their devices now")
    last = (doc or {}).get("last_pass") or {}
    changes = [c for c in (doc or {}).get("recent_changes") or () if isinstance(c, dict)]
    done = [c for c in changes if c.get("status") == "done" and now - c.get("time", 0) <= 3600]
    return {
        "verdict": "problem" if problems else ("unknown" if unknown else "ok"),
        "problems": problems,
        "unknown": unknown,
        "last_pass": {
            "number": last.get("number"),
            "age_s": round(now - last["ended"], 1)
            if isinstance(last.get("ended"), (int, float))
            else None,
            "reasons": list(last.get("reasons") or ())[:2],
            "findings": len(last.get("findings") or ()),
        }
        if last
        else None,
        "repairs_last_hour": len(done),
        "repairs_by_kind": dict(Counter(str(c.get("kind")) for c in done)),
        "last_reload": _last_reload(doc or {}),
    }


def _last_reload(doc: Mapping[str, Any]) -> Optional[dict[str, Any]]:
    """The reload fast path's last repair (status file `fast_paths.reload`)."""
    fast = doc.get("fast_paths")
    r = fast.get("reload") if isinstance(fast, dict) else None
    if not isinstance(r, dict) or not isinstance(r.get("signal"), (int, float)):
        return None
    restored = r.get("restored")
    signal = doc.get("reload_signal")
    return {
        "containers": r.get("containers"),
        "checked": r.get("checked"),
        "repair_ms": round((restored - r["signal"]) * 1000, 1)
        if isinstance(restored, (int, float))
        else None,
        "via": signal.get("last_via") if isinstance(signal, dict) else None,
    }


def render(s: Mapping[str, Any]) -> list[str]:
    lines = [f"node:       {s['verdict'].upper()}"]
    lines += [f"  problem:  {p}" for p in s["problems"]]
    lines += [f"  unknown:  {u}" for u in s["unknown"]]
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
        if r["repair_ms"] is not None:
            what = (
                f"{r['containers']} of {r['checked']} known GPU container(s) re-granted on "
                f"the signal, the last {r['repair_ms']:.1f} ms after it"
            )
        elif r["containers"]:
            what = f"{r['containers']} re-grant(s) tried on the signal, none read back done"
        else:
            what = f"none of {r['checked']} known GPU container(s) had lost a device"
        lines.append(f"last reload: {what}{via}")
    kinds = ", ".join(f"{n} {k}" for k, n in sorted(s["repairs_by_kind"].items()))
    lines.append(
        f"repairs:    {s['repairs_last_hour']} in the last hour" + (f" ({kinds})" if kinds else "")
    )
    return lines


def node_summary(root: Root, containers: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    from gpuguard.reporting.npd import read_status

    doc, why = read_status(root)
    return summarize(doc, why, containers)
