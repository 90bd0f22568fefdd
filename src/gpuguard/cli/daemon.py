"""`gpuguard daemon`: objects built here and passed in, then the loop."""

from __future__ import annotations

import argparse
import sys

from gpuguard.cli.args import _config, _log, _opt, _root
from gpuguard.errors import GpuguardError

# Optional backends the daemon's libraries load when they are installed and the daemon
# never uses: dbus-next's GLib main loop (PyGObject, ~4 MB resident) next to the asyncio
# one it uses. Marked absent before the first import, dbus-next takes the ImportError
# path it has for hosts without PyGObject. (`ssl` must stay: prometheus_client's
# exposition module imports it unconditionally, and without it there are no metrics.)
UNUSED_IN_DAEMON = ("gi",)


def _skip_unused_backends() -> None:
    for name in UNUSED_IN_DAEMON:
        sys.modules.setdefault(name, None)  # type: ignore[arg-type]


def cmd_daemon(args: argparse.Namespace) -> int:
    _skip_unused_backends()
    import asyncio

    from gpuguard.daemon import Daemon
    from gpuguard.metrics import make_output
    from gpuguard.notify import Notifier
    from gpuguard.sources import build_sources
    from gpuguard.steps.registry import build_steps
    from gpuguard.systemd import bus_address_for

    root = _root(args)
    try:
        cfg = _config(args, root)
    except GpuguardError as e:
        # Exit 2/3 stop the unit (RestartPreventExitStatus=): say why in its status line
        # and in the journal, since `systemctl status` is where an operator looks.
        Notifier().send(f"STATUS=not started: {e.message}")
        _log(args, None, root).event("config-invalid", e.message, level="error")
        raise
    log = _log(args, cfg, root)
    bus = _opt(args, "bus") or bus_address_for(root.prefix)
    daemon = Daemon(
        root=root,
        config=cfg,
        config_path=_opt(args, "config"),
        log=log,
        notifier=Notifier(),
        inventory_path=_opt(args, "inventory"),
        bus_address=bus,
        steps=build_steps(),  # steps/registry.py: every step, in STEP_ORDER, which says why
        sources=build_sources(root, cfg, log, bus, udev=not args.no_udev),
        dry_run=args.dry_run,
        metrics=make_output(),
    )
    return asyncio.run(daemon.run())
