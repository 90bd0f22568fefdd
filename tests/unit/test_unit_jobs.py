"""The unit-job actuator (actuate/units.py): the job's result comes back, a bus error
becomes the result's error instead of an exception, dry-run queues no job, and the
optional timeout reaches systemd.py only when given."""

from __future__ import annotations

import asyncio
from typing import Any

from gpuguard.actuate.units import run_job
from gpuguard.systemd import SystemdError


class FakeSystemd:
    def __init__(self, result: str = "done", error: str = "") -> None:
        self.calls: list[tuple[str, str, dict[str, Any]]] = []
        self.result, self.error = result, error

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


def test_each_verb_queues_its_job() -> None:
    sd = FakeSystemd()
    for verb in ("restart", "stop", "start"):
        job = asyncio.run(run_job(sd, verb, "kubelet.service"))  # type: ignore[arg-type]
        assert job.ok and job.outcome == "done"
    assert [c[0] for c in sd.calls] == ["RestartUnit", "StopUnit", "StartUnit"]
    assert all(c[2] == {} for c in sd.calls)  # systemd.py's own wait unless told


def test_a_failed_job_and_a_bus_error_are_results() -> None:
    job = asyncio.run(run_job(FakeSystemd("failed"), "stop", "kubelet.service"))  # type: ignore[arg-type]
    assert (job.ok, job.result, job.error) == (False, "failed", "")
    err = asyncio.run(run_job(FakeSystemd(error="bus gone"), "restart", "p.service"))  # type: ignore[arg-type]
    assert (err.ok, err.result, err.outcome) == (False, "", "bus gone")


def test_dry_run_queues_nothing_and_the_timeout_is_passed() -> None:
    sd = FakeSystemd()
    job = asyncio.run(run_job(sd, "restart", "p.service", dry_run=True))  # type: ignore[arg-type]
    assert job.dry_run and not job.ok and sd.calls == []
    asyncio.run(run_job(sd, "restart", "p.service", timeout=7.0))  # type: ignore[arg-type]
    assert sd.calls == [("RestartUnit", "p.service", {"timeout": 7.0})]
