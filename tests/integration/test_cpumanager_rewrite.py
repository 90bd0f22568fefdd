"""Seed 002 through the running daemon, on the cgroupfs driver's layout.

kubelet's CPU manager (policy static) periodically updates each container's cpuset
through the runtime; older runc then re-wrote the container's whole v1 device cgroup:
``a`` to devices.deny, then only runc's default list and the spec's devices, which
never name the GPU nodes the legacy NVIDIA hook granted. Nothing announces such an
update (no systemd unit, no uevent): gpuguard's device watch sees it within
WatchInterval= (its periodic audit would, within AuditInterval=1s here). The container
here is in no systemd scope, so no grant can be made durable: every rewrite is repaired
again.

Layout, inside the systemd namespace harness (whose v1 devices root is the instance's
cgroup, ``ns.cgroup_dir("devices")``): ``kubepods/burstable/pod<uid>/<64-hex id>``,
holding a process that runs in its own mount namespace with a /dev of only its nodes.

On cgroup v2 (unified) the same update makes runc regenerate the container's device
program from its spec, replacing the hook's (played by ``harness/bpfdev.py``). Without
a systemd scope, with ``V2Remedy=report``, gpuguard must report the loss
(``v2-report-only``) within its audit interval and grant nothing (second test); with
``V2Remedy=inplace`` (the default) it replaces runc's program with one admitting its
rules plus exactly the lost nodes (third test).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Optional

import pytest

from gpuguard.devices.probe import probe_open, query_device_programs
from gpuguard.devices.rules import RUNC_DEFAULT_RULES
from gpuguard.steps.container_access.reconcile import CAUSE_REWRITE
from integration.gpu_scopes import Container, boot_node, containers
from integration.gpuguard_ns import events, paused, settle, wait_for
from integration.harness import SystemdNamespace
from integration.harness import systemd_ns as systemd_ns
from integration.harness.bpfdev import DEFAULT_RULES, replace_programs

pytestmark = pytest.mark.root

AUDIT_INTERVAL = 1.0


def _cgroup(ns: SystemdNamespace, c: Container) -> Path:
    rel = f"kubepods/burstable/pod{c.pod_uid}/{c.container_id}"
    return ns.cgroup_dir(ns.device_hierarchy) / rel


def _write(path: Path, rules: list[str]) -> None:
    with open(path, "w") as f:
        for r in rules:
            f.write(r)  # one rule per write(2), as runc does
            f.flush()


def _runc_rewrite(cgroup: Path) -> None:
    """Seed 002: deny everything, then allow runc's defaults + the spec (no GPU)."""
    _write(cgroup / "devices.deny", ["a"])
    _write(cgroup / "devices.allow", [r.render() for r in RUNC_DEFAULT_RULES])


def _allows(ns: SystemdNamespace, c: Container, ma: int, mi: int) -> bool:
    return f"c {ma}:{mi} rw" in (_cgroup(ns, c) / "devices.list").read_text()


def _verdict(ns: SystemdNamespace, c: Container, minor: int) -> Optional[bool]:
    return probe_open(ns.path(f"/dev/nvidia{minor}"), [_cgroup(ns, c)]).verdict


def _start(ns: SystemdNamespace, c: Container) -> None:
    """runc create: the cgroup, its process (own /dev), runc's list; then the hook."""
    cg = _cgroup(ns, c)
    cg.mkdir(parents=True)
    if ns.layout == "v2":
        replace_programs(cg, DEFAULT_RULES)  # runc's program at create
    else:
        _runc_rewrite(cg)  # what runc writes at create, too
    top = "/sys/fs/cgroup" if ns.layout == "v2" else "/sys/fs/cgroup/devices"
    inner = f"{top}/kubepods/burstable/pod{c.pod_uid}/{c.container_id}"
    ns.popen(
        [
            "sh",
            "-c",
            f"echo $$ > {inner}/cgroup.procs && exec unshare -m --propagation private "
            f"sh -c 'mount --bind /run/ctrdev/{c.container_id[:12]} /dev && exec sleep 3000'",
        ]
    )
    wait_for(lambda: (cg / "cgroup.procs").read_text().strip(), what=f"{c.container_id[:12]}")
    if ns.layout == "v2":  # the hook: its own program, admitting the container's nodes
        replace_programs(cg, [*DEFAULT_RULES, *(("c", ma, mi) for ma, mi in c.given())])
    else:
        _write(cg / "devices.allow", [f"c {ma}:{mi} rw" for ma, mi in c.given()])


def _boot(systemd_ns, tmp_path, ctrs, layout: str, extra: str = "") -> SystemdNamespace:  # type: ignore[no-untyped-def]
    config = f"[Daemon]\nAuditInterval={AUDIT_INTERVAL:g}s\n{extra}"
    ns = boot_node(systemd_ns, tmp_path, ctrs, layout=layout, config=config)
    for c in ctrs:
        _start(ns, c)
    assert ns.systemctl("start", "gpuguard.service").returncode == 0
    wait_for(lambda: ns.path("/dev/nvidia1").exists(), what="gpuguard's nodes")
    time.sleep(AUDIT_INTERVAL + 0.5)  # at least one audit pass over intact containers
    assert not events(ns, "container-device-denied")
    assert all(_verdict(ns, c, c.gpus[0]) is True for c in ctrs)
    return ns


