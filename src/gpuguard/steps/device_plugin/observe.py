"""The device plugin step's view of the host: the plugins (devices/plugins.py finds them),
the Kubernetes containers with NVIDIA nodes in their /dev, and kubelet's latest start."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Optional, Sequence

from gpuguard.devices.containers import ContainerCgroup
from gpuguard.devices.kubeletstart import KubeletStartWatch
from gpuguard.devices.kubelettrust import kubelets
from gpuguard.devices.plugins import GPU_NODE, KUBELET_SOCKET, NodeInfo, PluginInfo, list_nodes
from gpuguard.devices.processes import ProcessInfo, boot_time, process_start
from gpuguard.host.paths import Root
from gpuguard.steps.device_plugin.podresources import Allocatable


@dataclass(frozen=True)
class ContainerDev:
    container_id: str
    pod_uid: str
    runtime: str
    pid: int
    dev: tuple[NodeInfo, ...]

    @property
    def is_gpu(self) -> bool:
        return any(GPU_NODE.fullmatch(os.path.basename(n.path)) for n in self.dev)


@dataclass(frozen=True)
class PluginObservation:
    now: float
    host_nodes: tuple[NodeInfo, ...]
    plugins: tuple[PluginInfo, ...]
    kubelet_started: Optional[float]  # latest kubelet (re)start; None: unknown/not running
    containers: tuple[ContainerDev, ...] = ()
    # identity -> the remembered plugin process, when it still runs (F4: its socket is gone)
    remembered: Mapping[str, Optional[ProcessInfo]] = field(default_factory=dict)
    # The node's GPUs (the inventory, else its /dev/nvidiaN) and what kubelet reports
    # allocatable (podresources.py); None: not asked (nothing to judge)
    gpus: int = 0
    allocatable: Optional[Allocatable] = None
    # from the inventory: its GPUs without MIG devices, and its MIG devices (None: no
    # inventory known, the GPUs counted from /dev); allocatable.py judges by them
    whole_gpus: Optional[int] = None
    mig_devices: Optional[int] = None
    # when gpuguard's re-admission bridge registered in this kubelet run (readmit/state.py):
    # a plugin socket older than that may have been replaced by it (F4)
    bridge_registered: Optional[float] = None
    # when the bridge's streams of this kubelet run ended (bridge_end.py): kubelet then
    # dropped the plugin that replaced them
    bridge_ended: Optional[float] = None
    # what told kubelet's start (devices/kubeletstart.py): its socket's listener, or
    # its inode only, and why ("": no kubelet.sock)
    kubelet_told_by: str = ""


def kubelet_started(
    root: Root,
    socket_dir: str,
    *,
    unit_started: Optional[float] = None,
    units: Sequence[str] = (),
    watch: Optional[KubeletStartWatch] = None,
) -> Optional[float]:
    """The latest kubelet (re)start, Unix time, the later of the unit's
    InactiveExitTimestamp and: the start of the process listening on kubelet.sock
    (devices/kubeletstart.py: a touch, chown or xattr change of the socket moves
    nothing; its boot-relative start put on the wall clock once, when first read, so
    that a clock step moves it no more than the plugin sockets' ctimes it is compared
    with); where no listener is read, the start of a kubelet process gpuguard trusts in
    one of `units` (devices/kubelettrust.py: a local user's process named kubelet,
    started now, would make every plugin look unregistered and get it restarted); where
    neither is known, kubelet.sock's ctime as first seen for its inode (``watch``
    remembers it across passes). None when kubelet does not seem to run (no
    kubelet.sock, no process)."""
    if watch is None:
        watch = KubeletStartWatch(root, root.path(socket_dir) / KUBELET_SOCKET)
    run = watch.look()
    pids = [p.pid for p in kubelets(root, units).trusted]
    if run is None and not pids:
        return None
    times: list[float] = []
    if unit_started:
        times.append(unit_started)
    if run is not None and run.listener is not None:
        times.append(run.wall())  # the process that listens is kubelet
    elif pids:
        btime = boot_time(root)
        times += [s for s in (process_start(root, pid, btime) for pid in pids) if s is not None]
    elif run is not None:
        times.append(run.wall())  # the inode only: its ctime as first seen
    return max(times) if times else None


def bridge_registered(root: Root, kubelet_started: Optional[float]) -> Optional[float]:
    """When the re-admission bridge's registration returned, if it did in the kubelet
    run that started at ``kubelet_started`` (kubelet.sock comes first)."""
    from gpuguard.host.statefile import load
    from gpuguard.readmit.state import SPEC, STATE_FILE

    s = load(root.path(STATE_FILE), SPEC).value
    at = s.registered_at if s is not None else None
    if at is None or kubelet_started is None or at < kubelet_started:
        return None
    return at


def container_devs(root: Root, containers: Iterable[ContainerCgroup]) -> tuple[ContainerDev, ...]:
    """Kubernetes containers with their NVIDIA nodes (GPU containers only)."""
    out: list[ContainerDev] = []
    for c in containers:
        for pid in c.pids[:1]:
            dev = list_nodes(root.path(f"/proc/{pid}/root/dev"))
            if dev is None:
                continue
            cd = ContainerDev(c.container_id, c.pod_uid, c.runtime, pid, dev)
            if cd.is_gpu:
                out.append(cd)
    return tuple(out)
