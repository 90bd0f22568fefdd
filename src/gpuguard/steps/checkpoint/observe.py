"""Is kubelet running, and how can we get it stopped around a checkpoint repair? And
what the remap needs from the host: the GPU identity history, the GPUs' NUMA nodes, when
this boot began.

Kubelet counts as running when systemd reports its unit active, or when a process
named `kubelet` exists under the root's /proc. With no systemd reachable and no such
process it is not running, and the checkpoint may be repaired directly.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import TYPE_CHECKING, Iterable, Optional

from gpuguard.checkpoint import history
from gpuguard.devices.processes import boot_time, kubelet_pids
from gpuguard.host.inventory import Inventory
from gpuguard.host.numparse import parse_decimal
from gpuguard.host.paths import GPU_HISTORY_FILE, Root
from gpuguard.host.safeio import proc_text
from gpuguard.steps.checkpoint.remap import RemapInputs

if TYPE_CHECKING:
    from gpuguard.engine.snapshot import HostSnapshot
    from gpuguard.host.systemd import Systemd, UnitState

DROPIN_NAME = "10-gpuguard.conf"


def boot_id(root: Root) -> str:
    try:
        text = proc_text(root.path("/proc/sys/kernel/random/boot_id"), max_bytes=64).strip()
    except OSError:
        return ""
    return text if len(text) <= 64 and text.isprintable() else ""


def numa_nodes(root: Root, inventory: Inventory) -> dict[str, int]:
    """The NUMA node of each GPU's PCI function, by bus id (sysfs form); GPUs whose node
    is unknown or -1 (no NUMA) are left out."""
    out: dict[str, int] = {}
    for g in inventory.gpus:
        bus = history.normal_bus_id(g.pci_bus_id)
        if "/" in bus or bus.startswith("."):
            continue
        try:
            text = proc_text(root.path(f"/sys/bus/pci/devices/{bus}/numa_node"), max_bytes=64)
        except OSError:
            continue
        node = parse_decimal(text.strip(), hi=4095)
        if node is not None:
            out[bus] = node
    return out


def remap_inputs(root: Root, inventory: Inventory, checkpoint_mtime: float) -> RemapInputs:
    path = root.path(GPU_HISTORY_FILE)
    hist, problem = history.read(path)
    return RemapInputs(
        hist, problem, str(path), numa_nodes(root, inventory), checkpoint_mtime, boot_time(root)
    )


def present_pods(snapshot: HostSnapshot, uids: Iterable[str]) -> frozenset[str]:
    """Of `uids`, the pods kubelet still has on this node: its pod directory
    (`pods/<uid>` beside `device-plugins/`), which kubelet keeps while it knows the pod
    (a static pod rejected at admission too, which a restart admits again), or its pod
    cgroup (a pod whose containers crash-loop keeps its sandbox between restarts). A pod
    kubelet forgot, or that never ran since this boot and has no directory, has neither."""
    from gpuguard.devices.cgroupnames import CGROUPFS_POD, systemd_pod_uid

    wanted = {u for u in uids if _POD_UID.fullmatch(u)}
    if not wanted:
        return frozenset()
    pods_dir = PurePosixPath(snapshot.checkpoint_path).parent.parent / "pods"
    found = {u for u in wanted if snapshot.root.path(str(pods_dir / u)).is_dir()}
    if found == wanted:
        return frozenset(found)
    found.update(c.pod_uid for c in snapshot.containers())
    for path in snapshot.strays():
        uid = systemd_pod_uid(path.name)
        m = CGROUPFS_POD.fullmatch(path.name) if uid is None else None
        uid = m.group(1) if m else uid
        if uid:
            found.add(uid)
    return frozenset(found & wanted)


_POD_UID = re.compile(r"[0-9a-f][0-9a-f-]{0,63}")  # a name, never a path


@dataclass(frozen=True)
class KubeletStatus:
    unit: str
    pids: tuple[int, ...]
    unit_state: Optional[UnitState]  # None: systemd not reachable
    systemd_error: str = ""

    @property
    def unit_active(self) -> bool:
        return self.unit_state is not None and self.unit_state.active

    @property
    def running(self) -> bool:
        return self.unit_active or bool(self.pids)

    @property
    def has_dropin(self) -> bool:
        return self.unit_state is not None and any(
            p.endswith(f"/{self.unit}.d/{DROPIN_NAME}") for p in self.unit_state.drop_in_paths
        )

    def hook_will_run(self, *, jobs: bool = True) -> bool:
        """The unit is starting, stopping or (`jobs`) has a job queued, and has gpuguard's
        drop-in: its pre-start hook runs before kubelet does (after a plain stop, the
        next pass finds it stopped)."""
        state = self.unit_state
        return self.has_dropin and state is not None and state.in_transition(jobs=jobs)

    def describe(self) -> str:
        if self.unit_state is not None:
            s = f"{self.unit} is {self.unit_state.active_state}"
            if self.unit_state.load_state != "loaded":
                s += f" ({self.unit_state.load_state})"
        else:
            s = f"systemd not reachable ({self.systemd_error})"
        if self.pids:
            s += f"; kubelet process(es) {', '.join(map(str, self.pids))}"
        return s


async def kubelet_status(root: Root, systemd: Optional[Systemd], unit: str) -> KubeletStatus:
    pids = kubelet_pids(root)
    if systemd is None:
        return KubeletStatus(unit, pids, None, "not asked")
    from gpuguard.host.systemd import SystemdError

    try:
        state = await systemd.unit_state(unit)
    except SystemdError as e:
        return KubeletStatus(unit, pids, None, str(e))
    return KubeletStatus(unit, pids, state)
