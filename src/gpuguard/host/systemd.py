"""A small systemd client over D-Bus (dbus-next), shared by `gpuguard check` and the daemon.

Two hard limits of the real bus shape it (both seen on systemd 252 / dbus 1.14):
- the bus daemon answers org.freedesktop.DBus.Error.LimitsExceeded beyond ~128
  pending replies per connection;
- dbus-next 0.2.3 drops the whole connection with BlockingIOError when its socket
  buffer fills (python-dbus-next issue 153).
So every call goes through one semaphore (MaxInFlight, default 64) and every reply is
checked: an error reply raises SystemdError, never passes silently.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

from dbus_next import BusType, Message, MessageType, Variant
from dbus_next.aio import MessageBus

from gpuguard.host import aio

SYSTEMD = "org.freedesktop.systemd1"
MANAGER_PATH = "/org/freedesktop/systemd1"
MANAGER = "org.freedesktop.systemd1.Manager"
UNIT = "org.freedesktop.systemd1.Unit"
PROPS = "org.freedesktop.DBus.Properties"
# Not UnitNew: a reload brings one per unit, each parsed before the Reloading(false)
# behind it; a new container scope is seen at its start job's JobRemoved instead.
MANAGER_SIGNALS = ("Reloading", "StartupFinished", "JobRemoved")


class SystemdError(Exception):
    """An error reply from systemd or the bus, or no bus at all."""

    def __init__(self, message: str, *, name: str = "") -> None:
        super().__init__(message)
        self.name = name


def _release(bus: MessageBus) -> None:
    """Close a finished connection's socket now. dbus-next 0.2.3 only shuts it down and
    leaves the fd to the garbage collector: each bus restart cost the daemon an fd."""
    loop = asyncio.get_running_loop()
    fd = getattr(bus, "_fd", None)
    if isinstance(fd, int):
        loop.remove_reader(fd)
        loop.remove_writer(fd)
    for name in ("_stream", "_sock"):
        obj = getattr(bus, name, None)
        if obj is not None:
            with contextlib.suppress(OSError):
                obj.close()


def unit_object_path(unit: str) -> str:
    """systemd's bus path for a unit: bytes outside [A-Za-z0-9] become _xx. systemd
    loads the unit when a call names its path, as LoadUnit does: one round trip less."""
    out = []
    for i, b in enumerate(unit.encode()):
        c = chr(b)
        if c.isascii() and (c.isalpha() or (c.isdigit() and i > 0)):
            out.append(c)
        else:
            out.append(f"_{b:02x}")
    return "/org/freedesktop/systemd1/unit/" + "".join(out)


def bus_address_for(root: Path) -> str:
    return f"unix:path={root / 'run/dbus/system_bus_socket'}"


@dataclass(frozen=True)
class UnitState:
    name: str
    load_state: str
    active_state: str
    sub_state: str
    invocation_id: str
    drop_in_paths: tuple[str, ...]
    inactive_exit_us: int  # when it last left 'inactive': a (re)start, not noise
    job_pending: bool = False  # a job (start, stop, restart) is queued or running for it

    @property
    def active(self) -> bool:
        return self.active_state in ("active", "reloading", "deactivating")

    def in_transition(self, *, jobs: bool = True) -> bool:
        """Starting or stopping, or (`jobs`) a job queued for it: during a restart job the
        unit is inactive for a moment between its stop and its start, the job still
        there."""
        return (jobs and self.job_pending) or self.active_state in ("activating", "deactivating")


class Systemd:
    """One connection to the system bus; calls bounded in flight, replies checked."""

    def __init__(self, bus_address: str, *, max_in_flight: int = 64, timeout: float = 30.0):
        self.bus_address = bus_address
        self.timeout = timeout
        self._sem = aio.Semaphore(max_in_flight)
        self._bus: Optional[MessageBus] = None
        self._job_waiters: dict[str, asyncio.Future[str]] = {}
        self._finished_jobs: dict[str, str] = {}  # JobRemoved seen before its waiter
        self._signal_handlers: list[Callable[[Message], None]] = []
        self._subscribed = False

    @property
    def bus(self) -> MessageBus:
        if self._bus is None:
            raise SystemdError("not connected to the system bus")
        return self._bus

    async def connect(self) -> None:
        bus: Optional[MessageBus] = None
        try:
            bus = MessageBus(bus_address=self.bus_address, bus_type=BusType.SYSTEM)
            connected = await asyncio.wait_for(bus.connect(), timeout=5.0)
        except Exception as e:  # dbus-next raises plain Exceptions on auth/handshake
            if bus is not None:
                _release(bus)  # a bus that accepted but never answered: one fd per retry
            raise SystemdError(
                f"cannot connect to the system bus at {self.bus_address}: {e}"
            ) from None
        connected.add_message_handler(self._dispatch)
        self._bus = connected

    def disconnect(self) -> None:
        if self._bus is not None:
            self._bus.disconnect()
            self._bus = None

    async def wait_for_disconnect(self) -> None:
        bus = self.bus
        try:
            await bus.wait_for_disconnect()
        finally:
            _release(bus)

    def on_signal(self, handler: Callable[[Message], None]) -> None:
        self._signal_handlers.append(handler)

    def _dispatch(self, msg: Message) -> None:
        if msg.message_type != MessageType.SIGNAL:
            return
        if msg.member == "JobRemoved" and msg.interface == MANAGER:
            _id, job, _unit, result = msg.body
            fut = self._job_waiters.pop(job, None)
            if fut is not None:
                if not fut.done():
                    fut.set_result(result)
            else:
                # The signal can be dispatched before the caller that queued the job has
                # seen its reply (both came in one read): keep the result for it.
                self._finished_jobs[job] = result
                while len(self._finished_jobs) > 256:
                    del self._finished_jobs[next(iter(self._finished_jobs))]
        for h in self._signal_handlers:
            h(msg)

    async def call(
        self,
        member: str,
        signature: str = "",
        body: Optional[list[Any]] = None,
        *,
        path: str = MANAGER_PATH,
        interface: str = MANAGER,
        destination: str = SYSTEMD,
    ) -> list[Any]:
        msg = Message(
            destination=destination,
            path=path,
            interface=interface,
            member=member,
            signature=signature,
            body=body or [],
        )
        async with self._sem:
            try:
                reply = await asyncio.wait_for(self.bus.call(msg), timeout=self.timeout)
            except asyncio.TimeoutError:
                raise SystemdError(
                    f"{interface}.{member}: no reply in {self.timeout:.0f}s"
                ) from None
            except (OSError, EOFError) as e:
                raise SystemdError(f"{interface}.{member}: bus connection lost: {e}") from None
        if reply is None:
            raise SystemdError(f"{interface}.{member}: no reply")
        if reply.message_type == MessageType.ERROR:
            detail = reply.body[0] if reply.body else ""
            raise SystemdError(
                f"{interface}.{member}: {reply.error_name}: {detail}", name=reply.error_name or ""
            )
        return list(reply.body)

    async def add_match(self, rule: str) -> None:
        await self.call(
            "AddMatch",
            "s",
            [rule],
            path="/org/freedesktop/DBus",
            interface="org.freedesktop.DBus",
            destination="org.freedesktop.DBus",
        )

    async def subscribe(self, unit_paths: Iterable[str] = ()) -> None:
        """Ask systemd for its signals: the Manager's, and property changes of `unit_paths`
        only (a daemon-reload re-sends properties of every unit: hundreds of signals the
        daemon would only parse to ignore)."""
        for path in unit_paths:
            await self.watch_properties(path)
        await self.add_match(
            "type='signal',sender='org.freedesktop.DBus',member='NameOwnerChanged',"
            f"arg0='{SYSTEMD}'"
        )
        await self._subscribe_manager()

    async def watch_properties(self, path: str) -> None:
        await self.add_match(f"type='signal',sender='{SYSTEMD}',interface='{PROPS}',path='{path}'")

    async def _subscribe_manager(self) -> None:
        """Manager signals (JobRemoved, Reloading, UnitNew, ...) to this connection, once."""
        if self._subscribed:
            return
        # Only the signals gpuguard uses: a reload of a node with hundreds of scopes
        # brings a UnitRemoved and a UnitNew for each, and every message the loop must
        # parse delays the Reloading(false) that matters.
        for member in MANAGER_SIGNALS:
            await self.add_match(
                f"type='signal',sender='{SYSTEMD}',interface='{MANAGER}',member='{member}'"
            )
        try:
            await self.call("Subscribe")
        except SystemdError as e:
            if e.name != "org.freedesktop.systemd1.AlreadySubscribed":
                raise
        self._subscribed = True

    async def unit_path(self, unit: str) -> str:
        (path,) = await self.call("LoadUnit", "s", [unit])
        return str(path)

    async def unit_state(self, unit: str) -> UnitState:
        path = await self.unit_path(unit)
        (props,) = await self.call("GetAll", "s", [UNIT], path=path, interface=PROPS)

        def get(name: str, default: Any) -> Any:
            v = props.get(name)
            return v.value if isinstance(v, Variant) else default

        inv = get("InvocationID", b"")
        job = get("Job", None)  # (id, object path); id 0: no job
        return UnitState(
            name=unit,
            load_state=get("LoadState", ""),
            active_state=get("ActiveState", ""),
            sub_state=get("SubState", ""),
            invocation_id=bytes(inv).hex() if isinstance(inv, (bytes, list)) else str(inv),
            drop_in_paths=tuple(get("DropInPaths", [])),
            inactive_exit_us=int(get("InactiveExitTimestamp", 0)),
            job_pending=isinstance(job, (list, tuple)) and bool(job) and job[0] != 0,
        )

    async def _job(self, member: str, unit: str, *, wait: bool, timeout: float) -> str:
        """Queue a start/stop/restart job; with wait, return its result ("done", ...)."""
        if wait:  # systemd emits JobRemoved only to subscribed clients
            await self._subscribe_manager()
        loop = asyncio.get_running_loop()
        (job,) = await self.call(member, "ss", [unit, "replace"])
        if not wait:
            return "queued"
        done = self._finished_jobs.pop(str(job), None)
        if done is not None:
            return done
        fut = self._job_waiters.setdefault(str(job), loop.create_future())
        try:
            return await asyncio.wait_for(fut, timeout=timeout)
        except asyncio.TimeoutError:
            self._job_waiters.pop(str(job), None)
            raise SystemdError(
                f"{member} {unit}: job {job} not finished in {timeout:.0f}s"
            ) from None

    async def restart_unit(self, unit: str, *, wait: bool = True, timeout: float = 120) -> str:
        return await self._job("RestartUnit", unit, wait=wait, timeout=timeout)

    async def stop_unit(self, unit: str, *, wait: bool = True, timeout: float = 120) -> str:
        return await self._job("StopUnit", unit, wait=wait, timeout=timeout)

    async def start_unit(self, unit: str, *, wait: bool = True, timeout: float = 120) -> str:
        return await self._job("StartUnit", unit, wait=wait, timeout=timeout)

    async def set_unit_properties(
        self, unit: str, runtime: bool, props: list[tuple[str, Variant]]
    ) -> None:
        # dbus-next wants D-Bus structs as Python lists
        body = [[name, value] for name, value in props]
        await self.call("SetUnitProperties", "sba(sv)", [unit, runtime, body])
