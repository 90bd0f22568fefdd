"""F4 on a real systemd: after a kubelet restart a device plugin that does not register
again is reported once the grace period is over, and (a host-service plugin) restarted.

Kubelet's device manager removes the plugin sockets when it starts and plugins must
serve a new one; the fake kubelet does the same, and the fake plugin (like old or
forked plugins) never watches for that. The host-service plugin is recognised from its
cgroup on either layout (on v2 from its cgroup2 line) and restarted through systemd.
"""

from __future__ import annotations

import pytest

from integration.gpuguard_ns import events, gpuguard_units, settle, setup_node, wait_for
from integration.harness import layout as layout
from integration.harness import systemd_ns as systemd_ns
from integration.harness.sysns import listening

pytestmark = pytest.mark.root

DIR = "/var/lib/kubelet/device-plugins"
SERVE = (
    "import socket, sys, time, os; p = sys.argv[1]; "
    "os.path.exists(p) and os.unlink(p); "
    "s = socket.socket(socket.AF_UNIX); s.bind(p); s.listen(); time.sleep(1e9)"
)
KUBELET = f"""[Unit]
Description=fake kubelet: removes plugin sockets at start, serves kubelet.sock
[Service]
ExecStartPre=/bin/sh -c 'mkdir -p {DIR}; rm -f {DIR}/*.sock'
ExecStart=/usr/bin/python3 -c "{SERVE}" {DIR}/kubelet.sock
"""
PLUGIN = f"""[Unit]
Description=fake NVIDIA device plugin that never re-registers
[Service]
ExecStart=/usr/bin/python3 -c "{SERVE}" {DIR}/nvidia-gpu.sock
"""


def _ns(systemd_ns, restart: str, layout: str = "v1"):  # type: ignore[no-untyped-def]
    units = gpuguard_units()
    units["kubelet.service"] = KUBELET
    units["fake-plugin.service"] = PLUGIN
    ns = systemd_ns(units=units, layout=layout)
    setup_node(
        ns,
        stale=False,
        config=f"[DevicePlugin]\nRegistrationGrace=1s\nCoolDown=0\nRestart={restart}\n",
    )
    ns.systemctl("start", "gpuguard.service")
    ns.systemctl("start", "kubelet.service")
    ns.wait_active("kubelet.service")
    # kubelet's socket first, as on a node: a plugin socket older than it is unregistered
    wait_for(lambda: listening(ns.path(f"{DIR}/kubelet.sock")), what="kubelet's socket")
    ns.systemctl("start", "fake-plugin.service")
    wait_for(lambda: ns.path(f"{DIR}/nvidia-gpu.sock").exists(), what="plugin socket")
    ns.systemctl("daemon-reload")  # a pass that sees the plugin registered
    settle(ns)
    assert not events(ns, "plugin-not-registered")
    return ns


def test_unregistered_plugin_is_reported_after_the_grace_period(systemd_ns) -> None:  # type: ignore[no-untyped-def]
    ns = _ns(systemd_ns, restart="no")
    ns.systemctl("restart", "kubelet.service")
    found = wait_for(
        lambda: events(ns, "plugin-not-registered"),
        timeout=20,
        what="plugin-not-registered after the grace period",
    )
    assert found[0]["PLUGIN"] == "nvidia.com/gpu"
    declined = wait_for(lambda: events(ns, "plugin-restart-declined"), what="decision logged")
    assert declined[0]["REASON"] == "disabled"
    assert ns.unit_property("fake-plugin.service", "NRestarts") == "0"


def test_unregistered_host_plugin_is_restarted_and_recovers(systemd_ns, layout) -> None:  # type: ignore[no-untyped-def]
    ns = _ns(systemd_ns, restart="yes", layout=layout)
    before = ns.unit_property("fake-plugin.service", "InvocationID")
    ns.systemctl("restart", "kubelet.service")
    wait_for(lambda: events(ns, "plugin-recovered"), timeout=40, what="plugin recovered")
    assert ns.unit_property("fake-plugin.service", "InvocationID") != before
    assert ns.path(f"{DIR}/nvidia-gpu.sock").exists()
    (restarted,) = events(ns, "plugin-restarted")
    assert restarted["METHOD"] == "systemd", restarted
