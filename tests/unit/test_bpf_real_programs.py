"""Real device programs (tests/fixtures/bpf-programs/, read back from the kernel on
Debian's own systemd, runc and crun) parsed as the kernel runs them: crun's first block
with access mask 0, runc 1.0-rc93's "any bit" access tests, privileged containers'
programs that admit everything, systemd 247's unnamed program. Each rebuilt program
(what a bridge or an in-place repair loads) admits exactly what the original did."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpuguard.devices.bpfprog import (
    ACC_MKNOD,
    ACC_READ,
    ACC_RW,
    ACC_WRITE,
    DeviceProgram,
    DevRule,
    build,
    grant_nodes,
    parse,
)

HERE = Path(__file__).resolve().parents[1] / "fixtures" / "bpf-programs"
FILES = sorted(p.name for p in HERE.glob("*.hex"))
REQUESTS = [
    (k, ma, mi, acc)
    for k in ("c", "b")
    for ma, mi in ((0, 0), (1, 3), (1, 11), (5, 0), (5, 2), (10, 200), (136, 4), (195, 0), (8, 0))
    for acc in range(1, 8)
]


def program(name: str) -> DeviceProgram:
    return parse(bytes.fromhex((HERE / name).read_text().strip()))


def test_every_fixture_is_listed_with_its_provenance() -> None:
    listed = [
        line.split("\t")[0] for line in (HERE / "PROVENANCE.tsv").read_text().splitlines()[1:]
    ]
    assert sorted(listed) == FILES


@pytest.mark.parametrize("name", FILES)
def test_a_real_program_rebuilt_admits_what_it_admitted(name: str) -> None:
    p = program(name)
    again = parse(build(p))
    assert again == p
    for r in REQUESTS:
        assert again.admits(*r) == p.admits(*r), r
    # a repair's program: the same plus read/write on the GPU, nothing else
    g = grant_nodes(p, [(195, 0)])
    for k, ma, mi, acc in REQUESTS:
        extra = (k, ma, mi) == ("c", 195, 0) and acc & ~ACC_RW == 0
        assert g.admits(k, ma, mi, acc) == (p.admits(k, ma, mi, acc) or extra)


def test_crun_first_block_has_access_mask_0_and_never_matches() -> None:
    p = program("crun-1.21.hex")
    assert p.rules[0] == DevRule(True, "c", 0, 0, 0)
    assert not any(p.rules[0].matches("c", 0, 0, acc) for acc in range(1, 8))
    assert not p.admits("c", 0, 0, ACC_RW)
    assert p.admits("c", 1, 3, ACC_RW) and not p.admits("c", 195, 0, ACC_RW)
    assert p.admits("c", 195, 0, ACC_MKNOD)  # "c *:* m"
    assert not p.admits_all


def test_runc_rc93_access_test_admits_any_shared_bit() -> None:
    """runc 1.0-rc93's "c *:* m" is `if (access & m) == 0 goto next`: an open with read
    and mknod would pass it; an open for read/write does not."""
    p = program("runc-1.0.0-rc93.hex")
    m = [r for r in p.rules if r.access == ACC_MKNOD]
    assert m and all(r.access_any for r in m)
    assert not p.admits("c", 195, 0, ACC_RW)
    assert p.admits("c", 195, 0, ACC_MKNOD | ACC_READ)  # the "any bit" semantics
    assert p.admits("c", 1, 3, ACC_READ | ACC_WRITE)


def test_systemd_247_program_is_of_the_shape_gpuguard_reads() -> None:
    p = program("systemd-247.hex")
    assert p.admits("c", 136, 4, ACC_RW) and not p.admits("c", 195, 0, ACC_RW)
    assert not any(r.access_any for r in p.rules)


@pytest.mark.parametrize("name", ["crun-1.21-privileged.hex", "runc-1.1.15-privileged.hex"])
def test_a_privileged_containers_program_admits_everything(name: str) -> None:
    p = program(name)
    assert p.admits_all
    assert all(p.admits(*r) for r in REQUESTS)


def test_admits_all_stops_at_a_deny_before_an_allow_all() -> None:
    everything = DevRule(True)
    assert DeviceProgram((everything,), False).admits_all
    assert not DeviceProgram((DevRule(False, "c", 1, 11), everything), True).admits_all
    assert DeviceProgram((DevRule(True, "c", 1, 11), everything), False).admits_all
    assert not DeviceProgram((DevRule(True, "c", 1, 11),), False).admits_all
