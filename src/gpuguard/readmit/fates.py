"""What became of each GPU pod kubelet rejected, from the API server's pods of this node
(readmit/apipods.py, read with kubelet's own kubeconfig).

A rejected pod is, as the latest answer tells it:

- ``running``: it runs again (phase Running);
- ``deleted``: the API server has it no more;
- ``replaced``: a pod with the same controller ownerReference (its ReplicaSet, Job,
  StatefulSet...) bound to this node and created after the rejection is its
  replacement: the newest Running one, else the newest;
- ``lost``: nothing makes it again: a bare pod (no controller), a static pod (its
  mirror pod's controller is the Node; every pod of a kubelet without an API server),
  or a controller's pod with no replacement on this node FOLLOW seconds after;
- ``waiting``: a controller's pod not replaced on this node yet;
- "": not known (the API server not read).

The bridge judges each rejection at once with the answer it has, then reads the API
server every few seconds while a fate may still change (FOLLOW seconds at most): each
new fate is written to the state file for the daemon's finding and journaled
(``readmit-pod-fate``). The judgement (``judge``, ``describe``) is pure.
"""

from __future__ import annotations

import calendar
import contextlib
import dataclasses
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional

from gpuguard.host.kubeapi import ApiPod
from gpuguard.readmit.klog import after_start, uid_key
from gpuguard.readmit.plan import READ, STANDALONE, ApiView
from gpuguard.readmit.state import RejectedPod

if TYPE_CHECKING:
    from gpuguard.journal.log import EventLog

WAITING, REPLACED, LOST, DELETED, RUNNING = "waiting", "replaced", "lost", "deleted", "running"
FOLLOW = 600.0  # seconds after a rejection its replacement is looked for
EVERY = 5.0  # seconds between looks (apipods.INTERVAL: no faster answer comes)


@dataclass(frozen=True)
class Fate:
    fate: str  # as above ("" not known)
    owner: str = ""  # its controller, "Kind/name"
    replacement: str = ""  # namespace/name
    replacement_uid: str = ""
    detail: str = ""  # "" not known: why

    @property
    def settled(self) -> bool:
        """Nothing the API server says later changes it (a replacement that is not
        running may still give way to one that is)."""
        return self.fate in (RUNNING, DELETED, LOST) or (
            self.fate == REPLACED and self.detail == RUNNING
        )


def created_unix(created: str) -> Optional[float]:
    """metadata.creationTimestamp (RFC 3339, whole seconds, UTC) as Unix time."""
    try:
        return float(calendar.timegm(time.strptime(created[:19], "%Y-%m-%dT%H:%M:%S")))
    except ValueError:
        return None


def judge(uid: str, at: Optional[float], view: ApiView, waited: float) -> Fate:
    """The fate of the pod ``uid`` rejected at ``at`` (Unix time; None: not known),
    ``waited`` seconds ago, in ``view``."""
    if view.source == STANDALONE:
        return Fate(LOST, detail="a static pod (kubelet has no API server)")
    if view.source != READ:
        return Fate("", detail=view.detail or "the API server's pods not read")
    key = uid_key(uid)
    mine = [p for p in view.pods if uid_key(p.uid) == key or uid_key(p.mirror_of) == key]
    if not mine:
        return Fate(DELETED)
    pod = mine[0]
    ctl = [o for o in pod.owners if o.controller]
    if pod.mirror_of or not ctl or ctl[0].kind == "Node":
        return Fate(LOST, detail="a static pod" if pod.mirror_of else "a bare pod")
    owner = ctl[0]
    shown = f"{owner.kind}/{owner.name}"
    if pod.phase == "Running" and not pod.deleting:
        return Fate(RUNNING, shown)

    def newer(p: ApiPod) -> bool:
        made = created_unix(p.created)
        # creationTimestamp is cut to the second: one within it may be newer
        return made is not None and (at is None or made + 1.0 > at)

    new = [
        p
        for p in view.pods
        if p.uid != pod.uid
        and not p.deleting
        and any(o.controller and o.uid == owner.uid for o in p.owners)
        and newer(p)
    ]
    if not new:
        return Fate(LOST if waited >= FOLLOW else WAITING, shown)
    new.sort(key=lambda p: (p.phase == "Running", p.created))
    by = new[-1]
    return Fate(REPLACED, shown, by.pod, by.uid, RUNNING if by.phase == "Running" else "")


def describe(p: RejectedPod, started: float) -> str:
    """A rejected pod's line: when kubelet rejected it, and its fate as recorded."""
    after = after_start(p.at, started)
    when = "at its start" if p.at_start or after is None else f"{after:.0f} s after its start"
    return f"kubelet rejected GPU pod {p.pod} {when}"


