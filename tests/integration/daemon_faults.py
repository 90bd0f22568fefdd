"""Shared by the fault tests and bench/soak.py: a GPU node in a systemd namespace (the
daemon from the repo's unit, kubepods scopes with fake GPU nodes), the daemon's
process as the host sees it (RSS, open fds, NRestarts), and the kernel's verdict on
every container's GPUs.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Optional, Sequence

from gpuguard.devices.probe import probe_open
from integration.gpu_scopes import Container, node_ro_binds, node_units
from integration.gpuguard_ns import setup_node
from integration.harness import SystemdNamespace

SERVICE = "gpuguard.service"


def boot_gpu_node(
    factory: Callable[..., SystemdNamespace],
    tmp: Path,
    ctrs: Sequence[Container],
    *,
    stale: bool = False,
    config: str = "",
    units: Optional[Mapping[str, str]] = None,
) -> SystemdNamespace:
    """A namespace with gpuguard's units, a kubelet stand-in, a checkpoint (stale or
    not) and an inventory whose minors 0 and 1 the containers' nodes use."""
    ns = factory(units=node_units(units), ro_binds=node_ro_binds(tmp, ctrs))
    setup_node(ns, stale=stale, config=config)
    return ns


@dataclass(frozen=True)
class ProcSample:
    pid: int  # inside the namespace (MainPID)
    rss_kb: int
    fds: int


def main_pid(ns: SystemdNamespace, unit: str = SERVICE) -> int:
    return int(ns.unit_property(unit, "MainPID") or 0)


def n_restarts(ns: SystemdNamespace, unit: str = SERVICE) -> int:
    return int(ns.unit_property(unit, "NRestarts") or 0)


def host_pid(ns: SystemdNamespace, inner: int, unit: str = SERVICE) -> Optional[int]:
    """The host PID of the unit's process whose PID inside the namespace is ``inner``."""
    tree = "unified" if ns.layout == "v2" else "systemd"  # where systemd keeps its units
    procs = ns.cgroup_dir(tree) / "system.slice" / unit / "cgroup.procs"
    try:
        pids = procs.read_text().split()
    except OSError:
        return None
    for p in pids:
        try:
            status = Path(f"/proc/{p}/status").read_text()
        except OSError:
            continue
        for line in status.splitlines():
            if line.startswith("NSpid:") and line.split()[-1] == str(inner):
                return int(p)
    return None


def sample(ns: SystemdNamespace, inner: int) -> Optional[ProcSample]:
    """RSS and open fds of the daemon (``inner`` = its MainPID), read from the host."""
    pid = host_pid(ns, inner)
    if pid is None:
        return None
    try:
        rss = 0
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1])
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None
    return ProcSample(inner, rss, fds)


def has_gpu(ns: SystemdNamespace, c: Container) -> bool:
    """What the kernel's devices.list says (cheap: for sampling)."""
    try:
        return f"c 195:{c.gpus[0]} rw" in c.devices_list(ns)
    except OSError:
        return False


def verdicts(ns: SystemdNamespace, c: Container) -> tuple[Optional[bool], Optional[bool]]:
    """The kernel's answers to opening (its own GPU, the other GPU) from c's cgroup:
    True = ENXIO (let through), False = EPERM (denied)."""
    mine, other = c.gpus[0], 1 - c.gpus[0]
    return (
        probe_open(ns.path(f"/dev/nvidia{mine}"), [c.cgroup(ns)]).verdict,
        probe_open(ns.path(f"/dev/nvidia{other}"), [c.cgroup(ns)]).verdict,
    )


def assert_exact_access(ns: SystemdNamespace, ctrs: Sequence[Container], where: str) -> None:
    """Each container reaches its own GPU and not the other one (kernel verdicts)."""
    wrong = {c.unit: verdicts(ns, c) for c in ctrs}
    wrong = {u: v for u, v in wrong.items() if v != (True, False)}
    assert not wrong, f"{where}: (own GPU, other GPU) verdicts not (allowed, denied): {wrong}"
