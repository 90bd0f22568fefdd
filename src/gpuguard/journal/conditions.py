"""Conditions: report a state once when it appears or changes, and once when it clears.

Some findings describe a lasting state that gpuguard cannot end by itself (no GPU
inventory, a container set up without /dev/nvidia-uvm): logging them on every pass
(every few minutes, per container) buries what changed, and gets gpuguard muted. As in
node-problem-detector's condition manager, the latest state per key wins, and only a
transition is reported. One `Conditions` per owner (the daemon, a step), built once and
kept for the process's life; a one-shot command starts empty, so it reports everything.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Collection, Iterable, Mapping, Optional

from gpuguard.journal.log import EventLog
from gpuguard.model import Finding

Key = tuple[str, ...]
# A finding as logged: its key and its summary (a changed summary is a new finding).
FindingId = tuple[Key, str]

CLEARED_KIND = "condition-cleared"


@dataclass(frozen=True)
class Transition:
    key: Key
    state: Optional[str]  # the new state; None: the condition cleared
    previous: Optional[str]  # None: it is new


class Conditions:
    def __init__(self) -> None:
        self._scopes: dict[str, dict[Key, str]] = {}

    def set(self, scope: str, key: Key, state: Optional[str]) -> Optional[Transition]:
        """One condition: `state` now (None: it does not hold). The transition, if any."""
        held = self._scopes.setdefault(scope, {})
        previous = held.get(key)
        if state == previous:
            return None
        if state is None:
            del held[key]
        else:
            held[key] = state
        return Transition(key, state, previous)

    def update(self, scope: str, current: Mapping[Key, str]) -> list[Transition]:
        """Every condition of `scope` at once: those not in `current` have cleared."""
        gone = [k for k in self._scopes.get(scope, {}) if k not in current]
        changes = [self.set(scope, k, s) for k, s in current.items()]
        changes += [self.set(scope, k, None) for k in gone]
        return [t for t in changes if t is not None]

    def holds(self, scope: str) -> Mapping[Key, str]:
        return dict(self._scopes.get(scope, {}))


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
) -> None:
    """Log the findings that are new or changed since the last call for `scope`, and one
    entry for each earlier one that no longer holds. `already`: findings this pass has
    logged before (the container access fast path), recorded but not logged again."""
    by_key = {finding_key(f): f for f in findings}
    states = {k: f"{f.severity}: {f.summary}" for k, f in by_key.items()}
    for t in conditions.update(scope, states):
        if t.state is not None:
            if finding_id(by_key[t.key]) not in already:
                log.finding(by_key[t.key])
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
