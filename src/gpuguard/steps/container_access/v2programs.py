"""The cgroup v2 layout's judgement of a container's device programs (cgroupv2.py reads
them; this is what it concludes from them): the verdicts on its nodes, which nodes a
program of systemd's denies, whether a scope admits every device, and which programs
of the runtime's deny what systemd's admit (repaired in place, never by a DeviceAllow=).

systemd's programs are those named ``sd_devices`` (249 and newer) or held open by PID 1
(older systemd loads them unnamed: devices/bpfread.systemd_held); gpuguard's bridges
count with them (bridge.py ends those).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, AbstractSet, Callable, Mapping, Optional, Sequence

from gpuguard.devices.bpfread import BRIDGE_NAME, SYSTEMD_NAME, ProgramCache, judge
from gpuguard.devices.probe import query_device_programs
from gpuguard.steps.container_access.view import AccessKey, Denier

if TYPE_CHECKING:
    from gpuguard.devices.containers import ContainerCgroup
    from gpuguard.devices.entitlement import Entitlement


def scope_verdicts(
    cache: ProgramCache,
    c: ContainerCgroup,
    cgroup_dir: Path,
    ent: Entitlement,
    ids: list[int],
    fd: Optional[int] = None,
) -> Optional[dict[AccessKey, bool]]:
    """Whether the device programs the kernel runs for `cgroup_dir` admit each node `c`
    was given (None: not readable, ask a probe); `ids` receives those programs' ids.
    `fd`: the cgroup's directory, open."""
    nodes = [(n.major, n.minor) for n in ent.nodes]
    verdicts = judge(cache, cgroup_dir, nodes, ids, fd)
    if verdicts is None:
        return None
    return {(c.container_id, n.numbers): verdicts[(n.major, n.minor)] for n in ent.nodes}


def systemd_denied(
    cache: ProgramCache, c: ContainerCgroup, ent: Entitlement, ids: Sequence[int]
) -> set[AccessKey]:
    """The nodes given to `c` that a program of systemd's among `ids` denies."""
    sd = [(i, cache.get(i)) for i in ids if cache.name(i) == SYSTEMD_NAME]
    if not sd:
        return set()
    return {
        (c.container_id, n.numbers)
        for n in ent.nodes
        if any(p and not cache.admits_rw(i, p, (n.major, n.minor)) for i, p in sd)
    }


def admit_all(cache: ProgramCache, ids: Optional[Sequence[int]]) -> bool:
    """Every program among `ids` read and admitting every device (none: True); False
    when one cannot be read (not known to admit all)."""
    if ids is None:
        return False
    progs = [cache.get(i) for i in ids]
    return all(p is not None and p.admits_all for p in progs)


def attached_from(program_dir: Path, scope_dir: Path) -> list[Path]:
    """`program_dir` and its ancestors up to `scope_dir`, both included (just
    `program_dir` when it is not below the scope)."""
    out = [program_dir]
    if program_dir != scope_dir and scope_dir in program_dir.parents:
        d = program_dir
        while d != scope_dir:
            d = d.parent
            out.append(d)
    return out


def runtime_deniers(
    cache: ProgramCache,
    c: ContainerCgroup,
    ent: Entitlement,
    ids: Sequence[int],
    verdicts: Mapping[AccessKey, bool],
    dirs: Sequence[Path],
    held: Callable[[], AbstractSet[int]],
) -> tuple[Denier, ...]:
    """The programs among `ids` (all read) that deny entitled nodes no program of
    systemd's (or a bridge) denies, each with the cgroup among `dirs` it is attached to
    and the nodes it denies. A node that a program attached elsewhere denies too (above
    the scope) is left out: replacing the others would not give it back. `held`: the
    programs PID 1 holds open, asked only when an unnamed program denies."""
    progs = {i: cache.get(i) for i in ids}
    if any(p is None for p in progs.values()):
        return ()  # a program gpuguard cannot read is never replaced (nor judged by)
    names = {i: cache.name(i) for i in ids}
    deny: dict[str, list[int]] = {}
    for n in ent.nodes:
        if verdicts.get((c.container_id, n.numbers)) is False:
            deny[n.numbers] = [
                i
                for i, p in progs.items()
                if p is not None and not cache.admits_rw(i, p, (n.major, n.minor))
            ]
    if not deny:
        return ()
    theirs = {i for i in ids if names[i] in (SYSTEMD_NAME, BRIDGE_NAME)}
    if any(names[i] == "" for d in deny.values() for i in d):
        theirs |= set(held()) & set(ids)  # systemd before 249 names no program
    where: dict[int, str] = {}
    for d in dirs:
        try:
            for i in query_device_programs(d):
                where.setdefault(i, str(d))
        except OSError:
            return ()
    per: dict[int, list[str]] = {}
    for numbers, deniers in deny.items():
        if not deniers or any(i in theirs or i not in where for i in deniers):
            continue  # systemd's to repair (DeviceAllow=, a bridge), or not ours to
        for i in deniers:
            per.setdefault(i, []).append(numbers)
    return tuple((i, where[i], tuple(nums)) for i, nums in sorted(per.items()))
