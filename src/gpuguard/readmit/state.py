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
import math
from dataclasses import dataclass, replace
from typing import Any, Callable, Optional

from gpuguard.host.statefile import TIME_MAX, Obj, StateFile

# Its own runtime directory (RuntimeDirectory= of gpuguard-readmit.service, preserved):
# gpuguard.service's /run/gpuguard goes away whenever the daemon stops.
STATE_FILE = "/run/gpuguard-readmit/state.json"
MAX_REJECTED = 256  # newest kept: far above the GPU pods of a node
MAX_RACED = 32
# Every bound the reader (_parse) enforces, which the Recorder applies to what it is
# given: nothing it accepts can make a later write (or the daemon's read) fail.
SOCK_MAX = 64  # kubelet_sock
DECISION_MAX = 16
DETAIL_MAX = 400  # detail, problem
RESOURCE_MAX = 256  # a resource name, a device ID, a raced socket's name
MAX_REGISTRATIONS = 64
MAX_DEVICES = 4096
POD_UID_MAX = 64
POD_MAX = 320  # namespace/name: 63 + 1 + 253 at most in Kubernetes
REASON_MAX = 64
MESSAGE_MAX = 400
FATE_MAX = 16


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
    at: Optional[float] = None  # Unix time kubelet rejected it (its record's own)
    at_start: bool = True  # within klog.AT_START of kubelet's start (or not told)
    # its fate, from the API server's pods of this node (readmit/fates.py): "" not
    # known, waiting, replaced, lost, deleted, running
    fate: str = ""
    owner: str = ""  # its controller, "Kind/name" ("" a bare or static pod, not known)
    replacement: str = ""  # replaced: the new pod's namespace/name
    replacement_uid: str = ""


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
    # decision "off": why, as readmit/offstate.py's causes ("" for any other decision)
    off_cause: str = ""
    kubelet_version: str = ""  # "1.34" as the bridge told it ("" when not told)
    # what kept the bridge from reading kubelet's rejections at this start ("" none):
    # the daemon's verdict on them is then unknown, never OK
    problem: str = ""
    # the bridge process that registered in this kubelet run (its pid and start, Unix
    # time): once it is gone its streams have ended (readmit/ended.py)
    pid: int = 0
    pid_start: float = 0.0
    # when the streams of this kubelet run's registrations ended (that process stopped,
    # or a later one found it gone): kubelet then dropped the plugin that replaced them
    streams_ended: Optional[float] = None
    config_error: str = ""  # the configuration the bridge could not read, one line

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
        o.text("resource", max_len=RESOURCE_MAX),
        o.real("registered_at"),
        o.texts("devices", max_items=MAX_DEVICES, max_len=RESOURCE_MAX),
        o.opt_real("healthy_at"),
    )


def _rejected(v: Any, where: str) -> RejectedPod:
    o = Obj(v, where)
    return RejectedPod(
        o.text("pod_uid", max_len=POD_UID_MAX),
        o.text("pod", max_len=POD_MAX),
        o.text("reason", max_len=REASON_MAX),
        o.text("message", max_len=MESSAGE_MAX),
        o.real("seen_at"),
        o.opt_real("at"),
        o.flag("at_start", default=True),  # absent before it existed
        o.text("fate", max_len=FATE_MAX, default=""),
        o.text("owner", max_len=POD_MAX, default=""),
        o.text("replacement", max_len=POD_MAX, default=""),
        o.text("replacement_uid", max_len=POD_UID_MAX, default=""),
    )


