"""The package never takes a device away from a running GPU container: the .deb built by
packaging/build-deb, installed, upgraded (old build -> new build), reinstalled,
downgraded, removed and purged with apt-get in a booted Debian 12 root
(integration/pkgroot), on cgroup v1 and v2, in observe mode (the canary configuration,
written before the install) and in repair mode.

The container's GPU is granted the way the legacy NVIDIA hook grants it, behind
systemd's back; systemd 252 re-applies a scope's device policy at every daemon-reload,
and the package reloads at each of those operations (debhelper's snippets, its own
postinst). A sampler in the container's cgroup opens the container's GPU node every
20 ms through each operation and counts the kernel's verdicts (EPERM: denied; ENXIO:
admitted, there is no driver behind the node). Zero denials are expected. A control at
the end shows the sampler sees a denial: the drop-in removed by hand, a reload.

The metrics endpoint an operator turned on stays on: gpuguard-metrics.socket enabled
and started before the upgrade is active after it, and a scrape answers.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import time
from pathlib import Path
from typing import Dict, Iterator, Tuple

import pytest

from integration.gpu_scopes import NODES, Container, dev_binds, fake_proc_devices, gpu_inventory
from integration.gpu_scopes import start as start_container
from integration.gpuguard_ns import wait_for
from integration.pkgroot import (
    PackageRoot,
    built_packages,
    debian_root,
    require_pkgroot_tools,
    source_version,
)
from integration.test_fleet_ops import FAKE_DRIVER, apt, prometheus_client, write_unit

pytestmark = pytest.mark.root

UPGRADE = "+test1"  # as test_package_install and test_fleet_ops: one build per run
CTR = Container("0000b000-0000-0000-0000-00000000b000", "cd" * 32, (0,))
INTERVAL = 0.02
STOP = "/run/sampler.stop"
NODE_CONF = "[Inventory]\nFile=/etc/gpuguard/inventory.json\n[Daemon]\nAuditInterval=1s\n"
CASES = [("v1", "observe"), ("v1", "repair"), ("v2", "observe"), ("v2", "repair")]
#: The control: without `gpuguard protect` (DurableGrants=no keeps it from writing) the
#: package's own install takes the GPU, and the observe-only daemon leaves it so.
UNPROTECTED = "[Daemon]\nMode=observe\n[Devices]\nDurableGrants=no\n"
MODES = {"observe": "[Daemon]\nMode=observe\n", "repair": ""}

# Runs in the root: joins the container's devices cgroup (from its process's
# /proc/PID/cgroup: "devices" on v1, "0::" on v2, by the layout booted), then opens the
# container's GPU node through its process's root every INTERVAL until the stop file
# exists; prints the counts as JSON.
SAMPLER = r"""
import errno, json, os, sys, time
STOP = "/run/sampler.stop"
unit, node, interval, layout = sys.argv[1], sys.argv[2], float(sys.argv[3]), sys.argv[4]
pid = cg = None
for p in filter(str.isdigit, os.listdir("/proc")):
    try:
        lines = open(f"/proc/{p}/cgroup").read().splitlines()
        comm = open(f"/proc/{p}/comm").read().strip()
    except OSError:
        continue
    if comm == "sleep" and any(unit in line for line in lines):
        pid = p
        dev = [l.split(":", 2)[2] for l in lines if "devices" in l.split(":")[1].split(",")]
        v2 = [l.split(":", 2)[2] for l in lines if l.startswith("0::")]
        cg = "/sys/fs/cgroup/devices" + dev[0] if layout == "v1" else "/sys/fs/cgroup" + v2[0]
        break
assert pid is not None, "no container process"
with open(cg + "/cgroup.procs", "w") as f:
    f.write(str(os.getpid()))
