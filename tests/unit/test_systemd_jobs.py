"""A job's JobRemoved can be dispatched before its caller sees the reply that named the
job (both arrive in one read): the result must not be lost (seen as a 120 s hang)."""

from __future__ import annotations

import asyncio
from typing import Any

from dbus_next import Message, MessageType

from gpuguard.host.systemd import MANAGER, Systemd

JOB = "/org/freedesktop/systemd1/job/42"
ADDR = "unix:path=/nonexistent"  # never connected: call() is replaced


def _job_removed(result: str) -> Message:
    return Message(
        message_type=MessageType.SIGNAL,
        path="/org/freedesktop/systemd1",
        interface=MANAGER,
        member="JobRemoved",
        signature="uoss",
        body=[42, JOB, "kubelet.service", result],
    )


class Early(Systemd):
    """Delivers JobRemoved while the StopUnit call is still returning."""

    async def _subscribe_manager(self) -> None:
        return None

    async def call(
        self, member: str, signature: str = "", body: Any = None, **kw: Any
    ) -> list[Any]:
        self._dispatch(_job_removed("done"))
        return [JOB]


class Late(Early):
    async def call(
        self, member: str, signature: str = "", body: Any = None, **kw: Any
    ) -> list[Any]:
        asyncio.get_running_loop().call_later(0.01, self._dispatch, _job_removed("failed"))
        return [JOB]


def test_job_removed_before_the_reply_is_kept() -> None:
    assert asyncio.run(Early(ADDR).stop_unit("kubelet.service", timeout=2)) == "done"


def test_job_removed_after_the_reply_is_waited_for() -> None:
    assert asyncio.run(Late(ADDR).stop_unit("kubelet.service", timeout=2)) == "failed"
