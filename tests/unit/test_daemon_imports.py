"""`gpuguard daemon` leaves the optional backend it never uses unloaded (RSS at idle):
dbus-next's GLib main loop, while everything it does use still loads, the Prometheus
client included (blocking `ssl` too once cost every metric: its exposition imports it)."""

from __future__ import annotations

import subprocess
import sys

from conftest import REPO

PROBE = """
import sys
from gpuguard.cli import daemon as cli
cli._skip_unused_backends()
import asyncio
import dbus_next
from dbus_next.aio import MessageBus
from gpuguard.daemon import Daemon
from gpuguard.steps.registry import build_steps
build_steps()
import importlib.util
from gpuguard.metrics import make_metrics
have_client = importlib.util.find_spec("prometheus_client") is not None
metrics = "ok" if (make_metrics() is not None) == have_client else "lost"
loaded = [m for m in sys.modules if m.split(".")[0] in cli.UNUSED_IN_DAEMON
          and sys.modules[m] is not None]
print(",".join(loaded) or "none", asyncio.run(asyncio.sleep(0, "ran")), metrics)
"""


def test_daemon_imports_leave_glib_unloaded_and_keep_metrics() -> None:
    assert set(cli_unused()) == {"gi"}
    p = subprocess.run(
        [sys.executable, "-c", PROBE],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={"PYTHONPATH": str(REPO / "src"), "PATH": "/usr/bin:/bin"},
        check=False,
    )
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.split() == ["none", "ran", "ok"]


def cli_unused() -> tuple[str, ...]:
    from gpuguard.cli import daemon as cli

    return cli.UNUSED_IN_DAEMON
