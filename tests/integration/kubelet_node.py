"""A GPU node with the real kubelet (harness/kubelet.py), with or without gpuguard.

With gpuguard the node has what a host that installed the package has: the repo's
gpuguard.service running the daemon from this checkout, and its kubelet drop-in, so
the pre-start hook runs at every kubelet start (integration/gpuguard_ns.py); without,
kubelet.service has no drop-in at all. Either way the node has fake GPUs (nodes
``c 195 <minor>`` in the namespace's private /dev), NVIDIA's driver registration in
/proc/devices (integration/gpu_scopes.py), one inventory file that the device plugin
double, the runtime hook and gpuguard all read, and the plugin double as a host
service (``nvidia-device-plugin.service``) or as a privileged static pod.

A "reboot" (:meth:`GpuNode.reboot`) is what a node goes through when its instance is
restarted or replaced: kubelet, the plugin and gpuguard stop, every pod's processes
die, containerd starts again, the GPUs come back (maybe with other UUIDs, maybe fewer),
then gpuguard starts (ordered before kubelet), kubelet, and the plugin. With
``driver="late"`` it is a GPU Operator node's boot: the driver's root
(``/run/nvidia/driver``, the fake NVML library of tests/fakenvml naming the GPUs) and
the GPU list (the inventory file) appear :data:`DRIVER_DELAY` s after kubelet's start,
the plugin after them; until then gpuguard sees the GPUs only on the PCI bus (the
namespace's /sys/bus/pci/devices, fake functions bound over it: ``boot(pci=True)``).
"""

from __future__ import annotations

import json
import shutil
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

import pytest

import fakenvml
from fakenvml import FakeGpu
from gpuguard.checkpoint import parse
from gpuguard.devices.probe import probe_open
from integration.gpu_scopes import UVM_MAJOR, fake_proc_devices, gpu_inventory
from integration.gpuguard_ns import GPUGUARD, settle, wait_for
from integration.harness import SystemdNamespace, require_systemd_ns
from integration.harness.kubelet import (
    CHECKPOINT,
    CONTAINERD_UNIT,
    LOG,
    MANIFESTS,
    REQUIRED_TOOLS,
    Container,
    KubeletNode,
    api_code,
    kubelet_of,
    kubelet_unit,
    prepare,
)
from integration.harness.kubelet_versions import Kubelet
from integration.harness.pods import INVENTORY, busybox_pod
from integration.harness.sysns import REPO
from integration.kubelet_sites import HostSite, NsFactory, Site, site, stack_versions

PLUGIN = "nvidia-device-plugin.service"
READMIT = "gpuguard-readmit.service"


def readmit_units() -> Dict[str, str]:
    """The repo's gpuguard-readmit.service, run from this checkout (gpuguard.service
    pulls it in, as on a host that installed the package)."""
    return {
        READMIT: (REPO / "units" / READMIT).read_text(),
        f"{READMIT}.d/50-checkout.conf": (
            f"[Service]\nExecStart=\nExecStart={GPUGUARD} readmit\nBindReadOnlyPaths={REPO}\n"
        ),
    }


# The inventory file stands in for NVML on this node: gpuguard may restart its kubelet
# as it would on a real one (a configured file alone never lets it: docs/inventory.md)
CONFIG = "[Inventory]\nFile=/etc/gpuguard/inventory.json\nAllowKubeletRestart=yes\n"


# The GPU Operator's layout after a reboot (GpuNode.reboot(driver="late")): gpuguard
# reads NVML from the driver container's root, nothing else tells it the GPUs
DRIVER_ROOT = "/run/nvidia/driver"
DRIVER_LIB = "usr/lib/x86_64-linux-gnu"
OPERATOR_CONFIG = f"[Inventory]\nDriverRoot={DRIVER_ROOT}\n"
DRIVER_DELAY = 8.0  # seconds from kubelet's start to the driver's arrival
# where the GPU list waits, out of the plugin's and the runtime hook's sight
LATE_INVENTORY = "/etc/gpuguard/.inventory.late"


def fake_pci(base: Path, n: int) -> Path:
    """The ``n`` GPUs of :func:`gpus`' slots as sysfs lists them with no driver bound
    (3D controllers, NVIDIA's vendor ID), plus a host bridge."""
    pci = base / "pci-devices"
    functions = [("0000:00:00.0", "0x8086", "0x060000")]
    for g in gpu_inventory(n)["gpus"]:
        functions.append((str(g["pci_bus_id"])[4:].lower(), "0x10de", "0x030200"))
    for address, vendor, klass in functions:
        d = pci / address
        d.mkdir(parents=True)
        (d / "vendor").write_text(vendor + "\n")
        (d / "class").write_text(klass + "\n")
        (d / "device").write_text("0x2330\n")
    return pci


