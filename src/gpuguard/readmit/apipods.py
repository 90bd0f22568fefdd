"""The API server's pods bound to this node, read by the bridge ahead of kubelet's start.

A kubelet start must cost the bridge a stat and a registration (kubelet re-admits
static pods 40-80 ms after its start), so the API server is never asked then: a
thread of its own reads it (host/kubeapi.py, 2 s per call at most) every INTERVAL
seconds while the loop wants it (readmit/__init__.py asks while a checkpointed GPU pod
has no process, i.e. before kubelet's start after a reboot; a running node asks
nothing), and the decision uses the latest answer not older than STALE. The first
read starts as soon as it is wanted; until it answers, the view is UNREAD.

``[Kubelet] Kubeconfig=`` empty, or naming no file: a kubelet without an API server
(STANDALONE, every pod static). The node's name is looked up once per kubeconfig
(host/kubeapi.node_name).
"""

from __future__ import annotations

import errno
import threading
import time
from typing import Callable, Optional

from gpuguard.config.schema import Config
from gpuguard.errors import GpuguardError
from gpuguard.host.echo import cut
from gpuguard.host.kubeapi import IDENTITY, Client, KubeApiError, load_kubeconfig, node_name
from gpuguard.host.paths import Root
from gpuguard.readmit.plan import READ, STANDALONE, UNREAD, ApiView

INTERVAL = 5.0  # seconds between reads while wanted
STALE = 15.0  # seconds: an older answer is not used (UNREAD, with the latest failure)
WANTED = 12.0  # seconds a want() lasts


class NodePods:
    """Reads through ``read_once`` (a view per call), in a thread, while wanted."""

    def __init__(self, read_once: Callable[[], ApiView]) -> None:
        self.read_once = read_once
        self.lock = threading.Lock()
        self.good: Optional[ApiView] = None  # the latest READ or STANDALONE answer
        self.failed: Optional[ApiView] = None  # the latest UNREAD, newer than good
        self.wanted_until = 0.0
        self.wake = threading.Event()
        self.stopping = False
        self.thread: Optional[threading.Thread] = None

    def want(self) -> None:
        """Read now (if not read within INTERVAL) and for the next WANTED seconds."""
        first = self.wanted_until < time.monotonic()
        self.wanted_until = time.monotonic() + WANTED
        if self.thread is None:
            self.thread = threading.Thread(target=self._run, name="api-pods", daemon=True)
            self.thread.start()
        elif first:
            self.wake.set()

    def view(self) -> ApiView:
        """The answer to decide with: the latest good one if fresh, else UNREAD."""
        now = time.monotonic()
        with self.lock:
            good, failed = self.good, self.failed
        if good is not None and now - good.at <= STALE:
            return good
        if failed is not None:
            return failed
        why = "no answer yet" if good is None else f"the last answer is {now - good.at:.0f} s old"
        return ApiView(UNREAD, detail=why, at=-1.0)

    def _run(self) -> None:
        while not self.stopping:
            if time.monotonic() < self.wanted_until:
                try:
                    v = self.read_once()
                except Exception as e:  # a bug: said, and decided as without an answer
                    v = ApiView(
                        UNREAD, detail=cut(f"reading failed: {e!r}", 300), at=time.monotonic()
                    )
                with self.lock:
                    if v.source == UNREAD:
                        self.failed = v
                    else:
                        self.good, self.failed = v, None
            self.wake.wait(INTERVAL)
            self.wake.clear()

    def stop(self) -> None:
        self.stopping = True
        self.wake.set()


class Reader:
    """One read of the API server as ``[Kubelet]`` says (the node's name kept)."""

    def __init__(self, root: Root, config: Callable[[], Config]) -> None:
        self.root = root
        self.config = config
        self.node: Optional[tuple[str, str, str]] = None  # (kubeconfig, name, how)

    def __call__(self) -> ApiView:
        at = time.monotonic()
        kc = self.config().kubelet
        if kc.kubeconfig is None:
            return ApiView(STANDALONE, detail="[Kubelet] Kubeconfig= is empty", at=at)
        try:
            cfg = load_kubeconfig(self.root.path(kc.kubeconfig), kc.kubeconfig)
        except GpuguardError as e:
            if getattr(e, "errno", 0) == errno.ENOENT:
                why = f"no {kc.kubeconfig}: a kubelet without an API server"
                return ApiView(STANDALONE, detail=why, at=at)
            return ApiView(UNREAD, detail=cut(e.message, 300), at=at)
        try:
            client = Client(cfg, root=self.root)
            known = self.node if self.node is not None and self.node[0] == kc.kubeconfig else None
            if known is None:
                name, how = node_name(client, kc.node_name)
                # a name not from the identity must be a Node: a wrong one lists no pod,
                # and every pod would be taken as deleted
                if how != IDENTITY and not client.node_exists(name):
                    why = f"no Node {name!r} in the API server (its name from {how})"
                    return ApiView(
                        UNREAD, detail=cut(f"{why}: set [Kubelet] NodeName=", 300), at=at
                    )
                known = (kc.kubeconfig, name, how)
            pods = client.node_pods(known[1])
        except (KubeApiError, GpuguardError, OSError, ValueError) as e:  # ssl.SSLError: OSError
            return ApiView(UNREAD, detail=cut(f"{cfg.server}: {e}", 300), at=at)
        self.node = known  # kept once an answer came with it
        how = f"{len(pods)} pods bound to node {known[1]} ({known[2]}) on {cfg.server}"
        return ApiView(READ, pods, known[1], cut(how, 300), at)


def reader(root: Root, config: Callable[[], Config]) -> NodePods:
    return NodePods(Reader(root, config))
