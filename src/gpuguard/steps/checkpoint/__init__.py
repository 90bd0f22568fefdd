"""The checkpoint step (F1): the daemon's and `gpuguard check`'s, coordinated with kubelet.

Kubelet reads the checkpoint only at start-up and rewrites it from memory, so the
file is changed only while kubelet is stopped:
- kubelet not running (or we ARE its ExecStartPre= hook): repair directly;
- kubelet running under systemd with our drop-in: RestartUnit, and the drop-in's
  ExecStartPre= hook repairs the file between stop and start;
- running under systemd without the drop-in: StopUnit, repair, StartUnit;
- running but not through systemd: nothing we can safely do; report (exit 5).
A repair made by the hook is reported only once verified (kubelet_hook.judge): a
`done` restart job says nothing about what the hook did.

Modules (docs/architecture.md has the map of the packages):

- the checkpoint step (F1), one class for the daemon and `gpuguard check`
  (`__init__.py`); its settings and report (`report.py`); kubelet coordination, the unit
  jobs around a repair (`kubelet.py`); is kubelet running (`observe.py`); which IDs are
  stale and the repair plan (`reconcile.py`, `deviceids.py`); the one-to-one map from a
  recorded generation of GPUs to the GPUs now (`gpumap.py`, pure) and each pod entry
  remapped or dropped through it (`remap.py`, pure); what the remap reads from the host:
  the history, NUMA nodes, boot time (`observe.py`); the repair, written atomically with
  a backup, each remap and drop journaled, and the GPUs recorded in the identity history
  once the checkpoint matches them (`actuate.py`); the records between a kubelet
  restart's caller and the pre-start hook, and when a repair counts as verified
  (`kubelet_hook.py`); the hook's memo of the last healthy checkpoint and inventory
  (`memo.py`)
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

__all__ = [
    "CheckReport",
    "CheckSettings",
    "CheckpointStep",
    "analyse_checkpoint",
    "check_checkpoint",
]


def __getattr__(name: str) -> object:
    # Loaded on first use: kubelet's pre-start hook imports this package for its
    # submodules (kubelet_hook, memo), and on an unchanged healthy node needs nothing
    # else from it.
    if name in ("CheckReport", "CheckSettings"):
        from gpuguard.steps.checkpoint import report

        return getattr(report, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
    """The check: the analysis, then kubelet's coordination where a repair needs kubelet
    stopped, on the pass's bus connection (`systemd`; None: one of its own). `on_restart`
    is called just before kubelet is restarted or stopped, whatever comes of it; the
    findings are journaled through `conditions` (the daemon's: once while they last)."""
    report, actuator = analyse_checkpoint(root, inventory, s, log, snapshot, conditions)
    if actuator is not None:
        from gpuguard.steps.checkpoint.kubelet import coordinate

        report = await coordinate(
            root, s, report, actuator, log, systemd, inventory, on_restart, snapshot
        )
    return _remember_gpus(root, inventory, s, log, report)


def _remember_gpus(
    root: Root, inventory: Inventory, s: CheckSettings, log: EventLog, report: CheckReport
) -> CheckReport:
    """Record the GPUs as the history's newest generation once the checkpoint matches them
    (healthy, repaired, or none yet): never before, so that the check after a reboot
    still finds the generation the checkpoint was written under. Except at the first
    look (no history file yet: an install, the first boot), whatever the checkpoint
    says: there is no older generation to keep, and the next change of GPUs can then be
    remapped. In observe mode too (gpuguard's own state, not the node's); never under
    --dry-run."""
    from gpuguard import exitcodes

    inputs = report.remap_inputs
    if inputs is None or not s.apply.records_own_state:
        return report
    # kept entries (no history: one present and one changed GPU) leave the rest matching
    matches = report.exit_code == exitcodes.OK or (report.left_stale and not report.actions)
    # the first look records whatever the checkpoint says, but never after a refusal or
    # a failure (an unsafe backup directory, kubelet not coordinated: nothing written)
    first_look = (
        inputs.history is None
        and not inputs.problem
        and report.exit_code in (exitcodes.OK, exitcodes.FINDINGS)
    )
    if not matches and not first_look:
        return report
    from gpuguard.steps.checkpoint.actuate import record_history

    record_history(root, inventory, inputs, log, inputs.path)
    return report


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
    from gpuguard.engine.snapshot import HostSnapshot
    from gpuguard.steps.checkpoint import reconcile as ckpt
    from gpuguard.steps.checkpoint.observe import remap_inputs
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
    inputs = remap_inputs(root, inventory, loaded.stat.st_mtime if loaded is not None else 0.0)
    report.remap_inputs = inputs
    if inputs.problem:
        log.event(
            "gpu-history-unusable",
            f"{inputs.problem}; stale checkpoint entries can only be dropped, not remapped, "
            "until the GPUs are recorded again",
            level="warning",
            fields={"GPUGUARD_RECONCILER": ckpt.NAME, "HISTORY": inputs.path},
        )
    if loaded is None:
        report.result = "no checkpoint file (kubelet's device manager has not written one yet)"
        return report, None
    cp, raw = loaded.checkpoint, loaded.raw
    analysis = ckpt.analyse(cp, inventory, s.resources, inputs)
    report.findings = list(analysis.findings)
    if conditions is None:  # a one-shot run: everything it found
        for f in report.findings:
            log.finding(f)
    else:
        from gpuguard.journal.conditions import log_findings

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
        elif analysis.kept:  # stale, but dropping would take a present GPU (remap.py)
            report.left_stale = len(analysis.kept)
            report.result = (
                f"{len(analysis.kept)} stale pod entries left as they are: each still holds "
                "a GPU this host has"
            )
            report.exit_code = exitcodes.FINDINGS
        else:
            report.result = "checkpoint matches this host's GPUs; nothing to do"
        return report, None
    # a repair is planned: only now its writer (a healthy checkpoint never loads it)
    from gpuguard.steps.checkpoint.actuate import CheckpointActuator

    actuator = CheckpointActuator(
        backup_dir=root.path(s.backup_dir),
        backup_keep=s.backup_keep,
        log=log,
        dropped_file=root.path(DROPPED_ENTRIES_FILE),
    )
    if s.kubelet_stopped:
        from gpuguard.devices.processes import kubelet_pids

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
    """The checkpoint step, one for the daemon and for `gpuguard check`.

    The daemon's (`given` None) takes its settings from the configuration, and turns a
    check that cannot go on (a corrupt checkpoint, kubelet that cannot be coordinated)
    into a finding. `gpuguard check`'s is given the settings its options make, and lets
    that error end the run with its exit code; its report (`report`) is what it prints.

    Restarting kubelet is rate limited in the daemon: at most once per COOLDOWN,
    whatever the passes find, so a checkpoint that keeps coming back stale (a plugin
    re-registering old IDs?) is reported, never fought in a restart loop. And it is made
    only as [Kubelet] RestartPolicy= allows: for pods the restart brings back, never for
    entries that were stale when the daemon started (`at_start`: an install, an upgrade,
    its own restart), which kubelet's next start repairs.
    """

    COOLDOWN = 600.0
    HOOK_RECHECK = 10.0  # a repair left to kubelet's pre-start hook: looked at again

    def __init__(
        self,
        clock: Callable[[], float] = time.monotonic,
        *,
        given: Optional[CheckSettings] = None,
    ) -> None:
        from gpuguard.journal.conditions import Conditions

        self.clock = clock
        self.last_restart = -1e18
        self.given = given  # `gpuguard check`'s settings; None: the daemon's
        self.report: Optional[CheckReport] = None  # the last check's
        self.conditions = Conditions()  # the daemon's findings, journaled once while they last
        # pods whose entries were stale at the daemon's first pass: never restarted for
        self.at_start: frozenset[str] = frozenset()

    def _restarting(self) -> None:
        # Counted when the restart is attempted, not when it succeeds: a restart whose
        # repair could not be verified must not be retried on the next pass either.
        self.last_restart = self.clock()

    def settings(
        self, svc: Services, ctx: PassContext, inventory: Inventory, starting: bool = False
    ) -> CheckSettings:
        """`gpuguard check`'s given settings, or the daemon's from its configuration
        (`starting`: its first pass, which leaves a kubelet restart to the next)."""
        if self.given is not None:
            return self.given
        from gpuguard.steps.checkpoint.report import CheckSettings, simulation

        cooled = self.clock() - self.last_restart > self.COOLDOWN
        return CheckSettings.from_config(
            svc.config.kubelet,
            apply=svc.apply,
            reason="daemon: " + ctx.work.reasons[0],
            bus_address=svc.bus_address,
            may_restart=cooled and not starting,
            simulation=simulation(inventory.source, False, svc.config.inventory),
            kubelet_units=svc.config.systemd.kubelet_units,
            kubelet_waits=starting,
            daemon=True,
            restart_not_for=self.at_start,
        )

    def run_alone(
        self, root: Root, inventory: Inventory, log: EventLog, snapshot: HostSnapshot
    ) -> CheckReport:
        """`gpuguard check` when it runs no other step (kubelet's pre-start hook, a node
        without the driver): the same check, with an event loop and a bus connection
        only when kubelet must be asked about, so a healthy node never loads asyncio or
        D-Bus."""
        assert self.given is not None, "the daemon's step runs in a pass"
        report, actuator = analyse_checkpoint(root, inventory, self.given, log, snapshot)
        if actuator is not None:
            import asyncio

            from gpuguard.steps.checkpoint.kubelet import coordinate

            done = coordinate(root, self.given, report, actuator, log, None, inventory)
            report = asyncio.run(done)
        self.report = _remember_gpus(root, inventory, self.given, log, report)
        return self.report

    async def __call__(self, svc: Services, ctx: PassContext) -> None:
        from gpuguard.journal.conditions import log_findings
        from gpuguard.model import Finding
        from gpuguard.steps.checkpoint import reconcile as ckpt

        inventory = await ctx.inventory()
        if inventory is None:
            ctx.unknown.append(
                "no GPU inventory (NVML unavailable): the checkpoint's device IDs cannot "
                "be judged against this node's GPUs"
            )
            return
        # The daemon's first pass runs before READY=1, and kubelet's unit is ordered
        # After=gpuguard.service: a restart job queued now would wait for gpuguard's own
        # start, which waits for this pass. The restart is the next pass's, right after.
        first = getattr(svc, "first_pass_done", None)
        starting = first is not None and not first.is_set()
        settings = self.settings(svc, ctx, inventory, starting)
        try:
            report = await check_checkpoint(
                svc.root,
                inventory,
                settings,
                svc.log,
                systemd=svc.systemd,
                on_restart=self._restarting,
                snapshot=ctx.host(svc),
                conditions=None if self.given is not None else self.conditions,
            )
        except GpuguardError as e:
            if self.given is not None:
                raise  # `gpuguard check`: the error is its exit code
            restarted = svc.apply.pick(made=settings.restart_kubelet, described=False)
            if isinstance(e, KubeletError) and restarted:
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
        self.report = report
        if self.given is not None:  # `gpuguard check`: its report says it all
            ctx.findings += report.findings
            ctx.outcomes += report.outcomes
            return
        # Why a repair waits for kubelet's next start (a simulation, restarts off): said
        # once while it lasts, like the findings.
        left = []
        if report.hook_pending:  # kubelet's unit was starting or stopping
            ctx.recheck(self.HOOK_RECHECK, "kubelet's unit was starting or stopping")
        elif starting and report.kubelet and report.result.startswith("not repaired"):
            # Stale before gpuguard looked (an install, an upgrade, its own restart):
            # never a reason to restart kubelet; its next start's hook repairs it.
            from gpuguard.steps.checkpoint.report import STALE_AT_START

            self.at_start = report.stale_pods()
            report.coordination = (
                "kubelet is running and gpuguard is starting: not restarted; kubelet's "
                "next start repairs the file (pre-start hook)"
            )
            report.result = STALE_AT_START
            why = f"{report.checkpoint}: {report.result}"
            left.append(Finding("checkpoint-refused", ckpt.NAME, why, severity="warning"))
        elif report.kubelet and report.result.startswith("not repaired"):
            why = f"{report.checkpoint}: {report.result}"
            left.append(Finding("checkpoint-refused", ckpt.NAME, why, severity="warning"))
        if not report.actions:  # healthy (or repaired): nothing stale is left from the start
            self.at_start = frozenset()
        log_findings(svc.log, self.conditions, "checkpoint:kubelet", left, lasting_clears=True)
        ctx.findings += report.findings + left
        ctx.outcomes += report.outcomes
