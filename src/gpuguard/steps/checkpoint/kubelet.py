"""Kubelet coordination around a checkpoint repair: which unit jobs (RestartUnit with the
pre-start hook, or StopUnit, repair, StartUnit), queued through actuate/units.py, which
journals each job with its reason; here only what a failed job means for the repair."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Callable, Optional

from gpuguard import exitcodes
from gpuguard.actuate.change import AsyncChange
from gpuguard.actuate.units import UnitJob, UnitJobs, Verb
from gpuguard.devices.processes import kubelet_pids
from gpuguard.errors import KubeletError
from gpuguard.host.inventory import Inventory
from gpuguard.host.paths import Root
from gpuguard.journal.log import EventLog
from gpuguard.model import Finding, Outcome
from gpuguard.steps.checkpoint import kubelet_hook
from gpuguard.steps.checkpoint import reconcile as ckpt
from gpuguard.steps.checkpoint.actuate import CheckpointActuator
from gpuguard.steps.checkpoint.observe import KubeletStatus, kubelet_status
from gpuguard.steps.checkpoint.report import (
    STALE_AT_START,
    CheckReport,
    CheckSettings,
    apply_repair,
)

if TYPE_CHECKING:  # dbus-next costs import time; a healthy node never needs it
    from gpuguard.engine.snapshot import HostSnapshot
    from gpuguard.host.systemd import Systemd

# Units that run kubelet inside a whole agent (k3s runs it in its own process, RKE2 as a
# child): restarting one restarts the agent, not kubelet alone.
AGENT_PREFIXES = ("k3s", "rke2")


async def coordinate(
    root: Root,
    s: CheckSettings,
    report: CheckReport,
    actuator: CheckpointActuator,
    log: EventLog,
    systemd: Optional[Systemd],
    inventory: Inventory,
    on_restart: Optional[Callable[[], None]] = None,
    snapshot: Optional[HostSnapshot] = None,
) -> CheckReport:
    k = _Kubelet(root, inventory, on_restart or (lambda: None), snapshot)
    if systemd is not None:
        return await _coordinated(k, s, report, actuator, log, systemd)
    from gpuguard.host.systemd import Systemd, SystemdError, bus_address_for

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
    repair was planned with (to re-analyse after a restart), the restart callback, the
    pass's snapshot (which pods run: RestartPolicy=)."""

    root: Root
    inventory: Inventory
    on_restart: Callable[[], None]
    snapshot: Optional[HostSnapshot] = None


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
    if not s.kubelet_unit:
        refused: list[Finding] = []  # processes named kubelet it may not act for
        s = replace(s, kubelet_unit=await pick_unit(root, systemd, s.kubelet_units, refused))
        for f in refused:
            log.finding(f)
        report.findings += refused
    if systemd is None:
        status = KubeletStatus(s.kubelet_unit, kubelet_pids(root), None, bus_error)
    else:
        status = await kubelet_status(root, systemd, s.kubelet_unit)
    report.kubelet = status.describe()
    if status.hook_will_run(jobs=not s.kubelet_waits):
        # A start or restart of kubelet's unit is under way, and its pre-start hook
        # repairs the file before kubelet reads it: two writers of one file around one
        # restart would race (and the second's backup would be the first's repair).
        state = status.unit_state
        assert state is not None
        report.coordination = (
            f"{s.kubelet_unit} is {state.active_state}"
            f"{' with a job queued' if state.job_pending else ''}: its pre-start hook "
            "repairs the file before kubelet starts; checked again after"
        )
        report.result = "left to kubelet's pre-start hook (its unit is starting or stopping)"
        report.hook_pending = True
        report.exit_code = exitcodes.FINDINGS
        return report
    if not status.running:
        report.coordination = "kubelet is not running: repair directly"
        return apply_repair(report, actuator, s)
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
    pods: tuple[str, ...] = ()
    if s.restart_gate:
        pods, result = restart_pods(k, s, report)
        if result:
            report.coordination = (
                f"kubelet is running and RestartPolicy={s.restart_gate}: not restarted; "
                "its next start repairs the file (pre-start hook)"
            )
            report.result = result
            report.exit_code = exitcodes.FINDINGS
            return report
    if status.has_dropin:
        return await _restart_with_hook(k, systemd, s, report, log, pods)
    return await _stop_repair_start(k, systemd, s, report, actuator, log, pods)


