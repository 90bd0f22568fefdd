"""The re-admission bridge's end while kubelet runs: the plugin kubelet dropped then is
restarted at once (steps/device_plugin/allocatable.py, bridge_end.py, limits.py).

kubelet 1.34 drops the plugin that replaced the bridge's endpoint when the bridge's
stream ends (a stop, restart or kill of gpuguard-readmit while kubelet runs). Before,
the rule waited for RegistrationGrace after kubelet's start and for the plugin's socket
to be older than RegistrationGrace, and the cool-down from the plugin's start held the
restart back: after a reboot (kubelet and plugin seconds old) nothing looked again
before the audit, and new pods were rejected meanwhile.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

from gpuguard.actuate.statefile import write_state
from gpuguard.config import DevicePluginConfig
from gpuguard.devices.processes import process_start
from gpuguard.host.paths import Root
from gpuguard.readmit.state import SPEC, STATE_FILE, ReadmitState, Registration
from gpuguard.steps.device_plugin import DevicePluginStep
from gpuguard.steps.device_plugin.allocatable import K_NOT_ALLOCATABLE
from gpuguard.steps.device_plugin.bridge_end import read_bridge_end
from gpuguard.steps.device_plugin.limits import why_not
from gpuguard.steps.device_plugin.reconcile import CAUSE_NOT_ALLOCATABLE, assess
from gpuguard.steps.device_plugin.state import PluginState
from unit.test_plugins_allocatable import GRACE, KUBELET, counts, obs, plugin

# a reboot: kubelet 10 s old, the plugin registered 3 s ago, the bridge ended 1 s ago
NOW = KUBELET + 10
SOON = dict(now=NOW, allocatable=counts({"nvidia.com/gpu": 0}))


def test_the_plugin_kubelet_dropped_at_the_bridge_s_end_is_restarted_at_once() -> None:
    young = plugin(ctime=NOW - 3)
    r = assess(obs(young, bridge_ended=NOW - 1, **SOON), registration_grace=GRACE)
    (f,) = r.findings
    assert f.kind == K_NOT_ALLOCATABLE and f.fields["BRIDGE_ENDED"] == f"{NOW - 1:.3f}"
    (a,) = r.actions
    assert a.cause == CAUSE_NOT_ALLOCATABLE and a.prompt
    assert "since the re-admission bridge's streams ended" in a.reason


def test_without_the_bridge_s_end_a_young_kubelet_and_plugin_are_not_judged() -> None:
    young = plugin(ctime=NOW - 3)
    r = assess(obs(young, **SOON), registration_grace=GRACE)
    assert r.findings == () and r.actions == ()


def test_a_plugin_registered_after_the_bridge_s_end_is_not_judged_early() -> None:
    later = plugin(ctime=NOW - 0.5)  # registering now: kubelet did not drop it
    r = assess(obs(later, bridge_ended=NOW - 1, **SOON), registration_grace=GRACE)
    assert r.findings == () and r.actions == ()
    # allocatable: nothing was dropped
    ok = dict(SOON, allocatable=counts({"nvidia.com/gpu": 2}))
    r = assess(obs(plugin(ctime=NOW - 3), bridge_ended=NOW - 1, **ok), registration_grace=GRACE)
    assert r.findings == () and r.actions == ()


def test_the_cool_down_does_not_hold_it_but_the_hourly_budget_does() -> None:
    young = dataclasses.replace(plugin(ctime=NOW - 3), process=plugin().process)
    (a,) = assess(obs(young, bridge_ended=NOW - 1, **SOON), registration_grace=GRACE).actions
    a = dataclasses.replace(a, process=dataclasses.replace(a.process, start=NOW - 4))
    cfg = DevicePluginConfig()  # CoolDown=5min, MaxRestartsPerHour=3
    kw: dict[str, Any] = dict(backoff_base=60.0, backoff_max=3600.0)
    assert why_not(cfg, PluginState(), a, NOW, **kw) is None
    slow = dataclasses.replace(a, prompt=False)
    assert why_not(cfg, PluginState(), slow, NOW, **kw)[0] == "cool-down"  # type: ignore[index]
    spent = PluginState(restarts=[NOW - 100, NOW - 50, NOW - 10])
    assert why_not(cfg, spent, a, NOW, **kw)[0] == "budget"  # type: ignore[index]


def _state(tmp: Path, **kw: Any) -> Root:
    root = Root(tmp)
    reg = Registration("nvidia.com/gpu", KUBELET + 0.05, ("GPU-a",))
    s = ReadmitState("7:1", KUBELET, "offered", "1 pod", registrations=(reg,), **kw)
    write_state(root.path(STATE_FILE), SPEC, s)
    return root


def test_the_end_is_read_from_the_state_file_or_from_the_process_being_gone(
    tmp_path: Path,
) -> None:
    me = os.getpid()
    start = process_start(Root(Path("/")), me)
    assert start is not None
    # each root's /proc is the host's: the test's own process is the bridge
    alive = _state(tmp_path / "a", pid=me, pid_start=start)
    (tmp_path / "a/proc").symlink_to("/proc")
    assert read_bridge_end(alive, KUBELET) is None  # the registering process runs
    said = _state(tmp_path / "b", pid=me, pid_start=start, streams_ended=KUBELET + 9)
    end = read_bridge_end(said, KUBELET)
    assert end is not None and end.ended == KUBELET + 9
    gone = _state(tmp_path / "c", pid=me, pid_start=start - 100)  # a recycled pid
    (tmp_path / "c/proc").symlink_to("/proc")
    end = read_bridge_end(gone, KUBELET)
    assert end is not None and end.gone and end.ended is None
    # another kubelet run, or a bridge that registered nothing: nothing ended
    assert read_bridge_end(said, KUBELET + 20) is None
    assert read_bridge_end(_state(tmp_path / "d"), KUBELET) is None

    step = DevicePluginStep()
    first = step.bridge_end.ended(gone, KUBELET, NOW)
    assert first == NOW and step.bridge_end.ended(gone, KUBELET, NOW + 5) == NOW  # the first pass
    assert step.bridge_end.ended(said, KUBELET, NOW + 5) == KUBELET + 9
