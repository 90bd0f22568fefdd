"""The daemon's inventory reader through the real pynvml and the fake driver library:
NVML appearing late, or its GPU set changing, is an event (INVENTORY_CHANGED), which
wakes the checkpoint step; the reason NVML is missing on a GPU Operator node is kept."""

from __future__ import annotations

import asyncio
import io
import json
from pathlib import Path

import pytest

import fakenvml
from conftest import require_tool
from gpuguard.config import load_config
from gpuguard.engine.inventory_reader import InventoryReader
from gpuguard.host.paths import Root
from gpuguard.journal.log import EventLog
from gpuguard.steps.events import Event, EventKind
from gpuguard.steps.registry import CHECKPOINT, woken_by


def test_driver_arriving_late_is_an_event(tmp_path: Path) -> None:
    require_tool("gcc")
    (tmp_path / "usr/local/nvidia/toolkit").mkdir(parents=True)  # an Operator node
    out = io.StringIO()
    events: list[Event] = []
    root = Root(tmp_path)
    reader = InventoryReader(
        EventLog(stream=out, level="debug"), load_config(root), root=root, on_change=events.append
    )
    assert asyncio.run(reader.read()) is None
    assert "driver container has not started" in reader.pending and events == []
    lib_dir = tmp_path / "run/nvidia/driver/usr/lib64"
    fakenvml.build(lib_dir)
    fakenvml.write_conf(lib_dir, fakenvml.gpus(2))
    inv = asyncio.run(reader.read())
    assert inv is not None and len(inv.gpus) == 2 and reader.pending == ""
    (event,) = events
    assert event.kind is EventKind.INVENTORY_CHANGED and "available" in event.why
    assert CHECKPOINT in woken_by(event.kind)
    asyncio.run(reader.read())
    assert len(events) == 1  # the same GPUs: nothing new
    fakenvml.write_conf(lib_dir, fakenvml.gpus(2, prefix="GPU-ffff"))  # new UUIDs
    asyncio.run(reader.read())
    assert len(events) == 2 and "GPU set changed" in events[1].why
    logged = [json.loads(line) for line in out.getvalue().splitlines()]
    (lib,) = [e for e in logged if e["kind"] == "nvml-library"]
    assert lib["GPUGUARD_NVML_LIBRARY"].startswith("/run/nvidia/driver/usr/lib64/libnvidia-ml")
    assert "GPU Operator's driver root" in lib["msg"]


@pytest.mark.parametrize("configured", [False, True])
def test_a_configured_driver_root_is_read_again_on_reload(tmp_path: Path, configured: bool) -> None:
    require_tool("gcc")
    lib_dir = tmp_path / "opt/drv/usr/lib64"
    fakenvml.build(lib_dir)
    fakenvml.write_conf(lib_dir, fakenvml.gpus(1))
    root = Root(tmp_path)
    if configured:
        (tmp_path / "etc/gpuguard").mkdir(parents=True)
        (tmp_path / "etc/gpuguard/gpuguard.conf").write_text("[Inventory]\nDriverRoot=/opt/drv\n")
    reader = InventoryReader(EventLog(stream=io.StringIO()), load_config(root), root=root)
    inv = asyncio.run(reader.read())
    assert (inv is not None) == configured
