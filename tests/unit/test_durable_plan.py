"""Which GPU scopes still need their durable DeviceAllow= grant."""

from __future__ import annotations

from pathlib import Path

from gpuguard.devices.containers import ContainerCgroup
from gpuguard.devices.entitlement import Entitlement, VisibleDevices
from gpuguard.devices.nodes import DeviceNode
from gpuguard.steps.container_access import plan_durable
from gpuguard.steps.container_access.observe import AccessView
from gpuguard.steps.container_access.reconcile import UnitDeviceAllow

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
    (act,) = plan_durable(_view((c, (GPU0, CTL))), planned, {}, LINKS)
    assert act.numbers == ("195:255",)


def test_no_scope_no_link_no_gpu_means_no_grant() -> None:
    cgroupfs = _ctr("b", None)
    no_gpu = _ctr("c", "cri-containerd-c.scope")
    no_link = _ctr("d", "cri-containerd-d.scope")
    view = _view((cgroupfs, (GPU0,)), (no_gpu, (CTL,)), (no_link, (GPU0,)))
    assert plan_durable(view, (), {}, {"/dev/char/195:255"}) == ()
