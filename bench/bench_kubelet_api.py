#!/usr/bin/env python3
"""GPU pods through a real API server (tests/integration/cluster_node.py): how fast each
workload's pod runs again after a reboot, and what the deleted-pod scenario costs.

Per round, on a fresh node (systemd namespace, containerd's CRI, the control plane of
harness/cluster.py, kubelet registered as a Node, the plugin double a DaemonSet, three
GPUs):

- ``reboot``: a bare Pod, a Deployment (1 replica) and a Job each holding one GPU; the
  node reboots with the GPUs of a case (``none``: every UUID the same; ``all``: every
  one new); printed per workload: seconds from kubelet's start (``systemctl start``,
  its pre-start hook included) to its pod's container started (kubelet's PLEG
  ContainerStarted, from its journal) and whether it is the same pod; the first API
  pod's admission after kubelet's start (kubelet's ``SyncLoop ADD`` of source "api")
  and the first devices pushed (``first_pushed``: the bridge's, with gpuguard);
  ``api_margin_ms``: the first devices' margin before it (negative: kubelet judged a
  pod before any device was healthy); ``bridge_margin_ms``: the margin gpuguard's
  readmit state records (kubelet's first ``SyncLoop ADD`` of any source, less the
  devices pushed healthy);
- ``deleted``: two Deployment pods on two GPUs, one deleted through the API while the
  node is down, the plugin 30 s late: the Deployment's pods failed, and those failed
  with ``Unimplemented`` (the bridge's Allocate).

Modes: ``none`` (no gpuguard) and ``gpuguard``. Prints figures, asserts nothing. Needs
root, the prebuilt kubelets and control plane (tests/integration/harness/
kubelet_versions.py and cluster.py say where they are found). Usage:

  sudo .venv/bin/python bench/bench_kubelet_api.py [--kubelets 1.34,1.36]
      [--cases none,all] [--modes gpuguard] [--scenarios reboot,deleted] [-n 1]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "src"))

from integration.cluster_node import (  # noqa: E402
    WORKLOADS,
    ApiNode,
    bare_pod,
    boot_api,
    deleted_pod_scenario,
    deployment,
    failed,
    job,
)
from integration.harness import SystemdNamespace  # noqa: E402
from integration.harness.kubelet import api_code  # noqa: E402
from integration.kubelet_node import gpus_after  # noqa: E402


def log_marks(n: ApiNode, t0: float) -> Dict[str, Optional[float]]:
    """Seconds from kubelet's start (its journal): its first ``SyncLoop ADD`` of API
    pods, and the first devices pushed by an endpoint (the bridge's, with gpuguard)."""
    inv = n.ns.unit_property("kubelet.service", "InvocationID")
    argv = ["journalctl", "--no-pager", "-o", "json", f"_SYSTEMD_INVOCATION_ID={inv}"]
    out: Dict[str, Optional[float]] = {
        "first_add": None,  # any source's, "SyncLoop ADD" source="file" pods=[] too
        "first_api_admission": None,
        "first_pushed": None,
    }
    for line in n.ns.run(argv, timeout=30).stdout.splitlines():
        e = json.loads(line)
        msg, at = e.get("MESSAGE", ""), int(e["__MONOTONIC_TIMESTAMP"]) / 1e6 - t0
        if not isinstance(msg, str):
            continue
        if re.search(r"SyncLoop \(?ADD", msg):
            out["first_add"] = out["first_add"] or at
        if re.search(r"SyncLoop \(?ADD.*api", msg):
            out["first_api_admission"] = out["first_api_admission"] or at
        elif "State pushed for device plugin" in msg:
            out["first_pushed"] = out["first_pushed"] or at
    return out


def reboot_round(n: ApiNode, case: str) -> Dict[str, Any]:
    before = n.run(bare_pod(), deployment(), job(), workloads=WORKLOADS)
    old = {p.uid: p.container_ids() for p in n.cluster.pods()}
    t0 = n.reboot(gpus_after(n.node, case, before["gpu-bare"].slot))
    uids = {p.uid for p in before.values()}

    def settled(pods: List[Any]) -> bool:
        ours = [p for p in pods if p.labels.get("app") in WORKLOADS]
        back = [p for p in ours if p.running and p.container_ids() != old.get(p.uid)]
        return len(back) == len(uids) or bool(failed(ours)) or len(ours) > len(uids)

    try:
        pods = n.cluster.wait_pods(settled, 90, "the GPU pods")
    except AssertionError:
        pods = n.cluster.pods()
    out: Dict[str, Any] = {}
    for w in WORKLOADS:
        mine = n.of(w, pods)
        same = [p for p in mine if p.uid == before[w].uid]
        at = n.started_at(before[w].uid) if same and same[0].running else None
        out[w] = (
            f"{at - t0:.2f}s" if at is not None else "-"
        ) + f"({'same pod' if same and same[0].running else 'NOT back'}, {len(mine)} pods)"
    marks = log_marks(n, t0)
    for k, v in marks.items():
        out[k] = f"{v:.3f}s" if v is not None else "-"
    adm, pushed = marks["first_api_admission"], marks["first_pushed"]
    out["api_margin_ms"] = round((adm - pushed) * 1000) if adm and pushed else "-"
    out["bridge_margin_ms"] = n.bridge_margin_ms()
    return out


def deleted_round(n: ApiNode) -> Dict[str, Any]:
    kept, pods = deleted_pod_scenario(n)
    again = [p for p in pods if p.uid == kept.uid]
    return {
        "pods": len(pods),
        "failed": len(failed(pods)),
        "unimplemented": sum("Unimplemented" in p.messages() for p in pods),
        "kept_pod": "Running" if again and again[0].running else "not running",
        "allocatable": n.cluster.allocatable("gpunode"),
    }


def one_round(
    work: Path, api: Path, scenario: str, kubelet: str, case: str, mode: str
) -> Dict[str, Any]:
    made: List[SystemdNamespace] = []

    def factory(**kw: Any) -> SystemdNamespace:
        ns = SystemdNamespace(work / f"ns{len(made)}", **kw)
        made.append(ns)
        ns.start()
        return ns

    t = time.monotonic()
    try:
        n_gpus = 2 if scenario == "deleted" else 3
        n = boot_api(
            factory, work, api, gpuguard=mode == "gpuguard", kubelet=kubelet, n_gpus=n_gpus
        )
        r = deleted_round(n) if scenario == "deleted" else reboot_round(n, case)
    finally:
        for ns in reversed(made):
            ns.stop()
    r["round_s"] = round(time.monotonic() - t, 1)
    return r


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-n", type=int, default=1, help="rounds per cell")
    ap.add_argument("--kubelets", default="1.34,1.36")
    ap.add_argument("--cases", default="none,all")
    ap.add_argument("--modes", default="gpuguard")
    ap.add_argument("--scenarios", default="reboot,deleted")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-kubelet-api-") as tmp:
        api = api_code(Path(tmp) / "api")
        i = 0
        for scenario in args.scenarios.split(","):
            cases = args.cases.split(",") if scenario == "reboot" else ["none"]
            for kubelet in args.kubelets.split(","):
                for case in cases:
                    for mode in args.modes.split(","):
                        for _ in range(args.n):
                            i += 1
                            r = one_round(Path(tmp) / f"r{i}", api, scenario, kubelet, case, mode)
                            print(
                                f"scenario={scenario} kubelet={kubelet} case={case} mode={mode} "
                                + " ".join(f"{k}={v}" for k, v in r.items()),
                                flush=True,
                            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
