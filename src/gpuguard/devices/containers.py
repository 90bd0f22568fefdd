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

The walk never raises on odd trees: unknown names, undecodable names, vanished
directories (a pod deleted mid-walk: ENOENT) are skipped with a debug reason. Depth is
bounded by the layout (kubepods / qos / pod / container), so a deep tree costs nothing.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Iterator, Optional

from gpuguard.devices.cgroupnames import (
    CGROUPFS_CONTAINER,
    CGROUPFS_POD,
    CGROUPFS_QOS,
    KUBEPODS_DIR,
    KUBEPODS_SLICE,
    RUNTIME,
    SYSTEMD_CONTAINER,
    SYSTEMD_QOS,
    has_control,
    systemd_pod_uid,
)
from gpuguard.host.echo import cut
from gpuguard.host.numparse import clip, parse_decimal
from gpuguard.host.paths import Root
from gpuguard.host.safeio import CGROUP_MAX, PROC_MAX, UnsafeFileError, read_bytes, read_kernel_text

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


@dataclass(frozen=True)
class _Found:
    pod_uid: str
    container_id: str
    runtime: str
    driver: str
    unit: Optional[str]
    path: Path


def _dir_names(d: str) -> list[str]:
    """Names of `d`'s child directories ([] when it vanished; an odd entry skipped)."""
    out = []
    try:
        with os.scandir(d) as it:
            for e in it:
                try:
                    if e.is_dir(follow_symlinks=False):
                        out.append(e.name)
                except OSError:
                    log.debug("skipping %s: cannot stat it", e.path)
    except OSError as err:
        log.debug("cannot list %s: %s", d, err.strerror)
    return out


def _subdirs(d: Path, refused: Optional[list[Path]] = None) -> list[tuple[str, Path]]:
    """Child directories, sorted; [] with a debug reason when ``d`` vanished or is odd.
    A name with a control character is never matched against a pattern: it goes to
    `refused` (a finding), or is skipped."""
    out = []
    for name in _dir_names(os.fspath(d)):
        if has_control(name):
            if refused is not None:
                refused.append(d / name)
            continue
        out.append((name, d / name))
    return sorted(out)


def _systemd_pods(kubepods: Path, refused: list[Path]) -> Iterator[tuple[str, Path]]:
    for name, path in _subdirs(kubepods, refused):
        uid = systemd_pod_uid(name)
        if uid:
            yield uid, path
        elif SYSTEMD_QOS.fullmatch(name):
            for qname, qpath in _subdirs(path, refused):
                quid = systemd_pod_uid(qname)
                if quid:
                    yield quid, qpath
                else:
                    log.debug("skipping %s: not a pod slice", qpath)
        else:
            log.debug("skipping %s: not a pod or QoS slice", path)


def _cgroupfs_pods(kubepods: Path, refused: list[Path]) -> Iterator[tuple[str, Path]]:
    for name, path in _subdirs(kubepods, refused):
        m = CGROUPFS_POD.fullmatch(name)
        if m:
            yield m.group(1), path
        elif name in CGROUPFS_QOS:
            for qname, qpath in _subdirs(path, refused):
                qm = CGROUPFS_POD.fullmatch(qname)
                if qm:
                    yield qm.group(1), qpath
                else:
                    log.debug("skipping %s: not a pod directory", qpath)
        else:
            log.debug("skipping %s: not a pod or QoS directory", path)


def _walk(hierarchy: Path, refused: list[Path]) -> Iterator[_Found]:
    systemd = hierarchy / KUBEPODS_SLICE
    for uid, pod in _systemd_pods(systemd, refused) if systemd.is_dir() else ():
        for name, path in _subdirs(pod, refused):
            m = SYSTEMD_CONTAINER.fullmatch(name)
            if not m:
                # crio-conmon-<id>.scope is the monitor, not the container
                log.debug("skipping %s: not a container scope", path)
                continue
            yield _Found(uid, m.group(2), RUNTIME[m.group(1)], "systemd", name, path)
    cgroupfs = hierarchy / KUBEPODS_DIR
    for uid, pod in _cgroupfs_pods(cgroupfs, refused) if cgroupfs.is_dir() else ():
        for name, path in _subdirs(pod, refused):
            m = CGROUPFS_CONTAINER.fullmatch(name)
            if not m:
                log.debug("skipping %s: not a container directory", path)
                continue
            runtime = RUNTIME[m.group(1)] if m.group(1) else "unknown"
            yield _Found(uid, m.group(2), runtime, "cgroupfs", None, path)


