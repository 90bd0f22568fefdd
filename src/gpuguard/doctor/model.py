"""Doctor verdicts: one line per check with the evidence and the fix."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from gpuguard import exitcodes
from gpuguard.host.echo import cut

OK = "ok"
EXPOSED = "exposed"  # nothing is broken now, but a known event would break it (F1-F4)
BROKEN = "broken"  # GPUs are unusable or missing now
UNKNOWN = "unknown"  # the evidence could not be read; the reason says why
VERDICTS = (OK, UNKNOWN, EXPOSED, BROKEN)  # in order of severity
EVIDENCE_MAX = 400  # characters of a check's evidence or fix


@dataclass(frozen=True)
class Check:
    name: str
    verdict: str
    evidence: str  # the file and the value the verdict rests on (or why there is none)
    fix: str = ""  # the next step; empty when there is nothing to do

    def __post_init__(self) -> None:
        # configuration values and command output are echoed here: one line, bounded
        object.__setattr__(self, "evidence", cut(self.evidence, EVIDENCE_MAX))
        object.__setattr__(self, "fix", cut(self.fix, EVIDENCE_MAX))

    def to_json(self) -> dict[str, str]:
        return {
            "check": self.name,
            "verdict": self.verdict,
            "evidence": self.evidence,
            "fix": self.fix,
        }


@dataclass(frozen=True)
class Report:
    checks: tuple[Check, ...]

    @property
    def verdict(self) -> str:
        """The node's verdict: the worst of its checks (unknown only when no check is
        exposed or broken and at least one could not be judged)."""
        return max((c.verdict for c in self.checks), key=VERDICTS.index, default=OK)

    @property
    def exit_code(self) -> int:
        """0: nothing exposed or broken (unknowns are listed, not failed); 1: something is.
        A broken node and an exposed one differ in the JSON "verdict", not the code."""
        return exitcodes.FINDINGS if self.verdict in (EXPOSED, BROKEN) else exitcodes.OK

    def to_json(self) -> dict[str, Any]:
        return {
            "verdict": self.verdict,
            "exit_code": self.exit_code,
            "checks": [c.to_json() for c in self.checks],
        }

    def render(self) -> str:
        width = max((len(c.name) for c in self.checks), default=0)
        lines = []
        for c in self.checks:
            line = f"{c.verdict.upper():8} {c.name:{width}}  {c.evidence}"
            if c.fix and c.verdict != OK:
                line += f"; fix: {c.fix}"
            lines.append(line)
        lines.append(f"node: {self.verdict}")
        return "\n".join(lines)


def worst(verdicts: Sequence[str]) -> str:
    return max(verdicts, key=VERDICTS.index, default=OK)
