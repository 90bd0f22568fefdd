"""What the daemon last found and did per step, and its recent changes: the parts of the
status file that `gpuguard npd`, `gpuguard status` and the metrics read.

A pass runs only the steps its events marked, so "the last pass's findings" says
nothing about a step that did not run. The ledger keeps each step's latest result
(the latest update per step wins, as in node-problem-detector's condition manager) and
the changes of the last hour, so readers answer from one file without a second audit.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any, Mapping, Optional, Sequence

from gpuguard.model import Finding, Outcome

RECENT_WINDOW = 3600.0
RECENT_MAX = 500  # a bound on the status file, not an expected number


class Ledger:
    def __init__(self) -> None:
        self.steps: dict[str, dict[str, Any]] = {}
        self.recent: deque[dict[str, Any]] = deque(maxlen=RECENT_MAX)

    def record(
        self,
        step: str,
        pass_number: int,
        findings: Sequence[Finding],
        outcomes: Sequence[Outcome],
        error: Optional[str] = None,
        now: Optional[float] = None,
        gauges: Optional[Mapping[str, float]] = None,
    ) -> None:
        now = time.time() if now is None else now
        self.steps[step] = {
            "pass": pass_number,
            "ended": now,
            "error": error,
            "findings": [f.to_json() for f in findings],
            "outcomes": [o.to_json() for o in outcomes],
            "gauges": dict(gauges or {}),
        }
        for o in outcomes:
            if o.status in ("done", "failed", "declined"):
                self.recent.append(
                    {
                        "time": now,
                        "step": step,
                        "kind": o.action.kind,
                        "status": o.status,
                        "target": o.action.target,
                    }
                )

    def to_json(self, now: Optional[float] = None) -> dict[str, Any]:
        now = time.time() if now is None else now
        while self.recent and now - self.recent[0]["time"] > RECENT_WINDOW:
            self.recent.popleft()
        return {"steps": self.steps, "recent_changes": list(self.recent)}
