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

Modules (docs/architecture.md has the map of the packages):

- the re-admission bridge for kubelet 1.26+ (`gpuguard readmit`,
  gpuguard-readmit.service; docs/checkpoint.md): the loop, one decision per kubelet
  start, made ahead (`__init__.py`); what it offers: the checkpoint's held device IDs
  present on the node, only while a GPU pod has no process (`plan.py`, pure); the
  kubelet version from its unit's executable, cached by the file's identity, the pods
  with processes, the plugin sockets (`observe.py`); its gRPC endpoints and registration
  with grpcio (`serve.py`) and the four messages encoded by hand (`wire.py`); inotify on
  kubelet's device-plugins directory (`watch.py`). It imports no step
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Union

from gpuguard.checkpoint.reader import load as load_checkpoint
from gpuguard.config.schema import Config
from gpuguard.errors import GpuguardError
from gpuguard.host.offswitch import read_off_switch
from gpuguard.host.paths import GPU_HISTORY_FILE, Root
from gpuguard.journal.log import EventLog
from gpuguard.readmit import rpcerror
from gpuguard.readmit.observe import alive_pods, other_sockets
from gpuguard.readmit.plan import Decision, decide
from gpuguard.readmit.presence import DRIVER_NOT_LOADED, THIS_BOOT, NodeDevices
from gpuguard.readmit.refusals import refused_field
from gpuguard.readmit.rejected import WATCH_SECONDS, RejectionWatch
from gpuguard.readmit.serve import Bridge, endpoint
from gpuguard.readmit.state import Recorder
from gpuguard.readmit.watch import DirWatch

POLL = 1.0  # seconds at most between looks for a new kubelet.sock (inotify wakes it)
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
        # the decision made ahead, for the checkpoint as it was then (its identity)
        self.ahead: Optional[tuple[tuple[int, int, int], float, Decision]] = None

    def checkpoint_key(self) -> tuple[int, int, int]:
        try:
            st = os.stat(self.root.path(self.inputs.cfg.kubelet.checkpoint_path))
        except OSError:
            return (0, 0, 0)
        return st.st_ino, st.st_mtime_ns, st.st_size

    def history_key(self) -> tuple[int, int, int]:
        """The GPU identity history's identity (inode, mtime, size); zeros when absent."""
        try:
            st = os.stat(self.root.path(GPU_HISTORY_FILE))
        except OSError:
            return (0, 0, 0)
        return st.st_ino, st.st_mtime_ns, st.st_size

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
        key = self.history_key()
        if key != self.inputs_history:
            self.inputs = self.read_inputs()
            self.inputs_history = key
            self.ahead = None

    def prepare(self) -> None:
        """Decide ahead of kubelet's start, so that its start costs a stat and the
        registration: again whenever the checkpoint changed (gpuguard's pre-start hook
        writes it just before kubelet starts) and every AHEAD seconds (pods that died)."""
        self.refresh_pci_view()
        key = self.checkpoint_key()
        now = time.monotonic()
        if self.ahead is None or self.ahead[0] != key or now - self.ahead[1] > AHEAD:
            self.ahead = (key, now, self.decision())
            for o in self.ahead[2].offers:  # its endpoint listening before kubelet starts
                self.bridge.serve(o.resource)

    def decided(self) -> Decision:
        """The decision made ahead when the checkpoint is still the same, else now."""
        self.refresh_pci_view()
        if self.ahead is not None and self.ahead[0] == self.checkpoint_key():
            return self.ahead[2]
        return self.decision()

    def kubelet_sock(self) -> Optional[tuple[int, int]]:
        """kubelet.sock's identity: its inode and change time (a kubelet start removes
        the old socket and makes a new one, which may get the same inode number)."""
        try:
            st = os.stat(self.plugins_dir / "kubelet.sock")
        except OSError:
            return None
        return st.st_ino, st.st_ctime_ns

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
                self.inputs_history = self.history_key()
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
        started = sock[1] / 1e9 if sock is not None else time.time()
        rec = self.recorder
        rec.kubelet_started(
            f"{sock[0]}:{sock[1]}" if sock else "", started, time.time() + WATCH_SECONDS + 5
        )
        if self.rejected is not None:  # the pods kubelet rejects now, named (any mode)
            self.rejected.start(self.inputs.cfg)  # this kubelet's own records
        off = read_off_switch(self.root)
        if off is not None:
            self.elog.event("readmit-skip", f"gpuguard is off ({off.describe()}): no offer")
            rec.decided("off", f"gpuguard is off ({off.describe()})")
            return
        d = self.decided()
        judged = {"EVIDENCE": d.evidence, "REFUSED": refused_field(d.refused)}
        if not d.offers:
            self.elog.event("readmit-skip", f"kubelet started: no offer: {d.why}", fields=judged)
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
                **judged,
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
                why, grpc_fields = rpcerror.describe(e)  # its status and details
                self.elog.event(
                    "readmit-failed",
                    f"registering {o.resource} failed: {why}",
                    level="warning",
                    fields={**fields, **grpc_fields},
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
