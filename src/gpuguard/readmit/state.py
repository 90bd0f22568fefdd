"""What the re-admission bridge saw at the latest kubelet start, for the daemon.

The bridge (gpuguard-readmit.service) writes it atomically after each change: the
kubelet start it served (kubelet.sock's identity and time), what it decided, per
resource when its registration returned, the devices it offered and when kubelet
received them, the device plugin sockets that raced it, when kubelet first admitted a
pod, and the GPU pods kubelet rejected. The daemon's readmit step turns the rejections
into findings (named in ``gpuguard status``, the metrics, an NPD condition) and the
margin into a gauge; the device plugin step reads the registration time, so that a
plugin whose socket predates it (it may have been replaced by the bridge) registers
again.

A rejection belongs to the kubelet run that made it: each kubelet start begins a new
list (that kubelet judges every pod again and names again the ones it rejects).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace
from typing import Any, Callable, Optional

from gpuguard.host.statefile import Obj, StateFile

# Its own runtime directory (RuntimeDirectory= of gpuguard-readmit.service, preserved):
# gpuguard.service's /run/gpuguard goes away whenever the daemon stops.
STATE_FILE = "/run/gpuguard-readmit/state.json"
MAX_REJECTED = 256  # newest kept: far above the GPU pods of a node
MAX_RACED = 32


@dataclass(frozen=True)
class Registration:
    resource: str
    registered_at: float  # Unix time the registration call returned
    devices: tuple[str, ...]  # the device IDs reported healthy
    healthy_at: Optional[float] = None  # when kubelet received them (ListAndWatch)


@dataclass(frozen=True)
class RejectedPod:
    pod_uid: str
    pod: str  # namespace/name
    reason: str  # kubelet's (UnexpectedAdmissionError)
    message: str  # kubelet's, bounded
    seen_at: float  # Unix time the bridge read it


@dataclass(frozen=True)
class ReadmitState:
    kubelet_sock: str  # one kubelet start: "pid:PID:TICKS" of its listener, else "inode:DEV:INO"
    kubelet_started: float  # Unix time kubelet started (devices/kubeletstart.py)
    decision: str  # offered | observe | skip | off | failed
    detail: str  # one line: why
    registrations: tuple[Registration, ...] = ()
    raced: tuple[str, ...] = ()  # plugin sockets seen right after the registration
    first_admission: Optional[float] = None  # kubelet's first SyncLoop ADD (klog time)
    rejected: tuple[RejectedPod, ...] = ()
    watch_until: float = 0.0  # Unix time the bridge stops reading kubelet's journal

    @property
    def healthy_at(self) -> Optional[float]:
        """When kubelet first received healthy devices from the bridge."""
        times = [r.healthy_at for r in self.registrations if r.healthy_at is not None]
        return min(times) if times else None

    @property
    def registered_at(self) -> Optional[float]:
        """When the bridge's last registration of this kubelet run returned."""
        times = [r.registered_at for r in self.registrations]
        return max(times) if times else None

    @property
    def margin(self) -> Optional[float]:
        """Seconds from the devices healthy to kubelet's first admission (negative:
        kubelet judged its pods before); None when either is not known."""
        healthy = self.healthy_at
        if healthy is None or self.first_admission is None:
            return None
        return self.first_admission - healthy

    def margins(self) -> tuple[tuple[str, float], ...]:
        """Each resource's margin: from its devices healthy to kubelet's first
        admission (seconds)."""
        if self.first_admission is None:
            return ()
        return tuple(
            (r.resource, self.first_admission - r.healthy_at)
            for r in self.registrations
            if r.healthy_at is not None
        )


def _registration(v: Any, where: str) -> Registration:
    o = Obj(v, where)
    return Registration(
        o.text("resource", max_len=256),
        o.real("registered_at"),
        o.texts("devices", max_items=4096, max_len=256),
        o.opt_real("healthy_at"),
    )


def _rejected(v: Any, where: str) -> RejectedPod:
    o = Obj(v, where)
    return RejectedPod(
        o.text("pod_uid", max_len=64),
        o.text("pod", max_len=320),
        o.text("reason", max_len=64),
        o.text("message", max_len=400),
        o.real("seen_at"),
    )


