"""Systemd unit jobs (RestartUnit, StopUnit, StartUnit): the one way gpuguard stops,
starts or restarts a unit, for kubelet around a checkpoint repair and for a device
plugin that runs as a host service.

Like every actuator it checks first, honours dry-run and journals each change once,
with its reason:

- a stop of a unit already stopped, or a start of one already running, queues no job
  and writes no entry (nothing changes); a restart is always queued;
- under dry-run no job is queued and nothing is journaled (the caller's plan says it);
- every job queued is one entry: the caller's kind (what the change is to its step,
  `kubelet-restart`, `plugin-restarted` ...) when systemd answers "done", else
  `unit-job-failed`, both with the reason, UNIT, JOB_RESULT and the caller's fields.

A job is queued with mode "replace" and awaited to its end (host/systemd.py bounds the wait);
a bus or systemd error becomes the result's `error`, never an exception, so each caller
decides what a failed job means for its step (its own entry for that consequence).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, Mapping, Optional

from gpuguard.actuate.change import AsyncChange

if TYPE_CHECKING:  # dbus-next costs import time; a healthy node never needs it
    from gpuguard.host.systemd import Systemd
    from gpuguard.journal.log import EventLog

Verb = Literal["restart", "stop", "start"]
MEMBER = {"restart": "RestartUnit", "stop": "StopUnit", "start": "StartUnit"}
_DONE = {"restart": "restarted", "stop": "stopped", "start": "started"}
# Unit states in which a stop or a start would change nothing.
_ALREADY = {"stop": ("inactive", "failed"), "start": ("active", "reloading")}
FAILED_KIND = "unit-job-failed"


@dataclass(frozen=True)
class UnitJob:
    """One job and its journal entry. ``reason`` completes "restarted UNIT ..." (a
    clause: "so that its pre-start hook repairs ...", "because ..."); ``kind`` is the
    entry's kind when the job is done; ``fields`` are the caller's (its step, ...)."""

    verb: Verb
    unit: str
    reason: str
    kind: str
    fields: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class JobResult:
    verb: Verb
    unit: str
    result: str  # systemd's job result ("done", "failed", "timeout" ...); "" if none ran
    error: str = ""  # why no result came: the bus, or systemd refused the job
    described: bool = False  # no job: a dry-run's description of it
    already: bool = False  # no job: the unit was already in the state asked for

    @property
    def ok(self) -> bool:
        return self.result == "done"

    @property
    def outcome(self) -> str:
        """The job's result, or the error that stood in for it."""
        return self.error or self.result


class UnitJobs:
    """Built per pass (or per `gpuguard check`) from the bus connection and the log."""

    def __init__(self, systemd: Systemd, log: EventLog) -> None:
        self.systemd = systemd
        self.log = log

    def change(self, job: UnitJob, *, timeout: Optional[float] = None) -> AsyncChange[JobResult]:
        """``job`` as a change for the executor: a dry-run queues and journals nothing."""
        return AsyncChange(
            f"unit-{job.verb}",
            lambda: self.run(job, timeout=timeout),
            lambda: JobResult(job.verb, job.unit, "", described=True),
        )

    async def _already(self, job: UnitJob) -> bool:
        states = _ALREADY.get(job.verb)
        if states is None:
            return False
        from gpuguard.host.systemd import SystemdError

        try:
            state = await self.systemd.unit_state(job.unit)
        except SystemdError:
            return False  # the job itself will say what the bus says
        return state.load_state == "loaded" and state.active_state in states

    async def run(self, job: UnitJob, *, timeout: Optional[float] = None) -> JobResult:
        """Queue ``job`` and await its result (``timeout``: None, host/systemd.py's wait).
        The making half of `change`, which callers that may be dry-runs give the
        executor."""
        if await self._already(job):
            return JobResult(job.verb, job.unit, "done", already=True)
        from gpuguard.host.systemd import SystemdError

        call = {
            "restart": self.systemd.restart_unit,
            "stop": self.systemd.stop_unit,
            "start": self.systemd.start_unit,
        }[job.verb]
        try:
            result = await (call(job.unit) if timeout is None else call(job.unit, timeout=timeout))
            res = JobResult(job.verb, job.unit, result)
        except SystemdError as e:
            res = JobResult(job.verb, job.unit, "", error=str(e))
        self._journal(job, res)
        return res

    def _journal(self, job: UnitJob, res: JobResult) -> None:
        fields = {
            "UNIT": job.unit,
            "GPUGUARD_ACTION": f"{job.verb}-unit",
            "JOB_RESULT": res.outcome,
            **job.fields,
        }
        if res.ok:
            msg = f"{_DONE[job.verb]} {job.unit} {job.reason}"
            self.log.event(job.kind, msg, level="notice", fields=fields)
        else:
            msg = f"{MEMBER[job.verb]} {job.unit} {job.reason}: {res.outcome}"
            self.log.event(FAILED_KIND, msg, level="error", fields=fields)
