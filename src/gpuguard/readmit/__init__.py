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
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from gpuguard.checkpoint.reader import load as load_checkpoint
from gpuguard.config.schema import Config
from gpuguard.devices.kubeletstart import KubeletStart, KubeletStartWatch
from gpuguard.errors import GpuguardError
from gpuguard.host.offswitch import read_off_switch
from gpuguard.host.paths import Root
from gpuguard.journal.log import EventLog
from gpuguard.readmit.observe import alive_pods, other_sockets
from gpuguard.readmit.plan import Decision, decide
from gpuguard.readmit.rejected import WATCH_SECONDS, RejectionWatch
from gpuguard.readmit.serve import Bridge, endpoint
from gpuguard.readmit.state import Recorder
from gpuguard.readmit.watch import DirWatch

POLL = 1.0  # seconds at most between looks for a new kubelet.sock (inotify wakes it)
REFRESH = 60.0  # configuration and inventory read again this often while idle
AHEAD = 5.0  # the decision made ahead is made again this often (pods that died)


@dataclass(frozen=True)
class Inputs:
    """What is read before kubelet starts, so that a kubelet start costs only the
    checkpoint's read: the configuration and the device IDs the node has."""

    cfg: Config
    present: frozenset[str]
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
    ) -> None:
        self.root = root
        self.elog = elog
        self.read_inputs = read_inputs
        self.inputs = read_inputs()
        self.bridge = bridge
        self.rejected = rejected
        # what the daemon reads (readmit/state.py); a stand-in that writes nothing
        self.recorder = recorder if recorder is not None else Recorder(lambda _s: None)
        self.plugins_dir = root.path(Path(self.inputs.cfg.kubelet.checkpoint_path).parent)
        # the decision made ahead, for the checkpoint as it was then (its identity)
        self.ahead: Optional[tuple[tuple[int, int, int], float, Decision]] = None
        self.kstart: Optional[KubeletStartWatch] = None  # kubelet.sock's listener

    def checkpoint_key(self) -> tuple[int, int, int]:
        try:
            st = os.stat(self.root.path(self.inputs.cfg.kubelet.checkpoint_path))
        except OSError:
            return (0, 0, 0)
        return st.st_ino, st.st_mtime_ns, st.st_size

    def prepare(self) -> None:
        """Decide ahead of kubelet's start, so that its start costs a stat and the
        registration: again whenever the checkpoint changed (gpuguard's pre-start hook
        writes it just before kubelet starts) and every AHEAD seconds (pods that died)."""
        key = self.checkpoint_key()
        now = time.monotonic()
        if self.ahead is None or self.ahead[0] != key or now - self.ahead[1] > AHEAD:
            self.ahead = (key, now, self.decision())
            for o in self.ahead[2].offers:  # its endpoint listening before kubelet starts
                self.bridge.serve(o.resource)

    def decided(self) -> Decision:
        """The decision made ahead when the checkpoint is still the same, else now."""
        if self.ahead is not None and self.ahead[0] == self.checkpoint_key():
            return self.ahead[2]
        return self.decision()

    def kubelet_sock(self) -> Optional[KubeletStart]:
        """kubelet's current run, told by kubelet.sock's listener, else its inode
        (devices/kubeletstart.py): a touch, chown or xattr change is no start. A stat
        per call; the socket is connected to only when its stat changed."""
        if self.kstart is None:
            self.kstart = KubeletStartWatch(self.root, self.plugins_dir / "kubelet.sock")
        return self.kstart.look()

    def run(self, stop: Callable[[], bool]) -> None:
        """Until ``stop()``: a kubelet.sock already there at the start is a kubelet
        that has re-admitted its pods already, never registered with."""
        seen = self.kubelet_sock()
        refreshed = time.monotonic()
        watch = DirWatch(self.plugins_dir)
        while not stop():
            watch.wait(POLL)
            sock = self.kubelet_sock()
            if sock is None or sock == seen:
                try:
                    self.prepare()
                except Exception as e:  # decided again at kubelet's start
                    self.ahead = None
                    self.elog.event("debug", f"deciding ahead failed: {e!r}"[:300], level="debug")
                sock = self.kubelet_sock()  # kubelet may have started meanwhile
            if sock is not None and sock != seen:
                seen = sock
                try:
                    self.on_kubelet_start()
                except Exception as e:  # never exit: the streams kubelet holds would end
                    self.elog.event("error", f"kubelet start not handled: {e!r}"[:300])
                refreshed = 0.0
            if time.monotonic() - refreshed > REFRESH:
                self.inputs = self.read_inputs()
                refreshed = time.monotonic()
        watch.close()

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
        return decide(entries, cfg.kubelet.resources, self.inputs.present, alive)

    def on_kubelet_start(self) -> None:
        t0 = time.monotonic()
        sock = self.kubelet_sock()
        started = sock.wall() if sock is not None else time.time()
        rec = self.recorder
        rec.kubelet_started(sock.key if sock else "", started, time.time() + WATCH_SECONDS + 5)
        if sock is not None and sock.listener is None and not sock.transient:
            self.elog.warning(f"kubelet's start told by {sock.told_by()}"[:300])
        if self.rejected is not None:  # the pods kubelet rejects now, named (any mode)
            self.rejected.start(time.time() - 5)
        off = read_off_switch(self.root)
        if off is not None:
            self.elog.event("readmit-skip", f"gpuguard is off ({off.describe()}): no offer")
            rec.decided("off", f"gpuguard is off ({off.describe()})")
            return
        d = self.decided()
        if not d.offers:
            self.elog.event("readmit-skip", f"kubelet started: no offer: {d.why}")
            rec.decided("skip", d.why)
            return
        plugins = other_sockets(self.plugins_dir)
        if plugins:
            why = f"a device plugin serves already ({', '.join(plugins)[:200]})"
            self.elog.event("readmit-skip", f"kubelet started: no offer: {why}")
            rec.decided("skip", why)
            return
        rec.decided("observe" if self.inputs.cfg.daemon.observe else "offered", d.why)
        for o in d.offers:
            fields = {
                "RESOURCE": o.resource,
                "DEVICES": ",".join(o.healthy),
                "ABSENT": ",".join(o.absent),
                "PODS": ",".join(o.pods),
                "ENDPOINT": endpoint(o.resource),
            }
            what = f"{len(o.healthy)} {o.resource} devices held by {len(o.pods)} pods"
            if self.inputs.cfg.daemon.observe:
                self.elog.event(
                    "readmit-observe", f"observe-only: would report {what} healthy", fields=fields
                )
                continue
            try:
                self.bridge.register(o.resource, o.healthy)
            except Exception as e:  # grpc.RpcError, or the socket's directory
                rec.decided("failed", f"registering {o.resource} failed")
                self.elog.event(
                    "readmit-failed",
                    f"registering {o.resource} failed: {str(e).splitlines()[0][:200]}",
                    level="warning",
                    fields=fields,
                )
                continue
            ms = (time.monotonic() - t0) * 1000
            rec.registered(o.resource, o.healthy, time.time())
            self.elog.event(
                "readmit-offered",
                f"kubelet started: reported {what} healthy for their re-admission "
                f"({d.why}; {ms:.0f} ms after kubelet.sock appeared)",
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
