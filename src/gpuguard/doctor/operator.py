"""What `gpuguard doctor` reads of the GPU Operator's layout (judged in operator_judge.py).

The GPU Operator runs the driver as a container, its files under its driver root
(/run/nvidia/driver), installs the NVIDIA container toolkit under
/usr/local/nvidia/toolkit (its configuration in .config/nvidia-container-runtime there),
configures containerd (a drop-in, or the main file), and since 25.10 gives containers
their devices by CDI (specs in /var/run/cdi). A host-installed driver and toolkit use
/etc instead. Presence and names only: nothing here parses a configuration.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

from gpuguard.host.inventory import Inventory
from gpuguard.host.nvmllib import OPERATOR_DRIVER_ROOT, NvmlLookup
from gpuguard.host.paths import Root

TOOLKIT_DIR = "/usr/local/nvidia/toolkit"
HOST_TOOLKIT_CONFIG = "/etc/nvidia-container-runtime/config.toml"
OPERATOR_TOOLKIT_CONFIG = f"{TOOLKIT_DIR}/.config/nvidia-container-runtime/config.toml"
HOST_CONTAINERD_CONFIG = "/etc/containerd/config.toml"
# The toolkit container's containerd drop-ins (containerd 2 and 1.7 with imports).
OPERATOR_CONTAINERD_DROPINS = (
    "/etc/containerd/conf.d/99-nvidia.toml",
    "/etc/containerd/config.d/99-nvidia.toml",
)
CDI_DIRS = ("/var/run/cdi", "/etc/cdi")
MAX_CDI_NAMES = 64  # a node has a few specs; a directory past this is listed so far


@dataclass(frozen=True)
class OperatorFacts:
    operator: bool  # the node expects its driver from a container
    toolkit_dir: bool  # /usr/local/nvidia/toolkit exists
    driver_root: str  # the driver container's root in use or expected
    driver_root_present: bool
    nvml: str  # where the GPUs were read: "NVML <library> (<layout>)", a file; or ""
    driver_wait: str  # why NVML is awaited ("" when it is not)
    toolkit_config: str  # the toolkit configuration read (host or operator path)
    containerd_config: str  # the containerd configuration read
    cdi_specs: tuple[str, ...]  # NVIDIA CDI spec files, as host paths


def _exists(root: Root, path: str) -> bool:
    return os.path.exists(root.path(path))


def toolkit_config(root: Root) -> str:
    """The toolkit configuration in effect: the host's, else the Operator's."""
    if not _exists(root, HOST_TOOLKIT_CONFIG) and _exists(root, OPERATOR_TOOLKIT_CONFIG):
        return OPERATOR_TOOLKIT_CONFIG
    return HOST_TOOLKIT_CONFIG


def containerd_config(root: Root) -> str:
    """Where the nvidia runtime is configured: the toolkit's drop-in, else the main file."""
    for dropin in OPERATOR_CONTAINERD_DROPINS:
        if _exists(root, dropin):
            return dropin
    return HOST_CONTAINERD_CONFIG


def cdi_specs(root: Root) -> tuple[str, ...]:
    found: list[str] = []
    for d in CDI_DIRS:
        try:
            with os.scandir(root.path(d)) as it:
                for n, entry in enumerate(it):
                    if n >= MAX_CDI_NAMES:
                        break
                    name = entry.name
                    if "nvidia" in name and name.endswith((".yaml", ".yml", ".json")):
                        found.append(f"{d}/{name}")
        except OSError:
            continue
    return tuple(sorted(found))


def read_operator(
    root: Root, inventory: Optional[Inventory], driver_wait: str, driver_root: str = ""
) -> OperatorFacts:
    lookup = NvmlLookup(root, driver_root)
    droot = driver_root.rstrip("/") if driver_root and driver_root != "/" else ""
    droot = droot or OPERATOR_DRIVER_ROOT
    return OperatorFacts(
        operator=lookup.operator_node(),
        toolkit_dir=_exists(root, TOOLKIT_DIR),
        driver_root=droot,
        driver_root_present=os.path.isdir(root.path(droot)),
        nvml=inventory.describe_source() if inventory is not None else "",
        driver_wait=driver_wait,
        toolkit_config=toolkit_config(root),
        containerd_config=containerd_config(root),
        cdi_specs=cdi_specs(root),
    )
