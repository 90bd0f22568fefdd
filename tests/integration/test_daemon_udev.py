"""uevent -> the real daemon -> one pass, end to end.

The daemon (``gpuguard daemon``, a real process, udev NOT disabled) runs in the private
network namespace of a sandboxed real systemd-udevd (harness/udevd.py). Fabricated
NVIDIA uevents are injected through the kernel in that namespace, so no listener on
the host sees them; udevd applies the repo's unmodified rules file and relays them.
The daemon's root prefix is a temporary directory, so its status file lands there
and is how the test sees its passes.

Two flavours, picked the way the daemon picks them (``_start_udev``):
- "udev": ROOT/run/udev/control exists, so the daemon listens to udevd's relay;
- "kernel": it does not, so the daemon takes the raw kernel uevents.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any, Dict, Iterator, List

import pytest

from conftest import REPO, require_root, require_tool
from gpuguard.steps.events import EventKind
from gpuguard.steps.registry import woken_by
from integration.gpuguard_ns import GPUGUARD, INVENTORY, setup_node
from integration.harness.udevd import UDEVADM, UDEVD, Udevd, UeventInjector, in_netns

pytestmark = pytest.mark.root

# the steps each kind of uevent wakes (the registry's declarations)
ALL_RECONCILERS = woken_by(EventKind.NVIDIA_PCI)
MODULE_RECONCILERS = woken_by(EventKind.NVIDIA_MODULE)

RULES_FILE = REPO / "udev-rules" / "71-gpuguard.rules"
NVIDIA_PCI = {"PCI_ID": "10DE:2330"}
GPU_FUNCTIONS = [f"/devices/pci0000:00/0000:00:0{i}.0/0000:{0x18 + i:02x}:00.0" for i in range(8)]
MODULES = ["nvidia", "nvidia_modeset", "nvidia_uvm", "nvidia_drm"]


class _Dir:
    """What gpuguard_ns.setup_node needs of a namespace: path() under a root."""

    def __init__(self, base: Path) -> None:
        self.base = base

    def path(self, p: str) -> Path:
        return self.base / p.lstrip("/")


class RunningDaemon:
    def __init__(self, root: Path, proc: subprocess.Popen[bytes], log: Path, source: str):
        self.root = root
        self.proc = proc
        self.log_path = log
        self.source = source
        self.injector: UeventInjector

    def status(self) -> Dict[str, Any]:
        try:
            return dict(json.loads((self.root / "run/gpuguard/status.json").read_text()))
        except (OSError, ValueError):
            return {}

    def passes(self) -> int:
        return int(self.status().get("passes", 0))

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-6000:]

    def wait_for(self, cond: Any, what: str, timeout: float = 15.0) -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"daemon exited {self.proc.returncode}:\n{self.log()}")
            value = cond()
            if value:
                return value
            time.sleep(0.01)
        raise AssertionError(f"timed out waiting for {what}:\n{self.log()}")

    def settle(self, quiet: float = 0.8, timeout: float = 20.0) -> int:
        """Wait until no pass ran for `quiet` seconds (well above the 150 ms quiet
        period and the 5 ms urgent one); return the pass count."""
        last, since = self.passes(), time.monotonic()
        deadline = since + timeout
        while time.monotonic() < deadline:
            time.sleep(0.02)
            now = self.passes()
            if now != last:
                last, since = now, time.monotonic()
            elif time.monotonic() - since >= quiet:
                return now
        raise AssertionError(f"the daemon never went quiet:\n{self.log()}")


@pytest.fixture(params=["udev", "kernel"])
def daemon(request: Any, tmp_path: Path) -> Iterator[RunningDaemon]:
    require_root()
    require_tool(UDEVD, UDEVADM, "setpriv", "unshare", "nsenter", str(GPUGUARD))
    source = str(request.param)
    root = tmp_path / "root"
    setup_node(_Dir(root), stale=False)  # a checkpoint that matches: passes change nothing
    inventory = root / "etc/gpuguard/inventory.json"
    assert json.loads(inventory.read_text()) == INVENTORY
    if source == "udev":
        # What the daemon looks at to pick udevd's relay (the socket itself is udevd's).
        (root / "run/udev").mkdir(parents=True)
        (root / "run/udev/control").touch()
    with Udevd(tmp_path / "udevd", {RULES_FILE.name: RULES_FILE.read_text()}, net=True) as udevd:
        log = tmp_path / "daemon.log"
        argv = ["setpriv", "--pdeathsig", "KILL", "nsenter", f"--net=/proc/{udevd.pid}/ns/net"]
        argv += [str(GPUGUARD), "daemon", "--root", str(root), "--inventory", str(inventory)]
        argv += ["--log-json", "--log-level", "debug"]
        env = {k: v for k, v in os.environ.items() if not k.startswith(("NOTIFY_", "WATCHDOG_"))}
        env.pop("JOURNAL_STREAM", None)
        with open(log, "wb") as out:
            # nsenter --net only: it execs the daemon, so proc.pid is the daemon.
            proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env)
        d = RunningDaemon(root, proc, log, source)
        try:
            d.wait_for(lambda: d.passes() >= 1, "the start-up pass")
            assert d.status()["first_pass"]["reasons"] == ["start-up"]
            d.wait_for(
                lambda: f"monitoring {source} events" in d.log_path.read_text(),
                f"the daemon to listen to {source} uevents",
            )
            with in_netns(udevd.pid):
                d.injector = UeventInjector()
            try:
                yield d
            finally:
                d.injector.close()
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        assert proc.returncode == 0, d.log()
        assert udevd.ping(), udevd.log()


def test_nvidia_module_add_runs_one_pass_naming_it(daemon: RunningDaemon) -> None:
    before = daemon.settle()
    # Negative control: a module the rules and the classifier ignore runs nothing.
    daemon.injector.send("add", "/module/loop", "module")
    assert daemon.settle() == before

    sent = time.time()
    daemon.injector.send("add", "/module/nvidia", "module")
    daemon.wait_for(lambda: daemon.passes() > before, "a pass after the uevent")
    assert daemon.settle() == before + 1, "one uevent, more than one pass"
    last = daemon.status()["last_pass"]
    assert last["reasons"] == ["udev: module nvidia add"]
    assert last["reconcilers"] == sorted(MODULE_RECONCILERS)
    # An "add" is urgent: the pass starts after the 5 ms urgent quiet period, not 150 ms.
    assert last["started"] - sent < 2.0, f"pass started {last['started'] - sent:.3f}s later"


def _driver_reload() -> List[tuple[str, str, str, Dict[str, str]]]:
    """50 uevents of an 8-GPU driver reload: unbind/remove, modules out and in, re-add."""
    ev: List[tuple[str, str, str, Dict[str, str]]] = []
    ev += [("unbind", g, "pci", NVIDIA_PCI) for g in GPU_FUNCTIONS]
    ev += [("remove", f"/module/{m}", "module", {}) for m in reversed(MODULES)]
    ev += [("remove", g, "pci", NVIDIA_PCI) for g in GPU_FUNCTIONS]
    ev += [("add", g, "pci", NVIDIA_PCI) for g in GPU_FUNCTIONS]
    ev += [("add", f"/module/{m}", "module", {}) for m in MODULES]
    ev += [("bind", g, "pci", {**NVIDIA_PCI, "DRIVER": "nvidia"}) for g in GPU_FUNCTIONS]
    ev += [("change", g, "pci", NVIDIA_PCI) for g in GPU_FUNCTIONS]
    ev += [("change", f"/module/{m}", "module", {}) for m in ("nvidia", "nvidia_uvm")]
    assert len(ev) == 50
    return ev


def test_burst_of_50_uevents_gives_one_pass(daemon: RunningDaemon) -> None:
    before = daemon.settle()
    for action, devpath, subsystem, props in _driver_reload():
        daemon.injector.send(action, devpath, subsystem, **props)
    daemon.wait_for(lambda: daemon.passes() > before, "a pass after the burst")
    after = daemon.settle()
    last = daemon.status()["last_pass"]
    print(f"\n{daemon.source}: 50 uevents, first mark -> pass start {last['first_mark_age_ms']} ms")
    assert after == before + 1, f"50 uevents gave {after - before} passes; last: {last}"
    assert last["reconcilers"] == sorted(ALL_RECONCILERS)
    assert len(last["reasons"]) == 8  # a sample of the burst
    assert all(r.startswith("udev: ") for r in last["reasons"]), last["reasons"]
