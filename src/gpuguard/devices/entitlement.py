"""Which NVIDIA nodes a container was given: the ones in its own /dev, never more.

The container's mount namespace is the record of what it was given: the runtime (or the
legacy NVIDIA hook) created or bind-mounted exactly those nodes. gpuguard re-grants
access only to nodes found there, matched to the host's nodes by major:minor (the
kernel checks numbers, not names).

Two other records are cross-checked, never used to add anything:

- ``NVIDIA_VISIBLE_DEVICES`` from /proc/<pid>/environ (``all``, ``none``, ``void``,
  a comma list of indices, GPU UUIDs, MIG UUIDs, ``MIG-GPU-<uuid>/<gi>/<ci>``,
  ``<index>:<mig index>``; a path means the volume-mounts strategy: no information);
- the kubelet checkpoint's device IDs for the pod (passed in as pod_uid -> IDs).

A GPU node whose GPU contradicts BOTH is a conflict: reported, not entitled. One
contradiction alone (e.g. index-based IDs after a renumbering, F6) is only a note. The
record of checkpoint entries gpuguard dropped (checkpoint/dropped.py) never adds to
this: it stands in for a pod's entries only once the checkpoint names the pod no more,
and a node that only a record names beside a live entry is `kept` (its existing
access is not called a conflict) but never granted.
"""

from __future__ import annotations

import errno
import logging
import os
from dataclasses import dataclass
from typing import AbstractSet, Mapping, Optional, Sequence

from gpuguard.devices.containers import ContainerCgroup
from gpuguard.devices.nodes import (
    ROLE_CTL,
    ROLE_GPU,
    ROLE_UVM,
    ROLE_UVM_TOOLS,
    DeviceNode,
    GpuLike,
    NvidiaMajors,
    list_nvidia_nodes,
)
from gpuguard.host.paths import Root
from gpuguard.host.safeio import PROC_MAX, UnsafeFileError, read_bytes

log = logging.getLogger(__name__)

ENV_NAME = "NVIDIA_VISIBLE_DEVICES"

# Host nodes every GPU container needs besides its GPUs (F3: the plugin adds these only
# if it saw them). modeset is not needed by CUDA, so its absence is not reported.
CONTROL_ROLES = (ROLE_CTL, ROLE_UVM, ROLE_UVM_TOOLS)


@dataclass(frozen=True)
class VisibleDevices:
    kind: str  # "unset" | "all" | "none" | "void" | "path" | "list"
    ids: tuple[str, ...] = ()


def parse_visible_devices(value: Optional[str]) -> VisibleDevices:
    if value is None or not value.strip():
        return VisibleDevices("unset")
    v = value.strip()
    if v in ("all", "none", "void"):
        return VisibleDevices(v)
    if v.startswith("/"):
        return VisibleDevices("path")
    return VisibleDevices("list", tuple(t.strip() for t in v.split(",") if t.strip()))


def parse_environ(raw: bytes) -> dict[str, str]:
    """/proc/<pid>/environ: NUL-separated KEY=VALUE; undecodable bytes replaced."""
    out: dict[str, str] = {}
    for item in raw.split(b"\0"):
        key, sep, value = item.partition(b"=")
        if sep and key:
            out[key.decode(errors="replace")] = value.decode(errors="replace")
    return out


def _gpu_names(gpu: GpuLike) -> set[str]:
    """Every ID that designates this GPU (or one of its MIG devices), lower-cased."""
    names = {str(gpu.index), gpu.uuid.lower()}
    for i, m in enumerate(gpu.mig):
        names.add(m.uuid.lower())
        names.add(f"{gpu.index}:{i}")
    return names


def _token_names(token: str) -> set[str]:
    t = token.strip().lower()
    out = {t}
    if t.startswith("mig-gpu-"):  # legacy MIG-GPU-<uuid>/<gi>/<ci>
        out.add(t[len("mig-") :].split("/", 1)[0])
    if "::" in t:  # time-slicing replica IDs: <id>::<n>
        out.add(t.split("::", 1)[0])
    return out


def _designates(tokens: Sequence[str] | AbstractSet[str], gpu: GpuLike) -> bool:
    names = _gpu_names(gpu)
    return any(_token_names(t) & names for t in tokens)


