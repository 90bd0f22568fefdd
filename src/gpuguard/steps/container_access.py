"""The container_access step (F2): GPU containers keep exactly the devices they were given.

Per pass: find GPU containers, read what their cgroup admits, and
1. re-grant what is denied by the fastest path first: a direct write to the v1
   devices.allow (microseconds per container), so CUDA works again at once;
2. then make grants durable: a runtime DeviceAllow=/dev/char/MAJ:MIN on the
   container's systemd scope, so the next daemon-reload/reexec re-applies them
   instead of wiping them. This is also done for containers whose access is still
   intact, as soon as they are seen (a new scope's UnitNew marks this step), so a
   reload never wipes them in the first place.
Entitlements (what a container was given) are read once per container process and
cached; a pass after a reload only re-reads devices.list.
"""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, AbstractSet, Callable, Mapping, Optional, Sequence

from gpuguard.conditions import Conditions, log_findings
from gpuguard.devices.audit import (
    FINDING_CONFLICT,
    FINDING_MISSING,
    FINDING_STALE,
    AccessKey,
    CgroupV1Allow,
    RestartContainer,
    UnitDeviceAllow,
    V2ReportOnly,
    audit,
    unreadable_findings,
    v1_allow,
    verdicts_from_rules,
)
from gpuguard.devices.cgroupio import CgroupWriteError, write_allow
from gpuguard.devices.containers import ContainerCgroup, detect_layout, discover_containers
from gpuguard.devices.entitlement import Entitlement, read_entitlement, unreadable_entitlement
from gpuguard.devices.nodes import (
    list_nvidia_nodes,
    nvidia_majors,
    read_proc_devices,
)
from gpuguard.devices.probe import probe_open
from gpuguard.devices.rules import DeviceRules, parse_devices_list
from gpuguard.errors import GpuguardError
from gpuguard.inventory import Inventory
from gpuguard.model import Action, Outcome
from gpuguard.paths import DEVICE_PLUGINS_DIR, Root
from gpuguard.plugins.discover import discover_plugins
from gpuguard.safeio import CGROUP_MAX, UnsafeFileError, read_kernel_text
from gpuguard.steps.registry import CONTAINER_ACCESS

if TYPE_CHECKING:
    from gpuguard.passes import PassContext, Services
    from gpuguard.snapshot import HostSnapshot
    from gpuguard.systemd import Systemd

NAME = CONTAINER_ACCESS
# Lasting states gpuguard cannot end itself: journaled when they appear, change or clear.
CONDITION_KINDS = frozenset({FINDING_MISSING, FINDING_STALE, FINDING_CONFLICT})
POD_RESTART_WINDOW = 3600.0  # V2Remedy=restart-container: one restart per pod per hour
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


class AccessObserver:
    """Reads the host for the step; caches each container's entitlement by its PID."""

    def __init__(self) -> None:
        self._cache: dict[tuple[str, str], tuple[int, Entitlement]] = {}
        # The v1 GPU containers of the last pass, for fast_view() after a reload, and the
        # devices.list text of each that admitted everything it was given.
        self._known_v1: tuple[tuple[ContainerCgroup, Entitlement], ...] = ()
        self._good: dict[str, str] = {}
        self._host_signature: tuple[tuple[str, str], ...] = ()

    def _read_v1(
        self,
        pairs: Sequence[tuple[ContainerCgroup, Entitlement]],
        access: dict[AccessKey, Optional[bool]],
        rules: dict[str, DeviceRules],
        broken: dict[str, str],
    ) -> None:
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
                r = parse_devices_list(text)
            except ValueError as e:  # not what the kernel writes: this container only
                broken[c.container_id] = f"{path}: {e}; check what wrote this file"
                continue
            rules[c.container_id] = r
            verdicts = verdicts_from_rules(c.container_id, ent.nodes, r)
            access.update(verdicts)
            if all(verdicts.values()):
                self._good[c.container_id] = text
            else:
                self._good.pop(c.container_id, None)

    def fast_view(self) -> AccessView:
        """The last pass's v1 GPU containers with their access as of now: no tree walk,
        no /proc reads. A reload's wipe is repaired from this before anything else."""
        access: dict[AccessKey, Optional[bool]] = {}
        rules: dict[str, DeviceRules] = {}
        broken: dict[str, str] = {}
        self._read_v1(self._known_v1, access, rules, broken)
        return AccessView(
            tuple(c for c, _ in self._known_v1),
            {c.key: e for c, e in self._known_v1},
            access,
            rules,
            broken,
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
        majors = nvidia_majors(read_proc_devices(root))
        if majors.nvidia is None:
            return None  # driver not loaded: no GPU node can be granted
        containers = discover_containers(root, detect_layout(root))
        gpus = inventory.gpus if inventory is not None else ()
        host_nodes = list_nvidia_nodes(root, majors)
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
                ent = read_entitlement(root, c, host_nodes, majors, gpus, snapshot.pod_device_ids)
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
        self._read_v1(v1, access, rules, broken)
        for c, _ent in v1:
            if c.container_id in broken:  # never granted anything, even durably
                ents[c.key] = unreadable_entitlement(c, broken[c.container_id])
        for c, ent in gpu:
            if c.cgroup_v1_devices is None and c.cgroup_v2 is not None:
                for n in ent.nodes:
                    res = probe_open(root.path(n.path), [c.cgroup_v2])
                    access[(c.container_id, n.numbers)] = res.verdict
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
            tuple(containers), ents, access, rules, broken=broken, plugin_containers=plugins
        )


