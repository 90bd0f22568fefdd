"""`gpuguard check`: the checkpoint and device steps once, and kubelet's pre-start hook."""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING, Mapping, Optional, Sequence

from gpuguard import exitcodes
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

if TYPE_CHECKING:  # loaded where used: a healthy kubelet hook stays fast
    from gpuguard.config import Config
    from gpuguard.engine.runner import StepResult
    from gpuguard.engine.snapshot import HostSnapshot
    from gpuguard.host.inventory import Inventory
    from gpuguard.host.offswitch import OffSwitch
    from gpuguard.host.paths import Root
    from gpuguard.journal.log import EventLog
    from gpuguard.model import Finding, Outcome
    from gpuguard.steps.checkpoint.kubelet_hook import HookRun
    from gpuguard.steps.checkpoint.memo import MemoKey
    from gpuguard.steps.checkpoint.report import CheckReport


def cmd_check(args: argparse.Namespace) -> int:
    from gpuguard.host.offswitch import read_off_switch

    root = root_from(args)
    off = read_off_switch(root)  # before the configuration: it works with a broken one
    if off is not None:
        return _disabled(args, root, off)
    if not args.kubelet_stopped:
        return _check(args, root, None)
    from gpuguard.steps.checkpoint.kubelet_hook import DEADLINE, FAILED, HookRun

    hook = HookRun(root)
    # kubelet waits for this hook: whatever is on disk, it ends within the deadline
    hook.arm(args.deadline or DEADLINE, getattr(args, "on_deadline", None))
    try:
        return _check(args, root, hook)
    except GpuguardError as e:
        hook.finish(FAILED, e.message, e.exit_code)
        raise
    finally:
        hook.disarm()


def _disabled(args: argparse.Namespace, root: Root, off: OffSwitch) -> int:
    """The off switch is set: kubelet's pre-start hook checks nothing and writes nothing
    (no result file either); a person's `gpuguard check` runs as a dry run."""
    log = log_from(args, None, root)
    if args.kubelet_stopped:
        log.event(
            "disabled-skip",
            f"kubelet pre-start: {off.describe()}; the kubelet checkpoint was not checked",
            level="notice",
            fields={"REASON": off.reason, "OFF_SWITCH": off.path},
        )
        return exitcodes.OK
    log.event(
        "disabled-skip",
        f"{off.describe()}: this check is a dry run and changes nothing "
        "(`gpuguard enable` turns repairs back on)",
        level="notice",
        fields={"REASON": off.reason, "OFF_SWITCH": off.path},
    )
    args.dry_run = True
    return _check(args, root, None)


def _simulation(args: argparse.Namespace, cfg: Config, inventory: Inventory) -> str:
    from gpuguard.steps.checkpoint.report import simulation

    cli = opt(args, "inventory") is not None
    return simulation(inventory.source, cli, cfg.inventory, allow=args.allow_kubelet_restart)


def _check(args: argparse.Namespace, root: Root, hook: Optional[HookRun]) -> int:
    from gpuguard.errors import NoDriverError
    from gpuguard.host.inventory import load_inventory

    # A dry run changes nothing: it runs even on a broken configuration (without the
    # broken file, which it names); a real check never acts on a partial one.
    cfg = config_or_fallback(args, root) if args.dry_run else config_from(args, root)
    k = cfg.kubelet
    # kubelet's pre-start hook with a healthy, unchanged checkpoint says nothing to the
    # journal: the event log (and its imports) only when something may be said.
    fast = hook is not None and args.only == "checkpoint" and not cfg.warnings
    fast = fast and hook is not None and not hook.unusable
    log = None if fast else log_from(args, cfg, root)
    if hook is not None:
        hook.start(root.path(k.checkpoint_path))
    try:
        inventory = load_inventory(inventory_path(args, cfg), nvml_lookup(root, cfg))
    except NoDriverError as e:
        if hook is None:
            raise
        return int(hook.skipped(log or log_from(args, cfg, root), e.message))
    memo_key = None
    if fast and hook is not None:
        # kubelet's pre-start hook: unchanged since the last verified healthy state?
        from gpuguard.steps.checkpoint import memo

        read = memo.checkpoint_sha256(root.path(k.checkpoint_path))
        if read is not None:
            memo_key = memo.memo_key(k.checkpoint_path, read[1], inventory, k.resources)
            if memo.unchanged(root, memo_key, hook.unusable):
                return _hook_unchanged(args, root, hook, inventory, k.checkpoint_path)
    from gpuguard.steps.checkpoint import CheckpointStep, CheckSettings

    log = log or log_from(args, cfg, root)
    log.facts_as_text = False  # the report below prints them: each fact once
    for why in hook.unusable if hook is not None else ():
        log.warning(f"kubelet pre-start: ignoring {why}")  # one line per unusable file
    from gpuguard.engine.executor import ChangeExecutor

    settings = CheckSettings.from_config(
        k,
        apply=ChangeExecutor(dry_run=args.dry_run, observe=cfg.daemon.observe),
        reason=args.reason,
        bus_address=opt(args, "bus"),
        policy=args.policy or "",
        may_restart=not args.no_restart,
        kubelet_stopped=args.kubelet_stopped,
        simulation=_simulation(args, cfg, inventory),
        kubelet_units=cfg.systemd.kubelet_units,
    )
    from gpuguard.engine.snapshot import HostSnapshot

    # One snapshot for the whole run, and the steps in the daemon's order
    # (registry.CHECK_ORDER), through the daemon's runner: the device steps, then the
    # checkpoint step, given this command's settings.
    snapshot = HostSnapshot(root, k.checkpoint_path)
    checkpoint = CheckpointStep(given=settings)
    devices: Optional[list[StepResult]] = None
    if args.only is None and _devices_first(root, snapshot):
        import asyncio

        from gpuguard.engine.oneshot import OneShotServices, check_steps, run_check_pass
        from gpuguard.host.systemd import bus_address_for
        from gpuguard.steps.registry import CHECKPOINT

        bus = opt(args, "bus") or bus_address_for(root.prefix)
        svc = OneShotServices(root, cfg, log, settings.apply, bus)
        steps = check_steps({CHECKPOINT: checkpoint})
        results = asyncio.run(run_check_pass(svc, steps, inventory, snapshot))
        devices = [r for r in results if r.name != CHECKPOINT]
    else:  # the checkpoint alone: no event loop unless kubelet must be asked
        checkpoint.run_alone(root, inventory, log, snapshot)
    report = checkpoint.report
    assert report is not None, "the checkpoint step ran"
    if hook is not None:
        _hook_result(hook, report, log)
        _remember_healthy(root, report, snapshot, memo_key)
    doc = report.to_json()
    code = report.exit_code
    findings: list[Finding] = []
    outcomes: list[Outcome] = []
    if devices is not None:
        from gpuguard.steps.container_access.reconcile import FINDING_UNREADABLE

        findings = [f for r in devices for f in r.findings]
        outcomes = [o for r in devices for o in r.outcomes]
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
        journaled = hook is not None and _stdout_is_journal(log)
        _print_report(root, report, findings, outcomes, journaled=journaled)
    return code


