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
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Optional

from gpuguard import exitcodes
from gpuguard.errors import BadInputError, GpuguardError, KubeletError
from gpuguard.inventory import Inventory
from gpuguard.log import EventLog
from gpuguard.model import Action, Finding, Outcome
from gpuguard.paths import DROPPED_ENTRIES_FILE, Root
from gpuguard.snapshot import HostSnapshot
from gpuguard.steps.checkpoint import kubelet_hook
from gpuguard.steps.checkpoint import reconcile as ckpt
from gpuguard.steps.checkpoint.actuate import CheckpointActuator
from gpuguard.steps.checkpoint.observe import KubeletStatus, kubelet_pids, kubelet_status

if TYPE_CHECKING:  # dbus-next costs import time; a healthy node never needs it
    from gpuguard.passes import PassContext, Services
    from gpuguard.systemd import Systemd


@dataclass(frozen=True)
class CheckSettings:
    checkpoint_path: str
    resources: tuple[str, ...]
    policy: str  # rewrite | delete | report
    backup_dir: str
    backup_keep: int
    kubelet_unit: str
    restart_kubelet: bool
    dry_run: bool
    kubelet_stopped: bool  # we run as kubelet's ExecStartPre=: kubelet is not up
    bus_address: Optional[str]
    reason: str = "check"
    # Non-empty: the inventory is a simulation (`check --inventory`), so a running
    # kubelet is never stopped or restarted for it; says why and which flag allows it.
    simulation: str = ""


@dataclass
class CheckReport:
    checkpoint: str
    inventory: dict[str, Any] = field(default_factory=dict)
    findings: list[Finding] = field(default_factory=list)
    actions: list[Action] = field(default_factory=list)
    outcomes: list[Outcome] = field(default_factory=list)
    kubelet: str = ""
    coordination: str = ""
    result: str = ""
    exit_code: int = exitcodes.OK

    def to_json(self) -> dict[str, Any]:
        return {
            "checkpoint": self.checkpoint,
            "inventory": self.inventory,
            "findings": [f.to_json() for f in self.findings],
            "actions": [a.to_json() for a in self.actions],
            "outcomes": [o.to_json() for o in self.outcomes],
            "kubelet": self.kubelet,
            "coordination": self.coordination,
            "result": self.result,
            "exit_code": self.exit_code,
        }

    def render(self) -> str:
        lines = [f"checkpoint: {self.checkpoint}"]
        inv = self.inventory
        if inv:
            lines.append(f"inventory:  {len(inv['gpus'])} GPU(s) from {inv['source']}")
            lines += [f"            {g['index']}: {g['uuid']}" for g in inv["gpus"]]
        for f in self.findings:
            lines.append(f"{f.severity + ':':9}  {f.summary}")
        for a in self.actions:
            lines.append(f"plan:       {a.describe()}")
        if self.kubelet:
            lines.append(f"kubelet:    {self.kubelet}")
        if self.coordination:
            lines.append(f"how:        {self.coordination}")
        for o in self.outcomes:
            lines.append(f"{o.status + ':':11} {o.detail}")
        lines.append(f"result:     {self.result}")
        return "\n".join(lines)


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

    return asyncio.run(_coordinate(root, s, report, actuator, log, None, inventory))


async def check_checkpoint(
    root: Root,
    inventory: Inventory,
    s: CheckSettings,
    log: EventLog,
    systemd: Optional[Systemd] = None,
    on_restart: Optional[Callable[[], None]] = None,
    snapshot: Optional[HostSnapshot] = None,
) -> CheckReport:
    """The same for the daemon, on its own bus connection (`systemd`). `on_restart` is
    called just before kubelet is restarted or stopped, whatever comes of it."""
    report, actuator = analyse_checkpoint(root, inventory, s, log, snapshot)
    if actuator is None:
        return report
    return await _coordinate(root, s, report, actuator, log, systemd, inventory, on_restart)


def analyse_checkpoint(
    root: Root,
    inventory: Inventory,
    s: CheckSettings,
    log: EventLog,
    snapshot: Optional[HostSnapshot] = None,
) -> tuple[CheckReport, Optional[CheckpointActuator]]:
    """Read and analyse the checkpoint (from the pass's `snapshot`, so every step decides
    from the same read); the actuator comes back only when a repair that needs kubelet
    stopped is planned (the report is final otherwise)."""
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
    for f in report.findings:
        log.finding(f)
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
        return _apply(report, actuator, s), None
    return report, actuator


