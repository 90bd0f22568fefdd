"""How the systemd source reads signals: one mark per real event, none for noise."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from dbus_next import Message, MessageType, Variant

from gpuguard.host.systemd import MANAGER, PROPS, UNIT
from gpuguard.journal.log import EventLog
from gpuguard.sources.systemd import SystemdSource, unit_object_path
from gpuguard.steps.events import Event, EventKind
from gpuguard.steps.registry import ALL_STEPS, woken_by

ALL = ALL_STEPS


class Recorder:
    """The source's events, and the marks the registry makes of them."""

    def __init__(self) -> None:
        self.events: list[Event] = []
        self.holds: list[bool] = []
        self.now = 100.0

    def mark(self, e: Event) -> None:
        self.events.append(e)

    @property
    def marks(self) -> list[tuple[frozenset[str], str, bool]]:
        return [(woken_by(e.kind), e.why, e.urgent) for e in self.events]


def _source(private: Any = None) -> tuple[SystemdSource, Recorder]:
    rec = Recorder()
    src = SystemdSource(
        lambda: None,  # type: ignore[arg-type,return-value]
        rec.mark,
        rec.holds.append,
        EventLog(level="error"),
        clock=lambda: rec.now,
        private=private,
    )
    return src, rec


def _sig(
    member: str, body: list[Any], *, interface: str = MANAGER, path: str = "/x", sig: str = ""
) -> Message:
    return Message(
        message_type=MessageType.SIGNAL,
        path=path,
        interface=interface,
        member=member,
        signature=sig,
        body=body,
    )


def _props(unit: str, state: str) -> Message:
    return _sig(
        "PropertiesChanged",
        [UNIT, {"ActiveState": Variant("s", state)}, []],
        interface=PROPS,
        path=unit_object_path(unit),
        sig="sa{sv}as",
    )


@pytest.mark.parametrize(
    ("unit", "path"),
    [
        ("kubelet.service", "/org/freedesktop/systemd1/unit/kubelet_2eservice"),
        ("containerd.service", "/org/freedesktop/systemd1/unit/containerd_2eservice"),
        (
            "cri-containerd-ab12.scope",
            "/org/freedesktop/systemd1/unit/cri_2dcontainerd_2dab12_2escope",
        ),
        ("1x.service", "/org/freedesktop/systemd1/unit/_31x_2eservice"),
    ],
)
def test_unit_object_path(unit: str, path: str) -> None:
    assert unit_object_path(unit) == path


def test_reload_holds_then_marks_everything_once() -> None:
    src, rec = _source()
    src._handle(_sig("Reloading", [True], sig="b"))
    for i in range(50):  # the burst a reload brings: ignored while reloading
        src._handle(_sig("UnitNew", [f"cri-containerd-{i:064x}.scope", "/p"], sig="so"))
        src._handle(_props("kubelet.service", "active"))
    src._handle(_sig("Reloading", [False], sig="b"))
    assert rec.holds == [True, False]
    assert rec.marks == [(ALL, "systemd: daemon-reload/reexec finished", True)]


def test_reexec_inside_reload_pair_is_one_mark() -> None:
    src, rec = _source()
    src._handle(_sig("Reloading", [True], sig="b"))
    src._handle(
        _sig(
            "NameOwnerChanged",
            ["org.freedesktop.systemd1", ":1.1", ":1.9"],
            interface="org.freedesktop.DBus",
            sig="sss",
        )
    )
    src._handle(_sig("Reloading", [False], sig="b"))
    rec.now += 0.5  # a late NameOwnerChanged right after the pair is the same reexec
    src._handle(
        _sig(
            "NameOwnerChanged",
            ["org.freedesktop.systemd1", ":1.9", ":1.10"],
            interface="org.freedesktop.DBus",
            sig="sss",
        )
    )
    assert len(rec.marks) == 1


