"""Cgroup v2 (devcgroup.py's DeviceCgroup): BPF device programs decide.

A container's verdicts come from the device programs the kernel runs for its cgroup,
read back (each once) and judged without a fork (devices/bpfread.py); a probe (one fork
per container) only where a program cannot be read or parsed, and never on the loop.

A container in a systemd scope is repaired by its scope's DeviceAllow= (planned for
every layout by reconcile.audit): systemd rebuilds the scope's program from it. Until
systemd has applied it, a bridge stands in for systemd's denying program (bridge.py):
a reload's sweep bridges each known scope that lost a node inline on the loop, an
urgent pass bridges before its walk, and the pass bridges each scope it repairs. A
scope-less container (the cgroupfs driver) has only its runtime's program: V2Remedy=
says whether it is replaced in place (inplace.py's checks and back-off), the container
restarted, or reported.

Which cgroup's programs decide for a container is `CgroupV2.program_dir`: the scope's
own with runc.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from pathlib import Path
from typing import TYPE_CHECKING, AbstractSet, Callable, Container, Mapping, Optional, Sequence

from gpuguard.devices.bpfread import BRIDGE_NAME, SYSTEMD_NAME, ProgramCache, judge
from gpuguard.devices.probe import probe_open, probe_open_all, query_device_programs
from gpuguard.model import Action, Finding, Outcome
from gpuguard.steps.container_access.actions import (
    RestartContainer,
    UnitDeviceAllow,
    V2ProgramReplace,
    V2ReportOnly,
)
from gpuguard.steps.container_access.actuate import apply_program_replace
from gpuguard.steps.container_access.bridge import Bridges
from gpuguard.steps.container_access.devcgroup import Grant, Report, Swept, Written
from gpuguard.steps.container_access.inplace import Backoff, hold_back
from gpuguard.steps.container_access.reconcile import CAUSE_REWRITE_V2, RECONCILER
from gpuguard.steps.container_access.settle import outside_apply
from gpuguard.steps.container_access.view import AccessKey, AccessView, Pair, Readings

if TYPE_CHECKING:
    from gpuguard.devices.containers import ContainerCgroup
    from gpuguard.devices.entitlement import Entitlement
    from gpuguard.devices.nodes import DeviceNode
    from gpuguard.devices.rules import DeviceRules
    from gpuguard.engine.passes import Services
    from gpuguard.host.paths import Root


def scope_verdicts(
    cache: ProgramCache,
    c: ContainerCgroup,
    cgroup_dir: Path,
    ent: Entitlement,
    ids: list[int],
    fd: Optional[int] = None,
) -> Optional[dict[AccessKey, bool]]:
    """Whether the device programs the kernel runs for `cgroup_dir` admit each node `c`
    was given (None: not readable, ask a probe); `ids` receives those programs' ids.
    `fd`: the cgroup's directory, open."""
    nodes = [(n.major, n.minor) for n in ent.nodes]
    verdicts = judge(cache, cgroup_dir, nodes, ids, fd)
    if verdicts is None:
        return None
    return {(c.container_id, n.numbers): verdicts[(n.major, n.minor)] for n in ent.nodes}


def systemd_denied(
    cache: ProgramCache, c: ContainerCgroup, ent: Entitlement, ids: Sequence[int]
) -> set[AccessKey]:
    """The nodes given to `c` that a program of systemd's among `ids` denies."""
    sd = [(i, cache.get(i)) for i in ids if cache.name(i) == SYSTEMD_NAME]
    if not sd:
        return set()
    return {
        (c.container_id, n.numbers)
        for n in ent.nodes
        if any(p and not cache.admits_rw(i, p, (n.major, n.minor)) for i, p in sd)
    }


