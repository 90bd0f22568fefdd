"""Debian's containerd + runc, run as a unit INSIDE a SystemdNamespace, with busybox.

Why inside the namespace (tests/integration/harness/containerd.py, written for the
device-plugin work, runs containerd on the host with the cgroupfs driver): runc's
systemd cgroup driver talks to the systemd of its mount namespace over D-Bus, so a
container made with ``ctr run --runc-systemd-cgroup`` becomes a real scope unit of
the namespace's systemd (``kubepods-...-pod<uid>.slice/cri-containerd-<id>.scope``),
which a ``systemctl daemon-reload`` there re-applies, exactly as on a kubelet node.

Confinement (everything dies with the namespace):
  * containerd is ``ctr-test-containerd.service`` of the namespace (Delegate=yes,
    KillMode=process, like Debian's containerd.service) with its own config: root,
    state and socket under the namespace's private ``/run``, the CRI plugin off;
    its shims, runc state (``/run/containerd/runc/<ns>``) and fifos are all in that
    private ``/run``. Containers live in the namespace's pid namespace and in the
    instance's cgroups, so the harness's poweroff and cgroup removal clean them up.
  * The busybox-static rootfs and the fake NVIDIA nodes (mknod in the test's tmp
    dir, never the host /dev) are bound at ``/run/ctr-test``.
  * A GPU node is given the way the legacy NVIDIA hook gives it: bind-mounted into
    the container's /dev (``--mount``) and granted behind runc's back (devices.allow on
    v1, a device program of its own on v2: ``bpfdev.py``); runc's spec never names it.
    Or (``spec_devices=``) the way a device plugin gives it: in runc's spec
    (``ctr run --device``), from nodes in the namespace's /dev.
  * Verdicts: devices.list on v1; on v2 the kernel's answer to a probe open of a fake
    node (``SystemdNamespace.fake_node``).
"""

from __future__ import annotations

import os
import shutil
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from gpuguard.devices.probe import probe_open

from .bpfdev import DEFAULT_RULES, replace_programs
from .sysns import SystemdNamespace

UNIT = "ctr-test-containerd.service"
INNER = "/run/ctr-test"  # the bound host dir, inside the namespace
SOCK = "/run/ctr-test-state/containerd.sock"
RUNC_ROOT = "/run/containerd/runc/default"
UVM_MAJOR = 511
CONTROL_NODES: Dict[str, Tuple[int, int]] = {
    "nvidiactl": (195, 255),
    "nvidia-uvm": (UVM_MAJOR, 0),
    "nvidia-uvm-tools": (UVM_MAJOR, 1),
}

CONFIG = """\
version = 2
root = "/run/ctr-test-state/root"
state = "/run/ctr-test-state/state"
disabled_plugins = ["io.containerd.grpc.v1.cri"]

[grpc]
  address = "{sock}"
[ttrpc]
  address = "{sock}.ttrpc"
"""

UNIT_TEXT = f"""[Unit]
Description=containerd for gpuguard tests (private config, root, state and socket)
[Service]
ExecStart=/usr/bin/containerd --config {INNER}/config.toml --log-level warn
Type=notify
Delegate=yes
KillMode=process
"""

REQUIRED_TOOLS = ("containerd", "containerd-shim-runc-v2", "ctr", "runc", "busybox")


