#!/usr/bin/env python3
"""F1 on the real kubelet 1.20.2: how many GPU pods come back after a reboot into new
GPU UUIDs, and how fast (tests/integration/kubelet_node.py boots the node).

Per round, on a fresh node (systemd namespace, containerd's CRI, the device plugin
double, three GPUs): two GPU static pods run; the node reboots with the GPUs of a case
(``all``: every UUID new; ``one``: gpu-b's GPU new; ``gone``: every UUID new and gpu-b's
GPU gone for good); then until every pod has settled (Running, Failed, or in
CrashLoopBackOff) it prints:

- pods back / pods before: pods Running again;
- seconds from kubelet's start (its pre-start hook included) to the last of those
  Running, when every pod whose GPU is still there is back ("-" otherwise);
- what the others show (UnexpectedAdmissionError, CrashLoopBackOff).

Modes: ``none`` (kubelet without gpuguard's drop-in), ``gpuguard`` (the daemon and the
pre-start hook, as installed). Stacks (tests/integration/kubelet_sites.py): ``host``
(this machine's systemd, containerd and runc; gpuguard from this checkout) or a
release's root (``trixie``: its own systemd 257, containerd 1.7 and runc, gpuguard from
its .deb). Prints figures and asserts nothing.

Needs root and the cached kubelet (scripts/build-kubelet). Usage:

  sudo .venv/bin/python bench/bench_kubelet_f1.py [-n 1] [--cases all,one,gone]
      [--modes none,gpuguard] [--stack host|trixie]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "src"))

from integration.harness import SystemdNamespace  # noqa: E402
from integration.harness.kubelet import api_code  # noqa: E402
from integration.harness.pods import Pod  # noqa: E402
from integration.kubelet_node import F1_PODS, boot_on, f1_reboot  # noqa: E402
from integration.kubelet_sites import site  # noqa: E402


def _settled(pod: Pod) -> bool:
    waiting = [c["state"].get("waiting", {}).get("reason") for c in pod.containers.values()]
    return pod.running or pod.phase == "Failed" or "CrashLoopBackOff" in waiting


def _what(pod: Pod) -> str:
    if pod.running:
        return "Running"
    if pod.phase == "Failed":
        return pod.reason
    return "CrashLoopBackOff"


def one_round(work: Path, api: Path, case: str, mode: str, stack: str) -> Dict[str, Any]:
    made: List[SystemdNamespace] = []

    def factory(**kw: Any) -> SystemdNamespace:
        ns = SystemdNamespace(work / f"ns{len(made)}", **kw)
        made.append(ns)
        ns.start()
        return ns

    where = site(stack, factory)
    try:
        node = boot_on(where, work, api, gpuguard=mode == "gpuguard")
        _slots, _before, t0 = f1_reboot(node, case)
        up: Dict[str, float] = {}
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            pods = node.pods()
            now = time.monotonic()
            for name in F1_PODS:
                if name in pods and pods[name].running:
                    up.setdefault(name, now - t0)
            if all(n in pods and _settled(pods[n]) for n in F1_PODS):
                break
            time.sleep(0.2)
        expected = 1 if case == "gone" else 2
        return {
            "back": len(up),
            "seconds": max(up.values()) if len(up) == expected else None,
            "up": up,
            "others": {n: _what(p) for n, p in pods.items() if n in F1_PODS and not p.running},
        }
    finally:
        where.stop()
        for ns in reversed(made):
            ns.stop()


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-n", type=int, default=1, help="rounds per case and mode")
    ap.add_argument("--cases", default="all,one,gone")
    ap.add_argument("--modes", default="none,gpuguard")
    ap.add_argument("--stack", default="host", help="host, or a release's root: trixie")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-kubelet-f1-") as tmp:
        api = api_code(Path(tmp) / "api")
        for mode in args.modes.split(","):
            label = "yes" if mode == "gpuguard" else "no"
            for case in args.cases.split(","):
                seconds: List[float] = []
                for i in range(args.n):
                    r = one_round(Path(tmp) / f"{mode}-{case}-{i}", api, case, mode, args.stack)
                    took = f"{r['seconds']:.1f}" if r["seconds"] is not None else "-"
                    each = [f"{k}=Running@{v:.1f}s" for k, v in sorted(r["up"].items())]
                    each += [f"{k}={v}" for k, v in sorted(r["others"].items())]
                    print(
                        f"stack={args.stack} case={case} gpuguard={label} "
                        f"pods_back={r['back']}/{len(F1_PODS)} seconds_to_running={took} "
                        + " ".join(each),
                        flush=True,
                    )
                    if r["seconds"] is not None:
                        seconds.append(r["seconds"])
                if seconds and args.n > 1:
                    print(
                        f"stack={args.stack} case={case} gpuguard={label}: seconds_to_running "
                        f"median={statistics.median(seconds):.1f} max={max(seconds):.1f} "
                        f"({len(seconds)}/{args.n} rounds with every pod whose GPU stayed back)"
                    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
