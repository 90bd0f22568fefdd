"""The steps outside the daemon: `gpuguard check` runs them once through the daemon's
runner, `gpuguard status` reads the same observations without acting."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping, Optional

from gpuguard.config import Config
from gpuguard.devices.nodes import nvidia_majors, read_proc_devices
from gpuguard.engine.passes import STATUS_FILE, PassContext, Work
from gpuguard.engine.runner import PassRunner, StepResult
from gpuguard.engine.snapshot import HostSnapshot
from gpuguard.host.inventory import Inventory
from gpuguard.host.paths import Root
from gpuguard.host.statefile import load
from gpuguard.journal.log import EventLog
from gpuguard.reporting.container_row import Access, ContainerRow
from gpuguard.reporting.status import SPEC as STATUS_SPEC
from gpuguard.reporting.status import Status
from gpuguard.steps.registry import CHECK_ORDER, STEPS, build_steps

if TYPE_CHECKING:
    from gpuguard.devices.containers import ContainerCgroup
    from gpuguard.engine.executor import ChangeExecutor
    from gpuguard.host.systemd import Systemd
    from gpuguard.steps.registry import Step


def driver_loaded(root: Root) -> bool:
    """Whether the NVIDIA driver registered its devices; without it the device steps
    have nothing to do (and `gpuguard check` need not load D-Bus or asyncio)."""
    return nvidia_majors(read_proc_devices(root)).nvidia is not None


@dataclass
class OneShotServices:
    root: Root
    config: Config
    log: EventLog
    apply: ChangeExecutor
    bus_address: str
    client: Optional[Systemd] = None

    @property
    def systemd(self) -> Optional[Systemd]:
        return self.client


def check_steps(given: Mapping[str, Step]) -> dict[str, Step]:
    """`gpuguard check`'s steps (registry.CHECK_ORDER), built as the daemon builds its
    own; `given`: steps by name made by the caller (the checkpoint step with the
    command's settings)."""
    return {
        **build_steps([s for s in STEPS if s.name in CHECK_ORDER and s.name not in given]),
        **given,
    }


async def run_check_pass(
    svc: OneShotServices,
    steps: Mapping[str, Step],
    inventory: Optional[Inventory],
    snapshot: HostSnapshot,
) -> list[StepResult]:
    """`gpuguard check`'s one pass: `steps` in the daemon's order (registry.CHECK_ORDER)
    through the daemon's runner, deciding from `snapshot`, then the daemon's immediate
    follow-up pass once (links just made: durable grants now). Only systemd's
    DeviceAllow= depends on what the first run made, so that follow-up needs the bus. A
    dry-run makes no link and plans on the links it planned (snapshot.Planned): it
    prints the grants the real run makes then, each change once. An error of any step
    ends the run (a bug: exit 70; the checkpoint's: its own exit code)."""
    from gpuguard.host.systemd import Systemd, SystemdError

    async def load() -> Optional[Inventory]:
        return inventory

    now = time.monotonic()
    ctx = PassContext(
        Work(frozenset(steps), ("check",), now, now, urgent=True),  # kubelet waits on it
        load,
        previous_inventory=inventory,
        snapshot=snapshot,
    )
    sd = Systemd(svc.bus_address, max_in_flight=svc.config.systemd.max_in_flight)
    try:
        await sd.connect()
        svc.client = sd
    except SystemdError:
        svc.client = None  # no systemd: direct cgroup repairs only
    runner = PassRunner(steps, CHECK_ORDER, propagate=(Exception,))
    try:
        return await runner.run_once(svc, ctx, steps, follow_up=svc.client is not None)
    finally:
        sd.disconnect()


def container_status(root: Root, cfg: Config, inventory: Optional[Inventory]) -> list[ContainerRow]:
    from gpuguard.steps.container_access.cgroups import Cgroups
    from gpuguard.steps.container_access.observe import AccessObserver
    from gpuguard.steps.container_access.reconcile import audit

    cgroups = Cgroups()
    view = AccessObserver(cgroups).observe(
        root,
        inventory,
        HostSnapshot(root, cfg.kubelet.checkpoint_path),
        cfg.device_plugin.socket_dir,
    )
    if view is None:
        return []
    findings, _ = audit(
        view.containers,
        view.entitlements,
        view.access,
        cgroup_of=cgroups.of,
        device_rules=view.rules,
        plugin_containers=view.plugin_containers,
    )
    rows = []
    for c in view.containers:
        if c.container_id in view.broken:  # one bad container costs that container only
            rows.append(_row(c, "unreadable", problems=(view.broken[c.container_id],)))
            continue
        ent = view.entitlements.get(c.key)
        if ent is None or not ent.is_gpu_container:
            continue
        denied = tuple(
            n.path for n in ent.nodes if view.access.get((c.container_id, n.numbers)) is False
        )
        unknown = tuple(
            n.path for n in ent.nodes if view.access.get((c.container_id, n.numbers)) is None
        )
        problems = tuple(
            f.summary for f in findings if f.fields.get("CONTAINER_ID") == c.container_id
        )
        rows.append(
            _row(
                c,
                "denied" if denied else ("unknown" if unknown else "ok"),
                nodes=tuple(n.path for n in ent.nodes),
                missing=tuple(n.path for n in ent.missing),
                stale=tuple(f"{n.path} {n.numbers}" for n, _ in ent.stale),
                denied=denied,
                unknown=unknown,
                problems=problems,
            )
        )
    return rows


def _row(
    c: ContainerCgroup,
    access: Access,
    *,
    nodes: tuple[str, ...] = (),
    missing: tuple[str, ...] = (),
    stale: Optional[tuple[str, ...]] = None,
    denied: tuple[str, ...] = (),
    unknown: tuple[str, ...] = (),
    problems: tuple[str, ...] = (),
) -> ContainerRow:
    """One container's row: who it is, then what was found (nothing, unless given)."""
    return ContainerRow(
        pod_uid=c.pod_uid,
        container_id=c.container_id,
        unit=c.unit,
        driver=c.driver,
        layout=c.layout,
        mechanism=c.mechanism,
        access=access,
        nodes=nodes,
        missing=missing,
        stale=stale,
        denied=denied,
        unknown=unknown,
        problems=problems,
    )


def daemon_status(root: Root) -> Optional[Status]:
    """The daemon's status file (reporting/status.py's loader, whether its daemon still
    runs or not); None when it is absent or not one this gpuguard writes."""
    return load(root.path(STATUS_FILE), STATUS_SPEC).value
