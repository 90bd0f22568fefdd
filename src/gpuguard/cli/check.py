"""`gpuguard check`: the checkpoint and device steps once, and kubelet's pre-start hook."""

from __future__ import annotations

import argparse
import json
from typing import Any

from gpuguard import exitcodes
from gpuguard.cli.args import _config, _inventory_path, _log, _opt, _root
from gpuguard.errors import GpuguardError


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
