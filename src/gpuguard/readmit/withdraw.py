"""The bridge's withdrawal: every device it offered reported Unhealthy once its pods are
re-admitted, so that no capacity it cannot allocate reaches the scheduler.

The devices the bridge reports healthy are held by the checkpoint's pods; kubelet
counts them allocatable (the Node's allocatable is the healthy count) and, for a new
pod, takes a device from the healthy ones no active pod uses. A pod that never comes
back (deleted while the node was down but the API server could not be read, rejected,
or gone otherwise) leaves its device free to kubelet: the scheduler places a new pod
there and kubelet asks the bridge to Allocate it, which it cannot. So once every pod
the bridge offered for has been re-admitted (kubelet's podresources ``List`` shows
its devices, in two looks in a row POLL apart), or WAIT seconds after kubelet's start
at most, the bridge sends ONE more ListAndWatch response: every device Unhealthy.
kubelet keeps admitted pods running on unhealthy devices, the allocatable becomes 0,
and the real plugin's registration reports the node's GPUs again. A pod kubelet
re-admits only after that (its API server unreachable for longer than WAIT) is
rejected as without the bridge.

Never after the real plugin registered: kubelet does not close a replaced endpoint's
stream, and an update sent on it is applied to the resource by name, over the real
plugin's devices (allocatable 0 until the plugin reports again, which NVIDIA's plugin
does only on a health change). A plugin makes its socket in kubelet's device-plugins
directory before it registers, so a socket there at any look (or at the moment of
sending) means the plugin has registered or is about to: the bridge then sends nothing,
for good in this kubelet run (``readmit-handed-over``). What is left is a plugin that
makes its socket and completes its registration within the microseconds between the
last look and the send.

``plan`` is the pure decision; :class:`Withdrawal` runs it in a thread per kubelet
start and journals the outcome (``readmit-withdrawn``, ``readmit-handed-over``).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Optional, Sequence

from gpuguard.host import unarygrpc
from gpuguard.host.protowire import fields
from gpuguard.journal.log import EventLog
from gpuguard.readmit.plan import Offer

WAIT = 30.0  # seconds after kubelet's start: withdrawn then whatever was re-admitted
POLL = 1.0  # seconds between looks
LIST = "/v1.PodResourcesLister/List"
SOCKET = "pod-resources/kubelet.sock"  # beside the device-plugins directory
TIMEOUT = 0.5
MAX_ANSWER = 8 << 20

WAIT_, WITHDRAW, HANDED_OVER = "wait", "withdraw", "handed-over"


def decode_list(data: bytes) -> dict[str, frozenset[str]]:
    """resource -> the device IDs kubelet's podresources ``List`` shows held.
    ListPodResourcesResponse{pod_resources = 1: PodResources{name = 1, namespace = 2,
    containers = 3: ContainerResources{name = 1, devices = 2: ContainerDevices{
    resource_name = 1, device_ids = 2}}}} (k8s.io/kubelet/pkg/apis/podresources/v1).
    ValueError on what is not one."""
    held: dict[str, set[str]] = {}
    for pod in fields(data).get(1, []):
        for ctr in fields(pod).get(3, []):
            for dev in fields(ctr).get(2, []):
                f = fields(dev)
                name = f.get(1, [b""])[-1].decode()
                held.setdefault(name, set()).update(i.decode() for i in f.get(2, []))
    return {k: frozenset(v) for k, v in held.items() if k}


def read_list(plugins_dir: Path) -> Optional[dict[str, frozenset[str]]]:
    """kubelet's answer, or None when it cannot be asked (no socket, no answer, a
    server not running as root: the withdrawal then waits for its deadline)."""
    path = plugins_dir.parent / SOCKET
    try:
        data = unarygrpc.call(  # kubelet's: its server runs as root
            LIST, str(path), b"", timeout=TIMEOUT, limit=MAX_ANSWER, peer_uid=0
        )
        return decode_list(data)
    except (unarygrpc.CallError, OSError, ValueError):
        return None


def pending(
    offers: Sequence[Offer], listed: Optional[Mapping[str, frozenset[str]]]
) -> tuple[str, ...]:
    """The pod UIDs offered for whose devices kubelet does not show held (all of them
    when kubelet could not be asked)."""
    out = set()
    for o in offers:
        shown = (listed or {}).get(o.resource, frozenset())
        for uid, ids in o.held:
            if listed is None or not set(ids) <= shown:
                out.add(uid)
    return tuple(sorted(out))


def plan(
    elapsed: float, waiting: Sequence[str], before: Optional[Sequence[str]], sockets: Sequence[str]
) -> str:
    """What to do at one look, ``elapsed`` seconds after kubelet's start: HANDED_OVER
    when a device plugin's socket exists, WITHDRAW when no offered pod is ``waiting``
    at this look and the one ``before``, or WAIT seconds have passed; else WAIT_."""
    if sockets:
        return HANDED_OVER
    if not waiting and before is not None and not before:
        return WITHDRAW
    return WITHDRAW if elapsed >= WAIT else WAIT_


@dataclass(frozen=True)
class Outcome:
    step: str  # WITHDRAW or HANDED_OVER ("" stopped: another kubelet start)
    waiting: tuple[str, ...]  # pods offered that kubelet had not re-admitted
    sockets: tuple[str, ...]  # the plugin sockets seen
    elapsed: float


class Withdrawal:
    """One thread per kubelet start: looks every POLL seconds, then withdraws (through
    ``withdraw(resource) -> open streams``) or hands over, and journals it."""

    def __init__(
        self,
        plugins_dir: Path,
        elog: EventLog,
        withdraw: Callable[[str], int],
        sockets: Callable[[], tuple[str, ...]],
        listed: Callable[[], Optional[dict[str, frozenset[str]]]],
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.dir = plugins_dir
        self.elog = elog
        self.withdraw = withdraw
        self.sockets = sockets
        self.listed = listed
        self.clock = clock
        self.stop_event: Optional[threading.Event] = None
        self.thread: Optional[threading.Thread] = None
        # held from the last look to the send, and by cancel(): once cancel() returns,
        # the previous kubelet's withdrawal never reaches the next registration
        self.sending = threading.Lock()

    def start(self, offers: Sequence[Offer], started: float) -> None:
        """For the offers registered at the kubelet start at Unix time ``started``."""
        self.cancel()
        stop = threading.Event()
        self.stop_event = stop
        self.thread = threading.Thread(
            target=self.run, args=(tuple(offers), started, stop), name="withdraw", daemon=True
        )
        self.thread.start()

    def cancel(self) -> None:
        with self.sending:
            if self.stop_event is not None:
                self.stop_event.set()

    def run(self, offers: tuple[Offer, ...], started: float, stop: threading.Event) -> Outcome:
        before: Optional[tuple[str, ...]] = None
        while True:
            socks = self.sockets()
            waiting = pending(offers, self.listed()) if not socks else ()
            elapsed = self.clock() - started
            step = plan(elapsed, waiting, before, socks)
            if step == HANDED_OVER:
                return self._handed_over(offers, socks, elapsed)
            if step == WITHDRAW:
                with self.sending:
                    if stop.is_set():  # another kubelet start: its own decision
                        return Outcome("", waiting, (), elapsed)
                    late = self.sockets()  # the moment of sending
                    if late:
                        return self._handed_over(offers, late, elapsed)
                    return self._withdrawn(offers, waiting, elapsed)
            before = waiting
            if stop.wait(POLL):
                return Outcome("", waiting, (), elapsed)

    def _handed_over(
        self, offers: Sequence[Offer], socks: tuple[str, ...], elapsed: float
    ) -> Outcome:
        self.elog.event(
            "readmit-handed-over",
            f"a device plugin's socket ({', '.join(socks)[:200]}) exists {elapsed:.1f} s after "
            "kubelet's start: the bridge sends nothing more; the plugin serves "
            f"{', '.join(o.resource for o in offers)[:200]}",
            fields={"PLUGINS": ",".join(socks), "RESOURCES": ",".join(o.resource for o in offers)},
        )
        return Outcome(HANDED_OVER, (), socks, elapsed)

    def _withdrawn(
        self, offers: Sequence[Offer], waiting: tuple[str, ...], elapsed: float
    ) -> Outcome:
        for o in offers:
            streams = self.withdraw(o.resource)
            late = [u for u in waiting if u in o.pods]
            why = (
                f"{len(late)} of {len(o.pods)} pods not re-admitted after {WAIT:.0f} s"
                if late
                else f"its {len(o.pods)} pods re-admitted"
            )
            self.elog.event(
                "readmit-withdrawn",
                f"reported the {len(o.healthy)} {o.resource} devices of the bridge unhealthy "
                f"{elapsed:.1f} s after kubelet's start ({why}): kubelet's allocatable is 0 "
                "until the device plugin registers",
                fields={
                    "RESOURCE": o.resource,
                    "DEVICES": ",".join(o.healthy),
                    "PENDING": ",".join(late),
                    "STREAMS": str(streams),
                },
            )
        return Outcome(WITHDRAW, waiting, (), elapsed)


def allocate_refused(elog: EventLog, resource: str, ids: tuple[str, ...]) -> None:
    """The journal entry of an Allocate kubelet asked of the bridge (readmit/serve.py
    refuses it): it should never be asked once the withdrawal works."""
    elog.event(
        "readmit-allocate",
        f"kubelet asked the re-admission bridge to allocate {resource} devices "
        f"({', '.join(ids)[:200] or 'none named'}) for a new pod: refused, the pod fails "
        "admission; the device plugin has not registered yet",
        level="warning",
        fields={"RESOURCE": resource, "DEVICES": ",".join(ids)},
    )