def _parse(o: Obj) -> ReadmitState:
    return ReadmitState(
        o.text("kubelet_sock", max_len=SOCK_MAX),
        o.real("kubelet_started"),
        o.text("decision", max_len=DECISION_MAX),
        o.text("detail", max_len=DETAIL_MAX),
        o.items("registrations", _registration, max_items=MAX_REGISTRATIONS),
        o.texts("raced", max_items=MAX_RACED, max_len=RESOURCE_MAX),
        o.opt_real("first_admission"),
        o.items("rejected", _rejected, max_items=MAX_REJECTED),
        o.real("watch_until"),
        o.text("off_cause", max_len=32, default=""),
        o.text("kubelet_version", max_len=32, default=""),
        o.text("problem", max_len=DETAIL_MAX, default=""),  # absent before it existed
        o.integer("pid", hi=2**22, default=0),
        o.real("pid_start", default=0.0),
        o.opt_real("streams_ended"),
        o.text("config_error", max_len=DETAIL_MAX, default=""),
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
                "at": p.at,
                "at_start": p.at_start,
                "fate": p.fate,
                "owner": p.owner,
                "replacement": p.replacement,
                "replacement_uid": p.replacement_uid,
            }
            for p in s.rejected
        ],
        "watch_until": s.watch_until,
        "off_cause": s.off_cause,
        "kubelet_version": s.kubelet_version,
        "problem": s.problem,
        "pid": s.pid,
        "pid_start": s.pid_start,
        "streams_ended": s.streams_ended,
        "config_error": s.config_error,
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


def _t(text: str, limit: int) -> str:
    """``text`` within the reader's bound for its field (a lone surrogate, which no
    UTF-8 can carry, replaced): what the Recorder stores, the reader reads back."""
    if len(text) > limit:
        text = text[:limit]
    if not text.isascii():
        text = text.encode("utf-8", "replace").decode("utf-8")[:limit]
    return text


def _time(at: Optional[float]) -> Optional[float]:
    """A time the reader accepts (finite, 0 to TIME_MAX), else None."""
    if at is None or not math.isfinite(at) or not 0.0 <= at <= TIME_MAX:
        return None
    return float(at)


def bounded_pod(pod: RejectedPod) -> RejectedPod:
    """``pod`` with every field within what the state file's reader accepts."""
    return RejectedPod(
        _t(pod.pod_uid, POD_UID_MAX),
        _t(pod.pod, POD_MAX),
        _t(pod.reason, REASON_MAX),
        _t(pod.message, MESSAGE_MAX),
        _time(pod.seen_at) or 0.0,
        _time(pod.at),
        pod.at_start,
        _t(pod.fate, FATE_MAX),
        _t(pod.owner, POD_MAX),
        _t(pod.replacement, POD_MAX),
        _t(pod.replacement_uid, POD_UID_MAX),
    )


