"""A privileged GPU container keeps every device through gpuguard's repairs (issue 25).

Real containerd 1.6 and runc 1.1 with the systemd cgroup driver (harness/runc_env.py:
containerd as a unit of the namespace's systemd, so each container is a scope), both
layouts. The privileged container is made as a device plugin's or dcgm-exporter's pod
is (``ctr run --privileged``: runc gives its scope DevicePolicy=auto and no
DeviceAllow=, every device admitted), with its GPU in its /dev; an ordinary GPU
container, whose GPU the legacy hook granted, runs next to it. With gpuguard running:
daemon-reloads, a daemon-reexec and runc updates. After each, once gpuguard's passes are
quiet, the kernel is asked from inside the privileged container's cgroups about every
access to /dev/kmsg, /dev/null, fuse, a block device and the GPUs: it admits everything
it admitted before (nothing narrowed), its scope has no DeviceAllow= and no drop-in of
gpuguard's, and the ordinary container still opens its GPU (gpuguard repaired it).
"""

from __future__ import annotations

from pathlib import Path
from typing import List

import pytest

from conftest import require_tool
from gpuguard.devices.cgroupchild import process_cgroup_dirs
from gpuguard.host.paths import Root
from integration.gpu_scopes import boot_node
from integration.gpuguard_ns import events, settle
from integration.harness import SystemdNamespace
from integration.harness import layout as layout
from integration.harness import systemd_ns as systemd_ns
from integration.harness.admitted import admitted, make_nodes
from integration.harness.runc_env import (
    INNER,
    REQUIRED_TOOLS,
    Containerd,
    RuncContainer,
    make_containers,
    prepare,
)

pytestmark = pytest.mark.root

DEVICES = [("c", 1, 11), ("c", 1, 3), ("c", 10, 229), ("b", 7, 0), ("c", 195, 0), ("c", 195, 1)]
KMSG = ("c", 1, 11, "rw")


def run_privileged(ns: SystemdNamespace, cd: Containerd, c: RuncContainer) -> int:
    """`ctr run --privileged` with the systemd driver, its GPU bound into its /dev."""
    argv = ["run", "-d", "--null-io", "--rootfs", f"--cgroup={c.cgroups_path}"]
    argv += ["--runc-systemd-cgroup", "--privileged"]
    if ns.layout == "v2":
        argv.append("--cpu-shares=0")  # cgroup2 here has no cpu controller (runc_env.py)
    for g in c.gpus:
        argv.append(
            f"--mount=type=bind,src={INNER}/dev/nvidia{g},dst=/dev/nvidia{g},options=rbind:rw"
        )
    cd.ctr(*argv, f"{INNER}/rootfs", c.container_id, "/bin/busybox", "sleep", "3000")
    cd.containers.append(c)
    return cd.pid(c)


def update(ns: SystemdNamespace, cd: Containerd, c: RuncContainer) -> None:
    """The CPU manager's `runc update` (on v2 here with no resource: runc_env.py)."""
    if ns.layout == "v1":
        cd.runc(c, "update", "--cpu-share", "512", c.container_id)
        return
    ns.path("/run/ctr-test/none.json").write_text("{}\n")
    cd.runc(c, "update", "-r", "/run/ctr-test/none.json", c.container_id)


def test_a_privileged_container_keeps_every_device_through_reloads(
    systemd_ns, tmp_path, layout
) -> None:  # type: ignore[no-untyped-def]
    require_tool(*REQUIRED_TOOLS)
    units, binds = prepare(tmp_path / "ctr")
    ns = boot_node(systemd_ns, tmp_path, layout=layout, units=units, binds=binds)
    cd = Containerd(ns)
    cd.start()
    plain, priv = make_containers(2, systemd=True)
    cd.run(plain)  # its GPU granted behind runc's back, as the legacy hook does
    pid = run_privileged(ns, cd, priv)
    if layout == "v1" and not (priv.cgroup(ns) / "cgroup.procs").read_text().split():
        (priv.cgroup(ns) / "cgroup.procs").write_text(str(pid))  # runc_env.py's quirk
    assert ns.unit_property(priv.unit, "DevicePolicy") == "auto"
    assert ns.unit_property(priv.unit, "DeviceAllow") == ""
    nodes = make_nodes(tmp_path / "nodes", DEVICES)

    def now() -> frozenset:  # type: ignore[type-arg]
        dirs: List[Path] = process_cgroup_dirs(Root(Path("/")), cd.pid(priv))
        return admitted(dirs, nodes, tmp_path / "mk")

    had = now()
    assert KMSG in had and ("c", 195, priv.gpus[0], "rw") in had, sorted(had)
    assert ns.systemctl("start", "gpuguard.service").returncode == 0
    settle(ns)
    for event in ("daemon-reload", "daemon-reload", "daemon-reexec", "update", "daemon-reload"):
        if event == "update":
            update(ns, cd, plain)
            update(ns, cd, priv)
        else:
            ns.systemctl(event, timeout=60)
        settle(ns, timeout=30)
        after = now()
        assert had <= after, f"after a {event}: narrowed {sorted(had - after)}"
        assert plain.allows(ns, (195, plain.gpus[0])), f"after a {event}: GPU lost"
        assert ns.unit_property(priv.unit, "DeviceAllow") == "", f"after a {event}"
        assert not ns.path(f"/run/systemd/system/{priv.unit}.d").exists()
    listed = {e.get("UNIT") for e in events(ns, "unit-device-allow")}
    assert priv.unit not in listed and plain.unit in listed, listed
    assert not events(ns, "reconciler-crashed")
    cd.remove_all()
