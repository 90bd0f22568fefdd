"""In-place repair on cgroup v2 without a scope (actuate/bpf.py), judged by the kernel.

A real cgroup2 directory under /sys/fs/cgroup/unified/gpuguard-test-<random>/, a device
program attached with raw bpf(2) as runc attaches its own (BPF_F_ALLOW_MULTI), fake GPU
nodes made with mknod in a temporary directory (never the host /dev): EPERM from the
program = denied, ENXIO = admitted (no driver behind the numbers).

- the lost node is admitted after the replacement, nothing else changes, one program;
- property (hypothesis, bounded): over random previous programs and lost nodes, the
  kernel admits after exactly what it admitted before plus the lost nodes;
- bad input: a program of unknown shape, no capabilities (setpriv), a frozen cgroup, an
  ancestor's program denying the node too: a clear error, the old program still
  attached, the verdicts unchanged;
- the step's actuator (V2Remedy=inplace): dry-run prints the replacement, changes nothing.

Everything is removed in finalizers (programs with their cgroup, cgroups deepest first).
"""

from __future__ import annotations

import contextlib
import os
import stat
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Callable, Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import require_root, require_tool
from gpuguard.actuate.bpf import BpfReplaceError, replace_change, replace_device_program
from gpuguard.devices.bpfprog import ACC_RW, DeviceProgram, DevRule, build
from gpuguard.devices.probe import probe_open, query_device_programs
from gpuguard.engine.executor import ChangeExecutor
from gpuguard.host.paths import Root
from gpuguard.steps.container_access.actuate import program_replace_change
from gpuguard.steps.container_access.reconcile import V2ProgramReplace
from integration.harness.bpfdev import OTHER_SHAPE, attach, detach_all, verdicts

pytestmark = pytest.mark.root

V2 = Path("/sys/fs/cgroup/unified")
NODES = [(195, 0), (195, 1), (195, 255), (510, 0), (510, 1), (1, 3)]
RUNC = DeviceProgram(
    (DevRule(True, "c", 1, 3, 7), DevRule(True, "c", 1, 5, 7), DevRule(True, "c", 136, None, 7)),
    False,
)
EXAMPLES = int(os.environ.get("GPUGUARD_PROPERTY_EXAMPLES", "15"))
#: the kernel's verdicts over hypothesis' programs: bounded, the same examples every run
KERNEL_EXAMPLES = settings(
    max_examples=EXAMPLES,
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)


def rule_lists(max_size: int) -> st.SearchStrategy[list[DevRule]]:
    """Random rules of runc's and systemd's shape (a wildcard in any field)."""
    return st.lists(
        st.builds(
            DevRule,
            st.booleans(),
            st.sampled_from(["c", None]),
            st.sampled_from([195, 510, 1, None]),
            st.sampled_from([0, 1, 255, 3, None]),
            st.sampled_from([None, ACC_RW, 2, 7]),
        ).filter(lambda r: (r.kind, r.major, r.minor, r.access) != (None,) * 4),
        max_size=max_size,
    )


@pytest.fixture
def cgroup(tmp_path: Path) -> Iterator[Path]:
    require_root()
    require_tool(str(V2 / "cgroup.procs"))
    base = V2 / f"gpuguard-test-{uuid.uuid4().hex[:12]}"
    base.mkdir()
    try:
        yield base
    finally:
        with contextlib.suppress(OSError):
            (base / "cgroup.freeze").write_text("0")
        for _ in range(100):  # a probe child may still be leaving
            try:
                base.rmdir()
                break
            except OSError:
                time.sleep(0.02)
        assert not base.exists(), f"could not remove {base}"


@pytest.fixture
def nodes(tmp_path: Path) -> dict[tuple[int, int], Path]:
    out = {}
    for ma, mi in NODES:
        p = tmp_path / f"n{ma}_{mi}"
        os.mknod(p, stat.S_IFCHR | 0o666, os.makedev(ma, mi))
        out[(ma, mi)] = p
    return out


def _verify(
    cg: Path, nodes: dict[tuple[int, int], Path], lost: list[tuple[int, int]]
) -> Callable[[], bool]:
    return lambda: all(probe_open(nodes[n], [cg], timeout=5).verdict is True for n in lost)


def test_lost_node_admitted_in_place(cgroup: Path, nodes: dict[tuple[int, int], Path]) -> None:
    old = attach(cgroup, build(RUNC))
    before = verdicts(cgroup, nodes)
    assert before[(195, 0)] is False and before[(1, 3)] is True

    dry = ChangeExecutor(dry_run=True).run(
        replace_change(cgroup, [(195, 0)], _verify(cgroup, nodes, []))
    )
    assert (dry.new_id, query_device_programs(cgroup)) == (0, (old,))
    assert dry.program.describe().startswith("allow c 195:0 rw; allow c 1:3 rwm")
    assert verdicts(cgroup, nodes) == before

    r = replace_device_program(cgroup, [(195, 0)], _verify(cgroup, nodes, [(195, 0)]))
    assert query_device_programs(cgroup) == (r.new_id,) and r.new_id != old
    assert verdicts(cgroup, nodes) == {**before, (195, 0): True}
    p = probe_open(nodes[(195, 0)], [cgroup])
    assert p.errno == 6  # ENXIO: past the program, no driver


