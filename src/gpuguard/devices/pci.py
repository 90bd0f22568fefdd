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
from gpuguard.host.safeio import UnsafeFileError, read_attr

log = logging.getLogger(__name__)

PCI_DEVICES = "/sys/bus/pci/devices"
NVIDIA_VENDOR = "0x10de"


@dataclass(frozen=True)
class PciFunction:
    address: str  # 0000:17:00.0
    vendor: str  # 0x10de
    device_id: str  # 0x2330
    klass: str  # 0x030200


@dataclass(frozen=True)
class PciGpu:
    address: str  # 0000:17:00.0
    device_id: str  # 0x2330
    driver: str  # the bound driver ("nvidia", "vfio-pci") or ""


def read_pci_functions(root: Root) -> tuple[PciFunction, ...]:
    """Every function under /sys/bus/pci/devices with its vendor, device and class, as
    the kernel shows them (lower-case hex), sorted by address.

    Each attribute is read as the kernel serves it (safeio.read_attr: sysfs reports a
    size of 4096 for every attribute, so the bound is the bytes read). Raises OSError
    when the directory itself cannot be listed (no sysfs: the caller says "unknown");
    an entry whose attributes cannot be read is skipped."""
    base = root.path(PCI_DEVICES)
    out = []
    for name in sorted(os.listdir(base)):
        d = base / name
        try:
            vendor = read_attr(d / "vendor")
            klass = read_attr(d / "class")
            device = read_attr(d / "device")
        except UnsafeFileError as e:
            log.debug("skipping %s: %s", d, e.message)
            continue
        if vendor is None or klass is None or device is None:
            log.debug("skipping %s: an attribute is gone", d)
            continue
        out.append(PciFunction(name, vendor.lower(), device.lower(), klass.lower()))
    return tuple(out)


def read_pci_gpus(root: Root) -> tuple[PciGpu, ...]:
    """The NVIDIA display-class functions under /sys/bus/pci/devices, sorted (OSError:
    no sysfs, as read_pci_functions)."""
    out = []
    for f in read_pci_functions(root):
        if f.vendor != NVIDIA_VENDOR or not f.klass.startswith("0x03"):
            continue
        try:
            driver = os.path.basename(os.readlink(root.path(PCI_DEVICES) / f.address / "driver"))
        except OSError:
            driver = ""
        out.append(PciGpu(f.address, f.device_id, driver))
    return tuple(out)
