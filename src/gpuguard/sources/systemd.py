"""systemd over D-Bus: daemon-reload/reexec, boot finished, runtime and kubelet (re)starts.

Only emits events (steps/events.py; the registry says which steps each wakes). What
each signal means:
- Reloading(true) ... Reloading(false): a daemon-reload (also the two halves of a
  daemon-reexec). Units are in flux in between, so the coalescer is held, and the
  end is an urgent SYSTEMD_RELOADED: this is when device cgroups were rewritten. The
  daemon runs the steps' reload fast paths on it at once, so the known GPU containers
  are re-granted before the quiet period, or a pass already running, delays them. Taken from
  systemd's private socket while that connection is up (tens of ms earlier than the
  bus delivers it: reload_socket.py), from the bus otherwise.
- NameOwnerChanged of org.freedesktop.systemd1 from one unique name to another: a
  reexec. It arrives inside its Reloading pair; outside one it is SYSTEMD_REEXECUTED.
- StartupFinished: boot is complete (BOOT_FINISHED).
- PropertiesChanged of a watched unit whose ActiveState becomes "active" from
  anything else: a (re)start (KUBELET_STARTED, RUNTIME_STARTED). A reload re-sends
  properties of every unit; those keep ActiveState "active" and are ignored, so a
  reload is one pass, not many. gpuguard-readmit.service's process ending (its
  ActiveState from active or deactivating to inactive, failed, or activating: an
  automatic restart) is READMIT_STOPPED (its streams ended: kubelet may have dropped
  the plugin that replaced its endpoint).
- JobRemoved of a container scope's job (cri-containerd-/crio-/docker-*.scope, result
  "done"): a new container whose device grant can be made durable before any reload,
  SCOPE_STARTED (the daemon hands it to the step's new-scope fast path; the end of a
  stop job is announced too: the step finds it gone). Not UnitNew: systemd sends a
  UnitNew for every unit on every reload (hundreds on a busy node), all parsed before
  the Reloading(false) behind them, while a reload starts no job; and at UnitNew the
  scope may not even have its cgroup yet, while at its start job's end it holds the
  runtime's process.
The connection is re-made with back-off when the bus goes away (dbus restart), and
a full pass follows every reconnection (BUS_RECONNECTED).
"""

from __future__ import annotations

import asyncio
import time
from typing import Callable, Iterable, Optional

from dbus_next import Message

from gpuguard.devices.cgroupnames import ANY_CONTAINER_SCOPE
from gpuguard.host import aio
from gpuguard.host.systemd import MANAGER, PROPS, UNIT, Systemd, SystemdError, unit_object_path
from gpuguard.journal.log import EventLog
from gpuguard.sources.reload_socket import PrivateReloadWatch
from gpuguard.steps.events import Event, EventKind

READMIT_UNIT = "gpuguard-readmit.service"  # the re-admission bridge (units/)

Emit = Callable[[Event], None]
VIA_BUS, VIA_PRIVATE = "bus", "private-socket"

__all__ = ["SystemdSource", "unit_object_path"]  # the path's home is gpuguard.host.systemd


