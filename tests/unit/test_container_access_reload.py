"""The reload's v1 sweep (steps/container_access/cgroupv1.py `CgroupV1.sweep`): each
known container read and written back before the next is read; only entitled nodes its
cgroup denies are written; a denial the scope's DeviceAllow= covers is left to the pass
(settle.py); a dry run writes nothing; one unreadable container does not stop the
others."""

from __future__ import annotations

import dataclasses
import os
import types
from pathlib import Path
from typing import AbstractSet, Any, Mapping, Sequence

import pytest

from gpuguard.devices.containers import ContainerCgroup
from gpuguard.devices.entitlement import Entitlement
from gpuguard.devices.rules import allows, parse_devices_list
from gpuguard.engine.executor import ChangeExecutor
from gpuguard.steps.container_access.cgroups import Cgroups
from gpuguard.steps.container_access.devcgroup import Swept
from gpuguard.steps.container_access.reconcile import CgroupV1Allow
from unit.test_devices_audit import CTL, GPU0, RUNC_LIST, UVM, _container, _ent

# devices.list follows the writes as the kernel's would (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("v1_kernel")

GIVEN = (GPU0, CTL, UVM)
INTACT = RUNC_LIST + "".join(n.allow_line("rw") + "\n" for n in GIVEN)
WIPED = RUNC_LIST + CTL.allow_line("rw") + "\n"  # the GPU and uvm lost, nvidiactl kept

Pair = tuple[ContainerCgroup, Entitlement]


def sweep_v1(
    pairs: Sequence[Pair], durable: Mapping[str, AbstractSet[str]], *, dry_run: bool
) -> Swept:
    svc: Any = types.SimpleNamespace(apply=ChangeExecutor(dry_run=dry_run))
    layouts = Cgroups()
    layouts.durable.update({u: set(n) for u, n in durable.items()})
    return layouts.v1.sweep(pairs, svc)


def _pair(tmp_path: Path, i: int, devices_list: str, unit: bool = True) -> Pair:
    cg = tmp_path / f"cg{i}"
    cg.mkdir()
    (cg / "devices.list").write_text(devices_list)
    (cg / "devices.allow").write_text("")
    c = dataclasses.replace(
        _container(driver="systemd", unit=unit), container_id=f"{i:064x}", cgroup_v1_devices=cg
    )
    return c, dataclasses.replace(_ent(GIVEN), container_id=c.container_id)


def _admitted(p: Pair) -> set[str]:
    c, _ = p
    assert c.cgroup_v1_devices is not None
    rules = parse_devices_list((c.cgroup_v1_devices / "devices.list").read_text())
    return {n.numbers for n in GIVEN if allows(rules, n.type, n.major, n.minor, "rw")}


def test_regrants_exactly_what_each_lost(tmp_path: Path) -> None:
    pairs = [_pair(tmp_path, 0, WIPED), _pair(tmp_path, 1, INTACT), _pair(tmp_path, 2, WIPED)]
    s = sweep_v1(pairs, {}, dry_run=False)
    assert s.looked == tuple(pairs)
    written = s.written()  # each write read back
    assert list(written) == [pairs[0][0].container_id, pairs[2][0].container_id]
    (t0, _), (t1, _) = written.values()
    assert t0 <= t1
    for cid, (_t, o) in written.items():
        assert o.status == "done", o.detail
        assert isinstance(o.action, CgroupV1Allow)
        assert o.action.numbers == (GPU0.numbers, UVM.numbers)  # not nvidiactl
        assert o.action.rules == (GPU0.allow_line("rw"), UVM.allow_line("rw"))
        assert o.action.container_id == cid
    assert all(_admitted(p) == {n.numbers for n in GIVEN} for p in pairs)
    # the verdicts as read, before the writes: what the journal's audit reports
    assert s.readings.access[(pairs[0][0].container_id, GPU0.numbers)] is False
    assert s.readings.access[(pairs[1][0].container_id, GPU0.numbers)] is True
    assert set(s.readings.rules) == {p[0].container_id for p in pairs}


def test_a_denial_the_scope_grants_waits_for_the_pass(tmp_path: Path) -> None:
    """Read inside systemd's deny-all-then-allow apply: not a loss, nothing written."""
    covered, bare = _pair(tmp_path, 0, WIPED), _pair(tmp_path, 1, WIPED, unit=False)
    unit = covered[0].unit
    assert unit is not None
    s = sweep_v1([covered, bare], {unit: {GPU0.numbers}}, dry_run=False)
    # the scope: uvm only (its GPU is covered); the container without a unit: both
    written = s.written()
    assert list(written) == [covered[0].container_id, bare[0].container_id]
    covered_o, bare_o = (o for _t, o in written.values())
    assert covered_o.action.numbers == (UVM.numbers,)  # type: ignore[attr-defined]
    assert bare_o.action.numbers == (GPU0.numbers, UVM.numbers)  # type: ignore[attr-defined]
    assert s.readings.access[(covered[0].container_id, GPU0.numbers)] is None
    assert s.readings.access[(covered[0].container_id, UVM.numbers)] is False
    assert GPU0.numbers not in _admitted(covered)
    assert _admitted(bare) == {n.numbers for n in GIVEN}


def test_dry_run_writes_nothing(tmp_path: Path) -> None:
    p = _pair(tmp_path, 0, WIPED)
    s = sweep_v1([p], {}, dry_run=True)
    ((_t, o),) = s.written().values()
    assert o.status == "dry-run" and o.detail.startswith("would write ")
    assert _admitted(p) == {CTL.numbers}
    assert p[0].cgroup_v1_devices is not None
    assert (p[0].cgroup_v1_devices / "devices.allow").read_text() == ""


def test_unreadable_or_gone_containers_are_skipped(tmp_path: Path) -> None:
    fifo, gone, ok = (_pair(tmp_path, i, WIPED) for i in range(3))
    assert fifo[0].cgroup_v1_devices is not None and gone[0].cgroup_v1_devices is not None
    (fifo[0].cgroup_v1_devices / "devices.list").unlink()
    os.mkfifo(fifo[0].cgroup_v1_devices / "devices.list")
    (gone[0].cgroup_v1_devices / "devices.list").unlink()
    s = sweep_v1([fifo, gone, ok], {}, dry_run=False)
    assert list(s.written()) == [ok[0].container_id]
    assert "devices.list" in s.readings.broken[fifo[0].container_id]
    assert gone[0].container_id not in s.readings.broken
    assert _admitted(ok) == {n.numbers for n in GIVEN}
