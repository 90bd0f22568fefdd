"""NvmlProbe=yes on a real container runtime, with fake NVML libraries.

A private containerd (harness/containerd.py) runs busybox "plugin" containers that
serve device plugin sockets (the host's python3, as in test_device_plugin.py) and see
every fake NVIDIA node, so only NVML can be wrong. The test compiles two tiny
``libnvidia-ml.so.1`` with gcc: a good one (nvmlInit_v2 returns 0) and a failing one
(999, NVML_ERROR_UNKNOWN: "Failed to initialize NVML: Unknown Error"). They are bound
into the containers under /opt (the harness binds the host's /usr read-only, and its
/lib and /lib64 are links into it, so the plugin's own files live outside them):

- "good": the plugin process loads the library itself (as NVIDIA's plugin keeps NVML
  loaded), from a directory nobody names: only its /proc/PID/maps says where;
- "bad": ``LD_LIBRARY_PATH=/opt/nvidia/lib`` in the plugin's environment names it;
- "bare": no library in its filesystem at all (this host has none either).

The probe's dlopen runs in our process image, after setns into the plugin's mount
namespace: the library's own dependency (libc) is the one we have loaded already.

No kubelet runs; the test plays it: a plugin container stopped by the step is deleted
and started again, this time with the good library ("the fixed plugin").
"""

from __future__ import annotations

import asyncio
import os
import secrets
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from conftest import require_root, require_tool
from gpuguard.actuate.containers import ContainerStopper
from gpuguard.engine.oneshot import OneShotServices
from gpuguard.engine.passes import PassContext
from gpuguard.host.paths import Root
from gpuguard.steps.device_plugin import DevicePluginStep, nvml_probe
from gpuguard.steps.device_plugin.actuate import PluginRestarter
from gpuguard.steps.device_plugin.nvml_probe import (
    NVML_LIBRARY,
    NvmlResult,
    plugin_cgroup_dirs,
    probe_nvml,
)
from integration.harness.containerd import SOCKET_SERVER, PrivateContainerd
from integration.plugin_node import (
    DP,
    host_root,
    journal,
    make_svc,
    run_with_kubelet,
)

pytestmark = pytest.mark.root

DEVS = [
    ("/dev/nvidia0", 195, 0),
    ("/dev/nvidiactl", 195, 255),
    ("/dev/nvidia-uvm", 510, 0),
    ("/dev/nvidia-uvm-tools", 510, 1),
]
# Like NVML: /dev/nvidiactl must open (ENXIO: the fake node has no driver, but the
# device cgroup let the open through); EPERM from the device cgroup -> Unknown Error.
FAKE_NVML = """\
#include <errno.h>
#include <fcntl.h>
#include <unistd.h>
int nvmlInit_v2(void) {
    int fd = open("/dev/nvidiactl", O_RDWR | O_CLOEXEC);
    if (fd >= 0) close(fd);
    else if (errno != ENXIO && errno != ENODEV) return 999; /* NVML_ERROR_UNKNOWN */
    return %d;
}
int nvmlShutdown(void) { return 0; }
const char *nvmlErrorString(int r) { return "Unknown Error"; }
"""
GOOD_SOCK, BAD_SOCK, BARE_SOCK = "nvidia-gpu.sock", "nvidia-gpu.shared.sock", "nvidia-mig.sock"
GOOD, BAD, BARE = "nvidia.com/gpu", "nvidia.com/gpu.shared", "nvidia.com/mig"