def test_cpu_manager_rewrite_is_repaired_by_the_periodic_audit(systemd_ns, tmp_path) -> None:  # type: ignore[no-untyped-def]
    ctrs = containers(2)
    ns = _boot(systemd_ns, tmp_path, ctrs, "v1")

    repair_s = []
    for round_ in range(3):
        before = len(events(ns, "container-device-denied"))
        with paused(ns):  # the loss checked before the audit can repair it
            for c in ctrs:
                _runc_rewrite(_cgroup(ns, c))
            for c in ctrs:
                assert not _allows(ns, c, 195, c.gpus[0]) and not _allows(ns, c, 511, 0)
                assert "c 1:3 rwm" in (_cgroup(ns, c) / "devices.list").read_text()
        t0 = time.monotonic()
        wait_for(
            lambda: all(_allows(ns, c, *n) for c in ctrs for n in c.given()),
            timeout=AUDIT_INTERVAL + 15.0,
            what=f"the audit to repair rewrite {round_}",
        )
        repair_s.append(time.monotonic() - t0)
        for c in ctrs:  # exactly what it was given, by the kernel's verdict
            mine, other = c.gpus[0], 1 - c.gpus[0]
            assert _verdict(ns, c, mine) is True  # ENXIO: allowed
            assert _verdict(ns, c, other) is False  # EPERM: never granted
            assert not _allows(ns, c, 195, other)
        new = events(ns, "container-device-denied")[before:]
        for c in ctrs:
            mine = [e for e in new if e["CONTAINER_ID"] == c.container_id]
            assert {e["DEVICE_NUMBERS"] for e in mine} >= {f"{ma}:{mi}" for ma, mi in c.given()}
            assert {e["CAUSE"] for e in mine} == {CAUSE_REWRITE}
            assert {e["CGROUP_DRIVER"] for e in mine} == {"cgroupfs"}
            assert {e["POD_UID"] for e in mine} == {c.pod_uid}
        # The device watch repairs a rewrite within WatchInterval= and asks for a pass;
        # the next round's rewrite waits for it, so each loss is a new finding, as on a
        # node where CPU manager updates are seconds apart.
        settle(ns)
    print(f"\nrewrite -> repaired (s): {[round(s, 3) for s in repair_s]}")
    assert not events(ns, "unit-device-allow"), "no scope: nothing can be made durable"
    assert not events(ns, "reconciler-crashed")


def test_cpu_manager_rewrite_on_v2_is_reported_and_nothing_broadened(systemd_ns, tmp_path) -> None:  # type: ignore[no-untyped-def]
    ctrs = containers(2)
    ns = _boot(systemd_ns, tmp_path, ctrs, "v2", extra="[Devices]\nV2Remedy=report\n")
    for c in ctrs:  # the update: runc's program from the spec replaces the hook's
        replace_programs(_cgroup(ns, c), DEFAULT_RULES)
        assert _verdict(ns, c, c.gpus[0]) is False
    wait_for(
        lambda: (
            {e.get("CONTAINER_ID") for e in events(ns, "v2-report-only")}
            >= {c.container_id for c in ctrs}
        ),
        timeout=AUDIT_INTERVAL + 15.0,
        what="the audit to report the v2 loss",
    )
    denied = events(ns, "container-device-denied")
    for c in ctrs:
        mine = [e for e in denied if e["CONTAINER_ID"] == c.container_id]
        assert {e["DEVICE_NUMBERS"] for e in mine} >= {f"{ma}:{mi}" for ma, mi in c.given()}
        assert {e["CGROUP_DRIVER"] for e in mine} == {"cgroupfs"}
        assert {(e["CGROUP_LAYOUT"], e["DEVICE_MECHANISM"]) for e in mine} == {
            ("v2", "own-program")
        }
        # reported, not repaired: the kernel still denies it, and grants nothing else
        assert _verdict(ns, c, c.gpus[0]) is False
        assert _verdict(ns, c, 1 - c.gpus[0]) is False
    assert not events(ns, "unit-device-allow") and not events(ns, "cgroup-v1-allow")
    assert not events(ns, "reconciler-crashed")


def test_cpu_manager_rewrite_on_v2_is_repaired_in_place(systemd_ns, tmp_path) -> None:  # type: ignore[no-untyped-def]
    ctrs = containers(2)
    ns = _boot(systemd_ns, tmp_path, ctrs, "v2", extra="[Devices]\nV2Remedy=inplace\n")
    with paused(ns):
        for c in ctrs:  # the update: runc's program from the spec replaces the hook's
            replace_programs(_cgroup(ns, c), DEFAULT_RULES)
            assert _verdict(ns, c, c.gpus[0]) is False
    wait_for(
        lambda: all(_verdict(ns, c, c.gpus[0]) is True for c in ctrs),
        timeout=AUDIT_INTERVAL + 15.0,
        what="the audit to replace the programs",
    )

    def replaced() -> set[str]:
        done = [e for e in events(ns, "v2-program-replace") if e["GPUGUARD_STATUS"] == "done"]
        return {e["CONTAINER_ID"] for e in done}

    # The entry is written after the probe confirmed the swap, so it may reach the
    # journal a moment after the kernel already admits the node.
    wait_for(
        lambda: replaced() == {c.container_id for c in ctrs},
        timeout=15.0,
        what="the v2-program-replace entries",
    )
    for c in ctrs:  # exactly what it was given, by the kernel's verdict; one program
        assert _verdict(ns, c, c.gpus[0]) is True
        assert _verdict(ns, c, 1 - c.gpus[0]) is False
        assert len(query_device_programs(_cgroup(ns, c))) == 1
    assert not events(ns, "v2-report-only") and not events(ns, "unit-device-allow")
    assert not events(ns, "reconciler-crashed")
