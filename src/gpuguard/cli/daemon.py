"""`gpuguard daemon`: objects built here and passed in, then the loop."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from gpuguard.cli.args import config_from, log_from, opt, root_from
from gpuguard.errors import GpuguardError

if TYPE_CHECKING:
    from gpuguard.reporting.metrics_state import Render

# Optional backends the daemon's libraries load when they are installed and the daemon
# never uses (RSS at idle, bench/README.md): dbus-next's GLib main loop (PyGObject, ~4 MB
# resident) next to the asyncio one it uses, and asyncio's TLS support (`ssl`, libssl,
# ~2 MB: the daemon speaks TLS to nobody). Marked absent before the first import, each
# library takes the ImportError path it has for hosts without them. prometheus_client
# needs `ssl` (its exposition module imports it): _load_renderer() lets it load for the
# one configuration that renders in the daemon (reporting/metrics_state.py). Also the
# compressors `shutil` loads for its archive functions (bz2, lzma: 0.3 MB with their
# libraries) and ElementTree's C parser, which dbus-next's introspection module imports
# and the daemon never calls (ElementTree keeps its pure-Python parser: 0.15 MB).
UNUSED_IN_DAEMON = ("gi", "ssl", "bz2", "lzma", "_elementtree")
# OpenSSL's hashes (libcrypto, ~3 MB) where Python has its own sha1 and sha256 built in:
# hashlib then uses those (MESSAGE_IDs, checkpoint digests: 5.6 ms per MB instead of 1.0).
# RHEL's Python builds none of them in, so there hashlib keeps OpenSSL.
BUILTIN_HASHES = (("_sha1",), ("_sha2", "_sha256"))


def skip_unused_backends() -> None:
    for name in UNUSED_IN_DAEMON:
        sys.modules.setdefault(name, None)  # type: ignore[arg-type]
    if "hashlib" not in sys.modules and all(
        any(n in sys.builtin_module_names for n in names) for names in BUILTIN_HASHES
    ):
        sys.modules.setdefault("_hashlib", None)  # type: ignore[arg-type]


def _load_renderer() -> Render:
    """metrics.render for `[Metrics] TextfileDirectory=`, `ssl` allowed back first."""
    if "ssl" in sys.modules and sys.modules["ssl"] is None:
        del sys.modules["ssl"]
    from gpuguard.reporting.metrics_output import load_renderer

    return load_renderer()


def cmd_daemon(args: argparse.Namespace) -> int:
    skip_unused_backends()  # a no-op after main's (tests call cmd_daemon directly)
    import asyncio

    from gpuguard.host.memtrim import fix_mmap_threshold

    fix_mmap_threshold()  # big transient blocks from mmap, not the heap (memtrim.py)

    from gpuguard.engine.daemon import Daemon
    from gpuguard.engine.executor import ChangeExecutor
    from gpuguard.host.notify import Notifier
    from gpuguard.host.systemd import bus_address_for
    from gpuguard.host.workers import worker_pool
    from gpuguard.journal.conditions import REMINDER
    from gpuguard.reporting.metrics_output import MetricsOutput
    from gpuguard.reporting.metrics_state import MetricsState
    from gpuguard.sources import build_sources
    from gpuguard.steps.registry import build_steps

    root = root_from(args)
    try:
        cfg = config_from(args, root)
    except GpuguardError as e:
        # Exit 2/3 stop the unit (RestartPreventExitStatus=): say why in its status line
        # and in the journal, since `systemctl status` is where an operator looks.
        Notifier().send(f"STATUS=not started: {e.message}")
        log_from(args, None, root).event("config-invalid", e.message, level="error")
        raise
    log = log_from(args, cfg, root)
    log.repeat_window = REMINDER  # a plan repeated by every pass: once an hour
    bus = opt(args, "bus") or bus_address_for(root.prefix)
    daemon = Daemon(
        root=root,
        config=cfg,
        config_path=opt(args, "config"),
        log=log,
        notifier=Notifier(),
        inventory_path=opt(args, "inventory"),
        bus_address=bus,
        steps=build_steps(),  # steps/registry.py: every step, in STEP_ORDER, which says why
        sources=build_sources(root, cfg, log, bus, udev=not args.no_udev),
        apply=ChangeExecutor(dry_run=args.dry_run, observe=cfg.daemon.observe),
        metrics=MetricsOutput(MetricsState(), renderer=_load_renderer),
        executor=worker_pool(),
    )
    return asyncio.run(daemon.run())
