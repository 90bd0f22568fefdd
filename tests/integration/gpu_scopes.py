"""GPU "containers" as systemd scopes in a namespace harness, the way the systemd cgroup
driver lays them out: kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-
pod<uid>.slice/cri-containerd-<id>.scope, each process in its own mount namespace whose
/dev holds exactly the nodes "the runtime gave it" (a directory of fake nodes made with
mknod in the test's tmp dir, bound over its /dev). Its device cgroup gets the nodes the
way the legacy NVIDIA hook grants them, behind systemd's back: written to devices.allow
(v1), or a device program of its own replacing systemd's (v2, ``harness/bpfdev.py``).
``has`` asks devices.list on v1 and the kernel itself (a probe open of a fake node:
EPERM vs ENXIO) on v2, where the policy is a BPF program.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import subprocess
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from gpuguard.devices.probe import probe_open
from integration.gpuguard_ns import gpuguard_units, wait_for
from integration.harness import SystemdNamespace
from integration.harness.bpfdev import DEFAULT_RULES, replace_programs

UVM_MAJOR = 511
NODES: Dict[str, Tuple[int, int]] = {
    "nvidiactl": (195, 255),
    "nvidia-uvm": (UVM_MAJOR, 0),
    "nvidia-uvm-tools": (UVM_MAJOR, 1),
}


def fake_proc_devices(path: Path, *, uvm: bool = True) -> Path:
    """The host's /proc/devices plus what a loaded NVIDIA driver registers (``uvm``:
    with nvidia_uvm loaded). Written in place, so a bind of it shows the new text."""
    text = Path("/proc/devices").read_text()
    head, _, tail = text.partition("\nBlock devices:")
    ours = "\n195 nvidia\n" + (f"{UVM_MAJOR} nvidia-uvm\n" if uvm else "")
    path.write_text(head.rstrip("\n") + ours + "\nBlock devices:" + tail)
    return path


def gpu_inventory(n: int) -> dict:  # type: ignore[type-arg]
    return {
        "gpus": [
            {
                "uuid": f"GPU-{uuid.UUID(int=i + 1)}",
                "index": i,
                "minor": i,
                "pci_bus_id": f"00000000:{i + 0x10:02X}:00.0",
            }
            for i in range(n)
        ]
    }


@dataclass
class Container:
    pod_uid: str
    container_id: str
    gpus: Tuple[int, ...]

    @property
    def unit(self) -> str:
        return f"cri-containerd-{self.container_id}.scope"

    @property
    def slice(self) -> str:
        return f"kubepods-besteffort-pod{self.pod_uid.replace('-', '_')}.slice"

    def cgroup(self, ns: SystemdNamespace) -> Path:
        return (
            ns.cgroup_dir(ns.device_hierarchy)
            / "kubepods.slice/kubepods-besteffort.slice"
            / self.slice
            / self.unit
        )

    def given(self) -> List[Tuple[int, int]]:
        return [(195, g) for g in self.gpus] + list(NODES.values())

    def devices_list(self, ns: SystemdNamespace) -> str:
        return (self.cgroup(ns) / "devices.list").read_text()

    def hook_grant(self, ns: SystemdNamespace) -> None:
        """Grant the container its nodes behind systemd's back, as the legacy hook does."""
        if ns.layout == "v2":
            rules = [*DEFAULT_RULES, *(("c", ma, mi) for ma, mi in self.given())]
            replace_programs(self.cgroup(ns), rules)
            return
        with open(self.cgroup(ns) / "devices.allow", "w") as f:
            for ma, mi in self.given():
                f.write(f"c {ma}:{mi} rw")
                f.flush()


def make_dev_dir(path: Path, gpus: Sequence[int]) -> Path:
    path.mkdir(parents=True)
    for name, (ma, mi) in [(f"nvidia{g}", (195, g)) for g in gpus] + list(NODES.items()):
        os.mknod(path / name, stat.S_IFCHR | 0o666, os.makedev(ma, mi))
    (path / "null").touch()  # the shell redirects to /dev/null
    return path


def dev_binds(tmp: Path, containers: Sequence[Container]) -> Dict[str, Path]:
    return {
        f"/run/ctrdev/{c.container_id[:12]}": make_dev_dir(
            tmp / f"dev-{c.container_id[:12]}", c.gpus
        )
        for c in containers
    }


FAKE_DRIVER = {
    # No NVIDIA driver here: only its registration in /proc/devices is simulated (the
    # unit gets a fresh /proc, so a drop-in binds it).
    "gpuguard.service.d/60-fake-driver.conf": (
        "[Service]\nBindReadOnlyPaths=/run/fake/devices:/proc/devices\n"
    ),
}