def test_lone_reexec_marks() -> None:
    src, rec = _source()
    src._handle(
        _sig(
            "NameOwnerChanged",
            ["org.freedesktop.systemd1", ":1.1", ":1.9"],
            interface="org.freedesktop.DBus",
            sig="sss",
        )
    )
    src._handle(  # systemd going away (shutdown) is not a reexec
        _sig(
            "NameOwnerChanged",
            ["org.freedesktop.systemd1", ":1.9", ""],
            interface="org.freedesktop.DBus",
            sig="sss",
        )
    )
    assert rec.marks == [(ALL, "systemd: daemon-reexec", True)]


def test_restart_detected_from_active_state_transitions() -> None:
    src, rec = _source()
    src._active[unit_object_path("kubelet.service")] = "active"
    for state in ("active", "deactivating", "inactive", "activating", "active", "active"):
        src._handle(_props("kubelet.service", state))
    src._handle(_props("containerd.service", "active"))  # first seen: a start
    src._handle(_props("unrelated.service", "active"))
    whys = [m[1] for m in rec.marks]
    assert whys == ["systemd: kubelet.service started", "systemd: containerd.service started"]
    assert "checkpoint" in rec.marks[0][0]
    assert "checkpoint" not in rec.marks[1][0]


def test_the_bridge_leaving_active_wakes_the_device_plugin_step_once() -> None:
    """Its streams ended: kubelet 1.26+ may have dropped the plugin that replaced it."""
    src, rec = _source()
    bridge = "gpuguard-readmit.service"
    src._active[unit_object_path(bridge)] = "active"
    states = (
        *("active", "deactivating", "inactive"),  # a stop: once its process is gone
        *("activating", "active"),  # started again: nothing
        *("activating", "activating", "active"),  # killed, restarted by Restart=
        *("failed", "inactive", "activating"),  # a crash, then started by hand
    )
    for state in states:
        src._handle(_props(bridge, state))
    assert [m[1] for m in rec.marks] == [
        "systemd: gpuguard-readmit.service ended (inactive)",
        "systemd: gpuguard-readmit.service ended (activating)",
        "systemd: gpuguard-readmit.service ended (failed)",
    ]
    assert all(m[0] == {"device_plugin"} for m in rec.marks)


def _job_removed(unit: str, result: str = "done") -> Message:
    return _sig("JobRemoved", [7, "/org/freedesktop/systemd1/job/7", unit, result], sig="uoss")


def test_new_container_scope_wakes_container_access() -> None:
    """A scope's job end is a SCOPE_STARTED naming the unit; the registry wakes the
    container access step on it."""
    src, rec = _source()
    src._handle(_job_removed("cri-containerd-" + "a" * 64 + ".scope"))
    src._handle(_job_removed("session-3.scope"))
    src._handle(_job_removed("cri-containerd-" + "b" * 64 + ".scope", "failed"))
    assert rec.marks == [
        (
            frozenset({"container_access"}),
            "systemd: new container scope cri-containerd-" + "a" * 64 + ".scope",
            False,
        )
    ]
    assert rec.events[0].unit == "cri-containerd-" + "a" * 64 + ".scope"


def test_a_scope_and_a_reloads_end_carry_what_the_fast_paths_need() -> None:
    """The scope's unit, and when the reload's end arrived (the daemon runs the reload
    fast paths on it before it marks the pass: test_step_registry.py)."""
    src, rec = _source()
    unit = "cri-containerd-" + "a" * 64 + ".scope"
    src._handle(_job_removed(unit))
    src._handle(_sig("Reloading", [True], sig="b"))
    src._handle(_job_removed(unit))  # inside a reload: units in flux, not a start
    src._handle(_sig("Reloading", [False], sig="b"))
    assert [(e.kind, e.unit, e.at) for e in rec.events] == [
        (EventKind.SCOPE_STARTED, unit, 0.0),
        (EventKind.SYSTEMD_RELOADED, "", 100.0),
    ]


def test_unit_new_is_not_listened_to() -> None:
    """A reload brings a UnitNew per unit, all parsed before its Reloading(false): the
    client no longer asks for them."""
    from gpuguard.host.systemd import MANAGER_SIGNALS

    assert "UnitNew" not in MANAGER_SIGNALS and "JobRemoved" in MANAGER_SIGNALS
    src, rec = _source()
    src._handle(_sig("UnitNew", ["cri-containerd-" + "a" * 64 + ".scope", "/p"], sig="so"))
    assert rec.marks == []


