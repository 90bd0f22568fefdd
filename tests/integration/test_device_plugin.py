"""F3 on a real container runtime: a device plugin that started before /dev/nvidia-uvm.

A private containerd (harness/containerd.py) runs a "plugin" container: busybox +
the host's python3 serving ``nvidia-gpu.sock`` in a device-plugins directory bound
from the test root, with /dev/nvidia0 and /dev/nvidiactl (fake numbers, 195:N) but no
uvm. Then the host gains the uvm nodes (mknod in a tmpfs private to containerd's
mount namespace: never the host /dev), and the step is called as the daemon would
call it after the nvidia_uvm module event. It must find the plugin through its socket
(in the container's own network namespace), see that its /dev lacks uvm, stop the
container through the real runtime (``ctr task kill``), and verify the replacement.

No kubelet runs, so the test plays kubelet: whenever the plugin's task is no longer
running it deletes the container and starts a new one, with the devices "the
plugin" would now be given.

The test root is a directory whose ``proc``/``sys`` link to the host's and whose
``dev`` links to the private node tmpfs (through containerd's /proc/PID/root).
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from conftest import require_root, require_tool
from gpuguard.actuate.containers import ContainerStopper
from gpuguard.engine.executor import ChangeExecutor
from gpuguard.engine.oneshot import OneShotServices
from gpuguard.engine.passes import PassContext
from gpuguard.steps.device_plugin import DevicePluginStep
from gpuguard.steps.device_plugin.actuate import PluginRestarter
from integration.harness.containerd import SOCKET_SERVER, PrivateContainerd
from integration.plugin_node import (
    DP,
    host_root,
    journal,
    make_svc,
    plugin_pass,
    run_with_kubelet,
)

pytestmark = pytest.mark.root

UVM_MAJOR = 510
GPU_DEVS = [("/dev/nvidia0", 195, 0), ("/dev/nvidiactl", 195, 255)]
UVM_DEVS = [("/dev/nvidia-uvm", UVM_MAJOR, 0), ("/dev/nvidia-uvm-tools", UVM_MAJOR, 1)]
UVM_REASON = "udev: module nvidia_uvm add"


class Node:
    """The test's host: a private containerd, a test root, and a kubelet stand-in."""

    def __init__(self, c: PrivateContainerd) -> None:
        self.c = c
        self.root = host_root(c, GPU_DEVS)
        self.plugin = ""
        self.plugin_uvm = False  # whether "the plugin" would be given uvm now
        self.plugins_started: list[tuple[str, int]] = []

    def add_uvm(self) -> None:
        for name, major, minor in UVM_DEVS:
            self.c.mknod(os.path.basename(name), major, minor)

    def start_plugin(self) -> int:
        cid = secrets.token_hex(32)
        devs = GPU_DEVS + (UVM_DEVS if self.plugin_uvm else [])
        pid = self.c.run(
            cid,
            ["/usr/bin/python3", "-I", "-S", "-c", SOCKET_SERVER, f"{DP}/nvidia-gpu.sock"],
            pod_uid=secrets.token_hex(4),
            devices=devs,
            binds=[(str(self.root / DP.lstrip("/")), DP, True)],
        )
        self.plugin = cid
        self.plugins_started.append((cid, pid))
        sock = self.root / DP.lstrip("/") / "nvidia-gpu.sock"
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # served once the new socket exists
            if sock.exists() and self._listening(pid):
                return pid
            time.sleep(0.02)
        raise AssertionError(f"plugin {cid[:12]} did not serve its socket: {self.c.log_tail()}")

    @staticmethod
    def _listening(pid: int) -> bool:
        text = Path(f"/proc/{pid}/net/unix").read_text()
        return any(
            line.endswith("nvidia-gpu.sock") and " 00010000 " in line for line in text.splitlines()
        )

    def start_workload(self) -> str:
        cid = secrets.token_hex(32)
        self.c.run(cid, ["/bin/sleep", "3600"], pod_uid=secrets.token_hex(4), devices=GPU_DEVS)
        return cid

    async def play_kubelet(self, stop: asyncio.Event) -> None:
        """Recreate the plugin container whenever its task is gone (kubelet's job)."""
        while not stop.is_set():
            status = await asyncio.to_thread(self.c.task_status, self.plugin)
            if status != "RUNNING":
                await asyncio.to_thread(self.c.remove, self.plugin)
                await asyncio.to_thread(self.start_plugin)
            await asyncio.sleep(0.02)


@pytest.fixture
def node() -> Iterator[Node]:
    require_root()
    require_tool("containerd", "ctr", "runc", "busybox", "nsenter", "unshare", "setpriv")
    with PrivateContainerd(namespace="default") as c:
        yield Node(c)
    # nothing of it may be left behind
    assert not c.cgroup_dirs()
    assert not c._shim_pids()
    assert not c.work.exists()


