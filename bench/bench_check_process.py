#!/usr/bin/env python3
"""`gpuguard check` as a whole process on a healthy node, and what its imports cost.

A temporary root holds a 1,000-entry checkpoint (built as in bench_checkpoint.py) whose
GPUs all match the inventory, so the check finds nothing to do: the cost every boot and
every hook run pays. Runs `gpuguard check --root R --inventory I` (and with
`--only checkpoint`) N times and prints p50/p95 wall time, then the slowest imports of
one run (`python -X importtime`). Figures only: nothing is asserted.
Target: p50 < 300 ms for `gpuguard check`, < 100 ms for the kubelet hook
(`check --only checkpoint --kubelet-stopped`) on an unchanged healthy node.

    .venv/bin/python bench/bench_check_process.py [--runs 30] [--top 15]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import List

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO / "src"))

from bench_checkpoint import build, pct  # noqa: E402

CHECKPOINT = "var/lib/kubelet/device-plugins/kubelet_internal_checkpoint"


def make_node(root: Path, entries: int) -> Path:
    raw, _ = build(entries, unique=False)
    # The node before the replacement: every GPU the checkpoint names is still here.
    from gpuguard.checkpoint import parse

    cp = parse(raw, source="bench")
    uuids = [u for _, ids in cp.registered or () for u in ids or ()]
    gpus = [
        {"uuid": u, "index": i, "minor": i, "pci_bus_id": f"00000000:{16 + i:02X}:00.0"}
        for i, u in enumerate(uuids)
    ]
    ckpt = root / CHECKPOINT
    ckpt.parent.mkdir(parents=True)
    ckpt.write_bytes(raw)
    inventory = root / "inventory.json"
    inventory.write_text(json.dumps({"gpus": gpus}))
    return inventory


def gpuguard_argv() -> List[str]:
    script = REPO / ".venv/bin/gpuguard"
    if script.exists():
        return [str(script)]
    return [sys.executable, "-m", "gpuguard"]


def run_many(argv: List[str], runs: int) -> List[float]:
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        p = subprocess.run(argv, env=env, capture_output=True)
        times.append((time.perf_counter() - t0) * 1000)
        if p.returncode != 0:
            raise SystemExit(f"{argv} exited {p.returncode}: {p.stderr.decode()[-2000:]}")
    return times


def import_costs(argv: List[str], top: int) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    script = REPO / ".venv/bin/gpuguard"
    py = [str(REPO / ".venv/bin/python")] if script.exists() else [sys.executable]
    p = subprocess.run(
        [*py, "-X", "importtime", "-m", "gpuguard", *argv[len(gpuguard_argv()) :]],
        env=env,
        capture_output=True,
        text=True,
    )
    rows = []
    for line in p.stderr.splitlines():
        if not line.startswith("import time:") or "self [us]" in line:
            continue
        own, cum, name = line[len("import time:") :].split("|", 2)
        rows.append((int(cum), int(own), name.strip()))
    total = sum(s for _, s, _ in rows)
    print(f"\nimports: {len(rows)} modules, {total / 1000:.1f} ms self time in all")
    print(f"  top {top} by cumulative time:  cumulative ms  self ms  module")
    for cum, own, name in sorted(rows, reverse=True)[:top]:
        print(f"  {'':30} {cum / 1000:13.1f} {own / 1000:8.1f}  {name}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--entries", type=int, default=1000)
    ap.add_argument("--top", type=int, default=15)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="gpuguard-bench-") as d:
        root = Path(d)
        inventory = make_node(root, args.entries)
        base = [*gpuguard_argv(), "check", "--root", str(root), "--inventory", str(inventory)]
        print(
            f"python {sys.version.split()[0]}; healthy node, {args.entries}-entry checkpoint "
            f"({(root / CHECKPOINT).stat().st_size / 1024:.0f} KiB); target p50 < 300 ms"
        )
        hook = [*base, "--only", "checkpoint", "--kubelet-stopped", "--reason", "bench"]
        for label, argv in (
            ("gpuguard check", base),
            ("gpuguard check --only checkpoint", [*base, "--only", "checkpoint"]),
            # kubelet's pre-start hook: the warm-up runs leave the memo of a verified
            # healthy state, so these runs take the unchanged-file path.
            ("hook (unchanged since verified)", hook),
        ):
            run_many(argv, 2)  # warm the page cache and .pyc files
            t = run_many(argv, args.runs)
            print(f"{label:34} p50 {pct(t, 50):6.1f} ms   p95 {pct(t, 95):6.1f} ms")
        t = run_many([*gpuguard_argv(), "--version"], args.runs)
        print(
            f"{'gpuguard --version (floor)':34} p50 {pct(t, 50):6.1f} ms   p95 {pct(t, 95):6.1f} ms"
        )
        import_costs(hook, args.top)


if __name__ == "__main__":
    main()
