"""What the bridge knows of the node's devices for its decisions (readmit/presence.py).

- ``[Inventory] File=`` (simulations, tests): that file, read again at each refresh;
- else NVML at most once, at the bridge's first read and only while kubelet has not
  started (no kubelet.sock), in a child process (readmit/nvmlchild.py): the driver's
  view for the first kubelet start of the boot when the driver is on the host;
- every later read, and that first one when NVML is not there (the GPU Operator's
  driver container starts after kubelet) or fails: the PCI bus and gpuguard's GPU
  history (the newest generation; one recorded in this boot knows its MIG devices).

NVML is never asked again in the bridge's life, whatever the decisions: the daemon
reads it and records each change of the GPUs in the history, which is what the PCI
view reads.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional

from gpuguard.checkpoint import history
from gpuguard.checkpoint.history import Generation
from gpuguard.devices.pci import read_pci_functions
from gpuguard.errors import GpuguardError
from gpuguard.host.echo import cut
from gpuguard.host.inventory import Inventory, load_inventory_file
from gpuguard.host.paths import GPU_HISTORY_FILE, Root
from gpuguard.host.safeio import proc_text
from gpuguard.readmit.nvmlchild import read_in_child
from gpuguard.readmit.presence import NodeDevices, from_inventory, from_pci_history

DriverRead = Callable[[Root, str], tuple[Optional[Inventory], str]]


def boot_id(root: Root) -> str:
    try:
        return proc_text(root.path("/proc/sys/kernel/random/boot_id"), max_bytes=64).strip()
    except (OSError, GpuguardError):
        return ""


def generations(root: Root, boot: str) -> tuple[Optional[Generation], Optional[Generation], str]:
    """(the newest generation, the newest of an earlier boot than ``boot``, why none)."""
    hist, problem = history.read(root.path(GPU_HISTORY_FILE))
    if hist is None:
        return None, None, problem
    earlier = next((g for g in reversed(hist.generations) if boot and g.boot_id != boot), None)
    return hist.newest, earlier, problem


class NodeReader:
    """One per bridge: remembers that its one NVML read was made."""

    def __init__(self, root: Root, read_driver: DriverRead = read_in_child) -> None:
        self.root = root
        self.read_driver = read_driver
        self.asked = False  # NVML asked (or its moment passed): never again
        self.nvml_reads = 0

    def read(
        self, inventory_file: str, driver_root: str, kubelet_started: bool
    ) -> tuple[NodeDevices, str]:
        """(the node's devices, the problem with the driver's view or "")."""
        boot = boot_id(self.root)
        gen, earlier, hist_problem = generations(self.root, boot)
        if inventory_file:
            try:
                inv = load_inventory_file(Path(inventory_file))
            except GpuguardError as e:
                return NodeDevices("", problem=e.message), e.message
            return from_inventory(inv, gen, f"inventory {cut(inventory_file, 120)}", earlier), ""
        why = "NVML read once at the bridge's start"
        if not self.asked:
            self.asked = True
            if kubelet_started:
                why = "kubelet had started before the bridge: NVML is not asked"
            else:
                self.nvml_reads += 1
                seen, why = self.read_driver(self.root, driver_root)
                if seen is not None:
                    return from_inventory(seen, gen, seen.describe_source(), earlier), ""
        try:
            functions = read_pci_functions(self.root)
        except OSError as e:
            problem = f"/sys/bus/pci/devices: {e.strerror}; {why}"
            return NodeDevices("", problem=problem), problem
        if gen is None and hist_problem:
            why = f"{why}; {hist_problem}"
        node = from_pci_history(functions, gen, why, boot, earlier)
        return node, cut(node.problem, 300)