class Node:
    """A private containerd, a test root (proc, sys, dev links), fake NVML builds."""

    def __init__(self, c: PrivateContainerd) -> None:
        self.c = c
        self.root = host_root(c, DEVS)
        self.libs = {"good": self._build("good", 0), "bad": self._build("bad", 999)}
        self.cids: dict[str, str] = {}  # socket -> container id
        self.pids: dict[str, int] = {}  # socket -> plugin pid
        self.started: list[tuple[str, str]] = []  # (socket, lib)

    def _build(self, name: str, rc: int) -> Path:
        d = self.c.work / "nvml" / name
        d.mkdir(parents=True)
        (d / "nvml.c").write_text(FAKE_NVML % rc)
        subprocess.run(
            [
                *("gcc", "-shared", "-fPIC", "-O1", f"-Wl,-soname,{NVML_LIBRARY}"),
                *("-o", str(d / NVML_LIBRARY), str(d / "nvml.c")),
            ],
            check=True,
            capture_output=True,
            timeout=60,
        )
        (d / "nvml.c").unlink()  # the bound directory holds the library only
        return d

    def start_plugin(self, sock: str, lib: str) -> int:
        """lib: "good" (loaded by the plugin from /opt/good/lib), "bad" (named by
        LD_LIBRARY_PATH=/opt/nvidia/lib) or "" (none)."""
        cid = secrets.token_hex(32)
        script, env, binds = SOCKET_SERVER, [], [(str(self.root / DP.lstrip("/")), DP, True)]
        extra: list[str] = []
        if lib == "good":
            binds.append((str(self.libs["good"]), "/opt/good/lib", False))
            script = script.replace(
                "p=sys.argv[1]\n", "p=sys.argv[1]\nimport ctypes\nctypes.CDLL(sys.argv[2])\n"
            )
            extra = [f"/opt/good/lib/{NVML_LIBRARY}"]
        elif lib == "bad":
            binds.append((str(self.libs["bad"]), "/opt/nvidia/lib", False))
            env = ["/usr/bin/env", "LD_LIBRARY_PATH=/opt/nvidia/lib"]
        argv = [*env, "/usr/bin/python3", "-I", "-S", "-c", script, f"{DP}/{sock}", *extra]
        pid = self.c.run(cid, argv, pod_uid=secrets.token_hex(4), devices=DEVS, binds=binds)
        self.cids[sock], self.pids[sock] = cid, pid
        self.started.append((sock, lib))
        path = self.root / DP.lstrip("/") / sock
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if path.exists() and self._ready(pid, sock, lib):
                return pid
            time.sleep(0.02)
        raise AssertionError(f"plugin {sock} did not come up: {self.c.log_tail()}")

    @staticmethod
    def _ready(pid: int, sock: str, lib: str) -> bool:
        try:
            unix = Path(f"/proc/{pid}/net/unix").read_text()
            maps = Path(f"/proc/{pid}/maps").read_text()
        except OSError:
            return False
        listening = any(line.endswith(sock) and " 00010000 " in line for line in unix.splitlines())
        return listening and (lib != "good" or NVML_LIBRARY in maps)

    async def play_kubelet(self, sock: str, stop: asyncio.Event) -> None:
        """Recreate a stopped plugin container, now with the good library."""
        while not stop.is_set():
            status = await asyncio.to_thread(self.c.task_status, self.cids[sock])
            if status != "RUNNING":
                await asyncio.to_thread(self.c.remove, self.cids[sock])
                await asyncio.to_thread(self.start_plugin, sock, "good")
            await asyncio.sleep(0.02)


@pytest.fixture
def node() -> Iterator[Node]:
    require_root()
    require_tool("containerd", "ctr", "runc", "busybox", "nsenter", "unshare", "setpriv", "gcc")
    with PrivateContainerd(namespace="default") as c:
        yield Node(c)
    # nothing of it may be left behind
    assert not c.cgroup_dirs()
    assert not c._shim_pids()
    assert not c.work.exists()


@pytest.fixture
def probes(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, NvmlResult]]:
    """Every probe the step runs (the real one), with its result."""
    seen: list[tuple[int, NvmlResult]] = []
    real = nvml_probe.probe_nvml

    def counting(pid: int, dirs: Any, **kw: Any) -> NvmlResult:
        r = real(pid, dirs, **kw)
        seen.append((pid, r))
        return r

    monkeypatch.setattr(nvml_probe, "probe_nvml", counting)
    return seen


def make_step(node: Node) -> DevicePluginStep:
    restarter = PluginRestarter(
        stopper=ContainerStopper(
            crictl="/nonexistent/crictl",
            ctr=shutil.which("ctr") or "/usr/bin/ctr",
            ctr_address=node.c.sock,
            ctr_namespace="default",
            command_timeout=20,
        ),
    )
    return DevicePluginStep(
        restarter=restarter, cgroup_root=node.c.cgroup_prefix, verify_timeout=20, poll=0.05
    )


async def run_pass(
    step: DevicePluginStep, svc: OneShotServices, node: Node, sock: str
) -> PassContext:
    return await run_with_kubelet(step, svc, lambda stop: node.play_kubelet(sock, stop), "test")