def is_agent(unit: str) -> bool:
    """A k3s or RKE2 unit: kubelet runs inside the whole agent."""
    return unit.startswith(AGENT_PREFIXES)


def restart_pods(k: _Kubelet, s: CheckSettings, report: CheckReport) -> tuple[tuple[str, ...], str]:
    """The pods a restart of the running kubelet brings back (RestartPolicy=for-pods):
    those kubelet still has (observe.present_pods: kubelet 1.20-1.26 replays a stale
    entry, so their containers crash-loop; a static pod rejected at admission is
    admitted again) whose entries the repair remaps, not those stale when the daemon
    started (an install or upgrade never restarts kubelet); or, when there are none, the
    check's result saying why. A dropped entry brings no pod back: its pod needs a new
    allocation before any plugin registered, and fails admission."""
    stale = report.stale_pods()
    if stale and stale <= s.restart_not_for:
        return (), STALE_AT_START
    left = "not repaired: left for kubelet's next start: "
    if s.restart_gate == "for-pods-no-agent" and is_agent(s.kubelet_unit):
        return (), (
            f"{left}{s.kubelet_unit} runs kubelet inside the whole agent, which "
            "RestartPolicy=for-pods-no-agent never restarts"
        )
    remapped = sorted({r.old.pod_uid for a in report.actions for r in getattr(a, "remaps", ())})
    if not remapped:
        return (), f"{left}no entry is remapped, so a restart would bring no pod back"
    from gpuguard.engine.snapshot import HostSnapshot
    from gpuguard.steps.checkpoint.observe import present_pods

    present = present_pods(k.snapshot or HostSnapshot(k.root, s.checkpoint_path), remapped)
    running = [p for p in remapped if p in present]
    pods = tuple(p for p in running if p not in s.restart_not_for)
    if pods:
        return pods, ""
    if running:
        return (), STALE_AT_START
    return (), f"{left}kubelet has no pod whose entry is remapped (none to bring back)"


async def pick_unit(
    root: Root,
    systemd: Optional[Systemd],
    candidates: tuple[str, ...],
    refused: Optional[list[Finding]] = None,
) -> str:
    """[Kubelet] Unit= left empty: the unit the trusted running kubelet is in
    (devices/kubelettrust.py; the processes refused are added to `refused`), else the
    first candidate ([Systemd] KubeletUnits=) that systemd has loaded, else the first.
    Always one of the candidates."""
    from gpuguard.devices.kubelettrust import kubelets

    found = kubelets(root, candidates)
    if refused is not None:
        refused += found.findings(ckpt.NAME)
    if systemd is None:
        running = found.first.unit if found.first is not None else ""
        return running or (candidates[0] if candidates else "kubelet.service")
    from gpuguard.host.systemd import SystemdError

    running_first = [p.unit for p in found.trusted] + list(candidates)
    for candidate in dict.fromkeys(running_first):
        try:
            if (await systemd.unit_state(candidate)).load_state == "loaded":
                return candidate
        except SystemdError:
            break
    return candidates[0] if candidates else "kubelet.service"


def _for_pods(s: CheckSettings, pods: tuple[str, ...]) -> str:
    """What a restart is for, as its journal entry says: the pods it brings back, and
    that an agent's unit restarts the whole agent."""
    out = f"; for pod(s) {', '.join(pods[:8])}{' ...' if len(pods) > 8 else ''}" if pods else ""
    if is_agent(s.kubelet_unit):
        out += f"; {s.kubelet_unit} is the whole agent: all of it restarts, not kubelet alone"
    return out


