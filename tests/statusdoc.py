"""Status files for tests: a short dict completed into the document the daemon writes.

Tests describe only what they are about (a step's findings, an error, an age); the
rest is filled in with what a healthy daemon writes, and the result is checked with
the status file's own loader (reporting/status.py), so a test can never pass on a
document the daemon would not write. Tests of broken files write their bytes
directly.
"""

from __future__ import annotations

import json
import time
from typing import Any, Mapping, Optional

from gpuguard.reporting.status import SPEC, VERSION, Status


def finding(f: Mapping[str, Any]) -> dict[str, Any]:
    return {"reconciler": "x", "severity": "warning", "summary": "", "fields": {}, **f}


def outcome(o: Mapping[str, Any]) -> dict[str, Any]:
    base = {
        "kind": "k",
        "reconciler": "x",
        "target": "t",
        "reason": "r",
        "detail": "",
        "fields": {},
    }
    return {**base, **o}


def step(s: Mapping[str, Any], now: float) -> dict[str, Any]:
    out = {"pass": 1, "ended": now, "error": None, "gauges": {}, "unknown": [], **s}
    out["findings"] = [finding(f) for f in s.get("findings", ())]
    out["outcomes"] = [outcome(o) for o in s.get("outcomes", ())]
    return out


def pass_record(p: Mapping[str, Any], now: float) -> dict[str, Any]:
    out = {
        "number": 1,
        "reasons": ["start-up"],
        "reconcilers": [],
        "first_mark_age_ms": 0.0,
        "started": now,
        "ended": now,
        "duration_ms": 1.0,
        "steps_ms": {},
        "gpus": None,
        **p,
    }
    out["findings"] = [finding(f) for f in p.get("findings", ())]
    out["outcomes"] = [outcome(o) for o in p.get("outcomes", ())]
    return out


def complete(doc: Mapping[str, Any], now: Optional[float] = None) -> dict[str, Any]:
    """`doc` (any subset of a status document) as the daemon would write it."""
    now = time.time() if now is None else now
    out: dict[str, Any] = {
        "version": VERSION,
        "pid": 4242,
        "started": now - 3600,
        "passes": 1,
        "bus_connected": True,
        "dry_run": False,
        "reload_signal": {"private_socket": False, "last_via": "", "reloads": 0, "received": {}},
        "first_pass": None,
        "last_pass": None,
        "fast_paths": {"new_scopes": {}},
        "steps": {},
        "recent_changes": [],
        "node": "unknown",
        "conditions": {},
        **doc,
    }
    out["steps"] = {k: step(v, now) for k, v in out["steps"].items()}
    for key in ("first_pass", "last_pass"):
        if out[key] is not None:
            out[key] = pass_record(out[key], now)
    return out


def model(doc: Mapping[str, Any], now: Optional[float] = None) -> Status:
    """The completed document through the daemon's own loader (SchemaError if invalid)."""
    return SPEC.decode(json.dumps(complete(doc, now)).encode())


def encode(doc: Mapping[str, Any], now: Optional[float] = None) -> bytes:
    """The completed document's bytes, as the daemon writes them."""
    return SPEC.encode(model(doc, now))
