"""`gpuguard daemon` leaves what it never uses unloaded (RSS at idle): dbus-next's GLib
main loop, asyncio's TLS (`ssl`), OpenSSL's hashes where Python has its own, and, in its
default configuration, prometheus_client (which would bring `ssl` back): the daemon
writes its metrics' values as JSON and `gpuguard metrics` renders them. Everything it
does use still loads and works: the metrics file, the hashes of MESSAGE_IDs and
checkpoint digests, asyncio and dbus-next. With `[Metrics] TextfileDirectory=` set, the
textfile is rendered in the daemon, by prometheus_client (`ssl` allowed back for it)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from conftest import REPO

PROBE = """
import json, sys
from pathlib import Path
from gpuguard.cli import daemon as cli
cli.skip_unused_backends()
import asyncio
import dbus_next
from dbus_next.aio import MessageBus
from gpuguard.engine.daemon import Daemon
from gpuguard.steps.registry import build_steps
from gpuguard.reporting.metrics_output import MetricsOutput
from gpuguard.reporting.metrics_state import STATE_FILE, MetricsState
from gpuguard.host.paths import Root
from gpuguard.reporting.metrics_file import SPEC
from gpuguard.reporting.status import PassRecord, Status
from gpuguard.reporting.status_figures import FastPaths, ReloadSignal
build_steps()
root = Root(Path(sys.argv[1]))
def a_pass(n):
    p = PassRecord(n, ("start-up",), (), 0.0, 1.0, 2.0, 5.0, {}, (), (), None)
    return p, Status(1, 0.0, n, True, False, ReloadSignal(), p, p, FastPaths(), {}, ())
def loaded():
    names = cli.UNUSED_IN_DAEMON + ("prometheus_client",)
    return [m for m in sys.modules if m.split(".")[0] in names and sys.modules[m] is not None]
# the daemon's own wiring (cmd_daemon), the default configuration: no TextfileDirectory=
out = MetricsOutput(MetricsState(), renderer=cli._load_renderer)
assert out.publish(*a_pass(1), root, None) == []
doc = json.loads(root.path(STATE_FILE).read_text())
metrics = "ok" if doc["families"]["gpuguard_passes"][0]["value"] == 1.0 else "lost"
from gpuguard.journal.catalog import message_id
from gpuguard.steps.checkpoint.reconcile import sha256
import hashlib, uuid
assert sha256(b"x") == "2d711642b726b04401627ca9fbac32f5c8530fb1903cc4db02258717921a4881"
assert message_id("x") == uuid.uuid5(uuid.UUID("5b0f3c2e-8d7a-4c1e-9f55-6a1d2b3c4e5f"), "x").hex
default = ",".join(loaded()) or "none"
builtin = all(any(n in sys.builtin_module_names for n in ns) for ns in cli.BUILTIN_HASHES)
openssl = sys.modules.get("_hashlib") is not None
hashes = "builtin" if not openssl else ("openssl" if not builtin else "openssl-loaded")
# TextfileDirectory= set (at start or by a reload): the textfile, by prometheus_client
assert out.publish(*a_pass(2), root, "/textfile") == []
import prometheus_client
text = root.path("/textfile/gpuguard.prom").read_bytes()
registry = prometheus_client.CollectorRegistry(auto_describe=False)
registry.register(sys.modules["gpuguard.reporting.metrics"].StateCollector(SPEC.decode(root.path(STATE_FILE).read_bytes())))
textfile = "prometheus_client" if text == prometheus_client.generate_latest(registry) else "other"
textfile += "+created" if b"gpuguard_passes_created" in text else ""
print(default, asyncio.run(asyncio.sleep(0, "ran")), metrics, hashes, textfile,
      "ssl" if sys.modules.get("ssl") is not None else "no-ssl")
"""


def test_daemon_default_imports_neither_prometheus_client_nor_ssl_and_the_textfile_does(
    tmp_path: Path,
) -> None:
    assert set(cli_unused()) == {"gi", "ssl", "bz2", "lzma", "_elementtree"}
    (tmp_path / "run/gpuguard").mkdir(parents=True)
    (tmp_path / "textfile").mkdir()
    default, ran, metrics, hashes, textfile, ssl = probe(PROBE, str(tmp_path))
    assert (default, ran, metrics) == ("none", "ran", "ok")
    # OpenSSL's hashes stay only where Python has no sha1/sha256 of its own (RHEL).
    assert hashes in ("builtin", "openssl")
    assert (textfile, ssl) == ("prometheus_client+created", "ssl")


# What the daemon loads (cmd_daemon's imports, every step, the udev source) must leave
# these out: each was loaded for one call the daemon can make without it (bench/README.md).
STDLIB_NOT_IN_DAEMON = ("fractions", "decimal", "difflib", "uuid", "platform", "bz2", "lzma")
COMMANDS_NOT_IN_DAEMON = ("check", "checkpoint", "protect", "readmit", "status", "switch")
NOT_IN_DAEMON = (
    *STDLIB_NOT_IN_DAEMON,
    "pyexpat",
    *(f"gpuguard.cli.{c}" for c in COMMANDS_NOT_IN_DAEMON),
)

LEAN = """
import contextlib, io, sys
import gpuguard.cli
from gpuguard.cli import daemon as cli
# `gpuguard daemon` as far as its arguments: what main and argparse load on the way
with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()):
    gpuguard.cli.main(["daemon", "--help"])
import asyncio
from gpuguard.engine.daemon import Daemon
from gpuguard.host.workers import worker_pool
from gpuguard.reporting.metrics_output import MetricsOutput
from gpuguard.sources import build_sources
from gpuguard.sources.udev import *
from gpuguard.steps.registry import build_steps
import pyudev
build_steps()
from gpuguard.config.types import parse_timespan
from gpuguard.journal.catalog import message_id
spans = (parse_timespan("2s 500ms"), parse_timespan("1.5us"), parse_timespan("2.5us"))
ids = message_id("pass-complete")
loaded = sorted(m for m in sys.modules if sys.modules[m] is not None and m in NOT)
# dbus-next's introspection still parses: ElementTree's pure-Python parser, expat on demand
from dbus_next.introspection import Node
node = Node.parse('<node><interface name="a.b"><method name="C"/></interface></node>')
print(" ".join(loaded) or "none", spans, ids, node.interfaces[0].methods[0].name)
"""


def test_daemon_leaves_out_what_one_call_would_load() -> None:
    import uuid

    want_id = uuid.uuid5(uuid.UUID("5b0f3c2e-8d7a-4c1e-9f55-6a1d2b3c4e5f"), "pass-complete")
    got = probe(f"NOT = {NOT_IN_DAEMON!r}\n{LEAN}")
    assert got == ["none", "(2.5,", "2e-06,", "2e-06)", want_id.hex, "C"]


def probe(code: str, *args: str) -> list[str]:
    """The words `code` prints, run in a fresh interpreter on the repo's sources."""
    p = subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={"PYTHONPATH": str(REPO / "src"), "PATH": "/usr/bin:/bin"},
        check=False,
    )
    assert p.returncode == 0, p.stderr[-2000:]
    return p.stdout.split()


def cli_unused() -> tuple[str, ...]:
    from gpuguard.cli import daemon as cli

    return cli.UNUSED_IN_DAEMON
