"""Command line, `gpuguard.cli:main` with its parser (here). Imports are lazy so
`gpuguard check` on a healthy node stays fast. One module per command group: `check.py`
(the checkpoint and device steps once, kubelet's pre-start hook), `status.py`,
`daemon.py` (the daemon's objects built and passed in), `checkpoint.py`, `protect.py`
(`gpuguard protect`, run by the maintainer scripts before each daemon-reload they cause),
`switch.py` (`gpuguard disable`/`enable`, the off switch: host/offswitch.py), `readmit.py`;
what they share, the root, configuration and log from the arguments, in `args.py`."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from pathlib import Path
from typing import Callable, Optional, Sequence

from gpuguard import exitcodes, version_line
from gpuguard.cli.args import (
    config_from,
    config_or_fallback,
    inventory_path,
    log_from,
    nvml_lookup,
    opt,
    root_from,
)
from gpuguard.errors import GpuguardError
from gpuguard.host.echo import cut

__all__ = ["COMMANDS", "build_parser", "log_from", "main"]

Command = Callable[[argparse.Namespace], int]

EPILOG = """exit codes: 0 healthy or repaired; 1 problems found and left (dry-run, policy);
2 usage or configuration error; 3 corrupt or unreadable input (nothing modified);
4 no NVIDIA driver/NVML (use --inventory); 5 kubelet could not be coordinated
(or a repair during its restart not verified); 70 internal error. See gpuguard(8)."""


class _CommandParser(argparse.ArgumentParser):
    """A command's parser: an option it does not know is reported with its own usage.

    By default argparse hands a subcommand's leftovers to the top-level parser, which
    prints `usage: gpuguard [-h] ...`, not the usage of the command that was mistyped."""

    def parse_known_args(  # type: ignore[override]
        self, args: Optional[Sequence[str]] = None, namespace: Optional[argparse.Namespace] = None
    ) -> tuple[argparse.Namespace, list[str]]:
        ns, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return ns, extras


def _common() -> _CommandParser:
    p = _CommandParser(add_help=False)
    g = p.add_argument_group("host")
    g.add_argument(
        "--root",
        type=Path,
        default=argparse.SUPPRESS,
        help="host root prefix; every path is taken under it (default /)",
    )
    g.add_argument(
        "--inventory",
        type=Path,
        default=argparse.SUPPRESS,
        help="JSON GPU inventory standing in for NVML (tests, simulations)",
    )
    g.add_argument(
        "--config",
        type=Path,
        default=argparse.SUPPRESS,
        help="configuration file (default ROOT/etc/gpuguard/gpuguard.conf)",
    )
    g.add_argument(
        "--bus",
        default=argparse.SUPPRESS,
        help="system bus address (default unix:path=ROOT/run/dbus/system_bus_socket)",
    )
    g.add_argument(
        "--log-level",
        choices=["debug", "info", "notice", "warning", "error"],
        default=argparse.SUPPRESS,
        help="the least severe messages logged (default from config: info)",
    )
    g.add_argument(
        "--log-json",
        action="store_true",
        default=argparse.SUPPRESS,
        help="log JSON lines to stderr (also GPUGUARD_LOG_FORMAT=json); the journal gets "
        "every entry either way when the host has journald",
    )
    return p


def _deadline(text: str) -> float:
    """--deadline: seconds, 0.1 to 3600."""
    try:
        value = float(text) if len(text) <= 16 and text.isascii() else -1.0
    except ValueError:
        value = -1.0
    if not 0.1 <= value <= 3600:  # NaN fails this too
        raise argparse.ArgumentTypeError("expected seconds between 0.1 and 3600")
    return value


def build_parser() -> argparse.ArgumentParser:
    common = _common()
    parser = argparse.ArgumentParser(
        prog="gpuguard",
        description="Keeps GPUs usable on Kubernetes nodes across reboots, daemon-reloads "
        "and kubelet/containerd restarts.",
        epilog=EPILOG,
        parents=[common],
    )
    parser.add_argument("--version", action="version", version=version_line())
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_CommandParser)
    sub.required = True

    c = sub.add_parser(
        "check",
        parents=[common],
        epilog=EPILOG,
        help="check and repair this node once (the kubelet checkpoint, ...)",
    )
    c.add_argument("--dry-run", action="store_true", help="print the plan; change nothing")
    c.add_argument("--json", action="store_true", help="print the report as JSON")
    c.add_argument("--only", choices=["checkpoint"], default=None, help="run only this check")
    c.add_argument(
        "--policy",
        choices=["rewrite", "delete", "report"],
        default=None,
        help="what to do with a stale checkpoint (default from config: rewrite)",
    )
    c.add_argument(
        "--kubelet-stopped",
        action="store_true",
        help="we run as kubelet's ExecStartPre= hook: repair in place, never restart kubelet",
    )
    c.add_argument(
        "--deadline",
        type=_deadline,
        default=None,
        metavar="SECONDS",
        help="with --kubelet-stopped: give up after this long (default 10), so kubelet "
        "starts whatever is on disk",
    )
    c.add_argument(
        "--no-restart", action="store_true", help="never restart or stop kubelet; report instead"
    )
    c.add_argument(
        "--allow-kubelet-restart",
        action="store_true",
        help="with --inventory (a simulation), still restart or stop a running kubelet for "
        "the repair; without it such a run reports the plan and exits 1",
    )
    c.add_argument("--reason", default="check", help=argparse.SUPPRESS)

    cp = sub.add_parser("checkpoint", parents=[common], help="inspect kubelet checkpoint files")
    cps = cp.add_subparsers(dest="checkpoint_command", metavar="ACTION")
    cps.required = True
    ins = cps.add_parser(
        "inspect",
        parents=[common],
        help="format, checksums, validity, contents and stale IDs of FILE",
    )
    ins.add_argument("file", type=Path)
    ins.add_argument("--json", action="store_true", help="print the inspection as JSON")
    can = cps.add_parser(
        "canonical",
        parents=[common],
        help="print the exact bytes kubelet would write for FILE's data",
    )
    can.add_argument("file", type=Path)

    d = sub.add_parser(
        "daemon",
        parents=[common],
        epilog=EPILOG,
        help="run the event-driven daemon (what gpuguard.service starts)",
    )
    d.add_argument(
        "--dry-run", action="store_true", help="log the plan of every pass; change nothing"
    )
    d.add_argument("--no-udev", action="store_true", help="do not listen to udev events")

    cf = sub.add_parser(
        "config", parents=[common], help="check the configuration and print the effective values"
    )
    cf.add_argument(
        "--check",
        action="store_true",
        help="only check it: no output when it is valid; otherwise the file and line, exit 2 "
        "(what `systemctl reload gpuguard` runs first); an unknown section or key is a "
        "warning (the daemon ignores it)",
    )
    cf.add_argument(
        "--strict",
        action="store_true",
        help="an unknown section or key is an error too (exit 2): for CI, not for nodes "
        "that may be rolled back",
    )
    dis = sub.add_parser(
        "disable",
        parents=[common],
        help="turn gpuguard off on this node (the off switch /etc/gpuguard/disabled): the "
        "daemon stops, kubelet's pre-start hook and driver loads change nothing; kept "
        "across reboots and upgrades",
    )
    dis.add_argument(
        "--reason", default="", help="why (shown by status, doctor, the journal and the metrics)"
    )
    sub.add_parser(
        "enable",
        parents=[common],
        help="turn gpuguard back on: remove the off switch and start gpuguard.service",
    )
    st = sub.add_parser(
        "status", parents=[common], help="per GPU container: is its device access intact?"
    )
    st.add_argument(
        "--json", action="store_true", help="print the containers and their access as JSON"
    )
    pr = sub.add_parser(
        "protect",
        parents=[common],
        help="before a daemon-reload: write each GPU container's present grant as its "
        "scope's drop-in (repairs nothing; the package runs it)",
    )
    pr.add_argument("--dry-run", action="store_true", help="print what it would write")
    pr.add_argument("--reason", default="", help="why (journaled with each write)")
    sub.add_parser("catalog", parents=[common], help="print the journal message catalog")
    sub.add_parser(
        "readmit",
        parents=[common],
        help="the re-admission bridge of gpuguard-readmit.service (kubelet 1.26+: GPU pods "
        "back after a reboot before the device plugin registers)",
    )
    doc = sub.add_parser(
        "doctor",
        parents=[common],
        help="is this node exposed to F1-F4, and why? (one line per check; changes nothing)",
        epilog="exit codes: 0 nothing exposed or broken (unknown checks are listed); "
        "1 a check is exposed or broken; 2 usage or configuration error; 70 internal error.",
    )
    doc.add_argument("--json", action="store_true", help="print the verdicts as JSON")
    npd = sub.add_parser(
        "npd",
        parents=[common],
        help="answer one node-problem-detector condition from the daemon's status file",
        epilog="exit codes (node-problem-detector's): 0 condition False (OK), 1 True (the "
        "problem is present), 2 unknown (no or unreadable status, daemon gone, result too "
        "old). The first output line is the message.",
    )
    from gpuguard.reporting.npd_names import DEFAULT_MAX_AGE, DEFAULT_MAX_LENGTH, NAMES

    npd.add_argument("condition", choices=list(NAMES))
    me = sub.add_parser(
        "metrics",
        parents=[common],
        help="print the daemon's Prometheus metrics, or serve them (gpuguard-metrics.socket)",
    )
    me.add_argument(
        "--serve",
        action="store_true",
        help="serve GET /metrics on the socket systemd passed (or --listen)",
    )
    me.add_argument("--listen", metavar="HOST:PORT", help="listen here instead (by hand, tests)")
    npd.add_argument(
        "--max-age",
        type=float,
        default=DEFAULT_MAX_AGE,
        metavar="SECONDS",
        help="a step result older than this is unknown (default %(default).0f)",
    )
    npd.add_argument(
        "--max-length",
        type=int,
        default=DEFAULT_MAX_LENGTH,
        metavar="BYTES",
        help="message length (NPD's max_output_length, default %(default)d)",
    )
    return parser


def cmd_config(args: argparse.Namespace) -> int:
    cfg = config_from(args, root_from(args), strict=args.strict)
    for warning in cfg.warnings:
        print(f"gpuguard: warning: {warning}", file=sys.stderr)
    if not args.check:
        sys.stdout.write(cfg.render())
    return exitcodes.OK


def cmd_catalog(args: argparse.Namespace) -> int:
    from gpuguard.journal.catalog import render_catalog

    sys.stdout.write(render_catalog())
    return exitcodes.OK


def cmd_doctor(args: argparse.Namespace) -> int:
    from gpuguard.doctor.run import run_doctor
    from gpuguard.host.commands import run
    from gpuguard.host.inventory import load_inventory

    root = root_from(args)
    cfg = config_or_fallback(args, root)
    from gpuguard.host.inventory import DriverPendingError

    driver_wait = ""
    try:
        inventory = load_inventory(inventory_path(args, cfg), nvml_lookup(root, cfg))
    except DriverPendingError as e:  # a GPU Operator node's driver pod not there yet
        inventory, driver_wait = None, e.message
    except GpuguardError:
        inventory = None  # the driver and gpu-count checks say what is missing

    def runner(argv: Sequence[str]) -> str:
        return run(argv, timeout=5.0).stdout

    report = run_doctor(
        root,
        inventory,
        cfg.kubelet.checkpoint_path,
        runner,
        kubelet_units=cfg.systemd.kubelet_units,
        observe=cfg.daemon.observe,
        driver_wait=driver_wait,
        driver_root=cfg.inventory.driver_root or "",
    )
    print(json.dumps(report.to_json(), indent=2) if args.json else report.render())
    return report.exit_code


def cmd_npd(args: argparse.Namespace) -> int:
    from gpuguard.reporting.npd import answer, one_line

    code, message = answer(root_from(args), args.condition, max_age=args.max_age)
    print(one_line(message, args.max_length))
    return code


def cmd_metrics(args: argparse.Namespace) -> int:
    from gpuguard.host.offswitch import read_off_switch
    from gpuguard.reporting.metrics_http import print_file, serve
    from gpuguard.reporting.metrics_state import STATE_FILE

    root = root_from(args)
    path = root.path(STATE_FILE)
    if args.serve:
        return serve(path, args.listen, lambda: read_off_switch(root) is not None)
    return print_file(path, read_off_switch(root) is not None)


def _command(module: str, name: str) -> Command:
    """A command of gpuguard/cli/<module>.py, imported when it runs: the daemon does not
    carry the other commands' code (each process runs one command)."""

    def run(args: argparse.Namespace) -> int:
        fn: Command = getattr(importlib.import_module(f"gpuguard.cli.{module}"), name)
        return fn(args)

    return run


