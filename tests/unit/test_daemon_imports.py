"""`gpuguard daemon` leaves what it never uses unloaded (RSS at idle): dbus-next's GLib
main loop, asyncio's TLS (`ssl`), and OpenSSL's hashes where Python has its own, while
everything it does use still loads and works: the metrics (once lost when `ssl` was
blocked under prometheus_client, which the daemon no longer imports), the hashes of
MESSAGE_IDs and checkpoint digests, asyncio and dbus-next."""

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
from gpuguard.metrics import make_output
out = make_output()
out.metrics.observe_pass({"number": 1, "duration_ms": 5.0}, {})
metrics = "ok" if b"gpuguard_passes_total 1.0" in out.metrics.exposition() else "lost"
from gpuguard.catalog import message_id
from gpuguard.steps.checkpoint.reconcile import sha256
import hashlib, uuid
assert sha256(b"x") == "2d711642b726b04401627ca9fbac32f5c8530fb1903cc4db02258717921a4881"
assert message_id("x") == uuid.uuid5(uuid.UUID("5b0f3c2e-8d7a-4c1e-9f55-6a1d2b3c4e5f"), "x").hex
loaded = [m for m in sys.modules if m.split(".")[0] in cli.UNUSED_IN_DAEMON + ("prometheus_client",)
          and sys.modules[m] is not None]
builtin = all(any(n in sys.builtin_module_names for n in ns) for ns in cli.BUILTIN_HASHES)
openssl = sys.modules.get("_hashlib") is not None
hashes = "builtin" if not openssl else ("openssl" if not builtin else "openssl-loaded")
print(",".join(loaded) or "none", asyncio.run(asyncio.sleep(0, "ran")), metrics, hashes)
"""


def test_daemon_imports_leave_unused_backends_unloaded_and_keep_metrics_and_hashes() -> None:
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
    # OpenSSL's hashes stay only where Python has no sha1/sha256 of its own (RHEL).
    assert p.stdout.split() in (["none", "ran", "ok", "builtin"], ["none", "ran", "ok", "openssl"])


def cli_unused() -> tuple[str, ...]:
    from gpuguard.cli import daemon as cli

    return cli.UNUSED_IN_DAEMON
