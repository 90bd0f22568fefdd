"""Which GPU scopes still need their durable DeviceAllow= grant, and never one that
would narrow a scope that admits every device."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from gpuguard.devices.containers import ContainerCgroup
from gpuguard.devices.entitlement import Entitlement, VisibleDevices
from gpuguard.devices.nodes import DeviceNode
from gpuguard.steps.container_access import plan_durable
from gpuguard.steps.container_access.durable import keep_open
from gpuguard.steps.container_access.observe import AccessView
from gpuguard.steps.container_access.reconcile import UnitDeviceAllow, V2ProgramReplace

GPU0 = DeviceNode("/dev/nvidia0", 195, 0, "gpu")
CTL = DeviceNode("/dev/nvidiactl", 195, 255, "ctl")


def _ctr(cid: str, unit: str | None) -> ContainerCgroup:
    return ContainerCgroup(
        pod_uid="pod-" + cid,
        container_id=cid,
        runtime="containerd",
        driver="systemd" if unit else "cgroupfs",
        cgroup_v1_devices=Path("/x"),
        cgroup_v2=None,
        unit=unit,
        pids=(1,),
    )


def _ent(c: ContainerCgroup, nodes: tuple[DeviceNode, ...]) -> Entitlement:
    return Entitlement(c.pod_uid, c.container_id, nodes, nodes, (), (), VisibleDevices("unset"))


def _view(*pairs: tuple[ContainerCgroup, tuple[DeviceNode, ...]]) -> AccessView:
    return AccessView(
        containers=tuple(c for c, _ in pairs),
        entitlements={c.key: _ent(c, n) for c, n in pairs},
        access={},
        rules={},
    )


LINKS = {"/dev/char/195:0", "/dev/char/195:255"}


def test_new_gpu_scope_gets_its_nodes() -> None:
    c = _ctr("a", "cri-containerd-a.scope")
    (act,) = plan_durable(_view((c, (GPU0, CTL))), (), {}, LINKS)
    assert act.unit == c.unit
    assert act.devices == (("/dev/char/195:0", "rw"), ("/dev/char/195:255", "rw"))


def test_already_durable_or_planned_is_not_repeated() -> None:
    c = _ctr("a", "cri-containerd-a.scope")
    assert plan_durable(_view((c, (GPU0, CTL))), (), {c.unit: {"195:0", "195:255"}}, LINKS) == ()  # type: ignore[dict-item]
    planned = (
        UnitDeviceAllow(
            "container_access", "r", c.unit or "", unit=c.unit or "", numbers=("195:0",)
        ),
    )
    kept, act = plan_durable(_view((c, (GPU0, CTL))), planned, {}, LINKS)
    assert kept == planned[0]  # the audit's, as planned
    assert act.numbers == ("195:255",)


def test_no_scope_no_link_no_gpu_means_no_grant() -> None:
    cgroupfs = _ctr("b", None)
    no_gpu = _ctr("c", "cri-containerd-c.scope")
    no_link = _ctr("d", "cri-containerd-d.scope")
    view = _view((cgroupfs, (GPU0,)), (no_gpu, (CTL,)), (no_link, (GPU0,)))
    assert plan_durable(view, (), {}, {"/dev/char/195:255"}) == ()


def _allow(c: ContainerCgroup, *numbers: str) -> UnitDeviceAllow:
    unit = c.unit or ""
    return UnitDeviceAllow(
        "container_access", "r", unit, unit=unit, container_id=c.container_id, numbers=numbers
    )


def test_a_scope_that_admits_every_device_gets_no_device_allow() -> None:
    """A privileged container's scope (DevicePolicy=auto, no entries: "a *:* rwm", no
    program): a DeviceAllow= would make it a closed list. Neither the audit's nor a new
    durable grant is kept; the confined scope next to it gets both."""
    open_, closed = _ctr("a", "cri-containerd-a.scope"), _ctr("b", "cri-containerd-b.scope")
    view = dataclasses.replace(
        _view((open_, (GPU0, CTL)), (closed, (GPU0, CTL))), unconfined=frozenset({"a"})
    )
    planned = (_allow(open_, "195:0"), _allow(closed, "195:0"))
    got = plan_durable(view, planned, {}, LINKS)
    assert [a.container_id for a in got] == ["b", "b"]
    assert keep_open(view, list(planned)) == [planned[1]]


def test_device_allow_is_not_repeated_while_the_runtimes_program_is_replaced() -> None:
    """What the scope's DeviceAllow= already holds is not set again when the program
    that denies is the runtime's, replaced in place (a DeviceAllow= changes nothing
    there, and each one wakes another pass); what it lacks still is."""
    c = _ctr("a", "cri-containerd-a.scope")
    fix = V2ProgramReplace("container_access", "r", "/cg", container_id="a", program_id=7)
    planned = (_allow(c, "195:0"), fix)
    covered = {c.unit or "": {"195:0", "195:255"}}
    assert plan_durable(_view((c, (GPU0, CTL))), planned, covered, LINKS) == ()
    (again,) = plan_durable(_view((c, (GPU0, CTL))), planned, {c.unit or "": {"195:255"}}, LINKS)
    assert again == planned[0]
