"""The fleet view against the real daemon on a real systemd: the status file carries each
step's latest result, `gpuguard npd` answers node-problem-detector from it, `gpuguard
status` summarises it and `gpuguard doctor` judges the namespace's node."""

from __future__ import annotations

import json

import pytest

from integration.gpuguard_ns import GPUGUARD, gpuguard_units, setup_node, status, wait_for
from integration.harness import systemd_ns as systemd_ns

pytestmark = pytest.mark.root

STEPS = {"container_access", "device_nodes", "checkpoint", "device_plugin", "gpu_count", "readmit"}


def test_npd_status_and_doctor_answer_from_the_daemon(systemd_ns) -> None:  # type: ignore[no-untyped-def]
    ns = systemd_ns(units=gpuguard_units())
    setup_node(ns, stale=True)
    ns.systemctl("start", "gpuguard.service")
    st = wait_for(lambda: status(ns) if status(ns).get("steps") else None, what="status")
    assert set(st["steps"]) == STEPS  # the start-up pass runs every step
    cp = st["steps"]["checkpoint"]
    assert [f["kind"] for f in cp["findings"]] and cp["outcomes"]
    assert all(o["status"] == "done" for o in cp["outcomes"])  # repaired in that pass

    def npd(condition: str) -> tuple[int, str]:
        r = ns.run([str(GPUGUARD), "npd", condition])
        return r.returncode, r.stdout

    # stale checkpoint found and repaired in the same pass: the condition is False
    assert npd("checkpoint") == (
        0,
        "kubelet's device checkpoint names only devices this node has\n",
    )
    # no NVIDIA driver registered its devices in this namespace: access cannot be
    # judged, and NPD hears "unknown", never "OK"
    code, out = npd("device-access")
    assert code == 2 and "NVIDIA driver has registered no device" in out, out
    # the test node's inventory has 3 GPUs, the repaired checkpoint registers 1 (the other
    # two were replaced and, with no history, dropped from the registered list): true
    code, out = npd("gpu-count")
    assert code == 1 and out.startswith("kubelet has 1 of 3 GPU(s) registered"), out
    assert out.count("\n") == 1 and len(out.rstrip("\n")) <= 80

    r = ns.run([str(GPUGUARD), "status"])
    lines = r.stdout.splitlines()
    assert lines[0] == "node:       PROBLEM", r.stdout
    assert lines[1].startswith("  problem:  GPUCountMismatch: kubelet has 1 of 3")
    repairs = next(line for line in lines if line.startswith("repairs:"))
    assert "checkpoint" in repairs and not repairs.startswith("repairs:    0 ")

    doc = json.loads(ns.run([str(GPUGUARD), "doctor", "--json"]).stdout)
    checks = {c["check"]: c for c in doc["checks"]}
    assert checks["daemon"]["verdict"] == "ok", checks["daemon"]
    assert checks["kubelet-dropin"]["verdict"] == "ok"  # the namespace has the repo's drop-in
    # real binaries: runc --version and systemd's shared library, as installed here
    runc = ns.run(["runc", "--version"], check=True).stdout.split()[2]
    assert runc in checks["runc"]["evidence"]
    systemd = ns.run(["systemctl", "--version"], check=True).stdout.split()[1]
    assert checks["systemd"]["verdict"] == "ok"
    assert f"systemd {systemd} (" in checks["systemd"]["evidence"]
    assert checks["cgroup-layout"]["verdict"] == "ok"
    assert checks["driver"]["verdict"] == "broken"  # no NVIDIA driver on this machine
    assert doc["verdict"] == "broken" and doc["exit_code"] == 1

    # the daemon stops (RuntimeDirectory= goes with it): NPD hears "unknown", not "OK"
    ns.systemctl("stop", "gpuguard.service")
    assert npd("checkpoint") == (2, "no /run/gpuguard/status.json: gpuguard daemon not running\n")