def gpus(n: int) -> List[Dict[str, Any]]:
    """``n`` GPUs in slots 0..n-1 (gpu_scopes' layout), each with a UUID of this boot."""
    return [{**g, "uuid": f"GPU-{uuid.uuid4()}"} for g in gpu_inventory(n)["gpus"]]


def gpu_pod(name: str, n: int = 1, **limits: Any) -> Dict[str, Any]:
    """A static pod holding ``n`` GPUs; its UID derived from its name (stable)."""
    uid = str(uuid.uuid5(uuid.NAMESPACE_DNS, f"{name}.gpuguard.test"))
    return busybox_pod(name, uid, {"nvidia.com/gpu": n, **limits})


class GpuNode(KubeletNode):
    """The kubelet node with its GPUs, plugin, gpuguard (or not), and reboots."""

    def __init__(
        self, ns: SystemdNamespace, devices: Path, *, gpuguard: bool, k: Optional[Kubelet] = None
    ) -> None:
        super().__init__(ns, k)
        self.gpuguard = gpuguard
        self.proc_devices = devices  # host file bound over the namespace's /proc/devices
        self.site = ""  # where it runs (integration/kubelet_sites.py), and what with:
        self.versions: Dict[str, str] = {}  # release, kubelet, systemd, containerd, ...
        self.install = ""  # how gpuguard got there ("none" without it)
        self.driver_at = 0.0  # time.monotonic() at the driver's arrival (driver="late")

    # -- GPUs ------------------------------------------------------------------------------
    @property
    def inventory(self) -> List[Dict[str, Any]]:
        return list(json.loads(self.ns.path(INVENTORY).read_text())["gpus"])

    def set_gpus(self, gpus: Sequence[Mapping[str, Any]]) -> None:
        """The inventory file (atomically) and the GPU nodes in the private /dev."""
        path = self.ns.path(INVENTORY)
        old = {g["minor"] for g in self.inventory} if path.exists() else set()
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(".inventory.tmp")
        tmp.write_text(json.dumps({"gpus": list(gpus)}))
        tmp.rename(path)
        new = {g["minor"] for g in gpus}
        for minor in old - new:
            self.ns.run(["rm", "-f", f"/dev/nvidia{minor}"], check=True)
        for minor in sorted(new - old):
            self.mknod(f"nvidia{minor}", 195, minor)

    def mknod(self, name: str, major: int, minor: int, *, check: bool = True) -> None:
        """A node in the namespace's private /dev (never the host's)."""
        argv = ["mknod", "-m", "666", f"/dev/{name}", "c", str(major), str(minor)]
        self.ns.run(argv, check=check)

    def load_uvm(self) -> None:
        """nvidia_uvm loaded later: registered in /proc/devices, its nodes made (as
        nvidia-modprobe -u -c0 makes them the first time CUDA runs on the host)."""
        fake_proc_devices(self.proc_devices, uvm=True)
        for name, minor in (("nvidia-uvm", 0), ("nvidia-uvm-tools", 1)):
            self.mknod(name, UVM_MAJOR, minor, check=False)  # gpuguard may have made it
            assert self.ns.path(f"/dev/{name}").exists()

    def slot(self, c: Container) -> str:
        """The PCI bus id of the GPU the container was given (by NVIDIA_VISIBLE_DEVICES)."""
        (g,) = [g for g in self.inventory if g["uuid"] == c.visible]
        return str(g["pci_bus_id"])

    def verdicts(self, c: Container) -> Dict[int, Optional[bool]]:
        """minor -> the kernel's answer to opening /dev/nvidia<minor> from the
        container's devices cgroup (True: allowed, ENXIO; False: denied, EPERM)."""
        cgroup = self.devices_cgroup(c)
        return {
            g["minor"]: probe_open(self.ns.fake_node(195, g["minor"]), [cgroup]).verdict
            for g in self.inventory
        }

    # -- services --------------------------------------------------------------------------
    def start_plugin(self, args: str = "") -> None:
        if args:
            dropin = f"[Service]\nEnvironment=PLUGIN_ARGS={args}\n"
            self.ns.write_unit(f"{PLUGIN}.d/args.conf", dropin)
            self.ns.systemctl("daemon-reload")
        self.ns.systemctl("start", PLUGIN)
        self.ns.wait_active(PLUGIN)
        self.wait_registered()

    def bridge_offers(self) -> List[Dict[str, Any]]:
        """gpuguard's re-admission bridge's offers during this kubelet run (journal
        entries with their fields)."""
        if not self.gpuguard:
            return []
        since = int(self.ns.unit_property("kubelet.service", "ExecMainStartTimestampMonotonic"))
        argv = ["journalctl", "--no-pager", "-o", "json", "-u", READMIT]
        out = []
        for line in self.ns.run(argv, timeout=30).stdout.splitlines():
            e = json.loads(line)
            kind, at = e.get("GPUGUARD_KIND"), int(e["__MONOTONIC_TIMESTAMP"])
            if kind == "readmit-offered" and at >= since:
                out.append(e)
        return out

    def registrations(self, resource: str = "nvidia.com/gpu") -> int:
        """The real plugin's registrations in this kubelet run (the bridge's left out)."""
        ours = sum(e.get("RESOURCE") == resource for e in self.bridge_offers())
        return max(super().registrations(resource) - ours, 0)

    def plugin_allocations(self) -> List[List[str]]:
        """The device IDs of each Allocate the plugin double (a host service) answered
        in its current run."""
        inv = self.ns.unit_property(PLUGIN, "InvocationID")
        argv = ["journalctl", "--no-pager", "-o", "cat", f"_SYSTEMD_INVOCATION_ID={inv}"]
        out = []
        for line in self.ns.run(argv, timeout=30).stdout.splitlines():
            if line.startswith("{") and '"allocate"' in line:
                out.append(list(json.loads(line)["ids"]))
        return out

    def start_gpuguard(self) -> None:
        assert self.gpuguard
        if self.ns.systemctl("start", "gpuguard.service", check=False).returncode != 0:
            raise AssertionError(f"gpuguard.service did not start:\n{self.log('gpuguard.service')}")
        self.ns.wait_active("gpuguard.service", timeout=30)
        settle(self.ns)

    def stage_driver(self) -> None:
        """The GPU Operator's driver prepared out of sight: its root with the fake NVML
        library naming the GPUs of the inventory, the GPU list moved aside, gpuguard
        configured as on such a node (NVML from the driver root only)."""
        gpus = self.inventory
        staging = self.ns.path("/run/nvidia/.driver")
        for d in (staging, self.ns.path(DRIVER_ROOT)):
            shutil.rmtree(d, ignore_errors=True)
        lib_dir = staging / DRIVER_LIB
        fakenvml.build(lib_dir)
        fakenvml.write_conf(
            lib_dir, [FakeGpu(g["uuid"], g["minor"], g["pci_bus_id"]) for g in gpus]
        )
        self.ns.path(INVENTORY).rename(self.ns.path(LATE_INVENTORY))
        if self.gpuguard:
            self.ns.path("/etc/gpuguard/gpuguard.conf").write_text(OPERATOR_CONFIG)

    def driver_arrives(self) -> float:
        """The driver container's root appears at once (no uevent), and the GPU list
        with it; returns time.monotonic() at that moment."""
        t = time.monotonic()
        self.ns.path("/run/nvidia/.driver").rename(self.ns.path(DRIVER_ROOT))
        self.ns.path(LATE_INVENTORY).rename(self.ns.path(INVENTORY))
        return t

    def reboot(
        self,
        gpus: Sequence[Mapping[str, Any]],
        *,
        lose_state: bool = False,
        plugin: str = "late",
        driver: str = "host",
    ) -> float:
        """The node restarted with ``gpus``; returns time.monotonic() at kubelet's start.
        ``lose_state``: gpuguard's state directory did not survive (a new disk).
        ``plugin``: when the plugin double starts: ``late``, as a unit once kubelet has
        judged every pod (it registers 0.3-1 s after kubelet's registration server, as
        NVIDIA's plugin does as a host service ordered after kubelet, or later as a
        DaemonSet's pod); ``fast``, as a unit right after kubelet's, already waiting
        for kubelet.sock (it registers 20-60 ms after the registration server: racing
        kubelet's re-admission); ``pod``, as the static pod it already is; ``none``: not
        started (the test starts it).
        ``driver``: ``host``, there at boot; ``late``, the GPU Operator's layout: the
        driver's root and the GPU list arrive :data:`DRIVER_DELAY` s after kubelet's
        start (:attr:`driver_at`), after kubelet's re-admission, and the plugin
        (``late`` only) after them."""
        self.stop_kubelet()
        self.ns.systemctl("stop", PLUGIN)
        if self.gpuguard:
            self.ns.systemctl("stop", "gpuguard.service", READMIT)
            if lose_state:
                self.ns.run(["sh", "-c", "rm -rf /var/lib/gpuguard/*"], check=True)
        self.kill_all()
        self.set_gpus(gpus)
        if driver == "late":
            self.stage_driver()
        if self.gpuguard:
            self.start_gpuguard()
        t0 = self.start_kubelet()
        if plugin == "fast":
            self.ns.systemctl("start", PLUGIN)
        # As at a boot: the plugin (a DaemonSet's pod, or a unit ordered after kubelet)
        # starts after kubelet has re-admitted its pods (each has a phase once judged).
        names = [p.stem for p in self.ns.path(MANIFESTS).glob("*.json")]
        self.wait_pods(lambda p: all(n in p and p[n].phase for n in names), 60, "re-admission")
        if driver == "late":
            assert plugin == "late", "the plugin waits for the driver"
            time.sleep(max(0.0, t0 + DRIVER_DELAY - time.monotonic()))
            self.driver_at = self.driver_arrives()
        if plugin == "late":
            self.start_plugin()
        elif plugin != "none":
            self.wait_registered()
        return t0

    def checkpoint_ids(self) -> Dict[str, List[str]]:
        """pod UID -> the device IDs of its entries in kubelet's checkpoint."""
        data = parse(self.ns.path(CHECKPOINT).read_bytes(), source="kubelet")
        out: Dict[str, List[str]] = {}
        for e in data.entries or ():
            out.setdefault(e.pod_uid, []).extend(e.all_device_ids())
        return out


