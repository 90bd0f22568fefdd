"""`gpuguard protect`'s plan: each GPU container's present grant (what the kernel admits
now) for its scope's drop-in; never a denied or unknown node, never a scope that admits
every device, never what the drop-in lists already."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import pytest

from gpuguard.devices.containers import ContainerCgroup
from gpuguard.devices.entitlement import Entitlement, VisibleDevices
from gpuguard.devices.nodes import DeviceNode
from gpuguard.steps.container_access.protect import plan_protect
from gpuguard.steps.container_access.view import AccessView

GPU0 = DeviceNode("/dev/nvidia0", 195, 0, "gpu")
GPU1 = DeviceNode("/dev/nvidia1", 195, 1, "gpu")
CTL = DeviceNode("/dev/nvidiactl", 195, 255, "ctl")


def _ctr(cid: str, unit: Optional[str] = None) -> ContainerCgroup:
    return ContainerCgroup(
        pod_uid="pod-" + cid,
        container_id=cid,
        runtime="containerd",
        driver="systemd" if unit != "" else "cgroupfs",
        cgroup_v1_devices=None,
        cgroup_v2=Path("/x"),
        unit=f"cri-containerd-{cid}.scope" if unit is None else (unit or None),
        pids=(1,),
    )


def _view(
    pairs: list[tuple[ContainerCgroup, tuple[DeviceNode, ...]]],
    access: dict[tuple[str, str], Optional[bool]],
    **kw: object,
) -> AccessView:
    ents = {
        c.key: Entitlement(c.pod_uid, c.container_id, n, n, (), (), VisibleDevices("unset"))
        for c, n in pairs
    }
    return AccessView(tuple(c for c, _ in pairs), ents, access, {}, **kw)  # type: ignore[arg-type]


def test_present_grant_only() -> None:
    a = _ctr("a")
    access = {("a", "195:0"): True, ("a", "195:1"): False, ("a", "195:255"): None}
    (p,) = plan_protect(_view([(a, (GPU0, GPU1, CTL))], access), {})
    assert p.unit == "cri-containerd-a.scope"
    assert p.add == (("/dev/char/195:0", "rw"),)  # never the denied nor the unknown one
    assert p.nodes == ("/dev/nvidia0",)
    assert p.denied == ("/dev/nvidia1",) and p.unknown == ("/dev/nvidiactl",)


def test_what_the_dropin_lists_is_not_written_again() -> None:
    a = _ctr("a")
    access = {("a", "195:0"): True, ("a", "195:255"): True}
    listed = {"cri-containerd-a.scope": [("/dev/char/195:0", "rw")]}
    (p,) = plan_protect(_view([(a, (GPU0, CTL))], access), listed)
    assert p.add == (("/dev/char/195:255", "rw"),) and p.kept == ("/dev/nvidia0",)
    # an entry without rw is no grant of the node: written again, with rw
    (p,) = plan_protect(
        _view([(a, (GPU0,))], access), {"cri-containerd-a.scope": [("/dev/char/195:0", "m")]}
    )
    assert p.add == (("/dev/char/195:0", "rw"),)


def test_never_for_an_open_scope_a_broken_one_no_scope_or_no_gpu() -> None:
    open_, broken, cgroupfs, ctl_only = _ctr("o"), _ctr("b"), _ctr("c", ""), _ctr("d")
    pairs = [(open_, (GPU0,)), (broken, (GPU0,)), (cgroupfs, (GPU0,)), (ctl_only, (CTL,))]
    access = {(c.container_id, n.numbers): True for c, ns in pairs for n in ns}
    view = _view(pairs, access, unconfined=frozenset({"o"}), broken={"b": "unreadable"})
    assert plan_protect(view, {}) == ()


def _run(root: Path, capsys: pytest.CaptureFixture[str], *extra: str) -> tuple[int, str]:
    from gpuguard import cli

    code = cli.main(["protect", "--root", str(root), *extra])
    return code, capsys.readouterr().out


def test_the_off_switch_and_durable_grants_no_write_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    etc = tmp_path / "etc/gpuguard"
    (etc / "gpuguard.conf.d").mkdir(parents=True)
    (etc / "disabled").write_text("CHG-1\n")
    code, out = _run(tmp_path, capsys)
    assert code == 0 and "gpuguard is disabled" in out and "nothing written" in out
    (etc / "disabled").unlink()
    (etc / "gpuguard.conf.d/50-off.conf").write_text("[Devices]\nDurableGrants=no\n")
    code, out = _run(tmp_path, capsys, "--dry-run")
    assert code == 0 and "DurableGrants=no: nothing written" in out
    assert not (tmp_path / "run").exists()


def test_a_broken_configuration_still_protects_with_the_defaults(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    etc = tmp_path / "etc/gpuguard"
    (etc / "gpuguard.conf.d").mkdir(parents=True)
    (etc / "gpuguard.conf.d/50-typo.conf").write_text("[Daemon]\nModee=observe\n")
    code, out = _run(tmp_path, capsys)  # no driver in this root: nothing to protect
    assert code == 0 and "no NVIDIA driver registered" in out, out
