"""Container GPU access audit: pure findings and actions (reconciler "container_access").

Inputs are observations, never the OS: the containers, their entitlements and the
observed access verdict per (container, node): from `rules.allows` over devices.list on
cgroup v1 (`verdicts_from_rules`), from `probe` or a BPF verdict on cgroup v2 (each
layout's reading: devcgroup.py).

Actions re-grant exactly the entitled nodes that are denied, never anything else: the
in-place re-grant each container's layout plans (`DeviceCgroup.plan_regrant`, given
here as `cgroup_of`), and, for a container in a systemd scope, the scope's
DeviceAllow= that makes it durable. Their kinds are in actions.py.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, AbstractSet, Mapping, Optional, Sequence, TypedDict

from gpuguard.devices.containers import ContainerCgroup
from gpuguard.devices.entitlement import Entitlement
from gpuguard.devices.nodes import ROLE_CTL, ROLE_GPU, ROLE_UVM, ROLE_UVM_TOOLS, DeviceNode
from gpuguard.devices.rules import DeviceRules, allows
from gpuguard.model import Action, Finding

# The actions (actions.py), re-exported: the step, the CLI and tests import them from here.
from gpuguard.steps.container_access.actions import CgroupV1Allow as CgroupV1Allow
from gpuguard.steps.container_access.actions import ContainerDeviceAction as ContainerDeviceAction
from gpuguard.steps.container_access.actions import RestartContainer as RestartContainer
from gpuguard.steps.container_access.actions import UnitDeviceAllow as UnitDeviceAllow
from gpuguard.steps.container_access.actions import V2ProgramReplace as V2ProgramReplace
from gpuguard.steps.container_access.actions import V2ReportOnly as V2ReportOnly
from gpuguard.steps.container_access.view import AccessKey as AccessKey
from gpuguard.steps.container_access.view import Denier
from gpuguard.steps.registry import CONTAINER_ACCESS

if TYPE_CHECKING:
    from gpuguard.steps.container_access.devcgroup import CgroupOf

RECONCILER = CONTAINER_ACCESS

FINDING_DENIED = "container-device-denied"
FINDING_MISSING = "container-device-missing"
FINDING_STALE = "container-device-stale"
FINDING_CONFLICT = "container-device-conflict"
FINDING_UNREADABLE = "container-unreadable"
FINDING_UNATTRIBUTED = "gpu-process-unattributed"

CAUSE_REWRITE = "daemon-reload/reexec or CPU manager rewrote the cgroup"
CAUSE_REWRITE_V2 = (
    "the container's device policy was re-applied without its GPU nodes "
    "(daemon-reload/reexec or a runtime update)"
)
CAUSE_PLUGIN_UVM = "device plugin started without /dev/nvidia-uvm (restart the plugin)"
CAUSE_PLUGIN_CTL = "device plugin or runtime did not give /dev/nvidiactl (restart the plugin)"
CAUSE_UNKNOWN = "something rewrote the container's device cgroup without these nodes"
CAUSE_RELOADED = "the driver module was reloaded after the container started"


class Subject(TypedDict):
    """The fields every container action carries: whose container, which nodes."""

    reconciler: str
    pod_uid: str
    container_id: str
    nodes: tuple[str, ...]
    numbers: tuple[str, ...]


def subject(c: ContainerCgroup, denied: Sequence[DeviceNode]) -> Subject:
    """`c` and its `denied` nodes, as each action of this step names them."""
    return Subject(
        reconciler=RECONCILER,
        pod_uid=c.pod_uid,
        container_id=c.container_id,
        nodes=tuple(n.path for n in denied),
        numbers=tuple(n.numbers for n in denied),
    )


_UVM_ROLES = (ROLE_UVM, ROLE_UVM_TOOLS)


def verdicts_from_rules(
    container_id: str, nodes: Sequence[DeviceNode], rules: DeviceRules, access: str = "rw"
) -> dict[AccessKey, bool]:
    """The v1 verdicts for ``nodes``: what the kernel decides for an O_RDWR open."""
    return {
        (container_id, n.numbers): allows(rules, n.type, n.major, n.minor, access) for n in nodes
    }


def _cause(
    node: DeviceNode,
    denied: Sequence[DeviceNode],
    ent: Entitlement,
    rewritten: Optional[str],
    verdict: Mapping[str, Optional[bool]],
) -> str:
    """`rewritten`: the cause of a container that lost every GPU, where its layout can
    tell it (DeviceCgroup.rewrite_cause)."""
    gpu_nodes = [n for n in ent.nodes if n.role == ROLE_GPU]
    all_gpus_denied = bool(gpu_nodes) and all(n in denied for n in gpu_nodes)
    if node.role in _UVM_ROLES:
        others_ok = all(
            verdict.get(n.numbers) is True for n in ent.nodes if n.role in (ROLE_GPU, ROLE_CTL)
        )
        if others_ok and all(n.role in _UVM_ROLES for n in denied):
            # seed 004: GPUs and ctl in the spec, uvm not: the plugin never saw it.
            return CAUSE_PLUGIN_UVM
    if all_gpus_denied and rewritten is not None:
        return rewritten
    return CAUSE_UNKNOWN


def unreadable_findings(
    containers: Sequence[ContainerCgroup], broken: Mapping[str, str]
) -> tuple[Finding, ...]:
    """One finding per container whose own files could not be read (`broken`:
    container_id -> the one-line reason); it costs that container only."""
    return tuple(
        Finding(
            kind=FINDING_UNREADABLE,
            reconciler=RECONCILER,
            summary=f"pod {c.pod_uid} container {c.container_id[:12]}: cannot be audited: "
            f"{broken[c.container_id]}; gpuguard leaves it as it is",
            fields={
                "POD_UID": c.pod_uid,
                "CONTAINER_ID": c.container_id,
                "CGROUP_DRIVER": c.driver,
                "CGROUP_LAYOUT": c.layout,
                "DEVICE_MECHANISM": c.mechanism,
            },
            severity="error",
        )
        for c in containers
        if c.container_id in broken
    )


def stray_findings(
    strays: Sequence[tuple[str, tuple[int, ...], tuple[str, ...]]],
) -> tuple[Finding, ...]:
    """One finding per kubepods cgroup that is no container gpuguard knows and whose
    processes hold NVIDIA nodes open (`strays`: cgroup, pids, nodes)."""
    return tuple(
        Finding(
            kind=FINDING_UNATTRIBUTED,
            reconciler=RECONCILER,
            summary=f"{cgroup}: process(es) {', '.join(map(str, pids[:8]))} hold "
            f"{', '.join(nodes)} open in a kubepods cgroup that is no container gpuguard "
            "knows: it cannot judge or repair their access; find what made this cgroup",
            fields={
                "CGROUP": cgroup,
                "PIDS": ",".join(map(str, pids[:64])),
                "DEVICE": ",".join(nodes),
            },
            severity="warning",
        )
        for cgroup, pids, nodes in strays
    )


def _finding(
    kind: str,
    c: ContainerCgroup,
    node: DeviceNode,
    summary: str,
    cause: str,
    severity: str,
    *,
    stale: str = "",
) -> Finding:
    fields = {
        "POD_UID": c.pod_uid,
        "CONTAINER_ID": c.container_id,
        "DEVICE": node.path,
        "DEVICE_NUMBERS": node.numbers,
        "CAUSE": cause,
        "CGROUP_DRIVER": c.driver,
        "CGROUP_LAYOUT": c.layout,
        "DEVICE_MECHANISM": c.mechanism,
    }
    if stale:
        fields["CONTAINER_DEVICE_NUMBERS"] = stale
    return Finding(
        kind=kind, reconciler=RECONCILER, summary=summary, fields=fields, severity=severity
    )


def audit(
    containers: Sequence[ContainerCgroup],
    entitlements: Mapping[tuple[str, str], Entitlement],
    access: Mapping[AccessKey, Optional[bool]],
    *,
    cgroup_of: CgroupOf,
    device_rules: Optional[Mapping[str, DeviceRules]] = None,
    remedy: str = "report",
    plugin_containers: AbstractSet[str] = frozenset(),
    deniers: Optional[Mapping[str, Sequence[Denier]]] = None,
) -> tuple[tuple[Finding, ...], tuple[Action, ...]]:
    """Findings and actions for every GPU container.

    ``entitlements`` by ``ContainerCgroup.key``; ``access`` by (container_id, "MAJ:MIN"):
    True allowed, False denied, None / absent unknown (nothing is done on unknown);
    ``cgroup_of``: each container's layout, which plans its in-place re-grant and may
    tell the cause of a loss; ``device_rules``: the parsed v1 devices.list per
    container_id, for cause heuristics; ``remedy``: V2Remedy=, what a cgroup with no
    re-grant in place gets (a report, a restart, a program replaced in place);
    ``plugin_containers``: IDs of device plugins' own containers, whose
    view of the host's nodes the device plugin step judges (and restarts them for);
    ``deniers``: by container_id, the runtime's programs in its scope that deny what
    systemd's admit (v2: replaced in place, cgroupv2.py)."""
    rules_by_id = device_rules or {}
    deniers = deniers or {}
    findings: list[Finding] = []
    actions: list[Action] = []
    for c in containers:
        ent = entitlements.get(c.key)
        if ent is None or not ent.readable:
            continue
        short = c.container_id[:12]
        for node in ent.conflicts:
            findings.append(
                _finding(
                    FINDING_CONFLICT,
                    c,
                    node,
                    f"pod {c.pod_uid} container {short} has {node.path} in its /dev but "
                    "neither NVIDIA_VISIBLE_DEVICES nor the checkpoint gives it that GPU; "
                    "gpuguard will not grant it",
                    "conflicting records",
                    "warning",
                )
            )
        if not ent.is_gpu_container:
            continue
        verdict = {n.numbers: access.get((c.container_id, n.numbers)) for n in ent.nodes}
        denied = [n for n in ent.nodes if verdict[n.numbers] is False]
        own = c.container_id in plugin_containers
        for node in () if own else ent.missing:
            cause = CAUSE_PLUGIN_UVM if node.role in _UVM_ROLES else CAUSE_PLUGIN_CTL
            findings.append(
                _finding(
                    FINDING_MISSING,
                    c,
                    node,
                    f"pod {c.pod_uid} container {short} has no {node.path} in its /dev, "
                    f"which the host has: {cause}; then recreate the container",
                    cause,
                    "warning",
                )
            )
        for theirs, host in () if own else ent.stale:
            findings.append(
                _finding(
                    FINDING_STALE,
                    c,
                    host,
                    f"pod {c.pod_uid} container {short} has {theirs.path} with stale "
                    f"numbers ({theirs.numbers}, host has {host.numbers}): "
                    f"{CAUSE_RELOADED}; recreate the container",
                    CAUSE_RELOADED,
                    "warning",
                    stale=theirs.numbers,
                )
            )
        if not denied:
            continue
        cg = cgroup_of(c)
        rewritten = cg.rewrite_cause(rules_by_id.get(c.container_id)) if cg else None
        for node in denied:
            cause = _cause(node, denied, ent, rewritten, verdict)
            findings.append(
                _finding(
                    FINDING_DENIED,
                    c,
                    node,
                    f"pod {c.pod_uid} container {short} was given {node.path} "
                    f"({node.numbers}) but its cgroup denies it: {cause}",
                    cause,
                    "error",
                )
            )
        what = ", ".join(n.path for n in denied)
        if cg is not None:  # the re-grant in place first: the fastest repair
            actions += cg.plan_regrant(c, denied, remedy, deniers.get(c.container_id, ()))
        if c.unit is not None:
            actions.append(
                UnitDeviceAllow(
                    reason=f"make the grant of {what} survive daemon-reload/reexec",
                    target=c.unit,
                    unit=c.unit,
                    devices=tuple((n.dev_char, "rw") for n in denied),
                    **subject(c, denied),
                )
            )
    return tuple(findings), tuple(actions)
