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
from typing import Mapping, Optional, Sequence

from gpuguard.model import Finding, Outcome
from gpuguard.reporting.status import Change, OutcomeRecord, StepResult

RECENT_WINDOW = 3600.0
RECENT_MAX = 500  # a bound on the status file, not an expected number


class Ledger:
    def __init__(self) -> None:
        self.steps: dict[str, StepResult] = {}
        self.recent: deque[Change] = deque(maxlen=RECENT_MAX)

    def record(
        self,
        step: str,
        pass_number: int,
        findings: Sequence[Finding],
        outcomes: Sequence[Outcome],
        error: Optional[str] = None,
        now: Optional[float] = None,
        gauges: Optional[Mapping[str, float]] = None,
        unknown: Sequence[str] = (),
    ) -> None:
        now = time.time() if now is None else now
        self.steps[step] = StepResult(
            pass_number=pass_number,
            ended=now,
            error=error,
            findings=tuple(findings),
            outcomes=tuple(OutcomeRecord.of(o) for o in outcomes),
            gauges=dict(gauges or {}),
            unknown=tuple(unknown),
        )
        for o in outcomes:
            if o.status in ("done", "failed", "declined"):
                self.recent.append(Change(now, step, o.action.kind, o.status, o.action.target))

    def recent_changes(self, now: Optional[float] = None) -> tuple[Change, ...]:
        """The changes of the last RECENT_WINDOW seconds (older ones are dropped)."""
        now = time.time() if now is None else now
        while self.recent and now - self.recent[0].time > RECENT_WINDOW:
            self.recent.popleft()
        return tuple(self.recent)
