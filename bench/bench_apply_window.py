#!/usr/bin/env python3
"""How long a durably granted container looks denied while systemd re-applies its scope.

systemd applies a scope's device policy as "deny all, then each DeviceAllow= entry"; a
read of the container's devices.list inside that window sees its GPU denied although the
scope grants it (steps/container_access/settle.py waits for the apply to end before it
calls that a loss). On a real systemd (a namespace of the test harness) with real
containerd + runc (systemd cgroup driver, v1 layout): one container whose scope carries
gpuguard's durable DeviceAllow=, gpuguard stopped, then for each trigger (`runc update`,
`systemctl daemon-reload`, `daemon-reexec`) a thread reads devices.list in a tight loop
and records every stretch without the GPU. Prints figures, asserts nothing.

  sudo .venv/bin/python bench/bench_apply_window.py [-n 5]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable, List

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "src"))

from integration.gpu_scopes import fake_proc_devices, gpu_inventory  # noqa: E402
from integration.gpuguard_ns import gpuguard_units, settle  # noqa: E402
from integration.harness import SystemdNamespace  # noqa: E402
from integration.harness.runc_env import Containerd, make_containers, prepare  # noqa: E402


def windows(path: Path, gpu: str, trigger: Callable[[], None], after: float) -> List[float]:
    """Milliseconds of each stretch in which `path` lacked `gpu` around `trigger`."""
    stop = threading.Event()
    found: List[float] = []

    def watch() -> None:
        since = None
        while not stop.is_set():
            t = time.monotonic()
            text = path.read_text()
            granted = gpu in text or text.startswith("a *:*")
            if not granted and since is None:
                since = t
            elif granted and since is not None:
                found.append((t - since) * 1000)
                since = None

    th = threading.Thread(target=watch)
    th.start()
    trigger()
    time.sleep(after)
    stop.set()
    th.join()
    return found


def main(argv: List[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-n", type=int, default=5, help="rounds per trigger (default 5)")
    args = ap.parse_args(argv)
    if os.geteuid() != 0:
        print("bench_apply_window: needs root (it boots a systemd namespace)", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="gpuguard-bench-") as name:
        tmp = Path(name)
        units = gpuguard_units()
        units["gpuguard.service.d/60-fake-driver.conf"] = (
            "[Service]\nBindReadOnlyPaths=/run/fake/devices:/proc/devices\n"
        )
        ctr_units, ctr_binds = prepare(tmp / "ctr")
        units.update(ctr_units)
        devices = fake_proc_devices(tmp / "devices")
        ns = SystemdNamespace(
            tmp / "ns",
            units=units,
            binds=ctr_binds,
            ro_binds={"/run/fake/devices": devices, "/proc/devices": devices},
        )
        with ns:
            etc = ns.path("/etc/gpuguard")
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "inventory.json").write_text(json.dumps(gpu_inventory(2)))
            (etc / "gpuguard.conf").write_text("[Inventory]\nFile=/etc/gpuguard/inventory.json\n")
            cd = Containerd(ns)
            cd.start()
            (c,) = make_containers(1, systemd=True)
            cd.run(c)
            (c.cgroup(ns) / "cgroup.procs").write_text(str(cd.pid(c)))  # see the runc tests
            ns.systemctl("start", "gpuguard.service")
            settle(ns)  # the scope has its durable DeviceAllow= now
            ns.systemctl("stop", "gpuguard.service")
            path, gpu = c.cgroup(ns) / "devices.list", f"c 195:{c.gpus[0]} "
            triggers = {
                "runc update": (
                    lambda: cd.runc(c, "update", "--cpu-share", "256", c.container_id),
                    0.05,
                ),
                "daemon-reload": (lambda: ns.systemctl("daemon-reload"), 0.05),
                "daemon-reexec": (lambda: ns.systemctl("daemon-reexec"), 0.5),
            }
            for label, (trigger, after) in triggers.items():
                seen = [w for _ in range(args.n) for w in windows(path, gpu, trigger, after)]
                figures = ", ".join(f"{w:.2f}" for w in seen) or "none seen"
                print(f"{label}: {len(seen)} window(s) in {args.n} round(s), ms: {figures}")
            cd.remove_all()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
