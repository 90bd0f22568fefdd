"""F2 on a real systemd: daemon-reload wipes a container's GPU grant (seed 003); gpuguard
restores exactly what the container was given and makes it survive later reloads."""

from __future__ import annotations

import json

import pytest

from gpuguard.devices.probe import probe_open
from integration.gpu_scopes import (
    containers,
    dev_binds,
    fake_proc_devices,
    gpu_inventory,
    has,
    start,
)
from integration.gpuguard_ns import events, gpuguard_units, settle, wait_for
from integration.harness import systemd_ns as systemd_ns

pytestmark = pytest.mark.root


def _boot(systemd_ns, tmp_path, ctrs):  # type: ignore[no-untyped-def]
    units = gpuguard_units()
    # No NVIDIA driver here: only the driver's registration in /proc/devices is
    # simulated, for the daemon (its unit gets a fresh /proc, so a drop-in binds it).
    units["gpuguard.service.d/60-fake-driver.conf"] = (
        "[Service]\nBindReadOnlyPaths=/run/fake/devices:/proc/devices\n"
    )
    ns = systemd_ns(
        units=units,
        ro_binds={
            "/run/fake/devices": fake_proc_devices(tmp_path / "devices"),
            "/proc/devices": tmp_path / "devices",
            **dev_binds(tmp_path, ctrs),
        },
    )
    etc = ns.path("/etc/gpuguard")
    etc.mkdir(parents=True, exist_ok=True)
    (etc / "inventory.json").write_text(json.dumps(gpu_inventory(2)))
    (etc / "gpuguard.conf").write_text("[Inventory]\nFile=/etc/gpuguard/inventory.json\n")
    return ns


def _verdict(ns, c, minor: int):  # type: ignore[no-untyped-def]
    """The kernel's answer to opening /dev/nvidia<minor> from inside c's cgroup."""
    return probe_open(ns.path(f"/dev/nvidia{minor}"), [c.cgroup(ns)]).verdict


def test_reload_wipe_is_repaired_exactly_and_durably(systemd_ns, tmp_path) -> None:  # type: ignore[no-untyped-def]
    ctrs = containers(4)
    ns = _boot(systemd_ns, tmp_path, ctrs)
    for c in ctrs:
        start(ns, c)
    assert all(has(c, ns, (195, c.gpus[0])) for c in ctrs)
    # Seed 003 reproduced: a daemon-reload re-applies each scope's DeviceAllow= list.
    ns.systemctl("daemon-reload")
    assert not any(has(c, ns, (195, c.gpus[0])) for c in ctrs)

    assert ns.systemctl("start", "gpuguard.service").returncode == 0
    settle(ns)
    for c in ctrs:
        mine, other = c.gpus[0], 1 - c.gpus[0]
        assert has(c, ns, (195, mine)) and has(c, ns, (195, 255)) and has(c, ns, (511, 0))
        assert not has(c, ns, (195, other)), "granted a GPU the container was not given"
        assert _verdict(ns, c, mine) is True  # ENXIO: the cgroup lets it through
        assert _verdict(ns, c, other) is False  # EPERM: still denied
    assert len(events(ns, "container-device-denied")) >= 4 * 4  # 4 nodes each
    assert ns.path("/dev/char/195:0").is_symlink() and ns.path("/dev/nvidia-uvm").exists()
    regrants = len(events(ns, "cgroup-v1-allow"))
    assert len(events(ns, "unit-device-allow")) >= 4

    windows = {"daemon-reload": 0, "daemon-reexec": 0}
    for verb in ["daemon-reload"] * 100 + ["daemon-reexec"] * 5:
        ns.systemctl(verb)
        if any(not has(c, ns, (195, c.gpus[0])) for c in ctrs):
            # systemd re-applies a unit's device policy as deny-all, then each allow:
            # a check right after `systemctl` returns can land inside that window.
            windows[verb] += 1
            wait_for(
                lambda: all(has(c, ns, (195, c.gpus[0])) for c in ctrs),
                timeout=2,
                what="systemd to finish re-applying the device policy",
            )
    settle(ns)
    print(f"\nchecks that caught systemd mid-apply: {windows}")
    assert windows["daemon-reload"] == 0
    assert len(events(ns, "cgroup-v1-allow")) == regrants, "durable grants needed re-granting"


def test_new_container_is_made_durable_before_any_reload(systemd_ns, tmp_path) -> None:  # type: ignore[no-untyped-def]
    ctrs = containers(2)
    ns = _boot(systemd_ns, tmp_path, ctrs)
    assert ns.systemctl("start", "gpuguard.service").returncode == 0
    settle(ns)
    for c in ctrs:
        start(ns, c)  # created behind gpuguard's back, as the NVIDIA hook does
    wait_for(
        lambda: {e.get("UNIT") for e in events(ns, "unit-device-allow")} >= {c.unit for c in ctrs},
        what="durable grants for the new scopes",
    )
    before = len(events(ns, "cgroup-v1-allow"))
    for _ in range(5):
        ns.systemctl("daemon-reload")
        assert all(has(c, ns, (195, c.gpus[0])) for c in ctrs)
    settle(ns)
    assert len(events(ns, "cgroup-v1-allow")) == before
    assert all(not has(c, ns, (195, 1 - c.gpus[0])) for c in ctrs)
