"""Each container is served by exactly one cgroup layout (steps/container_access/
cgroups.py): v1 wherever a v1 devices cgroup exists (a hybrid host's containers have a
cgroup2 path too, and must never get a v2 bridge or program replacement), v2 where only
a cgroup2 path does, none without either. The layout plans the container's re-grant."""

from __future__ import annotations

import dataclasses
import types
from typing import Any

from gpuguard.config import Config
from gpuguard.engine.executor import ChangeExecutor
from gpuguard.steps.container_access.cgroups import Cgroups
from gpuguard.steps.container_access.observe import AccessView
from unit.test_devices_audit import CID, CTL, GPU0, _container, _ent

GIVEN = (GPU0, CTL)


def test_each_container_has_exactly_one_layout() -> None:
    layouts = Cgroups()
    hybrid = _container(driver="systemd", v1=True, unit=True)
    unified = _container(driver="systemd", v1=False, unit=True)
    neither = dataclasses.replace(unified, cgroup_v2=None)
    assert hybrid.cgroup_v2 is not None  # both paths: v1 decides
    assert layouts.of(hybrid) is layouts.v1 and not layouts.v2.claims(hybrid)
    assert layouts.of(unified) is layouts.v2 and not layouts.v1.claims(unified)
    assert layouts.of(neither) is None
    for c in (hybrid, unified, neither):
        assert sum(cg.claims(c) for cg in layouts.all) == (0 if c is neither else 1)


def test_the_v2_layout_leaves_a_hybrid_hosts_containers_alone() -> None:
    """A hybrid scope denied its GPU: a v1 write repairs it, never a v2 bridge."""
    layouts = Cgroups()
    hybrid = _container(driver="systemd", v1=True, unit=True)
    view = AccessView((hybrid,), {hybrid.key: _ent(GIVEN)}, {(CID, GPU0.numbers): False}, {})
    svc: Any = types.SimpleNamespace(
        config=Config(), systemd=object(), apply=ChangeExecutor(dry_run=True)
    )
    assert layouts.v2.regrant_fast(view, svc) == ([], False)
    assert layouts.v2.before_durable(view, frozenset({str(hybrid.unit)}), svc) == []
    assert layouts.v2.bridges.pending == {}
    (a,) = layouts.v1.plan_regrant(hybrid, (GPU0,), "inplace")
    assert a.kind == "cgroup-v1-allow"


def test_a_scope_less_v2_container_gets_what_v2remedy_says() -> None:
    v2 = Cgroups().v2
    c = _container(v1=False)
    kinds = {r: [a.kind for a in v2.plan_regrant(c, (GPU0,), r)] for r in
             ("report", "inplace", "restart-container")}  # fmt: skip
    assert kinds == {"report": ["v2-report-only"], "inplace": ["v2-program-replace"],
                     "restart-container": ["restart-container"]}  # fmt: skip
    scope = _container(driver="systemd", v1=False, unit=True)
    assert v2.plan_regrant(scope, (GPU0,), "inplace") == ()  # its DeviceAllow= repairs it