def boot(factory: NsFactory, tmp: Path, api: Path, **kw: Any) -> GpuNode:
    """:func:`boot_on` this machine's own stack (a pytest ``systemd_ns`` factory)."""
    return boot_on(HostSite(factory), tmp, api, **kw)


def boot_on(
    site: Site,
    tmp: Path,
    api: Path,
    *,
    gpuguard: bool,
    n_gpus: int = 3,
    flags: Sequence[str] = (),
    config: str = "",
    uvm: bool = True,
    plugin: bool = True,
    kubelet: str = "1.20",
    extra_units: Optional[Mapping[str, str]] = None,
    extra_ro: Optional[Mapping[str, Path]] = None,
    containerd_extra: str = "",
    before_kubelet: Optional[Callable[[SystemdNamespace], None]] = None,
    pci: bool = False,
) -> GpuNode:
    """A booted node on ``site`` (integration/kubelet_sites.py) with containerd and
    kubelet running (and gpuguard's daemon before kubelet, when ``gpuguard``); the
    plugin double started as a service if ``plugin``. The node's ``versions`` say what
    it runs; a site that runs another stack than it stands for fails here. ``kubelet``:
    its version, "1.20", "1.34" or "1.36" (harness/kubelet_versions.py). A node with
    an API server (integration/cluster_node.py) adds its units (``extra_units``), their
    files (``extra_ro``), containerd's CNI section (``containerd_extra``), and starts
    them before kubelet's first start (``before_kubelet``). ``pci``: the GPUs' slots on
    the namespace's PCI bus (:func:`fake_pci`)."""
    require_systemd_ns()
    from conftest import require_tool

    require_tool(*REQUIRED_TOOLS)
    k = kubelet_of(kubelet)
    # the Operator-layout node (pci) runs a real one-process pause: gpuguard must tell a
    # sandbox kept between failed container starts from a running container
    binds, ro = prepare(tmp / "kubelet", api, real_pause=pci)
    if containerd_extra:
        with (tmp / "kubelet" / "containerd.toml").open("a") as f:
            f.write(containerd_extra)
    ro[str(k.binary.parent)] = k.binary.parent
    ro |= extra_ro or {}
    devices = fake_proc_devices(tmp / "devices", uvm=uvm)
    ro |= {"/run/fake/devices": devices, "/proc/devices": devices}
    if pci:
        ro["/sys/bus/pci/devices"] = fake_pci(tmp, n_gpus)
    units = {
        "containerd.service": CONTAINERD_UNIT,
        "kubelet.service": kubelet_unit(k, tmp / "kubelet", flags),
        PLUGIN: site.plugin_unit(),
        **(readmit_units() if gpuguard and site.name == "host" else {}),
        **(extra_units or {}),
    }
    ns = site.start(tmp, units=units, binds=binds, ro_binds=ro, gpuguard=gpuguard)
    node = GpuNode(ns, devices, gpuguard=gpuguard, k=k)
    node.mknod("nvidiactl", 195, 255)
    if uvm:
        node.mknod("nvidia-uvm", UVM_MAJOR, 0)
        node.mknod("nvidia-uvm-tools", UVM_MAJOR, 1)
    node.set_gpus(gpus(n_gpus))
    if gpuguard:
        site.install_gpuguard(ns, CONFIG + config)
    node.start_runtime()
    if before_kubelet is not None:
        before_kubelet(ns)
    if gpuguard:
        node.start_gpuguard()
    node.start_kubelet()
    seen = wait_for(node.runtime_seen, 30, "kubelet's line naming its container runtime")
    site.check(ns, seen)
    node.versions = {**stack_versions(ns, k.binary), "runtime_seen": seen}
    node.site, node.install = site.name, site.install if gpuguard else "none"
    if plugin:
        node.start_plugin()
    return node


