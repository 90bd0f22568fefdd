"""The new-scope fast path's figures in the status file: where a grant's time went after
systemd announced the scope, and the grant's call alone (sent -> systemd's reply), so
a slow grant during a burst of starts shows whether systemd kept it waiting."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, Optional

import pytest

from gpuguard.config import Config
from gpuguard.engine.executor import ChangeExecutor
from gpuguard.host.paths import Root
from gpuguard.journal.log import EventLog
from gpuguard.model import Outcome
from gpuguard.steps.container_access import newscope
from gpuguard.steps.container_access.durable import plan_durable
from gpuguard.steps.container_access.newscope import NewScope, NewScopes
from gpuguard.steps.container_access.observe import AccessView
from gpuguard.steps.container_access.reconcile import UnitDeviceAllow
from unit.test_devices_audit import CTL, GPU0, _container, _ent


class Svc:
    root = Root(Path("/nonexistent"))
    config = Config()
    log = EventLog(level="error")
    apply = ChangeExecutor()
    bus_address = ""
    systemd = object()  # a bus is up; the grant below is the test's own


def test_the_status_shows_the_grants_call_apart(monkeypatch: pytest.MonkeyPatch) -> None:
    c = _container(driver="systemd", unit=True)
    assert c.unit is not None
    ent = _ent((GPU0, CTL))
    links = frozenset(n.dev_char for n in ent.nodes)  # systemd resolves DeviceAllow= by them
    found = NewScope(view=AccessView((c,), {c.key: ent}, {}, {}), container=c, links=links)
    monkeypatch.setattr(newscope, "read_new_scope", lambda *a, **kw: found)
    monkeypatch.setattr(newscope, "detect_layout", lambda root: None)

    async def slow_grant(a: UnitDeviceAllow, svc: Any, sd: Optional[Any]) -> Outcome:
        await asyncio.sleep(0.05)  # systemd busy with a burst of starts
        return Outcome(a, "done", "DeviceAllow=...")

    scopes = NewScopes(plan_durable, slow_grant, {}, lambda o: None)

    async def main() -> None:
        scopes.announce(Svc(), c.unit, (), lambda why: None)  # type: ignore[arg-type]
        for _ in range(400):
            if scopes.queue.idle:
                return
            await asyncio.sleep(0.005)
        raise AssertionError("the scope was never handled")

    asyncio.run(main())
    st = scopes.status()
    assert st["granted"] == 1 and st["handled"] == 1
    call_p50, call_p99 = st["call_ms"]  # type: ignore[misc]
    granted_p50, _ = st["granted_ms"]  # type: ignore[misc]
    assert 45 <= call_p50 == call_p99 <= granted_p50  # asyncio may wake a tick early
    ready_p50, _ = st["ready_ms"]  # type: ignore[misc]
    assert ready_p50 <= granted_p50 - call_p50 + 0.2  # sent after it was found ready
