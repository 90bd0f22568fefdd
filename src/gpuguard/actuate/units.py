"""Systemd unit jobs (RestartUnit, StopUnit, StartUnit): the one way gpuguard stops,
starts or restarts a unit, for kubelet around a checkpoint repair and for a device
plugin that runs as a host service.

A job is queued with mode "replace" and awaited to its end (systemd.py bounds the wait);
a bus or systemd error becomes the result's `error`, never an exception, so each caller
decides what a failed job means for its step. Under dry-run no job is queued. The
journal entry for the change (with its reason) is the caller's: a kubelet stop, repair
and start is one entry for two jobs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Optional

if TYPE_CHECKING:  # dbus-next costs import time; a healthy node never needs it
    from gpuguard.systemd import Systemd

Verb = Literal["restart", "stop", "start"]
MEMBER = {"restart": "RestartUnit", "stop": "StopUnit", "start": "StartUnit"}


@dataclass(frozen=True)
class JobResult:
    verb: Verb
    unit: str
    result: str  # systemd's job result ("done", "failed", "timeout" ...); "" if none ran
    error: str = ""  # why no result came: the bus, or systemd refused the job
    dry_run: bool = False

    @property
    def ok(self) -> bool:
        return self.result == "done"

    @property
    def outcome(self) -> str:
        """The job's result, or the error that stood in for it."""
        return self.error or self.result


async def run_job(
    systemd: Systemd,
    verb: Verb,
    unit: str,
    *,
    dry_run: bool = False,
    timeout: Optional[float] = None,  # None: systemd.py's default wait for the job
) -> JobResult:
    if dry_run:
        return JobResult(verb, unit, "", dry_run=True)
    from gpuguard.systemd import SystemdError

    call = {
        "restart": systemd.restart_unit,
        "stop": systemd.stop_unit,
        "start": systemd.start_unit,
    }[verb]
    try:
        result = await (call(unit) if timeout is None else call(unit, timeout=timeout))
    except SystemdError as e:
        return JobResult(verb, unit, "", error=str(e))
    return JobResult(verb, unit, result)
