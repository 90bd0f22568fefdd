"""A new container scope handled on its own: its durable grant at once, not after a pass.

systemd announces a started scope (its start job's JobRemoved); the scope then holds
the runtime's init, not yet the container (see devices.entitlement.own_dev_pending),
so the scope is tried again briefly until its process has the container's /dev and
environment. Then this one container is judged as a pass judges it (read_entitlement,
then plan_durable: the same code, restricted to one container) and its DeviceAllow= set
through the same actuator, with the same journal entry. A scope that admits every
device already (a privileged container's) gets none: its layout is asked, as the
pass's read would say (durable.py: never narrow). The full pass stays the
backstop: it leaves alone the scopes queued here and does not grant again what was
granted here (the step's `durable` record, shared).

The cgroupfs driver has no scope to carry a durable grant, and nothing re-applies its
cgroup on a reload: a new cgroupfs container has nothing to gain from this (its losses
come from runtime updates, which no event announces; the audit repairs them).
"""

from __future__ import annotations

import asyncio
import os
import time
from collections import deque
from dataclasses import dataclass
from typing import (
    TYPE_CHECKING,
    AbstractSet,
    Awaitable,
    Callable,
    Mapping,
    Optional,
    Sequence,
    Union,
)

from gpuguard.devices.containers import (
    CgroupLayout,
    ContainerCgroup,
    detect_layout,
    find_scope,
    placement_pending,
    with_fresh_pids,
)
from gpuguard.devices.entitlement import own_dev_pending, read_entitlement
from gpuguard.devices.nodes import GpuLike, list_nvidia_nodes, nvidia_majors, read_proc_devices
from gpuguard.devices.scopepolicy import scope_devices
from gpuguard.errors import GpuguardError
from gpuguard.host.paths import DROPPED_ENTRIES_FILE, Root
from gpuguard.model import Outcome
from gpuguard.steps.container_access.reconcile import UnitDeviceAllow
from gpuguard.steps.container_access.scopequeue import ScopeQueue
from gpuguard.steps.container_access.view import AccessView

if TYPE_CHECKING:
    from gpuguard.engine.passes import Services
    from gpuguard.host.systemd import Systemd

# Scopes handled at once: each is a thread read and one D-Bus call, and systemd answers
# one call at a time, so a few dozen keep it busy without queueing more than half of
# MaxInFlight's default (64) on the bus.
CONCURRENCY = 32
GIVE_UP_AFTER = 10.0  # seconds; a container created but not started by then: the pass

Plan = Callable[
    [AccessView, tuple[UnitDeviceAllow, ...], Mapping[str, AbstractSet[str]], AbstractSet[str]],
    tuple[UnitDeviceAllow, ...],
]
Grant = Callable[[UnitDeviceAllow, "Services", Optional["Systemd"]], Awaitable[Outcome]]
Again = Callable[[str], None]  # asks for a full container access pass, with the reason
# The reason of the backstop pass after a new scope, "systemd: ..." like the source's
# marks, so that pass reuses the last GPU inventory (passes.PassContext.device_inventory).
BACKSTOP = "systemd: new container scope {}"


@dataclass(frozen=True)
class NewScope:
    """What one scope's read found: not ready yet (`pending`), nothing to do (`skip`),
    or one GPU container to judge (`view`, and the /dev/char links that exist)."""

    pending: str = ""
    skip: str = ""
    gone: bool = False  # no such container (a stop job's end, or the sandbox)
    container: Optional[ContainerCgroup] = None  # where it was found: not searched again
    view: Optional[AccessView] = None
    links: frozenset[str] = frozenset()
    # "MAJ:MIN" the scope's unit already allows (the runtime's DeviceAllow=, from the
    # container's OCI spec: CDI): durable without gpuguard
    runtime: frozenset[str] = frozenset()


