"""`DurableGrants=no` (gpuguard.conf(5)), on a real systemd in both layouts: a GPU
container's scope never gets a DeviceAllow= or a drop-in from gpuguard. After a
daemon-reload took the hook's grant away, on cgroup v1 gpuguard writes the GPU back to
devices.allow (until the next reload); on cgroup v2, where the scope's DeviceAllow= is
the repair, the loss is only reported (container-device-denied), with no bridge."""

from __future__ import annotations

import pytest

from integration.gpu_scopes import boot_node, containers, has, start
from integration.gpuguard_ns import events, settle, start_gpuguard
from integration.harness import layout as layout
from integration.harness import systemd_ns as systemd_ns

pytestmark = pytest.mark.root


def test_durable_grants_off_repairs_v1_in_place_and_only_reports_v2(
    systemd_ns, tmp_path, layout
) -> None:  # type: ignore[no-untyped-def]
    (c,) = containers(1)
    ns = boot_node(systemd_ns, tmp_path, [c], layout=layout, config="[Devices]\nDurableGrants=no\n")
    start_gpuguard(ns)
    start(ns, c)  # granted behind systemd's back, as the legacy NVIDIA hook does
    settle(ns)
    gpu = (195, c.gpus[0])
    assert has(c, ns, gpu)
    ns.systemctl("daemon-reload")
    settle(ns)
    denied = [
        e for e in events(ns, "container-device-denied") if e["CONTAINER_ID"] == c.container_id
    ]
    assert denied, "the loss was not reported"
    assert not events(ns, "unit-device-allow") and not events(ns, "v2-bridge-attach")
    assert "/dev/char/195" not in ns.unit_property(c.unit, "DeviceAllow")
    assert not ns.path(f"/run/systemd/system/{c.unit}.d").exists()
    if layout == "v1":
        assert has(c, ns, gpu), "v1: devices.allow is written back"
        assert events(ns, "cgroup-v1-allow")
    else:
        assert not has(c, ns, gpu), "v2: only reported"
        assert not events(ns, "v2-program-replace")
