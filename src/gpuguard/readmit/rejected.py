"""The GPU pods kubelet rejected at its start, named: kubelet 1.26+ logs each pod it
refuses to admit (``"Pod admission denied" podUID=... pod="NS/NAME"
reason="UnexpectedAdmissionError" message="Allocate failed due to ..."``); for two
minutes after each kubelet start the bridge reads kubelet's unit journal for them and
journals each GPU pod rejected by the device manager once (``readmit-rejected``, with
POD, POD_UID, REASON), whether or not it offered anything: with gpuguard off, in
observe mode, or when a GPU is gone for good, these are the pods lost.
"""

from __future__ import annotations

import re
import threading
import time
from dataclasses import dataclass
from typing import Callable

from gpuguard.errors import GpuguardError
from gpuguard.host import commands

DENIED = re.compile(
    r'"Pod admission denied" podUID="([^"]*)" pod="([^"]*)" reason="([^"]*)" '
    r'message="((?:[^"\\]|\\.)*)"'
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


class RejectionWatch:
    """Reads kubelet's journal after one kubelet start; a newer start supersedes it."""

    def __init__(self, unit: str, say: Callable[[Rejection], None]) -> None:
        self.unit = unit
        self.say = say
        self.generation = 0

    def start(self, since: float) -> None:
        self.generation += 1
        gen = self.generation
        threading.Thread(target=self._run, args=(gen, since), daemon=True).start()

    def _run(self, gen: int, since: float) -> None:
        seen: set[str] = set()
        deadline = time.monotonic() + WATCH_SECONDS
        while gen == self.generation and time.monotonic() < deadline:
            time.sleep(EVERY)
            argv = ["journalctl", "--no-pager", "-o", "cat", "-u", self.unit]
            argv += [f"--since=@{since:.0f}", "--grep=Pod admission denied"]
            try:
                res = commands.run(argv, timeout=10)
            except GpuguardError:
                continue
            for r in rejections(res.stdout):
                if r.pod_uid not in seen:
                    seen.add(r.pod_uid)
                    self.say(r)
