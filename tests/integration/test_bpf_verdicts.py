"""cgroup v2 verdicts without a fork (devices/bpfread.judge) agree with the kernel's.

The container access step judges a v2 container from the device programs the kernel
runs for its cgroup (BPF_F_QUERY_EFFECTIVE: its own and its ancestors'), each parsed
once, instead of forking a probe per node. Here random programs of runc's/systemd's
shape are attached to a parent cgroup and to its child (ALLOW_MULTI, as runc and
systemd attach them), and for every fake node the in-process verdict must equal the
kernel's answer to a real open from inside the child (EPERM vs ENXIO), as must the
batched probe (one fork for all nodes). A program of another shape makes `judge` give
up (None), never guess. Real cgroups under /sys/fs/cgroup/unified, removed afterwards.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path
from typing import Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpuguard.actuate.bpf import BPF_PROG_DETACH, _attach
from gpuguard.devices.bpfprog import ACC_RW, DeviceProgram, DevRule, build
from gpuguard.devices.bpfread import ProgramCache, effective_programs, fd_by_id, judge
from gpuguard.devices.probe import probe_open, probe_open_all, query_device_programs
from integration.test_bpf_inplace import EXAMPLES, NODES, _attach_prog
from integration.test_bpf_inplace import cgroup as cgroup
from integration.test_bpf_inplace import nodes as nodes

pytestmark = pytest.mark.root

RULES = st.lists(
    st.builds(
        DevRule,
        st.booleans(),
        st.sampled_from(["c", None]),
        st.sampled_from([195, 510, 1, None]),
        st.sampled_from([0, 1, 255, 3, None]),
        st.sampled_from([None, ACC_RW, 2, 7]),
    ).filter(lambda r: (r.kind, r.major, r.minor, r.access) != (None,) * 4),
    max_size=5,
)


@pytest.fixture
def child(cgroup: Path) -> Iterator[Path]:
    ctr = cgroup / "ctr"
    ctr.mkdir()
    try:
        yield ctr
    finally:
        for _ in range(100):  # a probe child may still be leaving
            with contextlib.suppress(OSError):
                ctr.rmdir()
                break
            time.sleep(0.02)


def _detach_all(cg: Path) -> None:
    for pid in query_device_programs(cg):
        fd, cgfd = fd_by_id(pid), os.open(cg, os.O_RDONLY | os.O_DIRECTORY)
        try:
            _attach(BPF_PROG_DETACH, cgfd, fd, 0)
        finally:
            os.close(fd)
            os.close(cgfd)


@settings(
    max_examples=EXAMPLES,
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(RULES, st.booleans(), st.one_of(st.none(), st.tuples(RULES, st.booleans())))
def test_judge_equals_the_kernel(
    cgroup: Path,
    child: Path,
    nodes: dict[tuple[int, int], Path],
    rules: list[DevRule],
    default: bool,
    parent: tuple[list[DevRule], bool] | None,
) -> None:
    for cg in (child, cgroup):  # the previous example's programs
        _detach_all(cg)
    _attach_prog(child, build(DeviceProgram(tuple(rules), default)))
    if parent is not None:
        _attach_prog(cgroup, build(DeviceProgram(tuple(parent[0]), parent[1])))
    assert len(effective_programs(child)) == 1 + (parent is not None)
    mine = judge(ProgramCache(), child, NODES)
    assert mine is not None
    batched = probe_open_all([nodes[n] for n in NODES], [child], timeout=2)
    for n, b in zip(NODES, batched):
        kernel = probe_open(nodes[n], [child], timeout=2).verdict
        assert kernel is not None, n
        assert mine[n] == kernel == b.verdict, (n, mine[n], kernel, b.verdict)


def test_a_program_of_another_shape_is_not_judged(
    child: Path,
    nodes: dict[tuple[int, int], Path],
) -> None:
    import struct

    def ins(code: int, dst: int = 0, src: int = 0, off: int = 0, imm: int = 0) -> bytes:
        return struct.pack("<BBhi", code, dst | (src << 4), off, imm)

    # if (type == char) allow else deny, written with JEQ: not runc's or systemd's shape
    odd = (
        ins(0x61, 2, 1, 0) + ins(0x54, 2, imm=0xFFFF) + ins(0x15, 2, off=2, imm=2)
        + ins(0xB7, 0, imm=0) + ins(0x95) + ins(0xB7, 0, imm=1) + ins(0x95)
    )  # fmt: skip
    _attach_prog(child, odd)
    cache = ProgramCache()
    assert judge(cache, child, NODES) is None  # the caller asks the kernel instead
    assert all(r.verdict is True for r in probe_open_all(list(nodes.values()), [child]))
    gone = child.parent / "gone"
    assert judge(cache, gone, NODES) is None and not gone.exists()


def test_systemds_program_is_judged_as_the_kernel_does(
    child: Path,
    nodes: dict[tuple[int, int], Path],
) -> None:
    from unit.test_bpfprog import SYSTEMD_252, _code

    _attach_prog(child, _code(SYSTEMD_252))  # a scope's program, as systemd 252 loads it
    mine = judge(ProgramCache(), child, NODES)
    assert mine is not None, "systemd's own shape must be judged without a probe"
    for n in NODES:
        assert mine[n] == probe_open(nodes[n], [child], timeout=2).verdict, n
    assert mine[(195, 0)] is True and mine[(195, 1)] is False
