"""The daemon's status file (/run/gpuguard/status.json) as a typed, versioned model.

The daemon writes a `Status` after every pass (engine/daemon.py, through
actuate/statefile.py); `gpuguard status`, `gpuguard npd`, the metrics and `gpuguard
doctor` read it through `read_status()`, the one loader: a file that is missing,
unsafe, malformed, of another version or out of range is "unknown" with one line
saying why, never a traceback. Readers use the fields, never string keys.

Per step, the latest result (ledger.py) holds its findings and outcomes and what it
could not see (`unknown`: a layer that could not be read is never "ok"); `conditions`
is the daemon's own verdict, per node-problem-detector condition, when it wrote the
file: ok, problem or unknown (npd.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Optional

from gpuguard.host.offswitch import REASON_MAX, OffSwitch
from gpuguard.host.paths import Root
from gpuguard.host.statefile import (
    TIME_MAX,
    Obj,
    SchemaError,
    StateFile,
    load,
    number,
    string,
)
from gpuguard.model import Finding, Outcome
from gpuguard.reporting.status_figures import COUNT_MAX, FastPaths, ReloadSignal

STATUS_FILE = "/run/gpuguard/status.json"
VERSION = 1
STATES = ("ok", "problem", "unknown")
MODES = ("repair", "observe")
SEVERITIES = ("info", "warning", "error")
MAX_FINDINGS = 10_000
MAX_PID = 2**22


def _finding(v: Any, where: str) -> Finding:
    o = Obj(v, where)
    severity = o.text("severity", max_len=16)
    if severity not in SEVERITIES:
        raise SchemaError(f"{where}.severity: not one of {', '.join(SEVERITIES)}")
    return Finding(
        kind=o.text("kind", max_len=128),
        reconciler=o.text("reconciler", max_len=64),
        summary=o.text("summary"),
        fields=o.mapping("fields", _str, max_items=256, default={}),
        severity=severity,
    )


def _str(v: Any, where: str) -> str:
    return string(v, where, 64 * 1024)


@dataclass(frozen=True)
class OutcomeRecord:
    """An outcome as written: the action's kind, step, target, reason and fields,
    with its status and detail."""

    kind: str
    reconciler: str
    target: str
    reason: str
    status: str  # done | skipped | dry-run | declined | failed
    detail: str = ""
    fields: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def parse(cls, v: Any, where: str) -> OutcomeRecord:
        o = Obj(v, where)
        return cls(
            kind=o.text("kind", max_len=128),
            reconciler=o.text("reconciler", max_len=64),
            target=o.text("target"),
            reason=o.text("reason"),
            status=o.text("status", max_len=16),
            detail=o.text("detail", default=""),
            fields=o.mapping("fields", _str, max_items=256, default={}),
        )

    @classmethod
    def of(cls, o: Outcome) -> OutcomeRecord:
        """The daemon's side: an actuator's Outcome as recorded."""
        a = o.action
        return cls(a.kind, a.reconciler, a.target, a.reason, o.status, o.detail, dict(a.fields()))

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "reconciler": self.reconciler,
            "target": self.target,
            "reason": self.reason,
            "status": self.status,
            "detail": self.detail,
            "fields": dict(self.fields),
        }


@dataclass(frozen=True)
class PassRecord:
    number: int
    reasons: tuple[str, ...]
    reconcilers: tuple[str, ...]
    first_mark_age_ms: float
    started: float
    ended: float
    duration_ms: float
    steps_ms: Mapping[str, float]
    findings: tuple[Finding, ...]
    outcomes: tuple[OutcomeRecord, ...]
    gpus: Optional[int]  # None: no GPU inventory

    @classmethod
    def parse(cls, v: Any, where: str) -> PassRecord:
        o = Obj(v, where)
        return cls(
            number=o.integer("number", hi=COUNT_MAX),
            reasons=o.texts("reasons", max_items=64, max_len=4096),
            reconcilers=o.texts("reconcilers", max_items=64, max_len=64),
            first_mark_age_ms=o.real("first_mark_age_ms", lo=-TIME_MAX),
            started=o.real("started"),
            ended=o.real("ended"),
            duration_ms=o.real("duration_ms"),
            steps_ms=o.mapping("steps_ms", lambda x, w: number(x, w, 0.0), max_items=64),
            findings=o.items("findings", _finding, max_items=MAX_FINDINGS),
            outcomes=o.items("outcomes", OutcomeRecord.parse, max_items=MAX_FINDINGS),
            gpus=o.opt_integer("gpus", hi=1 << 20),
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "number": self.number,
            "reasons": list(self.reasons),
            "reconcilers": list(self.reconcilers),
            "first_mark_age_ms": self.first_mark_age_ms,
            "started": self.started,
            "ended": self.ended,
            "duration_ms": self.duration_ms,
            "steps_ms": dict(self.steps_ms),
            "findings": [f.to_json() for f in self.findings],
            "outcomes": [o.to_json() for o in self.outcomes],
            "gpus": self.gpus,
        }

    @property
    def changes(self) -> int:
        return sum(o.status == "done" for o in self.outcomes)


def _gauge(v: Any, where: str) -> float:
    """A step's figure: a count stays the integer it was written as."""
    if isinstance(v, int) and not isinstance(v, bool) and abs(v) <= COUNT_MAX:
        return v
    return number(v, where)