def test_probe_in_the_plugins_context(node: Node) -> None:
    good = node.start_plugin(GOOD_SOCK, "good")
    bad = node.start_plugin(BAD_SOCK, "bad")
    bare = node.start_plugin(BARE_SOCK, "")
    root = Root(node.root)
    for pid in (good, bad, bare):
        dirs = plugin_cgroup_dirs(root, pid)
        assert dirs and all(node.c.cgroup_prefix in str(d) for d in dirs), dirs

    r = probe_nvml(good, plugin_cgroup_dirs(root, good), root=root)
    assert r == NvmlResult(True, 0, "nvmlInit succeeded", "ok", f"/opt/good/lib/{NVML_LIBRARY}")
    r = probe_nvml(bad, plugin_cgroup_dirs(root, bad), root=root)
    assert (r.ok, r.code, r.detail, r.stage) == (False, 999, "Unknown Error", "init")
    assert r.library == f"/opt/nvidia/lib/{NVML_LIBRARY}"
    r = probe_nvml(bare, plugin_cgroup_dirs(root, bare), root=root)
    assert (r.ok, r.code, r.stage) == (False, None, "load") and NVML_LIBRARY in r.detail
    # The device cgroup that applies is the plugin's: deny nvidiactl to the good plugin
    # (as a systemd daemon-reload does to containers on v1 hosts) and NVML fails.
    v1 = [d for d in plugin_cgroup_dirs(root, good) if (d / "devices.deny").exists()]
    assert v1 or not Path("/sys/fs/cgroup/devices").is_dir()
    if v1:
        (v1[0] / "devices.deny").write_text("c 195:255 rwm")
        r = probe_nvml(good, plugin_cgroup_dirs(root, good), root=root)
        assert (r.ok, r.code, r.detail) == (False, 999, "Unknown Error")
        # ... while outside that cgroup the node still opens (ENXIO: no driver)
        r = probe_nvml(good, [], root=root)
        assert r.ok, r
    # our own process gained no library and keeps its mount namespace
    assert NVML_LIBRARY not in Path("/proc/self/maps").read_text()
    assert os.readlink("/proc/self/ns/mnt") != os.readlink(f"/proc/{bad}/ns/mnt")


def test_failing_plugin_is_reported_declined_then_restarted_and_fixed(
    node: Node, probes: list[tuple[int, NvmlResult]]
) -> None:
    good = node.start_plugin(GOOD_SOCK, "good")
    bad = node.start_plugin(BAD_SOCK, "bad")
    old_bad_cid = node.cids[BAD_SOCK]
    step = make_step(node)

    # still starting (CoolDown): reported, restart declined
    svc, out = make_svc(node.root, nvml_probe=True, cool_down=3600.0)
    ctx = asyncio.run(run_pass(step, svc, node, BAD_SOCK))
    assert sorted(pid for pid, _r in probes) == sorted([good, bad])
    (f,) = ctx.findings
    assert f.kind == "plugin-nvml-failed" and f.severity == "error"
    assert f.fields["PLUGIN"] == BAD and f.fields["PLUGIN_PID"] == str(bad)
    assert f.fields["NVML_ERROR"] == "Unknown Error" and f.fields["NVML_CODE"] == "999"
    assert f.fields["CONTAINER_ID"] == old_bad_cid
    assert "Failed to initialize NVML: Unknown Error" in f.summary
    (d,) = journal(out, "plugin-restart-declined")
    assert (d["REASON"], d["CAUSE"], d["PLUGIN"]) == ("cool-down", "nvml-failed", BAD)
    assert node.c.task_status(old_bad_cid) == "RUNNING"

    # past CoolDown: restarted through containerd, kubelet recreates it (fixed)
    svc, out = make_svc(node.root, nvml_probe=True, cool_down=0.0)
    ctx = asyncio.run(run_pass(step, svc, node, BAD_SOCK))
    (o,) = ctx.outcomes
    assert o.status == "done", o.detail
    (restarted,) = journal(out, "plugin-restarted")
    assert restarted["CAUSE"] == "nvml-failed" and restarted["CONTAINER_ID"] == old_bad_cid
    assert restarted["METHOD"] == "ctr"
    (rec,) = journal(out, "plugin-recovered")
    assert int(rec["NEW_PLUGIN_PID"]) == node.pids[BAD_SOCK] != bad
    assert node.started[-1] == (BAD_SOCK, "good")

    # the next pass: NVML works everywhere, nothing to do
    probes.clear()
    ctx = asyncio.run(run_pass(step, svc, node, BAD_SOCK))
    assert ctx.findings == [] and ctx.outcomes == []
    assert sorted(pid for pid, _r in probes) == sorted([good, node.pids[BAD_SOCK]])
    assert all(r.ok for _pid, r in probes)


def test_plugin_without_the_library_and_nvml_probe_off(
    node: Node, probes: list[tuple[int, NvmlResult]]
) -> None:
    bare = node.start_plugin(BARE_SOCK, "")
    step = make_step(node)

    svc, out = make_svc(node.root, cool_down=3600.0)  # NvmlProbe=no, the default
    ctx = asyncio.run(run_pass(step, svc, node, BARE_SOCK))
    assert probes == [] and ctx.findings == [] and ctx.outcomes == []

    svc, out = make_svc(node.root, nvml_probe=True, cool_down=3600.0)
    ctx = asyncio.run(run_pass(step, svc, node, BARE_SOCK))
    assert [pid for pid, _r in probes] == [bare]
    (f,) = ctx.findings
    assert f.kind == "plugin-nvml-failed" and f.fields["PLUGIN"] == BARE
    assert f.fields["NVML_ERROR"].startswith(f"cannot load {NVML_LIBRARY} in the plugin's")
    assert "NVML_CODE" not in f.fields
    (d,) = journal(out, "plugin-restart-declined")
    assert (d["REASON"], d["CAUSE"]) == ("cool-down", "nvml-failed")
