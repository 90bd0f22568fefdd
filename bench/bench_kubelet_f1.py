#!/usr/bin/env python3
"""F1 on the real kubelet (1.20.2 or 1.34.9): how many GPU pods come back after a reboot
into new GPU UUIDs, and how fast (tests/integration/kubelet_node.py boots the node).

Per round, on a fresh node (systemd namespace, containerd's CRI, the device plugin
double, three GPUs): two GPU static pods run; the node reboots with the GPUs of a case
(``all``: every UUID new; ``one``: gpu-b's GPU new; ``gone``: every UUID new and gpu-b's
GPU gone for good; ``none``: no GPU changed); then until every pod has settled
(Running, Failed, or in CrashLoopBackOff) it prints:

- pods back / pods before: pods Running again;
- seconds from kubelet's start (its pre-start hook included) to the last of those
  Running, when every pod whose GPU is still there is back ("-" otherwise);
- what the others show (UnexpectedAdmissionError, CrashLoopBackOff);
- from kubelet's own log, in ms after its device plugin registration server started:
  the first endpoint's devices pushed (``healthy_ms``: gpuguard's bridge on 1.34 with
  gpuguard, else the plugin), the plugin's registration (``plugin_ms``), and kubelet's
  first admission of a pod (``admit_ms``: its ``SyncLoop ADD`` of the static pods);
  ``margin_ms`` = admit_ms - healthy_ms (negative: kubelet judged the pods before any
  device was healthy); ``gpuguard_margin_ms``: the same margin as gpuguard measures and
  exports it (``gpuguard_readmit_margin_seconds``, from the bridge's state file:
  kubelet's ListAndWatch answered to kubelet's first ``SyncLoop ADD``);
- the resident memory of gpuguard's daemon and of its bridge (``rss_kib``), and the
  bridge's start to READY and when that came after gpuguard.service's READY
  (``bridge_ready``: kubelet is ordered after both, so a negative figure cost it nothing).

Kubelets: ``--kubelet 1.20`` (default) or ``1.34`` (harness/kubelet_versions.py).
``--plugin late`` (default: the plugin double starts once kubelet has judged every pod,
a host service's or DaemonSet's timing) or ``fast`` (1.34: started with kubelet, already
waiting for its socket: racing the re-admission).

Modes: ``none`` (kubelet without gpuguard's drop-in), ``gpuguard`` (the daemon and the
pre-start hook, as installed). Stacks (tests/integration/kubelet_sites.py): ``host``
(this machine's systemd, containerd and runc; gpuguard from this checkout) or a
release's root (``trixie``: its own systemd 257, containerd 1.7 and runc, gpuguard from
its .deb). Prints figures and asserts nothing.

Needs root and the cached kubelet (scripts/build-kubelet). Usage:

  sudo .venv/bin/python bench/bench_kubelet_f1.py [-n 1] [--cases all,one,gone]
      [--modes none,gpuguard] [--stack host|trixie] [--kubelet 1.20|1.34]
"""

from __future__ import annotations

import argparse
import re
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


KLOG = re.compile(r"^[IWE]\d{4} (\d\d):(\d\d):(\d\d\.\d+)\s+\d+ \S+\] (.*)$", re.M)


def log_marks(log: str) -> Dict[str, Optional[float]]:
    """ms after kubelet's registration server started: the first devices pushed, the
    last endpoint's registration (the plugin's), the first static pod admission."""
    t: Dict[str, List[float]] = {"server": [], "pushed": [], "admit": []}
    for h, m, sec, text in KLOG.findall(log):
        at = (int(h) * 60 + int(m)) * 60 + float(sec)
        if "Starting device plugin registration server" in text or (
            "Starting Device Plugin manager" in text  # 1.20 logs no server line
        ):
            t["server"].append(at)
        elif "State pushed for device plugin" in text:
            t["pushed"].append(at)
        elif re.search(r"SyncLoop \(?ADD", text) and "file" in text:
            t["admit"].append(at)
    if not t["server"]:
        return {"healthy_ms": None, "plugin_ms": None, "admit_ms": None, "margin_ms": None}
    zero = t["server"][-1]  # this run's, after the reboot

    def ms(xs: List[float], last: bool = False) -> Optional[float]:
        xs = [x for x in xs if x >= zero]
        return round((xs[-1 if last else 0] - zero) * 1000, 1) if xs else None

    healthy, admit = ms(t["pushed"]), ms(t["admit"])
    margin = round(admit - healthy, 1) if healthy is not None and admit is not None else None
    return {
        "healthy_ms": healthy,
        "plugin_ms": ms(t["pushed"], last=True),
        "admit_ms": admit,
        "margin_ms": margin,
    }