@KERNEL_EXAMPLES
@given(
    rule_lists(5),
    st.booleans(),
    st.lists(st.sampled_from(NODES), max_size=3),
)
def test_kernel_admits_previous_plus_lost_only(
    cgroup: Path,
    nodes: dict[tuple[int, int], Path],
    rules: list[DevRule],
    default: bool,
    lost: list[tuple[int, int]],
) -> None:
    detach_all(cgroup)  # the previous example's program
    old = attach(cgroup, build(DeviceProgram(tuple(rules), default)))
    assert query_device_programs(cgroup) == (old,)
    before = verdicts(cgroup, nodes)
    r = replace_device_program(cgroup, lost, lambda: True)
    after = verdicts(cgroup, nodes)
    assert query_device_programs(cgroup) == (r.new_id,)
    for n in NODES:  # the kernel's word: exactly before plus the lost nodes
        assert after[n] == (before[n] or n in lost), (n, before[n], after[n])


def test_unknown_shape_is_refused_and_kept(
    cgroup: Path, nodes: dict[tuple[int, int], Path]
) -> None:
    old = attach(cgroup, OTHER_SHAPE)
    before = verdicts(cgroup, nodes)
    with pytest.raises(BpfReplaceError, match=f"program {old} left as it is: instruction 2"):
        replace_device_program(cgroup, [(195, 0)], lambda: True)
    assert query_device_programs(cgroup) == (old,)
    assert verdicts(cgroup, nodes) == before


def test_frozen_cgroup_keeps_the_old_program(
    cgroup: Path, nodes: dict[tuple[int, int], Path]
) -> None:
    old = attach(cgroup, build(RUNC))
    (cgroup / "cgroup.freeze").write_text("1")
    # the probe's child would freeze on joining: refused before any swap
    with pytest.raises(BpfReplaceError, match=r"the cgroup is frozen .* the old program stays"):
        replace_device_program(cgroup, [(195, 0)], _verify(cgroup, nodes, [(195, 0)]))
    assert query_device_programs(cgroup) == (old,)
    # frozen between the check and the probe: the probe times out, the swap is undone
    with pytest.raises(BpfReplaceError, match="the old program is back"):

        def freeze_then_probe() -> bool:
            (cgroup / "cgroup.freeze").write_text("1")
            return probe_open(nodes[(195, 0)], [cgroup], timeout=5).verdict is True

        (cgroup / "cgroup.freeze").write_text("0")
        replace_device_program(cgroup, [(195, 0)], freeze_then_probe)
    assert query_device_programs(cgroup) == (old,)
    (cgroup / "cgroup.freeze").write_text("0")
    assert verdicts(cgroup, nodes)[(195, 0)] is False


def test_without_capabilities_a_clear_error(
    cgroup: Path, nodes: dict[tuple[int, int], Path]
) -> None:
    require_tool("setpriv")
    old = attach(cgroup, build(RUNC))
    code = (
        "import sys; from pathlib import Path\n"
        "from gpuguard.actuate.bpf import BpfReplaceError, replace_change, replace_device_program\n"
        "try:\n"
        f"    replace_device_program(Path({str(cgroup)!r}), [(195, 0)], lambda: True)\n"
        "except BpfReplaceError as e:\n"
        "    print(e); sys.exit(3)\n"
    )
    res = subprocess.run(
        ["setpriv", "--inh-caps=-all", "--bounding-set=-all", sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 3, res.stderr
    assert res.stdout.startswith(f"{cgroup}: ") and "Operation not permitted" in res.stdout
    assert "Traceback" not in res.stderr
    assert query_device_programs(cgroup) == (old,)
    assert verdicts(cgroup, nodes)[(195, 0)] is False


def _action(cg: Path, nodes: dict[tuple[int, int], Path]) -> V2ProgramReplace:
    return V2ProgramReplace(
        reconciler="container_access",
        reason="test",
        target=str(cg),
        cgroup_dir=str(cg),
        nodes=(str(nodes[(195, 0)]),),
        numbers=("195:0",),
    )


def test_step_actuator_dry_run_then_real(cgroup: Path, nodes: dict[tuple[int, int], Path]) -> None:
    old = attach(cgroup, build(RUNC))
    a = _action(cgroup, nodes)
    o = ChangeExecutor(dry_run=True).run(program_replace_change(a, Root(Path("/"))))
    assert o.status == "dry-run" and "allow c 195:0 rw" in o.detail and "(dry-run)" in o.detail
    assert query_device_programs(cgroup) == (old,)
    assert verdicts(cgroup, nodes)[(195, 0)] is False
    o = ChangeExecutor().run(program_replace_change(a, Root(Path("/"))))
    assert o.status == "done", o.detail
    assert verdicts(cgroup, nodes)[(195, 0)] is True


def test_ancestor_denies_so_the_swap_is_rolled_back(
    cgroup: Path, nodes: dict[tuple[int, int], Path]
) -> None:
    # The parent's program denies the GPU too: replacing the container's cannot help, the
    # probe says so, the old program comes back and the outcome says why.
    attach(cgroup, build(RUNC))
    ctr = cgroup / "ctr"
    ctr.mkdir()
    try:
        old = attach(ctr, build(RUNC))
        o = ChangeExecutor().run(program_replace_change(_action(ctr, nodes), Root(Path("/"))))
        assert o.status == "failed" and "the old program is back" in o.detail
        assert query_device_programs(ctr) == (old,)
        assert verdicts(ctr, nodes)[(195, 0)] is False
    finally:
        for _ in range(100):
            try:
                ctr.rmdir()
                break
            except OSError:
                time.sleep(0.02)
