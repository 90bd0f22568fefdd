"""Cgroup v1 (devcgroup.py's DeviceCgroup): the devices controller decides.

A container's verdicts come from its `devices.list`, parsed (`rules.allows`), and a
lost node is written back to its `devices.allow`: microseconds, so CUDA works again at
once, before anything slower. Every write is read back before it counts as done
(actuate.confirm_v1): systemd may re-apply the scope's rules (deny all, then its own
allows) in between. The write does not survive the next reload or `runc update`; the
scope's DeviceAllow= (planned for every layout by reconcile.audit) does.

After a daemon-reload the last pass's containers are swept inline on the loop
(`sweep`): each read and, where an entitled node is denied, written at once, one after
another (the first has its GPU back before the second is read). Only the reads and the
writes are on that path: the actions and outcomes the journal needs are built after the
last write (`V1Write.outcome`: ~10 us each, about as much as the write itself), and
every write is read back after that.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, AbstractSet, Container, Mapping, Optional, Sequence

from gpuguard.devices.rules import ALLOW_ALL, DeviceRules, looks_runc_written, parsed_devices_list
from gpuguard.host.safeio import CGROUP_MAX, UnsafeFileError, read_bytes, read_kernel_text
from gpuguard.model import Action, Finding, Outcome
from gpuguard.steps.container_access.actions import CgroupV1Allow
from gpuguard.steps.container_access.actuate import (
    confirm_v1,
    grants_change,
    read_devices_list,
    v1_change,
)
from gpuguard.steps.container_access.devcgroup import Grant, Swept, Written
from gpuguard.steps.container_access.reconcile import (
    CAUSE_REWRITE,
    RECONCILER,
    verdicts_from_rules,
)
from gpuguard.steps.container_access.settle import outside_apply
from gpuguard.steps.container_access.view import Access, AccessView, Denier, Pair, Readings

if TYPE_CHECKING:
    from gpuguard.devices.containers import ContainerCgroup
    from gpuguard.devices.entitlement import Entitlement
    from gpuguard.devices.nodes import DeviceNode
    from gpuguard.engine.executor import ChangeExecutor
    from gpuguard.engine.passes import Services
    from gpuguard.host.paths import Root
    from gpuguard.steps.container_access.actions import UnitDeviceAllow


def v1_allow(c: ContainerCgroup, cgroup_dir: Path, denied: Sequence[DeviceNode]) -> CgroupV1Allow:
    """The direct re-grant of `denied` (entitled nodes the cgroup refuses) for `c`; where
    its process is below its scope (crun's SCOPE/container), the scope is written first:
    a v1 cgroup admits only what its parent does."""
    what = ", ".join(n.path for n in denied)
    above = c.cgroup_v1_devices
    return CgroupV1Allow(
        reason=f"re-grant {what} given to the container and denied by its cgroup",
        target=str(cgroup_dir),
        cgroup_dir=str(cgroup_dir),
        through=(str(above),) if above is not None and above != cgroup_dir else (),
        rules=tuple(n.allow_line("rw") for n in denied),
        reconciler=RECONCILER,
        pod_uid=c.pod_uid,
        container_id=c.container_id,
        nodes=tuple(n.path for n in denied),
        numbers=tuple(n.numbers for n in denied),
    )


@dataclass(frozen=True)
class V1Write:
    """One container's re-grant: the nodes written, when, and how it went."""

    container: ContainerCgroup
    cgroup_dir: Path
    denied: tuple[DeviceNode, ...]
    at: float  # time.monotonic() right after the write
    status: str
    detail: str

    def outcome(self) -> Outcome:
        a = v1_allow(self.container, self.cgroup_dir, self.denied)
        return Outcome(a, self.status, self.detail)


def regrant(
    c: ContainerCgroup,
    cgroup_dir: Path,
    nodes: Sequence[DeviceNode],
    access: Mapping[tuple[str, str], Optional[bool]],
    apply: ChangeExecutor,
) -> Optional[V1Write]:
    """Write back every node of `nodes` (what `c` was given) that `access` judges denied
    (False) on its v1 devices cgroup `cgroup_dir`; None when there is nothing to write."""
    denied = tuple(n for n in nodes if access.get((c.container_id, n.numbers)) is False)
    if not denied:
        return None
    rules = [n.allow_line("rw") for n in denied]
    above = c.cgroup_v1_devices
    through = (above,) if above is not None and above != cgroup_dir else ()
    status, detail = apply.run(grants_change(cgroup_dir, rules, through))
    return V1Write(c, cgroup_dir, denied, time.monotonic(), status, detail)


ALLOW_ALL_LINE = ALLOW_ALL.render()  # "a *:* rwm": what the kernel lists for allow-all


class CgroupV1:
    """The v1 layout: `devices.list` read, `devices.allow` written. Remembers, for the
    pass's reads, each container's list while it admitted everything it was given
    (a pass after a reload re-parses only what changed)."""

    def __init__(self, grant: Grant, durable: Mapping[str, AbstractSet[str]]) -> None:
        self.grant_durably = grant  # the scope's DeviceAllow= (cgroups.py)
        self.durable = durable  # unit -> numbers gpuguard set in its DeviceAllow=
        # container_id -> the devices.list text that admitted all of that entitlement
        # (the observer's, kept while the host's nodes are unchanged: the same object)
        self._good: dict[str, tuple[str, Entitlement]] = {}

    def claims(self, c: ContainerCgroup) -> bool:
        # where a v1 devices cgroup exists it decides (hybrid hosts too: containers.py)
        return c.cgroup_v1_devices is not None

    def _dir(self, c: ContainerCgroup) -> Path:
        """The devices cgroup its process is in, which the kernel checks (crun's
        SCOPE/container, below the scope's, which admits at least as much)."""
        d = c.v1_dir
        assert d is not None, "a container of this layout"
        return d

    @staticmethod
    def _open_scope(c: ContainerCgroup, own: str) -> bool:
        """The scope's devices.list is "a *:* rwm" (`own`: the list read where the
        process is; the scope's is read when it is another cgroup)."""
        scope = c.cgroup_v1_devices
        text: Optional[str] = own
        if scope is not None and c.process_v1 is not None:
            try:
                text = read_kernel_text(scope / "devices.list", what="devices.list")
            except UnsafeFileError:
                return False
        return (text or "").split("\n", 1)[0].strip() == ALLOW_ALL_LINE

    def admits_all(self, c: ContainerCgroup) -> bool:
        try:
            text = read_kernel_text(self._dir(c) / "devices.list", what="devices.list")
        except UnsafeFileError:
            return False
        return text is not None and self._open_scope(c, text)

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
        self._read(pairs, into, remember=True)
        if full:  # every container of this layout: forget the others, and the unreadable
            seen = {c.container_id for c, _ in pairs} - set(into.broken)
            for gone in set(self._good) - seen:
                del self._good[gone]

    def _read(
        self,
        pairs: Sequence[Pair],
        into: Readings,
        remember: bool,
        access: Optional[Access] = None,
    ) -> None:
        """`pairs`' devices.list read into `into` (`access`: the verdicts elsewhere).
        `remember` (what was last seen intact) only within a pass: its read in the
        pass's thread, or its fast read on the loop before that thread starts; a
        reload's sweep, which can run while a pass's thread does, reads without it."""
        rules, broken = into.rules, into.broken
        access = into.access if access is None else access
        for c, ent in pairs:
            path = self._dir(c) / "devices.list"
            try:
                text = read_kernel_text(path, what="devices.list", max_bytes=CGROUP_MAX)
            except UnsafeFileError as e:
                broken[c.container_id] = e.message
                continue
            if text is None:
                continue  # the container went away
            if self._open_scope(c, text):
                into.unconfined.add(c.container_id)
            good = self._good.get(c.container_id)
            if good is not None and good[0] == text and good[1] is ent:  # still fine
                access.update({(c.container_id, n.numbers): True for n in ent.nodes})
                continue
            try:
                r = parsed_devices_list(text)
            except ValueError as e:  # not what the kernel writes: this container only
                broken[c.container_id] = f"{path}: {e}; check what wrote this file"
                continue
            rules[c.container_id] = r
            verdicts = verdicts_from_rules(c.container_id, ent.nodes, r)
            access.update(verdicts)
            if not remember:
                continue
            if all(verdicts.values()):
                self._good[c.container_id] = (text, ent)
            else:
                self._good.pop(c.container_id, None)

    def reread(self, root: Root, pairs: Sequence[Pair]) -> Readings:
        out = Readings()
        for c, ent in pairs:
            r = self._rules(c)
            if r is None:
                out.access.update({(c.container_id, n.numbers): None for n in ent.nodes})
                continue
            out.rules[c.container_id] = r
            out.access.update(verdicts_from_rules(c.container_id, ent.nodes, r))
        return out

    def _rules(self, c: ContainerCgroup) -> Optional[DeviceRules]:
        try:
            return read_devices_list(self._dir(c))
        except (UnsafeFileError, ValueError):
            return None

    def fingerprint(self, root: Root, c: ContainerCgroup) -> Optional[bytes]:
        # devices.list as the kernel prints it: a runtime's own rewrite (cgroupfs
        # driver) changes it, and nothing announces that (devwatch.py)
        try:
            return read_bytes(self._dir(c) / "devices.list", what="devices.list",
                              max_bytes=CGROUP_MAX)[0]  # fmt: skip
        except UnsafeFileError:
            return None

    def end_of_pass(self, view: AccessView) -> None:
        pass  # what it remembers is pruned by the pass's full read

    # -- grant --------------------------------------------------------------------

    def plan_regrant(
        self,
        c: ContainerCgroup,
        denied: Sequence[DeviceNode],
        remedy: str,
        deniers: Sequence[Denier] = (),
    ) -> tuple[Action, ...]:
        return (v1_allow(c, self._dir(c), denied),)

    def rewrite_cause(self, rules: Optional[DeviceRules]) -> Optional[str]:
        # seeds 002/003: runc's defaults and the spec's nodes, the hook's grants gone
        return CAUSE_REWRITE if rules is not None and looks_runc_written(rules) else None

    def hold_back(
        self, actions: Sequence[Action], view: AccessView, now: float
    ) -> tuple[tuple[Action, ...], tuple[Finding, ...]]:
        return tuple(actions), ()

    async def grant(
        self, actions: Sequence[Action], view: AccessView, svc: Services
    ) -> list[Outcome]:
        # every container written before any is read back (the first has access at once)
        wrote = [svc.apply.run(v1_change(a)) for a in actions if isinstance(a, CgroupV1Allow)]
        return [confirm_v1(o) for o in wrote]

    # -- the fast re-grant --------------------------------------------------------

    def sweep(self, pairs: Sequence[Pair], svc: Services) -> Swept:
        """Each of `pairs` read, then re-granted what it lost. A denial the scope's
        DeviceAllow= covers (`durable`, as gpuguard set it) is judged unknown and left to
        the full pass's settled re-read: a read inside systemd's own deny-all-then-allow
        apply is no loss (settle.py)."""
        durable = self.durable
        s = Readings()
        writes: list[V1Write] = []
        for pair in pairs:
            c, ent = pair
            seen: Access = {}
            self._read((pair,), s, remember=False, access=seen)
            seen = outside_apply((c,), {c.key: ent}, seen, durable, frozenset()) or seen
            s.access.update(seen)
            w = regrant(c, self._dir(c), ent.nodes, seen, svc.apply)
            if w is not None:
                writes.append(w)

        def written() -> Written:  # each write read back now that all are made
            return {w.container.container_id: (w.at, confirm_v1(w.outcome())) for w in writes}

        return Swept(tuple(pairs), s, written)

    def regrant_fast(self, view: AccessView, svc: Services) -> tuple[list[Outcome], bool]:
        wrote = []
        for c in view.containers:
            if self.claims(c):
                ent = view.entitlements[c.key]
                w = regrant(c, self._dir(c), ent.nodes, view.access, svc.apply)
                if w is not None:
                    wrote.append(w)
        # every container written before any is read back
        return [confirm_v1(w.outcome()) for w in wrote], False

    def durable_now(
        self, view: AccessView, actions: Sequence[Action], svc: Services
    ) -> list[UnitDeviceAllow]:
        return []  # the write restored access: the pass makes it durable

    # -- make durable -------------------------------------------------------------

    def before_durable(
        self, view: AccessView, units: AbstractSet[str], svc: Services
    ) -> list[Outcome]:
        return []

    async def make_durable(self, units: Sequence[UnitDeviceAllow], svc: Services) -> list[Outcome]:
        return list(await asyncio.gather(*(self.grant_durably(a, svc, svc.systemd) for a in units)))

    def busy(self) -> AbstractSet[str]:
        return frozenset()
