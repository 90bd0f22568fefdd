"""Kubernetes containers from the kubepods cgroup tree, cgroup v1 and v2, both drivers.

Layouts (kubelet's cgroup-root is ``/`` unless ``--cgroup-root`` says otherwise):

- systemd driver: ``kubepods.slice/kubepods-burstable.slice/
  kubepods-burstable-pod<uid with _ for ->.slice/cri-containerd-<id>.scope``
  (``crio-<id>.scope``, ``docker-<id>.scope``; guaranteed pods sit directly under
  kubepods.slice as ``kubepods-pod<uid>.slice``);
- cgroupfs driver: ``kubepods/burstable/pod<uid>/<id>``, ``kubepods/pod<uid>/<id>``
  (cri-o names it ``crio-<id>``).

The name patterns live in devices/cgroupnames.py.

Hierarchies: v1 devices at /sys/fs/cgroup/devices; cgroup2 at /sys/fs/cgroup/unified on
hybrid hosts and /sys/fs/cgroup on unified ones. On a hybrid host BOTH apply to a
device open (the kernel runs the cgroup2 BPF device programs, then the v1 controller),
so a container is reported with both paths when both exist.

Processes are followed wherever the runtime put them: runc runs the container's process
in its scope (or cgroupfs directory), crun (1.8 and newer, systemd driver) in a
sub-cgroup of it, ``SCOPE/container``, whose device policy (its own v1 list, or its own
BPF program on v2) is what the kernel checks on top of the scope's. A container's
record keeps both: the scope, which a durable grant (DeviceAllow=) changes, and the
cgroup its process is in (`process_v2`, `process_v1`), which judges its opens. A scope
that holds processes (``cgroup.events``: populated) none of which is found within
`SUB_DEPTH` levels is a container that cannot be audited (`problem`), never one that
is silently left out; a directory under kubepods that is no container, pod or QoS
class is kept as a stray (`Kubepods.strays`): the container access step reports one
whose processes hold NVIDIA nodes open.

The walk never raises on odd trees: unknown names, undecodable names, vanished
directories (a pod deleted mid-walk: ENOENT) are skipped with a debug reason. Depth is
bounded by the layout (kubepods / qos / pod / container, and `SUB_DEPTH` below a
container), so a deep tree costs nothing.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional

from gpuguard.devices.cgroupnames import (
    KUBEPODS_SLICE,
    RUNTIME,
    SYSTEMD_CONTAINER,
    SYSTEMD_QOS,
    systemd_pod_uid,
)
from gpuguard.devices.cgrouptree import SUB_DEPTH, dir_names, find_processes, populated
from gpuguard.devices.cgrouptree import read_pids as read_pids  # re-exported
from gpuguard.devices.kubepods import Found, walk
from gpuguard.host.echo import cut
from gpuguard.host.paths import Root
from gpuguard.host.safeio import PROC_MAX, UnsafeFileError, read_bytes, read_kernel_text

log = logging.getLogger(__name__)

CGROUP_MOUNT = "/sys/fs/cgroup"


# The sandbox's only process runs the pause binary (k8s.gcr.io/pause: /pause).
_PAUSE_COMMANDS = ("/pause", "pause")


@dataclass(frozen=True)
class CgroupLayout:
    """Where the hierarchies are, as host paths (None: not mounted)."""

    v1_devices: Optional[str]
    v2: Optional[str]

    @property
    def kind(self) -> str:
        if self.v1_devices and self.v2:
            return "hybrid"
        if self.v2:
            return "unified"
        return "legacy" if self.v1_devices else "none"


@dataclass(frozen=True)
class ContainerCgroup:
    pod_uid: str
    container_id: str
    runtime: str  # "containerd" | "cri-o" | "docker" | "unknown" (cgroupfs, plain id)
    driver: str  # "systemd" | "cgroupfs"
    cgroup_v1_devices: Optional[Path]  # under the Root, ready to open
    cgroup_v2: Optional[Path]
    unit: Optional[str]  # the systemd scope, e.g. "cri-containerd-<id>.scope"
    pids: tuple[int, ...]
    # Non-empty: this container's own files could not be read (a malformed cgroup.procs,
    # a FIFO where a file should be); it gets a finding, every other one goes on.
    problem: str = ""
    # The cgroup its processes are in when the runtime put them below the scope or
    # directory above (crun: SCOPE/container); None: that cgroup itself.
    process_v2: Optional[Path] = None
    process_v1: Optional[Path] = None

    @property
    def key(self) -> tuple[str, str]:
        return (self.pod_uid, self.container_id)

    @property
    def layout(self) -> str:
        """ "v1" where a v1 devices cgroup decides (hybrid hosts too), else "v2"."""
        return "v1" if self.cgroup_v1_devices is not None else "v2"

    @property
    def mechanism(self) -> str:
        """What admits its devices, so what a repair can change: ``v1-rule`` (its
        devices.list), ``scope-device-allow`` (v2: the program systemd builds from its
        scope's DeviceAllow=), ``own-program`` (v2 without a scope: the runtime's own
        BPF program)."""
        if self.cgroup_v1_devices is not None:
            return "v1-rule"
        return "scope-device-allow" if self.unit is not None else "own-program"

    @property
    def v2_dir(self) -> Optional[Path]:
        """The cgroup2 directory its processes are in (its opens are judged there)."""
        return self.process_v2 or self.cgroup_v2

    @property
    def v1_dir(self) -> Optional[Path]:
        """The v1 devices directory its processes are in (the kernel checks that one)."""
        return self.process_v1 or self.cgroup_v1_devices


def detect_layout(root: Root) -> CgroupLayout:
    """Read the root's /proc/self/mountinfo; fall back to looking at the tree.

    mountinfo is authoritative on a real host (a stray directory named ``unified`` is not
    a cgroup2 mount); the fallback serves fake roots and containers without /proc."""
    v1: Optional[str] = None
    v2: Optional[str] = None
    try:
        text = read_kernel_text(root.path("/proc/self/mountinfo"), what="mountinfo") or ""
    except UnsafeFileError as e:
        log.debug("ignoring mountinfo: %s", e.message)
        text = ""
    for line in text.split("\n"):
        left, sep, right = line.partition(" - ")
        fields, rfields = left.split(), right.split()
        if not sep or len(fields) < 5 or len(rfields) < 3:
            continue
        mountpoint, fstype, opts = fields[4], rfields[0], rfields[2].split(",")
        if not mountpoint.startswith(CGROUP_MOUNT):
            continue
        if fstype == "cgroup2" and v2 is None:
            v2 = mountpoint
        elif fstype == "cgroup" and "devices" in opts and v1 is None:
            v1 = mountpoint
    if text and (v1 or v2):
        return CgroupLayout(v1, v2)
    if root.path(f"{CGROUP_MOUNT}/devices/devices.list").exists():
        v1 = f"{CGROUP_MOUNT}/devices"
    if root.path(f"{CGROUP_MOUNT}/cgroup.controllers").exists():
        v2 = CGROUP_MOUNT
    elif root.path(f"{CGROUP_MOUNT}/unified/cgroup.controllers").exists():
        v2 = f"{CGROUP_MOUNT}/unified"
    return CgroupLayout(v1, v2)


def _is_pause(root: Root, pids: tuple[int, ...]) -> bool:
    """True when the cgroup's only process is the pause binary (the pod sandbox)."""
    if len(pids) != 1:
        return False
    try:
        data, _st = read_bytes(
            root.path(f"/proc/{pids[0]}/cmdline"), what="cmdline", max_bytes=PROC_MAX
        )
    except UnsafeFileError:
        return False  # gone, or not a cmdline: not provably the sandbox
    argv0 = data.split(b"\0", 1)[0].decode(errors="replace")
    return argv0 in _PAUSE_COMMANDS or argv0.endswith("/pause")


