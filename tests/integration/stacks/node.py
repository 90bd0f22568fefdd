"""A GPU node of one Debian release: its own systemd booted in private namespaces
(integration/pkgroot), gpuguard installed from its .deb, the release's containerd with
runc and crun, and GPU containers granted their nodes behind the runtime's back.

* Fake GPUs: ``mknod c 195 N`` (and the control and UVM nodes) in the namespace's
  private /dev, the driver's registration in a /proc/devices bound into gpuguard's unit
  (``FAKE_DRIVER``); the inventory file stands in for NVML.
* containerd is the release's own ``containerd.service`` (``ExecStartPre=`` emptied:
  its ``modprobe overlay`` must not reach the host kernel; CRI off), driven with
  ``ctr run --runc-systemd-cgroup`` and, for crun, ``--runc-binary``: containers are
  scopes of the release's systemd, as kubelet's systemd driver makes them.
* Each container gets its GPU bind-mounted into its /dev, not in the runtime's spec,
  and granted as NVIDIA's legacy hook grants it: ``devices.allow`` (v1) or a device
  program of its own (v2, ``harness/bpfdev.py``) on the cgroup its process is in.
* The kernel judges: a child placed in the container's own cgroup (where the kernel
  says its process is, ``/proc/PID/cgroup``) opens the fake node: EPERM denied, ENXIO
  admitted (``gpuguard.devices.probe``).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from gpuguard.devices.probe import probe_open
from integration.gpu_scopes import fake_proc_devices, gpu_inventory
from integration.harness.bpfdev import DEFAULT_RULES, replace_programs
from integration.harness.containerd import busybox_rootfs
from integration.pkgroot import PackageRoot

UVM_MAJOR = 511
NODES: Dict[str, Tuple[int, int]] = {
    "nvidia0": (195, 0),
    "nvidia1": (195, 1),
    "nvidiactl": (195, 255),
    "nvidia-uvm": (UVM_MAJOR, 0),
    "nvidia-uvm-tools": (UVM_MAJOR, 1),
}
CONTROL = ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools")
RUNC_ROOT = "/run/containerd/runc/default"
ROOTFS = "/run/host/rootfs"
FAKE_DRIVER = "[Service]\nBindReadOnlyPaths=/run/fake/devices:/proc/devices\n"
CONTAINERD_DROPIN = (
    # The release's unit runs `modprobe overlay` first: never against the host's kernel.
    "[Service]\nExecStartPre=\n"
)
CONTAINERD_CONFIG = 'version = 2\ndisabled_plugins = ["io.containerd.grpc.v1.cri"]\n'
GPUGUARD_CONFIG = "[Inventory]\nFile=/etc/gpuguard/inventory.json\n"
APT_ENV = {"DEBIAN_FRONTEND": "noninteractive"}


class StackError(AssertionError):
    """The namespace does not run what the test asked for, or a step failed."""


@dataclass(frozen=True)
class Ctr:
    """A kubelet-like GPU container of one runtime."""

    runtime: str  # "runc" or "crun"
    pod_uid: str
    container_id: str
    gpu: int

    @property
    def unit(self) -> str:
        return f"cri-containerd-{self.container_id}.scope"

    @property
    def pod_slice(self) -> str:
        return f"kubepods-besteffort-pod{self.pod_uid.replace('-', '_')}.slice"

    def given(self) -> List[Tuple[int, int]]:
        return [NODES[f"nvidia{self.gpu}"], *(NODES[n] for n in CONTROL)]


def make_ctrs(runtime: str, n: int, salt: str) -> List[Ctr]:
    return [
        Ctr(
            runtime,
            str(uuid.uuid5(uuid.NAMESPACE_OID, f"{salt}-{runtime}-{i}")),
            hashlib.sha256(f"{salt}-{runtime}-{i}".encode()).hexdigest(),
            i % 2,
        )
        for i in range(n)
    ]


def prepare_host_dir(tmp: Path) -> Dict[str, Path]:
    """ro/rw binds for PackageRoot: the busybox rootfs (rw: runc makes mount points)."""
    rootfs = busybox_rootfs(tmp / "rootfs")
    return {ROOTFS: rootfs}


class Node:
    """Drives one booted release: gpuguard from its package, containerd, containers."""

    def __init__(self, ns: PackageRoot, tmp: Path) -> None:
        self.ns = ns
        self.tmp = tmp
        self.ctrs: List[Ctr] = []
        self.moved: List[str] = []  # processes moved into their scope (v1), and from where
        self._cgroup: Dict[str, Path] = {}

    # -- set-up -------------------------------------------------------------------
    def versions(self) -> Dict[str, str]:
        ns = self.ns
        return {
            "systemd": str(ns.systemd_version),
            "containerd": ns.tool_version(("containerd", "--version")).split("~")[0],
            "runc": ns.tool_version(("runc", "--version")),
            "crun": ns.tool_version(("crun", "--version")),
            "python": ns.tool_version(("python3", "--version")),
        }

    def write(self, inner: str, text: str) -> None:
        p = self.ns.path(inner)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)

    def prepare(self) -> None:
        """The driver's nodes and registration, gpuguard's configuration and the
        containerd overrides: before the package is installed (it starts the daemon)."""
        for name, (ma, mi) in NODES.items():
            self.ns.run(["mknod", "-m", "666", f"/dev/{name}", "c", str(ma), str(mi)], check=True)
        self.write("/run/fake/devices", fake_proc_devices(self.tmp / "devices").read_text())
        # `gpuguard status` run here reads the same registration as the daemon's unit
        self.ns.run(["mount", "--bind", "/run/fake/devices", "/proc/devices"], check=True)
        self.write("/etc/gpuguard/inventory.json", json.dumps(gpu_inventory(2)))
        self.write("/etc/gpuguard/gpuguard.conf.d/50-stack-test.conf", GPUGUARD_CONFIG)
        self.write("/etc/systemd/system/gpuguard.service.d/60-fake-driver.conf", FAKE_DRIVER)
        self.write(
            "/etc/systemd/system/containerd.service.d/50-no-modprobe.conf", CONTAINERD_DROPIN
        )
        self.write("/etc/containerd/config.toml", CONTAINERD_CONFIG)
        self.ns.systemctl("daemon-reload")

    def apt_install(self, deb: str) -> Tuple[int, str]:
        res = self.ns.run(
            ["apt-get", "install", "-y", "--no-install-recommends", deb], env=APT_ENV, timeout=300
        )
        return res.returncode, res.stdout + res.stderr

    def start_containerd(self) -> None:
        self.ns.systemctl("start", "containerd.service", timeout=60)
        self.ns.wait_active("containerd.service", timeout=30)
        deadline = time.monotonic() + 20
        while self.ns.run(["ctr", "version"]).returncode != 0:
            if time.monotonic() > deadline:
                raise StackError("containerd does not answer ctr version")
            time.sleep(0.1)

    # -- containers ---------------------------------------------------------------
    def ctr(self, *args: str, check: bool = True) -> str:
        res = self.ns.run(["ctr", *args], timeout=60)
        if check and res.returncode != 0:
            raise StackError(f"ctr {' '.join(args)}: {res.stderr.strip() or res.stdout}")
        return res.stdout

    def run(self, c: Ctr) -> None:
        argv = ["run", "-d", "--null-io", "--rootfs", "--runc-systemd-cgroup"]
        argv.append(f"--cgroup={c.pod_slice}:cri-containerd:{c.container_id}")
        if c.runtime != "runc":
            argv.append(f"--runc-binary=/usr/bin/{c.runtime}")
        if self.ns.layout == "v2" and "--cpu-shares" in self.ctr("run", "--help"):
            # this kernel keeps cpu in its v1 hierarchies: cgroup2 has no cpu.weight,
            # which ctr's default 1024 shares would make the runtime write
            argv.append("--cpu-shares=0")
        for n in [f"nvidia{c.gpu}", *CONTROL]:
            argv.append(f"--mount=type=bind,src=/dev/{n},dst=/dev/{n},options=rbind:rw")
        argv += [ROOTFS, c.container_id, "/bin/busybox", "sleep", "3000"]
        self.ctr(*argv)
        self.ctrs.append(c)
        self.check_runtime(c)
        if self.ns.layout == "v1" and self.placement(c).startswith("outside"):
            # systemd 252/257 on the hybrid layout leave the new process in its pod
            # slice's v1 devices cgroup ("Failed to migrate controller cgroups"; see
            # test_container_access_runc.py): put it where the runtime meant it.
            self.moved.append(f"{c.runtime}: {self.placement(c)}")
            (self.device_scope(c) / "cgroup.procs").write_text(str(self.host_pid(c)))
            self._cgroup.pop(c.container_id)

    def check_runtime(self, c: Ctr) -> None:
        """Fail unless ``c`` was made by the runtime asked for: runc keeps state.json in
        its state directory, crun a status file."""
        state = self.ns.path(f"{RUNC_ROOT}/{c.container_id}")
        made_by = (
            "runc"
            if (state / "state.json").exists()
            else "crun"
            if (state / "status").exists()
            else f"unknown ({sorted(p.name for p in state.glob('*'))})"
        )
        if made_by != c.runtime:
            raise StackError(f"{c.container_id[:12]}: asked for {c.runtime}, made by {made_by}")

    def scope_dir(self, c: Ctr) -> Path:
        tracking = "unified" if self.ns.layout == "v2" else "systemd"
        return (
            self.ns.cgroup_dir(tracking)
            / "kubepods.slice/kubepods-besteffort.slice"
            / c.pod_slice
            / c.unit
        )

    def host_pid(self, c: Ctr) -> int:
        for d in sorted(self.scope_dir(c).rglob("cgroup.procs")):
            pids = d.read_text().split()
            if pids:
                return int(pids[0])
        raise StackError(f"{c.unit}: no process in its scope")

    def cgroup(self, c: Ctr) -> Path:
        """Host dir of the cgroup where the kernel enforces ``c``'s device policy: its
        process's own (v1 devices hierarchy, or cgroup2), read from /proc/PID/cgroup."""
        if c.container_id not in self._cgroup:
            want = "devices" if self.ns.layout == "v1" else ""
            for line in Path(f"/proc/{self.host_pid(c)}/cgroup").read_text().splitlines():
                _n, ctrls, path = line.split(":", 2)
                if (want and want in ctrls.split(",")) or (not want and ctrls == ""):
                    top = Path("/sys/fs/cgroup") / ("devices" if want else "unified")
                    self._cgroup[c.container_id] = top / path.lstrip("/")
                    break
            else:
                raise StackError(f"{c.unit}: no {want or 'cgroup2'} line in /proc/PID/cgroup")
        return self._cgroup[c.container_id]

    def placement(self, c: Ctr) -> str:
        """Where the process is, relative to its scope: "scope", "scope/container", ..."""
        scope = self.device_scope(c)
        try:
            rel = self.cgroup(c).relative_to(scope)
        except ValueError:
            return f"outside its scope: {self.cgroup(c)}"
        return "scope" if str(rel) == "." else f"scope/{rel}"

    def device_scope(self, c: Ctr) -> Path:
        """Host dir of ``c``'s scope in the hierarchy that enforces device policy."""
        tracking = self.ns.cgroup_dir("unified" if self.ns.layout == "v2" else "systemd")
        return self.ns.cgroup_dir(self.ns.device_hierarchy) / self.scope_dir(c).relative_to(
            tracking
        )

    def hook_grant(self, c: Ctr) -> None:
        """The legacy NVIDIA hook's grant, behind the runtime's back: on the container's
        cgroup (the scope, the runtime's cgroupsPath) and, where the runtime runs the
        process in a sub-cgroup of it (crun's ``container`` on v2), there too: on v2 an
        open must pass every program from the scope down."""
        for d in dict.fromkeys([self.device_scope(c), self.cgroup(c)]):
            if self.ns.layout == "v2":
                replace_programs(d, [*DEFAULT_RULES, *(("c", ma, mi) for ma, mi in c.given())])
                continue
            with open(d / "devices.allow", "w") as f:
                for ma, mi in c.given():
                    f.write(f"c {ma}:{mi} rw")
                    f.flush()

    def verdict(self, c: Ctr, minor: int) -> Optional[bool]:
        return probe_open(self.ns.path(f"/dev/nvidia{minor}"), [self.cgroup(c)]).verdict

    def lacking(self, ctrs: List[Ctr]) -> List[Ctr]:
        return [c for c in ctrs if self.verdict(c, c.gpu) is not True]

    def over_granted(self, ctrs: List[Ctr]) -> List[Ctr]:
        return [c for c in ctrs if self.verdict(c, 1 - c.gpu) is not False]

    # -- events -------------------------------------------------------------------
    def update(self, c: Ctr) -> str:
        """The runtime's update as kubelet's CPU manager asks for one. On v2 here the
        host keeps every controller in its v1 hierarchies, so the update carries no
        resource (``-r`` with ``{}``); the runtime re-applies the device part all the same."""
        binary = c.runtime
        argv = [binary, "--root", RUNC_ROOT, "--systemd-cgroup", "update"]
        if self.ns.layout == "v1":
            argv += ["--cpu-share", "512"]
        else:
            self.write("/run/host-empty-resources.json", "{}\n")
            argv += ["-r", "/run/host-empty-resources.json"]
        res = self.ns.run([*argv, c.container_id])
        return "" if res.returncode == 0 else (res.stderr.strip() or res.stdout.strip())

    def reset(self, c: Ctr) -> None:
        """A runtime's DeviceAllow= reset over the bus (what runc's systemd driver sends)."""
        self.ns.systemctl(
            "set-property", "--runtime", c.unit, "DeviceAllow=", "DeviceAllow=/dev/null rw"
        )

    def remove_all(self) -> None:
        for c in self.ctrs:
            self.ctr("task", "kill", "-s", "SIGKILL", c.container_id, check=False)
        for c in self.ctrs:
            self.ctr("task", "delete", "-f", c.container_id, check=False)
            self.ctr("container", "delete", c.container_id, check=False)
        self.ctrs.clear()


def copy_debs(d: Path, *debs: Path) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    for deb in debs:
        shutil.copy2(deb, d / deb.name)
    return d
