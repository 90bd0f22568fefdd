"""A reload's v2 sweep (steps/container_access/bridge.py `Bridges.sweep`, as the v2 layout
has it: cgroupv2.py) on real cgroup
v2 device programs, judged by the kernel (a child opening fake nodes from inside).

Each scope is a cgroup with a program playing the hook's (admits its GPU) and one of
systemd's (``sd_devices``) as a reload leaves it. The sweep must bridge exactly the
scopes whose systemd program lost an entitled node, leave intact ones alone, leave a
denial the scope's DeviceAllow= covers to the pass unless systemd's own program denies
it, refuse a frozen cgroup (and hold it back), skip a vanished one, and in a dry run
change nothing.
"""

from __future__ import annotations

import contextlib
import time
import types
import uuid
from pathlib import Path
from typing import Any, Iterator

import pytest

from gpuguard.devices.bpfprog import ACC_RW, DeviceProgram, DevRule, build, grant_nodes
from gpuguard.devices.bpfread import BRIDGE_NAME
from gpuguard.devices.containers import ContainerCgroup
from gpuguard.devices.entitlement import Entitlement, VisibleDevices
from gpuguard.devices.nodes import ROLE_GPU, DeviceNode
from gpuguard.engine.executor import ChangeExecutor
from gpuguard.model import Outcome
from gpuguard.steps.container_access.bridge import Bridges
from gpuguard.steps.container_access.cgroupv2 import CgroupV2
from integration.harness.bpfdev import attach, detach_all, names, verdicts
from integration.test_bpf_inplace import RUNC
from integration.test_bpf_inplace import cgroup as cgroup
from integration.test_bpf_inplace import nodes as nodes

pytestmark = pytest.mark.root

GPU = DeviceNode("/dev/nvidia0", 195, 0, ROLE_GPU)
HOOK = grant_nodes(RUNC, [(195, 0)])  # the hook's program: runc's defaults + the GPU
SD_LOST = DeviceProgram((DevRule(True, "c", 1, 3, ACC_RW),), False)  # DeviceAllow=/dev/null
SD_KEPT = grant_nodes(SD_LOST, [(195, 0)])  # ... and the GPU


@pytest.fixture
def base(cgroup: Path) -> Iterator[Path]:
    """test_bpf_inplace's cgroup, each scope made under it removed before it."""
    try:
        yield cgroup
    finally:
        for cg in sorted(p for p in cgroup.iterdir() if p.is_dir()):
            with contextlib.suppress(OSError):
                (cg / "cgroup.freeze").write_text("0")
            with contextlib.suppress(OSError):
                detach_all(cg)
            _rmdir(cg)


def _rmdir(cg: Path) -> None:
    for _ in range(100):  # a probe child may still be leaving
        try:
            cg.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.02)
    raise AssertionError(f"could not remove {cg}")


def scope(top: Path, name: str, *programs: tuple[DeviceProgram, bytes]) -> Any:
    cg = top / name
    cg.mkdir()
    for prog, label in programs:
        attach(cg, build(prog), label)
    cid = uuid.uuid4().hex * 2
    c = ContainerCgroup(
        "pod", cid, "containerd", "systemd", None, cg, f"cri-containerd-{cid}.scope", (1,)
    )
    ent = Entitlement("pod", cid, (GPU,), (GPU,), (), (), VisibleDevices("unset"))
    return c, ent


def bridges(durable: dict[str, set[str]]) -> Bridges:
    async def grant(*_a: Any) -> Outcome:
        raise AssertionError("the sweep sets no DeviceAllow= itself")

    return CgroupV2(grant, durable).bridges  # the v2 layout's: its look, its cache


