#!/usr/bin/env python3
"""Cost of the fleet view: `gpuguard npd` (what node-problem-detector runs every 30 s
per condition), the status summary, a metrics update + export after a pass, and the
rendering of the metrics for a scrape (gpuguard-metrics.service, at each GET /metrics).

A status file like a busy node's: 200 GPU containers, the last container access check
with 200 findings and 200 outcomes, the other steps clean. Prints p50/p95; asserts
nothing. Target: `gpuguard npd` end to end (a new Python process, as NPD runs it)
well under NPD's 5 s timeout, and the in-process answer < 5 ms.

    .venv/bin/python bench/bench_fleet.py [--runs N]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, List

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "src"))

from gpuguard.host.paths import Root  # noqa: E402
from gpuguard.reporting.metrics_output import make_output  # noqa: E402
from gpuguard.reporting.npd import answer, read_status  # noqa: E402
from gpuguard.reporting.summary import node_summary  # noqa: E402


def status_doc(containers: int) -> dict[str, Any]:
    now = time.time()
    findings = [
        {
            "kind": "container-device-denied",
            "reconciler": "container_access",
            "summary": f"container {i:012x} denied /dev/nvidia{i % 8}",
            "severity": "warning",
            "fields": {"CONTAINER_ID": f"{i:064x}"},
        }
        for i in range(containers)
    ]
    outcomes = [
        {
            "kind": "cgroup-v1-allow",
            "reconciler": "container_access",
            "target": f"c{i}",
            "reason": "r",
            "status": "done",
            "detail": "",
            "fields": {},
        }
        for i in range(containers)
    ]
    step = {
        "pass": 9,
        "ended": now,
        "error": None,
        "findings": [],
        "outcomes": [],
        "gauges": {},
        "unknown": [],
    }
    last = {
        "number": 9,
        "reasons": ["systemd: daemon-reload/reexec finished"],
        "reconcilers": ["container_access"],
        "first_mark_age_ms": 5.0,
        "ended": now,
        "started": now,
        "duration_ms": 35.0,
        "steps_ms": {"container_access": 30.0},
        "findings": findings,
        "outcomes": outcomes,
        "gpus": 8,
    }
    return {
        "version": 1,
        "bus_connected": True,
        "dry_run": False,
        "reload_signal": {"private_socket": True, "last_via": "", "reloads": 1, "received": {}},
        "fast_paths": {"new_scopes": {}},
        "node": "problem",
        "conditions": {},
        "pid": os.getpid(),
        "started": now - 3600,
        "passes": 9,
        "last_pass": last,
        "first_pass": last,
        "steps": {
            "container_access": {
                **step,
                "findings": findings,
                "outcomes": outcomes,
                "gauges": {"gpu_containers": containers},
            },
            "device_nodes": step,
            "checkpoint": step,
            "device_plugin": step,
            "gpu_count": {**step, "gauges": {"gpus_pci": 8, "gpus_nvml": 8, "gpus_kubelet": 8}},
        },
        "recent_changes": [
            {
                "time": now,
                "step": "container_access",
                "kind": "cgroup-v1-allow",
                "status": "done",
                "target": f"c{i}",
            }
            for i in range(containers)
        ],
    }


def timed(fn: Callable[[], Any], runs: int) -> List[float]:
    out = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1000)
    return out


def report(name: str, ms: List[float]) -> None:
    ms = sorted(ms)
    p95 = ms[min(len(ms) - 1, int(len(ms) * 0.95))]
    print(f"{name}: n={len(ms)} p50={statistics.median(ms):.2f} ms p95={p95:.2f} ms")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--containers", type=int, default=200)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        doc = status_doc(args.containers)
        (root / "run/gpuguard").mkdir(parents=True)
        (root / "textfile").mkdir()
        (root / f"proc/{os.getpid()}").mkdir(parents=True)
        data = json.dumps(doc, indent=1)
        (root / "run/gpuguard/status.json").write_text(data)
        print(f"status file: {len(data) / 1024:.0f} KiB ({args.containers} GPU containers)")
        report(
            "npd answer in-process", timed(lambda: answer(Root(root), "device-access"), args.runs)
        )
        cmd = [str(REPO / ".venv/bin/gpuguard"), "npd", "device-access", "--root", str(root)]
        report(
            "gpuguard npd end to end (new process)",
            timed(lambda: subprocess.run(cmd, capture_output=True, check=False), args.runs),
        )
        report("status summary in-process", timed(lambda: node_summary(Root(root), []), args.runs))
        out = make_output()
        status, _why = read_status(Root(root))
        assert status is not None and status.last_pass is not None, _why
        last = status.last_pass
        report(
            "metrics update + export (2 files)",
            timed(lambda: out.publish(last, status, Root(root), "/textfile"), args.runs),
        )
        from gpuguard.reporting.metrics import render_file
        from gpuguard.reporting.metrics_state import STATE_FILE

        state = Root(root).path(STATE_FILE)
        report("metrics rendered for a scrape", timed(lambda: render_file(state), args.runs))


if __name__ == "__main__":
    main()
