"""Fault injection into the re-admission bridge on the real kubelet 1.34: every case ends
with the node's GPUs allocatable and gpuguard's reports true.

One boot; then, for each case, a reboot in which the bridge offered the checkpoint's
GPUs and the plugin double (a host service, registering once kubelet judged its pods)
replaced its endpoint, so that kubelet holds the bridge's stream; then the fault:

* ``kill``: the bridge SIGKILLed (systemd starts it again; the new process finds its
  predecessor's registration gone and says so, ``readmit-streams-ended`` HOW=gone);
* ``restart``: ``systemctl restart gpuguard-readmit`` (needrestart's way; HOW=stop);
* ``stop``: ``systemctl stop``, later ``start`` (HOW=stop);
* ``touch``: ``kubelet.sock`` touched and chowned to its own owner (configuration
  management's way): no kubelet start, to the bridge or to the daemon;
* ``config``: ``gpuguard.conf`` broken, then kubelet restarted (the bridge reads its
  configuration again at a kubelet start): the bridge keeps running on the last good
  one and says so once (``readmit-config-error``, and in its state file).

After each, kubelet's podresources API reports every GPU allocatable again, a new GPU
pod gets a free GPU from the plugin's own Allocate, and gpuguard's status carries no
finding about the plugin. A stream ending drops the plugin (kubelet 1.34 disconnects
the current client); gpuguard's daemon restarts it at once (``plugin-not-allocatable``,
``plugin-restarted``), once per case: CoolDown= is the default 5 minutes, counted from
the plugin's start seconds before, and RegistrationGrace= (20 s) has not passed since
kubelet's start, neither of which holds the restart back.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping

import pytest

from gpuguard.host.paths import DEVICE_PLUGINS_DIR, Root
from gpuguard.readmit.state import STATE_FILE
from gpuguard.steps.device_plugin.podresources import read_allocatable
from integration.gpuguard_ns import events, status, wait_for
from integration.harness import systemd_ns as systemd_ns
from integration.kubelet_node import (
    F1_PODS,
    PLUGIN,
    READMIT,
    GpuNode,
    NsFactory,
    boot,
    gpu_pod,
    gpus_after,
    two_gpu_pods,
)
from integration.kubelet_node import api as api

pytestmark = pytest.mark.root

RESOURCE = "nvidia.com/gpu"
# The plugin's cool-down is the default (5 min): the restart after a drop must not
# wait for it. RegistrationGrace=20s: a touch read as a kubelet start would show as a
# plugin restart within the case.
CONFIG = "[DevicePlugin]\nRegistrationGrace=20s\nMaxRestartsPerHour=5\n"
CASES = ("kill", "restart", "stop", "touch", "config")
KUBELET_SOCK = f"{DEVICE_PLUGINS_DIR}/kubelet.sock"


class Faults:
    def __init__(self, node: GpuNode) -> None:
        self.node = node
        self.gpus = len(node.inventory)
        self.pods = 0

    def allocatable(self) -> int:
        """Asked as the daemon asks, under the node's root (the socket is connected
        through its directory's descriptor: the root's long path does not matter)."""
        got = read_allocatable(Root(self.node.ns.root), DEVICE_PLUGINS_DIR, timeout=2.0)
        return -1 if got.unchecked else got.counts.get(RESOURCE, 0)

    def bridge(self, kind: str) -> List[Mapping[str, Any]]:
        return [e for e in self.node.ns.journal(READMIT) if e.get("GPUGUARD_KIND") == kind]

    def said(self) -> str:
        j = self.node.ns.journal(READMIT)
        return "\n".join(f"{x.get('GPUGUARD_KIND')}: {x.get('MESSAGE')}" for x in j)[-6000:]

    def reboot(self) -> None:
        """A reboot after which the bridge holds kubelet's stream of its endpoint."""
        node = self.node
        offered = len(self.bridge("readmit-offered"))
        node.reboot(gpus_after(node, "none", ""))
        try:
            node.wait_pods(lambda p: all(n in p and p[n].running for n in F1_PODS), 60, "pods back")
        except AssertionError as e:  # what the bridge did, for the failure's message
            raise AssertionError(f"{e}\nthe bridge's journal:\n{self.said()}") from None
        assert len(self.bridge("readmit-offered")) > offered, "the bridge offered"
        wait_for(lambda: self.allocatable() == self.gpus, 30, "the plugin's GPUs allocatable")

    def healthy(self, case: str) -> None:
        """Every GPU allocatable, a new GPU pod given a free GPU by the plugin, and
        no finding about the plugin in gpuguard's status."""
        node = self.node
        wait_for(lambda: self.allocatable() == self.gpus, 30, f"{case}: GPUs allocatable")
        self.pods += 1
        name = f"gpu-{case}"
        node.write_pod(gpu_pod(name))
        node.wait_pods(lambda p: name in p and p[name].running, 60, f"{name} running")
        c = node.running(name)
        assert node.plugin_allocations()[-1] == [c.visible], case  # the plugin's Allocate
        held = {node.running(n).visible for n in node.pods() if n.startswith("gpu-")}
        assert len(held) == 2 + self.pods, held  # each pod on a GPU of its own

        def clean() -> bool:
            step = status(node.ns).get("steps", {}).get("device_plugin", {})
            kinds = [f.get("kind") for f in step.get("findings", [])]
            return bool(step) and not [k for k in kinds if str(k).startswith("plugin-")]

        wait_for(clean, 30, f"{case}: no plugin finding in gpuguard's status")
        assert node.ns.unit_property(READMIT, "ActiveState") == "active", case