COMMANDS: dict[str, Command] = {
    "metrics": cmd_metrics,
    "npd": cmd_npd,
    "doctor": cmd_doctor,
    "check": _command("check", "cmd_check"),
    "daemon": _command("daemon", "cmd_daemon"),
    "config": cmd_config,
    "status": _command("status", "cmd_status"),
    "checkpoint-inspect": _command("checkpoint", "cmd_checkpoint_inspect"),
    "checkpoint-canonical": _command("checkpoint", "cmd_checkpoint_canonical"),
    "catalog": cmd_catalog,
    "disable": _command("switch", "cmd_disable"),
    "enable": _command("switch", "cmd_enable"),
    "protect": _command("protect", "cmd_protect"),
    "readmit": _command("readmit", "cmd_readmit"),
}


# The .deb/.rpm ship nvidia-ml-py (and dbus-next where the distribution lacks it) here.
# Appended, not inserted: a distribution package of the same module wins.
VENDOR_DIR = "/usr/lib/gpuguard/vendor"
ERROR_MAX = 500  # characters of the one error line


def _debug_wanted(args: Optional[argparse.Namespace]) -> bool:
    """--log-level debug, or LogLevel=debug in a configuration that still loads."""
    if args is None:
        return False
    if opt(args, "log_level") is not None:
        return bool(opt(args, "log_level") == "debug")
    try:
        return bool(config_from(args, root_from(args)).daemon.log_level == "debug")
    except Exception:  # the configuration itself may be what failed
        return False