def discover_containers(
    root: Root,
    layout: Optional[CgroupLayout] = None,
    *,
    cgroup_root: str = "/",
    skip_pause: bool = True,
) -> tuple[ContainerCgroup, ...]:
    """Every kubepods container with its v1 devices and v2 directories, sorted by key.

    ``cgroup_root`` is kubelet's ``--cgroup-root`` (tests use a private sub-tree)."""
    return discover_kubepods(root, layout, cgroup_root=cgroup_root, skip_pause=skip_pause)[0]


Kubepods = tuple[tuple[ContainerCgroup, ...], tuple[Path, ...]]  # containers, strays


def discover_kubepods(
    root: Root,
    layout: Optional[CgroupLayout] = None,
    *,
    cgroup_root: str = "/",
    skip_pause: bool = True,
) -> Kubepods:
    """`discover_containers`, and the strays: every directory of the kubepods tree that
    is no container (kubepods, QoS classes, pods, names no runtime gives), in cgroup2
    where it is mounted, else in the v1 devices hierarchy (a caller looks for
    processes in them)."""
    layout = layout or detect_layout(root)
    sub = cgroup_root.strip("/")
    found: dict[tuple[str, str], dict[str, Found]] = {}
    strays: list[Path] = []
    refused: list[Path] = []
    for which, mount in (("v1", layout.v1_devices), ("v2", layout.v2)):
        if mount is None:
            continue
        base = root.path(mount)
        if sub:
            base = base / sub
        # every process is in one cgroup2 directory: its strays are enough where it is
        # mounted (a hybrid host's v1 pod slices may hold a container's process that
        # systemd left there, which its cgroup2 scope attributes)
        keep: list[Path] = strays if which == "v2" or layout.v2 is None else []
        for f in walk(base, keep, refused):
            found.setdefault((f.pod_uid, f.container_id), {})[which] = f
    out: list[ContainerCgroup] = []
    for key in sorted(found):
        c = _container(root, found[key], skip_pause)
        if c is not None:
            out.append(c)
    return tuple(out) + _refused(refused), tuple(strays)


