"""What a pass is made of, shared by the daemon, one-shot `gpuguard check` and the steps.

Kept free of D-Bus and asyncio imports: `gpuguard check` on a healthy node must start fast.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Awaitable, Callable, Optional, Protocol

from gpuguard.config import Config
from gpuguard.host.inventory import Inventory
from gpuguard.host.paths import Root
from gpuguard.journal.log import EventLog
from gpuguard.model import Finding, Outcome
from gpuguard.steps.events import EventKind

if TYPE_CHECKING:
    from gpuguard.engine.executor import ChangeExecutor
    from gpuguard.engine.snapshot import HostSnapshot
    from gpuguard.host.systemd import Systemd

STATUS_FILE = "/run/gpuguard/status.json"

__all__ = ["STATUS_FILE", "FollowUp", "PassContext", "Services", "Work"]


@dataclass(frozen=True)
class Work:
    """What one pass serves: the reconcilers marked, why, and when the marks came."""

    reconcilers: frozenset[str]
    reasons: tuple[str, ...]
    first_mark: float  # monotonic time of the first mark this pass serves
    last_mark: float
    # An urgent mark among them (a reload's end, start-up, a reconnection): losses are
    # likely, and the steps repair what they already know before looking further.
    urgent: bool = False


@dataclass(frozen=True)
class FollowUp:
    """A pass a step wants later (`delay` seconds after this one): for itself (`step`,
    e.g. when a grace period ends, which nothing else announces) or for the steps an
    event of its own wakes (`event`, e.g. the /dev/char links it made); the runner
    resolves it to step names through the registry."""

    delay: float
    why: str
    step: str = ""
    event: Optional[EventKind] = None


@dataclass
class PassContext:
    """One pass: why it runs, the GPUs, and what the steps found and did.

    The inventory is loaded on first use: NVML can take a second to initialise, and
    the container access repair after a daemon-reload must not wait for it (it uses
    `previous_inventory`, the last pass's, when it needs GPU identities at all).
    """

    work: Work
    load_inventory: Callable[[], Awaitable[Optional[Inventory]]]
    previous_inventory: Optional[Inventory] = None
    # Why NVML is missing on a node that awaits its driver from a container (the
    # inventory reader's word after this pass's read); "" when it is not awaited.
    driver_wait: Callable[[], str] = lambda: ""
    # What every step of this pass decides from (see snapshot.py); made on first use.
    snapshot: Optional[HostSnapshot] = None
    findings: list[Finding] = field(default_factory=list)
    outcomes: list[Outcome] = field(default_factory=list)
    # passes the steps want later (recheck, announce); the runner resolves them
    followups: list[FollowUp] = field(default_factory=list)
    step: str = ""  # the step running now (the runner sets it)
    # Figures a step measured (gpu_containers, gpus_pci, ...): the status file and metrics.
    gauges: dict[str, float] = field(default_factory=dict)
    # What a step could not see (a layer it could not read, no GPU inventory): its
    # verdict is "unknown" there, never "ok" (status file, npd, metrics).
    unknown: list[str] = field(default_factory=list)
    _inventory: Optional[Inventory] = None
    _loaded: bool = False

    def host(self, svc: Services) -> HostSnapshot:
        """The pass's host snapshot, shared by its steps."""
        if self.snapshot is None:
            from gpuguard.engine.snapshot import HostSnapshot

            self.snapshot = HostSnapshot(svc.root, svc.config.kubelet.checkpoint_path)
        return self.snapshot

    def recheck(self, after: float, why: str) -> None:
        """This step again, `after` seconds from now."""
        self.followups.append(FollowUp(max(0.0, after), why, step=self.step))

    def announce(self, kind: EventKind, why: str) -> None:
        """Something this step did is an event for other steps (the registry says which):
        a pass for them right after this one."""
        self.followups.append(FollowUp(0.0, why, event=kind))

    async def inventory(self) -> Optional[Inventory]:
        if not self._loaded:
            self._inventory = await self.load_inventory()
            self._loaded = True
        return self._inventory

    @property
    def known_inventory(self) -> Optional[Inventory]:
        return self._inventory if self._loaded else self.previous_inventory

    async def device_inventory(self) -> Optional[Inventory]:
        """The inventory for device work: a systemd event (reload, a unit start) does
        not change the GPUs, so the last one serves and NVML is not waited for."""
        systemd_only = all(r.startswith("systemd:") for r in self.work.reasons)
        if systemd_only and self.previous_inventory is not None:
            return self.known_inventory
        return await self.inventory()


class Services(Protocol):
    """What a step may use: the daemon's shared objects, read at call time."""

    root: Root
    config: Config
    log: EventLog
    apply: ChangeExecutor  # makes or, under dry-run, describes every change
    bus_address: str

    @property
    def systemd(self) -> Optional[Systemd]: ...
