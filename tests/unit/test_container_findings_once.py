"""The container access step logs each finding once per pass: what its fast path (the
re-grant right after a daemon-reload) logged, the full pass that follows does not log or
count again. Under --dry-run nothing is written, so both see the same denial."""

from __future__ import annotations

import asyncio
import dataclasses
import io
import json
from pathlib import Path
from typing import Any, Optional

from gpuguard.config import Config
from gpuguard.devices.rules import parse_devices_list
from gpuguard.engine.executor import ChangeExecutor
from gpuguard.engine.oneshot import OneShotServices
from gpuguard.engine.passes import PassContext, Work
from gpuguard.host.paths import Root
from gpuguard.journal.log import EventLog
from gpuguard.steps.container_access import ContainerAccessStep
from gpuguard.steps.container_access.observe import AccessView
from gpuguard.steps.container_access.reconcile import verdicts_from_rules
from unit.test_devices_audit import CID, CTL, GPU0, HOST, RUNC_LIST, _container, _ent


class SameView:
    """The observer, as both of its views find the host: one container denied its GPU."""

    def __init__(self, view: AccessView) -> None:
        self.view = view
        self.fast_views = 0

    def fast_view(self, root: Root) -> AccessView:
        self.fast_views += 1
        return self.view

    def observe(self, *_: Any) -> Optional[AccessView]:
        return self.view


def one_pass(
    tmp_path: Path, view: AccessView, *, urgent: bool = True, observer: Optional[SameView] = None
) -> tuple[list[dict[str, Any]], PassContext]:
    out = io.StringIO()
    cfg = Config()
    cfg = dataclasses.replace(cfg, devices=dataclasses.replace(cfg.devices, durable_grants=False))
    svc = OneShotServices(
        Root(tmp_path),
        cfg,
        EventLog(stream=out, level="debug"),
        apply=ChangeExecutor(dry_run=True),
        bus_address="",
    )
    step = ContainerAccessStep()
    step.state.observer = observer or SameView(view)  # type: ignore[assignment]

    async def no_inventory() -> None:
        return None

    ctx = PassContext(
        Work(frozenset({"container_access"}), ("systemd:reload",), 0, 0, urgent=urgent),
        no_inventory,
    )
    asyncio.run(step(svc, ctx))
    return [json.loads(line) for line in out.getvalue().splitlines()], ctx


def test_a_finding_of_the_fast_path_is_logged_and_counted_once(tmp_path: Path) -> None:
    c = dataclasses.replace(_container(), cgroup_v1_devices=tmp_path / "devices" / CID)
    rules = parse_devices_list(RUNC_LIST)  # runc's defaults: the GPU was taken away
    view = AccessView(
        (c,), {c.key: _ent((GPU0, CTL))}, verdicts_from_rules(CID, HOST, rules), {CID: rules}
    )
    entries, ctx = one_pass(tmp_path, view)
    denied = [e for e in entries if e.get("kind") == "container-device-denied"]
    assert denied, entries  # the fast path did log it
    keys = [(e["kind"], e.get("DEVICE"), e["msg"]) for e in denied]
    assert len(keys) == len(set(keys)), keys
    found = [(f.kind, f.summary) for f in ctx.findings]
    assert len(found) == len(set(found)), found
    assert len([e for e in entries if e.get("kind") == "container-device-denied"]) == len(
        [f for f in ctx.findings if f.kind == "container-device-denied"]
    )


def test_a_pass_without_an_urgent_mark_repairs_in_the_full_pass_alone(tmp_path: Path) -> None:
    """A pass for new scopes or the periodic audit skips the known-containers look (0.1
    ms per container on the loop, a burst of starts brings a pass every few hundred
    ms): the full pass finds, logs and repairs the same denial, once."""
    c = dataclasses.replace(_container(), cgroup_v1_devices=tmp_path / "devices" / CID)
    rules = parse_devices_list(RUNC_LIST)
    view = AccessView(
        (c,), {c.key: _ent((GPU0, CTL))}, verdicts_from_rules(CID, HOST, rules), {CID: rules}
    )
    quiet = SameView(view)
    entries, ctx = one_pass(tmp_path, view, urgent=False, observer=quiet)
    assert quiet.fast_views == 0
    denied = [e for e in entries if e.get("kind") == "container-device-denied"]
    assert denied and len(denied) == len({(e.get("DEVICE"), e["msg"]) for e in denied})
    assert [o.action.kind for o in ctx.outcomes] == ["cgroup-v1-allow"]
    reload = SameView(view)
    one_pass(tmp_path, view, urgent=True, observer=reload)
    assert reload.fast_views == 1


def test_observe_mode_journals_a_lasting_loss_once(tmp_path: Path) -> None:
    """Nothing is repaired under observe mode, so the loss lasts: journaled when it
    appears, not again by the fast path of every later daemon-reload (a damaged node
    journaled the same lines per event)."""
    c = dataclasses.replace(_container(), cgroup_v1_devices=tmp_path / "devices" / CID)
    rules = parse_devices_list(RUNC_LIST)
    view = AccessView(
        (c,), {c.key: _ent((GPU0, CTL))}, verdicts_from_rules(CID, HOST, rules), {CID: rules}
    )
    out = io.StringIO()
    cfg = Config()
    cfg = dataclasses.replace(cfg, devices=dataclasses.replace(cfg.devices, durable_grants=False))
    svc = OneShotServices(
        Root(tmp_path),
        cfg,
        EventLog(stream=out, level="info"),
        apply=ChangeExecutor(dry_run=True),
        bus_address="",
    )
    step = ContainerAccessStep()
    step.state.observer = SameView(view)  # type: ignore[assignment]

    async def no_inventory() -> None:
        return None

    said = []
    for _ in range(3):
        ctx = PassContext(
            Work(frozenset({"container_access"}), ("systemd:reload",), 0, 0, urgent=True),
            no_inventory,
        )
        asyncio.run(step(svc, ctx))
        lines = [json.loads(line) for line in out.getvalue().splitlines()]
        out.seek(0)
        out.truncate()
        said.append([e for e in lines if e.get("kind") == "container-device-denied"])
        assert [f for f in ctx.findings if f.kind == "container-device-denied"]  # still found
    assert said[0] and said[1:] == [[], []], said