def test_every_fault_of_the_bridge_ends_with_the_gpus_allocatable(
    systemd_ns: NsFactory, tmp_path: Path, api: Path
) -> None:
    node = boot(systemd_ns, tmp_path, api, gpuguard=True, kubelet="1.34", config=CONFIG, n_gpus=8)
    two_gpu_pods(node)
    f = Faults(node)
    ns = node.ns
    figures: Dict[str, float] = {}

    def dropped_and_restarted(case: str, how: str, fault: Callable[[], None]) -> None:
        f.reboot()
        restarts = len(events(ns, "plugin-restarted"))
        said = len(f.bridge("readmit-streams-ended"))
        plugin_run = ns.unit_property(PLUGIN, "InvocationID")
        t0 = time.monotonic()
        fault()
        (restarted,) = wait_for(
            lambda: events(ns, "plugin-restarted")[restarts:], 30, f"{case}: plugin restarted"
        )
        figures[case] = time.monotonic() - t0
        assert restarted["CAUSE"] == "not-allocatable", restarted
        assert "since the re-admission bridge's streams ended" in restarted["MESSAGE"]
        assert ns.unit_property(PLUGIN, "InvocationID") != plugin_run
        found = events(ns, "plugin-not-allocatable")[-1]
        assert found["RESOURCE"] == RESOURCE and found["BRIDGE_ENDED"], found
        try:  # the new process says so at its start (RestartSec=1s, then its imports)
            (ended,) = wait_for(lambda: f.bridge("readmit-streams-ended")[said:], 30, "said")
        except AssertionError as e:
            raise AssertionError(f"{e}; the bridge's journal:\n{f.said()}") from None
        assert ended["HOW"] == how and ended["RESOURCES"] == RESOURCE, ended
        f.healthy(case)
        time.sleep(2.5)  # the pass 2 s after the end: nothing more to do
        assert len(events(ns, "plugin-restarted")) == restarts + 1, f"{case}: once"

    def kill() -> None:
        assert ns.systemctl("kill", "-s", "KILL", READMIT).returncode == 0

    def restart() -> None:
        assert ns.systemctl("restart", READMIT).returncode == 0

    def stop() -> None:
        assert ns.systemctl("stop", READMIT).returncode == 0
        wait_for(lambda: events(ns, "plugin-restarted")[-1:], 30, "the restart")
        assert ns.systemctl("start", READMIT).returncode == 0

    dropped_and_restarted("kill", "gone", kill)
    dropped_and_restarted("restart", "stop", restart)
    dropped_and_restarted("stop", "stop", stop)

    # config: broken, then a kubelet restart (read again then): the bridge stays up
    bridge_pid = ns.unit_property(READMIT, "MainPID")
    conf = ns.path("/etc/gpuguard/gpuguard.conf")
    good = conf.read_text()
    conf.write_text(good + "[Daemon]\nMode=sometimes\n")
    node.stop_kubelet()
    node.start_kubelet()
    (error,) = wait_for(lambda: f.bridge("readmit-config-error"), 30, "the config error said")
    assert "Mode" in error["MESSAGE"] and "keeps the last good one" in error["MESSAGE"]
    state = ns.path(STATE_FILE).read_text()
    assert "Mode" in state, state  # config_error, for the daemon and the operator
    # The double tells kubelet's restart by kubelet.sock's inode, which the new socket
    # may reuse; NVIDIA's plugin watches its creation. Started again, as its pod would be.
    ns.systemctl("restart", PLUGIN)
    node.wait_registered()
    f.healthy("config")
    assert ns.unit_property(READMIT, "MainPID") == bridge_pid, "the bridge never exited"
    assert len(f.bridge("readmit-config-error")) == 1  # once per distinct error
    conf.write_text(good)
    took = ", ".join(f"{k} {v:.2f}s" for k, v in figures.items())
    print(f"plugin restarted after the fault: {took}")

    # touch: kubelet.sock's ctime changes, nothing else; no kubelet start to anyone
    f.reboot()
    restarts = len(events(ns, "plugin-restarted"))
    decided = len(f.bridge("readmit-skip")) + len(f.bridge("readmit-offered"))
    st = os.stat(ns.path(KUBELET_SOCK))
    ns.run(["touch", KUBELET_SOCK], check=True)
    ns.run(["chown", f"{st.st_uid}:{st.st_gid}", KUBELET_SOCK], check=True)
    time.sleep(25)  # past RegistrationGrace=20s: a "kubelet start" would restart the plugin
    fooled = len(f.bridge("readmit-skip")) + len(f.bridge("readmit-offered")) - decided
    restarted = len(events(ns, "plugin-restarted")) - restarts
    print(f"touch: bridge decisions {fooled}, plugin restarts {restarted}")
    assert (fooled, restarted) == (0, 0), "a touch of kubelet.sock taken for a kubelet start"
    f.healthy("touch")
