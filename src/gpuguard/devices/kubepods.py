"""The kubepods cgroup tree walked into the cgroups of its containers (devices/
containers.py reads each one's processes and builds its record).

kubepods / QoS class / pod / container, by the name patterns of devices/cgroupnames.py
(both cgroup drivers and every runtime); every directory of the tree that is no
container goes into `strays` (kubepods, QoS classes, pods, names no runtime gives),
and a name with a control character into `refused`, never matched against a pattern.
Never raises on an odd tree: vanished directories and unknown names are skipped with
a debug reason; depth is bounded by the layout itself.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
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
from gpuguard.devices.cgrouptree import subdirs

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Found:
    pod_uid: str
    container_id: str
    runtime: str
    driver: str
    unit: Optional[str]
    path: Path


def _named(d: Path, refused: list[Path]) -> list[tuple[str, Path]]:
    """`d`'s child directories, sorted. A name with a control character is never
    matched against a pattern: it goes to `refused` (a finding)."""
    out = []
    for name, path in subdirs(d):
        if has_control(name):
            refused.append(path)
            continue
        out.append((name, path))
    return out


def _systemd_pods(
    kubepods: Path, strays: list[Path], refused: list[Path]
) -> Iterator[tuple[str, Path]]:
    strays.append(kubepods)
    for name, path in _named(kubepods, refused):
        uid = systemd_pod_uid(name)
        if uid:
            yield uid, path
        elif SYSTEMD_QOS.fullmatch(name):
            strays.append(path)
            for qname, qpath in _named(path, refused):
                quid = systemd_pod_uid(qname)
                if quid:
                    yield quid, qpath
                else:
                    log.debug("skipping %s: not a pod slice", qpath)
                    strays.append(qpath)
        else:
            log.debug("skipping %s: not a pod or QoS slice", path)
            strays.append(path)


def _cgroupfs_pods(
    kubepods: Path, strays: list[Path], refused: list[Path]
) -> Iterator[tuple[str, Path]]:
    strays.append(kubepods)
    for name, path in _named(kubepods, refused):
        m = CGROUPFS_POD.fullmatch(name)
        if m:
            yield m.group(1), path
        elif name in CGROUPFS_QOS:
            strays.append(path)
            for qname, qpath in _named(path, refused):
                qm = CGROUPFS_POD.fullmatch(qname)
                if qm:
                    yield qm.group(1), qpath
                else:
                    log.debug("skipping %s: not a pod directory", qpath)
                    strays.append(qpath)
        else:
            log.debug("skipping %s: not a pod or QoS directory", path)
            strays.append(path)


def walk(hierarchy: Path, strays: list[Path], refused: list[Path]) -> Iterator[Found]:
    """The containers under `hierarchy`; every other directory of the tree (kubepods,
    QoS classes, pods, what no pattern names) into `strays`."""
    systemd = hierarchy / KUBEPODS_SLICE
    for uid, pod in _systemd_pods(systemd, strays, refused) if systemd.is_dir() else ():
        strays.append(pod)
        for name, path in _named(pod, refused):
            m = SYSTEMD_CONTAINER.fullmatch(name)
            if not m:
                # crio-conmon-<id>.scope is the monitor, not the container
                log.debug("skipping %s: not a container scope", path)
                strays.append(path)
                continue
            yield Found(uid, m.group(2), RUNTIME[m.group(1)], "systemd", name, path)
    cgroupfs = hierarchy / KUBEPODS_DIR
    for uid, pod in _cgroupfs_pods(cgroupfs, strays, refused) if cgroupfs.is_dir() else ():
        strays.append(pod)
        for name, path in _named(pod, refused):
            m = CGROUPFS_CONTAINER.fullmatch(name)
            if not m:
                log.debug("skipping %s: not a container directory", path)
                strays.append(path)
                continue
            runtime = RUNTIME[m.group(1)] if m.group(1) else "unknown"
            yield Found(uid, m.group(2), runtime, "cgroupfs", None, path)
