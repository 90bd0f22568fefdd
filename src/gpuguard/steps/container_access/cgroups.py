"""Which layout serves each container (devcgroup.py), and the durable grant they share.

A container is served by the first layout that claims it from its record in the pass's
snapshot: v1 where a v1 devices cgroup exists (on a hybrid host it decides, though the
kernel runs the cgroup2 programs too), v2 where only a cgroup2 path does; one with
neither has nothing gpuguard can judge. The durable grant, a scope's DeviceAllow=
(with its drop-in first: actuate.device_allow_change), is the same on both and is
recorded in `durable` (unit -> device numbers), which the fast paths and the pass share.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Callable, Optional, Sequence

from gpuguard.model import Outcome
from gpuguard.steps.container_access.actuate import device_allow_change
from gpuguard.steps.container_access.cgroupv1 import CgroupV1
from gpuguard.steps.container_access.cgroupv2 import CgroupV2
from gpuguard.steps.container_access.devcgroup import DeviceCgroup
from gpuguard.steps.container_access.view import Pair

if TYPE_CHECKING:
    from gpuguard.devices.containers import ContainerCgroup
    from gpuguard.engine.passes import Services
    from gpuguard.host.systemd import Systemd
    from gpuguard.steps.container_access.actions import UnitDeviceAllow


class Cgroups:
    """The two layouts, long-lived (what each remembers across passes), and the choice
    between them."""

    def __init__(
        self,
        durable: Optional[dict[str, set[str]]] = None,
        carry: Callable[[Outcome], None] = lambda o: None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.durable: dict[str, set[str]] = {} if durable is None else durable
        self.v1 = CgroupV1(self.grant, self.durable)
        self.v2 = CgroupV2(self.grant, self.durable, clock, carry)
        self.all: tuple[DeviceCgroup, ...] = (self.v1, self.v2)

    def of(self, c: ContainerCgroup) -> Optional[DeviceCgroup]:
        """The layout that serves `c` (None: no cgroup gpuguard can judge); at most one
        claims a container (each says which it serves)."""
        for cg in self.all:
            if cg.claims(c):
                return cg
        return None

    def admits_all(self, c: ContainerCgroup) -> bool:
        """Whether `c`'s scope admits every device now (blocking: a thread): a new
        scope's grant asks before it sets a DeviceAllow= (durable.py: never narrow)."""
        cg = self.of(c)
        return cg is not None and cg.admits_all(c)

    def group(self, pairs: Sequence[Pair]) -> list[tuple[DeviceCgroup, list[Pair]]]:
        """`pairs` by the layout that serves each, in the layouts' order (the pairs no
        layout serves left out)."""
        out: dict[int, list[Pair]] = {}
        for p in pairs:
            cg = self.of(p[0])
            if cg is not None:
                out.setdefault(id(cg), []).append(p)
        return [(cg, out[id(cg)]) for cg in self.all if id(cg) in out]

    async def grant(self, a: UnitDeviceAllow, svc: Services, sd: Optional[Systemd]) -> Outcome:
        """The durable grant: the scope's DeviceAllow=, recorded once systemd took it."""
        outcome = await svc.apply.run_async(device_allow_change(a, sd, svc.root))
        if outcome.status == "done":
            self.durable.setdefault(a.unit, set()).update(a.numbers)
        return outcome