def _stdout_is_journal(log: EventLog) -> bool:
    """kubelet's pre-start hook: stdout is kubelet's journal stream, which already has
    every finding and change as the hook's own journal entries."""
    import sys

    from gpuguard.journal.log import under_journald

    return log.journal is not None and under_journald(sys.stdout)


def _print_report(
    root: Root,
    report: CheckReport,
    findings: Sequence[Finding],
    outcomes: Sequence[Outcome],
    *,
    journaled: bool,
) -> None:
    """The report, then the device steps' findings and outcomes, each fact once (the log
    prints none of them as text: `_check`), pods by namespace/name where the runtime
    knows them. `journaled`: the findings and changes are in the same journal already;
    only the summary lines are printed."""
    if journaled:
        report = report.summary_only()
    fields = [f.fields for f in (*findings, *report.findings)]
    fields += [o.action.fields() for o in outcomes]
    if not fields:  # no pod to name (a healthy node): devices/podnames is not loaded
        print("\n".join(line for line, _ in report.lines()))
        return
    from gpuguard.devices.podnames import name_pod, pod_names

    names = pod_names(root, (f.get("CONTAINER_ID", "") for f in fields))
    by_uid = {p.uid: p for p in names.values() if p.uid}

    def named(text: str, f: Mapping[str, str]) -> str:
        uid = f.get("POD_UID", "")
        return name_pod(text, uid, names.get(f.get("CONTAINER_ID", "")) or by_uid.get(uid))

    print("\n".join(named(line, f) for line, f in report.lines()))
    if journaled:
        return
    for f in findings:
        print(named(f"{f.severity + ':':11} {f.summary}", f.fields))
    for o in outcomes:
        a = o.action
        print(named(f"{o.status + ':':11} {a.kind} {a.target}: {o.detail}", a.fields()))


def _hook_result(hook: HookRun, report: CheckReport, log: EventLog) -> None:
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


def _hook_unchanged(
    args: argparse.Namespace, root: Root, hook: HookRun, inventory: Inventory, path: str
) -> int:
    """The hook's healthy fast path: the checkpoint's bytes and the GPUs are those a full
    check last found healthy, so that verdict stands; the hook's result is still written."""
    from gpuguard.steps.checkpoint.kubelet_hook import HEALTHY

    result = "checkpoint matches this host's GPUs; nothing to do (unchanged since last verified)"
    hook.finish(HEALTHY, result, exitcodes.OK)
    if args.json:
        doc = {"checkpoint": str(root.path(path)), "inventory": inventory.to_json()}
        print(json.dumps({**doc, "result": result, "exit_code": exitcodes.OK}, indent=2))
    else:
        print(f"checkpoint: {root.path(path)}\nresult:     {result}")
    return exitcodes.OK


def _remember_healthy(
    root: Root, report: CheckReport, snapshot: HostSnapshot, key: Optional[MemoKey]
) -> None:
    """After a full check that found the file healthy (no finding, no action), remember
    its digest and the inventory for the next kubelet start."""
    if key is None or report.exit_code != exitcodes.OK or report.findings or report.actions:
        return
    from gpuguard.steps.checkpoint import memo

    loaded = snapshot.checkpoint()
    # Only the bytes the analysis read: a file changed between the two reads is not
    # remembered (the next start verifies it fully).
    if loaded is not None and memo.digest(loaded.raw) == key.checkpoint_sha256:
        memo.write_memo(root, key)


def _devices_first(root: Root, snapshot: HostSnapshot) -> bool:
    """Whether the device steps run before the checkpoint's (`gpuguard check` without
    --only): the driver is loaded and the checkpoint is one the step will not refuse."""
    from gpuguard.engine.oneshot import driver_loaded

    return driver_loaded(root) and _checkpoint_usable(snapshot)


def _checkpoint_usable(snapshot: HostSnapshot) -> bool:
    """False when the checkpoint step will stop the run with exit 3 ("nothing was
    modified"): then the device steps must not act first."""
    from gpuguard.errors import BadInputError

    try:
        loaded = snapshot.checkpoint()
    except BadInputError:
        return False
    return loaded is None or bool(loaded.valid)
