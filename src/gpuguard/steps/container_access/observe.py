"""What the container_access step reads: GPU containers, what each was given and what
its cgroup admits (a worker thread runs this; each container's layout reads its
verdicts: devcgroup.py), and the grants systemd already keeps."""

from __future__ import annotations

import asyncio
import os
from typing import TYPE_CHECKING, AbstractSet, Optional, Sequence

from gpuguard.devices.entitlement import Entitlement, read_entitlement, unreadable_entitlement
from gpuguard.devices.nodes import list_nvidia_nodes
from gpuguard.devices.plugins import discover_plugins
from gpuguard.errors import GpuguardError
from gpuguard.host.inventory import Inventory
from gpuguard.host.paths import DEVICE_PLUGINS_DIR, Root

# The records, re-exported: the step, the CLI and tests import them from here.
from gpuguard.steps.container_access.view import AccessView as AccessView
from gpuguard.steps.container_access.view import Pair, Readings

if TYPE_CHECKING:
    from gpuguard.engine.snapshot import HostSnapshot
    from gpuguard.host.systemd import Systemd
    from gpuguard.steps.container_access.cgroups import Cgroups
    from gpuguard.steps.container_access.devcgroup import DeviceCgroup

SCOPE_IFACE = "org.freedesktop.systemd1.Scope"


class AccessObserver:
    """Reads the host for the step; caches each container's entitlement by its PID,
    and keeps the last pass's GPU containers for the fast paths."""

    def __init__(self, cgroups: Cgroups) -> None:
        self.cgroups = cgroups
        self._cache: dict[tuple[str, str], tuple[int, Entitlement]] = {}
        self._host_signature: tuple[tuple[str, str], ...] = ()
        # The last pass's GPU containers with their entitlements, by the layout that
        # serves each (grouped once: a reload's sweep starts writing at once)
        self._known: tuple[tuple[DeviceCgroup, tuple[Pair, ...]], ...] = ()

    @property
    def known(self) -> tuple[tuple[DeviceCgroup, tuple[Pair, ...]], ...]:
        """The last pass's GPU containers with their entitlements, by layout."""
        return self._known

    def know(self, pairs: Sequence[Pair]) -> list[tuple[DeviceCgroup, list[Pair]]]:
        """`pairs` (a pass's GPU containers) by layout, kept as the ones known now."""
        groups = self.cgroups.group(pairs)
        self._known = tuple((cg, tuple(some)) for cg, some in groups)
        return groups

    def fast_view(self, root: Root) -> AccessView:
        """The last pass's GPU containers with their access as of now: no tree walk,
        no /proc reads, no fork (unknown where a probe would be needed). A reload's
        wipe is repaired from this before anything else; on the loop, within a pass
        (its worker thread has not started)."""
        known = self._known  # one reference: observe() replaces it, never changes it
        r = Readings()
        for cg, some in known:
            cg.read(root, some, r, full=False)
        pairs = [p for _cg, some in known for p in some]
        return AccessView.of(tuple(c for c, _ in pairs), {c.key: e for c, e in pairs}, r)

    def observe(
        self,
        root: Root,
        inventory: Optional[Inventory],
        snapshot: HostSnapshot,
        plugin_socket_dir: str = DEVICE_PLUGINS_DIR,
    ) -> Optional[AccessView]:
        """Entitlements are judged against the pass's snapshot of the checkpoint (and the
        entries gpuguard dropped from it), never a re-read made after a step acted."""
        majors = snapshot.majors
        if majors.nvidia is None:
            return None  # driver not loaded: no GPU node can be granted
        containers = snapshot.containers()
        gpus = inventory.gpus if inventory is not None else ()
        # a dry-run's planned nodes count as made: the real run judges after making them
        host_nodes = snapshot.planned.host_nodes(list_nvidia_nodes(root, majors))
        signature = tuple(sorted((n.path, n.numbers) for n in host_nodes))
        if signature != self._host_signature:
            # Entitlements are judged against the host's nodes (a node made or removed
            # since, e.g. by the device_nodes step, changes them): judge afresh (and
            # what a layout remembers of a verdict holds for its entitlement only).
            self._cache.clear()
            self._host_signature = signature
        ents: dict[tuple[str, str], Entitlement] = {}
        broken: dict[str, str] = {}
        live = set()
        for c in containers:
            live.add(c.key)
            if c.problem:
                broken[c.container_id] = c.problem
                ents[c.key] = unreadable_entitlement(c, c.problem)
                continue
            cached = self._cache.get(c.key)
            if cached is not None and cached[0] in c.pids:
                ents[c.key] = cached[1]
                continue
            try:
                ent = read_entitlement(
                    root,
                    c,
                    host_nodes,
                    majors,
                    gpus,
                    snapshot.pod_device_ids,
                    snapshot.pod_recorded_ids,
                )
            except GpuguardError as e:  # its environ or /dev is not what it should be
                broken[c.container_id] = e.message
                ents[c.key] = unreadable_entitlement(c, e.message)
                continue
            ents[c.key] = ent
            if ent.readable and c.pids:
                self._cache[c.key] = (c.pids[0], ent)
        for gone in set(self._cache) - live:
            del self._cache[gone]
        gpu = [(c, ents[c.key]) for c in containers if ents[c.key].is_gpu_container]
        r = Readings()
        for cg, pairs in self.know(gpu):
            cg.read(root, pairs, r, full=True, planned=snapshot.planned.nodes)
        for c, _ent in gpu:
            if c.container_id in r.broken:  # never granted anything, even durably
                ents[c.key] = unreadable_entitlement(c, r.broken[c.container_id])
        plugins: frozenset[str] = frozenset()
        if any(e.missing or e.stale for _, e in gpu):  # rare: only then find the plugins
            plugins = frozenset(
                p.process.container_id
                for p in discover_plugins(root, plugin_socket_dir)
                if p.process is not None and p.process.container_id
            )
        return AccessView.of(tuple(containers), ents, r, broken=broken, plugin_containers=plugins)