def _refused(paths: list[Path]) -> tuple[ContainerCgroup, ...]:
    """A cgroup under kubepods whose name has a control character, as a container that
    cannot be audited (its finding names it, escaped): never matched as a pod or a
    container, never granted, never given a drop-in under a name systemd would not
    load. One per name (a hybrid host lists it in both hierarchies)."""
    out: dict[str, ContainerCgroup] = {}
    for p in paths:
        name = cut(p.name, 100)
        out.setdefault(
            name,
            ContainerCgroup(
                pod_uid=cut(p.parent.name, 100),
                container_id=f"refused:{name}",
                runtime="unknown",
                driver="systemd" if p.name.endswith((".scope", ".slice")) else "cgroupfs",
                cgroup_v1_devices=None,
                cgroup_v2=None,
                unit=None,
                pids=(),
                problem=f"cgroup {cut(str(p), 300)}: its name has a control character; "
                "no runtime makes one and systemd loads no unit by it, so gpuguard "
                "refuses it — remove the directory or find what made it",
            ),
        )
    return tuple(out[k] for k in sorted(out))


def _placed(
    v1: Optional[Path], v2: Optional[Path]
) -> tuple[tuple[int, ...], Optional[Path], Optional[Path], str]:
    """The container's processes, the cgroups below its scope that hold them in each
    hierarchy (None: the scope itself), and why it cannot be audited ("" if it can).
    Raises UnsafeFileError (a cgroup.procs that is not the kernel's)."""
    pids: tuple[int, ...] = ()
    where2 = where1 = None
    if v2 is not None:
        where2, pids = find_processes(v2)
    # v1 looked into only where cgroup2 does not say it is the scope itself (as it is
    # with runc: one read per container, as before crun was followed)
    if v1 is not None and (not pids or where2 != v2):
        where1, pids1 = find_processes(v1)
        pids = pids or pids1
    problem = ""
    if not pids and v2 is not None and populated(v2):
        problem = (
            f"{v2} holds processes (cgroup.events: populated 1) but none in it or "
            f"within {SUB_DEPTH} levels below it: gpuguard cannot tell which is the "
            "container's, so it judges and grants nothing; check where its runtime puts "
            "the container's process"
        )
    sub2 = where2 if where2 is not None and where2 != v2 else None
    sub1 = where1 if where1 is not None and where1 != v1 else None
    return pids, sub1, sub2, problem


