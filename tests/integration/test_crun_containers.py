"""Real crun containers through containerd, found where crun puts them (issue 25).

This host's crun (Debian 12: crun 1.8.1, installed by scripts/bootstrap --full) with
Debian's containerd 1.6 and the systemd cgroup driver, containerd a unit of the
namespace's systemd (harness/runc_env.py). crun runs the container's process in
``SCOPE/container``, with a device policy of its own there; its GPU is bound in and
granted behind crun's back as the legacy hook does, on the scope and on that
sub-cgroup. With gpuguard running: daemon-reloads, a daemon-reexec and crun updates;
after each, once gpuguard's passes are quiet, the kernel (asked
from where the process is) admits each container's GPU and not the other one, a
privileged crun container admits everything it admitted before, and `gpuguard status`
lists them all. crun 1.8.1 sets no device property on the scope on this layout (its
v1 list is "a *:* rwm", the policy is the sub-cgroup's), so gpuguard gives the scope no
DeviceAllow= (it admits everything: never narrowed). No DeviceAllow= reset here: crun
sends none, and setting one on such a scope makes systemd 252 move the container's
process into its pod slice's v1 devices cgroup, which admits everything (seen here
with gpuguard stopped: systemd's doing).

On cgroup v2 crun 1.8.1 cannot make a container on these machines: it raises
RLIMIT_MEMLOCK to load its device program, and their bounding set lacks
CAP_SYS_RESOURCE. There the test checks that it still fails with that error (as the
stacks matrix's cells do); crun 1.21 and 1.28 on v2 are proven by
tests/integration/test_stacks_f2.py (Debian 13 and sid).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import List

import pytest

from conftest import require_tool
from gpuguard.devices.cgroupchild import process_cgroup_dirs
from gpuguard.devices.probe import probe_open
from gpuguard.host.paths import Root
from integration.gpu_scopes import boot_node
from integration.gpuguard_ns import GPUGUARD, settle
from integration.harness import SystemdNamespace
from integration.harness import layout as layout
from integration.harness import systemd_ns as systemd_ns
from integration.harness.admitted import admitted, make_nodes
from integration.harness.runc_env import (
    CONTROL_NODES,
    INNER,
    REQUIRED_TOOLS,
    RUNC_ROOT,
    Containerd,
    RuncContainer,
    make_containers,
    prepare,
)

pytestmark = pytest.mark.root

CRUN = "/usr/bin/crun"
MEMLOCK = "setrlimit (RLIM_MEMLOCK): Operation not permitted"
DEVICES = [("c", 1, 11), ("c", 1, 3), ("c", 10, 229), ("c", 195, 0), ("c", 195, 1)]


def run_crun(
    ns: SystemdNamespace, cd: Containerd, c: RuncContainer, *, privileged: bool = False
) -> None:
    argv = ["run", "-d", "--null-io", "--rootfs", f"--cgroup={c.cgroups_path}"]
    argv += ["--runc-systemd-cgroup", f"--runc-binary={CRUN}"]
    if privileged:
        argv.append("--privileged")
    if ns.layout == "v2":
        argv.append("--cpu-shares=0")  # cgroup2 here has no cpu controller (runc_env.py)
    for name in [f"nvidia{g}" for g in c.gpus] + list(CONTROL_NODES):
        argv.append(f"--mount=type=bind,src={INNER}/dev/{name},dst=/dev/{name},options=rbind:rw")
    cd.ctr(*argv, f"{INNER}/rootfs", c.container_id, "/bin/busybox", "sleep", "3000")
    cd.containers.append(c)


def pid_of(ns: SystemdNamespace, c: RuncContainer) -> int:
    """The container's process: in its scope or below it (crun: SCOPE/container)."""
    for procs in sorted(c.cgroup(ns, "unified").rglob("cgroup.procs")):
        pids = procs.read_text().split()
        if pids:
            return int(pids[0])
    raise AssertionError(f"{c.unit}: no process in its scope")


def where(ns: SystemdNamespace, c: RuncContainer) -> List[Path]:
    return process_cgroup_dirs(Root(Path("/")), pid_of(ns, c))


def opens(ns: SystemdNamespace, c: RuncContainer, gpu: int) -> bool:
    return probe_open(ns.path("/run/ctr-test/dev") / f"nvidia{gpu}", where(ns, c)).verdict is True


def hook_grant(ns: SystemdNamespace, c: RuncContainer) -> None:
    """devices.allow on the scope, then on crun's SCOPE/container (v1 admits only what
    the parent does)."""
    scope = c.cgroup(ns)
    for d in (scope, *(p for p in where(ns, c) if scope in p.parents)):
        for ma, mi in c.given():
            (d / "devices.allow").write_text(f"c {ma}:{mi} rw")


def test_crun_containers_found_and_kept_through_reloads(systemd_ns, tmp_path, layout) -> None:  # type: ignore[no-untyped-def]
    require_tool(*REQUIRED_TOOLS, CRUN)
    units, binds = prepare(tmp_path / "ctr")
    ns = boot_node(systemd_ns, tmp_path, layout=layout, units=units, binds=binds)
    cd = Containerd(ns)
    cd.start()
    a, b, priv = make_containers(3, systemd=True)
    if layout == "v2":
        with pytest.raises(RuntimeError, match=r"RLIM_MEMLOCK"):
            run_crun(ns, cd, a)
        caps = Path("/proc/self/status").read_text()
        bounding = int(next(x for x in caps.splitlines() if x.startswith("CapBnd")).split()[1], 16)
        assert not bounding & (1 << 24), "CAP_SYS_RESOURCE is there: crun should have run"
        return
    for c in (a, b):
        run_crun(ns, cd, c)
        hook_grant(ns, c)
    run_crun(ns, cd, priv, privileged=True)
    for c in (a, b, priv):
        assert any(p.name == "container" for p in where(ns, c)), f"{c.unit}: {where(ns, c)}"
    nodes = make_nodes(tmp_path / "nodes", DEVICES)
    had = admitted(where(ns, priv), nodes, tmp_path / "mk")
    assert ("c", 1, 11, "rw") in had
    assert all(opens(ns, c, c.gpus[0]) for c in (a, b))
    assert ns.systemctl("start", "gpuguard.service").returncode == 0
    settle(ns)
    for event in ("daemon-reload", "daemon-reexec", "update", "daemon-reload"):
        if event == "update":
            for c in (a, b, priv):
                argv = [CRUN, "--root", RUNC_ROOT, "--systemd-cgroup", "update"]
                ns.run([*argv, "--cpu-share", "512", c.container_id], check=True)
        else:
            ns.systemctl(event, timeout=60)
        settle(ns, timeout=30)
        for c in (a, b):
            assert opens(ns, c, c.gpus[0]), f"after a {event}: {c.unit} lost its GPU"
            assert not opens(ns, c, 1 - c.gpus[0]), f"after a {event}: over-granted"
        after = admitted(where(ns, priv), nodes, tmp_path / "mk")
        assert had <= after, f"after a {event}: narrowed {sorted(had - after)}"
    for c in (a, b, priv):  # the scopes admit every device: never given a DeviceAllow=
        assert ns.unit_property(c.unit, "DeviceAllow") == "", c.unit
    status = ns.run([str(GPUGUARD), "status", "--json"], timeout=60)
    listed = {r["container_id"] for r in json.loads(status.stdout)["containers"]}
    assert {c.container_id for c in (a, b, priv)} <= listed, status.stdout
    cd.remove_all()
