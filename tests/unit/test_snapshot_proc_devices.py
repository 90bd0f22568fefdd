"""/proc/devices is read once per pass: the device nodes and container access steps
both take the NVIDIA majors from the pass's host snapshot."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, Optional

import pytest

from gpuguard.config import Config
from gpuguard.devices import nodes
from gpuguard.engine.executor import ChangeExecutor
from gpuguard.engine.oneshot import OneShotServices
from gpuguard.engine.passes import PassContext, Work
from gpuguard.engine.snapshot import HostSnapshot
from gpuguard.host.inventory import Inventory
from gpuguard.host.paths import Root
from gpuguard.journal.log import EventLog
from gpuguard.steps.registry import CONTAINER_ACCESS, DEVICE_NODES, STEPS, build_steps
from unit.test_device_nodes_step import INV, _root


def test_one_read_of_proc_devices_per_pass(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root: Root = _root(tmp_path)
    reads: list[str] = []
    real = nodes.read_kernel_text

    def counting(path: Path, **kw: Any) -> Optional[str]:
        if str(path).endswith("/proc/devices"):
            reads.append(str(path))
        return real(path, **kw)

    monkeypatch.setattr(nodes, "read_kernel_text", counting)
    cfg = Config()
    svc = OneShotServices(
        root, cfg, EventLog(level="error"), apply=ChangeExecutor(dry_run=True), bus_address=""
    )
    steps = build_steps([s for s in STEPS if s.name in (DEVICE_NODES, CONTAINER_ACCESS)])

    async def inventory() -> Optional[Inventory]:
        return INV

    ctx = PassContext(
        Work(frozenset({DEVICE_NODES, CONTAINER_ACCESS}), ("test",), 0, 0),
        inventory,
        snapshot=HostSnapshot(root, cfg.kubelet.checkpoint_path),
    )

    async def one_pass() -> None:
        await steps[DEVICE_NODES](svc, ctx)
        await steps[CONTAINER_ACCESS](svc, ctx)

    asyncio.run(one_pass())
    assert reads == [str(root.path("/proc/devices"))]
    assert ctx.snapshot is not None and ctx.snapshot.majors.nvidia == 195
    # the device nodes step judged with those majors: it planned the missing nodes
    assert any(o.action.kind == "device-node-created" for o in ctx.outcomes)
