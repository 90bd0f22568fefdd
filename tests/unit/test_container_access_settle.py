"""A denial of a node the container's scope already grants (DeviceAllow=) is judged
again once systemd's apply has settled: systemd re-applies a scope's device policy as
"deny all, then each entry" at every daemon-reload, reexec and `runc update`, and a pass
that reads devices.list inside that window must neither report a loss nor write.

The regression behind it: test_container_access_runc.py::
test_systemd_driver_update_and_reload_wipe_daemon_restores[v1] once saw a re-grant
("something rewrote the container's device cgroup") for a durably granted container:
the pass after a daemon-reload read its devices.list while the next `runc update` had
systemd re-apply it."""

from __future__ import annotations

import asyncio
import dataclasses
import io
import json
from pathlib import Path
from typing import Any, Optional

import pytest

from gpuguard.config import Config
from gpuguard.devices.rules import parse_devices_list
from gpuguard.engine.executor import ChangeExecutor
from gpuguard.engine.oneshot import OneShotServices
from gpuguard.engine.passes import PassContext, Work
from gpuguard.host.paths import Root
from gpuguard.host.systemd import Systemd
from gpuguard.journal.log import EventLog
from gpuguard.steps.container_access import ContainerAccessStep
from gpuguard.steps.container_access.observe import AccessView
from gpuguard.steps.container_access.reconcile import verdicts_from_rules
from gpuguard.steps.container_access.settle import covered_denials
from unit.test_devices_audit import CID, CTL, GPU0, GPU1, RUNC_LIST, UVM, UVMT, _container, _ent

# devices.list follows the writes as the kernel's would (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("v1_kernel")

GIVEN = (GPU0, CTL, UVM, UVMT)
# What systemd leaves once its apply is done: runc's defaults and the scope's entries.
APPLIED = RUNC_LIST + "".join(n.allow_line("rw") + "\n" for n in GIVEN)


class FileView:
    """The observer, reading the container's devices.list file at every call (both the
    fast path's view and the full pass's)."""

    def __init__(self, tmp_path: Path) -> None:
        self.c = dataclasses.replace(
            _container(driver="systemd", unit=True), cgroup_v1_devices=tmp_path / "cg"
        )
        self.c.cgroup_v1_devices.mkdir()  # type: ignore[union-attr]
        (tmp_path / "cg/devices.allow").write_text("")

    @property
    def devices_list(self) -> Path:
        return self.c.cgroup_v1_devices / "devices.list"  # type: ignore[operator]

    def _view(self) -> AccessView:
        # what devices.allow was given is admitted, as the kernel would
        allowed = (self.devices_list.parent / "devices.allow").read_text().replace("rw", "rw\n")
        rules = parse_devices_list(self.devices_list.read_text() + allowed)
        access = verdicts_from_rules(CID, GIVEN, rules)
        return AccessView((self.c,), {self.c.key: _ent(GIVEN)}, access, {CID: rules})

    def fast_view(self, root: Root) -> AccessView:
        return self._view()

    def observe(self, *_: Any) -> Optional[AccessView]:
        return self._view()


def one_pass(
    tmp_path: Path, durable: set[str], on_settle: Optional[str]
) -> tuple[list[dict[str, Any]], PassContext, FileView, list[str]]:
    """One pass (its fast path, then the full pass) while devices.list holds runc's
    defaults only, as inside systemd's apply; `durable`: the numbers the scope's
    DeviceAllow= grants; `on_settle`: what the file holds once the apply has ended
    (None: unchanged, a real loss)."""
    out = io.StringIO()
    svc = OneShotServices(
        Root(tmp_path),
        Config(),
        EventLog(stream=out, level="debug"),
        apply=ChangeExecutor(dry_run=False),
        bus_address="",
    )
    obs = FileView(tmp_path)
    obs.devices_list.write_text(RUNC_LIST)
    step = ContainerAccessStep()
    step.state.observer = obs  # type: ignore[assignment]
    step.state.durable[str(obs.c.unit)] = set(durable)
    settled: list[str] = []

    async def settle(_sd: Optional[Systemd], unit: str) -> None:
        settled.append(unit)
        if on_settle is not None:
            obs.devices_list.write_text(on_settle)

    step.state.settle = settle

    async def no_inventory() -> None:
        return None

    ctx = PassContext(
        Work(frozenset({"container_access"}), ("systemd: daemon-reload",), 0, 0, urgent=True),
        no_inventory,
    )
    asyncio.run(step(svc, ctx))
    return [json.loads(line) for line in out.getvalue().splitlines()], ctx, obs, settled


def _kinds(entries: list[dict[str, Any]]) -> list[str]:
    return [e.get("kind", "") for e in entries]


def test_a_durably_granted_node_caught_mid_apply_is_neither_reported_nor_written(
    tmp_path: Path,
) -> None:
    entries, ctx, obs, settled = one_pass(tmp_path, {n.numbers for n in GIVEN}, APPLIED)
    assert settled == [obs.c.unit]
    assert "container-device-denied" not in _kinds(entries), entries
    assert not ctx.findings and not ctx.outcomes
    assert (tmp_path / "cg/devices.allow").read_text() == ""  # nothing written
    debug = [e["msg"] for e in entries if e.get("kind") == "debug"]
    assert any("195:0 was denied while systemd re-applied" in m for m in debug), debug


def test_a_durably_granted_node_still_denied_once_settled_is_a_loss_and_repaired(
    tmp_path: Path,
) -> None:
    # e.g. the scope names /dev/char/195:0 but systemd could not resolve the link
    entries, ctx, _obs, settled = one_pass(tmp_path, {n.numbers for n in GIVEN}, None)
    assert len(settled) == 1
    denied = [e for e in entries if e.get("kind") == "container-device-denied"]
    assert {e["DEVICE_NUMBERS"] for e in denied} == {n.numbers for n in GIVEN}
    written = (tmp_path / "cg/devices.allow").read_text()
    assert "c 195:0 rw" in written and "c 195:1" not in written
    assert [o.action.kind for o in ctx.outcomes if o.status == "done"] == ["cgroup-v1-allow"]


def test_a_node_the_scope_does_not_grant_is_repaired_without_waiting(tmp_path: Path) -> None:
    entries, ctx, _obs, settled = one_pass(tmp_path, set(), APPLIED)
    assert settled == []
    assert "container-device-denied" in _kinds(entries)
    assert "c 195:0 rw" in (tmp_path / "cg/devices.allow").read_text()
    assert [o.action.kind for o in ctx.outcomes if o.status == "done"] == ["cgroup-v1-allow"]


def test_only_denials_of_granted_nodes_are_covered() -> None:
    c = _container(driver="systemd", unit=True)
    ent = _ent(GIVEN)
    access = {(CID, n.numbers): n is not CTL for n in GIVEN}  # ctl denied
    access[(CID, GPU0.numbers)] = False  # and the GPU
    unit = str(c.unit)
    cases = [
        ({}, frozenset()),
        ({unit: {GPU1.numbers}}, frozenset()),  # the scope grants another GPU
        ({unit: {GPU0.numbers}}, {(CID, GPU0.numbers)}),
        ({unit: {n.numbers for n in GIVEN}}, {(CID, GPU0.numbers), (CID, CTL.numbers)}),
        ({"other.scope": {GPU0.numbers}}, frozenset()),
    ]
    for durable, want in cases:
        assert covered_denials([c], {c.key: ent}, access, durable) == want, durable
    no_unit = _container(driver="cgroupfs")
    assert not covered_denials([no_unit], {no_unit.key: ent}, access, {unit: {GPU0.numbers}})
