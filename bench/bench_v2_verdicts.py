#!/usr/bin/env python3
"""What judging one cgroup v2 container's access costs, each way gpuguard has had.

N real cgroups under /sys/fs/cgroup/unified (removed afterwards), each with the program
systemd 252 attaches to a scope (DevicePolicy=strict, its GPU and /dev/null), and 4 fake
nodes per container (GPU, nvidiactl, uvm, uvm-tools; mknod in a temporary directory):

  probe per node:       a forked child per (container, node) joins the cgroup and opens
                        the node (the only way before; 4 forks per container);
  probe per container:  one child opens all 4 (now: the fallback when a program cannot
                        be read or parsed);
  programs, first pass: BPF_PROG_QUERY (effective) + read and parse each new program
                        (after a daemon-reload every program is new);
  programs, next pass:  the query only, programs already parsed.

Prints ms per container (p50 over --runs) and checks nothing. Needs root:

  sudo .venv/bin/python bench/bench_v2_verdicts.py [--containers 200] [--runs 5]
"""

from __future__ import annotations

import argparse
import os
import shutil
import stat
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Callable, List, Sequence

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "src"))

from gpuguard.actuate.bpf import BPF_F_ALLOW_MULTI, attach_prog, load_program  # noqa: E402
from gpuguard.devices.bpfread import ProgramCache, judge  # noqa: E402
from gpuguard.devices.probe import BPF_PROG_ATTACH, probe_open, probe_open_all  # noqa: E402
from unit.test_bpfprog import SYSTEMD_252, _code  # noqa: E402

V2 = Path("/sys/fs/cgroup/unified")
NODES = [(195, 0), (195, 255), (510, 0), (510, 1)]


def timed(runs: int, n: int, fn: Callable[[], object]) -> str:
    per = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        per.append((time.perf_counter() - t0) * 1000 / n)
    return f"p50 {statistics.median(per):7.3f} ms  max {max(per):7.3f} ms per container"


def main(argv: Sequence[str] = ()) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--containers", type=int, default=200)
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args(list(argv) or None)
    base = V2 / f"gg-bench-v2-{uuid.uuid4().hex[:8]}"
    work = Path(tempfile.mkdtemp(prefix="gg-bench-v2-"))
    cgs: List[Path] = []
    base.mkdir()
    try:
        nodes = []
        for ma, mi in NODES:
            p = work / f"n{ma}_{mi}"
            os.mknod(p, stat.S_IFCHR | 0o666, os.makedev(ma, mi))
            nodes.append(p)
        for i in range(args.containers):
            cg = base / f"ctr{i}"
            cg.mkdir()
            cgs.append(cg)
            fd, cgfd = load_program(_code(SYSTEMD_252)), os.open(cg, os.O_RDONLY)
            try:
                attach_prog(BPF_PROG_ATTACH, cgfd, fd, BPF_F_ALLOW_MULTI)
            finally:
                os.close(fd)
                os.close(cgfd)
        n, runs = len(cgs), args.runs
        print(f"cgroup v2 verdicts: {n} containers x {len(NODES)} nodes, {runs} runs")
        print("  probe per node:      ", timed(runs, n, lambda: [
            probe_open(p, [cg]) for cg in cgs for p in nodes]))  # fmt: skip
        print("  probe per container: ", timed(runs, n, lambda: [
            probe_open_all(nodes, [cg]) for cg in cgs]))  # fmt: skip
        print("  programs, first pass:", timed(runs, n, lambda: [
            judge(ProgramCache(), cg, NODES) for cg in cgs]))  # fmt: skip
        warm = ProgramCache()
        print("  programs, next pass: ", timed(runs, n, lambda: [
            judge(warm, cg, NODES) for cg in cgs]))  # fmt: skip
    finally:
        for cg in cgs:
            for _ in range(100):  # a probe child may still be leaving
                try:
                    cg.rmdir()
                    break
                except OSError:
                    time.sleep(0.02)
        base.rmdir()
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