class SystemdSource:
    def __init__(
        self,
        make_client: Callable[[], Systemd],
        emit: Emit,
        hold: Callable[[bool], None],
        log: EventLog,
        *,
        kubelet_units: Iterable[str] = ("kubelet.service",),
        runtime_units: Iterable[str] = ("containerd.service", "crio.service", "docker.service"),
        clock: Callable[[], float] = time.monotonic,
        private: Optional[Callable[[Callable[[bool], None]], PrivateReloadWatch]] = None,
    ) -> None:
        self.make_client = make_client
        self.emit = emit
        self.hold = hold
        self.log = log
        self.clock = clock
        self.client: Optional[Systemd] = None
        self.connected = aio.Event()
        self.first_attempt_done = aio.Event()
        self._stopping = False
        self._reloading = False
        self._reload_ended = -1e9
        # Reloading from systemd's private socket, ahead of the bus (reload_socket.py)
        self.private = None
        if private is not None:
            self.private = private(lambda active: self.reloading(active, VIA_PRIVATE))
            self.private.on_connect = lambda: self._count_from_now(VIA_PRIVATE)
        self.last_reload_via = ""  # where the last reload's end came from
        # Each path delivers every Reloading once: (starts, ends) seen on each, and acted
        # on. A path's copy of what the other delivered first is dropped; a (re)connected
        # path counts from the moment it connects (it missed what came before).
        self._seen = {VIA_BUS: [0, 0], VIA_PRIVATE: [0, 0]}
        self._acted = [0, 0]
        # Reported in the status file: (starts, ends) each path delivered since start-up
        self.received = {VIA_BUS: [0, 0], VIA_PRIVATE: [0, 0]}
        self.set_units(kubelet_units, runtime_units)

    def set_units(self, kubelet_units: Iterable[str], runtime_units: Iterable[str]) -> None:
        old = set(getattr(self, "_watch", ()))
        self._watch: dict[str, tuple[str, EventKind]] = {}
        for u in runtime_units:
            self._watch[unit_object_path(u)] = (u, EventKind.RUNTIME_STARTED)
        for u in kubelet_units:
            self._watch[unit_object_path(u)] = (u, EventKind.KUBELET_STARTED)
        self._watch[unit_object_path(READMIT_UNIT)] = (READMIT_UNIT, EventKind.READMIT_STOPPED)
        self._active: dict[str, str] = {}
        client = getattr(self, "client", None)
        if client is not None:  # a SIGHUP named other units: watch them from now on
            for path in set(self._watch) - old:
                task = asyncio.ensure_future(client.watch_properties(path))
                task.add_done_callback(lambda t: t.exception())

    def stop(self) -> None:
        self._stopping = True
        if self.private is not None:
            self.private.stop()
        if self.client is not None:
            self.client.disconnect()

    async def run(self) -> None:
        if self.private is None:
            return await self._run()
        private = asyncio.ensure_future(self.private.run())
        bus = asyncio.ensure_future(self._run())
        try:
            done, _ = await asyncio.wait({bus, private}, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                task.result()  # a bug in either path ends the source, and the daemon (70)
            await bus  # the private watch returns only when stopping
        finally:
            self.private.stop()
            for task in (private, bus):
                task.cancel()
            await asyncio.gather(private, bus, return_exceptions=True)

    async def _run(self) -> None:
        backoff = 0.25
        ever_connected = False
        while not self._stopping:
            client = self.make_client()
            try:
                await client.connect()
                self._count_from_now(VIA_BUS)
                client.on_signal(self._on_signal)
                await client.subscribe(self._watch)
                await self._snapshot_units(client)
            except SystemdError as e:
                client.disconnect()
                self.first_attempt_done.set()
                self.log.event(
                    "dbus-lost",
                    f"system bus not available: {e}; retrying in {backoff:.1f}s",
                    level="warning" if ever_connected else "info",
                )
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 30.0)
                continue
            self.client = client
            self.connected.set()
            self.first_attempt_done.set()
            backoff = 0.25
            self.log.event("dbus-connected", f"subscribed to systemd at {client.bus_address}")
            if ever_connected:
                self.emit(Event(EventKind.BUS_RECONNECTED, "reconnected to the system bus", True))
            ever_connected = True
            try:
                await client.wait_for_disconnect()
            except Exception as e:  # dbus-next surfaces socket errors here (issue 153)
                self.log.event("dbus-lost", f"system bus connection failed: {e}", level="warning")
            self.client = None
            self.connected.clear()
            self._reloading = False
            self.hold(False)
            if not self._stopping:
                self.log.event("dbus-lost", "lost the system bus; reconnecting", level="warning")
                await asyncio.sleep(backoff)

    async def _snapshot_units(self, client: Systemd) -> None:
        for path in self._watch:
            try:
                (state,) = await client.call(
                    "Get", "ss", [UNIT, "ActiveState"], path=path, interface=PROPS
                )
                self._active[path] = str(state.value)
            except SystemdError:
                self._active[path] = ""  # not loaded: its first start will show up

    def _on_signal(self, msg: Message) -> None:
        try:
            self._handle(msg)
        except Exception as e:  # a malformed signal must never take the loop down
            self.log.event("warning", f"ignored malformed D-Bus signal {msg.member}: {e}")

    @property
    def reloads_acted(self) -> int:
        return self._acted[1]

    def _count_from_now(self, via: str) -> None:
        self._seen[via] = list(self._acted)

    def reloading(self, active: bool, via: str = VIA_BUS) -> None:
        """systemd's Reloading(active) from one path (the bus, its private socket):
        acted on once, when the first path delivers it."""
        i = 0 if active else 1
        self.received[via][i] += 1
        seen = self._seen[via]
        seen[i] += 1
        if seen[i] <= self._acted[i]:
            return  # the other path delivered it first
        self._acted[i] = seen[i]
        if not active:  # an end implies its start: a late copy of that start is dropped
            self._acted[0] = max(self._acted[0], seen[i])
        self._reloading = active
        self.hold(active)
        if not active:
            self.last_reload_via = via
            self._reload_ended = self.clock()
            why = "systemd: daemon-reload/reexec finished"
            self.emit(Event(EventKind.SYSTEMD_RELOADED, why, urgent=True, at=self._reload_ended))

    def _handle(self, msg: Message) -> None:
        member = msg.member
        if msg.interface == MANAGER:
            if member == "Reloading":
                (active,) = msg.body
                self.reloading(bool(active), VIA_BUS)
            elif member == "StartupFinished":
                self.emit(Event(EventKind.BOOT_FINISHED, "systemd: startup finished"))
            elif member == "JobRemoved" and not self._reloading:
                _id, _job, unit, result = msg.body
                if result == "done" and ANY_CONTAINER_SCOPE.fullmatch(str(unit)):
                    why = f"systemd: new container scope {unit}"
                    self.emit(Event(EventKind.SCOPE_STARTED, why, unit=str(unit)))
        elif (
            member == "NameOwnerChanged" and msg.body and msg.body[0] == "org.freedesktop.systemd1"
        ):
            _name, old, new = msg.body
            recent = self.clock() - self._reload_ended < 2.0
            if old and new and old != new and not self._reloading and not recent:
                self.emit(Event(EventKind.SYSTEMD_REEXECUTED, "systemd: daemon-reexec", True))
        elif member == "PropertiesChanged" and msg.interface == PROPS:
            watched = self._watch.get(msg.path or "")
            if watched is None or not msg.body or msg.body[0] != UNIT:
                return
            changed = msg.body[1]
            if "ActiveState" not in changed:
                return
            state = str(changed["ActiveState"].value)
            before = self._active.get(msg.path or "", "")
            self._active[msg.path or ""] = state
            # Inside a reload the Reloading end wakes every step anyway; a unit that
            # looked new to us there is re-registration, not a start.
            unit, kind = watched
            if kind is EventKind.READMIT_STOPPED:
                # once its process is gone (its streams with it), not at "deactivating":
                # a stop's SIGTERM may take a while; auto-restart shows as "activating"
                was_up = before in ("active", "deactivating", "reloading")
                if was_up and state in ("inactive", "failed", "activating"):
                    self.emit(Event(kind, f"systemd: {unit} ended ({state})"))
            elif state == "active" and before != "active" and not self._reloading:
                self.emit(Event(kind, f"systemd: {unit} started"))
