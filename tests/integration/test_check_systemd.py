"""`gpuguard check` from the host against a real systemd running a fake kubelet.

The CLI runs on the host with `--root /proc/<nspid>/root --bus <the namespace's bus>`,
exactly as it would on a node, and must get kubelet stopped around the repair:
- kubelet.service active WITHOUT our drop-in: StopUnit, repair, StartUnit;
- WITH the drop-in: RestartUnit, and the drop-in's ExecStartPre= hook repairs;
- a kubelet process outside any unit: nothing safe to do, exit 5.
The fake kubelet copies the checkpoint at each start, so its second read must be the
repaired file (the one kubelet would load).
"""

from __future__ import annotations

import json
import subprocess
from typing import Any, Dict, List

import pytest

from gpuguard import exitcodes
from gpuguard.checkpoint import parse, verify
from integration.gpuguard_ns import (
    CHECKPOINT,
    FIXTURE,
    GPUGUARD,
    KEPT_GPU,
    MOVED_GPU,
    gpuguard_units,
    kubelet_reads,
    setup_node,
    wait_for,
)
from integration.harness import SystemdNamespace
from integration.harness import systemd_ns as systemd_ns

pytestmark = pytest.mark.root


def units(*, dropin: bool) -> Dict[str, str]:
    u = gpuguard_units()
    if not dropin:
        del u["kubelet.service.d/10-gpuguard.conf"]
        del u["kubelet.service.d/50-checkout.conf"]
    return u


