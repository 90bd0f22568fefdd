"""The gpu_count step on a fake root: a finding with the layer that lost GPUs."""

from __future__ import annotations

import asyncio
from pathlib import Path

from gpuguard.engine.executor import ChangeExecutor
from gpuguard.host.paths import KUBELET_CHECKPOINT, Root
from gpuguard.steps.gpu_count import observe_counts
from gpuguard.steps.gpu_count.reconcile import GpuCounts, findings, registered_gpus
from unit.doctor_support import INVENTORY, UUIDS, pci_gpu, write_checkpoint


def test_observe_counts_reads_pci_and_checkpoint(tmp_path: Path) -> None:
    pci_gpu(tmp_path, "0000:10:00.0")
    pci_gpu(tmp_path, "0000:11:00.0")
    pci_gpu(tmp_path, "0000:12:00.0", klass="0x068000")
    write_checkpoint(tmp_path, UUIDS[:1])
    c = observe_counts(Root(tmp_path), INVENTORY, KUBELET_CHECKPOINT)
    assert (c.pci, c.nvml, c.registered) == (2, 2, 1)
    (f,) = findings(c)
    assert f.kind == "gpu-count-mismatch" and f.fields["GPUGUARD_LAYER"] == "device-plugin"


def test_nothing_readable_is_no_finding(tmp_path: Path) -> None:
    c = observe_counts(Root(tmp_path), None, KUBELET_CHECKPOINT)
    assert (c.pci, c.nvml, c.registered) == (None, None, None)
    assert findings(c) == []


def test_mig_leaves_the_kubelet_layer_out_but_not_the_driver() -> None:
    assert findings(GpuCounts(2, 2, 14, mig=True)) == []
    assert findings(GpuCounts(3, 2, 14, mig=True))[0].fields["GPUGUARD_LAYER"] == "driver"


def test_registered_counts_replicas_once_and_absent_resource_is_none() -> None:
    reg = (("nvidia.com/gpu", ("GPU-a::0", "GPU-a::1", "GPU-b")), ("other", ("x",)))
    assert registered_gpus(reg, "nvidia.com/gpu") == 2
    assert registered_gpus(reg, "nvidia.com/mig-1g.10gb") is None


def test_step_logs_and_appends_its_finding(tmp_path: Path) -> None:
    import io
    import json

    from gpuguard.config import load_config
    from gpuguard.engine.oneshot import OneShotServices
    from gpuguard.engine.passes import PassContext, Work
    from gpuguard.journal.log import EventLog
    from gpuguard.steps.gpu_count import GpuCountStep

    pci_gpu(tmp_path, "0000:10:00.0")
    pci_gpu(tmp_path, "0000:11:00.0")
    pci_gpu(tmp_path, "0000:13:00.0")
    write_checkpoint(tmp_path, UUIDS)
    out = io.StringIO()
    root = Root(tmp_path)
    svc = OneShotServices(root, load_config(root), EventLog(stream=out), ChangeExecutor(), "")

    async def inventory() -> object:
        return INVENTORY

    ctx = PassContext(Work(frozenset({"gpu_count"}), ("test",), 0, 0), inventory)  # type: ignore[arg-type]
    asyncio.run(GpuCountStep()(svc, ctx))
    (f,) = ctx.findings
    assert f.fields["GPUGUARD_LAYER"] == "driver" and "NVML sees 2 of the 3" in f.summary
    entry = json.loads(out.getvalue().splitlines()[-1])
    assert "NVML sees 2 of the 3" in json.dumps(entry)


def test_more_gpus_in_nvml_than_on_this_pci_bus_is_not_a_loss() -> None:
    # a simulated inventory on a host without NVIDIA functions: PCI says nothing
    assert findings(GpuCounts(0, 2, 2)) == []
    (f,) = findings(GpuCounts(0, 2, 1))  # the kubelet layer is still compared with NVML
    assert f.fields["GPUGUARD_LAYER"] == "device-plugin"
