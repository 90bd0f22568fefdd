"""A runtime's DeviceAllow= reset over the bus, on a real systemd, on both layouts.

runc's systemd driver, on every `runc update` (kubelet's CPU manager asks for one
whenever the shared CPU pool changes), empties the scope's DeviceAllow= and lists only
the spec's devices. systemd then takes away the GPU that the legacy hook granted, and
sends no signal for it: DeviceAllow= has no change signal. It does write the property
to /run/systemd/transient/UNIT.d/50-DeviceAllow.conf, which gpuguard watches
(sources/transient.py). So the grant comes back within a pass, not at the next audit,
which is 10 minutes away here.

On cgroup v1 a runtime without the systemd driver writes the cgroup itself: deny all,
then its default list (runc < 1.0 on every update; any cgroupfs-driver update). No
file and no signal says so; the device watch (steps/container_access/devwatch.py)
compares each GPU container's devices.list every WatchInterval= and repairs it."""

from __future__ import annotations

import time

import pytest

from gpuguard.devices.probe import probe_open
from gpuguard.devices.rules import RUNC_DEFAULT_RULES
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


def _watch(ns):  # type: ignore[no-untyped-def]
    return status(ns).get("fast_paths", {}).get("device_watch", {})


def test_v1_runtime_rewrite_is_seen_by_the_watch(systemd_ns, tmp_path) -> None:  # type: ignore[no-untyped-def]
    ctrs = containers(2)
    ns = boot_node(systemd_ns, tmp_path, ctrs, layout="v1", config=CONFIG)
    start_gpuguard(ns)
    for c in ctrs:
        start(ns, c)
    settle(ns)
    c, other = ctrs
    mine = c.gpus[0]
    assert _verdict(ns, c, mine) is True
    time.sleep(1)  # a few WatchInterval= ticks: the watch has seen both lists as they are

    # the runtime's own write, as runc's cgroupfs driver makes it: nothing announces it
    d = c.cgroup(ns)
    (d / "devices.deny").write_text("a")
    with open(d / "devices.allow", "w") as f:
        for rule in RUNC_DEFAULT_RULES:
            f.write(rule.render())
            f.flush()
    lost = time.monotonic()
    assert _verdict(ns, c, mine) is False  # the loss is real
    wait_for(lambda: _verdict(ns, c, mine) is True, timeout=10, what="the GPU back")
    back = time.monotonic() - lost
    wait_for(lambda: _watch(ns).get("repaired") == 1, timeout=10, what="the watch's repair")
    print(f"\nGPU back {back * 1000:.0f} ms after the rewrite (polled); watch: {_watch(ns)}")
    assert _verdict(ns, c, 1 - mine) is False, "granted a GPU the container was not given"
    assert _verdict(ns, other, other.gpus[0]) is True
    allows = [e for e in events(ns, "cgroup-v1-allow") if e.get("GPUGUARD_STATUS") == "done"]
    assert any(e.get("CGROUP", "").endswith(d.name) for e in allows), "journaled, by cgroup"
    # gpuguard's own write changed the list too: judged once, no loop of passes
    n = settle(ns)
    time.sleep(2)
    assert passes(ns) == n, "passes went on with nothing to do"
    assert _watch(ns).get("repaired") == 1