def test_malformed_signal_is_ignored() -> None:
    src, rec = _source()
    src._on_signal(_sig("Reloading", [], sig=""))  # body missing
    assert rec.marks == []


class FakeWatch:
    def __init__(self, report: Any) -> None:
        self.report = report
        self.connected = False
        self.on_connect: Any = lambda: None

    def stop(self) -> None: ...


def _both() -> tuple[SystemdSource, Recorder, Any, Any]:
    """A source with a private-socket watch; (bus, private) deliver Reloading(b)."""
    src, rec = _source(private=FakeWatch)
    watch = src.private
    assert isinstance(watch, FakeWatch)
    watch.on_connect()

    def bus(active: bool) -> None:
        src._handle(_sig("Reloading", [active], sig="b"))

    return src, rec, bus, watch.report


def test_each_reload_is_acted_on_once_whichever_path_delivers_it_first() -> None:
    src, rec, bus, private = _both()
    # the private socket first (the usual order: the bus routes a backlog ahead of it)
    private(True), private(False), bus(True), bus(False)  # type: ignore[func-returns-value]
    assert rec.holds == [True, False] and len(rec.marks) == 1
    assert src.last_reload_via == "private-socket"
    # the bus first, the private copy dropped
    bus(True), bus(False), private(True), private(False)  # type: ignore[func-returns-value]
    assert rec.holds == [True, False, True, False] and len(rec.marks) == 2
    assert src.last_reload_via == "bus"
    # interleaved: the start from one, the end from the other
    private(True), bus(True), bus(False), private(False)  # type: ignore[func-returns-value]
    assert rec.holds[-2:] == [True, False] and len(rec.marks) == 3


def test_a_reexec_that_closes_the_private_socket_ends_through_the_bus_once() -> None:
    src, rec, bus, private = _both()
    private(True)  # then the old systemd execs: the connection closes, no end on it
    bus(True)  # the bus's late copy of the start
    bus(False)  # the new systemd's end, on the bus only
    assert rec.holds == [True, False] and len(rec.marks) == 1
    assert src.last_reload_via == "bus"
    src.private.on_connect()  # type: ignore[union-attr]  # reconnected: counts from here
    private(True), private(False), bus(True), bus(False)  # type: ignore[func-returns-value]
    assert rec.holds == [True, False, True, False] and len(rec.marks) == 2


def test_a_path_connected_inside_a_reload_never_holds_passes_after_its_end() -> None:
    """The private socket connects after systemd sent the start (it sees only the end)
    and the bus's start comes late: that start must not open a reload never closed."""
    src, rec, bus, private = _both()
    private(False)  # its first: the end of a reload whose start it missed
    bus(True), bus(False)  # type: ignore[func-returns-value]
    assert rec.holds == [False] and len(rec.marks) == 1
    assert not src._reloading


def test_every_delivery_is_counted_per_path_and_each_reload_acted_on_once() -> None:
    src, rec, bus, private = _both()
    for _ in range(3):
        private(True), bus(True), bus(False), private(False)  # type: ignore[func-returns-value]
    assert src.reloads_acted == 3 and len(rec.marks) == 3
    assert src.received == {"bus": [3, 3], "private-socket": [3, 3]}


def test_a_bug_in_the_private_watch_ends_the_source() -> None:
    """Not swallowed while the bus goes on: the daemon surfaces it and exits 70."""
    from gpuguard.host.systemd import SystemdError

    class Crashing(FakeWatch):
        async def run(self) -> None:
            raise RuntimeError("a bug in the watch")

    class NoBus:
        async def connect(self) -> None:
            raise SystemdError("no bus here")

        def disconnect(self) -> None: ...

    src = SystemdSource(
        NoBus,  # type: ignore[arg-type]
        lambda e: None,
        lambda held: None,
        EventLog(level="error"),
        private=Crashing,
    )
    with pytest.raises(RuntimeError, match="a bug in the watch"):
        asyncio.run(asyncio.wait_for(src.run(), 5))
