"""Lasting states are journaled when they appear, change and clear, not on every pass."""

from __future__ import annotations

import asyncio
import io
import json
from pathlib import Path
from typing import Any

from gpuguard.config import load_config
from gpuguard.engine.daemon import Daemon
from gpuguard.host.notify import Notifier
from gpuguard.host.paths import Root
from gpuguard.journal.conditions import CLEARED_KIND, Conditions, log_findings
from gpuguard.journal.log import EventLog
from gpuguard.model import Finding


def entries(stream: io.StringIO) -> list[dict[str, Any]]:
    return [json.loads(line) for line in stream.getvalue().splitlines()]


def test_transitions_only() -> None:
    c = Conditions()
    t = c.set("s", ("k",), "down")
    assert t is not None and (t.state, t.previous) == ("down", None)
    assert c.set("s", ("k",), "down") is None  # same state: nothing to report
    t = c.set("s", ("k",), "worse")
    assert t is not None and (t.state, t.previous) == ("worse", "down")
    t = c.set("s", ("k",), None)
    assert t is not None and (t.state, t.previous) == (None, "worse")
    assert c.set("s", ("k",), None) is None  # never held: no "cleared" either


def test_update_clears_what_is_no_longer_there() -> None:
    c = Conditions()
    assert len(c.update("s", {("a",): "x", ("b",): "y"})) == 2
    assert c.update("s", {("a",): "x", ("b",): "y"}) == []
    (t,) = c.update("s", {("a",): "x"})
    assert t.key == ("b",) and t.state is None and t.previous == "y"
    assert c.update("other", {}) == []  # scopes are independent
    assert c.holds("s") == {("a",): "x"}


def missing(cid: str, device: str = "/dev/nvidia-uvm") -> Finding:
    return Finding(
        "container-device-missing",
        "container_access",
        f"pod p container {cid} has no {device} in its /dev",
        {"CONTAINER_ID": cid, "POD_UID": "p", "DEVICE": device, "CAUSE": "c"},
        "warning",
    )


def test_findings_logged_once_per_container_and_state_then_cleared() -> None:
    out = io.StringIO()
    log, cond = EventLog(stream=out), Conditions()
    for _ in range(5):  # five passes, two containers in the same state
        log_findings(log, cond, "container_access", [missing("c1"), missing("c2")])
    assert [(e["kind"], e["CONTAINER_ID"]) for e in entries(out)] == [
        ("container-device-missing", "c1"),
        ("container-device-missing", "c2"),
    ]
    assert all(e["level"] == "warning" for e in entries(out))
    log_findings(log, cond, "container_access", [missing("c2")])  # c1's pod was recreated
    last = entries(out)[-1]
    assert last["kind"] == CLEARED_KIND and last["level"] == "info"
    assert last["GPUGUARD_CLEARED_KIND"] == "container-device-missing"
    assert last["GPUGUARD_SUBJECT"] == "c1"
    assert last["msg"] == "no longer so: pod p container c1 has no /dev/nvidia-uvm in its /dev"
    assert len(entries(out)) == 3


def test_daemon_reports_a_missing_inventory_once_and_when_it_is_back(tmp_path: Path) -> None:
    inventory = tmp_path / "inventory.json"
    out = io.StringIO()
    root = Root(tmp_path / "root")
    daemon = Daemon(
        root=root,
        config=load_config(root),
        config_path=None,
        log=EventLog(stream=out),
        notifier=Notifier(""),
        inventory_path=inventory,
        bus_address="unix:path=/nonexistent",
        steps={},
    )

    async def passes(n: int) -> None:
        for _ in range(n):
            await daemon.inventory_reader.read()

    asyncio.run(passes(4))
    (e,) = entries(out)
    assert e["kind"] == "inventory-unavailable" and e["level"] == "warning"
    assert e["GPUGUARD_PROBLEM"] == (
        f"GPU inventory unavailable: {inventory}: cannot read inventory: "
        "no such file — check --inventory or [Inventory] File="
    )
    inventory.write_text(json.dumps({"gpus": []}))
    asyncio.run(passes(3))
    assert [x["kind"] for x in entries(out)] == ["inventory-unavailable", "inventory-available"]
    assert entries(out)[1]["level"] == "notice"
