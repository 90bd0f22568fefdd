"""No garbage collection inside the reload's repair window (gcpause.py): the daemon's
reload fast paths run with the collector off, and it is back on after them, also when
one raises; a collector someone else turned off stays off. A fast path that raises is
journaled with its step's name (GPUGUARD_RECONCILER, as the catalog shows)."""

from __future__ import annotations

import gc
import io
from pathlib import Path
from typing import Any

from gpuguard.config import load_config
from gpuguard.engine.daemon import Daemon
from gpuguard.engine.gcpause import collector_paused, freeze_long_lived, thaw
from gpuguard.host.notify import Notifier
from gpuguard.host.paths import Root
from gpuguard.journal.log import EventLog
from gpuguard.reporting.status_figures import FastPaths
from gpuguard.steps.events import Event, EventKind

SEEN: list[bool] = []


class FastStep:
    def __init__(self, name: str, fail: bool = False) -> None:
        self.name, self.fail = name, fail

    async def __call__(self, svc: Any, ctx: Any) -> None:
        pass

    def on_reload(self, svc: Any, signal: float) -> None:
        SEEN.append(gc.isenabled())
        if self.fail:
            raise RuntimeError("a bug in a fast path")

    def fast_status(self) -> FastPaths:
        return FastPaths()


def daemon(tmp_path: Path, steps: dict[str, Any]) -> tuple[Daemon, io.StringIO]:
    root = Root(tmp_path / "root")
    out = io.StringIO()
    d = Daemon(
        root=root,
        config=load_config(root),
        config_path=None,
        log=EventLog(stream=out),
        notifier=Notifier(""),
        inventory_path=tmp_path / "inventory.json",
        bus_address="unix:path=/nonexistent",
        steps=steps,
        step_order=list(steps),
    )
    return d, out


def test_reload_fast_paths_run_without_the_collector(tmp_path: Path) -> None:
    SEEN.clear()
    d, out = daemon(tmp_path, {"a": FastStep("a", fail=True), "b": FastStep("b")})
    assert gc.isenabled()
    d.on_event(Event(EventKind.SYSTEMD_RELOADED, "systemd: reload", True, at=1.0))
    assert SEEN == [False, False]  # the second ran too, after the first raised
    assert gc.isenabled()
    assert "reload fast path raised RuntimeError" in out.getvalue()


def test_a_collector_turned_off_elsewhere_stays_off() -> None:
    gc.disable()
    try:
        with collector_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_freeze_then_thaw_leaves_nothing_frozen() -> None:
    freeze_long_lived()
    try:
        assert gc.get_freeze_count() > 0
    finally:
        thaw()
    assert gc.get_freeze_count() == 0


def test_a_crashed_bridge_follow_up_names_its_step() -> None:
    """The reload's bridge follow-up runs as a task nobody awaits: a bug there is
    journaled as reconciler-crashed with the step's name, as the catalog shows."""
    import asyncio
    import types

    from gpuguard.steps.container_access.cgroups import Cgroups

    out = io.StringIO()
    bridges = Cgroups().v2.bridges

    async def boom(*_a: Any) -> None:
        raise RuntimeError("a bug in the follow-up")

    bridges._follow_up = boom  # type: ignore[method-assign]
    svc = types.SimpleNamespace(log=EventLog(stream=out))
    asyncio.run(bridges.follow_up(svc, (), (), lambda v: None))  # type: ignore[arg-type]
    assert "reload bridge follow-up raised RuntimeError" in out.getvalue()
