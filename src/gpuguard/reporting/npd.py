"""Node conditions for node-problem-detector's custom plugin monitor, from the status file.

NPD runs a command per rule and reads its exit status (0 OK, 1 problem, 2 unknown;
anything else is unknown too) and its trimmed stdout, cut at `max_output_length` bytes
(80 by default), as the condition's message. The condition types say the problem
(`GPUDeviceAccessLost` True means access was lost), reasons are CamelCase.

The answer comes from the daemon's status file (/run/gpuguard/status.json: each step's
latest findings and outcomes, see ledger.py): no second audit, milliseconds. A finding
counts as a problem until a pass of its step repaired it (every outcome done or already
so); a step that never ran, crashed or is older than `max_age` is unknown, as is a
status file that cannot be read or a daemon that is gone.
"""

from __future__ import annotations

import errno
import json
import time
from dataclasses import dataclass
from typing import Any, Mapping, Optional

from gpuguard.host.paths import Root
from gpuguard.host.safeio import UnsafeFileError, read_bytes
from gpuguard.steps.registry import CHECKPOINT, CONTAINER_ACCESS, DEVICE_PLUGIN, GPU_COUNT

# passes.STATUS_FILE, repeated so `gpuguard npd` imports nothing heavy (a test keeps them equal).
STATUS_FILE = "/run/gpuguard/status.json"

OK, PROBLEM, UNKNOWN = 0, 1, 2
DEFAULT_MAX_LENGTH = 80  # NPD's default max_output_length
DEFAULT_MAX_AGE = 7200.0  # two default audit intervals
MAX_STATUS_BYTES = 16 * 1024 * 1024


@dataclass(frozen=True)
class Condition:
    name: str  # the command's argument
    type: str  # NodeCondition type; True means the problem is present
    steps: tuple[str, ...]  # the steps whose latest result decides it
    kinds: frozenset[str]  # finding kinds that are this problem
    reason: str  # NPD rule reason when True
    ok_reason: str  # default condition reason (False)
    ok_message: str


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
            }
        ),
        "KubeletCheckpointStale",
        "KubeletCheckpointOK",
        "kubelet's device checkpoint names only devices this node has",
    ),
    Condition(
        "device-plugin",
        "GPUDevicePluginStale",
        (DEVICE_PLUGIN,),
        frozenset(
            {
                "plugin-missing-device",
                "plugin-not-registered",
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
)
BY_NAME = {c.name: c for c in CONDITIONS}


def read_status(root: Root) -> tuple[Optional[Mapping[str, Any]], str]:
    """(status document, "") or (None, why it cannot be used)."""
    path = root.path(STATUS_FILE)
    try:  # non-blocking, regular files only, bounded: a FIFO here must not hang NPD
        data, _st = read_bytes(path, what="status file", max_bytes=MAX_STATUS_BYTES)
    except UnsafeFileError as e:
        if e.errno == errno.ENOENT:
            return None, f"no {STATUS_FILE}: gpuguard daemon not running"
        return None, f"cannot read {STATUS_FILE}: {e.message}"
    try:
        doc = json.loads(data)
    except ValueError:
        return None, f"{STATUS_FILE} is not valid JSON (half-written?)"
    if not isinstance(doc, dict) or not isinstance(doc.get("pid"), int):
        return None, f"{STATUS_FILE} is not a gpuguard status file"
    if not root.path(f"/proc/{doc['pid']}").is_dir():
        return None, f"gpuguard daemon (pid {doc['pid']}) is gone; status is stale"
    return doc, ""


def evaluate(
    cond: Condition, doc: Mapping[str, Any], now: float, max_age: float
) -> tuple[int, str]:
    """(exit status, message) for one condition from a status document."""
    steps = doc.get("steps")
    if not isinstance(steps, dict):
        return UNKNOWN, "status file has no per-step results (daemon too old?)"
    open_findings: list[Mapping[str, Any]] = []
    for name in cond.steps:
        st = steps.get(name)
        if not isinstance(st, dict):
            return UNKNOWN, f"no {name} check has run yet"
        if st.get("error"):
            return UNKNOWN, f"{name} check failed: {st['error']}"
        ended = st.get("ended")
        if not isinstance(ended, (int, float)) or now - ended > max_age:
            return UNKNOWN, f"last {name} check is older than {max_age:.0f}s"
        findings = [
            f
            for f in st.get("findings") or ()
            if isinstance(f, dict) and f.get("kind") in cond.kinds
        ]
        outcomes = [o for o in st.get("outcomes") or () if isinstance(o, dict)]
        repaired = bool(outcomes) and all(o.get("status") in ("done", "skipped") for o in outcomes)
        if findings and not repaired:
            open_findings += findings
    if not open_findings:
        return OK, cond.ok_message
    first = str(open_findings[0].get("summary", cond.reason))
    more = f" (+{len(open_findings) - 1} more)" if len(open_findings) > 1 else ""
    return PROBLEM, first + more


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
    doc, why = read_status(root)
    if doc is None:
        return UNKNOWN, why
    return evaluate(cond, doc, time.time() if now is None else now, max_age)


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