@dataclass(frozen=True)
class Entitlement:
    pod_uid: str
    container_id: str
    nodes: tuple[DeviceNode, ...]  # entitled: host nodes present in its /dev, minus conflicts
    present: tuple[DeviceNode, ...]  # host nodes found in its /dev
    conflicts: tuple[DeviceNode, ...]  # GPU nodes contradicting env AND checkpoint
    missing: tuple[DeviceNode, ...]  # host ctl/uvm nodes absent from its /dev (F3)
    visible: VisibleDevices
    notes: tuple[str, ...] = ()
    readable: bool = True  # False: its /dev could not be read (no process, gone)
    # (its node, the host's node of that path) where the numbers differ: the node was
    # made before a module reload gave the driver a new major; present, but stale
    stale: tuple[tuple[DeviceNode, DeviceNode], ...] = ()
    # GPU nodes that contradict NVIDIA_VISIBLE_DEVICES and the live checkpoint entry but
    # that a dropped-entries record names: not a conflict, and never granted
    kept: tuple[DeviceNode, ...] = ()

    @property
    def is_gpu_container(self) -> bool:
        return any(n.role == ROLE_GPU for n in self.present) or bool(self.conflicts)


def compute_entitlement(
    pod_uid: str,
    container_id: str,
    container_nodes: Sequence[DeviceNode],
    host_nodes: Sequence[DeviceNode],
    gpus: Sequence[GpuLike],
    visible: VisibleDevices,
    checkpoint_ids: Optional[AbstractSet[str]],
    recorded_ids: Optional[AbstractSet[str]] = None,
) -> Entitlement:
    """Pure: the entitlement from what the container's /dev holds.

    ``container_nodes`` as listed from its /dev, ``host_nodes`` the host's (listed or
    expected), ``checkpoint_ids`` the pod's IDs in the kubelet checkpoint (None: the pod
    has no entry there), ``recorded_ids`` what its dropped entries named (evidence that
    keeps, never grants)."""
    host_by_key = {n.key: n for n in host_nodes}
    host_by_path = {n.path: n for n in host_nodes}
    stale: list[tuple[DeviceNode, DeviceNode]] = []
    gpu_by_minor = {g.minor: g for g in gpus}
    notes: list[str] = []
    present: list[DeviceNode] = []
    for cn in container_nodes:
        hn = host_by_key.get(cn.key)
        if hn is None:
            same_path = host_by_path.get(cn.path)
            if same_path is not None and same_path.role in CONTROL_ROLES:
                stale.append((cn, same_path))
            notes.append(f"{cn.path} ({cn.numbers}) matches no host node; ignored")
            continue
        if hn not in present:
            present.append(hn)
    entitled: list[DeviceNode] = []
    conflicts: list[DeviceNode] = []
    kept: list[DeviceNode] = []
    for hn in present:
        if hn.role != ROLE_GPU:
            entitled.append(hn)
            continue
        gpu = gpu_by_minor.get(hn.minor)
        if gpu is None:
            notes.append(f"{hn.path}: GPU minor {hn.minor} not in the inventory; not cross-checked")
            entitled.append(hn)
            continue
        env_no = visible.kind == "none" or (
            visible.kind == "list" and not _designates(visible.ids, gpu)
        )
        ckpt_no = checkpoint_ids is not None and not _designates(checkpoint_ids, gpu)
        if env_no and ckpt_no and recorded_ids is not None and _designates(recorded_ids, gpu):
            kept.append(hn)
            notes.append(
                f"{hn.path} ({gpu.uuid}): only a record of dropped checkpoint entries names "
                f"it, neither {ENV_NAME} nor the checkpoint; its access is left as it is, "
                "never granted"
            )
            continue
        if env_no and ckpt_no:
            conflicts.append(hn)
            notes.append(
                f"{hn.path} ({gpu.uuid}) is in the container's /dev but neither "
                f"{ENV_NAME} nor the checkpoint gives it this GPU; not entitled"
            )
            continue
        if env_no:
            notes.append(f"{hn.path} ({gpu.uuid}): {ENV_NAME} does not name it; checkpoint does")
        if ckpt_no:
            notes.append(f"{hn.path} ({gpu.uuid}): checkpoint does not name it; {ENV_NAME} does")
        entitled.append(hn)
    missing: list[DeviceNode] = []
    if any(n.role == ROLE_GPU for n in present):
        present_keys = {n.key for n in present}
        stale_paths = {h.path for _, h in stale}
        missing = [
            n
            for n in host_nodes
            if n.role in CONTROL_ROLES and n.key not in present_keys and n.path not in stale_paths
        ]
    else:
        stale = []
    return Entitlement(
        pod_uid=pod_uid,
        container_id=container_id,
        nodes=tuple(entitled),
        present=tuple(present),
        conflicts=tuple(conflicts),
        missing=tuple(missing),
        visible=visible,
        notes=tuple(notes),
        stale=tuple(stale),
        kept=tuple(kept),
    )


