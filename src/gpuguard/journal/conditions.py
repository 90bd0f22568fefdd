"""Conditions: report a state once when it appears or changes, and once when it clears.

Some findings describe a lasting state that gpuguard cannot end by itself (no GPU
inventory, a container set up without /dev/nvidia-uvm): logging them on every pass
(every few minutes, per container) buries what changed, and gets gpuguard muted. As in
node-problem-detector's condition manager, the latest state per key wins, and only a
transition is reported. One `Conditions` per owner (the daemon, a step), built once and
kept for the process's life; a one-shot command starts empty, so it reports everything.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Callable, Collection, Iterable, Mapping, Optional

from gpuguard.journal.log import EventLog
from gpuguard.model import Finding

Key = tuple[str, ...]
# A finding as logged: its key and its summary (a changed summary is a new finding).
FindingId = tuple[Key, str]

CLEARED_KIND = "condition-cleared"
REMINDER = 3600.0  # a state that lasts is journaled again at most this often


@dataclass(frozen=True)
class Transition:
    key: Key
    state: Optional[str]  # the new state; None: the condition cleared
    previous: Optional[str]  # None: it is new
    lasted: bool = True  # a clear: the state was seen by more than one update


class Conditions:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._scopes: dict[str, dict[Key, str]] = {}
        self._since: dict[tuple[str, Key], float] = {}  # when the state began
        self._told: dict[tuple[str, Key], float] = {}  # when it was last journaled
        self._updates: dict[tuple[str, Key], int] = {}  # updates in a row that saw it

    def set(self, scope: str, key: Key, state: Optional[str]) -> Optional[Transition]:
        """One condition: `state` now (None: it does not hold). The transition, if any."""
        held = self._scopes.setdefault(scope, {})
        previous = held.get(key)
        if state == previous:
            if state is not None:
                self._updates[(scope, key)] = self._updates.get((scope, key), 1) + 1
            return None
        lasted = self._updates.pop((scope, key), 1) > 1
        if state is None:
            del held[key]
            self._since.pop((scope, key), None)
            self._told.pop((scope, key), None)
        else:
            held[key] = state
            self._since[(scope, key)] = self._told[(scope, key)] = self.clock()
            self._updates[(scope, key)] = 1
        return Transition(key, state, previous, lasted)

    def update(self, scope: str, current: Mapping[Key, str]) -> list[Transition]:
        """Every condition of `scope` at once: those not in `current` have cleared."""
        gone = [k for k in self._scopes.get(scope, {}) if k not in current]
        changes = [self.set(scope, k, s) for k, s in current.items()]
        changes += [self.set(scope, k, None) for k in gone]
        return [t for t in changes if t is not None]

    def holds(self, scope: str) -> Mapping[Key, str]:
        return dict(self._scopes.get(scope, {}))

    def due(self, scope: str) -> list[tuple[Key, float]]:
        """The states of `scope` journaled more than REMINDER ago, with when each began;
        each counts as journaled now."""
        now, out = self.clock(), []
        for key in self._scopes.get(scope, {}):
            if now - self._told.get((scope, key), now) >= REMINDER:
                self._told[(scope, key)] = now
                out.append((key, self._since.get((scope, key), now)))
        return out


def finding_key(f: Finding) -> Key:
    """What a finding is about: its kind and subject (container, plugin, device)."""
    fields = f.fields
    return (
        f.kind,
        fields.get("CONTAINER_ID", "") or fields.get("PLUGIN", ""),
        fields.get("DEVICE", ""),
        fields.get("POD_UID", ""),
    )


def finding_id(f: Finding) -> FindingId:
    """A finding as logged: its key and what it says."""
    return (finding_key(f), f.summary)


def log_findings(
    log: EventLog,
    conditions: Conditions,
    scope: str,
    findings: Iterable[Finding],
    *,
    already: Collection[FindingId] = (),
    lasting_clears: bool = False,
) -> None:
    """Log the findings that are new or changed since the last call for `scope`, again
    at most once an hour while they last, and one entry for each earlier one that no
    longer holds. `already`: findings this pass has logged before (the container access
    fast path), recorded but not logged again. `lasting_clears`: only a finding seen by
    more than one call is said to clear (one repaired in the pass that found it has its
    repair in the journal already)."""
    by_key = {finding_key(f): f for f in findings}
    states = {k: f"{f.severity}: {f.summary}" for k, f in by_key.items()}
    for t in conditions.update(scope, states):
        if t.state is not None:
            if finding_id(by_key[t.key]) not in already:
                log.finding(by_key[t.key])
            continue
        if lasting_clears and not t.lasted:
            continue
        kind, subject, device, pod = t.key
        was = (t.previous or "").split(": ", 1)[-1]
        log.event(
            CLEARED_KIND,
            f"no longer so: {was}",
            level="info",
            fields={
                "GPUGUARD_RECONCILER": scope,
                "GPUGUARD_CLEARED_KIND": kind,
                "GPUGUARD_SUBJECT": subject or device or pod or "-",
            },
        )
    for key, since in conditions.due(scope):
        f = by_key[key]
        began = time.strftime("%H:%M", time.localtime(time.time() - (conditions.clock() - since)))
        log.finding(replace(f, summary=f"{f.summary} (still so, since {began})"))
