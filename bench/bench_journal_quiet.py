#!/usr/bin/env python3
"""Journal lines per healthy node-day at the default settings, on a compressed timescale.

Boots a systemd namespace (tests/integration/harness) running the daemon from the
repo's unit file on a healthy node (a checkpoint that matches the inventory, the
NVIDIA driver's registration simulated, the device nodes made by the first pass), with
one change to the defaults: AuditInterval=1s instead of 5min, so that a day's 288 audit
passes take five minutes instead of a day. Waits for the first pass (start-up), then
counts the entries of gpuguard.service's journal (the daemon's own and systemd's about
the unit) at each priority over `--passes` audit passes, and prints:

  lines per pass at info or above, and the node-day figure
  = start-up lines (once per boot) + per-pass lines x 288 (a day at AuditInterval=5min).

Nothing is asserted here (tests/integration/test_fleet_ops.py asserts that a healthy
pass journals nothing at info or above). Needs root. Usage:

  sudo .venv/bin/python bench/bench_journal_quiet.py [--passes 120]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "src"))

from integration.gpu_scopes import fake_proc_devices  # noqa: E402
from integration.gpuguard_ns import gpuguard_units, passes, setup_node, wait_for  # noqa: E402
from integration.harness import SystemdNamespace  # noqa: E402

PASSES_PER_DAY = 24 * 3600 // 300  # the default AuditInterval=5min
NAMES = {0: "emerg", 1: "alert", 2: "crit", 3: "err", 4: "warning", 5: "notice", 6: "info"}
NAMES[7] = "debug"


def entries(ns: SystemdNamespace) -> List[Dict[str, Any]]:
    return [e for e in ns.journal("gpuguard.service") if "MESSAGE" in e]


def healthy_inventory(ns: SystemdNamespace) -> None:
    """The inventory cut to the GPUs kubelet has registered: every layer agrees."""
    from gpuguard.checkpoint import parse
    from integration.gpuguard_ns import CHECKPOINT, INVENTORY

    cp = parse(ns.path(CHECKPOINT).read_bytes(), source="bench")
    registered = {i for _resource, ids in cp.registered for i in ids or ()}
    gpus = [g for g in INVENTORY["gpus"] if g["uuid"] in registered]
    ns.path("/etc/gpuguard/inventory.json").write_text(json.dumps({"gpus": gpus}))


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--passes", type=int, default=120, help="audit passes to count over")
    args = ap.parse_args(argv)
    units = {
        **gpuguard_units(),
        "gpuguard.service.d/60-fake-driver.conf": (
            "[Service]\nBindReadOnlyPaths=/run/fake/devices:/proc/devices\n"
        ),
    }
    with tempfile.TemporaryDirectory(prefix="gpuguard-bench-journal-") as tmp:
        devices = fake_proc_devices(Path(tmp) / "devices")
        ns = SystemdNamespace(
            Path(tmp) / "ns", units=units, ro_binds={"/run/fake/devices": devices}
        )
        ns.start()
        try:
            setup_node(ns, stale=False, config="[Daemon]\nAuditInterval=1s\n")
            healthy_inventory(ns)
            ns.systemctl("start", "gpuguard.service")
            ns.wait_active("gpuguard.service", timeout=30)
            wait_for(lambda: passes(ns) >= 3, timeout=60, what="three passes")
            start_up = entries(ns)
            first = passes(ns)
            t0 = time.monotonic()
            wait_for(
                lambda: passes(ns) >= first + args.passes,
                timeout=args.passes * 5 + 60,
                what=f"{args.passes} audit passes",
            )
            counted = passes(ns) - first
            seconds = time.monotonic() - t0
            later = entries(ns)[len(start_up) :]
        finally:
            ns.stop()
    loud = [e for e in later if int(e.get("PRIORITY", 6)) <= 6]
    by = Counter(NAMES.get(int(e.get("PRIORITY", 6)), "?") for e in later)
    start_loud = [e for e in start_up if int(e.get("PRIORITY", 6)) <= 6]
    per_pass = len(loud) / counted
    print(f"passes counted: {counted} in {seconds:.0f} s (AuditInterval=1s)")
    print(f"start-up (first 3 passes): {len(start_loud)} lines at info or above")
    for e in start_loud:
        print(f"  [{NAMES.get(int(e.get('PRIORITY', 6)))}] {str(e['MESSAGE'])[:110]}")
    print(f"after start-up: {dict(by)} ({len(loud)} at info or above)")
    for e in loud[:10]:
        print(f"  [{NAMES.get(int(e.get('PRIORITY', 6)))}] {str(e['MESSAGE'])[:110]}")
    day = len(start_loud) + per_pass * PASSES_PER_DAY
    print(
        f"lines per healthy pass at info or above: {per_pass:.3f}; per node-day at the "
        f"default AuditInterval=5min ({PASSES_PER_DAY} passes): {day:.0f} "
        f"({len(start_loud)} at start-up + {per_pass * PASSES_PER_DAY:.0f})"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
