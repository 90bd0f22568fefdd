"""Event sources: translate outside signals into typed events (steps/events.py).

A source never acts and never names a step: it emits an `Event`, and the registry
(steps/registry.py) says which steps the event's kind wakes. main() builds the sources
(build_sources) and hands them to the daemon, which connects their events to its
dispatch (fast paths, then marks for its coalescer): the sources exist before the
daemon, so they emit through an EventSink.

Modules (docs/architecture.md has the map of the packages):

- `udev.py`, `systemd.py`, `timer.py`, `transient.py`: event sources (uevents, systemd's
  D-Bus signals, the periodic audit, a scope's device properties set at runtime seen in
  `/run/systemd/transient` with inotify on the loop), built in `main`
  (`sources.build_sources`) and handed to the daemon through an `EventSink`
- `reload_socket.py`, `dbuswire.py`: systemd's `Reloading` from its private socket (a
  header-only reader of the D-Bus wire format; reports only, never calls systemd)
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Callable, Optional

from gpuguard.steps.events import Event

if TYPE_CHECKING:
    from gpuguard.config import Config
    from gpuguard.host.paths import Root
    from gpuguard.journal.log import EventLog
    from gpuguard.sources.systemd import SystemdSource
    from gpuguard.sources.timer import AuditTimer, WatchTimer
    from gpuguard.sources.transient import TransientWatch
    from gpuguard.sources.udev import UdevSource

Emit = Callable[[Event], None]
Hold = Callable[[bool], None]


class EventSink:
    """Where the sources send their events; the daemon connects it to its dispatch."""

    def __init__(self) -> None:
        self._emit: Optional[Emit] = None
        self._hold: Optional[Hold] = None

    def connect(self, emit: Emit, hold: Hold) -> None:
        self._emit, self._hold = emit, hold

    def emit(self, event: Event) -> None:
        if self._emit is None:
            raise RuntimeError(f"a source sent {event.kind.value} before the daemon connected")
        self._emit(event)

    def hold(self, on: bool) -> None:
        if self._hold is None:
            raise RuntimeError("a source held passes before the daemon connected")
        self._hold(on)


class Sources:
    """The daemon's event sources: systemd's D-Bus signals, the periodic audit, the
    device watch's tick, and udev
    and the runtime properties systemd writes for container scopes (both made on the
    daemon's loop, since their fds go on that loop)."""

    def __init__(
        self,
        sink: EventSink,
        systemd: SystemdSource,
        timer: AuditTimer,
        udev: Optional[Callable[[asyncio.AbstractEventLoop], UdevSource]],
        max_in_flight: int,
        transient: Optional[Callable[[asyncio.AbstractEventLoop], Optional[TransientWatch]]],
        watch: Optional[WatchTimer] = None,
    ) -> None:
        self.sink = sink
        self.systemd = systemd
        self.timer = timer
        self.watch = watch
        self.udev = udev
        self.transient = transient
        self.max_in_flight = max_in_flight  # for the next bus connection

    def reconfigure(self, config: Config) -> None:
        """A reloaded configuration (SIGHUP): units to watch, audit interval, bus limit."""
        self.systemd.set_units(config.systemd.kubelet_units, config.systemd.runtime_units)
        self.timer.interval = config.daemon.audit_interval
        if self.watch is not None:
            self.watch.set_interval(config.devices.watch_interval)
        self.max_in_flight = config.systemd.max_in_flight


def build_sources(
    root: Root, config: Config, log: EventLog, bus_address: str, *, udev: bool
) -> Sources:
    """What main() hands the daemon; imports D-Bus, so only `gpuguard daemon` calls it."""
    from gpuguard.host.systemd import Systemd
    from gpuguard.journal.log import stdlib_logger
    from gpuguard.sources.reload_socket import PrivateReloadWatch
    from gpuguard.sources.systemd import SystemdSource
    from gpuguard.sources.timer import AuditTimer, WatchTimer

    sink = EventSink()
    sources: Sources

    def client() -> Systemd:
        return Systemd(bus_address, max_in_flight=sources.max_in_flight)

    def make_udev(loop: asyncio.AbstractEventLoop) -> UdevSource:
        from gpuguard.sources.udev import UdevSource, choose_source

        run_dir = str(root.path("/run"))
        logger = stdlib_logger(log, "udev")
        return UdevSource(loop, sink.emit, source=choose_source(run_dir), log=logger)

    def make_transient(loop: asyncio.AbstractEventLoop) -> Optional[TransientWatch]:
        from gpuguard.sources.transient import RUN_SYSTEMD, make_transient_watch

        return make_transient_watch(loop, sink.emit, str(root.path(RUN_SYSTEMD)))

    socket = config.daemon.private_socket

    def private(report: Callable[[bool], None]) -> PrivateReloadWatch:
        assert socket is not None
        return PrivateReloadWatch(root.path(socket), report, log)

    systemd = SystemdSource(
        client,
        sink.emit,
        sink.hold,
        log,
        kubelet_units=config.systemd.kubelet_units,
        runtime_units=config.systemd.runtime_units,
        private=private if socket else None,
    )
    timer = AuditTimer(sink.emit, config.daemon.audit_interval)
    watch = WatchTimer(sink.emit, config.devices.watch_interval)
    sources = Sources(sink, systemd, timer, make_udev if udev else None,
                      config.systemd.max_in_flight, make_transient, watch)  # fmt: skip
    return sources
