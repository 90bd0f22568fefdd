#!/usr/bin/env python3
"""`gpuguard check` as a whole process on a healthy node, and what its imports cost.

A temporary root holds a 1,000-entry checkpoint (built as in bench_checkpoint.py) whose
GPUs all match the inventory, so the check finds nothing to do: the cost every boot and
every hook run pays. Runs `gpuguard check --root R --inventory I` (and with
`--only checkpoint`), kubelet's pre-start hook (`check --only checkpoint
--kubelet-stopped`) on an unchanged node (the memo of the last verified state matches)
and on a healthy one it has not verified yet (the memo removed before each run: the
full check), each N times in turn with `gpuguard --version`, the CLI's start: min and
median wall and CPU time (user + system, the child's own), and each row's ratio to
`--version`, taken run by run. Then the slowest imports of the hook's unchanged run
(`python -X importtime`). Figures only: nothing is asserted. `--src DIR` runs the
package of another checkout (DIR is its src/), for before/after figures.
Targets: `gpuguard check` median < 300 ms; the hook on an unchanged healthy node
< 100 ms and under 2x `gpuguard --version`.

    .venv/bin/python bench/bench_check_process.py [--runs 30] [--top 15] [--src DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO / "src"))

from bench_checkpoint import build  # noqa: E402

CHECKPOINT = "var/lib/kubelet/device-plugins/kubelet_internal_checkpoint"
MEMO = "var/lib/gpuguard/kubelet-hook.memo.json"


def make_node(root: Path, entries: int) -> Path:
    raw = build(entries, unique=False)[0]
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


def gpuguard_argv(src: Optional[Path]) -> List[str]:
    script = REPO / ".venv/bin/gpuguard"
    if script.exists() and src is None:
        return [str(script)]
    return [python(), "-m", "gpuguard"]


def python() -> str:
    venv = REPO / ".venv/bin/python"
    return str(venv) if venv.exists() else sys.executable


def environ(src: Optional[Path]) -> dict[str, str]:
    # byte-compiled sources, as a package installs them: a run that compiles changed
    # modules (PYTHONDONTWRITEBYTECODE, a stale __pycache__) measures the compiler
    env = {**os.environ, "PYTHONPATH": str(src or REPO / "src")}
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    return env


def once(argv: Sequence[str], env: dict[str, str], before: Optional[Path]) -> Tuple[float, float]:
    """(wall ms, CPU ms) of one run; `before`: a file removed first (not timed)."""
    if before is not None and before.exists():
        before.unlink()
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    p = subprocess.run(argv, env=env, capture_output=True)
    wall = (time.perf_counter() - t0) * 1000
    now = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (now.ru_utime - used.ru_utime + now.ru_stime - used.ru_stime) * 1000
    if p.returncode != 0:
        raise SystemExit(f"{argv} exited {p.returncode}: {p.stderr.decode()[-2000:]}")
    return wall, cpu


def paired(
    argv: Sequence[str],
    floor: Sequence[str],
    runs: int,
    env: dict[str, str],
    before: Optional[Path],
) -> Tuple[List[Tuple[float, float]], List[Tuple[float, float]]]:
    """`argv` and the floor in turn, A B A B ...: a ratio taken run by run stays
    meaningful while the machine's speed drifts."""
    for _ in range(2):  # warm the page cache (and leave the memo of a verified state)
        once(argv, env, before)
        once(floor, env, None)
    a, b = [], []
    for _ in range(runs):
        a.append(once(argv, env, before))
        b.append(once(floor, env, None))
    return a, b


def row(label: str, a: List[Tuple[float, float]], b: List[Tuple[float, float]]) -> str:
    def mm(xs: List[float]) -> str:
        return f"{min(xs):6.1f} {statistics.median(xs):6.1f}"

    wall, cpu = [w for w, _ in a], [c for _, c in a]
    ratio = [x[1] / y[1] for x, y in zip(a, b) if y[1] > 0]
    wr = [x[0] / y[0] for x, y in zip(a, b)]
    return (
        f"{label:36} {mm(wall)}   {mm(cpu)}   "
        f"{statistics.median(wr):5.2f} {statistics.median(ratio) if ratio else 0.0:5.2f}"
    )


def import_costs(argv: List[str], top: int, src: Optional[Path]) -> None:
    p = subprocess.run(
        [python(), "-X", "importtime", "-m", "gpuguard", *argv[len(gpuguard_argv(src)) :]],
        env=environ(src),
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
    ap.add_argument("--src", type=Path, help="another checkout's src/ (before/after)")
    args = ap.parse_args()
    src = args.src.resolve() if args.src else None
    env = environ(src)
    subprocess.run(  # the .pyc files a package install would have
        [python(), "-m", "compileall", "-q", str(src or REPO / "src")], env=env, check=True
    )
    with tempfile.TemporaryDirectory(prefix="gpuguard-bench-") as d:
        root = Path(d)
        inventory = make_node(root, args.entries)
        gg = gpuguard_argv(src)
        base = [*gg, "check", "--root", str(root), "--inventory", str(inventory)]
        print(
            f"python {sys.version.split()[0]}; healthy node, {args.entries}-entry checkpoint "
            f"({(root / CHECKPOINT).stat().st_size / 1024:.0f} KiB); {args.runs} runs each, "
            f"in turn with `gpuguard --version`; package from {src or REPO / 'src'}"
        )
        print(f"{'':36} {'wall ms':>13}   {'CPU ms':>13}   x --version")
        print(
            f"{'':36} {'min':>6} {'median':>6}   {'min':>6} {'median':>6}   {'wall':>5} {'CPU':>5}"
        )
        hook = [*base, "--only", "checkpoint", "--kubelet-stopped", "--reason", "bench"]
        floor = [*gg, "--version"]
        for label, argv, before in (
            ("gpuguard check", base, None),
            ("gpuguard check --only checkpoint", [*base, "--only", "checkpoint"], None),
            # the warm-up runs leave the memo of a verified healthy state
            ("hook, unchanged since verified", hook, None),
            ("hook, healthy, not verified yet", hook, root / MEMO),
        ):
            a, b = paired(argv, floor, args.runs, env, before)
            print(row(label, a, b))
        print(row("gpuguard --version", b, b))
        once(hook, env, None)  # the memo again, for the import figures
        import_costs(hook, args.top, src)


if __name__ == "__main__":
    main()
