"""What a checkpoint check found and did, its settings, and applying a planned repair."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Mapping, Optional

from gpuguard import exitcodes
from gpuguard.model import Action, Finding, Outcome

if TYPE_CHECKING:
    from gpuguard.config import KubeletConfig
    from gpuguard.engine.executor import ChangeExecutor
    from gpuguard.steps.checkpoint.actuate import CheckpointActuator
    from gpuguard.steps.checkpoint.remap import RemapInputs


@dataclass(frozen=True)
class CheckSettings:
    checkpoint_path: str
    resources: tuple[str, ...]
    policy: str  # rewrite | delete | report
    backup_dir: str
    backup_keep: int
    kubelet_unit: str  # "": the unit kubelet runs in (kubelet.pick_unit)
    restart_kubelet: bool
    apply: ChangeExecutor  # makes or, under dry-run, describes the repair and restarts
    kubelet_stopped: bool  # we run as kubelet's ExecStartPre=: kubelet is not up
    bus_address: Optional[str]
    reason: str = "check"
    # The daemon's first pass: a kubelet start job queued now waits for gpuguard's own
    # start (After=gpuguard.service), so it is no restart under way (kubelet.py)
    kubelet_waits: bool = False
    # [Systemd] KubeletUnits=: where an empty kubelet_unit is looked for
    kubelet_units: tuple[str, ...] = ("kubelet.service",)
    # Non-empty: the inventory is a simulation (`check --inventory`), so a running
    # kubelet is never stopped or restarted for it; says why and which flag allows it.
    simulation: str = ""
    # The daemon's [Kubelet] RestartPolicy= (for-pods, for-pods-no-agent): a running
    # kubelet is restarted only for the pods it brings back (kubelet.restart_pods); "":
    # whenever a repair needs it (`gpuguard check`, the operator's own command).
    restart_gate: str = ""
    # pods whose entries were stale when the daemon started: never restarted for
    restart_not_for: frozenset[str] = frozenset()

    @classmethod
    def from_config(
        cls,
        k: KubeletConfig,
        *,
        apply: ChangeExecutor,
        reason: str,
        bus_address: Optional[str],
        policy: str = "",  # "": [Kubelet] Policy=
        may_restart: bool = True,  # False: not now, whatever RestartKubelet= says
        kubelet_stopped: bool = False,
        simulation: str = "",
        kubelet_units: tuple[str, ...] = ("kubelet.service",),
        kubelet_waits: bool = False,
        daemon: bool = False,  # True: RestartPolicy= gates the restart (restart_gate)
        restart_not_for: frozenset[str] = frozenset(),
    ) -> CheckSettings:
        """The one way from [Kubelet] to a check's settings (`gpuguard check`, the daemon)."""
        return cls(
            checkpoint_path=k.checkpoint_path,
            resources=tuple(k.resources),
            policy=policy or k.policy,
            backup_dir=k.backup_dir,
            backup_keep=k.backup_keep,
            kubelet_unit=k.unit or "",
            restart_kubelet=k.restart_kubelet and k.restart_policy != "never" and may_restart,
            apply=apply,
            kubelet_stopped=kubelet_stopped,
            bus_address=bus_address,
            reason=reason,
            simulation=simulation,
            kubelet_units=tuple(kubelet_units),
            kubelet_waits=kubelet_waits,
            restart_gate=k.restart_policy if daemon else "",
            restart_not_for=restart_not_for,
        )


def simulation(inventory_source: str, cli_file: bool, config: Any, *, allow: bool = False) -> str:
    """Why a running kubelet is left alone, "" when it is not: the GPU inventory comes
    from a file (`inventory_source` is not "nvml"), which stands in for NVML, and
    restarting a real kubelet for it is not a simulation. Allowed by
    --allow-kubelet-restart (`allow`) or `[Inventory] AllowKubeletRestart=yes`
    (`config`) for a file named by `[Inventory] File=`."""
    if inventory_source == "nvml" or allow:
        return ""
    if cli_file:
        return (
            "the GPU inventory comes from --inventory (a simulation), so a running kubelet "
            "is not restarted or stopped; pass --allow-kubelet-restart to allow it"
        )
    if config.allow_kubelet_restart:
        return ""
    return (
        f"the GPU inventory comes from the file {inventory_source} (a simulation), "
        "so a running kubelet is not restarted or stopped; its next start repairs the file "
        "(AllowKubeletRestart=yes allows a restart)"
    )


# The daemon's result for a repair that was stale when it started (an install, an
# upgrade, its own restart), at that pass and every later one: one journal line.
STALE_AT_START = (
    "not repaired: stale when gpuguard started, which never restarts kubelet; left for "
    "kubelet's next start (restarting kubelet's unit applies it now)"
)


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
    # left to kubelet's pre-start hook: its unit was starting or stopping (kubelet.py)
    hook_pending: bool = False
    # stale entries left as they are (they hold a present GPU; remap.py): the rest of the
    # checkpoint matches the GPUs, so they are recorded all the same
    left_stale: int = 0
    # what the remap read from the host (the history among it); not part of the report
    remap_inputs: Optional[RemapInputs] = field(default=None, repr=False, compare=False)

    def stale_pods(self) -> frozenset[str]:
        """The pods whose entries the planned repair remaps or drops."""
        pods: set[str] = set()
        for a in self.actions:
            pods.update(r.old.pod_uid for r in getattr(a, "remaps", ()))
            pods.update(d.entry.pod_uid for d in getattr(a, "drops", ()))
            pods.update(e.pod_uid for e in getattr(a, "dropped", ()))
        return frozenset(pods)

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

    def lines(self) -> list[tuple[str, Mapping[str, str]]]:
        """The report's lines, each with the journal fields of what it is about (a
        finding's, an action's) so a caller can name the pod it mentions."""
        out: list[tuple[str, Mapping[str, str]]] = [(f"checkpoint: {self.checkpoint}", {})]
        inv = self.inventory
        if inv:
            out.append((f"inventory:  {len(inv['gpus'])} GPU(s) from {inv['source']}", {}))
            out += [(f"            {g['index']}: {g['uuid']}", {}) for g in inv["gpus"]]
        out += [(f"{f.severity + ':':9}  {f.summary}", f.fields) for f in self.findings]
        for a in self.actions:
            out.append((f"plan:       {a.describe()}", a.fields()))
            out += [(f"            {d}", a.fields()) for d in getattr(a, "details", tuple)()]
        if self.kubelet:
            out.append((f"kubelet:    {self.kubelet}", {}))
        if self.coordination:
            out.append((f"how:        {self.coordination}", {}))
        out += [(f"{o.status + ':':11} {o.detail}", o.action.fields()) for o in self.outcomes]
        out.append((f"result:     {self.result}", {}))
        return out

    def render(self) -> str:
        return "\n".join(line for line, _fields in self.lines())

    def summary_only(self) -> CheckReport:
        """The report without its findings, plan and outcomes (journaled on their own)."""
        return replace(self, findings=[], actions=[], outcomes=[])


def apply_repair(
    report: CheckReport, actuator: CheckpointActuator, s: CheckSettings
) -> CheckReport:
    report.outcomes = [s.apply.run(actuator.change(a)) for a in report.actions]
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
