"""The most common GPU node failure, a broken driver (after a kernel update), on the
real daemon in a real systemd namespace, both cgroup layouts: NVML is unavailable, the
GPUs are still on the PCI bus (a sysfs of two NVIDIA 3D controllers bound over the
namespace's /sys/bus/pci/devices) and kubelet still registers them (its checkpoint).

Every report says problem or unknown, never OK (issue 25): the status file, `gpuguard
status`, `gpuguard npd` (1 problem, 2 unknown), the metrics and `gpuguard doctor`; the
GPU count's finding names the driver and the next step.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from integration.gpuguard_ns import CHECKPOINT, GPUGUARD, gpuguard_units, status, wait_for
from integration.harness import layout as layout
from integration.harness import systemd_ns as systemd_ns

pytestmark = pytest.mark.root

GPUS = ("GPU-11111111-1111-4111-8111-111111111111", "GPU-22222222-2222-4222-8222-222222222222")


def fake_pci(base: Path) -> Path:
    """Two NVIDIA GPUs (3D controllers, no driver bound) and a host bridge, as sysfs
    shows them: each function a directory of attributes."""
    pci = base / "pci-devices"
    for address, vendor, klass in (
        ("0000:00:00.0", "0x8086", "0x060000"),
        ("0000:3b:00.0", "0x10de", "0x030200"),
        ("0000:86:00.0", "0x10de", "0x030200"),
    ):
        d = pci / address
        d.mkdir(parents=True)
        (d / "vendor").write_text(vendor + "\n")
        (d / "class").write_text(klass + "\n")
        (d / "device").write_text("0x2330\n")
    return pci


def test_a_node_whose_driver_is_down_is_never_ok(systemd_ns, layout: str, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from gpuguard.checkpoint import Checkpoint, marshal

    ns = systemd_ns(
        units=gpuguard_units(),
        ro_binds={"/sys/bus/pci/devices": fake_pci(tmp_path)},
        layout=layout,
    )
    ckpt = ns.path(CHECKPOINT)
    ckpt.parent.mkdir(parents=True, exist_ok=True)
    ckpt.write_bytes(marshal(Checkpoint("v2", (), (("nvidia.com/gpu", GPUS),), 0, None)))
    # no [Inventory] File=: the GPUs come from NVML, which has no driver to talk to
    (ns.path("/etc/gpuguard")).mkdir(parents=True, exist_ok=True)
    (ns.path("/etc/gpuguard/gpuguard.conf")).write_text("[Daemon]\nAuditInterval=1h\n")
    assert ns.systemctl("start", "gpuguard.service").returncode == 0
    st = wait_for(lambda: status(ns) if status(ns).get("steps") else None, what="status")

    def gg(*argv: str) -> tuple[int, str]:
        r = ns.run([str(GPUGUARD), *argv])
        return r.returncode, r.stdout

    # the status file: the daemon's own verdict, per condition
    assert st["node"] == "problem", st["conditions"]
    conditions = st["conditions"]
    assert conditions["GPUCountMismatch"]["state"] == "problem"
    assert "NVML is unavailable while 2 NVIDIA GPU(s)" in conditions["GPUCountMismatch"]["message"]
    assert conditions["KubeletCheckpointStale"]["state"] == "unknown"
    assert conditions["GPUDeviceAccessLost"]["state"] == "unknown"
    assert st["steps"]["gpu_count"]["gauges"] == {"gpus_pci": 2, "gpus_kubelet": 2}
    # the plugin and the rejected pods are judged without the driver
    ok = ("GPUDevicePluginStale", "GPUPodsRejected")
    assert all(c["state"] != "ok" or t in ok for t, c in conditions.items())

    # npd: 1 with the driver named, 2 where nothing could be judged; never 0 with "agree"
    code, out = gg("npd", "gpu-count")
    assert code == 1 and out.startswith("NVML is unavailable while 2 NVIDIA GPU(s)"), out
    assert "agree" not in out and len(out.rstrip("\n")) <= 80
    code, out = gg("npd", "checkpoint")
    assert code == 2 and "no GPU inventory" in out, out
    code, out = gg("npd", "device-access")
    assert code == 2 and "NVIDIA driver" in out, out

    # gpuguard status: PROBLEM first, the unknowns listed
    code, out = gg("status")
    lines = out.splitlines()
    assert lines[0] == "node:       PROBLEM", out
    assert any("GPUCountMismatch: NVML is unavailable" in line for line in lines), out
    assert any(line.startswith("  unknown:  KubeletCheckpointStale") for line in lines), out
    assert code == 1

    # the metrics: the condition's status true/unknown, as kube-state-metrics spells it
    code, text = gg("metrics")
    assert code == 0, text
    assert 'gpuguard_node_condition_status{condition="GPUCountMismatch",status="true"} 1.0' in text
    unknown = 'gpuguard_node_condition_status{condition="KubeletCheckpointStale",status="unknown"}'
    assert f"{unknown} 1.0" in text
    assert 'gpuguard_node_condition{condition="KubeletCheckpointStale"}' not in text
    assert 'gpuguard_gpus{layer="pci"} 2.0' in text and 'layer="nvml"' not in text

    # doctor: the GPU count is broken, and says what to do about the driver
    doc = json.loads(ns.run([str(GPUGUARD), "doctor", "--json"]).stdout)
    checks = {c["check"]: c for c in doc["checks"]}
    assert checks["gpu-count"]["verdict"] == "broken", checks["gpu-count"]
    assert "NVML is unavailable while 2 NVIDIA GPU(s)" in checks["gpu-count"]["evidence"]
    assert "dkms status" in checks["gpu-count"]["fix"]
    assert doc["verdict"] == "broken" and doc["exit_code"] == 1
