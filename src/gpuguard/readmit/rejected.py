"""The GPU pods kubelet rejected at its start, named: kubelet 1.26+ logs each pod it
refuses to admit (``"Pod admission denied" podUID=... pod="NS/NAME"
reason="UnexpectedAdmissionError" message="Allocate failed due to ..."``); for two
minutes after each kubelet start the bridge reads kubelet's unit journal for them and
journals each GPU pod rejected by the device manager once (``readmit-rejected``, with
POD, POD_UID, REASON), whether or not it offered anything: with gpuguard off, in
observe mode, or when a GPU is gone for good, these are the pods lost. It also finds
kubelet's first admission (its first ``"SyncLoop ADD"``), for the margin between the
bridge's devices healthy and that moment (readmit/state.py).
"""

from __future__ import annotations

import re
import threading
import time
from dataclasses import dataclass
from typing import Callable, Optional

from gpuguard.errors import GpuguardError
from gpuguard.host import commands

DENIED = re.compile(
    r'"Pod admission denied" podUID="([^"]*)" pod="([^"]*)" reason="([^"]*)" '
    r'message="((?:[^"\\]|\\.)*)"'
)
# short-unix output: "1764342378.123456 host kubelet[12]: I1128 15:06:18.123456 ..."
ADD_LINE = re.compile(
    r"^(\d+\.\d+) \S+ [^:]*: [IWE]\d{4} (\d\d):(\d\d):(\d\d\.\d+) .*SyncLoop ADD", re.M
)
WATCH_SECONDS = 120.0
EVERY = 2.0


@dataclass(frozen=True)
class Rejection:
    pod_uid: str
    pod: str  # namespace/name
    reason: str
    message: str


def rejections(log: str) -> list[Rejection]:
    """The device manager's rejections in kubelet's log text (pure): reason
    UnexpectedAdmissionError with an ``Allocate failed`` message."""
    out = []
    for uid, pod, reason, message in DENIED.findall(log):
        if reason == "UnexpectedAdmissionError" and "Allocate failed" in message:
            out.append(Rejection(uid, pod, reason, message.replace('\\"', '"')[:300]))
    return out


def klog_unix(received: float, hours: int, minutes: int, seconds: float) -> float:
    """The Unix time of a klog line's clock time (kubelet's local time, no date), from
    when journald received it (UTC, a little later): the time zone is a whole number
    of quarter hours, the delay far less than 7 minutes."""
    day = received - received % 86400
    t = day + (hours * 60 + minutes) * 60 + seconds
    return t - round((t - received) / 900) * 900


def first_admission(log: str) -> Optional[float]:
    """kubelet's first admission in short-unix journal text: its first SyncLoop ADD."""
    m = ADD_LINE.search(log)
    if m is None:
        return None
    return klog_unix(float(m[1]), int(m[2]), int(m[3]), float(m[4]))


class RejectionWatch:
    """Reads kubelet's journal after one kubelet start; a newer start supersedes it.
    ``admitted`` gets kubelet's first admission (Unix time) once found."""

    def __init__(
        self,
        unit: str,
        say: Callable[[Rejection], None],
        admitted: Callable[[float], None] = lambda _at: None,
    ) -> None:
        self.unit = unit
        self.say = say
        self.admitted = admitted
        self.generation = 0

    def start(self, since: float) -> None:
        self.generation += 1
        gen = self.generation
        threading.Thread(target=self._run, args=(gen, since), daemon=True).start()

    def _run(self, gen: int, since: float) -> None:
        seen: set[str] = set()
        admitted = False
        deadline = time.monotonic() + WATCH_SECONDS
        while gen == self.generation and time.monotonic() < deadline:
            time.sleep(EVERY)
            argv = ["journalctl", "--no-pager", "-o", "short-unix", "-u", self.unit]
            argv += [f"--since=@{since:.0f}"]
            grep = "Pod admission denied" if admitted else "Pod admission denied|SyncLoop ADD"
            try:
                res = commands.run([*argv, f"--grep={grep}"], timeout=10)
            except GpuguardError:
                continue
            if gen != self.generation:
                return
            if not admitted:
                at = first_admission(res.stdout)
                if at is not None and at >= since:
                    admitted = True
                    self.admitted(at)
            for r in rejections(res.stdout):
                if r.pod_uid not in seen:
                    seen.add(r.pod_uid)
                    self.say(r)
