#!/usr/bin/env python3
"""Benchmark gpuguard's container_access step on a real systemd with many GPU containers.

GPU "containers" are kubepods scopes in the test harness's systemd namespace
(tests/integration/gpu_scopes.py: each a ``cri-containerd-<id>.scope`` whose process
has its own /dev of fake nodes, granted behind systemd's back as the legacy NVIDIA
hook does: a devices.allow write on cgroup v1, a device program of its own replacing
systemd's on v2, ``--layout v2``). The daemon runs from the repo's unit. Whether a
container has its GPU is read from devices.list on v1 and asked of the kernel on v2 (a
helper process per container, inside its cgroup, opens the fake GPU node: EPERM or
ENXIO). Prints figures, asserts nothing:

  (a) start -> durable grant: from a scope's start (systemd's "Started" journal entry)
      to gpuguard's unit-device-allow journal entry for it (same journal, same clock),
      with N containers started about 16 at a time. Split: the exposure window (the
      container on its own /dev, stamped by its process: from then on it runs with its
      GPU and a reload would take it away -> gpuguard's drop-in written, its mtime:
      durable against a reload; -> systemd answered), the harness's own start time,
      and systemd's answer to a bare GetUnit every 20 ms meanwhile (the floor under a
      grant's reply); then the daemon's own view of its new-scope fast path (status
      file: first try, ready, granted after the announcement).
  (b) N containers x --reloads daemon-reloads, durable grants in place: how many
      container-reloads found a container without its GPU rule right after
      ``systemctl daemon-reload`` returned (target 0). A miss that comes back by
      itself within 2 s with no re-grant by gpuguard is systemd's own re-apply window
      (deny all, then each allow), counted apart from real losses (= re-grants by
      gpuguard, from the cgroup-v1-allow journal count).
  (c) N NEW scopes created behind gpuguard's back, not yet durable: from ``systemctl
      daemon-reload`` returning to every container's access restored (all N polled
      back to back), and to the end of the repair pass (last_pass.ended in
      /run/gpuguard/status.json), p50/p99 over --fast-reloads reloads. v1: the fast
      path only (DurableGrants=no: the devices.allow write). v2: the repair is the
      scope's DeviceAllow= (systemd rebuilds the program), so DurableGrants=yes and
      before each reload every scope's DeviceAllow= is reset to /dev/null alone and the
      hook's program attached again: each reload finds N containers not yet durable.
      Target p99 < 10 ms. Then where the time goes: systemd's Reloading(false) at
      gpuguard, gpuguard's first and last write (its status file), the repair pass's
      start; with `--observers signal` also at two bare D-Bus client processes
      (Reloading only; also UnitNew) and on systemd's private socket. Those three read
      the reload's signals in the very window measured, so they are left out unless
      asked for.
  (d) one full audit pass with nothing to repair (SIGHUP-triggered, all reconcilers):
      last_pass.duration_ms / N. Target < 2 ms per container.

Needs root. Usage:

  sudo .venv/bin/python bench/bench_container_access.py              # 200 x 1000, v1
  sudo .venv/bin/python bench/bench_container_access.py --layout v2  # the same on v2
  sudo .venv/bin/python bench/bench_container_access.py --quick      # 50, 50 reloads
  sudo .venv/bin/python bench/bench_container_access.py --containers 5 --reloads 5
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import hashlib
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "src"))

from gpuguard.actuate.dropins import dropin_path  # noqa: E402
from integration.gpu_access import Access  # noqa: E402
from integration.gpu_scopes import (  # noqa: E402
    Container,
    containers,
    fake_proc_devices,
    gpu_inventory,
    make_dev_dir,
    start,
)
from integration.gpuguard_ns import events, gpuguard_units, passes, settle, status  # noqa: E402
from integration.harness import SystemdNamespace  # noqa: E402
from integration.harness.sysns import host_hierarchies  # noqa: E402

DURABLE_P99_TARGET_MS = 1000.0
FAST_P99_TARGET_MS = 10.0
PASS_PER_CONTAINER_TARGET_MS = 2.0
STARTED_MSG = "39f53479d3a045ac8e11786248231fbf"  # systemd: a unit's start job done


def percentile(values: Sequence[float], q: float) -> float:
    s = sorted(values)
    return s[max(0, math.ceil(q / 100 * len(s)) - 1)] if s else float("nan")


def fmt(values: Sequence[float]) -> str:
    if not values:
        return "n/a"
    return (
        f"p50 {percentile(values, 50):7.1f} ms  p99 {percentile(values, 99):7.1f} ms  "
        f"max {max(values):7.1f} ms  (n={len(values)})"
    )


def config(durable: bool) -> str:
    return (
        "[Inventory]\nFile=/etc/gpuguard/inventory.json\n"
        f"[Devices]\nDurableGrants={'yes' if durable else 'no'}\n"
    )


def write_config(ns: SystemdNamespace, durable: bool) -> None:
    (ns.path("/etc/gpuguard") / "gpuguard.conf").write_text(config(durable))


def regrants(ns: SystemdNamespace) -> List[Any]:
    """gpuguard's re-grants so far: devices.allow writes on v1; on v2 (durable grants
    already in place) a DeviceAllow= or a program replacement."""
    if ns.layout == "v1":
        return events(ns, "cgroup-v1-allow")
    return events(ns, "unit-device-allow") + events(ns, "v2-program-replace")


def undo_durable(ns: SystemdNamespace, ctrs: Sequence[Container]) -> None:
    """v2: make each scope not durable again (gpuguard's drop-in removed, DeviceAllow=
    back to /dev/null alone, which rebuilds systemd's program without the GPU) and grant
    the GPU again with the hook's own program, so the next reload wipes it as it wipes a
    new container's."""
    for c in ctrs:
        ns.path(dropin_path(c.unit)).unlink(missing_ok=True)
    script = "".join(
        f"systemctl set-property --runtime {c.unit} DeviceAllow= 'DeviceAllow=/dev/null rw'\n"
        for c in ctrs
    )
    ns.run(["sh", "-c", script], check=True, timeout=300)
    for c in ctrs:
        c.hook_grant(ns)


def start_all(
    ns: SystemdNamespace, ctrs: Sequence[Container], workers: int = 16
) -> Tuple[float, Dict[str, int]]:
    """Start every container, `workers` at a time: the time it took, and when each
    container's process got its own /dev (realtime us, the journal's clock)."""
    t0 = time.monotonic()
    with ThreadPoolExecutor(workers) as ex:
        ready = dict(zip((c.unit for c in ctrs), ex.map(lambda c: start(ns, c), ctrs)))
    return time.monotonic() - t0, ready


def sighup_pass(ns: SystemdNamespace) -> Dict[str, Any]:
    """A full pass (every reconciler) with nothing new: SIGHUP = configuration reload."""
    n = settle(ns)
    ns.systemctl("reload", "gpuguard.service")
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        last = status(ns).get("last_pass", {})
        if last.get("number", 0) > n and any("configuration" in r for r in last["reasons"]):
            return dict(last)
        time.sleep(0.02)
    raise RuntimeError("no pass after SIGHUP")


def part_a(ns: SystemdNamespace, ctrs: Sequence[Container]) -> None:
    ping = ns.popen(
        [sys.executable, "-c", PING_CLIENT, "unix:path=/run/dbus/system_bus_socket"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert ping.stdin is not None and ping.stdout is not None
    assert ping.stdout.readline().strip() == "ready"
    took, ready = start_all(ns, ctrs)
    ping.stdin.close()
    answered = [float(line) for line in ping.stdout]
    ping.wait(10)
    units = {c.unit for c in ctrs}
    deadline = time.monotonic() + 120
    granted: Dict[str, int] = {}
    while time.monotonic() < deadline:
        for e in events(ns, "unit-device-allow"):
            if e.get("UNIT") in units:
                granted.setdefault(e["UNIT"], int(e["__REALTIME_TIMESTAMP"]))
        if len(granted) == len(units):
            break
        time.sleep(0.2)
    started: Dict[str, int] = {}
    for e in ns.journal():
        if e.get("MESSAGE_ID") == STARTED_MSG and e.get("UNIT") in units:
            started[e["UNIT"]] = int(e["__REALTIME_TIMESTAMP"])
    lat = [(granted[u] - started[u]) / 1000 for u in units if u in granted and u in started]
    exposed = [(granted[u] - ready[u]) / 1000 for u in units if u in granted]
    written: Dict[str, int] = {}  # gpuguard's drop-in: durable against a reload from then
    for u in units:
        with contextlib.suppress(OSError):
            written[u] = ns.path(dropin_path(u)).stat().st_mtime_ns // 1000
    print(f"(a) {len(ctrs)} scopes started in {took:.1f} s (16 systemd-run at a time)")
    print(f"    start -> durable DeviceAllow=: {fmt(lat)}")
    print(
        f"    on its own /dev (a GPU container) -> gpuguard's drop-in written (durable "
        f"against a reload): {fmt([(written[u] - ready[u]) / 1000 for u in written])}"
    )
    print(f"    on its own /dev -> systemd answered the grant: {fmt(exposed)}")  # fmt: skip
    print(f"    systemd's answer to a bare GetUnit meanwhile (every 20 ms): {fmt(answered)}")
    print(f"    start -> on its own /dev (the harness): "
          f"{fmt([(ready[u] - started[u]) / 1000 for u in units if u in started])}")  # fmt: skip
    print(f"    containers without a durable grant after 120 s: {len(units) - len(granted)}")
    settle(ns)
    fast = status(ns).get("fast_paths", {}).get("new_scopes", {})
    if fast:  # the daemon's own view, from systemd's announcement (the last 256 grants)
        print(f"    daemon's fast path: {fast.get('granted')} granted, at most "
              f"{fast.get('peak_in_flight')} at once; after the announcement, p50/p99 ms: "
              f"first try {fast.get('first_try_ms')}, ready {fast.get('ready_ms')}, "
              f"granted {fast.get('granted_ms')}; the grant's call alone (sent -> "
              f"systemd's reply) {fast.get('call_ms')}")  # fmt: skip


def part_b(ns: SystemdNamespace, acc: Access, ctrs: Sequence[Container], reloads: int) -> None:
    regrants0 = len(regrants(ns))
    missing, windows, reload_ms = 0, 0, []
    t_start = time.monotonic()
    for i in range(reloads):
        if i and i % 100 == 0:
            print(f"    ... {i} reloads, {time.monotonic() - t_start:.0f} s", flush=True)
        t0 = time.monotonic()
        ns.systemctl("daemon-reload")
        reload_ms.append((time.monotonic() - t0) * 1000)
        lacking = acc.lacking(ctrs)
        if lacking:
            missing += len(lacking)
            windows += 1
            deadline = time.monotonic() + 2
            while lacking and time.monotonic() < deadline:
                time.sleep(0.005)
                lacking = acc.lacking(lacking)
    settle(ns)
    new = regrants(ns)[regrants0:]
    lost = len(new)
    print(f"(b) {len(ctrs)} containers x {reloads} daemon-reloads (durable grants)")
    print(f"    daemon-reload itself: {fmt(reload_ms)}")
    print(f"    container-reloads without the GPU right after the reload returned: {missing}")
    print(f"      reloads where a check caught systemd mid-apply: {windows}")
    print(f"    real losses (re-granted by gpuguard): {lost}   (target 0)")
    for why in sorted({str(e.get("MESSAGE", ""))[:160] for e in new})[:3]:
        print(f"      e.g. {why}")


BARE_CLIENT = """
import asyncio, sys, time
from dbus_next import BusType, Message
from dbus_next.aio import MessageBus

async def main(address, members):
    bus = await MessageBus(bus_address=address, bus_type=BusType.SYSTEM).connect()
    for m in members:
        rule = ("type='signal',sender='org.freedesktop.systemd1',"
                f"interface='org.freedesktop.systemd1.Manager',member='{m}'")
        await bus.call(Message(destination="org.freedesktop.DBus", path="/org/freedesktop/DBus",
            interface="org.freedesktop.DBus", member="AddMatch", signature="s", body=[rule]))
    await bus.call(Message(destination="org.freedesktop.systemd1", path="/org/freedesktop/systemd1",
        interface="org.freedesktop.systemd1.Manager", member="Subscribe"))
    def on(msg):
        if msg.member == "Reloading" and msg.body == [False]:
            print(time.monotonic(), flush=True)
    bus.add_message_handler(on)
    print("ready", flush=True)
    await bus.wait_for_disconnect()

asyncio.run(main(sys.argv[1], sys.argv[2:]))
"""


# systemd's answer to a bare call while the burst starts (the floor of a grant's wait:
# systemd answers one call at a time, between the burst's scope starts): every 20 ms a
# GetUnit through the bus, as gpuguard calls; each round trip in ms, until stdin closes.
PING_CLIENT = """
import asyncio, sys, time
from dbus_next import BusType, Message
from dbus_next.aio import MessageBus

async def main(address):
    bus = await MessageBus(bus_address=address, bus_type=BusType.SYSTEM).connect()
    loop = asyncio.get_running_loop()
    done = loop.create_future()
    loop.add_reader(0, lambda: done.done() or done.set_result(None))
    print("ready", flush=True)
    while not done.done():
        t = time.monotonic()
        await bus.call(Message(destination="org.freedesktop.systemd1",
            path="/org/freedesktop/systemd1", interface="org.freedesktop.systemd1.Manager",
            member="GetUnit", signature="s", body=["init.scope"]))
        print((time.monotonic() - t) * 1000, flush=True)
        await asyncio.wait([done], timeout=0.02)

asyncio.run(main(sys.argv[1]))
"""


# The same on systemd's private socket (what systemctl itself uses): systemd writes every
# signal to each direct connection, no broker in between, and the signals it queued
# during the reload (a UnitNew per unit) ahead of Reloading(false); read with gpuguard's
# own header-only reader (sources/dbuswire.py, argv[2]: the repo's src).
PRIVATE_CLIENT = """
import os, socket, sys, time
sys.path.insert(0, sys.argv[2])
from gpuguard.sources.dbuswire import FIXED, auth_request, header, reloading
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.connect(sys.argv[1])
s.sendall(auth_request(os.getuid()))
line = b""
while not line.endswith(b"\\r\\n"):
    line += s.recv(1)
assert line.startswith(b"OK"), line
s.sendall(b"BEGIN\\r\\n")
print("ready", flush=True)
buf = bytearray()
while True:
    d = s.recv(1 << 20)
    if not d:
        sys.exit(0)
    buf += d
    off = 0
    while len(buf) - off >= FIXED:
        h = header(buf, off)
        if len(buf) - off < h.total:
            break
        if reloading(buf, h, off) is False:
            print(time.monotonic(), flush=True)
        off += h.total
    del buf[:off]
"""


class BareClient:
    """A D-Bus client process of its own that notes when systemd's Reloading(false)
    reaches it (its own clock reading: CLOCK_MONOTONIC, the daemon's and this process's
    too); subscribed to Reloading only, or also to UnitNew as gpuguard was before it
    stopped listening to UnitNew."""

    def __init__(
        self, address: str, *, unit_new: bool, inside: Optional[SystemdNamespace] = None
    ) -> None:
        import subprocess
        import threading

        members = ["Reloading", "UnitNew"] if unit_new else ["Reloading"]
        if inside is not None:  # on the private socket: systemd refuses a peer whose PID
            # it cannot see, so the client runs in the namespace (`address`: its path)
            argv = [sys.executable, "-c", PRIVATE_CLIENT, address, str(REPO / "src")]
            self.proc = inside.popen(argv, stdout=subprocess.PIPE, text=True)
        else:
            argv = [sys.executable, "-c", BARE_CLIENT, address, *members]
            self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        if self.proc.stdout.readline().strip() != "ready":
            raise RuntimeError("bare D-Bus client did not connect")
        self.times: List[float] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.times.append(float(line))

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()

    def after(self, n: int, timeout: float = 2.0) -> Optional[float]:
        """The arrival of the (n+1)th Reloading(false), waiting for it up to `timeout`."""
        deadline = time.monotonic() + timeout
        while len(self.times) <= n and time.monotonic() < deadline:
            time.sleep(0.002)
        return self.times[n] if len(self.times) > n else None


def why_stuck(ns: SystemdNamespace, c: Container) -> None:
    """What a container left without its GPU looks like: its scope, its cgroup's device
    programs (v2) or rules (v1), and gpuguard's last journal entries that name it."""
    show = ns.systemctl("show", "-p", "ActiveState", "-p", "DeviceAllow", c.unit, check=False)
    print(f"      scope: {' '.join(show.stdout.split())}")
    cg = c.cgroup(ns)
    if ns.layout == "v2":
        from integration.harness.bpfdev import programs

        try:
            print(f"      device programs: {programs(cg)}")
        except OSError as e:
            print(f"      device programs: unreadable ({e})")
    else:
        print(f"      devices.list: {c.devices_list(ns).splitlines()}")
    mine = [e for e in events(ns) if c.container_id[:12] in str(e.get("MESSAGE", ""))]
    for e in mine[-3:]:
        print(f"      gpuguard: {str(e.get('MESSAGE', ''))[:300]}")
    if not mine:
        print("      gpuguard: no journal entry names this container")


class NoClient:
    """Where the signal-timing clients are left out (`--observers none`)."""

    times: List[float] = []

    def after(self, n: int, timeout: float = 2.0) -> Optional[float]:
        return None

    def stop(self) -> None:
        pass


def part_c(
    ns: SystemdNamespace,
    acc: Access,
    ctrs: Sequence[Container],
    reloads: int,
    observers: bool = False,
) -> None:
    v1_0 = len(events(ns, "cgroup-v1-allow"))
    units_0 = len(events(ns, "unit-device-allow"))
    restored_ms, pass_end_ms, pass_ms, wiped = [], [], [], 0
    # Three processes that time systemd's Reloading(false): they read the signals during
    # the very window measured (the UnitNew one parses every unit's UnitNew with
    # dbus-next), competing for the CPUs with systemd and gpuguard
    bare: Any = NoClient()
    bare_un: Any = NoClient()
    private: Any = NoClient()
    if observers:
        bare = BareClient(ns.bus_address, unit_new=False)
        bare_un = BareClient(ns.bus_address, unit_new=True)
        private = BareClient("/run/systemd/private", unit_new=False, inside=ns)
    steps: Dict[str, List[float]] = {}  # breakdown: ms after systemctl returned
    stuck: set[str] = set()

    def note(what: str, t: Optional[float], t_ret: float) -> None:
        if t is not None:
            steps.setdefault(what, []).append((t - t_ret) * 1000)

    for _ in range(reloads):
        if ns.layout == "v2":
            undo_durable(ns, ctrs)
            settle(ns, quiet=0.3)
        n = passes(ns)
        seen, seen_un, seen_pr = len(bare.times), len(bare_un.times), len(private.times)
        ns.systemctl("daemon-reload")
        t_ret, w_ret = time.monotonic(), time.time()
        pending = acc.lacking(ctrs)
        wiped += len(pending)
        while pending and time.monotonic() - t_ret < 5:
            pending = acc.lacking(pending)
        restored_ms.append((time.monotonic() - t_ret) * 1000)
        for c in pending:  # never restored within the limit: say which and why, once each
            if c.unit not in stuck:
                stuck.add(c.unit)
                print(f"    not restored 5 s after a reload: {c.unit}")
                why_stuck(ns, c)
        deadline = time.monotonic() + 5
        while passes(ns) <= n and time.monotonic() < deadline:
            time.sleep(0.005)
        doc = status(ns)
        last = doc.get("last_pass", {})
        if last.get("number", 0) > n:
            pass_end_ms.append((last["ended"] - w_ret) * 1000)
            pass_ms.append(float(last["duration_ms"]))
            note("repair pass started", last["started"] - w_ret + t_ret, t_ret)
        t_bare = bare.after(seen)
        note("Reloading(false) at a bare client (Reloading only)", t_bare, t_ret)
        if t_bare is not None and restored_ms:  # measured from systemd's signal instead
            note("from the bare client's signal: every container restored",
                 t_ret + restored_ms[-1] / 1000, t_bare)  # fmt: skip
        note("Reloading(false) at a bare client (+ UnitNew)", bare_un.after(seen_un), t_ret)
        note("Reloading(false) on systemd's private socket", private.after(seen_pr), t_ret)
        fast = doc.get("fast_paths", {}).get("reload", {})
        for key, what in (
            ("signal", "Reloading(false) at gpuguard"),
            ("first_write", "gpuguard's first write"),
            ("last_write", "gpuguard's last write"),
        ):
            note(what, fast.get(key), t_ret)
        for key, what in (
            ("cpu_ms", "the fast path's loop thread on a CPU (ms, not a time)"),
            ("cpu_wait_ms", "the fast path's loop thread waiting for a CPU (ms)"),
        ):
            if fast.get(key) is not None:
                steps.setdefault(what, []).append(float(fast[key]))
        if fast.get("containers") is not None:
            steps.setdefault("containers repaired on the signal (count, not ms)", []).append(
                float(fast["containers"])
            )
        if fast.get("signal") is not None:
            note(
                "from the signal at gpuguard: its last write",
                fast.get("last_write"),
                fast["signal"],
            )
        settle(ns, quiet=0.3)
    how = "fast path only (DurableGrants=no)"
    if ns.layout == "v2":
        how = "not yet durable (DeviceAllow= reset, hook program before each reload)"
    print(f"(c) {how}, {len(ctrs)} new scopes, {reloads} reloads")
    print(f"    containers wiped right after the reload returned: {wiped / reloads:.0f} per reload")
    print(f"    reload returned -> every container restored: {fmt(restored_ms)}")
    print(f"    reload returned -> repair pass ended:        {fmt(pass_end_ms)}")
    print(f"    repair pass duration:                        {fmt(pass_ms)}")
    if ns.layout == "v2":
        made = collections.Counter(e["GPUGUARD_STATUS"] for e in events(ns, "v2-bridge-attach"))
        # the last reload's bridges are detached once systemd has applied its 200
        # DeviceAllow= (seconds after the reload): waited for, up to 20 s, before counting
        deadline = time.monotonic() + 20
        while True:
            gone = collections.Counter(e["GPUGUARD_STATUS"] for e in events(ns, "v2-bridge-detach"))
            if sum(gone.values()) >= made["done"] or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        print(f"    v2 bridges (all parts): attached {dict(made)}, detached {dict(gone)}")
        why = collections.Counter(
            e["MESSAGE"].split("[failed: ", 1)[-1].split(".scope: ", 1)[-1][:100]
            for e in events(ns, "v2-bridge-attach")
            if e["GPUGUARD_STATUS"] == "failed"
        )
        for reason, n in why.most_common(3):
            print(f"      failed {n}x: ...{reason}")
    bare.stop()
    bare_un.stop()
    private.stop()
    print("    breakdown, ms after `systemctl daemon-reload` returned (negative: before):")
    for what, values in steps.items():
        print(f"      {what:52s} {fmt(values)}")
    print(
        f"    target p99 < {FAST_P99_TARGET_MS:.0f} ms; direct re-grants: "
        f"{len(events(ns, 'cgroup-v1-allow')) - v1_0}, DeviceAllow= set: "
        f"{len(events(ns, 'unit-device-allow')) - units_0} "
        f"(expected {'0' if ns.layout == 'v1' else 'one per wiped container'})"
    )
    regrants = collections.Counter(
        e["GPUGUARD_STATUS"] for e in events(ns, "cgroup-v1-allow")[v1_0:]
    )
    if regrants:  # failed: written, but not admitted when read back
        print(f"    direct re-grants by outcome: {dict(regrants)}")


@contextlib.contextmanager
def in_cpu_group(ns: SystemdNamespace, enabled: bool) -> Iterator[None]:
    """The bench's own process (its poller) and what it forks meanwhile (the v2 probers,
    the signal clients) in the namespace's cpu cgroup for the block, then back. Left in
    the host's root cpu group, each of them weighs as much as the whole namespace there
    (systemd, dbus-daemon and gpuguard together) and gpuguard's nice counts for nothing
    against them; in the namespace's group they compete as a node's other processes
    compete with gpuguard (v2 harness: one group for all; v1: a group per service)."""
    dirs = ns.cgroup_dirs()
    key = next((k for k in dirs if "cpu" in k.split(",")), None)
    if not enabled or key is None:  # no v1 cpu hierarchy: nothing to move
        print("    the bench's processes: in the host's cpu group")
        yield
        return
    home = next(parent for name, _t, _o, parent in host_hierarchies() if name == key)
    (dirs[key] / "cgroup.procs").write_text(str(os.getpid()))
    print("    the bench's processes: in the namespace's cpu group")
    try:
        yield
    finally:  # back before the namespace is stopped: it removes its cgroups
        (home / "cgroup.procs").write_text(str(os.getpid()))


def part_d(ns: SystemdNamespace, n: int, runs: int) -> None:
    durations = [float(sighup_pass(ns)["duration_ms"]) for _ in range(runs)]
    per = [d / n for d in durations]
    print(f"(d) full audit pass, nothing to repair, {n} GPU containers: {fmt(durations)}")
    print(
        f"    per container: p50 {percentile(per, 50):.3f} ms  max {max(per):.3f} ms "
        f"(target < {PASS_PER_CONTAINER_TARGET_MS:g} ms)"
    )


def main(argv: Sequence[str] = ()) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--containers", type=int, default=None, help="GPU containers (200)")
    ap.add_argument("--reloads", type=int, default=None, help="reloads for (b) (1000)")
    ap.add_argument("--fast-reloads", type=int, default=None, help="reloads for (c) (30)")
    ap.add_argument("--quick", action="store_true", help="50 containers, 50+10 reloads")
    ap.add_argument("--skip", default="", help="parts to skip, e.g. 'bc'")
    ap.add_argument("--layout", choices=("v1", "v2"), default="v1", help="cgroup layout (v1)")
    ap.add_argument(
        "--observers",
        choices=("none", "signal"),
        default="none",
        help="(c): also run three processes timing systemd's Reloading(false) (signal: "
        "the breakdown's first rows; they compete for the CPUs in the window measured)",
    )
    ap.add_argument(
        "--bench-cpu",
        choices=("namespace", "host"),
        default="namespace",
        help="(c): where the bench's own processes (poller, probers) compete for the "
        "CPUs: in the namespace's cpu group, or in the host's root group, where each "
        "weighs as much as the whole namespace (the figures before this option)",
    )
    args = ap.parse_args(list(argv) or None)
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[attr-defined]
    # SIGTERM (e.g. timeout(1)) must still stop the namespace and remove its cgroups
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    n = args.containers or (50 if args.quick else 200)
    reloads = args.reloads if args.reloads is not None else (50 if args.quick else 1000)
    fast = args.fast_reloads
    if fast is None:  # --reloads N caps (c) too, so a tiny run stays tiny
        fast = min(10 if args.quick else 30, reloads if args.reloads is not None else 30)

    first = containers(n)
    second = [  # for (c): other pods and ids, started while DurableGrants=no
        Container(str(uuid.UUID(int=0xC000 + i)), hashlib.sha256(b"new%d" % i).hexdigest(), c.gpus)
        for i, c in enumerate(first)
    ]
    work = Path(tempfile.mkdtemp(prefix="gg-bench-ca-"))
    devdir = work / "ctrdev"
    devdir.mkdir()
    for c in [*first, *second]:
        make_dev_dir(devdir / c.container_id[:12], c.gpus)
    units = gpuguard_units()
    units["gpuguard.service.d/60-fake-driver.conf"] = (
        "[Service]\nBindReadOnlyPaths=/run/fake/devices:/proc/devices\n"
    )
    devices = fake_proc_devices(work / "devices")
    ns = SystemdNamespace(
        work / "ns",
        layout=args.layout,
        units=units,
        ro_binds={"/run/fake/devices": devices, "/proc/devices": devices, "/run/ctrdev": devdir},
        boot_timeout=60,
    )
    t0 = time.monotonic()
    ns.start()
    acc = Access(ns)
    try:
        etc = ns.path("/etc/gpuguard")
        etc.mkdir(parents=True, exist_ok=True)
        (etc / "inventory.json").write_text(json.dumps(gpu_inventory(2)))
        write_config(ns, durable=True)
        ns.systemctl("start", "gpuguard.service")
        settle(ns)
        print(
            f"gpuguard container_access bench: {n} GPU containers (scopes), systemd 252, "
            f"cgroup {args.layout}",
            flush=True,
        )
        part_a(ns, first)
        acc.add(first)
        if "d" not in args.skip:
            part_d(ns, n, 3 if args.quick else 10)
        if "b" not in args.skip:
            part_b(ns, acc, first, reloads)
        if "c" not in args.skip:
            acc.close()
            ns.systemctl("stop", *[c.unit for c in first])
            write_config(ns, durable=args.layout == "v2")
            sighup_pass(ns)
            start_all(ns, second)  # (c) times the reloads, not the starts
            settle(ns)
            with in_cpu_group(ns, args.bench_cpu == "namespace"):
                acc.add(second)
                part_c(ns, acc, second, fast, observers=args.observers == "signal")
                acc.close()  # the probers exit before the bench leaves the group
        crashed = events(ns, "reconciler-crashed")
        print(f"reconciler crashes: {len(crashed)}; total {time.monotonic() - t0:.0f} s")
    finally:
        acc.close()
        ns.stop()
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