MAX_PID = 2**22  # the kernel's PID_MAX_LIMIT


def read_pids(cgroup_dir: Path) -> tuple[int, ...]:
    """cgroup.procs of a v1 or v2 directory; () if it vanished.

    Anything but PIDs, one per line, raises UnsafeFileError naming the file (the caller
    charges it to this container only)."""
    path = cgroup_dir / "cgroup.procs"
    text = read_kernel_text(path, what="cgroup.procs", max_bytes=CGROUP_MAX)
    if text is None:
        return ()
    pids = []
    for lineno, word in enumerate(text.split("\n"), 1):
        if not word:
            continue
        pid = parse_decimal(word, hi=MAX_PID)
        if pid == 0:  # a process outside our PID namespace: the kernel shows 0
            continue
        if pid is None:
            raise UnsafeFileError(
                f"{path}:{lineno}: {clip(word)} is not a process ID; the kernel writes one "
                "PID per line — check what wrote this file"
            )
        pids.append(pid)
    return tuple(pids)


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
    layout = layout or detect_layout(root)
    sub = cgroup_root.strip("/")
    found: dict[tuple[str, str], dict[str, _Found]] = {}
    refused: list[Path] = []
    for which, mount in (("v1", layout.v1_devices), ("v2", layout.v2)):
        if mount is None:
            continue
        base = root.path(mount)
        if sub:
            base = base / sub
        for f in _walk(base, refused):
            found.setdefault((f.pod_uid, f.container_id), {})[which] = f
    out: list[ContainerCgroup] = []
    for key in sorted(found):
        c = _container(root, found[key], skip_pause)
        if c is not None:
            out.append(c)
    return tuple(out) + _refused(refused)


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


def _container(root: Root, by: dict[str, _Found], skip_pause: bool) -> Optional[ContainerCgroup]:
    """One container from what the walk found of it in each hierarchy; None: the sandbox."""
    first = by.get("v1") or by["v2"]
    v1 = by["v1"].path if "v1" in by else None
    v2 = by["v2"].path if "v2" in by else None
    problem = ""
    try:
        pids = read_pids(v2) if v2 is not None else ()
        if not pids and v1 is not None:
            pids = read_pids(v1)
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
    )


def with_fresh_pids(root: Root, c: ContainerCgroup) -> Optional[ContainerCgroup]:
    """`c` with its cgroup.procs read again (a scope waiting for its process); None when
    its cgroup is gone or its process turns out to be the pod's sandbox."""
    d = c.cgroup_v2 if c.cgroup_v2 is not None else c.cgroup_v1_devices
    if d is None or not d.is_dir():
        return None
    try:
        pids = read_pids(c.cgroup_v2) if c.cgroup_v2 is not None else ()
        if not pids and c.cgroup_v1_devices is not None:
            pids = read_pids(c.cgroup_v1_devices)
    except UnsafeFileError as e:
        return replace(c, pids=(), problem=e.message)
    return None if _is_pause(root, pids) else replace(c, pids=pids)


def _scope_under(kubepods: str, unit: str) -> Optional[tuple[str, str]]:
    """The pod UID and `unit`'s path relative to `kubepods` (``QOS/POD/unit`` or
    ``POD/unit``); None if no pod slice holds it. One stat per pod, strings only: a
    burst of new scopes on a node of 200 pods asks this for each (pathlib objects and a
    sorted walk cost ~7 ms a lookup on a hybrid host, where both hierarchies were
    searched)."""
    for name in _dir_names(kubepods):
        uid = systemd_pod_uid(name)
        if uid:
            if os.path.isdir(os.path.join(kubepods, name, unit)):
                return uid, f"{name}/{unit}"
        elif SYSTEMD_QOS.fullmatch(name):
            for qname in _dir_names(os.path.join(kubepods, name)):
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
    by: dict[str, _Found] = {}
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
            by[which] = _Found(uid, m.group(2), RUNTIME[m.group(1)], "systemd", unit, path)
    return _container(root, by, skip_pause=True) if by else None
