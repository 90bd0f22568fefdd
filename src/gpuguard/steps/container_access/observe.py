"""What the container_access step reads: GPU containers, what each was given and what
its cgroup admits (a worker thread runs this), and the grants systemd already keeps."""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, AbstractSet, Container, Mapping, Optional, Sequence

from gpuguard.devices.bpfread import BRIDGE_NAME, SYSTEMD_NAME, ProgramCache, judge
from gpuguard.devices.containers import ContainerCgroup
from gpuguard.devices.entitlement import Entitlement, read_entitlement, unreadable_entitlement
from gpuguard.devices.nodes import (
    list_nvidia_nodes,
)
from gpuguard.devices.plugins import discover_plugins
from gpuguard.devices.probe import probe_open_all, query_device_programs
from gpuguard.devices.rules import DeviceRules, parsed_devices_list
from gpuguard.errors import GpuguardError
from gpuguard.host.inventory import Inventory
from gpuguard.host.paths import DEVICE_PLUGINS_DIR, Root
from gpuguard.host.safeio import CGROUP_MAX, UnsafeFileError, read_kernel_text
from gpuguard.steps.container_access.reconcile import (
    AccessKey,
    verdicts_from_rules,
)

if TYPE_CHECKING:
    from gpuguard.engine.snapshot import HostSnapshot
    from gpuguard.host.systemd import Systemd

SCOPE_IFACE = "org.freedesktop.systemd1.Scope"


@dataclass(frozen=True)
class AccessView:
    containers: tuple[ContainerCgroup, ...]
    entitlements: Mapping[tuple[str, str], Entitlement]
    access: Mapping[AccessKey, Optional[bool]]
    rules: Mapping[str, DeviceRules]
    # container_id -> why its own files could not be read: it gets a finding and is
    # neither judged nor granted anything; every other container goes on.
    broken: Mapping[str, str] = field(default_factory=dict)
    # device plugins' own containers: the plugin step judges their view of the nodes
    plugin_containers: frozenset[str] = frozenset()
    # v2 containers without a scope: the device programs attached to their own cgroup
    # (None: BPF_PROG_QUERY failed), for the in-place repair's checks (inplace.py)
    programs: Mapping[str, Optional[tuple[int, ...]]] = field(default_factory=dict)
    # v2 containers with a bridge of gpuguard's among their programs (bridge.py), and
    # the v2 (container, node) pairs that a program of systemd's itself denies
    bridged: frozenset[str] = frozenset()
    systemd_denies: frozenset[AccessKey] = frozenset()
    # v2 containers: the ids of every device program the kernel runs for their cgroup
    # (a failed bridge waits until these change: bridge.py)
    effective: Mapping[str, tuple[int, ...]] = field(default_factory=dict)


def scope_verdicts(
    cache: ProgramCache,
    c: ContainerCgroup,
    ent: Entitlement,
    ids: list[int],
    fd: Optional[int] = None,
) -> Optional[dict[AccessKey, bool]]:
    """Whether the device programs the kernel runs for `c`'s v2 cgroup admit each node
    it was given (None: not readable, ask a probe); `ids` receives those programs' ids.
    `fd`: the cgroup's directory, open."""
    assert c.cgroup_v2 is not None
    nodes = [(n.major, n.minor) for n in ent.nodes]
    verdicts = judge(cache, c.cgroup_v2, nodes, ids, fd)
    if verdicts is None:
        return None
    return {(c.container_id, n.numbers): verdicts[(n.major, n.minor)] for n in ent.nodes}


def systemd_denied(
    cache: ProgramCache, c: ContainerCgroup, ent: Entitlement, ids: Sequence[int]
) -> set[AccessKey]:
    """The nodes given to `c` that a program of systemd's among `ids` denies."""
    sd = [(i, cache.get(i)) for i in ids if cache.name(i) == SYSTEMD_NAME]
    if not sd:
        return set()
    return {
        (c.container_id, n.numbers)
        for n in ent.nodes
        if any(p and not cache.admits_rw(i, p, (n.major, n.minor)) for i, p in sd)
    }


