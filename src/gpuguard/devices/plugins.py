"""Find the device plugins and what they see: sockets, serving processes, their /dev.

A device plugin is a unix socket in kubelet's device-plugins directory (SocketDir,
``/var/lib/kubelet/device-plugins``) other than ``kubelet.sock``, served by one
process. The serving process is found the way ``ss -xlp`` does it, but precisely:

1. /proc/<pid>/net/unix is read once per network namespace (a plugin in a pod
   without hostNetwork binds its socket in the pod's namespace, which the host's
   /proc/net/unix does not list); a listening entry (flag __SO_ACCEPTCON) whose
   path has a plugin socket's name is a candidate, by socket inode;
2. the processes of that namespace holding ``socket:[inode]`` among their fds;
3. the candidate is confirmed when ``/proc/<pid>/root/<path it bound>`` is the very
   file (st_dev, st_ino) the host sees in SocketDir: the path in /proc/net/unix is
   the one in the plugin's mount namespace, which need not be the host's.

Which resource a socket serves is not in the socket. The heuristic, by name
(NVIDIA's plugin names its socket ``nvidia-<resource name without the
nvidia.com/ prefix>.sock``):

- ``nvidia.sock`` and ``nvidia-gpu.sock``: ``nvidia.com/gpu``;
- ``nvidia-<x>.sock`` (``nvidia-mig-1g.10gb.sock``, ``nvidia-gpu.shared.sock``):
  ``nvidia.com/<x>``;
- ``extra`` (glob of the socket name -> resource) is consulted first, for plugins
  with other names (e.g. Alibaba's gpushare); anything else is not a GPU plugin and
  is ignored.

Start times are wall-clock seconds: /proc/<pid>/stat field 22 (clock ticks since
boot) plus ``btime`` of /proc/stat, so about one second precise.
"""

from __future__ import annotations

import fnmatch
import logging
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Mapping, Optional

from gpuguard.devices.nodes import DeviceNode, list_dev_dir
from gpuguard.devices.processes import ProcessInfo, _pids, boot_time, process_info
from gpuguard.host.numparse import parse_decimal
from gpuguard.host.paths import DEVICE_PLUGINS_DIR, Root
from gpuguard.host.safeio import proc_text

log = logging.getLogger(__name__)

KUBELET_SOCKET = "kubelet.sock"
SO_ACCEPTCON = 0x10000  # __SO_ACCEPTCON in /proc/net/unix Flags: a listening socket

# The nodes a plugin hands to containers (seed 004's apiDeviceSpecs) and the GPUs.
_PLUGIN_NODE = re.compile(r"nvidia(?:[0-9]+|ctl|-uvm|-uvm-tools|-modeset)")  # fullmatch
GPU_NODE = re.compile(r"nvidia[0-9]+")  # fullmatch
UVM_PATH = "/dev/nvidia-uvm"

_SOCKET_GPU = ("nvidia.sock", "nvidia-gpu.sock")
_SOCKET_NVIDIA = re.compile(r"nvidia-([\x21-\x7e]+)\.sock")  # fullmatch; printable ASCII


def resource_for_socket(name: str, extra: Optional[Mapping[str, str]] = None) -> str:
    """The extended resource a plugin socket serves ("" when not a GPU plugin)."""
    for pattern, resource in (extra or {}).items():
        if fnmatch.fnmatchcase(name, pattern):
            return resource
    if name in _SOCKET_GPU:
        return "nvidia.com/gpu"
    m = _SOCKET_NVIDIA.fullmatch(name)
    return f"nvidia.com/{m.group(1)}" if m else ""


# One device-node type for every lister (devices/nodes.py); the plugin step's nodes
# carry their ctime and compare by `key` (type, major, minor).
NodeInfo = DeviceNode


@dataclass(frozen=True)
class PluginInfo:
    socket: str  # host path of the socket
    resource: str
    socket_ctime: float
    process: Optional[ProcessInfo]  # None: nobody listens on it
    dev: Optional[tuple[NodeInfo, ...]]  # its /dev view; None: no process or unreadable

    @property
    def name(self) -> str:
        return os.path.basename(self.socket)

    @property
    def identity(self) -> str:
        """Stable across restarts (container ids and pids are not)."""
        return self.resource or self.name


def parse_unix_table(text: str) -> list[tuple[int, int, str]]:
    """(flags, inode, path) of each path-bound entry of a /proc/net/unix table."""
    out: list[tuple[int, int, str]] = []
    for line in text.splitlines()[1:]:
        f = line.split(None, 7)
        if len(f) < 8 or not f[7].startswith("/"):
            continue
        try:
            out.append((int(f[3], 16), int(f[6]), f[7].strip()))
        except ValueError:
            continue
    return out