def p50_p99(values: Sequence[float]) -> list[float]:
    """[p50, p99] of `values` (ms), rounded for the status file; [] when there is none."""
    ordered = sorted(values)
    if not ordered:
        return []
    p50, p99 = ordered[len(ordered) // 2], ordered[(len(ordered) * 99 - 1) // 100]
    return [round(p50, 1), round(p99, 1)]


class PodDeviceIds:
    """The checkpoint's device IDs per pod (dropped entries included), re-read only when
    either file is replaced or changes: kubelet rewrites it (a new file) at each
    allocation, and a burst of scopes must not parse it once per scope."""

    def __init__(self, checkpoint_path: str) -> None:
        self.checkpoint_path = checkpoint_path
        self._key: object = None
        self._ids: Mapping[str, frozenset[str]] = {}

    def get(self, root: Root) -> Mapping[str, frozenset[str]]:
        from gpuguard.engine.snapshot import HostSnapshot

        key = (_identity(root, self.checkpoint_path), _identity(root, DROPPED_ENTRIES_FILE))
        if key != self._key:
            self._ids = HostSnapshot(root, self.checkpoint_path).pod_device_ids
            self._key = key
        return self._ids


def _identity(root: Root, path: str) -> object:
    try:
        st = os.stat(root.path(path))
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def read_new_scope(
    root: Root,
    unit: str,
    layout: CgroupLayout,
    gpus: Sequence[GpuLike],
    pod_ids: PodDeviceIds,
    known: Optional[ContainerCgroup] = None,
    admits_all: Callable[[ContainerCgroup], bool] = lambda c: False,
) -> NewScope:
    """One scope's container and entitlement (blocking: /proc and cgroupfs reads);
    `known`: where an earlier try found it, so a retry reads its cgroup.procs only;
    `admits_all`: whether its scope admits every device (its layout's read)."""
    c = find_scope(root, unit, layout) if known is None else with_fresh_pids(root, known)
    if c is None:
        return NewScope(skip="no container cgroup: gone, or the pod's sandbox", gone=True)
    if c.problem:
        return NewScope(skip=c.problem)  # the pass reports it
    why = placement_pending(c, layout)
    if why:  # found again at the next try
        return NewScope(pending=why)
    why = own_dev_pending(root, c)
    if why:
        return NewScope(pending=why, container=c)
    majors = nvidia_majors(read_proc_devices(root))
    if majors.nvidia is None:
        return NewScope(skip="NVIDIA driver not loaded")
    host_nodes = list_nvidia_nodes(root, majors)
    try:
        ent = read_entitlement(root, c, host_nodes, majors, gpus, pod_ids.get(root))
    except GpuguardError as e:
        return NewScope(skip=e.message)  # the pass reports it
    if not ent.readable:
        return NewScope(pending="; ".join(ent.notes), container=c)
    if not ent.is_gpu_container:
        return NewScope(skip="not a GPU container")
    links = frozenset(n.dev_char for n in ent.nodes if os.path.lexists(root.path(n.dev_char)))
    unconfined: frozenset[str] = frozenset()
    meant = scope_devices(root, unit)  # its transient files: bounded reads
    if admits_all(c):
        if meant is not None and not meant.admits_all:
            return NewScope(
                pending=f"its unit says DevicePolicy={meant.policy} with {meant.entries} "
                "DeviceAllow= entries, its cgroup still admits every device (systemd has "
                "not applied them yet)",
                container=c,
            )
        unconfined = frozenset({c.container_id})
    view = AccessView((c,), {c.key: ent}, {}, {}, unconfined=unconfined)
    return NewScope(view=view, links=links, runtime=meant.numbers if meant else frozenset())


class NewScopes:
    """The new-scope fast path of the container access step: a queue, and the handling
    of one scope with the step's own planner, durable record and actuator."""

    def __init__(
        self,
        plan: Plan,
        grant: Grant,
        durable: Mapping[str, AbstractSet[str]],
        carry: Callable[[Outcome], None],
        *,
        concurrency: int = CONCURRENCY,
        give_up_after: float = GIVE_UP_AFTER,
        admits_all: Callable[[ContainerCgroup], bool] = lambda c: False,
    ) -> None:
        self.plan, self.grant = plan, grant
        self.admits_all = admits_all
        self.durable = durable
        self.carry = carry
        self.queue = ScopeQueue(
            self._handle,
            on_give_up=self._give_up,
            on_error=self._failed,
            concurrency=concurrency,
            give_up_after=give_up_after,
        )
        self._svc: Optional[Services] = None
        self._gpus: Sequence[GpuLike] = ()
        self._again: Again = lambda why: None
        self._layout: Optional[CgroupLayout] = None
        self._pod_ids: Optional[PodDeviceIds] = None
        self._found: dict[str, ContainerCgroup] = {}  # scopes waiting for their process
        self._announced: dict[str, float] = {}
        self._first_try: dict[str, float] = {}
        # (first try, ready, granted) in ms after the announcement, and the grant's own
        # call (sent -> systemd's reply), of the last grants
        self._timings: deque[tuple[float, float, float, float]] = deque(maxlen=256)
        self.granted = 0

    def announce(self, svc: Services, unit: str, gpus: Sequence[GpuLike], again: Again) -> None:
        """A container scope's job ended (on the loop): queue it once. The full pass
        follows each scope handled here (the backstop: the report, anything missed),
        not a scope that is gone (the end of a stop job)."""
        cfg = svc.config
        if not (cfg.devices.regrant and cfg.devices.durable_grants):
            again(BACKSTOP.format(unit))  # DurableGrants=no: the pass alone, as before
            return
        self._svc, self._gpus, self._again = svc, gpus, again
        if self.queue.add(unit):
            self._announced[unit] = time.monotonic()

    def status(self) -> dict[str, Union[int, list[float]]]:
        """Counts, and where a grant's time went (p50, p99 in ms after systemd announced
        the scope): to its first try (the queue), to a ready read, to the grant; and the
        grant's call alone (`call_ms`: sent -> systemd's reply, what a burst of starts
        makes systemd keep it waiting)."""
        q = self.queue
        out: dict[str, Union[int, list[float]]] = {
            "handled": q.handled,
            "granted": self.granted,
            "waiting": len(q.busy()),
            "peak_in_flight": q.peak_running,
        }
        for i, name in enumerate(("first_try_ms", "ready_ms", "granted_ms", "call_ms")):
            figures = p50_p99([t[i] for t in self._timings])
            if figures:
                out[name] = figures
        return out

    def busy(self) -> frozenset[str]:
        """Scopes this path is handling: the pass leaves their durable grant to it."""
        return self.queue.busy()

    async def _handle(self, unit: str) -> bool:
        svc = self._svc
        assert svc is not None
        cfg = svc.config
        sd = svc.systemd
        if not (cfg.devices.regrant and cfg.devices.durable_grants) or sd is None:
            # switched off by a SIGHUP since it was queued, or the bus is down (the full
            # pass after the reconnection sees it)
            self._forget(unit)
            return True
        if self._pod_ids is None or self._pod_ids.checkpoint_path != cfg.kubelet.checkpoint_path:
            self._pod_ids = PodDeviceIds(cfg.kubelet.checkpoint_path)
        now = time.monotonic()
        announced = self._announced.get(unit, now)
        self._announced[unit] = announced
        first_try = self._first_try.setdefault(unit, now)
        if self._layout is None:
            self._layout = await asyncio.to_thread(detect_layout, svc.root)
        found = await asyncio.to_thread(
            read_new_scope,
            svc.root,
            unit,
            self._layout,
            self._gpus,
            self._pod_ids,
            self._found.get(unit),
            self.admits_all,
        )
        if found.pending:
            svc.log.debug(f"new scope {unit}: not ready yet: {found.pending}")
            if found.container is not None:
                self._found[unit] = found.container
            return False
        self._found.pop(unit, None)
        ready = time.monotonic()
        self._announced.pop(unit, None)
        self._first_try.pop(unit, None)
        if found.view is None:
            svc.log.debug(f"new scope {unit}: nothing to grant: {found.skip}")
            if not found.gone:
                self._again(BACKSTOP.format(unit))
            return True
        # No D-Bus Get of DeviceAllow= (systemd, busy starting the burst's scopes,
        # answers one call at a time): the unit's transient files say what the runtime
        # set. A CDI container's runtime lists its GPU nodes there, and it gets no call
        # and no drop-in; the legacy hook's nodes are not there, and get one call.
        durable = self.durable
        if found.runtime:
            durable = {**durable, unit: frozenset(durable.get(unit, ())) | found.runtime}
        actions = self.plan(found.view, (), durable, found.links)
        if not actions:
            why = (
                "its scope admits every device"
                if found.view.unconfined
                else "its DeviceAllow= has the nodes, or their /dev/char links are missing"
            )
            svc.log.debug(f"new scope {unit}: nothing to grant: {why}")
        for action in actions:
            sent = time.monotonic()
            outcome = await self.grant(action, svc, sd)
            replied = time.monotonic()
            svc.log.outcome(outcome)
            self.carry(outcome)
            self.granted += outcome.status == "done"
            ms = [(t - announced) * 1000 for t in (first_try, ready, replied)]
            self._timings.append((ms[0], ms[1], ms[2], (replied - sent) * 1000))
        self._again(BACKSTOP.format(unit))
        return True

    def _forget(self, unit: str) -> None:
        for d in (self._found, self._announced, self._first_try):
            d.pop(unit, None)

    def _give_up(self, unit: str, why: str) -> None:
        self._forget(unit)
        if self._svc is not None:
            self._svc.log.debug(f"new scope {unit}: left to the full pass: {why}")
        self._again(BACKSTOP.format(unit) + f" ({why})")

    def _failed(self, unit: str, e: BaseException) -> None:
        self._forget(unit)
        if self._svc is not None:
            self._svc.log.warning(
                f"new scope {unit}: fast path failed ({type(e).__name__}: {e}); "
                "the full pass handles it"
            )
        self._again(BACKSTOP.format(unit) + " (fast path failed)")