def _parse(o: Obj) -> ReadmitState:
    return ReadmitState(
        o.text("kubelet_sock", max_len=64),
        o.real("kubelet_started"),
        o.text("decision", max_len=16),
        o.text("detail", max_len=400),
        o.items("registrations", _registration, max_items=64),
        o.texts("raced", max_items=MAX_RACED, max_len=256),
        o.opt_real("first_admission"),
        o.items("rejected", _rejected, max_items=MAX_REJECTED),
        o.real("watch_until"),
    )


def _render(s: ReadmitState) -> dict[str, Any]:
    return {
        "kubelet_sock": s.kubelet_sock,
        "kubelet_started": s.kubelet_started,
        "decision": s.decision,
        "detail": s.detail,
        "registrations": [
            {
                "resource": r.resource,
                "registered_at": r.registered_at,
                "devices": list(r.devices),
                "healthy_at": r.healthy_at,
            }
            for r in s.registrations
        ],
        "raced": list(s.raced),
        "first_admission": s.first_admission,
        "rejected": [
            {
                "pod_uid": p.pod_uid,
                "pod": p.pod,
                "reason": p.reason,
                "message": p.message,
                "seen_at": p.seen_at,
            }
            for p in s.rejected
        ],
        "watch_until": s.watch_until,
    }


SPEC: StateFile[ReadmitState] = StateFile(
    path=STATE_FILE,
    what="re-admission bridge state",
    version=1,
    parse=_parse,
    render=_render,
    dir_mode=0o755,
    next_step="gpuguard-readmit writes it again at kubelet's next start",
)


class Recorder:
    """The bridge's state for the current kubelet start, written through ``write``
    after each change (from the main loop, gRPC's and the journal reader's threads)."""

    def __init__(self, write: Callable[[ReadmitState], None]) -> None:
        import threading

        self.write = write
        self.lock = threading.Lock()
        self.state: Optional[ReadmitState] = None
        # kubelet may open ListAndWatch before the registration call returns here
        self.early: dict[str, float] = {}

    def _change(self, how: Callable[[ReadmitState], ReadmitState]) -> None:
        with self.lock:
            if self.state is None:
                return
            self.state = how(self.state)
            state = self.state
            with contextlib.suppress(Exception):  # the bridge's work never waits on its report
                self.write(state)

    def kubelet_started(self, sock: str, at: float, watch_until: float) -> None:
        with self.lock:
            self.state = ReadmitState(sock, at, "skip", "deciding", watch_until=watch_until)
            self.early.clear()
        self._change(lambda s: s)

    def decided(self, decision: str, detail: str) -> None:
        self._change(lambda s: replace(s, decision=decision, detail=detail[:400]))

    def registered(self, resource: str, devices: tuple[str, ...], at: float) -> None:
        with self.lock:
            early = self.early.pop(resource, None)
        reg = Registration(resource, at, devices[:4096], early)
        self._change(
            lambda s: replace(
                s,
                registrations=(*(r for r in s.registrations if r.resource != resource), reg),
            )
        )

    def healthy(self, resource: str, at: float) -> None:
        def how(s: ReadmitState) -> ReadmitState:
            if not any(r.resource == resource for r in s.registrations):
                self.early.setdefault(resource, at)
                return s
            regs = tuple(
                replace(r, healthy_at=at) if r.resource == resource and r.healthy_at is None else r
                for r in s.registrations
            )
            return replace(s, registrations=regs)

        self._change(how)

    def raced(self, sockets: tuple[str, ...]) -> None:
        self._change(
            lambda s: replace(s, raced=tuple(sorted(set(s.raced) | set(sockets)))[:MAX_RACED])
        )

    def admitted(self, at: float) -> None:
        self._change(lambda s: replace(s, first_admission=at))

    def rejected(self, pod: RejectedPod) -> None:
        def how(s: ReadmitState) -> ReadmitState:
            kept = tuple(p for p in s.rejected if p.pod_uid != pod.pod_uid)
            return replace(s, rejected=(*kept, pod)[-MAX_REJECTED:])

        self._change(how)