def find_listeners(root: Root, sockets: Mapping[str, os.stat_result]) -> dict[str, tuple[int, str]]:
    """Host socket path -> (pid, path as that process bound it), for listening sockets.

    ``sockets`` maps each host socket path to its lstat()."""
    if not sockets:
        return {}
    by_name: dict[str, list[str]] = {}
    for host_path in sockets:
        by_name.setdefault(os.path.basename(host_path), []).append(host_path)
    netns: dict[str, list[int]] = {}
    for pid in _pids(root):
        try:
            ns = os.readlink(root.path(f"/proc/{pid}/ns/net"))
        except OSError:
            continue
        netns.setdefault(ns, []).append(pid)
    found: dict[str, tuple[int, str]] = {}
    for pids in netns.values():
        table = ""
        for pid in pids:  # the first one whose table is readable
            try:
                table = proc_text(root.path(f"/proc/{pid}/net/unix"))
                break
            except OSError:
                continue
        cands: dict[int, str] = {}
        for flags, inode, path in parse_unix_table(table):
            if flags & SO_ACCEPTCON and os.path.basename(path) in by_name:
                cands[inode] = path
        if not cands:
            continue
        for pid in pids:
            fd_dir = root.path(f"/proc/{pid}/fd")
            try:
                fds = os.listdir(fd_dir)
            except OSError:
                continue
            for fd in fds:
                try:
                    link = os.readlink(fd_dir / fd)
                except OSError:
                    continue
                if not link.startswith("socket:["):
                    continue
                number = parse_decimal(link[8:-1]) if link.endswith("]") else None
                inner = cands.get(number) if number is not None else None
                if inner is None:
                    continue
                for host_path in by_name[os.path.basename(inner)]:
                    if host_path in found:
                        continue
                    if _same_file(root, pid, inner, sockets[host_path]):
                        found[host_path] = (pid, inner)
    return found


def _same_file(root: Root, pid: int, inner: str, host_st: os.stat_result) -> bool:
    try:
        st = os.stat(root.path(f"/proc/{pid}/root{inner}"), follow_symlinks=False)
    except OSError as e:
        log.debug("cannot confirm %s of pid %d: %s", inner, pid, e.strerror)
        return False
    return (st.st_dev, st.st_ino) == (host_st.st_dev, host_st.st_ino)


def list_nodes(
    dev_dir: Path, pattern: re.Pattern[str] = _PLUGIN_NODE
) -> Optional[tuple[NodeInfo, ...]]:
    """The NVIDIA nodes a plugin cares about in ``dev_dir`` (None: not listable)."""
    return list_dev_dir(dev_dir, lambda name: bool(pattern.fullmatch(name)), block=True, ctime=True)


def discover_plugins(
    root: Root,
    socket_dir: str = DEVICE_PLUGINS_DIR,
    *,
    extra: Optional[Mapping[str, str]] = None,
    btime: Optional[float] = None,
) -> tuple[PluginInfo, ...]:
    """Every GPU plugin socket in ``socket_dir``, with its serving process and /dev view."""
    d = root.path(socket_dir)
    sockets: dict[str, os.stat_result] = {}
    try:
        names = sorted(os.listdir(d))
    except OSError as e:
        log.debug("cannot list %s: %s", d, e.strerror)
        return ()
    for name in names:
        if name == KUBELET_SOCKET or not resource_for_socket(name, extra):
            continue
        try:
            st = os.stat(d / name, follow_symlinks=False)
        except OSError:
            continue
        if stat.S_ISSOCK(st.st_mode):
            sockets[str(d / name)] = st
    listeners = find_listeners(root, sockets)
    bt = boot_time(root) if btime is None else btime
    out: list[PluginInfo] = []
    for host_path, st in sockets.items():
        proc: Optional[ProcessInfo] = None
        dev: Optional[tuple[NodeInfo, ...]] = None
        if host_path in listeners:
            pid = listeners[host_path][0]
            proc = process_info(root, pid, bt)
            if proc is not None:
                dev = list_nodes(root.path(f"/proc/{pid}/root/dev"))
        name = os.path.basename(host_path)
        out.append(
            PluginInfo(
                socket=f"{socket_dir.rstrip('/')}/{name}",
                resource=resource_for_socket(name, extra),
                socket_ctime=st.st_ctime,
                process=proc,
                dev=dev,
            )
        )
    return tuple(out)


def find_plugin(plugins: Iterable[PluginInfo], identity: str) -> Optional[PluginInfo]:
    for p in plugins:
        if p.identity == identity:
            return p
    return None
