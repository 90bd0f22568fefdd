"""V2Remedy=inplace on bad input, through the running daemon on a unified systemd node.

The scope-less containers of test_cpumanager_rewrite.py (cgroupfs driver layout, runc's
program played by harness/bpfdev.py), after the CPU manager's update took their GPU:

- a second device program attached next to runc's: gpuguard does not know which one to
  replace, so it replaces none: a `container-program-unexpected` finding naming the
  container, the cgroup and the next step; the kernel still denies (nothing broader);
- a frozen cgroup (cgroup.freeze): the replacement fails once with a clear reason, then
  is held back (`container-repair-backoff`, journaled once) instead of retried on each
  of the audits that follow (AuditInterval=1s); the old program stays attached;
- the daemon without CAP_SYS_ADMIN and CAP_BPF (a drop-in): BPF_PROG_QUERY fails, the
  replacement fails once and is held back the same way.

No daemon crash in any of them, and the other GPU is never admitted.
"""

from __future__ import annotations

import time

import pytest

from gpuguard.devices.bpfread import ProgramCache, judge
from gpuguard.devices.probe import query_device_programs
from integration.gpu_scopes import containers
from integration.gpuguard_ns import events, paused, wait_for
from integration.harness import systemd_ns as systemd_ns
from integration.harness.bpfdev import DEFAULT_RULES, attach, program, replace_programs
from integration.test_cpumanager_rewrite import AUDIT_INTERVAL, _boot, _cgroup, _verdict

pytestmark = pytest.mark.root


def _lose_gpu(ns, c, *, frozen: bool = False) -> int:  # type: ignore[no-untyped-def]
    """The CPU manager's update: runc's program from the spec replaces the hook's."""
    replace_programs(_cgroup(ns, c), DEFAULT_RULES)
    if frozen:  # a probe would freeze too: the programs' verdict (test_bpf_verdicts.py)
        assert judge(ProgramCache(), _cgroup(ns, c), [(195, c.gpus[0])]) == {
            (195, c.gpus[0]): False
        }
    else:
        assert _verdict(ns, c, c.gpus[0]) is False
    (prog,) = query_device_programs(_cgroup(ns, c))
    return prog


def _mine(ns, kind: str, c) -> list:  # type: ignore[no-untyped-def, type-arg]
    return [e for e in events(ns, kind) if e.get("CONTAINER_ID") == c.container_id]


def test_a_second_program_is_reported_not_replaced(systemd_ns, tmp_path) -> None:  # type: ignore[no-untyped-def]
    (c,) = containers(1)
    ns = _boot(systemd_ns, tmp_path, [c], "v2")
    with paused(ns):  # the 1 s audit would replace runc's program before the second lands
        runc = _lose_gpu(ns, c)
        attach(_cgroup(ns, c), program(DEFAULT_RULES), b"legacy_hook")  # another tool's
    two = query_device_programs(_cgroup(ns, c))
    assert len(two) == 2 and runc in two
    found = wait_for(
        lambda: _mine(ns, "container-program-unexpected", c),
        timeout=AUDIT_INTERVAL + 5,
        what="the finding",
    )
    e = found[0]
    assert str(_cgroup(ns, c)).endswith(e["CGROUP"].split("/sys/fs/cgroup/")[-1])
    assert e["PRIORITY"] == "3" and "restart the container" in e["MESSAGE"]
    assert "\n" not in e["MESSAGE"] and c.container_id[:12] in e["MESSAGE"]
    time.sleep(3 * AUDIT_INTERVAL)  # more audits: the state is journaled once
    assert len(_mine(ns, "container-program-unexpected", c)) == 1
    assert not _mine(ns, "v2-program-replace", c)
    assert query_device_programs(_cgroup(ns, c)) == two
    assert _verdict(ns, c, c.gpus[0]) is False and _verdict(ns, c, 1 - c.gpus[0]) is False
    assert not events(ns, "reconciler-crashed")


def _held_back(ns, c, reason: str) -> None:  # type: ignore[no-untyped-def]
    failed = wait_for(
        lambda: [e for e in _mine(ns, "v2-program-replace", c) if e["GPUGUARD_STATUS"] == "failed"],
        timeout=AUDIT_INTERVAL + 10,
        what="the failed replacement",
    )
    assert reason in failed[0]["MESSAGE"], failed[0]["MESSAGE"]
    held = wait_for(
        lambda: _mine(ns, "container-repair-backoff", c),
        timeout=AUDIT_INTERVAL + 5,
        what="the back-off finding",
    )
    assert held[0]["FAILURES"] == "1" and reason in held[0]["MESSAGE"]
    time.sleep(4 * AUDIT_INTERVAL)  # four audits more: no retry, the state logged once
    assert len(_mine(ns, "v2-program-replace", c)) == 1
    assert len(_mine(ns, "container-repair-backoff", c)) == 1
    assert not events(ns, "reconciler-crashed")


def test_a_frozen_cgroup_fails_once_then_is_held_back(systemd_ns, tmp_path) -> None:  # type: ignore[no-untyped-def]
    (c,) = containers(1)
    ns = _boot(systemd_ns, tmp_path, [c], "v2")
    (_cgroup(ns, c) / "cgroup.freeze").write_text("1")
    try:
        runc = _lose_gpu(ns, c, frozen=True)
        _held_back(ns, c, "the cgroup is frozen")
        assert query_device_programs(_cgroup(ns, c)) == (runc,)
    finally:
        (_cgroup(ns, c) / "cgroup.freeze").write_text("0")
    assert _verdict(ns, c, c.gpus[0]) is False and _verdict(ns, c, 1 - c.gpus[0]) is False


def test_without_bpf_capabilities_fails_once_then_is_held_back(systemd_ns, tmp_path) -> None:  # type: ignore[no-untyped-def]
    (c,) = containers(1)
    ns = _boot(systemd_ns, tmp_path, [c], "v2")
    ns.write_unit(
        "gpuguard.service.d/70-no-bpf.conf",
        "[Service]\nCapabilityBoundingSet=~CAP_SYS_ADMIN CAP_BPF\n",
        reload=True,
    )
    ns.systemctl("restart", "gpuguard.service")
    runc = _lose_gpu(ns, c)
    _held_back(ns, c, "Operation not permitted")
    assert query_device_programs(_cgroup(ns, c)) == (runc,)
    assert _verdict(ns, c, c.gpus[0]) is False and _verdict(ns, c, 1 - c.gpus[0]) is False
