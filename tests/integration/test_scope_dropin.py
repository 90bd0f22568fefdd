"""A new GPU container's grant written as its scope's drop-in, on a real systemd in both
cgroup layouts: the drop-in holds the container's own GPU and nothing else; it keeps it
across a daemon-reload on its own (gpuguard stopped, so nothing else can grant it), both
where systemd's own record of the D-Bus grant is missing (not answered yet) and where a
runtime reset DeviceAllow= over the bus (its drop-in sorts before gpuguard's); and the
pass removes it once the scope is gone, while a live scope's stays."""

from __future__ import annotations

from pathlib import Path

import pytest

from integration.gpu_scopes import Container, boot_node, containers, has, start, write_config
from integration.gpuguard_ns import events, passes, paused, settle, start_gpuguard, wait_for
from integration.harness import layout as layout
from integration.harness import systemd_ns as systemd_ns

pytestmark = pytest.mark.root

HELD = "[Daemon]\nQuietPeriod=1h\nMaxDelay=1h\n"  # no pass but the urgent ones
DROPIN = "/run/systemd/system/{}.d/60-gpuguard-devices.conf"
SYSTEMDS = "/run/systemd/transient/{}.d/50-DeviceAllow.conf"  # a transient unit's


def _dropin(ns, c: Container) -> Path:  # type: ignore[no-untyped-def]
    return ns.path(DROPIN.format(c.unit))  # type: ignore[no-any-return]


def _granted(ns, c: Container) -> bool:  # type: ignore[no-untyped-def]
    return any(e.get("UNIT") == c.unit for e in events(ns, "unit-device-allow"))


def test_the_drop_in_alone_keeps_the_containers_gpu_across_a_reload(
    systemd_ns, tmp_path, layout
) -> None:  # type: ignore[no-untyped-def]
    ctrs = containers(2)
    ns = boot_node(systemd_ns, tmp_path, ctrs, layout=layout, config=HELD)
    start_gpuguard(ns)
    for c in ctrs:
        start(ns, c)  # granted behind systemd's back, as the legacy NVIDIA hook does
    for c in ctrs:
        wait_for(lambda c=c: _granted(ns, c), timeout=30, what=f"{c.unit}'s grant")
        mine, other = c.gpus[0], 1 - c.gpus[0]
        text = _dropin(ns, c).read_text()
        lines = [line for line in text.splitlines() if line.startswith("DeviceAllow=")]
        assert f"DeviceAllow=/dev/char/195:{mine} rw" in lines, text
        assert not [line for line in lines if f"195:{other} " in line], "a GPU not given"
        assert "DeviceAllow= " not in text and "DeviceAllow=\n" not in text  # never a reset
    unanswered, reset = ctrs
    ns.path(SYSTEMDS.format(unanswered.unit)).unlink()  # as if systemd had not answered yet
    with paused(ns):  # nothing but systemd itself acts from here
        # a runtime's update through the bus (runc's systemd driver): DeviceAllow= reset
        # to its own list, in systemd's drop-in, which sorts before gpuguard's
        ns.systemctl("set-property", "--runtime", reset.unit, "DeviceAllow=")
        ns.systemctl("set-property", "--runtime", reset.unit, "DeviceAllow=/dev/null rw")
        assert "/dev/char/195" not in ns.unit_property(reset.unit, "DeviceAllow")
        ns.systemctl("daemon-reload")
        for c in ctrs:
            mine, other = c.gpus[0], 1 - c.gpus[0]
            paths = ns.unit_property(c.unit, "DropInPaths")
            assert DROPIN.format(c.unit) in paths, paths
            assert ("50-DeviceAllow" in paths) == (c is reset), paths
            assert f"/dev/char/195:{mine} rw" in ns.unit_property(c.unit, "DeviceAllow")
            assert has(c, ns, (195, mine)), f"{c.unit} lost its GPU at the reload"
            assert not has(c, ns, (195, other)), f"{c.unit} got a GPU it was not given"


def test_the_pass_removes_a_gone_scopes_drop_in_and_keeps_a_live_ones(
    systemd_ns, tmp_path, layout
) -> None:  # type: ignore[no-untyped-def]
    gone, live = containers(2)
    ns = boot_node(systemd_ns, tmp_path, [gone, live], layout=layout, config=HELD)
    start_gpuguard(ns)
    for c in (gone, live):
        start(ns, c)
        wait_for(lambda c=c: _granted(ns, c), timeout=30, what=f"{c.unit}'s grant")
        assert _dropin(ns, c).is_file()
    ns.systemctl("stop", gone.unit)
    before = passes(ns)
    write_config(ns, "")  # passes no longer held: the configuration reload's pass
    ns.systemctl("reload", "gpuguard.service")
    wait_for(lambda: passes(ns) > before, what="the full pass")
    settle(ns)
    (removed,) = events(ns, "unit-dropin-remove")
    assert removed["UNIT"] == gone.unit and removed["GPUGUARD_STATUS"] == "done", removed
    assert not _dropin(ns, gone).exists() and not _dropin(ns, gone).parent.exists()
    assert _dropin(ns, live).is_file()