async def _coordinate(
    root: Root,
    s: CheckSettings,
    report: CheckReport,
    actuator: CheckpointActuator,
    log: EventLog,
    systemd: Optional[Systemd],
    inventory: Inventory,
    on_restart: Optional[Callable[[], None]] = None,
) -> CheckReport:
    k = _Kubelet(root, inventory, on_restart or (lambda: None))
    if systemd is not None:
        return await _coordinated(k, s, report, actuator, log, systemd)
    from gpuguard.systemd import Systemd, SystemdError, bus_address_for

    own = Systemd(s.bus_address or bus_address_for(root.prefix))
    try:
        await own.connect()
    except SystemdError as e:
        return await _coordinated(k, s, report, actuator, log, None, str(e))
    try:
        return await _coordinated(k, s, report, actuator, log, own)
    finally:
        own.disconnect()


@dataclass(frozen=True)
class _Kubelet:
    """What coordinating kubelet needs beyond the settings: the host, the inventory the
    repair was planned with (to re-analyse after a restart), the restart callback."""

    root: Root
    inventory: Inventory
    on_restart: Callable[[], None]


def _apply(report: CheckReport, actuator: CheckpointActuator, s: CheckSettings) -> CheckReport:
    report.outcomes = [actuator.apply(a) for a in report.actions]
    statuses = {o.status for o in report.outcomes}
    if statuses == {"done"}:
        report.result = "repaired"
    elif statuses == {"dry-run"}:
        report.result = "dry run: nothing modified"
        report.exit_code = exitcodes.FINDINGS
    else:
        report.result = "repair failed: " + "; ".join(o.detail for o in report.outcomes)
        report.exit_code = exitcodes.BAD_INPUT
    return report


async def _coordinated(
    k: _Kubelet,
    s: CheckSettings,
    report: CheckReport,
    actuator: CheckpointActuator,
    log: EventLog,
    systemd: Optional[Systemd],
    bus_error: str = "",
) -> CheckReport:
    root = k.root
    if systemd is None:
        status = KubeletStatus(s.kubelet_unit, kubelet_pids(root), None, bus_error)
    else:
        status = await kubelet_status(root, systemd, s.kubelet_unit)
    report.kubelet = status.describe()
    if not status.running:
        report.coordination = "kubelet is not running: repair directly"
        return _apply(report, actuator, s)
    if not status.unit_active or systemd is None:
        raise KubeletError(
            f"{report.checkpoint}: not repaired: kubelet runs outside systemd "
            f"({status.describe()}); stop it, then run `gpuguard check` again"
        )
    if not s.restart_kubelet:
        report.coordination = "kubelet is running and restarts are off: left for its next start"
        report.result = "not repaired: kubelet must be restarted to apply the repair"
        report.exit_code = exitcodes.FINDINGS
        return report
    if s.simulation:  # also under --dry-run: the dry run prints what the real run does
        report.coordination = "kubelet is running and the inventory is simulated: left alone"
        report.result = f"not repaired: {s.simulation}"
        report.exit_code = exitcodes.FINDINGS
        return report
    if status.has_dropin:
        return await _restart_with_hook(k, systemd, s, report, log)
    return await _stop_repair_start(k, systemd, s, report, actuator, log)


async def _restart_with_hook(
    k: _Kubelet, systemd: Systemd, s: CheckSettings, report: CheckReport, log: EventLog
) -> CheckReport:
    from gpuguard.systemd import SystemdError

    report.coordination = (
        f"restart {s.kubelet_unit} through systemd; its ExecStartPre= hook repairs the file "
        "between stop and start"
    )
    if s.dry_run:
        report.result = "dry run: nothing modified, kubelet not restarted"
        report.exit_code = exitcodes.FINDINGS
        return report
    token = kubelet_hook.new_token()
    try:
        kubelet_hook.write_request(k.root, token)
    except OSError as e:
        # Without the token no outcome could be verified: do not restart at all.
        raise KubeletError(
            f"{report.checkpoint}: not repaired, kubelet not restarted: cannot write "
            f"{k.root.path(kubelet_hook.REQUEST)}: {e.strerror}"
        ) from None
    k.on_restart()
    try:
        try:
            result = await systemd.restart_unit(s.kubelet_unit)
        except SystemdError as e:
            result = f"failed: {e}"
        _log_kubelet(
            log,
            s,
            "kubelet-restart",
            f"restart of {s.kubelet_unit} (job {result}) so its pre-start hook repairs "
            f"{report.checkpoint}: {report.actions[0].reason}",
        )
        verdict = kubelet_hook.verify(
            k.root, token, s.checkpoint_path, k.inventory, s.resources, s.policy
        )
    finally:
        kubelet_hook.clear_request(k.root)
    if result != "done" and not verdict.verified:
        verdict = kubelet_hook.Verdict(
            False, f"the kubelet restart job ended with '{result}'; {verdict.detail}"
        )
    if not verdict.verified:
        report.outcomes = [Outcome(a, "failed", verdict.detail) for a in report.actions]
        log.event(
            "checkpoint-repair-unverified",
            f"{report.checkpoint}: not repaired: {verdict.detail}",
            level="error",
            fields={
                "GPUGUARD_RECONCILER": ckpt.NAME,
                "GPUGUARD_STATUS": "failed",
                "UNIT": s.kubelet_unit,
                "CHECKPOINT": report.checkpoint,
                "REASON": s.reason,
            },
        )
        raise KubeletError(f"{report.checkpoint}: not repaired: {verdict.detail}")
    report.outcomes = [Outcome(a, "done", verdict.detail) for a in report.actions]
    report.result = "repaired by kubelet's pre-start hook during a kubelet restart (verified)"
    if result != "done":  # repaired, but kubelet itself did not come back
        _coordination_failed(log, s, f"restart job ended with '{result}' (checkpoint repaired)")
        raise KubeletError(
            f"repaired {report.checkpoint} ({verdict.detail}), but the kubelet restart job "
            f"ended with '{result}'"
        )
    return report


