"""A container's device cgroup, as the container access step uses it: one interface.

The kernel judges a container's device opens in one of two ways, and gpuguard reads
and repairs each its own way:

- cgroup v1 (cgroupv1.py): the devices controller's `devices.list`, read and parsed;
  a lost node written back to `devices.allow` (microseconds), read back after.
- cgroup v2 (cgroupv2.py): BPF device programs, read back and judged without a fork; a
  scope's loss repaired by its DeviceAllow= (systemd rebuilds its program), bridged in
  place until then (bridge.py); a scope-less container's program replaced in place
  under V2Remedy=inplace (inplace.py), or the container reported or restarted.

Both implement `DeviceCgroup`: read the verdicts, plan and make the re-grant, the fast
re-grant (a reload's, inline on the loop), and what making a grant durable (a scope's
DeviceAllow=) takes on that layout. Which one serves a container is chosen from its
record in the pass's snapshot (cgroups.py, `Cgroups.of`), and nothing else in the step
looks at a container's layout (tests/unit/test_layout.py). The step's logic (the pass,
the reload's fast path, a new scope's grant) is written once against this interface.

Pure: the protocol (the records it fills are view.py's).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import (
    TYPE_CHECKING,
    AbstractSet,
    Awaitable,
    Callable,
    Container,
    Optional,
    Protocol,
    Sequence,
)

from gpuguard.model import Action, Finding, Outcome
from gpuguard.steps.container_access.view import AccessView, Denier, Pair, Readings

if TYPE_CHECKING:
    from gpuguard.devices.containers import ContainerCgroup
    from gpuguard.devices.nodes import DeviceNode
    from gpuguard.devices.rules import DeviceRules
    from gpuguard.engine.passes import Services
    from gpuguard.host.paths import Root
    from gpuguard.host.systemd import Systemd
    from gpuguard.steps.container_access.actions import UnitDeviceAllow

# Which layout serves a container (cgroups.py: `Cgroups.of`); None: no cgroup to judge
CgroupOf = Callable[["ContainerCgroup"], "Optional[DeviceCgroup]"]

# The durable grant (a scope's DeviceAllow=), the same for both layouts: cgroups.py
Grant = Callable[["UnitDeviceAllow", "Services", "Optional[Systemd]"], Awaitable[Outcome]]
# Journals what a reload's follow-up found, for the next pass (the step's)
Report = Callable[["AccessView"], None]
Written = dict[str, tuple[float, Outcome]]  # container_id -> (when, its re-grant)


@dataclass
class Swept:
    """What a reload's sweep of one layout's known containers did: the containers it
    looked at and what it read, the re-grants it made (`written`: their journal
    entries, built only after the last one), and what follows on the loop
    (`follow_up`: a task the step starts)."""

    looked: tuple[Pair, ...] = ()
    readings: Readings = field(default_factory=Readings)
    written: Callable[[], Written] = field(default=lambda: {})
    follow_up: Optional[Callable[[Written, Report], Awaitable[None]]] = None


class DeviceCgroup(Protocol):
    """One cgroup layout's way of judging and granting a container's devices."""

    def claims(self, c: ContainerCgroup) -> bool:
        """Whether this layout decides `c`'s device opens (cgroups.py asks in order)."""
        ...

    # -- read the verdicts --------------------------------------------------------

    def read(
        self,
        root: Root,
        pairs: Sequence[Pair],
        into: Readings,
        *,
        full: bool,
        planned: Container[str] = (),
    ) -> None:
        """Each pair's verdict on every node it was given, into `into`. `full`: the
        pass's read in its worker thread, of every container of this layout (may fork a
        probe; what it did not see is forgotten); else the fast read on the loop of the
        last pass's containers (no fork: unknown where a probe would be needed).
        `planned`: nodes a dry-run only planned (not on the host: unknown)."""
        ...

    def reread(self, root: Root, pairs: Sequence[Pair]) -> Readings:
        """The pairs' verdicts read afresh once systemd's apply has settled (settle.py;
        blocking: call from a thread); a container that cannot be read now is unknown."""
        ...

    def fingerprint(self, root: Root, c: ContainerCgroup) -> Optional[bytes]:
        """What decides `c`'s device opens, read cheaply enough to poll (devwatch.py:
        every WatchInterval= on the loop); a change is judged by `reread`. None: this
        layout is not watched so (its changes are announced), or `c` cannot be read
        now (the pass judges it)."""
        ...

    def end_of_pass(self, view: AccessView) -> None:
        """Forget what belongs to containers no longer in the pass's view."""
        ...

    # -- grant --------------------------------------------------------------------

    def plan_regrant(
        self,
        c: ContainerCgroup,
        denied: Sequence[DeviceNode],
        remedy: str,
        deniers: Sequence[Denier] = (),
    ) -> tuple[Action, ...]:
        """Pure: what re-grants `denied` (entitled nodes its cgroup refuses) on `c` in
        place now, besides the scope's DeviceAllow= (planned for every layout);
        `remedy`: V2Remedy= (report, inplace, restart-container); `deniers`: what the
        read found denying them that a DeviceAllow= cannot change (v2: a runtime's
        program in the scope)."""
        ...

    def admits_all(self, c: ContainerCgroup) -> bool:
        """Whether `c`'s scope admits every device now (read afresh: blocking, call
        from a thread); a new scope's grant asks it, as the pass's read says it
        (`Readings.unconfined`)."""
        ...

    def rewrite_cause(self, rules: Optional[DeviceRules]) -> Optional[str]:
        """Pure: the cause of a container that lost every GPU, when this layout can
        tell it (`rules`: its parsed devices.list, v1); None: unknown."""
        ...

    def hold_back(
        self, actions: Sequence[Action], view: AccessView, now: float
    ) -> tuple[tuple[Action, ...], tuple[Finding, ...]]:
        """`actions` without this layout's re-grants that must not run now, with a
        finding for each (v2: an in-place repair held back, inplace.py)."""
        ...

    async def grant(
        self, actions: Sequence[Action], view: AccessView, svc: Services
    ) -> list[Outcome]:
        """The pass's in-place re-grants among `actions` that are this layout's, before
        anything slower (each read back before it counts as done)."""
        ...

    # -- the fast re-grant --------------------------------------------------------

    def sweep(self, pairs: Sequence[Pair], svc: Services) -> Swept:
        """A reload's end, inline on the loop: the last pass's containers of this
        layout (`pairs`) each looked at and re-granted at once where they lost a node;
        a denial their scope's DeviceAllow= covers (as gpuguard set it: the step's
        `durable`, which each layout is given) waits for the pass (settle.py)."""
        ...

    def regrant_fast(self, view: AccessView, svc: Services) -> tuple[list[Outcome], bool]:
        """An urgent pass, before its walk: the last pass's containers of this layout
        in `view` (a fast read) re-granted in place where they lost a node; the
        outcomes, and whether a DeviceAllow= must follow at once (`durable_now`)."""
        ...

    def durable_now(
        self, view: AccessView, actions: Sequence[Action], svc: Services
    ) -> list[UnitDeviceAllow]:
        """The DeviceAllow= an urgent pass sets before its walk, among `actions` (the
        fast view's audit) and those its fast re-grants wait for."""
        ...

    # -- make durable -------------------------------------------------------------

    def before_durable(
        self, view: AccessView, units: AbstractSet[str], svc: Services
    ) -> list[Outcome]:
        """What this layout does before the pass sets DeviceAllow= on `units` (the
        scopes it repairs): v2 bridges them, and ends bridges left attached."""
        ...

    async def make_durable(self, units: Sequence[UnitDeviceAllow], svc: Services) -> list[Outcome]:
        """Each DeviceAllow= of `units` (its containers'), and what this layout does
        once systemd has applied it (v2: the bridge's detach)."""
        ...

    def busy(self) -> AbstractSet[str]:
        """Scopes whose DeviceAllow= this layout is setting on its own (a reload's
        follow-up): the pass leaves them alone."""
        ...
