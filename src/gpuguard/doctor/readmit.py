"""The doctor's readmit-bridge check: is gpuguard-readmit.service there for a kubelet
that needs it (1.26+ rejects, at its start, every GPU pod whose container is not
running before a device plugin registers: after a reboot, every GPU pod)?

Read from what the bridge writes whether it runs or stays off (readmit/state.py, its
cause readmit/offstate.py) and the kubelet version it cached; judged here (pure).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from gpuguard.doctor.model import EXPOSED, OK, UNKNOWN, Check
from gpuguard.host.paths import Root
from gpuguard.host.statefile import load
from gpuguard.readmit.offstate import OLD_KUBELET, SWITCH, exposure, needs_bridge
from gpuguard.readmit.state import SPEC, STATE_FILE, ReadmitState

NAME = "readmit-bridge"
START = "systemctl enable --now gpuguard-readmit.service"


@dataclass(frozen=True)
class BridgeFacts:
    state: Optional[ReadmitState]
    problem: str  # why the state file could not be used ("" when read or absent)
    cached_kubelet: str  # the kubelet version the bridge cached ("" when none)


def read_bridge(root: Root) -> BridgeFacts:
    from gpuguard.readmit.observe import CACHE, CACHE_FILE

    got = load(root.path(STATE_FILE), SPEC)
    cached = load(root.path(CACHE_FILE), CACHE).value
    return BridgeFacts(
        got.value, "" if got.absent else got.why, cached.version if cached is not None else ""
    )


def check_bridge(b: Optional[BridgeFacts]) -> Check:
    if b is None:
        return Check(NAME, UNKNOWN, "the re-admission bridge's state was not read")
    if b.problem:
        return Check(NAME, UNKNOWN, f"{STATE_FILE}: {b.problem}", START)
    s = b.state
    e = exposure(s)
    if e is not None:
        on = "kubelet 1.26+" if e.certain else "a kubelet whose version is unknown"
        return Check(
            NAME,
            EXPOSED,
            f"off on {on} ({e.detail}): kubelet rejects GPU pods at its next start",
            e.fix,
        )
    if s is not None and s.decision == "off":
        if s.off_cause == OLD_KUBELET or needs_bridge(s.kubelet_version) is False:
            return Check(NAME, OK, f"off: {s.detail} (kubelet {s.kubelet_version} needs none)")
        if s.off_cause == SWITCH:
            return Check(NAME, EXPOSED, f"off: {s.detail}", "gpuguard enable")
        return Check(NAME, UNKNOWN, f"off: {s.detail}", START)
    if s is not None:
        return Check(NAME, OK, f"on: {s.decision} ({s.detail})")
    needed = needs_bridge(b.cached_kubelet)
    if needed:
        return Check(
            NAME,
            EXPOSED,
            f"kubelet {b.cached_kubelet} needs it and gpuguard-readmit.service wrote no "
            f"state this boot ({STATE_FILE})",
            START,
        )
    if needed is False:
        return Check(NAME, OK, f"kubelet {b.cached_kubelet} re-admits without a device plugin")
    return Check(
        NAME,
        UNKNOWN,
        f"gpuguard-readmit.service wrote no state this boot ({STATE_FILE}) and kubelet's "
        "version was never told",
        START,
    )