@dataclass(frozen=True)
class RuncContainer:
    """A kubelet-like container: its cgroup placed as kubelet's driver places it."""

    pod_uid: str
    container_id: str  # 64 hex digits, as CRI ids are
    gpus: Tuple[int, ...]
    systemd: bool  # runc's systemd cgroup driver (else cgroupfs)

    @property
    def unit(self) -> str:
        return f"cri-containerd-{self.container_id}.scope"

    @property
    def pod_slice(self) -> str:
        return f"kubepods-besteffort-pod{self.pod_uid.replace('-', '_')}.slice"

    @property
    def cgroups_path(self) -> str:
        """linux.cgroupsPath for runc (ctr --cgroup)."""
        if self.systemd:
            return f"{self.pod_slice}:cri-containerd:{self.container_id}"
        return f"/kubepods/besteffort/pod{self.pod_uid}/{self.container_id}"

    @property
    def relative_cgroup(self) -> str:
        if self.systemd:
            return f"kubepods.slice/kubepods-besteffort.slice/{self.pod_slice}/{self.unit}"
        return self.cgroups_path.lstrip("/")

    def cgroup(self, ns: SystemdNamespace, hierarchy: str = "") -> Path:
        """Its cgroup in ``hierarchy`` (default: where device access is enforced)."""
        return ns.cgroup_dir(hierarchy or ns.device_hierarchy) / self.relative_cgroup

    def given(self) -> List[Tuple[int, int]]:
        return [(195, g) for g in self.gpus] + list(CONTROL_NODES.values())

    def devices_list(self, ns: SystemdNamespace) -> str:
        return (self.cgroup(ns) / "devices.list").read_text()

    def allows(self, ns: SystemdNamespace, numbers: Tuple[int, int]) -> bool:
        if ns.layout == "v2":
            return probe_open(ns.fake_node(*numbers), [self.cgroup(ns)]).verdict is True
        return f"c {numbers[0]}:{numbers[1]} rw" in self.devices_list(ns)


def prepare(host_dir: Path, gpus: int = 2) -> Tuple[Dict[str, str], Dict[str, Path]]:
    """Rootfs, fake nodes and config in ``host_dir``: (units, binds) for systemd_ns()."""
    host_dir.mkdir(parents=True, exist_ok=True)
    (host_dir / "config.toml").write_text(CONFIG.format(sock=SOCK))
    rootfs = host_dir / "rootfs"
    (rootfs / "bin").mkdir(parents=True)
    busybox = shutil.which("busybox") or "/bin/busybox"
    shutil.copy2(busybox, rootfs / "bin/busybox")
    for app in ("sh", "sleep", "cat", "ls"):
        os.symlink("busybox", rootfs / "bin" / app)
    for d in ("proc", "sys", "dev", "tmp", "etc", "usr", "var/lib/kubelet/device-plugins"):
        (rootfs / d).mkdir(parents=True)
    os.symlink("usr/lib", rootfs / "lib")  # for the host's python3 when /usr is bound in
    os.symlink("usr/lib64", rootfs / "lib64")
    dev = host_dir / "dev"
    dev.mkdir()
    nodes = {f"nvidia{g}": (195, g) for g in range(gpus)} | CONTROL_NODES
    for name, (ma, mi) in nodes.items():
        os.mknod(dev / name, stat.S_IFCHR | 0o666, os.makedev(ma, mi))
    return {UNIT: UNIT_TEXT}, {INNER: host_dir}