def node_units(extra: Optional[Mapping[str, str]] = None) -> Dict[str, str]:
    return {**gpuguard_units(), **FAKE_DRIVER, **(extra or {})}


def node_ro_binds(tmp: Path, ctrs: Sequence[Container]) -> Dict[str, Path]:
    devices = fake_proc_devices(tmp / "devices")
    return {"/run/fake/devices": devices, "/proc/devices": devices, **dev_binds(tmp, ctrs)}


def write_config(ns: SystemdNamespace, config: str = "") -> None:
    """gpuguard.conf: the inventory file standing in for NVML, then ``config``."""
    conf = "[Inventory]\nFile=/etc/gpuguard/inventory.json\n" + config
    (ns.path("/etc/gpuguard") / "gpuguard.conf").write_text(conf)


def boot_node(
    factory: Callable[..., SystemdNamespace],
    tmp: Path,
    ctrs: Sequence[Container] = (),
    *,
    layout: str = "v1",
    config: str = "",
    units: Optional[Mapping[str, str]] = None,
    binds: Optional[Mapping[str, Path]] = None,
) -> SystemdNamespace:
    """A GPU node booted on ``layout``: gpuguard's units (plus ``units``), the driver's
    registration, each container's /dev, an inventory of two GPUs (minors 0 and 1) and
    the configuration (:func:`write_config`). gpuguard itself is not started."""
    ns = factory(
        layout=layout, units=node_units(units), binds=binds, ro_binds=node_ro_binds(tmp, ctrs)
    )
    etc = ns.path("/etc/gpuguard")
    etc.mkdir(parents=True, exist_ok=True)
    (etc / "inventory.json").write_text(json.dumps(gpu_inventory(2)))
    write_config(ns, config)
    return ns


def start(ns: SystemdNamespace, c: Container, *, hook_grant: bool = True) -> int:
    """Start the container's scope; grant its nodes like the legacy NVIDIA hook does.

    In runc's order: the scope first (its process still on the host's /dev, as `runc
    init` is), the hook's grant next, the container's own /dev last. (Granting after the
    container runs would race with gpuguard's new-scope grant: on v2 both replace the
    scope's device program.) The process waits for the go on its stdin, a pipe, as `runc
    init` waits on its exec fifo: no polling, so a burst of starts costs no CPU while it
    waits. Returns once the process has its own /dev, with the moment it got it (its
    clock before the exec, CLOCK_REALTIME in us, the journal's clock): from then on it is
    a container with its GPU that a reload can take away."""
    name = c.container_id[:12]
    p = ns.popen(
        [
            "systemd-run",
            "--scope",
            "--quiet",
            f"--unit={c.unit}",
            f"--slice={c.slice}",
            "-p",
            "DevicePolicy=strict",
            "-p",
            "DeviceAllow=/dev/null rw",
            "unshare",
            "-m",
            "--propagation",
            "private",
            "bash",
            "-c",
            f"read -r _ && mount --bind /run/ctrdev/{name} /dev && echo $EPOCHREALTIME "
            "&& exec sleep 3000",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    assert p.stdin is not None and p.stdout is not None
    procs = c.cgroup(ns) / "cgroup.procs"
    pid = wait_for(lambda: procs.exists() and procs.read_text().split(), what=f"{c.unit} running")
    if hook_grant:
        c.hook_grant(ns)
    with p.stdin:
        p.stdin.write(b"\n")
    with p.stdout:
        stamp = p.stdout.readline().decode().strip()  # "" if it failed: its end closes it
    if not stamp:
        raise AssertionError(f"{c.unit}: the container's process ended before its own /dev")
    # cgroup.procs read from here names host PIDs; a plain file "null" in its own /dev
    assert Path(f"/proc/{pid[0]}/root/dev/null").is_file(), f"{c.unit} not on its own /dev"
    return round(float(stamp) * 1e6)  # "seconds.micros" (bash's EPOCHREALTIME)


def containers(n: int, gpus_per_node: int = 2) -> List[Container]:
    return [
        Container(
            str(uuid.UUID(int=0xA000 + i)),
            hashlib.sha256(b"ctr%d" % i).hexdigest(),
            (i % gpus_per_node,),
        )
        for i in range(n)
    ]


def has(c: Container, ns: SystemdNamespace, numbers: Tuple[int, int]) -> bool:
    """Does the container's cgroup admit ``numbers`` (rw)?"""
    if ns.layout == "v2":
        return probe_open(ns.fake_node(*numbers), [c.cgroup(ns)]).verdict is True
    return f"c {numbers[0]}:{numbers[1]} rw" in c.devices_list(ns)
