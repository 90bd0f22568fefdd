"""Time from /dev/nvidia-uvm appearing to the device plugin restarted and verified (F3).

Per round, on a private containerd (tests/integration/harness/containerd.py): start a
plugin container without uvm, create the uvm nodes (the synthetic nvidia_uvm module
event), run the device_plugin step once with a kubelet stand-in that recreates the
plugin container when its task is gone, and measure:

- detect: the step's observation + assessment (first finding) — measured separately
  by calling observe/assess once before the restarting pass;
- total: uvm created -> plugin-recovered (new plugin serving, its /dev has uvm).

Needs root, containerd, runc, busybox-static. Usage: bench_plugin_restart.py [-n 10]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "src"))

from gpuguard.steps.device_plugin.reconcile import assess  # noqa: E402
from integration.harness.containerd import PrivateContainerd  # noqa: E402
from integration.test_device_plugin import (  # noqa: E402
    Node,
    journal,
    make_step,
    make_svc,
    run_pass,
)


def one_round(node: Node) -> dict[str, float]:
    node.plugin_uvm = False
    node.start_plugin()
    svc, out = make_svc(node.root, cool_down=0.0, max_restarts_per_hour=1000)
    step = make_step(node)
    t0 = time.monotonic()
    node.add_uvm()
    node.plugin_uvm = True
    t_uvm = time.monotonic()
    obs = step.observe(svc.root, svc.config.device_plugin, None)
    result = assess(obs, registration_grace=120)
    t_detect = time.monotonic()
    assert result.actions, "stale plugin not detected"
    ctx = asyncio.run(run_pass(step, svc, node))
    t_done = time.monotonic()
    assert ctx.outcomes and ctx.outcomes[0].status == "done", ctx.outcomes
    assert journal(out, "plugin-recovered")
    # reset for the next round: no uvm, no plugin
    for name in ("nvidia-uvm", "nvidia-uvm-tools"):
        node.c.nsrun("rm", "-f", str(node.c.ns_dev / name))
    node.c.remove(node.plugin)
    state = node.root / "var/lib/gpuguard/plugin-restarts.json"
    state.unlink(missing_ok=True)
    return {
        "mknod_ms": (t_uvm - t0) * 1000,
        "detect_ms": (t_detect - t_uvm) * 1000,
        "pass_ms": (t_done - t_detect) * 1000,
        "total_ms": (t_done - t_uvm) * 1000,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-n", "--rounds", type=int, default=10)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    rounds = []
    with PrivateContainerd(namespace="default") as c:
        node = Node(c)
        for _ in range(a.rounds):
            rounds.append(one_round(node))
    keys = ("detect_ms", "pass_ms", "total_ms")
    summary = {
        k: {
            "median": statistics.median(r[k] for r in rounds),
            "min": min(r[k] for r in rounds),
            "max": max(r[k] for r in rounds),
        }
        for k in keys
    }
    if a.json:
        print(json.dumps({"rounds": rounds, "summary": summary}, indent=1))
        return 0
    print(f"device plugin restart after uvm appears, {a.rounds} rounds (private containerd)")
    for k in keys:
        s = summary[k]
        print(f"  {k:10} median {s['median']:8.1f}  min {s['min']:8.1f}  max {s['max']:8.1f}")
    print(
        "  detect = observe + assess; pass = restart via ctr + kubelet stand-in recreating "
        "the container + verification; total = uvm node created -> plugin-recovered"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