def read_entitlement(
    root: Root,
    container: ContainerCgroup,
    host_nodes: Sequence[DeviceNode],
    majors: NvidiaMajors,
    gpus: Sequence[GpuLike],
    checkpoint: Mapping[str, AbstractSet[str]],
    recorded: Optional[Mapping[str, AbstractSet[str]]] = None,
) -> Entitlement:
    """Read the container's /dev and environ through its first live process that is the
    container already (not the runtime's init, not on the host's /dev: see
    `process_pending`); nothing is given while none is."""
    pending = ""
    for pid in container.pids:
        dev = f"/proc/{pid}/root/dev"
        if not root.path(dev).is_dir():
            continue
        why = process_pending(root, pid, name_required=False)
        if why:
            pending = why
            continue
        # A FIFO or link where environ should be raises UnsafeFileError naming it: the
        # caller charges it to this container only.
        try:
            raw, _st = read_bytes(
                root.path(f"/proc/{pid}/environ"), what="environ", max_bytes=PROC_MAX
            )
        except UnsafeFileError as e:
            if e.errno not in (errno.ENOENT, errno.ESRCH, errno.EACCES):
                raise
            log.debug("cannot read environ of %d: %s", pid, e.message)
            raw = b""
        env = parse_environ(raw)
        return compute_entitlement(
            container.pod_uid,
            container.container_id,
            list_nvidia_nodes(root, majors, dev),
            host_nodes,
            gpus,
            parse_visible_devices(env.get(ENV_NAME)),
            checkpoint.get(container.pod_uid),
            (recorded or {}).get(container.pod_uid),
        )
    if pending:  # judged by a later pass, once the container runs (never cached)
        return unreadable_entitlement(container, f"not judged yet: {pending}")
    return unreadable_entitlement(container, "no live process to read its /dev from")


# What a container's process is called while the runtime still prepares it (before the
# exec of its command): runc and youki name their init stages, crun keeps its own name.
RUNTIME_INIT_PREFIXES = ("runc:", "youki:")
RUNTIME_INIT_NAMES = ("crun",)


def own_dev_pending(root: Root, container: ContainerCgroup) -> str:
    """Why the container's own /dev cannot be judged yet ("" once it can): its first
    process (`process_pending`), or none yet."""
    if not container.pids:
        return "no process in its cgroup yet"
    return process_pending(root, container.pids[0], name_required=True)


def process_pending(root: Root, pid: int, *, name_required: bool) -> str:
    """Why `pid` does not show what its container was given yet ("" once it does).

    A new scope holds the runtime's init before it holds the container: runc's systemd
    driver starts the scope with `runc init` in it, which still sees the host's /dev
    until it has switched to the container's root (after the hooks, the legacy NVIDIA
    hook among them, have added the GPU nodes), and still has runc's environment until
    it execs the command. Judging then would read the host's GPUs as the container's,
    and the PID stays the container's after the exec. A process whose /dev is the
    host's for good (a hostPath /dev) is never judged either: its /dev says nothing of
    what it was given. `name_required`: an unreadable comm means the process is gone
    (else the /dev check alone decides)."""
    try:
        comm, _st = read_bytes(root.path(f"/proc/{pid}/comm"), what="comm", max_bytes=64)
    except UnsafeFileError:
        if name_required:
            return f"process {pid} is gone"
        comm = b""
    name = comm.decode(errors="replace").strip()
    if name.startswith(RUNTIME_INIT_PREFIXES) or name in RUNTIME_INIT_NAMES:
        return f"process {pid} is still the runtime's init ({name})"
    try:
        own = os.stat(root.path(f"/proc/{pid}/root/dev"))
    except OSError as e:
        return f"/proc/{pid}/root/dev: {e.strerror}"
    try:
        host = os.stat(root.path("/dev"))
    except OSError:  # no host /dev to mistake for the container's
        return ""
    if (own.st_dev, own.st_ino) == (host.st_dev, host.st_ino):
        return f"process {pid} still sees the host's /dev"
    return ""


def unreadable_entitlement(container: ContainerCgroup, why: str) -> Entitlement:
    """What a container we could not read is given: nothing (it is never granted)."""
    return Entitlement(
        pod_uid=container.pod_uid,
        container_id=container.container_id,
        nodes=(),
        present=(),
        conflicts=(),
        missing=(),
        visible=VisibleDevices("unset"),
        notes=(why,),
        readable=False,
    )
