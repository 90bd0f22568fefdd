"""NVIDIA GPUs as the PCI bus sees them: the bottom layer of the GPU count.

A GPU is a PCI function with vendor 0x10de and a display class (0x03xxxx: VGA 0x0300,
3D controller 0x0302). NVSwitches (0x0680) and the audio/USB functions of consumer
boards have other classes and are not GPUs. Reading sysfs needs no driver: a GPU that
fell off the bus or that the driver failed to bind is still listed here.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from gpuguard.host.paths import Root
from gpuguard.host.safeio import proc_text

log = logging.getLogger(__name__)

PCI_DEVICES = "/sys/bus/pci/devices"
NVIDIA_VENDOR = "0x10de"


@dataclass(frozen=True)
class PciGpu:
    address: str  # 0000:17:00.0
    device_id: str  # 0x2330
    driver: str  # the bound driver ("nvidia", "vfio-pci") or ""


def read_pci_gpus(root: Root) -> tuple[PciGpu, ...]:
    """The NVIDIA display-class functions under /sys/bus/pci/devices, sorted.

    Raises OSError when the directory itself cannot be listed (no sysfs: the caller
    says "unknown"); unreadable entries are skipped."""
    base = root.path(PCI_DEVICES)
    out = []
    for name in sorted(os.listdir(base)):
        d = base / name
        try:
            vendor = proc_text(d / "vendor", max_bytes=64).strip().lower()
            if vendor != NVIDIA_VENDOR:
                continue
            klass = proc_text(d / "class", max_bytes=64).strip().lower()
            device = proc_text(d / "device", max_bytes=64).strip().lower()
        except OSError as e:
            log.debug("skipping %s: %s", d, e.strerror)
            continue
        if not klass.startswith("0x03"):
            continue
        try:
            driver = os.path.basename(os.readlink(d / "driver"))
        except OSError:
            driver = ""
        out.append(PciGpu(name, device, driver))
    return tuple(out)
