"""GPU count across the layers: PCI functions, GPUs NVML sees, devices kubelet registered.

A node that advertises fewer GPUs than it has is the F4 symptom users report most; the
count at each layer says where they were lost: PCI > NVML is the driver (a GPU fell off
the bus, Xid 79, or failed to initialise), NVML > kubelet is the device plugin (it did
not register them all, F4), kubelet > NVML is registrations from GPUs that are gone (F1).
Pure: the counts come in, a verdict goes out.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional, Sequence

from gpuguard.model import Finding
from gpuguard.steps.registry import GPU_COUNT

KIND = "gpu-count-mismatch"
RECONCILER = GPU_COUNT


@dataclass(frozen=True)
class GpuCounts:
    pci: Optional[int]  # None: sysfs unreadable
    nvml: Optional[int]  # None: no inventory (no driver, NVML failed)
    registered: Optional[int]  # None: no checkpoint or no RegisteredDevices for the resource
    resource: str = "nvidia.com/gpu"
    mig: bool = False  # MIG enabled: kubelet registers MIG devices, not GPUs
    # NVML missing on a node whose driver comes from a container (the GPU Operator's):
    # why (the driver container has not started), and whether the grace period for
    # it is over; "" when the driver is not awaited.
    driver_wait: str = ""
    wait_over: bool = False

    def to_json(self) -> dict[str, object]:
        return {
            "pci": self.pci,
            "nvml": self.nvml,
            "registered": self.registered,
            "resource": self.resource,
            "mig": self.mig,
        }


def registered_gpus(
    registered: Sequence[tuple[str, Optional[Sequence[str]]]], resource: str
) -> Optional[int]:
    """Distinct GPUs kubelet registered for `resource` (time-slicing replicas
    ``GPU-x::0``, ``GPU-x::1`` are one GPU); None when the resource is absent."""
    for name, ids in registered:
        if name == resource:
            return len({i.split("::", 1)[0] for i in ids or ()})
    return None


DRIVER_DOWN_NEXT = (
    "check `nvidia-smi` and `dmesg`, that the driver's kernel module is built and loaded "
    "for the running kernel (`dkms status`, `modprobe nvidia`), and that the user-space "
    "driver matches it; then restart the device plugin"
)


def judge(c: GpuCounts) -> tuple[Optional[str], str]:
    """(None when consistent, else which layer lost GPUs; the one-line explanation)."""
    if c.pci and c.nvml is None and c.driver_wait:
        # A GPU Operator node booting: the driver is a pod kubelet has yet to start.
        # Unknown (unknowns() says why) until the grace period ends.
        if not c.wait_over:
            return None, _counts(c)
        return "driver", (
            f"NVML is still unavailable while {c.pci} NVIDIA GPU(s) are on the PCI bus, "
            f"past the driver's grace period (DriverStartGrace=): {c.driver_wait}"
        )
    if c.pci and c.nvml is None:
        # The most common GPU node failure (a broken driver after a kernel update):
        # kubelet may still list the GPUs, NVML answers nothing. Never "agree".
        return "driver", (
            f"NVML is unavailable while {c.pci} NVIDIA GPU(s) are on the PCI bus: the "
            f"NVIDIA driver is not working; {DRIVER_DOWN_NEXT}"
        )
    if c.pci is not None and c.nvml is not None and c.nvml < c.pci:
        return "driver", (
            f"NVML sees {c.nvml} of the {c.pci} NVIDIA GPU(s) on the PCI bus: the driver "
            f"lost {c.pci - c.nvml} (fell off the bus, Xid 79, failed to initialise); "
            "check dmesg and nvidia-smi"
        )
    if c.pci is not None and c.nvml is not None and c.nvml > c.pci:
        # Not a lost GPU: this sysfs is not the GPUs' host (a simulated inventory, a
        # container without the host's /sys). The PCI layer says nothing here.
        c = replace(c, pci=None)
    if c.mig or c.registered is None:
        return None, _counts(c)
    have = c.nvml if c.nvml is not None else c.pci
    if have is None:
        return None, _counts(c)
    if c.registered < have:
        return "device-plugin", (
            f"kubelet has {c.registered} of {have} GPU(s) registered for {c.resource}: the "
            f"device plugin did not register {have - c.registered} (F4); restart the device "
            "plugin and check its log"
        )
    if c.registered > have:
        return "kubelet", (
            f"kubelet has {c.registered} GPU(s) registered for {c.resource} but the node has "
            f"{have}: stale registrations (F1), repaired with the checkpoint"
        )
    return None, _counts(c)


def unknowns(c: GpuCounts) -> list[str]:
    """The layers that could not be read: the count is then "unknown", never "ok"
    (a node without NVIDIA GPUs on its bus and no NVML has nothing to count)."""
    out = []
    if c.pci is None:
        out.append("the PCI bus (/sys/bus/pci/devices) could not be read")
    if c.nvml is None and c.pci != 0:
        out.append(
            f"no GPU inventory yet: {c.driver_wait}" if c.driver_wait
            else "no GPU inventory (NVML unavailable)"
        )  # fmt: skip
    if c.registered is None and (c.nvml or c.pci):
        out.append(f"kubelet's registrations of {c.resource} could not be read (no checkpoint?)")
    return out


def _counts(c: GpuCounts) -> str:
    def n(v: Optional[int]) -> str:
        return "?" if v is None else str(v)

    return f"PCI {n(c.pci)}, NVML {n(c.nvml)}, kubelet {n(c.registered)} ({c.resource})"


def findings(c: GpuCounts) -> list[Finding]:
    layer, text = judge(c)
    if layer is None:
        return []
    fields = {"GPUGUARD_LAYER": layer, "GPU_COUNTS": _counts(c)}
    return [Finding(KIND, RECONCILER, text, fields, severity="error")]
