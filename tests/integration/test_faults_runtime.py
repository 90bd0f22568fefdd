"""A container runtime restart under running GPU containers: Debian's containerd 1.6 and
runc 1.1 (systemd cgroup driver) as a unit of a real systemd, gpuguard from the repo's
unit watching it (RuntimeUnits=). containerd is restarted (KillMode=process, as
Debian's unit: shims and containers live on) and killed outright; each time the daemon
stays up, runs a pass for the runtime's start, and every container keeps exactly its
GPU (the kernel's verdict from its scope's devices cgroup), through later runc updates
and daemon-reloads too; a container created after the restart gets its grant made
durable. Containers and their cgroup quirk: see test_container_access_runc.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence, Tuple

import pytest

from conftest import require_tool
from gpuguard.devices.probe import probe_open
from integration.daemon_faults import SERVICE, main_pid, n_restarts
from integration.gpu_scopes import boot_node
from integration.gpuguard_ns import events, settle, status, wait_for
from integration.harness import SystemdNamespace
from integration.harness import systemd_ns as systemd_ns
from integration.harness.runc_env import (
    REQUIRED_TOOLS,
    UNIT,
    Containerd,
    RuncContainer,
    make_containers,
    prepare,
)

pytestmark = pytest.mark.root


def _boot(systemd_ns, tmp_path: Path) -> Tuple[SystemdNamespace, Containerd]:  # type: ignore[no-untyped-def]
    require_tool(*REQUIRED_TOOLS)
    ctr_units, ctr_binds = prepare(tmp_path / "ctr")
    config = f"[Systemd]\nRuntimeUnits={UNIT}\n"
    ns = boot_node(systemd_ns, tmp_path, config=config, units=ctr_units, binds=ctr_binds)
    cd = Containerd(ns)
    cd.start()
    return ns, cd


def _run(ns: SystemdNamespace, cd: Containerd, c: RuncContainer) -> None:
    cd.run(c)
    # runc 1.1.5 + systemd 252 leave the process in its pod slice's v1 devices cgroup
    (c.cgroup(ns) / "cgroup.procs").write_text(str(cd.pid(c)))


def _exact(tmp_path: Path, ns: SystemdNamespace, ctrs: Sequence[RuncContainer], where: str) -> None:
    for c in ctrs:
        mine, other = c.gpus[0], 1 - c.gpus[0]
        got = tuple(
            probe_open(tmp_path / f"ctr/dev/nvidia{m}", [c.cgroup(ns)]).verdict
            for m in (mine, other)
        )
        assert got == (True, False), f"{where}: {c.unit} (own GPU, other GPU) = {got}"


def _running(cd: Containerd, ctrs: Sequence[RuncContainer]) -> bool:
    out = cd.ctr("task", "ls")
    return all(
        any(line.split()[:1] == [c.container_id] and "RUNNING" in line for line in out.splitlines())
        for c in ctrs
    )


def test_containerd_restart_keeps_gpu_access(systemd_ns, tmp_path) -> None:  # type: ignore[no-untyped-def]
    ns, cd = _boot(systemd_ns, tmp_path)
    a, b, late = make_containers(3, systemd=True)
    for c in (a, b):
        _run(ns, cd, c)
    assert ns.systemctl("start", SERVICE).returncode == 0
    wait_for(
        lambda: {e.get("UNIT") for e in events(ns, "unit-device-allow")} >= {a.unit, b.unit},
        what="durable grants",
    )
    settle(ns)
    pid = main_pid(ns)
    _exact(tmp_path, ns, (a, b), "before")

    for how in ("restart", "kill", "restart"):
        if how == "restart":
            ns.systemctl("restart", UNIT)
        else:  # a crash: SIGKILL to containerd alone, then started again
            ns.systemctl("kill", "--kill-who=main", "-s", "KILL", UNIT)
            wait_for(lambda: ns.unit_property(UNIT, "ActiveState") != "active", what="dead")
            ns.systemctl("start", UNIT)
        ns.wait_active(UNIT)
        wait_for(
            lambda: any(f"{UNIT} started" in r for r in status(ns)["last_pass"]["reasons"]),
            what=f"a pass for the runtime's start ({how})",
        )
        wait_for(lambda: _running(cd, (a, b)), what="containers running again in ctr's view")
        settle(ns)
        _exact(tmp_path, ns, (a, b), f"after containerd {how}")

    # The runtime works after its restarts, and nothing it does loses the GPU.
    _run(ns, cd, late)
    wait_for(
        lambda: late.unit in {e.get("UNIT") for e in events(ns, "unit-device-allow")},
        what="durable grant for the container made after the restarts",
    )
    for c in (a, b, late):
        cd.runc(c, "update", "--cpu-share", "256", c.container_id)
    ns.systemctl("daemon-reload")
    settle(ns)
    _exact(tmp_path, ns, (a, b, late), "after runc updates and a daemon-reload")
    assert (main_pid(ns), n_restarts(ns)) == (pid, 0), "the daemon was restarted"
    assert not events(ns, "reconciler-crashed")
    cd.remove_all()
