"""The vocabulary every reconciler and actuator shares: findings and actions.

Reconcilers are pure functions from a host snapshot to findings and actions;
actuators are the only code that writes. Both are frozen dataclasses so a pass's
plan can be logged, printed for --dry-run and handed to operator hooks as JSON.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping


@dataclass(frozen=True)
class Finding:
    """Something wrong (or worth knowing) about the host.

    `kind` is a stable name (e.g. ``checkpoint-stale-entry``); each kind has a fixed
    journald MESSAGE_ID (gpuguard.journal.log.MESSAGE_IDS) and a catalog entry in docs/.
    `fields` become structured journal fields (GPU_UUID, POD_UID, CONTAINER_ID, ...).
    """

    kind: str
    reconciler: str
    summary: str
    fields: Mapping[str, str] = field(default_factory=dict)
    severity: str = "warning"  # "info" | "warning" | "error"

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "reconciler": self.reconciler,
            "summary": self.summary,
            "severity": self.severity,
            "fields": dict(self.fields),
        }


@dataclass(frozen=True)
class Action:
    """A change an actuator may make. Subclasses carry the parameters of one kind.

    `reason` says why (it goes to the journal with the change); `target` names what
    is changed (a path, a unit, a container) for humans and dry-run output.
    """

    reconciler: str
    reason: str
    target: str

    @property
    def kind(self) -> str:
        raise NotImplementedError

    def describe(self) -> str:
        """One line for --dry-run and the journal."""
        return f"{self.kind} {self.target}: {self.reason}"

    def fields(self) -> Mapping[str, str]:
        """Structured journal fields for this action (GPU_UUID, POD_UID, ...)."""
        return {}

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "reconciler": self.reconciler,
            "target": self.target,
            "reason": self.reason,
            "fields": dict(self.fields()),
        }


@dataclass(frozen=True)
class Outcome:
    """What an actuator did with one action."""

    action: Action
    status: str  # "done" | "skipped" (already so) | "dry-run" | "declined" | "failed"
    detail: str = ""

    def to_json(self) -> dict[str, Any]:
        out = self.action.to_json()
        out.update(status=self.status, detail=self.detail)
        return out