async def _stop_repair_start(
    k: _Kubelet,
    systemd: Systemd,
    s: CheckSettings,
    report: CheckReport,
    actuator: CheckpointActuator,
    log: EventLog,
) -> CheckReport:
    from gpuguard.systemd import SystemdError

    report.coordination = (
        f"the gpuguard drop-in is not active for {s.kubelet_unit}: stop it, repair, start it"
    )
    if s.dry_run:
        return _apply(report, actuator, s)
    k.on_restart()
    try:
        result = await systemd.stop_unit(s.kubelet_unit)
        if result != "done":
            raise SystemdError(f"stop job ended with '{result}'")
    except SystemdError as e:
        _coordination_failed(log, s, str(e))
        raise KubeletError(
            f"{report.checkpoint}: not repaired: stopping kubelet failed: {e}"
        ) from None
    try:
        _apply(report, actuator, s)
    finally:
        try:
            start = await systemd.start_unit(s.kubelet_unit)
        except SystemdError as e:
            start = str(e)
        _log_kubelet(
            log,
            s,
            "kubelet-stop-start",
            f"stopped {s.kubelet_unit}, repaired {report.checkpoint}, started it again "
            f"(start: {start})",
        )
    if start != "done":
        raise KubeletError(f"repaired {report.checkpoint}, but starting kubelet failed: {start}")
    return report


def _log_kubelet(log: EventLog, s: CheckSettings, kind: str, msg: str) -> None:
    """The journal entry for a kubelet restart or stop/start made for the checkpoint."""
    log.event(
        kind,
        msg,
        level="notice",
        fields={
            "GPUGUARD_RECONCILER": ckpt.NAME,
            "GPUGUARD_ACTION": kind,
            "UNIT": s.kubelet_unit,
            "REASON": s.reason,
        },
    )


def _coordination_failed(log: EventLog, s: CheckSettings, why: str) -> None:
    log.event(
        "kubelet-coordination-failed",
        f"{s.kubelet_unit}: {why}",
        level="error",
        fields={"UNIT": s.kubelet_unit, "GPUGUARD_RECONCILER": ckpt.NAME},
    )


class CheckpointStep:
    """The daemon's checkpoint step: the same check, on the daemon's bus connection.

    Restarting kubelet is rate limited here: at most once per KUBELET_RESTART_COOLDOWN,
    whatever the passes find, so a checkpoint that keeps coming back stale (a plugin
    re-registering old IDs?) is reported, never fought in a restart loop.
    """

    COOLDOWN = 600.0

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.last_restart = -1e18

    def _restarting(self) -> None:
        # Counted when the restart is attempted, not when it succeeds: a restart whose
        # repair could not be verified must not be retried on the next pass either.
        self.last_restart = self.clock()

    async def __call__(self, svc: Services, ctx: PassContext) -> None:
        inventory = await ctx.inventory()
        if inventory is None:
            return
        k = svc.config.kubelet
        cooled = self.clock() - self.last_restart > self.COOLDOWN
        settings = CheckSettings(
            checkpoint_path=k.checkpoint_path,
            resources=tuple(k.resources),
            policy=k.policy,
            backup_dir=k.backup_dir,
            backup_keep=k.backup_keep,
            kubelet_unit=k.unit,
            restart_kubelet=k.restart_kubelet and cooled,
            dry_run=svc.dry_run,
            kubelet_stopped=False,
            bus_address=svc.bus_address,
            reason="daemon: " + ctx.work.reasons[0],
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
            )
        except GpuguardError as e:
            kind = (
                "checkpoint-corrupt"
                if isinstance(e, BadInputError)
                else "kubelet-coordination-failed"
            )
            ctx.findings.append(Finding(kind, ckpt.NAME, e.message, severity="error"))
            return
        ctx.findings += report.findings
        ctx.outcomes += report.outcomes