def internal_error(e: BaseException, *, trace: bool) -> int:
    """The one line for a bug (exit 70, never 1: 1 means "problems left"); the trace only
    when asked for, since a hostile input must never print pages of Python."""
    from gpuguard.host.numparse import cut

    if trace:
        import traceback

        traceback.print_exception(type(e), e, e.__traceback__, file=sys.stderr)
    text = cut(" ".join(str(e).split()), 200)
    print(
        f"gpuguard: internal error: {type(e).__name__}: {text} (a bug: please report it; "
        "run with --log-level debug or LogLevel=debug for the trace)",
        file=sys.stderr,
    )
    return exitcodes.INTERNAL


def main(argv: Optional[Sequence[str]] = None) -> int:
    args: Optional[argparse.Namespace] = None
    try:
        if VENDOR_DIR not in sys.path and os.path.isdir(VENDOR_DIR):
            sys.path.append(VENDOR_DIR)
        if (sys.argv[1:] if argv is None else list(argv))[:1] == ["daemon"]:
            # before the parser: argparse's help formatter imports shutil, and shutil
            # the compressors the daemon leaves out
            from gpuguard.cli.daemon import skip_unused_backends

            skip_unused_backends()
        parser = build_parser()
        args = parser.parse_args(argv)
        name = args.command
        if name == "checkpoint":
            name = f"checkpoint-{args.checkpoint_command}"
        return COMMANDS[name](args)
    except GpuguardError as e:
        # one line of a few hundred bytes, whatever the error echoes (host/echo.py)
        print(f"gpuguard: {cut(e.message, ERROR_MAX)}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return exitcodes.OK
    except Exception as e:  # every command, the daemon included: a bug, in one line
        return internal_error(e, trace=_debug_wanted(args))
