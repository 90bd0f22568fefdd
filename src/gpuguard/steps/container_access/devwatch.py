"""A known GPU container's device cgroup rewritten behind systemd's back, seen within a
watch interval and repaired for that container alone.

On cgroup v1 a runtime with the cgroupfs driver (runc before 1.0 on every update; any
runc/crun `update` without the systemd driver, e.g. the kubelet CPU manager's) writes
`devices.deny` and `devices.allow` itself: neither systemd nor the kernel announces it
(cgroupfs sends no inotify event for a write to a control file), so before this watch
gpuguard saw it only at its next pass, whatever event brought one (a soak's p99: 6.6 s).

Every `[Devices] WatchInterval=` (200 ms by default) the daemon's timer asks this watch
(`on_tick`, inline on the loop) to read a fingerprint of each known GPU container's
device access (its layout's `fingerprint`: v1's `devices.list`, a few hundred bytes)
and compare it with the last one. A changed one is judged in a task: after systemd's
apply has settled (settle.py: a reload's or a systemd-driver update's deny-all-then-
allow is no loss), the container's verdicts are read afresh, and what it was given and
lost is written back by the same in-place re-grant a pass would make (its layout's
`plan_regrant` and `grant`), journaled with the finding's cause; then the step's pass
follows as the backstop. v2 has no fingerprint here (`None`): systemd swaps whole
programs, and a scope's DeviceAllow= set over the bus is announced by the file systemd
writes for it (resetscope.py).

It never grants more than a pass would: only containers the last pass judged (the
observer's `known`), only the nodes each was given, each read back.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from typing import TYPE_CHECKING, Callable, Sequence, Union

from gpuguard.steps.container_access.durable import NAME
from gpuguard.steps.container_access.newscope import p50_p99
from gpuguard.steps.container_access.view import AccessView, Pair

if TYPE_CHECKING:
    from gpuguard.engine.passes import Services
    from gpuguard.model import Finding, Outcome
    from gpuguard.steps.container_access.devcgroup import DeviceCgroup
    from gpuguard.steps.container_access.settle import Settle

Known = Callable[[], Sequence[tuple["DeviceCgroup", Sequence[Pair]]]]
# the journal and the pass's result for what a watch repair did (state.py's `report`
# and `carried.add`): the findings of the same audit as a pass, then the outcomes
Report = Callable[[AccessView, Sequence["Outcome"], "Services"], Sequence["Finding"]]
Carry = Callable[[Sequence["Outcome"], Sequence["Finding"]], None]


class DeviceWatch:
    """The known containers' device fingerprints, compared at each tick; a changed one
    judged and repaired in a task. Figures: repairs made and p50/p99 of tick -> read
    back (ms) for the status file."""

    def __init__(self, known: Known, settle: Callable[[], Settle], report: Report, carry: Carry):
        self.known, self.settle, self.report, self.carry = known, settle, report, carry
        self._last: dict[str, bytes] = {}  # container_id -> its last fingerprint
        self._inflight: set[str] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._timings: deque[float] = deque(maxlen=256)
        self._fresh: deque[float] = deque(maxlen=1024)  # seconds, not yet in the metrics
        self.ticks = 0
        self._failing = False
        self.changes = 0
        self.repaired = 0

    def on_tick(self, svc: Services, again: Callable[[str], None]) -> None:
        """Each known container's fingerprint read and compared; the changed ones
        judged in one task. A bug is journaled once, not at every tick."""
        try:
            self._tick(svc, again)
        except Exception as e:
            if not self._failing:
                svc.log.crashed(NAME, "device watch", e)
            self._failing = True
        else:
            self._failing = False

    def _tick(self, svc: Services, again: Callable[[str], None]) -> None:
        """Only the last pass's containers are remembered."""
        self.ticks += 1
        changed: list[tuple[DeviceCgroup, Pair]] = []
        live: set[str] = set()
        for cg, pairs in self.known():
            for pair in pairs:
                c = pair[0]
                fp = cg.fingerprint(svc.root, c)
                if fp is None:  # not watched on this layout, or unreadable: the pass's
                    continue
                live.add(c.container_id)
                before = self._last.get(c.container_id)
                self._last[c.container_id] = fp
                if before is not None and before != fp and c.container_id not in self._inflight:
                    changed.append((cg, pair))
        for gone in self._last.keys() - live:  # bounded by the live containers
            del self._last[gone]
        if not changed:
            return
        self.changes += len(changed)
        self._inflight.update(p[0].container_id for _cg, p in changed)
        task = asyncio.ensure_future(self._judge(changed, svc, time.monotonic(), again))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _judge(
        self,
        changed: Sequence[tuple[DeviceCgroup, Pair]],
        svc: Services,
        seen: float,
        again: Callable[[str], None],
    ) -> None:
        try:
            await self._repair(changed, svc, seen, again)
        except Exception as e:  # the pass repairs it: never the loop down
            svc.log.warning(f"device watch: a changed device cgroup could not be judged ({e})")
            again("device watch: a changed device cgroup could not be judged")
        finally:
            self._inflight.difference_update(p[0].container_id for _cg, p in changed)

    async def _repair(
        self,
        changed: Sequence[tuple[DeviceCgroup, Pair]],
        svc: Services,
        seen: float,
        again: Callable[[str], None],
    ) -> None:
        # One wait for every container changed in this tick: a reload's or an update's
        # apply in progress ends before anything is judged.
        unit = next((p[0].unit for _cg, p in changed if p[0].unit is not None), None)
        if unit is not None:
            await self.settle()(svc.systemd, unit)
        outcomes: list[Outcome] = []
        findings: list[Finding] = []
        lost_any = False
        for cg, (c, ent) in changed:
            fresh = await asyncio.to_thread(cg.reread, svc.root, [(c, ent)])
            verdicts = fresh.access
            denied = [n for n in ent.nodes if verdicts.get((c.container_id, n.numbers)) is False]
            if not denied:
                svc.log.debug(f"container {c.container_id[:12]}: device cgroup changed, no loss")
                continue
            lost_any = True
            if not (
                svc.config.devices.regrant
                and svc.apply.choose(made=lambda: True, described=lambda: False)
            ):
                continue  # observe mode, Regrant=no: the pass reports it, once
            view = AccessView.of((c,), {c.key: ent}, fresh)
            actions = cg.plan_regrant(c, denied, svc.config.devices.v2_remedy)
            done = await cg.grant(actions, view, svc)
            outcomes += done
            findings += self.report(view, done, svc)
            if any(o.status == "done" for o in done):
                self.repaired += 1
                took = time.monotonic() - seen
                self._timings.append(took * 1000)
                self._fresh.append(took)
        if outcomes:
            self.carry(outcomes, findings)
        if lost_any:
            again("device watch: a GPU container's device cgroup was rewritten")

    def take(self) -> list[float]:
        """The seconds of each repair since the last call (the metrics' histogram)."""
        out = list(self._fresh)
        self._fresh.clear()
        return out

    def status(self) -> dict[str, Union[int, list[float]]]:
        """Ticks, changes seen, repairs made, and p50/p99 of tick -> read back (ms)."""
        out: dict[str, Union[int, list[float]]] = {
            "watched": len(self._last),
            "changes": self.changes,
            "repaired": self.repaired,
        }
        figures = p50_p99(self._timings)
        if figures:
            out["repair_ms"] = figures
        return out
