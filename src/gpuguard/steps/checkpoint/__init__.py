"""`gpuguard check`: the one-shot checkpoint repair (F1), coordinated with kubelet.

Kubelet reads the checkpoint only at start-up and rewrites it from memory, so the
file is changed only while kubelet is stopped:
- kubelet not running (or we ARE its ExecStartPre= hook): repair directly;
- kubelet running under systemd with our drop-in: RestartUnit, and the drop-in's
  ExecStartPre= hook repairs the file between stop and start;
- running under systemd without the drop-in: StopUnit, repair, StartUnit;
- running but not through systemd: nothing we can safely do; report (exit 5).
A repair made by the hook is reported only once verified (kubelet_hook.judge): a
`done` restart job says nothing about what the hook did.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Callable, Optional

from gpuguard import exitcodes
from gpuguard.errors import BadInputError, GpuguardError, KubeletError
from gpuguard.host.paths import DROPPED_ENTRIES_FILE, Root

if TYPE_CHECKING:  # dbus-next costs import time; a healthy node never needs it
    from gpuguard.engine.passes import PassContext, Services
    from gpuguard.engine.snapshot import HostSnapshot
    from gpuguard.host.inventory import Inventory
    from gpuguard.host.systemd import Systemd
    from gpuguard.journal.conditions import Conditions
    from gpuguard.journal.log import EventLog
    from gpuguard.steps.checkpoint.actuate import CheckpointActuator
    from gpuguard.steps.checkpoint.report import CheckReport, CheckSettings

__all__ = ["CheckReport", "CheckSettings", "CheckpointStep", "check_checkpoint", "run_check"]


def __getattr__(name: str) -> object:
    # Loaded on first use: kubelet's pre-start hook imports this package for its
    # submodules (kubelet_hook, memo), and on an unchanged healthy node needs nothing
    # else from it.
    if name in ("CheckReport", "CheckSettings"):
        from gpuguard.steps.checkpoint import report

        return getattr(report, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def run_check(
    root: Root,
    inventory: Inventory,
    s: CheckSettings,
    log: EventLog,
    snapshot: Optional[HostSnapshot] = None,
) -> CheckReport:
    """The CLI's entry. An event loop and a bus connection only when kubelet must be
    asked about: a healthy node never loads asyncio or D-Bus."""
    report, actuator = analyse_checkpoint(root, inventory, s, log, snapshot)
    if actuator is None:
        return report
    import asyncio

    from gpuguard.steps.checkpoint.kubelet import coordinate

    return asyncio.run(coordinate(root, s, report, actuator, log, None, inventory))


async def check_checkpoint(
    root: Root,
    inventory: Inventory,
    s: CheckSettings,
    log: EventLog,
    systemd: Optional[Systemd] = None,
    on_restart: Optional[Callable[[], None]] = None,
    snapshot: Optional[HostSnapshot] = None,
    conditions: Optional[Conditions] = None,
) -> CheckReport:
    """The same for the daemon, on its own bus connection (`systemd`). `on_restart` is
    called just before kubelet is restarted or stopped, whatever comes of it; the
    findings are journaled through `conditions` (once while they last)."""
    report, actuator = analyse_checkpoint(root, inventory, s, log, snapshot, conditions)
    if actuator is None:
        return report
    from gpuguard.steps.checkpoint.kubelet import coordinate

    return await coordinate(root, s, report, actuator, log, systemd, inventory, on_restart)


def analyse_checkpoint(
    root: Root,
    inventory: Inventory,
    s: CheckSettings,
    log: EventLog,
    snapshot: Optional[HostSnapshot] = None,
    conditions: Optional[Conditions] = None,
) -> tuple[CheckReport, Optional[CheckpointActuator]]:
    """Read and analyse the checkpoint (from the pass's `snapshot`, so every step decides
    from the same read); the actuator comes back only when a repair that needs kubelet
    stopped is planned (the report is final otherwise)."""
    from gpuguard.devices.processes import kubelet_pids
    from gpuguard.engine.snapshot import HostSnapshot
    from gpuguard.journal.conditions import log_findings
    from gpuguard.steps.checkpoint import reconcile as ckpt
    from gpuguard.steps.checkpoint.actuate import CheckpointActuator
    from gpuguard.steps.checkpoint.report import CheckReport, apply_repair

    path = root.path(s.checkpoint_path)
    report = CheckReport(checkpoint=str(path), inventory=inventory.to_json())
    snap = snapshot or HostSnapshot(root, s.checkpoint_path)
    try:
        loaded = snap.checkpoint()
        if loaded is not None and not loaded.valid:
            raise BadInputError(loaded.problem)
    except BadInputError as e:
        log.event("checkpoint-corrupt", e.message, level="error", fields={"CHECKPOINT": path})
        raise
    if loaded is None:
        report.result = "no checkpoint file (kubelet's device manager has not written one yet)"
        return report, None
    cp, raw = loaded.checkpoint, loaded.raw
    analysis = ckpt.analyse(cp, inventory, s.resources)
    report.findings = list(analysis.findings)
    if conditions is None:  # a one-shot run: everything it found
        for f in report.findings:
            log.finding(f)
    else:
        log_findings(log, conditions, ckpt.NAME, report.findings, lasting_clears=True)
    report.actions = list(ckpt.plan(analysis, path=path, raw=raw, policy=s.policy))
    if analysis.refused:
        report.result = f"not repaired: {analysis.refused}"
        report.exit_code = exitcodes.FINDINGS
        return report, None
    if not report.actions:
        if analysis.stale:
            report.result = "stale entries found; Policy=report leaves them"
            report.exit_code = exitcodes.FINDINGS
        else:
            report.result = "checkpoint matches this host's GPUs; nothing to do"
        return report, None

    actuator = CheckpointActuator(
        backup_dir=root.path(s.backup_dir),
        backup_keep=s.backup_keep,
        log=log,
        dry_run=s.dry_run,
        dropped_file=root.path(DROPPED_ENTRIES_FILE),
    )
    if s.kubelet_stopped:
        pids = kubelet_pids(root)
        report.kubelet = "stopped (running as kubelet's ExecStartPre= hook)"
        if pids:
            raise KubeletError(
                f"{path}: not repaired: a kubelet process is still running "
                f"(pid {', '.join(map(str, pids))}) and would overwrite the file"
            )
        report.coordination = "repair directly"
        return apply_repair(report, actuator, s), None
    return report, actuator


class CheckpointStep:
    """The daemon's checkpoint step: the same check, on the daemon's bus connection.

    Restarting kubelet is rate limited here: at most once per KUBELET_RESTART_COOLDOWN,
    whatever the passes find, so a checkpoint that keeps coming back stale (a plugin
    re-registering old IDs?) is reported, never fought in a restart loop.
    """

    COOLDOWN = 600.0

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        from gpuguard.journal.conditions import Conditions

        self.clock = clock
        self.last_restart = -1e18
        self.conditions = Conditions()  # findings journaled once while they last

    def _restarting(self) -> None:
        # Counted when the restart is attempted, not when it succeeds: a restart whose
        # repair could not be verified must not be retried on the next pass either.
        self.last_restart = self.clock()

    async def __call__(self, svc: Services, ctx: PassContext) -> None:
        from gpuguard.journal.conditions import log_findings
        from gpuguard.model import Finding
        from gpuguard.steps.checkpoint import reconcile as ckpt
        from gpuguard.steps.checkpoint.report import CheckSettings, simulation

        inventory = await ctx.inventory()
        if inventory is None:
            return
        k = svc.config.kubelet
        cooled = self.clock() - self.last_restart > self.COOLDOWN
        # The daemon's first pass runs before READY=1, and kubelet's unit is ordered
        # After=gpuguard.service: a restart job queued now would wait for gpuguard's own
        # start, which waits for this pass. The restart is the next pass's, right after.
        first = getattr(svc, "first_pass_done", None)
        starting = first is not None and not first.is_set()
        settings = CheckSettings.from_config(
            k,
            dry_run=svc.dry_run,
            reason="daemon: " + ctx.work.reasons[0],
            bus_address=svc.bus_address,
            may_restart=cooled and not starting,
            simulation=simulation(inventory.source, False, svc.config.inventory),
            kubelet_units=svc.config.systemd.kubelet_units,
        )
        try:
            report = await check_checkpoint(
                svc.root,
                inventory,
                settings,
                svc.log,
                systemd=svc.systemd,
                on_restart=self._restarting,
                snapshot=ctx.host(svc),
                conditions=self.conditions,
            )
        except GpuguardError as e:
            if isinstance(e, KubeletError) and settings.restart_kubelet and not svc.dry_run:
                # A restart job that failed or was canceled (kubelet stopped meanwhile)
                # counts too: otherwise every pass would try again, a restart loop.
                self.last_restart = self.clock()
            kind = (
                "checkpoint-corrupt"
                if isinstance(e, BadInputError)
                else "kubelet-coordination-failed"
            )
            ctx.findings.append(Finding(kind, ckpt.NAME, e.message, severity="error"))
            return
        # Why a repair waits for kubelet's next start (a simulation, restarts off): said
        # once while it lasts, like the findings.
        left = []
        if starting and report.kubelet and report.result.startswith("not repaired"):
            report.coordination = "kubelet is running and gpuguard is starting: next pass"
            ctx.recheck(0.5, frozenset({ckpt.NAME}), "kubelet restart after gpuguard's start")
        elif report.kubelet and report.result.startswith("not repaired"):
            why = f"{report.checkpoint}: {report.result}"
            left.append(Finding("checkpoint-refused", ckpt.NAME, why, severity="warning"))
        log_findings(svc.log, self.conditions, "checkpoint:kubelet", left, lasting_clears=True)
        ctx.findings += report.findings + left
        ctx.outcomes += report.outcomes
