"""Tables for gpuguard.sources.udev.classify() and UdevSource's drain loop (fake monitor)."""

from __future__ import annotations

import asyncio
import errno
import logging
from typing import Any

import pytest

from gpuguard.sources import udev
from gpuguard.sources.udev import UdevSource, choose_source, classify, is_urgent
from gpuguard.steps.events import Event, EventKind

MODULE = EventKind.NVIDIA_MODULE
PCI = EventKind.NVIDIA_PCI

NV_PCI = {
    "SUBSYSTEM": "pci",
    "DEVPATH": "/devices/pci0000:00/0000:00:02.0/0000:3b:00.0",
    "PCI_ID": "10DE:2330",
    "PCI_SLOT_NAME": "0000:3b:00.0",
    "MODALIAS": "pci:v000010DEd00002330sv000010DEsd000016C1bc03sc02i00",
}


def module(name: str, action: str, **extra: str) -> dict[str, str]:
    return {"ACTION": action, "SUBSYSTEM": "module", "DEVPATH": f"/module/{name}", **extra}


def pci(action: str, **override: str) -> dict[str, str]:
    props = {"ACTION": action, **NV_PCI}
    props.update(override)
    return {k: v for k, v in props.items() if v != ""}


CASES: list[tuple[str, dict[str, str], frozenset[str] | None, str | None]] = [
    # (id, props, reconcilers or None for ignored, expected why)
    ("nvidia add", module("nvidia", "add"), MODULE, "udev: module nvidia add"),
    ("uvm add", module("nvidia_uvm", "add"), MODULE, "udev: module nvidia_uvm add"),
    ("modeset rm", module("nvidia_modeset", "remove"), MODULE, None),
    ("drm add", module("nvidia_drm", "add"), MODULE, None),
    # udevadm trigger --action=change replays modules too: a cheap re-check.
    ("nvidia change", module("nvidia", "change"), MODULE, None),
    # As seen after rules: extra properties do not matter.
    (
        "nvidia add tagged",
        module("nvidia", "add", TAGS=":gpuguard:systemd:", GPUGUARD_KIND="module"),
        MODULE,
        None,
    ),
    ("other module", module("nvme", "add"), None, None),
    ("prefix is not a match", module("nvidia_peermem", "add"), None, None),
    ("suffix is not a match", module("xnvidia", "add"), None, None),
    ("module bind ignored", module("nvidia", "bind"), None, None),
    ("pci add", pci("add"), PCI, "udev: pci 0000:3b:00.0 (10DE:2330) add"),
    ("pci remove", pci("remove"), PCI, "udev: pci 0000:3b:00.0 (10DE:2330) remove"),
    (
        "pci bind",
        pci("bind", DRIVER="nvidia"),
        PCI,
        "udev: pci 0000:3b:00.0 (10DE:2330) bind driver=nvidia",
    ),
    ("pci unbind", pci("unbind"), PCI, None),
    (
        "pci AER recovery",
        pci("change", ERROR_EVENT="SUCCESSFUL_RECOVERY", DEVICE_ONLINE="1"),
        PCI,
        "udev: pci 0000:3b:00.0 (10DE:2330) change ERROR_EVENT=SUCCESSFUL_RECOVERY",
    ),
    ("lower-case PCI_ID", pci("add", PCI_ID="10de:2330"), PCI, None),
    # MODALIAS fallback when PCI_ID is missing.
    ("modalias only", pci("remove", PCI_ID=""), PCI, None),
    ("intel pci", pci("add", PCI_ID="8086:0D57", MODALIAS="pci:v00008086d00000D57"), None, None),
    ("virtio pci", pci("bind", PCI_ID="1AF4:1041", MODALIAS=""), None, None),
    ("vendor as device id", pci("add", PCI_ID="1AF4:10DE", MODALIAS=""), None, None),
    ("pci without ids", pci("add", PCI_ID="", MODALIAS=""), None, None),
    ("pci unknown action", pci("online"), None, None),
    ("nvidia char device", {"ACTION": "add", "SUBSYSTEM": "nvidia", "DEVPATH": "/x"}, None, None),
    ("drm card", {"ACTION": "add", "SUBSYSTEM": "drm", "DEVPATH": "/d/card0"}, None, None),
    ("no action", {"SUBSYSTEM": "module", "DEVPATH": "/module/nvidia"}, None, None),
    ("no devpath", {"ACTION": "add", "SUBSYSTEM": "module"}, None, None),
    ("empty", {}, None, None),
]


