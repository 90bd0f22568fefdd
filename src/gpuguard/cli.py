"""Command line. Imports are lazy so `gpuguard check` on a healthy node stays fast."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any, Optional, Sequence

from gpuguard import __version__, exitcodes
from gpuguard.errors import GpuguardError

# `gpuguard status`: what admits a container's devices (ContainerCgroup.mechanism)
MECHANISM_TEXT = {
    "v1-rule": "v1 rule",
    "scope-device-allow": "scope DeviceAllow=",
    "own-program": "own BPF program",
}

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


def build_parser() -> argparse.ArgumentParser:
    common = _common()
    parser = argparse.ArgumentParser(
        prog="gpuguard",
        description="Keeps GPUs usable on Kubernetes nodes across reboots, daemon-reloads "
        "and kubelet/containerd restarts.",
        epilog=EPILOG,
        parents=[common],
    )
    parser.add_argument("--version", action="version", version=f"gpuguard {__version__}")
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

    sub.add_parser(
        "config", parents=[common], help="check the configuration and print the effective values"
    )
    st = sub.add_parser(
        "status", parents=[common], help="per GPU container: is its device access intact?"
    )
    st.add_argument(
        "--json", action="store_true", help="print the containers and their access as JSON"
    )
    sub.add_parser("catalog", parents=[common], help="print the journal message catalog")
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
    from gpuguard.npd import CONDITIONS, DEFAULT_MAX_AGE, DEFAULT_MAX_LENGTH

    npd.add_argument("condition", choices=[c.name for c in CONDITIONS])
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


def _opt(args: argparse.Namespace, name: str, default: Any = None) -> Any:
    return getattr(args, name, default)


def _log(args: argparse.Namespace, cfg: Any = None, root: Any = None) -> Any:
    from gpuguard.log import EventLog

    default = cfg.daemon.log_level if cfg is not None else "info"
    log = EventLog.auto(
        level=_opt(args, "log_level", default),
        force_json=_opt(args, "log_json", False),
        root=root.prefix if root is not None else Path("/"),
    )
    log.route_modules()  # devices/, steps/ ... log through it, debug included
    for warning in cfg.warnings if cfg is not None else ():
        log.warning(warning)  # a deprecated key, still read
    return log


def _root(args: argparse.Namespace) -> Any:
    from gpuguard.paths import Root

    # abspath, not resolve(): /proc/<pid>/root (another mount namespace's root) is a
    # magic link that resolves to "/", which would silently mean this host's files.
    return Root(Path(os.path.abspath(_opt(args, "root", "/"))))


def _config(args: argparse.Namespace, root: Any) -> Any:
    from gpuguard.config import load_config

    return load_config(root, path=_opt(args, "config"))


def _inventory_path(args: argparse.Namespace, cfg: Any) -> Optional[Path]:
    explicit = _opt(args, "inventory")
    if explicit is not None:
        return Path(explicit)
    return Path(cfg.inventory.file) if cfg.inventory.file else None


def cmd_check(args: argparse.Namespace) -> int:
    if not args.kubelet_stopped:
        return _check(args, _root(args), None)
    from gpuguard.steps.checkpoint.kubelet_hook import FAILED, HookRun

    root = _root(args)
    hook = HookRun(root)
    try:
        return _check(args, root, hook)
    except GpuguardError as e:
        hook.finish(FAILED, e.message, e.exit_code)
        raise


def _simulation(args: argparse.Namespace) -> str:
    if _opt(args, "inventory") is None or args.allow_kubelet_restart:
        return ""
    return (
        "the GPU inventory comes from --inventory (a simulation), so a running kubelet is "
        "not restarted or stopped; pass --allow-kubelet-restart to allow it"
    )


def _check(args: argparse.Namespace, root: Any, hook: Any) -> int:
    from gpuguard.errors import NoDriverError
    from gpuguard.inventory import load_inventory
    from gpuguard.steps.checkpoint import CheckSettings, run_check

    cfg = _config(args, root)
    log = _log(args, cfg, root)
    k = cfg.kubelet
    if hook is not None:
        hook.start(root.path(k.checkpoint_path))
    try:
        inventory = load_inventory(_inventory_path(args, cfg))
    except NoDriverError as e:
        if hook is None:
            raise
        return int(hook.skipped(log, e.message))
    settings = CheckSettings(
        checkpoint_path=k.checkpoint_path,
        resources=tuple(k.resources),
        policy=args.policy or k.policy,
        backup_dir=k.backup_dir,
        backup_keep=k.backup_keep,
        kubelet_unit=k.unit,
        restart_kubelet=k.restart_kubelet and not args.no_restart,
        dry_run=args.dry_run or cfg.daemon.dry_run,
        kubelet_stopped=args.kubelet_stopped,
        bus_address=_opt(args, "bus"),
        reason=args.reason,
        simulation=_simulation(args),
    )
    from gpuguard.oneshot import driver_loaded
    from gpuguard.snapshot import HostSnapshot

    # One snapshot for the whole run, and the steps in the daemon's order
    # (registry.CHECK_ORDER): the device steps, then the checkpoint.
    snapshot = HostSnapshot(root, k.checkpoint_path)
    devices = None
    if args.only is None and driver_loaded(root) and _checkpoint_usable(snapshot):
        import asyncio

        from gpuguard.oneshot import OneShotServices, run_device_steps
        from gpuguard.steps.container_access.reconcile import FINDING_UNREADABLE
        from gpuguard.systemd import bus_address_for

        svc = OneShotServices(
            root, cfg, log, settings.dry_run, _opt(args, "bus") or bus_address_for(root.prefix)
        )
        devices = asyncio.run(run_device_steps(svc, inventory, snapshot))
    report = run_check(root, inventory, settings, log, snapshot)
    if hook is not None:
        _hook_result(hook, report, log)
    doc = report.to_json()
    code = report.exit_code
    if devices is not None:
        findings, outcomes = devices
        doc["devices"] = {
            "findings": [f.to_json() for f in findings],
            "outcomes": [o.to_json() for o in outcomes],
        }
        left = [o for o in outcomes if o.status not in ("done", "skipped")]
        # A container gpuguard could not read is a problem left, whatever else it repaired.
        unread = [f for f in findings if f.kind == FINDING_UNREADABLE]
        if (left or unread or (findings and not outcomes)) and code == exitcodes.OK:
            code = exitcodes.FINDINGS
        doc["exit_code"] = code
    if args.json:
        print(json.dumps(doc, indent=2))
    else:
        print(report.render())
        for f in doc.get("devices", {}).get("findings", []):
            print(f"{f['severity'] + ':':11} {f['summary']}")
        for o in doc.get("devices", {}).get("outcomes", []):
            print(f"{o['status'] + ':':11} {o['kind']} {o['target']}: {o['detail']}")
    return code


def _hook_result(hook: Any, report: Any, log: Any) -> None:
    """What kubelet's pre-start hook leaves for the caller that restarted kubelet."""
    from gpuguard.steps.checkpoint import kubelet_hook as kh

    statuses = {o.status for o in report.outcomes}
    if report.result.startswith("no checkpoint file"):
        hook.skipped(log, report.result)
    elif statuses == {"done"}:
        hook.finish(kh.REPAIRED, report.result, report.exit_code)
    elif report.exit_code == exitcodes.OK and not report.actions:
        hook.finish(kh.HEALTHY, report.result, report.exit_code)
    elif report.exit_code == exitcodes.FINDINGS:
        hook.finish(kh.NOT_REPAIRED, report.result, report.exit_code)
    else:
        hook.finish(kh.FAILED, report.result, report.exit_code)


