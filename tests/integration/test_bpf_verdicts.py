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
from hypothesis import given
from hypothesis import strategies as st

from gpuguard.devices.bpfprog import DeviceProgram, DevRule, build, parse
from gpuguard.devices.bpfread import (
    ProgramCache,
    effective_programs,
    fd_by_id,
    judge,
    read_named,
)
from gpuguard.devices.probe import probe_open, probe_open_all
from integration.harness.bpfdev import OTHER_SHAPE, attach, detach_all
from integration.test_bpf_inplace import KERNEL_EXAMPLES, NODES, rule_lists
from integration.test_bpf_inplace import cgroup as cgroup
from integration.test_bpf_inplace import nodes as nodes

pytestmark = pytest.mark.root

RULES = rule_lists(5)


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


@KERNEL_EXAMPLES
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
        detach_all(cg)
    attach(child, build(DeviceProgram(tuple(rules), default)))
    if parent is not None:
        attach(cgroup, build(DeviceProgram(tuple(parent[0]), parent[1])))
    assert len(effective_programs(child)) == 1 + (parent is not None)
    mine = judge(ProgramCache(), child, NODES)
    assert mine is not None
    batched = probe_open_all([nodes[n] for n in NODES], [child], timeout=5)
    for n, b in zip(NODES, batched):
        kernel = probe_open(nodes[n], [child], timeout=5).verdict
        assert kernel is not None, n
        assert mine[n] == kernel == b.verdict, (n, mine[n], kernel, b.verdict)


def test_a_program_of_another_shape_is_not_judged(
    child: Path,
    nodes: dict[tuple[int, int], Path],
) -> None:
    attach(child, OTHER_SHAPE)
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

    attach(child, _code(SYSTEMD_252))  # a scope's program, as systemd 252 loads it
    mine = judge(ProgramCache(), child, NODES)
    assert mine is not None, "systemd's own shape must be judged without a probe"
    for n in NODES:
        assert mine[n] == probe_open(nodes[n], [child], timeout=5).verdict, n
    assert mine[(195, 0)] is True and mine[(195, 1)] is False


def test_one_cache_follows_the_programs_as_they_change(
    child: Path,
    nodes: dict[tuple[int, int], Path],
) -> None:
    """The daemon keeps one cache (verdicts remembered by program id and node) across
    passes and reloads while programs come and go: each new program is judged anew."""
    cache = ProgramCache()
    for rules in (
        (DevRule(True, "c", 195, 1, 7),),
        (DevRule(False, "c", 195, 1, 7), DevRule(True, "c", 195, None, 7)),
        (DevRule(True, "c", None, None, 7),),
        (),
    ):
        detach_all(child)
        attach(child, build(DeviceProgram(rules, False)))
        mine = judge(cache, child, NODES)
        assert mine is not None
        for n in NODES:
            assert mine[n] == probe_open(nodes[n], [child], timeout=5).verdict, (rules, n)
        cache.forget_unseen()


def test_a_program_larger_than_the_first_read_is_read_whole(
    child: Path,
    nodes: dict[tuple[int, int], Path],
) -> None:
    """A program's instructions are read with one call into a 4 KiB buffer; a longer
    one (here ~300 rules) takes a second call of its own size, never a cut copy."""
    rules = tuple(DevRule(True, "c", 510, 100 + i, 7) for i in range(300))
    prog = DeviceProgram((*rules, DevRule(True, "c", 195, 0, 7)), False)
    code = build(prog)
    assert len(code) > 4096
    prog_id = attach(child, code)
    fd = fd_by_id(prog_id)
    try:
        _name, xlated = read_named(fd)
    finally:
        os.close(fd)
    assert len(xlated) > 4096 and parse(xlated) == prog
    mine = judge(ProgramCache(), child, NODES)
    assert mine is not None
    for n in NODES:
        assert mine[n] == probe_open(nodes[n], [child], timeout=5).verdict, n
    assert mine[(195, 0)] is True and mine[(195, 1)] is False
