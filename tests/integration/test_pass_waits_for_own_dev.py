"""A full pass never judges a container by the host's /dev: on a real systemd, both
cgroup layouts. A container's process starts in its scope still seeing the host's /dev
(every GPU), as `runc init` does before it switches to the container's root, and keeps
its PID after the exec. A pass that read it then would take every GPU of the node for
its entitlement (and keep that reading for as long as the PID lives): the direct v1
write and the scope's DeviceAllow= would then grant the GPU it was not given. Full passes
forced during that window must grant nothing; once the container has its own /dev it
gets its own GPU, durably, and never the other."""

from __future__ import annotations

from pathlib import Path

import pytest

from integration.gpu_scopes import boot_node, containers, has
from integration.gpuguard_ns import events, passes, settle, start_gpuguard, wait_for
from integration.harness import layout as layout
from integration.harness import systemd_ns as systemd_ns

pytestmark = pytest.mark.root

GO = "/run/gg-test-go"  # the container's process stays on the host's /dev until this exists


def test_a_pass_during_the_runtimes_init_grants_nothing_then_only_its_own_gpu(
    systemd_ns, tmp_path: Path, layout: str
) -> None:  # type: ignore[no-untyped-def]
    (c,) = containers(1)
    mine, other = c.gpus[0], 1 - c.gpus[0]
    ns = boot_node(systemd_ns, tmp_path, [c], layout=layout)
    start_gpuguard(ns)
    assert ns.path(f"/dev/nvidia{other}").exists()  # what it must not be given by mistake
    ns.popen(
        [
            "systemd-run", "--scope", "--quiet", f"--unit={c.unit}", f"--slice={c.slice}",
            "-p", "DevicePolicy=strict", "-p", "DeviceAllow=/dev/null rw",
            "unshare", "-m", "--propagation", "private", "sh", "-c",
            f"while [ ! -e {GO} ]; do sleep 0.01; done;"
            f" mount --bind /run/ctrdev/{c.container_id[:12]} /dev && exec sleep 3000",
        ]
    )  # fmt: skip
    procs = c.cgroup(ns) / "cgroup.procs"
    wait_for(lambda: procs.exists() and procs.read_text().strip(), what="the scope's process")
    c.hook_grant(ns)  # its own GPU, behind systemd's back, as the legacy hook does
    # Two full passes while the process still sees the host's /dev.
    for _ in range(2):
        n = passes(ns)
        assert ns.systemctl("reload", "gpuguard.service").returncode == 0
        wait_for(lambda n=n: passes(ns) > n, what="a full pass")  # type: ignore[misc]
    pid = procs.read_text().split()[0]  # the host's PID (read from the host's cgroupfs)
    window_open = Path(f"/proc/{pid}/root/dev/nvidia{other}").exists()
    assert window_open, "the process left the host's /dev before the passes ran"
    assert not has(c, ns, (195, other))
    kinds = ("cgroup-v1-allow", "unit-device-allow", "v2-bridge-attach")
    granted = [e for k in kinds for e in events(ns, k) if e.get("CONTAINER_ID") == c.container_id]
    assert granted == [], f"judged from the host's /dev: {granted}"
    ns.path(GO).touch()  # the runtime's init is done: the container's own /dev next
    # Once it runs in its own /dev, its own GPU is made durable, and only that one.
    wait_for(
        lambda: f"/dev/char/195:{mine}" in _device_allow(ns, c.unit),
        timeout=30,
        what="the durable grant of its own GPU",
    )
    settle(ns)
    for k in kinds:
        for e in events(ns, k):
            numbers = str(e.get("DEVICE_NUMBERS", "")).split(",")
            assert f"195:{other}" not in numbers, f"{k} granted the GPU it was not given: {e}"
    assert f"/dev/char/195:{other}" not in _device_allow(ns, c.unit)
    ns.systemctl("daemon-reload")
    settle(ns)
    assert has(c, ns, (195, mine)) and not has(c, ns, (195, other))


def _device_allow(ns, unit: str) -> str:  # type: ignore[no-untyped-def]
    return str(ns.systemctl("show", "-p", "DeviceAllow", "--value", unit).stdout)
