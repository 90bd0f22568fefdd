"""Issue 9.1: a repair made by kubelet's pre-start hook is reported only when verified.

A real systemd runs a kubelet stand-in with the repo's drop-in (ExecStartPre=-hook: its
exit status is ignored, so RestartUnit's job ends `done` whatever the hook did). The
GPUs change under the running kubelet; `gpuguard check` on the host restarts it. The
hook is then made to fail in each way it can, and the CLI must never report success:
exit 5, one line saying why, the checkpoint's bytes unchanged, no backup, and the
failure in the node's journal with its MESSAGE_ID. Plus the success case verified, and
an --inventory run (a simulation) that must leave a running kubelet alone.
"""

from __future__ import annotations

import json
from typing import Any, Dict, List

import pytest

from gpuguard import exitcodes
from gpuguard.journal.catalog import message_id
from integration.gpuguard_ns import (
    BEFORE_CHANGE,
    CHECKPOINT,
    FIXTURE,
    GPUGUARD,
    INVENTORY,
    events,
    gpuguard_units,
    kubelet_reads,
    passes,
    settle,
    setup_node,
    status,
    wait_for,
)
from integration.harness import SystemdNamespace
from integration.harness import systemd_ns as systemd_ns
from integration.test_check_systemd import gpuguard_check, start_kubelet, units

pytestmark = pytest.mark.root


def plain(log: List[Dict[str, Any]]) -> List[str]:
    return [r["msg"] for r in log if r["kind"] == "plain"]


def hook_wrapper(ns: SystemdNamespace, body: str) -> None:
    """Point the drop-in's hook at a stand-in for gpuguard (a daemon-reload applies it)."""
    path = ns.path("/etc/gpuguard/fake-gpuguard")
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(0o755)
    ns.write_unit(
        "kubelet.service.d/60-broken-hook.conf",
        "[Service]\nEnvironment=GPUGUARD=/etc/gpuguard/fake-gpuguard\nTimeoutStartSec=2s\n",
        reload=True,
    )


def break_config(ns: SystemdNamespace) -> None:
    # The hook reads the node's file; the CLI on the host gets a good one with --config.
    ns.path("/etc/gpuguard/gpuguard.conf").write_text("[Kubelet]\nPolicy=sometimes\n")


def no_driver(ns: SystemdNamespace) -> None:
    # No [Inventory] File=: the hook asks NVML, and this node has no driver.
    ns.path("/etc/gpuguard/gpuguard.conf").write_text("")


BREAKS = {
    "no-driver": (no_driver, "kubelet's pre-start hook skipped (exit 0): "),
    "bad-config": (break_config, "kubelet's pre-start hook failed (exit 2): "),
    "timeout": (
        lambda ns: hook_wrapper(ns, "exec sleep 30"),
        "left no result for this restart",
    ),
    "killed": (
        lambda ns: hook_wrapper(ns, "kill -KILL $$"),
        "left no result for this restart",
    ),
}


@pytest.mark.parametrize("how", sorted(BREAKS))
def test_a_failing_hook_is_never_reported_as_a_repair(systemd_ns, tmp_path, how) -> None:  # type: ignore[no-untyped-def]
    ns = systemd_ns(units=units(dropin=True))
    setup_node(ns, stale=False)
    start_kubelet(ns)
    setup_node(ns, stale=True)  # the GPUs changed under the running kubelet
    good = tmp_path / "gpuguard.conf"
    good.write_text("")
    brk, why = BREAKS[how]
    brk(ns)
    code, out, log = gpuguard_check(ns, "--config", str(good))
    assert code == exitcodes.KUBELET, out + json.dumps(log)
    assert out == ""  # no report, no "repaired"
    (line,) = plain(log)
    assert line.startswith(f"gpuguard: {ns.path(CHECKPOINT)}: not repaired: ")
    assert why in line, line
    assert ns.path(CHECKPOINT).read_bytes() == FIXTURE.read_bytes()
    assert not ns.path("/var/lib/gpuguard/backups").exists()
    assert not [r for r in log if r.get("GPUGUARD_STATUS") == "done"]
    (failed,) = [r for r in log if r["kind"] == "checkpoint-repair-unverified"]
    assert failed["GPUGUARD_STATUS"] == "failed" and failed["level"] == "error"
    # The same entry in the node's own journald (the CLI logs there whatever its stderr).
    entries = [
        e for e in ns.journal() if e.get("MESSAGE_ID") == message_id("checkpoint-repair-unverified")
    ]
    assert len(entries) == 1 and why in entries[0]["MESSAGE"]
    assert entries[0]["PRIORITY"] == "3" and entries[0]["UNIT"] == "kubelet.service"
    if how == "no-driver":  # point 4: the hook exits 0 and says why, once
        kubelet = ns.journal("kubelet.service")
        skipped = [e for e in kubelet if e.get("GPUGUARD_KIND") == "kubelet-hook-skipped"]
        assert len(skipped) == 1 and "nothing to do" in skipped[0]["MESSAGE"]
        assert "code=exited ; status=0 }" in ns.unit_property("kubelet.service", "ExecStartPre")
        shown = ns.systemctl("status", "kubelet.service", check=False).stdout
        assert "ExecStartPre=" in shown and "status=0/SUCCESS" in shown, shown


