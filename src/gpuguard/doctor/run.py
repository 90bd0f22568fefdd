"""Build the doctor's inputs (inventory, checkpoint registrations) and judge the node."""

from __future__ import annotations

from typing import Optional, Sequence

from gpuguard.doctor.facts import Runner, gather
from gpuguard.doctor.judge import judge
from gpuguard.doctor.model import Report
from gpuguard.errors import GpuguardError
from gpuguard.host.inventory import Inventory
from gpuguard.host.paths import Root

Registered = Sequence[tuple[str, Optional[Sequence[str]]]]


def read_registered(root: Root, checkpoint_path: str) -> Optional[Registered]:
    """RegisteredDevices of kubelet's checkpoint; None when it cannot be read (the GPU
    count then leaves the kubelet layer out and says so)."""
    from gpuguard.checkpoint import load

    try:
        loaded = load(root.path(checkpoint_path))
    except GpuguardError:
        return None
    return loaded.checkpoint.registered or ()


def run_doctor(
    root: Root,
    inventory: Optional[Inventory],
    checkpoint_path: str,
    run: Runner,
    kubelet_units: Sequence[str] = ("kubelet.service",),
    observe: bool = False,
    driver_wait: str = "",
    driver_root: str = "",
) -> Report:
    registered = read_registered(root, checkpoint_path)
    facts = gather(
        root, inventory, registered, run, kubelet_units=kubelet_units, observe=observe,
        driver_wait=driver_wait, driver_root=driver_root,
    )  # fmt: skip
    return judge(facts)
