"""What the bridge offers kubelet for one kubelet start (pure).

kubelet 1.26+ re-admits the pods it had at start-up, before any device plugin has
answered: a pod whose container is not running and whose checkpointed devices are not
all reported healthy by the registered endpoint is rejected for good
(``UnexpectedAdmissionError``), a pod whose devices are all healthy keeps its
checkpointed allocation without an Allocate call. The bridge therefore offers, per
resource, exactly the device IDs that the checkpoint's pod entries hold AND the node
has (readmit/presence.py: the driver's view, or PCI + history before the driver
loads; every ID form of NVIDIA's plugin, readmit/devids.py), never another: no capacity
beyond the GPUs that exist, nothing kubelet could allocate to a new pod that is not
already held (a new pod gets its device from the real plugin once it registers).

It offers nothing when no checkpointed pod needs it: when every such pod still has
processes (a plain kubelet restart: kubelet keeps running containers without asking
any plugin), registering would only race the real plugin's own re-registration.

Pods from an API server (ApiView): a pod deleted while the node was down keeps its
checkpoint entry, and a device reported healthy that no pod kubelet re-admits is free
to kubelet: the Node's allocatable counts it, the scheduler places a new pod there and
kubelet asks the bridge to Allocate it, which it cannot (every such pod fails, and its
controller makes another). So where the API server's pods bound to this node were
read, a checkpointed pod's devices are offered only if it is one of them, not
Succeeded or Failed and not being deleted, or if it is a static pod (its UID is some
mirror pod's ``kubernetes.io/config.mirror`` annotation); the others are left out and
said why. A kubelet without an API server (no kubeconfig) has static pods only: all
are offered. A static pod whose mirror pod the API server does not hold (kubelet never
made it) is left out like a deleted one: the API server is the only witness.

When the API server could not be read (not reachable at boot, refused), every pod is
offered as without an API server, and the decision says so (``unread``, journaled
once): withholding would reject for good every static and bare GPU pod of the node
(kubelet's rejection at re-admission is final), the loss the bridge exists to prevent,
to avoid a risk that cannot start while the API server is unreachable (kubelet gets
new pods from that same server), and that the withdrawal (readmit/withdraw.py: every
device reported unhealthy once the offered pods are re-admitted, 30 s after kubelet's
start at most) ends.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, Optional, Sequence, Union

from gpuguard.checkpoint.model import PodDevicesEntry
from gpuguard.readmit.presence import NodeDevices
from gpuguard.readmit.refusals import describe, refusals

if TYPE_CHECKING:
    from gpuguard.host.kubeapi import ApiPod

#: ApiView.source: the pods were read; no API server (standalone); it could not be read
READ, STANDALONE, UNREAD = "read", "standalone", "unread"


@dataclass(frozen=True)
class ApiView:
    """What the API server said of this node's pods, as the bridge last read it."""

    source: str  # READ, STANDALONE or UNREAD
    pods: tuple[ApiPod, ...] = ()  # READ: the pods bound to this node
    node: str = ""  # the node's name asked for
    detail: str = ""  # one line: how, or why not
    at: float = 0.0  # when it was read (time.monotonic())

    @property
    def key(self) -> object:
        """What a decision depends on: a new read with the same answer is the same."""
        return (self.source, self.pods, self.node)


@dataclass(frozen=True)
class LeftOut:
    """A checkpointed pod whose devices are not offered, and why."""

    pod_uid: str
    why: str  # "no longer exists in the API server", ...


@dataclass(frozen=True)
class Offer:
    """The healthy devices to report for ``resource`` at this kubelet start."""

    resource: str
    healthy: tuple[str, ...]  # held by checkpointed pods and present on the node
    absent: tuple[str, ...]  # held, but not on the node: never reported
    pods: tuple[str, ...]  # the pod UIDs whose entries hold them
    held: tuple[tuple[str, tuple[str, ...]], ...] = ()  # pod UID -> its healthy IDs
    left_out: tuple[LeftOut, ...] = ()  # pods of this resource whose devices are not


@dataclass(frozen=True)
class Decision:
    offers: tuple[Offer, ...]
    why: str  # one line: what was decided and why
    evidence: str = ""  # what the node's devices were judged on (presence.py)
    # (pod uid, why) for each waiting pod with a held device not offered
    refused: tuple[tuple[str, str], ...] = ()
    unread: str = ""  # the API server's pods could not be read: why ("" read or none)
    left_out: tuple[LeftOut, ...] = ()  # pods without a process whose devices are not offered

    def left_out_text(self, limit: int = 400) -> str:
        """ "pod UID u: why; ..." for the journal ("" none)."""
        return "; ".join(f"pod UID {o.pod_uid} {o.why}" for o in self.left_out)[:limit]


