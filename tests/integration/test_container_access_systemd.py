"""F2 on a real systemd: daemon-reload wipes a container's GPU grant (seed 003); gpuguard
restores exactly what the container was given and makes it survive later reloads. Each
test runs on both cgroup layouts: v1 (devices.list; gpuguard re-grants in devices.allow at
once, then on the scope) and v2 (BPF device programs; the scope's DeviceAllow= is the
repair, and the kernel's verdict on a probe open is what is checked)."""

from __future__ import annotations

import json

import pytest

from gpuguard.devices.probe import probe_open
from integration.gpu_scopes import boot_node, containers, has, start
from integration.gpuguard_ns import events, settle, start_gpuguard, wait_for
from integration.harness import layout as layout
from integration.harness import systemd_ns as systemd_ns
from integration.harness.bpfdev import DEFAULT_RULES, replace_programs

pytestmark = pytest.mark.root


def _regrant_kind(ns) -> str:  # type: ignore[no-untyped-def]
    """The action that re-grants a wiped node: a devices.allow write on v1, the scope's
    DeviceAllow= on v2 (whose BPF program gpuguard does not write)."""
    return "cgroup-v1-allow" if ns.layout == "v1" else "unit-device-allow"


def _verdict(ns, c, minor: int):  # type: ignore[no-untyped-def]
    """The kernel's answer to opening /dev/nvidia<minor> from inside c's cgroup."""
    return probe_open(ns.path(f"/dev/nvidia{minor}"), [c.cgroup(ns)]).verdict


def test_reload_wipe_is_repaired_exactly_and_durably(systemd_ns, tmp_path, layout) -> None:  # type: ignore[no-untyped-def]
    ctrs = containers(4)
    ns = boot_node(systemd_ns, tmp_path, ctrs, layout=layout)
    for c in ctrs:
        start(ns, c)
    assert all(has(c, ns, (195, c.gpus[0])) for c in ctrs)
    # Seed 003 reproduced: a daemon-reload re-applies each scope's DeviceAllow= list.
    ns.systemctl("daemon-reload")
    assert not any(has(c, ns, (195, c.gpus[0])) for c in ctrs)

    start_gpuguard(ns)
    for c in ctrs:
        mine, other = c.gpus[0], 1 - c.gpus[0]
        assert has(c, ns, (195, mine)) and has(c, ns, (195, 255)) and has(c, ns, (511, 0))
        assert not has(c, ns, (195, other)), "granted a GPU the container was not given"
        assert _verdict(ns, c, mine) is True  # ENXIO: the cgroup lets it through
        assert _verdict(ns, c, other) is False  # EPERM: still denied
    denied = events(ns, "container-device-denied")
    assert len(denied) >= 4 * 4  # 4 nodes each
    mechanism = "v1-rule" if layout == "v1" else "scope-device-allow"
    assert {(e["CGROUP_LAYOUT"], e["DEVICE_MECHANISM"]) for e in denied} == {(layout, mechanism)}
    assert ns.path("/dev/char/195:0").is_symlink() and ns.path("/dev/nvidia-uvm").exists()
    assert len(events(ns, "unit-device-allow")) >= 4
    regrants = len(events(ns, _regrant_kind(ns)))

    windows = {"daemon-reload": 0, "daemon-reexec": 0}
    for verb in ["daemon-reload"] * 100 + ["daemon-reexec"] * 5:
        ns.systemctl(verb)
        if any(not has(c, ns, (195, c.gpus[0])) for c in ctrs):
            # systemd re-applies a unit's device policy as deny-all, then each allow:
            # a check right after `systemctl` returns can land inside that window.
            windows[verb] += 1
            wait_for(
                lambda: all(has(c, ns, (195, c.gpus[0])) for c in ctrs),
                timeout=15,
                what="systemd to finish re-applying the device policy",
            )
    settle(ns)
    print(f"\nchecks that caught systemd mid-apply: {windows}")
    assert windows["daemon-reload"] == 0
    assert len(events(ns, _regrant_kind(ns))) == regrants, "durable grants needed re-granting"