def gpuguard_check(
    ns: SystemdNamespace, *extra: str, allow_restart: bool = True
) -> tuple[int, str, List[Dict[str, Any]]]:
    """Run the CLI on the host; (exit code, stdout, JSON log records). The inventory file
    stands in for NVML, so restarting kubelet needs --allow-kubelet-restart."""
    inventory = ns.path("/etc/gpuguard/inventory.json")
    p = subprocess.run(
        [
            str(GPUGUARD),
            "check",
            "--only",
            "checkpoint",
            "--root",
            str(ns.root),
            "--bus",
            ns.bus_address,
            "--inventory",
            str(inventory),
            "--log-json",
            *(["--allow-kubelet-restart"] if allow_restart else []),
            *extra,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    records = []
    for line in p.stderr.splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:
            records.append({"kind": "plain", "msg": line})
    return p.returncode, p.stdout, records


def start_kubelet(ns: SystemdNamespace) -> None:
    ns.systemctl("start", "kubelet.service")
    ns.wait_active("kubelet.service")
    wait_for(lambda: len(kubelet_reads(ns)) == 1, what="the fake kubelet's first read")


def assert_repaired(data: bytes) -> None:
    cp = parse(data, source="what kubelet read")
    assert verify(cp), "kubelet would reject this checkpoint"
    ids = cp.all_device_ids()
    assert KEPT_GPU in ids and MOVED_GPU not in ids


def test_without_dropin_stop_repair_start(systemd_ns) -> None:  # type: ignore[no-untyped-def]
    ns = systemd_ns(units=units(dropin=False))
    setup_node(ns, stale=True)
    start_kubelet(ns)
    assert kubelet_reads(ns)[0] == FIXTURE.read_bytes()
    main_pid = ns.unit_property("kubelet.service", "MainPID")
    code, out, log = gpuguard_check(ns)
    assert code == exitcodes.OK, out + json.dumps(log)
    assert "stop it, repair, start it" in out and "result:     repaired" in out
    assert [r["kind"] for r in log if r["kind"].startswith("kubelet")] == [
        "kubelet-stop",
        "kubelet-start",
    ]
    ns.wait_active("kubelet.service")
    assert ns.unit_property("kubelet.service", "MainPID") != main_pid
    reads = wait_for(lambda: len(kubelet_reads(ns)) == 2 and kubelet_reads(ns), what="2nd read")
    assert_repaired(reads[1])
    assert reads[1] == ns.path(CHECKPOINT).read_bytes()
    backups = list(ns.path("/var/lib/gpuguard/backups").iterdir())
    assert [b.read_bytes() for b in backups] == [FIXTURE.read_bytes()]
    # Healthy now: nothing to do, kubelet left alone.
    code, out, _ = gpuguard_check(ns)
    assert code == exitcodes.OK and "nothing to do" in out
    assert len(kubelet_reads(ns)) == 2


def test_with_dropin_restart_and_the_hook_repairs(systemd_ns) -> None:  # type: ignore[no-untyped-def]
    ns = systemd_ns(units=units(dropin=True))
    setup_node(ns, stale=False)
    start_kubelet(ns)
    setup_node(ns, stale=True)  # the GPUs changed under a running kubelet
    code, out, log = gpuguard_check(ns)
    assert code == exitcodes.OK, out + json.dumps(log)
    assert "ExecStartPre= hook repairs" in out
    assert (
        "result:     repaired by kubelet's pre-start hook during a kubelet restart (verified)"
    ) in out
    assert "done:       verified: the pre-start hook repaired it (sha256 " in out
    assert [r["kind"] for r in log if r["kind"].startswith("kubelet")] == ["kubelet-restart"]
    ns.wait_active("kubelet.service")
    reads = wait_for(lambda: len(kubelet_reads(ns)) == 2 and kubelet_reads(ns), what="2nd read")
    assert_repaired(reads[1])
    journal = json.dumps(ns.journal("kubelet.service"))
    assert "checkpoint-repaired" in journal  # the hook's own record, in kubelet's journal


def test_dry_run_and_no_restart_leave_kubelet_and_file(systemd_ns) -> None:  # type: ignore[no-untyped-def]
    ns = systemd_ns(units=units(dropin=False))
    setup_node(ns, stale=True)
    start_kubelet(ns)
    main_pid = ns.unit_property("kubelet.service", "MainPID")
    for extra in (("--dry-run",), ("--no-restart",)):
        code, out, _ = gpuguard_check(ns, *extra)
        assert code == exitcodes.FINDINGS, out
        assert ns.path(CHECKPOINT).read_bytes() == FIXTURE.read_bytes()
        assert ns.unit_property("kubelet.service", "MainPID") == main_pid
        assert len(kubelet_reads(ns)) == 1
    assert not ns.path("/var/lib/gpuguard/backups").exists()


def test_kubelet_stopped_repairs_directly(systemd_ns) -> None:  # type: ignore[no-untyped-def]
    ns = systemd_ns(units=units(dropin=True))
    setup_node(ns, stale=True)
    code, out, log = gpuguard_check(ns)
    assert code == exitcodes.OK, out
    assert "kubelet.service is inactive" in out and "repair directly" in out
    assert not [r for r in log if r["kind"].startswith("kubelet")]
    assert_repaired(ns.path(CHECKPOINT).read_bytes())
    assert ns.unit_property("kubelet.service", "ActiveState") == "inactive"


def test_kubelet_outside_systemd_exit_5(systemd_ns) -> None:  # type: ignore[no-untyped-def]
    ns = systemd_ns(units=units(dropin=True))
    setup_node(ns, stale=True)
    ns.run(["cp", "/bin/sleep", "/tmp/kubelet"], check=True)
    proc = ns.popen(["/tmp/kubelet", "300"])
    try:
        wait_for(
            lambda: any(
                (p / "comm").read_text().strip() == "kubelet"
                for p in ns.path("/proc").iterdir()
                if p.name.isdigit() and (p / "comm").exists()
            ),
            what="the stray kubelet process",
        )
        code, out, log = gpuguard_check(ns)
        assert code == exitcodes.KUBELET, out
        (line,) = [r["msg"] for r in log if r["kind"] == "plain"]
        assert line.startswith("gpuguard: ") and "outside systemd" in line
        assert ns.path(CHECKPOINT).read_bytes() == FIXTURE.read_bytes()
        assert not ns.path("/var/lib/gpuguard/backups").exists()
    finally:
        proc.kill()  # nsenter's child dies with it (pdeathsig); the harness reaps the rest
        proc.wait(timeout=10)