@dataclass(frozen=True)
class StepResult:
    """A step's latest result (ledger.py): a pass runs only the steps its events marked."""

    pass_number: int
    ended: float
    error: Optional[str]  # the step crashed: its verdict is unknown
    findings: tuple[Finding, ...]
    outcomes: tuple[OutcomeRecord, ...]
    gauges: Mapping[str, float]
    unknown: tuple[str, ...] = ()  # what it could not see (a layer that could not be read)

    @classmethod
    def parse(cls, v: Any, where: str) -> StepResult:
        o = Obj(v, where)
        return cls(
            pass_number=o.integer("pass", hi=COUNT_MAX),
            ended=o.real("ended"),
            error=o.opt_text("error", max_len=4096),
            findings=o.items("findings", _finding, max_items=MAX_FINDINGS),
            outcomes=o.items("outcomes", OutcomeRecord.parse, max_items=MAX_FINDINGS),
            gauges=o.mapping("gauges", _gauge, max_items=256, default={}),
            unknown=o.texts("unknown", max_items=64, max_len=4096, default=[]),
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "pass": self.pass_number,
            "ended": self.ended,
            "error": self.error,
            "findings": [f.to_json() for f in self.findings],
            "outcomes": [o.to_json() for o in self.outcomes],
            "gauges": dict(self.gauges),
            "unknown": list(self.unknown),
        }


@dataclass(frozen=True)
class Change:
    time: float
    step: str
    kind: str
    status: str
    target: str

    @classmethod
    def parse(cls, v: Any, where: str) -> Change:
        o = Obj(v, where)
        return cls(
            time=o.real("time"),
            step=o.text("step", max_len=64),
            kind=o.text("kind", max_len=128),
            status=o.text("status", max_len=16),
            target=o.text("target"),
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "time": self.time,
            "step": self.step,
            "kind": self.kind,
            "status": self.status,
            "target": self.target,
        }


@dataclass(frozen=True)
class ConditionState:
    """A node condition as the daemon judged it when it wrote the file."""

    state: str  # ok | problem | unknown
    message: str

    @classmethod
    def parse(cls, v: Any, where: str) -> ConditionState:
        o = Obj(v, where)
        state = o.text("state", max_len=16)
        if state not in STATES:
            raise SchemaError(f"{where}.state: not one of {', '.join(STATES)}")
        return cls(state, o.text("message", max_len=4096))

    def to_json(self) -> dict[str, Any]:
        return {"state": self.state, "message": self.message}


def _off_switch(o: Obj) -> OffSwitch:
    return OffSwitch(
        path=o.text("path", max_len=4096),
        reason=o.text("reason", max_len=REASON_MAX * 4),
        since=o.real("since", lo=-TIME_MAX),
    )


