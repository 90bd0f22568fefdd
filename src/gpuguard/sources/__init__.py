"""Event sources: translate outside signals into "these steps may have work".

A source never acts; it only calls the mark function it was given. main() builds the
sources (build_sources) and hands them to the daemon, which connects their marks to its
coalescer: the sources exist before the daemon, so they mark through a MarkSink.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Callable, Optional

from gpuguard.steps.registry import CONTAINER_ACCESS

if TYPE_CHECKING:
    from gpuguard.config import Config
    from gpuguard.host.paths import Root
    from gpuguard.journal.log import EventLog
    from gpuguard.sources.systemd import SystemdSource
    from gpuguard.sources.timer import AuditTimer
    from gpuguard.sources.transient import TransientWatch
    from gpuguard.sources.udev import UdevSource

Mark = Callable[[frozenset[str], str, bool], None]
Hold = Callable[[bool], None]


class MarkSink:
    """Where the sources send their marks; the daemon connects it to its coalescer."""

    def __init__(self) -> None:
        self._mark: Optional[Mark] = None
        self._hold: Optional[Hold] = None
        self._reloaded: Optional[Callable[[float], None]] = None
        self._scope_started: Optional[Callable[[str], None]] = None

    def connect(
        self,
        mark: Mark,
        hold: Hold,
        reloaded: Optional[Callable[[float], None]] = None,
        scope_started: Optional[Callable[[str], None]] = None,
    ) -> None:
        self._mark, self._hold = mark, hold
        self._reloaded, self._scope_started = reloaded, scope_started

    def mark(self, names: frozenset[str], why: str, urgent: bool) -> None:
        if self._mark is None:
            raise RuntimeError(f"a source marked {sorted(names)} before the daemon connected")
        self._mark(names, why, urgent)

    def hold(self, on: bool) -> None:
        if self._hold is None:
            raise RuntimeError("a source held passes before the daemon connected")
        self._hold(on)

    def reloaded(self, when: float) -> None:
        """systemd ended a reload (`when`: monotonic): the daemon's fast path, at once."""
        if self._reloaded is not None:
            self._reloaded(when)

    def scope_started(self, unit: str) -> None:
        """A container scope's job ended: the daemon handles that scope on its own."""
        if self._scope_started is not None:
            self._scope_started(unit)
        else:
            self.mark(frozenset({CONTAINER_ACCESS}), f"systemd: new container scope {unit}", False)


class Sources:
    """The daemon's event sources: systemd's D-Bus signals, the periodic audit, and udev
    and the runtime properties systemd writes for container scopes (both made on the
    daemon's loop, since their fds go on that loop)."""

    def __init__(
        self,
        sink: MarkSink,
        systemd: SystemdSource,
        timer: AuditTimer,
        udev: Optional[Callable[[asyncio.AbstractEventLoop], UdevSource]],
        max_in_flight: int,
        transient: Optional[Callable[[asyncio.AbstractEventLoop], Optional[TransientWatch]]],
    ) -> None:
        self.sink = sink
        self.systemd = systemd
        self.timer = timer
        self.udev = udev
        self.transient = transient
        self.max_in_flight = max_in_flight  # for the next bus connection

    def reconfigure(self, config: Config) -> None:
        """A reloaded configuration (SIGHUP): units to watch, audit interval, bus limit."""
        self.systemd.set_units(config.systemd.kubelet_units, config.systemd.runtime_units)
        self.timer.interval = config.daemon.audit_interval
        self.max_in_flight = config.systemd.max_in_flight


def build_sources(
    root: Root, config: Config, log: EventLog, bus_address: str, *, udev: bool
) -> Sources:
    """What main() hands the daemon; imports D-Bus, so only `gpuguard daemon` calls it."""
    from gpuguard.host.systemd import Systemd
    from gpuguard.journal.log import stdlib_logger
    from gpuguard.sources.reload_socket import PrivateReloadWatch
    from gpuguard.sources.systemd import SystemdSource
    from gpuguard.sources.timer import AuditTimer

    sink = MarkSink()
    sources: Sources

    def client() -> Systemd:
        return Systemd(bus_address, max_in_flight=sources.max_in_flight)

    def make_udev(loop: asyncio.AbstractEventLoop) -> UdevSource:
        from gpuguard.sources.udev import UdevSource, choose_source

        run_dir = str(root.path("/run"))
        logger = stdlib_logger(log, "udev")
        return UdevSource(loop, sink.mark, source=choose_source(run_dir), log=logger)

    def make_transient(loop: asyncio.AbstractEventLoop) -> Optional[TransientWatch]:
        from gpuguard.sources.transient import RUN_SYSTEMD, make_transient_watch

        return make_transient_watch(loop, sink.mark, str(root.path(RUN_SYSTEMD)))

    socket = config.daemon.private_socket

    def private(report: Callable[[bool], None]) -> PrivateReloadWatch:
        assert socket is not None
        return PrivateReloadWatch(root.path(socket), report, log)

    systemd = SystemdSource(
        client,
        sink.mark,
        sink.hold,
        log,
        kubelet_units=config.systemd.kubelet_units,
        runtime_units=config.systemd.runtime_units,
        reloaded=sink.reloaded,
        scope_started=sink.scope_started,
        private=private if socket else None,
    )
    timer = AuditTimer(sink.mark, config.daemon.audit_interval)
    sources = Sources(sink, systemd, timer, make_udev if udev else None,
                      config.systemd.max_in_flight, make_transient)  # fmt: skip
    return sources