class AccessObserver:
    """Reads the host for the step; caches each container's entitlement by its PID."""

    def __init__(self) -> None:
        self._cache: dict[tuple[str, str], tuple[int, Entitlement]] = {}
        # The v1 GPU containers of the last pass, for fast_view() after a reload, and the
        # devices.list text of each that admitted everything it was given.
        self._known_v1: tuple[tuple[ContainerCgroup, Entitlement], ...] = ()
        self._good: dict[str, str] = {}
        self._host_signature: tuple[tuple[str, str], ...] = ()
        # The same for v2: the last pass's GPU containers judged by their device programs.
        self._known_v2: tuple[tuple[ContainerCgroup, Entitlement], ...] = ()
        self._programs = ProgramCache()
        self._root: Optional[Root] = None

    def _read_v2(
        self,
        root: Root,
        pairs: Sequence[tuple[ContainerCgroup, Entitlement]],
        access: dict[AccessKey, Optional[bool]],
        programs: dict[str, Optional[tuple[int, ...]]],
        *,
        probe: bool = True,
        planned: Container[str] = (),
        bridged: Optional[set[str]] = None,
        cache: Optional[ProgramCache] = None,
        sd_denies: Optional[set[AccessKey]] = None,
        effective: Optional[dict[str, tuple[int, ...]]] = None,
    ) -> None:
        """v2 verdicts from the programs the kernel runs for each cgroup, parsed once
        each (no fork); a probe, one fork per container, where a program cannot be read
        or parsed (``probe=False``: left unknown, for the fast path on the loop).
        ``planned``: nodes a dry-run only planned, not on the host: a probe has nothing
        to open there (the container's own node is a path it controls), so unknown.
        ``bridged``: receives the containers with a bridge of gpuguard's attached;
        ``sd_denies``: the (container, node) pairs a program of systemd's denies."""
        programs_cache = self._programs if cache is None else cache
        for c, ent in pairs:
            assert c.cgroup_v2 is not None
            ids: list[int] = []
            verdicts = scope_verdicts(programs_cache, c, ent, ids)
            if effective is not None:
                effective[c.container_id] = tuple(ids)
            if bridged is not None and any(programs_cache.name(i) == BRIDGE_NAME for i in ids):
                bridged.add(c.container_id)
            if sd_denies is not None and verdicts is not None:
                sd_denies |= systemd_denied(programs_cache, c, ent, ids)
            if verdicts is not None:
                access.update(verdicts)
            elif probe:
                real = [n for n in ent.nodes if n.path not in planned]
                res = probe_open_all([root.path(n.path) for n in real], [c.cgroup_v2])
                for n, r in zip(real, res):
                    access[(c.container_id, n.numbers)] = r.verdict
                for n in ent.nodes:
                    if n.path in planned:
                        access[(c.container_id, n.numbers)] = None
            if c.unit is None and probe:
                try:
                    programs[c.container_id] = query_device_programs(c.cgroup_v2)
                except OSError:
                    programs[c.container_id] = None

    @property
    def known_v1(self) -> tuple[tuple[ContainerCgroup, Entitlement], ...]:
        """The last pass's v1 GPU containers with their entitlements."""
        return self._known_v1

    @property
    def known_v2_scopes(self) -> tuple[tuple[ContainerCgroup, Entitlement], ...]:
        """The last pass's v2 GPU containers in a systemd scope."""
        return tuple(p for p in self._known_v2 if p[0].unit is not None)

    def read_v1(
        self,
        pairs: Sequence[tuple[ContainerCgroup, Entitlement]],
        access: dict[AccessKey, Optional[bool]],
        rules: dict[str, DeviceRules],
        broken: dict[str, str],
        remember: bool = False,
    ) -> None:
        """`pairs`' devices.list read into `access`, `rules` and `broken`. `remember`
        (what was last seen intact) only within a pass: its observe() in the pass's
        thread, or its fast view on the loop before that thread starts; a reload's sweep
        (reload.py), which can run while a pass's thread does, reads without it."""
        for c, ent in pairs:
            assert c.cgroup_v1_devices is not None
            path = c.cgroup_v1_devices / "devices.list"
            try:
                text = read_kernel_text(path, what="devices.list", max_bytes=CGROUP_MAX)
            except UnsafeFileError as e:
                broken[c.container_id] = e.message
                continue
            if text is None:
                continue  # the container went away
            if self._good.get(c.container_id) == text:  # unchanged since it was fine
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
                self._good[c.container_id] = text
            else:
                self._good.pop(c.container_id, None)

    def fast_view(
        self,
        remember: bool = True,
        pairs: Optional[Sequence[tuple[ContainerCgroup, Entitlement]]] = None,
        cache: Optional[ProgramCache] = None,
    ) -> AccessView:
        """The last pass's GPU containers with their access as of now: no tree walk,
        no /proc reads. A reload's wipe is repaired from this before anything else.
        `remember=False` outside a pass: a pass's observe() may be running in its
        thread, and only that thread updates what was last seen intact. `pairs`: some
        of the last pass's containers only; `cache`: the programs read outside a pass."""
        access: dict[AccessKey, Optional[bool]] = {}
        rules: dict[str, DeviceRules] = {}
        broken: dict[str, str] = {}
        programs: dict[str, Optional[tuple[int, ...]]] = {}
        sd_denies: set[AccessKey] = set()
        effective: dict[str, tuple[int, ...]] = {}
        # one reference: observe() replaces it, never changes it
        v1 = self._known_v1
        v2 = self._known_v2
        if pairs is not None:
            v1 = tuple(p for p in pairs if p[0].cgroup_v1_devices is not None)
            v2 = tuple(p for p in pairs if p[0].cgroup_v1_devices is None)
        self.read_v1(v1, access, rules, broken, remember)
        if self._root is not None and v2:
            self._read_v2(
                self._root,
                v2,
                access,
                programs,
                probe=False,
                cache=cache,
                sd_denies=sd_denies,
                effective=effective,
            )
        known = v1 + v2
        return AccessView(
            tuple(c for c, _ in known),
            {c.key: e for c, e in known},
            access,
            rules,
            broken,
            programs=programs,
            systemd_denies=frozenset(sd_denies),
            effective=effective,
        )

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
            # since, e.g. by the device_nodes step, changes them): judge afresh.
            self._cache.clear()
            self._good.clear()
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
        access: dict[AccessKey, Optional[bool]] = {}
        rules: dict[str, DeviceRules] = {}
        gpu = [(c, ents[c.key]) for c in containers if ents[c.key].is_gpu_container]
        v1 = tuple((c, e) for c, e in gpu if c.cgroup_v1_devices is not None)
        self.read_v1(v1, access, rules, broken, remember=True)
        for c, _ent in v1:
            if c.container_id in broken:  # never granted anything, even durably
                ents[c.key] = unreadable_entitlement(c, broken[c.container_id])
        v2 = tuple((c, e) for c, e in gpu if c.cgroup_v1_devices is None and c.cgroup_v2)
        programs: dict[str, Optional[tuple[int, ...]]] = {}
        bridged: set[str] = set()
        effective: dict[str, tuple[int, ...]] = {}
        self._read_v2(
            root,
            v2,
            access,
            programs,
            planned=snapshot.planned.nodes,
            bridged=bridged,
            effective=effective,
        )
        self._programs.forget_unseen()
        self._root, self._known_v2 = root, v2
        self._known_v1 = v1
        for stale_id in set(self._good) - {c.container_id for c, _ in v1}:
            del self._good[stale_id]
        for cid in broken:  # a container we could not read is judged afresh next pass
            self._good.pop(cid, None)
        plugins: frozenset[str] = frozenset()
        if any(e.missing or e.stale for _, e in gpu):  # rare: only then find the plugins
            plugins = frozenset(
                p.process.container_id
                for p in discover_plugins(root, plugin_socket_dir)
                if p.process is not None and p.process.container_id
            )
        return AccessView(
            tuple(containers),
            ents,
            access,
            rules,
            broken=broken,
            plugin_containers=plugins,
            programs=programs,
            bridged=frozenset(bridged),
            effective=effective,
        )


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
