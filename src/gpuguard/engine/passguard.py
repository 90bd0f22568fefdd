"""Never a repair loop: a pass whose changes repaired nothing holds the next one back.

A pass's own changes can wake the next pass: a DeviceAllow= it sets is written by
systemd to the file the transient watch reads (sources/transient.py), a node it makes
is a DEVICE_LINKS_CREATED event, a step asks for a recheck. When those changes do not
end what the pass found (a program gpuguard cannot replace still denies, a runtime
takes it away again at once), the next pass finds the same, changes the same, and
wakes the one after: without this guard, passes without end (Debian 11's systemd 247
with runc 1.0-rc93 on cgroup v2 ran about three a second).

The rule, whatever step or event is involved: a pass that acted (an outcome done or
failed) and was followed at once by a pass that found exactly the same findings
repaired nothing, and so does that one; each such pass in a row doubles how long the
next pass that no outside event asks for urgently (a daemon-reload, a reexec, start-up,
a reconnection) waits after it: `BASE`, twice that, ... up to `CAP`. "At once": the
marks that brought the next pass began within `PROMPT` of the previous pass's end, as
a pass's own change wakes the next one within milliseconds. A loss that comes back
later (kubelet's CPU manager rewriting a container's devices at each reconcile, every
10 s by default) was repaired, lost again and is repaired again: never held back. A
pass that finds something else, acts on nothing, or was brought by marks that came
later ends the streak. The periodic audit and urgent events still run passes, so a
repair that becomes possible is made, just not in a loop.

Pure: the daemon feeds it each pass and hands the wait to the coalescer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Hashable, Optional

BASE = 1.0  # seconds the next pass waits after the first pass that repaired nothing
CAP = 300.0  # the longest wait (the default audit interval)
# Marks this soon after a pass ended are its own doing (a change it made woke them); a
# repair loop's next pass is marked within milliseconds, an outside cause comes later.
PROMPT = 1.0


@dataclass(frozen=True)
class Verdict:
    """What one pass means for the next: how long it waits (0: not at all) and how
    many passes in a row repaired nothing."""

    wait: float
    streak: int

    def message(self, findings: int) -> str:
        return (
            f"{self.streak} pass(es) in a row changed something and found the same "
            f"{findings} finding(s): the next pass waits {self.wait:.0f}s unless an urgent "
            "event asks for one"
        )

    def entry(self) -> dict[str, Any]:
        """The journal entry's level and fields (kind pass-backoff)."""
        return {"level": "warning", "fields": {"PASSES": self.streak, "WAIT_S": f"{self.wait:.0f}"}}


class RepairLoopGuard:
    def __init__(self, base: float = BASE, cap: float = CAP) -> None:
        self.base, self.cap = base, cap
        self._acted = False
        self._findings: Optional[frozenset[Hashable]] = None
        self.streak = 0

    def after_pass(
        self, acted: bool, findings: frozenset[Hashable], prompt: bool = True
    ) -> Verdict:
        """Record a pass (`acted`: it changed or tried to change something; `findings`:
        what it found, by identity; `prompt`: its marks began within PROMPT of the
        previous pass's end); the wait before the next non-urgent pass."""
        same = bool(findings) and findings == self._findings
        fruitless = self._acted and same and prompt
        self.streak = self.streak + 1 if fruitless else 0
        self._acted, self._findings = acted, findings
        if not self.streak or not acted:
            return Verdict(0.0, self.streak)
        return Verdict(min(self.base * 2.0 ** (self.streak - 1), self.cap), self.streak)
