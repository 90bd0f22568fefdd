"""kubelet's allocatable devices, read through its podresources API.

``v1.PodResourcesLister/GetAllocatableResources`` (GA in kubelet 1.28, on by default
as beta from 1.23, absent before 1.21) answers with the devices kubelet's device
manager counts healthy. When a replaced endpoint's stream ends (the re-admission
bridge stopped after the real plugin registered: docs/checkpoint.md), kubelet 1.34
disconnects the resource's CURRENT plugin and marks every device unhealthy; the plugin
does not know, its socket and process look fine, and only this answer shows it: 0.

One unary call on kubelet's unix socket (``pod-resources/kubelet.sock`` under
kubelet's root directory, the parent of the device-plugins directory), bounded by
TIMEOUT, made only when the step has a plugin to judge, through host/unarygrpc.py
(HTTP/2 by hand: grpcio would cost the daemon 10-14 MB of RSS). The answer is decoded
with host/protowire.py, the bridge's encoder (readmit/wire.py): no generated code, no
python3-protobuf. Field numbers are those of k8s.io/kubelet/pkg/apis/podresources/v1
api.proto: AllocatableResourcesResponse{devices = 1: ContainerDevices{resource_name =
1, device_ids = 2, topology = 3}, cpu_ids = 2, memory = 3}.

The answer drives plugin restarts, so only kubelet's may count: the socket is never
reached through a symbolic link, it must be a socket owned by root in directories
only root may change (host/pathtrust.py: from the root down, the links on the way
resolved and checked), and after connect its server must run as root (SO_PEERCRED):
a pod with a read-write hostPath on ``pod-resources`` cannot put its own socket or
server there. Otherwise the check is unchecked, with the reason. The socket is
connected through its directory, opened ``O_PATH`` after the check
(``/proc/self/fd/N/kubelet.sock``): the directory cannot be swapped meanwhile, and
no root prefix makes the path too long for ``sun_path``.
"""

from __future__ import annotations

import os
import posixpath
import stat
from dataclasses import dataclass, field
from typing import Mapping

from gpuguard.host import pathtrust, unarygrpc
from gpuguard.host.paths import Root
from gpuguard.host.protowire import fields

METHOD = "/v1.PodResourcesLister/GetAllocatableResources"
SOCKET = "pod-resources/kubelet.sock"  # under kubelet's root directory
TIMEOUT = 0.5  # seconds: a local kubelet answers in milliseconds
MAX_ANSWER = 4 << 20  # bytes: thousands of devices fit in far less


@dataclass(frozen=True)
class Allocatable:
    """What kubelet said it can allocate, or why it could not be asked."""

    socket: str  # as configured (under the root prefix)
    counts: Mapping[str, int] = field(default_factory=dict)  # resource -> device IDs
    unchecked: str = ""  # why there is no answer ("" when kubelet answered)


def kubelet_dir(socket_dir: str) -> str:
    """kubelet's root directory: the parent of its device-plugins directory."""
    return posixpath.dirname(socket_dir.rstrip("/")) or "/"


def decode_allocatable(data: bytes) -> dict[str, int]:
    """resource name -> how many distinct device IDs kubelet reports allocatable
    (kubelet sends one ContainerDevices per device; several are summed).
    ValueError on a message that is not an AllocatableResourcesResponse."""
    ids: dict[str, set[bytes]] = {}
    for dev in fields(data).get(1, []):
        f = fields(dev)
        name = f.get(1, [b""])[-1].decode()  # UnicodeDecodeError is a ValueError
        ids.setdefault(name, set()).update(f.get(2, []))
    return {name: len(v) for name, v in ids.items() if name}


def read_allocatable(root: Root, socket_dir: str, timeout: float = TIMEOUT) -> Allocatable:
    """kubelet's answer, or an unchecked Allocatable saying why there is none."""
    shown = posixpath.join(kubelet_dir(socket_dir), SOCKET)
    try:
        found = pathtrust.resolve(root.path("/"), shown, follow_last=False)
    except pathtrust.Untrusted as e:
        return Allocatable(shown, unchecked=f"not kubelet's socket: {e}")
    if found is None:
        why = f"{shown}: No such file or directory (kubelet before 1.21, or not running)"
        return Allocatable(shown, unchecked=why)
    if not stat.S_ISSOCK(found.st.st_mode):
        return Allocatable(shown, unchecked=f"{shown} is not a socket")
    if found.st.st_uid != 0:
        why = f"not kubelet's socket: {shown} is owned by uid {found.st.st_uid}, not root"
        return Allocatable(shown, unchecked=why)
    try:  # connected relative to its directory, held open: no path too long, no race
        dfd = os.open(found.real.parent, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        return Allocatable(shown, unchecked=f"{shown}: {e.strerror}")
    try:
        again = os.stat(found.real.name, dir_fd=dfd, follow_symlinks=False)
        if (again.st_dev, again.st_ino) != (found.st.st_dev, found.st.st_ino):
            return Allocatable(shown, unchecked=f"{shown}: replaced while it was checked")
        data = unarygrpc.call(
            METHOD,
            f"/proc/self/fd/{dfd}/{found.real.name}",
            b"",
            timeout=timeout,
            limit=MAX_ANSWER,
            peer_uid=0,
        )
    except unarygrpc.PeerError as e:
        return Allocatable(shown, unchecked=f"not kubelet's socket: {shown}: {e}")
    except unarygrpc.CallError as e:
        why = f"{e} (kubelet before 1.21, or its KubeletPodResourcesGetAllocatable gate off?)"
        return Allocatable(shown, unchecked=f"kubelet's GetAllocatableResources: {why}")
    except OSError as e:
        return Allocatable(shown, unchecked=f"{shown}: {e.strerror or e}")
    finally:
        os.close(dfd)
    try:
        return Allocatable(shown, decode_allocatable(data))
    except ValueError as e:
        return Allocatable(shown, unchecked=f"kubelet's answer is not readable: {e}")
