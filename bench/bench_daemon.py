#!/usr/bin/env python3
"""Benchmark the real daemon, run from the repo's unit on a real systemd (PID 1 of a namespace).

Prints figures, asserts nothing (targets are shown beside them):

  (a) for each ``systemctl daemon-reload``: the time from the moment it returned
      (host ``time.time()``; no time namespace, so the same clock as the daemon's) to
      the start and to the end of the pass it triggered (``last_pass.started/ended``
      in /run/gpuguard/status.json). Each reload is paired with its own pass: the
      pass count must grow by exactly one, and stay there for a quiet period,
      before the next reload. Target: pass start p99 < 300 ms.
  (b) idle CPU: utime+stime of the daemon (its host PID, found in the instance's
      cgroups by NSpid == MainPID) over a quiet interval, as % of one CPU, with its
      wakeups (context switches). Target < 0.1 %.
  (c) RSS (VmRSS) after start-up and after the reloads. Target < 30 MB (the default
      configuration: no textfile).

Needs root (it boots the test harness's namespace). Usage:

  sudo .venv/bin/python bench/bench_daemon.py            # 50 reloads, 60 s idle
  sudo .venv/bin/python bench/bench_daemon.py --quick    # 10 reloads, 10 s idle
  sudo .venv/bin/python bench/bench_daemon.py --quick --textfile  # [Metrics] TextfileDirectory= set
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "src"))

from integration.gpuguard_ns import (  # noqa: E402
    gpuguard_units,
    passes,
    settle,
    setup_node,
    status,
    wait_for,
)
from integration.harness import SystemdNamespace  # noqa: E402

CLK_TCK = os.sysconf("SC_CLK_TCK")
TEXTFILE_DIR = "/var/lib/prometheus/node-exporter"
START_P99_TARGET_MS = 300.0
IDLE_CPU_TARGET_PCT = 0.1
RSS_TARGET_MB = 30.0


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (for n=50, p99 is the maximum)."""
    s = sorted(values)
    return s[max(0, math.ceil(q / 100 * len(s)) - 1)]


def daemon_host_pid(ns: SystemdNamespace) -> int:
    """Host PID of gpuguard.service's main process (NSpid ends with its MainPID)."""
    main = ns.unit_property("gpuguard.service", "MainPID")
    for pid in ns.processes():
        try:
            lines = Path(f"/proc/{pid}/status").read_text().splitlines()
        except OSError:
            continue
        for line in lines:
            if line.startswith("NSpid:") and line.split()[-1] == main and str(pid) != main:
                return pid
    raise RuntimeError(f"no host process with NSpid {main} in {ns.name}")


