"""Observe mode plans the same change at every event while a loss lasts: the plan is
journaled once per REMINDER, even when its detail names what each daemon-reload renews
(systemd's program id on a cgroup v2 scope); a changed plan is journaled at once."""

from __future__ import annotations

import io
import json

from gpuguard.actuate.bpf import Replacement
from gpuguard.devices.bpfprog import DeviceProgram
from gpuguard.journal.conditions import REMINDER
from gpuguard.journal.log import EventLog
from gpuguard.model import Outcome
from gpuguard.steps.container_access.bridgeplan import BridgeAttach


def test_a_plan_renewed_by_each_reload_is_journaled_once() -> None:
    out = io.StringIO()
    log = EventLog(stream=out, level="info")
    log.repeat_window = REMINDER

    def plan(old_id: int, nodes: str) -> None:
        a = BridgeAttach("container_access", f"{nodes} denied", "/sys/fs/cgroup/x.scope")
        r = Replacement("/sys/fs/cgroup/x.scope", old_id, 0, DeviceProgram((), False))
        log.outcome(Outcome(a, "dry-run", r.describe()))

    plan(101, "/dev/nvidia0")
    plan(102, "/dev/nvidia0")  # systemd's new program after a daemon-reload
    plan(103, "/dev/nvidia0")
    plan(104, "/dev/nvidia0, /dev/nvidia1")  # another plan
    said = [json.loads(line)["msg"] for line in out.getvalue().splitlines()]
    assert len(said) == 2, said
    assert "program 101" in said[0] and "program 104" in said[1]
