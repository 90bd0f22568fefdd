"""In a v2 scope, which programs deny what (steps/container_access/v2programs.py), and
what the v2 layout plans for each: a denial by systemd's program is the DeviceAllow='s
to repair (a bridge until then); one by a program of the runtime's that systemd's
admit (crun's in SCOPE/container, runc 1.0-rc93's after its update) is replaced in
place, never "repaired" by a DeviceAllow= that cannot change it. systemd's program is
told by its name, or, unnamed (systemd before 249), by PID 1 holding it. A scope that
admits every device is told apart from one that does not."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Optional

import pytest

from gpuguard.devices.bpfprog import ACC_RW, DeviceProgram, DevRule
from gpuguard.steps.container_access import v2programs
from gpuguard.steps.container_access.cgroups import Cgroups
from gpuguard.steps.container_access.reconcile import V2ProgramReplace
from gpuguard.steps.container_access.v2programs import admit_all, attached_from, runtime_deniers
from unit.test_devices_audit import CID, CTL, GPU0, _container, _ent

RUNTIME = DeviceProgram((DevRule(True, "c", 1, 3),), False)  # denies the GPU
SYSTEMD = DeviceProgram((DevRule(True, "c", 195, 0), DevRule(True, "c", 195, 255)), False)
OPEN = DeviceProgram((), True)


class Cache:
    """A ProgramCache of given programs (id -> name, rules; None: unreadable)."""

    def __init__(self, progs: dict[int, tuple[str, Optional[DeviceProgram]]]) -> None:
        self.progs = progs

    def get(self, i: int) -> Optional[DeviceProgram]:
        return self.progs[i][1]

    def name(self, i: int) -> str:
        return self.progs[i][0]

    def admits_rw(self, i: int, p: DeviceProgram, n: tuple[int, int]) -> bool:
        return p.admits("c", n[0], n[1], ACC_RW)


SCOPE = Path("/sys/fs/cgroup/k.slice/cri-containerd-x.scope")
SUB = SCOPE / "container"


def _deniers(
    progs: dict[int, tuple[str, Optional[DeviceProgram]]],
    attached: dict[Path, tuple[int, ...]],
    monkeypatch: pytest.MonkeyPatch,
    held: frozenset[int] = frozenset(),
    above: tuple[int, ...] = (),
) -> tuple[tuple[int, str, tuple[str, ...]], ...]:
    """`attached`: each cgroup's own programs; `above`: the effective set's programs
    attached higher up (a slice's)."""
    monkeypatch.setattr(v2programs, "query_device_programs", lambda d: attached.get(d, ()))
    c = _container(driver="systemd", v1=False, unit=True)
    ent = _ent((GPU0, CTL))
    cache = Cache(progs)
    ids = [*above, *(i for d in (SCOPE, SUB) for i in attached.get(d, ()))]
    verdicts = {
        (CID, n.numbers): all(p is not None and p.admits("c", n.major, n.minor, ACC_RW)
                              for _name, p in (progs[i] for i in ids))
        for n in ent.nodes
    }  # fmt: skip
    dirs = attached_from(SUB, SCOPE)
    return runtime_deniers(cache, c, ent, ids, verdicts, dirs, lambda: held)  # type: ignore[arg-type]


def test_crun_program_below_the_scope_denies_what_systemd_admits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    got = _deniers(
        {1: ("sd_devices", SYSTEMD), 2: ("", RUNTIME)},
        {SCOPE: (1,), SUB: (2,)},
        monkeypatch,
    )
    assert got == ((2, str(SUB), ("195:0", "195:255")),)


def test_a_denial_by_systemds_program_is_left_to_device_allow(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # systemd's (named) denies the GPU too: DeviceAllow= and a bridge, not a replacement
    both = {1: ("sd_devices", RUNTIME), 2: ("", RUNTIME)}
    assert _deniers(both, {SCOPE: (1,), SUB: (2,)}, monkeypatch) == ()
    # systemd 247: unnamed, known by PID 1 holding it
    unnamed = {1: ("", RUNTIME), 2: ("", RUNTIME)}
    assert _deniers(unnamed, {SCOPE: (1, 2)}, monkeypatch, held=frozenset({1})) == ()
    # once its DeviceAllow= is applied, runc 1.0-rc93's program alone denies
    applied = {1: ("", SYSTEMD), 2: ("", RUNTIME)}
    got = _deniers(applied, {SCOPE: (1, 2)}, monkeypatch, held=frozenset({1}))
    assert got == ((2, str(SCOPE), ("195:0", "195:255")),)


def test_an_unreadable_program_or_one_above_the_scope_is_never_replaced(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # 3 is attached above the scope (the pod slice): replacing 2 would not give it back
    above = {1: ("sd_devices", SYSTEMD), 2: ("", RUNTIME), 3: ("", RUNTIME)}
    assert _deniers(above, {SCOPE: (1,), SUB: (2,)}, monkeypatch, above=(3,)) == ()
    # one that cannot be read among them: nothing is replaced
    hidden = {1: ("sd_devices", SYSTEMD), 2: ("", RUNTIME), 3: ("", None)}
    assert _deniers(hidden, {SCOPE: (1, 3), SUB: (2,)}, monkeypatch) == ()


def test_the_layout_plans_a_replacement_of_the_runtimes_program_only_inplace() -> None:
    v2 = Cgroups().v2
    c = dataclasses.replace(_container(driver="systemd", v1=False, unit=True))
    deniers = ((2, str(SUB), ("195:0",)),)
    (a,) = v2.plan_regrant(c, (GPU0, CTL), "inplace", deniers)
    assert isinstance(a, V2ProgramReplace)
    assert (a.cgroup_dir, a.program_id, a.numbers, a.nodes) == (
        str(SUB),
        2,
        ("195:0",),
        ("/dev/nvidia0",),
    )
    assert a.probe_dir == str(c.cgroup_v2)  # where the process is (runc: the scope)
    assert a.fields()["BPF_PROGRAM"] == "2"
    assert v2.plan_regrant(c, (GPU0, CTL), "report", deniers) == ()
    assert v2.plan_regrant(c, (GPU0, CTL), "inplace", ()) == ()


def test_a_scope_admits_all_only_with_no_program_or_open_ones() -> None:
    cache = Cache({1: ("", OPEN), 2: ("sd_devices", SYSTEMD), 3: ("", None)})
    assert admit_all(cache, [])  # type: ignore[arg-type]
    assert admit_all(cache, [1])  # type: ignore[arg-type]
    assert not admit_all(cache, [1, 2])  # type: ignore[arg-type]
    assert not admit_all(cache, [3])  # type: ignore[arg-type]  # unreadable: not known
    assert not admit_all(cache, None)  # type: ignore[arg-type]


def test_attached_from_walks_up_to_the_scope_only() -> None:
    assert attached_from(SUB / "x", SCOPE) == [SUB / "x", SUB, SCOPE]
    assert attached_from(SCOPE, SCOPE) == [SCOPE]
    assert attached_from(Path("/elsewhere"), SCOPE) == [Path("/elsewhere")]