def make_step(node: Node, **kw: Any) -> DevicePluginStep:
    restarter = PluginRestarter(
        stopper=ContainerStopper(
            crictl="/nonexistent/crictl",  # as on this host: no crictl, so containerd's ctr
            ctr=shutil.which("ctr") or "/usr/bin/ctr",
            ctr_address=node.c.sock,
            ctr_namespace="default",
            command_timeout=20,
        ),
    )
    args: dict[str, Any] = dict(
        restarter=restarter, cgroup_root=node.c.cgroup_prefix, verify_timeout=20, poll=0.05
    )
    args.update(kw)
    return DevicePluginStep(**args)


async def run_pass(step: DevicePluginStep, svc: OneShotServices, node: Node) -> PassContext:
    return await run_with_kubelet(step, svc, node.play_kubelet, UVM_REASON)


def test_stale_plugin_is_restarted_through_containerd_and_recovers(node: Node) -> None:
    first_pid = node.start_plugin()
    workload = node.start_workload()  # set up by the stale plugin: no uvm
    svc, out = make_svc(node.root, cool_down=0.0)
    step = make_step(node)

    ctx = plugin_pass(UVM_REASON)
    asyncio.run(step(svc, ctx))  # type: ignore[arg-type]
    assert ctx.findings == [] and ctx.outcomes == []  # no uvm on the host yet: healthy

    node.add_uvm()
    node.plugin_uvm = True  # a plugin started now sees uvm
    old_cid = node.plugin
    t0 = time.monotonic()
    ctx = asyncio.run(run_pass(step, svc, node))
    took = time.monotonic() - t0

    kinds = [f.kind for f in ctx.findings]
    assert "plugin-missing-device" in kinds
    (missing,) = [f for f in ctx.findings if f.kind == "plugin-missing-device"]
    assert missing.fields["CONTAINER_ID"] == old_cid
    assert missing.fields["MISSING"] == "/dev/nvidia-uvm /dev/nvidia-uvm-tools"
    (o,) = ctx.outcomes
    assert o.status == "done", o.detail
    (restarted,) = journal(out, "plugin-restarted")
    assert restarted["METHOD"] == "ctr" and restarted["CONTAINER_ID"] == old_cid
    (rec,) = journal(out, "plugin-recovered")
    new_cid, new_pid = node.plugins_started[-1]
    assert new_cid != old_cid and int(rec["NEW_PLUGIN_PID"]) == new_pid != first_pid
    assert "nvidia-uvm" in os.listdir(f"/proc/{new_pid}/root/dev")
    # the workload set up by the stale plugin must be recreated: reported, not touched
    (w,) = [f for f in ctx.findings if f.kind == "container-missing-uvm"]
    assert w.fields["CONTAINER_ID"] == workload
    assert node.c.task_status(workload) == "RUNNING"
    assert took < 20

    # the next pass finds a healthy plugin and does nothing more
    ctx = asyncio.run(run_pass(step, svc, node))
    assert not [f for f in ctx.findings if f.kind.startswith("plugin-")] and ctx.outcomes == []
    assert len(node.plugins_started) == 2


def test_plugin_that_stays_stale_is_restarted_at_most_max_per_hour(node: Node) -> None:
    node.start_plugin()
    node.add_uvm()  # ... but every new plugin comes up without it again
    svc, out = make_svc(node.root, cool_down=0.0, max_restarts_per_hour=2)
    step = make_step(node, backoff_base=0.0)
    statuses = []
    for _ in range(4):
        ctx = asyncio.run(run_pass(step, svc, node))
        statuses.append(ctx.outcomes[0].status)
    assert statuses == ["failed", "failed", "declined", "declined"]
    assert len(node.plugins_started) == 3  # the original and two restarts, no more
    assert len(journal(out, "plugin-restart-failed")) == 2
    assert [e["REASON"] for e in journal(out, "plugin-restart-declined")] == ["budget"] * 2
    # a new daemon keeps the budget (persisted), and so declines too
    ctx = asyncio.run(run_pass(make_step(node, backoff_base=0.0), svc, node))
    assert ctx.outcomes[0].status == "declined"
    assert len(node.plugins_started) == 3
    saved = json.loads((node.root / "var/lib/gpuguard/plugin-restarts.json").read_text())
    assert len(saved["plugins"]["nvidia.com/gpu"]["restarts"]) == 2


def test_cool_down_from_the_plugin_start_is_respected(node: Node) -> None:
    node.start_plugin()
    node.add_uvm()
    svc, out = make_svc(node.root, cool_down=300.0)
    ctx = asyncio.run(run_pass(make_step(node), svc, node))
    assert ctx.outcomes[0].status == "declined"
    (d,) = journal(out, "plugin-restart-declined")
    assert d["REASON"] == "cool-down"
    assert node.c.task_status(node.plugin) == "RUNNING"
    assert len(node.plugins_started) == 1


