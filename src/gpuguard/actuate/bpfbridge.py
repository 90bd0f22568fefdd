"""A bridge: systemd's denying device program on a scope replaced in place, for the
moments until systemd applies the DeviceAllow= that repairs the scope durably.

`attach_bridge` replaces systemd's program (``sd_devices``), the one that denies the
lost nodes, by one named ``gpuguard_bridge`` admitting its rules plus those nodes (the
swap of actuate/bpf.py); `detach_bridges` detaches it once a program of systemd's is
attached next to it again (steps/container_access/bridge.py says why that is safe).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, List, Optional, Sequence, Tuple

from gpuguard.actuate.bpf import (
    BpfReplaceError,
    LoadedPrograms,
    Replacement,
    attach_prog,
    is_frozen,
    swap_program,
)
from gpuguard.actuate.change import Change
from gpuguard.devices.bpfprog import ACC_RW, DeviceProgram, grant_nodes, parse
from gpuguard.devices.bpfread import (
    BRIDGE_NAME,
    SYSTEMD_NAME,
    ProgramCache,
    read_rules,
)
from gpuguard.devices.bpfread import fd_by_id as _fd_by_id
from gpuguard.devices.probe import BPF_PROG_DETACH, open_cgroup, query_device_programs


@dataclass(frozen=True)
class _Attached:
    prog_id: int
    name: str
    program: Optional[DeviceProgram]  # None: unreadable or of another shape


@functools.lru_cache(maxsize=64)
def _parsed(code: bytes) -> DeviceProgram:
    """After a reload most scopes hold byte-identical programs: each parsed once."""
    return parse(code)


def _read(prog_id: int) -> _Attached:
    fd = _fd_by_id(prog_id)
    try:
        return _Attached(prog_id, *read_rules(fd, _parsed))
    finally:
        os.close(fd)


def _cached(cache: ProgramCache, prog_id: int) -> _Attached:
    program = cache.get(prog_id)  # reads the name too, when it is not cached yet
    return _Attached(prog_id, cache.name(prog_id), program)


def _attached(
    cgroup_dir: Path, cache: Optional[ProgramCache] = None, fd: Optional[int] = None
) -> List[_Attached]:
    """The programs attached to the cgroup itself. `cache`: the programs the caller
    has just judged the cgroup by (ids are not reused while a program exists), so
    only the one gpuguard swaps or detaches is opened again."""
    where = f"{cgroup_dir}: "
    try:
        ids = query_device_programs(cgroup_dir, fd=fd)
        if cache is not None:
            return [_cached(cache, i) for i in ids]
        return [_read(i) for i in ids]
    except OSError as e:
        raise BpfReplaceError(f"{where}cannot read its programs: {e.strerror}") from None


def _open(cgroup_dir: Path, p: _Attached) -> int:
    try:
        return _fd_by_id(p.prog_id)
    except OSError as e:
        raise BpfReplaceError(
            f"{cgroup_dir}: cannot open program {p.prog_id}: {e.strerror}; nothing changed"
        ) from None


def attach_bridge(
    cgroup_dir: Path,
    nodes: Sequence[Tuple[int, int]],
    verify: Callable[[], bool],
    *,
    loaded: Optional[LoadedPrograms] = None,
    cache: Optional[ProgramCache] = None,
    cg_fd: Optional[int] = None,
) -> Replacement:
    """Replace systemd's program on ``cgroup_dir``, the one that denies ``nodes``, by a
    bridge admitting its rules plus read/write on ``nodes``. Raises BpfReplaceError
    (nothing changed) unless exactly one program denies and it is systemd's, next to at
    most one other (the runtime's), or when the cgroup is frozen. ``cache``: the
    programs the caller judged the cgroup by (bpfread.ProgramCache); ``cg_fd``: the
    cgroup's directory, open (the caller closes it). The making half of `bridge_change`."""
    if is_frozen(cgroup_dir, cg_fd):
        raise BpfReplaceError(
            f"{cgroup_dir}: the cgroup is frozen (cgroup.events: frozen 1); no bridge"
        )
    old, new = _planned_bridge(cgroup_dir, nodes, cache, cg_fd)
    old_fd = _open(cgroup_dir, old)
    try:
        new_id = swap_program(cgroup_dir, old_fd, new, verify, BRIDGE_NAME, loaded, cg_fd)
    finally:
        os.close(old_fd)
    return Replacement(str(cgroup_dir), old.prog_id, new_id, new)


def bridge_change(
    cgroup_dir: Path,
    nodes: Sequence[Tuple[int, int]],
    verify: Callable[[], bool],
    *,
    loaded: Optional[LoadedPrograms] = None,
    cache: Optional[ProgramCache] = None,
    cg_fd: Optional[int] = None,
) -> Change[Replacement]:
    """`attach_bridge` as a change: its description judges the programs and plans the
    bridge (new id 0) as the real attach would, and attaches nothing."""

    def describe() -> Replacement:
        old, new = _planned_bridge(cgroup_dir, nodes, cache, cg_fd)
        return Replacement(str(cgroup_dir), old.prog_id, 0, new)

    def make() -> Replacement:
        return attach_bridge(cgroup_dir, nodes, verify, loaded=loaded, cache=cache, cg_fd=cg_fd)

    return Change("v2-bridge-attach", make, describe)


def _planned_bridge(
    cgroup_dir: Path,
    nodes: Sequence[Tuple[int, int]],
    cache: Optional[ProgramCache],
    cg_fd: Optional[int],
) -> Tuple[_Attached, DeviceProgram]:
    """systemd's program that denies ``nodes`` and the bridge that stands in for it."""
    where = f"{cgroup_dir}: "
    progs = _attached(cgroup_dir, cache, cg_fd)
    others = [p for p in progs if p.name != BRIDGE_NAME]

    def listed() -> str:  # for the refusals only
        return ", ".join(f"{p.prog_id} {p.name or '?'}" for p in progs)

    if len(others) > 2:
        raise BpfReplaceError(
            f"{where}{len(others)} device programs attached ({listed()}); a bridge stands in "
            "for systemd's next to at most one other: no bridge"
        )

    def admits(p: _Attached) -> bool:
        if p.program is None:
            return False
        if cache is not None:  # the same verdicts the caller judged by, remembered
            return all(cache.admits_rw(p.prog_id, p.program, n) for n in nodes)
        return all(p.program.admits("c", ma, mi, ACC_RW) for ma, mi in nodes)

    denying = [p for p in progs if not admits(p)]
    if not denying:
        raise BpfReplaceError(f"{where}no attached program denies the nodes now ({listed()})")
    if len(denying) != 1 or denying[0].name != SYSTEMD_NAME or denying[0].program is None:
        raise BpfReplaceError(
            f"{where}the programs that deny the nodes are not systemd's alone ({listed()}): "
            "no bridge"
        )
    old = denying[0]
    assert old.program is not None
    new = grant_nodes(old.program, nodes)
    return old, new


@dataclass(frozen=True)
class Detached:
    bridges: Tuple[int, ...]  # ids detached (none: none attached, or systemd's missing)
    systemd: Tuple[DeviceProgram, ...]  # systemd's programs attached next to them
    waiting: Tuple[int, ...]  # bridges left: no program of systemd's attached yet


def detach_bridges(cgroup_dir: Path) -> Detached:
    """Detach gpuguard's bridges from ``cgroup_dir`` once a program of systemd's is
    attached again; while none is, each bridge stands in for systemd's and stays. The
    making half of `detach_change`."""
    progs = _attached(cgroup_dir)
    bridges = [p for p in progs if p.name == BRIDGE_NAME]
    sd = [p for p in progs if p.name == SYSTEMD_NAME]
    theirs = tuple(p.program for p in sd if p.program is not None)
    if not bridges or not sd:
        return Detached((), theirs, tuple(p.prog_id for p in bridges))
    done: List[int] = []
    cg = open_cgroup(cgroup_dir)
    try:
        for b in bridges:
            try:
                fd = _fd_by_id(b.prog_id)
            except FileNotFoundError:
                continue  # gone meanwhile
            try:
                attach_prog(BPF_PROG_DETACH, cg, fd, 0)
            except FileNotFoundError:
                continue  # detached meanwhile
            finally:
                os.close(fd)
            done.append(b.prog_id)
    except OSError as e:
        raise BpfReplaceError(
            f"{cgroup_dir}: detaching bridge failed: {e.strerror}; it stays"
        ) from None
    finally:
        os.close(cg)
    return Detached(tuple(done), theirs, ())


def detach_change(cgroup_dir: Path) -> Change[Detached]:
    """`detach_bridges` as a change: its description names the bridges it would detach."""

    def describe() -> Detached:
        progs = _attached(cgroup_dir)
        bridges = [p for p in progs if p.name == BRIDGE_NAME]
        sd = [p for p in progs if p.name == SYSTEMD_NAME]
        theirs = tuple(p.program for p in sd if p.program is not None)
        if not bridges or not sd:
            return Detached((), theirs, tuple(p.prog_id for p in bridges))
        return Detached(tuple(p.prog_id for p in bridges), theirs, ())

    return Change("v2-bridge-detach", lambda: detach_bridges(cgroup_dir), describe)