async def _restart_with_hook(
    k: _Kubelet,
    systemd: Systemd,
    s: CheckSettings,
    report: CheckReport,
    log: EventLog,
    pods: tuple[str, ...] = (),
) -> CheckReport:
    report.coordination = (
        f"restart {s.kubelet_unit} through systemd; its ExecStartPre= hook repairs the file "
        "between stop and start"
    )

    def describe() -> CheckReport:
        report.result = "dry run: nothing modified, kubelet not restarted"
        report.exit_code = exitcodes.FINDINGS
        return report

    change = AsyncChange(
        "kubelet-restart", lambda: _restart_verified(k, systemd, s, report, log, pods), describe
    )
    return await s.apply.run_async(change)


async def _restart_verified(
    k: _Kubelet,
    systemd: Systemd,
    s: CheckSettings,
    report: CheckReport,
    log: EventLog,
    pods: tuple[str, ...],
) -> CheckReport:
    """The restart and its verdict: the hook's token, the job, the token read back."""
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
        why = (
            f"so that its pre-start hook repairs {report.checkpoint}: "
            f"{report.actions[0].reason}{_for_pods(s, pods)}"
        )
        job = await UnitJobs(systemd, log).run(_job(s, "restart", why, "kubelet-restart", pods))
        result = f"failed: {job.error}" if job.error else job.result
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
    pods: tuple[str, ...] = (),
) -> CheckReport:
    report.coordination = (
        f"the gpuguard drop-in is not active for {s.kubelet_unit}: stop it, repair, start it"
    )
    change = AsyncChange(
        "kubelet-stop-start",
        lambda: _stopped_repair(k, systemd, s, report, actuator, log, pods),
        lambda: apply_repair(report, actuator, s),  # the repair described; no job
    )
    return await s.apply.run_async(change)


async def _stopped_repair(
    k: _Kubelet,
    systemd: Systemd,
    s: CheckSettings,
    report: CheckReport,
    actuator: CheckpointActuator,
    log: EventLog,
    pods: tuple[str, ...],
) -> CheckReport:
    """Stop kubelet, repair, start it again (the repair's own writes: the executor's)."""
    k.on_restart()
    jobs = UnitJobs(systemd, log)
    why = f"to repair {report.checkpoint} while it is stopped (no gpuguard drop-in)"
    stop = await jobs.run(_job(s, "stop", why + _for_pods(s, pods), "kubelet-stop", pods))
    if not stop.ok:
        why = stop.error or f"stop job ended with '{stop.result}'"
        _coordination_failed(log, s, why)
        raise KubeletError(f"{report.checkpoint}: not repaired: stopping kubelet failed: {why}")
    try:
        apply_repair(report, actuator, s)
    finally:
        why = f"again after the repair of {report.checkpoint}"
        start = (await jobs.run(_job(s, "start", why, "kubelet-start"))).outcome
    if start != "done":
        raise KubeletError(f"repaired {report.checkpoint}, but starting kubelet failed: {start}")
    return report


def _job(s: CheckSettings, verb: Verb, why: str, kind: str, pods: tuple[str, ...] = ()) -> UnitJob:
    """A kubelet job for the checkpoint step, journaled by the actuator with `kind` (and
    the pods it is for, POD_UIDS)."""
    fields = {"GPUGUARD_RECONCILER": ckpt.NAME, "GPUGUARD_ACTION": kind, "REASON": s.reason}
    if pods:
        fields["POD_UIDS"] = ",".join(pods)
    if is_agent(s.kubelet_unit):
        fields["KUBELET_AGENT"] = "1"
    return UnitJob(verb, s.kubelet_unit, why, kind, fields)


def _coordination_failed(log: EventLog, s: CheckSettings, why: str) -> None:
    log.event(
        "kubelet-coordination-failed",
        f"{s.kubelet_unit}: {why}",
        level="error",
        fields={"UNIT": s.kubelet_unit, "GPUGUARD_RECONCILER": ckpt.NAME},
    )