def test_sweep_bridges_exactly_the_lost_scopes(base: Path, nodes: dict[Any, Path]) -> None:
    lost = scope(base, "lost", (HOOK, b"legacy_hook"), (SD_LOST, b"sd_devices"))
    kept = scope(base, "kept", (HOOK, b"legacy_hook"), (SD_KEPT, b"sd_devices"))
    # covered by its DeviceAllow= and systemd's program admits: the hook's denies
    # (systemd mid-apply, or another program's doing): left to the pass
    covered = scope(base, "covered", (RUNC, b"legacy_hook"), (SD_KEPT, b"sd_devices"))
    # covered too, but systemd's own program denies it: lost all the same
    sd_denies = scope(base, "sd-denies", (HOOK, b"legacy_hook"), (SD_LOST, b"sd_devices"))
    gone = scope(base, "gone")
    (base / "gone").rmdir()
    durable = {covered[0].unit: {GPU.numbers}, sd_denies[0].unit: {GPU.numbers}}
    b = bridges(durable)
    svc = types.SimpleNamespace(apply=ChangeExecutor())
    out, access = b.sweep([lost, kept, covered, sd_denies, gone], svc)  # type: ignore[arg-type]

    assert sorted(out) == sorted([lost[0].container_id, sd_denies[0].container_id])
    assert all(o.status == "done" for _t, o in out.values()), [o.detail for _t, o in out.values()]
    key = GPU.numbers
    assert access[(lost[0].container_id, key)] is False  # what the look saw
    assert access[(kept[0].container_id, key)] is True
    assert access[(covered[0].container_id, key)] is None
    assert access[(sd_denies[0].container_id, key)] is False
    assert not any(cid == gone[0].container_id for cid, _n in access)
    assert set(b.pending) == {lost[0].unit, sd_denies[0].unit}
    for c, _ in (lost, sd_denies):
        assert names(c.cgroup_v2) == [BRIDGE_NAME, "legacy_hook"]
        assert verdicts(c.cgroup_v2, nodes)[(195, 0)] is True
        assert verdicts(c.cgroup_v2, nodes)[(195, 1)] is False  # nothing beyond the GPU
    assert names(kept[0].cgroup_v2) == ["legacy_hook", "sd_devices"]
    assert names(covered[0].cgroup_v2) == ["legacy_hook", "sd_devices"]
    assert verdicts(covered[0].cgroup_v2, nodes)[(195, 0)] is False


def test_sweep_refuses_a_frozen_scope_and_holds_it_back(base: Path, nodes: dict[Any, Path]) -> None:
    frozen = scope(base, "frozen", (HOOK, b"legacy_hook"), (SD_LOST, b"sd_devices"))
    cg = frozen[0].cgroup_v2
    (cg / "cgroup.freeze").write_text("1")
    b = bridges({})
    svc = types.SimpleNamespace(apply=ChangeExecutor())
    out, _ = b.sweep([frozen], svc)  # type: ignore[arg-type]
    ((_t, o),) = out.values()
    assert o.status == "failed" and "frozen" in o.detail, o.detail
    assert b.pending == {} and str(cg) in b.backoff.failures
    assert names(cg) == ["legacy_hook", "sd_devices"]
    (cg / "cgroup.freeze").write_text("0")
    again, access = b.sweep([frozen], svc)  # type: ignore[arg-type]
    assert again == {} and access[(frozen[0].container_id, GPU.numbers)] is False  # held
    assert verdicts(cg, nodes)[(195, 0)] is False


def test_sweep_dry_run_changes_nothing(base: Path, nodes: dict[Any, Path]) -> None:
    lost = scope(base, "lost", (HOOK, b"legacy_hook"), (SD_LOST, b"sd_devices"))
    b = bridges({})
    out, _ = b.sweep([lost], types.SimpleNamespace(apply=ChangeExecutor(dry_run=True)))  # type: ignore[arg-type]
    ((_t, o),) = out.values()
    assert o.status == "dry-run" and "195:0" in o.detail
    assert names(lost[0].cgroup_v2) == ["legacy_hook", "sd_devices"]
    assert verdicts(lost[0].cgroup_v2, nodes)[(195, 0)] is False
