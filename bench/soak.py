#!/usr/bin/env python3
"""Soak: gpuguard on a real systemd under random lifecycle events, for minutes on end.

A systemd namespace (tests/integration/harness) booted on --layout (v1: hybrid, v2:
unified) runs the daemon from the repo's unit, a kubelet stand-in and --containers GPU
"containers" (kubepods scopes with fake GPU nodes, granted behind systemd's back as the
legacy NVIDIA hook does: tests/integration/gpu_scopes.py). For --minutes, one random
event about every 1/--rate seconds:

  daemon-reload, daemon-reexec, a container stopped and a new one started, a kubelet
  restart, a D-Bus daemon restart (dbus.service SIGKILLed, then started), and a
  runtime's rewrite of one container's device access, which no D-Bus signal announces:
  on v1 deny all, then runc's default list, written to the cgroup (as runc < 1.0 did on
  every update); on v2 the scope's DeviceAllow= reset over the bus to a list without
  the GPU (a runtime's systemd driver that empties it on an update, or an operator's
  set-property; gpuguard sees the file systemd writes for it: sources/transient.py).

Meanwhile a sampler asks whether every live container has its GPU, back to back (its
devices.list on v1; on v2 the kernel, through a prober process in each container's
cgroup: tests/integration/gpu_access.py) and records each stretch without it; the
daemon's RSS and open fds are read from /proc every second. At the end it prints: access losses and
how long each lasted (by the event that preceded them), the kernel's verdict on every
container, daemon restarts (NRestarts), RSS and open fds (start/end/max), passes run.
Prints figures, asserts nothing. Needs root.

  sudo .venv/bin/python bench/soak.py                      # 30 minutes, 50 containers
  sudo .venv/bin/python bench/soak.py --minutes 5 --layout v2
  sudo .venv/bin/python bench/soak.py --minutes 0.2 --containers 5   # smoke
"""

from __future__ import annotations

import argparse
import hashlib
import math
import os
import random
import shutil
import signal
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "src"))

import memtrace  # noqa: E402  (bench/, beside this file)
from gpuguard.devices.rules import RUNC_DEFAULT_RULES  # noqa: E402
from integration.daemon_faults import (  # noqa: E402
    SERVICE,
    ProcSample,
    boot_gpu_node,
    main_pid,
    n_restarts,
    sample,
    verdicts,
)
from integration.gpu_access import Access  # noqa: E402
from integration.gpu_scopes import Container, make_dev_dir, start  # noqa: E402
from integration.gpuguard_ns import events, settle, status  # noqa: E402
from integration.harness import SystemdNamespace  # noqa: E402

WEIGHTS: Dict[str, float] = {
    "daemon-reload": 4,
    "daemon-reexec": 1,
    "container-replace": 2,
    "kubelet-restart": 1,
    "dbus-restart": 0.5,
    "cgroup-rewrite": 1,
}


def percentile(values: Sequence[float], q: float) -> float:
    s = sorted(values)
    return s[max(0, math.ceil(q / 100 * len(s)) - 1)] if s else float("nan")


def new_container(i: int) -> Container:
    return Container(
        str(uuid.UUID(int=0xD000 + i)), hashlib.sha256(b"soak%d" % i).hexdigest(), (i % 2,)
    )


class Sampler(threading.Thread):
    """Asks whether each live container has its GPU, back to back; records losses."""

    def __init__(self, ns: SystemdNamespace) -> None:
        super().__init__(daemon=True)
        self.ns = ns
        self.access = Access(ns)  # its probers are added and removed under the lock
        self.lock = threading.Lock()
        self.live: Dict[str, Container] = {}
        self.open: Dict[str, float] = {}  # unit -> monotonic start of a loss
        self.losses: List[Tuple[float, float, str]] = []  # (start, seconds, unit)
        self.sweeps = 0
        self.stopping = threading.Event()

    def add(self, c: Container) -> None:
        with self.lock:
            self.access.add([c])
            self.live[c.unit] = c

    def remove(self, c: Container) -> None:
        """Before the container's scope is stopped (its prober exits first)."""
        with self.lock:
            self.live.pop(c.unit, None)
            self.open.pop(c.unit, None)  # a container that goes away ends its story
            self.access.remove(c)

    def run(self) -> None:
        while not self.stopping.is_set():
            with self.lock:  # one sweep: 50 containers in a millisecond or two
                ctrs = list(self.live.values())
                lacking = {c.unit for c in self.access.lacking(ctrs)}
                now = time.monotonic()
                for c in ctrs:
                    began = self.open.get(c.unit)
                    if c.unit in lacking and began is None:
                        self.open[c.unit] = now
                    elif c.unit not in lacking and began is not None:
                        del self.open[c.unit]
                        self.losses.append((began, now - began, c.unit))
            self.sweeps += 1
            time.sleep(0.002)

    def finish(self) -> None:
        self.stopping.set()
        self.join()
        self.access.close()
        now = time.monotonic()
        for unit, began in self.open.items():  # still lost at the end
            self.losses.append((began, now - began, unit + " (still lost)"))