@dataclass(frozen=True)
class Status:
    pid: int
    started: float
    passes: int
    bus_connected: bool
    dry_run: bool
    reload_signal: ReloadSignal
    first_pass: Optional[PassRecord]
    last_pass: Optional[PassRecord]
    fast_paths: FastPaths
    steps: Mapping[str, StepResult]
    recent_changes: tuple[Change, ...]
    node: str = "unknown"  # ok | problem | unknown: the daemon's verdict when it wrote this
    conditions: Mapping[str, ConditionState] = field(default_factory=dict)  # by NPD type
    mode: str = "repair"  # repair | observe (Mode=observe, DryRun=yes, --dry-run)
    off_switch: Optional[OffSwitch] = None  # set when the daemon saw it (it is stopping)


def _parse_status(o: Obj) -> Status:
    node = o.text("node", max_len=16)
    if node not in STATES:
        raise SchemaError(f"node: not one of {', '.join(STATES)}")
    mode = o.text("mode", max_len=16, default="repair")  # absent: written before modes
    if mode not in MODES:
        raise SchemaError(f"mode: not one of {', '.join(MODES)}")
    first, last = o.opt_obj("first_pass"), o.opt_obj("last_pass")
    off = o.opt_obj("off_switch")
    return Status(
        pid=o.integer("pid", lo=1, hi=MAX_PID),
        started=o.real("started"),
        passes=o.integer("passes", hi=COUNT_MAX),
        bus_connected=o.flag("bus_connected"),
        dry_run=o.flag("dry_run"),
        reload_signal=ReloadSignal.parse(o.obj("reload_signal").doc, "reload_signal"),
        first_pass=PassRecord.parse(first.doc, first.where) if first else None,
        last_pass=PassRecord.parse(last.doc, last.where) if last else None,
        fast_paths=FastPaths.parse(o.obj("fast_paths").doc, "fast_paths"),
        steps=o.mapping("steps", StepResult.parse, max_items=64),
        recent_changes=o.items("recent_changes", Change.parse, max_items=10_000),
        node=node,
        conditions=o.mapping("conditions", ConditionState.parse, max_items=64),
        mode=mode,
        off_switch=_off_switch(off) if off else None,
    )


def _render_status(s: Status) -> dict[str, Any]:
    return {
        "pid": s.pid,
        "started": s.started,
        "passes": s.passes,
        "bus_connected": s.bus_connected,
        "dry_run": s.dry_run,
        "reload_signal": s.reload_signal.to_json(),
        "first_pass": s.first_pass.to_json() if s.first_pass else None,
        "last_pass": s.last_pass.to_json() if s.last_pass else None,
        "fast_paths": s.fast_paths.to_json(),
        "steps": {k: v.to_json() for k, v in s.steps.items()},
        "recent_changes": [c.to_json() for c in s.recent_changes],
        "node": s.node,
        "conditions": {k: v.to_json() for k, v in s.conditions.items()},
        "mode": s.mode,
        "off_switch": s.off_switch.to_json() if s.off_switch is not None else None,
    }


SPEC: StateFile[Status] = StateFile(
    path=STATUS_FILE,
    what="status file",
    version=VERSION,
    parse=_parse_status,
    render=_render_status,
    mode=0o644,
    dir_mode=0o755,
    next_step="gpuguard.service rewrites it after its next pass; restart it if this stays",
)


def status_json(s: Status) -> dict[str, Any]:
    """The document as written (for `gpuguard status --json`)."""
    return {"version": VERSION, **_render_status(s)}


def read_status(root: Root, *, alive: bool = True) -> tuple[Optional[Status], str]:
    """(status, "") or (None, one line: why there is none). `alive`: a status whose
    daemon is gone is stale, so None too."""
    path: Path = root.path(STATUS_FILE)
    got = load(path, SPEC)
    if got.value is None:
        if got.absent:
            return None, f"no {STATUS_FILE}: gpuguard daemon not running"
        return None, got.why
    if alive and not root.path(f"/proc/{got.value.pid}").is_dir():
        return None, f"gpuguard daemon (pid {got.value.pid}) is gone; status is stale"
    return got.value, ""
