"""The v2 bridge on a real systemd (unified), with the daemon from the repo's unit.

A GPU scope that is not durable (its DeviceAllow= lacks the GPU: reset behind gpuguard's
back, the hook's program admitting it again, as the bench does) loses its GPU at a
daemon-reload: systemd attaches a program built from its list next to the hook's. The
daemon bridges it at once (systemd's program replaced in place by its rules plus the
lost nodes), sets DeviceAllow=, and detaches the bridge once systemd's new program is
attached: BPF_PROG_QUERY then shows the hook's program and systemd's, nothing of
gpuguard's; the kernel admits exactly the container's nodes and what it had; a later
reload loses nothing and needs no bridge. v2 only: v1 has no programs to bridge.
"""

from __future__ import annotations

import pytest

from gpuguard.actuate.dropins import dropin_path
from gpuguard.devices.bpfread import BRIDGE_NAME, SYSTEMD_NAME
from integration.gpu_scopes import NODES, boot_node, containers, has, start
from integration.gpuguard_ns import events, settle, start_gpuguard, status, wait_for
from integration.harness import systemd_ns as systemd_ns
from integration.harness.bpfdev import programs

pytestmark = pytest.mark.root


def test_not_yet_durable_scope_is_bridged_then_durable_and_the_bridge_gone(  # type: ignore[no-untyped-def]
    systemd_ns, tmp_path
) -> None:
    mine, other = containers(2)  # GPU 0 and GPU 1
    ns = boot_node(systemd_ns, tmp_path, [mine, other], layout="v2")
    start_gpuguard(ns)
    start(ns, mine)
    start(ns, other)
    wait_for(
        lambda: {e.get("UNIT") for e in events(ns, "unit-device-allow")} >= {mine.unit, other.unit},
        what="durable grants for the new scopes",
    )
    settle(ns)
    # Not durable any more, behind gpuguard's back: its drop-in gone, systemd's list is
    # /dev/null alone and the hook's program admits the GPU again (what a scope gpuguard
    # has not made durable yet looks like).
    ns.path(dropin_path(mine.unit)).unlink()
    ns.systemctl("set-property", "--runtime", mine.unit, "DeviceAllow=", "DeviceAllow=/dev/null rw")
    mine.hook_grant(ns)
    cg = mine.cgroup(ns)
    (hook_id,) = programs(cg)
    assert has(mine, ns, (195, 0))
    settle(ns)
    n_allow = len(events(ns, "unit-device-allow"))

    ns.systemctl("daemon-reload")  # systemd attaches its program without the GPU
    wait_for(lambda: events(ns, "v2-bridge-detach"), what="the bridge detached", timeout=20)
    settle(ns)
    # made by the reload's fast path: on systemd's end-of-reload signal, or by one of the
    # looks after it when systemd had not applied the scope's loss yet at the signal
    reload = status(ns)["fast_paths"]["reload"]
    assert reload["checked"] >= 1 and reload["containers"] in (0, 1), reload
    (attach,) = events(ns, "v2-bridge-attach")
    assert attach["UNIT"] == mine.unit and attach["GPUGUARD_STATUS"] == "done"
    assert "195:0" in attach["DEVICE_NUMBERS"].split(",")
    assert "195:1" not in attach["DEVICE_NUMBERS"]
    (detach,) = events(ns, "v2-bridge-detach")
    assert detach["GPUGUARD_STATUS"] == "done" and "admits the nodes" in detach["MESSAGE"]
    # durable again: gpuguard's DeviceAllow= (a new entry), or, where systemd's reload
    # raced the test's reset, the grant it had already; either way the scope holds it
    assert len(events(ns, "unit-device-allow")) >= n_allow
    assert "/dev/char/195:0 rw" in ns.unit_property(mine.unit, "DeviceAllow")
    # The bridge is gone: the hook's program and systemd's new one, nothing else.
    progs = programs(cg)
    assert hook_id in progs and sorted(progs.values()) == sorted(["legacy_hook", SYSTEMD_NAME])
    assert BRIDGE_NAME not in progs.values()
    # The kernel's word: its nodes and what it had, never the other GPU.
    for numbers in [(195, 0), *NODES.values()]:
        assert has(mine, ns, numbers), numbers
    assert not has(mine, ns, (195, 1))
    assert has(other, ns, (195, 1)) and not has(other, ns, (195, 0))

    # Durable now: a later reload loses nothing and needs no bridge.
    for _ in range(3):
        ns.systemctl("daemon-reload")
        assert has(mine, ns, (195, 0))
    settle(ns)
    assert len(events(ns, "v2-bridge-attach")) == 1
    assert BRIDGE_NAME not in programs(cg).values()