def _checkpoint_usable(snapshot: Any) -> bool:
    """False when the checkpoint step will stop the run with exit 3 ("nothing was
    modified"): then the device steps must not act first."""
    from gpuguard.errors import BadInputError

    try:
        loaded = snapshot.checkpoint()
    except BadInputError:
        return False
    return loaded is None or bool(loaded.valid)


def cmd_status(args: argparse.Namespace) -> int:
    from gpuguard.errors import NoDriverError
    from gpuguard.inventory import load_inventory
    from gpuguard.oneshot import container_status, daemon_status

    root = _root(args)
    cfg = _config(args, root)
    try:
        inventory = load_inventory(_inventory_path(args, cfg))
    except NoDriverError:
        inventory = None
    from gpuguard.summary import node_summary, render

    rows = container_status(root, cfg, inventory)
    daemon = daemon_status(root)
    summary = node_summary(root, rows)
    if args.json:
        print(json.dumps({"summary": summary, "daemon": daemon, "containers": rows}, indent=2))
    else:
        print("\n".join(render(summary)))
        if daemon is None:
            print("daemon:     not running (no status file)")
        else:
            last = daemon.get("last_pass") or {}
            print(
                f"daemon:     pid {daemon['pid']}, {daemon['passes']} pass(es); last: "
                f"{', '.join(last.get('reasons', [])[:2])} with "
                f"{len(last.get('findings', []))} finding(s)"
            )
        print(f"containers: {len(rows)} with GPUs")
        for r in rows:
            what = r["access"] if r["access"] != "denied" else "DENIED " + ", ".join(r["denied"])
            how = MECHANISM_TEXT.get(r["mechanism"], r["mechanism"])
            print(
                f"  pod {r['pod_uid']} {r['container_id'][:12]} {', '.join(r['nodes'])}: {what}"
                f" ({r['layout']}, {how})"
            )
            for p in r["problems"]:
                print(f"    {p}")
    bad = any(r["access"] != "ok" or r["missing"] for r in rows)
    return exitcodes.FINDINGS if bad else exitcodes.OK