def test_the_success_case_is_verified(systemd_ns) -> None:  # type: ignore[no-untyped-def]
    ns = systemd_ns(units=units(dropin=True))
    setup_node(ns, stale=False)
    start_kubelet(ns)
    setup_node(ns, stale=True)
    code, out, log = gpuguard_check(ns)
    assert code == exitcodes.OK, out + json.dumps(log)
    assert "(verified)" in out and "re-read after the restart: no stale device" in out
    record = json.loads(ns.path("/run/gpuguard/kubelet-hook.result").read_text())
    assert record["outcome"] == "repaired" and record["token"]
    assert record["after_sha256"] != record["before_sha256"]
    assert not ns.path("/run/gpuguard/kubelet-hook.request").exists()
    # A later plain kubelet restart (nobody asked) leaves a record without the token.
    ns.systemctl("restart", "kubelet.service")
    later = json.loads(ns.path("/run/gpuguard/kubelet-hook.result").read_text())
    assert later["token"] == "" and later["outcome"] == "healthy"


def test_an_inventory_file_never_restarts_kubelet_without_the_flag(systemd_ns) -> None:  # type: ignore[no-untyped-def]
    ns = systemd_ns(units=units(dropin=True))
    setup_node(ns, stale=False)
    start_kubelet(ns)
    setup_node(ns, stale=True)
    main_pid = ns.unit_property("kubelet.service", "MainPID")
    code, out, _ = gpuguard_check(ns, allow_restart=False)
    assert code == exitcodes.FINDINGS, out
    assert "plan:" in out
    result = (
        "result:     not repaired: the GPU inventory comes from --inventory (a simulation), "
        "so a running kubelet is not restarted or stopped; pass --allow-kubelet-restart"
    )
    assert result in out
    # The dry run prints exactly what the real run does (no "restart kubelet" promise).
    code, dry, _ = gpuguard_check(ns, "--dry-run", allow_restart=False)
    assert code == exitcodes.FINDINGS and result in dry, dry
    assert ns.unit_property("kubelet.service", "MainPID") == main_pid
    assert ns.path(CHECKPOINT).read_bytes() == FIXTURE.read_bytes()
    assert (
        "--allow-kubelet-restart"
        in __import__("subprocess")
        .run([str(GPUGUARD), "check", "--help"], capture_output=True, text=True)
        .stdout
    )


def test_the_daemon_reports_an_unverified_repair_and_restarts_kubelet_once(systemd_ns) -> None:  # type: ignore[no-untyped-def]
    ns = systemd_ns(units=gpuguard_units())
    allow = "[Inventory]\nAllowKubeletRestart=yes\n"  # the inventory file is a simulation
    # the checkpoint matching the GPUs it was written under: recorded as the history
    setup_node(ns, stale=True, config=allow)
    ns.path("/etc/gpuguard/inventory.json").write_text(json.dumps(BEFORE_CHANGE))
    assert ns.systemctl("start", "gpuguard.service").returncode == 0
    start_kubelet(ns)
    settle(ns)
    hook_wrapper(ns, "kill -KILL $$")  # the daemon-reload in it makes a pass too
    # the GPUs change under the running kubelet, which has pod B: [Kubelet]
    # RestartPolicy=for-pods restarts it for that pod, whose entry is remapped
    ns.path("/var/lib/kubelet/pods/94283d1b-ce5a-4797-bff8-0cf0c7143b2b").mkdir(parents=True)
    ns.path("/etc/gpuguard/inventory.json").write_text(json.dumps(INVENTORY))
    ns.systemctl("daemon-reload")
    wait_for(lambda: events(ns, "checkpoint-repair-unverified"), what="the unverified repair")
    (entry,) = events(ns, "checkpoint-repair-unverified")
    assert "left no result for this restart" in entry["MESSAGE"]
    assert entry["MESSAGE_ID"] == message_id("checkpoint-repair-unverified")
    assert not [e for e in events(ns) if e.get("GPUGUARD_STATUS") == "done"]
    assert len(kubelet_reads(ns)) == 2  # restarted once
    # More passes within the cool-down: reported again, never another restart.
    for _ in range(2):
        before = passes(ns)
        ns.systemctl("daemon-reload")
        wait_for(lambda: passes(ns) > before, what="another pass")  # noqa: B023
    settle(ns)
    # The last pass still reports the problem (the failure, or the stale entries it
    # leaves for kubelet's next start), and kubelet was not restarted again.
    kinds = {f["kind"] for f in status(ns)["last_pass"]["findings"]}
    assert kinds & {
        "kubelet-coordination-failed",
        "checkpoint-stale-entry",
        "checkpoint-entry-remap",
    }, kinds
    assert len(kubelet_reads(ns)) == 2
    restarts = [e for e in events(ns) if e.get("GPUGUARD_ACTION") == "kubelet-restart"]
    assert [e["GPUGUARD_KIND"] for e in restarts] == ["kubelet-restart"]  # queued once, done
    assert ns.path(CHECKPOINT).read_bytes() == FIXTURE.read_bytes()
