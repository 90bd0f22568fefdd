"""F3 on both cgroup layouts: a device plugin in a real containerd + runc container with
runc's systemd cgroup driver (``SystemdCgroup = true``), on a real systemd booted
hybrid (v1) or unified (v2), started before /dev/nvidia-uvm existed.

gpuguard must recognise the plugin's process as a container on either layout and stop
it through the runtime (``METHOD=ctr``; no crictl here), never with a signal behind the
runtime's back (issue 12: on v2 it read the v1 devices line of /proc/PID/cgroup, which
a kernel with v1 hierarchies still lists at their root, and sent SIGTERM).

The step runs in this process, as the device-plugin tests do (test_device_plugin.py),
against a test root whose /proc and /sys are the host's and whose /dev is the
namespace's private /dev (fake nodes, made there with mknod). The test plays kubelet:
whenever the plugin's task stops, it deletes the container and starts a new one, given
what "the plugin" would be given now.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import shutil
import time
import uuid
from pathlib import Path
from typing import Any, List, Tuple

import pytest

from conftest import require_tool
from gpuguard.actuate.containers import ContainerStopper
from gpuguard.devices.processes import process_info
from gpuguard.host.paths import Root
from gpuguard.steps.device_plugin import DevicePluginStep
from gpuguard.steps.device_plugin.actuate import PluginRestarter
from integration.gpuguard_ns import wait_for
from integration.harness import SystemdNamespace
from integration.harness import layout as layout
from integration.harness import systemd_ns as systemd_ns
from integration.harness.containerd import SOCKET_SERVER
from integration.harness.runc_env import (
    REQUIRED_TOOLS,
    SOCK,
    Containerd,
    RuncContainer,
    prepare,
)
from integration.plugin_node import DP, journal, make_svc, run_with_kubelet

pytestmark = pytest.mark.root

UVM_REASON = "udev: module nvidia_uvm add"
BEFORE_UVM = ["nvidia0", "nvidiactl"]
WITH_UVM = [*BEFORE_UVM, "nvidia-uvm", "nvidia-uvm-tools"]


class PluginNode:
    """The namespace, its containerd, a test root over them, and a kubelet stand-in."""

    def __init__(self, ns: SystemdNamespace, cd: Containerd, root: Path) -> None:
        self.ns, self.cd, self.root = ns, cd, root
        self.uvm = False
        self.started: List[Tuple[RuncContainer, int]] = []

    @property
    def plugin(self) -> RuncContainer:
        return self.started[-1][0]

    def start_plugin(self) -> int:
        n = len(self.started)
        c = RuncContainer(
            str(uuid.UUID(int=0xD000 + n)),
            hashlib.sha256(b"plugin%d" % n).hexdigest(),
            (0,),
            True,
        )
        pid = self.cd.run(
            c,
            hook_grant=False,
            spec_devices=True,
            nodes=WITH_UVM if self.uvm else BEFORE_UVM,
            args=["/usr/bin/python3", "-I", "-S", "-c", SOCKET_SERVER, f"{DP}/nvidia-gpu.sock"],
            mounts=[("/usr", "/usr", "ro"), (DP, DP, "rw")],
        )
        self.started.append((c, pid))
        sock = self.ns.path(f"{DP}/nvidia-gpu.sock")
        wait_for(lambda: sock.exists() and _listening(pid), what="the plugin's socket")
        return pid

    async def play_kubelet(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            status = await asyncio.to_thread(self.cd.task_status, self.plugin)
            if status != "RUNNING":
                await asyncio.to_thread(self.cd.remove, self.plugin)
                await asyncio.to_thread(self.start_plugin)
            await asyncio.sleep(0.05)


def _listening(pid: int) -> bool:
    text = Path(f"/proc/{pid}/net/unix").read_text()
    return any(ln.endswith("nvidia-gpu.sock") and " 00010000 " in ln for ln in text.splitlines())


def _boot(systemd_ns: Any, tmp_path: Path, layout: str) -> PluginNode:
    require_tool(*REQUIRED_TOOLS)
    units, binds = prepare(tmp_path / "ctr")
    ns = systemd_ns(layout=layout, units=units, binds=binds)
    ns.path(DP).mkdir(parents=True)
    cd = Containerd(ns)
    cd.start()
    for name, numbers in (("nvidia0", "195 0"), ("nvidiactl", "195 255")):
        ns.run(["mknod", "-m", "666", f"/dev/{name}", "c", *numbers.split()], check=True)
    root = tmp_path / "root"
    (root / "var/lib/kubelet").mkdir(parents=True)
    (root / "var/lib/gpuguard").mkdir(parents=True)
    os.symlink("/proc", root / "proc")
    os.symlink("/sys", root / "sys")
    os.symlink(ns.path("/dev"), root / "dev")
    os.symlink(ns.path(DP), root / DP.lstrip("/"))
    return PluginNode(ns, cd, root)


def test_stale_plugin_restarted_through_the_runtime_on_either_layout(  # type: ignore[no-untyped-def]
    systemd_ns, tmp_path, layout
) -> None:
    node = _boot(systemd_ns, tmp_path, layout)
    first_pid = node.start_plugin()
    info = process_info(Root(node.root), first_pid)
    assert info is not None
    assert (info.kind, info.container_id, info.runtime) == (
        "container",
        node.plugin.container_id,
        "containerd",
    ), info.cgroup

    for name, minor in (("nvidia-uvm", "0"), ("nvidia-uvm-tools", "1")):
        node.ns.run(["mknod", "-m", "666", f"/dev/{name}", "c", "511", minor], check=True)
    node.uvm = True  # a plugin started now sees uvm
    old = node.plugin.container_id
    svc, out = make_svc(node.root, cool_down=0.0)
    step = DevicePluginStep(
        restarter=PluginRestarter(
            stopper=ContainerStopper(
                crictl="/nonexistent/crictl",
                ctr=shutil.which("ctr") or "/usr/bin/ctr",
                ctr_address=str(node.ns.path(SOCK)),
                ctr_namespace="default",
                command_timeout=20,
            ),
            signal_fallback=False,  # a signal would be the bug: fail instead
        ),
        verify_timeout=20,
        poll=0.05,
    )
    t0 = time.monotonic()
    ctx = asyncio.run(run_with_kubelet(step, svc, node.play_kubelet, UVM_REASON))  # type: ignore[arg-type]
    took = time.monotonic() - t0

    (missing,) = [f for f in ctx.findings if f.kind == "plugin-missing-device"]
    assert missing.fields["CONTAINER_ID"] == old
    (o,) = ctx.outcomes
    assert o.status == "done", o.detail
    (restarted,) = journal(out, "plugin-restarted")
    assert restarted["METHOD"] == "ctr" and restarted["CONTAINER_ID"] == old
    (rec,) = journal(out, "plugin-recovered")
    new, new_pid = node.started[-1]
    assert new.container_id != old and int(rec["NEW_PLUGIN_PID"]) == new_pid != first_pid
    assert "nvidia-uvm" in os.listdir(f"/proc/{new_pid}/root/dev")
    print(f"\n{layout}: stale plugin replaced through the runtime in {took:.2f} s")
    node.cd.remove_all()
