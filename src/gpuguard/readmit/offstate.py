"""When the re-admission bridge stays off, and whether the node is exposed for it.

The bridge writes its state file (readmit/state.py) with decision "off" and one of
these causes even when it exits at once, so that the daemon (``gpuguard status``, the
metrics, the NPD condition) and ``gpuguard doctor`` can say what a node lacks: on a
kubelet 1.26+ node without the bridge, kubelet rejects every GPU pod whose container
is not running at its next start (after a reboot: every GPU pod). Pure, but for
``record_off``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from gpuguard.readmit.state import ReadmitState

SWITCH = "switch"  # gpuguard's off switch: everything is off, said elsewhere
OLD_KUBELET = "old-kubelet"  # before 1.26: kubelet re-admits without a plugin
ENV_OFF = "env-off"  # GPUGUARD_READMIT=off
UNKNOWN_VERSION = "unknown-version"  # kubelet's version could not be told
NO_GRPCIO = "no-grpcio"  # python3-grpcio is not installed
# no unit of [Systemd] KubeletUnits= is loaded and no kubelet was ever told here: no pod
# to re-admit (a kubelet in another unit is the daemon's kubelet-process-untrusted)
NO_KUBELET = "no-kubelet"
CAUSES = (SWITCH, OLD_KUBELET, ENV_OFF, UNKNOWN_VERSION, NO_GRPCIO, NO_KUBELET)

_ENV_FIX = (
    "remove GPUGUARD_READMIT=off from gpuguard-readmit.service's environment "
    "(systemctl edit gpuguard-readmit.service), then systemctl restart gpuguard-readmit"
)
FIXES = {
    NO_GRPCIO: "install python3-grpcio, then systemctl restart gpuguard-readmit",
    ENV_OFF: _ENV_FIX,
    UNKNOWN_VERSION: (
        "name kubelet's unit in [Systemd] KubeletUnits=, or set GPUGUARD_READMIT=on in "
        "gpuguard-readmit.service's environment for a kubelet 1.26 or later, then "
        "systemctl restart gpuguard-readmit"
    ),
}


@dataclass(frozen=True)
class Exposure:
    """A node whose kubelet needs the bridge (or may) while the bridge is off."""

    cause: str
    detail: str  # one line: the bridge's own reason
    fix: str
    certain: bool  # kubelet is known to be 1.26+ (False: its version is unknown)


def needs_bridge(version: str) -> Optional[bool]:
    parts = version.split(".")
    if len(parts) != 2 or not all(p.isdigit() for p in parts):
        return None
    return (int(parts[0]), int(parts[1])) >= (1, 26)


def exposure(state: Optional[ReadmitState]) -> Optional[Exposure]:
    """The exposure the bridge's state says (None: on, or off for a good reason)."""
    if state is None or state.decision != "off":
        return None
    cause = state.off_cause
    needed = needs_bridge(state.kubelet_version)
    if cause in ("", SWITCH, OLD_KUBELET, NO_KUBELET) or needed is False:
        return None
    fix = FIXES.get(cause, "systemctl restart gpuguard-readmit")
    return Exposure(cause, state.detail, fix, certain=needed is True)


def record_off(
    write: Callable[[ReadmitState], None], cause: str, detail: str, kubelet_version: str
) -> None:
    """The state file of a bridge that stays off (``write``: the bridge's writer)."""
    write(
        ReadmitState(
            "", 0.0, "off", detail[:400], off_cause=cause, kubelet_version=kubelet_version[:32]
        )
    )
