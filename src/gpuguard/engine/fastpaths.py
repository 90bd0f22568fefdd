"""The daemon's fast paths: work that must not wait for the quiet period or a running
pass, dispatched to the steps that implement a fast-path protocol (steps/registry.py:
found by `isinstance`, so the engine knows no step's internals).

- a daemon-reload/reexec ended: each `ReloadFastPath` inline on the loop, now, with no
  garbage collection in between (gcpause.py); the pass is marked after, urgently;
- a container scope started: each `ScopeFastPath` handles it on its own and asks for
  its pass when done;
- a scope's device properties were set at runtime: each `ScopeDevicesFastPath` looks at
  that one scope and says whether it took the event;
- the device watch's tick: each `DeviceWatchFastPath` looks for what no event
  announces; the tick itself never marks a pass (a step that acted asks for its own).
"""

from __future__ import annotations

from typing import Callable, Mapping, Optional, Protocol

from gpuguard.engine.gcpause import collector_paused
from gpuguard.engine.passes import Services
from gpuguard.host.inventory import Inventory
from gpuguard.reporting.metrics_output import MetricsOutput
from gpuguard.reporting.metrics_state import REPAIR_HISTOGRAM
from gpuguard.steps.events import Event, EventKind
from gpuguard.steps.registry import (
    DeviceWatchFastPath,
    ReloadFastPath,
    ScopeDevicesFastPath,
    ScopeFastPath,
    Step,
)


class Daemon(Services, Protocol):
    """What the fast paths use of the daemon (engine/daemon.py)."""

    @property
    def steps(self) -> Mapping[str, Step]: ...

    @property
    def metrics(self) -> Optional[MetricsOutput]: ...

    @property
    def inventory(self) -> Optional[Inventory]: ...

    def again(self, name: str) -> Callable[[str], None]: ...


def run_fast_paths(d: Daemon, names: frozenset[str], event: Event) -> frozenset[str]:
    """The fast paths `event` calls for; returns the woken steps they served (those ask
    for their own pass: the others are marked at once)."""
    if event.kind is EventKind.SYSTEMD_RELOADED:
        _reload(d, event.at)
    elif event.kind is EventKind.SCOPE_STARTED:
        return _new_scope(d, names, event)
    elif event.kind is EventKind.SCOPE_DEVICES_SET and event.unit:
        return _scope_devices(d, names, event)
    elif event.kind is EventKind.DEVICE_WATCH:
        return _device_watch(d, names)
    return frozenset()


def _reload(d: Daemon, signal: float) -> None:
    """systemd ended a daemon-reload/reexec: each step's reload fast path, inline."""
    restored: list[float] = []
    with collector_paused():
        for name, step in d.steps.items():
            if not isinstance(step, ReloadFastPath):
                continue
            try:
                done = step.on_reload(d, signal)
            except Exception as e:  # the pass that follows retries: never the loop down
                d.log.crashed(name, "reload fast path", e)
                continue
            if done is not None:
                restored.append(done)
    # This reload's repair time, written with the next pass's metrics
    if d.metrics is not None and restored:
        d.metrics.state.observe(REPAIR_HISTOGRAM, max(0.0, max(restored) - signal))


def _new_scope(d: Daemon, names: frozenset[str], event: Event) -> frozenset[str]:
    """A container scope's job ended: the woken steps with a fast path for it handle
    that scope on their own."""
    gpus = d.inventory.gpus if d.inventory is not None else ()
    served = set()
    for name, step in d.steps.items():
        if name in names and isinstance(step, ScopeFastPath):
            step.on_new_scope(d, event.unit, gpus, d.again(name))
            served.add(name)
    return frozenset(served)


def _scope_devices(d: Daemon, names: frozenset[str], event: Event) -> frozenset[str]:
    """A scope's device properties were set at runtime: the woken steps with a fast path
    for it look at that scope now; those that took it ask for their pass."""
    served = set()
    for name, step in d.steps.items():
        if name in names and isinstance(step, ScopeDevicesFastPath):
            again: Callable[[str], None] = d.again(name)
            try:
                if step.on_scope_devices(d, event.unit, again):
                    served.add(name)
            except Exception as e:  # the pass marked instead repairs it
                d.log.crashed(name, "scope devices fast path", e)
    return frozenset(served)


def _device_watch(d: Daemon, names: frozenset[str]) -> frozenset[str]:
    """The watch's tick: each woken step with a device watch looks now. All of them
    are served: a tick is no reason for a pass."""
    for name, step in d.steps.items():
        if name in names and isinstance(step, DeviceWatchFastPath):
            try:
                step.on_device_watch(d, d.again(name))
            except Exception as e:  # the next tick, or the pass, tries again
                d.log.crashed(name, "device watch", e)
    return names
