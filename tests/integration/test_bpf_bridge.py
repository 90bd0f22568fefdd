"""The v2 bridge (actuate/bpf.py attach_bridge, detach_bridges), judged by the kernel.

A real cgroup2 directory under /sys/fs/cgroup/unified/, a "runtime" program (the hook's
or runc's, attached with BPF_F_ALLOW_MULTI) next to a program named as systemd names its
own (``sd_devices``), fake nodes made with mknod in a temporary directory: EPERM from a
program = denied, ENXIO = admitted.

- property (hypothesis, bounded): over random runtime and systemd programs and lost
  nodes, the bridge admits at most what the cgroup admitted before plus the lost nodes;
  once systemd's new program (its rules plus the lost nodes, as DeviceAllow= makes it)
  is attached and the bridge detached, the kernel admits exactly what the runtime's and
  systemd's programs admit together, gpuguard's program is gone, and nothing outside
  what it had plus the lost nodes is admitted. Where the runtime's program denies a lost
  node too, no bridge is made and nothing changes;
- no bridge: a frozen cgroup, three programs, a denying program that is not systemd's;
- a bridge with no program of systemd's attached stays (it stands in for systemd's).
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Iterator

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpuguard.actuate.bpf import BpfReplaceError, LoadedPrograms
from gpuguard.actuate.bpfbridge import attach_bridge, bridge_change, detach_bridges
from gpuguard.devices.bpfprog import ACC_RW, DeviceProgram, DevRule, build, grant_nodes
from gpuguard.devices.bpfread import BRIDGE_NAME, ProgramCache
from gpuguard.devices.probe import query_device_programs
from gpuguard.engine.executor import ChangeExecutor
from integration.harness.bpfdev import attach, detach_all, detach_one, names, verdicts
from integration.test_bpf_inplace import KERNEL_EXAMPLES, NODES, RUNC, rule_lists
from integration.test_bpf_inplace import cgroup as cgroup
from integration.test_bpf_inplace import nodes as nodes

pytestmark = pytest.mark.root

Nodes = dict[tuple[int, int], Path]
SD = DeviceProgram((DevRule(True, "c", 1, 3, ACC_RW),), False)  # DeviceAllow=/dev/null rw


@pytest.fixture
def cleanup(cgroup: Path) -> Iterator[Path]:
    try:
        yield cgroup
    finally:
        with contextlib.suppress(OSError):
            detach_all(cgroup)


rules = rule_lists(4)


@KERNEL_EXAMPLES
@given(
    rules,
    st.booleans(),
    rules,
    st.booleans(),
    st.lists(st.sampled_from(NODES), min_size=1, max_size=3),
    st.sampled_from(["hook grants", "hook grants", "hook grants", "as drawn"]),
)
def test_bridge_then_systemd_admits_no_more_than_before_plus_lost(
    cleanup: Path,
    nodes: Nodes,
    runtime_rules: list[DevRule],
    runtime_default: bool,
    sd_rules: list[DevRule],
    sd_default: bool,
    lost: list[tuple[int, int]],
    case: str,
) -> None:
    cg = cleanup
    detach_all(cg)  # the previous example's programs
    runtime = DeviceProgram(tuple(runtime_rules), runtime_default)
    sd = DeviceProgram(tuple(sd_rules), sd_default)
    if case == "hook grants":  # the usual loss: the hook's program admits, systemd's not
        runtime = grant_nodes(runtime, lost)
        sd = DeviceProgram((DevRule(False, "c", *lost[0]), *sd.rules), sd.default_allow)
    rt_id = attach(cg, build(runtime), b"legacy_hook")
    attach(cg, build(sd), b"sd_devices")
    before = verdicts(cg, nodes)
    programs = sorted(query_device_programs(cg))

    def admits(p: DeviceProgram, n: tuple[int, int]) -> bool:
        return p.admits("c", n[0], n[1], ACC_RW)

    only_sd = all(admits(runtime, n) for n in lost) and not all(admits(sd, n) for n in lost)
    if not only_sd:  # the runtime's program denies too, or nothing denies: no bridge
        with pytest.raises(BpfReplaceError, match=r"no bridge|no attached program denies"):
            attach_bridge(cg, lost, lambda: True)
        assert sorted(query_device_programs(cg)) == programs
        assert verdicts(cg, nodes) == before
        return
    attach_bridge(cg, lost, lambda: True)
    bridged = verdicts(cg, nodes)
    assert BRIDGE_NAME in names(cg) and "sd_devices" not in names(cg)
    for n in NODES:  # the kernel's word: before plus the lost nodes, at most
        assert bridged[n] == (before[n] or (n in lost)), (n, before[n], bridged[n])
    # systemd applies the DeviceAllow= gpuguard set: its rules plus the lost nodes
    attach(cg, build(grant_nodes(sd, lost)), b"sd_devices")
    d = detach_bridges(cg)
    assert len(d.bridges) == 1 and d.waiting == ()
    assert names(cg) == ["legacy_hook", "sd_devices"] and rt_id in query_device_programs(cg)
    after = verdicts(cg, nodes)
    for n in NODES:
        expect = admits(runtime, n) and (admits(sd, n) or n in lost)
        assert after[n] == expect, (n, after[n])
        assert not after[n] or before[n] or n in lost  # never broader


@pytest.mark.parametrize("reads", ["direct", "cold-cache"])
def test_dry_run_changes_nothing_then_bridge_and_detach(
    cleanup: Path, nodes: Nodes, reads: str
) -> None:
    """`cold-cache`: the programs read through a ProgramCache that has not seen them
    (as `gpuguard check` does), the bridge loaded once and its id kept (LoadedPrograms)."""
    cg = cleanup
    via: dict[str, Any] = {}
    if reads == "cold-cache":
        via = {"cache": ProgramCache(), "loaded": LoadedPrograms()}
    hook = grant_nodes(RUNC, [(195, 0), (195, 255)])
    attach(cg, build(hook), b"legacy_hook")
    attach(cg, build(SD), b"sd_devices")
    before = verdicts(cg, nodes)
    assert before[(195, 0)] is False and before[(1, 3)] is True
    ids = sorted(query_device_programs(cg))
    dry = ChangeExecutor(dry_run=True).run(bridge_change(cg, [(195, 0)], lambda: True, **via))
    assert dry.new_id == 0 and sorted(query_device_programs(cg)) == ids
    assert verdicts(cg, nodes) == before
    r = attach_bridge(cg, [(195, 0)], lambda: True, **via)
    assert r.program.describe() == "allow c 195:0 rw; allow c 1:3 rw; else deny"
    assert r.new_id in query_device_programs(cg)
    assert verdicts(cg, nodes) == {**before, (195, 0): True}
    # no program of systemd's attached: the bridge stands in for it and stays
    d = detach_bridges(cg)
    assert d.bridges == () and d.waiting == (r.new_id,)
    assert verdicts(cg, nodes)[(195, 0)] is True


def test_no_bridge_for_three_programs_a_frozen_cgroup_or_a_foreign_denial(
    cleanup: Path, nodes: Nodes
) -> None:
    cg = cleanup
    attach(cg, build(RUNC), b"runc_like")  # denies 195:0 and is not systemd's
    before = verdicts(cg, nodes)
    with pytest.raises(BpfReplaceError, match="not systemd's alone"):
        attach_bridge(cg, [(195, 0)], lambda: True)
    attach(cg, build(SD), b"sd_devices")
    attach(cg, build(grant_nodes(RUNC, [(195, 0)])), b"legacy_hook")
    with pytest.raises(BpfReplaceError, match="3 device programs attached"):
        attach_bridge(cg, [(195, 0)], lambda: True)
    detach_all(cg)
    attach(cg, build(grant_nodes(RUNC, [(195, 0)])), b"legacy_hook")
    attach(cg, build(SD), b"sd_devices")
    ids = sorted(query_device_programs(cg))
    (cg / "cgroup.freeze").write_text("1")
    try:
        with pytest.raises(BpfReplaceError, match="frozen"):
            attach_bridge(cg, [(195, 0)], lambda: True)
    finally:
        (cg / "cgroup.freeze").write_text("0")
    assert sorted(query_device_programs(cg)) == ids
    assert verdicts(cg, nodes)[(195, 0)] is False and before[(195, 0)] is False


def test_a_bridge_that_does_not_verify_is_rolled_back(cleanup: Path, nodes: Nodes) -> None:
    cg = cleanup
    attach(cg, build(grant_nodes(RUNC, [(195, 0)])), b"legacy_hook")
    attach(cg, build(SD), b"sd_devices")
    ids = sorted(query_device_programs(cg))
    before = verdicts(cg, nodes)
    with pytest.raises(BpfReplaceError, match="old program is back"):
        attach_bridge(cg, [(195, 0)], lambda: False)
    assert sorted(query_device_programs(cg)) == ids
    assert verdicts(cg, nodes) == before


def test_a_program_swapped_meanwhile_is_not_replaced(
    cleanup: Path, nodes: Nodes, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The bridge takes the place of the very program it judged (BPF_F_REPLACE): if
    systemd swapped that program between the look and the swap, nothing changes."""
    import gpuguard.actuate.bpfbridge as bpfbridge

    cg = cleanup
    attach(cg, build(grant_nodes(RUNC, [(195, 0)])), b"legacy_hook")
    sd_id = attach(cg, build(SD), b"sd_devices")
    real_open = bpfbridge._open

    def swapped_meanwhile(cgroup_dir: Path, p: Any) -> int:
        fd = real_open(cgroup_dir, p)  # the program judged; then systemd's next one
        attach(cg, build(SD), b"sd_devices")
        detach_one(cg, sd_id)
        return fd

    monkeypatch.setattr(bpfbridge, "_open", swapped_meanwhile)
    with pytest.raises(BpfReplaceError, match=r"no longer attached.*nothing changed"):
        attach_bridge(cg, [(195, 0)], lambda: True)
    assert names(cg) == ["legacy_hook", "sd_devices"] and sd_id not in query_device_programs(cg)
    assert verdicts(cg, nodes)[(195, 0)] is False


