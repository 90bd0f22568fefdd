"""`gpuguard daemon` leaves the optional backends it never uses unloaded (RSS at idle):
dbus-next's GLib main loop and asyncio's TLS, while everything it does use still loads."""

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
loaded = [m for m in sys.modules if m.split(".")[0] in cli.UNUSED_IN_DAEMON
          and sys.modules[m] is not None]
print(",".join(loaded) or "none", asyncio.run(asyncio.sleep(0, "ran")))
"""


def test_daemon_imports_leave_glib_and_ssl_unloaded() -> None:
    assert set(cli_unused()) == {"gi", "ssl"}
    p = subprocess.run(
        [sys.executable, "-c", PROBE],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={"PYTHONPATH": str(REPO / "src"), "PATH": "/usr/bin:/bin"},
        check=False,
    )
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.split() == ["none", "ran"]


def cli_unused() -> tuple[str, ...]:
    from gpuguard.cli import daemon as cli

    return cli.UNUSED_IN_DAEMON
