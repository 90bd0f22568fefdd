"""What a checkpoint check found and did, its settings, and applying a planned repair."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

from gpuguard import exitcodes
from gpuguard.model import Action, Finding, Outcome
from gpuguard.steps.checkpoint.actuate import CheckpointActuator

if TYPE_CHECKING:
    from gpuguard.config import KubeletConfig
    from gpuguard.steps.checkpoint.remap import RemapInputs


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

    @classmethod
    def from_config(
        cls,
        k: KubeletConfig,
        *,
        dry_run: bool,
        reason: str,
        bus_address: Optional[str],
        policy: str = "",  # "": [Kubelet] Policy=
        may_restart: bool = True,  # False: not now, whatever RestartKubelet= says
        kubelet_stopped: bool = False,
        simulation: str = "",
    ) -> CheckSettings:
        """The one way from [Kubelet] to a check's settings (`gpuguard check`, the daemon)."""
        return cls(
            checkpoint_path=k.checkpoint_path,
            resources=tuple(k.resources),
            policy=policy or k.policy,
            backup_dir=k.backup_dir,
            backup_keep=k.backup_keep,
            kubelet_unit=k.unit,
            restart_kubelet=k.restart_kubelet and may_restart,
            dry_run=dry_run,
            kubelet_stopped=kubelet_stopped,
            bus_address=bus_address,
            reason=reason,
            simulation=simulation,
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
    # what the remap read from the host (the history among it); not part of the report
    remap_inputs: Optional[RemapInputs] = field(default=None, repr=False, compare=False)

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
            lines += [f"            {d}" for d in getattr(a, "details", tuple)()]
        if self.kubelet:
            lines.append(f"kubelet:    {self.kubelet}")
        if self.coordination:
            lines.append(f"how:        {self.coordination}")
        for o in self.outcomes:
            lines.append(f"{o.status + ':':11} {o.detail}")
        lines.append(f"result:     {self.result}")
        return "\n".join(lines)


def apply_repair(
    report: CheckReport, actuator: CheckpointActuator, s: CheckSettings
) -> CheckReport:
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
