"""Node conditions for node-problem-detector's custom plugin monitor, from the status file.

NPD runs a command per rule and reads its exit status (0 OK, 1 problem, 2 unknown;
anything else is unknown too) and its trimmed stdout, cut at `max_output_length` bytes
(80 by default), as the condition's message. The condition types say the problem
(`GPUDeviceAccessLost` True means access was lost), reasons are CamelCase.

The answer comes from the daemon's status file (/run/gpuguard/status.json: each step's
latest findings and outcomes, see ledger.py): no second audit, milliseconds. A finding
counts as a problem until a pass of its step repaired it (every outcome done or already
so); a step that never ran, crashed, is older than `max_age` or could not see a layer
it judges (its `unknown`: no GPU inventory, sysfs unreadable, no checkpoint) is
unknown, as is a status file that cannot be read or a daemon that is gone. Never "OK"
about what was not seen.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Mapping, Optional

from gpuguard.host.paths import Root
from gpuguard.model import Finding
from gpuguard.reporting.status import STATUS_FILE as STATUS_FILE
from gpuguard.reporting.status import ConditionState, Status, StepResult
from gpuguard.reporting.status import read_status as load_status
from gpuguard.steps.registry import (
    CHECKPOINT,
    CONTAINER_ACCESS,
    DEVICE_PLUGIN,
    GPU_COUNT,
    READMIT,
)

OK, PROBLEM, UNKNOWN = 0, 1, 2
DEFAULT_MAX_LENGTH = 80  # NPD's default max_output_length
DEFAULT_MAX_AGE = 7200.0  # two default audit intervals


@dataclass(frozen=True)
class Condition:
    name: str  # the command's argument
    type: str  # NodeCondition type; True means the problem is present
    steps: tuple[str, ...]  # the steps whose latest result decides it
    kinds: frozenset[str]  # finding kinds that are this problem
    reason: str  # NPD rule reason when True
    ok_reason: str  # default condition reason (False)
    ok_message: str
    # kinds a pass's repair leaves open: a problem even when its outcomes are done
    lasting: frozenset[str] = frozenset()


CONDITIONS: tuple[Condition, ...] = (
    Condition(
        "device-access",
        "GPUDeviceAccessLost",
        (CONTAINER_ACCESS,),
        frozenset(
            {
                "container-device-denied",
                "v2-report-only",
                "container-device-missing",
                "container-missing-uvm",
                # a container or GPU process gpuguard cannot audit: never "OK" about it
                "container-unreadable",
                "gpu-process-unattributed",
            }
        ),
        "GPUDeviceAccessLost",
        "GPUDeviceAccessOK",
        "every GPU container can open the devices it was given",
    ),
    Condition(
        "checkpoint",
        "KubeletCheckpointStale",
        (CHECKPOINT,),
        frozenset(
            {
                "checkpoint-stale-entry",
                "checkpoint-stale-registered",
                "checkpoint-corrupt",
                "checkpoint-refused",
                "kubelet-coordination-failed",
                # a remap not written yet (observe mode, dry-run, a refused restart)
                "checkpoint-entry-remap",
                "checkpoint-entry-kept",
            }
        ),
        "KubeletCheckpointStale",
        "KubeletCheckpointOK",
        "kubelet's device checkpoint names only devices this node has",
        lasting=frozenset({"checkpoint-entry-kept"}),
    ),
    Condition(
        "device-plugin",
        "GPUDevicePluginStale",
        (DEVICE_PLUGIN,),
        frozenset(
            {
                "plugin-missing-device",
                "plugin-not-registered",
                "plugin-not-allocatable",
                "plugin-not-serving",
                "plugin-nvml-failed",
            }
        ),
        "GPUDevicePluginStale",
        "GPUDevicePluginOK",
        "GPU device plugins are registered and see every device node",
    ),
    Condition(
        "gpu-count",
        "GPUCountMismatch",
        (GPU_COUNT,),
        frozenset({"gpu-count-mismatch"}),
        "GPUCountMismatch",
        "GPUCountOK",
        "PCI, NVML and kubelet agree on the number of GPUs",
    ),
    Condition(
        "gpu-pods",
        "GPUPodsRejected",
        (READMIT,),
        frozenset({"gpu-pod-rejected", "readmit-bridge-off"}),
        "GPUPodsRejected",
        "GPUPodsAdmitted",
        "no GPU pod kubelet rejected at its start is left unrun",
    ),
)
BY_NAME = {c.name: c for c in CONDITIONS}


def read_status(root: Root) -> tuple[Optional[Status], str]:
    """(status, "") or (None, why it cannot be used): reporting/status.py's loader, so a
    FIFO, a link, a huge, deep or malformed file here is "unknown", never a hang or a
    traceback."""
    return load_status(root)


def evaluate(
    cond: Condition, steps: Mapping[str, StepResult], now: float, max_age: float
) -> tuple[int, str]:
    """(exit status, message) for one condition from each step's latest result.

    Problem: a finding of its kinds not repaired by its step's pass. Unknown: a step
    that never ran, crashed, is older than `max_age`, or could not see a layer it
    judges (its `unknown`), while no problem is known. OK otherwise."""
    open_findings: list[Finding] = []
    unknown: list[str] = []
    for name in cond.steps:
        st = steps.get(name)
        if st is None:
            unknown.append(f"no {name} check has run yet")
            continue
        if st.error:
            unknown.append(f"{name} check failed: {st.error}")
            continue
        if now - st.ended > max_age:
            unknown.append(f"last {name} check is older than {max_age:.0f}s")
            continue
        findings = [f for f in st.findings if f.kind in cond.kinds]
        repaired = bool(st.outcomes) and all(o.status in ("done", "skipped") for o in st.outcomes)
        if findings and not repaired:
            open_findings += findings
        elif repaired:
            open_findings += [f for f in findings if f.kind in cond.lasting]
        unknown += st.unknown
    if open_findings:
        first = open_findings[0].summary or cond.reason
        more = f" (+{len(open_findings) - 1} more)" if len(open_findings) > 1 else ""
        return PROBLEM, first + more
    if unknown:
        more = f" (+{len(unknown) - 1} more)" if len(unknown) > 1 else ""
        return UNKNOWN, unknown[0] + more
    return OK, cond.ok_message


STATE_NAMES = {OK: "ok", PROBLEM: "problem", UNKNOWN: "unknown"}


def judge_conditions(
    steps: Mapping[str, StepResult], now: float, max_age: float = DEFAULT_MAX_AGE
) -> tuple[str, dict[str, ConditionState]]:
    """The node's state (problem if any condition has one, else unknown if any is
    unknown, else ok) and each condition's, by its type."""
    out = {}
    for c in CONDITIONS:
        code, msg = evaluate(c, steps, now, max_age)
        out[c.type] = ConditionState(STATE_NAMES[code], msg)
    states = {v.state for v in out.values()}
    node = "problem" if "problem" in states else "unknown" if "unknown" in states else "ok"
    return node, out


