"""The readmit step's word on a node whose re-admission bridge is off (pure, but for
``cached_version``): on a kubelet 1.26+ node (or one whose kubelet's version could not
be told) without the bridge, kubelet rejects at its next start every GPU pod whose
container is not running (after a reboot: every GPU pod). Never OK:

- the bridge's state says "off" for such a cause (readmit/offstate.py): a finding,
  ``readmit-bridge-off`` (a warning), with the fix: ``gpuguard status``, the metrics
  (gpuguard_open_findings), the NPD condition GPUPodsRejected;
- no state at all this boot while the kubelet version the bridge once cached says it
  needs one (the unit disabled, masked, or failing before it could write): unknown.
"""

from __future__ import annotations

from typing import Optional

from gpuguard.host.paths import Root
from gpuguard.host.statefile import load
from gpuguard.model import Finding
from gpuguard.readmit.offstate import exposure, needs_bridge
from gpuguard.readmit.state import STATE_FILE, ReadmitState
from gpuguard.steps.readmit.reconcile import RECONCILER

K_BRIDGE_OFF = "readmit-bridge-off"


def cached_version(root: Root) -> str:
    """kubelet's version as the bridge last cached it ("" when none)."""
    from gpuguard.readmit.observe import CACHE, CACHE_FILE

    got = load(root.path(CACHE_FILE), CACHE).value
    return got.version if got is not None else ""


def judge_exposure(
    state: Optional[ReadmitState], state_absent: bool, cached: str
) -> tuple[tuple[Finding, ...], tuple[str, ...]]:
    """(findings, unknowns) for the bridge's ``state``; ``cached``: kubelet's version
    as cached, read only when the state is absent."""
    e = exposure(state)
    if e is not None:
        on = "kubelet 1.26+" if e.certain else "a kubelet whose version is unknown"
        return (
            Finding(
                K_BRIDGE_OFF,
                RECONCILER,
                f"the re-admission bridge is off on {on}: GPU pods whose container is not "
                f"running are rejected at kubelet's next start ({e.detail}); {e.fix}",
                {"CAUSE": e.cause, "DETAIL": e.detail, "FIX": e.fix},
                "warning",
            ),
        ), ()
    if state_absent and needs_bridge(cached):
        return (), (
            f"gpuguard-readmit.service wrote no state this boot ({STATE_FILE}) and kubelet "
            f"{cached} needs it: GPU pods may be rejected at kubelet's next start; "
            "systemctl enable --now gpuguard-readmit.service",
        )
    return (), ()