class CgroupV2:
    """The v2 layout: programs read and judged, scopes bridged until their DeviceAllow=
    applies, scope-less programs replaced in place (with the back-off both share)."""

    def __init__(
        self,
        grant: Grant,
        durable: Mapping[str, AbstractSet[str]],
        clock: Callable[[], float] = time.monotonic,
        carry: Callable[[Outcome], None] = lambda o: None,
    ) -> None:
        self.grant_durably = grant  # the scope's DeviceAllow= (cgroups.py)
        self.durable = durable  # unit -> numbers gpuguard set in its DeviceAllow=
        self.clock = clock
        self.backoff = Backoff()  # failed in-place replacements and bridges (inplace.py)
        self.cache = ProgramCache()  # the pass's reads (its thread, its fast read)
        # the bridges, with their own cache for reads on the loop outside a pass
        self.bridges = Bridges(
            self.backoff, clock, grant, carry, dir_of=self.program_dir, look=self._look
        )

    def claims(self, c: ContainerCgroup) -> bool:
        # where a v1 devices cgroup exists it decides, also on a hybrid host, where the
        # kernel runs the cgroup2 programs too (cgroupv1.py)
        return c.cgroup_v2 is not None and c.cgroup_v1_devices is None

    def program_dir(self, c: ContainerCgroup) -> Path:
        """The cgroup whose device programs decide for the container's processes: its
        scope's (or its cgroupfs directory) with runc. The one place that says so: a
        runtime that confines the process in a sub-cgroup with a program of its own
        (crun's SCOPE/container) is chosen here."""
        assert c.cgroup_v2 is not None, "a container of this layout"
        return c.cgroup_v2

    # -- read the verdicts --------------------------------------------------------

    def read(
        self,
        root: Root,
        pairs: Sequence[Pair],
        into: Readings,
        *,
        full: bool,
        planned: Container[str] = (),
    ) -> None:
        """The programs the kernel runs for each cgroup, parsed once each (no fork); in
        the full read a probe, one fork per container, where a program cannot be read
        or parsed (the fast read leaves those unknown), the programs a scope-less
        cgroup has attached (for the in-place repair's checks) and the containers with
        a bridge attached; in the fast read the nodes systemd's own program denies.
        `planned`: nodes a dry-run only planned, not on the host: a probe has nothing to
        open there (the container's own node is a path it controls), so unknown."""
        cache = self.cache
        for c, ent in pairs:
            cg = self.program_dir(c)
            ids: list[int] = []
            verdicts = scope_verdicts(cache, c, cg, ent, ids)
            into.effective[c.container_id] = tuple(ids)
            if full and any(cache.name(i) == BRIDGE_NAME for i in ids):
                into.bridged.add(c.container_id)
            if not full and verdicts is not None:
                into.systemd_denies |= systemd_denied(cache, c, ent, ids)
            if verdicts is not None:
                into.access.update(verdicts)
            elif full:
                real = [n for n in ent.nodes if n.path not in planned]
                res = probe_open_all([root.path(n.path) for n in real], [cg])
                for n, r in zip(real, res):
                    into.access[(c.container_id, n.numbers)] = r.verdict
                for n in ent.nodes:
                    if n.path in planned:
                        into.access[(c.container_id, n.numbers)] = None
            if c.unit is None and full:
                try:
                    into.programs[c.container_id] = query_device_programs(cg)
                except OSError:
                    into.programs[c.container_id] = None
        if full:
            cache.forget_unseen()

    def reread(self, root: Root, pairs: Sequence[Pair]) -> Readings:
        out = Readings()
        for c, ent in pairs:
            for n in ent.nodes:
                res = probe_open(root.path(n.path), [self.program_dir(c)])
                out.access[(c.container_id, n.numbers)] = res.verdict
        return out

    def end_of_pass(self, view: AccessView) -> None:
        """Forget the back-off of cgroups that are gone (a new container starts clean)."""
        self.backoff.keep_only(
            {str(self.program_dir(c)) for c in view.containers if self.claims(c)}
        )

    def _look(
        self, c: ContainerCgroup, ent: Entitlement, ids: list[int], fd: int
    ) -> Mapping[AccessKey, Optional[bool]]:
        """One known scope's access now, outside a pass, as the fast path judges it: a
        denial its DeviceAllow= covers waits for the pass unless systemd's own program
        denies it (settle.outside_apply)."""
        cache = self.bridges.cache
        seen = scope_verdicts(cache, c, self.program_dir(c), ent, ids, fd)
        if seen is None:
            return {}
        if not (c.unit in self.durable and False in seen.values()):
            return seen  # nothing covered is denied (the usual case: no systemd_denied)
        sd = systemd_denied(cache, c, ent, ids)
        settled = outside_apply((c,), {c.key: ent}, seen, self.durable, sd)
        return seen if settled is None else settled

    # -- grant --------------------------------------------------------------------

    def plan_regrant(
        self, c: ContainerCgroup, denied: Sequence[DeviceNode], remedy: str
    ) -> tuple[Action, ...]:
        """In a scope: nothing in place (its DeviceAllow= is the repair, a bridge stands
        in until it applies). Without one, what V2Remedy= says."""
        if c.unit is not None:
            return ()
        cg = str(self.program_dir(c))
        what = ", ".join(n.path for n in denied)
        common = dict(
            reconciler=RECONCILER,
            pod_uid=c.pod_uid,
            container_id=c.container_id,
            nodes=tuple(n.path for n in denied),
            numbers=tuple(n.numbers for n in denied),
        )
        if remedy == "inplace":
            return (
                V2ProgramReplace(
                    reason=f"cgroup v2 without a systemd unit: add {what} to its program",
                    target=cg,
                    cgroup_dir=cg,
                    **common,  # type: ignore[arg-type]
                ),
            )
        if remedy == "restart-container":
            return (
                RestartContainer(
                    reason=f"cgroup v2 without a systemd unit: recreate to regain {what}",
                    target=c.container_id,
                    runtime_name=c.runtime,
                    **common,  # type: ignore[arg-type]
                ),
            )
        return (
            V2ReportOnly(
                reason=f"cgroup v2 BPF device policy denies {what}; recreate the pod",
                target=cg,
                cgroup_dir=cg,
                **common,  # type: ignore[arg-type]
            ),
        )

    def rewrite_cause(self, rules: Optional[DeviceRules]) -> Optional[str]:
        return CAUSE_REWRITE_V2

    def hold_back(
        self, actions: Sequence[Action], view: AccessView, now: float
    ) -> tuple[tuple[Action, ...], tuple[Finding, ...]]:
        return hold_back(actions, view.programs, self.backoff.failures, now)

    async def grant(
        self, actions: Sequence[Action], view: AccessView, svc: Services
    ) -> list[Outcome]:
        """V2Remedy=inplace: each program replaced (a thread: bpf(2), probe forks), the
        back-off fed with how it went."""
        out = []
        for a in actions:
            if not isinstance(a, V2ProgramReplace):
                continue
            o = await asyncio.to_thread(apply_program_replace, a, svc.root, dry_run=svc.dry_run)
            if not svc.dry_run:
                ids = view.programs.get(a.container_id)
                self.backoff.record(a.cgroup_dir, ids, o.status == "done", o.detail, self.clock())
            out.append(o)
        return out

    # -- the fast re-grant --------------------------------------------------------

    def _bridging(self, svc: Services) -> bool:
        """A bridge needs the DeviceAllow= that follows it: durable grants and a bus."""
        return svc.config.devices.durable_grants and svc.systemd is not None

    def sweep(self, pairs: Sequence[Pair], svc: Services) -> Swept:
        """The known scopes bridged where they lost a node (a denial their DeviceAllow=
        covers waits for the pass unless systemd's own program denies it: `_look`);
        then a follow-up task: more looks at the scopes systemd had not re-applied yet,
        and every bridge's DeviceAllow= (bridge.py)."""
        if not self._bridging(svc):
            return Swept()
        scopes = tuple(p for p in pairs if p[0].unit is not None)
        bridged, access = self.bridges.sweep(scopes, svc, record=False)
        if not scopes:
            return Swept((), Readings(access=dict(access)), lambda: bridged)

        async def follow_up(written: Written, report: Report) -> None:
            rest = [p for p in scopes if p[0].container_id not in written]
            failed = {cid for cid, (_t, o) in written.items() if o.status == "failed"}
            retry = [p for p in scopes if p[0].container_id in failed]
            await self.bridges.follow_up(svc, rest, retry, report)

        return Swept(scopes, Readings(access=dict(access)), lambda: bridged, follow_up)

    def _mine(self, view: AccessView) -> AccessView:
        return dataclasses.replace(
            view, containers=tuple(c for c in view.containers if self.claims(c))
        )

    def regrant_fast(self, view: AccessView, svc: Services) -> tuple[list[Outcome], bool]:
        """Bridges for the known scopes `view` finds denying nodes (their DeviceAllow=
        follows: `durable_now`); other v2 containers wait for the full pass (in-place
        replacement, with its back-off)."""
        if not self._bridging(svc):
            return [], bool(self.bridges.pending)  # switched off since: dropped next
        mine = self._mine(view)
        denied = any(
            c.unit is not None
            and any(
                view.access.get((c.container_id, n.numbers)) is False
                for n in view.entitlements[c.key].nodes
            )
            for c in mine.containers
        )
        if not denied:
            return [], bool(self.bridges.pending)
        return [o for _t, o in self.bridges.attach(mine, svc).values()], True

    def durable_now(
        self, view: AccessView, actions: Sequence[Action], svc: Services
    ) -> list[UnitDeviceAllow]:
        """The scopes' DeviceAllow= among `actions`, and those of the bridges made on the
        reload's signal."""
        if not self._bridging(svc):
            # durable grants switched off (SIGHUP) since a reload bridged: nothing
            # follows those bridges; the pass ends them once systemd's program is back
            self.bridges.claim()
            return []
        mine = {c.container_id for c in view.containers if self.claims(c)}
        units = [a for a in actions if isinstance(a, UnitDeviceAllow) and a.container_id in mine]
        planned = {a.unit for a in units}
        units += [a for u, (_b, a) in self.bridges.pending.items() if u not in planned]
        self.bridges.release()
        return units

    # -- make durable -------------------------------------------------------------

    def before_durable(
        self, view: AccessView, units: AbstractSet[str], svc: Services
    ) -> list[Outcome]:
        """Bridges left attached (an earlier run's, or whose DeviceAllow= failed) ended
        where systemd's program is back, then a bridge for each scope about to be
        repaired."""
        mine = self._mine(view)
        out = self.bridges.stale(mine, svc)
        repairing = tuple(c for c in mine.containers if c.unit in units)
        made = self.bridges.attach(dataclasses.replace(mine, containers=repairing), svc)
        return out + [o for _t, o in made.values()]

    async def make_durable(self, units: Sequence[UnitDeviceAllow], svc: Services) -> list[Outcome]:
        """Each DeviceAllow=, then the detach of its scope's bridge once systemd's
        program is attached."""
        self.bridges.release()
        claimed = self.bridges.claim({a.unit for a in units})
        return await self.bridges.grant_then_detach(units, svc, claimed)

    def busy(self) -> AbstractSet[str]:
        return self.bridges.in_flight