def one_line(text: str, limit: int) -> str:
    """One ASCII line of at most `limit` bytes: NPD cuts stdout at max_output_length
    bytes, which could split a UTF-8 character or keep a second line."""
    flat = " ".join(text.split()).encode("ascii", "replace").decode()
    return flat if len(flat) <= limit else flat[: max(0, limit - 3)] + "..."


def answer(
    root: Root, name: str, *, max_age: float = DEFAULT_MAX_AGE, now: Optional[float] = None
) -> tuple[int, str]:
    from gpuguard.host.offswitch import read_off_switch

    cond = BY_NAME[name]
    off = read_off_switch(root)
    if off is not None:  # nothing is checked: never "OK"
        why = off.reason or f"{off.path} is set"
        return UNKNOWN, f"gpuguard is disabled: {why} (gpuguard enable)"
    status, why = read_status(root)
    if status is None:
        return UNKNOWN, why
    return evaluate(cond, status.steps, time.time() if now is None else now, max_age)


PLUGIN_PATH = "/usr/libexec/gpuguard/npd-condition"  # hooks/npd-condition, as packaged
MONITOR_CONFIG = "/usr/share/gpuguard/node-problem-detector/gpuguard-monitor.json"


def monitor_config(path: str = PLUGIN_PATH, *, interval: str = "30s") -> dict[str, Any]:
    """The custom-plugin monitor configuration shipped in /usr/share/gpuguard (a test
    keeps the shipped file equal to this and valid against NPD's schema)."""
    return {
        "plugin": "custom",
        "pluginConfig": {
            "invoke_interval": interval,
            "timeout": "5s",
            "max_output_length": DEFAULT_MAX_LENGTH,
            "concurrency": 1,
            "enable_message_change_based_condition_update": False,
        },
        "source": "gpuguard-custom-plugin-monitor",
        "metricsReporting": True,
        "conditions": [
            {"type": c.type, "reason": c.ok_reason, "message": c.ok_message} for c in CONDITIONS
        ],
        "rules": [
            {
                "type": "permanent",
                "condition": c.type,
                "reason": c.reason,
                "path": path,
                "args": [c.name],
                "timeout": "3s",
            }
            for c in CONDITIONS
        ],
    }
