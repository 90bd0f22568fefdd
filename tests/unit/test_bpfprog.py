"""devices/bpfprog: runc/systemd-shaped device programs parsed, rebuilt and extended.

Properties (hypothesis, bounded and derandomized for CI): a built program parses back to
its rules (both kinds of access test: within the mask, and runc 1.0-rc93's any shared
bit; a mask of 0, as crun writes first); ``grant_nodes`` never admits a request outside
previous-admitted plus read/write on the granted char nodes, and admits all of those.
Shapes gpuguard did not expect are refused (UnknownProgramShape), never guessed. The
kernel's own verdict on the same programs is tests/integration/test_bpf_inplace.py.
"""

from __future__ import annotations

import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuguard.devices.bpfprog import (
    ACC_RW,
    DeviceProgram,
    DevRule,
    UnknownProgramShape,
    build,
    grant_nodes,
    parse,
)

MAJORS = st.sampled_from([1, 5, 136, 195, 234, 510])
MINORS = st.integers(min_value=0, max_value=4)
# access 0 (crun's first block) and runc 1.0-rc93's "any bit" tests included
RULES = st.builds(
    DevRule,
    st.booleans(),
    st.one_of(st.none(), st.sampled_from(["c", "b"])),
    st.one_of(st.none(), MAJORS),
    st.one_of(st.none(), MINORS),
    st.one_of(st.none(), st.integers(min_value=0, max_value=7)),
    st.booleans(),
).filter(
    lambda r: (
        (r.kind, r.major, r.minor, r.access) != (None,) * 4
        and (r.access is not None or not r.access_any)
    )
)
PROGRAMS = st.builds(DeviceProgram, st.lists(RULES, max_size=8).map(tuple), st.booleans())
NODES = st.lists(st.tuples(MAJORS, MINORS), max_size=4)
REQUESTS = [
    (k, ma, mi, acc)
    for k in ("c", "b")
    for ma in (1, 5, 136, 195, 234, 510)
    for mi in range(5)
    for acc in range(1, 8)
]


@settings(max_examples=200, derandomize=True, deadline=None)
@given(PROGRAMS)
def test_build_then_parse_is_identity(prog: DeviceProgram) -> None:
    assert parse(build(prog)) == prog


@settings(max_examples=200, derandomize=True, deadline=None)
@given(PROGRAMS, NODES)
def test_grant_admits_exactly_previous_plus_entitled(
    prev: DeviceProgram, nodes: list[tuple[int, int]]
) -> None:
    new = parse(build(grant_nodes(prev, nodes)))
    for k, ma, mi, acc in REQUESTS:
        entitled = k == "c" and (ma, mi) in nodes and acc & ACC_RW == acc
        assert new.admits(k, ma, mi, acc) == (prev.admits(k, ma, mi, acc) or entitled)


def _ins(code: int, dst: int = 0, src: int = 0, off: int = 0, imm: int = 0) -> bytes:
    return struct.pack("<BBhi", code, dst | (src << 4), off, imm)


def test_runc_shape_with_access_test_parses() -> None:
    prog = DeviceProgram((DevRule(True, "c", 195, 0, ACC_RW), DevRule(False, "b")), False)
    assert parse(build(prog)).describe() == "allow c 195:0 rw; deny b *:*; else deny"


@pytest.mark.parametrize(
    "code",
    [
        b"",
        b"\x00" * 7,
        # a jump past the next block
        build(DeviceProgram((DevRule(True, "c", 1, 3),), False))[:48]
        + _ins(0x55, 2, off=5, imm=2)
        + _ins(0xB7, 0, imm=1)
        + _ins(0x95)
        + _ins(0xB7, 0, imm=0)
        + _ins(0x95),
        # a verdict other than 0/1
        build(DeviceProgram((), False))[:48] + _ins(0xB7, 0, imm=7) + _ins(0x95),
        # a helper call
        build(DeviceProgram((), False))[:48] + _ins(0x85, imm=14) + _ins(0xB7) + _ins(0x95),
        # code after the default verdict
        build(DeviceProgram((), False)) + _ins(0xB7) + _ins(0x95),
        # falls off the end
        build(DeviceProgram((), False))[:48] + _ins(0x55, 2, off=0, imm=2),
        # a test of an unknown device type
        build(DeviceProgram((), False))[:48]
        + _ins(0x55, 2, off=2, imm=9)
        + _ins(0xB7, 0, imm=1)
        + _ins(0x95)
        + _ins(0xB7)
        + _ins(0x95),
    ],
)
def test_unexpected_shapes_are_refused(code: bytes) -> None:
    with pytest.raises(UnknownProgramShape):
        parse(code)


