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
own with runc, crun's ``SCOPE/container`` (its own program there, the scope's above it).
systemd's program, which a DeviceAllow= rebuilds and a bridge stands in for, is on the
scope (`scope_dir`). A program of the runtime's that denies what systemd's programs
admit (crun's in SCOPE/container, runc 1.0-rc93's after its update, next to systemd's)
is not repaired by a DeviceAllow=: with V2Remedy=inplace it is replaced in place, like
a scope-less container's (`deniers`). Which programs are systemd's: named
``sd_devices`` (systemd 249 and newer), or held open by PID 1 (older ones load theirs
unnamed: devices/bpfread.systemd_held).

The read also says which scopes admit every device already (`unconfined`): no device
program on the scope, or only ones that admit all (a privileged container's): those
are never given a DeviceAllow= (durable.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import time
from pathlib import Path
from typing import TYPE_CHECKING, AbstractSet, Callable, Container, Mapping, Optional, Sequence

from gpuguard.actuate.change import Change
from gpuguard.devices.bpfread import BRIDGE_NAME, ProgramCache, effective_programs, systemd_held
from gpuguard.devices.probe import probe_open, probe_open_all, query_device_programs
from gpuguard.model import Action, Finding, Outcome
from gpuguard.steps.container_access.actions import (
    RestartContainer,
    UnitDeviceAllow,
    V2ProgramReplace,
    V2ReportOnly,
)
from gpuguard.steps.container_access.actuate import program_replace_change
from gpuguard.steps.container_access.bridge import Bridges
from gpuguard.steps.container_access.devcgroup import Grant, Report, Swept, Written
from gpuguard.steps.container_access.durable import keep_open
from gpuguard.steps.container_access.inplace import Backoff, hold_back
from gpuguard.steps.container_access.reconcile import CAUSE_REWRITE_V2, RECONCILER, subject
from gpuguard.steps.container_access.settle import outside_apply
from gpuguard.steps.container_access.v2programs import (
    admit_all,
    attached_from,
    runtime_deniers,
    scope_verdicts,
    systemd_denied,
)
from gpuguard.steps.container_access.view import AccessKey, AccessView, Denier, Pair, Readings

if TYPE_CHECKING:
    from gpuguard.devices.containers import ContainerCgroup
    from gpuguard.devices.entitlement import Entitlement
    from gpuguard.devices.nodes import DeviceNode
    from gpuguard.devices.rules import DeviceRules
    from gpuguard.engine.passes import Services
    from gpuguard.host.paths import Root


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
            self.backoff, clock, grant, carry, dir_of=self.scope_dir, look=self._look
        )

    def claims(self, c: ContainerCgroup) -> bool:
        # where a v1 devices cgroup exists it decides, also on a hybrid host, where the
        # kernel runs the cgroup2 programs too (cgroupv1.py)
        return c.cgroup_v2 is not None and c.cgroup_v1_devices is None

    def program_dir(self, c: ContainerCgroup) -> Path:
        """The cgroup whose device programs decide for the container's processes (its
        own and every ancestor's, BPF_F_QUERY_EFFECTIVE): the scope's (or the cgroupfs
        directory) with runc; with crun, SCOPE/container, where its process is, below a
        program of crun's own. The one place that says so (devices/containers.py finds
        where the runtime put the process)."""
        d = c.v2_dir
        assert d is not None, "a container of this layout"
        return d

    def scope_dir(self, c: ContainerCgroup) -> Path:
        """The scope's cgroup (or the cgroupfs directory): where systemd's program is,
        which a DeviceAllow= rebuilds and a bridge stands in for."""
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
        open there (the container's own node is a path it controls), so unknown. Both
        reads say which scopes admit every device (`unconfined`); the full read, which
        runtime programs deny what systemd's admit (`deniers`)."""
        cache = self.cache
        held: list[frozenset[int]] = []  # PID 1's programs, read once if asked

        def pid1() -> frozenset[int]:
            if not held:
                held.append(systemd_held(root))
            return held[0]

        for c, ent in pairs:
            cg, scope = self.program_dir(c), self.scope_dir(c)
            ids: list[int] = []
            verdicts = scope_verdicts(cache, c, cg, ent, ids)
            scope_ids = self._scope_ids(cg, scope, ids, verdicts is not None)
            into.effective[c.container_id] = tuple(scope_ids or ())
            if admit_all(cache, scope_ids):
                into.unconfined.add(c.container_id)
            if full and any(cache.name(i) == BRIDGE_NAME for i in ids):
                into.bridged.add(c.container_id)
            if not full and verdicts is not None:
                into.systemd_denies |= systemd_denied(cache, c, ent, ids)
            if full and verdicts is not None and c.unit is not None and False in verdicts.values():
                dirs = attached_from(cg, scope)
                found = runtime_deniers(cache, c, ent, ids, verdicts, dirs, pid1)
                if found:
                    into.deniers[c.container_id] = found
                    into.programs[c.container_id] = tuple(ids)
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

    @staticmethod
    def _scope_ids(cg: Path, scope: Path, ids: list[int], read: bool) -> Optional[Sequence[int]]:
        """The programs the kernel runs for the scope's cgroup: those listed for the
        container's own cgroup when it is the scope, else asked (None: they cannot be
        listed). `read`: the container's verdicts were judged from `ids`; where they
        were not and none was listed, the listing itself may have failed: asked again."""
        if cg == scope and (read or ids):
            return ids
        try:
            return effective_programs(scope)
        except OSError:
            return None

    def admits_all(self, c: ContainerCgroup) -> bool:
        """Whether `c`'s scope admits every device now (its own read, for a new scope's
        grant outside a pass: blocking, call from a thread)."""
        try:
            ids = effective_programs(self.scope_dir(c))
        except OSError:
            return False
        return admit_all(ProgramCache(), ids)

    def reread(self, root: Root, pairs: Sequence[Pair]) -> Readings:
        out = Readings()
        for c, ent in pairs:
            for n in ent.nodes:
                res = probe_open(root.path(n.path), [self.program_dir(c)])
                out.access[(c.container_id, n.numbers)] = res.verdict
        return out

    def fingerprint(self, root: Root, c: ContainerCgroup) -> Optional[bytes]:
        return None  # systemd swaps whole programs; a reset over the bus is announced

    def end_of_pass(self, view: AccessView) -> None:
        """Forget the back-off of cgroups that are gone (a new container starts clean)."""
        mine = [c for c in view.containers if self.claims(c)]
        self.backoff.keep_only(
            {str(self.program_dir(c)) for c in mine} | {str(self.scope_dir(c)) for c in mine}
        )

    def _look(
        self, c: ContainerCgroup, ent: Entitlement, ids: list[int], fd: int
    ) -> Mapping[AccessKey, Optional[bool]]:
        """One known scope's access now, outside a pass, as the fast path judges it: a
        denial its DeviceAllow= covers waits for the pass unless systemd's own program
        denies it (settle.outside_apply)."""
        cache = self.bridges.cache
        seen = scope_verdicts(cache, c, self.scope_dir(c), ent, ids, fd)
        if seen is None:
            return {}
        if not (c.unit in self.durable and False in seen.values()):
            return seen  # nothing covered is denied (the usual case: no systemd_denied)
        sd = systemd_denied(cache, c, ent, ids)
        settled = outside_apply((c,), {c.key: ent}, seen, self.durable, sd)
        return seen if settled is None else settled

    # -- grant --------------------------------------------------------------------

    def plan_regrant(
        self,
        c: ContainerCgroup,
        denied: Sequence[DeviceNode],
        remedy: str,
        deniers: Sequence[Denier] = (),
    ) -> tuple[Action, ...]:
        """In a scope: its DeviceAllow= is the repair (a bridge stands in until it
        applies), and with V2Remedy=inplace each program of the runtime's that denies
        what systemd's admit (`deniers`) is replaced in place. Without one, what
        V2Remedy= says."""
        if c.unit is not None:
            return self._replace_deniers(c, denied, deniers) if remedy == "inplace" else ()
        cg = str(self.program_dir(c))
        what = ", ".join(n.path for n in denied)
        if remedy == "inplace":
            return (
                V2ProgramReplace(
                    reason=f"cgroup v2 without a systemd unit: add {what} to its program",
                    target=cg,
                    cgroup_dir=cg,
                    **subject(c, denied),
                ),
            )
        if remedy == "restart-container":
            return (
                RestartContainer(
                    reason=f"cgroup v2 without a systemd unit: recreate to regain {what}",
                    target=c.container_id,
                    runtime_name=c.runtime,
                    **subject(c, denied),
                ),
            )
        return (
            V2ReportOnly(
                reason=f"cgroup v2 BPF device policy denies {what}; recreate the pod",
                target=cg,
                cgroup_dir=cg,
                **subject(c, denied),
            ),
        )

    def _replace_deniers(
        self, c: ContainerCgroup, denied: Sequence[DeviceNode], deniers: Sequence[Denier]
    ) -> tuple[Action, ...]:
        out: list[Action] = []
        for prog_id, where, numbers in deniers:
            nodes = [n for n in denied if n.numbers in numbers]
            if not nodes:
                continue
            what = ", ".join(n.path for n in nodes)
            out.append(
                V2ProgramReplace(
                    reason=f"the runtime's device program {prog_id} on {where} denies {what}, "
                    "which systemd's program admits: add them to it (DeviceAllow= cannot)",
                    target=where,
                    cgroup_dir=where,
                    program_id=prog_id,
                    probe_dir=str(self.program_dir(c)),
                    reconciler=RECONCILER,
                    pod_uid=c.pod_uid,
                    container_id=c.container_id,
                    nodes=tuple(n.path for n in nodes),
                    numbers=tuple(n.numbers for n in nodes),
                )
            )
        return tuple(out)

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
            change = program_replace_change(a, svc.root)
            made = functools.partial(self._replaced, change.make, a, view)
            change = Change(change.what, made, change.describe)  # a swap made feeds the back-off
            out.append(await asyncio.to_thread(svc.apply.run, change))
        return out

    def _replaced(
        self, make: Callable[[], Outcome], a: V2ProgramReplace, view: AccessView
    ) -> Outcome:
        o = make()
        ids = view.programs.get(a.container_id)
        self.backoff.record(a.cgroup_dir, ids, o.status == "done", o.detail, self.clock())
        return o

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
        return keep_open(view, units, self.durable, actions)

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
