"""What the device-plugin integration tests share: a test root over a private
containerd, the step's services, a pass, the journal lines, and a pass with a
kubelet stand-in alongside (it recreates what the step stops)."""

from __future__ import annotations

import asyncio
import dataclasses
import io
import json
import os
import time
from pathlib import Path
from typing import Any, Awaitable, Callable, Optional, Sequence

from gpuguard.config import Config, DevicePluginConfig
from gpuguard.engine.executor import ChangeExecutor
from gpuguard.engine.oneshot import OneShotServices
from gpuguard.engine.passes import PassContext, Work
from gpuguard.host.paths import Root
from gpuguard.journal.log import EventLog
from gpuguard.steps.device_plugin import DevicePluginStep
from integration.harness.containerd import PrivateContainerd

DP = "/var/lib/kubelet/device-plugins"


def host_root(c: PrivateContainerd, devs: Sequence[tuple[str, int, int]]) -> Path:
    """The host as gpuguard sees it: real /proc and /sys, the containerd's fake /dev
    (with `devs` made in it), a device-plugins directory and gpuguard's state dir."""
    root = c.work / "host"
    for d in (DP.lstrip("/"), "var/lib/gpuguard"):
        (root / d).mkdir(parents=True)
    os.symlink("/proc", root / "proc")
    os.symlink("/sys", root / "sys")
    os.symlink(c.host_dev, root / "dev")
    for name, major, minor in devs:
        c.mknod(os.path.basename(name), major, minor)
    return root


def make_svc(root: Path, **dp: Any) -> tuple[OneShotServices, io.StringIO]:
    cfg = Config(device_plugin=dataclasses.replace(DevicePluginConfig(), socket_dir=DP, **dp))
    out = io.StringIO()
    log = EventLog(stream=out, level="debug")
    return OneShotServices(
        Root(root), cfg, log, apply=ChangeExecutor(dry_run=False), bus_address=""
    ), out


async def _none() -> None:
    return None


def plugin_pass(reason: str) -> PassContext:
    now = time.monotonic()
    ctx = PassContext(Work(frozenset({"device_plugin"}), (reason,), now, now), _none)
    ctx.step = "device_plugin"  # as the pass runner sets it (its rechecks name it)
    return ctx


def journal(out: io.StringIO, kind: Optional[str] = None) -> list[dict[str, Any]]:
    all_ = [json.loads(line) for line in out.getvalue().splitlines()]
    return [e for e in all_ if kind is None or e["kind"] == kind]


async def run_with_kubelet(
    step: DevicePluginStep,
    svc: OneShotServices,
    kubelet: Callable[[asyncio.Event], Awaitable[None]],
    reason: str,
) -> PassContext:
    stop = asyncio.Event()
    task = asyncio.create_task(kubelet(stop))
    try:
        ctx = plugin_pass(reason)
        await step(svc, ctx)  # type: ignore[arg-type]
        return ctx
    finally:
        stop.set()
        await task
