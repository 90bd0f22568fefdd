"""The device_nodes step: NVIDIA nodes and /dev/char links exist while the driver is up.

Modules (docs/architecture.md has the map of the packages):

- the device node step: which nodes and `/dev/char` links to create (`reconcile.py`),
  creating them (`actuate.py`); new links are a `DEVICE_LINKS_CREATED` event
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Sequence

from gpuguard.devices.caps import read_cap_minors
from gpuguard.devices.devchar import LinkState, check_dev_char_links
from gpuguard.devices.nodes import (
    DeviceNode,
    NvidiaMajors,
    expected_nodes,
    list_nvidia_nodes,
    nvidia_majors,
    read_loaded_modules,
    read_proc_devices,
)
from gpuguard.host.inventory import Inventory
from gpuguard.host.paths import Root
from gpuguard.journal.conditions import Conditions, log_findings
from gpuguard.model import Action, Finding, Outcome
from gpuguard.steps.device_nodes import reconcile as device_nodes
from gpuguard.steps.device_nodes.actuate import DeviceNodeActuator
from gpuguard.steps.events import EventKind

if TYPE_CHECKING:
    from gpuguard.engine.executor import ChangeExecutor
    from gpuguard.engine.passes import PassContext, Services
    from gpuguard.engine.snapshot import Planned


@dataclass(frozen=True)
class NodesView:
    loaded: bool  # the nvidia major is registered: the driver is up
    expected: tuple[DeviceNode, ...]
    existing: tuple[DeviceNode, ...]
    links: tuple[LinkState, ...]


def observe_nodes(
    root: Root, inventory: Optional[Inventory], majors: Optional[NvidiaMajors] = None
) -> NodesView:
    """`majors`: the pass's, from its host snapshot (None: read /proc/devices here)."""
    if majors is None:
        majors = nvidia_majors(read_proc_devices(root))
    if majors.nvidia is None or inventory is None:
        return NodesView(False, (), (), ())
    modules = read_loaded_modules(root)
    expected = expected_nodes(
        inventory.gpus, majors, read_cap_minors(root), modeset="nvidia_modeset" in modules
    )
    return NodesView(
        True, expected, list_nvidia_nodes(root, majors), check_dev_char_links(root, expected)
    )


def plan_nodes(
    view: NodesView, *, create_nodes: bool, create_links: bool
) -> tuple[tuple[Finding, ...], tuple[Action, ...]]:
    if not view.loaded:
        return (), ()
    return device_nodes.plan(
        view.expected,
        view.existing,
        view.links,
        create_nodes=create_nodes,
        create_links=create_links,
    )


def apply_all(
    actuator: DeviceNodeActuator, actions: Sequence[Action], apply: ChangeExecutor
) -> list[Outcome]:
    # Nodes before links: a link is only planned for a node that exists or is created.
    ordered = sorted(actions, key=lambda a: a.kind != "device-node-created")
    return [apply.run(actuator.change(a)) for a in ordered]


def _plan_for_later_steps(planned: Planned, view: NodesView, outcomes: Sequence[Outcome]) -> None:
    """A dry-run's nodes and links, for the later steps of the same run to plan with."""
    expected = {n.path: n for n in view.expected}
    for o in outcomes:
        if o.status != "dry-run":
            continue
        a = o.action
        if isinstance(a, device_nodes.CreateDeviceNode) and a.path in expected:
            planned.nodes[a.path] = expected[a.path]
        elif isinstance(a, device_nodes.CreateCharLink):
            planned.links.add(a.link)


class DeviceNodesStep:
    def __init__(self) -> None:
        self.conditions = Conditions()  # a finding that lasts is journaled once an hour

    async def __call__(self, svc: Services, ctx: PassContext) -> None:
        inventory = await ctx.device_inventory()
        cfg = svc.config.devices
        host = ctx.host(svc)  # /proc/devices read once for the pass's steps, in the thread
        host.planned.nodes.clear()  # the earlier pass's plan (a dry-run daemon's) ends
        host.planned.links.clear()  # here: this step plans afresh for the later ones
        view = await asyncio.to_thread(lambda: observe_nodes(svc.root, inventory, host.majors))
        findings, actions = plan_nodes(
            view, create_nodes=cfg.create_nodes, create_links=cfg.create_char_links
        )
        creates = svc.apply.pick(made=cfg.create_nodes or cfg.create_char_links, described=False)
        if not creates:
            # left as they are: journaled once while they last, not at every pass
            log_findings(svc.log, self.conditions, "device_nodes", findings, lasting_clears=True)
        else:
            for f in findings:  # each one repaired below: an event each time
                svc.log.finding(f)
        ctx.findings += findings
        if actions:
            actuator = DeviceNodeActuator(svc.root, svc.log, nvidia_modprobe=cfg.nvidia_modprobe)
            outcomes = await asyncio.to_thread(apply_all, actuator, actions, svc.apply)
            ctx.outcomes += outcomes
            _plan_for_later_steps(host.planned, view, outcomes)
            made = ("done", "dry-run")  # a dry-run's follow-up plans on its planned links
            if any(o.status in made and o.action.kind == "char-link-created" for o in outcomes):
                # durable DeviceAllow= grants resolve through the links just made
                ctx.announce(EventKind.DEVICE_LINKS_CREATED, "device links created")