def cmd_daemon(args: argparse.Namespace) -> int:
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


def cmd_config(args: argparse.Namespace) -> int:
    cfg = _config(args, _root(args))
    for warning in cfg.warnings:
        print(f"gpuguard: warning: {warning}", file=sys.stderr)
    sys.stdout.write(cfg.render())
    return exitcodes.OK


def _entry_json(e: Any) -> dict[str, Any]:
    ids: Any
    if e.shape == "v2":
        ids = {
            str(node): list(group) if group is not None else None for node, group in e.device_ids
        }
    elif e.device_ids is None:
        ids = None
    else:
        ids = list(e.device_ids) if e.shape == "v1" else {}
    return {
        "pod_uid": e.pod_uid,
        "container_name": e.container_name,
        "resource_name": e.resource_name,
        "device_ids": ids,
        "alloc_resp_bytes": None if e.alloc_resp is None else len(e.alloc_resp),
    }


def cmd_checkpoint_inspect(args: argparse.Namespace) -> int:
    from gpuguard.checkpoint import load
    from gpuguard.errors import BadInputError, NoDriverError
    from gpuguard.inventory import load_inventory
    from gpuguard.steps.checkpoint.reconcile import analyse

    root = _root(args)
    cfg = _config(args, root)
    doc: dict[str, Any] = {"file": str(args.file)}
    try:
        loaded = load(args.file)
    except BadInputError as e:
        doc.update(valid=False, error=e.message)
        if args.json:
            print(json.dumps(doc, indent=2))
        print(f"gpuguard: {e.message}", file=sys.stderr)
        return e.exit_code
    cp = loaded.checkpoint
    doc.update(
        format=cp.format,
        checksum_stored=cp.checksum,
        checksum_computed=loaded.computed,
        valid=loaded.valid,
        error=loaded.problem or None,
        registered_devices={
            r: list(ids) if ids is not None else None for r, ids in cp.registered or ()
        },
        entries=[_entry_json(e) for e in cp.entries or ()],
        inventory=None,
        stale=None,
    )
    try:
        inventory = load_inventory(_inventory_path(args, cfg))
    except NoDriverError as e:
        doc["inventory_error"] = e.message
    else:
        analysis = analyse(cp, inventory, tuple(cfg.kubelet.resources))
        doc["inventory"] = inventory.source
        doc["stale"] = [f.to_json() for f in analysis.findings]
    if args.json:
        print(json.dumps(doc, indent=2))
    else:
        print(_render_inspect(doc))
    return exitcodes.OK if loaded.valid else exitcodes.BAD_INPUT


