"""gpuguard's re-admission bridge (``gpuguard readmit``, gpuguard-readmit.service).

kubelet 1.26+ re-admits its pods at start-up 40-80 ms after its registration server
starts; at a node's boot no device plugin has reported a healthy device by then, so
every GPU pod whose container is not running fails for good
(``UnexpectedAdmissionError``: "no healthy devices present"), its GPU still in its
slot or not. The bridge is a small process started before kubelet that, as soon as
kubelet makes ``kubelet.sock``, registers each GPU resource the checkpoint holds and
reports healthy exactly the device IDs the checkpoint's pod entries hold (read after
gpuguard's pre-start hook, so remapped) that the node has (readmit/plan.py). kubelet
then re-admits those pods with their checkpointed allocation and no Allocate call;
the real plugin registers whenever it is ready, replaces the bridge's endpoint and
serves every new pod. The bridge keeps its stream open for kubelet's whole run
(readmit/serve.py says why) and never allocates.

It runs only for a kubelet that needs it: the version ``--version`` of the kubelet
unit's executable reports ([Systemd] KubeletUnits=, the first unit loaded), 1.26 and
later; cached by the executable's identity (/var/lib/gpuguard/kubelet-version.json).
``GPUGUARD_READMIT=on|off`` in the unit's environment overrides it (default auto).
The off switch and Mode=observe are read at each kubelet start: off, it does
nothing; observe, it journals what it would offer and registers nothing.

It never exits while kubelet holds its streams: a configuration that cannot be read
again, and any other error of the loop, are contained (readmit/contained.py). Each
kubelet start is handled in a thread of its own, each resource's registration in
another, each with its own channel and deadline: a slow or failing one delays no
other, and the loop keeps watching kubelet.sock meanwhile. Its own end while kubelet
runs is said, and written for the daemon (readmit/ended.py).

Modules (docs/architecture.md has the map of the packages): the loop (`__init__.py`),
its errors contained (`contained.py`), its own end said (`ended.py`); the offer
(`plan.py`, pure) over every device ID form (`devids.py`), present by the driver or by
PCI + history (`presence.py`; the pods left out: `refusals.py`); the node: NVML once, in
a child (`node.py`, `nvmlchild.py`), pods alive by their own containers (`alive.py`),
the API server's pods (`apipods.py`), kubelet's version and the plugin sockets
(`observe.py`), why it stays off (`offstate.py`); gRPC: endpoints and registration
(`serve.py`, `rpcerror.py`, `wire.py`), the withdrawal (`withdraw.py`), inotify
(`watch.py`); kubelet's rejections from its own records (`rejected.py`,
`kubeletlog.py`, `klog.py`) and the bounded state file (`state.py`). It imports no
step.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional, Union

from gpuguard.checkpoint.model import PodDevicesEntry
from gpuguard.checkpoint.reader import load as load_checkpoint
from gpuguard.config.schema import Config
from gpuguard.devices.kubeletstart import KubeletStart, KubeletStartWatch
from gpuguard.errors import GpuguardError
from gpuguard.host.offswitch import read_off_switch
from gpuguard.host.paths import GPU_HISTORY_FILE, Root
from gpuguard.journal.log import EventLog
from gpuguard.readmit import rpcerror
from gpuguard.readmit.contained import Contained
from gpuguard.readmit.ended import kubelet_listens, registered_in, say_ended
from gpuguard.readmit.observe import alive_pods, file_key, other_sockets
from gpuguard.readmit.plan import Decision, Offer, decide
from gpuguard.readmit.presence import DRIVER_NOT_LOADED, THIS_BOOT, NodeDevices
from gpuguard.readmit.refusals import refused_field
from gpuguard.readmit.rejected import WATCH_SECONDS, RejectionWatch
from gpuguard.readmit.serve import Bridge, endpoint
from gpuguard.readmit.state import ReadmitState, Recorder
from gpuguard.readmit.watch import DirWatch

if TYPE_CHECKING:  # the bridge's (cli/readmit.py); the daemon imports this package too
    from gpuguard.readmit.apipods import NodePods
    from gpuguard.readmit.withdraw import Withdrawal

POLL = 1.0  # seconds at most between looks for a new kubelet.sock (inotify wakes it)
QUICK = 0.005  # seconds between looks while kubelet.sock refuses just after it changed
REFRESH = 60.0  # configuration and inventory read again this often while idle
PCI_VIEWS = (DRIVER_NOT_LOADED, THIS_BOOT)  # presence.py's views without the driver
AHEAD = 5.0  # the decision made ahead is made again this often (pods that died)


@dataclass(frozen=True)
class Inputs:
    """What is read before kubelet starts, so that a kubelet start costs only the
    checkpoint's read: the configuration and the devices the node has (readmit/node.py;
    a plain set of IDs in tests)."""

    cfg: Config
    present: Union[NodeDevices, frozenset[str]]
    inventory_problem: str  # "" when the inventory was read


class Readmit:
    """The loop: one decision per kubelet start (a new kubelet.sock)."""

    def __init__(
        self,
        root: Root,
        elog: EventLog,
        read_inputs: Callable[[], Inputs],
        bridge: Bridge,
        rejected: Optional[RejectionWatch] = None,
        recorder: Optional[Recorder] = None,
        api: Optional[NodePods] = None,
        withdrawal: Optional[Withdrawal] = None,
    ) -> None:
        self.root = root
        self.elog = elog
        self.read_inputs = read_inputs
        self.inputs = read_inputs()
        self.inputs_history = self.history_key()  # the history the inputs were read with
        self.bridge = bridge
        self.rejected = rejected
        # what the daemon reads (readmit/state.py); a stand-in that writes nothing
        self.recorder = recorder if recorder is not None else Recorder(lambda _s: None)
        self.plugins_dir = root.path(Path(self.inputs.cfg.kubelet.checkpoint_path).parent)
        self.api = api  # the API server's pods of this node (readmit/apipods.py)
        self.withdrawal = withdrawal  # after the re-admissions (readmit/withdraw.py)
        # the decision made ahead, for the checkpoint as it was then (its identity) and
        # the inputs it was made with: any refresh, in either thread, makes it stale
        self.ahead: Optional[tuple[tuple[int, int, int], float, Decision, Inputs]] = None
        self.lock = threading.RLock()  # the loop's refresh and prepare, the start's thread
        self.start_decided = threading.Event()  # a start's thread has made its decision
        # what that decision was made of: a new answer of the API server is decided
        # again from them at kubelet's start, with no read (decide is pure)
        self.made_of: Optional[tuple[tuple[PodDevicesEntry, ...], frozenset[str], object]] = None
        self.contained = Contained(elog)
        # whether kubelet serves kubelet.sock now (tests: a stand-in)
        self.kubelet_listens: Callable[[], bool] = lambda: kubelet_listens(self.plugins_dir)
        self.handlers: list[threading.Thread] = []  # kubelet starts being handled
        self.kstart: Optional[KubeletStartWatch] = None  # kubelet.sock's listener

    def checkpoint_key(self) -> tuple[int, int, int]:
        return file_key(self.root.path(self.inputs.cfg.kubelet.checkpoint_path))

    def history_key(self) -> tuple[int, int, int]:
        return file_key(self.root.path(GPU_HISTORY_FILE))

    def refresh_pci_view(self) -> None:
        """The PCI view (no driver at the bridge's start) read again when the history
        changed since: the driver arrived and gpuguard (its daemon, or kubelet's
        pre-start hook) remapped the checkpoint to the GPUs' new UUIDs and recorded
        them, before the kubelet restart that brings the pods back. The driver's view
        (NVML, the inventory file) is read again only every REFRESH seconds, as before.
        (The history is gpuguard's own state file, written only by gpuguard as root.)"""
        present = self.inputs.present
        if not isinstance(present, NodeDevices) or present.evidence not in PCI_VIEWS:
            return
        if self.history_key() != self.inputs_history:
            self.refresh()  # the decision made ahead is then stale (its inputs)

    def prepare(self) -> None:
        """Decide ahead of kubelet's start, so that its start costs a stat and the
        registration: again whenever the checkpoint changed (gpuguard's pre-start hook
        writes it just before kubelet starts), the inputs were read again, and every
        AHEAD seconds (pods that died)."""
        with self.lock:
            self.refresh_pci_view()
            key = self.checkpoint_key()
            now = time.monotonic()
            a = self.ahead
            if a is None or a[0] != key or a[3] is not self.inputs or now - a[1] > AHEAD:
                self.ahead = (key, now, self.decision(), self.inputs)
                for o in self.ahead[2].offers:  # its endpoint listening before kubelet starts
                    self.bridge.serve(o.resource)

    def decided(self) -> Decision:
        """The decision made ahead when the checkpoint is still the same (made again,
        from the same checkpoint and processes, for a new answer of the API server),
        else now."""
        with self.lock:
            self.refresh_pci_view()
            a = self.ahead
            if a is not None and a[0] == self.checkpoint_key() and a[3] is self.inputs:
                if self.api is None or self.made_of is None:
                    return a[2]
                entries, alive, key = self.made_of
                api = self.api.view()
                if api.key == key:
                    return a[2]
                cfg = self.inputs.cfg
                return decide(entries, cfg.kubelet.resources, self.inputs.present, alive, api)
            return self.decision()

    def kubelet_sock(self) -> Optional[KubeletStart]:
        """kubelet's current run, told by kubelet.sock's listener, else its inode
        (devices/kubeletstart.py): a touch, chown or xattr change is no start. A stat
        per call; the socket is connected to only when its stat changed."""
        if self.kstart is None:
            self.kstart = KubeletStartWatch(self.root, self.plugins_dir / "kubelet.sock")
        return self.kstart.look()

    def resume(self, prior: Optional[ReadmitState]) -> None:
        """At this process's start: go on with the state an earlier process wrote; if it
        registered in the kubelet run that still goes on, its streams have ended."""
        if prior is None:
            return
        self.recorder.resume(prior)
        resources = registered_in(prior, self.kubelet_sock())
        if resources and self.kubelet_listens():
            self.recorder.streams_ended(time.time())
            say_ended(self.elog, resources, "gone")

    def stopping(self) -> None:
        """At SIGTERM, before the servers stop: said and written first, so that the
        daemon, woken by this process's end, finds the time."""
        resources = registered_in(self.recorder.current(), self.kubelet_sock())
        if resources and self.kubelet_listens():
            self.recorder.streams_ended(time.time())
            say_ended(self.elog, resources, "stop")

    def refresh(self) -> bool:
        """The configuration and inventory read again; on an error the last good ones
        stay, said once per distinct error and written to the state file."""
        with self.lock:
            history = self.history_key()
            try:
                inputs = self.read_inputs()
            except Exception as e:  # never exit: the streams kubelet holds would end
                self.recorder.config_error(self.contained.config_failed(e))
                return False
            self.inputs = inputs
            self.inputs_history = history
        if self.contained.config_read():
            self.recorder.config_error("")
        return True

    def run(self, stop: Callable[[], bool]) -> None:
        """Until ``stop()``: a kubelet.sock already there at the start is a kubelet
        that has re-admitted its pods already, never registered with."""
        seen = self.kubelet_sock()
        refreshed = time.monotonic()
        watch = DirWatch(self.plugins_dir)
        while not stop():
            try:
                # within milliseconds while kubelet.sock refuses just after it changed
                unsettled = self.kstart is not None and self.kstart.unsettled
                watch.wait(QUICK if unsettled else POLL)
                sock = self.kubelet_sock()
                if sock is None or sock == seen:
                    try:
                        self.prepare()
                    except Exception as e:  # decided again at kubelet's start
                        self.ahead = None
                        self.elog.event(
                            "debug", f"deciding ahead failed: {e!r}"[:300], level="debug"
                        )
                    sock = self.kubelet_sock()  # kubelet may have started meanwhile
                if sock is not None and sock != seen:
                    seen = sock
                    self.handle_kubelet_start()
                    # the configuration read again at a start, once the start's thread
                    # has decided: never ahead of it on the lock (ms count there)
                    self.start_decided.wait(1.0)
                    refreshed = 0.0
                if time.monotonic() - refreshed > REFRESH:
                    refreshed = time.monotonic()
                    self.refresh()
            except Exception as e:  # never exit: the streams kubelet holds would end
                self.contained.loop_failed("its loop", e)
                time.sleep(POLL)  # never a busy loop
        watch.close()

    def handle_kubelet_start(self) -> None:
        """on_kubelet_start in a thread of its own: the loop keeps watching kubelet.sock
        (a slow registration never hides kubelet's next start)."""

        def handle() -> None:
            try:
                self.on_kubelet_start()
            except Exception as e:  # never exit: the streams kubelet holds would end
                self.contained.loop_failed("kubelet start not handled", e)
            finally:
                self.start_decided.set()

        self.handlers = [t for t in self.handlers if t.is_alive()]
        self.start_decided.clear()
        t = threading.Thread(target=handle, name="readmit-kubelet-start", daemon=True)
        self.handlers.append(t)
        t.start()

    def decision(self) -> Decision:
        cfg = self.inputs.cfg
        try:
            loaded = load_checkpoint(self.root.path(cfg.kubelet.checkpoint_path))
        except GpuguardError as e:  # absent (no plugin ever registered), unreadable
            return Decision((), e.message)
        if not loaded.valid:
            return Decision((), f"kubelet's checkpoint not usable: {loaded.problem}")
        entries = loaded.checkpoint.entries or ()
        alive = alive_pods(self.root)
        api = self.api.view() if self.api is not None else None
        d = decide(entries, cfg.kubelet.resources, self.inputs.present, alive, api)
        self.made_of = (tuple(entries), alive, api.key if api is not None else None)
        if self.api is not None and (d.offers or d.left_out):  # read while pods wait
            self.api.want()
        return d

    def on_kubelet_start(self) -> None:
        """One kubelet start: the decision, then every offer's registration in parallel,
        each in its own thread with its own channel and deadline; returns when all
        have returned."""
        t0 = time.monotonic()
        sock = self.kubelet_sock()
        started = sock.wall() if sock is not None else time.time()
        rec = self.recorder
        run = sock.key if sock else ""
        rec.kubelet_started(run, started, time.time() + WATCH_SECONDS + 5)
        if sock is not None and sock.listener is None and not sock.transient:
            self.elog.warning(f"kubelet's start told by {sock.told_by()}"[:300])
        if self.rejected is not None:  # the pods kubelet rejects now, named (any mode)
            self.rejected.start(self.inputs.cfg, started)  # this kubelet's own records
        if self.withdrawal is not None:  # the previous kubelet's: never sent now
            self.withdrawal.cancel()
        off = read_off_switch(self.root)
        if off is not None:
            self.elog.event("readmit-skip", f"gpuguard is off ({off.describe()}): no offer")
            rec.decided("off", f"gpuguard is off ({off.describe()})")
            return
        d = self.decided()
        self.start_decided.set()
        judged = {"EVIDENCE": d.evidence, "REFUSED": refused_field(d.refused)}
        left = d.left_out_text()
        if not d.offers:
            self.elog.event(
                "readmit-skip",
                f"kubelet started: no offer: {d.why}{f' ({left})' if left else ''}",
                fields=judged,
            )
            rec.decided("skip", d.why)
            return
        plugins = other_sockets(self.plugins_dir)
        if plugins:
            why = f"a device plugin serves already ({', '.join(plugins)[:200]})"
            self.elog.event("readmit-skip", f"kubelet started: no offer: {why}")
            rec.decided("skip", why)
            return
        rec.decided("observe" if self.inputs.cfg.daemon.observe else "offered", d.why)
        if d.unread:
            self.elog.event(
                "readmit-api-unread",
                f"the API server's pods of this node could not be read ({d.unread[:200]}): "
                "every checkpointed GPU pod is offered, a pod deleted while the node was "
                "down too, until the bridge withdraws its devices",
                level="warning",
                fields={"PROBLEM": d.unread},
            )
        threads: list[threading.Thread] = []
        registered: list[Offer] = []  # appended by the threads (list.append is atomic)
        for o in d.offers:
            fields = {
                "RESOURCE": o.resource,
                "DEVICES": ",".join(o.healthy),
                "ABSENT": ",".join(o.absent),
                "PODS": ",".join(o.pods),
                "LEFT_OUT": ",".join(x.pod_uid for x in o.left_out),
                "ENDPOINT": endpoint(o.resource),
                **judged,
            }
            what = f"{len(o.healthy)} {o.resource} devices held by {len(o.pods)} pods"
            if self.inputs.cfg.daemon.observe:
                self.elog.event(
                    "readmit-observe", f"observe-only: would report {what} healthy", fields=fields
                )
                continue
            t = threading.Thread(
                target=self.register,
                args=(o, d, fields, what, t0, run, left, registered),
                name=f"readmit-register-{o.resource}"[:60],
                daemon=True,
            )
            threads.append(t)
            t.start()
        for t in threads:
            t.join()
        if registered and self.withdrawal is not None:
            self.withdrawal.start(registered, started)

    def register(
        self,
        o: Offer,
        d: Decision,
        fields: dict[str, str],
        what: str,
        t0: float,
        run: str,
        left: str,
        registered: list[Offer],
    ) -> None:
        """One resource's registration (its own thread, channel and deadline)."""
        try:
            self.bridge.register(o.resource, o.healthy)
        except Exception as e:  # grpc.RpcError, or the socket's directory
            self.recorder.decided("failed", f"registering {o.resource} failed", run=run)
            why, grpc_fields = rpcerror.describe(e)  # its status and details
            self.elog.event(
                "readmit-failed",
                f"registering {o.resource} failed: {why}",
                level="warning",
                fields={**fields, **grpc_fields},
            )
            return
        try:
            self.registered(o, d, fields, what, t0, run, left)
            registered.append(o)
        except Exception as e:  # never exit: the streams kubelet holds would end
            self.contained.loop_failed(f"after registering {o.resource}", e)

    def registered(
        self,
        o: Offer,
        d: Decision,
        fields: dict[str, str],
        what: str,
        t0: float,
        run: str,
        left: str,
    ) -> None:
        rec = self.recorder
        ms = (time.monotonic() - t0) * 1000
        rec.registered(o.resource, o.healthy, time.time(), run=run)
        self.elog.event(
            "readmit-offered",
            f"kubelet started: reported {what} healthy for their re-admission "
            f"({d.why}; {ms:.0f} ms after kubelet.sock appeared)"
            + (f"; left out: {left}" if left else ""),
            fields={**fields, "LATENCY_MS": f"{ms:.1f}"},
        )
        # A plugin's socket exists before kubelet handles its registration: none now
        # means the plugin registers after the bridge and replaces it. One now may
        # have registered first, and been replaced by the bridge (the race its
        # start-up waits to avoid): then new pods find only the held devices.
        raced = other_sockets(self.plugins_dir)
        if raced:
            rec.raced(raced)
            self.elog.event(
                "readmit-raced",
                f"a device plugin ({', '.join(raced)[:200]}) registered at the same "
                f"moment as the bridge's {o.resource}: if it registered first, kubelet "
                "now offers new pods only the held devices until the plugin registers "
                "again (restart it)",
                level="warning",
                fields={**fields, "PLUGINS": ",".join(raced)},
            )
