"""Is kubelet running, and how can we get it stopped around a checkpoint repair?

Kubelet counts as running when systemd reports its unit active, or when a process
named `kubelet` exists under the root's /proc. With no systemd reachable and no such
process it is not running, and the checkpoint may be repaired directly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from gpuguard.devices.processes import kubelet_pids
from gpuguard.host.paths import Root

if TYPE_CHECKING:
    from gpuguard.host.systemd import Systemd, UnitState

DROPIN_NAME = "10-gpuguard.conf"


@dataclass(frozen=True)
class KubeletStatus:
    unit: str
    pids: tuple[int, ...]
    unit_state: Optional[UnitState]  # None: systemd not reachable
    systemd_error: str = ""

    @property
    def unit_active(self) -> bool:
        return self.unit_state is not None and self.unit_state.active

    @property
    def running(self) -> bool:
        return self.unit_active or bool(self.pids)

    @property
    def has_dropin(self) -> bool:
        return self.unit_state is not None and any(
            p.endswith(f"/{self.unit}.d/{DROPIN_NAME}") for p in self.unit_state.drop_in_paths
        )

    def describe(self) -> str:
        if self.unit_state is not None:
            s = f"{self.unit} is {self.unit_state.active_state}"
            if self.unit_state.load_state != "loaded":
                s += f" ({self.unit_state.load_state})"
        else:
            s = f"systemd not reachable ({self.systemd_error})"
        if self.pids:
            s += f"; kubelet process(es) {', '.join(map(str, self.pids))}"
        return s


async def kubelet_status(root: Root, systemd: Optional[Systemd], unit: str) -> KubeletStatus:
    pids = kubelet_pids(root)
    if systemd is None:
        return KubeletStatus(unit, pids, None, "not asked")
    from gpuguard.host.systemd import SystemdError

    try:
        state = await systemd.unit_state(unit)
    except SystemdError as e:
        return KubeletStatus(unit, pids, None, str(e))
    return KubeletStatus(unit, pids, state)