@pytest.fixture(scope="session")
def api(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The deviceplugin v1beta1 code, generated once per session from kubelet's proto."""
    require_systemd_ns()
    return api_code(tmp_path_factory.mktemp("deviceplugin-api"))


@pytest.fixture
def sites(systemd_ns: NsFactory) -> Iterator[Callable[[str], Site]]:
    """Factory: ``sites(name)`` is the node site called ``name`` ("host", or a release
    of kubelet_sites.ROOT_STACKS), stopped when the test ends."""
    made: List[Site] = []

    def make(name: str) -> Site:
        made.append(site(name, systemd_ns))
        return made[-1]

    try:
        yield make
    finally:
        for s in reversed(made):
            s.stop()


def free_minor(node: GpuNode, held: Sequence[Container]) -> List[int]:
    used = {g["minor"] for g in node.inventory for c in held if g["uuid"] == c.visible}
    return sorted({g["minor"] for g in node.inventory} - used)


def hook_log(node: GpuNode) -> List[Dict[str, Any]]:
    """What the runtime hook granted: one entry (id, value, cgroup) per container."""
    p = node.ns.path(f"{LOG}/hook.log")
    return [json.loads(x) for x in p.read_text().splitlines()] if p.exists() else []


# -- F1: two GPU pods, then a reboot into other UUIDs (test_kubelet_f1.py, bench) -------------

F1_CASES = ("all", "one", "gone")  # kubelet 1.34 also runs "none": no GPU changed
F1_PODS = ("gpu-a", "gpu-b")


def two_gpu_pods(node: GpuNode) -> Dict[str, str]:
    """gpu-a and gpu-b running; the PCI bus id of each one's GPU."""
    for name in F1_PODS:
        node.write_pod(gpu_pod(name))
    node.wait_pods(lambda p: all(n in p and p[n].running for n in F1_PODS), 60, "two GPU pods")
    return {name: node.slot(node.running(name)) for name in F1_PODS}


def gpus_after(node: GpuNode, case: str, victim: str) -> List[Dict[str, Any]]:
    """The GPUs the node comes back with: every one with a new UUID (``all``), only the
    one in slot ``victim`` (``one``), every one new and ``victim``'s gone (``gone``), or
    every one as it was (``none``)."""
    fresh = {g["pci_bus_id"]: g["uuid"] for g in gpus(len(node.inventory))}
    out = []
    for g in node.inventory:
        if case == "gone" and g["pci_bus_id"] == victim:
            continue
        if case in ("all", "gone") or (case == "one" and g["pci_bus_id"] == victim):
            g = {**g, "uuid": fresh[g["pci_bus_id"]]}
        out.append(g)
    return out


def f1_reboot(node: GpuNode, case: str, **kw: Any) -> Tuple[Dict[str, str], Dict[str, str], float]:
    """Two GPU pods, then the reboot of ``case`` (gpu-b's GPU the one that changes or
    goes): (each pod's slot, slot -> UUID before, time.monotonic() at kubelet's start)."""
    slots = two_gpu_pods(node)
    before = {g["pci_bus_id"]: g["uuid"] for g in node.inventory}
    t0 = node.reboot(gpus_after(node, case, slots["gpu-b"]), **kw)
    return slots, before, t0