def _numbers_of(root: Root, path: str) -> Optional[str]:
    """MAJ:MIN of a DeviceAllow= entry; None for class entries ("char-*", "block-*",
    "char-pts": runc writes these on every container) and for unresolvable paths."""
    name = os.path.basename(path)
    if path.startswith("/dev/char/") and ":" in name:
        return name
    if not path.startswith("/"):
        return None
    try:
        st = os.stat(root.path(path))
    except OSError:
        return None
    return f"{os.major(st.st_rdev)}:{os.minor(st.st_rdev)}"


async def learn_durable(
    sd: Systemd,
    view: AccessView,
    root: Root,
    durable: dict[str, set[str]],
    busy: AbstractSet[str],
) -> None:
    """Ask systemd once per scope what its DeviceAllow= already holds, into `durable`
    (unit -> device numbers); forget the units that are gone. `busy`: scopes the
    new-scope path is handling (it records their grants itself)."""
    todo = [
        c.unit
        for c in view.containers
        if c.unit is not None
        and c.unit not in durable
        and c.unit not in busy
        and view.entitlements.get(c.key) is not None
        and view.entitlements[c.key].is_gpu_container
    ]
    live_units = {c.unit for c in view.containers if c.unit}
    for gone in set(durable) - live_units - set(busy):
        del durable[gone]
    await asyncio.gather(*(_learn_unit(sd, u, root, durable) for u in todo))


async def _learn_unit(sd: Systemd, unit: str, root: Root, durable: dict[str, set[str]]) -> None:
    """Add what the scope's DeviceAllow= holds to what we know of it (added, never
    replaced: a grant made meanwhile by the new-scope path must not be forgotten)."""
    from gpuguard.host.systemd import PROPS, SystemdError, unit_object_path

    try:
        (v,) = await sd.call(
            "Get",
            "ss",
            [SCOPE_IFACE, "DeviceAllow"],
            path=unit_object_path(unit),
            interface=PROPS,
        )
    except SystemdError:
        return
    numbers = {_numbers_of(root, dev) for dev, _perm in v.value}
    durable.setdefault(unit, set()).update(n for n in numbers if n)