def plan_durable(
    view: AccessView,
    planned: tuple[Action, ...],
    durable: Mapping[str, AbstractSet[str]],
    links: AbstractSet[str],
) -> tuple[UnitDeviceAllow, ...]:
    """DeviceAllow= for GPU containers whose scope does not carry their grant yet.

    `durable`: unit -> device numbers its DeviceAllow= already has (only units we
    know); `links`: the /dev/char paths that exist (systemd resolves through them).
    """
    already = {a.unit: set(a.numbers) for a in planned if isinstance(a, UnitDeviceAllow)}
    out: list[UnitDeviceAllow] = []
    for c in view.containers:
        ent = view.entitlements.get(c.key)
        if c.unit is None or ent is None or not ent.readable or not ent.is_gpu_container:
            continue
        have = set(durable.get(c.unit, ())) | already.get(c.unit, set())
        todo = [n for n in ent.nodes if n.numbers not in have and n.dev_char in links]
        if not todo:
            continue
        out.append(
            UnitDeviceAllow(
                reconciler=NAME,
                reason="make the grant durable before any daemon-reload can wipe it",
                target=c.unit,
                unit=c.unit,
                devices=tuple((n.dev_char, "rw") for n in todo),
                pod_uid=c.pod_uid,
                container_id=c.container_id,
                nodes=tuple(n.path for n in todo),
                numbers=tuple(n.numbers for n in todo),
            )
        )
    return tuple(out)


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


