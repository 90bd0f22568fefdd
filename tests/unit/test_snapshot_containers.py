"""The kubepods tree is walked once per pass: the container access and device plugin
steps both take the containers from the pass's host snapshot."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, Iterator, Optional

import pytest

from gpuguard.config import Config
from gpuguard.devices import containers
from gpuguard.engine.executor import ChangeExecutor
from gpuguard.engine.oneshot import OneShotServices
from gpuguard.engine.passes import PassContext, Work
from gpuguard.engine.snapshot import HostSnapshot
from gpuguard.host.inventory import Inventory
from gpuguard.host.paths import Root
from gpuguard.journal.log import EventLog
from gpuguard.steps.registry import CONTAINER_ACCESS, DEVICE_PLUGIN, STEPS, build_steps
from unit.test_device_nodes_step import INV, _root
from unit.test_devices_containers import CID1, UID_, _cg, _proc


def test_one_walk_of_the_kubepods_tree_per_pass(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root: Root = _root(tmp_path)
    pod = f"kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID_}.slice"
    _cg(tmp_path / "sys/fs/cgroup/devices", f"{pod}/cri-containerd-{CID1}.scope", (100,))
    (tmp_path / "sys/fs/cgroup/devices/devices.list").write_text("a *:* rwm\n")
    _proc(tmp_path, 100, "/usr/bin/python3")
    walks: list[Path] = []
    real = containers.walk

    def counting(base: Path, *a: Any, **kw: Any) -> Iterator[Any]:
        walks.append(base)
        return real(base, *a, **kw)

    monkeypatch.setattr(containers, "walk", counting)
    cfg = Config()
    svc = OneShotServices(
        root, cfg, EventLog(level="error"), apply=ChangeExecutor(dry_run=True), bus_address=""
    )
    steps = build_steps([s for s in STEPS if s.name in (CONTAINER_ACCESS, DEVICE_PLUGIN)])

    async def inventory() -> Optional[Inventory]:
        return INV

    ctx = PassContext(
        Work(frozenset({CONTAINER_ACCESS, DEVICE_PLUGIN}), ("test",), 0, 0),
        inventory,
        snapshot=HostSnapshot(root, cfg.kubelet.checkpoint_path),
    )

    async def one_pass() -> None:
        await steps[CONTAINER_ACCESS](svc, ctx)
        await steps[DEVICE_PLUGIN](svc, ctx)

    asyncio.run(one_pass())
    assert walks == [root.path("/sys/fs/cgroup/devices")]
    assert ctx.snapshot is not None
    (c,) = ctx.snapshot.containers()
    assert c.container_id == CID1