def _render_inspect(doc: dict[str, Any]) -> str:
    valid = "valid" if doc["valid"] else f"INVALID: {doc['error']}"
    lines = [
        f"file:       {doc['file']}",
        f"format:     {doc['format']}",
        f"checksum:   stored {doc['checksum_stored']}, "
        f"computed {doc['checksum_computed']} ({valid})",
        "registered:",
    ]
    for res, ids in doc["registered_devices"].items():
        lines.append(f"  {res}: {', '.join(ids) if ids else ids}")
    lines.append(f"entries:    {len(doc['entries'])}")
    for e in doc["entries"]:
        ids = e["device_ids"]
        shown = (
            " ".join(f"numa {n}: {', '.join(v or [])}" for n, v in ids.items())
            if isinstance(ids, dict)
            else ", ".join(ids or [])
        )
        lines.append(f"  pod {e['pod_uid']} {e['container_name']} {e['resource_name']}: {shown}")
    if doc["stale"] is None:
        lines.append(f"stale:      unknown ({doc.get('inventory_error', 'no inventory')})")
    elif not doc["stale"]:
        lines.append(f"stale:      none (inventory: {doc['inventory']})")
    else:
        lines.append(f"stale:      (inventory: {doc['inventory']})")
        lines += [f"  {f['summary']}" for f in doc["stale"]]
    return "\n".join(lines)


def cmd_checkpoint_canonical(args: argparse.Namespace) -> int:
    from gpuguard.checkpoint import load, marshal

    loaded = load(args.file)
    if not loaded.valid:
        print(f"gpuguard: warning: {loaded.problem}", file=sys.stderr)
    sys.stdout.buffer.write(marshal(loaded.checkpoint))
    sys.stdout.flush()
    return exitcodes.OK


def cmd_catalog(args: argparse.Namespace) -> int:
    from gpuguard.catalog import render_catalog

    sys.stdout.write(render_catalog())
    return exitcodes.OK


def cmd_doctor(args: argparse.Namespace) -> int:
    from gpuguard.commands import run
    from gpuguard.doctor.run import run_doctor
    from gpuguard.inventory import load_inventory

    root = _root(args)
    cfg = _config(args, root)
    try:
        inventory = load_inventory(_inventory_path(args, cfg))
    except GpuguardError:
        inventory = None  # the driver and gpu-count checks say what is missing

    def runner(argv: Sequence[str]) -> str:
        return run(argv, timeout=5.0).stdout

    report = run_doctor(root, inventory, cfg.kubelet.checkpoint_path, runner)
    print(json.dumps(report.to_json(), indent=2) if args.json else report.render())
    return report.exit_code


def cmd_npd(args: argparse.Namespace) -> int:
    from gpuguard.npd import answer, one_line

    code, message = answer(_root(args), args.condition, max_age=args.max_age)
    print(one_line(message, args.max_length))
    return code


def cmd_metrics(args: argparse.Namespace) -> int:
    from gpuguard.metrics import RUNTIME_FILE
    from gpuguard.metrics_http import print_file, serve

    path = _root(args).path(RUNTIME_FILE)
    return serve(path, args.listen) if args.serve else print_file(path)


COMMANDS = {
    "metrics": cmd_metrics,
    "npd": cmd_npd,
    "doctor": cmd_doctor,
    "check": cmd_check,
    "daemon": cmd_daemon,
    "config": cmd_config,
    "status": cmd_status,
    "checkpoint-inspect": cmd_checkpoint_inspect,
    "checkpoint-canonical": cmd_checkpoint_canonical,
    "catalog": cmd_catalog,
}


# The .deb/.rpm ship nvidia-ml-py (and dbus-next where the distribution lacks it) here.
# Appended, not inserted: a distribution package of the same module wins.
VENDOR_DIR = "/usr/lib/gpuguard/vendor"


def _debug_wanted(args: Optional[argparse.Namespace]) -> bool:
    """--log-level debug, or LogLevel=debug in a configuration that still loads."""
    if args is None:
        return False
    if _opt(args, "log_level") is not None:
        return bool(_opt(args, "log_level") == "debug")
    try:
        return bool(_config(args, _root(args)).daemon.log_level == "debug")
    except Exception:  # the configuration itself may be what failed
        return False


def internal_error(e: BaseException, *, trace: bool) -> int:
    """The one line for a bug (exit 70, never 1: 1 means "problems left"); the trace only
    when asked for, since a hostile input must never print pages of Python."""
    from gpuguard.numparse import cut

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
        parser = build_parser()
        args = parser.parse_args(argv)
        name = args.command
        if name == "checkpoint":
            name = f"checkpoint-{args.checkpoint_command}"
        return COMMANDS[name](args)
    except GpuguardError as e:
        print(f"gpuguard: {e.message}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return exitcodes.OK
    except Exception as e:  # every command, the daemon included: a bug, in one line
        return internal_error(e, trace=_debug_wanted(args))