class Recorder:
    """The bridge's state for the current kubelet start, written through ``write``
    after each change (from the main loop, gRPC's and the journal reader's threads).

    Whatever it is given is cut to the bounds the state file's reader enforces (and a
    change its reader would still refuse is not taken, ``refused`` says why), so no
    input, a forged 10,000-character pod name included, can make a later write or the
    daemon's read fail: every later rejection and raced socket still reaches the
    daemon."""

    def __init__(
        self,
        write: Callable[[ReadmitState], None],
        *,
        refused: Callable[[str], None] = lambda _w: None,
        me: tuple[int, float] = (0, 0.0),
    ) -> None:
        import threading

        self.write = write
        self.refused = refused
        self.me = me  # this process: its pid and start (Unix time)
        self.lock = threading.Lock()
        self.state: Optional[ReadmitState] = None
        # kubelet may open ListAndWatch before the registration call returns here
        self.early: dict[str, float] = {}

    def _change(self, how: Callable[[ReadmitState], ReadmitState]) -> None:
        with self.lock:
            if self.state is None:
                return
            new = how(self.state)
            _data, why = SPEC.refuses(new)
            if why:  # kept as it was: every later change still writes
                with contextlib.suppress(Exception):
                    self.refused(why)
                return
            self.state = new
            with contextlib.suppress(Exception):  # the bridge's work never waits on its report
                self.write(new)

    def kubelet_started(self, sock: str, at: float, watch_until: float) -> None:
        with self.lock:
            error = self.state.config_error if self.state is not None else ""
            self.state = ReadmitState(
                _t(sock, SOCK_MAX),
                _time(at) or 0.0,
                "skip",
                "deciding",
                watch_until=_time(watch_until) or 0.0,
                pid=self.me[0],
                pid_start=_time(self.me[1]) or 0.0,
                config_error=error,
            )
            self.early.clear()
        self._change(lambda s: s)

    def resume(self, state: ReadmitState) -> None:
        """Go on with the state an earlier process wrote (a restart of the bridge)."""
        with self.lock:
            self.state = state

    def current(self) -> Optional[ReadmitState]:
        with self.lock:
            return self.state

    def streams_ended(self, at: float) -> None:
        when = _time(at)
        self._change(
            lambda s: (
                s if s.streams_ended is not None or when is None else replace(s, streams_ended=when)
            )
        )

    def config_error(self, error: str) -> None:
        self._change(lambda s: replace(s, config_error=_t(error, DETAIL_MAX)))

    def decided(self, decision: str, detail: str, run: Optional[str] = None) -> None:
        """``run``: the kubelet start (kubelet_sock) it was made for, as registered's."""
        self._change(
            lambda s: (
                s
                if run is not None and s.kubelet_sock != run
                else replace(s, decision=_t(decision, DECISION_MAX), detail=_t(detail, DETAIL_MAX))
            )
        )

    def registered(
        self, resource: str, devices: tuple[str, ...], at: float, run: Optional[str] = None
    ) -> None:
        """``run``: the kubelet start (kubelet_sock) it was made for; a registration
        that returns after kubelet's next start is not this run's."""
        resource = _t(resource, RESOURCE_MAX)
        with self.lock:
            early = self.early.pop(resource, None)
        ids = tuple(_t(d, RESOURCE_MAX) for d in devices[:MAX_DEVICES])
        reg = Registration(resource, _time(at) or 0.0, ids, early)

        def how(s: ReadmitState) -> ReadmitState:
            if run is not None and s.kubelet_sock != run:
                return s
            return replace(
                s,
                registrations=(
                    *(r for r in s.registrations if r.resource != resource),
                    reg,
                )[-MAX_REGISTRATIONS:],
            )

        self._change(how)

    def healthy(self, resource: str, at: float) -> None:
        resource = _t(resource, RESOURCE_MAX)
        when = _time(at)
        if when is None:
            return

        def how(s: ReadmitState) -> ReadmitState:
            if not any(r.resource == resource for r in s.registrations):
                if len(self.early) < MAX_REGISTRATIONS:
                    self.early.setdefault(resource, when)
                return s
            regs = tuple(
                replace(r, healthy_at=when)
                if r.resource == resource and r.healthy_at is None
                else r
                for r in s.registrations
            )
            return replace(s, registrations=regs)

        self._change(how)

    def raced(self, sockets: tuple[str, ...]) -> None:
        names = {_t(n, RESOURCE_MAX) for n in sockets[:MAX_RACED]}
        self._change(lambda s: replace(s, raced=tuple(sorted(set(s.raced) | names))[:MAX_RACED]))

    def admitted(self, at: float) -> None:
        when = _time(at)
        if when is not None:
            self._change(lambda s: replace(s, first_admission=when))

    def rejected(self, pod: RejectedPod) -> None:
        pod = bounded_pod(pod)

        def how(s: ReadmitState) -> ReadmitState:
            kept = tuple(p for p in s.rejected if p.pod_uid != pod.pod_uid)
            return replace(s, rejected=(*kept, pod)[-MAX_REJECTED:])

        self._change(how)

    def fate(self, pod_uid: str, fate: str, owner: str, by: str, by_uid: str) -> None:
        """A rejected pod's fate as the API server's pods tell it (readmit/fates.py)."""

        def how(s: ReadmitState) -> ReadmitState:
            pods = tuple(
                bounded_pod(
                    replace(p, fate=fate, owner=owner, replacement=by, replacement_uid=by_uid)
                )
                if p.pod_uid == pod_uid
                else p
                for p in s.rejected
            )
            return replace(s, rejected=pods)

        self._change(how)

    def problem(self, why: str) -> None:
        """Something kept the bridge from reading kubelet's rejections at this start
        (each said once; the newest first, within the field's bound)."""

        def how(s: ReadmitState) -> ReadmitState:
            if why in s.problem:
                return s
            joined = f"{why}; {s.problem}" if s.problem else why
            return replace(s, problem=_t(joined, DETAIL_MAX))

        self._change(how)
