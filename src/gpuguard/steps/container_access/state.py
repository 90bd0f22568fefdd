"""What the container access step keeps across passes, in one object its three entry
points share (the pass, a reload's fast path, a new scope's grant: __init__.py).

- `durable`: unit -> the device numbers gpuguard set in its scope's DeviceAllow=
  (asked of systemd once per scope it had not seen); every grant records here;
- `carried`: what a fast path did and journaled between passes, added to the next
  pass's result (status file, metrics) without journaling it again;
- `cgroups`: the two layouts (devcgroup.py) and what each remembers (v1: the lists
  last seen intact; v2: programs read, bridges pending their DeviceAllow=, the in-place
  back-off);
- `observer`: entitlements by container process, the last pass's GPU containers;
- `scopes`: the new-scope queue (newscope.py); `resets`: a scope's DeviceAllow= set
  at runtime (resetscope.py); `watch`: device cgroups rewritten behind systemd's back
  (devwatch.py); `conditions`: lasting findings
  journaled on change; `pod_restarts`: V2Remedy=restart-container's budget;
- `last_reload`: what the last reload's fast path did (the status file).
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, AbstractSet, Callable, Optional, Sequence

from gpuguard.journal.conditions import Conditions, FindingId, Key, finding_id, finding_key
from gpuguard.model import Action, Finding, Outcome
from gpuguard.steps.container_access.cgroups import Cgroups
from gpuguard.steps.container_access.devwatch import DeviceWatch
from gpuguard.steps.container_access.durable import ReloadRepair, plan_durable
from gpuguard.steps.container_access.newscope import NewScopes
from gpuguard.steps.container_access.observe import AccessObserver
from gpuguard.steps.container_access.reconcile import RECONCILER, audit, unreadable_findings
from gpuguard.steps.container_access.resetscope import ScopeResets
from gpuguard.steps.container_access.settle import Settle, settle
from gpuguard.steps.container_access.view import AccessView

if TYPE_CHECKING:
    from gpuguard.actuate.containers import ContainerStopper
    from gpuguard.engine.passes import Services


class Carried:
    """Done between passes (a reload, a new scope) and journaled then."""

    def __init__(self) -> None:
        self.outcomes: list[Outcome] = []
        self.findings: list[Finding] = []
        self.ids: set[FindingId] = set()  # the findings' ids: not journaled again

    def outcome(self, o: Outcome) -> None:
        self.outcomes.append(o)

    def add(self, outcomes: Sequence[Outcome], findings: Sequence[Finding]) -> None:
        self.outcomes += outcomes
        self.findings += findings
        self.ids.update(finding_id(f) for f in findings)

    def take(self) -> tuple[list[Outcome], list[Finding], frozenset[FindingId]]:
        """Everything carried, for a pass's result; empty again after."""
        out = (list(self.outcomes), list(self.findings), frozenset(self.ids))
        self.outcomes.clear()
        self.findings.clear()
        self.ids.clear()
        return out


class AccessState:
    def __init__(
        self,
        clock: Callable[[], float] = time.monotonic,
        stopper: Optional[ContainerStopper] = None,  # default: from the configuration
    ) -> None:
        self.clock = clock
        self.stopper = stopper
        self.durable: dict[str, set[str]] = {}
        self.carried = Carried()
        self.cgroups = Cgroups(self.durable, self.carried.outcome, clock)
        self.observer = AccessObserver(self.cgroups)
        self.scopes = NewScopes(
            plan_durable,
            self.cgroups.grant,
            self.durable,
            self.carried.outcome,
            admits_all=self.cgroups.admits_all,
        )
        self.resets = ScopeResets(
            self.durable,
            self.cgroups.grant,
            self.carried.outcome,
            lambda: [p for _cg, pairs in self.observer.known for p in pairs],
            self.scopes.busy,
        )
        self.watch = DeviceWatch(
            lambda: self.observer.known,
            lambda: self.settle,
            self.report,
            self.carried.add,
        )
        self.conditions = Conditions()
        self.pod_restarts: dict[str, float] = {}  # pod UID -> when we last stopped one
        self.settle: Settle = settle  # how a covered denial waits for systemd's apply
        self.last_reload: Optional[ReloadRepair] = None
        self.followup: Optional[asyncio.Future[None]] = None  # after a reload's bridges

    def busy(self) -> AbstractSet[str]:
        """Scopes a fast path is granting on its own: the pass leaves them alone."""
        out = set(self.scopes.busy())
        for cg in self.cgroups.all:
            out |= cg.busy()
        return out

    def audit(
        self, view: AccessView, *, remedy: str = "report"
    ) -> tuple[tuple[Finding, ...], tuple[Action, ...]]:
        """The pure audit of `view`, each container's re-grant planned by its layout."""
        return audit(
            view.containers,
            view.entitlements,
            view.access,
            cgroup_of=self.cgroups.of,
            device_rules=view.rules,
            remedy=remedy,
            plugin_containers=view.plugin_containers,
            deniers=view.deniers,
        )

    def report(
        self,
        view: AccessView,
        outcomes: Sequence[Outcome],
        svc: Services,
        audited: Optional[tuple[Finding, ...]] = None,
    ) -> tuple[Finding, ...]:
        """The journal after a fast path's writes: the same audit as a full pass
        (findings with their causes; `audited`: that audit's findings when the caller
        has them), then one entry per change."""
        findings = audited
        if findings is None:
            findings, _ = self.audit(view)
        findings += unreadable_findings(view.containers, view.broken)
        # Nothing is repaired (observe mode, Regrant=no): a loss is a state, journaled
        # when it appears or changes (fullpass.journal), not again at every event.
        repairs = svc.config.devices.regrant and svc.apply.choose(
            made=lambda: True, described=lambda: False
        )
        held = {} if repairs else self.held()
        for f in findings:
            if held.get(finding_key(f)) != f"{f.severity}: {f.summary}":
                svc.log.finding(f)
        for o in outcomes:
            svc.log.outcome(o)
        return findings

    def held(self) -> dict[Key, str]:
        """The findings the full passes journaled and that still hold, by key."""
        return {
            **self.conditions.holds(f"{RECONCILER}:events"),
            **self.conditions.holds(RECONCILER),
        }

    def late_findings(self, view: AccessView, svc: Services) -> None:
        """What a reload's follow-up found, journaled now, for the next pass's result."""
        self.carried.findings.extend(self.report(view, (), svc))