def cpu_seconds(pid: int) -> float:
    """utime+stime of the whole process (all threads), from /proc/PID/stat."""
    text = Path(f"/proc/{pid}/stat").read_text()
    fields = text[text.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def sched_ns(pid: int) -> Tuple[int, int]:
    """(CPU ns, context switches) summed over the process's threads (finer than ticks)."""
    total_ns = switches = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total_ns += int((task / "schedstat").read_text().split()[0])
            for line in (task / "status").read_text().splitlines():
                if line.startswith(("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches")):
                    switches += int(line.split()[1])
        except (OSError, ValueError, IndexError):
            continue
    return total_ns, switches


def status_value(pid: int, key: str) -> str:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return line.split(":", 1)[1].strip()
    return ""


def rss_mb(pid: int) -> float:
    return int(status_value(pid, "VmRSS").split()[0]) / 1024


def threads(pid: int) -> int:
    return int(status_value(pid, "Threads") or 0)


def summary(name: str, values_ms: Sequence[float], target: Optional[str] = None) -> str:
    line = (
        f"{name}: n={len(values_ms)} p50={percentile(values_ms, 50):.1f} ms "
        f"p99={percentile(values_ms, 99):.1f} ms max={max(values_ms):.1f} ms "
        f"min={min(values_ms):.1f} ms"
    )
    return line + (f"  (target: {target})" if target else "")


def bench_reloads(ns: SystemdNamespace, count: int, quiet: float) -> Dict[str, Any]:
    starts: List[float] = []
    ends: List[float] = []
    durations: List[float] = []
    extra = 0
    before = settle(ns, quiet=quiet)
    for i in range(count):
        ns.systemctl("daemon-reload")
        returned = time.time()
        wait_for(lambda b=before: passes(ns) >= b + 1, timeout=15, what=f"pass for reload {i}")
        after = settle(ns, quiet=quiet)
        if after != before + 1:  # not one pass for this reload: count it, keep going
            extra += after - before - 1
        st = status(ns)
        last = st["last_pass"]
        if after == before + 1 and last["number"] == after:
            starts.append((last["started"] - returned) * 1000)
            ends.append((last["ended"] - returned) * 1000)
            durations.append(float(last["duration_ms"]))
        before = after
    return {"starts": starts, "ends": ends, "durations": durations, "extra_passes": extra}


def bench_idle(pid: int, seconds: float) -> Dict[str, float]:
    cpu0, (ns0, sw0), t0 = cpu_seconds(pid), sched_ns(pid), time.monotonic()
    time.sleep(seconds)
    cpu1, (ns1, sw1), t1 = cpu_seconds(pid), sched_ns(pid), time.monotonic()
    wall = t1 - t0
    return {
        "seconds": wall,
        "cpu_pct_ticks": (cpu1 - cpu0) / wall * 100,
        "cpu_pct_sched": (ns1 - ns0) / 1e9 / wall * 100,
        "wakeups_per_s": (sw1 - sw0) / wall,
    }


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="10 reloads, 10 s idle (smoke run)")
    ap.add_argument("--reloads", type=int, help="number of daemon-reloads (default 50)")
    ap.add_argument("--idle", type=float, help="idle measurement in seconds (default 60)")
    ap.add_argument("--json", type=Path, help="also write the raw figures to this file")
    ap.add_argument(
        "--textfile",
        action="store_true",
        help=f"set [Metrics] TextfileDirectory={TEXTFILE_DIR} (the daemon then renders)",
    )
    args = ap.parse_args(argv)
    reloads = args.reloads or (10 if args.quick else 50)
    idle = args.idle or (10.0 if args.quick else 60.0)
    if os.geteuid() != 0:
        print("bench_daemon: needs root (it boots a systemd namespace)", file=sys.stderr)
        return 2

    with tempfile.TemporaryDirectory(prefix="gpuguard-bench-") as tmp:
        ns = SystemdNamespace(Path(tmp) / "ns", units=gpuguard_units())
        with ns:
            if args.textfile:
                ns.path(TEXTFILE_DIR).mkdir(parents=True, exist_ok=True)
            config = f"[Metrics]\nTextfileDirectory={TEXTFILE_DIR}\n" if args.textfile else ""
            setup_node(ns, stale=False, config=config)
            t0 = time.monotonic()
            ns.systemctl("start", "gpuguard.service")  # Type=notify: returns at READY=1
            ready_ms = (time.monotonic() - t0) * 1000
            pid = daemon_host_pid(ns)
            settle(ns)
            rss_start = rss_mb(pid)
            first = status(ns)["first_pass"]
            print(f"gpuguard daemon: host pid {pid}, {threads(pid)} thread(s)")
            print(f"start to READY=1: {ready_ms:.0f} ms (first pass {first['duration_ms']} ms)")
            print(f"RSS after start: {rss_start:.1f} MB  (target: < {RSS_TARGET_MB:.0f} MB)")
            if args.textfile:
                prom = ns.path(f"{TEXTFILE_DIR}/gpuguard.prom")
                print(f"textfile: {prom.stat().st_size if prom.exists() else 'not'} bytes written")

            r = bench_reloads(ns, reloads, quiet=0.3)
            print(
                f"daemon-reloads: {reloads}, paired with exactly one pass: {len(r['starts'])}, "
                f"extra passes: {r['extra_passes']}"
            )
            if r["starts"]:
                print(
                    summary(
                        "reload returned -> pass start",
                        r["starts"],
                        f"p99 < {START_P99_TARGET_MS:.0f} ms",
                    )
                )
                print(summary("reload returned -> pass end", r["ends"]))
                print(summary("pass duration", r["durations"]))
            rss_after = rss_mb(pid)
            print(
                f"RSS after {reloads} reloads: {rss_after:.1f} MB  "
                f"(target: < {RSS_TARGET_MB:.0f} MB)"
            )

            settle(ns)
            passes_before = passes(ns)
            i = bench_idle(pid, idle)
            idle_passes = passes(ns) - passes_before
            print(
                f"idle CPU over {i['seconds']:.0f} s: {i['cpu_pct_ticks']:.3f} % of one CPU "
                f"(utime+stime), {i['cpu_pct_sched']:.4f} % (schedstat), "
                f"{i['wakeups_per_s']:.2f} wakeups/s, {idle_passes} pass(es)  "
                f"(target: < {IDLE_CPU_TARGET_PCT} %)"
            )
            if args.json:
                doc = {
                    "reloads": reloads,
                    "ready_ms": ready_ms,
                    "rss_start_mb": rss_start,
                    "rss_after_reloads_mb": rss_after,
                    "reload": r,
                    "idle": {**i, "passes": idle_passes},
                }
                args.json.write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