def test_legacy_hook_shape_without_access_register_parses() -> None:
    # r2 type, r4 major, r5 minor, no r3 (tests/integration/harness/bpfdev.py's shape)
    code = (
        _ins(0x61, 2, 1, 0)
        + _ins(0x54, 2, imm=0xFFFF)
        + _ins(0x61, 4, 1, 4)
        + _ins(0x61, 5, 1, 8)
        + _ins(0x55, 2, off=4, imm=2)
        + _ins(0x55, 4, off=3, imm=195)
        + _ins(0x55, 5, off=2, imm=1)
        + _ins(0xB7, 0, imm=1)
        + _ins(0x95)
        + _ins(0xB7, 0, imm=0)
        + _ins(0x95)
    )
    assert parse(code) == DeviceProgram((DevRule(True, "c", 195, 1),), False)


def test_a_rule_testing_nothing_is_not_built() -> None:
    # it would make every later block unreachable, which the verifier refuses
    with pytest.raises(ValueError, match="tests nothing"):
        build(DeviceProgram((DevRule(True),), False))


# systemd 252's program for DevicePolicy=strict, DeviceAllow=/dev/char/195:0 rw and
# /dev/null rw, as the kernel gives it back (read from a unified systemd's scope): each
# rule jumps to a shared "r0 = 1; exit", the default is "r0 = 0; goto exit".
SYSTEMD_252 = [
    (0x61, 0x12, 0, 0), (0x54, 0x02, 0, 0xFFFF), (0x61, 0x13, 0, 0), (0x74, 0x03, 0, 16),
    (0x61, 0x14, 4, 0), (0x61, 0x15, 8, 0),
    (0xBC, 0x31, 0, 0), (0x54, 0x01, 0, 6), (0x5D, 0x31, 4, 0), (0x55, 0x02, 3, 2),
    (0x55, 0x04, 2, 195), (0x55, 0x05, 1, 0), (0x05, 0x00, 9, 0),
    (0xBC, 0x31, 0, 0), (0x54, 0x01, 0, 6), (0x5D, 0x31, 4, 0), (0x55, 0x02, 3, 2),
    (0x55, 0x04, 2, 1), (0x55, 0x05, 1, 3), (0x05, 0x00, 2, 0),
    (0xB7, 0x00, 0, 0), (0x05, 0x00, 1, 0), (0xB7, 0x00, 0, 1), (0x95, 0x00, 0, 0),
]  # fmt: skip


def _code(insns: list[tuple[int, int, int, int]]) -> bytes:
    return b"".join(struct.pack("<BBhi", *i) for i in insns)


def test_systemds_shape_parses() -> None:
    prog = parse(_code(SYSTEMD_252))
    assert prog == DeviceProgram(
        (DevRule(True, "c", 195, 0, 6), DevRule(True, "c", 1, 3, 6)), default_allow=False
    )
    assert prog.admits("c", 195, 0, ACC_RW) and not prog.admits("c", 195, 1, ACC_RW)
    assert parse(build(prog)) == prog  # rebuilt in runc's shape, the same rules


@pytest.mark.parametrize(
    "change",
    [
        {12: (0x05, 0x00, 8, 0)},  # a rule jumping into the default, not to the accept
        {21: (0x05, 0x00, 0, 0)},  # the default jumping to the accept, not to exit
        {22: (0xB7, 0x00, 0, 7)},  # a shared verdict that is neither 0 nor 1
        {23: (0xB7, 0x00, 0, 1)},  # no exit at the end
    ],
)
def test_systemds_shape_altered_is_refused(change: dict[int, tuple[int, int, int, int]]) -> None:
    insns = [change.get(i, x) for i, x in enumerate(SYSTEMD_252)]
    with pytest.raises(UnknownProgramShape):
        parse(_code(insns))
