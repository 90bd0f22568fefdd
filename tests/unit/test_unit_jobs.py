"""The unit-job actuator (actuate/units.py): the job's result comes back, a bus error
becomes the result's error instead of an exception, dry-run queues no job and journals
nothing, a stop of a stopped unit or a start of a running one queues nothing, the
optional timeout reaches systemd.py only when given, and every job queued is exactly
one journal entry with the reason: the caller's kind when done, unit-job-failed else."""

from __future__ import annotations

import asyncio
import io
import json
from typing import Any

import pytest

from gpuguard.actuate.units import FAILED_KIND, UnitJob, UnitJobs, Verb
from gpuguard.engine.executor import ChangeExecutor
from gpuguard.host.systemd import SystemdError, UnitState
from gpuguard.journal.catalog import KINDS, message_id
from gpuguard.journal.log import EventLog


class FakeSystemd:
    def __init__(self, result: str = "done", error: str = "", state: str = "active") -> None:
        self.calls: list[tuple[str, str, dict[str, Any]]] = []
        self.result, self.error, self.state = result, error, state

    async def unit_state(self, unit: str) -> UnitState:
        if self.state == "unreachable":
            raise SystemdError("bus gone")
        return UnitState(unit, "loaded", self.state, "", "", (), 0)

    async def _job(self, member: str, unit: str, kw: dict[str, Any]) -> str:
        self.calls.append((member, unit, kw))
        if self.error:
            raise SystemdError(self.error)
        return self.result

    async def restart_unit(self, unit: str, **kw: Any) -> str:
        return await self._job("RestartUnit", unit, kw)

    async def stop_unit(self, unit: str, **kw: Any) -> str:
        return await self._job("StopUnit", unit, kw)

    async def start_unit(self, unit: str, **kw: Any) -> str:
        return await self._job("StartUnit", unit, kw)


def job(verb: Verb, unit: str = "kubelet.service") -> UnitJob:
    return UnitJob(verb, unit, "to repair its checkpoint", "kubelet-stop", {"REASON": "check"})


def run(sd: FakeSystemd, j: UnitJob, *, dry_run: bool = False) -> tuple[Any, list[dict[str, Any]]]:
    out = io.StringIO()
    jobs = UnitJobs(sd, EventLog(stream=out, level="debug"))  # type: ignore[arg-type]
    res = asyncio.run(ChangeExecutor(dry_run=dry_run).run_async(jobs.change(j)))
    return res, [json.loads(line) for line in out.getvalue().splitlines()]


@pytest.mark.parametrize(
    ("verb", "state", "member"),
    [("restart", "active", "RestartUnit"), ("stop", "active", "StopUnit"),
     ("start", "inactive", "StartUnit"), ("start", "failed", "StartUnit")],
)  # fmt: skip
def test_each_verb_queues_its_job_and_journals_it_once(verb: Verb, state: str, member: str) -> None:
    sd = FakeSystemd(state=state)
    res, entries = run(sd, job(verb))
    assert res.ok and res.outcome == "done" and not res.already
    assert sd.calls == [(member, "kubelet.service", {})]  # systemd.py's own wait
    (e,) = entries
    assert (e["kind"], e["level"]) == ("kubelet-stop", "notice")
    assert e["msg"].endswith("kubelet.service to repair its checkpoint")
    assert (e["UNIT"], e["JOB_RESULT"], e["REASON"]) == ("kubelet.service", "done", "check")


@pytest.mark.parametrize(("verb", "state"), [("stop", "inactive"), ("stop", "failed"),
                                             ("start", "active")])  # fmt: skip
def test_no_job_and_no_entry_when_the_unit_is_already_there(verb: Verb, state: str) -> None:
    sd = FakeSystemd(state=state)
    res, entries = run(sd, job(verb))
    assert res.ok and res.already and sd.calls == [] and entries == []


def test_an_unreadable_state_still_queues_the_job() -> None:
    sd = FakeSystemd(state="unreachable")
    res, entries = run(sd, job("stop"))
    assert res.ok and [c[0] for c in sd.calls] == ["StopUnit"] and len(entries) == 1


def test_a_failed_job_and_a_bus_error_are_results_and_unit_job_failed() -> None:
    res, entries = run(FakeSystemd("failed"), job("restart"))
    assert (res.ok, res.result, res.error) == (False, "failed", "")
    (e,) = entries
    assert (e["kind"], e["level"], e["JOB_RESULT"]) == (FAILED_KIND, "error", "failed")
    assert e["msg"] == "RestartUnit kubelet.service to repair its checkpoint: failed"
    err, entries = run(FakeSystemd(error="bus gone"), job("restart", "p.service"))
    assert (err.ok, err.result, err.outcome) == (False, "", "bus gone")
    assert [(e["kind"], e["UNIT"], e["JOB_RESULT"]) for e in entries] == [
        (FAILED_KIND, "p.service", "bus gone")
    ]
    assert FAILED_KIND in KINDS and message_id(FAILED_KIND)


def test_dry_run_queues_nothing_and_journals_nothing() -> None:
    sd = FakeSystemd()
    res, entries = run(sd, job("restart"), dry_run=True)
    assert res.described and not res.ok and sd.calls == [] and entries == []


def test_the_timeout_is_passed() -> None:
    sd = FakeSystemd()
    jobs = UnitJobs(sd, EventLog(stream=io.StringIO()))  # type: ignore[arg-type]
    asyncio.run(jobs.run(job("restart", "p.service"), timeout=7.0))
    assert sd.calls == [("RestartUnit", "p.service", {"timeout": 7.0})]