class Containerd:
    """Drives the namespace's containerd with ``ctr`` and its runc with ``runc``."""

    def __init__(self, ns: SystemdNamespace) -> None:
        self.ns = ns
        self.containers: List[RuncContainer] = []

    def start(self) -> None:
        self.ns.systemctl("start", UNIT)
        self.ns.wait_active(UNIT)

    def ctr(self, *args: str, check: bool = True, timeout: float = 60) -> str:
        res = self.ns.run(["ctr", "--address", SOCK, *args], timeout=timeout)
        if check and res.returncode != 0:
            raise RuntimeError(f"ctr {' '.join(args)}: {res.stderr.strip() or res.stdout}")
        return res.stdout

    def runc(self, c: RuncContainer, *args: str, check: bool = True) -> str:
        argv = ["runc", "--root", RUNC_ROOT]
        if c.systemd:
            argv.append("--systemd-cgroup")
        res = self.ns.run([*argv, *args])
        if check and res.returncode != 0:
            raise RuntimeError(f"runc {' '.join(args)}: {res.stderr.strip() or res.stdout}")
        return res.stdout

    def run(
        self,
        c: RuncContainer,
        *,
        hook_grant: bool = True,
        spec_devices: bool = False,
        nodes: Optional[Sequence[str]] = None,
        args: Sequence[str] = ("/bin/busybox", "sleep", "3000"),
        mounts: Sequence[Tuple[str, str, str]] = (),
    ) -> int:
        """Start ``c`` (busybox sleeping) with its nodes bound in, not in runc's spec.

        Then grant them behind runc's back, as the legacy NVIDIA hook does.
        ``spec_devices``: give them in runc's spec instead (``--device /dev/nvidiaN``:
        nodes the test made in the namespace's /dev, see :meth:`make_dev_nodes`), as a
        device plugin's allocation does. Returns the container's init PID (host PID
        namespace). ``nodes``: other /dev names than its GPUs and the control nodes;
        ``mounts``: (source inside the namespace, destination, "ro"/"rw") binds."""
        names = list(nodes) if nodes is not None else [f"nvidia{g}" for g in c.gpus]
        names += [] if nodes is not None else list(CONTROL_NODES)
        argv = ["run", "-d", "--null-io", "--rootfs", f"--cgroup={c.cgroups_path}"]
        if c.systemd:
            argv.append("--runc-systemd-cgroup")
        if self.ns.layout == "v2":
            # this kernel binds every controller to v1: cgroup2 has no cpu.weight, which
            # ctr's default 1024 shares would make runc write
            argv.append("--cpu-shares=0")
        for n in names:
            if spec_devices:
                argv.append(f"--device=/dev/{n}")
            else:
                argv.append(f"--mount=type=bind,src={INNER}/dev/{n},dst=/dev/{n},options=rbind:rw")
        for src, dst, mode in mounts:
            argv.append(f"--mount=type=bind,src={src},dst={dst},options=rbind:{mode}")
        argv += [f"{INNER}/rootfs", c.container_id, *args]
        self.ctr(*argv)
        self.containers.append(c)
        if hook_grant:
            self.hook_grant(c)
        return self.pid(c)

    def pid(self, c: RuncContainer) -> int:
        """Host PID of the container's init (from its cgroup2 directory, where
        systemd and runc agree on the cgroup; see the module docstring)."""
        procs = (c.cgroup(self.ns, "unified") / "cgroup.procs").read_text().split()
        return int(procs[0])

    def make_dev_nodes(self, gpus: int = 2) -> None:
        """The GPU nodes in the namespace's own /dev (a private tmpfs), WITHOUT their
        /dev/char links: what a node looks like before anyone created those."""
        nodes = {f"nvidia{g}": (195, g) for g in range(gpus)} | CONTROL_NODES
        for name, (ma, mi) in nodes.items():
            self.ns.run(["mknod", "-m", "666", f"/dev/{name}", "c", str(ma), str(mi)], check=True)

    def hook_grant(self, c: RuncContainer) -> None:
        if self.ns.layout == "v2":
            rules = [*DEFAULT_RULES, *(("c", ma, mi) for ma, mi in c.given())]
            replace_programs(c.cgroup(self.ns), rules)
            return
        fd = os.open(c.cgroup(self.ns) / "devices.allow", os.O_WRONLY)
        try:
            for ma, mi in c.given():
                os.write(fd, f"c {ma}:{mi} rw".encode())
        finally:
            os.close(fd)

    def task_status(self, c: RuncContainer) -> str:
        """RUNNING, STOPPED, ... or GONE (``ctr task ls``)."""
        for line in self.ctr("task", "ls").splitlines()[1:]:
            f = line.split()
            if f and f[0] == c.container_id:
                return f[2]
        return "GONE"

    def remove(self, c: RuncContainer) -> None:
        """Kill (if still running) and delete one container."""
        self.ctr("task", "kill", "-s", "SIGKILL", c.container_id, check=False)
        self.ctr("task", "delete", "-f", c.container_id, check=False)
        self.ctr("container", "delete", c.container_id, check=False)
        if c in self.containers:
            self.containers.remove(c)

    def remove_all(self) -> None:
        """Kill and delete every container (the namespace's poweroff would, too)."""
        for c in self.containers:
            self.ctr("task", "kill", "-s", "SIGKILL", c.container_id, check=False)
        for c in self.containers:
            self.ctr("task", "delete", "-f", c.container_id, check=False)
            self.ctr("container", "delete", c.container_id, check=False)
        self.containers.clear()


def make_containers(n: int, *, systemd: bool, gpus: int = 2) -> Sequence[RuncContainer]:
    import hashlib
    import uuid

    return [
        RuncContainer(
            str(uuid.UUID(int=0xB000 + i)),
            hashlib.sha256(b"runc%d" % i).hexdigest(),
            (i % gpus,),
            systemd,
        )
        for i in range(n)
    ]