def gpuguard_margin_ms(node: Any) -> Optional[float]:
    """The bridge's margin for nvidia.com/gpu (readmit/state.py), once it has read
    kubelet's first admission from the journal (within a few seconds)."""
    if not node.gpuguard:
        return None
    from gpuguard.host.statefile import load
    from gpuguard.readmit.state import SPEC, STATE_FILE

    deadline = time.monotonic() + 6
    while time.monotonic() < deadline:
        s = load(node.ns.path(STATE_FILE), SPEC).value
        if s is not None and s.first_admission is not None:
            margins = dict(s.margins())
            m = margins.get("nvidia.com/gpu")
            return round(m * 1000, 1) if m is not None else None
        time.sleep(0.5)
    return None


def rss_kib(node: Any, unit: str) -> Optional[int]:
    """VmRSS of the unit's main process, read inside the node's namespace."""
    pid = node.ns.unit_property(unit, "MainPID")
    if pid in ("", "0"):
        return None
    res = node.ns.run(["grep", "VmRSS", f"/proc/{pid}/status"])
    m = re.search(r"(\d+) kB", res.stdout)
    return int(m[1]) if m else None


def bridge_start(node: Any) -> str:
    """The bridge's start to READY (ms), and how long after gpuguard.service's own
    READY it came (ms; <= 0: kubelet, ordered after both, waited nothing for it)."""
    if not node.gpuguard:
        return "-"

    def at(unit: str, prop: str) -> int:
        return int(node.ns.unit_property(unit, prop) or 0)

    unit = "gpuguard-readmit.service"
    start, ready = (
        at(unit, "ExecMainStartTimestampMonotonic"),
        at(unit, "ActiveEnterTimestampMonotonic"),
    )
    daemon = at("gpuguard.service", "ActiveEnterTimestampMonotonic")
    if not (start and ready and daemon):
        return "-"
    return f"{(ready - start) / 1000:.0f}ms,after_daemon={(ready - daemon) / 1000:.0f}ms"


def one_round(
    work: Path,
    api: Path,
    case: str,
    mode: str,
    stack: str,
    kubelet: str = "1.20",
    plugin: str = "late",
) -> Dict[str, Any]:
    made: List[SystemdNamespace] = []

    def factory(**kw: Any) -> SystemdNamespace:
        ns = SystemdNamespace(work / f"ns{len(made)}", **kw)
        made.append(ns)
        ns.start()
        return ns

    where = site(stack, factory)
    try:
        node = boot_on(where, work, api, gpuguard=mode == "gpuguard", kubelet=kubelet)
        try:
            _slots, _before, t0 = f1_reboot(node, case, plugin=plugin)
        except AssertionError:  # the plugin never registered (every pod failed first)
            t0 = time.monotonic()
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
        rss = {u: rss_kib(node, u) for u in ("gpuguard.service", "gpuguard-readmit.service")}
        return {
            **log_marks(node.kubelet_log()),
            "gpuguard_margin_ms": gpuguard_margin_ms(node),
            "bridge_ready": bridge_start(node),
            "rss_kib": ",".join(f"{u.split('.')[0]}={v}" for u, v in rss.items() if v),
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
    ap.add_argument("--kubelet", default="1.20", choices=("1.20", "1.34"))
    ap.add_argument("--plugin", default="late", choices=("late", "fast"))
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-kubelet-f1-") as tmp:
        api = api_code(Path(tmp) / "api")
        for mode in args.modes.split(","):
            label = "yes" if mode == "gpuguard" else "no"
            for case in args.cases.split(","):
                seconds: List[float] = []
                for i in range(args.n):
                    work = Path(tmp) / f"{mode}-{case}-{i}"
                    r = one_round(work, api, case, mode, args.stack, args.kubelet, args.plugin)
                    took = f"{r['seconds']:.1f}" if r["seconds"] is not None else "-"
                    each = [f"{k}=Running@{v:.1f}s" for k, v in sorted(r["up"].items())]
                    each += [f"{k}={v}" for k, v in sorted(r["others"].items())]
                    print(
                        f"stack={args.stack} case={case} gpuguard={label} "
                        f"pods_back={r['back']}/{len(F1_PODS)} seconds_to_running={took} "
                        + " ".join(each)
                        + f" kubelet={args.kubelet} plugin={args.plugin}"
                        + "".join(
                            f" {k}={r[k] if r[k] is not None else '-'}"
                            for k in (
                                "healthy_ms",
                                "plugin_ms",
                                "admit_ms",
                                "margin_ms",
                                "gpuguard_margin_ms",
                            )
                        )
                        + f" rss_kib={r['rss_kib'] or '-'} bridge_ready={r['bridge_ready']}",
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