class Monitor(threading.Thread):
    """The daemon's RSS and open fds once a second, whichever process it is."""

    def __init__(self, ns: SystemdNamespace) -> None:
        super().__init__(daemon=True)
        self.ns = ns
        self.samples: List[ProcSample] = []
        self.times: List[float] = []  # monotonic, one per sample
        self.stopping = threading.Event()

    def run(self) -> None:
        while not self.stopping.wait(1.0):
            try:
                pid = main_pid(self.ns)
            except Exception:  # systemctl timing out under load: try again
                continue
            s = sample(self.ns, pid) if pid else None
            if s is not None:
                self.samples.append(s)
                self.times.append(time.monotonic())

    def rss_at(self, t: float) -> Optional[float]:
        """RSS (MB) of the last sample at or before monotonic `t` (None: none yet)."""
        at = [s for s, when in zip(self.samples, self.times) if when <= t]
        return at[-1].rss_kb / 1024 if at else None


class Soak:
    def __init__(self, ns: SystemdNamespace, devdir: Path, n: int, rng: random.Random) -> None:
        self.ns = ns
        self.devdir = devdir
        self.rng = rng
        self.sampler = Sampler(ns)
        self.next_id = n
        self.log: List[Tuple[float, str]] = []  # (monotonic, event)
        self.bus_down: List[Tuple[float, float]] = []  # dbus-restart: killed .. started
        self.ctrs = [new_container(i) for i in range(n)]

    def container(self) -> Container:
        c = new_container(self.next_id)
        self.next_id += 1
        make_dev_dir(self.devdir / c.container_id[:12], c.gpus)
        return c

    def do(self, event: str) -> None:
        self.log.append((time.monotonic(), event))
        ns = self.ns
        if event in ("daemon-reload", "daemon-reexec"):
            ns.systemctl(event, check=False, timeout=60)
        elif event == "kubelet-restart":
            ns.systemctl("restart", "kubelet.service", check=False, timeout=60)
        elif event == "dbus-restart":
            down = time.monotonic()
            ns.systemctl("kill", "-s", "KILL", "dbus.service", check=False)
            time.sleep(self.rng.uniform(0.0, 1.0))
            for _ in range(3):  # a start right after the kill can fail: try again
                if ns.systemctl("start", "dbus.service", check=False, timeout=60).returncode == 0:
                    break
                time.sleep(0.2)
            self.bus_down.append((down, time.monotonic()))
        elif event == "container-replace":
            old = self.ctrs.pop(self.rng.randrange(len(self.ctrs)))
            self.sampler.remove(old)
            ns.systemctl("stop", old.unit, check=False, timeout=60)
            new = self.container()
            start(ns, new)
            self.ctrs.append(new)
            self.sampler.add(new)
        elif event == "cgroup-rewrite" and ns.layout == "v2":
            c = self.rng.choice(self.ctrs)
            unit_allow = ("DeviceAllow=", "DeviceAllow=/dev/null rw")
            ns.systemctl("set-property", "--runtime", c.unit, *unit_allow, check=False)
        elif event == "cgroup-rewrite":
            c = self.rng.choice(self.ctrs)
            d = c.cgroup(ns)
            try:
                with open(d / "devices.deny", "w") as f:
                    f.write("a")
                with open(d / "devices.allow", "w") as f:
                    for rule in RUNC_DEFAULT_RULES:
                        f.write(rule.render())
                        f.flush()
            except OSError:
                pass  # the scope went away meanwhile
        else:
            raise ValueError(event)

    def cause(self, t: float) -> str:
        """The last event that began before t, and whether the bus was down then (no
        signal reaches gpuguard: it repairs on reconnecting)."""
        before = [e for when, e in self.log if when <= t]
        bus = any(a <= t <= b for a, b in self.bus_down)
        return (before[-1] if before else "none") + (" (bus down)" if bus else "")


