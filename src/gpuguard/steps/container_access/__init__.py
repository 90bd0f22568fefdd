"""The container_access step (F2): GPU containers keep exactly the devices they were given.

Per pass: find GPU containers, read what their cgroup admits, and
1. re-grant what is denied by the fastest path first: a direct write to the v1
   devices.allow (microseconds per container), so CUDA works again at once;
2. then make grants durable: a runtime DeviceAllow=/dev/char/MAJ:MIN on the
   container's systemd scope, so the next daemon-reload/reexec re-applies them
   instead of wiping them. This is also done for containers whose access is still
   intact, as soon as they are seen, so a reload never wipes them in the first place.
   A new scope does not wait for a pass: `on_new_scope` grants it on its own
   (newscope.py), and the pass leaves the scopes queued there alone.
After a daemon-reload, `on_reload` re-grants the last pass's v1 GPU containers at once,
inline on the loop, before the pass that follows (or the one running) goes on.
Entitlements (what a container was given) are read once per container process and
cached; a pass after a reload only re-reads devices.list.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import os
import time
from typing import TYPE_CHECKING, Callable, Optional, Sequence

from gpuguard.actuate.containers import ContainerStopper
from gpuguard.actuate.dropins import list_dropins
from gpuguard.devices.nodes import GpuLike
from gpuguard.host.threadclock import thread_clock
from gpuguard.journal.conditions import Conditions, FindingId, finding_id, log_findings
from gpuguard.model import Action, Finding, Outcome
from gpuguard.steps.container_access.actuate import (
    apply_device_allow,
    apply_dropin_remove,
    apply_program_replace,
    confirm_v1,
    decline_or_restart,
    write_v1,
)
from gpuguard.steps.container_access.bridge import Bridges
from gpuguard.steps.container_access.durable import (
    ReloadRepair,
    plan_dropin_removal,
    plan_durable,
)
from gpuguard.steps.container_access.inplace import (
    FINDING_BACKOFF,
    FINDING_UNEXPECTED,
    Backoff,
    hold_back,
)
from gpuguard.steps.container_access.newscope import NewScopes
from gpuguard.steps.container_access.observe import AccessObserver, AccessView, learn_durable
from gpuguard.steps.container_access.reconcile import (
    FINDING_CONFLICT,
    FINDING_MISSING,
    FINDING_STALE,
    CgroupV1Allow,
    RestartContainer,
    UnitDeviceAllow,
    V2ProgramReplace,
    V2ReportOnly,
    audit,
    unreadable_findings,
)
from gpuguard.steps.container_access.reload import regrant, sweep_v1
from gpuguard.steps.container_access.settle import confirm, outside_apply, settle
from gpuguard.steps.registry import CONTAINER_ACCESS

if TYPE_CHECKING:
    from gpuguard.engine.passes import PassContext, Services
    from gpuguard.host.systemd import Systemd

NAME = CONTAINER_ACCESS
# Lasting states gpuguard cannot end itself: journaled when they appear, change or clear.
CONDITION_KINDS = frozenset(
    {FINDING_MISSING, FINDING_STALE, FINDING_CONFLICT, FINDING_UNEXPECTED, FINDING_BACKOFF}
)


class ContainerAccessStep:
    def __init__(
        self,
        clock: Callable[[], float] = time.monotonic,
        stopper: Optional[ContainerStopper] = None,  # default: from the configuration
    ) -> None:
        self.observer = AccessObserver()
        self.stopper = stopper
        self.durable: dict[str, set[str]] = {}  # unit -> numbers in its DeviceAllow=
        self.clock = clock
        self.pod_restarts: dict[str, float] = {}  # pod UID -> when we last stopped one
        self.conditions = Conditions()
        self.backoff = Backoff()  # failed in-place replacements on v2 (inplace.py)
        self.settle = settle  # how a covered denial waits for systemd's apply to end
        # Done between passes (a reload, a new scope) and journaled then: the next pass
        # adds them to its result (status file, metrics) without journaling them again.
        self._carried: list[Outcome] = []
        self._carried_findings: list[Finding] = []
        self._carried_ids: set[FindingId] = set()
        self.last_reload: Optional[ReloadRepair] = None
        self.scopes = NewScopes(plan_durable, self._unit, self.durable, self._carried.append)
        # v2 scopes: access back before their DeviceAllow= (bridge.py)
        self.bridges = Bridges(self.backoff, clock, self.durable, self._unit, self._carried.append)
        self._followup: Optional[asyncio.Future[None]] = None  # after a reload's bridges

    def on_reload(self, svc: Services, signal: float) -> None:
        """systemd ended a daemon-reload/reexec (`signal`: when that arrived): re-grant
        the last pass's v1 GPU containers now, before anything else runs on the loop, and
        bridge its v2 scopes that lost a node (a task sets their DeviceAllow= next)."""
        if not svc.config.devices.regrant:
            return
        clock0 = thread_clock()
        known = self.observer.known_v1
        swept = sweep_v1(known, self.observer.read_v1, self.durable, dry_run=svc.dry_run)
        v1_done = [(w.container.container_id, w.at, w.outcome()) for w in swept.writes]
        scopes = svc.config.devices.durable_grants and svc.systemd is not None
        v2 = self.observer.known_v2_scopes if scopes else ()
        bridged, v2_access = self.bridges.sweep(v2, svc, record=False)
        spent = clock.since(clock0) if clock0 and (clock := thread_clock()) else None
        # every v1 write read back now that all are made (v2 bridges verify themselves)
        written = {cid: (t, confirm_v1(o)) for cid, t, o in v1_done}
        written.update(bridged)
        access = {**swept.access, **v2_access}
        if v2:  # more looks at the others, then DeviceAllow= for each bridge (bridge.py)
            rest = [p for p in v2 if p[0].container_id not in written]
            failed = {cid for cid, (_t, o) in written.items() if o.status == "failed"}
            retry = [p for p in v2 if p[0].container_id in failed]
            report = functools.partial(self._late_findings, svc=svc)
            self._followup = asyncio.ensure_future(self.bridges.follow_up(svc, rest, retry, report))
        known = (*known, *v2)
        fast = AccessView(
            tuple(c for c, _ in known),
            {c.key: e for c, e in known},
            access,
            swept.rules,
            swept.broken,
        )
        times = [t for t, _ in written.values()]
        self.last_reload = ReloadRepair(
            signal,
            min(times, default=None),
            max(times, default=None),
            len(written),
            len(fast.containers),
            cpu_ms=round(spent.on_cpu * 1000, 2) if spent else None,
            cpu_wait_ms=round(spent.waiting * 1000, 2) if spent else None,
            restored=max((t for t, o in written.values() if o.status == "done"), default=None),
        )
        if written:
            outcomes = {cid: o for cid, (_t, o) in written.items()}
            findings = self._report(fast, list(outcomes.values()), svc)
            self._carried += outcomes.values()
            self._carried_findings += findings
            self._carried_ids.update(finding_id(f) for f in findings)

    def fast_status(self) -> dict[str, object]:
        """The fast paths' last figures, for the status file (and bench/)."""
        out: dict[str, object] = {"new_scopes": self.scopes.status()}
        if self.last_reload is not None:
            out["reload"] = self.last_reload.to_json()
        return out

    def on_new_scope(
        self, svc: Services, unit: str, gpus: Sequence[GpuLike], again: Callable[[str], None]
    ) -> None:
        """A container scope started: its durable grant on its own (newscope.py)."""
        self.scopes.announce(svc, unit, gpus, again)

    async def __call__(self, svc: Services, ctx: PassContext) -> None:
        cfg = svc.config
        ctx.outcomes += self._carried
        ctx.findings += self._carried_findings
        carried_ids = frozenset(self._carried_ids)
        self._carried.clear()
        self._carried_findings.clear()
        self._carried_ids.clear()
        # What the fast path logged is not logged again by the full pass: once per pass.
        logged, fast_units = frozenset[FindingId](), frozenset[str]()
        # Only where losses are likely (a reload's end, start-up, a reconnection): the
        # look costs ~0.1 ms per known container on the loop, and a burst of new
        # scopes brings a pass every few hundred ms that the full pass serves alone.
        if cfg.devices.regrant and ctx.work.urgent:
            logged, fast_units = await self._fast_repair(svc, ctx)
        logged |= carried_ids
        snapshot = ctx.host(svc)
        # The GPUs are needed to judge conflicts: without them every GPU node in a
        # container's /dev would be entitled (the start-up pass used to run before any
        # step had loaded them). A systemd event reuses the last pass's, without waiting.
        inventory = await ctx.device_inventory()
        view = await asyncio.to_thread(
            self.observer.observe, svc.root, inventory, snapshot, cfg.device_plugin.socket_dir
        )
        if view is None:
            return
        # A node the scope's DeviceAllow= grants may be caught mid-apply: judged again.
        view = await confirm(view, self.durable, svc.root, svc.systemd, svc.log, self.settle)
        if snapshot.dropped_entries[1]:
            svc.log.warning(snapshot.dropped_entries[1])
        findings, actions = audit(
            view.containers,
            view.entitlements,
            view.access,
            device_rules=view.rules,
            restart_on_v2=cfg.devices.v2_remedy == "restart-container",
            inplace_on_v2=cfg.devices.v2_remedy == "inplace",
            plugin_containers=view.plugin_containers,
        )
        findings += unreadable_findings(view.containers, view.broken)
        actions, held = hold_back(actions, view.programs, self.backoff.failures, self.clock())
        findings += held
        # 1. the fast path: direct cgroup writes, before anything slower (logging the
        # findings is one journal message each: 4 per container after a reload)
        outcomes = []
        if cfg.devices.regrant:
            wrote = [self._v1(a, svc) for a in actions if isinstance(a, CgroupV1Allow)]
            outcomes = [confirm_v1(o) for o in wrote]  # read back once all are written
        # A loss this pass repairs is an event, journaled each time it happens; one left
        # as it is (observe mode, Regrant=no) is a state, journaled once while it lasts.
        events = [f for f in findings if f.kind not in CONDITION_KINDS]
        if svc.dry_run or not cfg.devices.regrant:
            scope = f"{NAME}:events"
            log_findings(
                svc.log, self.conditions, scope, events, already=logged, lasting_clears=True
            )
        else:
            for f in events:
                if finding_id(f) not in logged:
                    svc.log.finding(f)
        log_findings(
            svc.log,
            self.conditions,
            NAME,
            [f for f in findings if f.kind in CONDITION_KINDS],
            already=logged,
        )
        ctx.findings += [f for f in findings if finding_id(f) not in logged]
        ctx.gauges["gpu_containers"] = sum(
            1 for e in view.entitlements.values() if e.is_gpu_container
        )
        if not cfg.devices.regrant:
            return
        # 2. durable grants through systemd
        systemd = svc.systemd
        # DurableGrants=no: the direct writes only, no DeviceAllow= at all
        units = [
            a
            for a in actions
            if isinstance(a, UnitDeviceAllow)
            and cfg.devices.durable_grants
            and a.unit not in fast_units  # set moments ago; systemd may still apply it
        ]
        if cfg.devices.durable_grants and systemd is not None:
            await learn_durable(systemd, view, svc.root, self.durable, self.scopes.busy())
            planned = snapshot.planned.links  # a dry-run's: made, in the real run
            # Each distinct link looked up once: 200 containers share a dozen nodes, and
            # a lookup per container's node cost ~15 ms a pass during a burst of starts.
            named = {n.dev_char for e in view.entitlements.values() for n in e.nodes}
            links = {d for d in named if d in planned or os.path.lexists(svc.root.path(d))}
            units += plan_durable(view, tuple(units), self.durable, links)
            # New scopes the fast path is handling get their grant there, once.
            busy = self.scopes.busy() | self.bridges.in_flight  # a reload's follow-up too
            units = [a for a in units if a.unit not in busy]
            # bridges left attached, then a bridge for each scope about to be repaired
            outcomes += self.bridges.stale(view, svc)
            repairing = {a.unit for a in units}
            denied = dataclasses.replace(
                view, containers=tuple(c for c in view.containers if c.unit in repairing)
            )
            outcomes += [o for _t, o in self.bridges.attach(denied, svc).values()]
        self.bridges.release()
        claimed = self.bridges.claim({a.unit for a in units})
        outcomes += await self.bridges.grant_then_detach(units, svc, claimed)
        self.backoff.keep_only({str(c.cgroup_v2) for c in view.containers if c.cgroup_v2})
        for a in actions:
            if isinstance(a, V2ProgramReplace):
                o = await asyncio.to_thread(apply_program_replace, a, svc.root, dry_run=svc.dry_run)
                if not svc.dry_run:
                    ok = o.status == "done"
                    ids = view.programs.get(a.container_id)
                    self.backoff.record(a.cgroup_dir, ids, ok, o.detail, self.clock())
                outcomes.append(o)
            elif isinstance(a, (V2ReportOnly, RestartContainer)):
                outcomes.append(await self._other(a, svc))
        # 3. the drop-ins of durable grants whose scopes are gone (systemd never removes
        # them), whatever DurableGrants= says now
        live = {c.unit for c in view.containers if c.unit}
        live |= self.scopes.busy() | self.bridges.in_flight
        for gone in plan_dropin_removal(list_dropins(svc.root), live):
            outcomes.append(
                await asyncio.to_thread(apply_dropin_remove, gone, svc.root, dry_run=svc.dry_run)
            )
        for o in outcomes:
            svc.log.outcome(o)
        ctx.outcomes += outcomes

    async def _fast_repair(
        self, svc: Services, ctx: PassContext
    ) -> tuple[frozenset[FindingId], frozenset[str]]:
        """Right after a daemon-reload every millisecond counts: re-check the GPU
        containers the last pass knew and restore their grants before walking the tree,
        and before building the report (800 findings cost more than 200 writes): v1
        grants written back, v2 scopes given their DeviceAllow= (systemd rebuilds the
        program: the v2 repair). Inline on the loop, not in a thread: kernfs reads and
        writes of a few hundred bytes, and a bpf(2) query per v2 container (each program
        parsed once), ~15 ms for 200 containers, and nothing is more urgent.
        (`on_reload` does the v1 part as soon as systemd's signal arrives; this catches
        what was wiped since, e.g. by a reload whose end the bus never delivered.)
        Returns the findings it logged and the units it set DeviceAllow= on."""
        fast = self._settled(self.observer.fast_view())
        # every container written before any is read back (the first has access at once)
        wrote = [
            regrant(c, fast.entitlements[c.key], fast.access, dry_run=svc.dry_run)
            for c in fast.containers
        ]
        written = {w.container.container_id: confirm_v1(w.outcome()) for w in wrote if w}
        # v2 scopes lacking a node get their DeviceAllow= here (durable grants on); other
        # v2 containers wait for the full pass (in-place replacement, with its back-off).
        scopes = svc.config.devices.durable_grants and svc.systemd is not None
        denied_v2 = scopes and any(
            c.cgroup_v1_devices is None
            and c.unit is not None
            and any(
                fast.access.get((c.container_id, n.numbers)) is False
                for n in fast.entitlements[c.key].nodes
            )
            for c in fast.containers
        )
        if not written and not denied_v2 and not self.bridges.pending:
            return frozenset(), frozenset()
        audited, actions = audit(
            fast.containers, fast.entitlements, fast.access, device_rules=fast.rules
        )
        units: list[UnitDeviceAllow] = []
        bridged: list[Outcome] = []
        if scopes:
            v2 = {c.container_id for c in fast.containers if c.cgroup_v1_devices is None}
            units = [a for a in actions if isinstance(a, UnitDeviceAllow) and a.container_id in v2]
            # first the bridges (access back in ms), then DeviceAllow= for them and for
            # the bridges made on the reload's signal
            bridged = [o for _t, o in self.bridges.attach(fast, svc).values()]
            planned = {a.unit for a in units}
            units += [a for u, (_b, a) in self.bridges.pending.items() if u not in planned]
            self.bridges.release()
        done = await self.bridges.grant_then_detach(units, svc, self.bridges.claim())
        outcomes = [*written.values(), *bridged, *done]
        findings = self._report(fast, outcomes, svc, audited)
        ctx.findings += findings
        ctx.outcomes += outcomes
        return frozenset(finding_id(f) for f in findings), frozenset(a.unit for a in units)

    def _settled(self, fast: AccessView) -> AccessView:
        """`fast` with the denials the scope's DeviceAllow= covers left to the pass."""
        access = outside_apply(
            fast.containers, fast.entitlements, fast.access, self.durable, fast.systemd_denies
        )
        return fast if access is None else dataclasses.replace(fast, access=access)

    def _late_findings(self, view: AccessView, svc: Services) -> None:
        self._carried_findings.extend(self._report(view, (), svc))

    def _report(
        self,
        fast: AccessView,
        outcomes: Sequence[Outcome],
        svc: Services,
        audited: Optional[tuple[Finding, ...]] = None,
    ) -> tuple[Finding, ...]:
        """The journal after the writes: the same audit as a full pass (findings with
        their causes; `audited`: that audit's findings when the caller has them), then
        one entry per change."""
        findings = audited
        if findings is None:
            findings, _ = audit(
                fast.containers, fast.entitlements, fast.access, device_rules=fast.rules
            )
        findings += unreadable_findings(fast.containers, fast.broken)
        for f in findings:
            svc.log.finding(f)
        for o in outcomes:
            svc.log.outcome(o)
        return findings

    def _v1(self, a: CgroupV1Allow, svc: Services) -> Outcome:
        """The write only: its `done` stands once `confirm_v1` has read it back."""
        return write_v1(a, dry_run=svc.dry_run)

    async def _unit(self, a: UnitDeviceAllow, svc: Services, sd: Optional[Systemd]) -> Outcome:
        outcome = await apply_device_allow(a, sd, svc.root, dry_run=svc.dry_run)
        if outcome.status == "done":
            self.durable.setdefault(a.unit, set()).update(a.numbers)
        return outcome

    async def _other(self, a: Action, svc: Services) -> Outcome:
        rt = svc.config.runtime
        stopper = self.stopper or ContainerStopper(crictl=rt.crictl, cri_endpoint=rt.cri_endpoint)
        return await decline_or_restart(a, self.pod_restarts, self.clock(), stopper, svc.dry_run)
