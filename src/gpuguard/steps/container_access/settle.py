"""A denial is a loss only once systemd's apply has settled.

systemd (re-)applies a scope's device policy as "deny all, then each DeviceAllow=
entry": at a daemon-reload or reexec, and at every `runc update` of a systemd-driver
container (the CPU manager's, every few seconds on a busy node), since runc re-sends
the scope's properties. A read of devices.list (or a probe on cgroup v2) that lands in
that window (0.02-8.8 ms here, bench/bench_apply_window.py) sees a container without
nodes its scope's DeviceAllow= already grants. Reporting that as a loss would be a false
report, and re-granting them a needless write.

So a denied node that gpuguard knows the scope's DeviceAllow= covers is judged again
after the apply has settled: a short wait (for the runtime's own writes), then one
call answered by systemd (single-threaded, it answers only between two applies), then
one re-read. What is still denied then is a real loss (e.g. an entry systemd could not
resolve) and is reported and repaired as before; what is admitted again is logged at
debug level only. Nodes the scope does not cover are never delayed.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from typing import TYPE_CHECKING, AbstractSet, Awaitable, Callable, Mapping, Optional, Sequence

from gpuguard.steps.container_access.view import AccessKey, AccessView, Readings

if TYPE_CHECKING:
    from gpuguard.devices.containers import ContainerCgroup
    from gpuguard.devices.entitlement import Entitlement
    from gpuguard.host.paths import Root
    from gpuguard.host.systemd import Systemd
    from gpuguard.journal.log import EventLog
    from gpuguard.steps.container_access.devcgroup import CgroupOf, DeviceCgroup

# Seconds: above the longest window seen (8.8 ms, load average 11), for the runtime's own
# writes; systemd's apply is awaited by the call that follows, however long it takes.
SETTLE_DELAY = 0.05

Settle = Callable[["Optional[Systemd]", str], Awaitable[None]]


def covered_denials(
    containers: Sequence[ContainerCgroup],
    entitlements: Mapping[tuple[str, str], Entitlement],
    access: Mapping[AccessKey, Optional[bool]],
    durable: Mapping[str, AbstractSet[str]],
) -> frozenset[AccessKey]:
    """(container_id, numbers) denied although the container's scope's DeviceAllow=
    (as gpuguard knows it: `durable`, unit -> numbers) grants them."""
    out = set()
    for c in containers:
        ent = entitlements.get(c.key)
        if c.unit is None or ent is None:
            continue
        granted = durable.get(c.unit, ())
        for n in ent.nodes:
            key = (c.container_id, n.numbers)
            if access.get(key) is False and n.numbers in granted:
                out.add(key)
    return frozenset(out)


def unknown(
    access: Mapping[AccessKey, Optional[bool]], keys: AbstractSet[AccessKey]
) -> dict[AccessKey, Optional[bool]]:
    """`access` with `keys` judged unknown (nothing is reported or done on unknown)."""
    return {k: (None if k in keys else v) for k, v in access.items()}


def outside_apply(
    containers: Sequence[ContainerCgroup],
    entitlements: Mapping[tuple[str, str], Entitlement],
    access: Mapping[AccessKey, Optional[bool]],
    durable: Mapping[str, AbstractSet[str]],
    systemd_denies: AbstractSet[AccessKey],
) -> Optional[dict[AccessKey, Optional[bool]]]:
    """Outside a pass (a reload's fast paths): `access` with the denials the scope's
    DeviceAllow= covers judged unknown, for the full pass's settled re-read, since a
    read inside systemd's deny-all-then-allow apply is no loss; None when there are
    none. On v2 systemd swaps whole programs (no such window): a node its own program
    denies (`systemd_denies`) is lost even where covered (bridge.py)."""
    covered = covered_denials(containers, entitlements, access, durable) - systemd_denies
    return unknown(access, covered) if covered else None


async def settle(sd: Optional[Systemd], unit: str) -> None:
    """Wait until an apply in progress has ended: the runtime's writes, then systemd's."""
    from gpuguard.host.systemd import SystemdError

    await asyncio.sleep(SETTLE_DELAY)
    if sd is not None:
        # The bus gone, or the unit with it: the re-read decides all the same.
        with contextlib.suppress(SystemdError):
            await sd.unit_path(unit)  # answered only once systemd is between two applies


def reread(
    root: Root, pairs: Sequence[tuple[ContainerCgroup, Entitlement]], cgroup_of: CgroupOf
) -> Readings:
    """Each container's verdicts read afresh by its layout (blocking: call from a
    thread). A container that went away or reads badly now is unknown: nothing is done
    for it this pass."""
    mine: dict[int, tuple[DeviceCgroup, list[tuple[ContainerCgroup, Entitlement]]]] = {}
    for c, ent in pairs:
        cg = cgroup_of(c)
        if cg is not None:
            mine.setdefault(id(cg), (cg, []))[1].append((c, ent))
    out = Readings()
    for cg, some in mine.values():
        r = cg.reread(root, some)
        out.access.update(r.access)
        out.rules.update(r.rules)
    return out


async def confirm(
    view: AccessView,
    durable: Mapping[str, AbstractSet[str]],
    root: Root,
    sd: Optional[Systemd],
    log: EventLog,
    cgroup_of: CgroupOf,
    wait: Settle = settle,
) -> AccessView:
    """`view` with every covered denial judged again after the apply has settled."""
    keys = covered_denials(view.containers, view.entitlements, view.access, durable)
    if not keys:
        return view
    ids = {cid for cid, _ in keys}
    pairs = [(c, view.entitlements[c.key]) for c in view.containers if c.container_id in ids]
    t0 = time.monotonic()
    await wait(sd, next(c.unit for c, _ in pairs if c.unit is not None))
    r = await asyncio.to_thread(reread, root, pairs, cgroup_of)
    fresh, rules = r.access, r.rules
    waited = (time.monotonic() - t0) * 1000
    for cid, numbers in sorted(keys):
        if fresh.get((cid, numbers)) is True:
            log.debug(
                f"container {cid[:12]}: {numbers} was denied while systemd re-applied its "
                f"scope's device policy and is admitted again {waited:.0f} ms later: not a loss"
            )
    stale = {(c.container_id, n.numbers) for c, ent in pairs for n in ent.nodes}
    access = {k: v for k, v in view.access.items() if k not in stale}
    access.update(fresh)
    return dataclasses.replace(view, access=access, rules={**view.rules, **rules})