def fmt_ms(values: Sequence[float]) -> str:
    return (
        f"n={len(values)} p50={percentile(values, 50) * 1000:.1f} ms "
        f"p99={percentile(values, 99) * 1000:.1f} ms max={max(values) * 1000:.1f} ms"
    )


def report(soak: Soak, mon: Monitor, seconds: float, counts: Counter[str]) -> None:
    ns, sampler = soak.ns, soak.sampler
    print(
        f"events: {sum(counts.values())} in {seconds:.0f} s: "
        + ", ".join(f"{k} {counts[k]}" for k in WEIGHTS)
    )
    losses = sampler.losses
    print(
        f"access losses: {len(losses)} (a container without its GPU: "
        f"{'devices.list' if ns.layout == 'v1' else 'the kernel denies it'}; "
        f"{sampler.sweeps} sweeps, {sampler.sweeps / seconds:.0f}/s)"
    )
    by: Dict[str, List[float]] = defaultdict(list)
    for began, lasted, _unit in losses:
        by[soak.cause(began)].append(lasted)
    for cause, lasted in sorted(by.items()):
        print(f"  after {cause}: {fmt_ms(lasted)}")
    for began, lasted, unit in sorted(losses, key=lambda x: -x[1])[:5]:
        print(f"  longest: {lasted * 1000:.1f} ms {unit[:40]} after {soak.cause(began)}")
    still = [u for _b, _l, u in losses if u.endswith("(still lost)")]
    print(f"containers without their GPU at the end: {len(still)}")
    exact = sum(verdicts(ns, c) == (True, False) for c in soak.ctrs)
    print(f"kernel verdicts at the end (own GPU allowed, other denied): {exact}/{len(soak.ctrs)}")
    pids = sorted({s.pid for s in mon.samples})
    print(f"daemon restarts (NRestarts): {n_restarts(ns)}; main PIDs seen: {len(pids)}")
    if mon.samples:
        first, last = mon.samples[0], mon.samples[-1]
        rss = [s.rss_kb / 1024 for s in mon.samples]
        fds = [s.fds for s in mon.samples]
        print(f"RSS: start {rss[0]:.1f} MB, end {rss[-1]:.1f} MB, max {max(rss):.1f} MB")
        t0 = mon.times[0]
        marks = [m for m in (2, 10, 30) if t0 + m * 60 <= mon.times[-1]]
        at = {m: mon.rss_at(t0 + m * 60) for m in marks}
        print("RSS at minute " + ", ".join(f"{m}: {at[m]:.1f} MB" for m in marks))
        if 2 in at and mon.times[-1] - t0 > 180:
            hours = (mon.times[-1] - t0 - 120) / 3600
            grew = rss[-1] - (at[2] or 0.0)
            print(f"RSS growth from minute 2 to the end: {grew:+.1f} MB ({grew / hours:+.1f} MB/h)")
        print(f"open fds: start {first.fds}, end {last.fds}, max {max(fds)}")
    by_kind = Counter(str(e.get("GPUGUARD_KIND")) for e in events(ns))
    print(
        f"passes run: {by_kind['pass-complete']} ({by_kind['pass-complete'] / seconds * 60:.0f}"
        f"/min); re-grants: {by_kind['cgroup-v1-allow']}; durable grants: "
        f"{by_kind['unit-device-allow']}; v2 bridges: {by_kind['v2-bridge-attach']}; "
        f"kubelet restarts: {by_kind['kubelet-restart']}; "
        f"reconciler crashes: {by_kind['reconciler-crashed']}"
    )


