"""Restart a device plugin so that it starts afresh (and sees today's /dev), and verify.

How, in order of preference:

- a plugin in a Kubernetes container: stop the container through the runtime, so
  kubelet recreates it from its pod spec (crictl, else ctr: actuate/containers.py);
- a plugin run as a host service: systemd ``RestartUnit`` over D-Bus (actuate/units.py,
  which journals the restart: the result says so, and the step does not);
- last resort only (no runtime client worked, or a bare process): SIGTERM to the
  container's init (pid 1 of its pid namespace) or to the process, through a pidfd
  after checking that the pid still is the process we judged (same start time).

Every command runs with a timeout. Verification
waits (bounded) for a NEW process on the plugin's socket, then checks its /dev.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional

from gpuguard.actuate.containers import ContainerStopper
from gpuguard.actuate.units import UnitJob
from gpuguard.devices.plugins import NodeInfo, PluginInfo, discover_plugins, find_plugin, list_nodes
from gpuguard.devices.processes import (
    ProcessInfo,
    container_init_pid,
    same_process,
    still_running,
)
from gpuguard.host.paths import Root
from gpuguard.steps.device_plugin.reconcile import K_RESTARTED, RestartPlugin, view_gaps

if TYPE_CHECKING:
    from gpuguard.actuate.units import UnitJobs
    from gpuguard.config import RuntimeConfig


@dataclass(frozen=True)
class RestartResult:
    ok: bool
    method: str  # crictl | ctr | systemd | signal | none
    detail: str
    journaled: bool = False  # the unit-job actuator wrote the entry for this change


@dataclass(frozen=True)
class Verification:
    status: str  # "recovered" | "still-stale" | "timeout"
    plugin: Optional[PluginInfo]
    missing: tuple[str, ...]
    waited: float

    @property
    def ok(self) -> bool:
        return self.status == "recovered"


class PluginRestarter:
    def __init__(
        self, *, stopper: Optional[ContainerStopper] = None, signal_fallback: bool = True
    ) -> None:
        self.stopper = stopper or ContainerStopper()
        self.signal_fallback = signal_fallback

    @classmethod
    def from_config(cls, c: RuntimeConfig) -> PluginRestarter:
        return cls(stopper=ContainerStopper(crictl=c.crictl, cri_endpoint=c.cri_endpoint))

    def plan(self, p: ProcessInfo) -> str:
        """The method that will be tried first (for dry-run and journal)."""
        if p.kind == "container":
            return self.stopper.plan(p.runtime) or "signal"
        if p.kind == "service":
            return "systemd"
        return "signal"

    async def restart(
        self, root: Root, action: RestartPlugin, units: Optional[UnitJobs]
    ) -> RestartResult:
        p = action.process
        if not still_running(root, p):
            return RestartResult(False, "none", f"pid {p.pid} is no longer the plugin we judged")
        errors: list[str] = []
        method = self.plan(p)
        if method in ("crictl", "ctr"):
            stopped = await self.stopper.stop(p.container_id, p.runtime)
            if stopped.ok:
                return RestartResult(True, stopped.method, stopped.detail)
            errors += stopped.errors
            method = "signal"
        if method == "systemd":
            if units is None:
                return RestartResult(False, "systemd", f"{p.unit}: the system bus is down")
            why = f"(device plugin {action.identity}, {action.target}) because {action.reason}"
            fields = action.entry_fields(METHOD="systemd")
            timeout = self.stopper.command_timeout  # one bound for every restart command
            job = await units.run(
                UnitJob("restart", p.unit, why, K_RESTARTED, fields), timeout=timeout
            )
            if job.error:
                return RestartResult(False, "systemd", f"RestartUnit {p.unit}: {job.error}", True)
            detail = f"RestartUnit {p.unit}: job {job.result}"
            return RestartResult(job.ok, "systemd", detail, journaled=True)
        if not self.signal_fallback:
            return RestartResult(False, "none", "; ".join(errors) or "no way to restart it")
        return self._signal(root, p, errors)

    def _signal(self, root: Root, p: ProcessInfo, errors: list[str]) -> RestartResult:
        target = p.pid
        if p.kind == "container":
            target = container_init_pid(root, p.pid) or p.pid
        prefix = ("; ".join(errors) + "; ") if errors else ""
        try:
            fd = os.pidfd_open(target)
        except OSError as e:
            return RestartResult(False, "signal", f"{prefix}pidfd_open({target}): {e.strerror}")
        try:
            if target == p.pid and not still_running(root, p):
                return RestartResult(False, "signal", f"{prefix}pid {target} was recycled")
            signal.pidfd_send_signal(fd, signal.SIGTERM)
        except OSError as e:
            return RestartResult(False, "signal", f"{prefix}SIGTERM {target}: {e.strerror}")
        finally:
            os.close(fd)
        return RestartResult(True, "signal", f"{prefix}sent SIGTERM to pid {target}")


def check_new_plugin(
    root: Root,
    socket_dir: str,
    identity: str,
    old: ProcessInfo,
    host_nodes: tuple[NodeInfo, ...],
    *,
    extra: Optional[dict[str, str]] = None,
) -> tuple[Optional[PluginInfo], tuple[str, ...]]:
    """The plugin now serving ``identity`` if it is a new process, and what it lacks."""
    p = find_plugin(discover_plugins(root, socket_dir, extra=extra), identity)
    if p is None or p.process is None:
        return None, ()
    if same_process(p.process, old):
        return None, ()
    view = p.dev if p.dev is not None else list_nodes(root.path(f"/proc/{p.process.pid}/root/dev"))
    gaps, _how = view_gaps(host_nodes, view, p.process.start)
    return p, tuple(gaps)


async def verify(
    root: Root,
    socket_dir: str,
    identity: str,
    old: ProcessInfo,
    host_nodes: Callable[[], tuple[NodeInfo, ...]],
    *,
    timeout: float,
    poll: float = 0.25,
    extra: Optional[dict[str, str]] = None,
) -> Verification:
    """Wait up to ``timeout`` for a new plugin process on the socket; check its /dev."""
    t0 = time.monotonic()
    last: tuple[Optional[PluginInfo], tuple[str, ...]] = (None, ())
    while True:
        nodes = await asyncio.to_thread(host_nodes)
        last = await asyncio.to_thread(
            check_new_plugin, root, socket_dir, identity, old, nodes, extra=extra
        )
        waited = time.monotonic() - t0
        if last[0] is not None:  # a new plugin's /dev is final once it runs
            status = "still-stale" if last[1] else "recovered"
            return Verification(status, last[0], last[1], waited)
        if waited >= timeout:
            status = "still-stale" if last[0] is not None else "timeout"
            return Verification(status, last[0], last[1], waited)
        await asyncio.sleep(poll)