@pytest.mark.parametrize(
    ("props", "names", "why"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_classify(props: dict[str, str], names: EventKind | None, why: str | None) -> None:
    result = classify(props)
    if names is None:
        assert result is None
        return
    assert result is not None
    assert result[0] == names
    assert result[1].startswith("udev: ")
    if why is not None:
        assert result[1] == why


@pytest.mark.parametrize(
    ("props", "urgent"),
    [
        (module("nvidia", "add"), True),
        (module("nvidia", "remove"), False),
        (module("nvidia", "change"), False),
        (pci("add"), True),
        (pci("bind"), True),
        (pci("unbind"), False),
        (pci("remove"), False),
    ],
)
def test_urgency(props: dict[str, str], urgent: bool) -> None:
    assert is_urgent(props) is urgent


def test_widened_matches_for_tests() -> None:
    # The integration tests widen the match to hardware present on a VM.
    assert classify(module("loop", "add")) is None
    assert classify(module("loop", "add"), modules=["loop"]) is not None
    intel = pci("change", PCI_ID="8086:0D57", MODALIAS="")
    assert classify(intel) is None
    assert classify(intel, pci_vendors=["8086"]) is not None
    assert classify(intel, pci_vendors=["10de"]) is None


def test_module_name_is_devpath_basename() -> None:
    # KERNEL in the rules == basename of DEVPATH; classify must agree.
    props = {"ACTION": "add", "SUBSYSTEM": "module", "DEVPATH": "/module/nvidia/extra"}
    assert classify(props) is None


def test_choose_source(tmp_path: Any) -> None:
    assert choose_source(str(tmp_path)) == "kernel"
    (tmp_path / "udev").mkdir()
    (tmp_path / "udev" / "control").touch()
    assert choose_source(str(tmp_path)) == "udev"


def test_rejects_unknown_source() -> None:
    loop = asyncio.new_event_loop()
    try:
        with pytest.raises(ValueError):
            UdevSource(loop, lambda *_: None, source="netlink", log=logging.getLogger("t"))
    finally:
        loop.close()


class FakeDevice:
    def __init__(self, props: dict[str, str]) -> None:
        self.properties = props


class BadDevice:
    @property
    def properties(self) -> dict[str, str]:
        raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "garbled")


class FakeMonitor:
    """Replays a script of poll() results: a device, an exception, or None (empty)."""

    def __init__(self, script: list[Any]) -> None:
        self.script = list(script)
        self.polls = 0

    def poll(self, timeout: float | None = None) -> Any:
        assert timeout == 0, "the drain loop must never block"
        self.polls += 1
        if not self.script:
            return None
        item = self.script.pop(0)
        if isinstance(item, BaseException):
            raise item
        return item


def drain(script: list[Any]) -> tuple[list[tuple[EventKind, str, bool]], FakeMonitor]:
    marks: list[tuple[EventKind, str, bool]] = []
    loop = asyncio.new_event_loop()

    def emit(e: Event) -> None:
        marks.append((e.kind, e.why, e.urgent))

    try:
        src = UdevSource(loop, emit, log=logging.getLogger("t.udev"))
        monitor = FakeMonitor(script)
        src._monitor = monitor  # the drain loop, without libudev
        src._on_readable()
    finally:
        loop.close()
    return marks, monitor


def test_burst_is_drained_in_one_wakeup() -> None:
    script = [FakeDevice(module("nvidia", "add")), FakeDevice(module("nvme", "add"))]
    script += [FakeDevice(pci("bind"))] * 8
    marks, monitor = drain(script)
    assert len(marks) == 9
    assert marks[0] == (MODULE, "udev: module nvidia add", True)
    assert monitor.polls == 11  # ten events, then the empty poll that ends the drain


def test_garbled_events_are_skipped_not_raised(caplog: pytest.LogCaptureFixture) -> None:
    script = [
        OSError(errno.EINVAL, "Invalid argument"),
        BadDevice(),
        ValueError("libudev returned junk"),
        FakeDevice(module("nvidia_uvm", "add")),
    ]
    with caplog.at_level(logging.WARNING):
        marks, _ = drain(script)
    assert marks == [(MODULE, "udev: module nvidia_uvm add", True)]
    assert caplog.text.count("skipping") == 3


def test_overflow_marks_everything() -> None:
    marks, _ = drain([OSError(errno.ENOBUFS, "No buffer space available")])
    lost = EventKind.UDEV_EVENTS_LOST
    assert marks == [(lost, "udev: monitor overflowed, events lost", True)]


def test_flood_is_bounded_per_wakeup() -> None:
    n = udev.MAX_EVENTS_PER_WAKEUP + 10
    marks, monitor = drain([FakeDevice(module("nvidia", "remove"))] * n)
    assert len(marks) == udev.MAX_EVENTS_PER_WAKEUP
    assert len(monitor.script) == 10  # left for the next wake-up


def test_a_failing_mark_does_not_escape(caplog: pytest.LogCaptureFixture) -> None:
    loop = asyncio.new_event_loop()
    try:

        def mark(*_: Any) -> None:
            raise RuntimeError("coalescer bug")

        src = UdevSource(loop, mark, log=logging.getLogger("t.udev"))
        src._monitor = FakeMonitor([FakeDevice(module("nvidia", "add"))] * 2)
        with caplog.at_level(logging.ERROR):
            src._on_readable()
        assert caplog.text.count("error while handling") == 2
    finally:
        loop.close()


def test_receive_buffer_sized_within_rmem_max_without_privilege() -> None:
    """SO_RCVBUF up to net.core.rmem_max: granted without CAP_NET_ADMIN, never an error."""
    import socket
    from pathlib import Path

    from gpuguard.sources.udev import NETLINK_KOBJECT_UEVENT, size_receive_buffer

    rmem_max = int(Path("/proc/sys/net/core/rmem_max").read_text())
    sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_KOBJECT_UEVENT)
    try:
        got = size_receive_buffer(sock.fileno(), 8 * 1024 * 1024)
        assert got == min(8 * 1024 * 1024, rmem_max)
        assert size_receive_buffer(sock.fileno(), 64 * 1024) == 64 * 1024
        assert sock.fileno() >= 0 and sock.getsockopt(socket.SOL_SOCKET, socket.SO_TYPE)
    finally:
        sock.close()


def test_start_logs_no_warning(caplog: pytest.LogCaptureFixture) -> None:
    """A real kernel-source monitor: the buffer size is in the info line, no warning."""
    loop = asyncio.new_event_loop()
    src = udev.UdevSource(loop, lambda *a: None, source="kernel", log=logging.getLogger("t.u"))
    try:
        with caplog.at_level(logging.DEBUG, logger="t.u"):
            src.start()
    finally:
        src.stop()
        loop.close()
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    assert "KiB" in caplog.text and "receive buffer" in caplog.text
