"""The container_access step (F2): GPU containers keep exactly the devices they were given.

Per pass (fullpass.py): find GPU containers, read what their cgroup admits, and
1. re-grant what is denied by the fastest path first: on cgroup v1 a direct write to
   devices.allow (microseconds per container), so CUDA works again at once;
2. then make grants durable: a runtime DeviceAllow=/dev/char/MAJ:MIN on the
   container's systemd scope, so the next daemon-reload/reexec re-applies them
   instead of wiping them (on cgroup v2 this is the repair: systemd rebuilds the
   scope's program, and a bridge stands in until then). This is also done for
   containers whose access is still intact, as soon as they are seen, so a reload
   never wipes them in the first place.
A new scope does not wait for a pass: `on_new_scope` grants it on its own
(newscope.py), and the pass leaves the scopes queued there alone. After a
daemon-reload, `on_reload` re-grants the last pass's GPU containers at once, inline on
the loop, before the pass that follows (or the one running) goes on (fastpaths.py).
Entitlements (what a container was given) are read once per container process and
cached; a pass after a reload only re-reads the verdicts.

The three entry points are thin: what they share across passes is one object
(state.py), and each container's cgroup layout is one implementation of one interface
(devcgroup.py: cgroupv1.py, cgroupv2.py).

Modules (docs/architecture.md has the map of the packages):

- the container access step (F2). The step and its three thin entry points
  (`__init__.py`), what they share (`state.py`), the pass (`fullpass.py`), the fast
  paths after a reload and before an urgent pass's walk (`fastpaths.py`); the
  `DeviceCgroup` interface (`devcgroup.py`), its v1 implementation (`cgroupv1.py`:
  `devices.list` read, `devices.allow` written and read back, the reload's sweep with
  the journal's actions built after the last write) and v2 one (`cgroupv2.py`: programs
  read where the container's process is, `program_dir`, and judged, probes where they
  cannot be, scope bridges, in-place replacement; what it concludes from the programs in
  `v2programs.py`: verdicts, systemd's denials, a scope that admits every device, a
  runtime's program that denies what systemd's admit), the choice between them and the
  durable grant (`cgroups.py`); the records (`view.py`); containers and entitlements,
  the kubepods cgroups no container is in whose processes hold NVIDIA nodes open, and
  the grants systemd already keeps (`observe.py`); the pure audit (`reconcile.py`) and
  its actions (`actions.py`); which scopes still need a durable grant, never one that
  admits every device already (`durable.py`, pure); each GPU container's present grant
  for `gpuguard protect` (`protect.py`, pure); the v2 bridge that restores a scope's
  access in place until its `DeviceAllow=` is applied, and its detach (`bridgeplan.py`,
  pure; `bridge.py`: the bridges made in a pass, a reload's sweep through one open of
  each cgroup, the follow-up after a reload); when an in-place v2 repair is held back
  (several programs, a back-off after a failure: `inplace.py`, pure); the writes
  (`actuate.py`); a denial of a node the scope already grants judged again once
  systemd's apply has settled (`settle.py`); a new scope's grant on its own
  (`newscope.py`) through a bounded queue without duplicates (`scopequeue.py`)
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Callable, Optional, Sequence

from gpuguard.steps.container_access.durable import plan_durable
from gpuguard.steps.container_access.fastpaths import on_reload
from gpuguard.steps.container_access.fullpass import run_pass
from gpuguard.steps.container_access.state import AccessState
from gpuguard.steps.registry import CONTAINER_ACCESS

if TYPE_CHECKING:
    from gpuguard.actuate.containers import ContainerStopper
    from gpuguard.devices.nodes import GpuLike
    from gpuguard.engine.passes import PassContext, Services
    from gpuguard.reporting.status_figures import FastPaths

NAME = CONTAINER_ACCESS
__all__ = ["NAME", "ContainerAccessStep", "plan_durable"]


class ContainerAccessStep:
    def __init__(
        self,
        clock: Callable[[], float] = time.monotonic,
        stopper: Optional[ContainerStopper] = None,  # default: from the configuration
    ) -> None:
        self.state = AccessState(clock, stopper)

    async def __call__(self, svc: Services, ctx: PassContext) -> None:
        await run_pass(self.state, svc, ctx)

    def on_reload(self, svc: Services, signal: float) -> Optional[float]:
        """systemd ended a daemon-reload/reexec (`signal`: when that arrived): the last
        pass's GPU containers re-granted now, before anything else runs on the loop.
        Returns when the last access it restored was back (None: it restored none)."""
        return on_reload(self.state, svc, signal)

    def on_new_scope(
        self, svc: Services, unit: str, gpus: Sequence[GpuLike], again: Callable[[str], None]
    ) -> None:
        """A container scope started: its durable grant on its own (newscope.py)."""
        self.state.scopes.announce(svc, unit, gpus, again)

    def on_scope_devices(self, svc: Services, unit: str, again: Callable[[str], None]) -> bool:
        """A scope's DeviceAllow= was set at runtime: what gpuguard granted it set again
        at once where it was lost (resetscope.py); False leaves it to the pass."""
        return self.state.resets.on_devices_set(svc, unit, again)

    def on_device_watch(self, svc: Services, again: Callable[[str], None]) -> None:
        """WatchInterval= passed: the known containers' device cgroups compared with
        the last look, a rewritten one repaired at once (devwatch.py)."""
        self.state.watch.on_tick(svc, again)

    def take_reset_seconds(self) -> Sequence[float]:
        """Each runtime reset repaired since the last call, in seconds (the metrics)."""
        return self.state.resets.take() + self.state.watch.take()

    def fast_status(self) -> FastPaths:
        """The fast paths' last figures, for the status file (and bench/)."""
        from gpuguard.reporting.status_figures import FastPaths, figures

        last = self.state.last_reload
        return FastPaths(
            reload=last.figures() if last is not None else None,
            new_scopes=figures(self.state.scopes.status()),
            scope_resets=figures(self.state.resets.status()),
            device_watch=figures(self.state.watch.status()),
        )