def test_kernels_without_replace_attach_then_detach(
    cleanup: Path, nodes: Nodes, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before Linux 5.6 the kernel refuses BPF_F_REPLACE (EINVAL): the bridge is
    attached next to systemd's program, which is then detached, as before."""
    import errno

    import gpuguard.actuate.bpf as bpf

    real_attach = bpf.attach_prog
    flags_seen: list[int] = []

    def old_kernel(cmd: int, cgroup_fd: int, prog_fd: int, flags: int, replace_fd: int = 0) -> None:
        flags_seen.append(flags)
        if flags & bpf.BPF_F_REPLACE:
            raise OSError(errno.EINVAL, "Invalid argument")
        real_attach(cmd, cgroup_fd, prog_fd, flags, replace_fd)

    monkeypatch.setattr(bpf, "attach_prog", old_kernel)
    cg = cleanup
    attach(cg, build(grant_nodes(RUNC, [(195, 0)])), b"legacy_hook")
    attach(cg, build(SD), b"sd_devices")
    before = verdicts(cg, nodes)
    attach_bridge(cg, [(195, 0)], lambda: True)
    assert names(cg) == [BRIDGE_NAME, "legacy_hook"]
    assert verdicts(cg, nodes) == {**before, (195, 0): True}
    assert flags_seen == [bpf.BPF_F_ALLOW_MULTI | bpf.BPF_F_REPLACE, bpf.BPF_F_ALLOW_MULTI, 0]