path = f"/proc/{pid}/root/dev/{node}"
n = denied = other = 0
first = []
while not os.path.exists(STOP):
    try:
        os.close(os.open(path, os.O_RDWR))
        other += 1
    except OSError as e:
        if e.errno == errno.EPERM:
            denied += 1
            first.append(round(time.monotonic(), 3))
        elif e.errno != errno.ENXIO:
            other += 1
    n += 1
    if n == 1:
        print("ready", flush=True)
    time.sleep(interval)
print(json.dumps({"samples": n, "denied": denied, "other": other, "when": first[:5]}), flush=True)
"""


class Sampler:
    def __init__(self, ns: PackageRoot) -> None:
        self.ns = ns
        self.p = ns.popen(
            ["python3", "-c", SAMPLER, CTR.unit, "nvidia0", str(INTERVAL), ns.layout],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.p.stdout is not None
        assert self.p.stdout.readline().strip() == "ready", "the sampler did not start"

    def stop(self) -> Dict[str, object]:
        self.ns.path(STOP).touch()
        out, _ = self.p.communicate(timeout=30)
        self.ns.path(STOP).unlink()
        result: Dict[str, object] = json.loads(out.strip().splitlines()[-1])
        return result


def sampled(ns: PackageRoot, *argv: str) -> Tuple[Dict[str, object], str]:
    """apt-get ``argv`` with the sampler running (from before it until after it ended)."""
    s = Sampler(ns)
    time.sleep(0.2)
    out = apt(ns, *argv)
    time.sleep(0.5)  # what the reloads left behind settles
    return s.stop(), out


@contextlib.contextmanager
def booted(layout: str, tmp_path: Path) -> Iterator[PackageRoot]:
    """A booted Debian 12 root on ``layout`` with both builds at /run/host/debs."""
    require_pkgroot_tools()
    lower, _made = debian_root()
    debs = tmp_path / "debs"
    debs.mkdir()
    for suffix in ("", UPGRADE):
        deb = built_packages(suffix)["deb"]
        (debs / deb.name).write_bytes(deb.read_bytes())
    devices = fake_proc_devices(tmp_path / "devices")
    binds = {"/run/host/debs": debs, "/run/fake/devices": devices, "/proc/devices": devices}
    binds.update(dev_binds(tmp_path, [CTR]))
    binds.update(prometheus_client())
    ns = PackageRoot(tmp_path / "root", lower, layout=layout, ro_binds=binds)
    ns.start()
    try:
        yield ns
    finally:
        ns.stop()


@pytest.fixture(params=CASES, ids=["-".join(c) for c in CASES])
def node(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Tuple[PackageRoot, str]]:
    layout, mode = request.param
    with booted(layout, tmp_path) as ns:
        yield ns, mode


def prepare(ns: PackageRoot, mode_conf: str) -> Path:
    """The node as configuration management leaves it before the package: the driver's
    nodes, the inventory standing in for NVML, the mode (observe: fleet.md's canary);
    then a container granted its GPU by the hook. Returns its drop-in's host path."""
    for name, (ma, mi) in [("nvidia0", (195, 0)), *NODES.items()]:
        ns.run(["mknod", "-m", "666", f"/dev/{name}", "c", str(ma), str(mi)], check=True)
    etc = ns.path("/etc/gpuguard")
    (etc / "gpuguard.conf.d").mkdir(parents=True)
    (etc / "inventory.json").write_text(json.dumps(gpu_inventory(1)))
    (etc / "gpuguard.conf.d/10-node.conf").write_text(NODE_CONF)
    (etc / "gpuguard.conf.d/20-mode.conf").write_text(mode_conf)
    write_unit(ns, "gpuguard.service.d/60-fake-driver.conf", FAKE_DRIVER)
    ns.systemctl("daemon-reload")
    start_container(ns, CTR)  # the hook's grant, behind systemd's back
    dropin = ns.path(f"/run/systemd/system/{CTR.unit}.d/60-gpuguard-devices.conf")
    assert not dropin.exists()
    return dropin


def test_install_upgrade_remove_take_no_device(node: Tuple[PackageRoot, str]) -> None:
    ns, mode = node
    t0 = time.monotonic()
    dropin = prepare(ns, MODES[mode])
    old, new = (
        f"/run/host/debs/gpuguard_{source_version()}-1_all.deb",
        f"/run/host/debs/gpuguard_{source_version(UPGRADE)}-1_all.deb",
    )
    ops = [
        ("install", ("install", old)),
        ("upgrade", ("install", new)),
        ("reinstall", ("install", "--reinstall", new)),
        ("downgrade", ("install", "--allow-downgrades", old)),
        ("remove", ("remove", "gpuguard")),
        ("purge", ("purge", "gpuguard")),
    ]
    outputs = {}
    for op, argv in ops:
        if op == "upgrade":  # an operator turned the metrics endpoint on
            ns.systemctl("enable", "--now", "gpuguard-metrics.socket")
        result, outputs[op] = sampled(ns, *argv)
        print(f"\n{ns.layout} {mode} {op}: {result}")
        assert int(str(result["samples"])) >= 20, result
        assert result["denied"] == 0, (op, result, outputs[op])
        if op == "install":
            assert "made 1 grant(s) durable" in outputs[op], outputs[op]
            assert dropin.exists()
            t = time.monotonic()  # what each maintainer script's run costs (bench figure)
            res = ns.run(["gpuguard", "protect", "--dry-run"], check=True)
            print(f"gpuguard protect, 1 container: {time.monotonic() - t:.2f} s")
            assert "1 durable already" in res.stdout, res.stdout
        if op in ("upgrade", "reinstall", "downgrade"):  # debhelper stopped it first
            assert ns.unit_property("gpuguard-metrics.socket", "ActiveState") == "active", op
            scrape(ns)
    assert "kept 1 per-container drop-in(s)" in outputs["remove"], outputs["remove"]
    assert dropin.exists()
    entries = [e for e in ns.journal() if e.get("GPUGUARD_KIND") == "grant-protected"]
    assert entries and all(e.get("UNIT") == CTR.unit for e in entries)
    elapsed = time.monotonic() - t0
    if mode == "repair":  # the daemon's own SetUnitProperties: systemd holds the grant
        print(f"{ns.layout} {mode}: {elapsed:.1f} s")
        return
    # the control: without the drop-in, a reload takes the GPU (the sampler can fail)
    dropin.unlink()
    s = Sampler(ns)
    ns.systemctl("daemon-reload")
    time.sleep(0.3)
    control = s.stop()
    assert int(str(control["denied"])) > 0, control
    print(f"{ns.layout} {mode}: {elapsed:.1f} s; control (drop-in removed, reload): {control}")


@pytest.mark.parametrize("layout", ["v1", "v2"])
def test_without_protect_the_install_takes_the_gpu(layout: str, tmp_path: Path) -> None:
    """The control through the package itself: DurableGrants=no keeps `gpuguard protect`
    from writing, and the install's own daemon-reload takes the hook's grant away (the
    observe-only daemon leaves it so): what the test above would see without it."""
    with booted(layout, tmp_path) as ns:
        dropin = prepare(ns, UNPROTECTED)
        v = source_version()
        result, out = sampled(ns, "install", f"/run/host/debs/gpuguard_{v}-1_all.deb")
        print(f"\n{layout} observe, DurableGrants=no, install: {result}")
        assert "DurableGrants=no: nothing written" in out, out
        assert not dropin.exists()
        assert int(str(result["denied"])) > 0, result


def scrape(ns: PackageRoot) -> None:
    code = (
        "import urllib.request\n"
        "r = urllib.request.urlopen('http://127.0.0.1:9835/metrics', timeout=10)\n"
        "print(r.status, b'gpuguard_build_info' in r.read())"
    )
    res = wait_for(
        lambda: (r := ns.run(["python3", "-c", code], timeout=30)).returncode == 0 and r,
        timeout=20,
        what="a scrape after the upgrade",
    )
    assert res.stdout.split() == ["200", "True"], res