def _uid(uid: str) -> str:
    return uid.replace("_", "-").lower()


def left_out(uid: str, api: Optional[ApiView]) -> str:
    """Why the devices of checkpointed pod ``uid`` are not offered ("" offered)."""
    if api is None or api.source != READ:
        return ""
    u = _uid(uid)
    if any(_uid(p.mirror_of) == u for p in api.pods if p.mirror_of):
        return ""  # a static pod: kubelet has it from its manifest
    pod = next((p for p in api.pods if _uid(p.uid) == u), None)
    if pod is None:
        return "no longer exists in the API server"
    if pod.deleting:
        return f"is being deleted ({pod.pod})"
    if pod.terminal:
        return f"is {pod.phase} ({pod.pod})"
    return ""


def decide(
    entries: Iterable[PodDevicesEntry],
    resources: Sequence[str],
    present: Union[NodeDevices, frozenset[str]],
    alive: frozenset[str],
    api: Optional[ApiView] = None,
) -> Decision:
    """The offers for the checkpoint's ``entries`` of ``resources`` (glob patterns),
    the node's devices ``present`` (a plain set: exactly those IDs), the pod UIDs with
    processes, and what the API server said of this node's pods (None: not asked, as
    without one)."""
    node = present if isinstance(present, NodeDevices) else NodeDevices.of_ids(present)
    held: dict[str, dict[str, set[str]]] = {}  # resource -> pod uid -> ids
    for e in entries:
        if not any(fnmatch.fnmatchcase(e.resource_name, p) for p in resources):
            continue
        ids = e.all_device_ids()
        if ids:
            held.setdefault(e.resource_name, {}).setdefault(e.pod_uid, set()).update(ids)
    if not held:
        return Decision((), "no pod in kubelet's checkpoint holds a GPU")
    pods = {u for per in held.values() for u in per}
    running = {_uid(u) for u in alive}
    why_out = {u: left_out(u, api) for u in pods}
    kept = {u for u in pods if not why_out[u]}
    dropped = sorted(u for u in pods if why_out[u] and _uid(u) not in running)
    gone = f"; {len(dropped)} left out (gone from the API server)" if dropped else ""
    unread = (api.detail or "not read") if api is not None and api.source == UNREAD else ""
    waiting = sorted(u for u in kept if _uid(u) not in running)
    out_all = tuple(LeftOut(u, why_out[u]) for u in dropped)
    if not waiting:
        if dropped:
            why = f"no GPU pod without a running process is to run{gone}"
            return Decision((), why, unread=unread, left_out=out_all)
        return Decision((), f"every GPU pod of the checkpoint ({len(pods)}) is running")
    mine = {r: {u: ids for u, ids in per.items() if u in kept} for r, per in held.items()}
    offers = []
    verdicts: dict[str, str] = {}  # device ID -> "" (present) or why not
    for resource in sorted(held):
        held_ids = {i for ids in mine[resource].values() for i in ids}
        for i in held_ids:
            verdicts.setdefault(i, node.judge(i))
        offers.append(
            Offer(
                resource,
                tuple(sorted(i for i in held_ids if not verdicts[i])),
                tuple(sorted(i for i in held_ids if verdicts[i])),
                tuple(sorted(mine[resource])),
                tuple(
                    (u, tuple(sorted(i for i in ids if not verdicts[i])))
                    for u, ids in sorted(mine[resource].items())
                ),
                tuple(LeftOut(u, why_out[u]) for u in sorted(held[resource]) if u in dropped),
            )
        )
    refused = refusals(mine, verdicts, {_uid(u) for u in waiting}, _uid)
    said = describe(refused, node.evidence) + gone
    kept_offers = tuple(o for o in offers if o.healthy)
    if not kept_offers:
        why = f"none of the checkpoint's GPUs is on the node{said}"
        return Decision((), why, node.evidence, refused, unread, out_all)
    why = f"{len(waiting)} of {len(kept)} GPU pods have no running process{said}"
    return Decision(kept_offers, why, node.evidence, refused, unread, out_all)
