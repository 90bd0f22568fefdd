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
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Iterable, Sequence, Union

from gpuguard.checkpoint.model import PodDevicesEntry
from gpuguard.readmit.presence import NodeDevices
from gpuguard.readmit.refusals import describe, refusals


@dataclass(frozen=True)
class Offer:
    """The healthy devices to report for ``resource`` at this kubelet start."""

    resource: str
    healthy: tuple[str, ...]  # held by checkpointed pods and present on the node
    absent: tuple[str, ...]  # held, but not on the node: never reported
    pods: tuple[str, ...]  # the pod UIDs whose entries hold them


@dataclass(frozen=True)
class Decision:
    offers: tuple[Offer, ...]
    why: str  # one line: what was decided and why
    evidence: str = ""  # what the node's devices were judged on (presence.py)
    # (pod uid, why) for each waiting pod with a held device not offered
    refused: tuple[tuple[str, str], ...] = ()


def _uid(uid: str) -> str:
    return uid.replace("_", "-").lower()


def decide(
    entries: Iterable[PodDevicesEntry],
    resources: Sequence[str],
    present: Union[NodeDevices, frozenset[str]],
    alive: frozenset[str],
) -> Decision:
    """The offers for the checkpoint's ``entries`` of ``resources`` (glob patterns),
    the node's devices ``present`` (a plain set: exactly those IDs), and the pod UIDs
    with processes."""
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
    pods = {_uid(u) for per in held.values() for u in per}
    waiting = sorted(pods - {_uid(u) for u in alive})
    if not waiting:
        return Decision((), f"every GPU pod of the checkpoint ({len(pods)}) is running")
    offers = []
    verdicts: dict[str, str] = {}  # device ID -> "" (present) or why not
    for resource in sorted(held):
        held_ids = {i for per in held[resource].values() for i in per}
        for i in held_ids:
            verdicts.setdefault(i, node.judge(i))
        offers.append(
            Offer(
                resource,
                tuple(sorted(i for i in held_ids if not verdicts[i])),
                tuple(sorted(i for i in held_ids if verdicts[i])),
                tuple(sorted(held[resource])),
            )
        )
    refused = refusals(held, verdicts, set(waiting), _uid)
    said = describe(refused, node.evidence)
    kept = tuple(o for o in offers if o.healthy)
    if not kept:
        return Decision(
            (), f"none of the checkpoint's GPUs is on the node{said}", node.evidence, refused
        )
    return Decision(
        kept,
        f"{len(waiting)} of {len(pods)} GPU pods have no running process{said}",
        node.evidence,
        refused,
    )
