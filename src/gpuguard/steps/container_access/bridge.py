"""A bridge on cgroup v2: access back within milliseconds, until systemd applies the
DeviceAllow= that repairs a scope durably.

On a systemd scope the v2 repair is a runtime DeviceAllow=: systemd rebuilds the
scope's device program from it. Right after a daemon-reload systemd answers those calls
one at a time behind its re-apply work (200 containers: over a second). v1 is fast
because a direct devices.allow write restores access before any D-Bus call; the v2
equivalent is a *bridge*: systemd's denying program (``sd_devices``) is replaced in
place by one admitting its rules plus exactly the lost entitled nodes (the same swap as
V2Remedy=inplace: attached with BPF_F_ALLOW_MULTI, the old one detached only after,
verified by the kernel's programs read back), then DeviceAllow= is set as before, and
once systemd's new program is attached the bridge is detached.

Why it is safe:
- With several programs attached the kernel admits an open only if every one admits
  it. A bridge admits systemd's previous rules plus the lost entitled nodes, and the
  other programs (the runtime's) still judge next to it: the container gains nothing
  beyond what it had plus its entitlement.
- Once any program of systemd's is attached next to the bridge again, the bridge can
  only restrict (all must admit), so detaching it never removes access systemd grants;
  what then admits the container is systemd's program and the runtime's, as designed.
  Until then the bridge stands in for systemd's program and stays: detaching it with no
  program of systemd's attached would leave the runtime's alone, which may be broader.
- A bridge left attached (gpuguard stopped in between, DeviceAllow= failing) can only
  deny a device granted later: the next pass sees that denial (the usual
  container-device-denied) and removes the bridge as soon as systemd's program is there
  (at the latest after the next reload). gpuguard knows its bridges by the name it loads
  them with (``gpuguard_bridge``), so this holds across its own restarts.
- No bridge (DeviceAllow= alone, as without one) for a frozen cgroup, when the programs
  that deny are not systemd's alone or more than one other program is attached, when
  the in-place back-off holds the cgroup (inplace.py; a failed bridge is recorded
  there too, with the programs the kernel ran for the cgroup then: it is tried again
  once they change, e.g. systemd's next program after a reload, never in a loop), under
  DurableGrants=no (nothing would follow it) or without a bus.

The plan is pure (bridgeplan.py); `Bridges` makes the bridges (the pass's, and a reload's sweep)
and keeps those whose DeviceAllow= is still to come. The v2 layout (cgroupv2.py) owns
it: it says which cgroup's programs decide for a container (`dir_of`) and how one is
looked at (`look`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from pathlib import Path
from typing import (
    TYPE_CHECKING,
    Awaitable,
    Callable,
    Mapping,
    Optional,
    Sequence,
    Union,
)

from gpuguard.actuate.bpf import LoadedPrograms, Replacement
from gpuguard.actuate.change import AsyncChange, Change
from gpuguard.devices.bpfprog import ACC_RW
from gpuguard.devices.bpfread import ProgramCache, judge
from gpuguard.devices.probe import open_cgroup
from gpuguard.model import Outcome
from gpuguard.steps.container_access.bridgeplan import (
    BridgeAttach,
    BridgeDetach,
    DirOf,
    bridge_actions,
    bridge_nodes,
    bridge_targets,
    detach_of,
)
from gpuguard.steps.container_access.reconcile import RECONCILER, UnitDeviceAllow
from gpuguard.steps.container_access.view import AccessKey, AccessView
from gpuguard.steps.registry import CONTAINER_ACCESS

if TYPE_CHECKING:
    from gpuguard.actuate.bpfbridge import Detached
    from gpuguard.devices.containers import ContainerCgroup
    from gpuguard.devices.entitlement import Entitlement
    from gpuguard.devices.nodes import DeviceNode
    from gpuguard.engine.executor import ChangeExecutor
    from gpuguard.engine.passes import Services
    from gpuguard.host.systemd import Systemd
    from gpuguard.steps.container_access.inplace import Backoff

Pair = tuple["ContainerCgroup", "Entitlement"]  # a known container and what it was given
Written = tuple[float, Outcome]  # when a bridge was made, and how it went
# a bridge made or refused: the scope, its cgroup, its nodes, when, and the swap or why not
# the bridge made ("done") or described ("dry-run"), or why none was
Attached = Union[tuple[str, Replacement], str]
Made = tuple["ContainerCgroup", Path, "tuple[DeviceNode, ...]", float, Attached]
Grant = Callable[[UnitDeviceAllow, "Services", "Optional[Systemd]"], Awaitable[Outcome]]
# one known scope's access now, outside a pass (cgroupv2.py): its cgroup's programs read
# through the loop's cache (their ids into the list), its directory open
Look = Callable[
    ["ContainerCgroup", "Entitlement", list[int], int], Mapping[AccessKey, Optional[bool]]
]
# Waiting for systemd's program after its DeviceAllow= call returned: one more reply
# from systemd, then sleeps doubling from 10 ms (about 5 s in all: after a reload
# systemd answers hundreds of calls before it applies them); the next pass does the rest.
DETACH_TRIES = 10
DETACH_SLEEP = 0.01
# After a reload that lost something: more looks at the scopes systemd may not have
# re-applied yet (it does not re-apply them all before it answers the next call).
LOOKS = 4
LOOK_SLEEP = 0.03


def programs_now(a: BridgeAttach) -> Optional[tuple[int, ...]]:
    """The programs the kernel runs for the bridge's cgroup now (None: unreadable): a
    failed bridge is tried again only once these change (systemd's next program, after
    a reload or a DeviceAllow=) or after the back-off."""
    from gpuguard.devices.bpfread import effective_programs

    try:
        return effective_programs(Path(a.cgroup_dir))
    except OSError:
        return None


def _numbers(a: BridgeAttach) -> list[tuple[int, int]]:
    return [(int(ma), int(mi)) for ma, mi in (n.split(":") for n in a.numbers)]


def _pairs(nodes: Sequence[DeviceNode]) -> list[tuple[int, int]]:
    return [(n.major, n.minor) for n in nodes]


def attach(
    cgroup_dir: Path,
    nodes: Sequence[tuple[int, int]],
    cache: ProgramCache,
    loaded: LoadedPrograms,
    apply: ChangeExecutor,
    fd: Optional[int] = None,
) -> Attached:
    """The bridge's swap, verified by the kernel's programs read back (no fork: this
    runs inline on the loop right after a reload), made or described by `apply`; a
    failure (nothing changed): why. `fd`: the cgroup's directory, open (the look, the
    swap and the verification share it)."""
    from gpuguard.actuate.bpf import BpfReplaceError
    from gpuguard.actuate.bpfbridge import bridge_change

    def verify() -> bool:
        verdicts = judge(cache, cgroup_dir, nodes, fd=fd)
        return verdicts is not None and all(verdicts.values())

    change = bridge_change(cgroup_dir, nodes, verify, loaded=loaded, cache=cache, cg_fd=fd)
    try:
        return apply.run(
            Change(
                change.what,
                lambda: ("done", change.make()),
                lambda: ("dry-run", change.describe()),
            )
        )
    except BpfReplaceError as e:
        return f"{e}; DeviceAllow= alone repairs it"
    except OSError as e:
        return f"{cgroup_dir}: {e.strerror}; DeviceAllow= alone repairs it"


def detach(a: BridgeDetach, apply: ChangeExecutor) -> Optional[tuple[Outcome, bool]]:
    """Detach the cgroup's bridges if systemd's program is attached again (or, under
    dry-run, say so); None while none is (the bridge stays, standing in for it) or
    when no bridge is there. With the outcome: whether systemd's program admits the
    bridged nodes."""
    from gpuguard.actuate.bpf import BpfReplaceError
    from gpuguard.actuate.bpfbridge import detach_change

    change = detach_change(Path(a.cgroup_dir))

    def made() -> Optional[tuple[Outcome, bool]]:
        return _detached(a, change.make())

    def described() -> Optional[tuple[Outcome, bool]]:
        d = change.describe()
        if not d.bridges:
            return None
        ids = ", ".join(map(str, d.bridges))
        return Outcome(a, "dry-run", f"would detach bridge {ids}"), True

    try:
        return apply.run(Change(change.what, made, described))
    except BpfReplaceError as e:
        return Outcome(a, "failed", str(e)), False
    except OSError as e:
        return Outcome(a, "failed", f"{a.cgroup_dir}: {e.strerror}; the bridge stays"), False


def _detached(a: BridgeDetach, d: Detached) -> Optional[tuple[Outcome, bool]]:
    if not d.bridges:
        return None
    still = [
        n
        for n, (ma, mi) in zip(a.numbers, _numbers(a))
        if not all(p.admits("c", ma, mi, ACC_RW) for p in d.systemd)
    ]
    ids = ", ".join(map(str, d.bridges))
    if still:
        return Outcome(
            a,
            "done",
            f"bridge {ids} detached; systemd's program denies {', '.join(still)} "
            "(its DeviceAllow= did not take: reported by the next pass, which sets "
            "DeviceAllow= again, with no bridge during the back-off)",
        ), False
    return Outcome(a, "done", f"bridge {ids} detached; systemd's program admits the nodes"), True


class Bridges:
    """Bridges attached whose DeviceAllow= gpuguard has not set yet, by unit."""

    def __init__(
        self,
        backoff: Backoff,
        clock: Callable[[], float],
        grant: Grant,
        carry: Callable[[Outcome], None],
        *,
        dir_of: DirOf,
        look: Look,
    ) -> None:
        self.pending: dict[str, tuple[BridgeAttach, UnitDeviceAllow]] = {}
        self.grant = grant  # the step's DeviceAllow= (the same journal entry)
        self.dir_of = dir_of
        self.look = look
        self.carry = carry  # done between passes: into the next pass's result
        self.cache = ProgramCache()  # programs read on the loop (a pass's thread has its own)
        self.in_flight: set[str] = set()  # units whose DeviceAllow= is being set here
        # A failed bridge, or one whose DeviceAllow= did not take, holds the cgroup back
        # (inplace.py's back-off): never a bridge, detach, bridge again loop.
        self.backoff = backoff
        self.clock = clock
        self.loaded = LoadedPrograms()  # the same bridge program for many scopes

    def release(self) -> None:
        """Close the programs loaded for this burst (attached ones stay attached)."""
        self.loaded.close()

    def attach(
        self, view: AccessView, svc: Services, *, record: bool = True
    ) -> dict[str, tuple[float, Outcome]]:
        """A bridge for each v2 scope of `view` that denies entitled nodes, inline; when
        each was made and how it went, by container. `record=False`: a failure is not
        held back (on the reload's signal systemd may be swapping programs still)."""
        made: list[Made] = []
        now = self.clock()
        for c, cg, denied in bridge_targets(view, self.backoff.failures, now, self.dir_of):
            r = attach(cg, _pairs(denied), self.cache, self.loaded, svc.apply)
            made.append((c, cg, denied, time.monotonic(), r))
        return self._made(made, record)

    def claim(self, units: Optional[set[str]] = None) -> dict[str, BridgeAttach]:
        """The pending bridges of `units` (all: None), now the caller's to follow up."""
        mine = [u for u in self.pending if units is None or u in units]
        return {u: self.pending.pop(u)[0] for u in mine}

    def sweep(
        self, pairs: Sequence[Pair], svc: Services, *, record: bool = True
    ) -> tuple[dict[str, Written], dict[AccessKey, Optional[bool]]]:
        """A reload's bridges, one known scope after another: each looked at, and
        bridged at once where it lost nodes. Only reads and swaps until the last scope
        (one open of its directory for the look, the swap and the verification); the
        actions and outcomes for the journal are built after."""
        access: dict[AccessKey, Optional[bool]] = {}
        made: list[Made] = []
        now = self.clock()
        for c, ent in pairs:
            cg = self.dir_of(c)
            try:
                fd = open_cgroup(cg)
            except OSError:
                continue  # gone; a pass reports what cannot be read
            try:
                ids: list[int] = []
                seen = self.look(c, ent, ids, fd)
                access.update(seen)
                denied = bridge_nodes(c, cg, ent, seen, self.backoff.failures, tuple(ids), now)
                if denied:
                    loaded = self.loaded
                    r = attach(cg, _pairs(denied), self.cache, loaded, svc.apply, fd)
                    made.append((c, cg, denied, time.monotonic(), r))
            finally:
                os.close(fd)
        out = self._made(made, record)
        self.cache.forget_unseen()
        self.release()
        return out, access

    def _made(
        self,
        made: Sequence[Made],
        record: bool,
    ) -> dict[str, Written]:
        """The journal's actions and outcomes for bridges made (or refused), after the
        last one: the attached ones pending their DeviceAllow=, a failure held back
        (`record`) with the programs the kernel runs for the cgroup now."""
        out: dict[str, Written] = {}
        for c, cg, denied, at, r in made:
            b, allow = bridge_actions(c, cg, denied)
            if isinstance(r, str):
                out[c.container_id] = (at, Outcome(b, "failed", r))
                if record:
                    self.backoff.record(b.cgroup_dir, programs_now(b), False, r, self.clock())
                continue
            status, rep = r
            out[c.container_id] = (at, Outcome(b, status, rep.describe()))
            self.pending[b.unit] = (b, allow)
        return out

    async def follow_up(
        self,
        svc: Services,
        rest: Sequence[Pair],
        retry: Sequence[Pair],
        report: Callable[[AccessView], None],
    ) -> None:
        """`_follow_up`, journaled as a crash if it raises (a task: nobody awaits it)."""
        try:
            await self._follow_up(svc, rest, retry, report)
        except Exception as e:  # the pass that follows repairs what is left
            svc.log.crashed(CONTAINER_ACCESS, "reload bridge follow-up", e)

    async def _follow_up(
        self,
        svc: Services,
        rest: Sequence[Pair],
        retry: Sequence[Pair],
        report: Callable[[AccessView], None],
    ) -> None:
        """After a reload's first bridges: once systemd has answered one call (before
        any DeviceAllow= queues behind it: its re-apply went on meanwhile), a second
        sweep of the scopes whose loss it had not applied yet (`rest`; `report` journals
        what it finds) and of those whose bridge failed then (`retry`), then every
        bridge's DeviceAllow= at once (not after the pass's other steps)."""
        from gpuguard.host.systemd import SystemdError

        grants: list[asyncio.Future[list[Outcome]]] = []
        made: list[Outcome] = []
        todo, lost = [*rest, *retry], bool(self.pending)
        for _look in range(LOOKS):
            if svc.systemd is not None and todo:
                with contextlib.suppress(SystemdError):
                    await svc.systemd.unit_path(todo[0][0].unit or "")
            bridged, access = self.sweep(todo, svc)
            got = [(c, e) for c, e in todo if c.container_id in bridged]
            if got:
                report(AccessView(tuple(c for c, _ in got), {c.key: e for c, e in got}, access, {}))
            made += [o for _t, o in bridged.values()]
            units = [a for _b, a in self.pending.values()]
            grants.append(asyncio.ensure_future(self.grant_then_detach(units, svc, self.claim())))
            lost = lost or bool(bridged)
            todo = [p for p in todo if p[0].container_id not in bridged]
            if not todo or not lost:  # nothing lost on this reload: no more looks
                break
            await asyncio.sleep(LOOK_SLEEP)
        done = [o for g in grants for o in await g]
        for o in [*made, *done]:
            svc.log.outcome(o)
            self.carry(o)

    async def detach_after(self, b: BridgeAttach, svc: Services) -> Optional[Outcome]:
        """Once systemd's program (from the DeviceAllow= just set) is attached, detach
        the bridge; left to the next pass if it does not come within a few seconds."""
        a = detach_of(b, "systemd applied the scope's DeviceAllow=: its program is attached")
        return await svc.apply.run_async(
            AsyncChange(
                "v2-bridge-detach",
                lambda: self._detach_when_there(a, b, svc),
                lambda: Outcome(
                    a, "dry-run", "would detach the bridge once systemd's program is there"
                ),
            )
        )

    async def _detach_when_there(
        self, a: BridgeDetach, b: BridgeAttach, svc: Services
    ) -> Optional[Outcome]:
        from gpuguard.host.systemd import SystemdError

        for i in range(DETACH_TRIES):
            got = detach(a, svc.apply)
            if got is not None:
                o, admitted = got
                if not admitted:
                    now = self.clock()
                    self.backoff.record(b.cgroup_dir, programs_now(b), False, o.detail, now)
                return o
            if i == 0 and svc.systemd is not None:
                with contextlib.suppress(SystemdError):
                    await svc.systemd.unit_path(b.unit)  # answered once it has applied
            else:
                await asyncio.sleep(DETACH_SLEEP * 2 ** (i - 1))
        return None

    def stale(self, view: AccessView, svc: Services) -> list[Outcome]:
        """Bridges found attached (left by an earlier run, or whose DeviceAllow= failed)
        and not waiting for one: detached where systemd's program is attached again."""
        out = []
        for c in view.containers:
            if c.container_id not in view.bridged or c.unit in self.pending:
                continue
            cg = str(self.dir_of(c))
            a = BridgeDetach(
                reconciler=RECONCILER,
                reason="a bridge of gpuguard's left attached (an earlier repair) and "
                "systemd's program is attached again",
                target=cg,
                cgroup_dir=cg,
                unit=c.unit or "",
                pod_uid=c.pod_uid,
                container_id=c.container_id,
            )
            got = detach(a, svc.apply)
            if got is not None:
                out.append(got[0])
        return out

    async def grant_then_detach(
        self,
        units: Sequence[UnitDeviceAllow],
        svc: Services,
        bridges: Mapping[str, BridgeAttach],
    ) -> list[Outcome]:
        """Each DeviceAllow= (`grant`), then the detach of its unit's bridge (claimed:
        `bridges`), if any. A bridge whose DeviceAllow= failed stays until systemd's
        program is back."""

        async def one(a: UnitDeviceAllow) -> list[Outcome]:
            self.in_flight.add(a.unit)
            try:
                return await grant(a)
            finally:
                self.in_flight.discard(a.unit)

        async def grant(a: UnitDeviceAllow) -> list[Outcome]:
            o = await self.grant(a, svc, svc.systemd)
            b = bridges.get(a.unit)
            if b is None or o.status not in ("done", "dry-run"):
                return [o]
            d = await self.detach_after(b, svc)
            return [o] if d is None else [o, d]

        done = await asyncio.gather(*(one(a) for a in units))
        return [o for pair in done for o in pair]