def _container(root: Root, by: dict[str, Found], skip_pause: bool) -> Optional[ContainerCgroup]:
    """One container from what the walk found of it in each hierarchy; None: the sandbox."""
    first = by.get("v1") or by["v2"]
    v1 = by["v1"].path if "v1" in by else None
    v2 = by["v2"].path if "v2" in by else None
    sub1 = sub2 = None
    try:
        pids, sub1, sub2, problem = _placed(v1, v2)
    except UnsafeFileError as e:
        pids, problem = (), e.message
    if skip_pause and _is_pause(root, pids):
        log.debug("skipping %s/%s: pod sandbox (pause)", first.pod_uid, first.container_id)
        return None
    return ContainerCgroup(
        pod_uid=first.pod_uid,
        container_id=first.container_id,
        runtime=first.runtime,
        driver=first.driver,
        cgroup_v1_devices=v1,
        cgroup_v2=v2,
        unit=first.unit,
        pids=pids,
        problem=problem,
        process_v2=sub2,
        process_v1=sub1,
    )


def with_fresh_pids(root: Root, c: ContainerCgroup) -> Optional[ContainerCgroup]:
    """`c` with its processes found again (a scope waiting for its process: crun moves
    it below the scope); None when its cgroup is gone or its process turns out to be
    the pod's sandbox."""
    d = c.cgroup_v2 if c.cgroup_v2 is not None else c.cgroup_v1_devices
    if d is None or not d.is_dir():
        return None
    try:
        pids, sub1, sub2, problem = _placed(c.cgroup_v1_devices, c.cgroup_v2)
    except UnsafeFileError as e:
        return replace(c, pids=(), problem=e.message)
    if _is_pause(root, pids):
        return None
    return replace(c, pids=pids, problem=problem, process_v1=sub1, process_v2=sub2)


def placement_pending(c: ContainerCgroup, layout: CgroupLayout) -> str:
    """Why a new scope's cgroups are not all there yet ("" once they are). systemd makes
    a scope's cgroup in each hierarchy in turn; on a hybrid host a scope seen in cgroup2
    before its v1 devices cgroup exists would be judged by the programs of cgroup2 alone,
    where nothing confines it, and pass for one that admits every device."""
    if layout.kind == "hybrid" and c.cgroup_v1_devices is None:
        return "its cgroup in the v1 devices hierarchy is not there yet"
    return ""


def _scope_under(kubepods: str, unit: str) -> Optional[tuple[str, str]]:
    """The pod UID and `unit`'s path relative to `kubepods` (``QOS/POD/unit`` or
    ``POD/unit``); None if no pod slice holds it. One stat per pod, strings only: a
    burst of new scopes on a node of 200 pods asks this for each (pathlib objects and a
    sorted walk cost ~7 ms a lookup on a hybrid host, where both hierarchies were
    searched)."""
    for name in dir_names(kubepods):
        uid = systemd_pod_uid(name)
        if uid:
            if os.path.isdir(os.path.join(kubepods, name, unit)):
                return uid, f"{name}/{unit}"
        elif SYSTEMD_QOS.fullmatch(name):
            for qname in dir_names(os.path.join(kubepods, name)):
                quid = systemd_pod_uid(qname)
                if quid and os.path.isdir(os.path.join(kubepods, name, qname, unit)):
                    return quid, f"{name}/{qname}/{unit}"
    return None


def find_scope(
    root: Root,
    unit: str,
    layout: Optional[CgroupLayout] = None,
    *,
    cgroup_root: str = "/",
) -> Optional[ContainerCgroup]:
    """The container of one systemd scope (``cri-containerd-<id>.scope``), found by
    looking for it in each pod slice rather than walking every container: a new scope's
    fast path must not cost a walk of the whole tree. None: no such cgroup (not started
    yet, or gone), not a container scope, or the pod's sandbox."""
    m = SYSTEMD_CONTAINER.fullmatch(unit)
    if m is None:
        return None
    layout = layout or detect_layout(root)
    sub = cgroup_root.strip("/")
    by: dict[str, Found] = {}
    found: Optional[tuple[str, str]] = None  # pod UID, path under kubepods.slice
    for which, mount in (("v1", layout.v1_devices), ("v2", layout.v2)):
        if mount is None:
            continue
        kubepods = os.path.join(root.path(mount), sub, KUBEPODS_SLICE)
        # A hybrid host holds the same tree in both hierarchies: searched once.
        if found is None or not os.path.isdir(os.path.join(kubepods, found[1])):
            found = _scope_under(kubepods, unit)
        if found is not None:
            uid, rel = found
            path = Path(kubepods, rel)
            by[which] = Found(uid, m.group(2), RUNTIME[m.group(1)], "systemd", unit, path)
    return _container(root, by, skip_pause=True) if by else None
