"""A source that crashes is a bug: the daemon does not go on without it, it raises
(the CLI exits 70 and systemd restarts the unit)."""

from __future__ import annotations

import asyncio
import io
from pathlib import Path

import pytest

from gpuguard.config import load_config
from gpuguard.engine.daemon import Daemon
from gpuguard.host import aio
from gpuguard.host.notify import Notifier
from gpuguard.host.paths import Root
from gpuguard.journal.log import EventLog


class CrashingSource:
    """The systemd source's surface that Daemon.run uses; its run() fails once the
    daemon has started."""

    def __init__(self) -> None:
        self.first_attempt_done = aio.Event()  # built before the loop, as the real one
        self.client = None
        self.private = None
        self.stopped = False
        self.last_reload_via, self.reloads_acted = "", 0
        self.received: dict[str, list[int]] = {}

    async def run(self) -> None:
        self.first_attempt_done.set()
        await asyncio.sleep(0.2)
        raise RuntimeError("a bug in the source")

    def stop(self) -> None:
        self.stopped = True


def test_a_crashed_source_ends_the_daemon_with_its_exception(tmp_path: Path) -> None:
    root = Root(tmp_path)
    daemon = Daemon(
        root=root,
        config=load_config(root),
        config_path=None,
        log=EventLog(level="error", stream=io.StringIO()),
        notifier=Notifier(),
        inventory_path=None,
        bus_address="unix:path=/nonexistent",
        steps={},
    )
    source = CrashingSource()
    daemon.sd_source = source  # type: ignore[assignment]

    async def scenario() -> None:
        await asyncio.wait_for(daemon.run(), 10)

    with pytest.raises(RuntimeError, match="a bug in the source"):
        asyncio.run(scenario())
    assert daemon.passes >= 1 and source.stopped  # it had started, and stopped its source
