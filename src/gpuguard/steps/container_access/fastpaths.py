"""The re-grants that do not wait for a pass's walk: a reload's end, and an urgent pass
before it walks the tree. Both work on the last pass's GPU containers (the observer's
`known`), each re-granted by its layout (devcgroup.py), inline on the loop.

- `on_reload`: systemd ended a daemon-reload/reexec. Each known container is looked at
  and re-granted at once where it lost a node (v1: devices.allow written; v2: a bridge
  until its DeviceAllow=), before anything else runs on the loop; the journal's entries
  are built after the last write; what a layout does next (v2: more looks, then every
  bridge's DeviceAllow=) is a task.
- `repair_known`: an urgent pass (a reload's end, start-up, a reconnection) re-checks
  the known containers and restores their grants before walking the tree, and before
  building the report (800 findings cost more than 200 writes); it catches what was
  wiped since `on_reload`, e.g. by a reload whose end the bus never delivered.
A denial the scope's DeviceAllow= covers is left to the pass's settled re-read: a read
inside systemd's own deny-all-then-allow apply is no loss (settle.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
from typing import TYPE_CHECKING, Optional

from gpuguard.host.threadclock import thread_clock
from gpuguard.journal.conditions import FindingId, finding_id
from gpuguard.model import Outcome
from gpuguard.steps.container_access.devcgroup import DeviceCgroup, Written
from gpuguard.steps.container_access.durable import ReloadRepair
from gpuguard.steps.container_access.settle import outside_apply
from gpuguard.steps.container_access.view import AccessView, Readings

if TYPE_CHECKING:
    from gpuguard.engine.passes import PassContext, Services
    from gpuguard.steps.container_access.actions import UnitDeviceAllow
    from gpuguard.steps.container_access.state import AccessState


def on_reload(s: AccessState, svc: Services, signal: float) -> Optional[float]:
    """The known containers re-granted now (`signal`: when systemd's reload end
    arrived); returns when the last access it restored was back (None: none)."""
    if not svc.config.devices.regrant:
        return None
    clock0 = thread_clock()
    swept = [cg.sweep(pairs, svc) for cg, pairs in s.observer.known]
    spent = clock.since(clock0) if clock0 and (clock := thread_clock()) else None
    written: Written = {}
    r = Readings()
    for sw in swept:
        written.update(sw.written())  # v1's writes read back now that all are made
        r.access.update(sw.readings.access)
        r.rules.update(sw.readings.rules)
        r.broken.update(sw.readings.broken)
    report = functools.partial(s.late_findings, svc=svc)
    for sw in swept:
        if sw.follow_up is not None:  # more looks, then DeviceAllow= for each bridge
            s.followup = asyncio.ensure_future(sw.follow_up(written, report))
    looked = [p for sw in swept for p in sw.looked]
    fast = AccessView.of(tuple(c for c, _ in looked), {c.key: e for c, e in looked}, r)
    times = [t for t, _ in written.values()]
    s.last_reload = ReloadRepair(
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
        outcomes = [o for _t, o in written.values()]
        s.carried.add(outcomes, s.report(fast, outcomes, svc))
    return s.last_reload.restored


def settled(s: AccessState, fast: AccessView) -> AccessView:
    """`fast` with the denials the scope's DeviceAllow= covers left to the pass."""
    access = outside_apply(
        fast.containers, fast.entitlements, fast.access, s.durable, fast.systemd_denies
    )
    return fast if access is None else dataclasses.replace(fast, access=access)


async def repair_known(
    s: AccessState, svc: Services, ctx: PassContext
) -> tuple[frozenset[FindingId], frozenset[str]]:
    """Right after a daemon-reload every millisecond counts: the known containers
    re-checked (kernfs reads of a few hundred bytes, and a bpf(2) query per v2
    container, each program parsed once: ~15 ms for 200 containers, inline on the loop,
    not in a thread: nothing is more urgent) and re-granted in place, then the
    DeviceAllow= their layout sets at once (v2: systemd rebuilds the program: the
    repair). Returns the findings it journaled and the units it set DeviceAllow= on."""
    fast = settled(s, s.observer.fast_view(svc.root))
    quick: list[Outcome] = []
    wanted = False
    for cg in s.cgroups.all:
        outcomes, more = cg.regrant_fast(fast, svc)
        quick += outcomes
        wanted = wanted or more
    if not quick and not wanted:
        return frozenset(), frozenset()
    audited, actions = s.audit(fast)
    units: list[tuple[DeviceCgroup, list[UnitDeviceAllow]]] = [
        (cg, cg.durable_now(fast, actions, svc)) for cg in s.cgroups.all
    ]
    made = await asyncio.gather(*(cg.make_durable(us, svc) for cg, us in units if us))
    outcomes = [*quick, *(o for done in made for o in done)]
    findings = s.report(fast, outcomes, svc, audited)
    ctx.findings += findings
    ctx.outcomes += outcomes
    return frozenset(finding_id(f) for f in findings), frozenset(
        a.unit for _cg, us in units for a in us
    )
