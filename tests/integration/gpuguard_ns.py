"""A systemd namespace with gpuguard set up the way a host has it, from the repo's files.

The repo's own units/gpuguard.service runs the daemon (a drop-in only points ExecStart=
at this checkout's venv), with a configuration and an inventory file standing in for
NVML. A fake kubelet.service records the checkpoint it reads at start-up; it gets the
repo's kubelet drop-in with the hook path pointed at this checkout.
"""

from __future__ import annotations

import contextlib
import json
import time
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional

from conftest import CHECKPOINTS, REPO
from integration.harness import SystemdNamespace

GPUGUARD = REPO / ".venv/bin/gpuguard"
CHECKPOINT = "/var/lib/kubelet/device-plugins/kubelet_internal_checkpoint"
FIXTURE = CHECKPOINTS / "numa-blog-04.json"
KEPT_GPU = "GPU-77a702db-e37f-3a74-d46d-c5713f66058c"
MOVED_GPU = "GPU-c1e9f249-b37b-81c2-a8d9-ba5ca0294841"

# The node after an instance replacement: pod B's two GPUs came back with new UUIDs
# (with one of them still present, its entry would be kept, not dropped, without history).
INVENTORY = {
    "gpus": [
        {"uuid": KEPT_GPU, "index": 0, "minor": 0, "pci_bus_id": "00000000:3B:00.0"},
        {
            "uuid": "GPU-0b341c59-f96b-ba85-c137-78c3652fea65",
            "index": 1,
            "minor": 1,
            "pci_bus_id": "00000000:86:00.0",
        },
        {
            "uuid": "GPU-5d3e2a10-7c4b-4f0e-9a61-2b8e4c1d7f93",
            "index": 2,
            "minor": 2,
            "pci_bus_id": "00000000:AF:00.0",
        },
    ]
}

# The same slots before that replacement: the GPUs numa-blog-04 was written under, so a
# daemon started with these records them as the history's generation and remaps pod B.
BEFORE_CHANGE = {
    "gpus": [
        INVENTORY["gpus"][0],
        {**INVENTORY["gpus"][1], "uuid": "GPU-9b341c59-f96b-ba85-c137-78c3652fea65"},
        {**INVENTORY["gpus"][2], "uuid": MOVED_GPU},
    ]
}

FAKE_KUBELET = f"""[Unit]
Description=fake kubelet: records the device checkpoint it reads at start-up
[Service]
ExecStart=/bin/sh -c 'mkdir -p /var/lib/fake-kubelet; cd /var/lib/fake-kubelet; \\
  cat {CHECKPOINT} > .partial 2>/dev/null; mv .partial read-$(date +%%s%%N); exec sleep infinity'
"""


def gpuguard_units(config: str = "") -> Dict[str, str]:
    unit = (REPO / "units/gpuguard.service").read_text()
    dropin = (REPO / "units/kubelet.service.d/10-gpuguard.conf").read_text()
    hook = "/usr/libexec/gpuguard/kubelet-pre-start"
    assert hook in dropin
    return {
        "gpuguard.service": unit,
        # Only the binary's path differs from a packaged host. The unit's PrivateTmp= and
        # ProtectHome= would hide a checkout under /tmp or /root, so it is bound in.
        "gpuguard.service.d/50-checkout.conf": (
            f"[Service]\nExecStart=\nExecStart={GPUGUARD} daemon\nBindReadOnlyPaths={REPO}\n"
            f"ExecReload=\nExecReload={GPUGUARD} config --check\n"
            "ExecReload=/bin/kill -HUP $MAINPID\n"
        ),
        "kubelet.service": FAKE_KUBELET,
        "kubelet.service.d/10-gpuguard.conf": dropin.replace(
            hook, str(REPO / "hooks/kubelet-pre-start")
        ),
        "kubelet.service.d/50-checkout.conf": f"[Service]\nEnvironment=GPUGUARD={GPUGUARD}\n",
    }


def setup_node(ns: SystemdNamespace, *, stale: bool, config: str = "") -> None:
    """Checkpoint (stale or already matching), inventory and config inside `ns`."""
    ckpt = ns.path(CHECKPOINT)
    ckpt.parent.mkdir(parents=True, exist_ok=True)
    data = FIXTURE.read_bytes()
    if not stale:
        from gpuguard.checkpoint import marshal, parse
        from gpuguard.host.inventory import parse_inventory
        from gpuguard.steps.checkpoint.reconcile import analyse

        inv = parse_inventory(INVENTORY, source="test")
        repaired = analyse(parse(data, source="fixture"), inv, ("nvidia.com/gpu",)).repaired
        assert repaired is not None
        data = marshal(repaired)
    ckpt.write_bytes(data)
    etc = ns.path("/etc/gpuguard")
    etc.mkdir(parents=True, exist_ok=True)
    (etc / "inventory.json").write_text(json.dumps(INVENTORY))
    (etc / "gpuguard.conf").write_text("[Inventory]\nFile=/etc/gpuguard/inventory.json\n" + config)


def status(ns: SystemdNamespace) -> Dict[str, Any]:
    p = ns.path("/run/gpuguard/status.json")
    try:
        return dict(json.loads(p.read_text()))
    except (OSError, ValueError):
        return {}


def passes(ns: SystemdNamespace) -> int:
    return int(status(ns).get("passes", 0))


def wait_for(cond: Callable[[], Any], timeout: float = 15.0, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


@contextlib.contextmanager
def paused(ns: SystemdNamespace) -> Iterator[None]:
    """The daemon stopped (SIGSTOP) while a test makes a loss and checks that it is
    there: a periodic audit could repair it in between (AuditInterval=1s in some tests)."""
    assert ns.systemctl("kill", "-s", "STOP", "gpuguard.service").returncode == 0
    try:
        yield
    finally:
        ns.systemctl("kill", "-s", "CONT", "gpuguard.service")


def settle(ns: SystemdNamespace, quiet: float = 0.6, timeout: float = 15.0) -> int:
    """Wait until no new pass has run for `quiet` seconds; return the pass count."""
    deadline = time.monotonic() + timeout
    last, since = passes(ns), time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.05)
        now = passes(ns)
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet:
            return now
    raise AssertionError("gpuguard never went quiet")


def start_gpuguard(ns: SystemdNamespace) -> int:
    """Start the daemon and wait until its passes have settled; return the pass count."""
    assert ns.systemctl("start", "gpuguard.service").returncode == 0
    return settle(ns)


def events(ns: SystemdNamespace, kind: Optional[str] = None) -> List[Mapping[str, Any]]:
    out = [e for e in ns.journal("gpuguard.service") if "GPUGUARD_KIND" in e]
    return [e for e in out if kind is None or e["GPUGUARD_KIND"] == kind]


def bus_connections(ns: SystemdNamespace) -> int:
    """gpuguard's `dbus-connected` entries for the system bus (the private socket's, at
    start-up, say VIA=private-socket)."""
    return sum(e.get("VIA") != "private-socket" for e in events(ns, "dbus-connected"))


def kubelet_reads(ns: SystemdNamespace) -> List[bytes]:
    d = ns.path("/var/lib/fake-kubelet")
    if not d.exists():
        return []
    # each read appears whole (written as .partial, then renamed): never half a file
    return [p.read_bytes() for p in sorted(d.glob("read-*"))]


def gpuguard_ns(factory: Callable[..., SystemdNamespace], **kwargs: Any) -> SystemdNamespace:
    return factory(units=gpuguard_units(), **kwargs)
