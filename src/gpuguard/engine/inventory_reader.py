"""The daemon's GPU inventory, read afresh for each pass, and whether it is available.

NVML, or the inventory file: ``--inventory`` on the command line wins over
``[Inventory] File=``, which is read again with the rest of the configuration on SIGHUP.
Each read runs in a worker thread with a timeout (NVML may hang with its driver). An
unavailable inventory is a lasting state: journaled when it appears or its reason
changes and once when it clears, not on every pass of a node whose driver is missing
for hours.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Optional

from gpuguard.config import Config
from gpuguard.errors import GpuguardError
from gpuguard.host.inventory import Inventory, load_inventory
from gpuguard.journal.conditions import Conditions
from gpuguard.journal.log import EventLog


class InventoryReader:
    def __init__(self, log: EventLog, config: Config, cli_path: Optional[Path] = None) -> None:
        self.log = log
        self.cli_path = cli_path
        self.path = cli_path or _config_path(config)
        self.conditions = Conditions()

    def reconfigure(self, config: Config) -> None:
        self.path = self.cli_path or _config_path(config)

    async def read(self) -> Optional[Inventory]:
        """The inventory now, or None (journaled as a state) when it cannot be had."""
        try:
            inventory = await asyncio.wait_for(
                asyncio.to_thread(load_inventory, self.path), timeout=30
            )
        except GpuguardError as e:
            self._state(f"GPU inventory unavailable: {e.message}")
        except asyncio.TimeoutError:
            self._state("GPU inventory unavailable: NVML did not answer in 30s")
        else:
            self._state(None)
            return inventory
        return None

    def _state(self, problem: Optional[str]) -> None:
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
