"""The readmit step: the GPU pods kubelet rejected at its start, named where a finding
would be (``gpuguard status``, the metrics, the NPD condition GPUPodsRejected, the
journal), the margin the re-admission bridge had on kubelet's first admission, and a
bridge that is off where kubelet needs it (exposure.py).

Report only: it reads what gpuguard-readmit.service wrote (readmit/state.py). The
bridge reads kubelet's journal for two minutes after each kubelet start; while it does,
this step looks every few seconds (a kubelet start wakes it), and while a rejected pod
is named, every 30 s (it clears when the pod runs again, is deleted, or its controller
replaced it and the replacement runs: readmit/fates.py).
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Optional

from gpuguard.devices.kubeletstart import KubeletStartWatch
from gpuguard.journal.conditions import Conditions, log_findings
from gpuguard.readmit.rejected import WATCH_SECONDS
from gpuguard.steps.readmit.exposure import cached_version, judge_exposure
from gpuguard.steps.readmit.observe import observe
from gpuguard.steps.readmit.reconcile import MARGIN, RECONCILER, judge

if TYPE_CHECKING:
    from gpuguard.engine.passes import PassContext, Services

WATCHING = 2.0  # seconds between looks while the bridge reads kubelet's journal
NAMED = 30.0  # while a rejected pod is named: is it running again, or gone?


class ReadmitStep:
    def __init__(self) -> None:
        self.conditions = Conditions()
        self.run = ""  # the kubelet start (kubelet.sock) `cleared` belongs to
        self.cleared: frozenset[str] = frozenset()
        self.watch: Optional[KubeletStartWatch] = None  # kubelet's start: its listener

    async def __call__(self, svc: Services, ctx: PassContext) -> None:
        path = svc.config.kubelet.checkpoint_path
        sock = svc.root.path(path).parent / "kubelet.sock"
        if self.watch is None or self.watch.path != sock:
            self.watch = KubeletStartWatch(svc.root, sock)
        view = await asyncio.to_thread(observe, svc.root, path, self.watch)
        s = view.state
        if s is not None and s.kubelet_sock != self.run:
            self.run, self.cleared = s.kubelet_sock, frozenset()
        j = judge(view, self.cleared)
        self.cleared = j.cleared
        absent = s is None and not view.unreadable
        cached = await asyncio.to_thread(cached_version, svc.root) if absent else ""
        off, unknown = judge_exposure(s, absent, cached)
        ctx.unknown += unknown
        ctx.gauges["readmit_rejected_pods"] = j.rejected
        for resource, seconds in j.margins:
            ctx.gauges[f"{MARGIN}{resource}"] = seconds
        if view.unreadable:
            ctx.unknown.append(view.unreadable)
        if j.blind:
            ctx.unknown.append(j.blind)
        log_findings(svc.log, self.conditions, RECONCILER, j.findings + off)
        ctx.findings += j.findings + off
        # the bridge's state (written at its start when on) says it reads kubelet's
        # journal after a kubelet start, which this pass may precede
        started = view.kubelet_sock or 0.0
        until = max(s.watch_until, started + WATCH_SECONDS + 5) if s is not None else 0.0
        if time.time() < until:
            ctx.recheck(WATCHING, "the re-admission bridge reads kubelet's journal")
        elif j.findings:
            ctx.recheck(NAMED, "a rejected GPU pod is named: running again, or gone?")
