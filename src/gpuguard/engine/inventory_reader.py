"""The daemon's GPU inventory, read afresh for each pass, and whether it is available.

NVML, or the inventory file: ``--inventory`` on the command line wins over
``[Inventory] File=``, which is read again with the rest of the configuration on SIGHUP.
NVML's library is looked for where the driver is (host/nvmllib.py), the same lookup
every command uses. Each read runs in a worker thread with a timeout (NVML may hang
with its driver). An unavailable inventory is a lasting state: journaled when it
appears or its reason changes and once when it clears, not on every pass of a node
whose driver is missing for hours.

NVML becoming available, or its GPU set changing, is an event (INVENTORY_CHANGED):
the driver arriving after kubelet (a GPU Operator node's driver container) wakes the
checkpoint step at once, whatever made the pass that saw it.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Callable, Optional

from gpuguard.config import Config
from gpuguard.errors import GpuguardError
from gpuguard.host.inventory import DriverPendingError, Inventory, load_inventory
from gpuguard.host.nvmllib import NvmlLookup
from gpuguard.host.paths import Root
from gpuguard.journal.conditions import Conditions
from gpuguard.journal.log import EventLog
from gpuguard.steps.events import Event, EventKind

GpuSet = frozenset[tuple[str, str]]  # (UUID, PCI bus id) of each GPU


class InventoryReader:
    def __init__(
        self,
        log: EventLog,
        config: Config,
        cli_path: Optional[Path] = None,
        *,
        root: Optional[Root] = None,
        on_change: Optional[Callable[[Event], None]] = None,
    ) -> None:
        self.log = log
        self.cli_path = cli_path
        self.root = root or Root()
        self.on_change = on_change
        self.conditions = Conditions()
        self.reconfigure(config)
        self.pending = ""  # why NVML is not there yet on a node that waits for its driver
        self.library = ""  # the NVML library the last good read used
        self._gpus: Optional[GpuSet] = None  # the last read's; None: unavailable
        self._read = False

    def reconfigure(self, config: Config) -> None:
        self.path = self.cli_path or _config_path(config)
        self.lookup = NvmlLookup(self.root, config.inventory.driver_root or "")

    async def read(self) -> Optional[Inventory]:
        """The inventory now, or None (journaled as a state) when it cannot be had."""
        pending = ""
        try:
            inventory = await asyncio.wait_for(
                asyncio.to_thread(load_inventory, self.path, self.lookup), timeout=30
            )
        except DriverPendingError as e:
            pending = e.message
            self._state(f"GPU inventory unavailable: {e.message}")
        except GpuguardError as e:
            self._state(f"GPU inventory unavailable: {e.message}")
        except asyncio.TimeoutError:
            self._state("GPU inventory unavailable: NVML did not answer in 30s")
        else:
            self.pending = ""
            self._state(None, inventory.library)
            self._changed(inventory)
            return inventory
        self.pending = pending
        self._changed(None)
        return None

    def _changed(self, inventory: Optional[Inventory]) -> None:
        gpus = (
            None if inventory is None else frozenset((g.uuid, g.pci_bus_id) for g in inventory.gpus)
        )
        before, first = self._gpus, not self._read
        self._gpus, self._read = gpus, True
        if first or gpus is None or gpus == before or self.on_change is None:
            return
        why = "GPU inventory available" if before is None else "GPU set changed"
        self.on_change(Event(EventKind.INVENTORY_CHANGED, f"{why} ({len(gpus)} GPU(s))"))

    def _state(self, problem: Optional[str], library: str = "") -> None:
        if library and library != self.library:
            self.library = library
            self.log.event(
                "nvml-library",
                f"NVML: {library}",
                level="info",
                fields={"GPUGUARD_NVML_LIBRARY": library},
            )
        t = self.conditions.set("inventory", ("inventory",), problem)
        if t is None:
            return
        if problem is not None:
            self.log.event(
                "inventory-unavailable",
                f"{problem}; passes go on without GPU identities, and this is not "
                "repeated until it changes",
                level="warning",
                fields={"GPUGUARD_PROBLEM": problem},
            )
        elif t.previous is not None:
            self.log.event(
                "inventory-available",
                "GPU inventory available again",
                level="notice",
                fields={"GPUGUARD_PROBLEM": t.previous},
            )


def _config_path(config: Config) -> Optional[Path]:
    return Path(config.inventory.file) if config.inventory.file else None
