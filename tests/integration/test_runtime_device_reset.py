"""A runtime's DeviceAllow= reset over the bus, on a real systemd, on both layouts.

runc's systemd driver, on every `runc update` (kubelet's CPU manager asks for one
whenever the shared CPU pool changes), empties the scope's DeviceAllow= and lists only
the spec's devices. systemd then takes away the GPU that the legacy hook granted, and
sends no signal for it: DeviceAllow= has no change signal. It does write the property
to /run/systemd/transient/UNIT.d/50-DeviceAllow.conf, which gpuguard watches
(sources/transient.py). So the grant comes back within a pass, not at the next audit,
which is 10 minutes away here."""

from __future__ import annotations

import time

import pytest

from gpuguard.devices.probe import probe_open
from integration.gpu_scopes import boot_node, containers, start
from integration.gpuguard_ns import events, passes, settle, start_gpuguard, status, wait_for
from integration.harness import layout as layout
from integration.harness import systemd_ns as systemd_ns

pytestmark = pytest.mark.root

CONFIG = "[Daemon]\nAuditInterval=10min\n"


def _verdict(ns, c, minor: int):  # type: ignore[no-untyped-def]
    """The kernel's answer to opening /dev/nvidia<minor> from inside c's cgroup."""
    return probe_open(ns.path(f"/dev/nvidia{minor}"), [c.cgroup(ns)]).verdict


def _grants(ns, unit: str) -> int:  # type: ignore[no-untyped-def]
    return sum(1 for e in events(ns, "unit-device-allow") if e.get("UNIT") == unit)


def _resets(ns):  # type: ignore[no-untyped-def]
    return status(ns).get("fast_paths", {}).get("scope_resets", {})


def test_runtime_reset_is_repaired_before_the_audit(systemd_ns, tmp_path, layout) -> None:  # type: ignore[no-untyped-def]
    ctrs = containers(2)
    ns = boot_node(systemd_ns, tmp_path, ctrs, layout=layout, config=CONFIG)
    start_gpuguard(ns)
    for c in ctrs:
        start(ns, c)
    settle(ns)
    c, other = ctrs
    mine = c.gpus[0]
    assert _verdict(ns, c, mine) is True
    grants = _grants(ns, c.unit)
    assert grants >= 1  # durable before the reset

    reset = ("DeviceAllow=", "DeviceAllow=/dev/null rw")
    ns.systemctl("set-property", "--runtime", c.unit, *reset)
    wait_for(lambda: _grants(ns, c.unit) > grants, timeout=20, what="a new grant after the reset")
    wait_for(lambda: _verdict(ns, c, mine) is True, timeout=10, what="the GPU back")
    # by the one-scope fast path, not by a pass behind the quiet period (its figure
    # reaches the status file with the pass it asks for next)
    wait_for(lambda: _resets(ns).get("repaired") == 1, timeout=10, what="the fast path's repair")
    assert _verdict(ns, c, 1 - mine) is False, "granted a GPU the container was not given"
    assert f"/dev/char/195:{mine}" in ns.unit_property(c.unit, "DeviceAllow")
    print(f"\nlast pass's reasons: {status(ns).get('last_pass', {}).get('reasons')}")
    # the other container was not touched, and gpuguard's own grant (which systemd also
    # writes to that file) brought no loop of passes
    assert _verdict(ns, other, other.gpus[0]) is True
    n = settle(ns)
    time.sleep(2)
    assert passes(ns) == n, "passes went on with nothing to do"
    assert _grants(ns, c.unit) == grants + 1
