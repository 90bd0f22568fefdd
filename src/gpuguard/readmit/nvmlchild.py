"""The bridge's one NVML read, in a child process with a deadline.

gpuguard-readmit.service is ordered before kubelet and sits between kubelet and every
GPU for kubelet's whole run: NVML in its own process would hold ``/dev/nvidia*`` open
(driver-container upgrades, GPU resets and MIG reconfiguration fail with EBUSY), a
hung GPU would stall its READY=1 and so kubelet's start, and a crash in the library
would end the streams kubelet keeps. So the bridge asks NVML at most once, before
kubelet's start, through ``python3 -m gpuguard.readmit.nvmlchild``: a fresh
interpreter (no lock of a threaded parent inherited) that loads the library, reads
the GPUs (host/inventory.py: nvmlInit, the queries, nvmlShutdown), prints them as JSON
and exits. The parent waits at most TIMEOUT seconds (commands.run kills the child
then); a hang, a crash (a signal) or anything but the expected JSON is one line of
"why", and the bridge decides from the PCI bus and gpuguard's GPU history instead.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Optional, Sequence

from gpuguard.errors import GpuguardError
from gpuguard.host import commands
from gpuguard.host.echo import cut
from gpuguard.host.inventory import Inventory, parse_inventory
from gpuguard.host.paths import Root
from gpuguard.host.statefile import parse_json

TIMEOUT = 15.0  # seconds: NVML's init on a healthy 8-GPU node takes well under 1 s
MAX_OUT = 1024 * 1024
VENDOR_DIR = "/usr/lib/gpuguard/vendor"  # the packages' nvidia-ml-py (cli/__init__.py)


def child_argv(root: Root, driver_root: str) -> list[str]:
    return [sys.executable, "-m", "gpuguard.readmit.nvmlchild", str(root.prefix), driver_root]


def read_in_child(
    root: Root, driver_root: str, argv: Optional[Sequence[str]] = None, timeout: float = TIMEOUT
) -> tuple[Optional[Inventory], str]:
    """(the GPUs NVML reports, "") or (None, why not): never raises, never hangs past
    ``timeout``."""
    cmd = list(argv) if argv is not None else child_argv(root, driver_root)
    try:
        res = commands.run(cmd, timeout=timeout)
    except commands.CommandError as e:
        return None, f"NVML's reader: {cut(str(e), 200)}"
    if res.returncode < 0:
        return None, f"NVML's reader ended by signal {-res.returncode}"
    out = res.stdout[:MAX_OUT]
    try:
        doc = parse_json(out.encode())  # bounded numbers and nesting
    except ValueError:
        tail = (res.stderr or out).strip().splitlines()[-1:] or ["no output"]
        return None, f"NVML's reader failed (exit {res.returncode}): {cut(tail[0], 200)}"
    if not isinstance(doc, dict):
        return None, "NVML's reader answered no object"
    if isinstance(doc.get("error"), str):
        return None, cut(doc["error"], 300)
    try:
        inv = parse_inventory(doc, source="nvml")
    except GpuguardError as e:
        return None, f"NVML's reader answered an unusable inventory: {cut(e.message, 200)}"
    library = doc.get("library")
    if isinstance(library, str):
        inv = Inventory(inv.gpus, "nvml", inv.driver_version, cut(library, 300))
    return inv, ""


def main(argv: Sequence[str]) -> int:
    """The child: ``<root prefix> <driver root>``; prints the inventory or an error."""
    from pathlib import Path

    from gpuguard.host.inventory import load_nvml_inventory
    from gpuguard.host.nvmllib import NvmlLookup

    if VENDOR_DIR not in sys.path and os.path.isdir(VENDOR_DIR):
        sys.path.append(VENDOR_DIR)  # appended: a distribution package wins
    prefix = argv[0] if argv else "/"
    driver_root = argv[1] if len(argv) > 1 else ""
    try:
        inv = load_nvml_inventory(NvmlLookup(Root(Path(prefix)), driver_root))
    except GpuguardError as e:
        print(json.dumps({"error": e.message}))
        return 1
    print(json.dumps(inv.to_json()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
