#!/usr/bin/env python3
"""What the device watch costs the daemon's loop: one tick over N GPU containers.

Every `[Devices] WatchInterval=` (200 ms) the container access step reads each known
GPU container's v1 `devices.list` and compares it with its last look
(steps/container_access/devwatch.py), inline on the loop. This builds N containers whose
lists are regular files in a temporary root (a cgroupfs file costs about the same to
read: one open, one short read), ticks the watch `--ticks` times with nothing changed
(the steady state) and prints the loop time per tick (p50/p95), per container, and the
share of one CPU at the default interval. Figures only: nothing is asserted.

    .venv/bin/python bench/bench_device_watch.py [--containers 8,50,200] [--ticks 500]
"""

from __future__ import annotations

import argparse
import io
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, List

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "src"))

from gpuguard.config import load_config  # noqa: E402
from gpuguard.devices.containers import ContainerCgroup  # noqa: E402
from gpuguard.devices.entitlement import Entitlement, VisibleDevices  # noqa: E402
from gpuguard.devices.nodes import ROLE_GPU, DeviceNode  # noqa: E402
from gpuguard.engine.executor import ChangeExecutor  # noqa: E402
from gpuguard.host.paths import Root  # noqa: E402
from gpuguard.journal.log import EventLog  # noqa: E402
from gpuguard.steps.container_access.cgroupv1 import CgroupV1  # noqa: E402
from gpuguard.steps.container_access.devwatch import DeviceWatch  # noqa: E402

RUNC_LIST = "".join(
    f"c {n} rwm\n"
    for n in ("1:3", "1:5", "1:7", "1:8", "1:9", "5:0", "5:1", "5:2", "136:*", "10:200", "195:0")
)


class Svc:
    def __init__(self, root: Root) -> None:
        self.root = root
        self.config = load_config(root)
        self.log = EventLog(level="error", stream=io.StringIO())
        self.systemd = None
        self.apply = ChangeExecutor()


def one(n: int, ticks: int, interval: float) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        root = Root(Path(tmp))
        pairs = []
        for i in range(n):
            d = Path(tmp) / f"sys/fs/cgroup/devices/kubepods/pod{i}/ctr{i}"
            d.mkdir(parents=True)
            (d / "devices.list").write_text(RUNC_LIST)
            cid = f"{i:064x}"
            c = ContainerCgroup(f"p{i}", cid, "containerd", "cgroupfs", d, None, None, (i,))
            gpu = DeviceNode("/dev/nvidia0", 195, 0, ROLE_GPU)
            pairs.append(
                (c, Entitlement(f"p{i}", cid, (gpu,), (gpu,), (), (), VisibleDevices("list", ())))
            )
        v1 = CgroupV1(lambda *a: None, {})  # type: ignore[arg-type, return-value]
        known: Any = [(v1, pairs)]

        async def settle(*_a: Any) -> None: ...

        watch = DeviceWatch(lambda: known, lambda: settle, lambda *a: [], lambda *a: None)
        svc: Any = Svc(root)
        times: List[float] = []
        for _ in range(ticks):
            t0 = time.perf_counter()
            watch.on_tick(svc, lambda why: None)
            times.append(time.perf_counter() - t0)
        p50 = statistics.median(times) * 1e6
        p95 = sorted(times)[int(len(times) * 0.95)] * 1e6
        share = p50 / 1e6 / interval * 100
        return f"| {n} | {p50:.0f} us | {p95:.0f} us | {p50 / n:.1f} us | {share:.2f} % |"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--containers", default="8,50,200")
    ap.add_argument("--ticks", type=int, default=500)
    ap.add_argument("--interval", type=float, default=0.2, help="WatchInterval= (0.2 s)")
    args = ap.parse_args()
    print(f"device watch, {args.ticks} ticks with nothing changed, WatchInterval={args.interval}s")
    print("| GPU containers | tick p50 | tick p95 | per container | one CPU at the interval |")
    print("|---|---|---|---|---|")
    for n in (int(x) for x in args.containers.split(",")):
        print(one(n, args.ticks, args.interval))
    return 0


if __name__ == "__main__":
    sys.exit(main())