def test_declined_for_cool_down_is_restarted_when_it_ends(node: Node) -> None:
    """The boot case: uvm appears soon after the plugin started. The declined restart
    asks for a pass at the end of the cool-down, the only thing that triggers it here."""
    node.start_plugin()
    node.add_uvm()
    node.plugin_uvm = True
    old_cid = node.plugin
    svc, out = make_svc(node.root, cool_down=3.0)
    step = make_step(node)
    ctx = asyncio.run(run_pass(step, svc, node))
    assert ctx.outcomes[0].status == "declined" and len(node.plugins_started) == 1
    (f,) = ctx.followups
    after, why = f.delay, f.why
    assert f.step == "device_plugin" and f.event is None and 0 < after <= 3.2
    time.sleep(after)  # as the daemon's timer would
    ctx = asyncio.run(run_with_kubelet(step, svc, node.play_kubelet, f"follow-up: {why}"))
    (o,) = ctx.outcomes
    assert o.status == "done", o.detail
    assert journal(out, "plugin-restarted")[0]["CONTAINER_ID"] == old_cid
    assert journal(out, "plugin-recovered") and len(node.plugins_started) == 2
    assert ctx.followups == []


def access_root(node: Node, pids: list[int]) -> Path:
    """The same node for the container_access step: its kubepods tree at the top of the
    devices hierarchy (as kubelet lays it out), the driver registered in /proc/devices,
    and /proc holding the containers' processes (the real ones, linked)."""
    root = node.c.work / "access-root"
    (root / "proc").mkdir(parents=True)
    (root / "proc/devices").write_text(
        f"Character devices:\n195 nvidia-frontend\n{UVM_MAJOR} nvidia-uvm\n"
    )
    os.symlink("/proc/stat", root / "proc/stat")
    for pid in pids:
        os.symlink(f"/proc/{pid}", root / f"proc/{pid}")
    cg = root / "sys/fs/cgroup"
    cg.mkdir(parents=True)
    os.symlink(f"/sys/fs/cgroup/devices{node.c.cgroup_prefix}", cg / "devices")
    os.symlink(node.c.host_dev, root / "dev")
    (root / "var/lib/kubelet").mkdir(parents=True)
    os.symlink(node.root / DP.lstrip("/"), root / DP.lstrip("/"))
    return root


def test_container_findings_spare_the_plugin_and_are_journaled_once(node: Node) -> None:
    """container-device-missing names the workload set up by the stale plugin, never the
    plugin's own container (the plugin step restarts that one), once per container and
    node across passes, and says when it clears."""
    from gpuguard.host.paths import Root
    from gpuguard.steps.container_access import ContainerAccessStep

    plugin_pid = node.start_plugin()
    workload = node.start_workload()
    # set up before nvidia_uvm was reloaded: its uvm nodes carry the old major
    old = secrets.token_hex(32)
    old_devs = GPU_DEVS + [(path, UVM_MAJOR - 1, minor) for path, _, minor in UVM_DEVS]
    node.c.run(old, ["/bin/sleep", "3600"], pod_uid=secrets.token_hex(4), devices=old_devs)
    node.add_uvm()
    pids = [plugin_pid, node.c.task_pid(workload), node.c.task_pid(old)]
    root = access_root(node, pids)
    svc, out = make_svc(node.root)
    svc = OneShotServices(
        Root(root), svc.config, svc.log, apply=ChangeExecutor(dry_run=True), bus_address=""
    )
    step = ContainerAccessStep()
    for _ in range(3):  # three passes (audits)
        ctx = plugin_pass("periodic audit")
        asyncio.run(step(svc, ctx))  # type: ignore[arg-type]
        missing = [f for f in ctx.findings if f.kind == "container-device-missing"]
        assert {f.fields["CONTAINER_ID"] for f in missing} == {workload}, missing
    entries = journal(out, "container-device-missing")
    assert sorted((e["CONTAINER_ID"], e["DEVICE"], e["level"]) for e in entries) == [
        (workload, "/dev/nvidia-uvm", "warning"),
        (workload, "/dev/nvidia-uvm-tools", "warning"),
    ]
    assert entries[0]["msg"].startswith(
        f"pod {entries[0]['POD_UID']} container {workload[:12]} has no /dev/nvidia-uvm in "
        "its /dev, which the host has: device plugin started without /dev/nvidia-uvm"
    )
    assert node.plugin not in out.getvalue()  # nothing about the plugin's own container
    stale = journal(out, "container-device-stale")
    assert sorted((e["CONTAINER_ID"], e["DEVICE"], e["level"]) for e in stale) == [
        (old, "/dev/nvidia-uvm", "warning"),
        (old, "/dev/nvidia-uvm-tools", "warning"),
    ]
    uvm = next(e for e in stale if e["DEVICE"] == "/dev/nvidia-uvm")
    assert uvm["msg"] == (
        f"pod {uvm['POD_UID']} container {old[:12]} has /dev/nvidia-uvm with stale numbers "
        f"({UVM_MAJOR - 1}:0, host has {UVM_MAJOR}:0): the driver module was reloaded after "
        "the container started; recreate the container"
    )
    assert old not in {e["CONTAINER_ID"] for e in entries}  # present, so not "missing"

    node.c.remove(workload)  # its pod was deleted, as the finding asks
    ctx = plugin_pass("periodic audit")
    asyncio.run(step(svc, ctx))  # type: ignore[arg-type]
    cleared = journal(out, "condition-cleared")
    assert sorted(e["GPUGUARD_SUBJECT"] for e in cleared) == [workload, workload]
    assert {e["GPUGUARD_CLEARED_KIND"] for e in cleared} == {"container-device-missing"}
