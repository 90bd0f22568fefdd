"""When the re-admission bridge's streams ended in this kubelet run (readmit/ended.py).

kubelet keeps the stream of every endpoint the bridge registered; when the bridge's
process ends while that kubelet runs, kubelet drops the plugin that replaced it. The
time comes from the bridge's state file: written by the bridge at its SIGTERM, or by
its next process at its start after a SIGKILL or a crash. Until that process has
written it, the registering process named in the file (pid and start time) being gone
says the same: the step then takes the first pass that saw it gone as the time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from gpuguard.devices.processes import process_start
from gpuguard.host.paths import Root

# kubelet marks the dropped plugin's devices unhealthy within milliseconds of the
# stream's end; the step looks again this long after it (a pass woken by the unit's
# end may come first)
SETTLE = 2.0


@dataclass(frozen=True)
class BridgeEnd:
    registered_at: float  # this kubelet run's registration by the bridge
    ended: Optional[float]  # when its streams ended, as the bridge wrote it
    gone: bool  # the process that registered is gone


def read_bridge_end(root: Root, kubelet_started: Optional[float]) -> Optional[BridgeEnd]:
    """None unless the bridge registered in the kubelet run that started at
    ``kubelet_started`` and its streams have ended (or its process is gone)."""
    from gpuguard.host.statefile import load
    from gpuguard.readmit.state import SPEC, STATE_FILE

    s = load(root.path(STATE_FILE), SPEC).value
    at = s.registered_at if s is not None else None
    if s is None or at is None or kubelet_started is None or at < kubelet_started:
        return None
    if s.streams_ended is not None:
        return BridgeEnd(at, s.streams_ended, True)
    if s.pid <= 0 or not s.pid_start:
        return None  # a bridge that did not name itself: only its own word counts
    start = process_start(root, s.pid)
    if start is not None and abs(start - s.pid_start) < 0.5:  # the very process
        return None
    return BridgeEnd(at, None, True)


class BridgeEndClock:
    """When the bridge's streams of this kubelet run ended: the time the bridge wrote,
    else the first pass that found the registering process gone (kept across passes)."""

    def __init__(self) -> None:
        # (the bridge's registration time, the first pass that found its process gone)
        self.gone: Optional[tuple[float, float]] = None

    def ended(self, root: Root, started: Optional[float], now: float) -> Optional[float]:
        end = read_bridge_end(root, started)
        if end is None:
            return None
        if end.ended is not None:
            return end.ended
        if self.gone is None or self.gone[0] != end.registered_at:
            self.gone = (end.registered_at, now)
        return self.gone[1]
