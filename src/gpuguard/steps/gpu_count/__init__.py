"""The gpu_count step: PCI functions vs GPUs NVML sees vs devices kubelet registered.

Report only: a lost GPU is repaired by its own layer (driver, device plugin, checkpoint),
this step says which one lost it (reconcile.py).

Modules (docs/architecture.md has the map of the packages):

- GPUs on the PCI bus vs NVML vs kubelet's registrations: which layer lost them (report
  only)
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Optional

from gpuguard.devices.pci import read_pci_gpus
from gpuguard.errors import GpuguardError
from gpuguard.host.inventory import Inventory
from gpuguard.host.paths import Root
from gpuguard.journal.conditions import Conditions, log_findings
from gpuguard.steps.gpu_count.reconcile import GpuCounts, findings, registered_gpus, unknowns

if TYPE_CHECKING:
    from gpuguard.engine.passes import PassContext, Services


def observe_counts(root: Root, inventory: Optional[Inventory], checkpoint_path: str) -> GpuCounts:
    from gpuguard.checkpoint import load

    try:
        pci: Optional[int] = len(read_pci_gpus(root))
    except OSError:
        pci = None
    try:
        registered = load(root.path(checkpoint_path)).checkpoint.registered or ()
        reg = registered_gpus(registered, "nvidia.com/gpu")
    except GpuguardError:
        reg = None
    return GpuCounts(
        pci,
        len(inventory.gpus) if inventory is not None else None,
        reg,
        mig=inventory is not None and any(g.mig for g in inventory.gpus),
    )


# While the driver is awaited, how often to look again: NVML appearing without a
# uevent (the driver container's root mounted, its library there) is seen so, and its
# inventory change wakes the checkpoint step.
WAIT_POLL, WAIT_POLL_AFTER_GRACE = 5.0, 60.0


class GpuCountStep:
    def __init__(self) -> None:
        self.conditions = Conditions()  # a finding that lasts is journaled once an hour
        self.waiting_since: Optional[float] = None  # monotonic: NVML first awaited

    async def __call__(self, svc: Services, ctx: PassContext) -> None:
        inventory = await ctx.device_inventory()
        counts = await asyncio.to_thread(
            observe_counts, svc.root, inventory, svc.config.kubelet.checkpoint_path
        )
        counts = self._wait(svc, ctx, counts, ctx.driver_wait() if inventory is None else "")
        for layer, n in (
            ("pci", counts.pci),
            ("nvml", counts.nvml),
            ("kubelet", counts.registered),
        ):
            if n is not None:
                ctx.gauges[f"gpus_{layer}"] = n
        found = findings(counts)
        log_findings(svc.log, self.conditions, "gpu_count", found, lasting_clears=True)
        ctx.findings += found
        if not found:
            ctx.unknown += unknowns(counts)

    def _wait(self, svc: Services, ctx: PassContext, counts: GpuCounts, why: str) -> GpuCounts:
        """The driver awaited (a GPU Operator node's, not there yet): for how long, and
        a look again soon, since its library may appear without a uevent."""
        if not why or not counts.pci:
            self.waiting_since = None
            return counts
        now = time.monotonic()
        if self.waiting_since is None:
            self.waiting_since = now
        over = now - self.waiting_since >= svc.config.inventory.driver_start_grace
        ctx.recheck(WAIT_POLL_AFTER_GRACE if over else WAIT_POLL, "waiting for the driver")
        return replace(counts, driver_wait=why, wait_over=over)
