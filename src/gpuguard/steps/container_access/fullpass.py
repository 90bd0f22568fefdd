"""The container access step's pass: observe, reconcile, act, once.

0. An urgent pass (a reload's end, start-up, a reconnection) first re-grants the last
   pass's containers in place (fastpaths.repair_known): losses are likely, and they
   are known without a walk.
1. Observe: the kubepods tree walked, each GPU container's entitlement and its
   layout's verdicts read in a worker thread (observe.py); a denial the scope's
   DeviceAllow= already covers judged again once systemd's apply has settled
   (settle.py).
2. Reconcile: the pure audit (reconcile.py), each container's re-grant planned by its
   layout; what a layout holds back now (v2: the in-place back-off).
3. Act: the re-grants in place first, before anything slower (journaling the findings
   is one message each: 4 per container after a reload); then the findings; then the
   durable grants (each scope's DeviceAllow=, with what its layout does around it),
   the remedies that are no grant (a report, a restart), and the drop-ins of scopes
   that are gone.
"""

from __future__ import annotations

import asyncio
import os
from typing import TYPE_CHECKING, Optional, Sequence

from gpuguard.actuate.containers import ContainerStopper
from gpuguard.actuate.dropins import list_dropins
from gpuguard.journal.conditions import FindingId, finding_id, log_findings
from gpuguard.model import Action, Finding, Outcome
from gpuguard.steps.container_access.actuate import decline_or_restart, dropin_remove_change
from gpuguard.steps.container_access.devcgroup import DeviceCgroup
from gpuguard.steps.container_access.durable import keep_open, plan_dropin_removal, plan_durable
from gpuguard.steps.container_access.fastpaths import repair_known
from gpuguard.steps.container_access.inplace import FINDING_BACKOFF, FINDING_UNEXPECTED
from gpuguard.steps.container_access.observe import learn_durable
from gpuguard.steps.container_access.reconcile import (
    FINDING_CONFLICT,
    FINDING_MISSING,
    FINDING_STALE,
    FINDING_UNATTRIBUTED,
    RECONCILER,
    RestartContainer,
    UnitDeviceAllow,
    V2ReportOnly,
    stray_findings,
    unreadable_findings,
)
from gpuguard.steps.container_access.settle import confirm
from gpuguard.steps.container_access.view import AccessView

if TYPE_CHECKING:
    from gpuguard.engine.passes import PassContext, Services
    from gpuguard.steps.container_access.state import AccessState

# Lasting states gpuguard cannot end itself: journaled when they appear, change or clear.
CONDITION_KINDS = frozenset(
    {
        FINDING_MISSING,
        FINDING_STALE,
        FINDING_CONFLICT,
        FINDING_UNEXPECTED,
        FINDING_BACKOFF,
        FINDING_UNATTRIBUTED,
    }
)


async def run_pass(s: AccessState, svc: Services, ctx: PassContext) -> None:
    devices = svc.config.devices
    carried, carried_findings, logged = s.carried.take()  # journaled when done
    ctx.outcomes += carried
    ctx.findings += carried_findings
    fast_units: frozenset[str] = frozenset()
    # 0. Only where losses are likely: the look costs ~0.1 ms per known container on
    # the loop, and a burst of new scopes brings a pass every few hundred ms that the
    # full pass serves alone.
    if devices.regrant and ctx.work.urgent:
        repaired, fast_units = await repair_known(s, svc, ctx)
        logged |= repaired  # what the fast path journaled is not journaled again
    view = await observe(s, svc, ctx)
    if view is None:
        return
    findings, actions = reconcile(s, view, svc)
    outcomes = await grant_in_place(s, view, actions, svc) if devices.regrant else []
    journal(s, findings, logged, svc, ctx)
    ctx.gauges["gpu_containers"] = sum(1 for e in view.entitlements.values() if e.is_gpu_container)
    if not devices.regrant:
        return
    outcomes += await make_durable(s, view, actions, fast_units, svc, ctx)
    for cg in s.cgroups.all:
        cg.end_of_pass(view)
    for a in actions:
        if isinstance(a, (V2ReportOnly, RestartContainer)):
            outcomes.append(await remedy(s, a, svc))
    outcomes += await remove_dropins(s, view, svc)
    for o in outcomes:
        svc.log.outcome(o)
    ctx.outcomes += outcomes


async def observe(s: AccessState, svc: Services, ctx: PassContext) -> Optional[AccessView]:
    """The pass's view: None when the driver is not loaded (nothing can be granted)."""
    snapshot = ctx.host(svc)
    # The GPUs are needed to judge conflicts: without them every GPU node in a
    # container's /dev would be entitled (the start-up pass used to run before any
    # step had loaded them). A systemd event reuses the last pass's, without waiting.
    inventory = await ctx.device_inventory()
    plugins = svc.config.device_plugin.socket_dir
    view = await asyncio.to_thread(s.observer.observe, svc.root, inventory, snapshot, plugins)
    if view is None:
        ctx.unknown.append(
            "the NVIDIA driver has registered no device (no nvidia major in "
            "/proc/devices): GPU containers' access could not be judged"
        )
        return None
    # A node the scope's DeviceAllow= grants may be caught mid-apply: judged again.
    view = await confirm(view, s.durable, svc.root, svc.systemd, svc.log, s.cgroups.of, s.settle)
    if snapshot.dropped_entries[1]:
        svc.log.warning(snapshot.dropped_entries[1])
    return view


