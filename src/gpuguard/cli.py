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

EPILOG = """exit codes: 0 healthy or repaired; 1 problems found and left (dry-run, policy);
2 usage or configuration error; 3 corrupt or unreadable input (nothing modified);
4 no NVIDIA driver/NVML (use --inventory); 5 kubelet could not be coordinated;
70 internal error. See gpuguard(8)."""


def _common() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
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
    )
    g.add_argument(
        "--log-json",
        action="store_true",
        default=argparse.SUPPRESS,
        help="log JSON lines to stderr even under journald",
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
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
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
    ins.add_argument("--json", action="store_true")
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
    st.add_argument("--json", action="store_true")
    sub.add_parser("catalog", parents=[common], help="print the journal message catalog")
    return parser


def _opt(args: argparse.Namespace, name: str, default: Any = None) -> Any:
    return getattr(args, name, default)


def _log(args: argparse.Namespace, cfg: Any = None) -> Any:
    from gpuguard.log import EventLog

    default = cfg.daemon.log_level if cfg is not None else "info"
    return EventLog.auto(
        level=_opt(args, "log_level", default), force_json=_opt(args, "log_json", False)
    )


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
    from gpuguard.check import CheckSettings, run_check
    from gpuguard.inventory import load_inventory

    root = _root(args)
    cfg = _config(args, root)
    log = _log(args, cfg)
    inventory = load_inventory(_inventory_path(args, cfg))
    k = cfg.kubelet
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
    )
    from gpuguard.oneshot import driver_loaded
    from gpuguard.snapshot import HostSnapshot

    # One snapshot for the whole run, and the steps in the daemon's order
    # (passes.STEP_ORDER): the device steps, then the checkpoint.
    snapshot = HostSnapshot(root, k.checkpoint_path)
    devices = None
    if args.only is None and driver_loaded(root) and _checkpoint_usable(snapshot):
        import asyncio

        from gpuguard.oneshot import OneShotServices, run_device_steps
        from gpuguard.systemd import bus_address_for

        svc = OneShotServices(
            root, cfg, log, settings.dry_run, _opt(args, "bus") or bus_address_for(root.prefix)
        )
        devices = asyncio.run(run_device_steps(svc, inventory, snapshot))
    report = run_check(root, inventory, settings, log, snapshot)
    doc = report.to_json()
    code = report.exit_code
    if devices is not None:
        findings, outcomes = devices
        doc["devices"] = {
            "findings": [f.to_json() for f in findings],
            "outcomes": [o.to_json() for o in outcomes],
        }
        left = [o for o in outcomes if o.status not in ("done", "skipped")]
        if (left or (findings and not outcomes)) and code == exitcodes.OK:
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
    rows = container_status(root, cfg, inventory)
    daemon = daemon_status(root)
    if args.json:
        print(json.dumps({"daemon": daemon, "containers": rows}, indent=2))
    else:
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
            print(f"  pod {r['pod_uid']} {r['container_id'][:12]} {', '.join(r['nodes'])}: {what}")
            for p in r["problems"]:
                print(f"    {p}")
    bad = any(r["access"] != "ok" or r["missing"] for r in rows)
    return exitcodes.FINDINGS if bad else exitcodes.OK


def cmd_daemon(args: argparse.Namespace) -> int:
    import asyncio

    from gpuguard.daemon import Daemon
    from gpuguard.notify import Notifier
    from gpuguard.steps import build_steps

    root = _root(args)
    cfg = _config(args, root)
    log = _log(args, cfg)
    daemon = Daemon(
        root=root,
        config=cfg,
        config_path=_opt(args, "config"),
        log=log,
        notifier=Notifier(),
        inventory_path=_opt(args, "inventory"),
        bus_address=_opt(args, "bus"),
        steps=build_steps(),  # in passes.STEP_ORDER, which says why
        dry_run=args.dry_run,
        udev=not args.no_udev,
    )
    return asyncio.run(daemon.run())


def cmd_config(args: argparse.Namespace) -> int:
    cfg = _config(args, _root(args))
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
    from gpuguard.reconcilers.checkpoint import analyse

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


COMMANDS = {
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


def main(argv: Optional[Sequence[str]] = None) -> int:
    if VENDOR_DIR not in sys.path and os.path.isdir(VENDOR_DIR):
        sys.path.append(VENDOR_DIR)
    parser = build_parser()
    args = parser.parse_args(argv)
    name = args.command
    if name == "checkpoint":
        name = f"checkpoint-{args.checkpoint_command}"
    try:
        return COMMANDS[name](args)
    except GpuguardError as e:
        print(f"gpuguard: {e.message}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return exitcodes.OK
