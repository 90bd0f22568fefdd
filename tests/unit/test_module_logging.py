"""Module loggers (``logging.getLogger(__name__)`` in devices/, steps/ ...) reach the
event log: their debug lines at LogLevel=debug, nothing below it, and a SIGHUP's new
level applies to them too."""

from __future__ import annotations

import io
import json
import logging
from pathlib import Path
from typing import Any

import pytest

from gpuguard import cli
from gpuguard.devices.containers import CgroupLayout, discover_containers
from gpuguard.devices.nodes import read_proc_devices
from gpuguard.host.paths import Root
from gpuguard.journal.log import EventLog


def lines(out: io.StringIO) -> list[dict[str, Any]]:
    return [json.loads(line) for line in out.getvalue().splitlines()]


def test_a_module_debug_line_reaches_the_event_log_at_debug(tmp_path: Path) -> None:
    out = io.StringIO()
    log = EventLog(level="debug", stream=out)
    log.route_modules()
    read_proc_devices(Root(tmp_path))  # no /proc/devices in this root: a debug line
    (e,) = lines(out)
    assert e["level"] == "debug" and e["kind"] == "debug"
    assert e["msg"] == "cannot read /proc/devices: it does not exist"


def test_below_debug_nothing_and_a_new_level_applies(tmp_path: Path) -> None:
    out = io.StringIO()
    log = EventLog(level="info", stream=out)
    log.route_modules()
    read_proc_devices(Root(tmp_path))
    assert out.getvalue() == ""
    assert not logging.getLogger("gpuguard.devices.nodes").isEnabledFor(logging.DEBUG)
    log.set_level("debug")  # what SIGHUP does with LogLevel=debug
    read_proc_devices(Root(tmp_path))
    assert [e["msg"] for e in lines(out)] == ["cannot read /proc/devices: it does not exist"]


def test_the_cli_routes_them(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What every command gets from main: the module loggers go through its EventLog."""
    monkeypatch.setattr(EventLog, "auto", classmethod(lambda cls, **kw: EventLog(
        level=kw["level"], stream=io.StringIO())))  # fmt: skip
    args = cli.build_parser().parse_args(["check", "--root", str(tmp_path), "--log-level",
                                          "debug"])  # fmt: skip
    log = cli.log_from(args)
    (tmp_path / "sys/fs/cgroup/devices/kubepods/not-a-pod").mkdir(parents=True)
    discover_containers(Root(tmp_path), CgroupLayout("/sys/fs/cgroup/devices", None))
    assert any("not a pod or QoS directory" in e["msg"] for e in lines(log.stream))