def main(argv: Sequence[str] = ()) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=30.0, help="how long (30)")
    ap.add_argument("--containers", type=int, default=50, help="GPU containers (50)")
    ap.add_argument("--rate", type=float, default=1.0, help="events per second (1)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--layout", choices=("v1", "v2"), default="v1", help="cgroup layout (v1)")
    ap.add_argument(
        "--memtrace",
        action="store_true",
        help="run the daemon under tracemalloc (bench/memtrace.py) and print what grew "
        "between minute 1 and the end, by line (slows the daemon: not for timings)",
    )
    ap.add_argument(
        "--unit-env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="an Environment= for the daemon's unit (experiments: MALLOC_ARENA_MAX=8)",
    )
    args = ap.parse_args(list(argv) or None)
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[attr-defined]
    # SIGTERM (e.g. timeout(1)) must still stop the namespace and remove its cgroups
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    rng = random.Random(args.seed)
    work = Path(tempfile.mkdtemp(prefix="gg-soak-"))
    devdir = work / "ctrdev"
    ctrs = [new_container(i) for i in range(args.containers)]
    for c in ctrs:
        make_dev_dir(devdir / c.container_id[:12], c.gpus)
    made: List[SystemdNamespace] = []

    def factory(**kw: Any) -> SystemdNamespace:
        kw["ro_binds"] = {**kw["ro_binds"], "/run/ctrdev": devdir}
        ns = SystemdNamespace(work / "ns", layout=args.layout, boot_timeout=60, **kw)
        made.append(ns)
        ns.start()
        return ns

    load0 = os.getloadavg()[0]
    try:
        units = {MEMTRACE_UNIT: MEMTRACE_DROPIN} if args.memtrace else {}
        if args.unit_env:
            env = "".join(f"Environment={e}\n" for e in args.unit_env)
            units["gpuguard.service.d/61-env.conf"] = f"[Service]\n{env}"
        ns = boot_gpu_node(factory, work, [], units=units)
        ns.systemctl("start", SERVICE, "kubelet.service")
        soak = Soak(ns, devdir, args.containers, rng)
        for c in soak.ctrs:
            start(ns, c)
        settle(ns)
        print(
            f"gpuguard soak: {args.containers} GPU containers, cgroup {args.layout}, "
            f"{args.minutes:g} min, "
            f"{args.rate:g} event/s, seed {args.seed}; load average {load0:.2f}"
        )
        for c in soak.ctrs:
            soak.sampler.add(c)
        mon = Monitor(ns)
        soak.sampler.start()
        mon.start()
        counts: Counter[str] = Counter()
        kinds, weights = list(WEIGHTS), list(WEIGHTS.values())
        t0 = time.monotonic()
        end = t0 + args.minutes * 60
        next_report = t0 + 60
        while time.monotonic() < end:
            event = rng.choices(kinds, weights)[0]
            soak.do(event)
            counts[event] += 1
            time.sleep(min(max(0.0, end - time.monotonic()), rng.expovariate(args.rate)))
            if time.monotonic() > next_report:
                if args.memtrace and next_report == t0 + 60:
                    ns.systemctl("kill", "--signal=SIGUSR2", SERVICE, check=False)
                next_report += 60
                last = mon.samples[-1] if mon.samples else None
                print(
                    f"  ... {(time.monotonic() - t0) / 60:.0f} min, {sum(counts.values())} "
                    f"events, {len(soak.sampler.losses)} losses, "
                    f"passes {status(ns).get('passes')}, "
                    f"RSS {last.rss_kb / 1024 if last else 0:.1f} MB, fds {last.fds if last else 0}"
                )
        seconds = time.monotonic() - t0
        _settle_quietly(ns)
        time.sleep(0.5)  # the sampler's last sweeps
        soak.sampler.finish()
        mon.stopping.set()
        mon.join()
        report(soak, mon, seconds, counts)
        if args.memtrace:
            memtrace_report(ns)
        print(f"load average: {load0:.2f} at start, {os.getloadavg()[0]:.2f} at end")
    finally:
        for ns in made:
            ns.stop()
        shutil.rmtree(work, ignore_errors=True)
    return 0


MEMTRACE_UNIT = "gpuguard.service.d/60-memtrace.conf"
MEMTRACE_DROPIN = (
    f"[Service]\nExecStart=\nExecStart={REPO}/.venv/bin/python {REPO}/bench/memtrace.py daemon\n"
    "Environment=GPUGUARD_MEMTRACE_DIR=/var/lib/gpuguard/memtrace\n"
)


def memtrace_report(ns: SystemdNamespace) -> None:
    """What grew in the daemon between the snapshot at minute 1 and one taken now."""
    snaps = ns.path("/var/lib/gpuguard/memtrace")
    ns.systemctl("kill", "--signal=SIGUSR2", SERVICE, check=False)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not (snaps / "snap-1.pickle").exists():
        time.sleep(0.5)
    time.sleep(2)  # written in one go, but give a big snapshot time to land
    try:
        print("memory growth by line (tracemalloc, minute 1 to the end):")
        print("\n".join(memtrace.compare(snaps / "snap-0.pickle", snaps / "snap-1.pickle")))
    except (OSError, EOFError) as e:
        print(f"no tracemalloc snapshots to compare: {e}")


def _settle_quietly(ns: SystemdNamespace) -> None:
    try:
        settle(ns, timeout=30)
    except AssertionError:
        print("gpuguard did not go quiet within 30 s of the last event")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
