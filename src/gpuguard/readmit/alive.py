"""Which pods' own containers run: a process in a container cgroup of the pod other
than its sandbox (pause) container.

A pod whose GPU container crash-loops keeps its sandbox between restarts: counting
the sandbox's pause process as "running" made a kubelet restart get no offer, and
kubelet then rejected the pod (``UnexpectedAdmissionError``). kubepods.py's walk
finds every container cgroup of a pod (``cri-containerd-<id>.scope``, ``crio-<id>``,
``docker-<id>``, cgroupfs' ``<id>``), the sandbox's among them; it is told apart,
cheaply first and surely where it looks like one:

1. a cgroup with more than one process, or whose one process does not run a
   ``pause`` binary (``/proc/PID/cmdline``'s argv[0] ``/pause``, ``pause`` or
   ``.../pause``), is a container of the pod: one bounded read;
2. one that does is confirmed by the runtime's OCI bundle of that container id
   (devices/podnames.py's BUNDLES): containerd's annotation
   ``io.kubernetes.cri.container-type`` and CRI-O's ``io.kubernetes.cri-o.ContainerType``
   say ``sandbox`` or ``container``, which wins over the name (a tenant's container
   whose only process is named pause is still a container);
3. with no readable bundle the name decides (the daemon's own rule, devices/
   containers.py).

So a bundle is read only for the one cgroup per pod that runs pause.
"""

from __future__ import annotations

import os
from typing import Iterable, Optional

from gpuguard.devices.cgrouptree import find_processes
from gpuguard.devices.kubepods import walk
from gpuguard.devices.podnames import BUNDLES, MAX_SPEC
from gpuguard.host.paths import Root
from gpuguard.host.safeio import PROC_MAX, UnsafeFileError, read_bytes
from gpuguard.host.statefile import parse_json

TYPE_KEYS = ("io.kubernetes.cri.container-type", "io.kubernetes.cri-o.ContainerType")


def runs_pause(root: Root, pid: int) -> Optional[bool]:
    """Whether ``pid`` runs a pause binary; None when its cmdline cannot be read."""
    try:
        data, _st = read_bytes(
            root.path(f"/proc/{pid}/cmdline"), what="cmdline", max_bytes=PROC_MAX
        )
    except UnsafeFileError:
        return None
    argv0 = data.split(b"\0", 1)[0].decode(errors="replace")
    return argv0 in ("/pause", "pause") or argv0.endswith("/pause")


def container_type(root: Root, container_id: str) -> Optional[str]:
    """ "sandbox" or "container" as the runtime's OCI bundle of ``container_id``
    says; None when no bundle says."""
    if not container_id or not container_id.isalnum():
        return None
    for pattern in BUNDLES:
        path = root.path(pattern.format(id=container_id))
        if not os.path.lexists(path):
            continue
        try:
            data, _st = read_bytes(path, what="OCI spec", max_bytes=MAX_SPEC)
            spec = parse_json(data)
        except (UnsafeFileError, ValueError):
            continue
        notes = spec.get("annotations") if isinstance(spec, dict) else None
        if not isinstance(notes, dict):
            continue
        for key in TYPE_KEYS:
            v = notes.get(key)
            if v in ("sandbox", "container"):
                return str(v)
    return None


def is_sandbox(root: Root, container_id: str, pids: tuple[int, ...]) -> bool:
    """Whether the container cgroup holding ``pids`` is its pod's sandbox (above)."""
    if len(pids) != 1:
        return False
    pause = runs_pause(root, pids[0])
    if pause is False:
        return False
    kind = container_type(root, container_id)
    if kind is not None:
        return kind == "sandbox"
    return bool(pause)


def alive_pods(root: Root, tops: Iterable[str]) -> frozenset[str]:
    """Pod UIDs with a process in one of their own containers (never the sandbox alone)
    under each cgroup hierarchy of ``tops``."""
    alive: set[str] = set()
    for top in tops:
        for found in walk(root.path(top), [], []):
            if found.pod_uid in alive:
                continue
            try:
                _at, pids = find_processes(found.path)
            except UnsafeFileError:
                continue
            if pids and not is_sandbox(root, found.container_id, pids):
                alive.add(found.pod_uid)
    return frozenset(alive)