class ContainerAccessStep:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.observer = AccessObserver()
        self.durable: dict[str, set[str]] = {}  # unit -> numbers in its DeviceAllow=
        self.clock = clock
        self.pod_restarts: dict[str, float] = {}  # pod UID -> when we last stopped one
        self.conditions = Conditions()

    async def __call__(self, svc: Services, ctx: PassContext) -> None:
        cfg = svc.config
        if cfg.devices.regrant:
            self._fast_repair(svc, ctx)
        snapshot = ctx.host(svc)
        # The GPUs are needed to judge conflicts: without them every GPU node in a
        # container's /dev would be entitled (the start-up pass used to run before any
        # step had loaded them). A systemd event reuses the last pass's, without waiting.
        inventory = await ctx.device_inventory()
        view = await asyncio.to_thread(
            self.observer.observe, svc.root, inventory, snapshot, cfg.device_plugin.socket_dir
        )
        if view is None:
            return
        if snapshot.dropped_entries[1]:
            svc.log.warning(snapshot.dropped_entries[1])
        findings, actions = audit(
            view.containers,
            view.entitlements,
            view.access,
            device_rules=view.rules,
            restart_on_v2=cfg.devices.v2_remedy == "restart-container",
            plugin_containers=view.plugin_containers,
        )
        findings += unreadable_findings(view.containers, view.broken)
        # 1. the fast path: direct cgroup writes, before anything slower (logging the
        # findings is one journal message each: 4 per container after a reload)
        outcomes = []
        if cfg.devices.regrant:
            outcomes = [self._v1(a, svc) for a in actions if isinstance(a, CgroupV1Allow)]
        for f in findings:
            if f.kind not in CONDITION_KINDS:
                svc.log.finding(f)
        log_findings(
            svc.log, self.conditions, NAME, [f for f in findings if f.kind in CONDITION_KINDS]
        )
        ctx.findings += findings
        ctx.gauges["gpu_containers"] = sum(
            1 for e in view.entitlements.values() if e.is_gpu_container
        )
        if not cfg.devices.regrant:
            return
        # 2. durable grants through systemd
        systemd = svc.systemd
        # DurableGrants=no: the direct writes only, no DeviceAllow= at all
        units = [
            a for a in actions if isinstance(a, UnitDeviceAllow) and cfg.devices.durable_grants
        ]
        if cfg.devices.durable_grants and systemd is not None:
            await self._learn_durable(systemd, view, svc.root)
            links = {
                n.dev_char
                for e in view.entitlements.values()
                for n in e.nodes
                if os.path.lexists(svc.root.path(n.dev_char))
            }
            units += plan_durable(view, tuple(units), self.durable, links)
        outcomes += await asyncio.gather(*(self._unit(a, svc, systemd) for a in units))
        for a in actions:
            if isinstance(a, (V2ReportOnly, RestartContainer)):
                outcomes.append(self._other(a, svc))
        for o in outcomes:
            svc.log.outcome(o)
        ctx.outcomes += outcomes

    def _fast_repair(self, svc: Services, ctx: PassContext) -> None:
        """Right after a daemon-reload every millisecond counts: re-check the v1 GPU
        containers the last pass knew and write their grants back before walking the
        tree, and before building the report (800 findings cost more than 200 writes).
        Inline on the loop, not in a thread: these are kernfs reads and writes of a few
        hundred bytes each, ~15 ms for 200 containers, and nothing is more urgent."""
        fast = self.observer.fast_view()
        written: dict[str, Outcome] = {}
        for c in fast.containers:
            ent = fast.entitlements[c.key]
            denied = [n for n in ent.nodes if fast.access.get((c.container_id, n.numbers)) is False]
            if not denied or c.cgroup_v1_devices is None:
                continue
            action = v1_allow(c, c.cgroup_v1_devices, denied)
            written[c.container_id] = self._v1(action, svc)
        if not written:
            return
        # The report: the same audit as a full pass (findings with their causes).
        findings, _ = audit(
            fast.containers, fast.entitlements, fast.access, device_rules=fast.rules
        )
        findings += unreadable_findings(fast.containers, fast.broken)
        for f in findings:
            svc.log.finding(f)
        for o in written.values():
            svc.log.outcome(o)
        ctx.findings += findings
        ctx.outcomes += written.values()

    def _v1(self, a: CgroupV1Allow, svc: Services) -> Outcome:
        if svc.dry_run:
            return Outcome(a, "dry-run", "would write " + "; ".join(a.rules))
        try:
            write_allow(Path(a.cgroup_dir), a.rules)
        except (CgroupWriteError, OSError) as e:
            return Outcome(a, "failed", str(e))
        return Outcome(a, "done", "wrote " + "; ".join(a.rules))

    async def _unit(self, a: UnitDeviceAllow, svc: Services, sd: Optional[Systemd]) -> Outcome:
        from dbus_next import Variant

        from gpuguard.systemd import SystemdError

        if svc.dry_run:
            return Outcome(
                a, "dry-run", "would set DeviceAllow= " + ", ".join(d for d, _ in a.devices)
            )
        if sd is None:
            return Outcome(a, "failed", "system bus down; the next pass retries")
        value = Variant("a(ss)", [[dev, perm] for dev, perm in a.devices])
        try:
            await sd.set_unit_properties(a.unit, a.runtime, [("DeviceAllow", value)])
        except SystemdError as e:
            return Outcome(a, "failed", str(e))
        self.durable.setdefault(a.unit, set()).update(a.numbers)
        return Outcome(a, "done", "DeviceAllow=" + " ".join(d for d, _ in a.devices))

    def _other(self, a: Action, svc: Services) -> Outcome:
        if isinstance(a, V2ReportOnly):
            return Outcome(
                a,
                "declined",
                "cgroup v2 without a systemd scope: gpuguard does not rewrite runc's device "
                "program; recreate the container (V2Remedy=restart-container does it)",
            )
        assert isinstance(a, RestartContainer)
        # Never a restart loop: kubelet recreates the container, and if the new one is
        # denied too, stopping it again would be a loop. One restart per pod per window.
        now = self.clock()
        last = self.pod_restarts.get(a.pod_uid)
        if last is not None and now - last < POD_RESTART_WINDOW:
            return Outcome(
                a,
                "declined",
                f"pod {a.pod_uid} was already restarted {now - last:.0f}s ago (at most one "
                f"restart per pod per {POD_RESTART_WINDOW / 60:.0f} min); recreate it by hand",
            )
        if svc.dry_run:
            return Outcome(a, "dry-run", "would stop the container through the CRI")
        self.pod_restarts[a.pod_uid] = now
        from gpuguard.commands import CommandError, run

        dp = svc.config.device_plugin
        try:
            res = run([dp.crictl, "--runtime-endpoint", dp.cri_endpoint, "stop", a.container_id])
        except CommandError as e:
            return Outcome(a, "failed", str(e))
        if res.returncode != 0:
            return Outcome(a, "failed", res.stderr.strip()[:200])
        return Outcome(a, "done", "stopped; kubelet recreates it")

    async def _learn_durable(self, sd: Systemd, view: AccessView, root: Root) -> None:
        """Ask systemd once per scope what its DeviceAllow= already holds."""
        from gpuguard.systemd import PROPS, SystemdError

        todo = [
            c.unit
            for c in view.containers
            if c.unit is not None
            and c.unit not in self.durable
            and view.entitlements.get(c.key) is not None
            and view.entitlements[c.key].is_gpu_container
        ]
        live_units = {c.unit for c in view.containers if c.unit}
        for gone in set(self.durable) - live_units:
            del self.durable[gone]

        async def learn(unit: str) -> None:
            try:
                path = await sd.unit_path(unit)
                (v,) = await sd.call(
                    "Get", "ss", [SCOPE_IFACE, "DeviceAllow"], path=path, interface=PROPS
                )
            except SystemdError:
                return
            numbers = {_numbers_of(root, dev) for dev, _perm in v.value}
            self.durable[unit] = {n for n in numbers if n}

        await asyncio.gather(*(learn(u) for u in todo))