def fate_text(p: RejectedPod) -> str:
    """What became of it, as recorded (readmit/state.py)."""
    by = f"{p.replacement} ({p.replacement_uid})"
    if p.fate == REPLACED:
        return f"its {p.owner} replaced it with {by}"
    if p.fate == WAITING:
        return f"its {p.owner} has not replaced it on this node yet"
    if p.fate == LOST and p.owner:
        return f"it is lost: its {p.owner} made no replacement on this node"
    if p.fate == LOST:
        return "it is lost: a bare or static pod, which no controller makes again"
    if p.fate == RUNNING:
        return "it runs again"
    if p.fate == DELETED:
        return "it is deleted"
    return "whether a controller replaced it is not known (the API server not read)"


class Fates:
    """Follows the fates of the rejected pods of one kubelet run, in a thread of its
    own, through ``view`` (want: ask the API server to be read while wanted);
    ``record(pod, fate)`` gets each new fate."""

    def __init__(
        self,
        view: Callable[[], ApiView],
        want: Callable[[], None],
        record: Callable[[RejectedPod, Fate], None],
        still: Callable[[str], bool] = lambda _uid: True,
        every: float = EVERY,
    ) -> None:
        self.view = view
        self.want = want
        self.record = record
        self.still = still  # whether the pod is one of the current kubelet run's
        self.every = every
        self.lock = threading.Lock()
        self.pods: dict[str, tuple[RejectedPod, float, Fate]] = {}  # uid: pod, since, fate
        self.thread: Optional[threading.Thread] = None

    def add(self, pod: RejectedPod) -> Fate:
        """A pod just rejected: its fate now (with the answer there is)."""
        self.want()
        since = time.monotonic()
        fate = self.judged(pod, self.view(), since)
        with self.lock:
            if not fate.settled:
                self.pods[pod.pod_uid] = (pod, since, fate)
            if self.thread is None and self.pods:
                self.thread = threading.Thread(target=self.run, name="readmit-fates", daemon=True)
                self.thread.start()
        return fate

    @staticmethod
    def judged(pod: RejectedPod, view: ApiView, since: float) -> Fate:
        """``judge``, but a pod missing from an answer read before its rejection was
        seen (``since``, monotonic) is not known yet, never deleted."""
        fate = judge(pod.pod_uid, pod.at, view, time.monotonic() - since)
        if fate.fate == DELETED and view.at < since:
            return Fate("", detail="the API server's pods not read since the rejection")
        return fate

    def look(self) -> None:
        """One look at every pod followed."""
        view = self.view()
        with self.lock:
            followed = list(self.pods.items())
        for uid, (pod, since, old) in followed:
            if not self.still(uid):  # kubelet started again: judged anew
                with self.lock:
                    self.pods.pop(uid, None)
                continue
            fate = self.judged(pod, view, since)
            if fate.fate == "" or fate == old:
                continue
            with self.lock:
                if uid not in self.pods:
                    continue  # a new kubelet run
                if fate.settled:
                    del self.pods[uid]
                else:
                    self.pods[uid] = (pod, since, fate)
            self.record(pod, fate)

    def run(self) -> None:
        while True:
            self.want()
            time.sleep(self.every)
            with contextlib.suppress(Exception):  # a bug: looked at again next time
                self.look()
            with self.lock:
                if not self.pods:
                    self.thread = None
                    return


def fate_fields(p: RejectedPod) -> dict[str, str]:
    """The journal fields of a rejected pod and its fate (readmit-rejected's,
    readmit-pod-fate's; the daemon's finding's)."""
    return {
        "POD": p.pod,
        "POD_UID": p.pod_uid,
        "AT_START": "yes" if p.at_start else "no",
        "REJECTED_AT": f"{p.at:.3f}" if p.at is not None else "",
        "FATE": p.fate,
        "OWNER": p.owner,
        "REPLACEMENT": p.replacement,
        "REPLACEMENT_UID": p.replacement_uid,
    }


def say_rejected(elog: EventLog, p: RejectedPod, started: float) -> None:
    """``readmit-rejected``: the pod, when kubelet rejected it, and its fate then."""
    elog.event(
        "readmit-rejected",
        f"{describe(p, started)}: {p.message}; {fate_text(p)}",
        level="warning",
        fields={"REASON": p.reason, **fate_fields(p)},
    )


def say_fate(elog: EventLog, p: RejectedPod, started: float) -> None:
    """``readmit-pod-fate``: a rejected pod's new fate (lost: a warning)."""
    elog.event(
        "readmit-pod-fate",
        f"{describe(p, started)}: {fate_text(p)}",
        level="warning" if p.fate == LOST else "info",
        fields=fate_fields(p),
    )


def with_fate(p: RejectedPod, f: Fate) -> RejectedPod:
    return dataclasses.replace(
        p, fate=f.fate, owner=f.owner, replacement=f.replacement, replacement_uid=f.replacement_uid
    )