def reconcile(
    s: AccessState, view: AccessView, svc: Services
) -> tuple[tuple[Finding, ...], tuple[Action, ...]]:
    """The audit, and each layout's hold-backs (a finding each)."""
    findings, actions = s.audit(view, remedy=svc.config.devices.v2_remedy)
    findings += unreadable_findings(view.containers, view.broken)
    findings += stray_findings(view.strays)
    now = s.clock()
    for cg in s.cgroups.all:
        actions, held = cg.hold_back(actions, view, now)
        findings += held
    return findings, actions


async def grant_in_place(
    s: AccessState, view: AccessView, actions: Sequence[Action], svc: Services
) -> list[Outcome]:
    """Each layout's re-grants in place (each read back before it counts as done)."""
    outcomes = []
    for cg in s.cgroups.all:
        outcomes += await cg.grant(actions, view, svc)
    return outcomes


def journal(
    s: AccessState,
    findings: Sequence[Finding],
    logged: frozenset[FindingId],
    svc: Services,
    ctx: PassContext,
) -> None:
    """The findings once per pass (not those a fast path journaled); lasting ones when
    they appear, change or clear (journal/conditions.py). A loss this pass repairs is an
    event, journaled each time it happens; one left as it is (observe mode, Regrant=no)
    is a state, journaled once while it lasts."""
    events = [f for f in findings if f.kind not in CONDITION_KINDS]
    repairs = svc.config.devices.regrant and svc.apply.choose(
        made=lambda: True, described=lambda: False
    )
    if not repairs:
        scope = f"{RECONCILER}:events"
        log_findings(svc.log, s.conditions, scope, events, already=logged, lasting_clears=True)
    else:
        for f in events:
            if finding_id(f) not in logged:
                svc.log.finding(f)
    lasting = [f for f in findings if f.kind in CONDITION_KINDS]
    log_findings(svc.log, s.conditions, RECONCILER, lasting, already=logged)
    ctx.findings += [f for f in findings if finding_id(f) not in logged]


async def make_durable(
    s: AccessState,
    view: AccessView,
    actions: Sequence[Action],
    fast_units: frozenset[str],
    svc: Services,
    ctx: PassContext,
) -> list[Outcome]:
    """Each scope's DeviceAllow=: for the nodes the audit found denied, and for what a
    GPU container was given that its scope does not carry yet (a reload never wipes it
    then). DurableGrants=no: none at all. Not for the scopes a fast path is granting,
    nor those it set moments ago (`fast_units`: systemd may still apply them)."""
    durable_grants, sd = svc.config.devices.durable_grants, svc.systemd
    # the audit's DeviceAllow= (none under DurableGrants=no, none for the scopes a fast
    # path set) and the in-place repairs they come with
    asked = tuple(
        a
        for a in actions
        if not isinstance(a, UnitDeviceAllow) or (durable_grants and a.unit not in fast_units)
    )
    asked_units = [a for a in asked if isinstance(a, UnitDeviceAllow)]
    units = keep_open(view, asked_units, s.durable, asked)  # never narrow (durable.py)
    outcomes: list[Outcome] = []
    if durable_grants and sd is not None:
        await learn_durable(sd, view, svc.root, s.durable, s.scopes.busy())
        planned = ctx.host(svc).planned.links  # a dry-run's: made, in the real run
        # Each distinct link looked up once: 200 containers share a dozen nodes, and
        # a lookup per container's node cost ~15 ms a pass during a burst of starts.
        named = {n.dev_char for e in view.entitlements.values() for n in e.nodes}
        links = {d for d in named if d in planned or os.path.lexists(svc.root.path(d))}
        units = list(plan_durable(view, asked, s.durable, links))
        busy = s.busy()  # new scopes the fast path is handling get their grant there
        units = [a for a in units if a.unit not in busy]
        repairing = frozenset(a.unit for a in units)
        for cg in s.cgroups.all:
            outcomes += cg.before_durable(view, repairing, svc)
    by_id = {c.container_id: c for c in view.containers}
    mine: dict[int, list[UnitDeviceAllow]] = {id(cg): [] for cg in s.cgroups.all}
    plain: list[UnitDeviceAllow] = []  # a scope whose cgroup no layout serves
    for a in units:
        c = by_id.get(a.container_id)
        layout: Optional[DeviceCgroup] = s.cgroups.of(c) if c is not None else None
        (mine[id(layout)] if layout is not None else plain).append(a)
    made, alone = await asyncio.gather(
        asyncio.gather(*(cg.make_durable(mine[id(cg)], svc) for cg in s.cgroups.all)),
        asyncio.gather(*(s.cgroups.grant(a, svc, sd) for a in plain)),
    )
    return outcomes + [o for done in made for o in done] + list(alone)


async def remedy(s: AccessState, a: Action, svc: Services) -> Outcome:
    """A loss with no grant to make (V2Remedy=report, restart-container)."""
    rt = svc.config.runtime
    stopper = s.stopper or ContainerStopper(crictl=rt.crictl, cri_endpoint=rt.cri_endpoint)
    got = decline_or_restart(a, s.pod_restarts, s.clock(), stopper)
    return got if isinstance(got, Outcome) else await svc.apply.run_async(got)


async def remove_dropins(s: AccessState, view: AccessView, svc: Services) -> list[Outcome]:
    """The drop-ins of durable grants whose scopes are gone (systemd never removes
    them), whatever DurableGrants= says now."""
    live = {c.unit for c in view.containers if c.unit} | s.busy()
    return [
        await asyncio.to_thread(svc.apply.run, dropin_remove_change(gone, svc.root))
        for gone in plan_dropin_removal(list_dropins(svc.root), live)
    ]
