"""Which v2 scopes get a bridge before their DeviceAllow= (steps/container_access/
bridgeplan.py plan_bridges), as tables: only a v2 container in a systemd scope (the
v2 layout is given only its own containers: cgroups.py), only for entitled nodes its
cgroup denies (never an unknown verdict, never another node), never while the in-place
back-off holds its cgroup; the DeviceAllow= that follows names the same nodes. And a
fast view's denial that systemd's own program makes is no longer waved through as
"mid-apply" on v2 (fastpaths.settled)."""

from __future__ import annotations

import dataclasses

from gpuguard.steps.container_access import ContainerAccessStep
from gpuguard.steps.container_access.bridgeplan import ACTION_ATTACH, BridgeAttach
from gpuguard.steps.container_access.bridgeplan import plan_bridges as plan
from gpuguard.steps.container_access.cgroups import Cgroups
from gpuguard.steps.container_access.fastpaths import settled
from gpuguard.steps.container_access.inplace import BASE, Backoff, Failure
from gpuguard.steps.container_access.observe import AccessView
from gpuguard.steps.container_access.reconcile import UnitDeviceAllow
from unit.test_devices_audit import CID, CTL, GPU0, GPU1, UVM, UVMT, _container, _ent

GIVEN = (GPU0, CTL, UVM, UVMT)
LAYOUTS = Cgroups()


def plan_bridges(
    view: AccessView, failures: dict[str, Failure], now: float
) -> tuple[tuple[BridgeAttach, UnitDeviceAllow], ...]:
    """The v2 layout's bridges, for the containers of `view` it serves."""
    v2 = LAYOUTS.v2
    mine = tuple(c for c in view.containers if LAYOUTS.of(c) is v2)
    return plan(dataclasses.replace(view, containers=mine), failures, now, v2.program_dir)


def _view(access: dict[str, object], *, v1: bool = False, unit: bool = True) -> AccessView:
    c = _container(driver="systemd", v1=v1, unit=unit)
    verdicts = {(CID, n.numbers): access.get(n.numbers, True) for n in GIVEN}
    return AccessView((c,), {c.key: _ent(GIVEN)}, verdicts, {})  # type: ignore[arg-type]


def test_a_v2_scope_denying_entitled_nodes_gets_a_bridge_for_exactly_those() -> None:
    ((bridge, allow),) = plan_bridges(_view({GPU0.numbers: False, UVM.numbers: False}), {}, 0.0)
    assert bridge.kind == ACTION_ATTACH and bridge.unit == f"cri-containerd-{CID}.scope"
    assert bridge.numbers == (GPU0.numbers, UVM.numbers) and GPU1.numbers not in bridge.numbers
    assert bridge.cgroup_dir == bridge.target and bridge.cgroup_dir.endswith(CID)
    assert allow.unit == bridge.unit and allow.numbers == bridge.numbers
    assert allow.devices == ((GPU0.dev_char, "rw"), (UVM.dev_char, "rw"))
    assert bridge.fields()["DEVICE_MECHANISM"] == "scope-device-allow"


def test_no_bridge_for_v1_no_scope_unknown_or_intact() -> None:
    denied = {GPU0.numbers: False}
    assert plan_bridges(_view(denied, v1=True), {}, 0.0) == ()  # v1: devices.allow
    assert plan_bridges(_view(denied, unit=False), {}, 0.0) == ()  # V2Remedy=inplace
    assert plan_bridges(_view({GPU0.numbers: None}), {}, 0.0) == ()  # unknown waits
    assert plan_bridges(_view({}), {}, 0.0) == ()
    view = _view(denied)
    broken = dataclasses.replace(view, broken={CID: "unreadable"})
    assert plan_bridges(broken, {}, 0.0) == ()


def test_the_back_off_holds_a_bridge_until_it_ends() -> None:
    view = _view({GPU0.numbers: False})
    cg = str(view.containers[0].cgroup_v2)
    b = Backoff()
    b.record(cg, None, False, f"{cg}: the cgroup is frozen", 100.0)
    assert plan_bridges(view, b.failures, 100.0 + BASE - 1) == ()
    assert len(plan_bridges(view, b.failures, 100.0 + BASE)) == 1
    b.record(cg, None, False, "again", 100.0 + BASE)  # doubles
    assert plan_bridges(view, b.failures, 100.0 + 2 * BASE) == ()


def test_a_failed_bridge_is_tried_again_once_the_cgroups_programs_change() -> None:
    """Held while the kernel runs the same programs for the cgroup as when it failed;
    systemd's next program (a reload, a DeviceAllow=) ends the hold at once: one try per
    change, never a loop."""
    view = _view({GPU0.numbers: False})
    cg = str(view.containers[0].cgroup_v2)
    b = Backoff()
    b.record(cg, (7, 8), False, "the programs that deny are not systemd's alone", 100.0)
    same = dataclasses.replace(view, effective={CID: (7, 8)})
    assert plan_bridges(same, b.failures, 101.0) == ()
    changed = dataclasses.replace(view, effective={CID: (7, 9)})
    assert len(plan_bridges(changed, b.failures, 101.0)) == 1


def test_a_denial_systemds_own_program_makes_is_not_taken_for_mid_apply() -> None:
    s = ContainerAccessStep().state
    view = _view({GPU0.numbers: False})
    unit = str(view.containers[0].unit)
    s.durable[unit] = {GPU0.numbers}  # gpuguard believes the scope covers it
    assert settled(s, view).access[(CID, GPU0.numbers)] is None  # waits for the pass
    own = dataclasses.replace(view, systemd_denies=frozenset({(CID, GPU0.numbers)}))
    assert settled(s, own).access[(CID, GPU0.numbers)] is False  # lost: bridged now
