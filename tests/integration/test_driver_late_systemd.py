"""A GPU Operator node booting, on the real daemon in a real systemd namespace: the
driver is a pod kubelet starts, so NVML is missing at first. Its driver root
(/run/nvidia/driver) then appears with libnvidia-ml.so.1 (the fake driver library,
tests/fakenvml, through the real pynvml) and no uevent at all.

Before: the GPU count is unknown with the reason (the driver container has not
started), never "the NVIDIA driver is not working". After: the daemon sees NVML
without any event (its wait poll), the inventory change wakes the checkpoint step at
once, and the checkpoint is judged against the GPUs NVML names. The time from the
driver's arrival to the checkpoint judged is printed (the poll is 5 s).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

import fakenvml
from conftest import require_tool
from fakenvml import FakeGpu
from integration.gpuguard_ns import CHECKPOINT, gpuguard_units, status, wait_for
from integration.harness import systemd_ns as systemd_ns
from integration.test_driver_down import GPUS, fake_pci

pytestmark = pytest.mark.root

DRIVER_LIB = "/run/nvidia/driver/usr/lib/x86_64-linux-gnu"


def conditions(ns) -> dict:  # type: ignore[no-untyped-def,type-arg]
    return dict(status(ns).get("conditions") or {})


def test_driver_pod_arriving_late_wakes_the_checkpoint(systemd_ns, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    require_tool("gcc")
    from gpuguard.checkpoint import Checkpoint, marshal

    ns = systemd_ns(units=gpuguard_units(), ro_binds={"/sys/bus/pci/devices": fake_pci(tmp_path)})
    ckpt = ns.path(CHECKPOINT)
    ckpt.parent.mkdir(parents=True, exist_ok=True)
    ckpt.write_bytes(marshal(Checkpoint("v2", (), (("nvidia.com/gpu", GPUS),), 0, None)))
    ns.path("/etc/gpuguard").mkdir(parents=True, exist_ok=True)
    ns.path("/etc/gpuguard/gpuguard.conf").write_text("[Daemon]\nAuditInterval=1h\n")
    ns.path("/run/nvidia").mkdir(parents=True)  # the Operator's, before its driver pod
    assert ns.systemctl("start", "gpuguard.service").returncode == 0

    before = wait_for(
        lambda: conditions(ns) if "GPUCountMismatch" in conditions(ns) else None,
        what="the first pass",
    )
    count = before["GPUCountMismatch"]
    assert count["state"] == "unknown", count
    assert "driver container has not started" in count["message"], count
    assert "not working" not in str(before)
    assert before["KubeletCheckpointStale"]["state"] == "unknown"

    # the driver pod starts: its root mounted, the library and the driver there at once
    staging = ns.path("/run/nvidia/.staging")
    lib_dir = staging / DRIVER_LIB.removeprefix("/run/nvidia/driver/")
    fakenvml.build(lib_dir)
    gpus = [FakeGpu(u, i, f"00000000:{b}:00.0") for i, (u, b) in enumerate(zip(GPUS, ("3B", "86")))]
    fakenvml.write_conf(lib_dir, gpus)
    t0 = time.monotonic()
    os.rename(staging, ns.path("/run/nvidia/driver"))
    after = wait_for(
        lambda: c if (c := conditions(ns)).get("KubeletCheckpointStale", {}).get("state") == "ok"
        else None,
        timeout=30,
        what="the checkpoint judged once the driver arrived",
    )  # fmt: skip
    took = time.monotonic() - t0
    print(f"driver arrival -> checkpoint judged: {took:.2f} s")
    assert after["GPUCountMismatch"]["state"] == "ok", after["GPUCountMismatch"]
    st = status(ns)
    assert st["steps"]["gpu_count"]["gauges"].get("gpus_nvml") == 2
    journal = ns.run(["journalctl", "-o", "cat", "-u", "gpuguard.service", "--no-pager"]).stdout
    assert "NVML: /run/nvidia/driver/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1" in journal
    assert "inventory-changed" in journal or "GPU inventory available" in journal