def test_new_container_is_made_durable_before_any_reload(systemd_ns, tmp_path, layout) -> None:  # type: ignore[no-untyped-def]
    ctrs = containers(2)
    ns = boot_node(systemd_ns, tmp_path, ctrs, layout=layout)
    start_gpuguard(ns)
    for c in ctrs:
        start(ns, c)  # created behind gpuguard's back, as the NVIDIA hook does
    wait_for(
        lambda: {e.get("UNIT") for e in events(ns, "unit-device-allow")} >= {c.unit for c in ctrs},
        what="durable grants for the new scopes",
    )
    before = len(events(ns, _regrant_kind(ns)))
    for _ in range(5):
        ns.systemctl("daemon-reload")
        assert all(has(c, ns, (195, c.gpus[0])) for c in ctrs)
    settle(ns)
    assert len(events(ns, _regrant_kind(ns))) == before
    assert all(not has(c, ns, (195, 1 - c.gpus[0])) for c in ctrs)


def test_status_reports_and_oneshot_check_repairs(systemd_ns, tmp_path, layout) -> None:  # type: ignore[no-untyped-def]
    from integration.gpuguard_ns import GPUGUARD

    ctrs = containers(2)
    ns = boot_node(systemd_ns, tmp_path, ctrs, layout=layout)
    for c in ctrs:
        start(ns, c)
    ns.systemctl("daemon-reload")  # wipes both (gpuguard not running)
    # The nodes and links a running daemon would have made: check makes them too.
    res = ns.run([str(GPUGUARD), "status", "--json"])
    assert res.returncode == 0, res.stderr  # no host nodes yet: nothing to judge
    check = ns.run([str(GPUGUARD), "check", "--json"], timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr
    doc = json.loads(check.stdout)
    kinds = [o["kind"] for o in doc["devices"]["outcomes"] if o["status"] == "done"]
    assert "device-node-created" in kinds and "unit-device-allow" in kinds
    assert ("cgroup-v1-allow" in kinds) == (layout == "v1")
    status = json.loads(ns.run([str(GPUGUARD), "status", "--json"], check=True).stdout)
    rows = {r["container_id"]: r for r in status["containers"]}
    assert {rows[c.container_id]["access"] for c in ctrs} == {"ok"}
    mechanism = "v1-rule" if layout == "v1" else "scope-device-allow"
    assert {(r["layout"], r["mechanism"]) for r in rows.values()} == {(layout, mechanism)}
    text = ns.run([str(GPUGUARD), "status"], check=True).stdout
    how = "v1 rule" if layout == "v1" else "scope DeviceAllow="
    assert f": ok ({layout}, {how})" in text, text
    ns.systemctl("daemon-reload")  # durable now, even without the daemon
    assert all(has(c, ns, (195, c.gpus[0])) for c in ctrs)
    # A wipe behind everyone's back shows up in status as DENIED with exit code 1.
    if layout == "v1":
        ns.run(
            [
                "sh",
                "-c",
                f"echo 'c 195:{ctrs[0].gpus[0]} rw' > "
                f"/sys/fs/cgroup/devices/kubepods.slice/kubepods-besteffort.slice/"
                f"{ctrs[0].slice}/{ctrs[0].unit}/devices.deny",
            ],
            check=True,
        )
    else:  # a program without the GPU replaces systemd's
        replace_programs(ctrs[0].cgroup(ns), [*DEFAULT_RULES, ("c", 195, 255), ("c", 511, None)])
    assert not has(ctrs[0], ns, (195, ctrs[0].gpus[0]))
    res = ns.run([str(GPUGUARD), "status", "--json"])
    assert res.returncode == 1
    rows = {r["container_id"]: r for r in json.loads(res.stdout)["containers"]}
    assert rows[ctrs[0].container_id]["denied"] == [f"/dev/nvidia{ctrs[0].gpus[0]}"]
    assert rows[ctrs[1].container_id]["access"] == "ok"
